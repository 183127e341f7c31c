"""A worker's connection to the ps tasks, and where each master variable lives."""

import logging
import threading
import time

import tensorflow as tf

from tfdist._worker import compute_device
from tfdist.cluster import TaskUnreachableError
from tfdist.cluster import as_cluster_config
from tfdist.cluster import is_listening
from tfdist.cluster import wait_for_tasks

log = logging.getLogger("tfdist")

_connect_lock = threading.Lock()
_connected = {}


def ps_device(index):
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


class PSConnection:
    """Connects this training task to the cluster's ps tasks.

    Each worker process tells TensorFlow's eager runtime about the ps tasks and *its own*
    address only (a spec listing every worker hangs on connect: DESIGN.md). Shared resources
    on the ps tasks are then reachable by `shared_name` from every worker.

    Args:
      cluster: a `ClusterConfig`, TF_CONFIG dict or string, a cluster resolver, or None to
        read TF_CONFIG.
      connect_timeout: seconds the ps tasks get to start listening.
      inter_op_threads: inter-op threads of this process's TF executor, set before the
        runtime starts (None leaves TF's default). One thread is fastest where per-step
        latency dominates, as with several worker processes sharing a few cores.
    """

    @staticmethod
    def validate(cluster=None):
        """The cluster's `ClusterConfig`, checked for parameter-server training."""
        config = as_cluster_config(cluster)
        if config.num_ps < 1:
            raise ValueError(
                "a parameter-server strategy needs at least one ps task in the cluster. "
                f"Received jobs: { {job: len(a) for job, a in config.cluster.items()} }")
        if config.task_type not in ("chief", "worker"):
            raise ValueError(
                "a parameter-server strategy runs in a `chief` or `worker` task; ps tasks are "
                f"served by `tfdist-launch --job_name=ps`. Received task type: "
                f"{config.task_type!r}")
        return config

    def __init__(self, cluster=None, connect_timeout=30.0, inter_op_threads=1):
        self.config = config = self.validate(cluster)
        self.num_ps = config.num_ps
        self.num_workers = config.num_workers
        self.rank = config.worker_rank
        self.is_chief = config.is_chief
        self.task_name = f"/job:{config.task_type}/task:{config.task_index}"
        self.training_tasks = [f"/job:{job}/task:{i}" for job, i in config.training_tasks]
        self.training_addresses = [config.address(job, i) for job, i in config.training_tasks]
        self.ps_names = [f"/job:ps/task:{i}" for i in range(self.num_ps)]
        self.ps_addresses = list(config.cluster["ps"])
        wait_for_tasks(dict(zip(self.ps_names, config.cluster["ps"])), timeout=connect_timeout)
        spec = {"ps": list(config.cluster["ps"]),
                config.task_type: {config.task_index: config.task_address}}
        if inter_op_threads is not None:
            try:
                tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
            except RuntimeError:
                log.info("tfdist: TensorFlow already started; inter_op_threads=%s not applied",
                         inter_op_threads)
        key = repr(sorted(spec.items(), key=str))
        with _connect_lock:
            if _connected.get("key") not in (None, key):
                raise ValueError(
                    "this process is already connected to another cluster; one process "
                    f"trains in one cluster. Connected: {_connected['key']}, asked: {key}")
            if _connected.get("key") is None:
                tf.config.experimental_connect_to_cluster(
                    tf.train.ClusterSpec(spec), job_name=config.task_type,
                    task_index=config.task_index, make_master_device_default=False)
                _connected["key"] = key
        # The model computes on the worker's GPU when it has one; bookkeeping stays on its CPU.
        self.compute_device = compute_device(config.task_type, config.task_index)
        self.host_device = (f"/job:{config.task_type}/replica:0/task:{config.task_index}"
                            "/device:CPU:0")
        self.ps_devices = [ps_device(i) for i in range(self.num_ps)]
        self._ping(connect_timeout)

    def unreachable_ps(self):
        """`[(name, address)]` of the ps tasks whose server does not accept connections."""
        return [(name, address) for name, address in zip(self.ps_names, self.ps_addresses)
                if not is_listening(address)]

    def _ping(self, timeout):
        """Runs one op on every ps task, retrying while the first connections settle.

        A first remote op right after connecting can fail with "connection refused" or "reset
        by peer" while the gRPC channels come up (seen on this runtime); later ones do not.
        """
        deadline = time.monotonic() + timeout
        for name, device in zip(self.ps_names, self.ps_devices):
            while True:
                try:
                    with tf.device(device):
                        (tf.constant(1) + 1).numpy()
                    break
                except (tf.errors.UnavailableError, tf.errors.UnknownError,
                        tf.errors.InternalError) as e:
                    if time.monotonic() > deadline:
                        raise TaskUnreachableError(
                            f"{name} at {self.config.address('ps', self.ps_names.index(name))} "
                            f"did not answer ops within {timeout:g} s: {e.message}") from None
                    time.sleep(0.2)

