"""How a between-graph worker's `fit` reads its data (`tfdist._worker.WorkerDataset`), in
process: the dataset as it is, its iterators destroyed on the releasing thread.

Why it matters is measured, not tested (timings): on a 4-worker hard-sync run, destroying
Keras's per-epoch iterators on the training thread stalled every worker for 0.2-5 s at about
one epoch end in two (docs/benchmarks.md, "Hard sync's epoch ends").
"""

import threading
import time
import weakref

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import _worker
from tfdist._worker import WorkerDataset
from tfdist.gossip.engine import StochasticGradientPushExtended
from tfdist.ps.worker import ParameterServerExtended

# A bound against a hang, far above what the releasing thread takes here.
HANG_BOUND = 30


class _Blocker:
    """Holds the releasing thread in its destructor until `event` is set."""

    def __init__(self, event):
        self.event = event

    def __del__(self):
        self.event.wait(HANG_BOUND)


class WorkerDatasetTest(tf.test.TestCase):

    def test_both_worker_engines_read_through_it(self):
        for extended in (ParameterServerExtended, StochasticGradientPushExtended):
            self.assertIs(extended._experimental_distribute_dataset,
                          _worker.BetweenGraphExtendedMixin._experimental_distribute_dataset)
        dataset = tf.data.Dataset.range(10).batch(3)
        distributed = _worker.BetweenGraphExtendedMixin._experimental_distribute_dataset(
            None, dataset, None)
        self.assertIsInstance(distributed, tf.distribute.DistributedDataset)
        self.assertEqual(distributed.element_spec, dataset.element_spec)
        # Every epoch reads the whole dataset, in order, through a new iterator.
        for _ in range(2):
            self.assertEqual([b.numpy().tolist() for b in distributed],
                             [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]])
        self.assertEqual(distributed.reduce(np.int64(0), lambda s, b: s + tf.reduce_sum(b))
                         .numpy(), 45)

    def test_a_dropped_iterator_is_destroyed_on_the_releasing_thread(self):
        distributed = WorkerDataset(tf.data.Dataset.range(100).map(lambda i: i * 2))
        iterator = iter(distributed)
        self.assertEqual(next(iterator).numpy(), 0)
        resource = weakref.ref(_tf_compat.iterator_state(iterator)[0])
        # The releasing thread is held: dropping the iterator here must not destroy it.
        go = threading.Event()
        self.addCleanup(go.set)
        _worker._releaser.put(_Blocker(go))
        del iterator
        self.assertIsNotNone(resource(), "the iterator was destroyed on the thread that "
                                         "dropped it")
        go.set()
        deadline = time.monotonic() + HANG_BOUND
        while resource() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertIsNone(resource(), "the releasing thread never destroyed the iterator")


if __name__ == "__main__":
    tf.test.main()
