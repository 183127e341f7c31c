"""The compressed push of a parameter-server worker, whichever push it is (gradient or model).

Each worker encodes what it pushes to a ps task with the strategy's compressor, keeping its
own codec state (error-feedback residuals, ...) with its Keras optimizer, keyed by the pushed
parts' paths; each ps task decodes its shard. The codec also measures the bytes this worker
sends and receives, for the Keras logs.

A push the ps drops as stale (soft sync: computed on weights an update older; async:
staler than `max_staleness`; a model pushed for an older round) leaves the codec state as it
was before that step: its reply says so (`protocol.DROPPED_MESSAGE`), and the worker keeps
the new state only of pushes the ps took. Error feedback's invariant (Karimireddy et al.
2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", section 3: the
weights minus the residual follow the uncompressed trajectory; Stich and Karimireddy 2020,
"The Error-Feedback Framework", treat the residual as delayed gradient) then holds against
what the ps applied: the residual is what was computed and not applied *of the gradients the
ps accepted*, as the uncompressed strategy applies exactly those. Adding the dropped push's
sent part back to the residual instead (the invariant against every gradient computed) would
apply each dropped gradient later, staler still: the staleness bound the drop enforces
(SyncReplicasOptimizer's, Chen et al. 2016) would not hold, and a worker that is late at
every step would carry a growing sum of stale gradients into its first accepted push. DGC's
momentum and accumulation (Lin et al. 2018) go back the same way: the dropped step never
happened for the codec.
"""

import tensorflow as tf

from tfdist import compression as compression_lib
from tfdist.compression import state as compression_state
from tfdist.compression.base import sum_payload_bytes
from tfdist.compression.exchange import compression_logs
from tfdist.ps import protocol
from tfdist.ps import tables
from tfdist.ps import wire
from tfdist.ps.wire import push_key


def push_compressor(compression):
    """The compressor for the ps push path, or None; refuses those that need all-reduce."""
    compressor = compression_lib.get(compression)
    if compressor is None:
        return None
    capabilities = compressor.capabilities
    if _pushable(capabilities):
        return compressor
    allowed = [name for name in compression_lib.names()
               if _pushable(compression_lib.get(name).capabilities)]
    if capabilities.aggregate != "sum":
        why = (f"combines the replicas' payloads by {capabilities.aggregate}, which every "
               f"replica takes from all the others (an all-gather); a ps averages the pushes "
               f"it decodes")
    elif capabilities.rounds > 1:
        why = ("needs rounds of all-reduce between the replicas; a parameter-server push "
               "carries one message per step")
    else:
        why = ("codes each gradient in its own shape; a parameter-server push codes a "
               "shard's variables as one flat vector")
    raise ValueError(f"`compression`={compressor.name!r} {why}. Allowed here: {allowed}")


def _pushable(capabilities):
    """Whether a compressor of `capabilities` can code a parameter-server push."""
    return (capabilities.aggregate == "sum" and capabilities.rounds == 1
            and capabilities.elementwise)


