"""Faults on a running job: does it end, how long after the fault, at what accuracy, and was
any update lost or applied twice?

    python benchmarks/faults.py --out=benchmarks/results/faults            # full: ~30 runs
    python benchmarks/faults.py --quick --out=benchmarks/results/faults    # a few minutes

A 4-worker job (`benchmarks/faults_worker.py`: digits, each worker its own block of the
training rows, `BackupAndRestore` in a directory of its own) runs under soft sync 3 of 4 and
async (1 ps, `stall_timeout=--stall_timeout`) and under Stochastic Gradient Push (no ps),
once without a fault and once per scenario (`--scenarios`): when the faulted worker (the
chief, worker 0, or the last worker) prints `EPOCH --fault_epoch`, the harness

  kill           SIGKILLs it (not restarted);
  restart        SIGKILLs it and starts it again `--restart_delay` s later, with the same
                 TF_CONFIG (`LocalCluster.restart`), as a scheduler would;
  pause          stops it with SIGSTOP and continues it with SIGCONT `--pause` s later (a
                 hung machine that recovers; below the stall_timeout);
  hang           stops it with SIGSTOP for good (its port still accepts connections).

The job has ended when every worker that is not stopped for good has exited (then the stopped
one is killed); it is given `--end_timeout` s after the fault, plus what the fault-free run
took (on loaded cores a slow job is not a hung one). A scenario reports: whether
the job ended, in how many seconds after the fault, each worker's exit code and a failed
worker's last error line, the held-out accuracy of the chief's model after `join()` (or the
first surviving worker's) against the fault-free run's, and the update count: every step of
a worker pushes once, and each process writes its completed steps to disk after every step,
so the pushes sent (summed over the processes, killed ones included) are set against the ps
tasks' count of pushes applied (`aggregated_gradients`) and dropped as stale
(`dropped_gradients`), read by the last worker to finish (`strategy.progress()`). A process
killed or stopped for good may have had one push on its way: "ok" is sent <= applied +
dropped <= sent + those processes. Under SGP the count is the messages (sent against taken,
summed over the workers) and the push-sum mass after the final average (`final_weight_sum`,
M when no share was lost or taken twice).

Writes `<out>.json`, stamped (`machine.stamp`); `report.py` makes its table.
"""

import glob
import json
import os
import signal
import sys
import tempfile
import time

from absl import app
from absl import flags
from machine import apply_quick
from machine import finish
from machine import stamp
from machine import write_json

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.path.join("benchmarks", "results", "faults"),
                    "Output path without extension.")
flags.DEFINE_bool("quick", False, "Quick size: a few scenarios, short epochs, tasks forked "
                  "from a preloaded server (a check of the harness in a few minutes; its "
                  "figures are not for quoting).")
flags.DEFINE_integer("num_workers", 4, "Workers M.", lower_bound=3)
flags.DEFINE_integer("epochs", 9, "Epochs of each worker.", lower_bound=2)
flags.DEFINE_integer("repeat", 8, "Copies of its shard in a worker's epoch.", lower_bound=1)
flags.DEFINE_integer("fault_epoch", 3, "The fault comes when the faulted worker has trained "
                     "this many epochs.", lower_bound=1)
flags.DEFINE_float("stall_timeout", 10.0, "Every strategy's stall_timeout (seconds).")
flags.DEFINE_float("pause", 5.0, "Seconds a paused worker stays stopped.")
flags.DEFINE_float("restart_delay", 2.0, "Seconds between a kill and the restart.")
flags.DEFINE_float("end_timeout", 120.0, "Seconds the job gets to end after the fault.")
flags.DEFINE_float("start_timeout", 300.0, "Seconds the job gets to reach the fault.")
flags.DEFINE_list("strategies", [], "Run only the strategies whose name contains one of these.")
flags.DEFINE_list("scenarios", [], "Run only these scenarios (names as in SCENARIOS).")
flags.DEFINE_bool("preload", False, "Fork the tasks from a server that imported TensorFlow "
                  "once (`LocalCluster(preload=True)`): faster starts, restarts included.")

HERE = os.path.dirname(os.path.abspath(__file__))
DESCRIPTION = ("digits MLP 64-64-10 (4,810 parameters), SGD 0.05, batch 32 per worker step, "
               "each worker its own block of the 1,500 training rows; accuracy on the 297 "
               "held-out rows")

