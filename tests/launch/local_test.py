"""End-to-end tests of the local cluster launcher on localhost."""

import io
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf

from tests.launch.processes import alive
from tests.launch.processes import wait_until_gone
from tfdist.cluster import is_listening
from tfdist.launch import LocalCluster

# Deadline of every run in this file: no test can hang longer.
RUN_TIMEOUT = 60

# A worker's bare TensorFlow server, serving until its stdin closes.
WORKER_SERVER = """
import sys
import tensorflow as tf
server = tf.distribute.Server(tf.train.ClusterSpec({"worker": [sys.argv[1]]}),
                              job_name="worker", task_index=0)
sys.stdin.read()
"""


def _state(pid):
    """A process's state and where in the kernel it waits, for failure messages."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(")")[-1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return f"state {state}, waiting in {f.read() or '-'}"
    except OSError as e:
        return f"unreadable: {e}"


def _line_with(process, text):
    """The first line of `process`'s output holding `text` (the launcher's --timeout bounds
    the wait: at its end the output closes)."""
    line = process.stdout.readline()
    while line and text not in line:
        line = process.stdout.readline()
    return line


def _line_within(stream, text, timeout):
    """The first line of `stream` holding `text`, read on a thread so that the wait is bounded
    (an empty string if none came within `timeout` s or the stream ended)."""
    found = queue.Queue()

    def read():
        for line in stream:
            if text in line:
                found.put(line)
                return
        found.put("")

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=timeout)
    except queue.Empty:
        return ""


def _python(code):
    return [sys.executable, "-c", code]


class LocalClusterTest(tf.test.TestCase):
    # On the machine's network, so that "no port left open" is checked from here (inside a
    # private network the ports are out of reach anyway: isolation_test.py).

    def _assert_torn_down(self, cluster):
        pids = [cluster.pid(name) for name in cluster.task_names]
        self.assertFalse([p for p in pids if alive(p)], "a task outlived the cluster")
        for addresses in cluster.config.cluster.values():
            for address in addresses:
                self.assertFalse(is_listening(address), f"{address} still listens")

    def test_success_prefixes_output_and_stops_ps(self):
        out = io.StringIO()
        code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
                "print('task', c['task']['type'], c['task']['index'], len(c['cluster']['worker']))")
        with LocalCluster(_python(code), num_ps=1, num_workers=2, output=out,
                          timeout=RUN_TIMEOUT, isolate_network=False) as cluster:
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, out.getvalue())
        self.assertIn("[worker:0] task worker 0 2", out.getvalue())
        self.assertIn("[worker:1] task worker 1 2", out.getvalue())
        self.assertIn(("worker:1", "task worker 1 2"), cluster.lines)
        self.assertEqual(result.task_returncodes["worker:0"], 0)
        self._assert_torn_down(cluster)

    def test_first_failure_stops_the_rest_and_is_named(self):
        code = ("import json, os, sys, time; c = json.loads(os.environ['TF_CONFIG']); "
                "sys.exit(7) if c['task']['index'] == 1 else time.sleep(120)")
        start = time.monotonic()
        with LocalCluster(_python(code), num_ps=0, num_workers=3, output=None,
                          grace_period=0.5, timeout=RUN_TIMEOUT,
                          isolate_network=False) as cluster:
            result = cluster.wait()
        self.assertLess(time.monotonic() - start, 30)
        self.assertEqual(result.returncode, 7)
        self.assertEqual(result.failed_task, "worker:1")
        self.assertIn("worker:1 exited with code 7", result.message)
        self._assert_torn_down(cluster)

    def test_killed_worker_is_named_within_seconds(self):
        with LocalCluster(_python("import time; time.sleep(120)"), num_ps=1, num_workers=2,
                          output=None, grace_period=0.5, timeout=RUN_TIMEOUT,
                          isolate_network=False) as cluster:
            time.sleep(0.5)
            self.assertIsNone(cluster.returncode("worker:1"))
            os.kill(cluster.pid("worker:1"), signal.SIGKILL)
            start = time.monotonic()
            while cluster.returncode("worker:1") is None:
                self.assertLess(time.monotonic() - start, 10)
                time.sleep(0.05)
            self.assertEqual(cluster.returncode("worker:1"), -signal.SIGKILL)
            result = cluster.wait()
            self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(result.failed_task, "worker:1")
        self.assertIn("signal SIGKILL", result.message)
        self.assertEqual(result.returncode, 128 + signal.SIGKILL)  # as a shell reports it
        self._assert_torn_down(cluster)

    def test_timeout_bounds_the_run_and_kills_grandchildren(self):
        # The worker starts a grandchild that ignores SIGTERM: teardown must still end it.
        code = ("import subprocess, sys, time; "
                "p = subprocess.Popen([sys.executable, '-c', "
                "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print(1, flush=True); time.sleep(120)']); "
                "print('grandchild', p.pid, flush=True); time.sleep(120)")
        with LocalCluster(_python(code), num_ps=0, num_workers=1, output=None,
                          timeout=3, isolate_network=False) as cluster:
            result = cluster.wait()
        self.assertTrue(result.timed_out)
        self.assertEqual(result.returncode, 124)
        self.assertIn("timed out after 3 s", result.message)
        grandchild = [int(line.split()[1]) for _, line in cluster.lines
                      if line.startswith("grandchild")]
        self.assertLen(grandchild, 1)
        time.sleep(0.2)
        self.assertFalse(alive(grandchild[0]))
        self._assert_torn_down(cluster)

    def test_restarted_worker_runs_again_with_its_tf_config(self):
        # Each start of a worker prints its TF_CONFIG task and a start count; the first run of
        # worker 0 sleeps until it is restarted, the second exits 0.
        marker = os.path.join(self.get_temp_dir(), "started")
        code = ("import json, os, sys, time; t = json.loads(os.environ['TF_CONFIG'])['task']; "
                f"m = {marker!r} + str(t['index']); again = os.path.exists(m); "
                "open(m, 'a').close(); print('start', t['type'], t['index'], again, flush=True); "
                "time.sleep(0 if again or t['index'] else 120)")
        with LocalCluster(_python(code), num_ps=0, num_workers=2, output=None,
                          timeout=RUN_TIMEOUT, isolate_network=False) as cluster:
            deadline = time.monotonic() + 30
            while ("worker:0", "start worker 0 False") not in cluster.lines:
                self.assertLess(time.monotonic(), deadline, cluster.lines)
                time.sleep(0.05)
            first = cluster.pid("worker:0")
            cluster.restart("worker:0")
            self.assertNotEqual(cluster.pid("worker:0"), first)
            self.assertFalse(alive(first))
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster.lines)
        self.assertEqual(cluster.returncode("worker:0"), 0)  # the new process's, not -9
        self.assertIn(("worker:0", "start worker 0 True"), cluster.lines)
        with self.assertRaisesRegex(ValueError, r"`task` must be one of this cluster's workers "
                                                r"\['worker:0', 'worker:1'\]. Received: 'ps:0'"):
            cluster.restart("ps:0")
        self._assert_torn_down(cluster)

    def test_a_chatty_task_keeps_only_the_latest_lines(self):
        # 20,000 lines through a cluster that keeps 100: what is kept never passes the bound
        # (sampled while the task writes), and it is the latest lines.
        total, bound = 20_000, 100
        kept = []

        def sample(cluster, done):
            while not done.is_set():
                kept.append(len(cluster.lines))
                time.sleep(0.001)

        with LocalCluster(_python(f"for i in range({total}): print('line', i)"), num_ps=0,
                          num_workers=1, output=None, max_lines=bound, timeout=RUN_TIMEOUT,
                          isolate_network=False) as cluster:
            done = threading.Event()
            sampler = threading.Thread(target=sample, args=(cluster, done), daemon=True)
            sampler.start()
            try:
                result = cluster.wait()
            finally:
                done.set()
                sampler.join(10)
        self.assertEqual(result.returncode, 0, cluster.lines)
        self.assertNotEmpty(kept)
        self.assertLessEqual(max(kept), bound)
        self.assertEqual(cluster.lines, [("worker:0", f"line {i}")
                                         for i in range(total - bound, total)])
        self.assertEqual(cluster.dropped_lines, total - bound)

    def test_exception_in_with_block_tears_down(self):
        with self.assertRaises(RuntimeError):
            with LocalCluster(_python("import time; time.sleep(120)"), num_ps=1, num_workers=1,
                              output=None, timeout=RUN_TIMEOUT,
                              isolate_network=False) as cluster:
                raise RuntimeError("boom")
        self._assert_torn_down(cluster)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "`num_workers` must be an integer >= 1"):
            LocalCluster(["true"], num_workers=0)
        with self.assertRaisesRegex(ValueError, "`command` must be a non-empty argv list"):
            LocalCluster("python train.py")
        with self.assertRaisesRegex(ValueError, "`timeout` must be a positive"):
            LocalCluster(["true"], timeout=-1)
        with self.assertRaisesRegex(ValueError, "`max_lines` must be an integer >= 1. "
                                                "Received: 0"):
            LocalCluster(["true"], max_lines=0)


class LauncherCliTest(tf.test.TestCase):

    def _run(self, *args, timeout=RUN_TIMEOUT, **kwargs):
        return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], text=True,
                              capture_output=True, timeout=timeout, **kwargs)

    def test_local_success_and_failure_exit_codes(self):
        ok = self._run("--local", "--num_ps=1", "--num_workers=2", "--timeout=60", "--",
                       "python", "-c", "print('hello')")
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("[worker:1] hello", ok.stdout)
        bad = self._run("--local", "--num_ps=0", "--num_workers=2", "--grace_period=0.5",
                        "--timeout=60", "--", "python", "-c",
                        "import json, os, sys; "
                        "sys.exit(json.loads(os.environ['TF_CONFIG'])['task']['index'] * 5)")
        self.assertEqual(bad.returncode, 5)
        self.assertIn("FAILED: task worker:1 exited with code 5", bad.stderr)

    def test_flag_errors_are_one_message_not_a_traceback(self):
        for args, message in [
            (["--local", "--num_workers=0"], "--num_workers=0: 0 is not a positive integer"),
            (["--local"], "--local needs the worker command after `--`"),
            (["--job_name=worker", "--worker_hosts=a:99999", "--", "true"],
             r"port must be between 1 and 65535. Received: 99999"),
            (["--job_name=worker", "--worker_hosts=a:1", "--task_index=3", "--", "true"],
             "between 0 and 0 for job 'worker'"),
            (["--job_name=boss"], "--job_name"),
            ([], "give --job_name=ps|worker|chief"),
            (["--job_name=ps", "--ps_hosts=localhost:2", "--", "true"], "a ps task runs no"),
            (["--job_name=ps", "--ps_hosts=localhost:2", "--ps_import=no_such_module_here"],
             r"--ps_import=no_such_module_here: cannot import it \(ModuleNotFoundError"),
            (["--local", "--bandwidth=fast", "--", "true"],
             r"--bandwidth must be a rate such as '100mbit'.*Received: 'fast'"),
            (["--local", "--bandwidth=1gbit", "--noisolate_network", "--", "true"],
             r"needs the private network. Received: --noisolate_network"),
            (["--job_name=worker", "--worker_hosts=a:1", "--bandwidth=1gbit", "--", "true"],
             r"--bandwidth limits the private network of a --local cluster"),
            (["--local", "--topology=switched", "--noisolate_network", "--", "true"],
             r"--topology='switched' connects private network namespaces: it needs the "
             r"private network. Received: --noisolate_network"),
            (["--job_name=worker", "--worker_hosts=a:1", "--topology=hub", "--", "true"],
             r"--topology connects the tasks of a --local cluster"),
            (["--job_name=worker", "--worker_hosts=a:1", "--check_links", "--", "true"],
             r"--check_links measures a --local cluster's network. Received: --check_links "
             r"without --local"),
            (["--job_name=ps", "--ps_hosts=localhost:2", "--exit_after_workers_gone=5"],
             r"--exit_after_workers_gone watches the workers' ports: give --worker_hosts"),
            (["--job_name=ps", "--ps_hosts=localhost:2", "--exit_after_workers_gone=0"],
             r"--exit_after_workers_gone must be a positive number of seconds"),
            (["--job_name=worker", "--worker_hosts=a:1", "--connect_timeout=-1", "--", "true"],
             r"--connect_timeout must be a positive number of seconds"),
            (["--job_name=worker", "--worker_hosts=a:1", "--stall_timeout=0", "--", "true"],
             r"--stall_timeout must be a positive number of seconds"),
        ]:
            result = self._run(*args)
            self.assertNotEqual(result.returncode, 0, args)
            self.assertRegex(result.stderr, message)
            self.assertNotIn("Traceback", result.stderr)

    def test_worker_form_sets_tf_config_and_runs_command(self):
        result = self._run("--job_name=worker", "--task_index=1", "--ps_hosts=localhost:2000",
                           "--worker_hosts=localhost:2001,localhost:2002", "--", sys.executable,
                           "-c", "import os; print(os.environ['TF_CONFIG'])")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn('"task": {"index": 1, "type": "worker"}', result.stdout)

    def test_a_signal_to_the_launcher_stops_every_task_with_its_exit_code(self):
        # SIGTERM gives 143 and SIGHUP (a closed terminal) 129, as a shell reports them;
        # the worker is gone afterwards.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            process = subprocess.Popen(
                [sys.executable, "-m", "tfdist.launch", "--local", "--num_ps=0",
                 "--num_workers=1", "--timeout=60", "--noisolate_network", "--", "python",
                 "-c", "import os, time; print('PID', os.getpid(), flush=True); "
                 "time.sleep(60)"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                worker = int(_line_with(process, "PID").split()[-1])
                process.send_signal(sig)
                self.assertEqual(process.wait(timeout=30), 128 + sig)
                self.assertIn(f"{signal.Signals(sig).name}; every task stopped",
                              process.stderr.read())
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            self.assertFalse(alive(worker))

    def test_no_task_outlives_a_killed_launcher(self):
        # SIGKILL (an OOM kill, a CI's kill -9) gives the launcher no chance to clean up: its
        # ps and worker must still go, by the parent-death signal, and their ports close.
        process = subprocess.Popen(
            [sys.executable, "-m", "tfdist.launch", "--local", "--num_ps=1", "--num_workers=1",
             "--timeout=120", "--noisolate_network", "--", "python", "-c",
             "import json, os, time; print('PID', os.getpid(), json.loads(os.environ["
             "'TF_CONFIG'])['cluster']['ps'][0], flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = _line_with(process, "PID")
            worker, ps_address = int(line.split()[-2]), line.split()[-1]
            with open(f"/proc/{process.pid}/task/{process.pid}/children") as f:
                tasks = [int(pid) for pid in f.read().split()]
            self.assertIn(worker, tasks)
            self.assertLen(tasks, 2)
            process.kill()
            process.wait(10)
            wait_until_gone(tasks, ps_address)
            survivors = [f"{'worker' if pid == worker else 'ps'} {pid} ({_state(pid)})"
                         for pid in tasks if alive(pid)]
            self.assertFalse(survivors, "a task outlived its launcher")
            self.assertFalse(is_listening(ps_address), f"{ps_address} still listens")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    def test_ps_form_exits_once_its_workers_are_gone(self):
        # With --exit_after_workers_gone a ps keeps serving while its worker (a bare
        # TensorFlow server in a child process) answers, and exits 0 by itself once the
        # worker is gone, as a Kubernetes ps pod does when its job's workers are done. Gone
        # is "does not answer an RPC": the worker is stopped with SIGSTOP, its port still
        # accepting connections. (That a ps ends with 0 on SIGTERM is checked by
        # server_test.py, whose cluster's ps tasks the launcher stops so.) Cost: the ps and
        # the worker start together (TensorFlow's import), then about 5 s.
        from tfdist.cluster import pick_free_ports

        ps_port, worker_port = pick_free_ports(2)
        address = f"localhost:{ps_port}"
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER_SERVER, f"localhost:{worker_port}"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        process = subprocess.Popen(
            [sys.executable, "-m", "tfdist.launch", "--job_name=ps", f"--ps_hosts={address}",
             f"--worker_hosts=localhost:{worker_port}", "--exit_after_workers_gone=1",
             "--connect_timeout=60"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            seen = _line_within(process.stderr, "has answered", timeout=RUN_TIMEOUT)
            self.assertIn("every training task (1) has answered; the ps exits once none has "
                          "for 1 s", seen)
            time.sleep(2)  # two grace periods with the worker there: still serving
            self.assertIsNone(process.poll())
            self.assertTrue(is_listening(address))
            os.kill(worker.pid, signal.SIGSTOP)  # a hung worker: its port stays open
            self.assertEqual(process.wait(timeout=30), 0)
            self.assertTrue(is_listening(f"localhost:{worker_port}"))
            self.assertIn("every training task has come and gone", process.stderr.read())
        finally:
            for child in (worker, process):
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGCONT)
                    child.kill()
                child.wait()
            worker.stdin.close()
            process.stderr.close()
        self.assertFalse(is_listening(address))

    def test_worker_form_waits_for_its_ps_with_connect_timeout(self):
        # A worker given --connect_timeout runs its command once the ps tasks answer (here a
        # bare listening socket), with the strategies' default timeouts exported (and
        # --stall_timeout as TFDIST_STALL_TIMEOUT); without
        # them it exits 69 (EX_UNAVAILABLE) instead of starting the command.
        from tfdist.cluster import pick_free_ports

        ps_port, other_port, worker_port = pick_free_ports(3)
        code = ("import os; print('RAN', os.environ['TFDIST_CONNECT_TIMEOUT'], "
                "os.environ['TFDIST_INIT_TIMEOUT'], os.environ['TFDIST_STALL_TIMEOUT'])")
        args = ["--job_name=worker", f"--worker_hosts=localhost:{worker_port}",
                "--connect_timeout=2.5", "--stall_timeout=7"]
        with socket.create_server(("localhost", ps_port)):
            ok = self._run(*args, f"--ps_hosts=localhost:{ps_port}", "--", sys.executable,
                           "-c", code)
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertEqual(ok.stdout.split(), ["RAN", "2.5", "2.5", "7.0"])
        missing = self._run(*args, f"--ps_hosts=localhost:{other_port}", "--", sys.executable,
                            "-c", code)
        self.assertEqual(missing.returncode, 69, missing.stderr)
        self.assertNotIn("RAN", missing.stdout)
        self.assertIn(f"/job:ps/task:0 at localhost:{other_port} did not answer in 2.5 s",
                      missing.stderr)


if __name__ == "__main__":
    tf.test.main()
