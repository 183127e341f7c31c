"""The capacity model of benchmarks/capacity.py against closed forms; report.py's rules
(commits never mixed in a table, no difference inside the spread, fractions of the limit) and
its embedding table and plot on small JSON fixtures. The benchmarks themselves run in
`benchmarks/run_all.py --size=smoke` (or quick)."""

import importlib.util
import json
import math
import os
import re
import sys
import tempfile
from unittest import mock

import tensorflow as tf

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                     "capacity.py")
_spec = importlib.util.spec_from_file_location("capacity", _PATH)
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)
sys.path.insert(0, os.path.dirname(_PATH))
import before_after  # noqa: E402
import machine  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402
import step_ops  # noqa: E402


def _report_of(out, results):
    """report.md written from `results` (`{name: the JSON of benchmarks/results/<name>.json}`)
    put in `out`."""
    for name, value in results.items():
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(value, f)
    report.write_report(out)
    with open(os.path.join(out, "report.md")) as f:
        return f.read()


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


def _stamp(commit, dirty=False):
    return {"commit": commit, "dirty": dirty, "load_before": [1.0, 1.0, 1.0],
            "load_after": [1.5, 1.0, 1.0], "settings": {},
            "machine": {"cpus": 2, "memory_gib": 8.0, "cpu_model": "test CPU"}}


