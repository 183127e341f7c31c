"""The n-soft synchronous protocol of the parameter-server family (SyncReplicasOptimizer-style).

Shared resources on ps task 0, opened by every worker by shared name:

* `progress`: int64 telemetry, written by the chief's updater only: global step, gradients
  dropped, gradients aggregated, staleness sum and max, staleness histogram (`STAT_*`).
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
from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.policies import delay_compensated
from tfdist.ps.variables import open_shared_variable
from tfdist.ps.variables import wait_until_initialized

log = logging.getLogger("tfdist")

# Control entries of the gradient queue (their `step` field).
LEAVE, DEAD, ABORT, STOP = -1, -2, -3, -4
# Tokens that stop a worker; a token -(DEAD_TOKEN_BASE + r) means worker rank r died.
TOKEN_ABORTED, TOKEN_CHIEF_GONE, DEAD_TOKEN_BASE = -1, -2, 10

# Layout of the `progress` vector.
STAT_STEP, STAT_DROPPED, STAT_AGGREGATED, STAT_STALENESS_SUM, STAT_STALENESS_MAX = range(5)
STAT_HISTOGRAM = 5
NUM_STATS = STAT_HISTOGRAM + HISTOGRAM_BUCKETS

_applier = threading.local()


def in_updater():
    """True on the updater's thread, where the strategy applies updates for real."""
    return getattr(_applier, "active", False)


class SyncResources:
    """Opens the protocol's shared resources on ps task 0."""

    def __init__(self, connection, container="tfdist", compressor=None):
        self.connection = connection
        self.compressor = compressor
        # A push carries one flat float32 gradient, or a compressor's payload for it.
        self.payload_dtypes = (tuple(compressor.payload_dtypes(tf.float32)) if compressor
                               else (tf.float32,))
        self.device = connection.ps_devices[0]
        self.num_workers = connection.num_workers
        self.rank = connection.rank
        self.progress = open_shared_variable(
            self.device, "sync/progress", [NUM_STATS], tf.int64, "progress",
            container=container)
        with tf.init_scope(), tf.device(self.device):
            self.gradient_queue = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.int64, tf.int32, *self.payload_dtypes], shapes=[],
                capacity=-1, container=container, shared_name="sync/gradients")
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
                self.progress.assign(tf.zeros([NUM_STATS], tf.int64))
        else:
            wait_until_initialized(self.progress, timeout,
                                   f"the chief {self.connection.training_tasks[0]}")

    # Worker side, traced into the worker's train step --------------------------------------

    def push_and_wait(self, payload, local_step):
        """Pushes this worker's gradient payload for `local_step`, then waits for its token.

        Returns the new global step (the token); raises in-graph, with the message of a stop
        token, if the chief stopped the run.
        """
        with tf.device(self.device):
            push = tf.raw_ops.QueueEnqueueV2(
                handle=self.gradient_queue,
                components=[local_step, tf.constant(self.rank, tf.int32), *payload])
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
                            *[tf.zeros([0], dtype) for dtype in self.payload_dtypes]])

    def send_token(self, rank, value):
        with tf.init_scope(), tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.token_queues[rank],
                                      components=[tf.constant(value, tf.int64)])

    def read_progress(self):
        """The telemetry as a dict (global_step, dropped, aggregated, staleness figures)."""
        with tf.init_scope():
            return progress_dict(self.progress.numpy().tolist())


def progress_dict(values):
    aggregated = values[STAT_AGGREGATED]
    return {
        "global_step": values[STAT_STEP],
        "dropped_gradients": values[STAT_DROPPED],
        "aggregated_gradients": aggregated,
        "staleness_mean": values[STAT_STALENESS_SUM] / aggregated if aggregated else 0.0,
        "staleness_max": values[STAT_STALENESS_MAX],
        "staleness_histogram": values[STAT_HISTOGRAM:],
    }


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
        self.max_clock_gap = 0
        self.left = []
        self.dead = []
        self.error = None


