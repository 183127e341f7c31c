"""What workers and ps tasks share: resource names, the progress vector, queue layouts.

Every ps task serves its own shard of the model. Its shared resources (container `tfdist`):

* `control`: a string queue the ps creates when it starts. A worker says `hello` there with
  its rank, a nonce and the spec of the shard (`tfdist.ps.spec.ShardSpec`); the ps answers
  on `hello/{rank}` with the run the worker belongs to.
* per run, under `run/{run}/`: the master variables (`var/{path}`, keyed by the Keras
  variable path), the `push` queue (`tag, rank, payload..., values`), one `reply/{rank}`
  queue per worker (`token, message, progress, values`), the `progress` vector and the
  `update_lock` (held while an update is applied, and while a snapshot reads the masters).

A worker step is one push and one reply per ps task: the reply carries the global step
(token), the shard's new values (the weights the worker computes its next gradient on) and
the shard's telemetry; a negative token carries an error message instead. Tags below zero on
the push queue are control entries (`LEAVE`, `DEAD`, `STOP`, `SYNC`). What each message
carries, and how a push is coded, is `tfdist.ps.wire`.
"""

import numpy as np
import tensorflow as tf

from tfdist.ps import wire
from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.spec import AVERAGE
from tfdist.ps.spec import GRADIENT
from tfdist.ps.spec import OPTIMIZER  # noqa: F401  (the worker side's name for it)
from tfdist.ps.spec import PUSHED_ROLES  # noqa: F401
from tfdist.ps.spec import ROWS
from tfdist.ps.spec import TABLE  # noqa: F401  (the worker side's name for it)
from tfdist.ps.spec import VALUE
from tfdist.ps.spec import entry_of
from tfdist.ps.spec import spec_of
from tfdist.ps.tables import open_owner
from tfdist.ps.tables import part_name
from tfdist.ps.variables import open_shared_variable

CONTAINER = "tfdist"
CONTROL_QUEUE = "control"

# Control tags of the push queue.
LEAVE, DEAD, STOP, SYNC = -1, -2, -3, -4
# The message of the reply to a SYNC: a worker that (re)joins waits for it, and discards
# replies meant for an earlier process of its rank.
SYNC_MESSAGE = "sync"
# The message of the reply to a push the ps dropped as stale (its worker sent the current
# weights at once): the worker keeps no codec state of that push (`tfdist.ps.push_codec`).
DROPPED_MESSAGE = "dropped"
# The token of the reply to a push of a worker the run counts out (declared dead, or left):
# below 0, an error its step raises; a new process of that rank, syncing, skips it (it was
# meant for the earlier process). A reply that ends a run carries -1.
FENCED = -2

# Layout of the progress vector (then one membership entry per worker rank).
(STAT_STEP, STAT_UPDATES, STAT_DROPPED, STAT_AGGREGATED, STAT_STALENESS_SUM,
 STAT_STALENESS_MAX, STAT_CLOCK_GAP) = range(7)
STAT_HISTOGRAM = 7
STAT_MEMBERS = STAT_HISTOGRAM + HISTOGRAM_BUCKETS
# Membership of a rank: not seen yet, training, left, died.
EXPECTED, LIVE, LEFT, DIED = 0, 1, 2, 3


def num_stats(num_workers):
    return STAT_MEMBERS + num_workers


def progress_dict(values, num_workers):
    """The progress vector as a dict (global_step, dropped, staleness, membership...)."""
    values = [int(v) for v in values]
    aggregated = values[STAT_AGGREGATED]
    members = values[STAT_MEMBERS:STAT_MEMBERS + num_workers]
    return {
        "global_step": values[STAT_STEP],
        "updates": values[STAT_UPDATES],
        "dropped_gradients": values[STAT_DROPPED],
        "aggregated_gradients": aggregated,
        "staleness_mean": values[STAT_STALENESS_SUM] / aggregated if aggregated else 0.0,
        "staleness_max": values[STAT_STALENESS_MAX],
        "staleness_histogram": values[STAT_HISTOGRAM:STAT_MEMBERS],
        "max_clock_gap": values[STAT_CLOCK_GAP],
        "live": [r for r, m in enumerate(members) if m in (EXPECTED, LIVE)],
        "left": [r for r, m in enumerate(members) if m == LEFT],
        "dead": [r for r, m in enumerate(members) if m == DIED],
    }


def run_name(run, name):
    return f"run/{run}/{name}"


def variable_name(run, path):
    return run_name(run, f"var/{path}")


def open_run_variables(device, run, spec):
    """`(progress, {path: master})` of run `run` on `device`, as both sides open them."""
    spec = spec_of(spec)
    progress = open_shared_variable(device, run_name(run, "progress"),
                                    [num_stats(spec.num_workers)], tf.int64, "progress",
                                    container=CONTAINER)
    # A table's parts (and its slots') are named by no run: a worker's lookups hold their
    # handles from before it joins one.
    masters = {
        e.path: open_shared_variable(
            device, part_name(e.path, e.rows) if e.table else variable_name(run, e.path),
            e.shape, e.dtype, e.name, container=CONTAINER, trainable=e.trainable)
        for e in spec.variables}
    return progress, masters


