"""The update graph of one shard: pushes in, updates applied, replies out, all in-graph.

`ShardUpdateGraph` is built on resources that are already open (the run's push queue, its
reply queues, its progress vector and master variables), on the device they live on. The
ps service opens them as shared resources on its ps task; a unit test creates them in its
own process and drives the same graph (tests/ps/updater_test.py).

One `serve_updates` call takes pushes (`collect`: N of M, dropping pushes the policy
refuses), applies their mean (`apply`: the user's optimizer once per update, or the model
average), and replies to the workers whose pushes it used, update after update, until a
control entry (a worker joins, leaves, dies; the run stops) comes out of the push queue.
"""

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.ps import protocol
from tfdist.ps import shard_optimizer
from tfdist.ps import snapshot
from tfdist.ps import wire
from tfdist.ps.averaged_rows import averaged_rows
from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.policies import compensated_rows
from tfdist.ps.policies import delay_compensated
from tfdist.ps.policies import policy_from_spec
from tfdist.ps.rowwise import RowwiseUpdate
from tfdist.ps.shard_optimizer import RunFailed
from tfdist.ps.shard_optimizer import ShardStrategy
from tfdist.ps.spec import GRADIENT

_NO_CLOCK = 2 ** 62  # above any SSP clock


def shard_push_dtypes(layout, compressor):
    """The component dtypes of the push queue of a shard laid out as `layout`."""
    payload = (wire.compressed_push_dtypes(layout, compressor) if compressor
               else [tf.float32])
    return wire.push_dtypes(payload, layout.num_row_pairs)


