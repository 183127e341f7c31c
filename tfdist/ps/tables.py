"""Embedding tables that live only on the ps tasks: a worker reads the rows its batch touches.

A parameter server exists for models whose largest variables should not be copied to every
worker: the embedding tables of recommendation and ranking models, of which a step touches a
few thousand rows out of millions. A `TableVariable` is such a table as a worker's Keras model
sees it: a variable of the table's full shape with no storage on the worker. It lives whole
on one ps task or split by rows over several (`tfdist.ps.table_set`), each part a shared
variable there, by a name every task derives from the table's Keras path and rows; and:

* a lookup (`tf.gather` / Keras's `ops.take`, which Keras's `Embedding` calls) runs one gather
  per part on that part's ps task, as TF's own `ParameterServerStrategy` does: only the rows
  cross the network, each distinct one once. Its gradient is the rows' gradients
  (`tf.IndexedSlices`, one summed row per distinct id), which the worker pushes; the ps
  updates those rows (`tfdist.ps.rowwise`);
* a read of the whole table inside a train, test or predict step is an error that names the
  table (`check_step_reads`): it would copy the table to the worker every step;
* outside a step (saving a checkpoint, `get_weights`) the table is read in chunks of at most
  `CHUNK_BYTES`, each its own message, and the chief's writes (`load_weights`, a restored
  checkpoint) go to the parts in chunks too; other workers' writes are ignored, as for every
  master variable.
"""

import contextlib
import logging
import threading

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps import snapshot as snapshot_lib
from tfdist.ps import table_init
from tfdist.ps import variables as variables_lib
from tfdist.ps.spec import RunError

CONTAINER = "tfdist"
# The most one message of a chunked read or write carries (gRPC's own limit is 2 GiB).
CHUNK_BYTES = 64 << 20


def part_name(path, rows):
    """The shared name of the part `rows` = `(begin, end)` of the table at Keras path `path`.

    It names no run: a lookup traced before the worker joins a run (the first step's forward
    pass) must already hold the handle it will use.
    """
    return f"table/{path}/{rows[0]}:{rows[1]}"


def owner_name(path, rows):
    """The shared name of the string beside a part that names the run whose chief last
    initialised it (`TableVariable.claim`): a part outlives its run, and a later run of a
    model with the same table rewrites it (`TableVariable.read_in_chunks` checks)."""
    return part_name(path, rows) + "/run"


def open_owner(device, path, rows):
    """The owner string (`owner_name`) of the part `rows` of table `path`, on `device`."""
    return variables_lib.open_shared_variable(device, owner_name(path, rows), [], tf.string,
                                              "run", container=CONTAINER)


# The lookups of the replica step running (or being traced) in this thread, by table:
# `{id(table): [(ids, rows)]}`, or None outside a step; and the bytes each lookup of the step
# moved (`take_read_bytes`).
_step = threading.local()


@contextlib.contextmanager
def step_lookups():
    """One replica step: the lookups of tables that record them (`record_lookups`) are kept
    until its push takes them (`take_lookups`), and let go when it ends, taken or not (an
    evaluate or predict step's, an eager step's); so are the bytes every lookup moved."""
    previous = getattr(_step, "lookups", None), getattr(_step, "reads", None)
    _step.lookups, _step.reads = {}, []
    try:
        yield
    finally:
        _step.lookups, _step.reads = previous


def take_read_bytes():
    """The bytes the lookups of the current step (`step_lookups`) moved, an int64 scalar:
    each distinct id of a lookup sent to the ps task that holds its row, and the row back
    (a row two lookups read, twice). Then forgets them. A lookup inside a `tf.cond` or loop
    of the model cannot be reached from the push, and is left out."""
    reads = getattr(_step, "reads", None) or []
    _step.reads = []
    reachable = [size for size in reads if _reachable(size)]
    return tf.add_n(reachable) if reachable else tf.constant(0, tf.int64)


def _reachable(tensor):
    """Whether `tensor` can be used where ops are being made now: eager, or made in the
    current graph or a graph enclosing it (whose tensors a branch or loop body captures)."""
    if not isinstance(tensor, tf.Tensor) or tf.executing_eagerly() or not hasattr(
            tensor, "graph"):
        return True
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if tensor.graph is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


