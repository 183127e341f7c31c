"""Runs a compressor inside a strategy's gradient all-reduce.

`GradientExchange.all_reduce` takes what Keras's optimizer hands the strategy (every
gradient, one tensor per local replica, with its variable's name), codes each gradient alone
(quantisers, DGC, PowerSGD: their scale is the tensor's own) or fuses those of one dtype into
buckets (as Horovod's fusion buffer and PyTorch DDP's buckets do: top-k over a bucket),
compresses each replica's part with its own state (residuals and the like live in
replica-local float32 variables keyed by variable name), exchanges every payload of the step
in one collective through a `Communicator`, and returns the decoded sums. Gradients the
compressor does not take (integers, tensors under `min_size`, excluded names; for PowerSGD,
vectors) are all-reduced as they are.

`StrategyCommunicator` is the communicator over TF's own cross-device machinery: all-reduce
through the strategy's uncompressed batch reduce (collective ops across workers), all-gather
through `Strategy.gather`. An all-gather carries all of a replica's payload tensors as one
int32 vector (bit-cast; collectives gather no 8- or 16-bit integers), so a step costs one
all-gather, plus one for the sizes when they follow the data.
"""

import logging

import tensorflow as tf

from tfdist import _tf_compat
from tfdist.compression.base import Communicator
from tfdist.compression.state import CompressionState

log = logging.getLogger("tfdist")

_WIRE = tf.int32
# What one exchange reports (int64 tensors), and `compression_logs` turns into Keras logs.
STAT_NAMES = ("bytes_sent", "bytes_dense", "bytes_on_wire", "bytes_on_wire_dense")


def _to_wire(tensor):
    """`tensor` flattened and bit-cast to int32 words (zero padded)."""
    flat = tf.reshape(tensor, [-1])
    size = tensor.dtype.size
    if tensor.dtype == _WIRE:
        return flat
    if size == 4:
        return tf.bitcast(flat, _WIRE)
    if size == 8:
        return tf.reshape(tf.bitcast(flat, _WIRE), [-1])
    per_word = 4 // size
    pad = (per_word - tf.size(flat) % per_word) % per_word
    flat = tf.pad(flat, [[0, pad]])
    return tf.bitcast(tf.reshape(flat, [-1, per_word]), _WIRE)


def _from_wire(words, dtype, num_elements):
    dtype = tf.as_dtype(dtype)
    if dtype == _WIRE:
        return words[:num_elements]
    if dtype.size == 4:
        return tf.bitcast(words, dtype)[:num_elements]
    return tf.reshape(tf.bitcast(words, dtype), [-1])[:num_elements]


def _num_words(num_elements, dtype):
    return (num_elements * tf.as_dtype(dtype).size + 3) // 4


