"""`join`'s reading of a Stochastic Gradient Push worker's inboxes (its final average)."""

import numpy as np

from tfdist.gossip import protocol
from tfdist.gossip.node import PeerError


class Drain:
    """`join`'s reading of the inboxes: per sender, its training messages (added to x, w)
    up to its END (phase 1), then its AVERAGE message and the LOCAL messages that follow it
    (phase 2)."""

    def __init__(self, extended, steps, x, weight):
        self.extended = extended
        self.node = extended._node
        self.steps = steps
        self.x, self.weight = x, weight
        self.consumed = extended._consumed.numpy()
        ended = extended._ended.numpy()
        self.phase = {r: 1 if ended[r] >= 0 else 0 for r in range(self.node.num_workers)
                      if r != self.node.rank}
        self.peer_steps = {r: int(ended[r]) for r in self.phase if ended[r] >= 0}
        for sender, phase in self.phase.items():
            if phase:
                self._maybe_done(sender)
        self.models = {}
        self.locals = {}  # sender -> its local values (`_local_variables`), once all came
        self._parts = {}  # sender -> the LOCAL parts received
        self.local_size = 0

    def expect_local(self, size):
        """Every worker's LOCAL messages carry `size` values (the same model everywhere)."""
        self.local_size = size

    def local_parts(self, values):
        """`values` cut into message-sized parts (the last one padded with zeros)."""
        room = self.node.size - protocol.HEAD
        count = -(-values.size // room)
        padded = np.zeros([count * room], np.float32)
        padded[:values.size] = values
        return [padded[i * room:(i + 1) * room] for i in range(count)]

    def _take_local(self, sender, values):
        parts = self._parts.setdefault(sender, [])
        if values is not None:
            parts.append(values)
        if len(parts) * (self.node.size - protocol.HEAD) >= self.local_size:
            self.locals[sender] = (np.concatenate(parts)[:self.local_size] if parts
                                   else np.zeros([0], np.float32))
            self.phase[sender] = 2

    def _maybe_done(self, sender):
        if self.phase[sender] == (2 if self.extended._final_average else 1):
            self.node.done_with(sender)

    def advance(self, sender, until, wait=True):
        """Reads `sender`'s inbox until its phase reaches `until` (or, without `wait`, until
        the inbox is empty)."""
        node = self.node
        while self.phase[sender] < until:
            if not wait and not node.available(sender):
                return
            tag, info, weight, values = node.take_one(sender)
            if tag >= 0 and self.phase[sender] == 0:
                self.x = self.x + values.numpy()
                self.weight = self.weight + weight.numpy()
                self.consumed[sender] += 1
            elif tag == protocol.END and self.phase[sender] == 0:
                self.peer_steps[sender] = info
                self.phase[sender] = 1
            elif (tag == protocol.AVERAGE and self.phase[sender] == 1
                    and sender not in self.models):
                if info != self.local_size:
                    raise PeerError(
                        f"tfdist: {node.names[sender]} averages {info} values of non-gossiped "
                        f"model variables, {node.task_name} {self.local_size}: every worker "
                        "must build the same model under the strategy's scope")
                self.models[sender] = (values.numpy(), weight.numpy())
                self._take_local(sender, None)
            elif tag == protocol.LOCAL and sender in self.models and self.phase[sender] == 1:
                self._take_local(sender, values.numpy())
            elif tag == protocol.DEAD:
                self._dead(sender, info)
            else:
                raise PeerError(f"tfdist: an unexpected gossip message (tag {tag}) from "
                                f"{node.names[sender]} reached {node.task_name}: every worker "
                                "must run the same tfdist version, strategy arguments and "
                                "`graph`")
            self._maybe_done(sender)

    def _dead(self, sender, dead):
        """A DEAD report: an error, unless `dead` left after sending all it had to (its
        last messages may still wait in its inbox, ahead of the report)."""
        final = 2 if self.extended._final_average else 1
        if dead in self.phase and dead != sender and self.phase[dead] < final:
            self.advance(dead, final, wait=False)
        if dead not in self.phase or self.phase[dead] < final:
            raise PeerError(self.node.dead_message(dead))
