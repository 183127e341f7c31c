"""A worker's side of the protocol with one ps task (see `tfdist.ps.protocol`)."""

import os
import time

import tensorflow as tf

from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.snapshot import ShardSnapshot
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


class RunError(RuntimeError):
    """A ps task refused this worker, or its run failed."""


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

    def push_and_receive(self, tag, payload, values):
        """Pushes, then takes this worker's reply: `(token, stats, flat values)`.

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
            with tf.control_dependencies([check]):
                reply = tf.concat([wire.ints_as_floats(tf.concat([token[None], stats], 0)),
                                   values], axis=0)
        ints = 2 * (1 + protocol.num_stats(self.num_workers))
        with tf.device(self.connection.host_device):  # the token and stats go to host variables
            head, values = tf.split(reply, [ints, -1])
            token_and_stats = wire.floats_as_ints(head)
        return token_and_stats[0], token_and_stats[1:], values

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
        """Asks for the current weights (eagerly); returns `(token, stats, values)`.

        Replies meant for an earlier process of this rank (a restarted worker) are skipped.
        """
        with tf.init_scope():
            try:
                self.send_control(protocol.SYNC)
            except tf.errors.OpError:
                raise RunError(f"{self.task}: run {self.run} has ended") from None
            while True:
                try:
                    token, message, stats, values = self._dequeue()
                except tf.errors.OutOfRangeError:
                    raise RunError(f"{self.task}: run {self.run} has ended") from None
                message = message.numpy().decode("utf-8", "replace")
                if int(token) < 0:
                    raise RunError(f"{self.task}: {message}")
                if message == protocol.SYNC_MESSAGE:
                    return token, stats, values
                self.skipped_replies += 1

    def read_progress(self):
        with tf.init_scope():
            return protocol.progress_dict(self.progress.numpy().tolist(), self.num_workers)
