"""Model averaging's outer optimizer (DiLoCo): its argument, its copy on a worker, its state.

With an outer optimizer, a round of `ModelAveragingStrategy` does not replace the master copy
by the workers' mean model: the mean change `master - mean(local)` is an "outer gradient",
which the outer optimizer (any Keras optimizer) applies to the master copy on the ps tasks
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023: SGD with Nesterov momentum, learning rate 0.7, momentum 0.9).

Its state lives where the parameter-server strategies keep an optimizer's state: in master
variables on the ps tasks, keyed by Keras path, a slot of a variable split over ps tasks split
alike. Each worker builds its own copy of the outer optimizer (`OuterOptimizer`) on the model's
trained variables when it joins a run, under the strategy's scope, so that its variables are
mirrors of those masters: the chief initialises them, and its Keras checkpoints read and
restore them, as they do the model's. Keras saving reaches them through an attribute of the
model's optimizer (`tfdist_outer_optimizer`), in the checkpoint at
`optimizer/tfdist_outer_optimizer`.
"""

import json

import keras
import numpy as np

from tfdist import _saved_state
from tfdist import _tf_compat

# The name every task gives the outer optimizer: its variables' Keras paths (the masters' keys)
# are `outer_optimizer/...` on the workers and on the ps tasks alike.
NAME = "outer_optimizer"
# The attribute of the model's optimizer under which Keras checkpoints hold the outer state.
CHECKPOINT_ATTRIBUTE = "tfdist_outer_optimizer"

# Optimizer settings that mean nothing, or something wrong, for an update made on each ps task
# from the round's mean change.
_REFUSED = {
    "clipnorm": "each ps task applies the outer optimizer to its own shard (and a variable "
                "split over ps tasks part by part): a norm would be of a part",
    "global_clipnorm": "each ps task applies the outer optimizer to its own shard: the norm "
                       "would be of one shard's outer gradient",
    "use_ema": "the master copy is the model every worker continues from",
    "gradient_accumulation_steps": "every round is one outer step",
    "loss_scale_factor": "the outer gradient is a change of the weights, not of a loss",
}


def outer_optimizer_config(identifier):
    """Checks a strategy's `outer_optimizer` argument; returns its Keras config, or None.

    Args:
      identifier: None, a `keras.optimizers.Optimizer`, its name (`"sgd"`), its config (a
        dict `{"class_name": ..., "config": {...}}`, as `keras.optimizers.get` takes it) or
        that config as a JSON string (what a `--strategy_arg` flag carries).

    Raises:
      ValueError: the argument is none of those, or asks for what an outer update cannot do.
    """
    if identifier is None:
        return None
    received = identifier
    if isinstance(identifier, str) and identifier.lstrip().startswith("{"):
        try:
            identifier = json.loads(identifier)
        except json.JSONDecodeError as e:
            raise ValueError(f"`outer_optimizer` is a JSON string that does not parse ({e}). "
                             f"Received: {received!r}") from None
    if isinstance(identifier, keras.optimizers.Optimizer):
        optimizer = identifier
    elif isinstance(identifier, (str, dict)):
        try:
            optimizer = keras.optimizers.get(identifier)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"`outer_optimizer` must be a Keras optimizer, its name (e.g. 'sgd') or its "
                f"config ({{'class_name': 'SGD', 'config': {{...}}}}, a dict or JSON): Keras "
                f"could not make one ({type(e).__name__}: {e}). Received: {received!r}"
            ) from None
    else:
        raise ValueError(
            f"`outer_optimizer` must be None, a Keras optimizer, its name (e.g. 'sgd') or its "
            f"config (a dict or JSON string). Received: {received!r}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`outer_optimizer` cannot be a LossScaleOptimizer: the outer gradient is a change "
            "of the weights, not of a scaled loss. Pass its inner optimizer")
    config = keras.optimizers.serialize(optimizer)
    settings = config["config"]
    for key, why in _REFUSED.items():
        if settings.get(key):
            raise ValueError(f"`outer_optimizer` with `{key}={settings[key]!r}` is not "
                             f"supported: {why}. Received: {received!r}")
    return {**config, "config": {**settings, "name": NAME}}


class OuterOptimizer:
    """A worker's copy of the outer optimizer: mirrors of its state on the ps tasks.

    Args:
      config: the Keras config from `outer_optimizer_config`.
    """

    def __init__(self, config):
        self.config = config
        self.optimizer = None   # built when the worker joins a run
        self.building = False   # the variables made meanwhile are the outer optimizer's
        self._state = _CheckpointState()

    def attach(self, optimizer):
        """Puts the outer state in the Keras checkpoints that hold `optimizer`, the model's."""
        if optimizer is not self.optimizer:
            _saved_state.attach(optimizer, CHECKPOINT_ATTRIBUTE, self._state)

    def build(self, variables):
        """Makes the outer optimizer and its slots for `variables` (Keras variables).

        Called under the strategy's scope, which makes every variable a mirror of a master;
        a state restored from a checkpoint before (the chief's) is written into them, and
        becomes the masters' first value.
        """
        self.building = True
        try:
            self.optimizer = keras.optimizers.deserialize(self.config)
            self.optimizer.build(variables)
        finally:
            self.building = False
        self._state.bind(self.optimizer)


class _CheckpointState(_tf_compat.KerasSaveable):
    """The outer optimizer's variables in a Keras checkpoint.

    A checkpoint may be restored before the outer optimizer exists (Keras's BackupAndRestore
    restores before the first training step, when a worker joins the run and builds it): the
    values wait here until it is built.
    """

    def __init__(self):
        self._optimizer = None
        self._restored = None

    def __dir__(self):
        return []  # Keras saving walks an object's attributes: nothing is below this one

    def _obj_type(self):
        return "Optimizer"

    def save_own_variables(self, store):
        if self._optimizer is not None:
            self._optimizer.save_own_variables(store)
        elif self._restored:
            for key, value in self._restored.items():
                store[key] = value

    def load_own_variables(self, store):
        values = {key: np.array(store[key]) for key in store.keys()}
        if self._optimizer is not None:
            self._optimizer.load_own_variables(values)
        else:
            self._restored = values or None

    def bind(self, optimizer):
        self._optimizer = optimizer
        if self._restored:
            optimizer.load_own_variables(self._restored)
            self._restored = None
