"""Who sends to whom at each step of Stochastic Gradient Push: the communication graph.

A schedule answers two questions for a step k: the out-peers of a worker (where its shares go)
and, for a receiving worker, how many messages each other worker sends it at k. Built-in
graphs are periodic in k and are answered from tables inside the training step; a user's
callable is called from the step through `tf.py_function`.

>>> schedule = make_schedule("exponential", peers_per_step=1, num_workers=8)
>>> [schedule.out_peers(k, rank=0) for k in range(4)]
[[1], [2], [4], [1]]
"""

import contextlib
import inspect
import math
import random
import threading
import zlib

import numpy as np

from tfdist._args import check_int

GRAPHS = ("exponential", "ring")
# The steps a callable graph is checked on before a run's first step: called twice on each
# worker (`Schedule`), and compared between the workers (`check_agreement`).
CHECKED_STEPS = 32


def exponential_offsets(num_workers):
    """The hops of the directed exponential graph: 1, 2, 4, ... below `num_workers`."""
    return [2 ** j for j in range(max(1, math.ceil(math.log2(num_workers))))]


def max_peers(graph, num_workers):
    """How many distinct out-peers a worker of `graph` can have in one step."""
    if graph == "exponential":
        return min(len(exponential_offsets(num_workers)), num_workers - 1)
    return num_workers - 1


def check_graph(graph, peers_per_step, num_workers):
    """Checks `graph` and `peers_per_step` for a cluster of `num_workers`, with errors that
    name the argument, the allowed values and what was received."""
    if not callable(graph) and graph not in GRAPHS:
        raise ValueError(f"`graph` must be one of {list(GRAPHS)} or a callable "
                         f"`(step, rank, num_workers) -> out-peers`. Received: {graph!r}")
    if num_workers < 2:
        raise ValueError(f"Stochastic Gradient Push needs at least 2 workers (training tasks); "
                         f"the cluster has num_workers={num_workers}")
    check_int("peers_per_step", peers_per_step)
    if not 1 <= peers_per_step <= num_workers - 1:
        raise ValueError(f"`peers_per_step` must be between 1 and num_workers-1="
                         f"{num_workers - 1}. Received: {peers_per_step}")
    if graph == "exponential" and peers_per_step > max_peers(graph, num_workers):
        hops = exponential_offsets(num_workers)
        raise ValueError(
            f"`peers_per_step` must be between 1 and {len(hops)} with graph='exponential' and "
            f"{num_workers} workers: its out-peers are i + {hops} (mod {num_workers}). "
            f"Received: {peers_per_step}. A callable graph can name any peers")


