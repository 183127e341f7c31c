"""A worker program for the Stochastic Gradient Push tests, run through the launcher.

Scenarios (`--sgp_scenario`; every run passes `--strategy=sgp`):
  equivalence  overlap off, 3 workers. First fit: the graph is fully connected (every worker
               sends to both others), plain SGD: all-reduce SGD step for step. Second fit: an
               irregular graph (a hub per step takes two messages, one worker none), so the
               push-sum weights move away from 1; each worker saves its model (a `.keras`
               file). Worker 0 then takes one step more, alone (the others are ending), and
               `join` averages the models. The model ends in a BatchNormalization whose output
               is not used: its moving statistics follow each worker's own batches (no
               gradient reaches them) until `join` averages them too. Loading the saved file
               then restores each worker's push-sum weight and step.
  long         the default settings, trained long enough to be killed mid-run; prints READY
               and the logs after the first epoch.
  diverging    a graph function that answers differently on each worker after step
               DIVERGE (`diverging_graph`), batches of 2: trains `--epochs`, joins, and
               writes its progress.
"""

import json
import os

import keras
import tensorflow as tf
from absl import app
from absl import flags

import tfdist
from tests.strategies import ps_program
from tfdist.gossip import state as gossip_state

# ps_program defines --out_dir, --epochs and the strategy flags (run with --strategy=sgp).
FLAGS = flags.FLAGS
flags.DEFINE_enum("sgp_scenario", "equivalence", ["equivalence", "long", "diverging"],
                  "What to run.")

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


DIVERGE = 40


def diverging_graph(step, rank, num_workers):
    """A ring for DIVERGE steps (the steps checked before the first one agree); then a hop of
    1 or 2 in a phase of the calling process's own (its task index, as a function reading its
    host or process id would): a receiver that computed its senders' answers itself would
    wait at step DIVERGE for a message never sent."""
    if step < DIVERGE:
        return [(rank + 1) % num_workers]
    process = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    return [(rank + 1 + (process + step) % 2) % num_workers]


class Observe(keras.layers.Layer):
    """Passes its input on; in training, its BatchNormalization (no centre, no scale: no
    trainable weights) updates moving statistics from the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(center=False, scale=False)

    def build(self, input_shape):
        self.norm.build(input_shape)

    def call(self, inputs, training=None):
        self.norm(inputs, training=training)
        return inputs


def build_model(scenario):
    """`ps_program`'s model with SGD, and for `equivalence` an `Observe` layer last (its
    moving statistics come after the trained weights in `get_weights()`)."""
    model = ps_program.build_model("sgd")
    if scenario != "equivalence":
        return model
    observed = keras.Sequential([keras.Input((8,)), *model.layers, Observe()])
    optimizer = keras.optimizers.SGD(0.1)
    # The gossip state is the optimizer's once it is put to use (compile's metrics), not as
    # it is made: one Keras revives from its config has the same attributes.
    when_made = hasattr(optimizer, gossip_state.ATTRIBUTE)
    observed.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                     metrics=["accuracy"])
    observed.gossip_state_attached = [when_made, hasattr(optimizer, gossip_state.ATTRIBUTE)]
    return observed


def save(name, **values):
    with open(os.path.join(FLAGS.out_dir, name), "w") as f:
        json.dump(values, f)


class Ready(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            print("READY " + json.dumps({k: float(v) for k, v in logs.items()}), flush=True)


def inbound(port):
    """The TCP connections made to `port` on this host (established ones: gRPC keeps its
    channels open, so a peer that ever connected to it is still seen)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def history_of(history):
    return {k: [float(v) for v in vs] for k, vs in history.history.items()}


def main(argv):
    del argv
    overrides = {}
    if FLAGS.sgp_scenario == "equivalence":
        overrides = {"graph": phased_graph, "peers_per_step": 2, "overlap": False}
    elif FLAGS.sgp_scenario == "diverging":
        overrides = {"graph": diverging_graph}
    strategy = tfdist.strategies.from_flags(**overrides)
    rank = strategy.worker_index
    with strategy.scope():
        model = build_model(FLAGS.sgp_scenario)
    x, y = ps_program.data()
    xs, ys = strategy.shard(x, y)
    weights = lambda: [w.tolist() for w in model.get_weights()]  # noqa: E731
    result = {"initial": weights(), "devices": sorted({w.value.device for w in model.weights}),
              "gossip_state_attached": getattr(model, "gossip_state_attached", None)}
    fit = dict(batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False, verbose=0)
    if FLAGS.sgp_scenario == "long":
        model.fit(xs, ys, callbacks=[Ready()], **fit)
        raise AssertionError("worker 1 should have been killed, and this worker stopped")
    if FLAGS.sgp_scenario == "diverging":
        model.fit(xs, ys, **dict(fit, batch_size=2))
        strategy.join()
        save(f"worker{rank}.json", progress=strategy.progress())
        return
    first = model.fit(xs, ys, **fit)
    result.update(connected=weights(), first=history_of(first))
    second = model.fit(xs, ys, **fit)
    result.update(second=history_of(second), before_join=strategy.progress(),
                  before_join_weights=weights(),
                  courier_inbound=inbound(strategy.extended._node.courier_port))
    saved = os.path.join(FLAGS.out_dir, f"worker{rank}.keras")
    model.save(saved)
    if rank == 0:
        # One step more than the others, which are ending: their end markers come instead
        # of their messages, and worker 0 goes on alone.
        model.fit(xs[:BATCH], ys[:BATCH], batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
    result["at_join"] = weights()
    strategy.join()
    result.update(final=weights(), progress=strategy.progress(),
                  evaluation=model.evaluate(x, y, batch_size=64, verbose=0))
    model.load_weights(saved)  # (a `.keras` file: the weights and the optimizer's state)
    result.update(restored=strategy.progress(), restored_weights=weights())
    try:
        model.fit(xs, ys, **fit)
        result["fit_after_join"] = "trained"
    except tf.errors.InvalidArgumentError as e:
        result["fit_after_join"] = e.message
    save(f"worker{rank}.json", **result)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