# scenario -> (the faulted worker: "chief" or "worker", the action); None: no fault.
SCENARIOS = {
    "no fault": None,
    "kill a worker": ("worker", "kill"),
    "kill the chief": ("chief", "kill"),
    "restart a worker": ("worker", "restart"),
    "restart the chief": ("chief", "restart"),
    "pause a worker": ("worker", "pause"),
    "pause the chief": ("chief", "pause"),
    "hang a worker": ("worker", "hang"),
    "hang the chief": ("chief", "hang"),
}
QUICK = {"epochs": 3, "repeat": 2, "fault_epoch": 1, "stall_timeout": 6.0, "pause": 3.0,
         "end_timeout": 60.0, "preload": True}
QUICK_SCENARIOS = {"soft sync": ["restart a worker", "restart the chief", "pause the chief",
                                 "hang a worker"],
                   "async": ["kill the chief"], "SGP": ["pause a worker", "hang a worker"]}


def strategies():
    """`{name: (strategy flags, ps tasks)}`."""
    m, stall = FLAGS.num_workers, f"--strategy_arg=stall_timeout={FLAGS.stall_timeout:g}"
    return {
        f"soft sync ({m - 1} of {m})": (["--strategy=soft_sync",
                                         f"--strategy_arg=replicas_to_aggregate={m - 1}", stall],
                                        1),
        "async": (["--strategy=async", stall], 1),
        "SGP": (["--strategy=sgp", stall], 0),
    }


def _last_error(lines, task):
    """The last line of `task` that names an error (a traceback's last line, tfdist's: an
    in-graph assert's message quotes it)."""
    found = [text.strip() for name, text in lines if name == task
             and ("Error" in text or "tfdist:" in text)]
    return found[-1][:300] if found else None


def _wait_for_line(cluster, task, text, deadline):
    while (task, text) not in cluster.lines:
        if time.monotonic() > deadline or cluster.returncode(task) is not None:
            return False
        time.sleep(0.05)
    return True


def _inject(cluster, task, action):
    """The fault; returns the tasks now stopped for good."""
    pid = cluster.pid(task)
    if action in ("kill", "restart"):
        os.kill(pid, signal.SIGKILL)
        if action == "restart":
            time.sleep(FLAGS.restart_delay)
            cluster.restart(task)
    elif action == "pause":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(FLAGS.pause)
        os.kill(pid, signal.SIGCONT)
    elif action == "hang":
        os.kill(pid, signal.SIGSTOP)
        return {task}
    return set()


def run_scenario(strategy_flags, num_ps, scenario, usual_seconds=0.0):
    """One job with `scenario`'s fault: the figures of its run (see the module's doc). The
    job gets `--end_timeout` + `usual_seconds` (the fault-free job's time) after the
    fault to end."""
    from tfdist.launch import LocalCluster

    m = FLAGS.num_workers
    workers = [f"worker:{r}" for r in range(m)]
    fault = SCENARIOS[scenario]
    target = None if fault is None else ("worker:0" if fault[0] == "chief" else workers[-1])
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, os.path.join(HERE, "faults_worker.py"),
                   f"--out_dir={out_dir}", f"--epochs={FLAGS.epochs}",
                   f"--repeat={FLAGS.repeat}", *strategy_flags]
        cluster = LocalCluster(command, num_ps=num_ps, num_workers=m, output=None,
                               startup_timeout=FLAGS.start_timeout, stop_on_failure=False,
                               preload=FLAGS.preload)
        result = {"scenario": scenario, "faulted": target}
        with cluster:
            start = time.monotonic()
            stopped = set()
            fault_at = start
            if target is not None:
                if not _wait_for_line(cluster, target, f"EPOCH {FLAGS.fault_epoch}",
                                      start + FLAGS.start_timeout):
                    result["error"] = (f"{target} did not reach epoch {FLAGS.fault_epoch} "
                                       f"(exit code {cluster.returncode(target)}): no fault made")
                fault_at = time.monotonic()
                if "error" not in result:
                    stopped = _inject(cluster, target, fault[1])
            deadline = fault_at + (FLAGS.end_timeout + usual_seconds if target
                                   else FLAGS.start_timeout)
            while any(cluster.returncode(t) is None for t in workers if t not in stopped):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            ended_at = time.monotonic()
            codes = {t: cluster.returncode(t) for t in workers}
            lines = cluster.lines
        running = [t for t in workers if codes[t] is None and t not in stopped]
        killed = [target] if fault is not None and fault[1] == "kill" else []
        result.update(
            ended=not running, still_running=running, stopped_for_good=sorted(stopped),
            killed=killed,
            seconds_after_fault=round(ended_at - fault_at, 1) if target else None,
            job_seconds=round(ended_at - start, 1), exit_codes=codes,
            errors={t: _last_error(lines, t) for t in workers
                    if codes[t] not in (0, None) and t not in stopped and t not in killed})
        result.update(_outcome(out_dir, m, workers, stopped, codes))
    return result


