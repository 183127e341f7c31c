"""Model averaging of embedding tables by the rows a round changed (both sides).

Under `ModelAveragingStrategy` every worker trains its own copy of the model (local SGD
needs one), tables included. Averaging a table whole every round would make a round's cost
follow the table's size; a round changes only the rows its batches looked up. So a table
named by `embedding_tables` (role `rows`) is averaged by rows:

* a worker keeps, per table, a mask of the rows its optimizer changed since its last round,
  set from the row ids of the table's gradient at each step (`ChangedRows.track`), and a
  round pushes only those rows, ids and values;
* the ps averages each pushed row over the round's N aggregated workers, a worker that did
  not push a row counting with the master's value (it started the round from it):
  `(sum of the pushed values + (N - pushes of the row) * master) / N` (`averaged_rows`);
* the reply carries the rows the round changed (the union of the pushed ids) with their new
  values, which every worker scatters into its copy. A row nobody touched never travels.

When every worker starts the round from the master copy this is the whole-table average, to
the rounding of a sum's order (bit for bit with two workers). It holds when a row that a
step's gradient does not touch keeps its value: the local optimizer is plain SGD, Adagrad,
RMSprop or Adadelta without momentum and weight decay on the table, and the table has no
constraint (`rows_exact`); momentum, Adam and weight decay move every row they ever touched,
every step, and a constraint every row.

A worker whose push came too late for its round (N of M) is dropped and sent every row
changed since the weights it pushed from (the ps keeps, per row, the round that last
changed it), with the rows it changed itself: its copy becomes the master's, and its own
unsent changes are dropped, as the whole-model path does.
"""

import logging
import math

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat

log = logging.getLogger("tfdist")

# Keras optimizers under which a row without gradient keeps its value (no momentum, no weight
# decay), and, among them, those under which it keeps its slots too (`optimizer_state=
# "averaged"` averages the slots by the same rows).
_ROW_LOCAL = {"SGD": True, "Adagrad": True, "RMSprop": False, "Adadelta": False}
# The slot a momentum setting adds (zero: none).
_MOMENTUM = {"SGD": "momentum", "RMSprop": "momentum"}
# Rows read per message when a worker copies a master table (gRPC's limit is 2 GiB).
CHUNK_BYTES = 64 << 20


def averaged_rows(ids, values, master, count):
    """The per-row average of a round: `(rows, flat averaged values)`.

    Args:
      ids: int64 `[n]`, the rows the round's pushes carry, each push's once (a row pushed
        by k workers is there k times).
      values: float32, their values, flat (`n * width`).
      master: the master variable (or tensor) of the rows before the round.
      count: the number of pushes in the round (N), a float32 scalar.

    Returns:
      The distinct rows, and each one's `(sum of its pushed values + (N - pushes) *
      master) / N`, flat.
    """
    width = math.prod(master.shape[1:])
    rows, position = tf.unique(tf.cast(ids, tf.int64))
    distinct = tf.size(rows)
    sums = tf.math.unsorted_segment_sum(tf.reshape(values, [-1, width]), position, distinct)
    pushes = tf.math.unsorted_segment_sum(tf.ones_like(position, tf.float32), position,
                                          distinct)
    held = tf.reshape(tf.cast(tf.gather(master, rows), tf.float32), [-1, width])
    count = tf.cast(count, tf.float32)
    mean = (sums + (count - pushes)[:, None] * held) / count
    return rows, tf.reshape(mean, [-1])


