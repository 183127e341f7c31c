"""Liveness: a probe that sees a stopped process, and the watcher that acts on it.

`ServerProbeTest` probes a real TensorFlow server in a child process, started as a tfdist
training task starts its own (its eager context connected to a cluster), whose main thread
computes in Python the whole time: it answers; stopped with SIGSTOP it does not (its port
still accepts connections), and a probe returns by its deadline; resumed it answers again;
restarted on the same port it answers (a probe that reports restarts says so, once);
killed, nothing listens. Cost: two child processes,
one after the other (about 5 s each on an idle 2-core machine, most of it importing
TensorFlow; 40 s at nice 19 on a loaded one, load average 7-15).

`LivenessWatcherTest` drives the watcher's rounds (a ps's view of its workers), and
`PSWatchdogTest` the watchdog's (a worker's view of its ps tasks), with a scripted probe and
clock, in milliseconds.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import tensorflow as tf

from tfdist.cluster import pick_free_ports
from tfdist.cluster.probe import ANSWERED
from tfdist.cluster.probe import GONE
from tfdist.cluster.probe import RESTARTED
from tfdist.cluster.probe import STALLED
from tfdist.cluster.probe import ServerProbe
from tfdist.ps import protocol
from tfdist.ps.connection import PSWatchdog
from tfdist.ps.membership import LivenessWatcher
from tfdist.ps.membership import Membership
from tfdist.ps.protocol import EXPECTED
from tfdist.ps.protocol import LIVE

TASK = "/job:chief/task:0"

# A training task's server: started through the process's eager context, as
# `tfdist.ps.connection.PSConnection` starts a worker's; then the main thread holds the GIL
# in a Python loop until its deadline.
CHILD = textwrap.dedent("""
    import sys, time
    import tensorflow as tf
    from tensorflow.python.eager import context

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec({"chief": {0: sys.argv[1]}}), job_name="chief", task_index=0,
        make_master_device_default=False)
    context.context().ensure_initialized()
    print("ready", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    count = 0
    while time.monotonic() < deadline:
        count += 1
""")

# Seconds a child may take to start (importing TensorFlow on a loaded machine), and a bound
# against a hung probe far above its deadline.
START_TIMEOUT = 120
HANG_BOUND = 30


class ServerProbeTest(tf.test.TestCase):

    def start_child(self, address):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, address, str(START_TIMEOUT + 60)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))

        def reap():
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
            child.wait()
            child.stdout.close()

        self.addCleanup(reap)
        ready = threading.Event()
        threading.Thread(target=lambda: child.stdout.readline() == "ready\n" and ready.set(),
                         daemon=True).start()
        self.assertTrue(ready.wait(START_TIMEOUT), f"the child server at {address} never "
                        f"started (exit code {child.poll()})")
        return child

    def timed(self, probe, address):
        start = time.monotonic()
        answer = probe(address, TASK)
        return answer, time.monotonic() - start

    def test_a_busy_server_answers_a_stopped_one_stalls_a_killed_one_is_gone(self):
        address = f"localhost:{pick_free_ports(1)[0]}"
        probe = ServerProbe(timeout=1.0)
        self.addCleanup(probe.close)
        # A worker's watchdog tells a replaced ps task from a live one.
        reporting = ServerProbe(timeout=1.0, report_restarts=True)
        self.addCleanup(reporting.close)
        child = self.start_child(address)
        self.assertEqual(probe(address, TASK), ANSWERED)  # creates a session there
        self.assertEqual(reporting(address, TASK), ANSWERED)
        self.assertEqual(probe(address, TASK), ANSWERED)  # asks that session

        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(2):
            answer, took = self.timed(probe, address)
            self.assertEqual(answer, STALLED)
            self.assertLess(took, HANG_BOUND)
        self.assertIn("DeadlineExceeded", probe.errors[address])
        os.kill(child.pid, signal.SIGCONT)
        self.assertEqual(probe(address, TASK), ANSWERED)
        self.assertNotIn(address, probe.errors)

        # Killed and restarted on the same address between two probes: the new process does
        # not know the session the probe kept; it says so, and that is an answer. The next
        # probe creates a session there.
        child.kill()
        child.wait()
        child = self.start_child(address)
        self.assertEqual(probe(address, TASK), ANSWERED)
        self.assertEqual(probe(address, TASK), ANSWERED)
        self.assertEqual(reporting(address, TASK), RESTARTED)
        self.assertIn("a new process answers there", reporting.errors[address])
        self.assertEqual(reporting(address, TASK), ANSWERED)  # its new session there

        child.kill()
        child.wait()
        answer, took = self.timed(probe, address)
        self.assertEqual(answer, GONE)
        self.assertLess(took, HANG_BOUND)
        # Seen gone, then a new process there (a replaced task is down while it starts): the
        # first answer there is the restart, not a server the probe meets for the first time.
        self.assertEqual(reporting(address, TASK), GONE)
        child = self.start_child(address)
        self.assertEqual(probe(address, TASK), ANSWERED)
        self.assertEqual(reporting(address, TASK), RESTARTED)
        self.assertIn("went away", reporting.errors[address])
        self.assertEqual(reporting(address, TASK), ANSWERED)

    def test_timeout_is_checked(self):
        with self.assertRaisesRegex(ValueError, "`timeout` must be a positive number"):
            ServerProbe(timeout=0)


class ScriptedProbe:
    """Answers what `answers[address]` says (default ANSWERED); a probe of an address in
    `meet` first waits at that barrier."""

    timeout = 2.0  # a ServerProbe's deadline

    def __init__(self):
        self.answers, self.errors, self.meet = {}, {}, {}

    def __call__(self, address, task):
        if address in self.meet:
            self.meet[address].wait()
        return self.answers.get(address, ANSWERED)

    def close(self):
        pass


class FakeRun:

    def __init__(self, statuses, init_timeout=100.0, stall_timeout=30.0):
        n = len(statuses)
        self.run, self.created, self.finished = "r1", 0.0, threading.Event()
        self.spec = types.SimpleNamespace(
            worker_addresses=[f"host:{i}" for i in range(n)],
            worker_tasks=[f"/job:worker/task:{i}" for i in range(n)],
            init_timeout=init_timeout, stall_timeout=stall_timeout)
        self.members = Membership(n, threading.Lock())
        self.members.status[:] = statuses
        self.told, self.stalls = [], {}

    def send_control(self, kind, rank):
        self.told.append((kind, rank))


class LivenessWatcherTest(tf.test.TestCase):

    def watcher(self, run, misses_to_dead=4):
        self.now = 0.0
        self.probe = ScriptedProbe()
        watcher = LivenessWatcher(lambda: run, interval=0.5, misses_to_dead=misses_to_dead,
                                  probe=self.probe, clock=lambda: self.now)
        self.addCleanup(watcher.close)
        return watcher

    def poll_until(self, watcher, until, step=0.5):
        while self.now < until:
            watcher.poll()
            self.now += step

    def test_a_stalled_worker_dies_after_the_runs_stall_timeout_a_slow_one_never(self):
        run = FakeRun([LIVE, LIVE], stall_timeout=30.0)  # the job's value, from its spec
        watcher = self.watcher(run)
        self.poll_until(watcher, 10.0)
        self.probe.answers["host:1"] = STALLED  # stopped at t=10 s
        self.poll_until(watcher, 39.5)
        self.assertEqual(run.told, [])  # 29.5 s without an answer: not yet
        self.poll_until(watcher, 41.0)
        self.assertEqual(run.told, [(protocol.DEAD, 1)])
        self.assertRegex(run.stalls[1], r"no answer for 3\d s, stall_timeout=30 s")
        self.poll_until(watcher, 100.0)
        self.assertEqual(run.told, [(protocol.DEAD, 1)])  # told once

    def test_a_worker_that_answers_within_stall_timeout_stays(self):
        run = FakeRun([LIVE])
        watcher = self.watcher(run)
        for _ in range(5):  # answers once every 25 s (a slow machine): never cut off
            self.probe.answers["host:0"] = STALLED
            self.poll_until(watcher, self.now + 25.0)
            self.probe.answers["host:0"] = ANSWERED
            self.poll_until(watcher, self.now + 0.5)
        self.assertEqual(run.told, [])

    def test_a_killed_worker_dies_after_misses_to_dead_probes(self):
        run = FakeRun([LIVE, LIVE])
        watcher = self.watcher(run, misses_to_dead=4)
        self.poll_until(watcher, 1.0)
        self.probe.answers["host:0"] = GONE
        self.poll_until(watcher, self.now + 1.5)  # 3 misses
        self.assertEqual(run.told, [])
        self.poll_until(watcher, self.now + 0.5)
        self.assertEqual(run.told, [(protocol.DEAD, 0)])
        self.assertEqual(run.stalls, {})  # killed: it "died"

    def test_a_worker_never_seen_dies_after_init_timeout(self):
        run = FakeRun([LIVE, EXPECTED], init_timeout=100.0)
        watcher = self.watcher(run)
        self.probe.answers["host:1"] = STALLED
        self.poll_until(watcher, 99.5)
        self.assertEqual(run.told, [])
        self.poll_until(watcher, 101.0)
        self.assertEqual(run.told, [(protocol.DEAD, 1)])

    def test_workers_are_probed_at_once(self):
        # Each probe of a stalled worker takes the probe's whole deadline: one after the
        # other, they would delay noticing the others. Here the probes of workers 0 and 1
        # return only once both have started (a barrier, not a clock).
        run = FakeRun([LIVE, LIVE, LIVE])
        watcher = self.watcher(run, misses_to_dead=1)
        barrier = threading.Barrier(2, timeout=HANG_BOUND)
        self.probe.meet = {"host:0": barrier, "host:1": barrier}
        self.probe.answers = {"host:0": STALLED, "host:1": STALLED, "host:2": GONE}
        watcher.poll()
        self.assertEqual(run.told, [(protocol.DEAD, 2)])


class PSWatchdogTest(tf.test.TestCase):
    """A worker's view of its ps tasks, with a scripted probe and clock."""

    def watchdog(self, stall_timeout=4.0):
        self.now = 0.0
        self.probe = ScriptedProbe()
        self.ended = []
        connection = types.SimpleNamespace(ps_addresses=["ps0:1", "ps1:1"],
                                           ps_names=["/job:ps/task:0", "/job:ps/task:1"])
        watchdog = PSWatchdog(connection, stall_timeout, self.ended.append, probe=self.probe,
                              clock=lambda: self.now, fuse=False)
        self.addCleanup(watchdog.liveness.close)
        return watchdog

    def poll_until(self, watchdog, until, step=1.0):
        found = []
        while self.now < until and not found:
            found = watchdog.poll()
            self.now += step
        return found

    def test_a_ps_silent_for_stall_timeout_is_named_a_slow_one_never(self):
        watchdog = self.watchdog(stall_timeout=4.0)
        self.assertEqual(self.poll_until(watchdog, 3.0), [])
        self.probe.answers["ps1:1"] = STALLED  # stopped at t=3 s
        self.probe.errors["ps1:1"] = "DeadlineExceededError: Deadline Exceeded"
        self.assertEqual(self.poll_until(watchdog, 7.0), [])  # silent 3 s: not yet
        self.probe.answers["ps1:1"] = ANSWERED  # slow, but it answered
        self.assertEqual(self.poll_until(watchdog, 8.0), [])
        self.probe.answers["ps1:1"] = STALLED
        self.assertEqual(self.poll_until(watchdog, 12.0), [])
        (stalled,) = self.poll_until(watchdog, 20.0)
        self.assertEqual(stalled[:2], ("/job:ps/task:1", "ps1:1"))
        self.assertEqual(stalled[2], "no answer for 5 s, stall_timeout=4 s; "
                                     "DeadlineExceededError: Deadline Exceeded")

    def test_stop_waits_for_the_round_of_probes_in_flight(self):
        # A worker stops its watchdog at exit: a probe still waiting on its RPC as the
        # interpreter finalizes would abort the process (SIGABRT, "FATAL: exception not
        # rethrown"), its job failing after its work was done. stop() returns once the
        # round in flight has ended, and the thread with it.
        entered, release, finished = threading.Event(), threading.Event(), threading.Event()

        class InFlightProbe(ScriptedProbe):
            def __call__(self, address, task):
                entered.set()
                release.wait(HANG_BOUND)
                finished.set()
                return ANSWERED

        connection = types.SimpleNamespace(ps_addresses=["ps0:1"], ps_names=["/job:ps/task:0"])
        watchdog = PSWatchdog(connection, 4.0, lambda stalled: None, interval=0.01,
                              probe=InFlightProbe(), fuse=False).start()
        self.assertTrue(entered.wait(HANG_BOUND))
        threading.Timer(0.2, release.set).start()
        watchdog.stop()
        self.assertTrue(finished.is_set())
        self.assertFalse(watchdog._thread.is_alive())

    def test_the_fuses_last_word_names_the_silent_ps_tasks(self):
        # What the fuse writes if the watchdog's thread cannot run any more (another thread
        # holds Python's lock, waiting on a stopped ps): the tasks silent in the last round,
        # or every ps task when all answered it.
        watchdog = self.watchdog(stall_timeout=4.0)
        watchdog.poll()
        self.assertRegex(watchdog.last_word(), r"^tfdist: /job:ps/task:0 at ps0:1 or "
                                               r"/job:ps/task:1 at ps1:1 stopped answering \(")
        self.probe.answers["ps1:1"] = STALLED
        self.now = 1.0
        watchdog.poll()
        self.assertEqual(
            watchdog.last_word(),
            "tfdist: /job:ps/task:1 at ps1:1 stopped answering (this worker's Python threads "
            "have not run for 10 s: a TensorFlow call waiting on the ps holds Python's lock; "
            "stall_timeout=4 s): its shard of the master variables is gone, and no worker can "
            "train on without it. Restart the job; the chief's last checkpoint holds the model")

    def test_its_thread_calls_on_stall_once_and_stops(self):
        watchdog = self.watchdog(stall_timeout=0.2)
        watchdog.liveness._clock = time.monotonic
        watchdog.interval = 0.05
        self.probe.answers["ps0:1"] = GONE
        watchdog.start()
        watchdog._thread.join(HANG_BOUND)
        self.assertFalse(watchdog._thread.is_alive())
        self.assertLen(self.ended, 1)
        self.assertEqual([task for task, _, _ in self.ended[0]], ["/job:ps/task:0"])

    def test_a_ps_replaced_by_a_new_process_is_named_at_once(self):
        # A ps task restarted under a run answers the probe, but not in its session there:
        # its shard is gone. Named in the next round, not after stall_timeout; the thread
        # calls on_restart once (a worker whose op failed there asks `replaced()` too).
        watchdog = self.watchdog(stall_timeout=HANG_BOUND)
        self.assertEqual(watchdog.poll(), [])
        self.probe.answers["ps1:1"] = RESTARTED
        self.probe.errors["ps1:1"] = "a new process answers there"
        self.assertEqual(watchdog.poll(), [])  # not stalled: it answers
        self.assertEqual(watchdog.replaced(),
                         [("/job:ps/task:1", "ps1:1", "a new process answers there")])
        restarted = []
        watchdog.on_restart = restarted.append
        watchdog.liveness._clock = time.monotonic
        watchdog.interval = 0.05
        watchdog.start()
        watchdog._thread.join(HANG_BOUND)
        self.assertFalse(watchdog._thread.is_alive())
        self.assertEqual(restarted, [[("/job:ps/task:1", "ps1:1",
                                       "a new process answers there")]])
        self.assertEqual(self.ended, [])  # on_stall was not called

    def test_stop_ends_its_thread(self):
        # A worker that left its run stops watching: its thread ends, nothing is called.
        watchdog = self.watchdog(stall_timeout=HANG_BOUND)
        watchdog.liveness._clock = time.monotonic
        watchdog.interval = 0.05
        self.probe.answers["ps0:1"] = STALLED
        watchdog.start()
        watchdog.stop()
        watchdog._thread.join(HANG_BOUND)
        self.assertFalse(watchdog._thread.is_alive())
        self.assertEqual(self.ended, [])


if __name__ == "__main__":
    tf.test.main()
