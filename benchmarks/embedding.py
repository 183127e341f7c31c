"""Parameter servers on the workload they exist for: a recommendation job with large embedding
tables (issue 21), against tf_keras `fit` under TF's `ParameterServerStrategy` and one process.

    python benchmarks/embedding.py --peer_python=<peer env>/bin/python    # full, hours
    python benchmarks/embedding.py --quick --peer_python=...               # a few minutes

The job (`embedding_job.py`): 8 Zipf-distributed ids per example in three tables (V, V / 10
and 1,000 rows, 16 wide), a dense tower (concat, Dense 64, Dense 1 sigmoid), Adagrad, batch
`--batch_size` per worker, labels that depend on the ids. Cells, for every V of `--rows`:

* tfdist `AsyncStrategy` and `SoftSyncStrategy` (hard sync) at each of `--workers` workers and
  `--ps` ps tasks (`embedding_worker.py` on a `LocalCluster`), with the strategy argument
  `embedding_tables=--embedding_tables` where the strategy takes it (tfdist after issue 21;
  before, every worker mirrors every table: the only behaviour there is);
* tf_keras 2.21 `fit` under TF's `ParameterServerStrategy`, same workers and ps, in the
  peer's own environment (`--peer_python`, see `tf_keras_peer.py`; `embedding_peer.py`);
* one process, Keras 3 `fit` with no strategy; and, for accuracy only, one process at hard
  sync's global batch (`workers` x `--batch_size`: after the same examples, hard sync has
  taken `workers` times fewer updates than one process at `--batch_size`).

Every run first trains `--quality_examples` examples in all and evaluates (loss, accuracy on
20,000 held-out examples: the same for every cell of a V), then measures over `--window` s
after `--warmup` s: updates per second (one update of the ps variables: a push for async and
the peer, `workers` pushes for hard sync), examples per second (pushes x batch), and the
bytes a worker step costs the network: the cluster runs in a private network namespace whose
loopback carries only its traffic, and the transmit counter's change over the window divided
by the pushes in it is the bytes of one worker step, both ways, TCP/IP headers included
(measured, not from tfdist's logs: without compression they carry no byte counts). Where no
private namespace can be made, the bytes are not measured (null) and only the documented
estimates below stand. Each process's peak resident memory is VmHWM of /proc/<pid>/status,
polled by this launcher (tfdist, one process) or read by the peer's coordinator before it
stops its servers; a run is stopped, and recorded as failed, when the machine's available
memory falls under `--min_available_memory_gib` (tables mirrored on every worker grow each
worker with V). The load average is recorded before and after each run, and where the
cores' time went over each window (machine-wide, `machine.cpu_counters`: busy, idle, time
stolen by the hypervisor, context switches, delayed TCP acknowledgements in the run's
network namespace) is kept with each run as `cores` and printed beside its rate. Runs are repeated
`--repeats` times, interleaved (every cell once, then again), and each figure is kept as
median, min and max.

Writes `--out`.json, stamped with the commit (and whether the tree was dirty), the machine,
the load and the settings; `report.py` draws its table and plot.
"""

import ctypes
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import embedding_job as job
from absl import app
from absl import flags
from machine import apply_quick
from machine import available_memory_bytes
from machine import finish
from machine import interleaved
from machine import load_note
from machine import loopback_counters
from machine import peak_resident_bytes
from machine import resume_problems
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["100000", "1000000", "10000000"], "V: rows of the large table.")
flags.DEFINE_list("workers", ["2", "4"], "Worker counts of the distributed cells.")
flags.DEFINE_list("ps", ["1", "2"], "Ps task counts of the distributed cells.")
flags.DEFINE_list("systems", ["async", "hard_sync", "peer", "one_process",
                               "one_process_global"],
                  "Which systems run: async, hard_sync, peer (needs --peer_python), "
                  "one_process, one_process_global (accuracy only, first repeat only: one "
                  "process at hard sync's global batch, `workers` x --batch_size, for each "
                  "of --workers).")
flags.DEFINE_integer("repeats", 3, "Runs of each cell, interleaved.", lower_bound=1)
flags.DEFINE_float("warmup", 5.0, "Seconds of training before each window.", lower_bound=0)
flags.DEFINE_float("window", 20.0, "Seconds of each measurement window.", lower_bound=1)
flags.DEFINE_integer("quality_examples", 51200, "Examples trained (all workers) before the "
                     "evaluation of each run.", lower_bound=256)