class Updater:
    """The chief's updater: turns pushes into optimizer updates, as its policy says.

    Args:
      strategy: the strategy whose scope the optimizer's update runs in.
      resources: the `SyncResources`.
      optimizer: the user's Keras optimizer (built on the master variables).
      layout: the `GradientLayout` of the pushed gradients.
      policy: a `SoftSyncPolicy` or `AsyncPolicy`.
      worker_timeout: seconds without any update before the run is stopped.
      liveness_interval: seconds without an update before worker liveness is probed.
    """

    def __init__(self, strategy, resources, optimizer, layout, policy, worker_timeout,
                 liveness_interval=1.0):
        self.strategy = strategy
        self.resources = resources
        self.optimizer = optimizer
        self.layout = layout
        self.policy = policy
        self.worker_timeout = worker_timeout
        self.liveness_interval = liveness_interval
        self.num_workers = resources.num_workers
        self.stats = UpdaterStats()
        self._live = set(range(self.num_workers))
        self._last_progress = time.monotonic()
        self._stopping = threading.Event()
        self._clocks = [0] * self.num_workers
        self._waiting = set()
        self._step_now = 0
        self._weights_read = None
        if policy.delay_compensation is not None:
            # DC-ASGD keeps, per worker, the weights it was last released with.
            with tf.init_scope(), tf.device(resources.device):
                self._weights_read = tf.Variable(
                    tf.tile(self._flat_weights()[None], [self.num_workers, 1]),
                    trainable=False, name="tfdist_weights_read")
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

    def _flat_weights(self):
        return GradientLayout.flatten([v.read_value() for v in self.layout.variables])

    def _collect(self, required, state):
        """Takes gradient-queue entries until `required` usable ones or a control entry."""
        res = self.resources
        step = res.progress[STAT_STEP]

        def cond(state, event, rank):
            return tf.logical_and(state["accepted"] < required, tf.equal(event, 0))

        def body(state, event, rank):
            entry_step, entry_rank, *payload = tf.raw_ops.QueueDequeueV2(
                handle=res.gradient_queue,
                component_types=[tf.int64, tf.int32, *res.payload_dtypes])
            entry_step = tf.reshape(entry_step, [])
            entry_rank = tf.reshape(entry_rank, [])
            control = entry_step < 0
            usable = tf.logical_and(tf.logical_not(control),
                                    self.policy.accepts(entry_step, step))
            stale = tf.logical_and(tf.logical_not(control), tf.logical_not(usable))
            staleness = tf.maximum(step - entry_step, 0)
            new = dict(state)
            new["total"] = tf.cond(
                usable, lambda: state["total"] + self._decode(payload, entry_step, entry_rank),
                lambda: state["total"])
            taken = tf.cast(usable, tf.int64)
            new["accepted"] = state["accepted"] + tf.cast(usable, tf.int32)
            new["dropped"] = state["dropped"] + tf.cast(stale, tf.int64)
            new["staleness_sum"] = state["staleness_sum"] + taken * staleness
            new["staleness_max"] = tf.maximum(state["staleness_max"], taken * staleness)
            new["histogram"] = state["histogram"] + taken * tf.one_hot(
                tf.minimum(staleness, HISTOGRAM_BUCKETS - 1), HISTOGRAM_BUCKETS, dtype=tf.int64)
            new["last_rank"] = tf.where(usable, entry_rank, state["last_rank"])
            # A usable push is released after the update it joins; a stale one at once, with
            # the current step, so that its worker computes its next gradient on new weights.
            new["released"] = tf.logical_or(state["released"], tf.logical_and(
                usable, tf.cast(tf.one_hot(entry_rank, self.num_workers, dtype=tf.int32),
                                tf.bool)))
            release_stale = tf.cond(stale, lambda: self._release(entry_rank, step),
                                    lambda: tf.constant(True))
            with tf.control_dependencies([release_stale]):
                new["total"] = tf.identity(new["total"])
            return new, tf.where(control, tf.cast(-entry_step, tf.int32), 0), entry_rank

        return tf.while_loop(cond, body, [state, tf.constant(0), tf.constant(-1)],
                             parallel_iterations=1)

    def _decode(self, payload, entry_step, entry_rank):
        """A push's flat gradient (decoded on the ps device, with the key it was made with)."""
        size = self.layout.total_size
        compressor = self.resources.compressor
        if compressor is None:
            return tf.reshape(payload[0], [size])
        key = tf.stack([entry_step, tf.cast(entry_rank, tf.int64)])
        return compressor.decompress(payload, [size], tf.float32, key)

    def _release(self, rank, step):
        """Puts token `step` on worker `rank`'s queue (in-graph, `rank` a tensor)."""
        def branch(r):
            def put():
                with tf.control_dependencies([tf.raw_ops.QueueEnqueueV2(
                        handle=self.resources.token_queues[r], components=[step])]):
                    return tf.constant(True)
            return put
        return tf.switch_case(rank, [branch(r) for r in range(self.num_workers)])

    def _apply_state(self, state):
        """Applies the mean gradient with the user's optimizer, then releases the workers.

        For model averaging the mean is the new model (with a compressor: the mean change
        of the models since the last round, added to it), and the step counts rounds.
        """
        res = self.resources
        gradient = state["total"] / tf.cast(state["accepted"], tf.float32)
        if self.policy.averages_weights:
            for variable, value in zip(self.layout.variables, self.layout.unflatten(gradient)):
                if res.compressor is None:
                    variable.assign(value)
                else:
                    variable.assign_add(value)
            return self._record_and_release(state, res.progress[STAT_STEP] + 1)
        if self._weights_read is not None:
            gradient = delay_compensated(
                gradient, self._flat_weights(), self._weights_read[state["last_rank"]],
                self.policy.delay_compensation)
        _applier.active = True
        _applier.learning_rate_factor = self.policy.learning_rate_factor(
            state["staleness_sum"] // tf.maximum(tf.cast(state["accepted"], tf.int64), 1))
        try:
            self.optimizer.apply(self.layout.unflatten(gradient), self.layout.variables)
        finally:
            _applier.active = False
            _applier.learning_rate_factor = None
        return self._record_and_release(
            state, lambda: tf.cast(self.optimizer.iterations, tf.int64))

    def _record_and_release(self, state, new_step):
        """Records the update's telemetry and releases the workers whose pushes it used."""
        res = self.resources
        # Releasing a worker lets it read the weights: only after every update has landed.
        weights = self._flat_weights()
        with tf.control_dependencies([weights]):
            new_step = new_step() if callable(new_step) else tf.identity(new_step)
            old = res.progress.read_value()
            record = res.progress.assign(tf.concat([
                tf.stack([new_step, old[STAT_DROPPED] + state["dropped"],
                          old[STAT_AGGREGATED] + tf.cast(state["accepted"], tf.int64),
                          old[STAT_STALENESS_SUM] + state["staleness_sum"],
                          tf.maximum(old[STAT_STALENESS_MAX], state["staleness_max"])]),
                old[STAT_HISTOGRAM:] + state["histogram"]], axis=0))
        updates = [record]
        if self._weights_read is not None:
            updates.append(self._weights_read.scatter_nd_update(
                state["last_rank"][None, None], weights[None]))
        if self.policy.defers_release:
            # The Python loop releases workers once the slowest has caught up.
            with tf.control_dependencies(updates):
                return tf.identity(new_step)
        with tf.control_dependencies(updates):
            for rank in range(self.num_workers):
                tf.cond(state["released"][rank],
                        lambda rank=rank: tf.raw_ops.QueueEnqueueV2(
                            handle=res.token_queues[rank], components=[new_step]),
                        lambda: tf.no_op())
            return tf.identity(new_step)

    def _step_fn(self, required, state):
        """One round trip per update: collect, and apply when `required` gradients came.

        Everything runs on ps task 0 (the variables on other ps tasks are updated where they
        live); only a small summary comes back to the chief.
        """
        with tf.device(self.resources.device):
            state, event, rank = self._collect(required, state)
            complete = tf.logical_and(tf.equal(event, 0), state["accepted"] >= required)
            new_step = tf.cond(complete, lambda: self._apply_state(state),
                               lambda: tf.constant(0, tf.int64))
        with tf.device(self.resources.connection.local_device):
            summary = tf.stack([tf.cast(complete, tf.int64), tf.cast(event, tf.int64),
                                tf.cast(rank, tf.int64), tf.cast(state["accepted"], tf.int64),
                                state["dropped"], new_step])
        return state, summary

    def _apply_fn(self, state):
        with tf.device(self.resources.device):
            return self._apply_state(state)

    # Python loop ------------------------------------------------------------------------

    def _empty_state(self):
        with tf.device(self.resources.device):
            zero = tf.constant(0, tf.int64)
            return {"total": tf.zeros([self.layout.total_size]), "accepted": tf.constant(0),
                    "released": tf.zeros([self.num_workers], tf.bool), "dropped": zero,
                    "staleness_sum": zero, "staleness_max": zero,
                    "histogram": tf.zeros([HISTOGRAM_BUCKETS], tf.int64),
                    "last_rank": tf.constant(0)}

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
            required = self.policy.required(len(self._live))
            if required == 0:
                self._record_leftover_drops(state)
                log.info("tfdist: every worker left; the updater stops after %d updates",
                         self.stats.updates)
                return
            state, summary = self._step(tf.constant(required), state)
            complete, event, rank, accepted, dropped, new_step = summary.numpy().tolist()
            if complete:
                self._updated(accepted, dropped)
                state = empty
                if self.policy.defers_release:
                    self._clocks[rank] += 1
                    self._waiting.add(rank)
                    self._step_now = new_step
                    self._release_caught_up()
                continue
            if event == -LEAVE:
                self._live.discard(rank)
                self.stats.left.append(rank)
            elif event == -DEAD:
                if rank not in self._live:
                    continue
                self._live.discard(rank)
                self.stats.dead.append(rank)
                if self.policy.fails_on_dead_worker:
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
            if self.policy.defers_release:
                self._waiting -= set(self.stats.left) | set(self.stats.dead)
                self._release_caught_up()
            # Fewer workers may now be enough for the gradients already taken.
            if 0 < accepted >= self.policy.required(len(self._live)):
                self._apply(state)
                self._updated(accepted, dropped)
                state = empty

    def _record_leftover_drops(self, state):
        """Counts stale pushes that no update followed (the last ones before every worker left).

        Drops are recorded with the update that follows them; the slow worker's last pushes
        can be stale with no update after them.
        """
        dropped = int(state["dropped"].numpy())
        if dropped:
            with tf.init_scope(), tf.device(self.resources.device):
                self.resources.progress.assign_add(
                    tf.one_hot(STAT_DROPPED, NUM_STATS, dtype=tf.int64) * dropped)
            self.stats.dropped += dropped

    def _release_caught_up(self):
        """Stale synchronous parallel: release waiting workers at most s pushes ahead."""
        if not self._live:
            return
        slowest = min(self._clocks[r] for r in self._live)
        for rank in sorted(self._waiting):
            gap = self._clocks[rank] - slowest
            if gap <= self.policy.max_staleness:
                self.stats.max_clock_gap = max(self.stats.max_clock_gap, gap)
                self._waiting.discard(rank)
                self.resources.send_token(rank, self._step_now)

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


__all__ = ["SyncResources", "GradientLayout", "Updater", "ChiefWatch", "in_updater"]
