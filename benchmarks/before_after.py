"""Update rates of two commits on the same job, interleaved: did a change leave the engines'
speed alone? (Issue 23's rule for a restructure: "the benchmarks' rates stay within noise".)

    python benchmarks/before_after.py --before=REV --after=HEAD --repeats=3 \
        --out=benchmarks/results/restructure/before_after

Each commit is checked out into a temporary git worktree and runs its own
`benchmarks/rates.py` (its own harness, its own tfdist first on the path) once per repeat,
the two commits alternating in ABBA order (before, after, after, before, ...), so both see
the same spells of load; the worktrees are removed at the end, also on failure. Rows are
matched by name; a row only one side has is listed apart. A row's figure is the median of
its repeats with the min and max; two medians whose ranges overlap are "no difference" (the
rule of `report.py`), and only rows whose ranges are apart get a ratio that means
something; each pair's ratio is listed too (a change that is slower in every pair shows it
even inside wide ranges).

`--only` keeps rows whose name contains one of its values (the all-reduce reference and the
one-process limit always run inside `rates.py`); older harnesses read `--only` as a
comma-separated list, so a value with a comma is passed whole and filtered here.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from machine import finish
from machine import spread
from machine import stamp

FLAGS = flags.FLAGS


def define_flags():
    """This script's flags (defined when it runs, not when tests import it)."""
    flags.DEFINE_string("before", None, "The commit measured first in each pair (a git "
                        "revision).")
    flags.DEFINE_string("after", "HEAD", "The commit measured second in each pair.")
    flags.DEFINE_integer("repeats", 3, "Runs of each commit's rates.py (interleaved).",
                         lower_bound=1)
    flags.DEFINE_multi_string("only", [], "Keep only rows whose name contains this "
                              "(repeatable).")
    flags.DEFINE_integer("num_workers", 2, "Workers M (rates.py --num_workers).",
                         lower_bound=1)
    flags.DEFINE_float("timeout", 1800.0, "Seconds one rates.py run may take.", lower_bound=1)
    flags.DEFINE_string("out", os.path.join("benchmarks", "results", "before_after"),
                        "Output path without extension (.json and .md are written).")
    flags.mark_flag_as_required("before")


HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("before", "after")


def _git(*args, cwd=HERE):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve(revision, flag):
    """The full commit hash of `revision`, or a usage error naming `flag`."""
    try:
        return _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    except subprocess.CalledProcessError as error:
        raise app.UsageError(f"--{flag}={revision!r} is not a commit of this repository: "
                             f"{error.stderr.strip()}") from None


def rates_of(result):
    """`{row: updates per second}` of one `rates.py` JSON (a number, or older harnesses' and
    newer harnesses' `{"median": x}` of a one-repeat run)."""
    rows = {}
    for name, row in result["rows"].items():
        value = row.get("updates_per_second")
        rows[name] = value["median"] if isinstance(value, dict) else value
    return rows


def compare(runs, only=()):
    """`{"rows": {name: {side: spread, "verdict": ...}}, "only_one_side": {...}}` of
    `runs` (`{side: [{row: rate}] per repeat}`)."""
    names = {side: set().union(*runs[side]) for side in SIDES}
    kept = [n for n in sorted(names["before"] & names["after"])
            if not only or any(part in n for part in only)]
    table = {}
    for name in kept:
        cells = {side: spread([r.get(name) for r in runs[side]]) for side in SIDES}
        b, a = cells["before"], cells["after"]
        measured = [len([r for r in runs[side] if r.get(name) is not None]) for side in SIDES]
        if None in (b["median"], a["median"]):
            verdict = "not measured on both sides"
        elif min(measured) < 2:
            verdict = f"{a['median'] / b['median']:.2f}x (one run: no spread to judge it by)"
        elif a["min"] > b["max"] or a["max"] < b["min"]:
            verdict = f"{a['median'] / b['median']:.2f}x (ranges apart)"
        else:
            verdict = "no difference (ranges overlap)"
        pairs = [round(after[name] / before[name], 3)
                 for before, after in zip(runs["before"], runs["after"])
                 if before.get(name) and after.get(name) is not None]
        table[name] = {**cells, "ratio": (a["median"] / b["median"]
                                          if b["median"] and a["median"] else None),
                       "pair_ratios": pairs, "verdict": verdict}
    apart = {side: sorted(n for n in names[side] - names[other]
                          if not only or any(part in n for part in only))
             for side, other in (("before", "after"), ("after", "before"))}
    return {"rows": table, "only_one_side": apart}


