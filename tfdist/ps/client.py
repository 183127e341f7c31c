"""A worker's side of the protocol with one ps task (see `tfdist.ps.protocol`)."""

import os
import time
import typing

import tensorflow as tf

from tfdist import _bitcast
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.snapshot import ShardSnapshot
from tfdist.ps.spec import RunError
from tfdist.ps.spec import spec_of

# The largest payload (bytes) that travels packed with the push's head and values.
PACK_LIMIT = 16 << 20


# How a push's payload tensor travels (`ShardClient.push_and_receive`): packed, as a float32
# vector of static size, as float32 or int64 values of a size known when the step runs, or
# beside the pack.
_STATIC, _FLOATS, _INTS, _BESIDE = "static", "floats", "ints", "beside"


def _pack_kind(tensor):
    if tensor.shape.rank != 1:
        return _BESIDE
    if tensor.dtype == tf.float32:
        return _STATIC if tensor.shape.is_fully_defined() else _FLOATS
    return _INTS if tensor.dtype == tf.int64 else _BESIDE


# What a closed run's queues raise: closed (a push, a dequeue of the empty queue), or
# freed. Any other error (the ps task unreachable, stopped) is not "the run ended", and is
# raised as it is, for the caller to name the ps task (`unreachable_ps`).
_RUN_ENDED = (tf.errors.CancelledError, tf.errors.OutOfRangeError, tf.errors.NotFoundError)


class Reply(typing.NamedTuple):
    """A ps task's reply to this worker.

    Attributes:
      token: the global step of the weights it carries.
      stats: the progress vector (`protocol.progress_dict`).
      values: the shard's flat values (`protocol.ShardLayout.split_reply`).
      dropped: (a bool tensor) the push it answers was dropped as stale, its weights are
        the current ones; False for the answer to a SYNC.
      reads: the values of the variables `push_and_receive` was asked to read on the ps
        task once the reply was taken (`reads`).
    """

    token: typing.Any
    stats: typing.Any
    values: typing.Any
    dropped: typing.Any = False
    reads: tuple = ()


def _unclaimed(answer):
    """Whether a hello's answer is a run the chief has not said hello to (and so has not
    initialised), unfinished."""
    return not (answer.get("finished") or answer.get("initialized", True)
                or answer.get("chief", True))


def check_one_run(answers, ps_names, ps_addresses, job):
    """Raises `RunError` unless the hello answers of every ps task describe one run.

    Each ps task decides on its own whether the worker joins a run in progress, starts one
    (the chief then initialises its masters) or comes back to one that finished: a ps task
    started again empty under a run (in progress or finished) would have the chief
    initialise its shard afresh beside the others' trained ones, its optimizer's step
    included, and leave any other worker waiting for an initialisation that never comes.
    So the answers must agree, for every worker: the chief's all say initialise, or none
    does; another worker's answers hold no run the chief has initialised beside one the
    chief never said hello to (the chief says hello to every ps task before it initialises
    any: such a run is not the one it initialised). Workers starting one job at once may
    each start its run on a different ps task, and the chief initialises the shards one
    after the other: neither is refused. The error names each ps task and what it holds.

    Args:
      answers: the answers of the ps tasks' hellos, in ps order (of a worker that is not
        the chief, those of runs the chief had not said hello to asked again after the
        others: `agree_on_one_run`).
      ps_names, ps_addresses: each ps task's name and address.
      job: this worker's job id.
    """

    def state(answer):
        if answer.get("finished"):
            return "finished"
        if answer["initialize"]:
            return "new"
        if answer.get("initialized", True):
            return "in progress"
        return "unclaimed" if _unclaimed(answer) else "starting"

    states = [state(a) for a in answers]
    if len(set(states)) <= 1 or set(states) <= {"unclaimed", "starting"} or (
            set(states) <= {"starting", "in progress"}):
        return
    held = {"new": f"holds no run of job {job!r} (started empty: a replacement ps task?)",
            "unclaimed": "holds run {run} of job {job!r}, which its chief never joined "
                         "(started empty: a replacement ps task?)",
            "starting": "holds run {run} of job {job!r}, which its chief has not initialised",
            "in progress": "holds run {run} of job {job!r} in progress",
            "finished": "holds run {run} of job {job!r}, finished"}
    shards = ", while ".join(
        f"{name} at {address} " + held[s].format(run=a.get("run"), job=a.get("job"))
        for name, address, a, s in sorted(zip(ps_names, ps_addresses, answers, states),
                                           key=lambda t: t[3] not in ("new", "unclaimed")))
    raise RunError(
        f"the ps tasks do not hold one run: {shards}. A run cannot go on with some shards "
        "trained and others fresh: the shards of the ps tasks without the run are lost, "
        "optimizer state included. Restart the job from the chief's last checkpoint: stop "
        "every worker (each ps task ends its run once none is left) and start them again, "
        "or restart every ps task")


