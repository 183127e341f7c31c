"""Helpers of the parameter-server tests: run `ps_program.py` on a local cluster."""

import json
import os
import signal
import sys
import time

from tfdist.launch import LocalCluster

PROGRAM = os.path.join(os.path.dirname(__file__), "ps_program.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RUN_TIMEOUT = 180


def make_cluster(out_dir, num_workers, *flags, **kwargs):
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return LocalCluster([sys.executable, PROGRAM, f"--out_dir={out_dir}", *flags],
                        num_ps=kwargs.pop("num_ps", 1), num_workers=num_workers,
                        timeout=RUN_TIMEOUT, output=None, env=env, **kwargs)


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


def _ps_crashed(result):
    """True if a ps task crashed (SIGSEGV / SIGABRT / SIGBUS inside TensorFlow's server).

    A ps stopped by the launcher's teardown ends with SIGTERM or SIGKILL, not these.
    """
    crashes = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS)
    return result.returncode != 0 and any(
        task.startswith("ps:") and code in crashes
        for task, code in result.task_returncodes.items())


def run_cluster(out_dir, num_workers, *flags, **kwargs):
    """Runs a cluster to its end; returns `(cluster, result)`.

    TF 2.21's gRPC server has crashed (SIGSEGV inside the ps process, no Python frame of ours
    on its stack) about once in several dozen runs here; such a run is retried once, in a fresh
    directory, and the retry is what the test checks.
    """
    for attempt in range(2):
        run_dir = out_dir if attempt == 0 else os.path.join(out_dir, "retry")
        os.makedirs(run_dir, exist_ok=True)
        with make_cluster(run_dir, num_workers, *flags, **kwargs) as cluster:
            result = cluster.wait()
        if not _ps_crashed(result):
            break
        print(f"ps crashed ({result.message}); running once more:\n{cluster_log(cluster)}",
              file=sys.stderr)
    return cluster, result, run_dir
