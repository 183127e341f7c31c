"""One command regenerates every benchmark table from the current commit, then the report.

    python benchmarks/run_all.py --size=quick            # every benchmark, smallest settings
    python benchmarks/run_all.py --size=full --peer_python=PEER/bin/python   # hours

Runs rates, straggler, quality, scaling, compression, network (compression on a switched,
rate-limited network), network_sgp (Stochastic Gradient Push there), embedding (embedding
tables on the ps against table size, `--quick` at the quick size) and faults (workers killed,
stopped and restarted under a running job, `--quick` at the quick size), each writing a fresh
JSON into --out_dir (an earlier file of the same name is removed first, so nothing of an
earlier run is kept), each stamped with the commit (and whether the tree was dirty), the
machine, the load before and after and its settings (`machine.stamp`); then `report.py`
writes report.md from them. Measure on quiet cores: every rate follows the load (the JSON
records it, the report shows it).
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from machine import finish
from machine import run_cluster
from machine import spread
from machine import stamp

FLAGS = flags.FLAGS
flags.DEFINE_enum("size", "quick", ["quick", "full"],
                  "quick: every benchmark at its smallest settings (a check that the harness "
                  "works end to end; its figures are not for quoting); full: the settings the "
                  "README quotes.")
flags.DEFINE_string("out_dir", os.path.join("benchmarks", "results"), "Where results go.")
flags.DEFINE_string("peer_python", None, "Python of an environment with tensorflow and "
                    "tf_keras, for the ParameterServerStrategy rows of the rates and "
                    "embedding tables (benchmarks/tf_keras_peer.py). None: no peer rows.")
flags.DEFINE_list("only", [], "Run only these benchmarks (rates, straggler, quality, scaling, "
                  "compression, network, network_sgp, embedding, faults); the report is written "
                  "from whatever JSON --out_dir holds, and refuses tables whose commits "
                  "differ.")
flags.DEFINE_float("run_timeout", 4 * 3600.0, "Seconds each benchmark may take.")

HERE = os.path.dirname(os.path.abspath(__file__))

# benchmark -> (script, {size: flags (None: not at that size)}, result file (default: its
# name; a second benchmark of a file adds settings to it, in the same run))
BENCHMARKS = {
    "rates": ("rates.py", {
        "quick": ["--num_workers=2", "--repeats=3", "--window=2", "--warmup=1",
                  "--only=async, 1 ps, steps_per_execution 10",
                  "--only=tf_keras ParameterServerStrategy, 1 ps, steps_per_execution 10"],
        "full": ["--num_workers=4", "--repeats=3", "--window=8", "--warmup=4"]}),
    "straggler": ("straggler.py", {
        "quick": ["--num_workers=3", "--window=3", "--only=hard sync",
                  "--scenarios=persistent"],
        "full": ["--num_workers=4", "--window=10"]}),
    "quality": ("quality.py", {
        "quick": ["--seeds=1", "--workers=2", "--epochs=2", "--modes=hard sync"],
        "full": []}),
    "compression": ("compression.py", {
        "quick": ["--fast", "--compressors=fp16,topk", "--seeds=0", "--epochs=1",
                  "--timing_steps=5"],
        "full": []}),
    "network": ("network.py", {
        "quick": ["--compressors=none,topk", "--workers=2", "--bandwidths=100mbit",
                  "--epochs=1", "--timing_steps=10", "--nowithout_error_feedback"],
        "full": []}),
    "network_n8": ("network.py", {
        "quick": None,
        "full": ["--compressors=none,topk,powersgd,qsgd", "--workers=8", "--bandwidths=1gbit",
                 "--parts=timing"]}, "network"),
    "network_sgp": ("network.py", {
        "quick": ["--sgp", "--compressors=none", "--workers=2", "--bandwidths=100mbit",
                  "--timing_steps=10", "--parts=timing"],
        "full": ["--sgp", "--compressors=none", "--workers=4", "--bandwidths=100mbit",
                 "--parts=timing"]}),
    "embedding": ("embedding.py", {"quick": ["--quick"], "full": []}),
    "faults": ("faults.py", {"quick": ["--quick"], "full": []}),
}
PEER_BENCHMARKS = ("rates", "embedding")  # those given --peer_python
SCALING = {"quick": ([1, 2], 2.0), "full": ([1, 2, 4, 8], 10.0)}
LIMIT_MODE = "one process, no strategy (limit)"


def _path(name):
    return os.path.join(FLAGS.out_dir, name)


def _fresh(name):
    """Removes an earlier result of `name` (its JSON and PNG): nothing of it is kept."""
    for extension in (".json", ".png"):
        if os.path.exists(_path(name + extension)):
            os.remove(_path(name + extension))


def _run(script, *args):
    command = [sys.executable, os.path.join(HERE, script), *args]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, timeout=FLAGS.run_timeout)


def _ps_rate(strategy_flags, num_ps, num_workers, window):
    """Updates per second of one ps_worker.py run on a local cluster."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, os.path.join(HERE, "ps_worker.py"), f"--out_dir={out}",
                   f"--window={window}", *strategy_flags]
        result, _ = run_cluster(command, 600.0, num_ps=num_ps, num_workers=num_workers)
        if result.returncode:
            raise RuntimeError(f"{' '.join(strategy_flags)} on {num_workers} workers failed: "
                               f"{result.message}")
        with open(os.path.join(out, "rate.json")) as f:
            return json.load(f)["updates_per_second"]


