"""Distribution strategies by name: TensorFlow's built-ins and tfdist's own."""

from tfdist.strategies.flags import define_flags
from tfdist.strategies.flags import from_flags
from tfdist.strategies.registry import get
from tfdist.strategies.registry import names
from tfdist.strategies.registry import parse_strategy_args
from tfdist.strategies.registry import register

__all__ = [
    "define_flags",
    "from_flags",
    "get",
    "names",
    "parse_strategy_args",
    "register",
]