class StrategyCommunicator(Communicator):
    """All-reduce and all-gather over a TF strategy, called in cross-replica context.

    Args:
      strategy: the container strategy.
      batch_reduce: the strategy's uncompressed `_batch_reduce_to`.
      options: the collective options of the call being served.
    """

    def __init__(self, strategy, batch_reduce, options=None):
        self.strategy = strategy
        self.devices = tuple(strategy.extended.worker_devices)
        self.num_replicas = strategy.num_replicas_in_sync
        self._batch_reduce = batch_reduce
        self._options = options
        # What one replica receives on the wire for the calls so far (int64 tensors): a ring
        # all-reduce of B bytes moves 2(N-1)/N * B through each replica, an all-gather
        # (N-1) payloads of the largest replica's size (TF pads to it), and the sizes first
        # when they vary. (Collectives' own message headers are not counted.)
        self.wire = []

    def _per_replica(self, tensors):
        return _tf_compat.PerReplica(tuple(tensors))

    def wire_bytes(self):
        """Bytes one replica received on the wire for the calls so far (int64 tensor)."""
        return tf.add_n(self.wire) if self.wire else tf.constant(0, tf.int64)

    def all_reduce(self, tensors):
        # One batch per dtype: TF's collective all-reduce packs a batch into one buffer.
        count = len(tensors[0])
        n = self.num_replicas
        payload = sum(t.shape.num_elements() * t.dtype.size for t in tensors[0])
        self.wire.append(tf.constant(2 * (n - 1) * payload // n, tf.int64))
        by_dtype = {}
        for j in range(count):
            by_dtype.setdefault(tensors[0][j].dtype, []).append(j)
        results = [[None] * count for _ in self.devices]
        for indices in by_dtype.values():
            pairs = []
            for j in indices:
                value = self._per_replica([t[j] for t in tensors])
                pairs.append((value, value))
            reduced = self._batch_reduce(tf.distribute.ReduceOp.SUM, pairs, self._options)
            for j, value in zip(indices, reduced):
                for r, component in enumerate(self.strategy.experimental_local_results(value)):
                    results[r][j] = component
        return results

    def all_gather(self, tensors, sizes_vary=False):
        local = len(self.devices)
        count = len(tensors[0])
        # Eager tensors always have a full shape: only the compressor knows it may vary.
        static = not sizes_vary and all(t.shape.is_fully_defined() for t in tensors[0])
        wires = []
        for r in range(local):
            with tf.device(self.devices[r]):
                wires.append(tf.concat([_to_wire(t) for t in tensors[r]], axis=0))
        gathered = self.strategy.gather(self._per_replica(wires), axis=0)
        if static:
            elements = [[t.shape.num_elements() for t in tensors[0]]] * self.num_replicas
        else:  # the sizes follow the data: gather them too
            sizes = []
            for r in range(local):
                with tf.device(self.devices[r]):
                    sizes.append(tf.stack([tf.size(t) for t in tensors[r]]))
            all_sizes = tf.reshape(self.strategy.gather(self._per_replica(sizes), axis=0),
                                   [self.num_replicas, count])
            elements = [tf.unstack(row) for row in tf.unstack(all_sizes)]
        dtypes = [t.dtype for t in tensors[0]]
        words = [[_num_words(n, d) for n, d in zip(row, dtypes)] for row in elements]
        totals = [sum(row) for row in words] if static else tf.stack(
            [tf.add_n(row) for row in words])
        # TF gathers each call's shape (one int32 word) first, and pads to the largest.
        others = self.num_replicas - 1
        if static:
            self.wire.append(tf.constant(4 * others * (max(totals) + 1), tf.int64))
        else:
            self.wire.append(4 * others * (tf.cast(tf.reduce_max(totals), tf.int64)
                                           + count + 2))
        results = []
        for r in range(local):
            with tf.device(self.devices[r]):
                per_replica = tf.split(gathered, totals, num=self.num_replicas)
                replicas = []
                for part, w_row, e_row in zip(per_replica, words, elements):
                    splits = w_row if static else tf.stack(w_row)
                    pieces = tf.split(part, splits, num=count)
                    replica = []
                    for piece, n, like in zip(pieces, e_row, tensors[r]):
                        value = _from_wire(piece, like.dtype, n)
                        if not sizes_vary and like.shape.is_fully_defined():
                            value = tf.reshape(value, like.shape)
                        replica.append(value)
                    replicas.append(replica)
                results.append(replicas)
        return results


class GradientExchange:
    """A compressor's state and statistics for one strategy's gradient all-reduce.

    Each gradient is compressed on its own when the compressor's scale or selection must be
    its own (`capabilities.per_tensor`: quantisers, DGC) or it codes a tensor in its own
    shape (not `elementwise`: PowerSGD); the others' gradients of one dtype are fused into
    buckets of at most `bucket_bytes` (as Horovod's fusion buffer and PyTorch DDP's buckets
    are), so that a top-k ranks across layers. Gradients the compressor does not take
    (`Compressor.takes`: integers, tensors under `min_size`, excluded names) are all-reduced
    exactly. Compressor state (residuals, PowerSGD's Q, DGC's velocity) is kept in float32
    replica-local variables keyed by the variables' names, whatever the gradients' dtype.

    Args:
      compressor: a `tfdist.compression.Compressor`.
      strategy: the container strategy (replica-local state variables are made under it).
      bucket_bytes: the largest fused bucket (float32 bytes; DDP's default 25 MiB).
    """

    def __init__(self, compressor, strategy, bucket_bytes=25 << 20):
        self.compressor = compressor
        self.bucket_bytes = bucket_bytes
        self._strategy = strategy
        self._default_state = None

    def default_state(self):
        """The state used when no optimizer's own is given (made on first use)."""
        if self._default_state is None:
            self._default_state = CompressionState(self._strategy)
        return self._default_state

    def _units(self, gradients, names):
        """Lists of gradient indices compressed together, and the indices sent exactly."""
        compressor = self.compressor
        capabilities = compressor.capabilities
        take = [i for i, g in enumerate(gradients)
                if compressor.takes(names[i], g[0].shape, g[0].dtype)]
        taken = set(take)
        exact = [i for i in range(len(gradients)) if i not in taken]
        if capabilities.per_tensor or not capabilities.elementwise:
            return [[i] for i in take], exact
        units, sizes = {}, {}
        for i in take:
            dtype = gradients[i][0].dtype
            size = 4 * gradients[i][0].shape.num_elements()
            buckets = units.setdefault(dtype, [[]])
            if buckets[-1] and sizes.get(dtype, 0) + size > self.bucket_bytes:
                buckets.append([])
                sizes[dtype] = 0
            buckets[-1].append(i)
            sizes[dtype] = sizes.get(dtype, 0) + size
        return [unit for buckets in units.values() for unit in buckets], exact

    def all_reduce(self, gradients, communicator, names=None, state=None):
        """Sums `gradients[i][replica]` over every replica of the job.

        Args:
          gradients: per gradient, this process's replicas' tensors.
          communicator: moves payloads.
          names: per gradient, its variable's name (the key of its compressor state, and
            what `exclude` matches); None: positions.
          state: the `CompressionState` to keep codec state in (the optimizer's own);
            None: the exchange's default one.

        Returns `(sums, stats)`: sums in the same layout, and `stats` with `bytes_sent`
        (one replica's payload bytes this step, int64 tensor) and `bytes_dense` (what the
        same gradients weigh uncompressed).
        """
        compressor = self.compressor
        capabilities = compressor.capabilities
        if names is None:
            names = [f"gradient_{i}" for i in range(len(gradients))]
        replicas = range(len(communicator.devices))
        dense_bytes = sum(g[0].shape.num_elements() * g[0].dtype.size for g in gradients)
        units, exact = self._units(gradients, names)

        if state is None:
            state = self.default_state()
        # The step key: the same on every replica, so random choices agree without messages.
        step = state.get("step", lambda: {"step": tf.zeros([], tf.int64)},
                         replicated=("step",))["step"]

        tensors, unit_keys, variables = [], [], []
        for unit in units:
            fused = []
            for r in replicas:
                with tf.device(communicator.devices[r]):
                    # Compressed in float32 (state too): an fp16 model keeps its residuals.
                    fused.append(tf.concat([tf.reshape(tf.cast(gradients[i][r], tf.float32),
                                                       [-1]) for i in unit], axis=0)
                                 if capabilities.elementwise else
                                 tf.cast(tf.convert_to_tensor(gradients[unit[0]][r]),
                                         tf.float32))
            tensors.append(fused)
            first = fused[0]
            unit_key = ("unit", tuple(names[i] for i in unit), tuple(first.shape.as_list()))
            unit_keys.append(unit_key)
            variables.append(state.get(
                unit_key, lambda s=first.shape: compressor.initial_state(s, tf.float32),
                replicated=capabilities.replicated_state))
        synchronized = []
        if (communicator.num_replicas > len(communicator.devices)
                and (capabilities.replicated_state or capabilities.shared_key)):
            # Several workers: the state each holds alike must be alike (one process's
            # replicas are restored alike).
            shared = [("step", step)] + [
                (f"{'+'.join(unit_key[1])}/{name}", unit_variables[name])
                for unit_key, unit_variables in zip(unit_keys, variables)
                for name in sorted(state.replicated(unit_key) & set(unit_variables))]
            synchronized = [self._synchronize(state, communicator, shared)]
        with tf.control_dependencies(synchronized):
            key = tf.stack([tf.identity(step[0]), tf.constant(0, tf.int64)])
            states = [[{name: tf.identity(v[r]) for name, v in unit_variables.items()}
                       for r in replicas] for unit_variables in variables]

        sums, new_states, sent = ([], [], tf.constant(0, tf.int64))
        if units:
            # Payload values travel in the gradients' own dtype (a float16 model's in float16).
            sums, new_states, sent = compressor.exchange(
                tensors, states, communicator, key,
                [gradients[unit[0]][0].dtype for unit in units])
        updates = [step[r].assign_add(1) for r in replicas]
        for unit_variables, unit_states in zip(variables, new_states):
            for name, components in unit_variables.items():
                for r in replicas:
                    with tf.device(communicator.devices[r]):
                        updates.append(components[r].assign(unit_states[r][name]))

        result = [[None] * len(replicas) for _ in gradients]
        for unit, unit_sums in zip(units, sums):
            for r in replicas:
                with tf.device(communicator.devices[r]):
                    sizes = [gradients[i][r].shape.num_elements() for i in unit]
                    pieces = tf.split(tf.reshape(unit_sums[r], [-1]), sizes)
                    for i, piece in zip(unit, pieces):
                        result[i][r] = tf.cast(tf.reshape(piece, gradients[i][r].shape),
                                               gradients[i][r].dtype)
        exact_bytes = sum(gradients[i][0].shape.num_elements() * gradients[i][0].dtype.size
                          for i in exact)
        if exact:
            reduced = communicator.all_reduce([[gradients[i][r] for i in exact]
                                               for r in replicas])
            for j, i in enumerate(exact):
                for r in replicas:
                    result[i][r] = reduced[r][j]
        with tf.control_dependencies(updates):
            result = [[tf.identity(t) for t in row] for row in result]
            bytes_sent = sent + exact_bytes
        n = communicator.num_replicas
        return result, {"bytes_sent": bytes_sent,
                        "bytes_dense": tf.constant(dense_bytes, tf.int64),
                        # Ring collectives send as much as they receive: both count.
                        "bytes_on_wire": 2 * communicator.wire_bytes(),
                        "bytes_on_wire_dense": tf.constant(4 * (n - 1) * dense_bytes // n,
                                                           tf.int64)}


    @staticmethod
    def _synchronize(state, communicator, shared):
        """Makes the state every replica must hold alike the same on every worker at the
        first step after the state's start, a restore or a reset, by broadcasting replica
        0's; a worker whose values differed (restored from another checkpoint, or not
        restored) logs which. Every step all-reduces the workers' flags (one float32), so
        that every worker takes the broadcast's branch, and its collective, together.

        Args:
          state: the `CompressionState` (its `sync_flags`).
          communicator: a `StrategyCommunicator`.
          shared: `(name, per-replica variables)` of the replicated state.

        Returns the op that ends the synchronisation.
        """
        replicas = range(len(communicator.devices))
        flags = state.sync_flags()
        pending = communicator.all_reduce([[tf.cast(flags[r], tf.float32)]
                                           for r in replicas])[0][0] > 0
        n = communicator.num_replicas
        payload = sum(v[0].shape.num_elements() * v[0].dtype.size for _, v in shared)
        # (Counted here: what the branch's collective moves exists only on the steps it runs.)
        communicator.wire.append(tf.where(pending, tf.constant(2 * (n - 1) * payload // n,
                                                                tf.int64), 0))

        def broadcast():
            mark = len(communicator.wire)
            first = [state.replica_offset + r == 0 for r in replicas]
            values = communicator.all_reduce([
                [v[r].read_value() if first[r] else tf.zeros_like(v[r]) for _, v in shared]
                for r in replicas])
            del communicator.wire[mark:]
            differed = tf.stack([tf.reduce_any(tf.not_equal(values[r][j], v[r]))
                                 for j, (_, v) in enumerate(shared) for r in replicas])
            names = [name for name, _ in shared for _ in replicas]

            def warn(differed):
                which = sorted({name for name, d in zip(names, differed.numpy()) if d})
                log.warning("tfdist: the compression state that every worker must hold alike "
                            "differed on this worker from the chief's (restored from another "
                            "checkpoint, or not restored?): %s; it now holds the chief's",
                            ", ".join(which))
                return tf.constant(0)

            warned = tf.cond(tf.reduce_any(differed),
                             lambda: tf.py_function(warn, [differed], tf.int32),
                             lambda: tf.constant(0))
            with tf.control_dependencies([warned]):
                updates = [v[r].assign(values[r][j]) for j, (_, v) in enumerate(shared)
                           for r in replicas]
                updates += [flags[r].assign(0) for r in replicas]
            return tf.group(updates)

        return tf.cond(pending, broadcast, tf.no_op)


def compression_logs(stats):
    """Keras log entries for the exchange statistics of one step.

    `bytes_sent` is one replica's payload and `bytes_dense` the same gradients uncompressed.
    `bytes_on_wire` is what one replica sends and receives on the wire for the exchange
    actually used: in an all-reduce at the job's N (ring collectives send as much as they
    receive), and `compression_ratio` the dense ring all-reduce's wire bytes at the same N
    over it; on the parameter-server push path what a
    worker sends and receives in its round trips (the reply, the model, is dense), and the
    ratio the same round trips with a dense push over it. With one replica: payload against
    dense.
    """
    sent = tf.cast(stats["bytes_sent"], tf.float32)
    dense = tf.cast(stats["bytes_dense"], tf.float32)
    logs = {"bytes_sent": sent, "bytes_dense": dense,
            "compression_ratio": tf.math.divide_no_nan(dense, sent)}
    if "bytes_on_wire" in stats:
        wire = tf.cast(stats["bytes_on_wire"], tf.float32)
        wire_dense = tf.cast(stats["bytes_on_wire_dense"], tf.float32)
        logs["bytes_on_wire"] = wire
        logs["compression_ratio"] = tf.where(wire_dense > 0,
                                             tf.math.divide_no_nan(wire_dense, wire),
                                             logs["compression_ratio"])
    return logs

