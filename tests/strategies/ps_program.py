"""A worker program for the parameter-server tests, run by the tests through the launcher.

Scenarios:
  equivalence  train a fixed shard; the chief saves initial and final weights.
  late         the chief, then worker 1, take one step; the chief then trains an epoch
               alone; worker 1's next push, computed on the weights of its first reply, is
               stale.
  long         train long enough to be killed mid-run; print READY after the first epoch.
  checkpoint   BackupAndRestore on every worker (own directory), ModelCheckpoint on the
               chief; with --crash_after_epoch the chief dies after that epoch.
  (any)        with --stop_rank, that worker stops itself (SIGSTOP) after its first epoch;
               with --slow_rank, that worker sleeps after each step and pauses after its
               first epoch.
  restart      the chief is SIGKILLed while it waits for a reply and started again (with
               `--strategy=async --strategy_arg=max_staleness=4 --strategy_arg=on_stale='wait'`,
               see `test_a_restarted_chief_takes_only_its_own_replies`).
  rows_restart model averaging of a table by rows on 3 workers, worker 2 SIGKILLed after
               steps it did not push and started again (`rows_restart_scenario`).
"""

import json
import os
import signal
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf
from absl import app
from absl import flags

import tfdist
from tests.strategies import ps_functions

FLAGS = flags.FLAGS
flags.DEFINE_enum("scenario", "equivalence",
                  ["equivalence", "late", "long", "checkpoint", "absent", "restart",
                   "rows_restart"],
                  "What to run.")
flags.DEFINE_integer("crash_after_epoch", -1, "checkpoint: the chief dies after this epoch.")
flags.DEFINE_string("out_dir", None, "Where to write results.")
tfdist.strategies.define_flags(default="soft_sync")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "momentum", "adam", "adamw", "loss_scale"],
                  "Optimizer. momentum: with `loss_scale_factor=8` (the loss scaled, the "
                  "gradients unscaled once); adamw: weight decay but not on biases, and a "
                  "kernel constraint on the first layer; loss_scale: Adam in a dynamic "
                  "LossScaleOptimizer.")
flags.DEFINE_enum("model", "mlp", ["mlp", "embedding"],
                  "mlp: 8-16-2; embedding: each feature bucketed into one of 48 ids, an "
                  "Embedding(48, 4) (a sparse gradient), then Dense(2).")
flags.DEFINE_integer("slow_rank", -1, "A worker that sleeps after each step.")
flags.DEFINE_float("slow_delay", 0.05, "Its sleep, in seconds.")
flags.DEFINE_string("hold_file", None, "The slow worker, after its pause, also waits for "
                    "this file (a test's signal).")
flags.DEFINE_float("pause", 0.0, "The slow worker's pause after its first epoch, in seconds "
                   "(a long validation or checkpoint: no push meanwhile).")
flags.DEFINE_integer("stop_rank", -1, "A worker that stops itself with SIGSTOP after its "
                     "first epoch, printing STOPPING (a hung process: its port stays open).")
flags.DEFINE_integer("steps_per_execution", 1, "Keras `steps_per_execution`.")
flags.DEFINE_integer("wait_for_dead", -1, "long: the other workers, at their second epoch's "
                     "end, wait until the run counts this worker dead (a test kills it): the "
                     "run ends after the death is seen, however fast its epochs.")
flags.DEFINE_bool("frozen", False, "async: a staleness function that zeroes every update.")
flags.DEFINE_bool("chief_early_stopping", False, "The chief trains with "
                  "`EarlyStopping(restore_best_weights=True)` (patience: every epoch), which "
                  "writes its best epoch's weights at the end of its fit.")
flags.DEFINE_bool("chief_halves", False, "equivalence: only the chief's callback halves the "
                  "learning rate (a `ReduceLROnPlateau` watching the chief's logs).")
flags.DEFINE_bool("split_table", False, "--model=embedding: the table (768 bytes, whole "
                  "under `variable_partitioner='auto'`) in one part per ps task "
                  "(`split_table`), every other variable whole.")

ROWS, BATCH = 128, 16
TABLE_SHAPE = (48, 4)


def split_table(shape, dtype):
    """A `variable_partitioner`: the embedding table in as many parts as there are ps tasks
    (tfdist caps a partitioner's parts at that), anything else whole."""
    del dtype
    return [64 if tuple(shape) == TABLE_SHAPE else 1] + [1] * (len(shape) - 1)


def data(model="mlp"):
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 8).astype("float32")
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).astype("int32")
    if model in ("embedding", "dense_lookup"):
        x = np.clip(((x + 3) * 8).astype("int32"), 0, 47)
    return x, y


