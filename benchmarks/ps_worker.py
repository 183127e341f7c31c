"""Worker program of the parameter-server benchmarks: digits, optional stragglers.

A straggler is slow at every step (`--straggler_rank`, `--straggler_delay`) or stalls now and
then (`--stall_ranks`, `--stall_seconds` once every `--stall_every` steps; several stalling
ranks take turns, evenly spaced in the period).

Every worker trains until the chief has measured the update rate over `--window` seconds
(after `--warmup` seconds), then stops. The chief writes `rate.json`; every worker writes its
mean step time to `worker<rank>.json`.

Equal work: every worker computes `--batch_size` rows a step, whatever the strategy: under
MultiWorkerMirrored `fit`'s batch is the global one, so it is `--batch_size` times the replicas
there. `rate.json` says the rows an update averages (`rows_per_update`) and the rows per second
that went into updates (`examples_per_second`). `--no_strategy` runs plain Keras `fit` in one
process (no strategy at all): the limit the distributed rows are measured against.
"""

import contextlib
import json
import os
import threading
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf
from absl import app
from absl import flags

import tfdist

FLAGS = flags.FLAGS
tfdist.strategies.define_flags(default="soft_sync")
flags.DEFINE_string("out_dir", None, "Where to write results.")
flags.DEFINE_integer("straggler_rank", -1, "Worker rank slowed down (-1: none).")
flags.DEFINE_float("straggler_delay", 0.0, "Seconds the straggler sleeps after each step.")
flags.DEFINE_list("stall_ranks", [], "Worker ranks that stall now and then.")
flags.DEFINE_integer("stall_every", 0, "A stalling worker stalls after one step in this many "
                     "(0: never).", lower_bound=0)
flags.DEFINE_float("stall_seconds", 0.0, "Seconds of each stall.", lower_bound=0)
flags.DEFINE_float("warmup", 4.0, "Seconds before the measurement window.")
flags.DEFINE_float("window", 10.0, "Seconds of the measurement window.")
flags.DEFINE_float("startup_timeout", 120.0, "Seconds the chief waits for its 20th step "
                   "before the warm-up starts anyway.")
flags.DEFINE_integer("batch_size", 32, "Rows a worker computes per step.", lower_bound=1)
flags.DEFINE_bool("no_strategy", False, "Plain Keras `fit` in one process, no strategy "
                  "(the one-process limit; run it with num_workers=1, no ps).")
flags.DEFINE_integer("steps_per_execution", 1, "Keras `steps_per_execution`.", lower_bound=1)


class _Pace(keras.callbacks.Callback):
    """Slows the straggler, records step times, and stops when the chief says so."""

    def __init__(self, delay, stop_file, steps_per_call, stall=None, lockstep=False):
        super().__init__()
        self.delay, self.stop_file, self.steps_per_call = delay, stop_file, steps_per_call
        self.stall = stall  # (every, offset, seconds) or None
        # All-reduce workers step together: they stop at the step the chief names in the
        # stop file, not each at the step it sees the file (a worker that left would leave
        # the others in a collective, and their run ends in a coordination-service error).
        self.lockstep, self._stop_at = lockstep, None
        self.step_times, self._last, self.steps, self.stalls = [], None, 0, 0

    def on_train_batch_end(self, batch, logs=None):
        # Called once per `tf.function` call, which runs `steps_per_execution` steps.
        if self.delay:
            time.sleep(self.delay)
        stalled = False
        if self.stall is not None:
            every, offset, seconds = self.stall
            # (after the first 20 steps: traces and start-up first)
            stalled = self.steps >= 20 and (self.steps + offset) % every == 0
            if stalled:
                time.sleep(seconds)
                self.stalls += 1
        now = time.monotonic()
        if self._last is not None and not stalled:  # the pace between stalls
            self.step_times.append((now - self._last) / self.steps_per_call)
        self._last = now
        self.steps += self.steps_per_call
        if self._stop_at is None and os.path.exists(self.stop_file):
            with open(self.stop_file) as f:
                text = f.read().strip()
            if text or not self.lockstep:  # (the chief may not have written it yet)
                self._stop_at = int(text) if self.lockstep else 0
        if self._stop_at is not None and self.steps >= self._stop_at:
            self.model.stop_training = True


def _progress(strategy, pace):
    """The parameter-server telemetry, or for the others the chief's own step count (every
    step of an all-reduce, gossip or one-process run is one update of its model)."""
    if strategy is not None and hasattr(strategy, "placement"):
        return strategy.progress()
    steps = pace.steps
    return {"global_step": steps, "dropped_gradients": 0, "aggregated_gradients": steps,
            "staleness_max": 0, "staleness_mean": 0.0}


