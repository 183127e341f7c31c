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
