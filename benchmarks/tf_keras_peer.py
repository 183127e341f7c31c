"""The peer of the parameter-server rows: tf_keras `fit` under TF's `ParameterServerStrategy`.

What a user goes back to when tfdist's parameter-server strategies are too slow: TF's own
asynchronous parameter-server training, which needs tf_keras (Keras 2) — Keras 3 has none.
It runs in its own environment, with full TensorFlow and tf_keras:

    python -m venv peer
    peer/bin/pip install tensorflow-cpu==2.21.0 tf_keras==2.21.0 scikit-learn absl-py
    python benchmarks/rates.py --peer_python=peer/bin/python

Same job as `ps_worker.py`: the digits MLP (64-64-10, 4.8 k parameters), SGD 0.05, batch 32
per step, on a local cluster of this machine (a coordinator, `--num_workers` worker servers,
`--num_ps` ps servers). Every step is one update of the ps variables, by whichever worker
ran it; the rate is the optimizer's step count read on the ps, per second, over `--window`
seconds after `--warmup`. Writes `{"updates_per_second": ...}` to `--out`. Every server
process is started with a deadline and killed at the end, however the run ends.
"""

import contextlib
import json
import os
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


def fit_and_measure(tf_keras, model, data, steps_per_execution, counters=dict,
                    steps_per_epoch=None):
    """Fits `model` on `data` (a `DatasetCreator`) until the coordinator has counted the
    optimizer's steps over `--window` seconds after `--warmup`; returns
    `{"updates_per_second": ...}`, and for each of `counters()` (more counters read at both
    ends of the window) its change per second as `<name>_per_second`. An epoch is
    `steps_per_epoch` steps (default 20 x `steps_per_execution`): its end waits for every
    scheduled step; training stops at the first step after the window either way."""
    result = {}

    def measure():
        time.sleep(FLAGS.warmup)
        before, more_before = int(model.optimizer.iterations.numpy()), counters()
        start = time.monotonic()
        time.sleep(FLAGS.window)
        after, more_after = int(model.optimizer.iterations.numpy()), counters()
        elapsed = time.monotonic() - start
        result.update({f"{name}_per_second": (more_after[name] - value) / elapsed
                       for name, value in more_before.items()})
        result["updates_per_second"] = (after - before) / elapsed
        model.stop_training = True

    class Stop(tf_keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if "updates_per_second" in result:
                self.model.stop_training = True

    threading.Thread(target=measure, daemon=True).start()
    model.fit(data, epochs=100000, steps_per_epoch=steps_per_epoch or 20 * steps_per_execution,
              verbose=0, callbacks=[Stop()])
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
                             tf_keras.utils.experimental.DatasetCreator(dataset_fn),
                             FLAGS.steps_per_execution)
    return {**result, "steps_per_execution": FLAGS.steps_per_execution,
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
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield cluster, servers
    finally:
        timer.cancel()
        stop_servers()


def main(argv):
    del argv
    if FLAGS.serve:
        job, index = FLAGS.serve.split(":")
        _serve(json.loads(FLAGS.cluster), job, int(index))
        return
    with local_cluster(FLAGS.num_workers, FLAGS.num_ps, FLAGS.timeout) as (cluster, _):
        result = _coordinate(cluster)
        with open(FLAGS.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    app.run(main)