def rows_exact(optimizer, table, averaged_state):
    """None if under `optimizer` (a Keras optimizer) a row of Keras variable `table` that a
    step's gradient does not touch keeps its value (and, with `averaged_state`, its slots);
    else why not, for an error."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    name = type(inner).__name__
    if not type(inner).__module__.startswith("keras.") or name not in _ROW_LOCAL:
        return (f"its optimizer {name} is not one of {sorted(_ROW_LOCAL)}, under which a row "
                "without gradient keeps its value")
    momentum = _MOMENTUM.get(name)
    if momentum and getattr(inner, momentum, 0):
        return f"{name} with {momentum}={getattr(inner, momentum)} moves every row it ever touched"
    if getattr(table, "constraint", None) is not None:
        return "its constraint is applied to every row at every step"
    if getattr(inner, "use_ema", False):
        return (f"{name} with use_ema=True keeps a moving average of every row and writes it "
                "into the table (at the end of `fit`, and every ema_overwrite_frequency "
                "steps)")
    if getattr(inner, "weight_decay", None) and _tf_compat.keras_optimizer_decays(inner, table):
        return f"{name}'s weight decay moves every row at every step"
    if averaged_state and not _ROW_LOCAL[name]:
        return (f"with optimizer_state='averaged' its {name} slots decay on every row at "
                "every step")
    return None


class ChangedRows:
    """A worker's record of the rows of its tables averaged by rows that changed since its
    last round, and what a round pushes and takes of them.

    Args:
      host_device: where the masks live (the worker's host; None: the current device).
    """

    def __init__(self, host_device=None):
        self.host_device = host_device
        self.tables = []    # mirrors averaged by rows (role `rows`), tables and slots
        self._masks = {}    # id(table): its bool mask of changed rows
        self._warned_dense = set()

    def add(self, variable, table=None):
        """`variable` (a mirror, role `rows`) is averaged by rows: a table, or (`table`) an
        optimizer slot of one, which shares its table's changed rows."""
        variable._tfdist_rows_table = variable if table is None else table
        if table is None:
            # (Made under the strategy's scope: the dtype, given, keeps it a local variable.)
            with tf.init_scope(), tf.device(self.host_device):
                self._masks[id(variable)] = tf.Variable(
                    tf.zeros([variable.shape[0]], tf.bool), dtype=tf.bool, trainable=False,
                    name="tfdist_changed_rows")
        self.tables.append(variable)

    def drop(self, variable):
        """`variable` goes back to whole averaging (`role` average)."""
        self.tables = [t for t in self.tables if t is not variable]
        self._masks.pop(id(variable), None)
        del variable._tfdist_rows_table

    def paths(self):
        return [t._tfdist_path for t in self.tables]

    def track(self, variable, gradient):
        """The op marking the rows `gradient` (of `variable`, in a step) touches; None for
        a variable not averaged by rows."""
        mask = self._masks.get(id(variable))
        if mask is None:
            return None
        if isinstance(gradient, tf.IndexedSlices):
            ids = tf.cast(gradient.indices, tf.int64)
        else:
            # A dense gradient (a transform made it so): its nonzero rows, a whole pass a step.
            if variable._tfdist_path not in self._warned_dense:
                self._warned_dense.add(variable._tfdist_path)
                log.warning("tfdist: the gradient of the table %s reaches the optimizer dense "
                            "(`global_clipnorm`, a custom transform?): each step scans every "
                            "row for the changed ones", variable._tfdist_path)
            gradient = tf.reshape(tf.convert_to_tensor(gradient), [variable.shape[0], -1])
            ids = tf.reshape(tf.where(tf.reduce_any(gradient != 0, axis=1)), [-1])
        with tf.device(self.host_device):
            return mask.scatter_update(tf.IndexedSlices(tf.ones_like(ids, tf.bool), ids))

    def pushed(self, part):
        """`(ids, flat float32 values)` of the rows of `part` (a `Part` of a table averaged
        by rows, or of its slot) changed since the last round, ids local to the part."""
        mask = self._masks[id(part.variable._tfdist_rows_table)]
        begin, end = part.rows if part.rows is not None else (0, part.variable.shape[0])
        with tf.device(self.host_device):
            ids = tf.reshape(tf.where(mask[begin:end]), [-1])
        values = tf.gather(part.variable, ids + begin)
        return ids, tf.reshape(tf.cast(values, tf.float32), [-1])

    def take(self, part, ids, values):
        """The op writing a reply's rows (`ids` local to `part`, flat `values`) into the
        worker's copy."""
        variable = part.variable
        begin = 0 if part.rows is None else part.rows[0]
        values = tf.cast(tf.reshape(values, [-1, *variable.shape[1:]]), variable.dtype)
        return variable.scatter_update(tf.IndexedSlices(values, ids + begin))

    def count(self):
        """How many rows (of tables and slots) the next round pushes."""
        counts = [tf.math.count_nonzero(self._masks[id(t._tfdist_rows_table)], dtype=tf.int64)
                  for t in self.tables]
        return tf.add_n(counts) if counts else tf.constant(0, tf.int64)

    def reset(self):
        """The ops forgetting every changed row (after a round)."""
        return [mask.assign(tf.zeros_like(mask)) for mask in self._masks.values()]

    def copy_masters(self):
        """Eagerly, after joining a run (or before leaving it): every table takes its master
        copy, read in chunks of at most `CHUNK_BYTES`; nothing stays marked changed."""
        for variable in self.tables:
            row_bytes = max(1, math.prod(variable.shape[1:])) * variable.dtype.size
            step = max(1, CHUNK_BYTES // row_bytes)
            value = np.empty(variable.shape.as_list(), variable.dtype.as_numpy_dtype)
            for master, rows in variable._tfdist_masters:
                begin = 0 if rows is None else rows[0]
                size = int(master.shape[0])
                for start in range(0, size, step):
                    stop = min(size, start + step)
                    with tf.device(master.device):
                        chunk = tf.raw_ops.ResourceGather(
                            resource=master.handle, dtype=variable.dtype,
                            indices=tf.range(start, stop, dtype=tf.int64))
                    value[begin + start:begin + stop] = chunk.numpy()
            variable.assign(value, read_value=False)
        self.reset()


def keras_variable_of(optimizer, variable):
    """The Keras variable of `optimizer` whose storage is `variable`, or None."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for keras_variable in _tf_compat.keras_optimizer_trained_variables(inner):
        if _tf_compat.keras_variable_storage(keras_variable) is variable:
            return keras_variable
    return None

