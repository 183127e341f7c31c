"""Distribution strategies by name: TensorFlow's built-ins and tfdist's own."""

from tfdist.strategies import registry as _registry
from tfdist.strategies.flags import define_flags
from tfdist.strategies.flags import from_flags
from tfdist.strategies.model_averaging import ModelAveragingStrategy
from tfdist.strategies.parameter_server import AsyncStrategy
from tfdist.strategies.parameter_server import SoftSyncStrategy
from tfdist.strategies.registry import get
from tfdist.strategies.registry import names
from tfdist.strategies.registry import parse_strategy_args
from tfdist.strategies.registry import register
from tfdist.strategies.telemetry import TelemetryCallback

_registry.register("soft_sync", SoftSyncStrategy)
_registry.register("async", AsyncStrategy)
_registry.register("model_averaging", ModelAveragingStrategy)

__all__ = [
    "AsyncStrategy",
    "ModelAveragingStrategy",
    "SoftSyncStrategy",
    "TelemetryCallback",
    "define_flags",
    "from_flags",
    "get",
    "names",
    "parse_strategy_args",
    "register",
]
