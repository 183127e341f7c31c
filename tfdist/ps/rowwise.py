"""Row-wise ("lazy") optimizer updates of embedding tables on the ps.

An embedding table's gradient touches the rows its batch looked up; Keras 3's optimizers
update a variable densely, every row every step, so a million-row table costs a million-row
update per step. A ps task holding a table applies the user's Keras optimizer to the rows an
update touches instead:

1. the rows' gradients are summed per row (`sum_rows`),
2. the touched rows of the table and of each of its slots are gathered into small scratch
   variables of the optimizer's own kind (a second instance of the user's optimizer, built on
   a scratch variable of `chunk_rows` rows, whose step counter, learning rate and other
   shared state are the main optimizer's own variables),
3. the optimizer's own `update_step` (and weight decay) runs on the scratch rows,
4. the rows and their slots are scattered back.

So the update is the user's optimizer's math on each touched row, and untouched rows keep
their values and their slots: exact for SGD without momentum and Adagrad (whose update of a
row with a zero gradient is zero), and TF1's `LazyAdamOptimizer` semantics for Adam,
momentum and the like (a row's moments decay only when it is touched).
"""

import keras
import tensorflow as tf

from tfdist import _tf_compat

# Keras optimizers whose update of a row reads only that row's gradient and slots, and the
# optimizer's step counter and learning rate (Nadam also keeps a product of all steps'
# momentum factors, updated once per apply: not row-local).
ROWWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Ftrl", "Lion"})

# Scratch rows per chunk: about 64 KiB per scratch variable (1,024 rows 16 wide), at least 256
# rows. Every chunk is padded to this size and the optimizer's math runs on all of it, so an
# update costs at least one chunk per table on each ps task holding some of it: a chunk
# near the rows an update touches (hundreds to a few thousand) keeps that cost following the
# rows touched. (1 MiB chunks, 16,384 rows, made each update of a 100k-row table on 2 ps
# tasks cost twice the padded work, and halved async's rate against 1 ps.)
_CHUNK_BYTES = 64 << 10