flags.DEFINE_integer("batch_size", 256, "Batch per worker step.", lower_bound=1)
flags.DEFINE_integer("steps_per_execution", 10, "Keras `steps_per_execution` of every "
                     "system.", lower_bound=1)
flags.DEFINE_enum("embedding_tables", "auto", ["auto", "none"], "tfdist strategy argument "
                  "`embedding_tables` where the strategy takes it: auto (tables on the ps "
                  "only) or none (every worker mirrors them).")
flags.DEFINE_float("timeout", 1800.0, "Seconds each run may take.", lower_bound=1)
flags.DEFINE_string("peer_python", None, "Python of an environment with tensorflow and "
                    "tf_keras 2.21 (see tf_keras_peer.py); None: no peer cells.")
flags.DEFINE_float("min_available_memory_gib", 2.0, "A run is stopped (and recorded as "
                   "failed) when the machine's available memory falls under this.",
                   lower_bound=0)
flags.DEFINE_bool("quick", False, "Quick size: V 100k and 1M, 2 workers, 1 ps, 1 repeat, "
                  "short windows (a few minutes; not for quoting).")
flags.DEFINE_bool("resume", False, "Carry on the run in --out.json (measured at this commit, "
                  "a clean tree, the same settings): the runs it holds are kept and the "
                  "rest made in the same interleaved order.")
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "embedding"),
                    "Output path without extension.")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = {"async": "tfdist async", "hard_sync": "tfdist hard sync",
           "peer": "tf_keras ParameterServerStrategy", "one_process": "one process (Keras 3)",
           "one_process_global": "one process at the global batch (Keras 3)"}
TRAIN_EXAMPLES = 262144
POLL_SECONDS = 0.5


class PeakMemory:
    """Polls the peak resident memory (VmHWM) of named processes while a run goes on, and
    stops the run (`stop()`) when the machine's available memory falls under
    `--min_available_memory_gib`: the machine is shared, and a cell that would exhaust it
    (tables mirrored on every worker at large V) is recorded as failed instead."""

    def __init__(self, pids, stop):
        self._pids, self._stop_run, self.peaks = pids, stop, {}
        self.low_memory = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        floor = FLAGS.min_available_memory_gib * 2**30
        while True:
            for name, pid in self._pids().items():
                peak = peak_resident_bytes(pid)
                if peak is not None:
                    self.peaks[name] = max(peak, self.peaks.get(name, 0))
            available = available_memory_bytes()
            if available < floor and self.low_memory is None:
                self.low_memory = (f"stopped: the machine's available memory fell to "
                                   f"{available / 2**30:.1f} GiB (under "
                                   f"--min_available_memory_gib="
                                   f"{FLAGS.min_available_memory_gib:g})")
                self._stop_run()
            if self._stop.wait(POLL_SECONDS):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()


