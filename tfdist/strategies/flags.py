"""A `--strategy` flag for user scripts.

```python
from absl import app
import tfdist

tfdist.strategies.define_flags(default="one_device")

def main(argv):
    # --strategy=multi_worker_mirrored --compression=topk --compression_arg=ratio=0.001
    strategy = tfdist.strategies.from_flags()
    ...

app.run(main)
```
"""

from absl import flags

from tfdist.strategies import registry


def define_flags(default="one_device", flag_values=flags.FLAGS):
    """Defines `--strategy` (a registered name), `--strategy_arg` (repeatable key=value),
    `--compression` (a `tfdist.compression` name) and `--compression_arg` (key=value)."""
    flags.DEFINE_string(
        "strategy", default,
        "Distribution strategy by name: " + ", ".join(registry.names()) + ".",
        flag_values=flag_values)
    flags.DEFINE_multi_string(
        "strategy_arg", [], "Strategy constructor argument as key=value (repeatable).",
        flag_values=flag_values)
    flags.DEFINE_string(
        "compression", None,
        "Gradient compression for strategies that take `compression=` (compressed_mirrored, "
        "multi_worker_mirrored, soft_sync, async, model_averaging): one of " + ", ".join(
            compression_names()) + ". Default: none.", flag_values=flag_values)
    flags.DEFINE_multi_string(
        "compression_arg", [], "Compressor constructor argument as key=value (repeatable).",
        flag_values=flag_values)
    for name, valid_names in (("strategy", registry.names), ("compression", compression_names)):
        flags.register_validator(name, _name_validator(name, valid_names),
                                 flag_values=flag_values)
        flags.register_validator(f"{name}_arg", _args_validator(f"{name}_arg"),
                                 flag_values=flag_values)


def _name_validator(flag, valid_names):
    def check(value):
        if value is not None and value not in valid_names():
            raise flags.ValidationError(
                f"--{flag} must be one of {valid_names()}. Received: {value!r}")
        return True

    return check


def _args_validator(flag):
    def check(value):
        try:
            registry.parse_strategy_args(value)
        except ValueError as e:
            raise flags.ValidationError(f"--{flag}: {e}") from None
        return True

    return check


def from_flags(flag_values=flags.FLAGS, **overrides):
    """Builds the strategy named by `--strategy` with `--strategy_arg` arguments."""
    kwargs = registry.parse_strategy_args(flag_values.strategy_arg)
    compression_args = registry.parse_strategy_args(flag_values.compression_arg)
    if flag_values.compression is not None:
        kwargs["compression"] = {"name": flag_values.compression, "config": compression_args}
    elif compression_args:
        raise ValueError(f"--compression_arg needs --compression. Received: "
                         f"{flag_values.compression_arg}")
    kwargs.update(overrides)
    return registry.get(flag_values.strategy, **kwargs)


def compression_names():
    from tfdist import compression

    return compression.names()
