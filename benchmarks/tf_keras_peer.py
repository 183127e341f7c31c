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


def _coordinate(cluster):
    import tensorflow as tf
    import tf_keras
    from sklearn.datasets import load_digits

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
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
    result = {}
    started = threading.Event()

    def iterations():
        return int(model.optimizer.iterations.numpy())

    def measure():
        deadline = time.monotonic() + FLAGS.timeout
        while not started.is_set() or iterations() < 20:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(FLAGS.warmup)
        before, start = iterations(), time.monotonic()
        time.sleep(FLAGS.window)
        after, elapsed = iterations(), time.monotonic() - start
        result["updates_per_second"] = (after - before) / elapsed
        result["examples_per_second"] = result["updates_per_second"] * FLAGS.batch_size
        model.stop_training = True

    class Stop(tf_keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            started.set()

    threading.Thread(target=measure, daemon=True).start()
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=FLAGS.steps_per_epoch, verbose=0, callbacks=[Stop()])
    if "updates_per_second" not in result:
        raise RuntimeError(f"the epoch of {FLAGS.steps_per_epoch} steps ended before the "
                           "window did: raise --steps_per_epoch")
    return {**result, "rows_per_update": FLAGS.batch_size,
            "steps_per_execution": FLAGS.steps_per_execution,
            "steps_per_epoch": FLAGS.steps_per_epoch,
            "num_workers": FLAGS.num_workers, "num_ps": FLAGS.num_ps,
            "tensorflow": tf.__version__, "tf_keras": tf_keras.__version__}


def main(argv):
    del argv
    if FLAGS.serve:
        job, index = FLAGS.serve.split(":")
        _serve(json.loads(FLAGS.cluster), job, int(index))
        return
    ports = _free_ports(1 + FLAGS.num_workers + FLAGS.num_ps)
    cluster = {"chief": [f"localhost:{ports[0]}"],
               "worker": [f"localhost:{p}" for p in ports[1:1 + FLAGS.num_workers]],
               "ps": [f"localhost:{p}" for p in ports[1 + FLAGS.num_workers:]]}
    servers = []

    def stop_servers():
        for server in servers:
            server.kill()
        for server in servers:
            server.wait()

    def give_up():
        print(f"tf_keras_peer: timed out after {FLAGS.timeout:g} s", file=sys.stderr,
              flush=True)
        stop_servers()
        os._exit(124)

    timer = threading.Timer(FLAGS.timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        for job in ("ps", "worker"):
            for index in range(len(cluster[job])):
                servers.append(subprocess.Popen(
                    [sys.executable, __file__, f"--serve={job}:{index}",
                     f"--cluster={json.dumps(cluster)}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        load_before = [round(x, 2) for x in os.getloadavg()]
        result = _coordinate(cluster)
        result.update(load_before=load_before,
                      load_after=[round(x, 2) for x in os.getloadavg()])
        with open(FLAGS.out, "w") as f:
            json.dump(result, f)
    finally:
        timer.cancel()
        stop_servers()


if __name__ == "__main__":
    app.run(main)
