"""The update graph of one shard: pushes in, updates applied, replies out, all in-graph.

`ShardUpdateGraph` is built on resources that are already open (the run's push queue, its
reply queues, its progress vector and master variables), on the device they live on. The
ps service opens them as shared resources on its ps task; a unit test creates them in its
own process and drives the same graph (tests/ps/updater_test.py).

One `serve_updates` call takes pushes (`collect`: N of M, dropping pushes the policy
refuses), applies their mean (`apply`: the user's optimizer once per update, or the model
average), and replies to the workers whose pushes it used, update after update, until a
control entry (a worker joins, leaves, dies; the run stops) comes out of the push queue.

This module builds the graph (the shard's Keras variables and optimizers) and holds its loop,
its replies and what it records and releases (stale synchronous parallel's clocks among
them); taking pushes is `CollectMixin`'s (`tfdist.ps.updater_collect`), applying their mean
`ApplyMixin`'s (`tfdist.ps.updater_apply`).
"""

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.ps import protocol
from tfdist.ps import shard_optimizer
from tfdist.ps import snapshot
from tfdist.ps import wire
from tfdist.ps.policies import policy_from_spec
from tfdist.ps.rowwise import RowwiseUpdate
from tfdist.ps.shard_optimizer import RunFailed
from tfdist.ps.shard_optimizer import ShardStrategy
from tfdist.ps.spec import GRADIENT
from tfdist.ps.updater_apply import ApplyMixin
from tfdist.ps.updater_collect import CollectMixin

_NO_CLOCK = 2 ** 62  # above any SSP clock


def shard_push_dtypes(layout, compressor):
    """The component dtypes of the push queue of a shard laid out as `layout`."""
    payload = (wire.compressed_push_dtypes(layout, compressor) if compressor
               else [tf.float32])
    return wire.push_dtypes(payload, layout.num_row_pairs)


