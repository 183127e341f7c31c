"""Worker program of the fault benchmark (`benchmarks/faults.py`): digits, a shard each.

Each worker trains `--epochs` epochs of its shard of the digits training rows (`--repeat`
copies of it, batch 32, SGD) with `keras.callbacks.BackupAndRestore` in a directory of its
own, so that a restarted worker resumes after its last whole epoch. It prints `EPOCH <n>`
after each epoch (the harness's schedule waits for these lines), and after every step writes
how many steps this process has completed to `pushes.<rank>.<pid>`: each step is one push (a
gradient to the ps tasks, or an SGP step's messages), and a killed process's count stays on
disk. After `fit`: `strategy.join()`, the accuracy on the held-out rows, and
`worker<rank>.<pid>.json` with the count and `strategy.progress()`.
"""

import json
import os
import time

import keras
import numpy as np
from absl import app
from absl import flags

import tfdist
from tfdist.gossip import protocol

FLAGS = flags.FLAGS
tfdist.strategies.define_flags(default="soft_sync")
flags.DEFINE_string("out_dir", None, "Where to write results.")
flags.DEFINE_integer("epochs", 10, "Epochs of each worker's shard.", lower_bound=1)
flags.DEFINE_integer("repeat", 10, "Copies of its shard a worker's epoch goes through.",
                     lower_bound=1)

BATCH = 32
TEST_ROWS = 297  # of digits' 1,797, held out: 1,500 train, 375 per worker with 4


def data():
    """`(x_train, y_train, x_test, y_test)`: digits shuffled with a fixed seed."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype("float32"), y[order].astype("int32")
    return x[TEST_ROWS:], y[TEST_ROWS:], x[:TEST_ROWS], y[:TEST_ROWS]


class _Count(keras.callbacks.Callback):
    """Counts the steps this process completed (on disk after each), prints `EPOCH n`. A
    step of a worker handed its finished run (a chief restarted after the others finished:
    its `fit` ends after one step that trains nothing and pushes nothing) is not a push."""

    def __init__(self, path, extended):
        super().__init__()
        self.steps = 0
        self._extended = extended
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def on_train_batch_end(self, batch, logs=None):
        if getattr(self._extended, "run_finished", False):
            return
        self.steps += 1
        os.pwrite(self._fd, f"{self.steps:12d}\n".encode(), 0)

    def on_epoch_end(self, epoch, logs=None):
        print(f"EPOCH {epoch + 1}", flush=True)


def main(argv):
    del argv
    strategy = tfdist.strategies.from_flags()
    rank, workers = strategy.worker_index, strategy.num_workers
    x, y, x_test, y_test = data()
    rows = len(x) // workers
    x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    x, y = np.tile(x, (FLAGS.repeat, 1)), np.tile(y, FLAGS.repeat)
    keras.utils.set_random_seed(0)  # the same initial weights everywhere (SGP sends none)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    pid = os.getpid()
    count = _Count(os.path.join(FLAGS.out_dir, f"pushes.{rank}.{pid}"), strategy.extended)
    backup = keras.callbacks.BackupAndRestore(os.path.join(FLAGS.out_dir, f"backup{rank}"))
    model.fit(x, y, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False, verbose=0,
              callbacks=[backup, count])
    strategy.join()
    result = {"rank": rank, "pid": pid, "steps": count.steps, "finished_at": time.time()}
    try:
        result["accuracy"] = float(model.evaluate(x_test, y_test, batch_size=99,
                                                  verbose=0)[1])
    except Exception as e:  # noqa: BLE001 (a figure missing, said so: the run goes on)
        result["accuracy_error"] = f"{type(e).__name__}: {e}"[:300]
    result["progress"] = strategy.progress()
    if isinstance(strategy, tfdist.strategies.StochasticGradientPushStrategy):
        size = protocol.HEAD + sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        progress = result["progress"]
        result["messages_sent"] = ((progress["bytes_sent"] - progress.get("plan_bytes_sent", 0))
                                   // (4 * size))
    with open(os.path.join(FLAGS.out_dir, f"worker{rank}.{pid}.json"), "w") as f:
        json.dump(result, f)
    print(f"DONE {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
