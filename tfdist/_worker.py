"""What the between-graph engines (parameter server, gossip) share about a worker process:
where it computes, what its strategy tells about its task, how its `fit` reads its data."""

import atexit
import logging
import os
import queue
import sys
import threading

import tensorflow as tf

from tfdist import _tf_compat

log = logging.getLogger("tfdist")


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

    def _experimental_distribute_dataset(self, dataset, options):
        del options  # one replica, whose input is read on the host
        return WorkerDataset(dataset)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        del options
        return WorkerDataset(dataset_fn(tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)))


class WorkerDataset(_tf_compat.DatasetAsIs, tf.distribute.DistributedDataset):
    """The dataset a between-graph worker's `fit` reads: one replica, so the dataset as it
    is (prefetching one batch), read by plain `tf.data` iterators that are destroyed on a
    thread of their own when dropped (`release_aside`).

    A `tf.data.Dataset` (Keras takes it in `fit`, `evaluate` and `predict`; AutoGraph loops
    over it in-graph) and a `tf.distribute.DistributedDataset` (Keras does not distribute it
    again).

    Why: with `steps_per_epoch` unset on a dataset of known size, Keras 3's `EpochIterator`
    makes an iterator at an epoch's end and another at the next epoch's start, dropping the
    first unread, and drops the previous epoch's at the next first step. On a worker of a
    cluster, destroying such an iterator (mostly the unread one) took 0.4-5 s at about one
    epoch start in two of a 4-worker hard-sync run (1 ms in a process of its own; the cause
    inside TensorFlow was not found), and in hard sync every worker waits for the one that
    stalls. With TF's per-replica `MultiDeviceIterator` (OneDeviceStrategy's) the waits were
    0.1-15 s at every epoch start.

    The batches are read on the host: on a GPU worker the step copies its batch to the GPU
    (TF's device prefetching is built on the same remote calls as `MultiDeviceIterator`, and
    was not measured here).
    """

    def __init__(self, dataset):
        super().__init__(dataset.prefetch(1))

    def __iter__(self):
        if not tf.executing_eagerly():  # inside a `tf.function`: TF's own graph iterator
            return super().__iter__()
        return _tf_compat.HandingOverIterator(self, release_aside)


class _Releaser:
    """A daemon thread that drops what it is given, one after another: where TensorFlow's
    destructors run.

    At the interpreter's exit it finishes only what it is dropping (bounded) and leaves the
    rest to go with the process: a daemon thread still inside a TensorFlow call when the
    interpreter finalizes aborts the process (CONTRIBUTING.md, "Traps").
    """

    JOIN_SECONDS = 30.0

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._exiting = False
        self._thread = threading.Thread(target=self._run, name="tfdist-release", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def put(self, state):
        self._queue.put(state)

    def _run(self):
        while True:
            state = self._queue.get()
            if state is None or self._exiting:
                return
            del state  # the TensorFlow destructors run here

    def stop(self):
        self._exiting = True
        self._queue.put(None)
        self._thread.join(self.JOIN_SECONDS)
        if self._thread.is_alive():
            log.warning("tfdist: a tf.data iterator was still being destroyed %.0f s into "
                        "the exit", self.JOIN_SECONDS)


_releaser = None
_releaser_lock = threading.Lock()


def release_aside(state):
    """Drops `state` (what keeps a dropped `tf.data` iterator alive) on the releasing
    thread, started at the first call."""
    global _releaser
    if sys.is_finalizing():
        return  # no new thread now: `state` goes here, with the process
    with _releaser_lock:
        if _releaser is None:
            _releaser = _Releaser()
        releaser = _releaser
    releaser.put(state)


def _forget_releaser_in_child():
    global _releaser, _releaser_lock
    _releaser, _releaser_lock = None, threading.Lock()  # a forked child has no such thread


os.register_at_fork(after_in_child=_forget_releaser_in_child)