def _cell(*values):
    return {"median": sorted(values)[len(values) // 2], "min": min(values), "max": max(values)}


def _rates_row(updates, rows_per_update):
    runs = [{"updates_per_second": u, "load_before": [2.0, 1, 1], "load_after": [3.5, 1, 1]}
            for u in updates]
    return {"updates_per_second": _cell(*updates),
            "examples_per_second": _cell(*[u * rows_per_update for u in updates]),
            "rows_per_update": rows_per_update, "runs": runs}


class ReportTest(tf.test.TestCase):
    """report.py's rules on small JSON fixtures (no benchmark runs)."""

    def test_a_table_of_two_commits_is_refused(self):
        self.assertEqual(report.one_commit({"a": "0123", "b": "0123"}), "0123")
        with self.assertRaisesRegex(report.MixedCommits, r"2 commits \(0123: a, c; 4567: b\)"):
            report.one_commit({"a": "0123", "b": "4567", "c": "0123"})

    def test_a_difference_inside_the_spread_is_no_difference(self):
        reference = _cell(100.0, 110.0, 120.0)
        wide = report.compare(_cell(105.0, 130.0, 140.0), reference)  # diff 20, spread 35
        self.assertTrue(wide["no_difference"])
        self.assertAlmostEqual(wide["ratio"], 130 / 110)
        self.assertEqual(report.comparison_text(wide), "no difference (1.18x)")
        narrow = report.compare(_cell(200.0, 205.0, 210.0), reference)  # diff 95, spread 20
        self.assertFalse(narrow["no_difference"])
        self.assertEqual(report.comparison_text(narrow), "1.86x")
        self.assertIsNone(report.compare({"median": None}, reference))

    def test_a_step_time_inside_the_spread_is_no_speed_up(self):
        uncompressed = {"seconds_per_step": 1.0, "speedup": 1.0,
                        "seconds_per_step_spread": _cell(0.8, 1.0, 1.3)}
        close = {"seconds_per_step": 0.9, "speedup": 1.0 / 0.9, "fraction_of_limit": 0.5,
                 "seconds_per_step_spread": _cell(0.85, 0.9, 0.95)}
        self.assertEqual(report.step_cell(close, uncompressed),
                         "0.900 (0.850–0.950; no difference (1.1x); 0.50)")
        fast = {"seconds_per_step": 0.1, "speedup": 10.0,
                "seconds_per_step_spread": _cell(0.09, 0.1, 0.12)}
        self.assertEqual(report.step_cell(fast, uncompressed), "0.100 (0.090–0.120; 10.0x)")
        self.assertEqual(report.step_cell({"error": "boom"}, uncompressed), "error")

    def test_fraction_of_the_faster_limit(self):
        limits = [_cell(1000.0, 1100.0, 1200.0), _cell(2000.0, 2200.0, 2400.0), None]
        self.assertAlmostEqual(report.fraction_of_limit(_cell(550.0), limits), 0.25)
        self.assertIsNone(report.fraction_of_limit(_cell(550.0), [None]))

    def test_part_commits_keep_what_an_earlier_run_measured(self):
        results = {"stamp": _stamp("a" * 40)}
        machine.record_parts(results, _stamp("b" * 40, dirty=True), ["timing/1gbit, N=2"],
                             kept=["timing/100mbit, N=2"])
        self.assertEqual(results["part_commits"], {"timing/100mbit, N=2": "a" * 12,
                                                   "timing/1gbit, N=2": "b" * 12 + "+dirty"})
        self.assertEqual(report.part_commit(results, "timing/1gbit, N=2"), "b" * 12 + "+dirty")
        self.assertEqual(machine.commit_label(None), "not recorded")
        # Each part keeps the load of the sitting that measured it (a part measured before
        # loads were kept per part has none); the report lists them where they differ.
        self.assertEqual(list(results["part_loads"]), ["timing/1gbit, N=2"])
        self.assertEqual(results["part_loads"]["timing/1gbit, N=2"]["load_before"],
                         [1.0, 1.0, 1.0])
        self.assertEqual(report._part_loads_text(results), "")
        results["stamp"] = _stamp("b" * 40)
        machine.record_parts(results, _stamp("c" * 40), ["timing/100mbit, N=2"],
                             kept=["timing/1gbit, N=2"])
        results["part_loads"]["timing/1gbit, N=2"] = {"load_before": [3.0, 2, 1],
                                                      "load_after": [4.0, 2, 1]}
        self.assertIn("timing/1gbit, N=2: 3 / 2 / 1 to 4 / 2 / 1",
                      report._part_loads_text(results))

    def test_scaling_and_straggler_tables_give_spread_rows_and_examples(self):
        scaling = {"stamp": _stamp("f" * 40), "repeats": 3,
                   "hard sync": {"2": 100.0}, "async": {"2": 400.0},
                   report.LIMIT_MODE: {"2": 200.0},
                   "runs": {"hard sync": {"2": [90.0, 100.0, 120.0]},
                            "async": {"2": [400.0, 380.0, 410.0]},
                            report.LIMIT_MODE: {"2": [200.0, 190.0, 210.0]}}}
        capacity_result = report.build_capacity({"hard sync": {"1": 300.0, "2": 100.0}}, 10.0)
        text = "\n".join(report.scaling_section(scaling, capacity_result,
                                                {"scaling.json": "f" * 12}))
        # hard sync: 100 updates/s of 64 rows (6,400 ex/s) over the limit's 200 x 64.
        self.assertIn("| 2 | 100.0 (90.0–120.0) | 6,400 | 0.50 | 400.0 (380.0–410.0) | 12,800 "
                      "| 1.00 | 200.0 (190.0–210.0) | 12,800 |", text)
        straggler = {"stamp": _stamp("f" * 40), "num_workers": 4, "repeats": 3, "slowdown": 4,
                     "window_seconds": 8, "job": "digits MLP", "network": "local",
                     "limit": {"examples_per_second": _cell(25600.0)},
                     "modes": {"soft sync (3 of 4)": {
                         "baseline": {"updates_per_second": _cell(100.0, 90.0, 110.0),
                                      "examples_per_second": _cell(9600.0, 8640.0, 10560.0)},
                         "repeats": [{"baseline": {"rows_per_update": 96}}],
                         "persistent": {"updates_per_second": _cell(100.0, 95.0, 105.0),
                                        "rate_ratio": _cell(1.0, 0.9, 1.1)}}}}
        text = "\n".join(report.straggler_section(straggler))
        self.assertIn("| soft sync (3 of 4) | 96 | 100.0 (90.0–110.0) | 9,600 (8,640–10,560) | "
                      "0.38 |", text)

    def test_the_links_of_each_setting_are_stated_against_the_set_rate(self):
        network = {"links": {"1gbit, N=8": {"set_rate": 1e9, "pairs": [9.1e8, 6.2e8, 8e8, 7e8],
                                            "aggregate": 3.0e9, "topology": "switched",
                                            "bytes_per_pair": 125000000},
                             "100mbit, N=2": {"error": "no namespaces"}}}
        text = " ".join(report._links_text(network))
        self.assertIn("1gbit, N=8: 4 pair(s) on the switched network, 620–910 Mbit/s a pair "
                      "(62%–91% of the set rate), 3,000 Mbit/s together", text)
        self.assertIn("100mbit, N=2: not measured (no namespaces)", text)
        self.assertEqual(report._links_text({}), [])

    def test_a_step_time_ratio_gives_its_quartiles(self):
        spread = machine.ratio_spread([1.0, 1.1, 1.2, 1.3, 0.9])
        self.assertEqual((spread["median"], spread["min"], spread["max"], spread["pairs"]),
                         (1.1, 0.9, 1.3, 5))
        self.assertIn("min–max 0.900–1.300 of 5 neighbouring pairs",
                      report._ratio_spread_text({"step_time_ratio_spread": spread}))
        two = machine.ratio_spread([1.0, 1.2])  # quartiles inside the min-max
        self.assertTrue(1.0 <= two["q1"] <= two["q3"] <= 1.2, two)
        self.assertIsNone(machine.ratio_spread([]))
        self.assertEqual(report._ratio_spread_text({"step_time_ratio": 1.05}), "")

    def test_report_names_commits_refuses_mixtures_and_gives_fractions(self):
        out = self.get_temp_dir()
        rows = {
            "one process, Keras fit, no strategy": _rates_row([400.0, 410.0, 420.0], 64),
            "all-reduce (tfdist MultiWorkerMirrored)": _rates_row([60.0, 62.0, 64.0], 64),
            "async, 1 ps": _rates_row([300.0, 320.0, 340.0], 32),
            "hard sync, 1 ps": _rates_row([50.0, 61.0, 70.0], 64),
            "tf_keras ParameterServerStrategy, 1 ps": _rates_row([150.0, 160.0, 170.0], 32),
        }
        rates = {"stamp": _stamp("c" * 40), "num_workers": 2, "window_seconds": 2.0,
                 "repeats": 3, "rows_per_worker_step": 32, "job": "digits MLP",
                 "network": "local cluster", "reference": "all-reduce (tfdist "
                 "MultiWorkerMirrored)", "limit": ["one process, Keras fit, no strategy"],
                 "peer": ["tf_keras ParameterServerStrategy, 1 ps"], "rows": rows,
                 "bytes_per_ps_task": {"1 ps": [19240]}}
        timing = {"none": {"seconds_per_step": 1.0, "speedup": 1.0}}
        network = {"stamp": _stamp("d" * 40), "job": "CNN", "network": "switched",
                   "machine": "here", "timing_steps": 5,
                   "timing": {"100mbit, N=2": timing, "100mbit, N=4": timing},
                   "part_commits": {"timing/100mbit, N=2": "d" * 12,
                                    "timing/100mbit, N=4": "e" * 12}}
        text = _report_of(out, {"rates": rates, "network": network})
        self.assertIn("Measured at commit `cccccccccccc` on 2 cores, test CPU, 8.0 GiB.", text)
        rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
                for line in text.splitlines() if line.startswith("| ")}
        # async: 320 x 32 rows a second against the limit's 410 x 64; 5.16x all-reduce's
        # updates; 2.58x its examples; against the peer 2.00x (equal rows per update).
        self.assertEqual(rows["async, 1 ps"][1:9], [
            "32", "320.0 (300.0–340.0)", "10,240 (9,600–10,880)", "0.39", "5.16x", "2.58x",
            "2.00x", "2–3.5 |"])
        # hard sync's 61 (50-70) against all-reduce's 62 (60-64): no difference.
        self.assertEqual(rows["hard sync, 1 ps"][5:7],
                         ["no difference (0.98x)", "no difference (0.98x)"])
        self.assertIn("**Table refused**: its figures come from 2 commits (dddddddddddd: "
                      "timing/100mbit, N=2; eeeeeeeeeeee: timing/100mbit, N=4)", text)


def _embedding_cell(system, label, workers, ps, rows, examples, memory, accuracy, runs=1, errors=0):
    return {"system": system, "label": label, "workers": workers, "ps": ps, "rows": rows,
            "updates_per_second": _cell(examples / 256) if examples else None,
            "examples_per_second": _cell(examples / 2, examples, examples * 2)
            if examples else None,
            "bytes_per_worker_step": _cell(50000.0) if ps else None,
            "worker_peak_bytes": _cell(memory * 2**20),
            "ps_peak_bytes": _cell(1536 * 2**20) if ps else None, "accuracy": _cell(accuracy),
            "loss": _cell(0.5),
            "runs": [{"error": "timed out" if i < errors else None} for i in range(runs)]}


def _embedding_fixture():
    """A small `embedding.json`: two V, tfdist async, hard sync and the peer at 2 workers and
    1 ps, one process, one process at the global batch; one failed run."""
    cells = []
    for rows, scale in ((100000, 1.0), (1000000, 0.5)):
        cells += [
            _embedding_cell("async", "tfdist async", 2, 1, rows, 25600 * scale, 700, 0.80, 3,
                            errors=int(rows == 1000000)),
            _embedding_cell("peer", "tf_keras ParameterServerStrategy", 2, 1, rows, 12800,
                            650, 0.78, 3),
            _embedding_cell("one_process", "one process (Keras 3)", 1, 0, rows, 6400, 900,
                            0.81, 3),
            _embedding_cell("hard_sync", "tfdist hard sync", 2, 1, rows, 25600, 700, 0.75, 3),
            _embedding_cell("one_process_global", "one process at the global batch (Keras 3)",
                            2, 0, rows, None, 900, 0.76)]
    return json.loads(json.dumps({
        "stamp": _stamp("0123456789abcdef" * 2 + "01234567", dirty=True),
        "settings": {"job": "Generated job.", "batch_size": 256, "steps_per_execution": 10,
                     "embedding_tables": "auto", "repeats": 3, "window": 20.0, "warmup": 5.0,
                     "quality_examples": 51200},
        "estimates": {str(rows): {"parameters": 17 * rows, "unique_rows_per_batch":
                                  {"items": 400.0, "categories": 230.0, "context": 214.0},
                                  "rows_only_bytes_per_worker_step": 200000.0,
                                  "whole_model_bytes_per_worker_step": 8.0 * 17 * rows}
                      for rows in (100000, 1000000)},
        "cells": cells}))


class EmbeddingReportTest(tf.test.TestCase):

    def test_the_estimate_tfdist_moves_is_named_or_found_from_the_bytes(self):
        result = _embedding_fixture()
        for estimate in result["estimates"].values():  # measured: 50,000 bytes a step
            estimate.update(rows_only_bytes_per_worker_step=60000.0,
                            every_id_bytes_per_worker_step=120000.0)
        text = "\n".join(report.embedding_section(result))
        self.assertIn("both ways: what tfdist's step moves, besides the distinct ids", text)
        for estimate in result["estimates"].values():
            estimate["tfdist_moves"] = "every_id"
        text = "\n".join(report.embedding_section(result))
        self.assertIn("every id (what tfdist's step moves: each id looked up", text)

    def test_table_compares_each_cell_with_the_peer_its_smallest_v_and_one_process(self):
        text = "\n".join(report.embedding_section(_embedding_fixture()))
        rows = [line for line in text.splitlines() if line.startswith("| tfdist async")]
        self.assertLen(rows, 2)
        cells = [c.strip() for c in rows[1].split("|")[1:-1]]
        # V, examples/s with its spread, against the peer and the smallest V, bytes, memory,
        # accuracy against one process, failed runs.
        self.assertEqual(cells[3], "1,000,000")
        self.assertEqual(cells[5], "12,800 (6,400-25,600)")
        # A ratio inside the cells' spread is no difference (a claim needs a gap).
        self.assertEqual(cells[6], "no difference (1.00x)")
        self.assertEqual(cells[7], "no difference (0.50x)")
        self.assertEqual(cells[8], "50,000")
        self.assertEqual(cells[9], "700")
        self.assertEqual(cells[10], "1,536")
        self.assertEqual(cells[11], "0.800 (-1.0)")
        self.assertEqual(cells[13], "1 of 3")
        self.assertIn("Load average (1 / 5 / 15 min) 1 / 1 / 1 at the start", text)
        self.assertIn("| 1,000,000 | 17,000,000 | 844 | 200,000 | 136,000,000 |", text)
        # A result with tfdist's own estimate (every id a batch looks up) shows it beside.
        result = _embedding_fixture()
        for estimate in result["estimates"].values():
            estimate["every_id_bytes_per_worker_step"] = 353288.0
        text = "\n".join(report.embedding_section(result))
        self.assertIn("| rows only (bytes) | every id (bytes) | whole model (bytes) |", text)
        self.assertIn("| 1,000,000 | 17,000,000 | 844 | 200,000 | 353,288 | 136,000,000 |",
                      text)
        # Hard sync's accuracy against one process at its global batch (2 x 256).
        hard = [line for line in text.splitlines() if line.startswith("| tfdist hard sync")]
        self.assertEqual(hard[0].split("|")[12].strip(), "0.750 (-1.0)")
        peer = next(line for line in text.splitlines() if line.startswith("| tf_keras"))
        self.assertNotIn("x |", peer.split("|")[7])  # no ratio of the peer to itself

    def test_a_merged_result_names_each_run(self):
        result = _embedding_fixture()
        result["merged_from"] = [
            {"commit": "a" * 40, "rows": ["100000"], "systems": ["async", "peer"], "cells": 2},
            {"commit": "b" * 40, "rows": ["1000000"], "systems": ["async"], "cells": 1}]
        text = "\n".join(report.embedding_section(result))
        self.assertIn("The cells come from 2 runs of the same tfdist code: `aaaaaaaaaaaa`: V "
                      "100,000 (async, peer, 2 cells); `bbbbbbbbbbbb`: V 1,000,000 (async, 1 "
                      "cells).", text)

    def test_report_names_the_commit_and_writes_the_plot(self):
        out = self.get_temp_dir()
        text = _report_of(out, {"embedding": _embedding_fixture()})
        self.assertIn("## Embedding tables: a recommendation job against V\n\n"
                      "Measured at commit `0123456789ab+dirty` on 2 cores, test CPU, 8.0 GiB.",
                      text)
        self.assertGreater(os.path.getsize(os.path.join(out, "embedding.png")), 1000)
        # A run of repeats of one shape (`--out=.../embedding_repeats`): a section of its own.
        repeats = _embedding_fixture()
        repeats["settings"].update(workers=["2"], ps=["1"], repeats=3)
        text = _report_of(out, {"embedding_repeats": repeats})
        self.assertIn("## Embedding tables: a recommendation job against V, 3 repeats at 2 "
                      "workers, 1 ps\n\nMeasured at commit", text)
        self.assertIn("![embedding](embedding_repeats.png)", text)
        self.assertGreater(os.path.getsize(os.path.join(out, "embedding_repeats.png")), 1000)


def _faults_fixture():
    """A small `faults.json`: soft sync without a fault, the chief killed (finished, one push
    on its way), a worker hung (did not end); SGP without a fault and a worker killed."""
    def run(scenario, faulted, ended=True, codes=(0, 0, 0, 0), after=12.5, job=30.0,
            accuracy=None, **more):
        return {"scenario": scenario, "faulted": faulted, "ended": ended,
                "still_running": [] if ended else ["worker:0", "worker:1"],
                "stopped_for_good": ["worker:3"] if scenario == "hang a worker" else [],
                "killed": [faulted] if scenario.startswith("kill") else [],
                "seconds_after_fault": None if faulted is None else after, "job_seconds": job,
                "exit_codes": {f"worker:{r}": c for r, c in enumerate(codes)},
                "errors": more.pop("errors", {}), **({"accuracy": accuracy} if accuracy
                                                     else {}), **more}

    return {"stamp": _stamp("fedcba9876543210" * 2 + "01234567"),
            "settings": {"quick": True, "num_workers": 4, "epochs": 3, "repeat": 2,
                         "fault_epoch": 1, "stall_timeout": 6.0, "pause": 3.0,
                         "restart_delay": 2.0, "end_timeout": 60.0, "preload": True},
            "job": "Generated job.",
            "strategies": {
                "soft sync (3 of 4)": {
                    "no fault": run("no fault", None, accuracy=0.9, updates="ok",
                                    pushes_sent=400, pushes_applied=390, pushes_dropped=10),
                    "kill the chief": run("kill the chief", "worker:0", codes=(-9, 0, 0, 0),
                                          accuracy=0.885, updates="ok", pushes_sent=380,
                                          pushes_applied=371, pushes_dropped=10),
                    "hang a worker": run("hang a worker", "worker:3", ended=False,
                                         codes=(None, None, 0, None), after=90.0, job=120.0,
                                         updates="not known: no worker finished")},
                "SGP": {
                    "no fault": run("no fault", None, accuracy=0.92, updates="ok",
                                    messages_sent=600, messages_taken=600,
                                    final_weight_sum=4.0),
                    "kill a worker": run("kill a worker", "worker:3", codes=(1, 1, 1, -9),
                                         errors={"worker:0": "PeerError: tfdist: "
                                                 "/job:worker/task:3 at h:1 stopped answering"},
                                         updates="not known: no worker finished")}}}


class BeforeAfterTest(tf.test.TestCase):

    def test_rows_compare_by_spread_and_rows_of_one_side_are_listed(self):
        # Older harnesses wrote a row's rate as a number, newer ones as {"median": x}.
        self.assertEqual(before_after.rates_of({"rows": {"a": {"updates_per_second": 2.0},
                                                         "b": {"updates_per_second":
                                                               {"median": 3.0}}}}),
                         {"a": 2.0, "b": 3.0})
        runs = {"before": [{"async": 10.0, "sync": 5.0, "old": 1.0},
                           {"async": 12.0, "sync": 6.0, "old": 1.0},
                           {"async": 11.0, "sync": 5.5, "old": 1.0}],
                "after": [{"async": 11.5, "sync": 9.0, "new": 2.0},
                          {"async": 13.0, "sync": 8.0, "new": 2.0},
                          {"async": 9.0, "sync": 10.0, "new": 2.0}]}
        result = before_after.compare(runs)
        self.assertEqual(result["only_one_side"], {"before": ["old"], "after": ["new"]})
        self.assertEqual(result["rows"]["async"]["verdict"], "no difference (ranges overlap)")
        self.assertEqual(result["rows"]["async"]["before"],
                         {"median": 11.0, "min": 10.0, "max": 12.0})
        self.assertEqual(result["rows"]["sync"]["verdict"], "1.64x (ranges apart)")
        self.assertEqual(list(before_after.compare(runs, only=["async"])["rows"]), ["async"])
        stamp = {"commit": "c" * 40, "load_before": [1.0, 1.0, 1.0],
                 "load_after": [2.0, 2.0, 2.0],
                 "settings": {"before": "a" * 40, "after": "b" * 40, "repeats": 3,
                              "num_workers": 2}}
        text = before_after.markdown({"stamp": stamp, **result})
        self.assertIn("`aaaaaaaaaaaa` -> `bbbbbbbbbbbb`", text)
        self.assertIn("| sync | 5.5 (5.0-6.0) | 9.0 (8.0-10.0) | 1.64x (ranges apart) | "
                      "1.80, 1.33, 1.82 |", text)
        self.assertEqual(result["rows"]["async"]["pair_ratios"], [1.15, 1.083, 0.818])
        self.assertIn("Rows only before: old.", text)
        # One run a side has no spread: its ratio is not called a difference.
        one = before_after.compare({side: r[:1] for side, r in runs.items()}, only=["sync"])
        self.assertEqual(one["rows"]["sync"]["verdict"],
                         "1.80x (one run: no spread to judge it by)")
        self.assertEqual(one["only_one_side"], {"before": [], "after": []})

    def test_only_reaches_a_list_flag_harness_as_one_flag(self):
        # An older rates.py reads `--only` as a comma-separated list, a repeated flag keeping
        # only its last value: it is given every value in one flag (a value with a comma
        # then matches more rows, which `compare` filters out); a newer one each apart.
        only = ["model averaging", "async, 2 ps"]
        for source, want in (('flags.DEFINE_list("only", [], "Rows.")',
                              ["--only=model averaging,async, 2 ps"]),
                             ('flags.DEFINE_multi_string("only", [], "Rows.")',
                              ["--only=model averaging", "--only=async, 2 ps"])):
            tree = tempfile.mkdtemp(dir=self.get_temp_dir())
            os.makedirs(os.path.join(tree, "benchmarks"))
            with open(os.path.join(tree, "benchmarks", "rates.py"), "w") as f:
                f.write(source)
            self.assertEqual(before_after.only_flags(tree, only), want)
            self.assertEqual(before_after.only_flags(tree, []), [])


class StepOpsTest(tf.test.TestCase):

    def test_every_op_of_a_step_is_counted_and_two_steps_compared(self):
        @tf.function
        def step(x):
            return tf.cond(x > 0, lambda: x * 2.0, lambda: x + 1.0)

        graph_def = step.get_concrete_function(
            tf.TensorSpec([], tf.float32)).graph.as_graph_def()
        ops = step_ops.graph_ops(graph_def)
        # The branches' ops live in the graph's function library: they count too.
        self.assertEqual((ops["Mul"], ops["AddV2"]), (1, 1))
        self.assertEqual(sum(ops.values()),
                         len(graph_def.node) + sum(len(f.node_def)
                                                   for f in graph_def.library.function))
        # A node's signature holds what it does, not its name or its function's trace number.
        signatures = step_ops.graph_signatures(graph_def)
        self.assertEqual(sum(signatures.values()), sum(ops.values()))
        self.assertTrue(any(s.startswith("If ") or s.startswith("StatelessIf ")
                            for s in signatures), signatures)
        self.assertFalse(any(re.search(r"branch=\S+_\d+\b", s) for s in signatures))
        before = {"steps": {"async": {"ops": {"Mul": 1, "Send": 2}},
                            "soft_sync": {"ops": {"Mul": 1}, "signatures": {"Mul @ (2 in)": 1}},
                            "hard": {"ops": {"Mul": 1}, "signatures": {"Mul @ (2 in) T=f": 1}}}}
        after = {"steps": {"async": {"ops": {"Mul": 1, "Send": 3, "Recv": 1}},
                           "soft_sync": {"ops": {"Mul": 1}, "signatures": {"Mul @ (2 in)": 1}},
                           "hard": {"ops": {"Mul": 1}, "signatures": {"Mul @ (3 in) T=f": 1}},
                           "sgp": {"ops": {}}}}
        self.assertEqual(step_ops.compare(before, after),
                         ["async: differs: Recv 0 -> 1, Send 2 -> 3",
                          "hard: differs: the same op counts",
                          "  1 -> 0: Mul @ (2 in) T=f", "  0 -> 1: Mul @ (3 in) T=f",
                          "sgp: only after",
                          "soft_sync: the same step, node for node"])

class FaultsReportTest(tf.test.TestCase):

    def test_each_fault_gives_its_end_time_accuracy_against_no_fault_and_update_count(self):
        text = "\n".join(report.faults_section(_faults_fixture()))
        self.assertIn("**Quick size**", text)
        self.assertIn("`stall_timeout=6`", text)
        rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in
                                                                 line.split("|")[3:-1]]
                for line in text.splitlines() if line.startswith("| soft") or
                line.startswith("| SGP")}
        self.assertEqual(rows[("soft sync (3 of 4)", "no fault")],
                         ["yes", "30", "finished", "0.900",
                          "ok: 400 sent, 390 applied + 10 dropped"])
        # The killed chief is the fault, not a failure of the job; accuracy in points.
        self.assertEqual(rows[("soft sync (3 of 4)", "kill the chief")],
                         ["yes", "12.5 (30)", "finished", "0.885 (-1.5)",
                          "ok: 380 sent, 371 applied + 10 dropped"])
        self.assertEqual(rows[("soft sync (3 of 4)", "hang a worker")][:3],
                         ["no", "90 (120)", "did not end: worker:0, worker:1 still running"])
        self.assertEqual(rows[("SGP", "no fault")][4],
                         "ok: 600 messages sent, 600 taken; mass 4.0000")
        self.assertEqual(rows[("SGP", "kill a worker")][2:4],
                         ["failed: worker:0 exit 1 (and 2 more): PeerError: tfdist: "
                          "/job:worker/task:3 at h:1 stopped answering", "none"])

    def test_report_names_the_commit(self):
        out = self.get_temp_dir()
        text = _report_of(out, {"faults": _faults_fixture()})
        self.assertIn("## Faults on a running job\n\nMeasured at commit `fedcba987654` on 2 cores, "
                      "test CPU, 8.0 GiB.", text)


