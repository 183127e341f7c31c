"""Update rate under a straggler: hard sync, soft sync (N of M), async, all-reduce and SGP.

    python benchmarks/straggler.py --num_workers=4 --out=benchmarks/results/straggler

For each mode the same local cluster (1 ps, M workers; no ps for all-reduce, tfdist's
`MultiWorkerMirroredStrategy` on TF's collectives, nor for Stochastic Gradient Push) runs on
digits once with every worker at full speed, then once per straggler scenario
(`--scenarios`):

  persistent   the last worker is `--slowdown` times slower at every step (it sleeps
               (slowdown - 1) x its own measured step time after each step);
  transient    the last worker stalls once every `--stall_every` steps, for
               `--stall_steps` x its measured step time (shorter than SGP's max_delay=8
               steps' worth: a delay bound may absorb it, a barrier pays every one);
  rotating     every worker stalls so, in turn (evenly spaced in the period): a barrier pays
               M stalls per period, each worker only its own.

The figure of merit is the ratio of the chief's update rate (global steps per second) with and
without the straggler, both measured in this run; for the stall scenarios, beside it, the
ratio if every stall were paid in full by everyone (`ratio_if_paid`: K t / (K t + n d), K the
period, t the step time without straggler, n the stalls per period, d a stall).

Every mode runs `--repeats` times, interleaved (every mode once, then again), each repeat
with its own baseline; a cell keeps the median and the min-max of its repeats. The limit,
one process (plain Keras `fit`, no strategy) on the global batch of a synchronous update (32
x M rows), runs as often. Writes `<out>.json` and `<out>.png`, stamped (`machine.stamp`).
"""

import json
import os
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
flags.DEFINE_integer("num_workers", 4, "Workers M.", lower_bound=2)
flags.DEFINE_float("slowdown", 4.0, "How many times slower the straggler is.", lower_bound=1)
flags.DEFINE_float("window", 10.0, "Seconds of each measurement window.", lower_bound=1)
flags.DEFINE_float("timeout", 240.0, "Seconds each run may take.")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "straggler"),
                    "Output path without extension.")
flags.DEFINE_list("only", [], "Run only the modes whose name contains one of these.")
flags.DEFINE_integer("repeats", 3, "Runs of every mode (interleaved).", lower_bound=1)
SCENARIOS = ("persistent", "transient", "rotating")
flags.DEFINE_multi_enum("scenarios", list(SCENARIOS), SCENARIOS, "Straggler scenarios.")
flags.DEFINE_integer("stall_every", 20, "Steps between a worker's stalls (transient, rotating).",
                     lower_bound=2)
flags.DEFINE_float("stall_steps", 4.0, "A stall's length, in the stalling worker's step times.",
                   lower_bound=0)

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(strategy_flags, num_ps, straggler_delay=0.0, stall_ranks=(), stall_seconds=0.0,
         num_workers=None):
    num_workers = num_workers or FLAGS.num_workers
    straggler = FLAGS.num_workers - 1 if straggler_delay else -1
    stall = ([f"--stall_ranks={','.join(str(r) for r in stall_ranks)}",
              f"--stall_every={FLAGS.stall_every}", f"--stall_seconds={stall_seconds}"]
             if stall_ranks else [])
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "ps_worker.py"), f"--out_dir={out_dir}",
                   f"--window={FLAGS.window}", f"--straggler_rank={straggler}",
                   f"--straggler_delay={straggler_delay}", *stall, *strategy_flags]
        result, lines = run_cluster(command, FLAGS.timeout, num_ps=num_ps,
                                    num_workers=num_workers)
        if result.returncode:
            lines = [line.strip() for _, line in lines]
            starts = [i for i, line in enumerate(lines) if line.split(":")[0].endswith("Error")]
            error = " ".join(lines[starts[-1]:starts[-1] + 3]) if starts else result.message
            return {"error": error[:400]}
        with open(os.path.join(out_dir, "rate.json")) as f:
            figures = json.load(f)
        with open(os.path.join(out_dir, f"worker{num_workers - 1}.json")) as f:
            # The median: a start-up stall (SGP's first wait for its peers' couriers) is not
            # the worker's pace.
            last = json.load(f)
        figures["last_worker_step_seconds"] = last["median_step_seconds"]
        figures["last_worker_stalls"] = last["stalls"]
        figures["load_after"] = load_note()["load_average_1_5_15"]
        return figures


