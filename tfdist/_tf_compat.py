"""Every TensorFlow / Keras private API tfdist cannot avoid, in one place.

The public `tf.distribute` API has no way to write a new strategy, and Keras 3 exposes no
hook for where its optimizer lives. Each import below says why it is needed, so that the next
TensorFlow or Keras upgrade touches this file only.
"""

# Model averaging's outer optimizer state, like codec state, saves itself with its
# optimizer (an attribute, which Keras saving walks; Keras exports no public name for it).
# Codec state saves itself with its optimizer: the class Keras's saving walks into (and,
# below, the base class whose `_serialize_to_tensors` a `tf.train.Checkpoint` calls). Its
# variables are made while a step is traced, maybe after a checkpoint was restored, so it
# saves itself as one entry rather than as variables.
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: F401

# A strategy is a `tf.distribute.Strategy` over a `StrategyExtended`; the one-device extended
# is the base of the parameter-server family (one replica per worker process).
from tensorflow.python.distribute import distribute_lib  # noqa: F401
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended  # noqa: F401
from tensorflow.python.distribute.one_device_strategy import (  # noqa: F401
    _OneDeviceReplicaContext as OneDeviceReplicaContext,
)

# A master variable is a resource variable around a handle that every worker opens by shared
# name on a ps task; only the private base class accepts an existing handle.
from tensorflow.python.ops import handle_data_util  # noqa: F401
from tensorflow.python.ops import resource_variable_ops  # noqa: F401
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable  # noqa: F401

# A worker's mirror of a master variable is a local resource variable whose eager reads and
# writes outside a step go to the master: a subclass of the concrete class.
from tensorflow.python.ops.resource_variable_ops import ResourceVariable  # noqa: F401

# (Codec state, as above: what `tf.train.Checkpoint` saves.)
from tensorflow.python.trackable.base import Trackable  # noqa: F401

# A table kept on the ps saves itself as slices of its parts (`tfdist.ps.tables`), as TF's
# own `ShardedVariable` does, through the saveable of a resource variable.
from tensorflow.python.training.saving.saveable_object_util import ResourceVariableSaveable  # noqa: F401


def set_handle_shape_and_dtype(handle, shape, dtype):
    """Gives a raw `VarHandleOp` handle the shape metadata a `tf.Variable` needs.

    Without it Keras fails on "unknown rank" (DESIGN.md, checked by hand).
    """
    import tensorflow as tf

    handle_data = handle_data_util.create_handle_data(tf.TensorShape(shape), tf.as_dtype(dtype))
    resource_variable_ops._set_handle_shapes_and_types(  # pylint: disable=protected-access
        handle, handle_data, graph_mode=not tf.executing_eagerly())


def keras_optimizer_in_scope():
    """The Keras optimizer whose `apply` is being traced, or None.

    Keras 3 reaches a strategy's `update` from inside `Optimizer.apply`, which runs under
    `keras.name_scope(optimizer.name, caller=optimizer)`; the strategy finds the optimizer it
    must apply on the ps there. Keras offers no public hook for it.
    """
    import keras
    from keras.src.backend.common import global_state

    for entry in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        caller = getattr(entry, "caller", None)
        if isinstance(caller, keras.optimizers.Optimizer):
            return caller
    return None


def keras_layer_in_scope():
    """The Keras layer making a variable now, or None (an optimizer's or a metric's
    variable, or one made outside Keras).

    Keras 3 makes a layer's weights under `keras.name_scope(layer.name, caller=layer)`, a
    metric's under the metric's and an optimizer's under the optimizer's; the innermost
    caller says whose variable it is. Keras offers no public hook for it.
    """
    import keras
    from keras.src.backend.common import global_state

    for entry in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        caller = getattr(entry, "caller", None)
        if caller is not None:
            return caller if isinstance(caller, keras.layers.Layer) else None
    return None


