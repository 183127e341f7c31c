"""tfdist: distribution strategies for Keras 3 on TensorFlow's runtime.

The submodules `cluster`, `launch`, `strategies` (and the others listed in `__all__`) load on
first use, so that the launcher starts without importing TensorFlow.
"""

import importlib
import os

# Blocking ops shared across worker processes (token queues) hang when the ps runs each
# client's eager ops on one streaming thread; this must be set before TensorFlow starts.
os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")

__version__ = "0.1.0"

_SUBMODULES = ("cluster", "compression", "launch", "strategies")

__all__ = [*_SUBMODULES, "__version__"]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tfdist.{name}")
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
