"""Taking pushes towards an update of one shard: the collect step of `ShardUpdateGraph`.

`CollectMixin` is the part of `ShardUpdateGraph` (`tfdist.ps.updater`) that dequeues pushes
until an update has the N of M it needs (or a control entry arrives): the state an update
collects (`empty_state`), a push's payload decoded (compressed or not; its table rows, delay
compensated where the push carries the rows its worker read), the staleness the policy
accepts or refuses, and the reply at once to a worker whose push is dropped. The queues,
variables and policy it reads are made in `ShardUpdateGraph`.
"""

import tensorflow as tf

from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.policies import compensated_rows


class CollectMixin:
    """`empty_state`, `_collect` and the decoding of a push, for `ShardUpdateGraph`."""

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

    def fenced_message(self):
        """What a worker the run counts out is told when it pushes or syncs."""
        return (f"tfdist: {self.task}: the run counts this worker out (it was declared dead "
                "after it stopped answering for the job's stall_timeout, or it had left the "
                "run) and goes on without it: its pushes are refused. If it was declared dead, "
                "restart it: a new process says hello and rejoins the run")

    def _collect(self, required, live, state):
        """Takes pushes until `required` usable ones, or a control entry. A push of a rank
        not in `live` (a worker declared dead that woke up: a process resumed after its
        stall_timeout) is fenced: dropped, counted so, and its worker told with an error
        that ends its training."""
        step = self._step()
        main_dtypes = self.push_dtypes[2:-1]

        def cond(state, event, rank):
            return tf.logical_and(state["accepted"] < required, tf.equal(event, 0))

        def body(state, event, rank):
            tag, entry_rank, *rest = tf.raw_ops.QueueDequeueV2(
                handle=self.push_queue, component_types=self.push_dtypes)
            payload, values = rest[:len(main_dtypes)], rest[-1]
            tag, entry_rank = tf.reshape(tag, []), tf.reshape(entry_rank, [])
            control = tag < 0
            ranked = tf.logical_and(entry_rank >= 0, entry_rank < self.num_workers)
            member = tf.logical_and(ranked, tf.gather(
                live, tf.clip_by_value(entry_rank, 0, self.num_workers - 1)))
            # (A rank out of range, a forged push: dropped, nobody to tell.)
            fenced = tf.logical_and(tf.logical_and(tf.logical_not(control), ranked),
                                    tf.logical_not(member))
            pushed = tf.logical_and(tf.logical_not(control), member)
            unranked = tf.logical_and(tf.logical_not(control), tf.logical_not(ranked))
            usable = tf.logical_and(pushed, self.policy.accepts(tag, step))
            stale = tf.logical_and(pushed, tf.logical_not(usable))
            staleness = tf.maximum(step - tag, 0)
            taken = tf.cast(usable, tf.int64)
            new = dict(state)

            grown = ("table_rows", "table_values", "rows_ids", "rows_values")

            def take():
                main, tables, rows = self._decode(payload, tag, entry_rank)
                # Non-trainable state comes as the change each worker's steps made to it
                # since it last read the masters: the changes add up (frozen weights change
                # by exactly 0).
                return (state["total"] + main,
                        state["values"] + tf.reshape(values, [self.layout.value_size]),
                        *[[tf.concat([old, piece[i]], 0)
                           for old, piece in zip(state[key], pairs)]
                          for key, pairs, i in zip(grown, (tables, tables, rows, rows),
                                                   (0, 1, 0, 1))])

            (new["total"], new["values"], *grown_values) = tf.cond(
                usable, take, lambda: (state["total"], state["values"],
                                       *[state[key] for key in grown]))
            new.update(zip(grown, grown_values))
            new["accepted"] = state["accepted"] + tf.cast(usable, tf.int32)
            new["dropped"] = state["dropped"] + tf.cast(
                tf.logical_or(tf.logical_or(stale, fenced), unranked), tf.int64)
            new["staleness_sum"] = state["staleness_sum"] + taken * staleness
            new["staleness_max"] = tf.maximum(state["staleness_max"], taken * staleness)
            new["histogram"] = state["histogram"] + taken * tf.one_hot(
                tf.minimum(staleness, HISTOGRAM_BUCKETS - 1), HISTOGRAM_BUCKETS, dtype=tf.int64)
            new["last_rank"] = tf.where(usable, entry_rank, state["last_rank"])
            new["released"] = tf.logical_or(state["released"], tf.logical_and(
                usable, tf.one_hot(entry_rank, self.num_workers, on_value=True,
                                   off_value=False)))
            # A stale push is dropped and its worker sent the current weights at once
            # (of a table averaged by rows, the rows it lacks: `_rows_since`), told that
            # its push was dropped.
            sent = tf.cond(stale, lambda: self._send(entry_rank, step, self._reply_values(
                self._rows_since(tag, self._pushed_rows(payload)) if self.layout.rows
                else None), message=protocol.DROPPED_MESSAGE), lambda: tf.constant(True))
            told = self._fence_if(fenced, entry_rank)  # (at once)
            with tf.control_dependencies([sent, told]):
                new["total"] = tf.identity(new["total"])
            return new, tf.where(control, tf.cast(-tag, tf.int32), 0), entry_rank

        return self._loop(cond, body, state)
