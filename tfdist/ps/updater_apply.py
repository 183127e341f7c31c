"""Applying an update of one shard: the apply step of `ShardUpdateGraph`.

`ApplyMixin` is the part of `ShardUpdateGraph` (`tfdist.ps.updater`) that applies the mean
of the pushes an update collected: the non-trainable values' mean change, then the model
average (with an outer optimizer's step, and tables averaged by the rows a round changed) or
the user's optimizer once on the mean gradient (delay-compensated for DC-ASGD, its learning
rate scaled by the update's staleness, a table's rows applied lazily or made dense). The
variables and optimizers it uses are built in `ShardUpdateGraph`.
"""

import tensorflow as tf

from tfdist.ps import protocol
from tfdist.ps.averaged_rows import averaged_rows
from tfdist.ps.policies import delay_compensated


class ApplyMixin:
    """`_apply` and the updates it is made of, for `ShardUpdateGraph`."""

    def _apply(self, state):
        """Applies the mean of the accepted pushes; returns the new global step and the rows
        of the tables averaged by rows that the update changed (`[(ids, flat values)]`).

        The non-trainable values add the mean change of the pushes (each worker's change
        since it last read them: under sync, where every worker read the same, the mean of
        the pushed values; under async each push adds its own, so concurrent workers'
        BatchNorm statistics combine instead of the last overwriting the others'); the main
        variables are updated by
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

    def _current_values(self):
        return protocol.ShardLayout.flatten([v.value for v in self.value_variables])
