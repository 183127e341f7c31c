"""Tests of the all-reduce family: CompressedMirroredStrategy, MultiWorkerMirroredStrategy."""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tests.strategies import collective_program
from tfdist.launch import LocalCluster

PROGRAM = collective_program.__file__
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DEVICES = ["/cpu:0", "/cpu:1"]
COMPRESSORS = [(name,) for name in tfdist.compression.names()]


def two_devices():
    return len(tf.config.list_logical_devices("CPU")) >= 2


def build(strategy, optimizer="sgd", width=16):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="tanh"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.1) if optimizer == "sgd"
                      else keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy")
    return model


def train(strategy, optimizer="sgd", epochs=2, width=16, run_eagerly=False):
    x, y = collective_program.data()
    model = build(strategy, optimizer, width)
    model.run_eagerly = run_eagerly
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


class CompressedMirroredTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        if not two_devices():
            self.skipTest("needs two logical CPUs (set by tests/conftest.py)")

    @parameterized.parameters(("sgd",), ("adam",))
    def test_no_compression_reproduces_mirrored_exactly(self, optimizer):
        reference, _ = train(tf.distribute.MirroredStrategy(DEVICES), optimizer)
        model, history = train(tfdist.strategies.CompressedMirroredStrategy(DEVICES),
                               optimizer)
        for a, b in zip(reference.get_weights(), model.get_weights()):
            self.assertAllEqual(a, b)
        self.assertNotIn("bytes_sent", history)

    def test_none_compressor_also_exact(self):
        reference, _ = train(tf.distribute.MirroredStrategy(DEVICES))
        model, history = train(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression="none"))
        for a, b in zip(reference.get_weights(), model.get_weights()):
            self.assertAllEqual(a, b)
        self.assertEqual(history["compression_ratio"], [1.0, 1.0])

    def test_fp16_within_tolerance(self):
        # Stated tolerance: fp16 rounds each exchanged gradient to ~3 significant digits;
        # after 8 SGD steps the weights stay within 1e-3 of the uncompressed run.
        reference, _ = train(tf.distribute.MirroredStrategy(DEVICES))
        model, history = train(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression="fp16"))
        for a, b in zip(reference.get_weights(), model.get_weights()):
            self.assertAllClose(a, b, atol=1e-3, rtol=0)
        self.assertEqual(history["compression_ratio"], [2.0, 2.0])

    @parameterized.parameters(("threshold",), ("onebit",), ("randomk",))
    def test_run_eagerly_matches_the_traced_step(self, name):
        # Keras's run_eagerly=True calls the strategy outside tf.function: same exchange,
        # including payloads whose size differs between replicas (threshold). Not top-k
        # here: the softmax layer's gradients come in pairs of exactly equal magnitude, and
        # eager and traced arithmetic (1e-8 apart) break such ties differently.
        traced, traced_history = train(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression=name))
        eager, history = train(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression=name), run_eagerly=True)
        for a, b in zip(traced.get_weights(), eager.get_weights()):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)
        self.assertEqual(history["bytes_sent"], traced_history["bytes_sent"])

    @parameterized.parameters(COMPRESSORS)
    def test_every_compressor_trains_and_reports_bytes(self, name):
        strategy = tfdist.strategies.CompressedMirroredStrategy(DEVICES, compression=name)
        model, history = train(strategy)
        for key in ("bytes_sent", "bytes_dense", "compression_ratio"):
            self.assertIn(key, history)
        self.assertEqual(history["bytes_dense"][-1], 4 * (8 * 16 + 16 + 16 * 2 + 2))
        self.assertAllClose(history["compression_ratio"][-1],
                            history["bytes_dense"][-1] / history["bytes_sent"][-1])
        compressor = strategy.compressor
        if not compressor.variable_size and compressor.elementwise:
            self.assertEqual(history["bytes_sent"][-1],
                             compressor.payload_bytes([int(history["bytes_dense"][-1]) // 4],
                                                      tf.float32))
        for weight in model.weights:
            parts = strategy.experimental_local_results(weight.value)
            self.assertAllEqual(parts[0], parts[1])  # replicas agree after decoding
            self.assertTrue(np.all(np.isfinite(parts[0].numpy())))

    def test_residuals_are_per_replica(self):
        strategy = tfdist.strategies.CompressedMirroredStrategy(DEVICES, compression="topk")
        train(strategy, epochs=1)
        residuals = [v for variables in strategy.extended._exchange.states.variables.values()
                     for name, v in variables.items() if name == "residual"]
        self.assertLen(residuals, 1)  # one fused float32 vector
        first, second = strategy.experimental_local_results(residuals[0])
        self.assertNotAllClose(first, second)  # each replica keeps what it left out

    def test_embedding_gradients_pass_and_the_rest_is_compressed(self):
        # An embedding's gradient is an IndexedSlices: TF all-gathers it as it is; the dense
        # gradients of the same step still go through the compressor.
        rng = np.random.RandomState(0)
        x = rng.randint(0, 100, (64, 6)).astype("int32")
        y = (x[:, 0] % 2).astype("int32")

        def fit(strategy):
            keras.utils.set_random_seed(1)
            with strategy.scope():
                model = keras.Sequential([
                    keras.Input((6,), dtype="int32"), keras.layers.Embedding(100, 4),
                    keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                              SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return model.get_weights(), history.history

        # (compression=None is TF's MirroredStrategy with a collective key range of its own:
        # two built-in instances in one process share keys, and TF then refuses collectives
        # of another shape under the same key.)
        reference, _ = fit(tfdist.strategies.CompressedMirroredStrategy(DEVICES))
        weights, history = fit(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression="fp16"))
        self.assertEqual(history["bytes_dense"][-1], 4 * (4 * 2 + 2))  # the Dense layer
        self.assertEqual(history["compression_ratio"][-1], 2.0)
        for a, b in zip(reference, weights):
            self.assertAllClose(a, b, atol=1e-3, rtol=0)
        self.assertNotAllEqual(reference[1], weights[1])  # the Dense kernel went through fp16

    def test_topk_ratio_on_a_larger_model(self):
        strategy = tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression=tfdist.compression.get("topk", ratio=0.01))
        _, history = train(strategy, epochs=1, width=512)
        self.assertGreaterEqual(history["compression_ratio"][-1], 50)


class RegistryAndErrorsTest(tf.test.TestCase):

    def test_names(self):
        self.assertIsInstance(tfdist.strategies.get("compressed_mirrored", devices=DEVICES,
                                                    compression="fp16"),
                              tfdist.strategies.CompressedMirroredStrategy)
        self.assertIn("multi_worker_mirrored", tfdist.strategies.names())
        self.assertIn("tf_multi_worker_mirrored", tfdist.strategies.names())

    def test_unknown_compressor_is_named(self):
        with self.assertRaisesRegex(ValueError, "Unknown compressor 'zip'. Valid names"):
            tfdist.strategies.CompressedMirroredStrategy(DEVICES, compression="zip")

    def test_tf_config_with_ps_is_refused(self):
        config = {"cluster": {"worker": ["localhost:2000"], "ps": ["localhost:2001"]},
                  "task": {"type": "worker", "index": 0}}
        os.environ["TF_CONFIG"] = json.dumps(config)
        try:
            with self.assertRaisesRegex(ValueError, "has no use for ps tasks.*1 ps task"):
                tfdist.strategies.MultiWorkerMirroredStrategy()
        finally:
            del os.environ["TF_CONFIG"]


def run_workers(out_dir, *flags):
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalCluster([sys.executable, PROGRAM, f"--out_dir={out_dir}", *flags], num_ps=0,
                      num_workers=2, timeout=180, output=None, env=env) as cluster:
        result = cluster.wait()
    log = "\n".join(f"[{task}] {line}" for task, line in cluster.lines[-60:])
    return result, log


def load(out_dir, name):
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


class MultiWorkerTest(tf.test.TestCase):
    """Two worker processes on localhost, through the launcher, with Keras 3 `fit`."""

    def reference(self, compression=None, embedding=False):
        # One process, two replicas, the same global batches: tf.data gives worker i the
        # i-th half of each global batch, as MirroredStrategy gives it to replica i.
        if not two_devices():
            self.skipTest("needs two logical CPUs (set by tests/conftest.py)")
        strategy = (tfdist.strategies.CompressedMirroredStrategy(DEVICES, compression)
                    if compression else tf.distribute.MirroredStrategy(DEVICES))
        with strategy.scope():
            model = collective_program.build_model(embedding=embedding)
        model.fit(collective_program.dataset(embedding), epochs=2, verbose=0)
        return model.get_weights()

    def test_fit_evaluate_predict_without_compression(self):
        out = self.get_temp_dir()
        result, log = run_workers(out)
        self.assertEqual(result.returncode, 0, log)
        chief, other = load(out, "worker_0.json"), load(out, "worker_1.json")
        self.assertEqual(chief["num_replicas"], 2)
        for expected, a, b in zip(self.reference(), chief["weights"], other["weights"]):
            self.assertAllClose(a, b, rtol=0, atol=0)
            self.assertAllClose(expected, a, rtol=1e-5, atol=1e-6)
        self.assertIn("loss", chief["evaluation"])
        self.assertEqual(chief["predict_shape"], [collective_program.ROWS, 2])
        self.assertNotIn("bytes_sent", chief["history"])

    def test_fit_with_topk_compression(self):
        out = self.get_temp_dir()
        result, log = run_workers(out, "--compression=topk", "--epochs=3")
        self.assertEqual(result.returncode, 0, log)
        chief, other = load(out, "worker_0.json"), load(out, "worker_1.json")
        for a, b in zip(chief["weights"], other["weights"]):
            self.assertAllEqual(a, b)
        history = chief["history"]
        self.assertEqual(history["bytes_dense"][-1], 712.0)
        self.assertEqual(history["bytes_sent"][-1], 8.0)  # one value + one index of 178
        self.assertEqual(history["compression_ratio"][-1], 89.0)

    def test_fp16_close_to_uncompressed(self):
        out = self.get_temp_dir()
        result, log = run_workers(out, "--compression=fp16")
        self.assertEqual(result.returncode, 0, log)
        for expected, got in zip(self.reference(), load(out, "worker_0.json")["weights"]):
            self.assertAllClose(expected, got, atol=1e-3, rtol=0)

    def test_run_eagerly_with_variable_size_payloads(self):
        # Eager steps see fully defined shapes; threshold payloads differ in size per worker.
        out = self.get_temp_dir()
        result, log = run_workers(out, "--run_eagerly", "--compression=threshold")
        self.assertEqual(result.returncode, 0, log)
        chief, other = load(out, "worker_0.json"), load(out, "worker_1.json")
        expected = self.reference("threshold")
        for want, a, b in zip(expected, chief["weights"], other["weights"]):
            self.assertAllEqual(a, b)
            self.assertAllClose(want, a, rtol=1e-5, atol=1e-6)
        self.assertGreater(chief["history"]["bytes_sent"][-1], 0)
        self.assertLess(chief["history"]["bytes_sent"][-1], chief["history"]["bytes_dense"][-1])

    def test_embedding_with_compression(self):
        # The embedding's IndexedSlices go through TF's all-gather, the dense gradients of
        # the same step through the compressor's collectives, in the same order everywhere.
        out = self.get_temp_dir()
        result, log = run_workers(out, "--embedding", "--compression=fp16")
        self.assertEqual(result.returncode, 0, log)
        chief, other = load(out, "worker_0.json"), load(out, "worker_1.json")
        expected = self.reference("fp16", embedding=True)
        for want, a, b in zip(expected, chief["weights"], other["weights"]):
            self.assertAllEqual(a, b)
            self.assertAllClose(want, a, rtol=1e-5, atol=1e-6)
        self.assertEqual(chief["history"]["bytes_dense"][-1], 4 * (4 * 16 + 16 + 16 * 2 + 2))
        self.assertEqual(chief["history"]["compression_ratio"][-1], 2.0)

    def test_steps_per_execution_is_a_clear_error(self):
        out = self.get_temp_dir()
        result, log = run_workers(out, "--steps_per_execution=2")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("`steps_per_execution` must be 1 with several workers", log)


if __name__ == "__main__":
    tf.test.main()
