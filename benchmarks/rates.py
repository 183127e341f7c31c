"""Update rates of every strategy on one job, in one run: the one-process limit, MWMS, the PS
family, SGP, and the peer a user would go back to, tf_keras `fit` under TF's
`ParameterServerStrategy`.

    python benchmarks/rates.py --num_workers=4 --out=benchmarks/results/rates \
        --peer_python=PEER/bin/python     # the peer's own environment, see tf_keras_peer.py

Job: the digits MLP of `ps_worker.py` (64-64-10, 4.8 k parameters, SGD), on this machine's
local clusters (no bandwidth limit). Equal work: every worker computes 32 rows a step in every
row (MultiWorkerMirrored's `fit` batch is the global 32 x M); each row says the rows an update
averages beside updates per second, and the rows per second that went into updates.

The limit: plain Keras `fit` in one process, no strategy, on the same cores, at the global
batch of a synchronous update (32 x M rows), at steps_per_execution 1 and 10; the report
gives each row's examples per second as a fraction of the faster of the two. All-reduce runs
at steps_per_execution 1 (the reference) and 10, as the ps rows do.

Each row runs its own cluster and measures, on the chief, global updates per second over
`--window` seconds after a warm-up; every row runs `--repeats` times, interleaved (row 1..n,
then again), with the load average before and after each run; a row's figure is the median,
with the min and max beside it. Comparisons (and the rule that a difference smaller than the
spread is no difference) are `report.py`'s. Bytes per ps task are what one push of a worker
carries to each task (the reply carries as much back), as the runs placed the model.
"""

import json
import os
import statistics
import sys
import tempfile

from absl import app
from absl import flags
from machine import finish
from machine import load_note
from machine import run_cluster
from machine import spread
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Workers M.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Rows each worker computes per step.", lower_bound=1)
flags.DEFINE_float("window", 8.0, "Seconds of each measurement window.", lower_bound=1)
flags.DEFINE_float("warmup", 4.0, "Seconds before each window.", lower_bound=0)
flags.DEFINE_integer("repeats", 3, "Runs of each row (interleaved).", lower_bound=1)
flags.DEFINE_float("timeout", 180.0, "Seconds each run may take.")
flags.DEFINE_multi_string("only", [], "Run only the rows whose name contains this (repeatable; "
                          "the all-reduce reference and the limit always run).")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "rates"),
                    "Output path without extension.")
flags.DEFINE_string("peer_python", None,
                    "Python of an environment with tensorflow and tf_keras: adds the rows of "
                    "TF's ParameterServerStrategy (tf_keras_peer.py). None: no peer rows.")

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "all-reduce (tfdist MultiWorkerMirrored)"
LIMIT = "one process, Keras fit, no strategy"
PEER = "tf_keras ParameterServerStrategy, 1 ps"
SPE10 = ["--steps_per_execution=10"]


def rows(m, peer):
    """name -> (flags, ps tasks (None: the peer), workers)."""
    limit = ["--no_strategy", f"--batch_size={m * FLAGS.batch_size}"]
    table = {
        LIMIT: (limit, 0, 1),
        f"{LIMIT}, steps_per_execution 10": (limit + SPE10, 0, 1),
        REFERENCE: (["--strategy=multi_worker_mirrored"], 0, m),
        f"{REFERENCE}, steps_per_execution 10": (["--strategy=multi_worker_mirrored", *SPE10],
                                                  0, m),
        "hard sync, 1 ps": (["--strategy=soft_sync"], 1, m),
        "hard sync, 2 ps": (["--strategy=soft_sync"], 2, m),
        "async, 1 ps": (["--strategy=async"], 1, m),
        "async, 2 ps": (["--strategy=async"], 2, m),
        "model averaging, period 1, 1 ps": (["--strategy=model_averaging"], 1, m),
        "hard sync, 1 ps, steps_per_execution 10": (["--strategy=soft_sync", *SPE10], 1, m),
        "async, 1 ps, steps_per_execution 10": (["--strategy=async", *SPE10], 1, m),
        "SGP, exponential graph, 1 peer, overlap": (["--strategy=sgp"], 0, m),
        "SGP, synchronous (overlap off)": (["--strategy=sgp",
                                            "--strategy_arg=overlap=False"], 0, m),
    }
    if peer:
        table[PEER] = (["--steps_per_execution=1"], None, m)
        table[f"{PEER}, steps_per_execution 10"] = (SPE10, None, m)
    return table


