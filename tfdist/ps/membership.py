"""Who is in a run, and who is still alive: membership and liveness of the workers.

Each worker rank of a run is expected (not seen yet), live (training), left or died; the
run's progress vector shows it to every worker. A run ends when its policy needs no more
pushes from the live ones. The `LivenessWatcher` of a ps task probes the servers of the
current run's workers with an RPC (`tfdist.cluster.liveness`) and tells the run of those
that went away, stopped answering, or never came.
"""

import logging
import threading

import tensorflow as tf

from tfdist.cluster.liveness import Liveness
from tfdist.cluster.liveness import Target
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT
from tfdist.cluster.probe import STALLED
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.protocol import DIED
from tfdist.ps.protocol import EXPECTED
from tfdist.ps.protocol import LEFT
from tfdist.ps.protocol import LIVE

log = logging.getLogger("tfdist")

_IN_RUN = (EXPECTED, LIVE)


class Membership:
    """The status of each worker rank of one run.

    Args:
      num_workers: the number of worker ranks.
      lock: the service's lock, which orders "a worker joins the run" against "the run
        ends".
      progress: the run's progress vector, where each rank's status is published; None
        until it is open.
      device: the device of `progress`.
    """

    def __init__(self, num_workers, lock, progress=None, device=None):
        self.status = [EXPECTED] * num_workers
        # Per rank: a hello admitted it since its last SYNC (a new process: its SYNC joins it
        # even where a late DEAD entry for its earlier process came in between).
        self.admitted = [False] * num_workers
        self.lock = lock
        self.progress = progress
        self.device = device
        self.closing = False  # set under the lock: no worker may join any more

    @property
    def live(self):
        """The ranks expected or training."""
        return [r for r, s in enumerate(self.status) if s in _IN_RUN]

    def live_mask(self):
        return tf.constant([s in _IN_RUN for s in self.status])

    def in_run(self, rank):
        return self.status[rank] in _IN_RUN

    def admit(self, rank, finished):
        """Under the lock: lets worker `rank` join; False if the run is ending (`finished`:
        its updater is done).

        A rank that left or died is expected again (a restarted worker), so the run does not
        end before its SYNC arrives.
        """
        if self.closing or finished:
            return False
        if self.status[rank] in (LEFT, DIED):
            self.status[rank] = EXPECTED
        self.admitted[rank] = True
        return True

    def may_join(self, rank):
        """Whether a SYNC of worker `rank` joins it: it is in the run, or a hello admitted
        it since its last SYNC. Not so a worker the run counted out (declared dead) that
        woke and syncs with no hello: an earlier process, fenced."""
        with self.lock:
            return self.in_run(rank) or self.admitted[rank]

    def end_if_nobody_is_left(self, policy):
        """Closes the run if `policy` needs no push from the live workers; True if closed."""
        with self.lock:
            if policy.required(len(self.live)) == 0:
                self.closing = True
        return self.closing

    def _set(self, rank, status):
        with self.lock:
            self.status[rank] = status
        with tf.device(self.device):
            self.progress.scatter_nd_update([[protocol.STAT_MEMBERS + rank]], [status])

    def join(self, rank):
        """Worker `rank` trains (its SYNC came)."""
        with self.lock:
            self.admitted[rank] = False
        if self.status[rank] != LIVE:
            self._set(rank, LIVE)

    def leave(self, rank):
        """Worker `rank` left; False if it was not in the run."""
        if not self.in_run(rank):
            return False
        self._set(rank, LEFT)
        return True

    def die(self, rank):
        """Worker `rank` died: its status before (EXPECTED or LIVE), or None if it was not
        in the run."""
        was = self.status[rank]
        if was not in _IN_RUN:
            return None
        self._set(rank, DIED)
        return was


class BadControlMessage(ValueError):
    """A control message the service cannot act on; it is logged and ignored."""


# The fields of each control message type and the JSON types they must have.
_CONTROL_FIELDS = {"hello": {"rank": int, "nonce": str, "spec": dict},
                   "absent": {"rank": int},
                   "refused": {"rank": int, "run": str, "error": str},
                   "stop": {}}
_TYPE_NAMES = {int: "an integer", str: "a string", dict: "a JSON object"}


def _a(kind):
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} message"