class ShardUpdateGraph:
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

    # State of an update being collected ------------------------------------------------------

    def empty_state(self):
        """What `collect` has taken towards the next update: nothing yet."""
        zero = tf.constant(0, tf.int64)
        return {"total": tf.zeros([self.layout.main_size]),
                "values": tf.zeros([self.layout.value_size]),
                "accepted": tf.constant(0), "dropped": zero,
                "released": tf.zeros([self.num_workers], tf.bool),
                "staleness_sum": zero, "staleness_max": zero,
                "histogram": tf.zeros([HISTOGRAM_BUCKETS], tf.int64),
                "last_rank": tf.constant(0),
                # Each table's pushed rows and their flat values, every accepted push's.
                "table_rows": [tf.zeros([0], tf.int64) for _ in self.layout.tables],
                "table_values": [tf.zeros([0], tf.float32) for _ in self.layout.tables],
                # Each table averaged by rows: the rows and values every accepted push
                # carries.
                "rows_ids": [tf.zeros([0], tf.int64) for _ in self.layout.rows],
                "rows_values": [tf.zeros([0], tf.float32) for _ in self.layout.rows]}

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

    def _rows_since(self, tag, pushed):
        """What a worker whose push (its rows `pushed`) was computed at global step `tag`
        and dropped must take of each table averaged by rows: every row changed since, and
        every row it changed itself, with their master values."""
        out = []
        for master, versions, (ids, _) in zip(self.rows_masters, self.row_versions, pushed):
            changed = tf.reshape(tf.where(versions > tag), [-1])
            rows, _ = tf.unique(tf.concat([changed, ids], axis=0))
            out.append((rows, tf.reshape(tf.cast(tf.gather(master, rows), tf.float32), [-1])))
        return out

    def _current_values(self):
        return protocol.ShardLayout.flatten([v.value for v in self.value_variables])

    def _step(self):
        return self.progress[protocol.STAT_STEP]

    def _pairs(self, payload):
        """`(main payload, [(rows, flat row values)])` of a push: the pairs follow the
        main payload (one vector, or a compressor's codes)."""
        coded = (1 if self.compressor is None
                 else len(wire.compressed_push_dtypes(self.layout, self.compressor)))
        return payload[:coded], list(zip(payload[coded::2], payload[coded + 1::2]))

    def _pushed_rows(self, payload):
        """The pairs of a push's tables averaged by rows (its last pairs)."""
        _, pairs = self._pairs(payload)
        return pairs[len(pairs) - len(self.layout.rows):]

    def _decode(self, payload, tag, rank):
        """`(main vector, [(rows, flat row values)] of each table, [the same of each table
        averaged by rows])` of a push's payload (a table's rows delay-compensated where the
        push carries the rows its worker read)."""
        main, pairs = self._pairs(payload)
        if self.compressor is None:
            sparse = len(self.layout.sparse)
            main, pairs = self.layout.densify(main[0], pairs[:sparse]), pairs[sparse:]
        else:
            main = wire.decode_push(self.layout, self.compressor, main,
                                    wire.push_key(tag, rank, self.spec.shard,
                                                  self.num_workers))
        rows = pairs[len(pairs) - len(self.layout.rows):]
        tables, pairs = [], iter(pairs)
        for variable, entry in zip(self.table_variables, self.layout.tables):
            gradient = next(pairs)
            if entry.read_rows:
                gradient = compensated_rows(variable, entry, gradient, next(pairs),
                                            self.policy.delay_compensation)
            tables.append(gradient)
        return main, tables, rows

    def _send(self, rank, step, values, message=""):
        """Enqueues a reply to worker `rank` with `values` at global step `step`; with
        delay compensation, records them as the weights that worker reads.

        `rank` is a Python int where the caller knows it (one enqueue), else a tensor (one
        branch per worker)."""
        stats = self.progress.read_value()

        def put(r):
            ops = [tf.raw_ops.QueueEnqueueV2(
                handle=self.reply_queues[r],
                components=[step, tf.constant(message), stats, values])]
            if self.weights_read is not None:
                ops.append(self.weights_read.scatter_nd_update(
                    [[r]], values[None, :self.layout.main_size]))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        if isinstance(rank, int):
            return put(rank)
        return tf.switch_case(rank, [lambda r=r: put(r) for r in range(self.num_workers)])

    # Collect ---------------------------------------------------------------------------------

    def _collect(self, required, state):
        """Takes pushes until `required` usable ones, or a control entry."""
        step = self._step()
        main_dtypes = self.push_dtypes[2:-1]
        # State values are summed as changes from the masters: pushes that all carry the
        # master's value (frozen weights) leave it exactly as it is, step after step.
        current = self._current_values()

        def cond(state, event, rank):
            return tf.logical_and(state["accepted"] < required, tf.equal(event, 0))

        def body(state, event, rank):
            tag, entry_rank, *rest = tf.raw_ops.QueueDequeueV2(
                handle=self.push_queue, component_types=self.push_dtypes)
            payload, values = rest[:len(main_dtypes)], rest[-1]
            tag, entry_rank = tf.reshape(tag, []), tf.reshape(entry_rank, [])
            control = tag < 0
            usable = tf.logical_and(tf.logical_not(control), self.policy.accepts(tag, step))
            stale = tf.logical_and(tf.logical_not(control), tf.logical_not(usable))
            staleness = tf.maximum(step - tag, 0)
            taken = tf.cast(usable, tf.int64)
            new = dict(state)

            grown = ("table_rows", "table_values", "rows_ids", "rows_values")

            def take():
                main, tables, rows = self._decode(payload, tag, entry_rank)
                return (state["total"] + main,
                        state["values"] + tf.reshape(values, [self.layout.value_size])
                        - current,
                        *[[tf.concat([old, piece[i]], 0)
                           for old, piece in zip(state[key], pairs)]
                          for key, pairs, i in zip(grown, (tables, tables, rows, rows),
                                                   (0, 1, 0, 1))])

            (new["total"], new["values"], *grown_values) = tf.cond(
                usable, take, lambda: (state["total"], state["values"],
                                       *[state[key] for key in grown]))
            new.update(zip(grown, grown_values))
            new["accepted"] = state["accepted"] + tf.cast(usable, tf.int32)
            new["dropped"] = state["dropped"] + tf.cast(stale, tf.int64)
            new["staleness_sum"] = state["staleness_sum"] + taken * staleness
            new["staleness_max"] = tf.maximum(state["staleness_max"], taken * staleness)
            new["histogram"] = state["histogram"] + taken * tf.one_hot(
                tf.minimum(staleness, HISTOGRAM_BUCKETS - 1), HISTOGRAM_BUCKETS, dtype=tf.int64)
            new["last_rank"] = tf.where(usable, entry_rank, state["last_rank"])
            new["released"] = tf.logical_or(state["released"], tf.logical_and(
                usable, tf.one_hot(entry_rank, self.num_workers, on_value=True,
                                   off_value=False)))
            # A stale push is dropped and its worker sent the current weights at once
            # (of a table averaged by rows, the rows it lacks: `_rows_since`).
            sent = tf.cond(stale, lambda: self._send(entry_rank, step, self._reply_values(
                self._rows_since(tag, self._pushed_rows(payload)) if self.layout.rows
                else None)), lambda: tf.constant(True))
            with tf.control_dependencies([sent]):
                new["total"] = tf.identity(new["total"])
            return new, tf.where(control, tf.cast(-tag, tf.int32), 0), entry_rank

        return self._loop(cond, body, state)

    # Apply -----------------------------------------------------------------------------------

    def _apply(self, state):
        """Applies the mean of the accepted pushes; returns the new global step and the rows
        of the tables averaged by rows that the update changed (`[(ids, flat values)]`).

        The non-trainable values take their mean; the main variables are updated by
        `_apply_average` (model averaging) or `_apply_gradients` (the optimizer, once). Each
        takes the mean main vector, the collected state and the updates to order after; an
        update of other entries (rows of a table kept on the ps: gather, apply, scatter) is
        one more such method over its entries.
        """
        count = tf.cast(state["accepted"], tf.float32)
        updates = []
        if self.layout.value_size:
            values = self.layout.unflatten(self._current_values() + state["values"] / count,
                                           self.layout.values, self.layout.value_sizes)
            updates += [v.assign(x) for v, x in zip(self.value_variables, values)]
        if not self.policy.averages_weights:
            return self._apply_gradients(state["total"] / count, state, updates), None
        return self._apply_average(state["total"] / count, state, updates)

    def _apply_average(self, mean, state, updates):
        """Model averaging: each variable takes the mean model (or adds the mean change); an
        outer optimizer steps on the round's outer gradient, master - mean. A table averaged
        by rows averages the rows pushed (`averaged_rows`); returns `(step, those rows)`."""
        step = self._step() + 1
        rows = []
        for master, versions, entry, ids, flat in zip(
                self.rows_masters, self.row_versions, self.layout.rows, state["rows_ids"],
                state["rows_values"]):
            changed, averaged = averaged_rows(ids, flat, master, state["accepted"])
            updates += [master.scatter_update(tf.IndexedSlices(
                            tf.cast(tf.reshape(averaged, [-1, *entry.shape[1:]]), master.dtype),
                            changed)),
                        versions.scatter_update(tf.IndexedSlices(
                            tf.fill(tf.shape(changed), step), changed))]
            rows.append((changed, averaged))
        parts = self.layout.unflatten(mean, self.layout.main, self.layout.main_sizes)
        outer_gradients, outer_variables = [], []
        for variable, part, entry in zip(self.main_variables, parts, self.layout.main):
            if entry.outer:
                # A compressed round's `part` is the mean change: its negation.
                outer_gradients.append(-part if self.spec.delta else variable.value - part)
                outer_variables.append(variable)
            else:
                updates.append(variable.assign_add(part) if self.spec.delta
                               else variable.assign(part))
        if outer_variables:
            with tf.control_dependencies(updates):
                self.outer_optimizer.apply(outer_gradients, outer_variables)
            updates.append(self.outer_optimizer.iterations.value)
        with tf.control_dependencies(updates):
            return tf.identity(step), rows

    def _apply_gradients(self, mean, state, updates):
        """The user's optimizer applied once to the mean gradient (delay-compensated for
        the worker of the last push, its learning rate scaled by the update's staleness).

        Returns the new global step: the updater's own count, one more per update. The
        optimizer's `iterations` is what Keras and the user see (a schedule's step, what a
        checkpoint holds), and the chief's `load_weights` may set it back; the global step
        tags pushes and measures their staleness, so it never goes back."""
        if self.weights_read is not None:
            mean = delay_compensated(
                mean, protocol.ShardLayout.flatten([v.value for v in self.main_variables]),
                self.weights_read[state["last_rank"]], self.policy.delay_compensation)
        parts = self.layout.unflatten(mean, self.layout.main, self.layout.main_sizes)
        if self.optimizer is None:  # a shard with no trained variable: state only
            with tf.control_dependencies(updates):
                return self._step() + 1
        extended = self.strategy.extended
        factor = self.policy.learning_rate_factor(
            state["staleness_sum"] // tf.maximum(tf.cast(state["accepted"], tf.int64), 1))
        extended.learning_rate_factor = factor
        try:
            with tf.control_dependencies(updates):
                # A table's rows step first: at the step count the apply below then counts.
                rows, dense = self._apply_table_rows(state, factor)
            gradients, variables = parts + [g for g, _ in dense], \
                self.main_variables + [v for _, v in dense]
            with tf.control_dependencies(updates + rows):
                if variables:
                    self.optimizer.apply(gradients, variables)
                else:  # only tables, updated by rows: the update is counted all the same
                    self.optimizer.iterations.assign_add(1)
        finally:
            extended.learning_rate_factor = None
        with tf.control_dependencies([self.optimizer.iterations.value]):
            return self._step() + 1

    def _apply_table_rows(self, state, factor):
        """`(ops, [(dense gradient, table)])`: each table's mean gradient rows applied lazily
        (`tfdist.ps.rowwise`), or made dense for the optimizer's own apply
        (`table_updates="dense"`)."""
        count = tf.cast(state["accepted"], tf.float32)
        ops, dense = [], []
        for variable, entry, rows, flat in zip(self.table_variables, self.layout.tables,
                                               state["table_rows"], state["table_values"]):
            values = tf.reshape(flat, [-1, *entry.shape[1:]]) / count
            if self.rowwise is not None:
                ops.append(self.rowwise.apply(variable, rows, values, factor))
            else:
                dense.append((tf.scatter_nd(rows[:, None], values, entry.shape), variable))
        return ops, dense

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
            state, event, rank = self._collect(required, state)
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
        with tf.device(self.device):
            self.waiting.scatter_nd_update([[rank]], [False])
