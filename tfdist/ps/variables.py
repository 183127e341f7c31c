"""Master variables on the ps tasks, and the worker-local mirrors a Keras model trains with.

A master variable is one copy of a variable on a ps task, opened by every task of the run
through its shared name. A worker's model holds mirrors: variables on the worker's own compute
device (its GPU when it has one), which its train step reads and writes. Each step's reply
from the ps brings the new values into the mirrors.

Outside a train step a mirror stands for its master, once the worker has joined a run: eager
reads (`get_weights`, saving a checkpoint) read the master, eager writes (`set_weights`,
`load_weights`, restoring a checkpoint) write it too. Before the worker joins, a mirror is a
plain local variable: what the chief holds then (a restored backup, weights it loaded)
becomes the master copy when it starts a run; a worker joining a run in progress takes the
master's values.
"""

import contextlib
import logging
import threading
import typing

import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps.spec import ROWS
from tfdist.ps.spec import VALUE

_state = threading.local()


@contextlib.contextmanager
def replica_step():
    """Marks this thread as running a replica's step (eagerly or while tracing it)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_replica_step():
    """Whether this thread is running (or tracing) a replica's step."""
    return bool(getattr(_state, "depth", 0))


log = logging.getLogger("tfdist")
_warned_rows = set()


def _warn_rows_write(variable):
    """A write of the chief to a table averaged by the rows a round changed (model
    averaging) reaches the master and the chief's copy, not the other workers' copies, whose
    untouched rows keep their value until they take the masters (`join()`): said once per
    table, at the write."""
    if getattr(variable, "_tfdist_role", None) != ROWS or variable._tfdist_path in _warned_rows:
        return
    _warned_rows.add(variable._tfdist_path)
    log.warning(
        "tfdist: %s is averaged by the rows a round changed: a write to it during the run "
        "(load_weights, set_weights, a callback's assign) reaches the master and this worker's "
        "copy, but the other workers keep the rows they do not touch until they join; "
        "written at the end of fit (EarlyStopping's restore_best_weights) it reaches every "
        "worker at join(). To write it whole mid-run, average it whole: "
        "`embedding_tables=None` on the strategy", variable._tfdist_path)


def _stands_for_master(variable):
    # (A follower whose steps read its own copy stands for that copy: its callbacks read and
    # write the learning rate its steps use, until the next round brings the master's.)
    return (bool(variable._tfdist_masters) and tf.executing_eagerly()
            and not getattr(_state, "depth", 0)
            and (variable._tfdist_writable or not variable._tfdist_read_locally))


class SharedVariable(_tf_compat.BaseResourceVariable):
    """A resource variable whose storage is a shared resource on a ps task.

    It has no deleter: no task can destroy the copy that the others use.
    """

    # The `tfdist.ps.snapshot.ShardSnapshot` of its shard, once a worker has joined a run:
    # inside `consistent_reads()` a read takes its value from the shard's snapshot.
    snapshot = None


def consistent_value(master):
    """The value of `master`: inside `tfdist.ps.snapshot.consistent_reads()`, its shard's
    snapshot's (once the worker has joined the run)."""
    snapshot = getattr(master, "snapshot", None)
    return master.read_value() if snapshot is None else snapshot.value(master)


def open_shared_variable(device, shared_name, shape, dtype, name, container="tfdist",
                         trainable=False):
    """Opens (creating on first use, uninitialised) the variable `shared_name` on `device`."""
    shape = tf.TensorShape(shape)
    dtype = tf.as_dtype(dtype)
    with tf.init_scope(), tf.device(device):
        handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=shape, container=container,
                                        shared_name=shared_name, name=name)
    _tf_compat.set_handle_shape_and_dtype(handle, shape, dtype)
    return SharedVariable(
        handle=handle, shape=shape, dtype=dtype, trainable=trainable, name=name,
        unique_id=f"{container}/{shared_name}", handle_name=name, in_graph_mode=False)