def _mode(name, strategy_flags, num_ps):
    print(f"{name}: without straggler ...", flush=True)
    base = _run(strategy_flags, num_ps)
    if "error" in base:
        print(f"{name}: does not run: {base['error']}", flush=True)
        return {"error": base["error"]}
    result = {"baseline": base}
    step = base["last_worker_step_seconds"]
    if "persistent" in FLAGS.scenarios:
        delay = (FLAGS.slowdown - 1) * step
        print(f"{name}: with one worker slowed {FLAGS.slowdown:g}x (+{delay * 1000:.1f} "
              "ms/step) ...", flush=True)
        slow = _run(strategy_flags, num_ps, straggler_delay=delay)
        if "error" in slow:
            result["error"] = slow["error"]
        else:
            ratio = slow["updates_per_second"] / base["updates_per_second"]
            print(f"{name}: {base['updates_per_second']:.1f} -> "
                  f"{slow['updates_per_second']:.1f} updates/s, ratio {ratio:.2f}", flush=True)
            result.update(straggler=slow, straggler_delay_seconds=delay, rate_ratio=ratio)
    m, every = FLAGS.num_workers, FLAGS.stall_every
    stall = FLAGS.stall_steps * step
    for scenario, ranks in (("transient", [m - 1]), ("rotating", list(range(m)))):
        if scenario not in FLAGS.scenarios:
            continue
        print(f"{name}: {scenario}, worker(s) {ranks} stalling {stall * 1000:.0f} ms every "
              f"{every} steps ...", flush=True)
        run = _run(strategy_flags, num_ps, stall_ranks=ranks, stall_seconds=stall)
        if "error" in run:
            result[scenario] = {"error": run["error"]}
            continue
        ratio = run["updates_per_second"] / base["updates_per_second"]
        base_step = 1.0 / base["updates_per_second"]
        paid = every * base_step / (every * base_step + len(ranks) * stall)
        print(f"{name}: {scenario}: ratio {ratio:.2f} (every stall paid in full: {paid:.2f})",
              flush=True)
        result[scenario] = {"run": run, "stall_ranks": ranks, "stall_seconds": stall,
                            "rate_ratio": ratio, "ratio_if_paid": paid}
    return result


def _combine(repeats):
    """A mode's cells from its repeats (each a `_mode` result): updates/s and the ratios,
    median and min-max over the repeats that ran."""
    ran = [r for r in repeats if "updates_per_second" in r.get("baseline", {})]
    if not ran:
        return {"error": repeats[0].get("error", "no run"), "repeats": repeats}
    cells = {"repeats": repeats, "baseline": {
        "updates_per_second": spread([r["baseline"]["updates_per_second"] for r in ran]),
        "examples_per_second": spread([r["baseline"].get("examples_per_second")
                                       for r in ran]),
        "rows_per_update": spread([r["baseline"].get("rows_per_update") for r in ran])["median"]}}
    for scenario in FLAGS.scenarios:
        pairs = [(r, r if scenario == "persistent" else r.get(scenario, {})) for r in ran]
        done = [(r, d) for r, d in pairs if "rate_ratio" in d]
        if not done:
            errors = [d.get("error") or r.get("error") for r, d in pairs]
            cells[scenario] = {"error": next((e for e in errors if e), "no run")}
            continue
        runs = [r["straggler"] if scenario == "persistent" else d["run"] for r, d in done]
        cells[scenario] = {
            "updates_per_second": spread([run["updates_per_second"] for run in runs]),
            "rate_ratio": spread([d["rate_ratio"] for _, d in done])}
        if scenario != "persistent":
            cells[scenario]["ratio_if_paid"] = spread(
                [d["ratio_if_paid"] for _, d in done])["median"]
    return cells


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
    run_stamp = stamp()
    repeats = {name: [] for name in modes}
    limit = []
    for repeat in range(FLAGS.repeats):
        print(f"repeat {repeat + 1} of {FLAGS.repeats}", flush=True)
        limit.append(_run(["--no_strategy", f"--batch_size={32 * m}"], 0, num_workers=1))
        for name, spec in modes.items():
            repeats[name].append(_mode(name, *spec))
    results = {"num_workers": m, "repeats": FLAGS.repeats, "slowdown": FLAGS.slowdown,
               "window_seconds": FLAGS.window,
               "scenarios": FLAGS.scenarios, "stall_every": FLAGS.stall_every,
               "stall_steps": FLAGS.stall_steps,
               "job": "digits MLP 64-64-10 (4,810 parameters), 32 rows per worker per step "
                      "(MultiWorkerMirrored: a global batch of 32 x M), SGD",
               "network": "local cluster, no bandwidth limit",
               "limit": {"name": "one process, Keras fit, no strategy",
                         "rows_per_update": 32 * m, "runs": limit,
                         "examples_per_second": spread([r.get("examples_per_second")
                                                        for r in limit])},
               "modes": {name: _combine(runs) for name, runs in repeats.items()}}
    results["stamp"] = finish(run_stamp)
    write_json(FLAGS.out + ".json", results)
    _plot(results, FLAGS.out + ".png")
    print(json.dumps({name: {scenario: r.get(scenario, {}).get("rate_ratio")
                             for scenario in FLAGS.scenarios}
                      for name, r in results["modes"].items()}, indent=1))


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    names = [n for n, r in modes.items() if "baseline" in r]
    labels = {"persistent": f"one worker {results['slowdown']:g}x slower",
              "transient": f"one worker stalls every {results.get('stall_every')} steps",
              "rotating": "each worker stalls in turn"}
    scenarios = results.get("scenarios", ["persistent"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(scenarios)
    xs = range(len(names))
    for i, scenario in enumerate(scenarios):
        ratios = [modes[n].get(scenario, {}).get("rate_ratio", {}).get("median") or 0.0
                  for n in names]
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], ratios, width,
               label=labels[scenario])
    ax.set_xticks(list(xs), [n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_ylabel("rate with / without straggler")
    ax.set_title(f"Update rate under stragglers, {results['num_workers']} workers "
                 "(digits MLP, localhost)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    app.run(main)
