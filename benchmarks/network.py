"""Compressed all-reduce on a slow network: step time and accuracy of every compressor against
uncompressed, on local clusters whose network is rate-limited (`LocalCluster(bandwidth=)`).

    python benchmarks/network.py --out=benchmarks/results/network            # hours
    python benchmarks/network.py --out=/tmp/n --compressors=none,topk --workers=2 \
        --bandwidths=100mbit --epochs=2                                       # minutes

Job (`network_worker.py`): a CNN on digits with 1.08 M parameters (two convolutions, a
512 x 2048 dense layer), batch 32 per worker, SGD, tfdist's MultiWorkerMirroredStrategy with
`compression=<codec>`, on a local cluster whose network is limited to `--bandwidths` (tc's
token bucket): `--topology=switched` (default) gives every worker a link of that rate of its
own, each way, as machines on a switch; `--topology=hub` puts every task on one loopback of
that rate, shared by the N workers as on a hub.

* Step time: median seconds per step of the chief over a timing run of `--timing_steps`
  steps, at every bandwidth and N of `--workers`, `--timing_repeats` runs interleaved (the
  cell: their median, with the min-max); ratios are uncompressed over the codec
  at the same bandwidth and N, in the same invocation. Each setting also times the limit,
  `LIMIT`: plain Keras `fit` in one process (no strategy, no network) on the global batch
  of 32 x N rows, on the same cores.
* Links: before each setting's timing, the rate each pair of its workers gets with every
  pair sending at once (`tfdist.launch.links`, plain TCP): whether the set rate holds on
  these cores (`--nocheck_links` skips it).
* Accuracy: a full run (`--epochs`) of every codec at N = `--accuracy_workers` (by default
  with no rate limit: it changes the time, not the numbers), with the loss of every epoch;
  lossy codecs also without error feedback.

The cores of this machine are shared by every worker: compute-bound steps (those the
compressed exchanges reach) are slower here than on N machines. Writes <out>.json and
<out>.png.
"""

import json
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
from machine import finish
from machine import record_parts
from machine import run_cluster
from machine import spread
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "network"),
                    "Output path without extension.")
flags.DEFINE_list("compressors", None, "Compressors (default: none and every registered).")
flags.DEFINE_list("bandwidths", ["100mbit", "1gbit"], "Link rates (tc units).")
flags.DEFINE_enum("topology", "switched", ["switched", "hub"],
                  "switched: every task a link of the rate of its own; hub: one link of the "
                  "rate shared by every task.")
flags.DEFINE_list("workers", ["2", "4"], "Worker counts N of the timing runs.")
flags.DEFINE_list("wide_compressors", None,
                  "Compressors timed at every bandwidth and N; the others only at the first "
                  "of each (default: all everywhere).")
flags.DEFINE_bool("check_links", True,
                  "Before timing each setting, measure the rate pairs of its workers get at "
                  "once on its network (tfdist.launch.links), into the JSON's `links`.")
flags.DEFINE_integer("accuracy_workers", 2, "N of the accuracy runs.")
flags.DEFINE_string("accuracy_bandwidth", None, "Link rate of the accuracy runs (None: no "
                    "limit; accuracy does not depend on it, the run's length does).")
flags.DEFINE_integer("epochs", 15, "Epochs of the accuracy runs.")
flags.DEFINE_integer("timing_steps", 20, "Steps of each timing run.")
flags.DEFINE_integer("timing_repeats", 3, "Timing runs of every cell (interleaved); a cell "
                     "keeps their median and min-max.", lower_bound=1)
flags.DEFINE_bool("without_error_feedback", True,
                  "Also run the lossy codecs' accuracy without error feedback.")
flags.DEFINE_float("timeout", 1200.0, "Seconds one cluster run may take.")
flags.DEFINE_bool("sgp", False, "Also time Stochastic Gradient Push (its defaults, uncompressed) "
                  "at every bandwidth and N: the row `sgp`, its speed-up against uncompressed "
                  "all-reduce in the same run.")
flags.DEFINE_multi_enum("parts", ["timing", "accuracy"], ["timing", "accuracy"],
                        "Parts to run; the others are kept from an existing <out>.json.")

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = "one process, no strategy"
# What each compressor runs with (the papers' settings where the issue names none).
SETTINGS = {
    "topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.01},
    "dgc": {"ratio": 0.001, "momentum": 0.9, "warmup_steps": 40},  # accuracy runs
    "powersgd": {"rank": 4},
    "threshold": {"threshold": 0.001},
}