def in_xla_context():
    """Whether the function being traced is compiled by XLA (`jit_compile=True`)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def keras_gradient_all_reduce(strategy):
    """`(optimizer, variables)` of the gradients a Keras optimizer of `strategy` is
    all-reducing right now (variables in the order of the gradients), or None. An optimizer
    made outside any strategy's scope (its strategy is TF's default) gives "outside".

    Keras 3's TF optimizer sums the gradients in `_all_reduce_sum_gradients`, through the
    replica context, just after it pairs them with their variables
    (`filtered_grads_and_vars`); under MirroredStrategy the replicas run in threads of their
    own and the sum in the caller's thread, so the frame is found on the stack of this thread
    or of the replica threads of the `strategy.run` this thread is running (TF's
    `_call_for_each_replica` holds them): another thread training with the same strategy at
    the same time is not looked at. Keras offers no public hook for it.
    """
    import sys

    import keras

    stacks = sys._current_frames()
    here = sys._getframe(1)
    frames = [here]
    frame = here
    while frame is not None:
        if frame.f_code.co_name == "_call_for_each_replica":
            for thread in frame.f_locals.get("threads") or ():
                replica = stacks.get(getattr(thread, "ident", None))
                if replica is not None:
                    frames.append(replica)
        frame = frame.f_back
    found = None
    for frame in frames:
        while frame is not None:
            if frame.f_code.co_name == "_all_reduce_sum_gradients":
                optimizer = frame.f_locals.get("self")
                pairs = frame.f_locals.get("filtered_grads_and_vars")
                if isinstance(optimizer, keras.optimizers.Optimizer) and pairs is not None:
                    owner = getattr(optimizer, "_distribution_strategy", None)
                    if owner is strategy:
                        return optimizer, [variable for _, variable in pairs]
                    if type(owner).__name__ == "_DefaultDistributionStrategy":
                        found = "outside"
            frame = frame.f_back
    return found


def keras_builds_from_a_batch():
    """Whether Keras 3 is reducing a data batch to build a model from its shapes.

    Keras 3.15's `TensorFlowTrainer._maybe_symbolic_build` hands the first distributed batch
    of `fit` / `evaluate` to `Strategy.reduce("MEAN", batch, axis=None)` and reads only the
    shape and dtype of what comes back (keras-team/keras#20585). Reducing it moves a whole
    batch between the workers and fails when the replicas' batches differ in size (32 rows
    over 3 replicas are 11, 11 and 10). Keras offers no hook for it; the frame that called
    the strategy's `reduce` (the caller of this function) tells when its code is that very
    method's (pinned to Keras 3.15 by a test). Only the direct caller: a reduce made further
    down, inside the build, is a real reduce.
    """
    import sys

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    code = TensorFlowTrainer._maybe_symbolic_build.__code__  # pylint: disable=protected-access
    return sys._getframe(2).f_code is code  # the caller of the strategy's `reduce`


def keras_model_of_step(fn):
    """The Keras model whose `train_step` / `test_step` `fn` is, or None.

    Keras 3 hands its model's bound step method to `Strategy.run`, which TF wraps for
    autograph (`functools.wraps`, so `__wrapped__` leads back to it). Keras offers no other
    way for a strategy to reach the model's metrics.
    """
    import inspect

    import keras

    owner = getattr(inspect.unwrap(fn), "__self__", None)
    return owner if isinstance(owner, keras.Model) else None


def keras_own_train_step(fn):
    """The Keras model whose `fn` is Keras's own TF `train_step`, with Keras's own
    `compute_loss`, or None (a test step, a user's `train_step` or `compute_loss`, a custom
    loop: any of them may scale its loss its own way)."""
    import inspect

    import keras

    model = keras_model_of_step(fn)
    if model is None:
        return None
    step = getattr(inspect.unwrap(fn), "__func__", None)
    if (step is not keras.Model.train_step
            or type(model).compute_loss is not keras.Model.compute_loss):
        return None
    return model


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


def keras_variable_paths(optimizer, variables):
    """The Keras paths (`model/layer/kernel`) of the TF `variables` an optimizer updates.

    Keras 3's TF optimizer hands the strategy each Keras variable's TF storage
    (`variable.value`); its path is on the Keras variable. A variable the optimizer does not
    know keeps its TF name.
    """
    paths = {}
    for keras_variable in keras_optimizer_trained_variables(optimizer):
        if isinstance(getattr(keras_variable, "path", None), str):
            paths[id(getattr(keras_variable, "value", None))] = keras_variable.path
    return [paths.get(id(v), v.name.split(":")[0]) for v in variables]


def keras_variable_being_initialized():
    """The Keras `Variable` whose TF storage is being made now, or None.

    A Keras `Variable` makes its `tf.Variable` in `_initialize`, possibly later than its
    constructor ran (deferred initialisation); a strategy's variable creator runs inside it.
    Keras offers no public hook for it.
    """
    import sys

    import keras

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "_initialize" and isinstance(owner, keras.Variable):
            return owner
        frame = frame.f_back
    return None


def keras_variable_path(name):
    """The Keras path (`model/layer/kernel`) of the variable whose TF storage is being made.

    Master variables are keyed by path, which every worker gives a model's variables alike
    (a creation counter shifts when one task makes one variable more): the path of the Keras
    variable being initialised; Keras's current name scope plus `name` otherwise.
    """
    from keras.src.backend.common.name_scope import current_path

    owner = keras_variable_being_initialized()
    if owner is not None:
        return owner.path
    parent = current_path()
    return f"{parent}/{name}" if parent else name


def keras_name_scope_for_path(path):
    """A Keras name scope under which a variable named `path`'s last part gets `path`."""
    import contextlib

    import keras

    parent, _, _ = path.rpartition("/")
    if not parent:
        return contextlib.nullcontext()
    head, _, last = parent.rpartition("/")
    return keras.name_scope(last, override_parent=head or None)