def run_peer(peer_flags, num_workers):
    """One run of tf_keras_peer.py in the peer's environment."""
    import subprocess

    with tempfile.TemporaryDirectory() as out_dir:
        out = os.path.join(out_dir, "rate.json")
        command = [FLAGS.peer_python, os.path.join(HERE, "tf_keras_peer.py"), f"--out={out}",
                   f"--num_workers={num_workers}", "--num_ps=1", f"--window={FLAGS.window}",
                   f"--warmup={FLAGS.warmup}", f"--timeout={FLAGS.timeout}",
                   f"--batch_size={FLAGS.batch_size}", *peer_flags]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=FLAGS.timeout + 30)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {FLAGS.timeout + 30:g} s"}
        if done.returncode or not os.path.exists(out):
            return {"error": f"exit {done.returncode}: {done.stderr[-400:]}"}
        with open(out) as f:
            return json.load(f)


def run_once(strategy_flags, num_ps, num_workers):
    if num_ps is None:
        return run_peer(strategy_flags, num_workers)
    load_before = load_note()["load_average_1_5_15"]
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "ps_worker.py"), f"--out_dir={out_dir}",
                   f"--window={FLAGS.window}", f"--warmup={FLAGS.warmup}",
                   f"--batch_size={FLAGS.batch_size}", *strategy_flags]
        result, lines = run_cluster(command, FLAGS.timeout, num_ps=num_ps,
                                    num_workers=num_workers)
        if result.returncode:
            tail = " | ".join(line for _, line in lines[-5:])
            return {"error": f"{result.message}: {tail}"[:500]}
        with open(os.path.join(out_dir, "rate.json")) as f:
            return json.load(f) | {"load_before": load_before,
                                   "load_after": load_note()["load_average_1_5_15"]}


def summarize(figures):
    """A row's cell from its runs: updates/s and examples/s (median, min, max), rows per
    update (median), the runs themselves."""
    done = [f for f in figures if "updates_per_second" in f]
    row = {"updates_per_second": spread([f["updates_per_second"] for f in done]),
           "examples_per_second": spread([f["examples_per_second"] for f in done
                                          if f.get("examples_per_second") is not None]),
           "rows_per_update": spread([f["rows_per_update"] for f in done
                                      if f.get("rows_per_update")])["median"],
           "runs": figures}
    sent = [f["bytes_sent_per_step"] for f in done if "bytes_sent_per_step" in f]
    if sent:  # a gossip worker's messages per step (the all-reduce and ps rows: placement)
        row["bytes_sent_per_worker_step"] = statistics.median(sent)
    return row


def main(argv):
    del argv
    m = FLAGS.num_workers
    table = rows(m, FLAGS.peer_python)
    if FLAGS.only:
        table = {name: spec for name, spec in table.items()
                 if name == REFERENCE or name.startswith(LIMIT)
                 or any(part in name for part in FLAGS.only)}
    runs = {name: [] for name in table}
    run_stamp = stamp()
    for repeat in range(FLAGS.repeats):
        for name, (strategy_flags, num_ps, workers) in table.items():
            figures = run_once(strategy_flags, num_ps, workers)
            runs[name].append(figures)
            shown = figures.get("updates_per_second", figures.get("error"))
            print(f"[{repeat + 1}/{FLAGS.repeats}] {name}: {shown}", flush=True)
    results = {"stamp": finish(run_stamp), "num_workers": m,
               "window_seconds": FLAGS.window, "repeats": FLAGS.repeats,
               "rows_per_worker_step": FLAGS.batch_size,
               "job": f"digits MLP 64-64-10 (4,810 parameters), {FLAGS.batch_size} rows per "
                      "worker per step, SGD",
               "network": "local cluster, no bandwidth limit", "reference": REFERENCE,
               "limit": [name for name in table if name.startswith(LIMIT)],
               "peer": [name for name in table if name.startswith(PEER)],
               "rows": {name: summarize(figures) for name, figures in runs.items()}}
    results["bytes_per_ps_task"] = _bytes_per_ps(runs)
    write_json(FLAGS.out + ".json", results)
    print(json.dumps({n: r["updates_per_second"] for n, r in results["rows"].items()},
                     indent=1))


def _bytes_per_ps(runs):
    """What one push of a worker carries to each ps task, as the runs placed the model
    (`strategy.placement()`), per number of ps tasks."""
    out = {}
    for figures in runs.values():
        for figure in figures:
            if figure.get("placement"):
                key = f"{len(figure['placement'])} ps"
                out.setdefault(key, [task["bytes_pushed"] for task in figure["placement"]])
    return dict(sorted(out.items()))


if __name__ == "__main__":
    app.run(main)
