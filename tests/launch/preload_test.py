"""`LocalCluster(preload=True)`: tasks forked from a server that imported TensorFlow once run
their programs as `python` would, and keep the cluster's guarantees (a process group each, a
deadline, no task outliving its launcher)."""

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import tensorflow as tf

from tests.launch.processes import alive
from tests.launch.processes import wait_until_gone
from tfdist.cluster import is_listening
from tfdist.launch import LocalCluster
from tfdist.launch import preload
from tfdist.launch.preload import command_form

RUN_TIMEOUT = 60

# A worker program: what it sees of its interpreter, an exit function, then its exit code.
PROGRAM = """
import atexit, json, os, sys
preloaded = "tensorflow" in sys.modules
import tensorflow as tf
task = json.loads(os.environ["TF_CONFIG"])["task"]
# What runs at exit sees the program's argv (runpy would have put the server's back).
atexit.register(lambda: print("atexit ran", flush=True) if sys.argv[1:] == ["--flag", "x"]
                else print("atexit saw argv", sys.argv, flush=True))
# A pool never shut down: the interpreter's end stops its thread (a fresh python exits).
import concurrent.futures
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(int).result()
print("seen", json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(),
      "path0": sys.path[0], "extra": os.environ.get("EXTRA"), "preloaded": preloaded,
      "group_leader": os.getpgid(0) == os.getpid(), "parent": os.getppid()}), flush=True)
if task["index"] == 1:
    raise ValueError("boom from worker 1")
if task["index"] == 2:
    sys.exit(3)
"""


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


