"""Compressed gradient exchange: step time, bytes per step, codec cost, digits accuracy.

    python benchmarks/compression.py --out=benchmarks/results/compression          # full
    python benchmarks/compression.py --out=/tmp/c --fast                            # minutes

One process, two replicas on two logical CPU devices (CompressedMirroredStrategy), so that
every figure of a comparison comes from the same run:

* step time of `CompressedMirroredStrategy(compression=None)` over TF's `MirroredStrategy`
  on the same model and data (runs interleaved, median of the repeats);
* bytes one replica sends per step (from the Keras logs of training) against dense float32,
  for every compressor, on an MLP of ~0.4 M parameters (gradients fused into one vector);
* one replica's encode + decode time for that gradient (its own payload in, every replica's
  payload out), as a share of the measured step time with that compressor, on the MLP and on
  a small CIFAR-size CNN (~0.12 M parameters, far more compute per parameter);
* digits test accuracy with each compressor, with and without error feedback, over seeds,
  against the uncompressed run.

Writes <out>.json and <out>.png.
"""

import json
import statistics
import time

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from machine import finish  # noqa: E402
from machine import ratio_spread  # noqa: E402
from machine import record_parts  # noqa: E402
from machine import stamp  # noqa: E402
from machine import write_json  # noqa: E402

import tfdist  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/compression", "Output path prefix.")
flags.DEFINE_bool("fast", False, "CI-sized: 1 seed, 3 epochs, fewer repeats.")
flags.DEFINE_list("compressors", None, "Compressors to measure (default: all).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the accuracy runs.")
flags.DEFINE_integer("epochs", 20, "Epochs of the digits runs.")
flags.DEFINE_multi_enum("parts", ["exchange", "accuracy"], ["exchange", "accuracy"],
                        "Parts to measure; the others are kept from an existing <out>.json.")
flags.DEFINE_integer("timing_steps", 50, "Timed steps per fit of the step-time comparison.")
flags.DEFINE_integer("repeats", 40, "Interleaved repeats of each timed fit (a quarter of "
                     "that for each compressor against `none`).")

DEVICES = ["/cpu:0", "/cpu:1"]
TIMING_INPUT, TIMING_WIDTH, TIMING_BATCH = 256, 512, 64
CNN_INPUT = (32, 32, 3)
# What each compressor is run with here (the settings where it names them).
SETTINGS = {
    "topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.01},
    "dgc": {"ratio": 0.001, "momentum": 0.9},
    "powersgd": {"rank": 2},
}
LEARNING_RATE = 0.1
DIGITS_STEPS_PER_EPOCH = 45  # 1437 training digits, global batch 32
# DGC warms its sparsity up over the first epochs (the paper: 4 epochs, 75 % to 99.9 %).
ACCURACY_SETTINGS = {"dgc": {"warmup_steps": 4 * DIGITS_STEPS_PER_EPOCH}}


def compressor(name, error_feedback=None, for_accuracy=False):
    kwargs = dict(SETTINGS.get(name, {}))
    if for_accuracy:
        kwargs.update(ACCURACY_SETTINGS.get(name, {}))
    if error_feedback is not None and name != "none":
        kwargs["error_feedback"] = error_feedback
    return tfdist.compression.get(name, **kwargs)


def learning_rate(name):
    # DGC carries the momentum itself (momentum correction): the optimizer's step is scaled so
    # that the effective step size, lr / (1 - m), matches plain SGD's.
    if name == "dgc":
        return LEARNING_RATE * (1 - SETTINGS["dgc"]["momentum"])
    return LEARNING_RATE


# Step time and bytes --------------------------------------------------------------------


def timing_data(kind="mlp", drop_remainder=False):
    """`drop_remainder=True`: every batch's size is known when the step is traced."""
    rng = np.random.RandomState(0)
    shape = (TIMING_INPUT,) if kind == "mlp" else CNN_INPUT
    x = rng.randn(TIMING_BATCH * 64, *shape).astype("float32")
    y = rng.randint(0, 10, len(x)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        TIMING_BATCH, drop_remainder=drop_remainder).repeat()