class ResumeTest(tf.test.TestCase):
    """A full run_all.py takes longer than one sitting: `--resume` carries it on from the same
    clean commit and settings only, and the report says how many sittings it took."""

    def test_a_run_is_carried_on_only_from_its_commit_clean_tree_machine_and_settings(self):
        code = {"commit": "a" * 40, "dirty": False, "machine": {"cpus": 2}}
        self.assertEqual(machine.resume_problems(code, code, {"rows": [1], "complete": False},
                                                 {"rows": [1]}), [])
        other = machine.resume_problems(code, dict(code, commit="b" * 40))
        self.assertEqual(len(other), 1)
        self.assertIn("measured at commit " + "a" * 40, other[0])
        self.assertIn("this checkout is " + "b" * 40, other[0])
        self.assertIn("clean tree", machine.resume_problems(code, dict(code, dirty=True))[0])
        settings = machine.resume_problems(code, code, {"rows": [1], "window": 20.0},
                                           {"rows": [1, 2], "window": 20.0})
        self.assertEqual(settings, ["its settings differ: rows ([1] then, [1, 2] now)"])
        self.assertRegex(machine.resume_problems(code, dict(code, machine={"cpus": 8}))[0],
                         r"^it was measured on another machine \(2 cores")
        unknown = {"commit": "unknown", "dirty": None}
        self.assertEqual(len(machine.resume_problems(unknown, unknown)), 2)

    def test_a_run_is_carried_on_by_another_machine_of_the_same_kind(self):
        # Two hosts of one kind differ in their kernel build and a few kB of memory.
        host = {"cpus": 2, "cpu_model": "AMD EPYC", "memory_gib": 23.5,
                "memory_bytes": 25276510208, "system": "Linux-6.18.44-fc-v657-x86_64"}
        other_host = dict(host, memory_bytes=25276518400, system="Linux-6.18.44-fc-v509-x86_64")
        code = {"commit": "a" * 40, "dirty": False}
        self.assertEqual(machine.resume_problems(dict(code, machine=host),
                                                 dict(code, machine=other_host)), [])
        for key, value in (("cpus", 4), ("cpu_model", "Intel Xeon"), ("memory_gib", 7.8)):
            problems = machine.resume_problems(dict(code, machine=host),
                                               dict(code, machine=dict(host, **{key: value})))
            self.assertEqual(len(problems), 1, key)
            self.assertIn("another machine", problems[0])
        # The report says the sittings ran on several machines of one kind.
        out = self.get_temp_dir()
        run = {"commit": "a" * 40, "dirty": False, "size": "full", "peer": True, "run": "r1",
               "machine": host, "benchmarks": {"faults": {"finished": True}},
               "sittings": [{"started": "2026-01-01T00:00:00Z", "machine": host,
                             "load_before": [0, 0, 0]},
                            {"started": "2026-01-02T00:00:00Z", "machine": other_host,
                             "load_before": [0, 0, 0]}]}
        with open(os.path.join(out, "run_all.json"), "w") as f:
            json.dump(run, f)
        text = report.run_text(out, {"run_all.json"})[0]
        self.assertIn("in 2 sittings", text)
        self.assertIn("on 2 machines of one kind (2 cores, AMD EPYC, 23.5 GiB", text)

    def _run_all(self, out, *args):
        import subprocess

        return subprocess.run([sys.executable, os.path.join(os.path.dirname(_PATH),
                                                            "run_all.py"),
                               f"--out_dir={out}", *args],
                              capture_output=True, text=True, timeout=120)

    def test_resume_refuses_another_commit_and_carries_on_its_own(self):
        out = self.get_temp_dir()
        done = self._run_all(out, "--resume", "--only=faults")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("--resume: no run to resume", done.stderr)
        code = machine.code_note()
        record = {"commit": "0" * 40, "dirty": False, "size": "quick", "peer": False,
                  "sittings": [{"started": "2026-01-01T00:00:00Z", "load_before": [1, 1, 1]}],
                  "benchmarks": {"faults": {"sittings": 1, "finished": True}}}
        with open(os.path.join(out, "run_all.json"), "w") as f:
            json.dump(record, f)
        done = self._run_all(out, "--resume", "--only=faults")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("measured at commit " + "0" * 40, done.stderr)
        self.assertIn("start a new run (--new_run)", done.stderr)
        # The run's own commit: refused from a dirty tree, else the finished benchmark is
        # skipped and the report written, the sitting recorded.
        record.update(commit=code["commit"], machine=machine.machine_note(), run="r1")
        with open(os.path.join(out, "run_all.json"), "w") as f:
            json.dump(record, f)
        done = self._run_all(out, "--resume", "--only=faults")
        if code["dirty"]:
            self.assertNotEqual(done.returncode, 0)
            self.assertIn("clean tree", done.stderr)
            return
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("faults.py", done.stdout)
        with open(os.path.join(out, "run_all.json")) as f:
            self.assertEqual(len(json.load(f)["sittings"]), 1)  # nothing was left to run
        with open(os.path.join(out, "report.md")) as f:
            self.assertIn(f"at commit `{code['commit'][:12]}`, in 1 sitting", f.read())

    def test_the_run_and_its_tasks_import_tfdist_from_its_tree(self):
        # A worktree at the measured commit need not be installed: run_all's own process
        # (the scaling runs' clusters) and every task it starts import tfdist from it.
        with mock.patch.dict(os.environ, {"PYTHONPATH": "elsewhere"}), \
                mock.patch.object(sys, "path", ["first"]):
            run_all._import_from_this_tree()
            self.assertEqual(sys.path[0], run_all.ROOT)
            self.assertEqual(os.environ["PYTHONPATH"], run_all.ROOT + os.pathsep + "elsewhere")

    def test_an_unfinished_run_is_not_replaced_without_new_run(self):
        out = self.get_temp_dir()
        with open(os.path.join(out, "run_all.json"), "w") as f:
            json.dump({"commit": "0" * 40, "dirty": False, "size": "full", "peer": True,
                       "run": "r0", "sittings": [], "benchmarks": {
                           "rates": {"finished": True}, "embedding": {"sittings": 1}}}, f)
        done = self._run_all(out, "--only=faults")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("records an unfinished run (at commit " + "0" * 40 + "; not finished: "
                      "embedding): carry it on with --resume, or start a new run over it "
                      "with --new_run", done.stderr)

    def test_a_sitting_runs_what_the_run_has_not_finished_keeping_shared_files(self):
        everything = [*run_all.BENCHMARKS, "scaling"]
        fresh = run_all.plan(everything, "full", {"benchmarks": {}})
        self.assertEqual([step[0] for step in fresh],
                         ["rates", "straggler", "quality", "compression", "network",
                          "network_n8", "network_sgp", "embedding", "faults", "scaling"])
        # A new run removes each file once, before its first writer; nothing carries on.
        self.assertEqual([(name, file, f, c) for name, _, file, f, c in fresh
                          if name.startswith("network")],
                         [("network", "network", True, False),
                          ("network_n8", "network", False, False),
                          ("network_sgp", "network_sgp", True, False)])
        # Stopped in network_n8 after network finished, and in the embedding matrix: the
        # next sitting keeps network.json (network's part) and carries the matrix on.
        record = {"benchmarks": {name: {"finished": True} for name in
                                 ("rates", "straggler", "quality", "compression", "network")}}
        record["benchmarks"]["network_n8"] = {"sittings": 1}
        steps = run_all.plan(everything, "full", record)
        self.assertEqual([(name, file, f, c) for name, _, file, f, c in steps], [
            ("network_n8", "network", False, False), ("network_sgp", "network_sgp", True, False),
            ("embedding", "embedding", True, False), ("faults", "faults", True, False),
            ("scaling", "scaling", True, False)])
        record["benchmarks"].update(network_n8={"finished": True},
                                    network_sgp={"finished": True},
                                    embedding={"sittings": 1}, faults={"failed": "exit 1"})
        steps = run_all.plan(["embedding", "faults"], "full", record)
        self.assertEqual([(name, f, c) for name, _, _, f, c in steps],
                         [("embedding", False, True), ("faults", False, False)])
        # The smoke size has no network_n8.
        self.assertNotIn("network_n8",
                         [step[0] for step in run_all.plan(everything, "smoke",
                                                           {"benchmarks": {}})])
        self.assertEqual(run_all.unfinished(record), ["embedding", "faults"])

    def test_a_sitting_on_another_kind_of_machine_begins_stopped_benchmarks_again(self):
        amd = {"cpus": 2, "cpu_model": "AMD EPYC", "memory_gib": 23.5}
        intel = dict(amd, cpu_model="Intel Xeon", memory_gib=23.6)
        everything = [*run_all.BENCHMARKS, "scaling"]
        record = {"commit": "a" * 40, "dirty": False, "size": "full", "peer": True,
                  "machine": amd, "benchmarks": {
                      name: {"finished": True, "sittings": 1, "machine": amd}
                      for name in ("rates", "straggler", "quality", "compression", "network")}}
        record["benchmarks"]["network_n8"] = {"sittings": 1}  # (no machine: the run's)
        record["benchmarks"]["embedding"] = {"sittings": 2, "machine": amd}
        # On the same kind the matrix carries on; on another it begins again from nothing
        # (its file removed), and network_n8 keeps the finished network's part of the file.
        same = run_all.plan(everything, "full", record, dict(amd, system="other host"))
        self.assertIn(("embedding", False, True), [(n, f, c) for n, _, _, f, c in same])
        steps = run_all.plan(everything, "full", record, intel)
        self.assertEqual([(name, f, c) for name, _, _, f, c in steps], [
            ("network_n8", False, False), ("network_sgp", True, False),
            ("embedding", True, False), ("faults", True, False), ("scaling", True, False)])
        # The resumed run is carried on (the commit, tree, size and peer are its own), and
        # the record names each benchmark's machine and the one begun again.
        path = os.path.join(self.get_temp_dir(), "run_all.json")
        machine.write_json(path, record)
        manifest = run_all.Manifest.resumed(path, {"commit": "a" * 40, "dirty": False,
                                                   "machine": intel}, "full", True)
        manifest.start("embedding", intel)
        manifest.start("faults", intel)
        with open(path) as f:
            entries = json.load(f)["benchmarks"]
        self.assertEqual((entries["embedding"]["sittings"], entries["embedding"]["machine"]),
                         (1, intel))
        self.assertEqual(entries["embedding"]["begun_again"],
                         "stopped after 2 sitting(s) on 2 cores, AMD EPYC, 23.5 GiB, begun "
                         "again from nothing on this machine")
        self.assertEqual(entries["faults"], {"sittings": 1, "started": mock.ANY,
                                             "machine": intel})
        self.assertEqual(entries["rates"]["machine"], amd)
        # The report's header says which benchmark sat on which kind, and what began again.
        with open(path) as f:
            run = json.load(f)
        run.update(run="r1", sittings=[{"started": "2026-01-01T00:00:00Z", "machine": amd},
                                       {"started": "2026-01-02T00:00:00Z", "machine": intel}])
        out = self.get_temp_dir()
        machine.write_json(os.path.join(out, "run_all.json"), run)
        text = report.run_text(out, {"run_all.json"})[0]
        self.assertIn("in 2 sittings (the first started 2026-01-01T00:00:00Z, the last "
                      "2026-01-02T00:00:00Z) on 2 kinds of machine, each benchmark on one "
                      "(rates, straggler, quality, compression, network, network_n8: 2 cores, "
                      "AMD EPYC, 23.5 GiB; embedding, faults: 2 cores, Intel Xeon, 23.6 GiB; ",
                      text)
        self.assertIn("Begun again on another kind of machine: embedding (stopped after 2 "
                      "sitting(s) on 2 cores, AMD EPYC, 23.5 GiB, begun again", text)

    def test_a_table_of_figures_from_two_kinds_of_machine_is_refused(self):
        amd = {"cpus": 2, "cpu_model": "AMD EPYC", "memory_gib": 23.5}
        intel = dict(amd, cpu_model="Intel Xeon")
        result = {"stamp": {"commit": "a" * 40, "dirty": False, "machine": intel},
                  "part_commits": {"n2": "a" * 12, "n8": "a" * 12},
                  "part_machines": {"n2": amd, "n8": intel}}
        self.assertEqual(report.measured(result, "n2"), ("a" * 12, "2 cores, AMD EPYC, 23.5 GiB"))
        self.assertEqual(report.measured(result), ("a" * 12, "2 cores, Intel Xeon, 23.5 GiB"))
        ok, line = report.commit_line({part: report.measured(result, part)
                                       for part in ("n2", "n8")})
        self.assertFalse(ok)
        self.assertEqual(line, "**Table refused**: its figures come from 2 kinds of machine "
                         "(2 cores, AMD EPYC, 23.5 GiB: n2; 2 cores, Intel Xeon, 23.5 GiB: n8); "
                         "measure them again on one machine: a ratio compares runs of one "
                         "machine.")
        # A figure that does not depend on the machine (a byte ratio) is named by its commit.
        self.assertEqual(report.commit_line({"timing": report.measured(result, "n8"),
                                             "ratio": "a" * 12}),
                         (True, f"Measured at commit `{'a' * 12}` on 2 cores, Intel Xeon, "
                                "23.5 GiB."))
        # A table with no sources (a network.json without timings) is refused, not a crash.
        self.assertEqual(report.commit_line({}),
                         (False, "**Table refused**: its figures come from 0 commits (); "
                                 "measure them again in one run (benchmarks/run_all.py)."))
        # record_parts keeps each part's machine.
        results = {"stamp": {"commit": "a" * 40, "dirty": False, "machine": amd},
                   "part_machines": {"n2": amd}}
        machine.record_parts(results, {"commit": "a" * 40, "dirty": False, "machine": intel},
                             ["n8"], kept=["n2"])
        self.assertEqual(results["part_machines"], {"n2": amd, "n8": intel})

    def test_an_interleaved_matrix_carries_on_where_it_stopped(self):
        keys = ["a", "b", "once"]
        every = list(machine.interleaved(keys, 3, {}, once=lambda key: key == "once"))
        self.assertEqual(every, [(0, "a"), (0, "b"), (0, "once"), (1, "a"), (1, "b"),
                                 (2, "a"), (2, "b")])
        # Stopped after the second run of "a": the rest, in the same order.
        made = {"a": 2, "b": 1, "once": 1}
        self.assertEqual(list(machine.interleaved(keys, 3, made, once=lambda k: k == "once")),
                         [(1, "b"), (2, "a"), (2, "b")])

    def test_a_result_file_is_written_whole_or_not_at_all(self):
        path = os.path.join(self.get_temp_dir(), "sub", "r.json")
        machine.write_json(path, {"a": 1})
        machine.write_json(path, {"a": 2})
        with open(path) as f:
            self.assertEqual(json.load(f), {"a": 2})
        self.assertEqual(os.listdir(os.path.dirname(path)), ["r.json"])

    def test_report_header_names_the_run_its_sittings_and_other_commits(self):
        out = self.get_temp_dir()
        with open(os.path.join(out, "run_all.json"), "w") as f:
            json.dump({"commit": "f" * 40, "dirty": False, "size": "full", "peer": True,
                       "run": "r1",
                       "sittings": [{"started": "2026-01-01T00:00:00Z"},
                                    {"started": "2026-01-02T00:00:00Z"}],
                       "benchmarks": {"rates": {"finished": True},
                                      "faults": {"failed": "exit 1"},
                                      "embedding": {"sittings": 2}}}, f)
        ours = _embedding_fixture()
        ours["stamp"]["run"] = "r1"
        with open(os.path.join(out, "truncated.json"), "w") as f:
            f.write('{"stamp": {"co')  # (a write cut short: it is named, nothing fails)
        text = _report_of(out, {"faults": _faults_fixture(), "embedding": ours})
        self.assertIn("This run: `run_all.py --size=full` with the tf_keras peer at commit "
                      "`ffffffffffff`, in 2 sittings (the first started 2026-01-01T00:00:00Z, "
                      "the last 2026-01-02T00:00:00Z). Finished: rates. Failed: faults. Not "
                      "finished (stopped): embedding. **Results not of this run in this "
                      "directory** (their tables name their commits): faults.json "
                      "(fedcba987654, by hand), truncated.json (cannot be read: ", text)
        self.assertNotIn("embedding.json (", text)

    def test_an_embedding_run_of_several_sittings_says_so(self):
        result = _embedding_fixture()
        result["stamp"]["sittings"] = [{"load_before": [0.5, 1.0, 1.5]},
                                       {"load_before": [0.2, 0.3, 0.4]}]
        text = "\n".join(report.embedding_section(result))
        self.assertIn("Measured in 2 sittings of the same commit (`--resume`: each carried on "
                      "in the same interleaved order where the last stopped; the load at the "
                      "start of each: 0.5 / 1.0 / 1.5; 0.2 / 0.3 / 0.4).", text)