class TableVariable(_tf_compat.BaseResourceVariable):
    """An embedding table whose rows live only on ps tasks (see the module docstring).

    Made by `TableVariable.create`; `tf.Variable`'s metaclass keeps a subclass from adding
    constructor arguments of its own.
    """

    _tfdist_writable = True
    # Called before an eager read outside a step: the engine makes sure the parts hold
    # values (the chief writes the initial ones; another worker waits for them).
    before_read = None

    @classmethod
    def create(cls, path, shape, dtype, parts, initial_value=None, trainable=True, name=None):
        """The table at Keras path `path`.

        Args:
          path: the Keras variable path (the parts' shared names derive from it).
          shape: the whole table's shape (rows first).
          dtype: its dtype.
          parts: `[(device, (begin, end))]`, the ps device of each part's rows, in row order,
            covering every row.
          initial_value: what `initialize` writes to parts that hold nothing yet: a callable
            (a Keras initializer's), run on the first part's ps task, or a tensor.
          trainable: as for `tf.Variable`.
          name: the variable's name (default: the path's last part).
        """
        shape = tf.TensorShape(shape)
        dtype = tf.as_dtype(dtype)
        if not parts or parts[0][1][0] != 0 or parts[-1][1][1] != shape[0] or any(
                a[1][1] != b[1][0] for a, b in zip(parts, parts[1:])):
            raise ValueError(f"the parts of table {path} must cover its {shape[0]} rows in "
                             f"order. Received: {[rows for _, rows in parts]}")
        name = name or path.rpartition("/")[2]
        opened = []
        for device, rows in parts:
            part_shape = [rows[1] - rows[0], *shape[1:]]
            opened.append((variables_lib.open_shared_variable(
                device, part_name(path, rows), part_shape, dtype, name, container=CONTAINER,
                trainable=trainable), tuple(rows)))
        handle = opened[0][0].handle
        variable = cls(handle=handle, shape=shape, dtype=dtype, trainable=trainable, name=name,
                       unique_id=f"{CONTAINER}/table/{path}", handle_name=name,
                       in_graph_mode=False)
        variable._tfdist_path = path
        variable._tfdist_parts = tuple(opened)
        variable._tfdist_initial_value = initial_value
        variable._tfdist_step_reads = []
        variable._tfdist_record_lookups = False
        variable._tfdist_pending = None   # the chief's value from before the run
        variable._tfdist_joined = False
        # The parts this worker wrote its initial value into since it last joined a run.
        variable._tfdist_written = set()
        # Each part's owner string (`claim`), and the run this worker's is in, by part.
        variable._tfdist_owners = {}
        variable._tfdist_runs = {}
        return variable

    @property
    def parts(self):
        """`((master, (begin, end)), ...)`: each part's shared variable and rows."""
        return self._tfdist_parts

    def follow(self):
        """Writes outside a step are ignored: another task (the chief) sets this table."""
        self._tfdist_writable = False

    # Lookups ------------------------------------------------------------------------------

    def sparse_read(self, indices, name=None):
        """The rows `indices` (any shape), gathered on the ps tasks that hold them.

        Each distinct id crosses to its ps task once and its row comes back once (a batch of
        Zipf-distributed ids repeats its popular ones: about half of a recommendation
        batch's ids); the worker spreads the rows to every position. The gradient likewise
        has one row per distinct id of this lookup, the sum of its positions' gradients:
        what the ps would sum before applying it (`tfdist.ps.rowwise.sum_rows`). (Two lookups
        of a table in one step give a gradient with each lookup's rows, which the ps sums.)
        """
        del name
        _tf_compat.variable_accessed(self)
        indices = tf.convert_to_tensor(indices)
        parts = self._tfdist_parts
        shape = self.shape
        distinct, position = tf.unique(tf.reshape(indices, [-1]))
        read = []  # the distinct ids' rows, as they came from the ps

        @tf.custom_gradient
        def lookup(handle):
            del handle  # the gradient's anchor: the tape watches this variable's handle
            if len(parts) == 1:
                master, _ = parts[0]
                with tf.device(master.device):
                    rows = tf.raw_ops.ResourceGather(resource=master.handle, indices=distinct,
                                                     dtype=self.dtype)
            else:
                positions, gathered = [], []
                everything = tf.range(tf.size(distinct))
                for master, (begin, end) in parts:
                    mine = tf.logical_and(distinct >= begin, distinct < end)
                    positions.append(tf.boolean_mask(everything, mine))
                    local = tf.boolean_mask(distinct, mine) - tf.cast(begin, distinct.dtype)
                    with tf.device(master.device):
                        gathered.append(tf.raw_ops.ResourceGather(
                            resource=master.handle, indices=local, dtype=self.dtype))
                # An id past the last row belongs to no part: the error a gather gives.
                tf.debugging.assert_equal(
                    tf.reduce_sum([tf.size(p) for p in positions]), tf.size(distinct),
                    message=f"an id is outside the {shape[0]} rows of table {self._tfdist_path}")
                rows = tf.dynamic_stitch(positions, gathered)
            read.append(rows)
            result = tf.reshape(tf.gather(rows, position),
                                tf.concat([tf.shape(indices), shape[1:]], axis=0))

            def gradient(upstream):
                values = tf.reshape(upstream, tf.concat([[-1], shape[1:]], axis=0))
                summed = tf.math.unsorted_segment_sum(values, position, tf.size(distinct))
                return tf.IndexedSlices(summed, distinct, tf.constant(shape.as_list(), tf.int64))

            return result, gradient

        result = lookup(self.handle)
        reads = getattr(_step, "reads", None)
        if reads is not None:
            row_bytes = shape[1:].num_elements() * self.dtype.size
            reads.append(tf.size(distinct, out_type=tf.int64)
                         * (indices.dtype.size + row_bytes))
        record = getattr(_step, "lookups", None)
        if self._tfdist_record_lookups and record is not None:
            record.setdefault(id(self), []).append((distinct, read[0]))
        return result

    def record_lookups(self):
        """From now on each lookup in a step (`step_lookups`) is kept for `take_lookups`
        (the rows a step read: delay compensation per row)."""
        self._tfdist_record_lookups = True

    def take_lookups(self):
        """The rows this table's lookups in the current step (`step_lookups`) read, as
        `tf.IndexedSlices(rows, ids)` (each distinct id of a lookup once; a row two lookups
        read, twice); then forgets them.

        The push that takes them may be traced in a branch of the step (a
        `LossScaleOptimizer` applies inside a `tf.cond`): lookups of an enclosing graph are
        captured. A lookup traced inside a branch or loop of the model itself cannot be
        reached from the push; its rows are left out (logged once): they are applied
        uncompensated, as a row nobody read would be."""
        record = getattr(_step, "lookups", None) or {}
        lookups = record.pop(id(self), [])
        reachable = [(ids, rows) for ids, rows in lookups if _reachable(rows)]
        if len(reachable) < len(lookups) and not getattr(self, "_tfdist_warned_lookups", False):
            self._tfdist_warned_lookups = True
            logging.getLogger("tfdist").warning(
                "tfdist: lookups of the table %s inside a `tf.cond` or loop of the model "
                "cannot travel with the push: delay compensation leaves their rows "
                "uncompensated", self._tfdist_path)
        if not reachable:
            return tf.IndexedSlices(tf.zeros([0, *self.shape[1:]], self.dtype),
                                    tf.zeros([0], tf.int64))
        return tf.IndexedSlices(tf.concat([rows for _, rows in reachable], axis=0),
                                tf.concat([tf.cast(ids, tf.int64) for ids, _ in reachable], 0))

    # Whole reads and writes ----------------------------------------------------------------

    def _read_variable_op(self, no_copy=False):
        del no_copy
        if tf.executing_eagerly():
            if variables_lib.in_replica_step():
                raise ValueError(self._whole_read_error("an eager step (`run_eagerly=True`)"))
            return tf.convert_to_tensor(self.read_in_chunks())
        # Traced: kept only if something uses it, which a step must not
        # (`check_step_reads`); `tf.shape` converts the table to a tensor and uses only its
        # static shape.
        reads = []
        for master, _ in self._tfdist_parts:
            with tf.device(master.device):
                reads.append(tf.raw_ops.ReadVariableOp(resource=master.handle, dtype=self.dtype))
        value = reads[0] if len(reads) == 1 else tf.concat(reads, axis=0)
        if variables_lib.in_replica_step():
            self._tfdist_step_reads.append(value)
        return value

    def _whole_read_error(self, where):
        return (f"the embedding table {self._tfdist_path} ({self.shape.as_list()}) lives on "
                f"the ps tasks and is read whole in {where}: that would copy it to the worker "
                "every step. Look rows up (`keras.layers.Embedding`, `ops.take(table, ids, "
                "axis=0)`, `tf.gather`), keep the step compiled, or keep this variable on the "
                "workers: `embedding_tables=None` on the strategy (or leave it out of its list)")

    def read_in_chunks(self):
        """The whole table as a NumPy array, read part by part in bounded chunks (before the
        run, the chief's own value of it, if it wrote one)."""
        if not tf.executing_eagerly():
            raise ValueError(self._whole_read_error("a traced function"))
        if self._tfdist_pending is not None:
            return self._tfdist_pending.copy()
        if self.before_read is not None:
            self.before_read()
        self._check_owners()
        out = np.empty(self.shape.as_list(), self.dtype.as_numpy_dtype)
        # Inside `tfdist.ps.snapshot.consistent_reads()`: each part's copy, taken on its ps
        # task between two updates with the rest of its shard.
        copies = ({id(master): variables_lib.consistent_value(master)
                   for master, _ in self._tfdist_parts if master.snapshot is not None}
                  if snapshot_lib.active() else {})
        for master, begin, end in self._chunks():
            offset = self._part_begin(master)
            with tf.device(master.device):
                if id(master) in copies:
                    chunk = copies[id(master)][begin - offset:end - offset]
                else:
                    # A gather of the chunk's rows: a read of the whole part would copy it
                    # on the ps at every chunk (a gathered variable is copied on read).
                    chunk = tf.raw_ops.ResourceGather(
                        resource=master.handle, dtype=self.dtype,
                        indices=tf.range(begin - offset, end - offset, dtype=tf.int64))
            out[begin:end] = chunk.numpy()
        self._check_owners()  # (a run that started during the read wrote some of it)
        return out

    def _part_begin(self, master):
        return next(rows[0] for m, rows in self._tfdist_parts if m is master)

    def _chunks(self, parts=None):
        """`(master, begin, end)` for every chunk of rows of `parts` (default: all), in row
        order."""
        row_bytes = max(1, int(np.prod(self.shape[1:], dtype=np.int64))) * self.dtype.size
        step = max(1, CHUNK_BYTES // row_bytes)
        for master, (begin, end) in parts or self._tfdist_parts:
            for start in range(begin, end, step):
                yield master, start, min(end, start + step)

    def is_initialized(self, name=None):
        del name
        with tf.init_scope():
            return all(variables_lib.is_initialized(master) for master, _ in self._tfdist_parts)

    def initialize(self, force=False):
        """Writes the initial value into every part that holds nothing yet (`force`: into
        every part, but those this worker wrote since it last joined a run: a step's
        `ready()` wrote them just before its run started): the chief's own value if it
        wrote one before the run, else the initializer's, computed on the first part's ps
        task (nothing crosses to this worker). Returns how many parts it wrote."""
        targets = [(m, rows) for m, rows in self._tfdist_parts
                   if not variables_lib.is_initialized(m)
                   or (force and id(m) not in self._tfdist_written)]
        if not targets:
            return 0
        self._write_initial(targets)
        self._tfdist_written.update(id(m) for m, _ in targets)
        return len(targets)

    def _write_initial(self, targets):
        """Writes the initial value (`initialize`) into the parts `targets`."""
        if self._tfdist_pending is not None:
            self._write_parts(self._tfdist_pending, targets)
            return
        initial = self._tfdist_initial_value
        make_rows = (self._rows_initializer(initial) if len(self._tfdist_parts) > 1
                     else None)
        if make_rows is not None:
            # Each part's rows made on its own ps task, a chunk at a time: no task holds
            # more than its part and a chunk.
            self._write_parts(make_rows, targets)
            return
        with tf.init_scope(), tf.device(self._tfdist_parts[0][0].device):
            value = initial() if callable(initial) else initial
            value = tf.convert_to_tensor(value, dtype=self.dtype)
            if value.shape != self.shape:
                raise ValueError(f"the initial value of table {self._tfdist_path} has shape "
                                 f"{value.shape}, not {self.shape}")
            if len(self._tfdist_parts) == 1:
                # One part, on this device: the value becomes the part (an assign takes the
                # tensor, not a copy), where a write in chunks would hold both.
                self._tfdist_parts[0][0].assign(value, read_value=False)
                return
        self._write_parts(value, targets)

    def _rows_initializer(self, initial):
        """`make(begin, end)`: rows of the initial value made alone (`table_init`), or None
        (the value is made whole, on the first part's ps task)."""
        if not callable(initial):
            return None
        initializer = _tf_compat.keras_initializer_of(initial)
        make_rows = (None if initializer is None
                     else table_init.rows_initializer(initializer, self.shape, self.dtype))
        if make_rows is None:
            logging.getLogger("tfdist").info(
                "tfdist: the initial value of table %s is made whole on %s, then split over "
                "its %d parts (its initializer, %s, is not made a part at a time)",
                self._tfdist_path, self._tfdist_parts[0][0].device, len(self._tfdist_parts),
                type(initializer).__name__ if initializer is not None else "a function")
        return make_rows

    def claim(self, runs):
        """A new run, on its chief, before `initialize` writes it: each part's owner names
        the run (`runs`: `{id(master): run}`, the run of the part's ps task)."""
        with tf.init_scope():
            for master, _ in self._tfdist_parts:
                self._owner(master).assign(runs[id(master)], read_value=False)

    def _owner(self, master):
        """The string beside part `master` naming the run that owns it (`owner_name`)."""
        if id(master) not in self._tfdist_owners:
            rows = next(rows for m, rows in self._tfdist_parts if m is master)
            self._tfdist_owners[id(master)] = open_owner(master.device, self._tfdist_path,
                                                         rows)
        return self._tfdist_owners[id(master)]

    def _check_owners(self):
        """A whole read (a checkpoint, the model saved after `join()`) of a run's table
        must be that run's: a later run of a model with this table (another job on these
        ps tasks, or this job started again while a worker took a finished run's final
        weights) rewrites the parts, which would otherwise be read, and saved, silently."""
        if not self._tfdist_runs:
            return  # not in a run yet: the parts hold no run's values
        with tf.init_scope():
            for master, rows in self._tfdist_parts:
                owner = self._owner(master)
                found = (owner.numpy().decode("utf-8", "replace")
                         if variables_lib.is_initialized(owner) else None)
                run = self._tfdist_runs[id(master)]
                if found == run:
                    continue
                now = (f"belong to run {found} now" if found is not None else
                       "belong to no run now (a later run freed them on the ps task)")
                raise RunError(
                    f"the embedding table {self._tfdist_path}: its rows {rows[0]}:{rows[1]} "
                    f"on {master.device} {now}, not to run {run} this worker is in: a "
                    "later run of a model with this table (another job on these ps tasks, "
                    "or this job started again) took them, and they are neither read (nor "
                    "saved) nor written as this run's. Take this run's model from its own "
                    "checkpoint (`keras.callbacks.ModelCheckpoint`, `BackupAndRestore`), "
                    "and give each job its own ps tasks")

    def joined(self, initialized, runs=None):
        """The worker joined a run: the chief's value from before it (`load_weights`, a
        restored backup) became the run's if the run was new (`initialized`: `initialize`
        wrote it), else the run's table stands, as for every master variable. `runs`
        (`{id(master): run}`): the run of each part's ps task, which whole reads check
        the part still belongs to (`claim`)."""
        self._tfdist_runs = dict(runs or {})
        if self._tfdist_pending is not None and not initialized:
            logging.getLogger("tfdist").info(
                "tfdist: the run in progress keeps its table %s; the value written before "
                "joining it is dropped", self._tfdist_path)
        self._tfdist_pending = None
        self._tfdist_joined = True
        self._tfdist_written = set()

    def _write_parts(self, value, parts):
        """Writes `value` (the whole table: a NumPy array, a tensor on some device, or a
        function `(begin, end) -> rows` run on each part's device) into `parts`, in chunks
        of at most `CHUNK_BYTES`."""
        with tf.init_scope():
            for master, _ in parts:
                if not variables_lib.is_initialized(master):
                    with tf.device(master.device):
                        master.assign(tf.zeros(master.shape, self.dtype), read_value=False)
            for master, begin, end in self._chunks(parts):
                offset = self._part_begin(master)
                rows = tf.range(begin - offset, end - offset, dtype=tf.int64)
                if isinstance(value, np.ndarray):
                    chunk = tf.constant(value[begin:end])
                elif callable(value):
                    with tf.device(master.device):
                        chunk = value(begin, end)
                else:
                    with tf.device(value.device):
                        chunk = value[begin:end]
                with tf.device(master.device):
                    tf.raw_ops.ResourceScatterUpdate(resource=master.handle, indices=rows,
                                                     updates=chunk)

    def _write(self, value):
        if variables_lib.in_replica_step() or not tf.executing_eagerly():
            raise ValueError(
                f"the embedding table {self._tfdist_path} is written in a step or a traced "
                "function: its rows are updated on the ps tasks, by the optimizer; write it "
                "eagerly (`set_weights`, `load_weights`) on the chief")
        if not self._tfdist_writable:
            return self
        value = np.array(value, self.dtype.as_numpy_dtype)
        if value.shape != tuple(self.shape.as_list()):
            raise ValueError(f"the value written to table {self._tfdist_path} has shape "
                             f"{value.shape}, not {self.shape.as_list()}")
        if self._tfdist_joined:
            self._check_owners()  # (a later run's table is not this run's to write)
            self._write_parts(value, self._tfdist_parts)
        else:
            # Before the run: the chief's value, written when it starts a new run (a run in
            # progress keeps its own table, as for every master variable).
            self._tfdist_pending = value
            self._tfdist_written = set()
        return self

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name
        self._write(value)
        return self if read_value else None

    def _gather_saveables_for_checkpoint(self):
        """A `tf.train.Checkpoint` saves a table as its parts, each a slice of the whole (as
        TF's `ShardedVariable` does), read and written on its ps task; a checkpoint of a
        table and of a plain variable of its shape are the same."""
        def saveables(name=self.name):
            self._check_owners()  # (at each save and restore, before the parts are read)
            out = []
            for master, (begin, _) in self._tfdist_parts:
                offset = [begin] + [0] * (len(self.shape) - 1)
                spec = tf.Variable.SaveSliceInfo(
                    full_name=name, full_shape=self.shape.as_list(), var_offset=offset,
                    var_shape=master.shape.as_list()).spec
                out.append(_PartSaveable(master, spec, name, self))
            return out

        return {"VARIABLE_VALUE": saveables}

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        """A SavedModel (`model.export`, `tf.saved_model.save`) of a model whose tables live
        on the ps tasks is refused with the route that works: its functions gather rows on
        the ps devices and would carry the table's parts as variables of their own."""
        del object_map, tensor_map, options, kwargs
        raise ValueError(
            f"the embedding table {self._tfdist_path} ({self.shape.as_list()}) lives on the "
            "ps tasks: a SavedModel (`model.export`, `tf.saved_model.save`) cannot be made "
            "from this model. On the chief, save it as a Keras file (the tables are read in "
            "bounded chunks), load that file without a strategy and export the copy:\n"
            "    model.save('model.keras')\n"
            "    keras.models.load_model('model.keras').export('exported')\n"
            "(or keep the tables on the workers: `embedding_tables=None` on the strategy)")

    def _refuse(self, *args, **kwargs):
        del args, kwargs
        raise ValueError(
            f"the embedding table {self._tfdist_path} lives on the ps tasks: its rows are "
            "updated there by the optimizer; write it whole with `assign` (on the chief)")

    assign_add = assign_sub = scatter_add = scatter_sub = scatter_update = _refuse
    scatter_max = scatter_min = scatter_mul = scatter_div = batch_scatter_update = _refuse
    scatter_nd_add = scatter_nd_sub = scatter_nd_update = _refuse


def check_step_reads(tables):
    """Raises if a step just traced used a whole-table read (`TableVariable` docstring)."""
    for table in tables:
        reads, table._tfdist_step_reads = table._tfdist_step_reads, []
        if any(read.consumers() for read in reads):
            raise ValueError(table._whole_read_error("the step's code (a custom layer, a "
                                                     "regularizer or a constraint of it?)"))



class _PartSaveable(_tf_compat.ResourceVariableSaveable):
    """One part of a table in a checkpoint; restoring it writes nothing on a worker that
    follows the chief (its writes are ignored, as every other of its writes to a table)."""

    def __init__(self, master, spec, name, table):
        super().__init__(master, spec, name)
        self._table = table

    def restore(self, restored_tensors, restored_shapes):
        if not self._table._tfdist_writable:
            return tf.no_op()
        return super().restore(restored_tensors, restored_shapes)