class ShardUpdateGraph(CollectMixin, ApplyMixin):
    """The in-graph update loop of one shard, on already-open resources.

    Args:
      spec: the run's `ShardSpec`.
      device: the device of the resources (and of the update).
      push_queue: the run's push queue (components `shard_push_dtypes`).
      reply_queues: one reply queue per worker rank (`wire.REPLY_DTYPES`).
      progress: the run's progress vector (`protocol.num_stats` int64s).
      masters: `{path: variable}`, the shard's master variables, initialised.
      update_lock: the run's update lock (`protocol.open_update_lock`), held while an update
        is applied and recorded: a snapshot of the shard (a checkpoint) is taken between two.
      task: the ps task's name, for errors.
    """

    def __init__(self, spec, device, push_queue, reply_queues, progress, masters,
                 update_lock, task="the ps task"):
        self.spec = spec
        self.device = device
        self.push_queue = push_queue
        self.reply_queues = reply_queues
        self.progress = progress
        self.masters = masters
        self.update_lock = update_lock
        self.task = task
        self.num_workers = spec.num_workers
        self.policy = policy_from_spec(spec.policy)
        self.layout = protocol.ShardLayout(spec.variables)
        self.compressor = compression_lib.get(spec.compression)
        self.push_dtypes = shard_push_dtypes(self.layout, self.compressor)
        self._build()

    # Building --------------------------------------------------------------------------------

    def _build(self):
        """The shard's Keras variables and optimizers, and the update loop's functions."""
        self.strategy = ShardStrategy(self.device, self.masters)
        entries = self.layout.main + self.layout.values
        with self.strategy.scope():
            self.variables = []
            for e in entries:
                with _tf_compat.keras_name_scope_for_path(e.path):
                    self.variables.append(keras.Variable(
                        "zeros", shape=e.shape, dtype=e.dtype, name=e.name,
                        trainable=e.role == GRADIENT))
            for variable, e in zip(self.variables, entries):
                if e.constraint is not None:
                    variable.constraint = shard_optimizer.deserialize(
                        self.task, keras.constraints.get, e.constraint,
                        f"the constraint of {e.path}")
            self.main_variables = self.variables[:len(self.layout.main)]
            self.value_variables = self.variables[len(self.layout.main):]
            self.table_variables = []
            for e in self.layout.tables:
                with _tf_compat.keras_name_scope_for_path(e.path):
                    self.table_variables.append(keras.Variable(
                        "zeros", shape=e.shape, dtype=e.dtype, name=e.name, trainable=True))
            self.optimizer = self.outer_optimizer = None
            outer = [v for v, e in zip(self.main_variables, self.layout.main) if e.outer]
            trained = self.main_variables + self.table_variables
            entries = self.layout.main + self.layout.tables
            if (self.spec.optimizer is not None and trained) or outer:
                for module in self.spec.imports:
                    shard_optimizer.import_module(self.task, module)
            self.rowwise = None
            if self.spec.optimizer is not None and trained:
                self.optimizer = shard_optimizer.rebuild_optimizer(self.task,
                                                                   self.spec.optimizer)
                excluded = [v for v, e in zip(trained, entries) if not e.weight_decay]
                if excluded:
                    self.optimizer.exclude_from_weight_decay(var_list=excluded)
                self.optimizer.build(trained)
                shard_optimizer.check_masters(self.task, self.optimizer, self.masters)
                if self.table_variables and self.spec.table_updates == "lazy":
                    try:
                        self.rowwise = RowwiseUpdate(self.optimizer, self.table_variables)
                    except ValueError as e:
                        raise RunFailed(f"{self.task}: {e}") from None
            if outer:
                self.outer_optimizer = shard_optimizer.deserialize(
                    self.task, keras.optimizers.deserialize, self.spec.outer_optimizer,
                    f"the outer optimizer {self.spec.outer_optimizer.get('class_name')!r}")
                self.outer_optimizer.build(outer)
                shard_optimizer.check_masters(self.task, self.outer_optimizer, self.masters)
        with tf.device(self.device):
            self.clocks = tf.Variable(tf.zeros([self.num_workers], tf.int64))
            self.waiting = tf.Variable(tf.zeros([self.num_workers], tf.bool))
            # Tables averaged by rows: per row, the global step of the round that last
            # changed it (what a dropped worker missed).
            self.rows_masters = [self.masters[e.path] for e in self.layout.rows]
            self.row_versions = [tf.Variable(tf.zeros([e.shape[0]], tf.int64))
                                 for e in self.layout.rows]
            self.weights_read = None
            if self.policy.delay_compensation is not None:
                # DC-ASGD: per worker, the weights it was last sent (what it computes on).
                self.weights_read = tf.Variable(tf.zeros(
                    [self.num_workers, self.layout.main_size], tf.float32))
        # A state handed back between calls holds the tables' rows taken so far: any size.
        self.serve_updates = tf.function(self._serve_updates_fn, reduce_retracing=True)
        self.apply_now = tf.function(self._apply_fn, reduce_retracing=True)
        self.release_one = tf.function(self._release_one_fn)
        self.rejoin = tf.function(self._rejoin_fn)
        self.forget = tf.function(self._forget_fn)
        self.release_caught_up = tf.function(self._release_caught_up_fn)
        self.record_end = tf.function(self._record_end_fn)

    def start_from_optimizer_step(self):
        """A run resumed from a checkpoint counts its global step on from the restored
        optimizer step (from then on the two are apart: `_apply_gradients`)."""
        if self.optimizer is not None:
            with tf.device(self.device):
                self.progress.scatter_nd_update(
                    [[protocol.STAT_STEP]],
                    [tf.cast(self.optimizer.iterations.value, tf.int64)])

    # Replies ---------------------------------------------------------------------------------

    def _flat_values(self):
        return protocol.ShardLayout.flatten([v.value for v in self.variables])

    def _reply_values(self, rows=None):
        """A reply's values: the shard's main and state variables, then (tables averaged by
        rows) `rows`, `[(ids, flat values)]` per such table (None: no row)."""
        values = self._flat_values()
        if not self.layout.rows:
            return values
        if rows is None:
            rows = [(tf.zeros([0], tf.int64), tf.zeros([0])) for _ in self.layout.rows]
        return tf.concat([values, wire.rows_section(rows)], axis=0)

    def _step(self):
        return self.progress[protocol.STAT_STEP]

    def _send(self, rank, step, values, message="", weights=True):
        """Enqueues a reply to worker `rank` with `values` at global step `step`; with
        delay compensation, records them as the weights that worker reads (unless not
        `weights`: an error's reply, which carries none).

        `rank` is a Python int where the caller knows it (one enqueue), else a tensor (one
        branch per worker)."""
        stats = self.progress.read_value()

        def put(r):
            ops = [tf.raw_ops.QueueEnqueueV2(
                handle=self.reply_queues[r],
                components=[step, tf.constant(message), stats, values])]
            if self.weights_read is not None and weights:
                ops.append(self.weights_read.scatter_nd_update(
                    [[r]], values[None, :self.layout.main_size]))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        if isinstance(rank, int):
            return put(rank)
        return tf.switch_case(rank, [lambda r=r: put(r) for r in range(self.num_workers)])

    def _fence_if(self, fenced, rank):
        """If `fenced`: tells worker `rank` the run counts it out (an error its step raises;
        a new process of its rank that syncs skips it: `protocol.FENCED`)."""
        return tf.cond(fenced, lambda: self._send(
            rank, tf.constant(protocol.FENCED, tf.int64), tf.zeros([0]),
            message=self.fenced_message(), weights=False), lambda: tf.constant(True))

    # Record and release ----------------------------------------------------------------------

    def _record_fn(self, step, state, clock_gap=None, updated=True):
        old = self.progress.read_value()
        gap = old[protocol.STAT_CLOCK_GAP] if clock_gap is None else tf.maximum(
            old[protocol.STAT_CLOCK_GAP], clock_gap)
        return self.progress.assign(tf.concat([
            tf.stack([step, old[protocol.STAT_UPDATES] + int(updated),
                      old[protocol.STAT_DROPPED] + state["dropped"],
                      old[protocol.STAT_AGGREGATED] + tf.cast(state["accepted"], tf.int64),
                      old[protocol.STAT_STALENESS_SUM] + state["staleness_sum"],
                      tf.maximum(old[protocol.STAT_STALENESS_MAX], state["staleness_max"]),
                      gap]),
            old[protocol.STAT_HISTOGRAM:protocol.STAT_MEMBERS] + state["histogram"],
            old[protocol.STAT_MEMBERS:]], axis=0), read_value=False)

    def _record_end_fn(self, step, state):
        """The record of a run's end (pushes dropped since its last update); a `tf.function`
        returns tensors, not the assign op `_record_fn` gives its in-graph callers."""
        self._record_fn(step, state, updated=False)

    def _apply_and_release(self, state, live):
        """One update: apply, record, and reply to the workers whose pushes it used, under
        the update lock; returns the op that lets the lock go."""
        _, released = snapshot.locked(self.update_lock,
                                      lambda: self._apply_and_release_locked(state, live))
        return released

    def _apply_and_release_locked(self, state, live):
        step, rows = self._apply(state)
        if not self.policy.defers_release:
            with tf.control_dependencies([self._record_fn(step, state)]):
                values = self._reply_values(rows)
            for rank in range(self.num_workers):
                tf.cond(state["released"][rank], lambda rank=rank: self._send(rank, step, values),
                        lambda: tf.constant(True))
            return
        # Stale synchronous parallel: the worker waits until it is at most `max_staleness`
        # pushes ahead of the slowest live worker.
        rank = state["last_rank"]
        ticked = [self.clocks.scatter_nd_add([[rank]], [1]),
                  self.waiting.scatter_nd_update([[rank]], [True])]
        with tf.control_dependencies(ticked):
            self._release_caught_up_fn(live, step, state, updated=True)

    @staticmethod
    def _slowest_clock(clocks, mask):
        """The smallest clock of the workers in `mask` (`_NO_CLOCK` if none)."""
        none = tf.fill(tf.shape(clocks), tf.constant(_NO_CLOCK, tf.int64))
        return tf.reduce_min(tf.where(mask, clocks, none))

    def _release_caught_up_fn(self, live, step=None, state=None, updated=False):
        step = self._step() if step is None else step
        clocks = self.clocks.read_value()
        slowest = self._slowest_clock(clocks, live)
        gaps = clocks - slowest
        release = tf.logical_and(tf.logical_and(self.waiting.read_value(), live),
                                 gaps <= self.policy.max_staleness)
        gap = tf.reduce_max(tf.where(release, gaps, tf.zeros_like(gaps)))
        if state is None:
            state = self.empty_state()
        with tf.control_dependencies([self._record_fn(step, state, gap, updated)]):
            values = self._reply_values()
            cleared = self.waiting.assign(tf.logical_and(self.waiting.read_value(),
                                                         tf.logical_not(release)))
        with tf.control_dependencies([cleared]):
            for r in range(self.num_workers):
                tf.cond(release[r], lambda r=r: self._send(r, step, values),
                        lambda: tf.constant(True))

    # The loop and its control entries --------------------------------------------------------

    def _serve_updates_fn(self, required, live, state):
        """Update after update, in-graph, until a control entry arrives: returns
        `(state, event, rank)`, `event` the entry's tag negated."""

        def cond(state, event, rank):
            return tf.equal(event, 0)

        def body(state, event, rank):
            state, event, rank = self._collect(required, live, state)
            complete = tf.logical_and(tf.equal(event, 0), state["accepted"] >= required)

            def apply():
                with tf.control_dependencies([self._apply_and_release(state, live)]):
                    return self.empty_state()

            state = tf.cond(complete, apply, lambda: state)
            return state, event, rank

        with tf.device(self.device):
            return self._loop(cond, body, state)

    def _loop(self, cond, body, state):
        """`tf.while_loop` over `(state, event, rank)`; the tables' rows in `state` grow with
        every push taken."""
        loop = [state, tf.constant(0), tf.constant(-1)]
        invariants = tf.nest.map_structure(lambda t: t.shape, loop)
        for key in ("table_rows", "table_values"):
            invariants[0][key] = [tf.TensorShape([None]) for _ in self.layout.tables]
        for key in ("rows_ids", "rows_values"):
            invariants[0][key] = [tf.TensorShape([None]) for _ in self.layout.rows]
        return tf.while_loop(cond, body, loop, shape_invariants=invariants,
                             parallel_iterations=1)

    def _apply_fn(self, live, state):
        with tf.device(self.device):
            self._apply_and_release(state, live)

    def _release_one_fn(self, rank):
        with tf.device(self.device):
            self._send(rank, self._step(), self._reply_values(), message=protocol.SYNC_MESSAGE)

    def _rejoin_fn(self, rank, live):
        """A worker (re)joins: SSP counts it from the slowest other live worker's clock."""
        with tf.device(self.device):
            others = tf.logical_and(live, tf.logical_not(tf.one_hot(
                rank, self.num_workers, on_value=True, off_value=False)))
            slowest = self._slowest_clock(self.clocks.read_value(), others)
            clock = tf.where(slowest == _NO_CLOCK, tf.constant(0, tf.int64), slowest)
            self.clocks.scatter_nd_update([[rank]], [clock])
            self._forget_fn(rank)

    def _forget_fn(self, rank):
        """Worker `rank` left, died or rejoins: a push of it held back (stale synchronous
        parallel) is released with the fence's error (a stopped worker that wakes is told;
        a new process of the rank skips it: `protocol.FENCED`)."""
        with tf.device(self.device):
            told = self._fence_if(tf.gather(self.waiting, rank), rank)
            with tf.control_dependencies([told]):
                self.waiting.scatter_nd_update([[rank]], [False])
