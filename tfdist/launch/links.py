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
# every sender is connected (each leaves a file in argv 2), all within `limit` seconds (argv
# 3); each receiver says the bytes it got, the rate, and when its first and last bytes came
# (this machine's clock; the first chunk only starts the clock, tc lets a bucket's worth
# through at once). An odd worker count leaves the last worker out.
PAIRS = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
size, ready, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
index, workers = config["task"]["index"], config["cluster"]["worker"]
if index >= 2 * (len(workers) // 2):
    sys.exit(0)
host, port = workers[index - index % 2].rsplit(":", 1)
deadline = time.monotonic() + limit
if index % 2 == 0:
    with socket.create_server(("", int(port))) as server:
        server.settimeout(limit)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(max(1.0, deadline - time.monotonic()))
            got, first, start = 0, 0, None
            while got < size:
                chunk = connection.recv(1 << 16)
                if not chunk:
                    break
                if start is None:
                    start, first = time.time(), len(chunk)
                got += len(chunk)
            end = time.time()
    if got < size or end <= start:
        sys.exit(f"worker {index}: got {got} of {size} bytes from worker {index + 1}")
    print("RATE", index, (got - first) * 8 / (end - start), start, end, got, flush=True)
else:
    while True:
        try:
            link = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"worker {index}: worker {index - 1} never listened")
            time.sleep(0.05)
    open(os.path.join(ready, str(index)), "w").close()
    while len(os.listdir(ready)) < len(workers) // 2:
        if time.monotonic() > deadline:
            sys.exit(f"worker {index}: another sender never connected")
        time.sleep(0.005)
    link.settimeout(max(1.0, deadline - time.monotonic()))
    block = memoryview(b"x" * (1 << 20))
    with link:
        left = size
        while left:
            left -= link.send(block[:min(left, len(block))])
"""

# Bytes a pair sends without a rate limit (loopback's speed is the CPU's), and at least.
UNLIMITED_BYTES = 64 << 20
MIN_BYTES = 2 << 20


@dataclasses.dataclass
class LinkRates:
    """What `measure_links` measured, in bits per second.

    Attributes:
      set_rate: the rate the network was set to (None: no limit).
      pairs: the rate each pair's receiver got, by the receiver's index (0, 2, 4...).
      aggregate: every pair's bytes over the time from the first byte to the last, either
        pair's: about `len(pairs) x set_rate` on a switch, `set_rate` on a hub.
      topology: "switched", "hub" (one loopback every task shares) or "host" (the tasks ran
        on this machine's own network: no private one).
      bytes_per_pair: what each pair sent.
    """
    set_rate: float
    pairs: list
    aggregate: float
    topology: str
    bytes_per_pair: int

    def text(self):
        def mbit(bits):
            return f"{bits / 1e6:,.1f} Mbit/s"

        held = ""
        if self.set_rate and self.topology != "hub":
            held = f", {min(self.pairs) / self.set_rate:.0%} of the set rate or more"
        elif self.set_rate:
            held = (f" (on a hub the pairs share the set rate: together "
                    f"{self.aggregate / self.set_rate:.0%} of it)")
        return (f"{len(self.pairs)} pair(s) sending at once on the {self.topology} network "
                f"(set: {mbit(self.set_rate) if self.set_rate else 'no limit'}): "
                f"{' / '.join(mbit(p) for p in self.pairs)} a pair{held}; "
                f"{mbit(self.aggregate)} together")


def measure_links(bandwidth, num_workers=2, topology=None, seconds=1.0, timeout=60.0,
                  isolate_network="auto"):
    """The rates pairs of workers get at once on a local cluster of this network.

    Args:
      bandwidth: the link rate, as `LocalCluster(bandwidth=)` takes it ("100mbit"), or None.
      num_workers: the cluster's workers (at least 2): `num_workers // 2` pairs send at once.
      topology: `LocalCluster(topology=)`: None (switched with a bandwidth), "switched", "hub".
      seconds: how long each pair sends at the set rate (its bytes: rate x seconds, at least
        2 MiB; 64 MiB without a limit).
      timeout: seconds the whole measurement may take (a pair that has not sent by then is
        an error, not a low rate).
      isolate_network: `LocalCluster(isolate_network=)`.

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
    for name, value in (("seconds", seconds), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"`{name}` must be a number > 0. Received: {value!r}")
    rate = parse_bandwidth(bandwidth) if bandwidth is not None else None
    size = max(MIN_BYTES, int(rate * seconds / 8)) if rate else UNLIMITED_BYTES
    pairs = num_workers // 2
    with tempfile.TemporaryDirectory() as ready:
        cluster = LocalCluster([sys.executable, "-c", PAIRS, str(size), ready, repr(timeout)],
                               num_ps=0, num_workers=num_workers, output=None,
                               timeout=timeout + 30.0, bandwidth=bandwidth, topology=topology,
                               outbound_network=False, isolate_network=isolate_network)
        with cluster:
            private = cluster.network is not None  # (gone once the cluster has stopped)
            result = cluster.wait()
    said = sorted((line.split()[1:] for _, line in cluster.lines if line.startswith("RATE ")),
                  key=lambda fields: int(fields[0]))
    if result.returncode or len(said) != pairs:
        why = (result.message if result.returncode else
               f"{len(said)} of {pairs} pair(s) reported")
        raise RuntimeError(f"measuring the links of {num_workers} workers at "
                           f"{bandwidth or 'no limit'} did not finish: {why}; last lines: "
                           f"{[line for _, line in cluster.lines[-5:]]}")
    starts, ends = [float(f[2]) for f in said], [float(f[3]) for f in said]
    topology = cluster.topology if private else "host"
    return LinkRates(set_rate=rate, pairs=[float(f[1]) for f in said],
                     aggregate=sum(int(f[4]) for f in said) * 8 / (max(ends) - min(starts)),
                     topology=topology, bytes_per_pair=size)
