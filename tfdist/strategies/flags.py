"""A `--strategy` flag for user scripts.

```python
from absl import app
import tfdist

tfdist.strategies.define_flags(default="one_device")

def main(argv):
    strategy = tfdist.strategies.from_flags()   # --strategy=soft_sync --strategy_arg=x=1
    ...

app.run(main)
```
"""

from absl import flags

from tfdist.strategies import registry


def define_flags(default="one_device", flag_values=flags.FLAGS):
    """Defines `--strategy` (a registered name) and `--strategy_arg` (repeatable key=value)."""
    flags.DEFINE_string(
        "strategy", default,
        "Distribution strategy by name: " + ", ".join(registry.names()) + ".",
        flag_values=flag_values)
    flags.DEFINE_multi_string(
        "strategy_arg", [], "Strategy constructor argument as key=value (repeatable).",
        flag_values=flag_values)

    def _check_name(value):
        if value not in registry.names():
            raise flags.ValidationError(
                f"--strategy must be one of {registry.names()}. Received: {value!r}")
        return True

    def _check_args(value):
        try:
            registry.parse_strategy_args(value)
        except ValueError as e:
            raise flags.ValidationError(f"--strategy_arg: {e}") from None
        return True

    flags.register_validator("strategy", _check_name, flag_values=flag_values)
    flags.register_validator("strategy_arg", _check_args, flag_values=flag_values)


def from_flags(flag_values=flags.FLAGS, **overrides):
    """Builds the strategy named by `--strategy` with `--strategy_arg` arguments."""
    kwargs = registry.parse_strategy_args(flag_values.strategy_arg)
    kwargs.update(overrides)
    return registry.get(flag_values.strategy, **kwargs)
