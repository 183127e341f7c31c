"""What the between-graph engines (parameter server, gossip) share about a worker process:
where it computes, what its strategy tells about its task."""

import tensorflow as tf


def compute_device(task_type, task_index, gpus=None):
    """Where a worker computes: its first GPU if it has one, else its CPU.

    Args:
      task_type, task_index: the worker's task.
      gpus: the local GPUs (None: `tf.config.list_physical_devices("GPU")`).
    """
    if gpus is None:
        gpus = tf.config.list_physical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    return f"/job:{task_type}/replica:0/task:{task_index}/device:{kind}:0"



class WorkerTasksMixin:
    """`is_chief`, `worker_index`, `num_workers`, `cluster_config` of a between-graph strategy.

    Its extended's `_connection` knows the cluster: `is_chief`, `rank`, `num_workers` and
    `config` (a `tfdist.cluster.ClusterConfig`).
    """

    @property
    def is_chief(self):
        """True on the chief (worker 0 when the cluster has no chief task), which writes
        checkpoints."""
        return self.extended._connection.is_chief

    @property
    def worker_index(self):
        """This worker's rank among the training tasks (0 = chief)."""
        return self.extended._connection.rank

    @property
    def num_workers(self):
        return self.extended._connection.num_workers

    @property
    def cluster_config(self):
        return self.extended._connection.config


class BetweenGraphExtendedMixin:
    """What a between-graph extended (one replica per worker process, each running its own
    `fit`) tells TF and Keras: not TF's multi-worker mode (no cross-worker reductions of
    logs or metrics), and only the chief checkpoints and writes summaries. Its
    `_connection` has `is_chief`."""

    def _in_multi_worker_mode(self):
        return False

    @property
    def experimental_between_graph(self):
        return True

    @property
    def should_checkpoint(self):
        return self._connection.is_chief

    @property
    def should_save_summary(self):
        return self._connection.is_chief
