"""A worker's connection to the ps tasks, and where each master variable lives."""

import logging
import threading
import time

import tensorflow as tf

from tfdist._process import LastWordFuse
from tfdist._worker import compute_device
from tfdist.cluster import TaskUnreachableError
from tfdist.cluster import as_cluster_config
from tfdist.cluster import wait_for_tasks
from tfdist.cluster.liveness import Liveness
from tfdist.cluster.liveness import Target
from tfdist.cluster.probe import ANSWERED
from tfdist.cluster.probe import RESTARTED
from tfdist.cluster.probe import ProbePool
from tfdist.cluster.probe import ServerProbe
from tfdist.cluster.probe import join_prober
from tfdist.cluster.probe import probing_seconds

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
        """`[(name, address, why)]` of the ps tasks whose server does not answer an RPC within
        the probe's deadline: killed (nothing accepts connections there) or stopped (a hung
        process or machine, whose port still accepts them)."""
        probes = ProbePool(ServerProbe())
        try:
            answers = probes(list(zip(self.ps_addresses, self.ps_names)))
            return [(name, address, probes.probe.errors.get(address, ""))
                    for name, address, answer in zip(self.ps_names, self.ps_addresses, answers)
                    if answer != ANSWERED]
        finally:
            probes.close()

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



class PSWatchdog:
    """Ends a worker whose ps task stopped answering, rather than letting it hang.

    A worker's ops on a ps task have no deadline: a ps that was killed fails them at once
    (nothing accepts the connection), but one that is stopped (SIGSTOP, a hung machine:
    its port still accepts connections) leaves every one waiting for ever, the worker's
    step, its `join()`, its exit. The watchdog probes every ps task's server with an RPC
    (`tfdist.cluster.liveness`, as a ps probes its workers), and once one has not answered for
    `stall_timeout` seconds it calls `on_stall([(name, address, why)])` from its thread,
    which ends the process with an error naming the task.

    A ps task replaced by a new, empty process (restarted by hand or by its scheduler) answers
    the probe, but not in the session the probe had on the old one (`RESTARTED`): its shard,
    which this worker's run was using, is gone. The watchdog then calls
    `on_restart([(name, address, why)])` at once (the worker's next op there would fail with
    TensorFlow's bare NotFound). The probe's first session on each ps task is made in its
    first round, after the worker's hellos in all but a slow start: a ps task replaced
    between a hello and that round is not seen (the run's own check, when the chief joins,
    still is).

    Its thread cannot run while another holds Python's lock in a call that waits on the
    stopped ps (TensorFlow registers each newly traced function on the ps tasks, and waits
    for them, holding it). So each round also re-arms a `LastWordFuse`: if no round comes
    for `stall_timeout` plus two rounds' worth of probing, the fuse checks the ps tasks
    itself (their gRPC servers' HTTP/2 answer, with a deadline) and ends the process with
    the same error naming those that do not answer; while all answer, the worker is only
    busy (a long save holding Python's lock), and it waits on.

    Args:
      connection: the worker's `PSConnection`.
      stall_timeout: seconds a ps task may go without answering.
      on_stall: called once, with the tasks that stopped answering.
      on_restart: called once, with the tasks replaced by a new process (None: `on_stall`).
      interval: seconds between rounds of probes (None: a quarter of `stall_timeout`, at
        most 1).
      probe, clock: for tests (a `ServerProbe`, `time.monotonic`).
      fuse: for tests: False runs without a `LastWordFuse`.
    """

    def __init__(self, connection, stall_timeout, on_stall, on_restart=None, interval=None,
                 probe=None, clock=None, fuse=True):
        self.targets = list(zip(connection.ps_addresses, connection.ps_names))
        self.task = getattr(connection, "task_name", "this worker")
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall
        self.on_restart = on_restart or on_stall
        self.restarted = {}  # address: (name, address, why) of a ps task found replaced
        self._poll_lock = threading.Lock()
        self.interval = min(1.0, stall_timeout / 4) if interval is None else interval
        # A killed ps fails the worker's next op at once: only the stall rule counts here.
        self.liveness = Liveness(stall_timeout, probe=probe or ServerProbe(report_restarts=True),
                                 clock=clock)
        self._stopped = threading.Event()
        self._thread = None
        self._fuse = LastWordFuse() if fuse else None

    @property
    def fuse_seconds(self):
        """Seconds without a round after which the fuse ends the process: the stall
        timeout, and two rounds with probes that take their whole deadline."""
        return self.stall_timeout + 2 * (self.interval + self.liveness.probe.timeout)

    def start(self):
        self._thread = threading.Thread(target=self._watch, name="tfdist-ps-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self):
        """Stops the watchdog, and waits for its round of probes in flight (at exit, a probe
        still waiting on its RPC would abort the process: `join_prober`)."""
        self._stopped.set()
        if self._fuse is not None:
            self._fuse.disarm()
        join_prober(self._thread, self.interval + probing_seconds(
            self.liveness.probe.timeout, len(self.targets)))

    def poll(self):
        """Probes every ps task once; returns `[(name, address, why)]` of those that have not
        answered for more than `stall_timeout` (those found replaced go to `restarted`).
        The watchdog's thread and a leaving worker's may poll at once: one round at a time,
        so each reads its own round's answers (a replaced task answers `RESTARTED` once)."""
        with self._poll_lock:
            found = self.liveness.check({address: Target(address, name)
                                         for address, name in self.targets})
            for address, name in self.targets:
                if self.liveness.answers.get(address) == RESTARTED:
                    self.restarted.setdefault(
                        address, (name, address, self.liveness.probe.errors.get(address, "")))
        names = dict(self.targets)
        return [(names[dead.key], dead.key, dead.why) for dead in found]

    def replaced(self):
        """`[(name, address, why)]` of the ps tasks found replaced by a new process, after
        probing each once more (a worker whose op on one failed asks why). A ps task this
        round finds stalled is told to `on_stall` here (each is judged once)."""
        stalled = self.poll()
        if stalled and not self.restarted:
            self.on_stall(stalled)
        return list(self.restarted.values())

    def last_word(self, named=None):
        """The error the fuse writes if no round comes any more and a ps task does not answer
        its own check then (`named`: the fuse's "{silent}", which it replaces with those
        tasks; None: the tasks that did not answer the last round, all of them if every one
        did)."""
        if named is None:
            silent = [(address, name) for address, name in self.targets
                      if not self.liveness.answered_last_round(address)]
            named = " or ".join(f"{name} at {address}"
                                for address, name in silent or self.targets)
        return (f"tfdist: {named} stopped answering ({self.task}'s Python threads have not run "
                f"for {self.fuse_seconds:g} s: a TensorFlow call waiting on the ps holds "
                f"Python's lock; stall_timeout={self.stall_timeout:g} s): its shard of the "
                "master variables is gone, and no worker can train on without it. Restart "
                "the job; the chief's last checkpoint holds the model")

    def _watch(self):
        try:
            while not self._stopped.wait(self.interval):
                stalled = self.poll()
                if self._stopped.is_set():
                    break
                if self.restarted:
                    self.on_restart(list(self.restarted.values()))
                    return
                if stalled:
                    self.on_stall(stalled)
                    return
                if self._fuse is not None:
                    # It checks the ps tasks itself before it goes off: a long call
                    # holding Python's lock while every ps answers is a busy worker.
                    self._fuse.arm(self.fuse_seconds, self.last_word("{silent}"),
                                   [(name, address) for address, name in self.targets])
        finally:
            if self._fuse is not None:
                self._fuse.close()
            self.liveness.close()
