"""Strategies by lower-case name: TensorFlow's built-ins and tfdist's own.

>>> strategy = tfdist.strategies.get("one_device")
>>> type(strategy).__name__
'OneDeviceStrategy'

`get` accepts a name (with keyword arguments for the constructor), a dict
`{"name": ..., "config": {...}}`, or a strategy instance (returned as is).
"""

import ast

import tensorflow as tf

from tfdist import _registry

_REGISTRY = {}


def register(name, factory=None):
    """Registers `factory(**kwargs) -> tf.distribute.Strategy` under a snake_case `name`.

    Usable as a decorator: `@register("soft_sync")`.
    """
    if not isinstance(name, str) or not name or name != name.lower() or " " in name:
        raise ValueError(f"`name` must be a lower-case snake_case string. Received: {name!r}")

    def _register(f):
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise ValueError(f"a strategy is already registered as {name!r}")
        _REGISTRY[name] = f
        return f

    return _register(factory) if factory is not None else _register


def names():
    """The registered strategy names, sorted."""
    _load_tfdist_strategies()
    return sorted(_REGISTRY)


def get(identifier, **kwargs):
    """Returns a strategy by name, config dict, or instance.

    Args:
      identifier: a registered name (see `names()`), a dict `{"name": ..., "config": {...}}`,
        or a `tf.distribute.Strategy` (returned unchanged).
      **kwargs: constructor arguments for the named strategy.

    Raises:
      ValueError: the name is unknown (the message lists the valid names), or the arguments
        do not fit the strategy.
    """
    _load_tfdist_strategies()
    return _registry.resolve(identifier, kwargs, _REGISTRY, "strategy", tf.distribute.Strategy,
                             names)


def parse_strategy_args(pairs):
    """Parses `["key=value", ...]` (from a flag) into keyword arguments.

    Values are Python literals where they parse as one (`3`, `0.5`, `True`, `"a"`), else strings.
    """
    kwargs = {}
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"strategy arguments are written key=value. Received: {pair!r}")
        try:
            kwargs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kwargs[key] = text
    return kwargs


_loaded = False


def _load_tfdist_strategies():
    # tfdist's own strategies register themselves when their modules are imported.
    global _loaded
    if not _loaded:
        _loaded = True
        import tfdist.strategies  # noqa: F401


# TensorFlow's built-ins ----------------------------------------------------------------------


@register("one_device")
def _one_device(device="/cpu:0"):
    return tf.distribute.OneDeviceStrategy(device)


@register("mirrored")
def _mirrored(**kwargs):
    return tf.distribute.MirroredStrategy(**kwargs)


@register("tf_multi_worker_mirrored")
def _tf_multi_worker_mirrored(**kwargs):
    return tf.distribute.MultiWorkerMirroredStrategy(**kwargs)


@register("central_storage")
def _central_storage(**kwargs):
    return tf.distribute.experimental.CentralStorageStrategy(**kwargs)


@register("parameter_server")
def _parameter_server(cluster_resolver=None, **kwargs):
    if cluster_resolver is None:
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.ParameterServerStrategy(cluster_resolver, **kwargs)


@register("tpu")
def _tpu(tpu=None, **kwargs):
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.OpError) as e:
        raise ValueError(f"strategy 'tpu' needs a reachable TPU (tpu={tpu!r}): {e}") from None
    return tf.distribute.TPUStrategy(resolver, **kwargs)