# Timing runs measure the steady state: no warm-up (DGC's would cover every timed step).
TIMING_SETTINGS = {"dgc": {"warmup_steps": 0}}


def run(compression, workers, bandwidth, extra):
    """One cluster run; the chief's JSON (or {"error": ...}). `compression` "sgp": Stochastic
    Gradient Push, uncompressed."""
    if compression == "sgp":
        compression, extra = "none", {**extra, "strategy": "sgp"}
    if compression == LIMIT:  # one process, the global batch, no network to limit
        compression, bandwidth = "none", None
        extra = {**extra, "strategy": "none", "batch_per_worker": 32 * workers}
        workers = 1
    config = dict(SETTINGS.get(compression, {}))
    config.update(extra.pop("config", {}))
    with tempfile.TemporaryDirectory() as out_dir:
        out = os.path.join(out_dir, "result.json")
        command = [sys.executable, os.path.join(HERE, "network_worker.py"), f"--out={out}",
                   f"--compression={compression}", f"--compression_config={json.dumps(config)}",
                   *[f"--{k}={v}" for k, v in extra.items()]]
        start = time.perf_counter()
        result, lines = run_cluster(command, FLAGS.timeout, num_ps=0, num_workers=workers,
                                    bandwidth=bandwidth,
                                    topology=FLAGS.topology if bandwidth else None)
        if result.returncode or not os.path.exists(out):
            tail = " | ".join(line for _, line in lines[-4:])
            return {"error": f"{result.message}: {tail}"[:600]}
        with open(out) as f:
            figures = json.load(f)
        figures["wall_seconds"] = time.perf_counter() - start
        return figures


def _cell(runs):
    """A timing cell from its runs: the figures of the first that ran, with the median
    seconds per step and their min-max over every run that ran (`seconds_per_step_spread`);
    the first error where none ran."""
    ran = [figures for figures in runs if "seconds_per_step" in figures]
    if not ran:
        return runs[0]
    steps = spread([figures["seconds_per_step"] for figures in ran])
    return {**ran[0], "seconds_per_step": steps["median"], "seconds_per_step_spread": steps,
            "runs": runs}


def links(bandwidth, workers):
    """What pairs of the setting's workers get at once on its network (`measure_links`: on
    2 cores, many links at a high rate may not reach it), or why it was not measured."""
    import dataclasses

    from tfdist.launch.isolation import IsolationUnavailable
    from tfdist.launch.links import measure_links

    try:
        rates = measure_links(bandwidth, num_workers=max(2, workers), topology=FLAGS.topology)
    except (IsolationUnavailable, RuntimeError) as e:
        return {"error": str(e)[:300]}
    print(f"[links {bandwidth} N={workers}] {rates.text()}", flush=True)
    return dataclasses.asdict(rates)


def lossy(name):
    import tfdist

    return name != "none" and tfdist.compression.get(name).capabilities.lossy


