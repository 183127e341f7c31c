"""A worker program for the multi-worker all-reduce tests, run through the launcher.

Every worker trains the same model on `data()` with tfdist's MultiWorkerMirroredStrategy,
then evaluates and predicts, and writes what it saw to `<out_dir>/<task>.json`. With
`--scenarios`, each worker instead runs `fit`, `evaluate` and `predict` once per scenario
(an input kind, a global batch size, a `steps_per_execution`) on `UNEVEN_ROWS` rows, each
with a model of its own, in one cluster run.
"""

import json
import os

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app
from absl import flags

import tfdist

FLAGS = flags.FLAGS


def define_flags():
    # Defined only when run as a program: the tests import data() and build_model() from
    # here next to ps_program, whose flags share these names.
    flags.DEFINE_string("out_dir", None, "Where to write results.")
    flags.DEFINE_string("compression", None, "Compressor name (None: no compression).")
    flags.DEFINE_integer("epochs", 2, "Epochs.")
    flags.DEFINE_integer("steps_per_execution", 1, "Keras steps_per_execution.")
    flags.DEFINE_bool("run_eagerly", False, "Keras run_eagerly.")
    flags.DEFINE_bool("embedding", False, "Integer inputs through an Embedding layer (its "
                      "gradient is an IndexedSlices).")
    flags.DEFINE_bool("restore_other_step", False, "After `fit`, worker 1 restores its codec "
                      "state with another step counter (a checkpoint of another step), then "
                      "every worker trains one epoch more.")
    flags.DEFINE_list("scenarios", [], "Scenarios `input:batch_size:steps_per_execution` "
                      "(input: numpy, dataset or pydataset) to run instead of the default job.")

ROWS, BATCH, VOCABULARY = 128, 32, 100


def data(embedding=False):
    rng = np.random.RandomState(0)
    if embedding:
        x = rng.randint(0, VOCABULARY, (ROWS, 8)).astype("int32")
        return x, (x[:, 0] % 2).astype("int32")
    x = rng.randn(ROWS, 8).astype("float32")
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int32")
    return x, y


def build_model(steps_per_execution=1, run_eagerly=False, embedding=False):
    keras.utils.set_random_seed(1)
    inputs = ([keras.Input((8,), dtype="int32"), keras.layers.Embedding(VOCABULARY, 4),
               keras.layers.GlobalAveragePooling1D()] if embedding else [keras.Input((8,))])
    model = keras.Sequential([*inputs, keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution,
                  run_eagerly=run_eagerly)
    return model


def dataset(embedding=False):
    """Global batches of BATCH; tf.data gives each worker its share of every batch."""
    x, y = data(embedding)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


UNEVEN_ROWS = 100  # no batch size of the scenarios divides it: a last partial batch


class Batches(keras.utils.PyDataset):
    """`x, y` as a Keras PyDataset of global batches."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def parse_scenario(scenario):
    """`"dataset:32:3"` -> `("dataset", 32, 3)`."""
    kind, batch_size, steps_per_execution = scenario.split(":")
    if kind not in ("numpy", "dataset", "pydataset"):
        raise ValueError(f"scenario input must be numpy, dataset or pydataset. Received: {kind}")
    return kind, int(batch_size), int(steps_per_execution)


def run_scenario(scenario, strategy=None):
    """Builds a model (under `strategy`'s scope if given), then `fit` (one epoch, in order),
    `evaluate` and `predict` on `UNEVEN_ROWS` rows as `scenario` says. Returns what it saw."""
    kind, batch_size, steps_per_execution = parse_scenario(scenario)
    x, y = data()
    x, y = x[:UNEVEN_ROWS], y[:UNEVEN_ROWS]
    if kind == "numpy":
        inputs, kwargs = (x, y), {"batch_size": batch_size, "shuffle": False}
    elif kind == "dataset":
        inputs = (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size),)
        kwargs = {}
    else:
        inputs, kwargs = (Batches(x, y, batch_size),), {"shuffle": False}
    if strategy is None:
        model = build_model(steps_per_execution)
    else:
        with strategy.scope():
            model = build_model(steps_per_execution)
    history = model.fit(*inputs, epochs=1, verbose=0, **kwargs)
    kwargs.pop("shuffle", None)
    evaluation = model.evaluate(*inputs, verbose=0, return_dict=True, **kwargs)
    predict_input = inputs[0] if kind != "numpy" else x
    predictions = model.predict(predict_input, verbose=0, **kwargs)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "evaluation": {k: float(v) for k, v in evaluation.items()},
            "predictions": predictions.tolist()}


def main(argv):
    del argv
    if FLAGS.scenarios:
        strategy = tfdist.strategies.get("multi_worker_mirrored",
                                         compression=FLAGS.compression)
        config = tfdist.cluster.parse_tf_config()
        result = {name: run_scenario(name, strategy) for name in FLAGS.scenarios}
        with open(os.path.join(FLAGS.out_dir, f"{config.task_type}_{config.task_index}.json"),
                  "w") as f:
            json.dump({"num_replicas": strategy.num_replicas_in_sync, "scenarios": result}, f)
        return
    strategy = tfdist.strategies.get("multi_worker_mirrored", compression=FLAGS.compression)
    config = tfdist.cluster.parse_tf_config()
    with strategy.scope():
        model = build_model(FLAGS.steps_per_execution, FLAGS.run_eagerly, FLAGS.embedding)
    history = model.fit(dataset(FLAGS.embedding), epochs=FLAGS.epochs, verbose=2)
    if FLAGS.restore_other_step:
        if config.task_index == 1:
            state = model.optimizer.tfdist_compression_state
            values = state.values()
            values["step/step"] = values["step/step"] + 5
            state.restore(values)
        history = model.fit(dataset(FLAGS.embedding), epochs=1, verbose=2)
    evaluation = model.evaluate(dataset(FLAGS.embedding), verbose=0, return_dict=True)
    x, _ = data(FLAGS.embedding)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    result = {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "predict_shape": list(predictions.shape),
        "num_replicas": strategy.num_replicas_in_sync,
    }
    name = f"{config.task_type}_{config.task_index}.json"
    with open(os.path.join(FLAGS.out_dir, name), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("out_dir")
    app.run(main)
