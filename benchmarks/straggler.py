"""Update rate under a straggler: hard sync, soft sync (N of M), async, all-reduce and SGP.

    python benchmarks/straggler.py --num_workers=4 --out=benchmarks/results/straggler

For each mode the same local cluster (1 ps, M workers; no ps for all-reduce, tfdist's
`MultiWorkerMirroredStrategy` on TF's collectives, nor for Stochastic Gradient Push) runs
twice on digits: once with every worker at full speed, once with the last worker slowed
down `--slowdown` times (it sleeps (slowdown - 1) x its own measured step time after each
step). The figure of merit is the
ratio of the chief's update rate (global steps per second) with and without the straggler,
both measured in this run. Writes `<out>.json` and `<out>.png`.
"""

import json
import os
import sys
import tempfile

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 4, "Workers M.", lower_bound=2)
flags.DEFINE_float("slowdown", 4.0, "How many times slower the straggler is.", lower_bound=1)
flags.DEFINE_float("window", 10.0, "Seconds of each measurement window.", lower_bound=1)
flags.DEFINE_float("timeout", 240.0, "Seconds each run may take.")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "straggler"),
                    "Output path without extension.")
flags.DEFINE_list("only", [], "Run only the modes whose name contains one of these.")

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(strategy_flags, num_ps, straggler_delay=0.0):
    from tfdist.launch import LocalCluster

    straggler = FLAGS.num_workers - 1 if straggler_delay else -1
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "ps_worker.py"), f"--out_dir={out_dir}",
                   f"--window={FLAGS.window}", f"--straggler_rank={straggler}",
                   f"--straggler_delay={straggler_delay}", *strategy_flags]
        with LocalCluster(command, num_ps=num_ps, num_workers=FLAGS.num_workers,
                          timeout=FLAGS.timeout, output=None) as cluster:
            result = cluster.wait()
        if result.returncode:
            lines = [line.strip() for _, line in cluster.lines]
            starts = [i for i, line in enumerate(lines) if line.split(":")[0].endswith("Error")]
            error = " ".join(lines[starts[-1]:starts[-1] + 3]) if starts else result.message
            return {"error": error[:400]}
        with open(os.path.join(out_dir, "rate.json")) as f:
            figures = json.load(f)
        with open(os.path.join(out_dir, f"worker{FLAGS.num_workers - 1}.json")) as f:
            # The median: a start-up stall (SGP's first wait for its peers' couriers) is not
            # the worker's pace.
            figures["last_worker_step_seconds"] = json.load(f)["median_step_seconds"]
        return figures


def _mode(name, strategy_flags, num_ps):
    print(f"{name}: without straggler ...", flush=True)
    base = _run(strategy_flags, num_ps)
    if "error" in base:
        print(f"{name}: does not run: {base['error']}", flush=True)
        return {"error": base["error"]}
    delay = (FLAGS.slowdown - 1) * base["last_worker_step_seconds"]
    print(f"{name}: with one worker slowed {FLAGS.slowdown:g}x (+{delay * 1000:.1f} ms/step) ...",
          flush=True)
    slow = _run(strategy_flags, num_ps, straggler_delay=delay)
    if "error" in slow:
        return {"baseline": base, "error": slow["error"]}
    ratio = slow["updates_per_second"] / base["updates_per_second"]
    print(f"{name}: {base['updates_per_second']:.1f} -> {slow['updates_per_second']:.1f} "
          f"updates/s, ratio {ratio:.2f}", flush=True)
    return {"baseline": base, "straggler": slow, "straggler_delay_seconds": delay,
            "rate_ratio": ratio}


def main(argv):
    del argv
    m = FLAGS.num_workers
    modes = {
        f"hard sync ({m} of {m})": (["--strategy=soft_sync"], 1),
        f"soft sync ({m - 1} of {m})": (["--strategy=soft_sync",
                                         f"--strategy_arg=replicas_to_aggregate={m - 1}"], 1),
        "async (inverse)": (["--strategy=async", "--strategy_arg=staleness='inverse'"], 1),
        "all-reduce (MultiWorkerMirrored)": (["--strategy=multi_worker_mirrored"], 0),
        "SGP (overlap, max_delay 1)": (["--strategy=sgp"], 0),
        "SGP (overlap, max_delay 8)": (["--strategy=sgp", "--strategy_arg=max_delay=8"], 0),
    }
    if FLAGS.only:
        modes = {name: spec for name, spec in modes.items()
                 if any(part in name for part in FLAGS.only)}
    results = {"num_workers": m, "slowdown": FLAGS.slowdown, "window_seconds": FLAGS.window,
               "modes": {name: _mode(name, *spec) for name, spec in modes.items()}}
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, FLAGS.out + ".png")
    print(json.dumps({name: r.get("rate_ratio", r.get("error")) for name, r in
                      results["modes"].items()}, indent=1))


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results["modes"].items() if "rate_ratio" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    base = [results["modes"][n]["baseline"]["updates_per_second"] for n in names]
    slow = [results["modes"][n]["straggler"]["updates_per_second"] for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="no straggler")
    ax.bar([x + 0.2 for x in xs], slow, 0.4,
           label=f"one worker {results['slowdown']:g}x slower")
    for x, n in zip(xs, names):
        ax.annotate(f"x{results['modes'][n]['rate_ratio']:.2f}", (x + 0.2, slow[x]),
                    ha="center", va="bottom")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("updates / s (chief)")
    ax.set_title(f"Update rate, 1 ps + {results['num_workers']} workers (digits MLP)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    app.run(main)
