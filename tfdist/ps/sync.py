"""The n-soft synchronous protocol of the parameter-server family (SyncReplicasOptimizer-style).

Shared resources on ps task 0, opened by every worker by shared name:

* `progress`: int64 `[global_step, dropped_gradients]`, written by the chief's updater only.
* the gradient queue: one entry per push, `(step, worker_rank, flat_gradient)`; the step is
  the global step the worker read its weights at. Negative steps are control entries
  (a worker leaving, a worker found dead, an abort).
* one token queue per worker: the updater puts one token (the new global step) per push it
  consumed; a worker blocks on its own queue after pushing. Negative tokens stop a worker
  with a message (see `STOP_MESSAGES`).

The chief runs an `Updater` thread (TF1 ran the same duty as the chief's queue runner): take
entries in arrival order, keep the first `replicas_to_aggregate` fresh gradients, drop and
count stale ones, apply the user's Keras optimizer to the mean on the ps devices, advance the
global step, and release the workers whose pushes it consumed.
"""

import logging
import threading
import time

import numpy as np
import tensorflow as tf

from tfdist.cluster import is_listening
from tfdist.ps.variables import is_initialized
from tfdist.ps.variables import open_shared_variable
from tfdist.ps.variables import wait_until_initialized

log = logging.getLogger("tfdist")

# Control entries of the gradient queue (their `step` field).
LEAVE, DEAD, ABORT, STOP = -1, -2, -3, -4
# Tokens that stop a worker; a token -(DEAD_TOKEN_BASE + r) means worker rank r died.
TOKEN_ABORTED, TOKEN_CHIEF_GONE, DEAD_TOKEN_BASE = -1, -2, 10

_applier = threading.local()


def in_updater():
    """True on the updater's thread, where the strategy applies updates for real."""
    return getattr(_applier, "active", False)


class SyncResources:
    """Opens the protocol's shared resources on ps task 0."""

    def __init__(self, connection, container="tfdist"):
        self.connection = connection
        self.device = connection.ps_devices[0]
        self.num_workers = connection.num_workers
        self.rank = connection.rank
        self.progress = open_shared_variable(
            self.device, "sync/progress", [2], tf.int64, "progress", container=container)
        with tf.init_scope(), tf.device(self.device):
            self.gradient_queue = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.int64, tf.int32, tf.float32], shapes=[], capacity=-1,
                container=container, shared_name="sync/gradients")
            self.token_queues = [
                tf.raw_ops.FIFOQueueV2(component_types=[tf.int64], shapes=[], capacity=-1,
                                       container=container, shared_name=f"sync/tokens/{r}")
                for r in range(self.num_workers)]
        messages = self._stop_messages(connection)
        self.stop_messages = tf.constant(messages)
        self._num_messages = len(messages)

    @staticmethod
    def _stop_messages(connection):
        chief = connection.training_tasks[0]
        messages = [""] * (DEAD_TOKEN_BASE + connection.num_workers)
        messages[-TOKEN_ABORTED] = (
            f"tfdist: the chief {chief} stopped the run (no aggregated update within its "
            "timeout, or its updater failed); see the chief's log")
        messages[-TOKEN_CHIEF_GONE] = (
            f"tfdist: the chief {chief} at {connection.training_addresses[0]} is gone; no "
            "update can come")
        for rank, task in enumerate(connection.training_tasks):
            messages[DEAD_TOKEN_BASE + rank] = (
                f"tfdist: {task} at {connection.training_addresses[rank]} died, and with "
                "replicas_to_aggregate equal to the number of workers (hard sync) no update "
                "can be made without it")
        return messages

    def initialize(self, timeout):
        """The chief zeroes the progress counters; the others wait for it."""
        if self.connection.is_chief:
            with tf.init_scope():
                self.progress.assign(tf.zeros([2], tf.int64))
        else:
            wait_until_initialized(self.progress, timeout,
                                   f"the chief {self.connection.training_tasks[0]}")

    # Worker side, traced into the worker's train step --------------------------------------

    def push_and_wait(self, flat_gradient, local_step):
        """Pushes this worker's gradient for `local_step`, then waits for its token.

        Returns the new global step (the token); raises in-graph, with the message of a stop
        token, if the chief stopped the run.
        """
        with tf.device(self.device):
            push = tf.raw_ops.QueueEnqueueV2(
                handle=self.gradient_queue,
                components=[local_step, tf.constant(self.rank, tf.int32), flat_gradient])
            with tf.control_dependencies([push]):
                token = tf.raw_ops.QueueDequeueV2(
                    handle=self.token_queues[self.rank], component_types=[tf.int64])[0]
        message = tf.gather(self.stop_messages, tf.clip_by_value(
            -token, 0, self._num_messages - 1))
        check = tf.debugging.Assert(token >= 0, [message])
        with tf.control_dependencies([check]):
            return tf.identity(token)

    def send_control(self, kind, rank):
        """Puts a control entry (LEAVE, DEAD, ABORT, STOP) on the gradient queue."""
        with tf.init_scope(), tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(
                handle=self.gradient_queue,
                components=[tf.constant(kind, tf.int64), tf.constant(rank, tf.int32),
                            tf.zeros([0], tf.float32)])

    def send_token(self, rank, value):
        with tf.init_scope(), tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.token_queues[rank],
                                      components=[tf.constant(value, tf.int64)])

    def read_progress(self):
        with tf.init_scope():
            step, dropped = self.progress.numpy().tolist()
        return step, dropped