def _kill_group(pid):
    """Kills process `pid`, the leader of its own process group, and every process of the
    group (a LocalCluster task, the peer and its servers)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _common_flags(rows):
    return [f"--rows={rows}", f"--quality_examples={FLAGS.quality_examples}",
            f"--train_examples={TRAIN_EXAMPLES}", f"--batch_size={FLAGS.batch_size}",
            f"--steps_per_execution={FLAGS.steps_per_execution}", f"--warmup={FLAGS.warmup}",
            f"--window={FLAGS.window}"]


def _read(out_dir, name):
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_tfdist(system, rows, workers, num_ps):
    """One run of `embedding_worker.py`: on a `LocalCluster`, or alone for one process."""
    from tfdist.launch import LocalCluster

    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "embedding_worker.py"),
                   f"--out_dir={out_dir}", *_common_flags(rows)]
        if system in ("one_process", "one_process_global"):
            command.append("--one_process")
            if system == "one_process_global":
                # Hard sync's update: the mean over `workers` batches; accuracy only.
                command += [f"--batch_size={FLAGS.batch_size * workers}", "--quality_only"]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
            with PeakMemory(lambda: {"worker:0": process.pid}, process.kill) as memory:
                try:
                    _, stderr = process.communicate(timeout=FLAGS.timeout)
                    error = f"exit {process.returncode}: {stderr[-400:]}" \
                        if process.returncode else None
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()
                    error = f"timed out after {FLAGS.timeout:g} s"
        else:
            command += [f"--strategy={'async' if system == 'async' else 'soft_sync'}",
                        f"--embedding_tables={FLAGS.embedding_tables}"]
            with LocalCluster(command, num_ps=num_ps, num_workers=workers,
                              timeout=FLAGS.timeout, output=None) as cluster:
                workers_of = [f"worker:{i}" for i in range(workers)]
                # (killing the workers ends `wait()`, which tears the cluster down)
                with PeakMemory(lambda: {name: cluster.pid(name)
                                         for name in cluster.task_names},
                                lambda: [_kill_group(cluster.pid(name))
                                         for name in workers_of]) as memory:
                    result = cluster.wait()
            error = None
            if result.returncode:
                tail = " | ".join(line for _, line in cluster.lines[-5:])
                error = f"{result.message}: {tail}"[:600]
        error = memory.low_memory or error
        rate, quality = _read(out_dir, "rate.json"), _read(out_dir, "quality.json")
    if rate:
        rate["pushes_per_second"] = (rate["aggregated_gradients"]
                                     + rate["dropped_gradients"])
    return {"rate": rate, "quality": quality, "peak_resident_bytes": memory.peaks,
            "error": error if error or not rate else None}


def _peer_start(network):
    """For `preexec_fn`: the peer's coordinator dies with this launcher (its servers die with
    it), in the run's private network where there is one."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if network is not None:
        network.enter_in_child()


def run_peer(rows, workers, num_ps):
    """One run of `embedding_peer.py` in the peer's environment, in a private network (its
    loopback counter is then the run's own traffic)."""
    from tfdist.launch.isolation import private_network

    network = private_network()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            out = os.path.join(out_dir, "peer.json")
            command = [FLAGS.peer_python, os.path.join(HERE, "embedding_peer.py"),
                       f"--out={out}", f"--num_workers={workers}", f"--num_ps={num_ps}",
                       f"--timeout={FLAGS.timeout}", *_common_flags(rows)]
            # A session of its own: the peer's servers are killed with it, however it ends.
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True, env=env,
                                       start_new_session=True,
                                       preexec_fn=functools.partial(_peer_start, network))
            with PeakMemory(dict, lambda: _kill_group(process.pid)) as memory:
                try:
                    _, stderr = process.communicate(timeout=FLAGS.timeout + 30)
                except subprocess.TimeoutExpired:
                    _kill_group(process.pid)
                    process.communicate()
                    return {"error": f"timed out after {FLAGS.timeout + 30:g} s"}
            if memory.low_memory or process.returncode or not os.path.exists(out):
                return {"error": memory.low_memory
                        or f"exit {process.returncode}: {stderr[-400:]}"}
            with open(out) as f:
                return json.load(f) | {"error": None}
    finally:
        if network is not None:
            network.close()


def derive(figures):
    """The per-run figures of the tables from what a run wrote."""
    rate, quality = figures.get("rate") or {}, figures.get("quality") or {}
    peaks = figures.get("peak_resident_bytes") or {}
    workers = [v for k, v in sorted(peaks.items()) if k.startswith("worker")]
    ps = [v for k, v in sorted(peaks.items()) if k.startswith("ps")]
    out = {"updates_per_second": rate.get("updates_per_second"),
           "examples_per_second": None, "bytes_per_worker_step": None,
           "worker_peak_bytes": max(workers) if workers else None,
           "worker_peak_bytes_each": workers, "ps_peak_bytes": max(ps) if ps else None,
           "ps_peak_bytes_each": ps,
           "loss": quality.get("loss"), "accuracy": quality.get("accuracy"),
           "quality_examples": quality.get("examples")}
    # Where the cores' time went over the window (`machine.cpu_counters`), machine-wide.
    out["cores"] = {name: rate.get(f"{key}_per_second") for name, key in (
        ("user", "cpu_user_seconds"), ("system", "cpu_system_seconds"),
        ("idle", "cpu_idle_seconds"), ("steal", "cpu_steal_seconds"),
        ("context_switches", "context_switches"), ("tcp_delayed_acks", "tcp_delayed_acks"))}
    if out["cores"]["user"] is not None:
        out["cores"]["busy"] = out["cores"]["user"] + out["cores"]["system"]
    pushes = rate.get("pushes_per_second")
    if pushes:
        out["examples_per_second"] = pushes * FLAGS.batch_size
        private = quality.get("network_namespace") not in (
            None, loopback_counters()["network_namespace"])
        if private and "loopback_tx_bytes_per_second" in rate:
            out["bytes_per_worker_step"] = rate["loopback_tx_bytes_per_second"] / pushes
    return out