def agree_on_one_run(clients, answers, job):
    """`check_one_run` on the answers of this worker's hellos to `clients`' ps tasks.

    A worker that is not the chief, finding a run the chief initialised on one ps task,
    asks again (a second hello) the ps tasks whose run the chief had not said hello to when
    they answered: it may have since (a job starting: this worker's hello started the run
    there, then the chief said hello to every ps task and initialised them). When the check
    refuses, the runs that cannot be this job's (those the chief never said hello to, or
    that the chief was told to initialise) end at once with its error, on their ps tasks:
    a worker that joined one meanwhile is told, instead of waiting `init_timeout` for an
    initialisation that never comes.

    Returns the answers checked.
    """
    if any(a.get("initialized") and not a.get("finished") for a in answers):
        answers = [client.hello_again() if _unclaimed(answer) else answer
                   for client, answer in zip(clients, answers)]
    connection = clients[0].connection
    try:
        check_one_run(answers, connection.ps_names, connection.ps_addresses, job)
    except RunError as error:
        for client, answer in zip(clients, answers):
            if answer["initialize"] or _unclaimed(answer):
                client.refuse(answer["run"], str(error))
        raise
    return answers


class ShardClient:
    """Talks to ps task `shard`: hello, then pushes and replies within its run.

    Args:
      connection: the worker's `PSConnection`.
      shard: the ps task's index.
    """

    def __init__(self, connection, shard):
        self.connection = connection
        self.shard = shard
        self.rank = connection.rank
        self.device = connection.ps_devices[shard]
        self.task = connection.ps_names[shard]
        self.run = None
        self.skipped_replies = 0  # replies to an earlier process of this rank, skipped at sync
        with tf.init_scope(), tf.device(self.device):
            self.control = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.string], shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=protocol.CONTROL_QUEUE)
            self.answers = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.string], shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=f"hello/{self.rank}")

    def _send_control(self, message):
        with tf.init_scope(), tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.control,
                                      components=[tf.constant(wire.encode(message))])

    def hello(self, spec, timeout=60.0):
        """Joins (or starts) the ps task's run for `spec`; returns the ps's answer.

        Raises `RunError` if no answer comes within `timeout` seconds (a ps task that runs
        no tfdist service: a bare `tf.distribute.Server`).
        """
        spec = spec_of(spec)
        self._hello_args = (spec, timeout)
        nonce = os.urandom(8).hex()
        self._send_control({"type": "hello", "rank": self.rank, "nonce": nonce,
                            "spec": spec.to_json()})
        deadline = time.monotonic() + timeout
        while True:
            with tf.init_scope(), tf.device(self.device):
                while int(tf.raw_ops.QueueSizeV2(handle=self.answers)) == 0:
                    if time.monotonic() > deadline:
                        raise RunError(
                            f"{self.task} at {self.connection.ps_addresses[self.shard]} did "
                            f"not answer within {timeout:g} s. Serve ps tasks with "
                            "`tfdist-launch --job_name=ps` (`tfdist.launch.server.serve`): a "
                            "bare tf.distribute.Server runs no tfdist service")
                    time.sleep(0.02)
                text = tf.raw_ops.QueueDequeueV2(handle=self.answers,
                                                 component_types=[tf.string])[0]
            answer = wire.decode(text.numpy())
            if answer.get("nonce") == nonce:  # older answers were for an earlier process
                break
        if answer.get("error"):
            raise RunError(f"{self.task} at {self.connection.ps_addresses[self.shard]}: "
                           f"{answer['error']}")
        self.open_run(answer["run"], spec)
        return answer

    def hello_again(self):
        """Says hello again, as the last time; returns the ps's new answer."""
        return self.hello(*self._hello_args)

    def refuse(self, run, error):
        """Tells the ps that this worker found its run `run` beside another of its job
        (`error`): a run not initialised yet ends with it."""
        self._send_control({"type": "refused", "rank": self.rank, "run": run, "error": error})

    def absent(self):
        """Tells the ps this worker will not train (it never joined a run)."""
        self._send_control({"type": "absent", "rank": self.rank})

    def open_run(self, run, spec):
        spec = spec_of(spec)
        self.run = run
        self.num_workers = spec.num_workers
        self.push_dtypes = None
        self.reply_queue = protocol.open_reply_queue(self.device, run, self.rank)
        self.progress, self.masters = protocol.open_run_variables(self.device, run, spec)
        self.update_lock = protocol.open_update_lock(self.device, run)
        # Checkpoints (Keras's whole-model reads) read the shard between two updates.
        self.snapshot = ShardSnapshot(
            self.device, self.update_lock,
            [self.masters[e.path] for e in spec.variables if not e.table])

    def open_push_queue(self, payload_dtypes, num_sparse=0):
        self.push_dtypes = wire.push_dtypes(payload_dtypes, num_sparse)
        self.push_queue = protocol.open_push_queue(self.device, self.run, self.push_dtypes)

    # In-graph (or eager) ---------------------------------------------------------------------

    def push_and_receive(self, tag, payload, values, reads=()):
        """Pushes, then takes this worker's reply (a `Reply`: whether the push was dropped
        comes with it). `reads`: floating variables on this ps task, read once the reply is
        taken; their values come back in the reply's pack (`Reply.reads`), not as a read
        of their own after it (a round trip more).

        One tensor travels each way where it can: every tensor that crosses to or from the
        ps within a step is an RPC of its own, and the ps's CPU per round trip doubles
        from 1 to 4 tensors each way (4,810 floats, measured on this machine). The tag, the
        rank, the values and the payload travel packed in one float32 vector, unpacked into
        the push queue's components on the ps; the reply's token, progress and values come
        back packed the same way. The int64s travel as the float32 words of their bits
        (concat and split copy them untouched: nothing computes on them): the tag and rank,
        and the rows of a gradient pushed as rows (an embedding's, a table's), which travel
        with their values, their sizes known only when the step runs, in the head. A
        payload of other dtypes (a compressor's codes) travels beside the pack, and static
        float32 payloads of more than `PACK_LIMIT` bytes in all are not packed (each pack
        and unpack copies the shard).

        Raises in-graph, with the ps's message, if the reply is an error.
        """
        payload = list(payload)
        kinds = [_pack_kind(p) for p in payload]
        if sum(4 * p.shape.num_elements() for p, kind in zip(payload, kinds)
               if kind == _STATIC) > PACK_LIMIT:
            kinds = [_BESIDE if kind == _STATIC else kind for kind in kinds]
        dynamic = [(p, kind) for p, kind in zip(payload, kinds) if kind in (_FLOATS, _INTS)]
        sizes = [tf.size(p, out_type=tf.int64) for p, _ in dynamic]
        head = wire.ints_as_floats(tf.stack([tf.cast(tag, tf.int64),
                                             tf.constant(self.rank, tf.int64), *sizes]))
        static = [p for p, kind in zip(payload, kinds) if kind == _STATIC]
        tail = [p if kind == _FLOATS else wire.ints_as_floats(p) for p, kind in dynamic]
        flat = tf.concat([head, values, *static, *tail], axis=0)
        splits = [int(t.shape[0]) for t in (head, values, *static)] + [-1]
        with tf.device(self.device):
            head, values, *rest = tf.split(flat, splits)
            ints = wire.floats_as_ints(head)
            unpacked = iter(rest[:-1])
            if dynamic:
                words = ints[2:] * tf.constant([2 if kind == _INTS else 1
                                                for _, kind in dynamic], tf.int64)
                pieces = tf.split(rest[-1], words, num=len(dynamic))
                unpacked_dynamic = iter(piece if kind == _FLOATS else wire.floats_as_ints(piece)
                                        for piece, (_, kind) in zip(pieces, dynamic))
            components = [p if kind == _BESIDE else next(unpacked) if kind == _STATIC
                          else next(unpacked_dynamic) for p, kind in zip(payload, kinds)]
            push = tf.raw_ops.QueueEnqueueV2(
                handle=self.push_queue,
                components=[ints[0], tf.cast(ints[1], tf.int32), *components, values])
            with tf.control_dependencies([push]):
                token, message, stats, values = self._dequeue()
                check = tf.debugging.Assert(token >= 0, [message])
                dropped = tf.cast(tf.equal(message, protocol.DROPPED_MESSAGE), tf.int64)
            with tf.control_dependencies([check]):
                reply = tf.concat([wire.ints_as_floats(tf.concat(
                    [token[None], dropped[None], stats], 0)),
                    *[_bitcast.as_float32_words(v.read_value()) for v in reads], values],
                    axis=0)
        ints = 2 * (2 + protocol.num_stats(self.num_workers))
        sizes = [_bitcast.float32_words_size(v.dtype, v.shape) for v in reads]
        with tf.device(self.connection.host_device):  # the token and stats go to host variables
            head, *words, values = tf.split(reply, [ints, *sizes, -1])
            head = wire.floats_as_ints(head)
            read = tuple(_bitcast.from_float32_words(w, v.dtype, v.shape)
                         for w, v in zip(words, reads))
        return Reply(head[0], head[2:], values, tf.not_equal(head[1], 0), read)

    def _dequeue(self):
        with tf.device(self.device):
            return tf.raw_ops.QueueDequeueV2(handle=self.reply_queue,
                                             component_types=wire.REPLY_DTYPES)

    def send_control(self, kind):
        with tf.init_scope(), tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(
                handle=self.push_queue,
                components=[tf.constant(kind, tf.int64), tf.constant(self.rank, tf.int32),
                            *[tf.zeros([0], d) for d in self.push_dtypes[2:]]])

    def sync(self):
        """Asks for the current weights (eagerly); returns a `Reply`.

        Replies meant for an earlier process of this rank (a restarted worker) are skipped.
        A run that ended (its queues closed) may have left why in this worker's reply
        queue (a run that failed tells every worker in it): that is raised. A run whose
        queues are closed or freed raises `RunError`; any other error (the ps task out of
        reach) is raised as TensorFlow's, which the worker's `leave()` at exit names.
        """
        with tf.init_scope():
            try:
                self.send_control(protocol.SYNC)
            except tf.errors.CancelledError:
                pass  # the run closed its queues: why, if it said, waits in the reply queue
            except _RUN_ENDED:
                raise RunError(f"{self.task}: run {self.run} has ended") from None
            while True:
                try:
                    token, message, stats, values = self._dequeue()
                except _RUN_ENDED:
                    raise RunError(f"{self.task}: run {self.run} has ended") from None
                message = message.numpy().decode("utf-8", "replace")
                if int(token) == protocol.FENCED:
                    self.skipped_replies += 1  # an earlier process's fenced push
                    continue
                if int(token) < 0:  # (a message of tfdist's names its task itself)
                    raise RunError(message if message.startswith("tfdist: ")
                                   else f"{self.task}: {message}")
                if message == protocol.SYNC_MESSAGE:
                    return Reply(token, stats, values)
                self.skipped_replies += 1

    def read_progress(self):
        with tf.init_scope():
            return protocol.progress_dict(self.progress.numpy().tolist(), self.num_workers)
