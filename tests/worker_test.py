"""How a between-graph worker's `fit` reads its data (`tfdist._worker.WorkerDataset`), in
process: a `tf.data.Dataset` as it is, whose eager iterators are destroyed on the releasing
thread.

Why it matters is measured, not tested (timings): on a 4-worker hard-sync run, destroying
Keras's per-epoch iterators on the training thread stalled every worker for 0.4-5 s at about
one epoch start in two (the class's docstring).
"""

import threading
import time
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import _worker
from tfdist._worker import BetweenGraphExtendedMixin
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
            for hook in ("_experimental_distribute_dataset", "_distribute_datasets_from_function"):
                self.assertIs(getattr(extended, hook), getattr(BetweenGraphExtendedMixin, hook))
        dataset = tf.data.Dataset.range(10).batch(3)
        for distributed in (
                BetweenGraphExtendedMixin._experimental_distribute_dataset(None, dataset, None),
                BetweenGraphExtendedMixin._distribute_datasets_from_function(
                    None, lambda context: dataset.shard(context.num_input_pipelines,
                                                        context.input_pipeline_id), None)):
            self.assertIsInstance(distributed, WorkerDataset)
            self.assertIsInstance(distributed, tf.distribute.DistributedDataset)
            self.assertIsInstance(distributed, tf.data.Dataset)
            self.assertEqual(distributed.element_spec, dataset.element_spec)
            self.assertEqual(distributed.cardinality().numpy(), 4)
            # Every epoch reads the whole dataset, in order, through a new iterator.
            for _ in range(2):
                self.assertEqual([b.numpy().tolist() for b in distributed],
                                 [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]])

    def test_keras_fit_evaluate_and_predict_take_it(self):
        # As a user passes `strategy.experimental_distribute_dataset(ds)` to Keras: Keras
        # takes it as a dataset and does not distribute it again.
        x = np.arange(40, dtype="float32").reshape(20, 2) / 40
        y = x.sum(axis=1, keepdims=True)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        data = WorkerDataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(6))
        history = model.fit(data, epochs=3, verbose=0)
        self.assertLen(history.history["loss"], 3)
        self.assertLess(history.history["loss"][-1], history.history["loss"][0])
        self.assertAllClose(model.evaluate(data, verbose=0), history.history["loss"][-1],
                            rtol=0.5)
        self.assertEqual(model.predict(WorkerDataset(tf.data.Dataset.from_tensor_slices(
            x).batch(6)), verbose=0).shape, (20, 1))

    def test_a_tf_function_loops_over_it_in_graph(self):
        # AutoGraph takes it as a dataset: a loop with no loop variables, and one with some.
        distributed = WorkerDataset(tf.data.Dataset.range(5))
        total = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def add_all():
            for value in distributed:
                total.assign_add(value)

        @tf.function
        def count():
            n = tf.constant(0, tf.int64)
            for value in distributed:
                n += value
            return n

        add_all()
        self.assertEqual(total.numpy(), 10)
        self.assertEqual(count().numpy(), 10)

    def test_a_dropped_iterator_is_destroyed_on_the_releasing_thread(self):
        distributed = WorkerDataset(tf.data.Dataset.range(100).map(lambda i: i * 2))
        iterator = iter(distributed)
        self.assertEqual(next(iterator).numpy(), 0)
        resource = weakref.ref(tf.nest.flatten(iterator, expand_composites=True)[0])
        self.assertEqual(resource().dtype, tf.resource)
        # The releasing thread is held: dropping the iterator here must not destroy it.
        go = threading.Event()
        self.addCleanup(go.set)
        _worker.release_aside(_Blocker(go))
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
