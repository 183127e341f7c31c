"""Train a small Keras classifier on scikit-learn's digits with any registered strategy.

One process:

    python examples/train_digits.py --strategy=one_device

A local parameter-server cluster (1 ps, 3 workers), soft-synchronous:

    tfdist-launch --local --num_ps=1 --num_workers=3 -- python examples/train_digits.py

Two workers all-reducing top-k compressed gradients over TF collectives:

    tfdist-launch --local --num_ps=0 --num_workers=2 -- python examples/train_digits.py \
        --strategy=multi_worker_mirrored --compression=topk --compression_arg=ratio=0.05

Model averaging every 16 steps with DiLoCo's outer step (Nesterov momentum) on the ps:

    tfdist-launch --local --num_ps=1 --num_workers=4 -- python examples/train_digits.py \
        --strategy=model_averaging --strategy_arg=period=16 --strategy_arg=outer_optimizer='{
        "class_name": "SGD", "config": {"learning_rate": 0.7, "momentum": 0.9, "nesterov": true}}'

Four workers and no server, Stochastic Gradient Push (each worker gossips with one peer a
step, and `join` averages the models at the end):

    tfdist-launch --local --num_ps=0 --num_workers=4 -- python examples/train_digits.py \
        --strategy=sgp

The data ships with scikit-learn (no download). Every worker passes the whole training set to
`fit`; tfdist's parameter-server strategies give each worker its own shard of the batches, and
the all-reduce strategies split every global batch over the replicas (tf.data auto-sharding).
The chief prints the test accuracy and, with --output_json, writes the run's figures.
"""

import json
import os
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app
from absl import flags

import tfdist  # noqa: F401  (sets TensorFlow's environment before it starts)

FLAGS = flags.FLAGS
tfdist.strategies.define_flags(default="soft_sync")
flags.DEFINE_integer("epochs", 20, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Per-worker (per-replica) batch size.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "Learning rate for one worker's batch.",
                   lower_bound=0)
flags.DEFINE_bool("scale_learning_rate", True,
                  "Multiply the learning rate by the number of gradients each update averages "
                  "(the linear scaling rule), so that an update over N workers' batches moves "
                  "as far as N single-worker steps.")
flags.DEFINE_integer("steps_per_execution", 1, "Keras `steps_per_execution`: training steps "
                     "per call.", lower_bound=1)
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "momentum", "adam"], "Keras optimizer.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the train/test split.")
flags.DEFINE_string("output_json", None, "Where the chief writes accuracy and timings.")
flags.DEFINE_bool("eval_every_epoch", False,
                  "The chief records test accuracy and elapsed time after every epoch "
                  "(written to --output_json as `curve`).")
flags.DEFINE_integer("verbose", 2, "Keras fit verbosity (0, 1 = progress bar, 2 = a line "
                     "per epoch).")


def load_digits(seed):
    """The digits split 80/20 with a fixed permutation; pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_load_digits

    x, y = sk_load_digits(return_X_y=True)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order].astype("float32") / 16.0, y[order].astype("int32")
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


class TestCurve(keras.callbacks.Callback):
    """Test accuracy and elapsed seconds after every epoch."""

    def __init__(self, x_test, y_test):
        super().__init__()
        self.x_test, self.y_test, self.points = x_test, y_test, []

    def on_train_begin(self, logs=None):
        self.start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.time() - self.start
        _, accuracy = self.model.evaluate(self.x_test, self.y_test, batch_size=256, verbose=0)
        self.points.append({"epoch": epoch + 1, "seconds": elapsed,
                            "test_accuracy": float(accuracy)})


def make_optimizer(name, learning_rate):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate)
    if name == "momentum":
        return keras.optimizers.SGD(learning_rate, momentum=0.9)
    return keras.optimizers.Adam(learning_rate / 50)


def main(argv):
    del argv
    (x_train, y_train), (x_test, y_test) = load_digits(FLAGS.seed)
    strategy = tfdist.strategies.from_flags()
    learning_rate = FLAGS.learning_rate
    if FLAGS.scale_learning_rate:
        # Stochastic Gradient Push's workers each step on their own batch, and the gossip
        # mixes every worker's steps into every model.
        sgp = isinstance(strategy, tfdist.strategies.StochasticGradientPushStrategy)
        learning_rate *= (strategy.num_workers if sgp else
                          getattr(strategy, "replicas_to_aggregate",
                                  strategy.num_replicas_in_sync))
    with strategy.scope():
        model = build_model(FLAGS.seed)
        model.compile(optimizer=make_optimizer(FLAGS.optimizer, learning_rate),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=FLAGS.steps_per_execution)
    # tfdist's parameter-server and gossip strategies give each worker its own share of the
    # data; the all-reduce strategies take a global batch and split it over their replicas.
    if hasattr(strategy, "shard"):
        (x_fit, y_fit), batch_size = strategy.shard(x_train, y_train), FLAGS.batch_size
    else:
        x_fit, y_fit = x_train, y_train
        batch_size = FLAGS.batch_size * strategy.num_replicas_in_sync
    config = os.environ.get("TF_CONFIG")
    is_chief = not config or tfdist.cluster.parse_tf_config(config).is_chief
    curve = TestCurve(x_test, y_test)
    callbacks = [curve] if FLAGS.eval_every_epoch and is_chief else []
    start = time.time()
    history = model.fit(x_fit, y_fit, batch_size=batch_size, epochs=FLAGS.epochs,
                        shuffle=False, verbose=FLAGS.verbose, callbacks=callbacks)
    if hasattr(strategy, "join"):
        strategy.join()  # the chief waits for every worker: the weights are final after it
    train_seconds = time.time() - start
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    if is_chief:
        print(f"test accuracy {accuracy:.4f}, test loss {loss:.4f}, "
              f"trained in {train_seconds:.1f} s with {FLAGS.strategy}")
        if FLAGS.output_json:
            figures = {"strategy": FLAGS.strategy, "compression": FLAGS.compression,
                       "test_accuracy": float(accuracy),
                       "test_loss": float(loss), "train_seconds": train_seconds,
                       "curve": curve.points,
                       "history": {k: [float(v) for v in vs]
                                   for k, vs in history.history.items()}}
            with open(FLAGS.output_json, "w") as f:
                json.dump(figures, f, indent=1)


if __name__ == "__main__":
    app.run(main)
