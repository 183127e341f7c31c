"""Worker program of `embedding.py`: the recommendation job of `embedding_job.py` under a
tfdist parameter-server strategy (`--strategy=async` or `soft_sync`), or in one process with
no strategy (`--one_process`).

Two phases in one run, so that a cell costs one start-up:

1. quality: the workers train `--quality_examples` examples in all (each its share, batch
   `--batch_size`, one pass over its shard of the data), then the chief evaluates the model on
   20,000 examples of its own seed and writes `quality.json` (loss, accuracy). The workers
   meet before and after the evaluation (files in `--out_dir`: the cluster is local), so
   that the evaluated model has trained exactly `--quality_examples` examples: an async
   worker that went on to the rate phase would train the model under evaluation. This phase
   is also the warm-up: every trace is done before the timing starts.
2. rate: the workers train on; the chief measures over `--window` seconds (after `--warmup`)
   the global updates per second, the pushes of all workers, and the bytes the cluster's
   private network carried (its loopback's transmit counter: every byte between two tasks
   once, headers included), writes `rate.json`, and stops everyone (`ps_worker.py`'s
   machinery).

`--embedding_tables` is passed to the strategy only when its constructor takes that argument
(tfdist after issue 21); with older tfdist every worker mirrors every table, the only
behaviour there is. `placement.json` holds what the chief's strategy says about it.
"""

import contextlib
import inspect
import json
import os
import threading
import time

import embedding_job as job
import keras
import numpy as np
import ps_worker
from absl import app
from absl import flags
from machine import cpu_counters
from machine import loopback_counters

import tfdist

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 100000, "V: rows of the large table.", lower_bound=1000)
flags.DEFINE_integer("quality_examples", 51200, "Examples (all workers) trained before the "
                     "evaluation.", lower_bound=1)
flags.DEFINE_integer("train_examples", 262144, "Examples generated for training (the rate "
                     "phase cycles over them).", lower_bound=1)
flags.DEFINE_bool("one_process", False, "Train in this process with no strategy.")
flags.DEFINE_bool("quality_only", False, "With --one_process: stop after the quality "
                  "phase.")
flags.DEFINE_enum("embedding_tables", "auto", ["auto", "none"],
                  "Strategy argument `embedding_tables` (when the strategy takes it): auto "
                  "keeps the tables on the ps; none mirrors them on every worker.")

TEST_EXAMPLES = 20000
MEET_SECONDS = 600.0


def _meet(names, who):
    """Waits until every file of `names` exists in `--out_dir` (written by the other
    workers), at most `MEET_SECONDS`."""
    deadline = time.monotonic() + MEET_SECONDS
    paths = [os.path.join(FLAGS.out_dir, name) for name in names]
    while not all(os.path.exists(path) for path in paths):
        if time.monotonic() > deadline:
            missing = [name for name, path in zip(names, paths) if not os.path.exists(path)]
            raise RuntimeError(f"{who}: after {MEET_SECONDS:g} s still no {missing} in "
                               f"--out_dir={FLAGS.out_dir}")
        time.sleep(0.05)


def _loopback_bytes():
    return {"loopback_tx_bytes": loopback_counters()["loopback_tx_bytes"], **cpu_counters()}


def _strategy():
    """The strategy of `--strategy`, and what was passed as `embedding_tables` (None: the
    strategy takes no such argument)."""
    if FLAGS.one_process:
        return None, None
    strategy_class = {"async": tfdist.strategies.AsyncStrategy,
                      "soft_sync": tfdist.strategies.SoftSyncStrategy}.get(FLAGS.strategy)
    if strategy_class is None:
        raise app.UsageError(f"--strategy must be async or soft_sync (or --one_process). "
                             f"Received: {FLAGS.strategy!r}")
    if "embedding_tables" not in inspect.signature(strategy_class).parameters:
        return tfdist.strategies.from_flags(), None
    value = None if FLAGS.embedding_tables == "none" else FLAGS.embedding_tables
    return tfdist.strategies.from_flags(embedding_tables=value), FLAGS.embedding_tables


def _write(name, figures):
    path = os.path.join(FLAGS.out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(figures, f)
    os.replace(path + ".tmp", path)


def main(argv):
    del argv
    if FLAGS.quality_only and not FLAGS.one_process:
        raise app.UsageError("--quality_only is for --one_process")
    x, y = job.generate(FLAGS.rows, FLAGS.train_examples, seed=0)
    strategy, embedding_tables = _strategy()
    num_workers = getattr(strategy, "num_workers", 1)
    chief = strategy is None or strategy.worker_index == 0
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = job.build_model(keras, FLAGS.rows)
        job.compile_model(keras, model, FLAGS.steps_per_execution)
    if strategy is not None:
        x, y = strategy.shard(x, y)
    share = FLAGS.quality_examples // num_workers
    if share > len(x):
        raise app.UsageError(f"--quality_examples={FLAGS.quality_examples} needs "
                             f"{share} examples per worker; --train_examples gives {len(x)}")
    model.fit(x[:share], y[:share], batch_size=FLAGS.batch_size, epochs=1, verbose=0)
    rank = 0 if chief else strategy.worker_index
    _write(f"trained{rank}", {})
    if chief:
        _meet([f"trained{i}" for i in range(num_workers)], "the chief's evaluation")
        x_test, y_test = job.generate(FLAGS.rows, TEST_EXAMPLES, seed=1)
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
        _write("quality.json", {"loss": float(loss), "accuracy": float(accuracy),
                                "examples": share * num_workers,
                                "embedding_tables": embedding_tables,
                                "network_namespace": loopback_counters()["network_namespace"],
                                "placement": strategy.placement() if strategy else None})
    else:
        _meet(["quality.json"], f"worker {rank}'s rate phase")
    if FLAGS.quality_only:
        return
    pace = ps_worker._Pace(0.0, os.path.join(FLAGS.out_dir, "stop"),
                           FLAGS.steps_per_execution)
    if chief:
        threading.Thread(target=ps_worker._measure, daemon=True,
                         args=(strategy, pace, FLAGS.out_dir, _loopback_bytes)).start()
    # Enough passes for the whole window: the chief's stop file ends training.
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1000, verbose=0, callbacks=[pace])
    if strategy is not None:
        strategy.join()
    times = pace.step_times[5:] or pace.step_times
    _write(f"worker{rank}.json",
           {"median_step_seconds": float(np.median(times)) if times else None,
            "steps": pace.steps})


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
