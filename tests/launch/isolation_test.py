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


def _connects(host, port):
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class IsolationTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        try:
            PrivateNetwork().close()
        except IsolationUnavailable as e:
            self.skipTest(f"this system refuses network namespaces: {e}")

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


class FallbackTest(tf.test.TestCase):

    def test_warns_loudly_where_namespaces_are_refused(self):
        refused = IsolationUnavailable(1, "unshare(CLONE_NEWNET): Operation not permitted")
        with mock.patch.object(isolation, "PrivateNetwork", side_effect=refused):
            with self.assertWarnsRegex(RuntimeWarning, "could not give the local cluster a "
                                                       "private network"):
                self.assertIsNone(private_network())
            with self.assertRaisesRegex(IsolationUnavailable, "Operation not permitted"):
                private_network(required=True)

    def test_bad_argument(self):
        with self.assertRaisesRegex(ValueError, "`isolate_network` must be 'auto', True or "
                                                "False. Received: 'yes'"):
            LocalCluster(["true"], isolate_network="yes")


if __name__ == "__main__":
    tf.test.main()