# The all-reduce family extends TF's own Mirrored / CollectiveAllReduce engines: compression
# hooks into their `_batch_reduce_to` (where Keras's gradient all-reduce lands on CPU), and a
# payload crosses devices as a `PerReplica`, the only type their cross-device ops accept.
from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended  # noqa: F401,E402
from tensorflow.python.distribute.distribute_utils import regroup  # noqa: F401,E402
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended  # noqa: F401,E402
from tensorflow.python.distribute.values import Mirrored  # noqa: F401,E402
from tensorflow.python.distribute.values import PerReplica  # noqa: F401,E402

# Keras optimizers and variables: the private state a strategy reads -------------------------
# Keras 3 exposes no public name for an optimizer's trained variables (in order), a Keras
# variable's TF storage as it is (`.value` may autocast it), its shape before its storage
# exists, or an optimizer's own weight-decay rules; the ps engine needs each of them.
# Checked against Keras 3.15: `BaseOptimizer._trainable_variables` (set in `build`),
# `_iterations`, `_get_variable_index`, `_use_weight_decay` and `_apply_weight_decay` in
# `keras/src/optimizers/base_optimizer.py`; `Variable._value` and `_shape` in
# `keras/src/backend/common/variables.py`. `tests/tf_compat_test.py` runs each function.


def keras_whole_model_reads(context):
    """Runs Keras's whole-model reads inside `context()` (a context manager factory):
    `Model.save`, `Model.save_weights` and `Layer.get_weights`, which `ModelCheckpoint`,
    `BackupAndRestore` and `EarlyStopping` call. Keras has no hook around a read of the whole
    model, so those methods of its base classes are wrapped, once per `context`."""
    import functools

    import keras

    for owner, name in ((keras.Model, "save"), (keras.Model, "save_weights"),
                        (keras.layers.Layer, "get_weights")):
        method = owner.__dict__[name]
        if getattr(method, "_tfdist_reads_in", None) is context:
            continue
        original = getattr(method, "_tfdist_original", method)

        def wrap(original):
            @functools.wraps(original)
            def read_whole(self, *args, **kwargs):
                with context():
                    return original(self, *args, **kwargs)
            return read_whole

        wrapped = wrap(original)
        wrapped._tfdist_original = original
        wrapped._tfdist_reads_in = context
        setattr(owner, name, wrapped)


def keras_optimizer_trained_variables(optimizer):
    """The Keras variables `optimizer` was built on, in its order (`[]` before it is built)."""
    return list(getattr(optimizer, "_trainable_variables", None) or ())


def keras_optimizer_slot(optimizer, name, shape):
    """Whether the variable `name` of `shape` that `optimizer` makes now is a per-weight slot
    (a momentum, Adam's moments), not one of its scalars (step counter, learning rate, a loss
    scale and its counter).

    Keras marks neither. It makes a slot while the optimizer is built on its weights, named
    after the weight it shadows (`add_variable_from_reference`: `{path with _}_{slot}`), and
    of its shape; the scalars are made in the constructor, or before the weights are known.
    """
    import tensorflow as tf

    for weight in keras_optimizer_trained_variables(optimizer):
        path = getattr(weight, "path", None)
        if (isinstance(path, str) and str(name).startswith(path.replace("/", "_") + "_")
                and tf.TensorShape(shape) == tf.TensorShape(weight.shape)):
            return True
    return False


