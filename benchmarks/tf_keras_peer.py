"""The peer of the parameter-server rows: tf_keras `fit` under TF's `ParameterServerStrategy`.

What a user goes back to when tfdist's parameter-server strategies are too slow: TF's own
asynchronous parameter-server training, which needs tf_keras (Keras 2) — Keras 3 has none.
It runs in its own environment, with full TensorFlow and tf_keras:

    python -m venv PEER
    PEER/bin/pip install tensorflow-cpu==2.21.0 "tf_keras==2.21.*" scikit-learn absl-py
    python benchmarks/rates.py --peer_python=PEER/bin/python

Same job as `ps_worker.py`: the digits MLP (64-64-10, 4.8 k parameters), SGD 0.05, batch 32
per step, on a local cluster of this machine (a coordinator, `--num_workers` worker servers,
`--num_ps` ps servers). Every step is one update of the ps variables (32 rows), by whichever
worker ran it.

Run as its users run it for throughput: one epoch of `--steps_per_epoch` steps (tf_keras
joins its coordinator at every epoch's end, so short epochs would put a barrier in the
window), and the window timed from the coordinator's own counter, the optimizer's
`iterations` read on the ps: it opens once training has run `--warmup` seconds past its
first 20 steps (start-up, tracing and the workers' first connections are outside it), and
closes `--window` seconds later; the epoch's end (its join) comes after. Writes
`{"updates_per_second": ..., "examples_per_second": ..., "load_before": ...}` to `--out`.
Every server process is started with a deadline and killed at the end, however the run ends.
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "Worker servers.", lower_bound=1)
flags.DEFINE_integer("num_ps", 1, "Ps servers.", lower_bound=1)
flags.DEFINE_integer("steps_per_execution", 1, "Keras `steps_per_execution`.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Batch size of a step.", lower_bound=1)
flags.DEFINE_float("warmup", 4.0, "Seconds before the measurement window.", lower_bound=0)
flags.DEFINE_float("window", 8.0, "Seconds of the measurement window.", lower_bound=1)
flags.DEFINE_float("timeout", 180.0, "Seconds the whole run may take.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 1_000_000, "Steps of the one epoch (the window ends "
                     "training long before).", lower_bound=1)
flags.DEFINE_string("out", None, "Where to write the result (JSON).")
flags.DEFINE_string("serve", None, "Internal: run the server `job:index` of --cluster.")
flags.DEFINE_string("cluster", None, "Internal: the cluster, as JSON.")


def _free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _serve(cluster, job, index):
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", start=True)
    server.join()


def coordinator_strategy(cluster, variable_partitioner=None):
    """TF's `ParameterServerStrategy`, coordinated from this process (the cluster's chief)."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=variable_partitioner)


def fit_and_measure(tf_keras, model, data, counters=dict, steps_per_epoch=None):
    """Fits `model` on `data` (a `DatasetCreator`) until the coordinator has counted the
    optimizer's steps (its `iterations`, read on the ps) over `--window` seconds; returns
    `{"updates_per_second": ...}`, and for each of `counters()` (more counters read at both
    ends of the window) its change per second as `<name>_per_second`.

    The window opens `--warmup` seconds after this fit's first 20 steps (start-up, tracing
    and the workers' first connections are outside it). An epoch is `steps_per_epoch` steps
    (default `--steps_per_epoch`, one long epoch: tf_keras joins its coordinator at every
    epoch's end, so short epochs would put a barrier in the window); training stops at the
    first step after the window either way."""
    result = {}
    started = threading.Event()

    def iterations():
        return int(model.optimizer.iterations.numpy())

    first = iterations()  # a fit before this one (a quality phase) already counted steps

    def measure():
        deadline = time.monotonic() + FLAGS.timeout
        while not started.is_set() or iterations() < first + 20:
            if time.monotonic() > deadline:
                model.stop_training = True
                return
            time.sleep(0.05)
        time.sleep(FLAGS.warmup)
        before, more_before = iterations(), counters()
        start = time.monotonic()
        time.sleep(FLAGS.window)
        after, more_after = iterations(), counters()
        elapsed = time.monotonic() - start
        result.update({f"{name}_per_second": (more_after[name] - value) / elapsed
                       for name, value in more_before.items()})
        result["updates_per_second"] = (after - before) / elapsed
        model.stop_training = True

    class Stop(tf_keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            started.set()

        def on_epoch_end(self, epoch, logs=None):
            if "updates_per_second" in result:
                self.model.stop_training = True

    epochs = 1 if steps_per_epoch is None else 100_000
    steps_per_epoch = steps_per_epoch or FLAGS.steps_per_epoch
    threading.Thread(target=measure, daemon=True).start()
    model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0,
              callbacks=[Stop()])
    if "updates_per_second" not in result:
        raise RuntimeError(f"training ended before the window did (the epoch of "
                           f"{steps_per_epoch} steps, or 20 steps not reached within "
                           f"--timeout={FLAGS.timeout:g} s): raise --steps_per_epoch")
    return result