def is_initialized(variable):
    with tf.init_scope():
        return bool(tf.raw_ops.VarIsInitializedOp(resource=variable.handle).numpy())


def _rows_of(sparse_delta, rows):
    """The rows `[begin, end)` of an `IndexedSlices` update, indexed from `begin`."""
    begin, end = rows
    indices = sparse_delta.indices
    keep = tf.logical_and(indices >= begin, indices < end)
    return tf.IndexedSlices(tf.boolean_mask(sparse_delta.values, keep),
                            tf.boolean_mask(indices, keep) - tf.cast(begin, indices.dtype))


_MIRROR_ARGS = ("initial_value", "trainable", "name", "dtype", "constraint",
                "distribute_strategy", "synchronization", "aggregation", "shape")


class MirrorVariable(_tf_compat.ResourceVariable):
    """A worker's local copy of a master variable (see the module docstring).

    Made by `MirrorVariable.create`; `tf.Variable`'s metaclass keeps a subclass from adding
    constructor arguments of its own.
    """

    _tfdist_masters = ()    # (master, rows) per part, in row order; rows None: whole
    _tfdist_copies = ()
    _tfdist_writable = True
    # Non-trainable state (VALUE): the value this mirror last took from its masters, which
    # its worker's pushes count their change from (`change_since_read`).
    _tfdist_last_read = None
    _tfdist_on_write = None   # called after each write that reaches the masters
    # The worker's own steps read this copy (a learning rate under model averaging): when it
    # follows, outside a step it stands for this copy, until the master's value is taken
    # again.
    _tfdist_read_locally = False

    @classmethod
    def create(cls, path, role, **kwargs):
        """A mirror of the master(s) at Keras path `path`.

        Args:
          path: the Keras variable path, the master's key.
          role: what a push does with it (`tfdist.ps.protocol` roles).
          **kwargs: `tf.Variable` arguments.
        """
        variable = cls(**{k: v for k, v in kwargs.items() if k in _MIRROR_ARGS})
        variable._tfdist_path = path
        variable._tfdist_role = role
        return variable

    def bind(self, master, rows=None):
        """From now on, outside a step, this variable stands for its masters.

        Args:
          master: a master variable on a ps task.
          rows: `(begin, end)`: the master holds these rows of this variable (a part of a
            variable split over ps tasks). None: the whole variable; a second whole master
            is a copy (the optimizer's step counter and learning rate, one per ps task):
            reads take the first, writes go to all.
        """
        if self._tfdist_role == VALUE and self._tfdist_last_read is None:
            with tf.init_scope(), tf.device(self.device):
                # (A plain variable: the class made directly, past the strategy's creator.)
                self._tfdist_last_read = _tf_compat.ResourceVariable(
                    super()._read_variable_op(), trainable=False,
                    name=self.name.partition(":")[0] + "_last_read")
        if rows is None and self._tfdist_masters:
            self._tfdist_copies = (*self._tfdist_copies, master)
        else:
            self._tfdist_masters = tuple(sorted((*self._tfdist_masters, (master, rows)),
                                                key=lambda m: m[1] or (0, 0)))

    def follow(self):
        """Outside a step, writes are ignored: another task (the chief) sets this variable."""
        self._tfdist_writable = False

    def on_write(self, callback):
        """Outside a step, after each write that reaches the masters: `callback(self)`."""
        self._tfdist_on_write = callback

    def _written(self, value=None):
        _warn_rows_write(self)
        self._refresh(value)
        if self._tfdist_on_write is not None:
            self._tfdist_on_write(self)
        return self

    def assign_read(self, value):
        """Writes `value`, read from the masters (a reply, a pull), into this mirror;
        returns the updates."""
        updates = [super().assign(value, read_value=False)]
        if self._tfdist_last_read is not None:
            updates.append(self._tfdist_last_read.assign(value, read_value=False))
        return updates

    def change_since_read(self):
        """Non-trainable state: what this worker's steps changed in it since it last took
        the masters' value (float32), the push's `values` (the ps adds the mean change of
        an update's pushes: concurrent workers' statistics combine, none overwrites the
        others')."""
        local = super()._read_variable_op()
        return (tf.cast(local, tf.float32)
                - tf.cast(self._tfdist_last_read.read_value(), tf.float32))

    def master_value(self, consistent=True):
        """The value of the master copy (its parts joined; inside
        `tfdist.ps.snapshot.consistent_reads()`, each from its shard's snapshot, unless
        not `consistent`)."""
        values = [consistent_value(master) if consistent else master.read_value()
                  for master, _ in self._tfdist_masters]
        return values[0] if len(values) == 1 else tf.concat(values, axis=0)

    def _refresh(self, value=None):
        """After a write to the masters: the copies and this variable take their value
        (`value`: the value written, not read back, which another worker's update may have
        changed since)."""
        if value is None:
            value = self.master_value(consistent=False)
        for copy in self._tfdist_copies:
            copy.assign(value, read_value=False)
        self.assign_read(value)
        return self

    def _serialize_to_tensors(self):
        # `tf.train.Checkpoint` asks for the value eagerly and may read it later in a
        # function of its own (a save that spans tasks: a table's parts are written by the
        # ps tasks), where this variable stands for its local copy: the master's value is
        # taken now (inside `consistent_reads()`, which the checkpoint's write enters: from
        # the shard's snapshot).
        if _stands_for_master(self):
            return {_tf_compat.VARIABLE_VALUE_KEY: self.read_value()}
        return super()._serialize_to_tensors()

    def _read_variable_op(self, no_copy=False):
        if _stands_for_master(self):
            with tf.device(self.device):
                return tf.identity(self.master_value())
        return super()._read_variable_op(no_copy=no_copy)

    def _write(self, method, value, **kwargs):
        if not _stands_for_master(self):
            return getattr(super(), method)(value, **kwargs)
        if not self._tfdist_writable:
            return self
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        for master, rows in self._tfdist_masters:
            # Each part's own op on its ps task: an add there is atomic against the updater.
            getattr(master, method)(value if rows is None else value[rows[0]:rows[1]],
                                    read_value=False)
        return self._written(value if method == "assign" else None)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._write("assign", value, use_locking=use_locking, name=name,
                           read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_add", delta, use_locking=use_locking, name=name,
                           read_value=read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_sub", delta, use_locking=use_locking, name=name,
                           read_value=read_value)

    def _scatter(self, method, sparse_delta, use_locking=False, name=None):
        if not _stands_for_master(self):
            return getattr(super(), method)(sparse_delta, use_locking=use_locking, name=name)
        if not self._tfdist_writable:
            return self
        for master, rows in self._tfdist_masters:
            delta = sparse_delta if rows is None else _rows_of(sparse_delta, rows)
            getattr(master, method)(delta, use_locking=use_locking, name=name)
        return self._written()

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_update", sparse_delta, use_locking, name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_add", sparse_delta, use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_sub", sparse_delta, use_locking, name)


class Part(typing.NamedTuple):
    """The rows of a mirror that one ps task holds (`rows` None: the whole variable)."""

    variable: MirrorVariable
    rows: tuple = None

    @property
    def shape(self):
        shape = self.variable.shape.as_list()
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return shape

    def take(self, tensor):
        """This part of `tensor`, a value (or gradient) of the whole variable; of a sparse
        gradient (`tf.IndexedSlices`), the slices of this part's rows, renumbered."""
        if self.rows is None:
            return tensor
        begin, end = self.rows
        if isinstance(tensor, tf.IndexedSlices):
            mine = tf.logical_and(tensor.indices >= begin, tensor.indices < end)
            return tf.IndexedSlices(tf.boolean_mask(tensor.values, mine),
                                    tf.boolean_mask(tensor.indices, mine) - begin,
                                    dense_shape=self.shape)
        return tf.convert_to_tensor(tensor)[begin:end]
