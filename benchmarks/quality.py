"""Digits accuracy of every parameter-server mode against single-process training.

    python benchmarks/quality.py                       # 3 seeds, 4 and 8 workers, 20 epochs
    python benchmarks/quality.py --seeds=1 --workers=4 --epochs=5   # a quick look
    python benchmarks/quality.py --update --modes="averaging k=16 outer"   # one mode again

Every mode trains `examples/train_digits.py` for the same number of epochs on a local cluster
(1 ps + M workers, no ps for SGP; each worker a 1/M share of the data; learning rate scaled
by the gradients each update averages, by M for SGP). The chief records the test accuracy
after every epoch and the wall time since training began. Writes `<out>.json` (per run and
mean / std over seeds) and `<out>.png` (accuracy against epoch and against seconds).
"outer" rows average with DiLoCo's outer step on the ps (SGD with Nesterov momentum,
--outer_learning_rate, --outer_momentum): 16x fewer exchanges than k=1.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from absl import app
from absl import flags
from machine import finish
from machine import record_parts
from machine import run_cluster
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("seeds", 3, "Seeds per mode.", lower_bound=1)
flags.DEFINE_list("workers", ["4", "8"], "Worker counts M.")
flags.DEFINE_integer("epochs", 20, "Epochs of every run.", lower_bound=1)
flags.DEFINE_float("dc_lambda", 0.04, "lambda of delay-compensated ASGD.")
flags.DEFINE_float("outer_learning_rate", 0.7, "Learning rate of the outer optimizer.")
flags.DEFINE_float("outer_momentum", 0.9, "Nesterov momentum of the outer optimizer.")
flags.DEFINE_list("modes", None, "Only these modes (default: all).")
flags.DEFINE_float("timeout", 900.0, "Seconds each run may take.")
flags.DEFINE_bool("update", False, "Keep the results already in <out>.json (single process "
                  "included) and run only --modes, replacing theirs.")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "quality"),
                    "Output path without extension.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")


def modes():
    return {
        "hard sync": ["--strategy=soft_sync"],
        "async none": ["--strategy=async", "--strategy_arg=staleness='none'"],
        "async inverse": ["--strategy=async", "--strategy_arg=staleness='inverse'"],
        # DC-ASGD as Zheng et al. run it: the plain learning rate, the gradient compensated.
        "async delay_compensated": [
            "--strategy=async", f"--strategy_arg=delay_compensation={FLAGS.dc_lambda}"],
        "averaging k=1": ["--strategy=model_averaging", "--strategy_arg=period=1"],
        "averaging k=4": ["--strategy=model_averaging", "--strategy_arg=period=4"],
        "averaging k=16": ["--strategy=model_averaging", "--strategy_arg=period=16"],
        "averaging k=16 outer": ["--strategy=model_averaging", "--strategy_arg=period=16",
                                 f"--strategy_arg=outer_optimizer={json.dumps(outer())}"],
        # No ps: each worker gossips with one peer a step; `join` averages the models.
        "sgp": ["--strategy=sgp"],
        # Synchronous SGP: every step takes what was sent to it at that step, so on the
        # exponential graph each worker receives what it sends and w stays 1.
        "sgp synchronous": ["--strategy=sgp", "--strategy_arg=overlap=False"],
    }


def outer():
    """The outer optimizer of the "outer" modes (DiLoCo's: SGD with Nesterov momentum)."""
    return {"class_name": "SGD", "config": {"learning_rate": FLAGS.outer_learning_rate,
                                            "momentum": FLAGS.outer_momentum,
                                            "nesterov": True}}


def _run(flags_, seed, num_workers=None):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        command = [sys.executable, EXAMPLE, f"--output_json={path}", f"--seed={seed}",
                   f"--epochs={FLAGS.epochs}", "--eval_every_epoch", "--verbose=0", *flags_]
        if num_workers is None:
            subprocess.run(command, check=True, capture_output=True, timeout=FLAGS.timeout)
        else:
            num_ps = 0 if "--strategy=sgp" in flags_ else 1
            result, lines = run_cluster(command, FLAGS.timeout, num_ps=num_ps,
                                        num_workers=num_workers)
            if result.returncode:
                tail = "\n".join(line for _, line in lines[-20:])
                raise RuntimeError(f"{flags_} on {num_workers} workers failed: "
                                   f"{result.message}\n{tail}")
        with open(path) as f:
            return json.load(f)


def _summary(runs):
    accuracy = [r["test_accuracy"] for r in runs]
    seconds = [r["train_seconds"] for r in runs]
    return {"test_accuracy_mean": float(np.mean(accuracy)),
            "test_accuracy_std": float(np.std(accuracy)),
            "train_seconds_mean": float(np.mean(seconds)), "runs": runs}


def main(argv):
    del argv
    seeds = list(range(FLAGS.seeds))
    run_stamp = stamp()
    if FLAGS.update and os.path.exists(FLAGS.out + ".json"):
        with open(FLAGS.out + ".json") as f:
            results = json.load(f)
        if results["epochs"] != FLAGS.epochs or results["seeds"] != seeds:
            raise app.UsageError(f"--update needs the epochs and seeds of {FLAGS.out}.json: "
                                 f"{results['epochs']} epochs, seeds {results['seeds']}")
        results["dc_lambda"] = FLAGS.dc_lambda
        single = results["single process"]
    else:
        results = {"epochs": FLAGS.epochs, "seeds": seeds, "dc_lambda": FLAGS.dc_lambda}
        print("single process ...", flush=True)
        single = _summary([_run(["--strategy=one_device"], s) for s in seeds])
        results["single process"] = single
    results["outer_optimizer"] = outer()
    print(f"single process: {single['test_accuracy_mean']:.4f}", flush=True)
    chosen = {k: v for k, v in modes().items() if not FLAGS.modes or k in FLAGS.modes}
    if FLAGS.update:
        # Their seconds come from another run than the other rows': the report says so.
        results["updated_modes"] = sorted(set(results.get("updated_modes", [])) | set(chosen))
    else:
        results.pop("updated_modes", None)
    for m in (int(w) for w in FLAGS.workers):
        results.setdefault(f"{m} workers", {})
        for name, mode_flags in chosen.items():
            summary = _summary([_run(mode_flags, s, num_workers=m) for s in seeds])
            summary["vs_single_points"] = 100 * (summary["test_accuracy_mean"]
                                                 - single["test_accuracy_mean"])
            results[f"{m} workers"][name] = summary
            print(f"{m} workers, {name}: {summary['test_accuracy_mean']:.4f} "
                  f"({summary['vs_single_points']:+.2f} points), "
                  f"{summary['train_seconds_mean']:.1f} s", flush=True)
    measured = [f"{m} workers/{name}" for m in FLAGS.workers for name in chosen]
    every = [f"{group}/{name}" for group in results if group.endswith(" workers")
             for name in results[group]]
    record_parts(results, run_stamp, measured + ([] if FLAGS.update else ["single process"]),
                 kept=[p for p in every if p not in measured]
                 + (["single process"] if FLAGS.update else []))
    results["stamp"] = finish(run_stamp)
    write_json(FLAGS.out + ".json", results)
    plot(results, FLAGS.out + ".png")


def _curve(runs, key):
    xs = np.mean([[p[key] for p in r["curve"]] for r in runs], axis=0)
    ys = np.mean([[p["test_accuracy"] for p in r["curve"]] for r in runs], axis=0)
    return xs, ys


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [k for k in results if k.endswith("workers")]
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 4 * len(groups)), squeeze=False)
    for row, group in zip(axes, groups):
        for name, summary in [("single process", results["single process"]),
                              *results[group].items()]:
            style = "k--" if name == "single process" else "-"
            for ax, key in zip(row, ("epoch", "seconds")):
                xs, ys = _curve(summary["runs"], key)
                ax.plot(xs, ys, style, label=f"{name} ({summary['test_accuracy_mean']:.3f})")
        for ax, key in zip(row, ("epoch", "seconds")):
            ax.set_xlabel(key)
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0.8, 1.0)
            ax.set_title(f"digits, {group}, mean of {len(results['seeds'])} seeds")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    app.run(main)