def rowwise_optimizer(optimizer):
    """True if `optimizer` (or a LossScaleOptimizer's inner one) can update rows lazily."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    cls = type(inner)
    return cls.__module__.startswith("keras.") and cls.__name__ in ROWWISE_OPTIMIZERS


def sum_rows(indices, values, num_rows=None):
    """`(rows, sums)`: the distinct rows of `indices` (int64) and each one's summed values.

    `num_rows`, if given, checks every index against the table's row count: an id out of
    range is an error, as in a dense gather, not a silent write elsewhere.
    """
    indices = tf.cast(tf.reshape(indices, [-1]), tf.int64)
    if num_rows is not None:
        past = "an embedding id is past the last row of the table"
        checks = [tf.debugging.assert_less(indices, tf.cast(num_rows, tf.int64), message=past),
                  tf.debugging.assert_non_negative(indices, message="an embedding id is negative")]
        with tf.control_dependencies(checks):
            indices = tf.identity(indices)
    rows, position = tf.unique(indices)
    sums = tf.math.unsorted_segment_sum(values, position, tf.size(rows))
    return rows, sums


class RowwiseUpdate:
    """Applies a built Keras optimizer to the touched rows of its tables (see the module).

    Args:
      optimizer: the Keras optimizer, built on (at least) `tables`; its own variables are
        what the row updates share (step counter, learning rate).
      tables: the Keras variables (2-D or more, rows first) to update row-wise.
      chunk_rows: rows per scratch chunk (None: about 1 MiB per scratch variable).

    Raises:
      ValueError: the optimizer's update is not row-local, or a table is not one of its
        variables.
    """

    def __init__(self, optimizer, tables, chunk_rows=None):
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if not rowwise_optimizer(inner):
            raise ValueError(
                f"row-wise (lazy) updates of embedding tables need an optimizer whose update "
                f"of a row reads only that row: one of {sorted(ROWWISE_OPTIMIZERS)}. "
                f"Received: {type(inner).__name__}. Pass `embedding_updates='dense'` to "
                "update tables densely on the ps (every row, every step)")
        self.optimizer = inner
        self._tables = {}
        for table in tables:
            if not _tf_compat.keras_optimizer_knows(inner, table):
                raise ValueError(f"{table.path} is not a variable the optimizer was built on")
            self._tables[id(table)] = _TableRows(inner, table, chunk_rows)

    def apply(self, table, indices, values, learning_rate_factor=None):
        """The update of `table`'s rows `indices` with gradient rows `values` (summed per row
        when an index repeats); returns the op (in a `tf.function`) that does it.

        `learning_rate_factor` scales this update's learning rate (staleness policies).
        """
        rows = self._tables.get(id(table))
        if rows is None:
            raise ValueError(f"{table.path} is not a table of this row-wise update")
        indices, values = sum_rows(indices, values, table.shape[0])
        return rows.apply(indices, values, learning_rate_factor)


class _TableRows:
    """One table's scratch rows, and the row optimizer built on them."""

    def __init__(self, optimizer, table, chunk_rows):
        self.table = table
        row_shape = list(table.shape[1:])
        width = max(1, int(tf.TensorShape(row_shape).num_elements() or 1))
        itemsize = tf.as_dtype(table.dtype).size
        self.chunk = int(chunk_rows or max(256, _CHUNK_BYTES // (width * itemsize)))
        self.chunk = min(self.chunk, int(table.shape[0]))
        shared = {v.path: v for v in optimizer.variables}
        with tf.init_scope(), tf.variable_creator_scope(_ShareByPath(shared)):
            # The scratch variable's name differs from every model variable's, so that
            # its slots do too; everything else the row optimizer makes is the main one's.
            self.scratch = keras.Variable(
                tf.zeros([self.chunk, *row_shape], table.dtype), trainable=True,
                name="tfdist_rows")
            self.row_optimizer = optimizer.__class__.from_config(optimizer.get_config())
            if (optimizer.weight_decay is not None
                    and not _tf_compat.keras_optimizer_decays(optimizer, table)):
                self.row_optimizer.exclude_from_weight_decay(var_list=[self.scratch])
            self.row_optimizer.build([self.scratch])
        # A slot of a variable is named `{its path, "/" as "_"}_{slot}`: the scratch's slots
        # name the slots of the table, looked up by their exact names.
        scratch_prefix = self.scratch.path.replace("/", "_") + "_"
        self.scratch_slots = {v.path.rpartition("/")[2][len(scratch_prefix):]: v
                              for v in self.row_optimizer.variables
                              if v.path.rpartition("/")[2].startswith(scratch_prefix)}
        by_name = {v.path.rpartition("/")[2]: v for v in optimizer.variables}
        slot_prefix = table.path.replace("/", "_") + "_"
        missing = [name for name in self.scratch_slots if slot_prefix + name not in by_name]
        if missing:
            raise ValueError(
                f"the optimizer has no {missing} state of {table.path} (a row has "
                f"{sorted(self.scratch_slots)}): it cannot be updated row by row")
        self.slots = {name: by_name[slot_prefix + name] for name in self.scratch_slots}

    def apply(self, indices, values, learning_rate_factor):
        total = tf.size(indices)
        chunks = (total + self.chunk - 1) // self.chunk

        def body(i):
            # Ops on one resource run in program order (a `tf.function`'s automatic control
            # dependencies): load the rows, update them, store them back.
            begin = i * self.chunk
            size = tf.minimum(self.chunk, total - begin)
            rows = indices[begin:begin + size]
            pad = [[0, self.chunk - size]] + [[0, 0]] * (len(self.table.shape) - 1)
            self.scratch.value.assign(tf.pad(self.table.value.sparse_read(rows), pad))
            for name, slot in self.slots.items():
                self.scratch_slots[name].value.assign(tf.pad(slot.value.sparse_read(rows), pad))
            optimizer = self.row_optimizer
            learning_rate = optimizer.learning_rate
            if learning_rate_factor is not None:
                learning_rate = (tf.cast(learning_rate, tf.float32)
                                 * tf.cast(learning_rate_factor, tf.float32))
            _tf_compat.keras_optimizer_apply_weight_decay(optimizer, [self.scratch])
            gradient = tf.pad(tf.cast(values[begin:begin + size], self.table.dtype), pad)
            optimizer.update_step(gradient, self.scratch.value, learning_rate)
            stores = [self.table.value.scatter_update(
                tf.IndexedSlices(self.scratch.value[:size], rows))]
            for name, slot in self.slots.items():
                stores.append(slot.value.scatter_update(
                    tf.IndexedSlices(self.scratch_slots[name].value[:size], rows)))
            with tf.control_dependencies(stores):
                return i + 1

        return tf.while_loop(lambda i: i < chunks, body, [tf.constant(0)],
                             parallel_iterations=1)


class _ShareByPath:
    """A variable creator: a variable whose Keras path is already `shared`'s is that one's
    storage (the row optimizer's step counter, learning rate)."""

    def __init__(self, shared):
        self.shared = shared

    def __call__(self, next_creator, **kwargs):
        path = _tf_compat.keras_variable_path((kwargs.get("name") or "Variable").split(":")[0])
        existing = self.shared.get(path)
        if existing is not None:
            return existing.value
        return next_creator(**kwargs)
