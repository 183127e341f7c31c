"""What the launcher tests check of the processes they start: alive, and gone in time."""

import os
import time

from tfdist.cluster import is_listening


def alive(pid):
    """Whether `pid` runs (a zombie is dead but not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(pids, address, timeout=20):
    """Waits up to `timeout` s until none of `pids` runs and nothing listens at `address`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (any(alive(pid) for pid in pids)
                                           or is_listening(address)):
        time.sleep(0.1)
