"""Update rates of every strategy on one job, in one run: one process, MWMS, the PS family,
and the peer a user would go back to, tf_keras `fit` under TF's `ParameterServerStrategy`.

    python benchmarks/rates.py --num_workers=2 --out=benchmarks/results/rates \
        --peer_python=peer/bin/python     # the peer's own environment, see tf_keras_peer.py

Job: the digits MLP of `ps_worker.py` (64-64-10, 4.8 k parameters, batch 32 per worker, SGD),
on this machine's local clusters (localhost, no bandwidth limit). Each row runs its own
cluster and measures, on the chief, global updates per second over `--window` seconds after a
warm-up; rows are run `--repeats` times, interleaved, and the median is kept. Ratios are
against tfdist's `MultiWorkerMirroredStrategy` measured in the same run (one step per call,
and `fit`'s `batch_size=32`, which under all-reduce is the global batch: 32 / M rows per
worker, as in the earlier runs), and the async rows also against the peer at the same
`steps_per_execution` (its async training: every step an update). The two "all-reduce,
batch 32 per worker" rows do the ps rows' work per step (a global batch of 32 M), at
`steps_per_execution` 1 and 10. Bytes per ps task are what one push of a worker carries to
each task (the reply carries as much back), as the runs placed the model
(`strategy.placement()`: variables split by rows over the ps tasks with the default
`variable_partitioner="auto"`).
"""

import json
import os
import statistics
import sys
import tempfile

from absl import app
from absl import flags
from machine import load_note

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Workers M.", lower_bound=1)
flags.DEFINE_float("window", 8.0, "Seconds of each measurement window.", lower_bound=1)
flags.DEFINE_float("warmup", 4.0, "Seconds before each window.", lower_bound=0)
flags.DEFINE_integer("repeats", 2, "Runs of each row (interleaved); the median is kept.",
                     lower_bound=1)
flags.DEFINE_float("timeout", 180.0, "Seconds each run may take.")
flags.DEFINE_list("only", [], "Run only the rows whose name contains one of these (and the "
                  "all-reduce reference).")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "rates"),
                    "Output path without extension.")
flags.DEFINE_string("peer_python", None,
                    "Python of an environment with tensorflow and tf_keras: adds the rows of "
                    "TF's ParameterServerStrategy (tf_keras_peer.py). None: no peer rows.")

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "multi_worker_mirrored"


PEER = "tf_keras ParameterServerStrategy, 1 ps"
ALL_REDUCE = "all-reduce, batch 32 per worker"
SPE10 = ["--steps_per_execution=10"]


def rows(m, peer):
    table = {
        "one process (one_device)": (["--strategy=one_device"], 0, 1),
        REFERENCE: (["--strategy=multi_worker_mirrored"], 0, m),
        ALL_REDUCE: (["--strategy=multi_worker_mirrored", f"--batch_size={32 * m}"], 0, m),
        f"{ALL_REDUCE}, steps_per_execution 10": (
            ["--strategy=multi_worker_mirrored", f"--batch_size={32 * m}", *SPE10], 0, m),
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
                   f"--warmup={FLAGS.warmup}", f"--timeout={FLAGS.timeout}", *peer_flags]
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
    from tfdist.launch import LocalCluster

    if num_ps is None:
        return run_peer(strategy_flags, num_workers)
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "ps_worker.py"), f"--out_dir={out_dir}",
                   f"--window={FLAGS.window}", f"--warmup={FLAGS.warmup}", *strategy_flags]
        with LocalCluster(command, num_ps=num_ps, num_workers=num_workers,
                          timeout=FLAGS.timeout, output=None) as cluster:
            result = cluster.wait()
        if result.returncode:
            tail = " | ".join(line for _, line in cluster.lines[-5:])
            return {"error": f"{result.message}: {tail}"[:500]}
        with open(os.path.join(out_dir, "rate.json")) as f:
            return json.load(f) | {"load_after": load_note()["load_average_1_5_15"]}


def main(argv):
    del argv
    m = FLAGS.num_workers
    table = rows(m, FLAGS.peer_python)
    if FLAGS.only:
        table = {name: spec for name, spec in table.items()
                 if name == REFERENCE or any(part in name for part in FLAGS.only)}
    runs = {name: [] for name in table}
    load_before = load_note()
    for repeat in range(FLAGS.repeats):
        for name, (strategy_flags, num_ps, workers) in table.items():
            figures = run_once(strategy_flags, num_ps, workers)
            runs[name].append(figures)
            shown = figures.get("updates_per_second", figures.get("error"))
            print(f"[{repeat + 1}/{FLAGS.repeats}] {name}: {shown}", flush=True)
    results = {"num_workers": m, "window_seconds": FLAGS.window, "repeats": FLAGS.repeats,
               "job": "digits MLP 64-64-10 (4,810 parameters), batch 32 per worker, SGD",
               "network": "localhost, no limit", "load_before": load_before,
               "load_after": load_note(), "rows": {}}
    for name, figures in runs.items():
        rates = [f["updates_per_second"] for f in figures if "updates_per_second" in f]
        row = {"updates_per_second": statistics.median(rates) if rates else None,
               "runs": figures}
        sent = [f["bytes_sent_per_step"] for f in figures if "bytes_sent_per_step" in f]
        if sent:  # a gossip worker's messages per step (the all-reduce and ps rows: placement)
            row["bytes_sent_per_worker_step"] = statistics.median(sent)
        results["rows"][name] = row
    reference = results["rows"][REFERENCE]["updates_per_second"]
    for name, row in results["rows"].items():
        if row["updates_per_second"] and reference:
            row["ratio_to_mwms"] = row["updates_per_second"] / reference
        peer = results["rows"].get(PEER + name.partition(", 1 ps")[2])
        if name.startswith("async, 1 ps") and peer and peer["updates_per_second"]:
            row["ratio_to_tf_keras_pss"] = row["updates_per_second"] / peer["updates_per_second"]
    results["bytes_per_ps_task"] = _bytes_per_ps(runs)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({n: {k: v for k, v in r.items() if k.startswith("ratio")}
                      for n, r in results["rows"].items()}, indent=1))


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
