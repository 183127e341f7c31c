"""A local cluster's servers are reachable inside the cluster only."""

import socket
import sys
import time
from unittest import mock

import tensorflow as tf

from tfdist.cluster import is_listening
from tfdist.launch import LocalCluster
from tfdist.launch import isolation
from tfdist.launch.isolation import IsolationUnavailable
from tfdist.launch.isolation import PrivateNetwork
from tfdist.launch.isolation import private_network

# The worker checks that the ps answers from inside, says so, and stays up for a while.
WORKER = """
import json, os, socket, sys, time
address = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
host, port = address.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=5):
    print("INSIDE", port, flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


# Worker 0 times `size` bytes that worker 1 sends it over the cluster's network (TCP).
LINK = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
host, port = config["cluster"]["worker"][0].rsplit(":", 1)
size = int(sys.argv[1])
if config["task"]["index"] == 0:
    with socket.create_server((host, int(port))) as server:
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            got, start = 0, None
            while got < size:
                chunk = connection.recv(1 << 16)
                if not chunk:
                    break
                start = start or time.monotonic()
                got += len(chunk)
            print("RATE", got * 8 / (time.monotonic() - start), flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            link = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline, "worker 0 never listened"
            time.sleep(0.05)
    with link:
        link.sendall(b"x" * size)
"""


def _skip_without_namespaces(test):
    try:
        PrivateNetwork().close()
    except IsolationUnavailable as e:
        test.skipTest(f"this system refuses network namespaces: {e}")


def _connects(host, port):
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class IsolationTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        _skip_without_namespaces(self)

    def test_ps_is_reachable_inside_the_cluster_only(self):
        done = self.get_temp_dir() + "/done"
        with LocalCluster([sys.executable, "-c", WORKER, done], num_ps=1, num_workers=1,
                          output=None, timeout=90, isolate_network=True) as cluster:
            deadline = time.monotonic() + 60
            while not any(line.startswith("INSIDE") for _, line in cluster.lines):
                self.assertLess(time.monotonic(), deadline, cluster.lines)
                time.sleep(0.05)
            port = int(next(line.split()[1] for _, line in cluster.lines
                            if line.startswith("INSIDE")))
            # Not from this machine's network, on any of its addresses...
            hosts = {"127.0.0.1", "localhost"}
            try:
                hosts.add(socket.gethostbyname(socket.gethostname()))
            except OSError:
                pass
            for host in hosts:
                self.assertFalse(_connects(host, port), f"{host}:{port} reachable from outside")
            # ...nor from a second network namespace...
            other = PrivateNetwork()
            try:
                with other.inside():
                    self.assertFalse(_connects("127.0.0.1", port))
            finally:
                other.close()
            # ...while inside the cluster's own namespace it answers.
            with cluster.network.inside():
                self.assertTrue(is_listening(f"localhost:{port}"))
            open(done, "w").close()
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster.lines)
        # The user is told at start that the script has no network beyond the cluster.
        self.assertTrue(any(task == "tfdist-launch" and "--noisolate_network" in line
                            for task, line in cluster.lines), cluster.lines)


class BandwidthTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        _skip_without_namespaces(self)

    def _rate(self, bandwidth, size):
        with LocalCluster([sys.executable, "-c", LINK, str(size)], num_ps=0, num_workers=2,
                          output=None, timeout=60, bandwidth=bandwidth) as cluster:
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster.lines)
        return next(float(line.split()[1]) for _, line in cluster.lines
                    if line.startswith("RATE"))

    def test_the_private_network_is_held_at_the_set_rate(self):
        # 2 MB at 8 Mbit/s: about 2 s (the bucket's first 256 KiB go at once).
        limited = self._rate("8mbit", 2 << 20)
        self.assertBetween(limited, 0.5 * 8e6, 1.5 * 8e6)
        self.assertGreater(self._rate(None, 2 << 20), 10 * limited)

    def test_bad_bandwidth(self):
        for bad in ("fast", "100", "-5mbit", "1kbit", 100):
            with self.assertRaisesRegex(ValueError, r"`bandwidth` must be a rate such as "
                                                    r"'100mbit'.*Received: "):
                LocalCluster(["true"], bandwidth=bad)
        self.assertEqual(isolation.parse_bandwidth("12.5MBps"), 1e8)
        with self.assertRaisesRegex(ValueError, "needs `isolate_network` 'auto' or True"):
            LocalCluster(["true"], bandwidth="100mbit", isolate_network=False)


class FallbackTest(tf.test.TestCase):

    def test_warns_loudly_where_namespaces_are_refused(self):
        refused = IsolationUnavailable(1, "unshare(CLONE_NEWNET): Operation not permitted")
        with mock.patch.object(isolation, "PrivateNetwork", side_effect=refused):
            with self.assertWarnsRegex(RuntimeWarning, "could not give the local cluster a "
                                                       "private network"):
                self.assertIsNone(private_network())
            with self.assertRaisesRegex(IsolationUnavailable, "Operation not permitted"):
                private_network(required=True)
            # A rate limit needs the namespace: an error, not a warning and an open network.
            cluster = LocalCluster(["true"], num_ps=0, bandwidth="8mbit")
            with self.assertRaisesRegex(IsolationUnavailable, r"`bandwidth`='8mbit' limits a "
                                                              r"private network namespace"):
                cluster.start()

    def test_bad_argument(self):
        with self.assertRaisesRegex(ValueError, "`isolate_network` must be 'auto', True or "
                                                "False. Received: 'yes'"):
            LocalCluster(["true"], isolate_network="yes")


if __name__ == "__main__":
    tf.test.main()
