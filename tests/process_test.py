"""The last-word fuse: a child process that ends a process whose Python threads cannot run.

Each test starts a `sleep` as the fused process and the fuse's own small child (no
TensorFlow), and local ports standing for ps tasks that answer or do not: 0.5 to 3 s each.
"""

import os
import signal
import socket
import subprocess
import threading
import time

import tensorflow as tf

from tfdist._process import LastWordFuse

# A bound against a hang, far above the fuse's deadlines here.
HANG_BOUND = 30


def _listener(test, answer):
    """A local port that answers each connection with an HTTP/2 SETTINGS frame, as a gRPC
    server does (`answer`), or accepts it in the kernel and says nothing, as a stopped one
    does; returns its "host:port"."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    test.addCleanup(server.close)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            test.addCleanup(conn.close)

    if answer:
        threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


class LastWordFuseTest(tf.test.TestCase):

    def start(self):
        target = subprocess.Popen(["sleep", str(HANG_BOUND)])
        fuse = LastWordFuse(target.pid, stderr=subprocess.PIPE)

        def reap():
            fuse.close()
            fuse._child.stderr.close()
            if target.poll() is None:
                os.kill(target.pid, signal.SIGCONT)
                target.kill()
            target.wait()

        self.addCleanup(reap)
        return target, fuse

    def test_not_rearmed_it_writes_its_last_word_and_kills(self):
        target, fuse = self.start()
        fuse.arm(0.3, "tfdist: /job:ps/task:0 at h:1 stopped answering\n(in one line)")
        self.assertEqual(target.wait(HANG_BOUND), -9)
        fuse._child.wait(HANG_BOUND)
        self.assertEqual(fuse._child.stderr.read(),
                         b"tfdist: /job:ps/task:0 at h:1 stopped answering (in one line)\n")

    def test_rearmed_or_disarmed_it_waits_and_ends_when_closed(self):
        target, fuse = self.start()
        for _ in range(6):  # re-armed every 0.1 s with 2 s to go: never goes off
            fuse.arm(2.0, "never")
            time.sleep(0.1)
        fuse.disarm()
        time.sleep(2.5)  # past the last arming's deadline
        self.assertIsNone(target.poll())
        fuse.close()
        self.assertEqual(fuse._child.returncode, 0)
        self.assertEqual(fuse._child.stderr.read(), b"")
        self.assertIsNone(target.poll())

    def test_a_busy_process_whose_ps_tasks_answer_is_left_alone(self):
        # A long call holding Python's lock (a save) while the ps tasks are fine: when the
        # fuse's time is up it finds every target answering, and waits on.
        target, fuse = self.start()
        fuse.arm(0.3, "never {silent}", [("/job:ps/task:0", _listener(self, answer=True))])
        time.sleep(1.5)  # five times the fuse's time
        self.assertIsNone(target.poll())
        fuse.close()
        self.assertEqual(fuse._child.stderr.read(), b"")

    def test_it_names_only_the_ps_task_that_does_not_answer(self):
        target, fuse = self.start()
        alive, stopped = _listener(self, answer=True), _listener(self, answer=False)
        fuse.arm(0.3, "tfdist: {silent} stopped answering",
                 [("/job:ps/task:0", alive), ("/job:ps/task:1", stopped)])
        self.assertEqual(target.wait(HANG_BOUND), -9)  # after the check's 2 s deadline
        fuse._child.wait(HANG_BOUND)
        self.assertEqual(fuse._child.stderr.read().decode(),
                         f"tfdist: /job:ps/task:1 at {stopped} stopped answering\n")

    def test_a_stopped_process_is_left_alone(self):
        # SIGSTOP (^Z, a debugger) stops every thread, the watcher's with them, but nothing
        # of the process waits in vain: the fuse waits on, and goes off only once the
        # process runs again without being re-armed.
        target, fuse = self.start()
        os.kill(target.pid, signal.SIGSTOP)
        fuse.arm(0.3, "once running again")
        time.sleep(1.0)
        self.assertIsNone(target.poll())
        os.kill(target.pid, signal.SIGCONT)
        self.assertEqual(target.wait(HANG_BOUND), -9)
        fuse._child.wait(HANG_BOUND)
        self.assertEqual(fuse._child.stderr.read(), b"once running again\n")


if __name__ == "__main__":
    tf.test.main()
