"""Keras's private state that the engines read: optimizers' and variables' private
attributes, and the paths of variables being made.

Keras 3 exposes no public name for an optimizer's trained variables (in order), a Keras
variable's TF storage as it is (`.value` may autocast it), its shape before its storage
exists, or an optimizer's own weight-decay rules; the ps engine needs each of them.
Checked against Keras 3.15: `BaseOptimizer._trainable_variables` (set in `build`),
`_iterations`, `_get_variable_index`, `_use_weight_decay` and `_apply_weight_decay` in
`keras/src/optimizers/base_optimizer.py`; `Variable._value` and `_shape` in
`keras/src/backend/common/variables.py`; the initializer a variable's storage is made from
in `keras/src/backend/tensorflow/core.py`. `tests/tf_compat_test.py` runs each function.

Part of `tfdist._tf_compat`, which re-exports every name here.
"""


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


def keras_initializer_of(initial_value):
    """The Keras initializer a Keras variable's `initial_value` calls, or None.

    Keras 3.15's TF backend makes a variable's storage from
    `lambda: initializer(self._shape, dtype=self._dtype)`
    (`Variable._initialize_with_initializer`, `keras/src/backend/tensorflow/core.py`): the
    initializer is that function's free variable `initializer`. Anything else (a value, a
    function of another shape) gives None.
    """
    code = getattr(initial_value, "__code__", None)
    closure = getattr(initial_value, "__closure__", None)
    if code is None or not closure or "initializer" not in code.co_freevars:
        return None
    found = closure[code.co_freevars.index("initializer")].cell_contents
    import keras

    return found if isinstance(found, keras.initializers.Initializer) else None


def keras_initializer_fans(initializer, shape):
    """`(fan_in, fan_out)` of a Keras variance-scaling initializer on `shape`, as its own
    `__call__` computes them (Keras 3.15: `compute_fans` in
    `keras/src/initializers/random_initializers.py`, with the initializer's `input_axes`
    and `output_axes`)."""
    from keras.src.initializers.random_initializers import compute_fans

    return compute_fans(shape, input_axes=initializer.input_axes,
                        output_axes=initializer.output_axes)


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
