"""What the between-graph engines (parameter server, gossip) share about a worker process:
where it computes, what its strategy tells about its task, how its `fit` reads its data."""

import atexit
import logging
import queue
import threading
import weakref

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
        del options
        return WorkerDataset(dataset)


class WorkerDataset(tf.distribute.DistributedDataset):
    """The dataset a between-graph worker's `fit` reads: one replica, so the dataset as it
    is, read by a plain `tf.data` iterator, whose iterators are destroyed on a thread of their
    own (`release_aside`).

    Why: Keras 3 makes two iterators at every epoch's end and drops the first unused (its
    `EpochIterator`), and the previous epoch's at the next epoch's first step. On a worker
    of a cluster, destroying an iterator whose threads have just started took from 0.2 to
    5 s in about one epoch end in two (measured on a 4-worker hard-sync run; 1 ms in a
    process of its own), and in hard sync every worker waits for the one that stalls. TF's
    per-replica `MultiDeviceIterator` (what `OneDeviceStrategy` gives Keras) stalled for
    5-60 s at most epoch starts.
    """

    def __init__(self, dataset):
        self._dataset = dataset.prefetch(1)

    def __iter__(self):
        iterator = iter(self._dataset)
        release_aside(iterator)
        return iterator

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def reduce(self, initial_state, reduce_func):
        return self._dataset.reduce(initial_state, reduce_func)


class _Releaser:
    """A daemon thread that drops the objects it is given, one after another.

    Joined at the interpreter's exit (`atexit`, bounded): a daemon thread still inside a
    TensorFlow call when the interpreter finalizes aborts the process (CONTRIBUTING.md).
    """

    JOIN_SECONDS = 30.0

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tfdist-release", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def put(self, state):
        self._queue.put(state)

    def _run(self):
        while True:
            state = self._queue.get()
            if state is None:
                return
            del state  # the TensorFlow destructors run here, on this thread

    def stop(self):
        self._queue.put(None)
        self._thread.join(self.JOIN_SECONDS)
        if self._thread.is_alive():
            log.warning("tfdist: a tf.data iterator was still being destroyed after %.0f s "
                        "at exit", self.JOIN_SECONDS)


_releaser = None
_releaser_lock = threading.Lock()


def release_aside(iterator):
    """When `iterator` (a `tf.data` iterator made in eager mode) is dropped, its TensorFlow
    state is destroyed on the releasing thread, not on the thread that dropped it."""
    global _releaser
    with _releaser_lock:
        if _releaser is None:
            _releaser = _Releaser()
    finalizer = weakref.finalize(iterator, _releaser.put, _tf_compat.iterator_state(iterator))
    finalizer.atexit = False  # at exit, whatever is left goes with the process
