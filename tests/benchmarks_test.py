"""The capacity model of benchmarks/capacity.py against closed forms; report.py's embedding
table and plot on a small fixture; the compression benchmark end to end at its smallest
settings."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import tensorflow as tf

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "capacity.py")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(_PATH),
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


capacity = _load("capacity")
report = _load("report")


def _figure(median, low=None, high=None):
    return {"median": median, "min": median if low is None else low,
            "max": median if high is None else high}


def _cell(system, label, workers, ps, rows, examples, memory, accuracy, runs=1, errors=0):
    return {"system": system, "label": label, "workers": workers, "ps": ps, "rows": rows,
            "updates_per_second": _figure(examples / 256),
            "examples_per_second": _figure(examples, examples / 2, examples * 2),
            "bytes_per_worker_step": _figure(50000.0) if ps else None,
            "worker_peak_bytes": _figure(memory * 2**20),
            "ps_peak_bytes": _figure(1536 * 2**20) if ps else None, "accuracy": _figure(accuracy),
            "loss": _figure(0.5),
            "runs": [{"error": "timed out" if i < errors else None} for i in range(runs)]}


def _embedding_fixture():
    """A small `embedding.json`: two V, tfdist async and the peer at 2 workers and 1 ps,
    one process; one failed run."""
    cells = []
    for rows, scale in ((100000, 1.0), (1000000, 0.5)):
        cells += [_cell("async", "tfdist async", 2, 1, rows, 25600 * scale, 700, 0.80, 3,
                        errors=int(rows == 1000000)),
                  _cell("peer", "tf_keras ParameterServerStrategy", 2, 1, rows, 12800, 650,
                        0.78, 3),
                  _cell("one_process", "one process (Keras 3)", 1, 0, rows, 6400, 900, 0.81,
                        3)]
    return json.loads(json.dumps({
        "commit": {"sha": "0123456789abcdef", "dirty": True},
        "machine": {"cpus": 2, "memory_bytes": 24 * 2**30},
        "load_before": {"load_average_1_5_15": [1.0, 1.5, 2.0], "cpus": 2},
        "load_after": {"load_average_1_5_15": [2.0, 1.5, 1.0], "cpus": 2},
        "settings": {"job": "Generated job.", "batch_size": 256, "steps_per_execution": 10,
                     "embedding_tables": "auto", "repeats": 3, "window": 20.0, "warmup": 5.0,
                     "quality_examples": 51200},
        "estimates": {str(rows): {"parameters": 17 * rows, "unique_rows_per_batch":
                                  {"items": 400.0, "categories": 230.0, "context": 214.0},
                                  "rows_only_bytes_per_worker_step": 200000.0,
                                  "whole_model_bytes_per_worker_step": 8.0 * 17 * rows}
                      for rows in (100000, 1000000)},
        "cells": cells}))


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


class EmbeddingReportTest(tf.test.TestCase):

    def test_table_compares_each_cell_with_the_peer_its_smallest_v_and_one_process(self):
        text = "\n".join(report.embedding_section(_embedding_fixture()))
        rows = [line for line in text.splitlines() if line.startswith("| tfdist async")]
        self.assertLen(rows, 2)
        cells = [c.strip() for c in rows[1].split("|")[1:-1]]
        # V, examples/s with its spread, against the peer and the smallest V, bytes, memory,
        # accuracy against one process, failed runs.
        self.assertEqual(cells[3], "1,000,000")
        self.assertEqual(cells[5], "12,800 (6,400-25,600)")
        self.assertEqual(cells[6], "1.00x")
        self.assertEqual(cells[7], "0.50x")
        self.assertEqual(cells[8], "50,000")
        self.assertEqual(cells[9], "700")
        self.assertEqual(cells[10], "1,536")
        self.assertEqual(cells[11], "0.800 (-1.0)")
        self.assertEqual(cells[13], "1 of 3")
        self.assertIn("Commit 0123456789 (dirty tree)", text)
        self.assertIn("Load average (1 / 5 / 15 min) 1 / 1.5 / 2 at the start", text)
        self.assertIn("| 1,000,000 | 17,000,000 | 844 | 200,000 | 136,000,000 |", text)
        peer = next(line for line in text.splitlines() if line.startswith("| tf_keras"))
        self.assertNotIn("x |", peer.split("|")[7])  # no ratio of the peer to itself

    def test_plot_is_written(self):
        path = os.path.join(self.get_temp_dir(), "embedding.png")
        report.plot_embedding(_embedding_fixture(), path)
        self.assertGreater(os.path.getsize(path), 1000)


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