def keras_optimizer_makes_learning_rate(name):
    """Whether the variable named `name` that an optimizer makes now is its learning rate
    (Keras's constructor makes it as `learning_rate` when the rate is a float; Keras exports
    no name for it)."""
    return str(name).split(":")[0] == "learning_rate"


def keras_optimizer_learning_rate(optimizer):
    """The Keras variable holding `optimizer`'s learning rate, or None (a schedule)."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = getattr(inner, "_learning_rate", None)
    return rate if isinstance(rate, keras.Variable) else None


def keras_variable_storage(variable):
    """The TF variable behind Keras variable `variable` as it is (no autocast), or None."""
    return getattr(variable, "_value", None)


def keras_optimizer_step_storage(optimizer):
    """The TF variable behind `optimizer`'s step counter (`iterations`), or None."""
    return keras_variable_storage(getattr(optimizer, "_iterations", None))


def keras_variable_declared_shape(variable):
    """The shape Keras variable `variable` was declared with, known before its storage is
    made (None for one made from a value, which learns its shape from it)."""
    return getattr(variable, "_shape", None)


def keras_optimizer_decays(optimizer, variable):
    """Whether `optimizer`'s weight decay applies to Keras variable `variable`
    (`exclude_from_weight_decay`)."""
    return optimizer._use_weight_decay(variable)


def keras_optimizer_knows(optimizer, variable):
    """Whether `optimizer` was built on Keras variable `variable`.

    Keras 3.15: `BaseOptimizer._get_variable_index` (`keras/src/optimizers/base_optimizer.py`)
    looks the variable up in a dict, a `KeyError` for one it was not built on.
    """
    try:
        optimizer._get_variable_index(variable)  # pylint: disable=protected-access
    except KeyError:
        return False
    return True


def keras_optimizer_apply_weight_decay(optimizer, variables):
    """`optimizer`'s decoupled weight decay, applied to `variables` as its `apply` does."""
    optimizer._apply_weight_decay(variables)


def start_eager_context():
    """Starts this process's eager context now (with it, the server of a cluster it was
    connected to), which TensorFlow otherwise starts at the first op."""
    from tensorflow.python.eager import context

    context.context().ensure_initialized()


def create_remote_session(session):
    """Creates `session` (a `tf.compat.v1.Session` on a `grpc://` target) on its server now.

    A session on a remote server is created there (a CreateSession RPC, with the session's
    `operation_timeout_in_ms`) by its first run. The liveness probe
    (`tfdist.cluster.probe.ServerProbe`) creates it without running anything, so that no op
    of the probed process needs a thread; TF's `Session` has only this private method for it
    (checked on TF 2.21).
    """
    session._extend_graph()  # pylint: disable=protected-access


def discard_remote_session(session):
    """Drops `session` without the CloseSession RPC that closing it sends.

    For a session whose server is gone, or restarted and no longer knows it: the RPC would
    take its whole deadline to fail (retries of a refused connection) or would be useless.
    `Session.close` and `__del__` skip the RPC of a session marked closed; `__del__` still
    frees it in this process (checked on TF 2.21).
    """
    session._closed = True  # pylint: disable=protected-access


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


def keras_update_step_arguments(args):
    """`(gradient, learning_rate)` if `args` of a `StrategyExtended.update` call are those of
    a Keras optimizer's update step, else None (an assign of a moving average, an
    accumulation of gradients, a user's own `update`).

    Keras 3.15 gives no other sign: `TFOptimizer._distributed_tf_update_step`
    (`keras/src/backend/tensorflow/optimizer.py`) calls
    `distribution.extended.update(var, apply_grad_to_update_var, args=(grad, learning_rate),
    group=False)`, its other `update` calls (`_overwrite_model_variables_with_average_value`,
    gradient accumulation) pass one argument.
    """
    if len(args) != 2:
        return None
    return tuple(args)