def estimates(rows):
    """Documented estimates of one worker step's bytes (both ways, payload only): rows-only
    (each distinct row a batch touches read once, its gradient and int64 id pushed once, the
    dense part both ways: what tfdist's step moves with the tables on the ps, `tfdist_moves`,
    since a lookup sends each distinct id once, besides those ids); every id (each id the
    batch looks up, repeated ones included, sent as the model feeds it (int32) and its row
    back, its gradient row and int64 id pushed, the dense part both ways: what tfdist's step
    moved before that); and the whole model both ways (a worker that mirrors every table and
    exchanges its whole shard, as tfdist before issue 21)."""
    unique = job.unique_rows_per_batch(rows, FLAGS.batch_size)
    dense = job.parameters(rows) - job.EMBEDDING_DIM * sum(job.table_rows(rows).values())
    row_bytes = 4 * job.EMBEDDING_DIM
    rows_only = sum(unique.values()) * (2 * row_bytes + 8) + 2 * 4 * dense
    ids = FLAGS.batch_size * job.NUM_COLUMNS
    return {"unique_rows_per_batch": unique, "parameters": job.parameters(rows),
            "rows_only_bytes_per_worker_step": rows_only,
            "every_id_bytes_per_worker_step": ids * (4 + 8 + 2 * row_bytes) + 2 * 4 * dense,
            "whole_model_bytes_per_worker_step": 2 * 4 * job.parameters(rows),
            "tfdist_moves": "rows_only"}


def summarize(runs):
    """Median, min and max of each figure over the runs that gave it."""
    keys = ("updates_per_second", "examples_per_second", "bytes_per_worker_step",
            "worker_peak_bytes", "ps_peak_bytes", "loss", "accuracy")
    out = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values)}
    return out


def _cells():
    cells = []
    for system in FLAGS.systems:
        if system not in SYSTEMS:
            raise app.UsageError(f"--systems must be among {sorted(SYSTEMS)}. Received: "
                                 f"{system!r}")
        if system == "peer" and not FLAGS.peer_python:
            continue
        if system == "one_process":
            cells.append((system, 1, 0))
            continue
        if system == "one_process_global":
            cells += [(system, int(m), 0) for m in FLAGS.workers]
            continue
        cells += [(system, int(m), int(s)) for m in FLAGS.workers for s in FLAGS.ps]
    return cells


QUICK = {"rows": ["100000", "1000000"], "workers": ["2"], "ps": ["1"], "repeats": 1,
         "warmup": 2.0, "window": 6.0, "quality_examples": 12800}


