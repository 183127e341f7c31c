"""Master variables: one copy on a ps task, opened by every worker through a shared name."""

import contextlib
import threading
import time

import tensorflow as tf

from tfdist import _tf_compat

_state = threading.local()


@contextlib.contextmanager
def master_writes_suppressed():
    """Within this scope (at trace time, on this thread) writes to master variables are no-ops.

    A worker's Keras optimizer still runs after the worker has pushed its gradients; the
    update it would make is the chief updater's job, applied once per aggregated step. The
    worker step enters this scope right after its push.
    """
    previous = getattr(_state, "suppressed", False)
    _state.suppressed = True
    try:
        yield
    finally:
        _state.suppressed = previous


def writes_suppressed():
    return getattr(_state, "suppressed", False)


class MasterVariable(_tf_compat.BaseResourceVariable):
    """A resource variable whose storage is a shared resource on a ps task.

    It has no deleter: no worker can destroy the copy that the others use.
    """

    def _suppressed(self):
        return writes_suppressed()

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if self._suppressed():
            return self
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        if self._suppressed():
            return self
        return super().assign_add(delta, use_locking=use_locking, name=name,
                                  read_value=read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        if self._suppressed():
            return self
        return super().assign_sub(delta, use_locking=use_locking, name=name,
                                  read_value=read_value)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        if self._suppressed():
            return self
        return super().scatter_update(sparse_delta, use_locking=use_locking, name=name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        if self._suppressed():
            return self
        return super().scatter_add(sparse_delta, use_locking=use_locking, name=name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        if self._suppressed():
            return self
        return super().scatter_sub(sparse_delta, use_locking=use_locking, name=name)


def open_shared_variable(device, shared_name, shape, dtype, name, container="tfdist",
                         trainable=False, synchronization=None, aggregation=None,
                         distribute_strategy=None):
    """Opens (creating on first use) the variable `shared_name` on `device`, eagerly."""
    shape = tf.TensorShape(shape)
    dtype = tf.as_dtype(dtype)
    with tf.init_scope(), tf.device(device):
        handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=shape, container=container,
                                        shared_name=shared_name, name=name)
    _tf_compat.set_handle_shape_and_dtype(handle, shape, dtype)
    return MasterVariable(
        handle=handle, shape=shape, dtype=dtype, trainable=trainable, name=name,
        unique_id=f"{container}/{shared_name}", handle_name=name, in_graph_mode=False,
        synchronization=synchronization, aggregation=aggregation,
        distribute_strategy=distribute_strategy)


def is_initialized(variable):
    with tf.init_scope():
        return bool(tf.raw_ops.VarIsInitializedOp(resource=variable.handle).numpy())


def wait_until_initialized(variable, timeout, who):
    """Waits until another task initialised `variable`, or raises naming that task."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not is_initialized(variable):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{who} did not initialise the master variable {variable.name!r} within "
                f"{timeout:g} s: is the chief running the same model code?")
        time.sleep(delay)
        delay = min(0.2, delay * 2)
