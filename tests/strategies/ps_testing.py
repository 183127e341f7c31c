"""Helpers of the parameter-server tests: run `ps_program.py` on a local cluster."""

import json
import os
import signal
import sys
import time

from tfdist.launch import LocalCluster

PROGRAM = os.path.join(os.path.dirname(__file__), "ps_program.py")
USERS_MODEL = os.path.join(os.path.dirname(__file__), "ps_users_model.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
# A bound against a hang, counted from the cluster's start: on loaded cores (a load of 15
# on the 2 cores) five tasks took 130 s to start TensorFlow before a run of 40 s.
RUN_TIMEOUT = 300
# Test clusters fork their Python tasks from a server that imported TensorFlow once
# (`LocalCluster(preload=True)`): TensorFlow's import, about 6 s of CPU a process, was half the
# suite's time. TFDIST_TEST_PRELOAD=0 starts every task as a fresh interpreter instead.
PRELOAD = os.environ.get("TFDIST_TEST_PRELOAD", "1") != "0"


def make_cluster(out_dir, num_workers, *flags, **kwargs):
    """A local cluster running `program` (default `ps_program.py`) on every worker."""
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **kwargs.pop("env", {})}
    program = kwargs.pop("program", PROGRAM)
    # A ps task's start (TensorFlow's import) takes 5 s on quiet cores and far longer on
    # loaded ones: a bound against a hang, not a timing.
    kwargs.setdefault("startup_timeout", 120.0)
    kwargs.setdefault("preload", PRELOAD)
    return LocalCluster([sys.executable, program, f"--out_dir={out_dir}", *flags],
                        num_ps=kwargs.pop("num_ps", 1), num_workers=num_workers,
                        timeout=RUN_TIMEOUT, output=None, env=env, **kwargs)


def end_stopped(cluster, task):
    """Ends `task`, stopped with SIGSTOP (or not): SIGCONT, then SIGKILL (a stopped process
    holds a SIGTERM until it runs again)."""
    pid = cluster.pid(task)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def load_result(out_dir, name):
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def cluster_log(cluster):
    return "\n".join(f"[{task}] {line}" for task, line in cluster.lines[-150:])


def wait_for_line(cluster, text, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for _, line in list(cluster.lines)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no line with {text!r} within {timeout} s:\n{cluster_log(cluster)}")


def run_cluster(out_dir, num_workers, *flags, **kwargs):
    """Runs a cluster to its end in `out_dir`; returns `(cluster, result)`.

    (Runs used to be retried once when a ps crashed with SIGSEGV; the cause, TF's eager-service
    race when workers connect together, is avoided by `tfdist.launch.server` and tested in
    tests/launch/server_test.py, so a ps crash now fails the test.)
    """
    os.makedirs(out_dir, exist_ok=True)
    with make_cluster(out_dir, num_workers, *flags, **kwargs) as cluster:
        result = cluster.wait()
    return cluster, result