class DenseLookup(keras.layers.Layer):
    """An embedding whose gradient is dense (a one-hot product), for one-process references:
    Keras 3's Adam squares each slice of a sparse gradient before repeated rows are summed
    (v gathers the sum of g^2 where the batch repeats an id), while tfdist's ps applies Adam
    to the summed gradient, as the algorithm (and TF1's duplicate-index handling) has it."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(48, 4), initializer="uniform")

    def call(self, ids):
        return keras.ops.matmul(keras.ops.one_hot(ids, 48), self.embeddings)


def build_model(optimizer, steps_per_execution=1, model="mlp"):
    keras.utils.set_random_seed(1)
    constraint = keras.constraints.MaxNorm(0.5) if optimizer == "adamw" else None
    if model in ("embedding", "dense_lookup"):
        lookup = keras.layers.Embedding(*TABLE_SHAPE) if model == "embedding" else DenseLookup()
        model = keras.Sequential([keras.Input((8,), dtype="int32"), lookup,
                                  keras.layers.Flatten(),
                                  keras.layers.Dense(2, activation="softmax")])
    else:
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="tanh",
                                                     kernel_constraint=constraint),
                                  keras.layers.Dense(2, activation="softmax")])

    def adamw():
        adamw = keras.optimizers.AdamW(0.01, weight_decay=0.5)
        adamw.exclude_from_weight_decay(var_names=["bias"])
        return adamw

    optimizers = {"sgd": lambda: keras.optimizers.SGD(0.1),
                  "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                                           loss_scale_factor=8.0),
                  "adam": lambda: keras.optimizers.Adam(0.01),
                  "adamw": adamw,
                  "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
                      keras.optimizers.Adam(0.01), initial_scale=2.0 ** 4, dynamic_growth_steps=2)}
    model.compile(optimizer=optimizers[optimizer](), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def wait_until(predicate, what, timeout=60.0):
    """Polls `predicate` until it holds; a TimeoutError saying `what` did not happen after
    `timeout` seconds (a bound against a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s")
        time.sleep(0.05)


def wait_for_file(path, timeout=60.0):
    wait_until(lambda: os.path.exists(path), f"{path} did not appear", timeout)


def save(name, **values):
    with open(os.path.join(FLAGS.out_dir, name), "w") as f:
        json.dump(values, f)


def tf_checkpoint_round_trip(model):
    """The model and optimizer as the chief reads them (the masters, after `join()`), and as
    a plain Keras model and optimizer restore them from a `tf.train.Checkpoint` of both
    written by the chief."""
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(FLAGS.out_dir, "tf_checkpoint"))
    plain = build_model(FLAGS.optimizer, model=FLAGS.model)
    plain.optimizer.build(plain.trainable_variables)
    # (the strategy's state beside the optimizer, a compressor's residuals: not in plain)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(path).expect_partial()
    values = lambda variables: [np.asarray(v.numpy()).tolist() for v in variables]  # noqa: E731
    return {"weights": values(model.weights), "optimizer": values(model.optimizer.variables),
            "restored_weights": values(plain.weights),
            "restored_optimizer": values(plain.optimizer.variables)}


def codec_state(model):
    """The worker's codec state (push residuals) as saved: `{name: list}`, or None."""
    state = getattr(model.optimizer, "tfdist_compression_state", None)
    if state is None:
        return None
    return {name: np.asarray(value).tolist() for name, value in state.values().items()}


class Crash(keras.callbacks.Callback):
    """Dies after `epoch` (after BackupAndRestore saved it), writing the codec state."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            save("codec_state_saved.json", state=codec_state(self.model))
            print(f"CRASH after epoch {epoch}", flush=True)
            os._exit(3)


class RestoredCodecState(keras.callbacks.Callback):
    """Writes the codec state once BackupAndRestore (before it) has restored the run."""

    def on_train_begin(self, logs=None):
        save(f"codec_state_restored{tfdist.cluster.parse_tf_config().task_index}.json",
             state=codec_state(self.model))


def halve_learning_rate():
    """From the second epoch on, each epoch halves the learning rate (a callback's write)."""
    return keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2 if epoch else lr)


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(FLAGS.slow_delay)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            time.sleep(FLAGS.pause)
            if FLAGS.hold_file:
                wait_for_file(FLAGS.hold_file, 120)