def measure_scaling(worker_counts, window, repeats=3):
    """Hard-sync and async update rates at each worker count (1 ps), and the one-process
    limit at each count's global batch (32 x M rows): the median of `repeats` interleaved
    runs (every run in `runs`)."""
    run_stamp = stamp({"worker_counts": worker_counts, "window": window, "repeats": repeats})
    runs = {mode: {str(m): [] for m in worker_counts}
            for mode in ("hard sync", "async", LIMIT_MODE)}
    for _ in range(repeats):
        for m in worker_counts:
            for mode, strategy_flags, num_ps, workers in (
                    ("hard sync", ["--strategy=soft_sync"], 1, m),
                    ("async", ["--strategy=async"], 1, m),
                    (LIMIT_MODE, ["--no_strategy", f"--batch_size={32 * m}"], 0, 1)):
                rate = _ps_rate(strategy_flags, num_ps, workers, window)
                runs[mode][str(m)].append(rate)
                print(f"scaling: {mode}, {m} workers: {rate:.1f} updates/s", flush=True)
    results = {mode: {m: spread(rates)["median"] for m, rates in by_m.items()}
               for mode, by_m in runs.items()}
    results.update(runs=runs, repeats=repeats, stamp=finish(run_stamp))
    return results


def main(argv):
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    chosen = FLAGS.only or [*BENCHMARKS, "scaling"]
    unknown = sorted(set(chosen) - set(BENCHMARKS) - {"scaling"})
    if unknown:
        raise app.UsageError(f"--only must name benchmarks among "
                             f"{', '.join([*BENCHMARKS, 'scaling'])}. Received: {unknown}")
    failed = []
    written = set()
    for name, (script, sizes, *file) in BENCHMARKS.items():
        if name not in chosen or sizes[FLAGS.size] is None:
            continue
        file = file[0] if file else name
        if file not in written:
            _fresh(file)
            written.add(file)
        extra = ([f"--peer_python={FLAGS.peer_python}"]
                 if name in PEER_BENCHMARKS and FLAGS.peer_python else [])
        try:
            _run(script, f"--out={_path(file)}", *sizes[FLAGS.size], *extra)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            failed.append(f"{name} ({e})")  # the others still run; no JSON: no section
    if "scaling" in chosen:
        _fresh("scaling")
        try:
            scaling = measure_scaling(*SCALING[FLAGS.size])
            with open(_path("scaling.json"), "w") as f:
                json.dump(scaling, f, indent=1)
        except RuntimeError as e:
            failed.append(f"scaling ({e})")
    _run("report.py", f"--out_dir={FLAGS.out_dir}")
    if failed:
        print("run_all: FAILED: " + "; ".join(failed), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)