def timing_model(strategy, lr=0.01, kind="mlp"):
    """The MLP (every parameter in a dense layer: the most exchange per unit of compute) or
    a small CIFAR-size CNN (the compute per parameter of a typical vision model)."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    with strategy.scope():
        if kind == "mlp":
            model = keras.Sequential([
                keras.Input((TIMING_INPUT,)),
                layers.Dense(TIMING_WIDTH, activation="relu"),
                layers.Dense(TIMING_WIDTH, activation="relu"),
                layers.Dense(10)])
        else:
            model = keras.Sequential([
                keras.Input(CNN_INPUT),
                layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(),
                layers.Conv2D(64, 3, activation="relu"), layers.MaxPooling2D(),
                layers.Conv2D(64, 3, activation="relu"), layers.Flatten(),
                layers.Dense(64, activation="relu"), layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _StepClock(keras.callbacks.Callback):
    """Times training steps between batch ends, leaving out fit's set-up and the first steps."""

    skip = 5

    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def seconds_per_step(self):
        ends = self.ends[self.skip:]
        return (ends[-1] - ends[0]) / (len(ends) - 1)


def timed_fit(model, data, steps):
    clock = _StepClock()
    history = model.fit(data, epochs=1, steps_per_epoch=steps + clock.skip, verbose=0,
                        callbacks=[clock])
    return clock.seconds_per_step(), history.history


def step_times(models, data, steps, repeats, timers=None):
    """Seconds per step of each model: interleaved repeats (A B B A ...), median.

    `timers` (name -> a function returning seconds) are sampled once per repeat, right after
    the fits, so that their samples can be paired with the steps of the same repeat (this
    machine's speed drifts by 2x over minutes).
    """
    timers = timers or {}
    for model in models.values():  # trace and warm up
        timed_fit(model, data, 5)
    samples = {name: [] for name in [*models, *timers]}
    logs = {}
    names = list(models)
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            seconds, logs[name] = timed_fit(models[name], data, steps)
            samples[name].append(seconds)
        for name, timer in timers.items():
            samples[name].append(timer())
    return {name: statistics.median(s) for name, s in samples.items()}, logs, samples


def real_gradients(kind="mlp"):
    """The timing model's gradients on one batch (what a codec sees in training)."""
    model = timing_model(tf.distribute.get_strategy(), kind=kind)
    x, y = next(iter(timing_data(kind)))
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def codec_timer(comp, real, replicas=2, repeats=5, unroll=10):
    """A function that measures one replica's encode + decode time for the gradients `real`.

    The replica encodes its gradient; a linear payload is then decoded once (after the
    all-reduce), every replica's part of any other payload together (`decompress_sum`,
    after the all-gather), as `Compressor.exchange` does. Replicas run side by side on
    their own devices, so one replica's codec time is what a step waits for. PowerSGD works
    per matrix (the kernels' gradients). The codec runs `unroll` times per call (on slightly
    different gradients), so the cost of calling a tf.function is spread thin; a
    measurement is the median of `repeats` calls.
    """
    if comp.capabilities.elementwise:  # fused into one vector, as the exchange does
        gradients = [tf.concat([tf.reshape(g, [-1]) for g in real], axis=0)]
    else:
        gradients = [g for g in real if comp.compressible(g.shape, g.dtype)]
    shapes = [g.shape for g in gradients]
    states = [comp.initial_state(s, tf.float32) for s in shapes]
    key = tf.constant([1, 0], tf.int64)
    parts = 1 if comp.capabilities.linear else replicas

    @tf.function
    def run():
        total = tf.constant(0.0)
        for _ in range(unroll):
            outputs = []
            for gradient, state, shape in zip(gradients, states, shapes):
                # Each round depends on the last, so no round is shared or skipped.
                payload, _ = comp.compress(gradient + 1e-12 * total, state, key)
                outputs.append(comp.decompress_sum([payload] * parts, shape, tf.float32, key))
            total += tf.add_n([tf.reduce_sum(o) for o in outputs])
        return total

    def seconds():
        with tf.device(DEVICES[0]):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run().numpy()
                times.append((time.perf_counter() - start) / unroll)
        return statistics.median(times)

    with tf.device(DEVICES[0]):
        run()  # trace
    return seconds


def baseline_ratio(data, steps, repeats):
    """Step seconds of TF's MirroredStrategy and of `CompressedMirroredStrategy(compression=
    None)` on `data`, and the median ratio of neighbouring runs (robust to the machine's
    drift)."""
    baseline = {"tf MirroredStrategy": timing_model(tf.distribute.MirroredStrategy(DEVICES)),
                "tfdist, compression=None": timing_model(
                    tfdist.strategies.CompressedMirroredStrategy(DEVICES))}
    seconds, _, samples = step_times(baseline, data, steps, repeats)
    ratios = [a / b for a, b in zip(samples["tfdist, compression=None"],
                                    samples["tf MirroredStrategy"])]
    return seconds, ratio_spread(ratios), int(baseline["tf MirroredStrategy"].count_params())