def open_table_owners(device, spec):
    """The strings beside the table parts of `spec` naming the run that owns each
    (`tfdist.ps.tables.owner_name`): freed with the parts when the run is torn down."""
    return [open_owner(device, e.path, e.rows) for e in spec_of(spec).variables if e.table]


def open_update_lock(device, run):
    """The update lock of run `run` on `device` (a `MutexV2`): the updater holds it while it
    applies an update, a worker's snapshot of the shard while it reads the masters
    (`tfdist.ps.snapshot`)."""
    with tf.init_scope(), tf.device(device):
        return tf.raw_ops.MutexV2(container=CONTAINER,
                                  shared_name=run_name(run, "update_lock"))


def open_push_queue(device, run, dtypes):
    """The push queue of run `run` on `device`, its components of `dtypes`."""
    with tf.init_scope(), tf.device(device):
        return tf.raw_ops.FIFOQueueV2(component_types=dtypes, shapes=[], capacity=-1,
                                      container=CONTAINER, shared_name=run_name(run, "push"))


def open_reply_queue(device, run, rank):
    """The queue of run `run`'s replies to worker `rank`."""
    with tf.init_scope(), tf.device(device):
        return tf.raw_ops.FIFOQueueV2(component_types=wire.REPLY_DTYPES, shapes=[],
                                      capacity=-1, container=CONTAINER,
                                      shared_name=run_name(run, f"reply/{rank}"))


class ShardLayout:
    """How one shard's pushed variables are flattened into float32 vectors, and back.

    `main` are the variables whose part of a push goes through the compressor (gradients, or
    the averaged model); `values` the non-trainable state, pushed uncompressed as the change
    since the worker last read it. A reply carries the values of `main + values`, in that
    order.

    Args:
      entries: the shard's `VariableEntry`s (or their JSON dicts).
    """

    def __init__(self, entries):
        entries = [entry_of(e) for e in entries]
        self.main = [e for e in entries if e.role in (GRADIENT, AVERAGE)]
        self.values = [e for e in entries if e.role == VALUE]
        # Tables on this ps: a push carries the rows of each one's gradient after the
        # sparse gradients' rows; a reply never carries a table.
        self.tables = [e for e in entries if e.role == TABLE]
        # Tables averaged by rows (model averaging): a push carries the rows its worker
        # changed in the round, a reply the rows the round changed, after the values.
        self.rows = [e for e in entries if e.role == ROWS]
        self.row_widths = [_size(e.shape[1:]) for e in self.rows]
        self.main_sizes = [_size(e.shape) for e in self.main]
        self.value_sizes = [_size(e.shape) for e in self.values]
        self.main_size = int(sum(self.main_sizes))
        self.value_size = int(sum(self.value_sizes))
        self.reply_size = self.main_size + self.value_size
        # Gradients pushed as the rows they touch: `(offset in the main vector, row size)`.
        offsets = np.cumsum([0] + self.main_sizes[:-1]).tolist()
        self.sparse = [(int(offset), _size(e.shape[1:]))
                       for offset, e in zip(offsets, self.main) if e.sparse]
        self.dense_sizes = [n for n, e in zip(self.main_sizes, self.main) if not e.sparse]
        # `(rows, flat row values)` pairs a push carries: sparse gradients', then tables'
        # (each table's gradient rows, then, with `read_rows`, the rows its worker read), then
        # the rows of each table averaged by rows.
        self.num_row_pairs = (len(self.sparse) + sum(1 + e.read_rows for e in self.tables)
                              + len(self.rows))

    def densify(self, dense, sparse):
        """The main vector of a push: `dense` (the other gradients, flat) with each sparse
        gradient's rows `(rows, flat row values)` added at its place (repeated rows sum)."""
        if not self.sparse:
            return tf.reshape(dense, [self.main_size])
        pieces = iter(tf.split(dense, self.dense_sizes) if self.dense_sizes else [])
        full = tf.concat([tf.zeros([n]) if e.sparse else next(pieces)
                          for n, e in zip(self.main_sizes, self.main)], axis=0)
        for (offset, width), (rows, values) in zip(self.sparse, sparse):
            positions = (offset + rows[:, None] * width
                         + tf.range(width, dtype=tf.int64)[None, :])
            full = tf.tensor_scatter_nd_add(full, tf.reshape(positions, [-1, 1]),
                                            tf.reshape(values, [-1]))
        return full

    @staticmethod
    def flatten(tensors):
        if not tensors:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
                          for t in tensors], axis=0)

    def unflatten(self, flat, entries, sizes):
        if not entries:
            return []
        return [tf.cast(tf.reshape(part, e.shape), e.dtype)
                for part, e in zip(tf.split(flat, sizes), entries)]

    def split_reply(self, flat):
        """`(main values, value values)` of a reply's flat vector, in each variable's dtype
        (the rows after them: `reply_rows`)."""
        main, values, _ = tf.split(flat, [self.main_size, self.value_size, -1])
        return (self.unflatten(main, self.main, self.main_sizes),
                self.unflatten(values, self.values, self.value_sizes))

    def reply_rows(self, flat):
        """`[(ids, flat row values)]` of each `rows` entry in a reply's flat vector."""
        if not self.rows:
            return []
        return wire.split_rows_section(flat[self.reply_size:], self.row_widths)


def _size(shape):
    return int(np.prod(shape)) if shape else 1
