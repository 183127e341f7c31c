"""Consistent reads of a shard: a checkpoint takes each shard's masters between two updates.

Each ps task applies its shard's updates one after the other, while a worker's eager read of
a master variable (`get_weights`, a checkpoint on the chief) is an RPC of its own. A model
read variable by variable while the updater applies would hold layers, slots and
`iterations` of different updates. So each run has an update lock on each ps task (a shared
`MutexV2`, `tfdist.ps.protocol.open_update_lock`): the updater holds it while it applies an
update and records it (`locked`), and a `ShardSnapshot` holds it while it reads every master
of the shard on the ps task (the values stay there until the worker reads them: each crosses
once, as a plain read's would).

Inside `consistent_reads()` the eager reads of masters come from one snapshot per shard,
taken at the first read of one of its masters. Keras's whole-model reads enter it
(`Model.save`, `Model.save_weights`, `Layer.get_weights`: `ModelCheckpoint`,
`BackupAndRestore` and `EarlyStopping` call them), and so does `join()`'s final read (of
the mirrors' masters only: its snapshots leave the table parts out); a read
outside it takes the master as it is then. Shards are read one after the other: each is
between two of its own updates (with several ps tasks, each task updates its shard on its
own, so no moment holds for all of them). An embedding table kept on the ps tasks is read in
bounded chunks (`tfdist.ps.tables`): inside `consistent_reads()` each part is copied on its
ps task under the lock, with the rest of its shard, and the chunks are read from that copy,
freed when the read ends (the part's size more on its ps task meanwhile).
"""

import contextlib
import threading

import tensorflow as tf

from tfdist import _tf_compat

_state = threading.local()


@contextlib.contextmanager
def consistent_reads(tables=True):
    """Eager reads of master variables in this thread, until it exits, come from one
    snapshot per shard (re-entrant: an inner one reads from the outer one's snapshots).

    `tables=False`: the reads inside take no part of a table kept on the ps (`join()`'s
    final read of the mirrors): the snapshots leave them out, where a copy of each would
    double the tables on their ps tasks meanwhile; a part read all the same is read as it
    is."""
    if active():
        yield
        return
    _state.taken, _state.tables = {}, tables
    try:
        yield
    finally:
        _state.taken = None  # the values go, the copies of table parts on the ps with them


def checkpoint_reads():
    """`consistent_reads()` for a `tf.train.Checkpoint` save: its snapshots leave the table
    parts out (a table's saveables are written by its ps tasks from the parts themselves: a
    copy of each would double the tables on their ps tasks, unused)."""
    return consistent_reads(tables=False)


def active():
    """Whether this thread is inside `consistent_reads()`, executing eagerly (a function
    traced meanwhile reads its variables as they are: a snapshot's tensors are eager)."""
    return getattr(_state, "taken", None) is not None and tf.executing_eagerly()


def locked(lock, fn):
    """`fn()` traced so that its ops run while `lock` (a `MutexV2` handle) is held; returns
    `(fn's result, the op that lets the lock go)`.

    The lock is let go once every op `fn` made has run (`tf.CriticalSection` waits only for
    the ops its result depends on: an update's assigns are not all in its result).
    """
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    held = tf.raw_ops.MutexLock(mutex=lock)
    with tf.control_dependencies([held]):
        result = fn()
    made = [op for op in graph.get_operations()[before:] if op is not held.op]
    with tf.control_dependencies(made):
        released = tf.raw_ops.ConsumeMutexLock(mutex_lock=held)
    return result, released


class ShardSnapshot:
    """Reads every master of one shard between two of its updates (see the module docstring).

    Args:
      device: the ps task's device.
      lock: the run's update lock there (`protocol.open_update_lock`).
      masters: the shard's master variables read whole (the mirrors' masters).
    """

    def __init__(self, device, lock, masters):
        self.device = device
        self.lock = lock
        self.masters = list(masters)
        self.tables = []
        self._take = tf.function(self._take_fn)
        self._take_masters = tf.function(lambda: self._take_fn(tables=False))
        for master in self.masters:
            master.snapshot = self
        _tf_compat.keras_whole_model_reads(consistent_reads, checkpoint_reads)

    def add_tables(self, parts):
        """Adds the masters of the shard's parts of tables kept on the ps tasks (before the
        first snapshot), read in chunks."""
        self.tables += parts
        for master in parts:
            master.snapshot = self

    def _take_fn(self, tables=True):
        def read():
            return [tf.identity(m.read_value())
                    for m in self.masters + (self.tables if tables else [])]

        values, released = locked(self.lock, read)
        with tf.control_dependencies([released]):
            return [tf.identity(v) for v in values]

    def value(self, master):
        """`master`'s value: inside `consistent_reads()`, its shard's snapshot's (of a table
        part, a tensor on the ps task, to read in chunks)."""
        if not active():
            return master.read_value()
        taken = _state.taken
        if id(self) not in taken:
            # Called on the ps task, the snapshot stays there: a value crosses to the
            # worker when it is read (a table part's, chunk by chunk).
            with tf.device(self.device):
                values = self._take() if _state.tables else self._take_masters()
            taken[id(self)] = dict(zip((id(m) for m in self.masters + self.tables), values))
        if id(master) not in taken[id(self)]:
            return master.read_value()  # a table part, left out (`consistent_reads`)
        return taken[id(self)][id(master)]