def _outcome(out_dir, m, workers, stopped, codes):
    """Accuracy and the update count from the workers' files."""
    reports = []
    for path in glob.glob(os.path.join(out_dir, "worker*.json")):
        with open(path) as f:
            reports.append(json.load(f))
    pushes, processes = 0, 0
    for path in glob.glob(os.path.join(out_dir, "pushes.*")):
        with open(path) as f:
            text = f.read().strip()
        pushes += int(text) if text else 0
        processes += 1
    finished = {r["pid"] for r in reports}
    # Processes that started training but never reported (killed, stopped for good): each
    # may have had one push on its way.
    unreported = sum(1 for path in glob.glob(os.path.join(out_dir, "pushes.*"))
                     if int(path.rsplit(".", 1)[1]) not in finished)
    out = {"processes": processes, "workers_reported": len(reports),
           "pushes_sent": pushes, "pushes_unreported_processes": unreported}
    by_rank = sorted(reports, key=lambda r: (r["rank"], -r["finished_at"]))
    with_accuracy = [r for r in by_rank if "accuracy" in r]
    if with_accuracy:
        out["accuracy"] = with_accuracy[0]["accuracy"]
        out["accuracy_of"] = f"worker:{with_accuracy[0]['rank']}"
    if not reports:
        out["updates"] = "not known: no worker finished"
        return out
    last = max(reports, key=lambda r: r["finished_at"])["progress"]
    if "aggregated_gradients" in last:
        applied, dropped = last["aggregated_gradients"], last["dropped_gradients"]
        out.update(pushes_applied=applied, pushes_dropped=dropped)
        taken = applied + dropped
        if taken < pushes:
            out["updates"] = f"{pushes - taken} lost"
        elif taken > pushes + unreported:
            out["updates"] = f"{taken - pushes - unreported} more applied than sent"
        else:
            out["updates"] = "ok"
    else:
        sent = sum(r.get("messages_sent", 0) for r in reports)
        taken = sum(r["progress"]["messages_received"] for r in reports)
        mass = last.get("final_weight_sum")
        out.update(messages_sent=sent, messages_taken=taken, final_weight_sum=mass)
        if len(reports) < m:
            out["updates"] = "not known: a worker did not finish"
        elif sent != taken:
            out["updates"] = f"{sent - taken} messages sent, not taken"
        elif mass is None or abs(mass - m) > 1e-3 * m:
            out["updates"] = f"push-sum mass {mass} (not {m})"
        else:
            out["updates"] = "ok"
    return out


def main(argv):
    del argv
    quick_scenarios = {}
    if FLAGS.quick:
        apply_quick(QUICK)
        quick_scenarios = QUICK_SCENARIOS
    unknown = sorted(set(FLAGS.scenarios) - set(SCENARIOS))
    if unknown:
        raise app.UsageError(f"--scenarios must name scenarios among {list(SCENARIOS)}. "
                             f"Received: {unknown}")
    settings = {name: FLAGS[name].value for name in
                ("quick", "num_workers", "epochs", "repeat", "fault_epoch", "stall_timeout",
                 "pause", "restart_delay", "end_timeout", "preload")}
    results = {"stamp": stamp(settings), "settings": settings, "job": DESCRIPTION,
               "strategies": {}}
    for name, (strategy_flags, num_ps) in strategies().items():
        if FLAGS.strategies and not any(part in name for part in FLAGS.strategies):
            continue
        chosen = FLAGS.scenarios or next(
            (s for key, s in quick_scenarios.items() if name.startswith(key)), list(SCENARIOS))
        if "no fault" not in chosen:
            chosen = ["no fault", *chosen]  # the reference of the accuracy
        runs = results["strategies"][name] = {}
        for scenario in chosen:
            print(f"{name}: {scenario} ...", flush=True)
            # A job on loaded cores is slow, not hung: it gets what the fault-free run took.
            usual = runs.get("no fault", {}).get("job_seconds") or 0.0
            runs[scenario] = run_scenario(strategy_flags, num_ps, scenario, usual)
            print(f"{name}: {scenario}: {json.dumps(runs[scenario])}", flush=True)
    results["stamp"] = finish(results["stamp"])
    write_json(FLAGS.out + ".json", results)


if __name__ == "__main__":
    app.run(main)
