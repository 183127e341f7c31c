"""Compressed gradient exchange: compressors, error feedback, and their registry.

A compressor is chosen by name and used by tfdist's all-reduce strategies
(`CompressedMirroredStrategy`, `MultiWorkerMirroredStrategy`) and parameter-server
strategies through their `compression=` argument:

    strategy = tfdist.strategies.MultiWorkerMirroredStrategy(
        compression=tfdist.compression.get("topk", ratio=0.01))
"""

from tfdist.compression.base import Capabilities
from tfdist.compression.base import Communicator
from tfdist.compression.base import Compressor
from tfdist.compression.base import ErrorFeedback
from tfdist.compression.powersgd import PowerSGDCompressor
from tfdist.compression.quantize import BF16Compressor
from tfdist.compression.quantize import FP16Compressor
from tfdist.compression.quantize import MajorityVoteCompressor
from tfdist.compression.quantize import NoCompression
from tfdist.compression.quantize import OneBitCompressor
from tfdist.compression.quantize import QSGDCompressor
from tfdist.compression.quantize import SignSGDCompressor
from tfdist.compression.quantize import TernGradCompressor
from tfdist.compression.registry import get
from tfdist.compression.registry import names
from tfdist.compression.registry import register
from tfdist.compression.registry import serialize
from tfdist.compression.sparsify import DGCCompressor
from tfdist.compression.sparsify import RandomKCompressor
from tfdist.compression.sparsify import ThresholdCompressor
from tfdist.compression.sparsify import TopKCompressor

for _cls in (NoCompression, FP16Compressor, BF16Compressor, TopKCompressor, RandomKCompressor,
             ThresholdCompressor, OneBitCompressor, SignSGDCompressor, TernGradCompressor,
             QSGDCompressor, PowerSGDCompressor, DGCCompressor, MajorityVoteCompressor):
    register(_cls.name, _cls)
del _cls

__all__ = [
    "BF16Compressor",
    "Capabilities",
    "Communicator",
    "Compressor",
    "DGCCompressor",
    "ErrorFeedback",
    "FP16Compressor",
    "MajorityVoteCompressor",
    "NoCompression",
    "OneBitCompressor",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "SignSGDCompressor",
    "TernGradCompressor",
    "ThresholdCompressor",
    "TopKCompressor",
    "get",
    "names",
    "register",
    "serialize",
]