class GradientLayout:
    """How a worker's gradients are flattened into one float32 vector, and back."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.shapes = [v.shape for v in self.variables]
        self.dtypes = [v.dtype for v in self.variables]
        self.sizes = [int(np.prod(s)) if s.rank else 1 for s in self.shapes]
        self.total_size = int(sum(self.sizes))

    @staticmethod
    def flatten(gradients):
        parts = [tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), [-1])
                 for g in gradients]
        return tf.concat(parts, axis=0)

    def unflatten(self, flat):
        pieces = tf.split(flat, self.sizes)
        return [tf.cast(tf.reshape(p, s), d)
                for p, s, d in zip(pieces, self.shapes, self.dtypes)]


class UpdaterStats:
    """What the updater did, for logs and tests (read on the chief)."""

    def __init__(self):
        self.updates = 0
        self.aggregated = 0
        self.dropped = 0
        self.left = []
        self.dead = []
        self.error = None


class Updater:
    """The chief's updater: aggregates the first N fresh gradients of each step and applies them.

    Args:
      strategy: the strategy whose scope the optimizer's update runs in.
      resources: the `SyncResources`.
      optimizer: the user's Keras optimizer (built on the master variables).
      layout: the `GradientLayout` of the pushed gradients.
      replicas_to_aggregate: N, gradients per update.
      worker_timeout: seconds without any update before the run is stopped.
      liveness_interval: seconds without an update before worker liveness is probed.
    """

    def __init__(self, strategy, resources, optimizer, layout, replicas_to_aggregate,
                 worker_timeout, liveness_interval=1.0):
        self.strategy = strategy
        self.resources = resources
        self.optimizer = optimizer
        self.layout = layout
        self.replicas_to_aggregate = replicas_to_aggregate
        self.worker_timeout = worker_timeout
        self.liveness_interval = liveness_interval
        self.num_workers = resources.num_workers
        self.hard_sync = replicas_to_aggregate == self.num_workers
        self.stats = UpdaterStats()
        self._live = set(range(self.num_workers))
        self._last_progress = time.monotonic()
        self._stopping = threading.Event()
        self._step = tf.function(self._step_fn)
        self._apply = tf.function(self._apply_fn)
        self._thread = threading.Thread(target=self._run, name="tfdist-updater", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="tfdist-watchdog",
                                          daemon=True)

    def start(self):
        self._thread.start()
        self._watchdog.start()

    def join(self, timeout=None):
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self):
        return self._thread.is_alive()

    # In-graph parts ----------------------------------------------------------------------

    def _collect(self, required, total, accepted, released, dropped):
        """Takes gradient-queue entries until `required` fresh ones or a control entry."""
        res = self.resources
        step = res.progress[0]

        def cond(total, accepted, released, dropped, event, rank):
            return tf.logical_and(accepted < required, tf.equal(event, 0))

        def body(total, accepted, released, dropped, event, rank):
            entry_step, entry_rank, gradient = tf.raw_ops.QueueDequeueV2(
                handle=res.gradient_queue, component_types=[tf.int64, tf.int32, tf.float32])
            entry_step = tf.reshape(entry_step, [])
            entry_rank = tf.reshape(entry_rank, [])
            control = entry_step < 0
            fresh = tf.logical_and(tf.logical_not(control), entry_step >= step)
            stale = tf.logical_and(tf.logical_not(control), entry_step < step)
            total = tf.cond(
                fresh, lambda: total + tf.reshape(gradient, [self.layout.total_size]),
                lambda: total)
            # A fresh push is released after the update it joins; a stale one at once, with
            # the current step, so that its worker computes its next gradient on new weights.
            released = tf.logical_or(released, tf.logical_and(
                fresh, tf.cast(tf.one_hot(entry_rank, self.num_workers, dtype=tf.int32),
                               tf.bool)))
            release_stale = tf.cond(stale, lambda: self._release(entry_rank, step),
                                    lambda: tf.constant(True))
            with tf.control_dependencies([release_stale]):
                total = tf.identity(total)
            return (total, accepted + tf.cast(fresh, tf.int32), released,
                    dropped + tf.cast(stale, tf.int64),
                    tf.where(control, tf.cast(-entry_step, tf.int32), 0), entry_rank)

        return tf.while_loop(
            cond, body, [total, accepted, released, dropped, tf.constant(0), tf.constant(-1)],
            parallel_iterations=1)

    def _release(self, rank, step):
        """Puts token `step` on worker `rank`'s queue (in-graph, `rank` a tensor)."""
        def branch(r):
            def put():
                with tf.control_dependencies([tf.raw_ops.QueueEnqueueV2(
                        handle=self.resources.token_queues[r], components=[step])]):
                    return tf.constant(True)
            return put
        return tf.switch_case(rank, [branch(r) for r in range(self.num_workers)])

    def _apply_mean(self, total, accepted, released, dropped):
        """Applies the mean gradient with the user's optimizer, then releases the workers."""
        res = self.resources
        gradients = self.layout.unflatten(total / tf.cast(accepted, tf.float32))
        _applier.active = True
        try:
            self.optimizer.apply(gradients, self.layout.variables)
        finally:
            _applier.active = False
        # Releasing a worker lets it read the weights: only after every update has landed.
        barrier = [v.read_value() for v in self.layout.variables]
        with tf.control_dependencies(barrier):
            new_step = tf.cast(self.optimizer.iterations, tf.int64)
            old = res.progress.read_value()
            record = res.progress.assign(tf.stack([new_step, old[1] + dropped]))
        with tf.control_dependencies([record]):
            for rank in range(self.num_workers):
                tf.cond(released[rank],
                        lambda rank=rank: tf.raw_ops.QueueEnqueueV2(
                            handle=res.token_queues[rank], components=[new_step]),
                        lambda: tf.no_op())
            return tf.identity(new_step)

    def _step_fn(self, required, total, accepted, released, dropped):
        """One round trip per update: collect, and apply when `required` gradients came.

        Everything runs on ps task 0 (the variables on other ps tasks are updated where they
        live); only a small summary comes back to the chief.
        """
        with tf.device(self.resources.device):
            total, accepted, released, dropped, event, rank = self._collect(
                required, total, accepted, released, dropped)
            complete = tf.logical_and(tf.equal(event, 0), accepted >= required)
            tf.cond(complete, lambda: self._apply_mean(total, accepted, released, dropped),
                    lambda: tf.constant(0, tf.int64))
        with tf.device(self.resources.connection.local_device):
            summary = tf.stack([tf.cast(complete, tf.int64), tf.cast(event, tf.int64),
                                tf.cast(rank, tf.int64), tf.cast(accepted, tf.int64),
                                dropped])
        return (total, accepted, released, dropped), summary

    def _apply_fn(self, total, accepted, released, dropped):
        with tf.device(self.resources.device):
            return self._apply_mean(total, accepted, released, dropped)

    # Python loop ------------------------------------------------------------------------

    def _empty_state(self):
        with tf.device(self.resources.device):
            return (tf.zeros([self.layout.total_size]), tf.constant(0),
                    tf.zeros([self.num_workers], tf.bool), tf.constant(0, tf.int64))

    def _run(self):
        try:
            with self.strategy.scope():
                self._loop()
        except Exception as e:  # The workers must hear of it, or they wait forever.
            self.stats.error = e
            log.exception("tfdist: the updater failed; stopping every worker")
            self._stop_workers(TOKEN_ABORTED)

    def _updated(self, accepted, dropped):
        self.stats.updates += 1
        self.stats.aggregated += accepted
        self.stats.dropped += dropped
        self._last_progress = time.monotonic()

    def _loop(self):
        empty = self._empty_state()
        state = empty
        while True:
            required = min(self.replicas_to_aggregate, len(self._live))
            if required == 0:
                log.info("tfdist: every worker left; the updater stops after %d updates",
                         self.stats.updates)
                return
            state, summary = self._step(tf.constant(required), *state)
            complete, event, rank, accepted, dropped = summary.numpy().tolist()
            if complete:
                self._updated(accepted, dropped)
                state = empty
                continue
            if event == -LEAVE:
                self._live.discard(rank)
                self.stats.left.append(rank)
            elif event == -DEAD:
                if rank not in self._live:
                    continue
                self._live.discard(rank)
                self.stats.dead.append(rank)
                if self.hard_sync:
                    log.error("tfdist: %s died; stopping the run (hard sync)",
                              self.resources.connection.training_tasks[rank])
                    self._stop_workers(-(DEAD_TOKEN_BASE + rank))
                    return
                log.warning("tfdist: %s died; going on with %d worker(s)",
                            self.resources.connection.training_tasks[rank], len(self._live))
            elif event == -ABORT:
                log.error("tfdist: no update for %g s; stopping the run", self.worker_timeout)
                self._stop_workers(TOKEN_ABORTED)
                return
            elif event == -STOP:
                return
            # Fewer workers may now be enough for the gradients already taken.
            if 0 < accepted >= min(self.replicas_to_aggregate, len(self._live)):
                self._apply(*state)
                self._updated(accepted, dropped)
                state = empty

    def _stop_workers(self, token):
        self._stopping.set()
        for rank in range(self.num_workers):
            try:
                self.resources.send_token(rank, token)
            except tf.errors.OpError:
                pass

    def stop(self):
        """Ends the updater at once (the chief is shutting down)."""
        self._stopping.set()
        if self.running:
            self.resources.send_control(STOP, -1)

    def _watch(self):
        """Finds dead workers (their server port closed) and stalls past the timeout."""
        connection = self.resources.connection
        reported, seen = set(), {connection.rank}
        while self.running and not self._stopping.wait(0.25):
            idle = time.monotonic() - self._last_progress
            for rank in sorted(self._live - seen):
                # A worker still starting up is not dead: only one seen before can die.
                if is_listening(connection.training_addresses[rank], timeout=0.5):
                    seen.add(rank)
            if idle < self.liveness_interval:
                continue
            for rank in sorted((self._live & seen) - reported - {connection.rank}):
                if not is_listening(connection.training_addresses[rank], timeout=0.5):
                    reported.add(rank)
                    self.resources.send_control(DEAD, rank)
            if idle > self.worker_timeout:
                self.resources.send_control(ABORT, -1)
                return


class ChiefWatch:
    """On a non-chief worker: stops this worker's wait if the chief's server goes away."""

    def __init__(self, resources, interval=1.0, misses=2):
        self.resources = resources
        self.interval = interval
        self.misses = misses
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfdist-chief-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        address = self.resources.connection.training_addresses[0]
        missed = 0
        while not self._done.wait(self.interval):
            missed = 0 if is_listening(address, timeout=0.5) else missed + 1
            if missed >= self.misses:
                try:
                    self.resources.send_token(self.resources.rank, TOKEN_CHIEF_GONE)
                except tf.errors.OpError:
                    pass
                return

    def stop(self):
        self._done.set()


__all__ = ["SyncResources", "GradientLayout", "Updater", "ChiefWatch", "in_updater",
           "is_initialized"]