def _measure(strategy, pace, out_dir, counters=dict):
    """On the chief: global steps per second over the window, which starts `warmup` seconds
    after the chief's 20th step (start-up, the runs' first traces and, for gossip, the
    couriers' start do not count: an SGP worker's first messages wait for its peers'
    couriers, which it meets at step 1 + max_delay).

    `counters()` returns more counters `{name: number}` (bytes on a link, ...): their
    changes over the window go into rate.json as `<name>_per_second`."""
    deadline = time.monotonic() + FLAGS.startup_timeout
    while pace.steps < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(FLAGS.warmup)
    before, more_before = _progress(strategy, pace), counters()
    start = time.monotonic()
    time.sleep(FLAGS.window)
    after, more_after = _progress(strategy, pace), counters()
    elapsed = time.monotonic() - start
    figures = ({name: (after[name] - before[name]) / elapsed for name in
                ("global_step", "dropped_gradients", "aggregated_gradients")}
               | {"updates_per_second": (after["global_step"] - before["global_step"])
                  / elapsed, "staleness_max": after["staleness_max"],
                  "staleness_mean": after["staleness_mean"]}
               | {f"{name}_per_second": (more_after[name] - value) / elapsed
                  for name, value in more_before.items()})
    figures.update(_work(strategy, figures))
    if strategy is not None and hasattr(strategy, "placement"):
        figures["placement"] = strategy.placement()
    elif isinstance(strategy, tfdist.strategies.StochasticGradientPushStrategy):
        gossip = strategy.progress()  # what the chief's courier carried per step
        figures["bytes_sent_per_step"] = gossip["bytes_sent"] / max(gossip["step"], 1)
    with open(os.path.join(out_dir, "rate.json"), "w") as f:
        json.dump(figures, f)
    # The step to stop at: a margin past the chief's step for the all-reduce workers, which
    # are at most a step apart (the others stop when they see the file).
    stop = os.path.join(out_dir, "stop")
    with open(stop + ".tmp", "w") as f:
        f.write(str(pace.steps + 20 * pace.steps_per_call))
    os.replace(stop + ".tmp", stop)


def _workers(strategy):
    """How many worker processes compute steps."""
    if strategy is None:
        return 1
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return strategy.num_replicas_in_sync
    return getattr(strategy, "num_workers", 1)


def _work(strategy, figures):
    """Rows per update and rows per second that went into updates, over the window.

    A parameter-server update averages the pushes it aggregated (`--batch_size` rows each:
    hard sync M of them, async one); an all-reduce or one-process step is one update of
    `fit`'s whole batch; an SGP step of the chief stands for a round of every worker's step
    (the workers keep each other's pace within `max_delay`), M x `--batch_size` rows.
    """
    updates = figures["updates_per_second"]
    if strategy is not None and hasattr(strategy, "placement"):
        examples = figures["aggregated_gradients"] * FLAGS.batch_size
        rows = examples / updates if updates else None
    else:
        rows = FLAGS.batch_size * _workers(strategy)
        examples = updates * rows
    return {"rows_per_update": rows, "examples_per_second": examples,
            "rows_per_worker_step": FLAGS.batch_size, "workers": _workers(strategy)}


def main(argv):
    del argv
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    strategy = None if FLAGS.no_strategy else tfdist.strategies.from_flags()
    resolver = getattr(strategy, "cluster_resolver", None)
    rank = getattr(strategy, "worker_index", None)
    if rank is None:
        rank = resolver.task_id if resolver is not None and resolver.task_id else 0
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss="sparse_categorical_crossentropy",
                      steps_per_execution=FLAGS.steps_per_execution)
    if strategy is not None and hasattr(strategy, "shard"):
        x, y = strategy.shard(x, y)
    # Enough data for the whole window: the chief's stop file ends training.
    x, y = np.tile(x, (50, 1)), np.tile(y, 50)
    stalling = [int(r) for r in FLAGS.stall_ranks]
    stall = None
    if FLAGS.stall_every and rank in stalling:
        offset = stalling.index(rank) * FLAGS.stall_every // len(stalling)
        stall = (FLAGS.stall_every, offset, FLAGS.stall_seconds)
    lockstep = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    pace = _Pace(FLAGS.straggler_delay if rank == FLAGS.straggler_rank else 0.0,
                 os.path.join(FLAGS.out_dir, "stop"), FLAGS.steps_per_execution, stall,
                 lockstep)
    if rank == 0:
        threading.Thread(target=_measure, args=(strategy, pace, FLAGS.out_dir),
                         daemon=True).start()
    # Equal work: `fit`'s batch is the global one under MultiWorkerMirrored.
    batch = FLAGS.batch_size * (_workers(strategy) if lockstep else 1)
    model.fit(x, y, batch_size=batch, epochs=1000, verbose=0, callbacks=[pace])
    if hasattr(strategy, "join"):
        strategy.join()
    times = pace.step_times[5:] or pace.step_times
    with open(os.path.join(FLAGS.out_dir, f"worker{rank}.json"), "w") as f:
        json.dump({"mean_step_seconds": float(np.mean(times)),
                   "median_step_seconds": float(np.median(times)), "steps": pace.steps,
                   "stalls": pace.stalls}, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