def main(argv):
    del argv
    if FLAGS.quick:
        apply_quick(QUICK)
    rows_list, cells = [int(v) for v in FLAGS.rows], _cells()
    settings = ({name: FLAGS[name].value for name in
                 ("rows", "workers", "ps", "systems", "repeats", "warmup", "window",
                  "quality_examples", "batch_size", "steps_per_execution", "embedding_tables",
                  "quick")}
                | {"peer": bool(FLAGS.peer_python), "train_examples": TRAIN_EXAMPLES,
                   "job": job.DESCRIPTION})
    # The commit, machine and load (machine.stamp), as every benchmark's JSON carries them.
    results = {"stamp": stamp(settings), "settings": settings,
               "estimates": {str(rows): estimates(rows) for rows in rows_list}, "cells": []}
    runs = {(cell, rows): [] for rows in rows_list for cell in cells}
    if FLAGS.resume:
        results = resumed(results, runs)
    order = [(cell, rows) for rows in rows_list for cell in cells]
    # (seeded, one process at the global batch: its accuracy is the same every run)
    for repeat, ((system, workers, num_ps), rows) in interleaved(
            order, FLAGS.repeats, {key: len(made) for key, made in runs.items()},
            once=lambda key: key[0][0] == "one_process_global"):
        before, start = load_note()["load_average_1_5_15"], time.monotonic()
        if system == "peer":
            figures = run_peer(rows, workers, num_ps)
        else:
            figures = run_tfdist(system, rows, workers, num_ps)
        run = {**derive(figures), "error": figures.get("error"),
               "load_before": before, "load_after": load_note()["load_average_1_5_15"],
               "seconds": time.monotonic() - start, "ended": time.time(), "raw": figures}
        runs[((system, workers, num_ps), rows)].append(run)
        rate = run["updates_per_second"]
        cores = run["cores"]
        shown = run["error"] or ((f"{rate:.1f} updates/s, " if rate else "")
                                 + f"accuracy {run['accuracy']}"
                                 + (f" (cores busy {cores['busy']:.2f}, steal "
                                    f"{cores['steal']:.2f}, delayed acks "
                                    f"{cores.get('tcp_delayed_acks') or 0:.0f}/s)"
                                    if cores.get("busy") is not None else ""))
        print(f"[{repeat + 1}/{FLAGS.repeats}] V={rows:,} {SYSTEMS[system]}, "
              f"{workers} workers, {num_ps} ps: {shown}", flush=True)
        # After every run: a run stopped later keeps what was measured so far
        # (`settings["complete"]` says whether every run was made).
        _write(results, runs, complete=False)
    _write(results, runs, complete=True)
    print(f"wrote {FLAGS.out}.json", flush=True)


def resumed(results, runs):
    """`results` carried on from --out.json: its stamp (the load at its start, each sitting's
    start added) and its runs put into `runs`, once the file is found to be a run of this
    commit, from a clean tree, with these settings."""
    path = FLAGS.out + ".json"
    if not os.path.exists(path):
        raise app.UsageError(f"--resume: {path} does not exist: nothing to carry on (run "
                             f"without --resume)")
    with open(path) as f:
        earlier = json.load(f)
    now, then = results["stamp"], earlier.get("stamp", {})
    problems = resume_problems(then, now, earlier.get("settings"), results["settings"])
    if problems:
        raise app.UsageError(f"--resume: {path} cannot be carried on: {'; '.join(problems)}")
    for cell in earlier["cells"]:
        key = ((cell["system"], cell["workers"], cell["ps"]), cell["rows"])
        if key in runs:
            runs[key].extend(cell["runs"])
    # The last run made: where it failed, the end of the sitting may have killed its tasks
    # before this launcher: it is made again.
    last = max(((run["ended"], key) for key, made in runs.items() for run in made
                if "ended" in run), default=None)
    if last is not None and runs[last[1]][-1].get("error"):
        print(f"resuming: the last run made ({last[1]}) failed and is made again: "
              f"{runs[last[1]][-1]['error']}", flush=True)
        runs[last[1]].pop()
    sittings = then.get("sittings", [{"load_before": then.get("load_before"),
                                      "machine": then.get("machine")}])
    stamp_now = dict(then, sittings=[*sittings, {"load_before": now["load_before"],
                                                 "machine": now.get("machine")}])
    made = sum(len(r) for r in runs.values())
    print(f"resuming {path}: {made} runs kept, sitting {len(stamp_now['sittings'])}",
          flush=True)
    return dict(results, stamp=stamp_now)


def _write(results, runs, complete):
    """Writes `--out`.json: the cells measured so far (a cell with no run yet is left
    out)."""
    out = dict(results, settings=dict(results["settings"], complete=complete), cells=[])
    for ((system, workers, num_ps), rows), cell_runs in runs.items():
        if cell_runs:
            out["cells"].append({"system": system, "label": SYSTEMS[system],
                                 "workers": workers, "ps": num_ps, "rows": rows,
                                 **summarize(cell_runs), "runs": cell_runs})
    out["stamp"] = finish(dict(results["stamp"]))
    write_json(FLAGS.out + ".json", out)


if __name__ == "__main__":
    app.run(main)
