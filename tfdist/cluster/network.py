"""Free ports and task readiness on a cluster's network."""

import contextlib
import math
import os
import random
import socket
import time

from tfdist._args import check_int
from tfdist.cluster.config import parse_address

# Ports handed out by bind(0) come from the ephemeral range, where an outgoing connection can
# take the same port between our check and the server's bind ("connection reset by peer" seen
# on this machine). Pick ports below it instead.
_LOW_PORT, _HIGH_PORT = 15000, 30000


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _port_range(enough=1000):
    """Where to pick ports: outside the ephemeral range, wherever this machine puts it.

    15000-30000 below it when that leaves `enough` ports; else above it; else below it
    from 1024; else (an ephemeral range over every port) anywhere from 1024.
    """
    ephemeral_low, ephemeral_high = _ephemeral_range()
    for low, high in ((_LOW_PORT, min(_HIGH_PORT, ephemeral_low - 1)),
                      (ephemeral_high + 1, 65535), (1024, ephemeral_low - 1)):
        if high - low + 1 >= enough:
            return low, high
    return 1024, 65535


def _port_is_free(port):
    # TF servers listen on every interface, so the port must be free on the wildcard address.
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 on this machine
                continue
            return False
    return True


def pick_free_ports(count, rng=None):
    """Returns `count` distinct free TCP ports below the ephemeral range.

    Args:
      count: how many ports, at least 1.
      rng: optional `random.Random`, for reproducible choices in tests.

    Raises:
      ValueError: `count` is not a positive integer, or no free port was found.
    """
    check_int("count", count, low=1)
    rng = rng or random.Random()
    low, high = _port_range()
    ports = []
    for _ in range(200 * count):
        port = rng.randint(low, high)
        if port not in ports and _port_is_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise ValueError(f"found only {len(ports)} free ports of the {count} asked for between "
                     f"{low} and {high}")


def is_listening(address, timeout=0.5):
    """True if something accepts TCP connections at `host:port`."""
    host, port = parse_address(address)
    with contextlib.suppress(OSError):
        with socket.create_connection((host, port), timeout=timeout):
            return True
    return False


class TaskUnreachableError(RuntimeError):
    """A cluster task did not answer in time."""


# Set by `tfdist-launch --connect_timeout` (600 s in Kubernetes pods) for the command it runs:
# the defaults of the strategies' `connect_timeout` and `init_timeout`.
CONNECT_TIMEOUT_ENV = "TFDIST_CONNECT_TIMEOUT"
INIT_TIMEOUT_ENV = "TFDIST_INIT_TIMEOUT"
# Set by `tfdist-launch --stall_timeout`: the default `stall_timeout` of the parameter-server
# strategies.
STALL_TIMEOUT_ENV = "TFDIST_STALL_TIMEOUT"
# Seconds a task whose port accepts connections may go without answering an RPC before it is
# dead (a stopped process, a hung machine): the default `stall_timeout`.
DEFAULT_STALL_TIMEOUT = 60.0
# The id of the job a task belongs to, the same in every task of one launch and in a task its
# scheduler restarts (`LocalCluster` sets a new one per cluster): a run on the ps tasks
# belongs to one job (`tfdist.ps.worker.job_id`).
JOB_ID_ENV = "TFDIST_JOB_ID"


def timeout_from_env(variable, default, environ=None):
    """Seconds from environment variable `variable`, or `default` where it is unset or empty.

    Raises:
      ValueError: the variable holds something other than a positive number of seconds.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(variable, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"environment variable {variable} must be a positive number of "
                         f"seconds, e.g. 600. Received: {value!r}")
    return seconds


def wait_for_tasks(tasks, timeout=30.0, poll_interval=0.1):
    """Waits until every task accepts connections, or raises naming the first that did not.

    Args:
      tasks: a map from task name (e.g. `/job:ps/task:0`) to its `host:port`.
      timeout: seconds to wait in all.
      poll_interval: seconds between attempts.

    Raises:
      TaskUnreachableError: names the task, its address and the timeout.
    """
    deadline = time.monotonic() + timeout
    pending = dict(tasks)
    while pending:
        for name, address in list(pending.items()):
            if is_listening(address, timeout=min(0.5, poll_interval * 5)):
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            name, address = next(iter(pending.items()))
            raise TaskUnreachableError(
                f"{name} at {address} did not answer in {timeout:g} s"
                + (f" (nor did {len(pending) - 1} other task(s))" if len(pending) > 1 else ""))
        time.sleep(poll_interval)
