"""A local cluster's servers are reachable inside the cluster only."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import tensorflow as tf

from tfdist.cluster import is_listening
from tfdist.launch import LocalCluster
from tfdist.launch import isolation
from tfdist.launch.isolation import IsolationUnavailable
from tfdist.launch.isolation import PrivateNetwork
from tfdist.launch.isolation import private_network
from tfdist.launch.links import PAIRS
from tfdist.launch.links import measure_links

# The worker checks that the ps answers from inside, says so, tries a server outside the
# cluster (argv 2 and 3), says what it got, and stays up for a while.
WORKER = """
import json, os, socket, sys, time
address = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
host, port = address.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=5):
    print("INSIDE", port, flush=True)
try:
    with socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=5) as outside:
        outside.settimeout(5)
        print("OUTSIDE", outside.recv(5).decode() or "nothing", flush=True)
except OSError as e:
    print("OUTSIDE", type(e).__name__, flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _skip_without_namespaces(test):
    try:
        PrivateNetwork().close()
    except IsolationUnavailable as e:
        test.skipTest(f"this system refuses network namespaces: {e}")


def _host_address():
    """This machine's address on its own network (not a loopback one), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # a documentation address: no packet is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


class _Greeter:
    """A server outside the cluster, on this machine's own address, that says HELLO."""

    def __init__(self, host):
        self.server = socket.create_server((host, 0))
        self.address = (host, self.server.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                connection.sendall(b"HELLO")

    def close(self):
        self.server.close()


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
        # ... and the tasks reach out through slirp4netns where it is installed.
        done = self.get_temp_dir() + "/done"
        host = _host_address()
        if host is None:
            self.skipTest("this machine has no address beside its loopback")
        greeter = _Greeter(host)
        self.addCleanup(greeter.close)
        with LocalCluster([sys.executable, "-c", WORKER, done, *map(str, greeter.address)],
                          num_ps=1, num_workers=1, output=None, timeout=90,
                          isolate_network=True) as cluster:
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
        outside = next(line.split()[1] for task, line in cluster.lines
                       if line.startswith("OUTSIDE"))
        notice = [line for task, line in cluster.lines if task == "tfdist-launch"]
        if shutil.which("slirp4netns"):
            self.assertEqual(outside, "HELLO")
            self.assertTrue(any("the outside through slirp4netns (outgoing connections only"
                                in line for line in notice), notice)
        else:
            # The user is told at start that the script has no network beyond the cluster.
            self.assertNotEqual(outside, "HELLO")
            self.assertTrue(any("slirp4netns, which would give it a way out, is not "
                                "installed" in line and "--noisolate_network" in line
                                for line in notice), notice)


class OutboundTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        _skip_without_namespaces(self)
        if not shutil.which("slirp4netns"):
            self.skipTest("slirp4netns is not installed")
        self.host = _host_address()
        if self.host is None:
            self.skipTest("this machine has no address beside its loopback")

    def _hello_from_inside(self, network, address):
        code = ("import socket, sys\n"
                "try:\n"
                f"    c = socket.create_connection({address!r}, timeout=5); c.settimeout(5)\n"
                "    print(c.recv(5).decode())\n"
                "except OSError as e:\n"
                "    print(type(e).__name__)\n")
        return subprocess.run([sys.executable, "-c", code], preexec_fn=network.enter_in_child,
                              capture_output=True, text=True, timeout=30).stdout.strip()

    def test_slirp4netns_gives_a_way_out_and_goes_with_the_network(self):
        greeter = _Greeter(self.host)
        self.addCleanup(greeter.close)
        network = PrivateNetwork()
        try:
            self.assertNotEqual(self._hello_from_inside(network, greeter.address), "HELLO")
            self.assertIsNone(network.connect_outbound())
            self.assertTrue(network.has_outbound)
            process = network._outbound[0]
            self.assertEqual(self._hello_from_inside(network, greeter.address), "HELLO")
        finally:
            network.close()
        self.assertFalse(network.has_outbound)
        self.assertIsNotNone(process.poll())  # slirp4netns ended with the network

    def test_loopback_resolvers_are_named(self):
        path = self.get_temp_dir() + "/resolv.conf"
        with open(path, "w") as f:
            f.write("# a comment\nnameserver 127.0.0.53\nnameserver 10.0.0.1\n"
                    "nameserver ::1\noptions edns0\n")
        self.assertEqual(isolation.loopback_resolvers(path), ["127.0.0.53", "::1"])
        self.assertEqual(isolation.loopback_resolvers(path + ".missing"), [])


class BandwidthTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        _skip_without_namespaces(self)

    def _rate(self, bandwidth, size, **kwargs):
        ready = tempfile.mkdtemp(dir=self.get_temp_dir())
        with LocalCluster([sys.executable, "-c", PAIRS, str(size), ready, "30"], num_ps=0,
                          num_workers=2, output=None, timeout=60, bandwidth=bandwidth,
                          **kwargs) as cluster:
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster.lines)
        self.notices = [line for task, line in cluster.lines if task == "tfdist-launch"]
        return next(float(line.split()[2]) for _, line in cluster.lines
                    if line.startswith("RATE"))

    def test_the_private_network_is_held_at_the_set_rate(self):
        # 2 MB at 8 Mbit/s: about 2 s (the bucket's first 256 KiB go at once).
        limited = self._rate("8mbit", 2 << 20)
        self.assertBetween(limited, 0.5 * 8e6, 1.5 * 8e6)
        # (This run also keeps its network sealed, on request.)
        self.assertGreater(self._rate(None, 2 << 20, outbound_network=False), 10 * limited)
        self.assertTrue(any("nothing else (no downloads, no logging services: "
                            "--nooutbound_network / outbound_network=False keeps it sealed)"
                            in line for line in self.notices), self.notices)

    def test_bad_bandwidth(self):
        for bad in ("fast", "100", "-5mbit", "1kbit", 100):
            with self.assertRaisesRegex(ValueError, r"`bandwidth` must be a rate such as "
                                                    r"'100mbit'.*Received: "):
                LocalCluster(["true"], bandwidth=bad)
        self.assertEqual(isolation.parse_bandwidth("12.5MBps"), 1e8)
        with self.assertRaisesRegex(ValueError, "needs `isolate_network` 'auto' or True"):
            LocalCluster(["true"], bandwidth="100mbit", isolate_network=False)


# A worker that says TASK to whoever connects to its address, for 30 s.
GREETER = """
import json, os, socket, time
port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0].rsplit(":", 1)[1])
with socket.create_server(("", port)) as server:
    server.settimeout(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            connection, _ = server.accept()
        except OSError:
            continue
        with connection:
            connection.sendall(b"TASK")
"""


def _greeting(host, port):
    """What a server at host:port says first, or why nothing."""
    try:
        with socket.create_connection((host, port), timeout=2) as connection:
            connection.settimeout(2)
            return connection.recv(4).decode(errors="replace")
    except OSError as e:
        return type(e).__name__


class SwitchedNetworkTest(tf.test.TestCase):
    """Cost: two 4-worker clusters of plain Python (no TensorFlow), about 1 + 2 s of traffic."""

    def setUp(self):
        super().setUp()
        _skip_without_namespaces(self)
        if not (shutil.which("tc") or os.path.exists("/usr/sbin/tc")) or not (
                shutil.which("ip") or os.path.exists("/usr/sbin/ip")):
            self.skipTest("iproute2's `ip` and `tc` are not installed")

    def test_two_pairs_each_get_the_full_rate_on_a_switch_and_share_a_hub(self):
        # 2.5 MB a pair at 20 Mbit/s: about 1 s on the switch, 2 s on the hub.
        rate = 20e6
        switched = measure_links("20mbit", num_workers=4, seconds=1.0)
        self.assertEqual(switched.topology, "switched")  # the default with a bandwidth
        self.assertEqual((switched.set_rate, switched.bytes_per_pair), (rate, 2500000))
        self.assertLen(switched.pairs, 2)
        for got in switched.pairs:
            self.assertBetween(got, 0.7 * rate, 1.3 * rate)
        self.assertGreater(switched.aggregate, 1.4 * rate)
        self.assertIn("2 pair(s) sending at once on the switched network (set: 20.0 Mbit/s)",
                      switched.text())
        # On the hub the pairs share the one link (TCP need not share it evenly: the sum).
        hub = measure_links("20mbit", num_workers=5, topology="hub", seconds=1.0)
        self.assertLen(hub.pairs, 2)  # the fifth worker sits out
        self.assertLess(hub.aggregate, 1.3 * rate)

    def test_the_launcher_checks_the_links_before_the_job(self):
        result = subprocess.run(
            [sys.executable, "-m", "tfdist.launch", "--local", "--num_ps=0", "--num_workers=2",
             "--bandwidth=20mbit", "--check_links", "--timeout=60", "--", sys.executable, "-c",
             "print('JOB RAN', flush=True)"], capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stderr, r"links of 2 workers: 1 pair\(s\) sending at once on "
                                        r"the switched network \(set: 20\.0 Mbit/s\): [0-9.]+ "
                                        r"Mbit/s a pair")
        self.assertIn("JOB RAN", result.stdout + result.stderr)

    def test_the_switched_tasks_are_out_of_reach_from_outside(self):
        with LocalCluster([sys.executable, "-c", GREETER], num_ps=0, num_workers=1,
                          output=None, timeout=60, topology="switched",
                          outbound_network=False) as cluster:
            address = cluster.config.cluster["worker"][0]
            self.assertStartsWith(address, "10.213.0.2:")  # an address of the bridge's
            host, port = address.rsplit(":", 1)
            deadline = time.monotonic() + 30
            with cluster.network.inside():  # from the switch, the task's address answers
                while _greeting(host, int(port)) != "TASK":
                    self.assertLess(time.monotonic(), deadline, cluster.lines)
                    time.sleep(0.05)
            # From this machine's network the task is not there (whatever may answer for
            # that address on this machine's own routes, it is not the task).
            self.assertNotEqual(_greeting(host, int(port)), "TASK")
            self.assertNotEqual(_greeting("127.0.0.1", int(port)), "TASK")

    def test_bad_topology(self):
        with self.assertRaisesRegex(ValueError, r"`topology` must be 'switched', 'hub' or None. "
                                                r"Received: 'star'"):
            LocalCluster(["true"], topology="star")
        with self.assertRaisesRegex(ValueError, "`topology`='switched' connects private network "
                                                "namespaces: it needs `isolate_network`"):
            LocalCluster(["true"], topology="switched", isolate_network=False)


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
        with self.assertRaisesRegex(ValueError, "`outbound_network` must be 'auto' or False. "
                                                "Received: True"):
            LocalCluster(["true"], outbound_network=True)


class LinkArgumentsTest(tf.test.TestCase):
    """measure_links refuses bad arguments before it starts anything."""

    def test_bad_link_measurements(self):
        with self.assertRaisesRegex(ValueError, r"`num_workers` must be an integer >= 2 .*"
                                                r"Received: 1"):
            measure_links("20mbit", num_workers=1)
        with self.assertRaisesRegex(ValueError, r"`seconds` must be a number > 0\. Received: 0"):
            measure_links("20mbit", seconds=0)
        with self.assertRaisesRegex(ValueError, r"`bandwidth` must be a rate"):
            measure_links("fast")
        with self.assertRaisesRegex(ValueError, r"`timeout` must be a number > 0\. "
                                                r"Received: None"):
            measure_links("20mbit", timeout=None)


if __name__ == "__main__":
    tf.test.main()
