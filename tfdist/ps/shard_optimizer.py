"""The ps side's copy of the user's optimizer: its config, and the strategy it is built in.

A ps task rebuilds the optimizer the workers train with (its config travels in the run's
spec), minus what each worker applied before pushing (loss scaling, clipping); inside
`ShardStrategy` every variable the optimizer makes is the master the workers named by its
Keras path, and a staleness policy's factor scales the learning rate of an update.
"""

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps.policies import resolve_function

# The parts of an optimizer's config that a worker has already applied to its gradient
# before pushing it (Keras's `apply` unscales and clips before the all-reduce).
_APPLIED_BY_WORKERS = {"loss_scale_factor": None, "clipnorm": None, "clipvalue": None,
                       "global_clipnorm": None, "gradient_accumulation_steps": None}


class RunFailed(Exception):
    """The run cannot go on; the message is what every worker is told."""


def ps_optimizer_config(config):
    """The optimizer config a ps applies: what workers did before the push taken out.

    A `LossScaleOptimizer`'s scaling lives with each worker (it unscales and skips
    non-finite steps there); the ps applies its inner optimizer.
    """
    if config is None:
        return None
    config = dict(config)
    if config.get("class_name") == "LossScaleOptimizer":
        config = dict(config["config"]["inner_optimizer"])
    inner = dict(config.get("config", {}))
    inner.update({k: v for k, v in _APPLIED_BY_WORKERS.items() if k in inner})
    config["config"] = inner
    return config


def rebuild_optimizer(task, config):
    """The workers' optimizer rebuilt on ps `task` from its Keras `config` (as the ps
    applies it: `ps_optimizer_config`)."""
    config = ps_optimizer_config(config)
    name = config.get("class_name") if isinstance(config, dict) else config
    return deserialize(task, keras.optimizers.deserialize, config,
                       f"the workers' optimizer {name!r}")


def deserialize(task, get, config, what):
    """`get(config)` on ps `task`, or the `RunFailed` that says how to make `what` known."""
    try:
        return get(config)
    except Exception as e:
        raise RunFailed(
            f"{task} could not rebuild {what} from its Keras config "
            f"({type(e).__name__}: {e}). A custom class (optimizer, learning rate "
            "schedule, constraint) must be registered with "
            "`@keras.saving.register_keras_serializable()` in a module the ps tasks "
            "import: name it with `tfdist-launch --job_name=ps --ps_import=MODULE` (or "
            "`--local ... --ps_import=MODULE`, `LocalCluster(ps_imports=[...])`, "
            "a manifest's `--ps_import`)") from None


def import_module(task, module):
    """Imports `module` (or the module of a `module:function`) on ps `task`."""
    try:
        resolve_function(module) if ":" in module else __import__(module)
    except Exception as e:
        raise RunFailed(
            f"{task} could not import {module!r}, which the workers' "
            f"optimizer or staleness function needs ({type(e).__name__}: {e}). Install "
            f"it where the ps tasks run, or put it on their PYTHONPATH") from None


def check_masters(task, optimizer, masters):
    """Every variable of an optimizer rebuilt on ps `task` must be one of its `masters`
    (its state on the ps, in the chief's checkpoints), found by the Keras path every worker
    gave it: raises `RunFailed` naming those that are not, and why they may not be."""
    opened = {id(m) for m in masters.values()}
    local = [v.path for v in optimizer.variables if id(v.value) not in opened]
    if not local:
        return
    # A worker numbers a second variable at a Keras path `path#1`, and its slots
    # `{slot path}#1`; the optimizer rebuilt here names that slot by the numbered path.
    own = f"{optimizer.name}/"
    shared = sorted({path.partition("#")[0] for path in masters
                     if "#" in path and not path.startswith(own)})
    why = (f" The model has several variables at the same Keras path ({shared}; the workers "
           "number the others `#1`, `#2`...), and an optimizer names its slots by that "
           "path: give the layers or weights distinct names (a layer's `name=`, "
           "`add_weight(name=...)`)" if shared else
           f" The workers named the variables of {optimizer.name!r} otherwise: do the "
           "workers and the ps tasks run the same Keras version?")
    raise RunFailed(f"{task}: the variables {local} of the optimizer {optimizer.name!r}, "
                    "rebuilt on this ps task, have no master in the run's spec: they would "
                    "live on this ps task alone, never in a checkpoint, so the run is "
                    f"refused.{why}")


class ShardExtended(_tf_compat.OneDeviceExtended):
    """Where the ps-side optimizer's variables live, and how staleness scales its step."""

    def __init__(self, container_strategy, device, masters):
        super().__init__(container_strategy, device)
        self.masters = masters
        self.learning_rate_factor = None

    def _create_variable(self, next_creator, **kwargs):
        path = _tf_compat.keras_variable_path(kwargs.get("name") or "Variable")
        master = self.masters.get(path)
        if master is not None:
            return master
        return super()._create_variable(next_creator, **kwargs)

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable  # masters are made outside the scope, by shared name

    def _update(self, var, fn, args, kwargs, group):
        arguments = _tf_compat.keras_update_step_arguments(args)
        if self.learning_rate_factor is not None and arguments is not None:
            gradient, learning_rate = arguments
            args = (gradient, tf.cast(learning_rate, tf.float32) * self.learning_rate_factor)
        return super()._update(var, fn, args, kwargs, group)


class ShardStrategy(tf.distribute.Strategy):
    """A one-device strategy on the ps task's device whose variables are the run's masters."""

    def __init__(self, device, masters):
        super().__init__(ShardExtended(self, device, masters))
