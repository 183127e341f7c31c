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
import threading

import tensorflow as tf

from tfdist import _tf_compat

_state = threading.local()


@contextlib.contextmanager
def replica_step():
    """Marks this thread as running a replica's step (eagerly or while tracing it)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _stands_for_master(variable):
    return (variable._tfdist_master is not None and tf.executing_eagerly()
            and not getattr(_state, "depth", 0))


class SharedVariable(_tf_compat.BaseResourceVariable):
    """A resource variable whose storage is a shared resource on a ps task.

    It has no deleter: no task can destroy the copy that the others use.
    """


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


_MIRROR_ARGS = ("initial_value", "trainable", "name", "dtype", "constraint",
                "distribute_strategy", "synchronization", "aggregation", "shape")


class MirrorVariable(_tf_compat.ResourceVariable):
    """A worker's local copy of a master variable (see the module docstring).

    Made by `MirrorVariable.create`; `tf.Variable`'s metaclass keeps a subclass from adding
    constructor arguments of its own.
    """

    _tfdist_master = None
    _tfdist_copies = ()
    _tfdist_writable = True

    @classmethod
    def create(cls, path, ps_index, role, **kwargs):
        """A mirror of the master at Keras path `path` on ps task `ps_index`.

        Args:
          path: the Keras variable path, the master's key.
          ps_index: the ps task that holds the master.
          role: what a push does with it (`tfdist.ps.protocol` roles).
          **kwargs: `tf.Variable` arguments.
        """
        variable = cls(**{k: v for k, v in kwargs.items() if k in _MIRROR_ARGS})
        variable._tfdist_path = path
        variable._tfdist_ps_index = ps_index
        variable._tfdist_role = role
        return variable

    def bind(self, master):
        """From now on, outside a step, this variable stands for `master`.

        Binding more masters makes them copies (the optimizer's step counter and learning
        rate, one per ps task): reads take the first, writes go to all.
        """
        if self._tfdist_master is None:
            self._tfdist_master = master
        else:
            self._tfdist_copies = (*self._tfdist_copies, master)

    def follow(self):
        """Outside a step, writes are ignored: another task (the chief) sets this variable."""
        self._tfdist_writable = False

    def _read_variable_op(self, no_copy=False):
        if _stands_for_master(self):
            with tf.device(self.device):
                return tf.identity(self._tfdist_master.read_value())
        return super()._read_variable_op(no_copy=no_copy)

    def _write(self, method, *args, **kwargs):
        if not _stands_for_master(self):
            return getattr(super(), method)(*args, **kwargs)
        if not self._tfdist_writable:
            return self
        kwargs["read_value"] = False
        getattr(self._tfdist_master, method)(*args, **kwargs)
        for copy in self._tfdist_copies:
            copy.assign(self._tfdist_master.read_value(), read_value=False)
        super().assign(self._tfdist_master.read_value(), read_value=False)
        return self

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
        getattr(self._tfdist_master, method)(sparse_delta, use_locking=use_locking, name=name)
        for copy in self._tfdist_copies:
            copy.assign(self._tfdist_master.read_value(), read_value=False)
        super().assign(self._tfdist_master.read_value(), read_value=False)
        return self

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_update", sparse_delta, use_locking, name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_add", sparse_delta, use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_sub", sparse_delta, use_locking, name)
