"""TelemetryCallback writes the ps counters and the staleness histogram to TensorBoard."""

import glob
import os

import tensorflow as tf

import tfdist


class _FakeStrategy:
    def __init__(self):
        self.step = 0

    def progress(self):
        self.step += 10
        histogram = [0] * 16
        histogram[0], histogram[3] = 6, 2
        return {"global_step": self.step, "dropped_gradients": 1, "aggregated_gradients": 8,
                "staleness_mean": 0.75, "staleness_max": 3, "staleness_histogram": histogram}


def _events(log_dir):
    events = []
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                events.append((event.step, value.tag, value))
    return events


class TelemetryCallbackTest(tf.test.TestCase):

    def test_writes_scalars_and_histogram_at_the_global_step(self):
        log_dir = self.get_temp_dir()
        callback = tfdist.strategies.TelemetryCallback(_FakeStrategy(), log_dir,
                                                       every_n_batches=2)
        for batch in range(4):
            callback.on_train_batch_end(batch)
        callback.on_epoch_end(0)
        callback.on_train_end()
        events = _events(log_dir)
        self.assertEqual(sorted({step for step, _, _ in events}), [10, 20, 30])
        tags = {tag for _, tag, _ in events}
        self.assertContainsSubset({"tfdist/dropped_gradients", "tfdist/staleness_mean",
                                   "tfdist/staleness_max", "tfdist/staleness"}, tags)
        histogram = next(v for _, tag, v in events if tag == "tfdist/staleness")
        values = tf.make_ndarray(histogram.tensor)  # [buckets, 3]: left, right, count
        self.assertEqual(values[:, 2].sum(), 8)
        mean = next(v for _, tag, v in events if tag == "tfdist/staleness_mean")
        self.assertAllClose(tf.make_ndarray(mean.tensor), 0.75)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "must be a tfdist parameter-server strategy"):
            tfdist.strategies.TelemetryCallback(tf.distribute.get_strategy(), "/tmp/x")
        with self.assertRaisesRegex(ValueError, "`every_n_batches` must be None or an integer"):
            tfdist.strategies.TelemetryCallback(_FakeStrategy(), "/tmp/x", every_n_batches=0)


class _FakeGossip:
    telemetry_scalars = ("push_sum_weight", "messages_late")

    def progress(self):
        return {"step": 7, "push_sum_weight": 0.5, "messages_late": 3}


class GossipTelemetryTest(tf.test.TestCase):

    def test_gossip_counters_at_the_worker_step(self):
        log_dir = self.get_temp_dir()
        callback = tfdist.strategies.TelemetryCallback(_FakeGossip(), log_dir)
        callback.on_epoch_end(0)
        callback.on_train_end()
        events = {(step, tag) for step, tag, _ in _events(log_dir)}
        self.assertEqual(events, {(7, "tfdist/push_sum_weight"), (7, "tfdist/messages_late")})