def _coordinate(cluster):
    import tensorflow as tf
    import tf_keras
    from sklearn.datasets import load_digits

    strategy = coordinator_strategy(cluster)
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")

    def dataset_fn(context):
        del context
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(FLAGS.batch_size)

    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.Input((64,)),
                                     tf_keras.layers.Dense(64, activation="relu"),
                                     tf_keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=tf_keras.optimizers.SGD(0.05),
                      loss="sparse_categorical_crossentropy",
                      steps_per_execution=FLAGS.steps_per_execution)
    result = fit_and_measure(tf_keras, model,
                             tf_keras.utils.experimental.DatasetCreator(dataset_fn))
    result["examples_per_second"] = result["updates_per_second"] * FLAGS.batch_size
    return {**result, "rows_per_update": FLAGS.batch_size,
            "steps_per_execution": FLAGS.steps_per_execution,
            "steps_per_epoch": FLAGS.steps_per_epoch,
            "num_workers": FLAGS.num_workers, "num_ps": FLAGS.num_ps,
            "tensorflow": tf.__version__, "tf_keras": tf_keras.__version__}


@contextlib.contextmanager
def local_cluster(num_workers, num_ps, timeout):
    """A cluster of this machine for a coordinator in this process: yields `(cluster,
    servers)`, the cluster as a dict of addresses and `{"worker:0": process, ...}`, one
    server process per task. Every server is killed on leaving the block, and this whole
    process ends (exit 124) after `timeout` seconds, however the run goes."""
    ports = _free_ports(1 + num_workers + num_ps)
    cluster = {"chief": [f"localhost:{ports[0]}"],
               "worker": [f"localhost:{p}" for p in ports[1:1 + num_workers]],
               "ps": [f"localhost:{p}" for p in ports[1 + num_workers:]]}
    servers = {}

    def stop_servers():
        for server in servers.values():
            server.kill()
        for server in servers.values():
            server.wait()

    def give_up():
        print(f"tf_keras_peer: timed out after {timeout:g} s", file=sys.stderr, flush=True)
        stop_servers()
        os._exit(124)

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        for job in ("ps", "worker"):
            for index in range(len(cluster[job])):
                servers[f"{job}:{index}"] = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), f"--serve={job}:{index}",
                     f"--cluster={json.dumps(cluster)}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent)
        yield cluster, servers
    finally:
        timer.cancel()
        stop_servers()


def _die_with_parent():
    """For `preexec_fn`: the server is SIGKILLed when this coordinator dies, however it dies
    (Linux's parent-death signal; this runs in the peer's environment, without tfdist)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv):
    del argv
    if FLAGS.serve:
        job, index = FLAGS.serve.split(":")
        _serve(json.loads(FLAGS.cluster), job, int(index))
        return
    with local_cluster(FLAGS.num_workers, FLAGS.num_ps, FLAGS.timeout) as (cluster, _):
        load_before = [round(x, 2) for x in os.getloadavg()]
        result = _coordinate(cluster)
        result.update(load_before=load_before,
                      load_after=[round(x, 2) for x in os.getloadavg()])
        with open(FLAGS.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    app.run(main)