def markdown(result):
    s = result["stamp"]["settings"]
    lines = [f"# Rates before and after: `{s['before'][:12]}` -> `{s['after'][:12]}`", "",
             f"Each commit's own `benchmarks/rates.py`, {s['repeats']} interleaved run(s) each, "
             f"{s['num_workers']} workers, measured at `{result['stamp']['commit'][:12]}`'s "
             f"harness driver; load average before {result['stamp']['load_before']}, after "
             f"{result['stamp']['load_after']}. Updates per second: median (min-max).", "",
             "| row | before | after | after / before | each pair's after / before |",
             "|---|---|---|---|---|"]
    if result["stamp"].get("driver"):
        lines[4:4] = [f"Run by {result['stamp']['driver']}.", ""]
    for name, row in result["rows"].items():
        cell = [("-" if row[side]["median"] is None else
                 f"{row[side]['median']:.1f} ({row[side]['min']:.1f}-{row[side]['max']:.1f})")
                for side in SIDES]
        pairs = ", ".join(f"{r:.2f}" for r in row.get("pair_ratios", [])) or "-"
        lines.append(f"| {name} | {cell[0]} | {cell[1]} | {row['verdict']} | {pairs} |")
    for side, names in result["only_one_side"].items():
        if names:
            lines.append(f"\nRows only {side}: " + ", ".join(names) + ".")
    return "\n".join(lines) + "\n"


def only_flags(worktree, only):
    """`rates.py`'s `--only` flags for the harness at `worktree`: one per value where it is
    repeatable; where it is a comma-separated list (older harnesses, where a repeated flag
    keeps only its last value) one flag of every value joined, a value with a comma then
    matching more rows than asked, which `compare` filters out."""
    if not only:
        return []
    with open(os.path.join(worktree, "benchmarks", "rates.py")) as f:
        listed = 'DEFINE_list("only"' in f.read()
    return [f"--only={','.join(only)}"] if listed else [f"--only={part}" for part in only]


def run_rates(worktree, out, log):
    """One `rates.py --repeats=1` of the commit checked out at `worktree`."""
    command = [sys.executable, os.path.join("benchmarks", "rates.py"), "--repeats=1",
               f"--num_workers={FLAGS.num_workers}", f"--out={out}"]
    command += only_flags(worktree, FLAGS.only)
    env = {**os.environ, "PYTHONPATH": worktree}
    try:
        done = subprocess.run(command, cwd=worktree, env=env, stdout=log, stderr=log,
                              timeout=FLAGS.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {FLAGS.timeout:g} s"
    if done.returncode or not os.path.exists(out + ".json"):
        return None, f"exit {done.returncode} (log: {log.name})"
    with open(out + ".json") as f:
        return rates_of(json.load(f)), None


def main(argv):
    del argv
    commits = {"before": resolve(FLAGS.before, "before"), "after": resolve(FLAGS.after, "after")}
    settings = {**commits, "repeats": FLAGS.repeats, "num_workers": FLAGS.num_workers,
                "only": FLAGS.only}
    run_stamp = stamp(settings)
    runs = {side: [] for side in SIDES}
    errors = []
    with tempfile.TemporaryDirectory(prefix="tfdist-before-after-") as tmp:
        trees = {}
        try:
            for side in SIDES:
                trees[side] = os.path.join(tmp, side)
                _git("worktree", "add", "--detach", trees[side], commits[side])
            for repeat in range(FLAGS.repeats):
                # ABBA: each commit goes first as often as the other (a load that drifts
                # over a pair favours neither).
                for side in (SIDES if repeat % 2 == 0 else SIDES[::-1]):
                    out = os.path.join(tmp, f"{side}_{repeat}")
                    with open(out + ".log", "w") as log:
                        rows, error = run_rates(trees[side], out, log)
                    if error:
                        errors.append(f"{side} run {repeat + 1}: {error}")
                        print(f"[{repeat + 1}/{FLAGS.repeats}] {side}: {error}", flush=True)
                        with open(out + ".log") as f:
                            print(f.read()[-2000:], flush=True)
                        continue
                    runs[side].append(rows)
                    print(f"[{repeat + 1}/{FLAGS.repeats}] {side} {commits[side][:12]}: " +
                          ", ".join(f"{n}: {v:.1f}" for n, v in rows.items() if v), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=HERE,
                               capture_output=True)
    if not all(runs.values()):
        raise SystemExit("A side has no successful run: " + "; ".join(errors))
    result = {"stamp": finish(run_stamp), **compare(runs, FLAGS.only), "runs": runs,
              "errors": errors}
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(FLAGS.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    define_flags()
    app.run(main)