class PreloadTest(tf.test.TestCase):

    def test_a_forked_task_runs_its_program_as_python_would(self):
        # In the cluster's private network where the system allows one (the tasks enter it
        # after the fork), as the test clusters run.
        script = os.path.join(self.get_temp_dir(), "program.py")
        with open(script, "w") as f:
            f.write(PROGRAM)
        cwd = os.path.join(self.get_temp_dir(), "cwd")
        os.makedirs(cwd, exist_ok=True)
        with LocalCluster([sys.executable, script, "--flag", "x"], num_ps=1, num_workers=3,
                          output=None, timeout=RUN_TIMEOUT, cwd=cwd, env={"EXTRA": "yes"},
                          stop_on_failure=False, preload=True) as cluster:
            ps = cluster.pid("ps:0")
            ps_parent = _parent(ps)
            result = cluster.wait()
        log = "\n".join(f"[{task}] {line}" for task, line in cluster.lines)
        # The ps (`python -m tfdist.launch`) and the workers were forked, not started by the
        # launcher; each ended as its program did.
        self.assertNotEqual(ps_parent, os.getpid())
        self.assertEqual({name: code for name, code in result.task_returncodes.items()
                          if name.startswith("worker")},
                         {"worker:0": 0, "worker:1": 1, "worker:2": 3}, log)
        # (Workers 1 and 2 fail at about the same time: either may be seen first.)
        self.assertIn(result.failed_task, ("worker:1", "worker:2"), log)
        seen = {task: json.loads(line.split(" ", 1)[1]) for task, line in cluster.lines
                if line.startswith("seen ")}
        self.assertLen(seen, 3, log)
        for task, view in seen.items():
            self.assertEqual(view["name"], "__main__")
            self.assertEqual(view["argv"], [script, "--flag", "x"])
            self.assertEqual(view["cwd"], os.path.realpath(cwd))
            self.assertEqual(view["path0"], os.path.dirname(script))
            self.assertEqual(view["extra"], "yes")
            self.assertTrue(view["preloaded"], task)
            self.assertTrue(view["group_leader"], task)
            self.assertNotEqual(view["parent"], os.getpid())
        # An exception prints its traceback, exit functions run after it, as in python.
        worker1 = [line for task, line in cluster.lines if task == "worker:1"]
        self.assertIn("ValueError: boom from worker 1", worker1, log)
        self.assertGreater(worker1.index("atexit ran"),
                           worker1.index("ValueError: boom from worker 1"))
        for task in ("worker:0", "worker:2"):
            self.assertIn((task, "atexit ran"), cluster.lines)
        # `python -c` is not a script or a module: it starts a fresh interpreter.
        self.assertIsNone(command_form([sys.executable, "-c", "print(1)"]))
        self.assertIsNone(command_form(["bash", "run.sh"]))
        self.assertEqual(command_form([sys.executable, "-m", "tfdist.launch", "--x"]),
                         ("module", "tfdist.launch"))

    def test_a_killed_task_is_named_and_no_task_outlives_a_killed_launcher(self):
        # The launcher (its own process, its script guarded by `__main__`) starts a 1-ps,
        # 2-worker cluster whose workers sleep, SIGKILLs worker 1 and supervises; once it has
        # named worker 1, the ps is stopped and the launcher SIGKILLed: every task must go,
        # by the death signals (the fork server's on the launcher, each task's on the server).
        launcher = textwrap.dedent(f"""
            import os, signal, sys
            from tfdist.launch import LocalCluster
            if __name__ == "__main__":
                script = os.path.join({self.get_temp_dir()!r}, "sleeper.py")
                with open(script, "w") as f:
                    f.write("import time\\ntime.sleep(120)\\n")
                with LocalCluster([sys.executable, script], num_ps=1, num_workers=2,
                                  output=sys.stdout, timeout=120, isolate_network=False,
                                  stop_on_failure=False, preload=True) as cluster:
                    print("PIDS", *[cluster.pid(t) for t in cluster.task_names],
                          cluster.config.cluster["ps"][0], flush=True)
                    os.kill(cluster.pid("worker:1"), signal.SIGKILL)
                    cluster.wait()
        """)
        process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout],
                         daemon=True).start()
        try:
            seen, pids, address = [], None, None
            deadline = time.monotonic() + RUN_TIMEOUT
            while time.monotonic() < deadline:
                try:
                    line = lines.get(timeout=1)
                except queue.Empty:
                    continue
                seen.append(line)
                if line.startswith("PIDS"):
                    *pids, address = line.split()[1:]
                    pids = [int(p) for p in pids]
                if "worker:1 exited with signal SIGKILL; the other workers go on" in line:
                    break
            self.assertIsNotNone(pids, "".join(seen))
            self.assertIn("worker:1 exited with signal SIGKILL", "".join(seen))
            # The fork server (every task's parent) must go too, and the ps, stopped, by the
            # kernel's death signal (no code of its own runs while it is stopped).
            pids.append(_parent(pids[0]))
            os.kill(pids[0], signal.SIGSTOP)
            process.kill()
            process.wait(10)
            wait_until_gone(pids, address)
            self.assertFalse([p for p in pids if alive(p)], "a task outlived its launcher")
            self.assertFalse(is_listening(address))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    def test_a_task_whose_server_died_is_seen_ending(self):
        # The server killed (an OOM kill, say) while its task runs: the task gets its death
        # signal, which it may handle (it takes a second to end); the launcher sees it end
        # when its process group goes, with that signal's code, and never waits for ever.
        script = os.path.join(self.get_temp_dir(), "handles_term.py")
        with open(script, "w") as f:
            f.write("import signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(7)))\n"
                    "print('up', flush=True)\n"
                    "time.sleep(60)\n")
        task = preload.ForkedTask([sys.executable, script], dict(os.environ), None,
                                  signal.SIGTERM, None, {})
        self.assertEqual(task.stdout.readline(), b"up\n")
        self.assertIsNone(task.poll())
        preload._server.process.kill()
        self.assertEqual(task.wait(RUN_TIMEOUT), -signal.SIGTERM)
        self.assertFalse(alive(task.pid))
        task.stdout.close()

    def test_bad_argument(self):
        with self.assertRaisesRegex(ValueError, r"`preload` must be True or False. "
                                                r"Received: 'yes'"):
            LocalCluster(["true"], preload="yes")


if __name__ == "__main__":
    tf.test.main()
