"""A Stochastic Gradient Push worker's state between steps, as checkpoints hold it.

The model's variables hold the de-biased weights z = x / w; a resumed worker needs its
push-sum weight w too (x = w z is what it gossips), and its step count, which drives the
graph schedule: workers restored from checkpoints of the same step send to the same peers
as they would have. The reference implementation keeps `ps_weight` in its `state_dict`
(facebookresearch/stochastic_gradient_push, `GossipDataParallel.state_dict`).

`GossipState` is saved with the model's optimizer, as the compression strategies' codec
state is (`tfdist._saved_state`): Keras files at `optimizer/tfdist_gossip_state`.
Messages in flight when the checkpoint was written are not in it: a restored worker does
not wait for messages sent before its restored step.
"""

import io
import logging

import numpy as np

from tfdist import _saved_state
from tfdist._saved_state import SavedState

log = logging.getLogger("tfdist")

ATTRIBUTE = "tfdist_gossip_state"


class GossipState(SavedState):
    """Saves and restores one worker's push-sum weight and step.

    Args:
      extended: the `StochasticGradientPushExtended` whose state this is: it gives
        `gossip_state()` -> `(weight, step, rank, num_workers)` and takes
        `restore_gossip_state(weight, step)` (step None: kept).
    """

    def __init__(self, extended):
        self._extended = extended

    def __dir__(self):
        return []  # Keras saving walks an object's attributes: nothing is below this one

    def to_bytes(self):
        weight, step, rank, num_workers = self._extended.gossip_state()
        buffer = io.BytesIO()
        np.savez(buffer, weight=np.float32(weight), step=np.int64(step), rank=np.int64(rank),
                 num_workers=np.int64(num_workers))
        return buffer.getvalue()

    def from_bytes(self, data):
        with np.load(io.BytesIO(data)) as arrays:
            weight, step = float(arrays["weight"]), int(arrays["step"])
            rank, num_workers = int(arrays["rank"]), int(arrays["num_workers"])
        _, _, my_rank, my_workers = self._extended.gossip_state()
        if num_workers != my_workers:
            log.warning("tfdist: this checkpoint's gossip state is of a run of %d workers, this "
                        "run has %d: the push-sum weight is restored, the graph schedule "
                        "starts over", num_workers, my_workers)
            step = 0
        elif rank != my_rank:
            log.warning("tfdist: worker %d restores the gossip state of worker %d (its "
                        "checkpoint): give each worker its own checkpoint path", my_rank, rank)
        self._extended.restore_gossip_state(weight, step)

    def restore_missing(self):
        # A file saved without gossip state (plain Keras, another strategy): the model's
        # weights are the de-biased z; x = z from them on (w = 1), the step count kept.
        self._extended.restore_gossip_state(1.0, None)


def attach(optimizer, state):
    """Puts `state` in the Keras checkpoints that hold `optimizer`."""
    _saved_state.attach(optimizer, ATTRIBUTE, state)
