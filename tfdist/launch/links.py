"""How fast a local cluster's links really are: every pair of workers sends at once.

A rate-limited local network (`LocalCluster(bandwidth=...)`) is a promise made with tc; on a
machine of few cores the bridge and the token buckets cost CPU, and a high rate with many links
may not be reached. `measure_links` checks it the way the benchmarks need it: the workers of a
cluster of that network pair up (1 sends to 0, 3 to 2, ...), every sender starts at once,
and each receiver reports the rate it got. On a switch each pair should get the full rate; on a
hub (`topology="hub"`) the pairs share it.

    from tfdist.launch.links import measure_links
    measure_links("1gbit", num_workers=8)   # LinkRates(set 1e9, pairs [...], aggregate ...)

`tfdist-launch --local --bandwidth=RATE --check_links` prints the same before the job.
The bytes are plain TCP between the tasks' addresses (what a gRPC channel rides on); no
tensor crosses here.
"""

import dataclasses
import sys
import tempfile

from tfdist.launch.isolation import parse_bandwidth

# Pairs of workers at once: each odd worker sends `size` bytes to the worker before it, once
# every sender is connected (each leaves a file in argv 2); each receiver says the rate it
# got, and when its first and last bytes came (this machine's clock). An odd worker count
# leaves the last worker out.
PAIRS = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
size, ready = int(sys.argv[1]), sys.argv[2]
index, workers = config["task"]["index"], config["cluster"]["worker"]
if index >= 2 * (len(workers) // 2):
    sys.exit(0)
host, port = workers[index - index % 2].rsplit(":", 1)
deadline = time.monotonic() + 30
if index % 2 == 0:
    with socket.create_server(("", int(port))) as server:
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            got, start = 0, None
            while got < size:
                chunk = connection.recv(1 << 16)
                if not chunk:
                    break
                start = start or time.time()
                got += len(chunk)
            end = time.time()
            print("RATE", index, got * 8 / (end - start), start, end, flush=True)
else:
    while True:
        try:
            link = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline, "the receiver never listened"
            time.sleep(0.05)
    open(os.path.join(ready, str(index)), "w").close()
    while len(os.listdir(ready)) < len(workers) // 2:
        assert time.monotonic() < deadline, "another sender never connected"
        time.sleep(0.005)
    with link:
        link.sendall(b"x" * size)
"""

# Bytes a pair sends without a rate limit (loopback's speed is the CPU's).
UNLIMITED_BYTES = 64 << 20


@dataclasses.dataclass
class LinkRates:
    """What `measure_links` measured, in bits per second.

    Attributes:
      set_rate: the rate the network was set to (None: no limit).
      pairs: the rate each pair's receiver got, in the order of the receivers.
      aggregate: every pair's bytes over the time from the first byte to the last, either
        pair's: about `len(pairs) x set_rate` on a switch, `set_rate` on a hub.
      topology: "switched" or "hub" (None: no private network).
      bytes_per_pair: what each pair sent.
    """
    set_rate: float
    pairs: list
    aggregate: float
    topology: str
    bytes_per_pair: int

    def text(self):
        def mbit(bits):
            return f"{bits / 1e6:,.1f}"

        held = ("" if not self.set_rate else
                f", {min(self.pairs) / self.set_rate:.0%} of the set rate or more")
        return (f"{len(self.pairs)} pair(s) sending at once on the {self.topology or 'host'} "
                f"network (set: {'no limit' if not self.set_rate else mbit(self.set_rate)} "
                f"Mbit/s): {' / '.join(mbit(p) for p in self.pairs)} Mbit/s a pair{held}; "
                f"{mbit(self.aggregate)} Mbit/s together")


def measure_links(bandwidth, num_workers=2, topology=None, seconds=1.0, timeout=60.0):
    """The rates pairs of workers get at once on a local cluster of this network.

    Args:
      bandwidth: the link rate, as `LocalCluster(bandwidth=)` takes it ("100mbit"), or None.
      num_workers: the cluster's workers (at least 2): `num_workers // 2` pairs send at once.
      topology: `LocalCluster(topology=)`: None (switched with a bandwidth), "switched", "hub".
      seconds: how long each pair sends at the set rate (its bytes: rate x seconds; 64 MiB
        without a limit).
      timeout: seconds the whole measurement may take.

    Returns:
      A `LinkRates`.

    Raises:
      ValueError: a bad argument (named).
      IsolationUnavailable: the machine cannot make the private network.
      RuntimeError: the measurement did not finish (what a task said).
    """
    from tfdist.launch.local import LocalCluster

    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 2:
        raise ValueError(f"`num_workers` must be an integer >= 2 (workers pair up to send). "
                         f"Received: {num_workers!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"`seconds` must be a number > 0. Received: {seconds!r}")
    rate = parse_bandwidth(bandwidth) if bandwidth is not None else None
    size = int(rate * seconds / 8) if rate else UNLIMITED_BYTES
    with tempfile.TemporaryDirectory() as ready:
        cluster = LocalCluster([sys.executable, "-c", PAIRS, str(size), ready], num_ps=0,
                               num_workers=num_workers, output=None, timeout=timeout,
                               bandwidth=bandwidth, topology=topology,
                               outbound_network=False)
        with cluster:
            result = cluster.wait()
    said = [line.split()[2:] for task, line in cluster.lines if line.startswith("RATE")]
    if result.returncode or len(said) != num_workers // 2:
        raise RuntimeError(f"measuring the links of {num_workers} workers at {bandwidth} did "
                           f"not finish: {result.message or 'not every pair reported'}; last "
                           f"lines: {[line for _, line in cluster.lines[-5:]]}")
    starts, ends = ([float(s) for _, s, _ in said], [float(e) for _, _, e in said])
    return LinkRates(set_rate=rate, pairs=[float(r) for r, _, _ in said],
                     aggregate=len(said) * size * 8 / (max(ends) - min(starts)),
                     topology=cluster.topology, bytes_per_pair=size)