def main(argv):
    del argv
    import tfdist

    names = FLAGS.compressors or ["none", *[n for n in tfdist.compression.names()
                                            if n != "none"]]
    run_stamp = stamp()
    results = {}
    if os.path.exists(FLAGS.out + ".json"):
        with open(FLAGS.out + ".json") as f:
            results = json.load(f)
    measured = []
    results.update({
        "job": "digits CNN, 1.08 M parameters, batch 32 per worker, SGD, tfdist "
               "MultiWorkerMirroredStrategy" + (" (row sgp: StochasticGradientPushStrategy, "
                                                 "exponential graph, 1 peer, overlap)"
                                                 if FLAGS.sgp else ""),
        "network": ("a private namespace per task on a bridge, every link limited by tc tbf "
                    "(machines on a switch)" if FLAGS.topology == "switched" else
                    "one private namespace, loopback limited by tc tbf (a hub: its rate shared "
                    "by all tasks)"),
        "settings": SETTINGS, "machine": "every task on this machine's cores"})
    if "timing" in FLAGS.parts:
        # A run replaces the settings (bandwidth, N) it measures and keeps the others: each
        # row's ratios come from one run, and `--workers=8` can be added to a 2/4 run.
        timing = dict(results.get("timing", {}))
        first = (FLAGS.bandwidths[0], int(FLAGS.workers[0]))
        for bandwidth in FLAGS.bandwidths:
            for workers in map(int, FLAGS.workers):
                measured.append(f"timing/{bandwidth}, N={workers}")
                chosen = [name for name in names + (["sgp"] if FLAGS.sgp else []) + [LIMIT]
                          if (bandwidth, workers) == first or not FLAGS.wide_compressors
                          or name in FLAGS.wide_compressors + [LIMIT]]
                if FLAGS.check_links:
                    results.setdefault("links", {})[f"{bandwidth}, N={workers}"] = links(
                        bandwidth, workers)
                else:  # an earlier run's links are not this timing's
                    results.get("links", {}).pop(f"{bandwidth}, N={workers}", None)
                runs = {name: [] for name in chosen}
                for repeat in range(FLAGS.timing_repeats):  # interleaved
                    for name in chosen:
                        load_before = os.getloadavg()[0]
                        figures = run(name, workers, bandwidth,
                                      {"max_steps": FLAGS.timing_steps,
                                       "config": dict(TIMING_SETTINGS.get(name, {}))})
                        runs[name].append(figures | {"load_before": load_before,
                                                     "load_after": os.getloadavg()[0]})
                        print(f"[timing {bandwidth} N={workers}, {repeat + 1}/"
                              f"{FLAGS.timing_repeats}] {name}: "
                              f"{figures.get('seconds_per_step', figures.get('error'))}",
                              flush=True)
                row = timing[f"{bandwidth}, N={workers}"] = {
                    name: _cell(figures) for name, figures in runs.items()}
                results.setdefault("timing_steps_by_setting", {})[
                    f"{bandwidth}, N={workers}"] = FLAGS.timing_steps
                base = row.get("none", {}).get("seconds_per_step")
                limit = row.get(LIMIT, {}).get("seconds_per_step")
                for figures in row.values():
                    if base and figures.get("seconds_per_step"):
                        figures["speedup"] = base / figures["seconds_per_step"]
                    if limit and figures.get("seconds_per_step"):
                        figures["fraction_of_limit"] = limit / figures["seconds_per_step"]
        results["timing"] = timing
    if "accuracy" in FLAGS.parts:
        measured.append("accuracy")
        accuracy = {}
        bandwidth = FLAGS.accuracy_bandwidth
        for name in names:
            variants = [("", {})]
            if FLAGS.without_error_feedback and lossy(name):
                variants.append((" (no error feedback)", {"config": {"error_feedback": False}}))
            for suffix, extra in variants:
                figures = run(name, FLAGS.accuracy_workers, bandwidth,
                              {"epochs": FLAGS.epochs, **extra})
                accuracy[name + suffix] = figures
                print(f"[accuracy N={FLAGS.accuracy_workers}] {name}{suffix}: "
                      f"{figures.get('test_accuracy', figures.get('error'))}", flush=True)
        base = accuracy.get("none", {}).get("test_accuracy")
        for figures in accuracy.values():
            if base is not None and "test_accuracy" in figures:
                figures["accuracy_difference"] = figures["test_accuracy"] - base
        results["accuracy"] = accuracy
        results["accuracy_setting"] = {"workers": FLAGS.accuracy_workers,
                                       "epochs": FLAGS.epochs, "bandwidth": bandwidth}
    every = [f"timing/{s}" for s in results.get("timing", {})] + (
        ["accuracy"] if "accuracy" in results else [])
    record_parts(results, run_stamp, measured, kept=[p for p in every if p not in measured])
    results["stamp"] = finish(run_stamp)
    results["topology"] = FLAGS.topology
    write_json(FLAGS.out + ".json", results)
    plot(results, FLAGS.out + ".png")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    timing = results.get("timing", {})
    names = sorted({n for row in timing.values() for n in row})
    width = 0.8 / max(1, len(timing))
    for i, (setting, row) in enumerate(sorted(timing.items())):
        speedups = [row.get(n, {}).get("speedup", 0) for n in names]
        left.bar([j + i * width for j in range(len(names))], speedups, width, label=setting)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=60)
    left.axhline(1, color="gray", lw=0.5)
    left.set_ylabel("speed-up per step over uncompressed")
    left.set_yscale("log")
    left.legend(fontsize=7)
    left.set_title("step time, shared rate-limited link")
    for name, figures in sorted(results.get("accuracy", {}).items()):
        if "loss" in figures:
            right.plot(range(1, len(figures["loss"]) + 1), figures["loss"], label=name,
                       lw=1.5 if name == "none" else 0.8,
                       ls="--" if "no error feedback" in name else "-")
    right.set_yscale("log")
    right.set_xlabel("epoch")
    right.set_ylabel("training loss")
    setting = results.get("accuracy_setting", {})
    right.set_title(f"digits CNN (1.08 M), N={setting.get('workers')}")
    right.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    app.run(main)
