"""Child processes that end with the process that started them (the launcher's tasks, a gossip
worker's courier), and a process that ends on its last word."""

import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent, sig=signal.SIGTERM):
    """For `preexec_fn`: the child is sent `sig` when its launcher dies, however it dies
    (Linux's parent-death signal: an OOM kill or `kill -9` of the launcher leaves no task
    behind), and exits at once if the launcher is already gone. The signal follows the
    launcher's thread that started the task: start clusters from a thread that lives on.

    A ps task gets SIGKILL: it has nothing to save, and its SIGTERM handler is Python code,
    which runs only once the main thread is back from TensorFlow's C++ (a ps still starting
    its runtime when the launcher died could outlive it). A worker gets SIGTERM, which its
    program may handle to save its work."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(1)


def end_with_last_word(code=1):
    """Ends this process now, with exit code `code`, after the logged error that says why.

    A worker whose ps task is gone can do nothing more, and TensorFlow's own teardown (its
    eager context trying to reach the lost task) would print hundreds of lines of gRPC errors
    after that error: the last screen a user sees would be noise. Like a ps task at its end
    (`tfdist.launch.main`), the process flushes what it has logged and printed, and exits
    without that teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# The fuse's process: stdlib only (it starts in milliseconds, without TensorFlow). Each line
# on its stdin re-arms it: "<seconds>\t<last word>". With no line for that long, it writes the
# last word to its stderr (the worker's) and SIGKILLs the worker, unless the worker is
# stopped (SIGSTOP, ^Z, a debugger: its threads do not run, but nothing waits in vain; the
# count starts again); it ends when stdin closes
# (the worker ended, however it ended: only the worker holds the pipe's other end).
_FUSE_PROGRAM = r"""
import os, select, signal, sys, time
target = int(sys.argv[1])
seconds, word, buffered = None, "", b""
deadline = None
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if not ready:
        try:
            with open(f"/proc/{target}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            state = "?"
        if state in ("T", "t"):  # stopped (SIGSTOP, ^Z, a debugger): not frozen; wait on
            deadline = time.monotonic() + float(seconds)
            continue
        sys.stderr.write(word + "\n")
        sys.stderr.flush()
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    chunk = os.read(0, 65536)
    if not chunk:
        break
    buffered += chunk
    *lines, buffered = buffered.split(b"\n")
    for line in lines:
        text = line.decode("utf-8", "replace")
        if text == "disarm":
            deadline = None
        else:
            seconds, _, word = text.partition("\t")
            deadline = time.monotonic() + float(seconds)
"""


class LastWordFuse:
    """Ends a process whose Python threads cannot run, with a last word on its stderr.

    A thread that watches for a fault (`tfdist.ps.connection.PSWatchdog`) cannot act while
    another thread holds Python's lock in a call that never returns: TensorFlow registers
    each newly traced function on the remote tasks and waits for them while holding it, so
    a stopped ps freezes every Python thread of its workers. The fuse is a small child
    process (no TensorFlow) that the watcher re-arms at every round with `arm(seconds,
    word)`: if no round re-arms it within `seconds`, it writes `word` on the process's
    stderr and SIGKILLs it. A process that is itself stopped (SIGSTOP, ^Z, a debugger) is
    left alone, its count starting again (Linux: its state in /proc). It ends with the
    process (its stdin closes), or with `close()`.

    Args:
      target: the process id to end (None: this process).
      stderr: where the last word goes (None: this process's stderr; a test's pipe).
    """

    def __init__(self, target=None, stderr=None):
        import subprocess

        target = os.getpid() if target is None else target
        self._child = subprocess.Popen(
            [sys.executable, "-c", _FUSE_PROGRAM, str(target)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=stderr, close_fds=True)

    def _send(self, line):
        try:
            self._child.stdin.write(line.encode("utf-8") + b"\n")
            self._child.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the fuse has gone off, or was closed

    def arm(self, seconds, word):
        """Ends the process with `word` unless `arm` or `disarm` is called within
        `seconds`."""
        self._send(f"{seconds!r}\t{' '.join(word.splitlines())}")

    def disarm(self):
        self._send("disarm")

    def close(self):
        """Disarms the fuse and ends its process."""
        try:
            self._child.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self._child.wait(timeout=5)
        except Exception:  # noqa: BLE001 - a fuse that does not end is killed
            self._child.kill()
            self._child.wait()
