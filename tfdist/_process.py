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


def flush_standard_streams():
    """Flushes stdout and stderr, as the interpreter does at its end (a closed or broken one is
    passed over): before an `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def end_with_last_word(code=1):
    """Ends this process now, with exit code `code`, after the logged error that says why.

    A worker whose ps task is gone can do nothing more, and TensorFlow's own teardown (its
    eager context trying to reach the lost task) would print hundreds of lines of gRPC errors
    after that error: the last screen a user sees would be noise. Like a ps task at its end
    (`tfdist.launch.main`), the process flushes what it has logged and printed, and exits
    without that teardown."""
    logging.shutdown()
    flush_standard_streams()
    os._exit(code)


# The fuse's process: stdlib only (it starts in milliseconds, without TensorFlow). Each line
# on its stdin re-arms it: "<seconds>\t<targets>\t<last word>", targets "name=host:port|...".
# With no line for that long, it checks the targets: each is a gRPC server (a ps task), alive
# when it sends its HTTP/2 SETTINGS within a deadline in answer to a client's preface (a
# stopped server's kernel still accepts the connection, but nothing answers). If every target
# answers, the process is only busy (a long call holding Python's lock while the ps tasks are
# fine): the count starts again. Otherwise it writes the last word to its stderr (the
# worker's), "{silent}" replaced by the targets that did not answer, and SIGKILLs the worker.
# With no targets it goes off unchecked. A worker that is itself stopped (SIGSTOP, ^Z, a
# debugger: its threads do not run, but nothing waits in vain) is left alone, the count
# starting again. It ends when stdin closes (the worker ended, however it ended: only the
# worker holds the pipe's other end).
_FUSE_PROGRAM = r"""
import os, select, signal, socket, sys, threading, time
target = int(sys.argv[1])
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

def answers(address, timeout=2.0):
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.sendall(PREFACE)
            got = b""
            while len(got) < 9:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                conn.settimeout(left)
                chunk = conn.recv(9 - len(got))
                if not chunk:
                    return False
                got += chunk
            return got[3] == 4  # the server's SETTINGS frame
    except (OSError, ValueError):
        return False

def silent(targets):
    found = {}
    threads = [threading.Thread(target=lambda t=t: found.__setitem__(t, answers(t[1])))
               for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [t for t in targets if not found.get(t)]

def started(pid):  # the process's start time (a reused pid is another process)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None

birth = started(target)
seconds, targets, word, buffered = None, [], "", b""
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
        quiet = silent(targets) if targets else []
        if targets and not quiet:  # busy, not waiting on a stopped ps: wait on
            deadline = time.monotonic() + float(seconds)
            continue
        if started(target) != birth:  # gone (a child of it kept the pipe open)
            break
        named = " or ".join(f"{name} at {address}" for name, address in quiet)
        sys.stderr.write(word.replace("{silent}", named) + "\n")
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
            seconds, _, rest = text.partition("\t")
            listed, _, word = rest.partition("\t")
            targets = [tuple(item.rsplit("=", 1)) for item in listed.split("|") if item]
            deadline = time.monotonic() + float(seconds)
"""


class LastWordFuse:
    """Ends a process whose Python threads cannot run, with a last word on its stderr.

    A thread that watches for a fault (`tfdist.ps.connection.PSWatchdog`) cannot act while
    another thread holds Python's lock in a call that never returns: TensorFlow registers
    each newly traced function on the remote tasks and waits for them while holding it, so
    a stopped ps freezes every Python thread of its workers. The fuse is a small child
    process (no TensorFlow) that the watcher re-arms at every round with `arm(seconds,
    word, targets)`: if no round re-arms it within `seconds` and a target (a ps task's gRPC
    server) does not answer then, it writes `word` on the process's stderr and SIGKILLs it;
    while every target answers, a long call is only a busy process, and it waits on. A
    process that is itself stopped (SIGSTOP, ^Z, a debugger) is left alone, its count
    starting again (Linux: its state in /proc). It ends with the process (its stdin
    closes), or with `close()`.

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

    def arm(self, seconds, word, targets=()):
        """Ends the process with `word` unless `arm` or `disarm` is called within
        `seconds`, and some of `targets` (`[(name, "host:port")]` of gRPC servers) does not
        answer then: `{silent}` in `word` names those. With every target answering the
        process is only busy, and the count starts again; with no targets the fuse goes off
        unchecked."""
        listed = "|".join(f"{name}={address}" for name, address in targets)
        self._send(f"{seconds!r}\t{listed}\t{' '.join(word.splitlines())}")

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