class StopSelf(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            print("STOPPING", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)


class Ready(keras.callbacks.Callback):
    def __init__(self, strategy, rank):
        super().__init__()
        self.strategy, self.rank = strategy, rank

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            print("READY", flush=True)
        if epoch == 1 and FLAGS.wait_for_dead not in (-1, self.rank):
            wait_until(lambda: FLAGS.wait_for_dead in self.strategy.progress()["dead"],
                       f"worker {FLAGS.wait_for_dead} not counted dead")


def wait_for_updates(strategy, count, timeout=60.0):
    wait_until(lambda: strategy.progress()["updates"] >= count,
               f"{count} updates not reached", timeout)


def restart_scenario(strategy, model, xs, ys):
    """SSP with bound 4. The chief's first process takes one step (clock 1), then worker 1
    joins at clock 1 and takes one (clock 2); the chief blocks in its 6th push after that
    (clock 7: 5 ahead of worker 1). The test kills it there and writes `go`; worker 1's next
    step (clock 3) releases the dead process, whose reply stays in the chief's reply queue;
    the test then restarts the chief, whose 4 steps (clocks 4 to 7), with worker 1 idle,
    must each take the reply to its own push. 13 updates in all."""
    one = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    if strategy.worker_index == 1:
        wait_for_file(os.path.join(FLAGS.out_dir, "chief_joined"))
        model.fit(xs[:BATCH], ys[:BATCH], **one)
        save("worker1_joined")
        wait_for_updates(strategy, 8)  # the chief's first process is blocked in its 6th push
        print("PAUSED", flush=True)
        wait_for_file(os.path.join(FLAGS.out_dir, "go"))
        history = model.fit(xs[BATCH:2 * BATCH], ys[BATCH:2 * BATCH], **one)
        print("RELEASED", flush=True)
        wait_for_file(os.path.join(FLAGS.out_dir, "chief_done"))
        return history
    if not os.path.exists(os.path.join(FLAGS.out_dir, "chief_joined")):
        model.fit(xs[:BATCH], ys[:BATCH], **one)
        save("chief_joined")
        wait_for_file(os.path.join(FLAGS.out_dir, "worker1_joined"))
        model.fit(xs, ys, batch_size=BATCH, epochs=400, shuffle=False, verbose=0)
        raise AssertionError("the chief's first process should have been killed")
    history = model.fit(xs, ys, **one)
    save("restarted", history_step=history.history["global_step"][-1],
         progress_step=strategy.progress()["global_step"],
         skipped=[client.skipped_replies for client in strategy.extended._clients])
    save("chief_done")
    return history


def rows_restart_scenario(strategy, model, xs, ys):
    """`--strategy=model_averaging --strategy_arg=period=3
    --strategy_arg=replicas_to_aggregate=2` on 3 workers: each worker's shard is 3 batches,
    so a round an epoch. Workers 0 and 1 train 2 epochs (rounds 1 and 2). Worker 2 then
    trains 2 steps (the rows they touch marked changed, nothing pushed), writes `marked`,
    prints MARKED and waits: the test SIGKILLs it, waits until the ps tasks count it dead,
    and starts it again. The new process joins the run and trains an epoch while worker 0
    trains its third (round 3: their two models); worker 1 leaves once worker 0 is done.
    Returns the history of the worker's training (worker 0's two fits as one)."""
    one = dict(batch_size=BATCH, shuffle=False, verbose=0)
    marked = os.path.join(FLAGS.out_dir, "marked")
    if strategy.worker_index == 2:
        if os.path.exists(marked):  # the new process
            return model.fit(xs, ys, epochs=1, **one)
        for rank in (0, 1):
            wait_for_file(os.path.join(FLAGS.out_dir, f"trained{rank}"), 240)
        model.fit(xs[-2 * BATCH:], ys[-2 * BATCH:], epochs=1, **one)
        save("marked")
        print("MARKED", flush=True)
        wait_for_file(os.path.join(FLAGS.out_dir, "never"), 240)
        raise AssertionError("worker 2's first process should have been killed")
    history = model.fit(xs, ys, epochs=2, **one)
    save(f"trained{strategy.worker_index}")
    if strategy.worker_index == 1:
        wait_for_file(os.path.join(FLAGS.out_dir, "chief_done"), 240)
        return history
    third = model.fit(xs, ys, epochs=1, **one)
    save("chief_done")
    for key, values in third.history.items():
        history.history[key] = history.history.get(key, []) + values
    history.epoch = history.epoch + [len(history.epoch)]
    return history


def main(argv):
    del argv
    overrides = {}
    if FLAGS.scenario == "absent" and tfdist.cluster.parse_tf_config().task_index == 1:
        return  # worker 1 never starts: no server, no hello
    if FLAGS.frozen:
        overrides["staleness"] = ps_functions.frozen
    if FLAGS.split_table:
        overrides["variable_partitioner"] = split_table
    strategy = tfdist.strategies.from_flags(**overrides)
    rank = strategy.worker_index
    with strategy.scope():
        model = build_model(FLAGS.optimizer, FLAGS.steps_per_execution, FLAGS.model)
    x, y = data(FLAGS.model)
    xs, ys = strategy.shard(x, y)
    if strategy.is_chief:
        save("initial.json", weights=[w.tolist() for w in model.get_weights()])
    if FLAGS.scenario == "restart":
        history = restart_scenario(strategy, model, xs, ys)
    elif FLAGS.scenario == "rows_restart":
        history = rows_restart_scenario(strategy, model, xs, ys)
    elif FLAGS.scenario == "late":
        # The chief starts the run with one step, worker 1 joins with one step; the chief
        # then trains an epoch alone, and worker 1's next push, computed on the weights of
        # its first reply, is stale.
        one = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        if rank == 0:
            model.fit(xs[:BATCH], ys[:BATCH], **one)
            save("chief_joined")
            wait_for_file(os.path.join(FLAGS.out_dir, "worker1_joined"))
            history = model.fit(xs, ys, **one)
            save("chief_done", step=strategy.progress()["global_step"])
        else:
            wait_for_file(os.path.join(FLAGS.out_dir, "chief_joined"))
            model.fit(xs[:BATCH], ys[:BATCH], **one)
            save("worker1_joined")
            wait_for_file(os.path.join(FLAGS.out_dir, "chief_done"))
            history = model.fit(xs[:3 * BATCH], ys[:3 * BATCH], **one)
    elif FLAGS.scenario == "checkpoint":
        callbacks = [keras.callbacks.BackupAndRestore(
            os.path.join(FLAGS.out_dir, f"backup{rank}")), RestoredCodecState(),
            halve_learning_rate()]
        if strategy.is_chief:
            callbacks.append(keras.callbacks.ModelCheckpoint(
                os.path.join(FLAGS.out_dir, "model.weights.h5"), save_weights_only=True))
            if FLAGS.crash_after_epoch >= 0:
                callbacks.append(Crash(FLAGS.crash_after_epoch))
        history = model.fit(xs, ys, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False,
                            verbose=0, callbacks=callbacks)
        state = codec_state(model)
        if state:
            strategy.reset_compression_state()
            save(f"codec_state_reset{rank}.json", before=state, after=codec_state(model))
    else:
        callbacks = ([Ready(strategy, rank)] if FLAGS.scenario == "long" else
                     [halve_learning_rate()] if FLAGS.scenario == "equivalence"
                     and (rank == 0 or not FLAGS.chief_halves) else [])
        if rank == FLAGS.slow_rank:
            callbacks.append(Slow())
        if rank == FLAGS.stop_rank:
            callbacks.append(StopSelf())
        early_stopping = None
        if rank == 0 and FLAGS.chief_early_stopping:
            early_stopping = keras.callbacks.EarlyStopping(
                monitor="loss", patience=FLAGS.epochs, restore_best_weights=True)
            callbacks.append(early_stopping)
        history = model.fit(xs, ys, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False,
                            verbose=0, callbacks=callbacks)
        if early_stopping is not None:
            save("best_weights.json", weights=[w.tolist() for w in early_stopping.best_weights],
                 updates=strategy.progress()["updates"])  # (after the restore)
        if getattr(strategy.extended, "run_finished", False):
            # A chief back after its run finished: a second fit trains nothing either.
            again = model.fit(xs, ys, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False,
                              verbose=0)
            save("second_fit.json", epochs=len(again.epoch))
    strategy.join()
    if FLAGS.scenario == "checkpoint" and strategy.is_chief:
        save("tf_checkpoint.json", **tf_checkpoint_round_trip(model))
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0)
    # With a table on the ps, `predict` looks its rows up there too.
    predictions = (model.predict(x[:24], batch_size=16, verbose=0).tolist()
                   if FLAGS.model == "embedding" else None)
    result = {"evaluation": evaluation, "predictions": predictions,
              "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
              "progress": strategy.progress(),
              "pushes": int(sum(len(range(0, len(xs), BATCH)) for _ in history.epoch))
              + (1 if FLAGS.scenario == "late" else 0),
              "local_weights": [w.tolist() for w in model.get_weights()],
              "devices": sorted({w.value.device for w in model.weights}),
              "placement": strategy.placement() if history.epoch else None,
              "sparse_pushed": [len(layout.sparse) for layout in strategy.extended._layouts]
              if history.epoch else None,
              "tables_pushed": [len(layout.tables) for layout in strategy.extended._layouts]
              if history.epoch else None,
              "tables_read_rows": [[e.read_rows for e in layout.tables]
                                   for layout in strategy.extended._layouts]
              if history.epoch else None,
              "loss_scale": float(getattr(model.optimizer, "dynamic_scale", 0.0)),
              # As a step reads it (eager reads of a joined worker's mirror read the master).
              "learning_rate": float(tf.function(
                  lambda: tf.identity(model.optimizer.learning_rate.value))())}
    if strategy.is_chief:
        stats = result["progress"]
        result.update(updates=stats["updates"], dropped=stats["dropped_gradients"],
                      max_clock_gap=stats["max_clock_gap"],
                      aggregated=stats["aggregated_gradients"], left=stats["left"],
                      dead=stats["dead"], weights=[w.tolist() for w in model.get_weights()])
    save(f"worker{rank}.json", **result)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
