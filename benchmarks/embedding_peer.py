"""The peer of `embedding.py`: the job of `embedding_job.py` under tf_keras `fit` with TF's
`ParameterServerStrategy`, run as its users run it for throughput. In the peer's own
environment (tensorflow and tf_keras, see `tf_keras_peer.py`), on that file's local cluster
(a coordinator here, `--num_workers` worker and `--num_ps` ps servers).

As TF's parameter-server tutorial sets it up: the tables split over the ps tasks by
`MinSizePartitioner` (shards of at least 256 KiB, at most one per ps task), the data a
`DatasetCreator` whose function shards the examples by input pipeline (each worker its own
share), `steps_per_execution` as given. Each step is one batch of `--batch_size` on one
worker and one update of the ps variables. Two phases, as `embedding_worker.py`:

1. quality: `--quality_examples` examples (one epoch of that many steps), then the
   coordinator evaluates the trained weights on the test examples (a copy of the model
   outside the strategy);
2. rate: fit on, in epochs of 1,000 x `steps_per_execution` steps, the optimizer's step
   count read by the coordinator before and after the window
   (`tf_keras_peer.fit_and_measure`); the loopback bytes of this process's network
   namespace over the same window; then each server's peak resident memory.

Writes every figure to `--out` (JSON).
"""

import json
import os
import re

import embedding_job as job
import numpy as np
import tf_keras_peer
from absl import app
from absl import flags
from machine import cpu_counters
from machine import loopback_counters
from machine import peak_resident_bytes

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 100000, "V: rows of the large table.", lower_bound=1000)
flags.DEFINE_integer("quality_examples", 51200, "Examples trained before the evaluation.",
                     lower_bound=1)
flags.DEFINE_integer("train_examples", 262144, "Examples generated for training.",
                     lower_bound=1)

TEST_EXAMPLES = 20000


def _weights(model):
    """The model's weights as numpy arrays, a table split over ps tasks (its parts named
    `.../part_<i>`, in order) joined again."""
    by_name = {}
    for weight in model.weights:
        name = re.sub(r"/part_\d+", "", weight.name)
        by_name.setdefault(name, []).append(weight.numpy())
    return [np.concatenate(parts) for parts in by_name.values()]


def _coordinate(cluster, servers):
    import tensorflow as tf
    import tf_keras

    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=FLAGS.num_ps)
    strategy = tf_keras_peer.coordinator_strategy(cluster, partitioner)
    x, y = job.generate(FLAGS.rows, FLAGS.train_examples, seed=0)

    def dataset_fn(context):
        data = tf.data.Dataset.from_tensor_slices((x, y))
        data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
        return data.repeat().batch(FLAGS.batch_size).prefetch(2)

    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        model = job.build_model(tf_keras, FLAGS.rows)
        job.compile_model(tf_keras, model, FLAGS.steps_per_execution)
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    steps = FLAGS.quality_examples // FLAGS.batch_size
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    local = job.build_model(tf_keras, FLAGS.rows)
    job.compile_model(tf_keras, local)
    local.set_weights(_weights(model))
    x_test, y_test = job.generate(FLAGS.rows, TEST_EXAMPLES, seed=1)
    loss, accuracy = local.evaluate(x_test, y_test, batch_size=1024, verbose=0)
    del local

    def loopback_bytes():
        return {"loopback_tx_bytes": loopback_counters()["loopback_tx_bytes"],
                **cpu_counters()}

    # A long epoch, as a user after throughput sets it: no wait for every step in the window.
    rate = tf_keras_peer.fit_and_measure(tf_keras, model, data, loopback_bytes,
                                         1000 * FLAGS.steps_per_execution)
    peaks = {name: peak_resident_bytes(server.pid) for name, server in servers.items()}
    return {"rate": rate | {"pushes_per_second": rate["updates_per_second"]},
            "quality": {"loss": float(loss), "accuracy": float(accuracy),
                        "examples": steps * FLAGS.batch_size,
                        "network_namespace": loopback_counters()["network_namespace"]},
            "peak_resident_bytes": peaks | {"coordinator": peak_resident_bytes(os.getpid())},
            "steps_per_execution": FLAGS.steps_per_execution,
            "tensorflow": tf.__version__, "tf_keras": tf_keras.__version__}


def main(argv):
    del argv
    with tf_keras_peer.local_cluster(FLAGS.num_workers, FLAGS.num_ps, FLAGS.timeout) as (
            cluster, servers):
        result = _coordinate(cluster, servers)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)
