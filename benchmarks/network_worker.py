"""One worker of `network.py`: a 1.08 M-parameter CNN on digits under tfdist's
MultiWorkerMirroredStrategy with one compressor (or, `--strategy=sgp`, Stochastic Gradient
Push with its defaults, uncompressed), timed step by step.

Every worker runs this under `tfdist-launch --local` (TF_CONFIG from the launcher); the
chief writes `<out>`: seconds per step (median over the run, first steps left out), the
loss of every epoch, test accuracy, and the compression figures of the Keras logs.
"""

import json
import os
import statistics
import time

import keras
import tensorflow as tf
from absl import app
from absl import flags

import tfdist

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Where the chief writes its JSON.")
flags.DEFINE_string("compression", None, "Compressor name (None: uncompressed).")
flags.DEFINE_string("compression_config", "{}", "JSON of the compressor's arguments.")
flags.DEFINE_integer("epochs", 15, "Epochs over the digits training set.")
flags.DEFINE_integer("max_steps", None, "Stop after this many steps (timing-only runs).")
flags.DEFINE_integer("batch_per_worker", 32, "Batch size per worker.")
flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and of the data order.")
flags.DEFINE_enum("strategy", "multi_worker_mirrored", ["multi_worker_mirrored", "sgp", "none"],
                  "The strategy: all-reduce (with --compression), Stochastic Gradient Push, or "
                  "none: plain Keras `fit` in one process (the limit; give it the global "
                  "batch as --batch_per_worker).")

SKIP = 5  # steps left out of the timing (tracing, the first collectives)


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    return train_test_split(x, y.astype("int32"), test_size=360, random_state=0)


def build_model():
    """Two small convolutions and a 512 x 2048 dense layer: 1.08 M parameters, nearly all in
    one kernel, little compute (on a slow network the exchange is what a step costs)."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(2048, activation="relu"),
        layers.Dense(10),
    ])


def main(argv):
    del argv
    config = json.loads(FLAGS.compression_config)
    compression = (None if FLAGS.compression in (None, "none")
                   else tfdist.compression.get(FLAGS.compression, **config))
    gossip = FLAGS.strategy == "sgp"
    alone = FLAGS.strategy == "none"
    if alone:
        if compression is not None:
            raise app.UsageError("--strategy=none exchanges nothing: no --compression")
        strategy, workers = tf.distribute.get_strategy(), 1
    elif gossip:
        if compression is not None:
            raise app.UsageError("--strategy=sgp exchanges float32 models: no --compression")
        strategy = tfdist.strategies.StochasticGradientPushStrategy()
        workers = strategy.num_workers
    else:
        strategy = tfdist.strategies.MultiWorkerMirroredStrategy(compression=compression)
        workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(FLAGS.seed)
    x_train, x_test, y_train, y_test = digits()
    global_batch = FLAGS.batch_per_worker * workers
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    if gossip:  # each worker its own rows, in batches of its own
        train = (train.shard(workers, strategy.worker_index)
                 .shuffle(len(x_train), seed=FLAGS.seed)
                 .batch(FLAGS.batch_per_worker, drop_remainder=True))
    else:
        train = train.shuffle(len(x_train), seed=FLAGS.seed).batch(global_batch,
                                                                    drop_remainder=True)
    learning_rate = FLAGS.learning_rate
    if FLAGS.compression == "dgc":  # DGC carries the momentum (lr / (1 - m) per step)
        learning_rate *= 1 - compression.momentum
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    ends = []
    clock = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    callbacks = [clock]
    epochs = FLAGS.epochs
    if FLAGS.max_steps:
        steps_per_epoch = len(x_train) // global_batch
        epochs = max(1, -(-FLAGS.max_steps // steps_per_epoch))
        callbacks.append(StopAfter(FLAGS.max_steps))
    history = model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks).history
    intervals = [b - a for a, b in zip(ends[SKIP:], ends[SKIP + 1:])]
    if gossip:
        strategy.join()  # the final average: every worker's model the same
        progress = strategy.progress()
        # Sent per step, and as much received (with one peer a step, one message each way):
        # what the all-reduce rows' bytes_on_wire counts; a dense ring all-reduce moves
        # 2 x 2 (N - 1) / N x 4 bytes per parameter.
        history["bytes_on_wire"] = [2 * progress["bytes_sent"] / max(progress["step"], 1)]
        dense = 2 * 2 * (workers - 1) / workers * 4 * model.count_params()
        history["compression_ratio"] = [dense / history["bytes_on_wire"][0]]
        history["bytes_sent"] = [progress["bytes_sent"] / max(progress["step"], 1)]
    _, accuracy = model.evaluate(x_test, y_test, batch_size=120, verbose=0)
    if (alone or strategy.worker_index == 0 if gossip or alone else
            strategy.cluster_resolver.task_type in ("chief", None) or (
                strategy.cluster_resolver.task_type == "worker"
                and strategy.cluster_resolver.task_id == 0)):
        result = {
            "compression": FLAGS.compression or "none", "config": config,
            "strategy": FLAGS.strategy,
            "workers": workers, "parameters": int(model.count_params()),
            "steps": len(ends), "seconds_per_step": statistics.median(intervals),
            "loss": [float(v) for v in history["loss"]],
            "test_accuracy": float(accuracy),
        }
        for key in ("bytes_sent", "bytes_dense", "bytes_on_wire", "compression_ratio"):
            if key in history:
                result[key] = float(history[key][-1])
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(result, f)


class StopAfter(keras.callbacks.Callback):
    """Stops training after `steps` steps (every worker alike: collectives stay paired)."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.steps:
            self.model.stop_training = True


@flags.validator("max_steps", message=f"--max_steps must be above {SKIP + 1}: the first {SKIP} "
                 "steps are left out of the timing, which needs two steps after them")
def _check_max_steps(value):
    return value is None or value > SKIP + 1


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)
