"""Parameter-server telemetry for TensorBoard.

The Keras logs of a parameter-server strategy already carry `global_step`,
`dropped_gradients` and, for `AsyncStrategy`, `staleness_mean` / `staleness_max` (so Keras's
own `TensorBoard` callback plots them). `TelemetryCallback` adds what a scalar log cannot
hold: the staleness histogram, and the cluster-wide counters as the ps holds them; for
`StochasticGradientPushStrategy`, its gossip counters (`push_sum_weight`, `messages_late`,
...) at the worker's own step.

```python
callbacks = [tfdist.strategies.TelemetryCallback(strategy, "logs/tfdist")]
model.fit(x, y, callbacks=callbacks if strategy.is_chief else [])
```
"""

import importlib.util

import keras
import numpy as np
import tensorflow as tf

from tfdist._args import check_int

SCALARS = ("dropped_gradients", "aggregated_gradients", "staleness_mean", "staleness_max")


class TelemetryCallback(keras.callbacks.Callback):
    """Writes the ps telemetry (scalars and staleness histogram) at the global step.

    Args:
      strategy: a tfdist parameter-server strategy (anything with `progress()`), or
        `StochasticGradientPushStrategy` (its gossip counters, at the worker's own step).
      log_dir: TensorBoard log directory.
      every_n_batches: also write every n training batches (None: at epoch ends only).
    """

    def __init__(self, strategy, log_dir, every_n_batches=None):
        super().__init__()
        if not hasattr(strategy, "progress"):
            raise ValueError(f"`strategy` must be a tfdist parameter-server strategy (with "
                             f"`progress()`). Received: {type(strategy).__name__}")
        check_int("every_n_batches", every_n_batches, "None or an integer >= 1", low=1,
                  allow_none=True)
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("TelemetryCallback writes TensorBoard summaries and needs the "
                              "`tensorboard` package: pip install tensorboard")
        self.strategy = strategy
        self.log_dir = log_dir
        self.every_n_batches = every_n_batches
        self._writer = None

    def _write(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        progress = self.strategy.progress()
        counts = np.asarray(progress.get("staleness_histogram", []), np.int64)
        # A gossip strategy has no global step: its scalars go at the worker's own step.
        step = progress["global_step"] if "global_step" in progress else progress["step"]
        with self._writer.as_default(step=int(step)):
            for name in getattr(self.strategy, "telemetry_scalars", SCALARS):
                tf.summary.scalar(f"tfdist/{name}", float(progress[name]))
            if counts.sum():
                values = np.repeat(np.arange(len(counts), dtype=np.float32), counts)
                tf.summary.histogram("tfdist/staleness", values, buckets=len(counts))
        self._writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_batches and (batch + 1) % self.every_n_batches == 0:
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        self._write()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
