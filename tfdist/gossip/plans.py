"""A callable graph's answers, as each sender announces them: receivers never guess.

A built-in graph is a table every worker holds. A user's `graph` function is called by each
worker for its own rank only: its answers for a chunk of `CHUNK` steps are decided once (the
worker then sends exactly to those peers) and sent, one chunk ahead, to every other worker in
a plan (`tfdist.gossip.protocol`'s plan queues). A receiver counts the messages it waits for
from a sender on that sender's plan alone, so a function that answers differently on
different workers, or later than the steps checked before the first one, changes who sends
to whom but never leaves a worker waiting for a message its sender does not send.

A receiver waits for a sender's plan for a chunk when it first needs it: the sender sends it
when it starts the chunk before (and its first two when its first step is traced), so the
workers keep within about two chunks of each other. A sender that ended its training says
so in its last plan (it sends nothing at its later steps); one that died is reported in the
plan queues as in the inboxes.
"""

import threading

import numpy as np

from tfdist.gossip import protocol
from tfdist.gossip.node import PeerError

# Steps of one plan.
CHUNK = 32


class Plans:
    """This worker's own out-peers, chunk by chunk, and the plans its peers announced.

    Args:
      schedule: the run's `Schedule` (a callable graph).
      node: this worker's `GossipNode` (`send_plan`, `take_plan`, `dead_message`).
    """

    def __init__(self, schedule, node):
        self.schedule = schedule
        self.node = node
        self.rank, self.num_workers = node.rank, node.num_workers
        self._own = {}  # chunk: [CHUNK, p] int32, this worker's out-peers
        self._theirs = {s: {} for s in range(self.num_workers) if s != self.rank}
        self._first = {}  # sender: the first chunk it announced
        self._ended = {}  # sender: its step count when it ended (it sends nothing after)
        self._lock = threading.Lock()
        self.bytes_sent = 0  # of this worker's plans, to all its peers

    def _own_chunk(self, chunk):
        if chunk not in self._own:
            steps = range(chunk * CHUNK, (chunk + 1) * CHUNK)
            self._own[chunk] = np.stack([self.schedule.padded_out_peers(k, self.rank)
                                         for k in steps])
            self.bytes_sent += self.node.send_plan(protocol.PLAN_PEERS, chunk, self._own[chunk])
        return self._own[chunk]

    def start(self, step):
        """Announces the chunk of `step` and the next (before the first step)."""
        with self._lock:
            self._own_chunk(step // CHUNK)
            self._own_chunk(step // CHUNK + 1)

    def out_peers(self, step):
        """int32 `[p]`: this worker's out-peers at `step`, as announced; at a chunk's first
        step the next chunk is announced."""
        chunk = step // CHUNK
        with self._lock:
            peers = self._own_chunk(chunk)[step % CHUNK]
            self._own_chunk(chunk + 1)
            for old in [c for c in self._own if c < chunk]:
                del self._own[old]
        return peers

    def in_counts(self, step):
        """int64 `[M]`: how many messages each sender sends this worker at `step` (0 or 1),
        as its plan says; waits for a plan that has not come yet."""
        counts = np.zeros([self.num_workers], np.int64)
        with self._lock:
            for sender in self._theirs:
                peers = self._peers_of(sender, step)
                counts[sender] = peers is not None and self.rank in peers
        return counts

    def end(self, steps):
        """Tells every peer that this worker took its last step (`steps` steps)."""
        sent = self.node.send_plan(protocol.PLAN_END, steps, np.zeros([0], np.int32))
        with self._lock:  # (not around the send: `in_counts` holds it while it waits)
            self.bytes_sent += sent

    def _peers_of(self, sender, step):
        """`sender`'s out-peers at `step` (None: it sends nothing then)."""
        chunk, theirs = step // CHUNK, self._theirs[sender]
        while chunk not in theirs:
            if sender in self._ended:
                return None  # it ended before that chunk: nothing comes
            if sender in self._first and self._first[sender] > chunk:
                return None  # it started after that chunk (restored at a later step)
            kind, value, peers = self.node.take_plan(sender)
            if kind == protocol.PLAN_DEAD:
                raise PeerError(self.node.dead_message(value))
            if kind == protocol.PLAN_END:
                self._ended[sender] = value
            else:
                self._first.setdefault(sender, value)
                theirs[value] = peers.reshape([CHUNK, -1])
        for old in [c for c in theirs if c < chunk]:
            del theirs[old]
        if sender in self._ended and step >= self._ended[sender]:
            return None
        return theirs[chunk][step % CHUNK]
