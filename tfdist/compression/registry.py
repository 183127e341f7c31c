"""Compressors by name, and configs that round-trip.

>>> tfdist.compression.get("topk", ratio=0.01)
TopKCompressor(ratio=0.01, error_feedback=True)
>>> tfdist.compression.get(tfdist.compression.serialize(_))
TopKCompressor(ratio=0.01, error_feedback=True)
"""

from tfdist import _registry
from tfdist.compression.base import Compressor

_REGISTRY = {}


def register(name, cls=None):
    """Registers a `Compressor` subclass under a lower-case snake_case `name`."""
    if not isinstance(name, str) or not name or name != name.lower() or " " in name:
        raise ValueError(f"`name` must be a lower-case snake_case string. Received: {name!r}")

    def _register(c):
        if not (isinstance(c, type) and issubclass(c, Compressor)):
            raise ValueError(f"only Compressor subclasses can be registered. Received: {c!r}")
        if name in _REGISTRY and _REGISTRY[name] is not c:
            raise ValueError(f"a compressor is already registered as {name!r}")
        _REGISTRY[name] = c
        return c

    return _register(cls) if cls is not None else _register


def names():
    """The registered compressor names, sorted."""
    return sorted(_REGISTRY)


def get(identifier, **kwargs):
    """Returns a compressor from a name, a `{"name", "config"}` dict, an instance, or None.

    Args:
      identifier: a registered name (see `names()`), a dict from `serialize`, a `Compressor`
        (returned as is), or None (no compression; returns None).
      **kwargs: constructor arguments for the named compressor.

    Raises:
      ValueError: unknown name (the message lists the valid ones) or bad arguments.
    """
    if identifier is None:
        if kwargs:
            raise ValueError(f"compressor arguments need a compressor name. Received: "
                             f"{sorted(kwargs)}")
        return None
    return _registry.resolve(identifier, kwargs, _REGISTRY, "compressor", Compressor, names)


def serialize(compressor):
    """`{"name": ..., "config": {...}}` for `compressor`; `get` turns it back."""
    if not isinstance(compressor, Compressor) or compressor.name not in _REGISTRY:
        raise ValueError(f"`compressor` must be a registered Compressor. Received: "
                         f"{compressor!r}")
    return {"name": compressor.name, "config": compressor.get_config()}
