"""The model push (model averaging, local SGD, DiLoCo): the worker trains its own copy with
its optimizer and pushes the model (or, compressed, its change) every `period` steps; the ps
tasks average the models, or apply an outer optimizer to the round's mean change. Tables
are averaged by the rows a round changed (`tfdist.ps.averaged_rows`). The interface it
implements, and the gradient push beside it: `tfdist.ps.push`.
"""

import logging

import numpy as np
import tensorflow as tf

from tfdist import _saved_state
from tfdist import _tf_compat
from tfdist.ps import protocol
from tfdist.ps.averaged_rows import ChangedRows
from tfdist.ps.averaged_rows import keras_variable_of
from tfdist.ps.averaged_rows import rows_exact
from tfdist.ps.outer_optimizer import OuterOptimizer
from tfdist.ps.push import Push
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import replica_step

log = logging.getLogger("tfdist")


class ModelPush(Push):
    """The model every `period` local steps, averaged on the ps tasks (or, with an outer
    optimizer, its mean change applied there by that optimizer).

    Args:
      period: local steps between averaging rounds.
      average_optimizer_state: the optimizer's slots are averaged with the model (else each
        worker keeps its own).
      outer_optimizer: the Keras config of the outer optimizer, or None.
    """

    mode = "averaging"
    log_names = ("averaging_round", "dropped_models")
    averages_rows = True

    def __init__(self, period=1, average_optimizer_state=False, outer_optimizer=None):
        super().__init__()
        self.period = period
        self.average_optimizer_state = average_optimizer_state
        self.outer = None if outer_optimizer is None else OuterOptimizer(outer_optimizer)
        if self.outer is not None:
            self._outer_on_use = _saved_state.OnUse(self.outer.attach)
        self._bases = {}  # with compression: each shard's model at the last average
        # The tables averaged by rows (`tfdist.ps.averaged_rows`), and the rows each changed.
        self.rows = ChangedRows()
        self._rates = []  # the mirror of the model's optimizer's learning rate, if a master

    def attach(self, engine):
        super().attach(engine)
        with tf.init_scope(), tf.device(engine._connection.host_device):
            self._local_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="tfdist_local_steps")
            self._round_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="tfdist_round_steps")
            self._rows_pushed = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="tfdist_table_rows_pushed")
        self.rows.host_device = engine._connection.host_device

    def variable_made(self, optimizer):
        if self.outer is not None and not self.outer.building:
            # The outer state goes with the model's optimizer once it is put to use
            # (`_saved_state.OnUse`): before a checkpoint or a backup restores it.
            self._outer_on_use.seen(optimizer)

    def role(self, kwargs, optimizer):
        if self.outer is not None and self.outer.building:
            return protocol.OPTIMIZER  # the outer optimizer's state lives on the ps tasks
        if optimizer is not None:
            name = kwargs.get("name") or ""
            if _tf_compat.keras_optimizer_makes_learning_rate(name):
                # A run-wide hyperparameter, never averaged: a master the chief's writes
                # (a callback's new rate) reach, which every worker takes each round.
                return protocol.OPTIMIZER
            shape = getattr(kwargs.get("initial_value"), "shape", kwargs.get("shape"))
            if not (self.average_optimizer_state
                    and _tf_compat.keras_optimizer_slot(optimizer, name, shape)):
                return None  # the step counter, a loss scale: each worker's own
        return (protocol.AVERAGE if tf.as_dtype(kwargs.get("dtype") or tf.float32).is_floating
                else None)

    def update(self, step, variable, args):
        arguments = _tf_compat.keras_update_step_arguments(args)
        optimizer_step = arguments is not None
        if optimizer_step and self.optimizer is None:
            self.optimizer = _tf_compat.keras_optimizer_in_scope()
            if self.optimizer is not None:
                self.check_optimizer(self.optimizer, self._strategy_name())
                if self.outer is not None:
                    self.outer.attach(self.optimizer)
        if optimizer_step:
            self.rows.track(variable, arguments[0])  # (a table averaged by rows: its rows)
        step.trained = step.trained or optimizer_step
        return True  # the worker trains its own copy

    def after_step(self):
        engine = self.engine
        if engine._clients is None:
            engine._ensure_run()
        if engine.run_finished:
            return  # nothing trains any more: no round (`join()` takes the final weights)
        count = self._local_steps.assign_add(1)
        since = self._round_steps.assign_add(1)
        with tf.control_dependencies([since]):
            tf.cond(tf.equal(count % self.period, 0), self._average, tf.no_op)

    def _average(self):
        """Pushes this worker's model (or its change), and takes the round's average."""
        engine = self.engine

        def model_part(part):
            return part.take(part.variable.read_value())

        counted = self._rows_pushed.assign(self.rows.count(), read_value=False)
        if engine._codec is None:
            done = engine._exchange(model_part)
        else:
            offsets = {}
            for shard, parts in enumerate(engine._shards):
                start = 0
                for part in parts:
                    size = int(np.prod(part.shape))
                    offsets[id(part)] = (shard, start, size)
                    start += size

            def change(part):
                shard, start, size = offsets[id(part)]
                base = self._base(shard).read_value()[start:start + size]
                return tf.reshape(tf.cast(model_part(part), tf.float32), [-1]) - base

            done = engine._exchange(change)
        with tf.control_dependencies([done, counted]):
            return tf.group(self._round_steps.assign(0), *self.rows.reset())

    def _base(self, shard):
        """With compression: the shard's model at the last average."""
        if shard not in self._bases:
            size = self.engine._layouts[shard].main_size
            with tf.init_scope(), tf.device(_tf_compat.one_device(self.engine)):
                self._bases[shard] = tf.Variable(tf.zeros([size]), trainable=False,
                                                 name="tfdist_base")
        return self._bases[shard]

    def reply_reads(self, shard):
        # The learning rate's master (the chief's last write) on ps task 0, the copy its
        # reads take, read there once the round's reply is taken: when every worker's model
        # makes a round, the chief's write before its push is seen by all. It travels in the
        # reply's pack (a scalar a round, no round trip of its own).
        if shard != 0:
            return []
        return [self.engine._clients[0].masters[rate._tfdist_path] for rate in self._rates]

    def on_reply(self, shard, values, reads):
        layout = self.engine._layouts[shard]
        updates = [self.rows.take(part, ids, rows) for part, (ids, rows) in zip(
            self.engine._row_parts[shard], layout.reply_rows(values))]
        updates += [rate.assign(value, read_value=False)
                    for rate, value in zip(self._rates, reads)]
        if self.engine._codec is not None:
            updates.append(self._base(shard).assign(values[:layout.main_size]))
        return updates

    def pushed_rows(self, shard):
        return [piece for part in self.engine._row_parts[shard]
                for piece in self.rows.pushed(part)]

    def joined(self, copy_tables):
        # A worker that joins (or rejoins) a run takes the learning rate the chief set so
        # far at once, not only after its first round (hundreds of steps with DiLoCo).
        for rate in self._rates:
            rate.assign(rate.master_value(), read_value=False)
        if copy_tables:
            self.rows.copy_masters()

    def logs(self, stats):
        logs = super().logs(stats)
        if self.rows.tables:
            logs["table_rows_pushed"] = self._rows_pushed.read_value()
        return logs

    def prepare_run(self, sparse):
        """Finds the learning rate's mirror (the workers' steps read it, each round takes
        the master's) and checks the tables averaged by rows against the optimizer
        (`_check_rows`). With an outer optimizer: builds this worker's copy of it, whose
        variables are mirrors of masters, on the variables the model's optimizer trains,
        which it marks `outer`. The rest (BatchNorm statistics, the optimizer's slots under
        `optimizer_state="averaged"`, tables averaged by rows) is averaged plainly."""
        storage = _tf_compat.keras_variable_storage
        rate = storage(_tf_compat.keras_optimizer_learning_rate(self.optimizer))
        if isinstance(rate, MirrorVariable) and rate._tfdist_role == protocol.OPTIMIZER:
            rate._tfdist_read_locally = True
            self._rates = [rate]
        self._check_rows()
        if self.outer is None:
            return {}
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        trained = [v for v in _tf_compat.keras_optimizer_trained_variables(inner)
                   if isinstance(storage(v), MirrorVariable)
                   and storage(v)._tfdist_role == protocol.AVERAGE]
        if not trained:
            raise ValueError(
                "`outer_optimizer` applies to the variables the model's Keras optimizer "
                "trains, and this train step trains none under the strategy's scope: train "
                "with `model.fit` (or `optimizer.apply`) on a model built and compiled inside "
                "`with strategy.scope():`")
        with tf.init_scope(), _tf_compat.container_strategy(self.engine).scope():
            self.outer.build(trained)
        return {id(storage(v)): {"outer": True} for v in trained}

    def _check_rows(self):
        """Each table averaged by rows must be exact so: a row its gradient does not touch
        keeps its value under the local optimizer (`rows_exact`), and no outer optimizer
        steps on the model. A table the user named (`embedding_tables=[...]`) is refused
        otherwise; one "auto" found goes back to being averaged whole, with a warning."""
        rule = self.engine._tables.rule
        if self.optimizer is None:
            return  # nothing trains: no row changes
        for variable in [t for t in self.rows.tables if t._tfdist_rows_table is t]:
            keras_variable = keras_variable_of(self.optimizer, variable)
            why = (None if keras_variable is None else
                   rows_exact(self.optimizer, keras_variable, self.average_optimizer_state))
            if why is None and self.outer is not None:
                why = ("an outer optimizer (`outer_optimizer`) steps on the round's change of "
                       "the whole model, not on rows")
            if why is None:
                continue
            if rule.embedding_tables != "auto":
                raise ValueError(
                    f"the embedding table {variable._tfdist_path} cannot be averaged by the "
                    f"rows a round changed: {why}. Leave it out of `embedding_tables` "
                    f"(or pass `embedding_tables=None`) to average it whole every round. "
                    f"Received: embedding_tables={rule.embedding_tables!r}")
            log.warning("tfdist: the embedding table %s is averaged whole every round, not by "
                        "the rows a round changed: %s (`embedding_tables`)",
                        variable._tfdist_path, why)
            for table in [t for t in self.rows.tables if t._tfdist_rows_table is variable]:
                self.rows.drop(table)
                table._tfdist_role = protocol.AVERAGE

    def split_optimizer(self):
        # Averaging is elementwise; an outer optimizer's update must be too.
        if self.outer is None:
            return None, None
        return self.outer.optimizer, "the outer optimizer is"

    def spec(self):
        return {"mode": self.mode, "optimizer": None,
                "outer_optimizer": None if self.outer is None else self.outer.config,
                "delta": self.engine._codec is not None}

    def rebuilt_optimizers(self):
        return [] if self.outer is None else [self.outer.optimizer]

    def before_leave(self):
        if not int(self._round_steps.numpy()):
            return

        # The steps since the last round make one more round (a period longer than the run
        # makes only this one).
        def last_round():
            self._average()  # a tf.function returns tensors, not the round's op

        with replica_step():
            tf.function(last_round)()
