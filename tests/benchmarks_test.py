"""The capacity model of benchmarks/capacity.py against closed forms; the compression
benchmark end to end at its smallest settings."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import tensorflow as tf

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "capacity.py")
_spec = importlib.util.spec_from_file_location("capacity", _PATH)
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)


class CapacityModelTest(tf.test.TestCase):

    def test_order_statistic(self):
        self.assertAlmostEqual(capacity.expected_order_statistic(1, 1), 1.0)
        self.assertAlmostEqual(capacity.expected_order_statistic(4, 4), 1 + 1 / 2 + 1 / 3 + 1 / 4)
        self.assertAlmostEqual(capacity.expected_order_statistic(4, 1), 1 / 4)
        # The slowest of many grows like log(m); the 90 % fastest stays bounded.
        self.assertAlmostEqual(capacity.expected_order_statistic(1024, 1024),
                               math.log(1024) + 0.5772, places=2)
        self.assertLess(capacity.expected_order_statistic(1024, 921), 2.5)

    def test_fit_recovers_a_linear_cost(self):
        rates = {m: 1.0 / (0.004 + 0.002 * m) for m in (1, 2, 4, 8)}
        compute_s, per_push_s = capacity.fit_local(rates)
        self.assertAlmostEqual(compute_s, 0.004)
        self.assertAlmostEqual(per_push_s, 0.002)
        for row in capacity.check_local(rates, compute_s, per_push_s):
            self.assertAlmostEqual(row["error"], 0.0)

    def test_projection_terms(self):
        model = capacity.CapacityModel(compute_s=0.01, per_push_s=0.0, model_bytes=4e6,
                                       bandwidth_bytes_s=1e9, latency_s=0.0, jitter=0.0,
                                       compression_ratio=100.0)
        # Ring all-reduce moves 2 (M - 1) / M of the model per link.
        self.assertAlmostEqual(model.ring_all_reduce(4), 0.01 + 2 * 3 / 4 * 4e6 / 1e9)
        # A single ps receives and sends M models per update.
        self.assertAlmostEqual(model.parameter_server(4), 0.01 + 4 * 2 * 4e6 / 1e9)
        self.assertAlmostEqual(model.compressed_all_gather(4), 0.01 + 3 * 4e4 / 1e9)
        rows = model.projections([8, 64])
        self.assertLess(rows[0]["ps_hard_sync_s"], rows[1]["ps_hard_sync_s"])
        self.assertLess(rows[1]["ps_soft_sync_0.9_s"], rows[1]["ps_hard_sync_s"])


class CompressionBenchmarkTest(tf.test.TestCase):

    def test_smallest_run_writes_every_figure(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = os.path.join(self.get_temp_dir(), "compression")
        command = [sys.executable, os.path.join(root, "benchmarks", "compression.py"),
                   f"--out={out}", "--fast", "--compressors=fp16,topk", "--seeds=0",
                   "--epochs=1", "--timing_steps=5"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=400)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(out + ".json") as f:
            figures = json.load(f)
        self.assertTrue(os.path.exists(out + ".png"))
        exchange = figures["exchange"]
        self.assertGreater(exchange["step_time_ratio"], 0)
        self.assertEqual(exchange["compressors"]["fp16"]["bytes_ratio"], 2.0)
        self.assertGreaterEqual(exchange["compressors"]["topk"]["bytes_ratio"], 50)
        self.assertEqual(exchange["compressors"]["topk"]["bytes_sent"],
                         exchange["compressors"]["topk"]["documented_bytes"])
        cnn = exchange["cnn"]["compressors"]
        self.assertEqual(set(cnn), {"fp16", "topk"})
        for entry in cnn.values():
            self.assertGreater(entry["codec_share"], 0)
            self.assertLess(entry["codec_share"], 1)
        accuracy = figures["accuracy"]["compressors"]
        self.assertEqual(set(accuracy["topk"]), {"error_feedback", "no_error_feedback"})


if __name__ == "__main__":
    tf.test.main()
