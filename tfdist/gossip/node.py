"""A Stochastic Gradient Push worker's side of the wire: its server, queues, courier, watcher.

The worker's TF server is started through its own eager context, knowing only its own task
(as a ps task's is, `tfdist.launch.server`): it hosts the worker's `outbox` and one `inbox` per
peer, and peers' couriers enqueue there. Its courier (`tfdist.gossip.courier`) is a child
process that forwards the outbox. A watcher thread probes the peers at once
(`tfdist.cluster.liveness`): one that has refused connections for `peer_timeout` seconds, or
not answered an RPC for `stall_timeout` (or a dead courier), is reported with a `DEAD`
message in every inbox, so that a step or a `join` waiting for a message fails with the
peer's name instead of waiting for ever.
"""

import functools
import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist._process import die_with
from tfdist._worker import compute_device
from tfdist.cluster import pick_free_ports
from tfdist.cluster import wait_for_tasks
from tfdist.cluster.liveness import Liveness
from tfdist.cluster.liveness import Target
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT
from tfdist.cluster.probe import ANSWERED
from tfdist.cluster.probe import PROBE_TIMEOUT
from tfdist.cluster.probe import ServerProbe
from tfdist.cluster.probe import join_prober
from tfdist.cluster.probe import probing_seconds
from tfdist.gossip import protocol

log = logging.getLogger("tfdist")

_started = []  # one node per process: a process has one eager context and one server


class PeerError(RuntimeError):
    """A peer stopped answering, or sent what has no place where it came."""


