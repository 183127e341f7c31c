"""Distribution strategies by name: TensorFlow's built-ins and tfdist's own."""

from tfdist.strategies import registry as _registry
from tfdist.strategies.collective import CompressedMirroredStrategy
from tfdist.strategies.collective import MultiWorkerMirroredStrategy
from tfdist.strategies.flags import define_flags
from tfdist.strategies.flags import from_flags
from tfdist.strategies.gossip import StochasticGradientPushStrategy
from tfdist.strategies.model_averaging import ModelAveragingStrategy
from tfdist.strategies.parameter_server import AsyncStrategy
from tfdist.strategies.parameter_server import SoftSyncStrategy
from tfdist.strategies.registry import get
from tfdist.strategies.registry import names
from tfdist.strategies.registry import parse_strategy_args
from tfdist.strategies.registry import register
from tfdist.telemetry import TelemetryCallback

_registry.register("soft_sync", SoftSyncStrategy)
_registry.register("async", AsyncStrategy)
_registry.register("model_averaging", ModelAveragingStrategy)
_registry.register("sgp", StochasticGradientPushStrategy)
_registry.register("compressed_mirrored", CompressedMirroredStrategy)
# tfdist's MultiWorkerMirrored takes the built-in's name: it is the one that runs Keras 3 `fit`
# (and with compression=None computes what TF's would); TF's own stays reachable.
_registry.register("multi_worker_mirrored", MultiWorkerMirroredStrategy)

__all__ = [
    "AsyncStrategy",
    "CompressedMirroredStrategy",
    "ModelAveragingStrategy",
    "MultiWorkerMirroredStrategy",
    "SoftSyncStrategy",
    "StochasticGradientPushStrategy",
    "TelemetryCallback",
    "define_flags",
    "from_flags",
    "get",
    "names",
    "parse_strategy_args",
    "register",
]