class PushCodec:
    """One worker's compression of its pushes, and the bytes they take on the wire.

    Args:
      compressor: the strategy's compressor (`push_compressor`).
      strategy: the public strategy (the codec states are made under its scope).
      connection: the worker's `PSConnection` (its rank, the run's size, its host device).
    """

    def __init__(self, compressor, strategy, connection):
        self.compressor = compressor
        self._connection = connection
        # Each push unit's error-feedback residual (and other codec state), kept with the
        # optimizer so that Keras files and checkpoints save it (one replica: this worker).
        self._states = compression_state.StateRegistry(strategy, compressor,
                                                       lambda: connection.rank)
        with tf.init_scope(), tf.device(connection.host_device):
            self._bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="tfdist_bytes_sent")
            # What this worker sent and received on the wire in its last round trips, and
            # the same with its pushes dense (`bytes_on_wire` / `bytes_on_wire_dense`).
            self._wire = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                     name="tfdist_wire_bytes")

    def spec(self):
        return compression_lib.serialize(self.compressor)

    def attach(self, optimizer):
        """Gives the Keras optimizers made under the strategy their codec state (to save),
        once put to use (`tfdist.compression.state.StateRegistry.attach`)."""
        self._states.attach(optimizer)

    def states(self):
        return self._states.states()

    def reset(self):
        self._states.reset()

    def queue_dtypes(self, layout):
        return wire.compressed_push_dtypes(layout, self.compressor)

    def compress(self, layout, shard, flat, tag, optimizer):
        """Compresses this worker's part for `shard`, variable by variable where the codec's
        scale is each tensor's own (`wire.push_units`).

        Returns `(payload, keep_state)`: `keep_state(dropped)` (once the reply is here, its
        `dropped` flag) gives the updates of the codec state (kept in `optimizer`'s
        `CompressionState`, keyed by the parts' paths and rows): the new state, or, for a
        push the ps dropped, none (see the module docstring).
        """
        compressor = self.compressor
        units, _ = wire.push_units(layout, compressor)
        state = self._states.state_of(optimizer)
        states = []
        for unit in units:
            size = sum(layout.main_sizes[i] for i in unit)
            paths = tuple(layout.main[i].path + (
                "" if layout.main[i].rows is None else
                "@{}:{}".format(*layout.main[i].rows)) for i in unit)
            variables = state.get(
                ("unit", paths, (size,)),
                lambda size=size: compressor.initial_state([size], tf.float32),
                replicated=compressor.capabilities.replicated_state)
            states.append({name: components[0] for name, components in variables.items()})
        connection = self._connection
        key = push_key(tag, connection.rank, shard, connection.num_workers)
        payload, new_states = wire.encode_push(
            layout, compressor, flat, [{n: v.read_value() for n, v in unit.items()}
                                       for unit in states], key)

        def keep_state(dropped):
            def assign():
                with tf.control_dependencies([unit[n].assign(new[n]) for unit, new in
                                              zip(states, new_states) for n in unit]):
                    return tf.constant(True)

            return [tf.cond(dropped, lambda: tf.constant(False), assign)]

        return payload, keep_state

    def measure(self, layouts, sent, pushed_values, replies, pushed_rows):
        """The updates recording one exchange's bytes: the payloads `sent`, and
        `[compressed, dense]` bytes of the step's traffic with every ps task: each push (its
        tag and rank, the state values it carries, the payload, and the row pairs
        `pushed_rows[shard]`: a table's gradient rows and ids, a table averaged by rows'
        changed rows), each reply (its token, its dropped flag, progress and the worker's
        shard of the model, the ps variables it was asked to read (model averaging's learning
        rate), with the rows a round of a table averaged by rows changed:
        replies are never compressed, so the push path's ratio is at most about 2x), and
        what the step's lookups of tables kept on the ps moved (ids out, rows back:
        `tfdist.ps.tables.take_read_bytes`). Rows travel uncompressed."""
        payload_bytes = sum_payload_bytes(sent)
        header = 16 + 8 * (2 + protocol.num_stats(self._connection.num_workers))
        common = tf.constant(header * len(replies), tf.int64) + tables.take_read_bytes()
        for values, reply, rows in zip(pushed_values, replies, pushed_rows):
            common += 4 * (tf.size(values, out_type=tf.int64)
                           + tf.size(reply.values, out_type=tf.int64))
            common += sum(read.dtype.size * read.shape.num_elements() for read in reply.reads)
            common += wire.row_pairs_bytes(rows)
        dense = 4 * sum(layout.main_size for layout in layouts)
        return [self._bytes_sent.assign(payload_bytes),
                self._wire.assign(tf.stack([common + payload_bytes, common + dense]))]

    def logs(self, layouts):
        dense = 4 * sum(layout.main_size for layout in layouts)
        wire = self._wire.read_value()
        return compression_logs({"bytes_sent": self._bytes_sent.read_value(),
                                 "bytes_dense": tf.constant(dense, tf.int64),
                                 "bytes_on_wire": wire[0],
                                 "bytes_on_wire_dense": wire[1]})