def measure_exchange(names, steps, repeats):
    data = timing_data()
    # Batches of a size unknown when traced (Keras's own from arrays, `batch()` without
    # drop_remainder): tfdist weighs each replica's gradient by its examples every step,
    # which makes a batch the replicas do not divide exact; TF's strategy does not. With
    # the sizes known (drop_remainder), nothing is weighted.
    seconds, ratio, size = baseline_ratio(data, steps, repeats)
    even_seconds, even_ratio, _ = baseline_ratio(
        timing_data(drop_remainder=True), steps, max(2, repeats // 2))
    result = {"model_parameters": size,
              "step_seconds": seconds, "timing": {"steps": steps, "repeats": repeats},
              "step_time_ratio": ratio["median"], "step_time_ratio_spread": ratio,
              "static_batch": {"step_seconds": even_seconds,
                               "step_time_ratio": even_ratio["median"],
                               "step_time_ratio_spread": even_ratio,
                               "repeats": max(2, repeats // 2)},
              "compressors": {}}
    print(f"step time: tfdist/tf = {ratio['median']:.3f} (batch size known when traced: "
          f"{even_ratio['median']:.3f})", flush=True)
    size = result["model_parameters"]
    real = real_gradients()
    for name in names:
        comp = compressor(name)
        models = {"none": timing_model(tfdist.strategies.CompressedMirroredStrategy(
                      DEVICES, compression="none")),
                  name: timing_model(tfdist.strategies.CompressedMirroredStrategy(
                      DEVICES, compression=comp))}
        seconds, logs, samples = step_times(models, data, steps, max(2, repeats // 4),
                                            timers={"codec": codec_timer(comp, real)})
        # Each repeat's codec time over the same repeat's step time, median.
        share = statistics.median(c / t for c, t in zip(samples["codec"], samples[name]))
        entry = {
            "config": tfdist.compression.serialize(comp)["config"],
            "bytes_sent": logs[name]["bytes_sent"][-1],
            "bytes_dense": logs[name]["bytes_dense"][-1],
            "bytes_ratio": logs[name]["bytes_dense"][-1] / logs[name]["bytes_sent"][-1],
            "documented_bytes": (comp.payload_bytes([size], tf.float32)
                                 if comp.capabilities.elementwise else None),
            "step_seconds": seconds[name],
            "step_seconds_uncompressed": seconds["none"],
            "codec_seconds": seconds["codec"],
            "codec_share": share,
        }
        result["compressors"][name] = entry
        print(f"{name}: bytes x{entry['bytes_ratio']:.1f}, step {1000 * seconds[name]:.2f} ms "
              f"(none {1000 * seconds['none']:.2f}), codec {100 * entry['codec_share']:.1f} %",
              flush=True)
    result["cnn"] = measure_cnn_share(names, steps, max(2, repeats // 4))
    return result


def measure_cnn_share(names, steps, repeats):
    """The codec's share of the step on the small CNN, where a step computes much more per
    parameter than the MLP's (the codec's cost is per parameter, the step's per sample)."""
    data = timing_data("cnn")
    real = real_gradients("cnn")
    result = {"model_parameters": sum(g.shape.num_elements() for g in real),
              "compressors": {}}
    for name in names:
        comp = compressor(name)
        model = timing_model(tfdist.strategies.CompressedMirroredStrategy(
            DEVICES, compression=comp), kind="cnn")
        seconds, _, samples = step_times({name: model}, data, steps, repeats,
                                         timers={"codec": codec_timer(comp, real)})
        share = statistics.median(c / t for c, t in zip(samples["codec"], samples[name]))
        result["compressors"][name] = {"step_seconds": seconds[name],
                                       "codec_seconds": seconds["codec"],
                                       "codec_share": share}
        print(f"cnn {name}: step {1000 * seconds[name]:.2f} ms, codec "
              f"{1000 * seconds['codec']:.3f} ms, {100 * share:.1f} %", flush=True)
    return result


# Accuracy --------------------------------------------------------------------------------


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    return train_test_split(x, y.astype("int32"), test_size=0.2, random_state=0)


def digits_accuracy(data, strategy, lr, seed, epochs):
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(lr),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0)
    return float(model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"])


def measure_accuracy(names, seeds, epochs):
    data = digits()

    def runs(make_strategy, lr):
        accuracies = [digits_accuracy(data, make_strategy(), lr, seed, epochs) for seed in seeds]
        return {"mean": float(np.mean(accuracies)), "std": float(np.std(accuracies)),
                "runs": accuracies}

    result = {"epochs": epochs, "seeds": seeds, "learning_rate": LEARNING_RATE}
    result["uncompressed"] = runs(lambda: tfdist.strategies.CompressedMirroredStrategy(DEVICES),
                                  LEARNING_RATE)
    print(f"digits uncompressed: {result['uncompressed']['mean']:.4f}", flush=True)
    result["compressors"] = {}
    for name in names:
        entry = {}
        for error_feedback in ((None,) if name == "none" else (True, False)):
            comp = compressor(name, error_feedback, for_accuracy=True)
            r = runs(lambda c=comp: tfdist.strategies.CompressedMirroredStrategy(
                DEVICES, compression=c), learning_rate(name))
            r["vs_uncompressed_points"] = 100 * (r["mean"] - result["uncompressed"]["mean"])
            entry["error_feedback" if comp.error_feedback else "no_error_feedback"] = r
            print(f"digits {name} ef={comp.error_feedback}: {r['mean']:.4f} "
                  f"({r['vs_uncompressed_points']:+.2f})", flush=True)
        result["compressors"][name] = entry
    return result


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exchange, accuracy = result["exchange"], result["accuracy"]
    names = list(exchange["compressors"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ratios = [exchange["compressors"][n]["bytes_ratio"] for n in names]
    axes[0].bar(names, ratios)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("dense fp32 bytes / bytes sent")
    axes[0].set_title(f"Bytes per step ({exchange['model_parameters']:,} parameters)")
    shares = [100 * exchange["compressors"][n]["codec_share"] for n in names]
    positions = np.arange(len(names))
    cnn = exchange.get("cnn")
    width = 0.4 if cnn else 0.8
    axes[1].bar(positions - (width / 2 if cnn else 0), shares, width=width,
                color="tab:orange", label=f"MLP ({exchange['model_parameters']:,} parameters)")
    if cnn:
        axes[1].bar(positions + width / 2,
                    [100 * cnn["compressors"][n]["codec_share"] for n in names], width=width,
                    color="tab:green", label=f"CNN ({cnn['model_parameters']:,} parameters)")
    axes[1].set_xticks(positions)
    axes[1].set_xticklabels(names)
    axes[1].axhline(10, color="gray", ls="--", lw=1)
    axes[1].set_ylabel("encode + decode, % of step time")
    axes[1].set_title("Encode + decode, one replica")
    axes[1].legend(fontsize=7, loc="upper left")
    base = accuracy["uncompressed"]["mean"]
    acc_names = list(accuracy["compressors"])
    for offset, key, label in ((-0.2, "error_feedback", "with error feedback"),
                               (0.2, "no_error_feedback", "without")):
        xs, ys, es = [], [], []
        for i, n in enumerate(acc_names):
            r = accuracy["compressors"][n].get(key)
            if r is not None:
                xs.append(i + offset)
                ys.append(r["mean"])
                es.append(r["std"])
        axes[2].bar(xs, ys, width=0.4, yerr=es, label=label)
    axes[2].axhline(base, color="black", lw=1, label="uncompressed")
    axes[2].axhline(base - 0.01, color="gray", ls="--", lw=1, label="-1 point")
    axes[2].set_xticks(range(len(acc_names)))
    axes[2].set_xticklabels(acc_names)
    lowest = min(r["mean"] for entry in accuracy["compressors"].values()
                 for r in entry.values())
    axes[2].set_ylim(max(0.0, min(lowest, base - 0.05) - 0.05), 1.0)
    axes[2].set_ylabel("digits test accuracy")
    axes[2].set_title(f"{accuracy['epochs']} epochs, {len(accuracy['seeds'])} seed(s)")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv):
    del argv
    names = FLAGS.compressors or tfdist.compression.names()
    seeds = [int(s) for s in FLAGS.seeds]
    epochs, steps, repeats = FLAGS.epochs, FLAGS.timing_steps, FLAGS.repeats
    if FLAGS.fast:
        seeds, epochs, steps, repeats = seeds[:1], min(epochs, 3), min(steps, 20), 4
    result = {}
    if set(FLAGS.parts) != {"exchange", "accuracy"}:
        with open(FLAGS.out + ".json") as f:
            result = json.load(f)
    run_stamp = stamp()
    if "exchange" in FLAGS.parts:
        result["exchange"] = measure_exchange(names, steps, repeats)
    if "accuracy" in FLAGS.parts:
        result["accuracy"] = measure_accuracy(names, seeds, epochs)
    record_parts(result, run_stamp, FLAGS.parts,
                 kept=[p for p in ("exchange", "accuracy") if p in result and p not in FLAGS.parts])
    result["stamp"] = finish(run_stamp)
    write_json(FLAGS.out + ".json", result)
    plot(result, FLAGS.out + ".png")
    print(f"wrote {FLAGS.out}.json and {FLAGS.out}.png", flush=True)


if __name__ == "__main__":
    app.run(main)