class Schedule:
    """The out-peers and in-counts of every worker at every step.

    Args:
      graph: "exponential" (at step k worker i sends to i + 2^((k p + t) mod L), t < p, with
        L = ceil(log2 M) hops: the time-varying directed exponential graph of the paper),
        "ring" (i sends to i + 1, ..., i + p at every step), or a callable
        `(step, rank, num_workers) -> list of out-peers` giving between 1 and
        `peers_per_step` distinct ranks other than `rank` (a worker with p out-peers at a
        step keeps 1/(p+1) of its parameters and weight and sends 1/(p+1) to each).
        Each worker calls it for its own rank and follows its answers, which it announces
        to the others (`tfdist.gossip.plans`): a receiver waits only for what its senders
        announced. It must still give the same answer for the same `(step, rank)` on every
        worker, or the workers make another graph than the one it describes (a random ring
        drawn on each worker alone is no ring). A callable that has a parameter `seed` is called
        with `seed=`, an integer derived from the step alone (the same for every rank at a
        step, another at each step: `np.random.default_rng(seed)` draws, say, one random
        permutation per step that every rank sees). A callable may also draw from Python's
        `random` or NumPy's global `np.random`: each call runs with both seeded from `(seed,
        step, rank)` (and their state restored after). Any other randomness must be derived
        from `step`, `rank` and `seed` alone. Checked when the schedule is made: the graph
        is called twice for each of the first `CHECKED_STEPS` steps and every rank, and an
        answer that changes is refused (`check_agreement` then compares the workers').
      peers_per_step: p, out-peers per step (a callable graph's most).
      num_workers: M.
      seed: mixed into the seeds of each call of a callable graph.
    """

    def __init__(self, graph, peers_per_step, num_workers, seed=0):
        check_graph(graph, peers_per_step, num_workers)
        self.graph = graph
        self.seed = seed
        self.peers_per_step = peers_per_step
        self.num_workers = num_workers
        if graph == "exponential":
            hops = exponential_offsets(num_workers)
            # Step k uses the hops (k p + t) mod L: the table repeats after L steps.
            self.period = len(hops)
            self._hops = [[hops[(k * peers_per_step + t) % len(hops)]
                           for t in range(peers_per_step)] for k in range(self.period)]
        elif graph == "ring":
            self.period = 1
            self._hops = [list(range(1, peers_per_step + 1))]
        else:
            self.period = None
            self._takes_seed = _has_seed_parameter(graph)
            self._check_repeatable()

    @property
    def periodic(self):
        return self.period is not None

    def out_peers(self, step, rank):
        """The ranks `rank` sends to at `step` (checked when the graph is a callable)."""
        if self.periodic:
            return [(rank + hop) % self.num_workers for hop in self._hops[step % self.period]]
        step, rank = int(step), int(rank)
        with _seeded_global_random(self.seed, step, rank):
            if self._takes_seed:
                peers = self.graph(step, rank, self.num_workers, seed=self.step_seed(step))
            else:
                peers = self.graph(step, rank, self.num_workers)
        try:
            peers = [int(p) for p in peers]
        except (TypeError, ValueError):
            raise ValueError(f"`graph` must return a list of ranks. Received {peers!r} for "
                             f"step={step}, rank={rank}") from None
        if (not 1 <= len(peers) <= self.peers_per_step or len(set(peers)) != len(peers)
                or rank in peers or not all(0 <= p < self.num_workers for p in peers)):
            raise ValueError(
                f"`graph` must return between 1 and peers_per_step={self.peers_per_step} "
                f"distinct ranks between 0 and {self.num_workers - 1} other than the "
                f"sender's. Received "
                f"{peers} for step={step}, rank={rank}")
        return peers

    def step_seed(self, step):
        """The `seed` a callable graph is given at `step`: the same for every rank."""
        return int(np.random.SeedSequence([self.seed & 0xFFFFFFFF, int(step) & 0xFFFFFFFF,
                                           int(step) >> 32]).generate_state(1, np.uint64)[0])

    def graph_name(self):
        graph = self.graph
        name = getattr(graph, "__qualname__", None) or type(graph).__qualname__
        return f"{getattr(graph, '__module__', None) or '?'}.{name}"

    def _step_table(self, step):
        """`[M, p]` int32: every rank's padded out-peers at `step`."""
        return np.stack([self.padded_out_peers(step, rank) for rank in range(self.num_workers)])

    def _check_repeatable(self):
        """Refuses a callable graph whose answer changes when it is called again."""
        for step in range(CHECKED_STEPS):
            for rank in range(self.num_workers):
                first, again = self.out_peers(step, rank), self.out_peers(step, rank)
                if first != again:
                    raise ValueError(
                        f"`graph` ({self.graph_name()}) gave {first} then {again} for "
                        f"step={step}, rank={rank}: it must give the same out-peers every time "
                        "it is called with the same step and rank, on every worker (each "
                        "worker follows its own answers: answers that differ make another "
                        "graph than the one it describes, a random ring drawn on each worker "
                        "alone is no ring). Draw from the `seed` argument it is given when it "
                        "takes one (the same at a step on every worker), or from Python's "
                        "`random` or NumPy's global generator (seeded for each call), or "
                        "derive the peers from step and rank alone")

    def digests(self, steps):
        """`[steps]` int64: a 24-bit digest (exact in a float32) of every rank's out-peers at
        each of the first `steps` steps, for comparing the workers' answers."""
        return np.array([zlib.crc32(self._step_table(k).tobytes()) & 0xFFFFFF
                         for k in range(steps)], np.int64)

    def in_counts(self, step, rank):
        """`[M]` int64: how many messages each worker sends to `rank` at `step` (0 or 1)."""
        counts = np.zeros([self.num_workers], np.int64)
        for sender in range(self.num_workers):
            if sender != rank and rank in self.out_peers(step, sender):
                counts[sender] += 1
        return counts

    def padded_out_peers(self, step, rank):
        """`out_peers` as int32 `[peers_per_step]`, -1 after the last peer."""
        peers = self.out_peers(step, rank)
        return np.array(peers + [-1] * (self.peers_per_step - len(peers)), np.int32)

    def tables(self, rank):
        """`(out_peers [period, p], in_counts [period, M])` of `rank`, for periodic graphs."""
        out = np.array([self.out_peers(k, rank) for k in range(self.period)], np.int32)
        counts = np.stack([self.in_counts(k, rank) for k in range(self.period)])
        return out, counts


def check_agreement(schedule, names, rank, digests):
    """Raises if another worker's `digests` (`{rank: Schedule.digests(n)}`) differ from this
    worker's: their graph functions answer differently, and the workers, each following
    its own answers, would make another graph than the function describes.

    Raises:
      ValueError: naming the graph, both workers, the first step that differs and this
        worker's out-peers there.
    """
    for other, theirs in sorted(digests.items()):
        theirs = np.asarray(theirs, np.int64)
        ours = schedule.digests(len(theirs))
        differ = np.flatnonzero(ours != theirs)
        if differ.size:
            step = int(differ[0])
            raise ValueError(
                f"`graph` ({schedule.graph_name()}) gives other out-peers on {names[other]} "
                f"than on {names[rank]} at step {step} (on {names[rank]}: "
                f"{schedule._step_table(step).tolist()}, rank by rank, -1 for no peer; "
                f"the first {len(theirs)} steps are compared before the first step): it must "
                "give the same out-peers for the same step and rank on every worker, or the "
                "workers make another graph than it describes. Derive them from step, rank "
                "and the `seed` argument (or Python's `random` / NumPy's global generator, "
                "seeded for each call), not from the process, the host or the time")


def _has_seed_parameter(graph):
    try:
        parameters = inspect.signature(graph).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in parameters)


_global_random = threading.Lock()


@contextlib.contextmanager
def _seeded_global_random(*key):
    """Python's and NumPy's global generators seeded from `key`, restored afterwards."""
    seed = int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]).generate_state(1)[0])
    with _global_random:
        saved = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])


def make_schedule(graph, peers_per_step, num_workers):
    return Schedule(graph, peers_per_step, num_workers)
