"""Whether a TensorFlow server is alive: it answers an RPC within a deadline.

A TCP connect is not enough to tell a live task from a hung one (the kernel accepts
connections for a stopped process). `ServerProbe` asks the server itself; `ProbePool` asks
several at once. The ps tasks probe their workers with it, the workers their ps tasks, and
Stochastic Gradient Push's workers their peers.
"""

import concurrent.futures
import logging
import threading

import tensorflow as tf

from tfdist import _tf_compat
from tfdist._args import check_seconds
from tfdist.cluster.network import is_listening

log = logging.getLogger("tfdist")

# Answers of `ServerProbe`.
ANSWERED = "answered"  # the server answered an RPC within the deadline
STALLED = "stalled"  # its port accepts connections, but it did not answer in time
GONE = "gone"  # nothing accepts connections at its address
# A new process answers at its address: the server the probe knew (its session there) is
# gone. Only from a probe made with `report_restarts=True`; else such a server is ANSWERED.
RESTARTED = "restarted"

# Seconds a server gets to answer one probe.
PROBE_TIMEOUT = 2.0
# What `is_listening` may add to each probe before its RPC (its own deadline).
_LISTEN_CHECK_SECONDS = 0.5


class ServerProbe:
    """Asks TensorFlow servers whether they answer an RPC within a deadline.

    A TCP connect is not enough: the kernel accepts connections for a stopped process (a
    hung machine, SIGSTOP) as for a live one. So a probe is an RPC to the server's master
    service, made by TensorFlow's own gRPC runtime: a `tf.compat.v1.Session` on
    `grpc://address`. The first probe of a server creates a session there (CreateSession,
    which lists only the probed task's own devices, through `device_filters`); each later
    one asks that session for its devices (ListDevices). Both are answered by the server's
    RPC threads: no op runs, no thread of the training process is needed (a worker whose
    Python thread sleeps or computes answers). A server that restarted answers "session
    not found": it is alive (`ANSWERED`, or `RESTARTED` with `report_restarts`: a worker
    whose ps task was replaced lost the shard it held), and the next probe creates a new
    session there. So is a server found at an address where the server it knew was seen
    gone in between (a replaced task is down while it starts). A session is kept per
    address for as long as its server lives.

    TensorFlow logs, in C++: the probed server, once per session (at INFO, hidden from
    TF_CPP_MIN_LOG_LEVEL=1), "Scanning workers for devices" (and, the first time,
    "Initializing CoordinationService": its first worker session initialises the
    coordination service its eager context was configured with; no agent connects to it);
    this process, for each ListDevices without an answer (at ERROR), "Could not list
    devices".

    A probe makes at most one RPC, with the deadline `timeout`, after a TCP connect of at
    most half a second: a port that refuses connections is `GONE` at once, without an RPC
    (whose retries would take the whole deadline).

    Example:

        probe = ServerProbe(timeout=2.0)
        probe("localhost:2223", "/job:worker/task:0")  # ANSWERED, STALLED or GONE
        probe.errors["localhost:2223"]  # why the last probe there did not answer

    Args:
      timeout: seconds a server gets to answer one probe.
      report_restarts: answer `RESTARTED`, not `ANSWERED`, when a new process answers at an
        address where the probe had a session (a ps task replaced under its workers).
    """

    def __init__(self, timeout=PROBE_TIMEOUT, report_restarts=False):
        self.timeout = check_seconds("timeout", timeout)
        self.report_restarts = report_restarts
        self.errors = {}  # address: why its last probe did not answer
        self._sessions = {}  # address: the session kept on its server
        self._lost = set()  # addresses whose known server went away (GONE) since
        self._server_locks = {}  # address: held while its server is probed
        self._lock = threading.Lock()

    def __call__(self, address, task):
        """Probes the server of `task` (e.g. "/job:worker/task:0") at `address` ("host:port").

        Servers at different addresses may be probed at once, from several threads.

        Returns `ANSWERED`, `STALLED` or `GONE` (or `RESTARTED`: `report_restarts`).
        """
        with self._lock:
            server_lock = self._server_locks.setdefault(address, threading.Lock())
        with server_lock:
            return self._probe(address, task)

    def _probe(self, address, task):
        if not is_listening(address, timeout=min(_LISTEN_CHECK_SECONDS, self.timeout)):
            if address in self._sessions:
                # The server it knew went away: whoever answers there next is a new process
                # (a replaced task is down for seconds, while it imports TensorFlow).
                self._lost.add(address)
            self._discard(address)
            self.errors[address] = "nothing accepts connections there"
            return GONE
        session = self._sessions.get(address)
        try:
            if session is None:
                session = self._new_session(address, task)
                _tf_compat.create_remote_session(session)
                self._sessions[address] = session
                if address in self._lost:
                    self._lost.discard(address)
                    if self.report_restarts:
                        self.errors[address] = ("a new process answers there: the one this "
                                                "probe had a session on went away")
                        return RESTARTED
            else:
                session.list_devices()
        except tf.errors.OpError as e:
            if self._sessions.get(address) is not session:
                _tf_compat.discard_remote_session(session)  # never created there
            elif isinstance(e, tf.errors.InvalidArgumentError) and (
                    "is not found" in e.message):
                # The server answered that it does not know the session: a new process.
                self._discard(address)
                if self.report_restarts:
                    self.errors[address] = ("a new process answers there, which does not "
                                            "know the session this probe had on the old one")
                    return RESTARTED
                self.errors.pop(address, None)
                return ANSWERED
            first_line = e.message.strip().split("\n")[0]
            self.errors[address] = (f"{type(e).__name__}: {first_line}" if first_line
                                    else type(e).__name__)
            return STALLED
        self.errors.pop(address, None)
        return ANSWERED

    def _new_session(self, address, task):
        graph = tf.Graph()
        with graph.as_default():
            tf.constant(0)  # a session is created with a graph; nothing runs it
        config = tf.compat.v1.ConfigProto(
            operation_timeout_in_ms=max(1, int(self.timeout * 1000)), device_filters=[task])
        return tf.compat.v1.Session(f"grpc://{address}", graph=graph, config=config)

    def _discard(self, address):
        session = self._sessions.pop(address, None)
        if session is not None:
            _tf_compat.discard_remote_session(session)

    def close(self):
        """Closes the sessions kept on the servers (one RPC each, within the deadline)."""
        with self._lock:
            locks = list(self._server_locks.items())
        for address, server_lock in locks:
            with server_lock:
                session = self._sessions.pop(address, None)
                if session is None:
                    continue
                try:
                    session.close()
                except tf.errors.OpError:
                    pass  # that server is gone or stalled: its session goes with it