class GossipNode:
    """This worker's server, queues and courier.

    Args:
      config: the cluster's `ClusterConfig` (this task a chief or worker).
      connect_timeout: seconds the peers get to start listening.
      peer_timeout: seconds a peer may refuse connections before it is taken for dead.
      inter_op_threads: inter-op threads of this worker's TF executor, besides the one its
        courier's waiting dequeue holds.
      stall_timeout: seconds a peer whose port accepts connections may go without answering
        an RPC (`tfdist.cluster.probe.ServerProbe`) before it is taken for dead: a stopped
        process, a hung machine.
    """

    def __init__(self, config, connect_timeout, peer_timeout, inter_op_threads,
                 stall_timeout=DEFAULT_STALL_TIMEOUT):
        if _started:
            raise ValueError("this process already runs a StochasticGradientPushStrategy: a "
                             "process has one TF server, and trains in one SGP run")
        self.config = config
        self.rank = config.worker_rank
        self.is_chief = config.is_chief
        tasks = config.training_tasks
        self.num_workers = len(tasks)
        self.names = [f"/job:{job}/task:{i}" for job, i in tasks]
        self.addresses = [config.address(job, i) for job, i in tasks]
        self.task_name = self.names[self.rank]
        self.host_device = protocol.task_device(tasks[self.rank])
        self.compute_device = compute_device(config.task_type, config.task_index)
        self.peer_timeout = peer_timeout
        self.stall_timeout = stall_timeout
        self._why = {}  # rank -> why it was taken for dead
        self._start_server(inter_op_threads)
        _started.append(self)
        # The courier's own server port: it only connects out (to the peers' ports), nothing
        # connects to it, so no firewall rule needs it (tests/strategies/sgp_test.py checks).
        self.courier_port = port = pick_free_ports(1)[0]
        spec = {"tf_config": config.to_dict(), "port": port, "connect_timeout": connect_timeout}
        env = dict(os.environ, TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE="False")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.courier = subprocess.Popen(
            [sys.executable, "-m", "tfdist.gossip.courier", json.dumps(spec)], env=env,
            preexec_fn=functools.partial(die_with, os.getpid()))
        self.outbox = protocol.outbox_queue(self.host_device)
        wait_for_tasks({n: a for r, (n, a) in enumerate(zip(self.names, self.addresses))
                        if r != self.rank}, timeout=connect_timeout)
        self.size = None
        self.inboxes = None
        self.expected = set(range(self.num_workers)) - {self.rank}  # peers watched
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.reported = None  # the rank reported dead, if any
        self._watcher = None

    def _start_server(self, threads):
        config = self.config
        try:
            tf.config.threading.set_inter_op_parallelism_threads(threads + 1)
        except RuntimeError:
            log.info("tfdist: TensorFlow already started; inter_op_threads=%s not applied",
                     threads)
        spec = tf.train.ClusterSpec({config.task_type: {config.task_index:
                                                        config.task_address}})
        tf.config.experimental_connect_to_cluster(
            spec, job_name=config.task_type, task_index=config.task_index,
            protocol=config.rpc_layer or "grpc", make_master_device_default=False)
        _tf_compat.start_eager_context()

    # Queues ----------------------------------------------------------------------------

    def open_inboxes(self, size):
        """Creates the inboxes for messages of `size` floats; starts the watcher."""
        if self.size is not None:
            if size != self.size:
                raise ValueError(f"the gossiped variables changed size ({self.size - protocol.HEAD}"
                                 f" -> {size - protocol.HEAD} values): every step of a run "
                                 "must train the same variables")
            return
        with tf.init_scope():
            self.inboxes = {s: protocol.inbox_queue(self.host_device, s, size)
                            for s in range(self.num_workers) if s != self.rank}
            self.plans = {s: protocol.plan_queue(self.host_device, s) for s in self.inboxes}
        self.size = size
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="sgp-watcher")
        self._watcher.start()

    def send(self, peers, message):
        """Puts `(peers, message)` in the outbox (in-graph or eagerly)."""
        with tf.device(self.host_device):
            return tf.raw_ops.QueueEnqueueV2(handle=self.outbox,
                                             components=[tf.cast(peers, tf.int32), message])

    def send_plan(self, kind, value, peers):
        """Sends a plan (`tfdist.gossip.plans`) to every peer (eagerly); returns the bytes
        it puts on the network (the plan to each of them)."""
        others = [protocol.PLAN] + [r for r in range(self.num_workers) if r != self.rank]
        with tf.init_scope():
            plan = protocol.pack_plan(kind, value, peers)
            self.send(tf.constant(others), plan)
        return 4 * int(plan.shape[0]) * (len(others) - 1)

    def take_plan(self, sender):
        """The next plan from `sender` (eagerly, waiting for it): `(kind, value, peers)`."""
        with tf.init_scope(), tf.device(self.host_device):
            plan = tf.raw_ops.QueueDequeueV2(handle=self.plans[sender],
                                             component_types=[tf.float32])[0]
        return protocol.unpack_plan(plan)

    def take(self, needed, greedy, skip):
        """Takes, from each sender s, `needed[s]` messages (waiting for them), and with
        `greedy` also every message already there; nothing from a sender whose `skip[s]`.
        In-graph.

        Returns `(messages [n, L], senders [n], waited)`: `waited` is True when a message
        had not arrived yet.
        """
        parts, senders, waited = [], [], []
        with tf.device(self.host_device):
            for sender, queue in self.inboxes.items():
                need = needed[sender]
                size = tf.cast(tf.raw_ops.QueueSizeV2(handle=queue), tf.int64)
                count = tf.maximum(need, size) if greedy else need
                count = tf.where(skip[sender], tf.constant(0, tf.int64), count)
                waited.append(count > size)
                messages = tf.raw_ops.QueueDequeueManyV2(
                    handle=queue, n=tf.cast(count, tf.int32), component_types=[tf.float32])[0]
                parts.append(messages)
                senders.append(tf.fill([count], tf.constant(sender, tf.int64)))
            any_waited = tf.reduce_any(tf.stack(waited))
            return tf.concat(parts, 0), tf.concat(senders, 0), any_waited

    def take_one(self, sender):
        """The next message from `sender` (eagerly, waiting for it): `(tag, info, w, x)`."""
        with tf.init_scope(), tf.device(self.host_device):
            message = tf.raw_ops.QueueDequeueV2(handle=self.inboxes[sender],
                                                component_types=[tf.float32])[0]
            tags, _, infos, weights, values = protocol.unpack(message[None])
        return int(tags[0]), int(infos[0]), weights[0], values[0]

    def available(self, sender):
        with tf.init_scope(), tf.device(self.host_device):
            return int(tf.raw_ops.QueueSizeV2(handle=self.inboxes[sender]))

    # Peers' liveness ---------------------------------------------------------------------

    def dead_message(self, dead):
        """What a step or `join` says when `dead` (a rank, or `num_workers`: the courier)
        stopped answering."""
        if dead == self.num_workers:
            return (f"tfdist: the courier of {self.task_name} (the process that carries its "
                    "messages to its peers) exited; Stochastic Gradient Push cannot go on")
        why = self._why.get(dead)
        return (f"tfdist: {self.names[dead]} at {self.addresses[dead]} stopped answering"
                f"{f' ({why})' if why else ''}: its messages cannot reach {self.task_name}, "
                "and Stochastic Gradient Push cannot go on without them. Restart the job")

    def done_with(self, sender):
        """Stops watching `sender`: every message it will send here has been taken."""
        with self._lock:
            self.expected.discard(sender)

    @property
    def _probe_timeout(self):
        """Seconds one probe of a peer waits: never longer than a stall may last."""
        return min(PROBE_TIMEOUT, self.stall_timeout)

    def _watch(self):
        """Every half second: the courier is alive, and each peer whose messages this worker
        still waits for answers an RPC (all probed at once, `tfdist.cluster.liveness`). One
        that refuses connections for `peer_timeout`, or accepts them but does not answer for
        `stall_timeout`, is reported dead."""
        liveness = Liveness(self.stall_timeout, gone_timeout=self.peer_timeout,
                            probe=ServerProbe(timeout=self._probe_timeout))
        try:
            while not self._stop.wait(0.5):
                if self.courier.poll() is not None:
                    self._report(self._blame_for_courier(liveness.probe))
                    return
                with self._lock:
                    peers = sorted(self.expected)
                found = liveness.check({peer: Target(self.addresses[peer], self.names[peer])
                                        for peer in peers})
                with self._lock:
                    found = [dead for dead in found if dead.key in self.expected]
                if found:
                    self._why[found[0].key] = found[0].why
                    self._report(found[0].key)
                    return
        finally:
            liveness.close()

    def _blame_for_courier(self, probe):
        """Who to name when the courier exited: a peer it was to reach whose server does not
        answer an RPC (`probe`, a `ServerProbe`: gone, or stopped with its port open; the
        courier fails, or never connects, when a peer dies or hangs under it: the user must
        be sent to that peer's machine), else the courier itself (`num_workers`)."""
        with self._lock:
            peers = sorted(self.expected)
        for peer in peers:
            # Asked twice: a peer that does not answer once may have been busy.
            if not any(probe(self.addresses[peer], self.names[peer]) == ANSWERED
                       for _ in range(2)):
                self._why[peer] = probe.errors.get(self.addresses[peer])
                return peer
        return self.num_workers

    def _report(self, dead):
        self.reported = dead
        log.error("%s", self.dead_message(dead))
        poison = protocol.control(protocol.DEAD, self.rank, dead, self.size)
        plan = protocol.pack_plan(protocol.PLAN_DEAD, dead, [])
        for sender, queue in self.inboxes.items():
            with tf.device(self.host_device):
                tf.raw_ops.QueueEnqueueV2(handle=queue, components=[poison])
                tf.raw_ops.QueueEnqueueV2(handle=self.plans[sender], components=[plan])

    # Ending ------------------------------------------------------------------------------

    def stop(self, timeout=60.0):
        """Stops the watcher (waiting for its round of probes in flight: `join_prober`), then
        lets the courier deliver what is in the outbox and exit."""
        self._stop.set()
        # A round probes each peer (twice when the courier exited), one after the other at
        # worst, after its half-second wait.
        join_prober(self._watcher, 0.5 + 2 * probing_seconds(self._probe_timeout,
                                                             self.num_workers))
        if self.courier.poll() is None:
            try:
                with tf.init_scope():
                    self.send(tf.constant([protocol.STOP]), tf.zeros([protocol.HEAD]))
                self.courier.wait(timeout)
            except (tf.errors.OpError, subprocess.TimeoutExpired):
                log.warning("tfdist: the courier of %s did not finish within %g s",
                            self.task_name, timeout)
                self.courier.kill()


def sum_in_rank_order(values):
    """`sum(values)` in float64, in the order given: the same bits on every worker."""
    return np.sum(np.stack([np.asarray(v, np.float64) for v in values]), axis=0)

