"""A worker program for the Stochastic Gradient Push tests, run through the launcher.

Scenarios (`--sgp_scenario`; every run passes `--strategy=sgp`):
  equivalence  overlap off, 3 workers. First fit: the graph is fully connected (every worker
               sends to both others), plain SGD: all-reduce SGD step for step. Second fit: an
               irregular graph (a hub per step takes two messages, one worker none), so the
               push-sum weights move away from 1. Worker 0 then takes one step more, alone
               (the others are ending), and `join` averages the models.
  long         the default settings, trained long enough to be killed mid-run; prints READY
               and the logs after the first epoch.
"""

import json
import os

import keras
import tensorflow as tf
from absl import app
from absl import flags

import tfdist
from tests.strategies import ps_program

# ps_program defines --out_dir, --epochs and the strategy flags (run with --strategy=sgp).
FLAGS = flags.FLAGS
flags.DEFINE_enum("sgp_scenario", "equivalence", ["equivalence", "long"], "What to run.")

BATCH = 14
# Steps of the first fit (fully connected): 2 epochs (`--epochs=2`) of 42 rows (128 // 3) in
# batches of 14.
SWITCH = 6


def phased_graph(step, rank, num_workers):
    """Fully connected for the first SWITCH steps; then at step k worker k mod M is a hub that
    the others send to, and the hub sends to the next worker."""
    if step < SWITCH:
        return [peer for peer in range(num_workers) if peer != rank]
    hub = step % num_workers
    return [(hub + 1) % num_workers] if rank == hub else [hub]


def save(name, **values):
    with open(os.path.join(FLAGS.out_dir, name), "w") as f:
        json.dump(values, f)


class Ready(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            print("READY " + json.dumps({k: float(v) for k, v in logs.items()}), flush=True)


def history_of(history):
    return {k: [float(v) for v in vs] for k, vs in history.history.items()}


def main(argv):
    del argv
    overrides = {}
    if FLAGS.sgp_scenario == "equivalence":
        overrides = {"graph": phased_graph, "peers_per_step": 2, "overlap": False}
    strategy = tfdist.strategies.from_flags(**overrides)
    rank = strategy.worker_index
    with strategy.scope():
        model = ps_program.build_model("sgd")
    x, y = ps_program.data()
    xs, ys = strategy.shard(x, y)
    weights = lambda: [w.tolist() for w in model.get_weights()]  # noqa: E731
    result = {"initial": weights(), "devices": sorted({w.value.device for w in model.weights})}
    fit = dict(batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False, verbose=0)
    if FLAGS.sgp_scenario == "long":
        model.fit(xs, ys, callbacks=[Ready()], **fit)
        raise AssertionError("worker 1 should have been killed, and this worker stopped")
    first = model.fit(xs, ys, **fit)
    result.update(connected=weights(), first=history_of(first))
    second = model.fit(xs, ys, **fit)
    result.update(second=history_of(second), before_join=strategy.progress())
    if rank == 0:
        # One step more than the others, which are ending: their end markers come instead
        # of their messages, and worker 0 goes on alone.
        model.fit(xs[:BATCH], ys[:BATCH], batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
    strategy.join()
    result.update(final=weights(), progress=strategy.progress(),
                  evaluation=model.evaluate(x, y, batch_size=64, verbose=0))
    try:
        model.fit(xs, ys, **fit)
        result["fit_after_join"] = "trained"
    except tf.errors.InvalidArgumentError as e:
        result["fit_after_join"] = e.message
    save(f"worker{rank}.json", **result)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
