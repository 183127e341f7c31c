"""What Keras is doing now, found where Keras offers no hook: the optimizer or layer whose
name scope is open, the gradient all-reduce or the build under way (from the stack's frames),
the model whose step is running, and Keras's whole-model reads (wrapped).

Each function says what it reaches and the Keras version it was checked on; each is pinned
by a test (`tests/tf_compat_test.py`, or the test named there). Part of `tfdist._tf_compat`,
which re-exports every name here.
"""

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


def keras_whole_model_reads(context, checkpoint_context=None):
    """Runs Keras's whole-model reads inside `context()` (a context manager factory):
    `Model.save`, `Model.save_weights` and `Layer.get_weights`, which `ModelCheckpoint`,
    `BackupAndRestore` and `EarlyStopping` call, and the functions every route to a saved
    model or weights file ends in (`keras.saving.save_model`, `keras.saving.save_weights`,
    their `keras.models` and `tf.keras` names, a name imported before this ran): Keras's own
    `saving_lib.save_model`, `saving_lib.save_weights_only` and the legacy
    `save_model_to_hdf5`, which Keras's modules look up when they call them. Keras has no
    hook around a read of the whole model, so those methods of its base classes and those
    functions of its private modules (`keras.src`: no public name reaches them) are wrapped,
    once per `context`. So is TensorFlow's `tf.train.Checkpoint._write`, which its `save`,
    `write` and `tf.train.CheckpointManager.save` call (a checkpoint's variables are read,
    `_serialize_to_tensors`, eagerly inside it), in `checkpoint_context` (None: `context`)."""
    import functools

    import keras
    import tensorflow as tf
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib

    def wrap(original, context):
        @functools.wraps(original)
        def read_whole(*args, **kwargs):
            with context():
                return original(*args, **kwargs)
        read_whole._tfdist_original = original
        read_whole._tfdist_reads_in = context
        return read_whole

    for owner, name, within in (
            (keras.Model, "save", context), (keras.Model, "save_weights", context),
            (keras.layers.Layer, "get_weights", context), (saving_lib, "save_model", context),
            (saving_lib, "save_weights_only", context),
            (legacy_h5_format, "save_model_to_hdf5", context),
            (tf.train.Checkpoint, "_write", checkpoint_context or context)):
        method = owner.__dict__[name]
        if getattr(method, "_tfdist_reads_in", None) is within:
            continue
        setattr(owner, name, wrap(getattr(method, "_tfdist_original", method), within))