def control_message(text, num_workers=None):
    """A message of the control queue (hello, absent, refused, stop), as the dict the service
    acts on.

    What a worker says about itself reaches a run only through here and `LivenessWatcher`.
    Anything may arrive on the queue (any process that reaches the ps port can enqueue), so
    the message is checked before anyone acts on it.

    Args:
      text: the message as it travelled (bytes or str of JSON).
      num_workers: None, or the number of worker ranks a `rank` field must be below.

    Raises:
      BadControlMessage: naming what is wrong (not JSON, not an object, an unknown type, a
        missing field, a field of the wrong type, a rank out of range) and what was received.
    """
    shown = repr(text if len(text) <= 200 else text[:200] + (b"..." if isinstance(
        text, bytes) else "..."))
    try:
        message = wire.decode(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadControlMessage(f"not JSON ({e}). Received: {shown}") from None
    if not isinstance(message, dict):
        raise BadControlMessage(f"not a JSON object but a {type(message).__name__}. "
                                f"Received: {shown}")
    kind = message.get("type")
    if kind not in _CONTROL_FIELDS:
        raise BadControlMessage(f"`type` must be one of {sorted(_CONTROL_FIELDS)}. "
                                f"Received: type={kind!r}")
    for field, wanted in _CONTROL_FIELDS[kind].items():
        if field not in message:
            raise BadControlMessage(f"{_a(kind)} needs a `{field}` field. "
                                    f"Received: {shown}")
        value = message[field]
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise BadControlMessage(f"`{field}` of {_a(kind)} must be "
                                    f"{_TYPE_NAMES[wanted]}. Received: {field}={value!r}")
    if "rank" in _CONTROL_FIELDS[kind]:
        check_rank(message["rank"], num_workers, kind)
    return message


def check_rank(rank, num_workers, kind):
    """Raises `BadControlMessage` unless `rank` is a worker rank (below `num_workers`)."""
    if rank < 0 or (num_workers is not None and rank >= num_workers):
        bound = "" if num_workers is None else f" and below num_workers={num_workers}"
        raise BadControlMessage(f"`rank` of {_a(kind)} must be >= 0{bound}. "
                                f"Received: rank={rank}")


class LivenessWatcher:
    """Finds workers that went away, stopped answering, or never came, and tells their run.

    Each round probes the servers of every worker of the current run at once
    (`tfdist.cluster.liveness.Liveness`). A worker that has joined, or whose server was
    seen, is dead after `misses_to_dead` probes in a row found nothing listening at its
    address (a killed process), or once it has not answered for the run's `stall_timeout`
    (`ShardSpec.stall_timeout`: the job's strategy argument) while its port accepts
    connections (a stopped process, a hung machine); one whose server never answered is
    dead `init_timeout` after the run started. A slow worker is never cut off: its server's
    RPC threads answer while its training thread computes or waits.

    Args:
      current_run: a function returning the service's current run (or None): it has
        `run`, `members` (a `Membership`), `finished`, `created`, `spec`, `stalls` (a dict
        where the watcher says, by rank, why a worker it tells dead stopped answering) and
        `send_control(tag, rank)`.
      interval: seconds between rounds of probes.
      misses_to_dead: probes in a row finding nothing listening after which a worker is
        dead.
      probe: a `ServerProbe` (None: a new one, with its default deadline; a run's
        stall_timeout below that deadline is noticed at the first probe past it).
      clock: for tests (`time.monotonic`).
    """

    def __init__(self, current_run, interval, misses_to_dead, probe=None, clock=None):
        self.current_run = current_run
        self.interval = interval
        self.liveness = Liveness(DEFAULT_STALL_TIMEOUT, misses_to_dead=misses_to_dead,
                                 probe=probe, clock=clock)
        self.probe = self.liveness.probe
        self.stopped = threading.Event()

    def watch(self):
        try:
            while not self.stopped.wait(self.interval):
                self.poll()
        finally:
            self.close()

    def close(self):
        """Stops the probing threads and closes the probe's sessions."""
        self.liveness.close()

    def poll(self):
        """Probes the workers of the current run once; tells the run of the dead ones."""
        run = self.current_run()
        if run is None or run.finished.is_set():
            return
        spec, statuses = run.spec, list(run.members.status)
        targets = {}
        for rank, status in enumerate(statuses):
            if status not in _IN_RUN:
                self.liveness.forget((run.run, rank))
                continue
            came_by = None if status == LIVE else run.created + spec.init_timeout
            targets[(run.run, rank)] = Target(spec.worker_addresses[rank],
                                              spec.worker_tasks[rank], came_by)
        for dead in self.liveness.check(targets, stall_timeout=spec.stall_timeout):
            rank = dead.key[1]
            if dead.answer == STALLED:
                run.stalls[rank] = dead.why
                log.warning("tfdist: %s at %s stopped answering (%s): treated as dead",
                            spec.worker_tasks[rank], spec.worker_addresses[rank], dead.why)
            try:
                run.send_control(protocol.DEAD, rank)
            except tf.errors.OpError:
                pass  # the run ended meanwhile