# Threads probing servers at once.
_PROBE_THREADS = 16


class ProbePool:
    """Probes several servers at once with one `ServerProbe`: a stalled server's probe takes
    its whole deadline and must not delay the answers of the others.

    Args:
      probe: the `ServerProbe` (or any `probe(address, task) -> answer`).
    """

    def __init__(self, probe):
        self.probe = probe
        self._pool = None

    def __call__(self, targets):
        """`[answer]` of each `(address, task)` of `targets`, in order."""
        try:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=_PROBE_THREADS, thread_name_prefix="tfdist-probe")
            return list(self._pool.map(lambda target: self.probe(*target), targets))
        except RuntimeError as error:
            # The interpreter is shutting down (a worker leaving at exit names a lost ps):
            # no new pool thread may start ("cannot schedule new futures after interpreter
            # shutdown"). One after the other, then; any other error is raised.
            if "shutdown" not in str(error):
                raise
            return [self.probe(*target) for target in targets]

    def close(self):
        """Stops the probing threads and closes the probe's sessions."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.probe.close()


def probing_seconds(probe_timeout, targets):
    """The longest a probing thread of `targets` servers can take to end once told to stop:
    a round of probes one after the other (what a round falls back to at exit), each its
    port check and its deadline (`probe_timeout`), then closing its session on each server
    (one RPC each, within the deadline)."""
    return max(1, targets) * (2 * probe_timeout + _LISTEN_CHECK_SECONDS)


def join_prober(thread, timeout):
    """Waits up to `timeout` s for `thread` (a daemon thread that probes servers, already told
    to stop) to end; not when called from that thread itself.

    A probe waits on an RPC with Python's lock released. If the interpreter finalizes
    meanwhile (the main thread returned: a worker's normal exit), the thread that takes the
    lock back is ended by CPython with a forced unwind, which TensorFlow's C++ frames do not
    let through: the process aborts (SIGABRT, "FATAL: exception not rethrown") after its
    work is done, and its job fails. Whoever stops such a thread at exit waits for its
    round of probes to end first.
    """
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    if thread.is_alive():
        log.warning("tfdist: %s still waits on a server after %g s: if the process exits "
                    "now, it may abort as it ends", thread.name, timeout)
        return False
    return True
