"""TensorFlow's private `tf.distribute` names: the strategy engines tfdist extends and their
collectives.

The public `tf.distribute` API has no way to write a new strategy: a strategy is a
`tf.distribute.Strategy` over a `StrategyExtended`, and tfdist's engines subclass TF's own
(`OneDeviceExtended` for the between-graph family, `MirroredExtended` and
`CollectiveAllReduceExtended` for the all-reduce family) and read their private state. Part
of `tfdist._tf_compat`, which re-exports every name here.
"""

# The all-reduce family extends TF's own Mirrored / CollectiveAllReduce engines: compression
# hooks into their `_batch_reduce_to` (where Keras's gradient all-reduce lands on CPU), and a
# payload crosses devices as a `PerReplica`, the only type their cross-device ops accept.
from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended  # noqa: F401
from tensorflow.python.distribute.distribute_utils import regroup  # noqa: F401
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended  # noqa: F401
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended  # noqa: F401
from tensorflow.python.distribute.one_device_strategy import (  # noqa: F401
    _OneDeviceReplicaContext as OneDeviceReplicaContext,
)
from tensorflow.python.distribute.values import Mirrored  # noqa: F401
from tensorflow.python.distribute.values import PerReplica  # noqa: F401


def in_xla_context():
    """Whether the function being traced is compiled by XLA (`jit_compile=True`)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def inside_while_loop():
    """Whether the function being traced is part of a `tf.while_loop` body or condition
    (Keras 3 runs `steps_per_execution > 1` steps in one)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_v2_func_graphs as graphs

    graph = tf.compat.v1.get_default_graph()
    while graph is not None and getattr(graph, "building_function", False):
        if isinstance(graph, (graphs.WhileBodyFuncGraph, graphs.WhileCondFuncGraph)):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def use_trace_time_instance_keys_in_loops(cross_device_ops):
    """Makes `cross_device_ops`' collectives traced inside a `tf.while_loop` take their
    instance keys when they are traced.

    TF 2.21 gives a collective traced in a `tf.function` its instance key at call time, as
    a "call-time capture" of the enclosing function. A collective in a function called
    inside a loop body (Keras's step function inside its `steps_per_execution` loop) leaves
    that capture as a placeholder nothing feeds: "You must feed a value for placeholder
    tensor ...". A key fixed when the op is traced is what TF's collectives used before
    call-time keys, and is safe in a loop: the collective executor tells the iterations of
    one op apart by its frame and iteration. Every worker traces the same steps in the same
    order (Keras traces on each worker's first call), so their keys agree. The limit: these
    keys come from the per-device counter the call-time keys use, so a function that one
    worker alone traces (or retraces, for an input shape only it sees) shifts that worker's
    later keys against the others', and their collectives do not meet.

    Returns the number of collective launchers changed (TF 2.21:
    `CollectiveAllReduce._launchers` and `CollectiveReplicaLauncher._use_unique_instance_key`
    in `tensorflow/python/distribute/cross_device_ops.py` and `cross_device_utils.py`; none for
    cross-device ops that are not collective).
    """
    import types

    launchers = getattr(cross_device_ops, "_launchers", ())
    for launcher in launchers:
        base = launcher._use_unique_instance_key  # pylint: disable=protected-access

        def use_unique_instance_key(self, base=base):
            del self
            return base() and not inside_while_loop()

        launcher._use_unique_instance_key = types.MethodType(  # pylint: disable=protected-access
            use_unique_instance_key, launcher)
    return len(launchers)


# Strategy engines: the private state of TF's `StrategyExtended` classes a subclass reads --------
# (Checked against TF 2.21.) A strategy's behaviour lives in its `StrategyExtended`; TF gives
# a subclass no public name for the strategy it belongs to, for the one device of a
# `OneDeviceExtended`, for a worker's place in a multi-worker cluster, or for the
# cross-device ops doing its all-reduces.


def container_strategy(extended):
    """The `tf.distribute.Strategy` that `extended` (a `StrategyExtended`) belongs to.

    TF 2.21: `StrategyExtendedV2._container_strategy` in
    `tensorflow/python/distribute/distribute_lib.py` (a method reading a weak reference).
    """
    return extended._container_strategy()  # pylint: disable=protected-access


def one_device(extended):
    """The device string of a `OneDeviceExtended` (its one replica's, resolved).

    TF 2.21: `OneDeviceExtended.__init__` sets `self._device = device_util.resolve(device)` in
    `tensorflow/python/distribute/one_device_strategy.py`.
    """
    return extended._device  # pylint: disable=protected-access


def worker_index_in_cluster(extended):
    """The index of this worker among a multi-worker strategy's workers (0 for one process).

    Replica `r` of this process is replica `index * len(worker_devices) + r` of the job, as
    TF numbers them. TF 2.21: `CollectiveAllReduceExtended._id_in_cluster` (set in
    `_initialize_local` and `_initialize_multi_worker` of
    `tensorflow/python/distribute/collective_all_reduce_strategy.py`); a `MirroredExtended`
    (one process) has none.
    """
    if isinstance(extended, CollectiveAllReduceExtended):
        return extended._id_in_cluster  # pylint: disable=protected-access
    return 0


def cross_device_ops(extended):
    """The distinct `CrossDeviceOps` a Mirrored / MultiWorkerMirrored extended reduces with.

    TF 2.21: `MirroredExtended` keeps them in `_cross_device_ops` and, with its fallbacks,
    `_collective_ops` (`tensorflow/python/distribute/mirrored_strategy.py`, `__init__` and
    `_initialize_single_worker`); `CollectiveAllReduceExtended` in `_cross_device_ops` and
    `_host_cross_device_ops` (`collective_all_reduce_strategy.py`, `_initialize_local` and
    `_initialize_multi_worker`). Those not made (None) are left out.
    """
    found = []
    for name in ("_collective_ops", "_cross_device_ops", "_host_cross_device_ops"):
        ops = getattr(extended, name, None)
        if ops is not None and all(ops is not other for other in found):
            found.append(ops)
    return found
