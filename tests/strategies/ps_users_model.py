"""A worker program shaped like a user's, for the parameter-server tests.

A CNN on the digits with BatchNormalization, Dropout and a frozen Dense layer, Adam with a
custom learning-rate schedule (which the ps tasks import with `--ps_import`), a
`tf.data` pipeline sharded per worker, `validation_data`, and a `ModelCheckpoint` of the whole
model (`.keras`) on the chief. Every worker writes `worker{rank}.json`: its history, its final
weights by path, the frozen layer's weights before training, and its predictions on the first
validation images.
"""

import json
import os

import keras
import tensorflow as tf
from absl import app
from absl import flags

import tfdist
from tests.strategies import ps_functions

FLAGS = flags.FLAGS
TRAIN, BATCH = 1500, 32


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    return (x[:TRAIN], y[:TRAIN].astype("int32")), (x[TRAIN:], y[TRAIN:].astype("int32"))


def build_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.25)(h)
    frozen = keras.layers.Dense(64, activation="relu", name="frozen")
    h = frozen(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = keras.Model(inputs, outputs)
    frozen.trainable = False
    # A custom schedule: the ps tasks import its module (`--ps_import`) to rebuild Adam.
    model.compile(optimizer=keras.optimizers.Adam(ps_functions.WarmUp(0.01, 5)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv):
    del argv
    strategy = tfdist.strategies.from_flags()
    rank = strategy.worker_index
    (x, y), (x_val, y_val) = digits()
    with strategy.scope():
        model = build_model()
    frozen_before = [w.tolist() for w in model.get_layer("frozen").get_weights()]
    train = (tf.data.Dataset.from_tensor_slices((x, y))
             .shard(strategy.num_workers, rank)
             .shuffle(512, seed=rank)
             .batch(BATCH, drop_remainder=True)
             .prefetch(2))
    validation = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(64)
    callbacks = []
    if strategy.is_chief:
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(FLAGS.out_dir, "model.keras")))
    history = model.fit(train, epochs=FLAGS.epochs, validation_data=validation, verbose=0,
                        callbacks=callbacks)
    strategy.join()
    result = {
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "weights": {w.path: w.numpy().tolist() for w in model.weights},
        "frozen_before": frozen_before,
        "predictions": model.predict(x_val[:16], verbose=0).tolist(),
        "placement": strategy.placement(),
    }
    with open(os.path.join(FLAGS.out_dir, f"worker{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    # Defined here: the tests import this module beside ps_program, which has flags too.
    flags.DEFINE_string("out_dir", None, "Where to write results.")
    flags.DEFINE_integer("epochs", 2, "Epochs.")
    tfdist.strategies.define_flags(default="soft_sync")
    flags.mark_flag_as_required("out_dir")
    app.run(main)
