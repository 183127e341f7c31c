"""One command regenerates every benchmark table from the current commit, then the report.

    python benchmarks/run_all.py --size=smoke            # the harness end to end, minutes
    python benchmarks/run_all.py --size=quick --peer_python=PEER/bin/python  # 2.5 hours or so
    python benchmarks/run_all.py --size=full --peer_python=PEER/bin/python   # hours

The quick size makes every comparison the README quotes, at short windows, fewer codecs and
table sizes: a reviewer re-running it checks the full run's conclusions (the verdicts, not
the last digit) in 2.5 hours or so on 2 cores, against the full size's 5.5.

Runs rates, straggler, quality, scaling, compression, network (compression on a switched,
rate-limited network), network_sgp (Stochastic Gradient Push there), embedding (embedding
tables on the ps against table size) and faults (workers killed, stopped and restarted under
a running job), each writing a fresh
JSON into --out_dir (an earlier file of the same name is removed first, so nothing of an
earlier run is kept), each stamped with the commit (and whether the tree was dirty), the
machine, the load before and after and its settings (`machine.stamp`); then `report.py`
writes report.md from them. Measure on quiet cores: every rate follows the load (the JSON
records it, the report shows it).

The full size takes longer than many machines are lent for at a time (about 5.5 hours on 2
cores, the embedding matrix about 2 of them). `--resume` carries on a run that was stopped:
`run_all.json` in --out_dir records the run (an id, its commit, machine, size and peer, each
benchmark's sittings and machine), and a resumed run refuses to go on from another commit, a
dirty tree, size or peer; it skips the benchmarks that finished and reruns the one that
was stopped (a result file two benchmarks share keeps the part of the one that finished),
except the embedding matrix, which carries on from its last finished run
(`embedding.py --resume`: its runs stay interleaved). Each benchmark is measured on one
machine (its ratios compare runs of one machine): a sitting on a machine of another kind
(cores, CPU model, memory) keeps the benchmarks that finished, each naming its machine, and
begins a stopped one again from nothing, the embedding matrix too. A run left unfinished is
not replaced by a new one unless `--new_run` says so. Every benchmark stamps the run's id;
the report's header names the run, its sittings, and every result file in the directory not
of it.

The tasks import tfdist from this tree (its root goes first on PYTHONPATH): a run from a
second checkout (a worktree at the commit to measure) measures that checkout, not the
installed one.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from machine import RUN_VARIABLE
from machine import code_note
from machine import finish
from machine import kind_text
from machine import load_note
from machine import machine_note
from machine import resume_problems
from machine import run_cluster
from machine import same_kind
from machine import spread
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_enum("size", "quick", list(SIZES),
                      "smoke: every benchmark at its smallest settings, minutes (the harness "
                      "works end to end; its figures are not for quoting); quick: every "
                      "comparison the README quotes, at short windows and fewer codecs and "
                      "table sizes (2.5 hours or so on 2 cores: the same conclusions, to check "
                      "them); full: the settings the README quotes (hours).")
    flags.DEFINE_string("out_dir", os.path.join("benchmarks", "results"), "Where results go.")
    flags.DEFINE_string("peer_python", None, "Python of an environment with tensorflow and "
                        "tf_keras, for the ParameterServerStrategy rows of the rates and "
                        "embedding tables (benchmarks/tf_keras_peer.py). None: no peer rows.")
    flags.DEFINE_list("only", [], "Run only these benchmarks (rates, straggler, quality, "
                      "scaling, compression, network, network_n8, network_sgp, embedding, "
                      "faults); the report is written from whatever JSON --out_dir holds, "
                      "flags those of another run and refuses tables whose commits differ.")
    flags.DEFINE_float("run_timeout", 6 * 3600.0, "Seconds each benchmark may take.")
    flags.DEFINE_bool("resume", False, "Carry on the run recorded in --out_dir/run_all.json "
                      "(same commit, clean tree, same size and peer): skip the benchmarks that "
                      "finished, carry the embedding matrix on from its last finished run.")
    flags.DEFINE_bool("new_run", False, "Start a new run over an unfinished one recorded in "
                      "--out_dir (its results of benchmarks this run makes again are "
                      "removed); without it, an unfinished run is refused: --resume it.")


SIZES = ("smoke", "quick", "full")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MANIFEST = "run_all.json"
RESUMABLE = ("embedding",)  # benchmarks that carry on from their own partial JSON

# benchmark -> (script, {size: flags (None: not at that size)}, result file (default: its
# name; a second benchmark of a file adds settings to it, in the same run))
BENCHMARKS = {
    "rates": ("rates.py", {
        "smoke": ["--num_workers=2", "--repeats=3", "--window=2", "--warmup=1",
                  "--only=async, 1 ps, steps_per_execution 10",
                  "--only=tf_keras ParameterServerStrategy, 1 ps, steps_per_execution 10"],
        # 5 repeats: with 3, one slow run of async through 1 ps (365 updates/s where the
        # others gave 503-579) put async against the peer inside the spread, 1.85x, where
        # the full run told them apart, 1.94x; a median of 5 is steadier (3 s windows gave
        # 1.52x "no difference": the full size's 8 s ones are kept)
        "quick": ["--num_workers=4", "--repeats=5", "--window=8", "--warmup=4",
                  "--only=hard sync, 1 ps", "--only=async, 1 ps",
                  "--only=tf_keras ParameterServerStrategy, 1 ps"],
        "full": ["--num_workers=4", "--repeats=5", "--window=8", "--warmup=4"]}),
    "straggler": ("straggler.py", {
        "smoke": ["--num_workers=3", "--window=3", "--only=hard sync",
                  "--scenarios=persistent"],
        # (the full size's 10 s windows: with 4 s ones all-reduce's rate without the
        # straggler came out 1.5 times the full run's, and its ratio 0.26 against 0.46)
        "quick": ["--num_workers=4", "--window=10", "--scenarios=persistent",
                  "--only=hard sync,soft sync,all-reduce"],
        "full": ["--num_workers=4", "--window=10"]}),
    "quality": ("quality.py", {
        "smoke": ["--seeds=1", "--workers=2", "--epochs=2", "--modes=hard sync"],
        "quick": ["--seeds=1", "--workers=4", "--epochs=2"],
        "full": []}),
    "compression": ("compression.py", {
        "smoke": ["--fast", "--compressors=fp16,topk", "--seeds=0", "--epochs=1",
                  "--timing_steps=5"],
        "quick": ["--repeats=8"],
        "full": []}),
    "network": ("network.py", {
        "smoke": ["--compressors=none,topk", "--workers=2", "--bandwidths=100mbit",
                  "--epochs=1", "--timing_steps=10", "--nowithout_error_feedback"],
        "quick": ["--compressors=none,powersgd,dgc,randomk,topk,signsgd,threshold,fp16",
                  "--timing_steps=10", "--nowithout_error_feedback"],
        "full": []}),
    "network_n8": ("network.py", {
        "smoke": None,
        "quick": ["--compressors=none,topk,powersgd,qsgd", "--workers=8", "--bandwidths=1gbit",
                  "--parts=timing", "--timing_steps=10"],
        "full": ["--compressors=none,topk,powersgd,qsgd", "--workers=8", "--bandwidths=1gbit",
                 "--parts=timing"]}, "network"),
    "network_sgp": ("network.py", {
        "smoke": ["--sgp", "--compressors=none", "--workers=2", "--bandwidths=100mbit",
                  "--timing_steps=10", "--parts=timing"],
        "quick": ["--sgp", "--compressors=none", "--workers=4", "--bandwidths=100mbit",
                  "--timing_steps=10", "--parts=timing"],
        "full": ["--sgp", "--compressors=none", "--workers=4", "--bandwidths=100mbit",
                 "--parts=timing"]}),
    "embedding": ("embedding.py", {
        "smoke": ["--quick"],
        "quick": ["--rows=100000,1000000", "--workers=2", "--ps=1,2", "--repeats=3",
                  "--warmup=2", "--window=8", "--quality_examples=12800"],
        "full": []}),
    "faults": ("faults.py", {"smoke": ["--quick"], "quick": ["--quick"], "full": []}),
}
PEER_BENCHMARKS = ("rates", "embedding")  # those given --peer_python
SCALING = {"smoke": ([1, 2], 2.0), "quick": ([1, 2, 4], 3.0), "full": ([1, 2, 4, 8], 10.0)}
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


class Manifest:
    """`run_all.json`: one run of this script (its id, commit, machine, size and peer, each
    benchmark's sittings), over however many sittings it takes."""

    def __init__(self, path, record):
        self.path = path
        self.record = record

    @classmethod
    def new(cls, path, code, size, peer):
        return cls(path, {"run": f"{_now()}-{os.getpid()}", **code, "size": size,
                          "peer": peer, "sittings": [], "benchmarks": {}})

    @staticmethod
    def read(path):
        """The record at `path`, or None."""
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    @classmethod
    def resumed(cls, path, code, size, peer):
        """The manifest at `path`, checked to be a run this invocation may carry on."""
        record = cls.read(path)
        if record is None:
            raise app.UsageError(f"--resume: no run to resume: {path} does not exist (run "
                                 f"without --resume to start one)")
        problems = resume_problems(record, code, {k: record.get(k) for k in ("size", "peer")},
                                   {"size": size, "peer": peer}, same_machine=False)
        if problems:
            raise app.UsageError(f"--resume: {path} records a run this invocation cannot "
                                 f"carry on: {'; '.join(problems)}. A run is measured from one "
                                 f"clean commit with one size and peer: carry it on from "
                                 f"there, or start a new run (--new_run).")
        return cls(path, record)

    def start(self, name, machine):
        """`name` begins a sitting on `machine` (a `machine_note`): one of another kind than
        its last sitting's begins it again (`plan`), the record says so."""
        entry = self.record["benchmarks"].setdefault(name, {"sittings": 0})
        if entry["sittings"] and moved(self.record, name, machine):
            then = kind_text(benchmark_machine(self.record, name))
            entry.update(sittings=0, begun_again=f"stopped after {entry['sittings']} "
                         f"sitting(s) on {then}, begun again from nothing on this machine")
        entry["sittings"] += 1
        entry["started"] = _now()
        entry["machine"] = machine
        entry.pop("failed", None)
        self._write()

    def end(self, name, seconds, failed=None):
        entry = self.record["benchmarks"][name]
        entry["ended"] = _now()
        if failed:
            entry["failed"] = failed
        else:
            entry["finished"] = True
            entry["seconds_last_sitting"] = round(seconds, 1)
        self._write()

    def sitting(self):
        self.record["sittings"].append({"started": _now(), "machine": machine_note(),
                                        "load_before": load_note()["load_average_1_5_15"]})
        self._write()

    def _write(self):
        write_json(self.path, self.record)


def unfinished(record):
    """The benchmarks a run recorded as started and not finished (stopped, or failed)."""
    return [name for name, entry in record["benchmarks"].items() if not entry.get("finished")]


def benchmark_machine(record, name):
    """The machine benchmark `name` of the run `record` last sat on (a record written before
    benchmarks named theirs: the run's)."""
    return record["benchmarks"].get(name, {}).get("machine") or record.get("machine")


def moved(record, name, machine):
    """Whether benchmark `name`, started in the run `record`, last sat on a machine of
    another kind than `machine` (None: not known, taken as the same)."""
    return (name in record["benchmarks"] and machine is not None
            and not same_kind(benchmark_machine(record, name), machine))


def plan(chosen, size, record, machine=None):
    """What a sitting of the run `record` on `machine` runs, in order: `(name, script,
    result file, fresh, carry_on)` for each benchmark of `chosen` that the run has not
    finished. `fresh`: its file is removed first, unless a benchmark of the run that writes
    the same file has started (`network` and `network_n8` both write network.json: each
    keeps the other's part); `carry_on`: it carries on from its own partial result
    (`RESUMABLE`, started in an earlier sitting on a machine of this kind: one stopped on
    another kind begins again from nothing). `script` None: the scaling runs, made here."""
    started = record["benchmarks"]
    files = {name: (entry[2] if len(entry) > 2 else name)
             for name, entry in BENCHMARKS.items()}
    files["scaling"] = "scaling"
    steps, freshened = [], set()
    for name, (script, sizes, *_) in [*BENCHMARKS.items(), ("scaling", (None, {}))]:
        if (name not in chosen or (script is not None and sizes[size] is None)
                or started.get(name, {}).get("finished")):
            continue
        file = files[name]
        again = moved(record, name, machine)
        others = {files[other] for other in started
                  if other in files and (other != name or not again)}
        fresh = file not in others and file not in freshened
        freshened.add(file)
        steps.append((name, script, file, fresh,
                      name in RESUMABLE and name in started and not again))
    return steps


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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


def _import_from_this_tree():
    """Every task this run starts, and this process (the scaling runs' clusters), imports
    tfdist from this tree, not an installed copy (nor none: a worktree need not be
    installed)."""
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + path if path else "")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def main(argv):
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    _import_from_this_tree()
    chosen = FLAGS.only or [*BENCHMARKS, "scaling"]
    unknown = sorted(set(chosen) - set(BENCHMARKS) - {"scaling"})
    if unknown:
        raise app.UsageError(f"--only must name benchmarks among "
                             f"{', '.join([*BENCHMARKS, 'scaling'])}. Received: {unknown}")
    code, peer = {**code_note(), "machine": machine_note()}, bool(FLAGS.peer_python)
    path = _path(MANIFEST)
    if FLAGS.resume:
        manifest = Manifest.resumed(path, code, FLAGS.size, peer)
    else:
        earlier = Manifest.read(path)
        if earlier is not None and unfinished(earlier) and not FLAGS.new_run:
            raise app.UsageError(
                f"{path} records an unfinished run (at commit {earlier.get('commit')}; not "
                f"finished: {', '.join(unfinished(earlier))}): carry it on with --resume, or "
                f"start a new run over it with --new_run")
        manifest = Manifest.new(path, code, FLAGS.size, peer)
    # Every benchmark started stamps the run it belongs to (the report flags others).
    os.environ[RUN_VARIABLE] = manifest.record["run"]
    steps = plan(chosen, FLAGS.size, manifest.record, code["machine"])
    if steps:
        manifest.sitting()
    failed = []
    for name, script, file, fresh, carry_on in steps:
        if fresh:
            _fresh(file)
        start = time.monotonic()
        manifest.start(name, code["machine"])
        try:
            if script is None:
                write_json(_path("scaling.json"), measure_scaling(*SCALING[FLAGS.size]))
            else:
                extra = ([f"--peer_python={FLAGS.peer_python}"]
                         if name in PEER_BENCHMARKS and FLAGS.peer_python else [])
                if carry_on and os.path.exists(_path(file + ".json")):
                    extra.append("--resume")
                _run(script, f"--out={_path(file)}", *BENCHMARKS[name][1][FLAGS.size], *extra)
            manifest.end(name, time.monotonic() - start)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError) as e:
            failed.append(f"{name} ({e})")  # the others still run; no JSON: no section
            manifest.end(name, time.monotonic() - start, failed=str(e))
    _run("report.py", f"--out_dir={FLAGS.out_dir}")
    if failed:
        print("run_all: FAILED: " + "; ".join(failed), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
