"""What a parameter-server worker's step sends its ps tasks: one interface, two pushes.

`GradientPush` (soft sync, async): a worker's optimizer step is the ps's job; the gradients
of the step are recorded and pushed, and the ps tasks apply the user's optimizer to them.
`ModelPush` (model averaging, local SGD, DiLoCo): the worker trains its own copy with its
optimizer and pushes the model (or, compressed, its change) every `period` steps; the ps tasks
average the models, or apply an outer optimizer to the round's mean change.

The engine (`tfdist.ps.worker.ParameterServerExtended`) runs the run (joining it, placement,
the mirrors, the exchange with every ps task, leaving) and asks its push every question whose
answer depends on what is pushed: the role of a new variable, what an optimizer update of a
step does, what the step exchanges, the spec's fields, the logs.
"""

import abc
import logging

import keras
import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.compression import sparsify
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps.averaged_rows import ChangedRows
from tfdist.ps.averaged_rows import keras_variable_of
from tfdist.ps.averaged_rows import rows_exact
from tfdist.ps.outer_optimizer import OuterOptimizer
from tfdist.ps.rowwise import ROWWISE_OPTIMIZERS
from tfdist.ps.rowwise import rowwise_optimizer
from tfdist.ps.tables import TableVariable
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import replica_step

log = logging.getLogger("tfdist")


class Push(abc.ABC):
    """The part of a parameter-server worker that depends on what its steps push.

    `attach` gives it its engine (and makes its state); the engine then calls the rest.
    """

    mode = None       # the spec's name for it (the ps tasks' updater reads it)
    log_names = ()    # (the step counter's, the dropped pushes') names in the Keras logs
    keeps_tables = False  # embedding tables may live on the ps tasks only (`ps.tables`)
    averages_rows = False  # embedding tables stay on the workers, averaged by rows

    def __init__(self):
        self.engine = None
        self.optimizer = None  # the run's Keras optimizer, once a train step has shown it

    def attach(self, engine):
        self.engine = engine

    def check_optimizer(self, optimizer, strategy_name):
        """Refuses the optimizer features the engine cannot give their meaning."""
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if getattr(inner, "use_ema", False):
            raise ValueError(
                "`use_ema=True` is not supported by the tfdist parameter-server strategies: at "
                "the end of `fit` Keras would write one worker's moving average into the shared "
                "weights the others train. Compile with `use_ema=False`, and keep an average of "
                "the weights in a callback on the chief if you need one")

    @abc.abstractmethod
    def role(self, kwargs, optimizer):
        """The role (`protocol`) of a new variable made with `kwargs` by `optimizer` (a
        Keras optimizer or None); None keeps it local to this worker."""

    @abc.abstractmethod
    def update(self, step, variable, args):
        """An update of `variable` inside a step (`args`: an optimizer's update step's when
        `_tf_compat.keras_update_step_arguments` finds its gradient in them); returns whether
        it runs on this worker."""

    def after_step(self):
        """After the outermost replica call of a step that trained (by default, nothing:
        the step's push is done)."""
        return None

    def prepare_run(self, sparse):
        """When the worker joins the run: `{id(mirror): spec entry fields}` the push adds
        (`sparse`: the ids of the mirrors whose gradient came as rows)."""
        return {}

    def split_optimizer(self):
        """`(optimizer, words)`: the optimizer whose update must be elementwise for a
        variable split over ps tasks to be exact (None: any split is), and how to name it."""
        return None, None

    @abc.abstractmethod
    def spec(self):
        """The spec's fields of this push: `mode`, the `optimizer` and `outer_optimizer`
        configs the ps tasks rebuild, `delta` (pushes are changes since the last average)."""

    def rebuilt_optimizers(self):
        """The optimizers the ps tasks rebuild (they import a custom one's module)."""
        return []

    def on_reply(self, shard, values):
        """Updates to run when `shard`'s reply (its flat values) lands."""
        return []

    def pushed_rows(self, shard):
        """The `(ids, flat values)` pairs a push to `shard` carries last (tables averaged
        by rows)."""
        return []

    def joined(self, copy_tables):
        """Eagerly, once the worker took the masters' values (`copy_tables`: a run this
        worker did not just initialise)."""
        return None

    def before_leave(self):
        """What this worker pushes before it leaves the run (by default, nothing: each
        step pushed its own)."""
        return None

    def logs(self, stats):
        step, dropped = self.log_names
        return {step: stats[protocol.STAT_STEP], dropped: stats[protocol.STAT_DROPPED]}

    def _strategy_name(self):
        return type(_tf_compat.container_strategy(self.engine)).__name__


class GradientPush(Push):
    """A push per step: the step's gradients, applied on the ps tasks by the user's optimizer
    (its state lives there)."""

    mode = "gradients"
    log_names = ("global_step", "dropped_gradients")
    keeps_tables = True

    def check_optimizer(self, optimizer, strategy_name):
        super().check_optimizer(optimizer, strategy_name)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps and steps > 1:
            raise ValueError(
                f"`gradient_accumulation_steps={steps}` is not supported by "
                f"{strategy_name}: each push is one update on the ps. For a larger "
                "effective batch use a larger batch per worker, or aggregate more workers per "
                "update (`replicas_to_aggregate`)")
        iterations = _tf_compat.keras_optimizer_step_storage(inner)
        if iterations is not None and not isinstance(iterations, MirrorVariable):
            raise ValueError(
                f"the optimizer {type(inner).__name__} was created outside the scope of "
                f"{strategy_name}: its step counter and slots would stay with each worker "
                "instead of living on the ps tasks (and in the chief's checkpoints). Create "
                "it, and compile the model, inside `with strategy.scope():`")

    def role(self, kwargs, optimizer):
        if optimizer is not None:
            # A LossScaleOptimizer's scale is each worker's own (it scales its own loss).
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                return None
            return protocol.OPTIMIZER
        if not tf.as_dtype(kwargs.get("dtype") or tf.float32).is_floating:
            return None
        return protocol.GRADIENT if kwargs.get("trainable", True) else protocol.VALUE

    def update(self, step, variable, args):
        # A worker's optimizer step is the ps's job: the gradient is recorded, and pushed
        # once the last gradient of the all-reduce has its variable.
        arguments = _tf_compat.keras_update_step_arguments(args)
        if arguments is not None and step.trained:
            raise ValueError(
                "a second optimizer update in one train step: tfdist parameter-server "
                "strategies push one `optimizer.apply` per step (a train step with two "
                "optimizers, as in a GAN, is not supported)")
        if arguments is not None:
            gradient, _ = arguments
            step.recorded.append((variable, gradient))
            if len(step.recorded) == step.expected:
                self._push(step)
        return False

    def _take_optimizer(self):
        engine = self.engine
        optimizer = _tf_compat.keras_optimizer_in_scope()
        if self.optimizer is None:
            self.optimizer = optimizer
            if optimizer is None:
                raise ValueError(
                    "tfdist parameter-server strategies train with a Keras optimizer inside "
                    "`model.fit` (or `optimizer.apply` in `strategy.run`)")
            self.check_optimizer(optimizer, self._strategy_name())
            compressor = None if engine._codec is None else engine._codec.compressor
            warning = sparsify.momentum_applied_twice(compressor, optimizer)
            if warning:  # (the pushes are gradients: the ps applies the optimizer to them)
                log.warning("tfdist: %s", warning)
        elif optimizer is not self.optimizer:
            raise ValueError(
                "the train step applies another optimizer than the run's first (the model "
                "was compiled again?): the ps tasks apply the optimizer the run started with. "
                "Compile once per strategy")

    def _push(self, step):
        engine = self.engine
        step.trained = True
        variables = [v for v, _ in step.recorded]
        if engine._left:
            raise ValueError(f"{engine._connection.task_name} has left the run "
                             "(`strategy.join()`): it cannot train any more")
        self._take_optimizer()
        unknown = [v.name for v in variables
                   if not isinstance(v, (MirrorVariable, TableVariable))]
        if unknown:
            raise ValueError(f"these trained variables were not created under the strategy's "
                             f"scope: {unknown}. Build the model and compile it inside "
                             "`with strategy.scope():`")
        # Without compression, an embedding's gradient travels as the rows it touches; a
        # compressor codes dense vectors.
        sparse = [v for v, g in step.recorded if isinstance(g, tf.IndexedSlices)]
        engine._ensure_run(variables, sparse if engine._codec is None else ())
        frozen = [v._tfdist_path for v in variables
                  if v._tfdist_role not in (protocol.GRADIENT, protocol.TABLE)]
        if frozen:
            raise ValueError(
                f"the train step trains {frozen}, which the run's first step did not train "
                "(unfrozen after training began?); the ps tasks keep the variables the run "
                "started with as state. Set `trainable` before the first `fit`")
        pushed_sparse = {id(p.variable) for layout, parts in zip(engine._layouts, engine._shards)
                         for p, e in zip(parts, layout.main) if e.sparse}
        dense = [v._tfdist_path for v in sparse
                 if id(v) not in pushed_sparse and not isinstance(v, TableVariable)]
        if dense and not getattr(self, "_warned_sparse", False):
            self._warned_sparse = True
            log.warning("tfdist: the gradients of %s are sparse (embedding rows) but are "
                        "pushed dense, the whole variable each step (a compressor codes dense "
                        "vectors; or the run's first trace gave them dense)", dense)
        # A sparse gradient pushed dense is made dense once, not once per part; a table's
        # stays rows.
        gradients = {id(v): g if (id(v) in pushed_sparse or isinstance(v, TableVariable)
                                  or not isinstance(g, tf.IndexedSlices))
                     else tf.convert_to_tensor(g) for v, g in step.recorded}
        dense_tables = [v._tfdist_path for v, g in step.recorded
                        if isinstance(v, TableVariable) and not isinstance(g, tf.IndexedSlices)]
        if dense_tables:
            raise ValueError(
                f"the gradients of the embedding tables {dense_tables} reach the optimizer "
                "dense (every row): something between the loss and the optimizer made them "
                "so (`global_clipnorm`, a custom gradient transform), and pushing them would "
                "move and update every row each step. Use `clipnorm` / `clipvalue`, which keep "
                "the rows, or keep the tables on the workers (`embedding_tables=None`)")
        for table in engine._tables.tables:
            if id(table) not in gradients:  # not trained by this step: no rows
                gradients[id(table)] = tf.IndexedSlices(
                    tf.zeros([0, *table.shape[1:]], table.dtype), tf.zeros([0], tf.int64),
                    tf.constant(table.shape.as_list(), tf.int64))
        missing = sorted({p.variable._tfdist_path for s in engine._shards for p in s
                          if p.variable._tfdist_role == protocol.GRADIENT
                          and id(p.variable) not in gradients})
        if missing:
            raise ValueError(f"the train step pushed no gradient for {missing}, which an "
                             "earlier trace trained; every trace must train the same variables")
        engine._exchange(lambda part: part.take(gradients[id(part.variable)]))

    def prepare_run(self, sparse):
        fields = {}
        for variable in self.engine._mirrors:
            if variable._tfdist_role == protocol.GRADIENT:
                fields[id(variable)] = self._update_options(variable)
                if id(variable) in sparse:
                    fields[id(variable)]["sparse"] = True
        tables = self.engine._tables
        if tables.tables and tables.updates == "lazy" and not rowwise_optimizer(self.optimizer):
            inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
            raise ValueError(
                f"row-wise (lazy) updates of the embedding tables "
                f"{[t._tfdist_path for t in tables.tables]} need an optimizer whose update of "
                f"a row reads only that row: one of {sorted(ROWWISE_OPTIMIZERS)}. Received: "
                f"{type(inner).__name__}. Pass `embedding_updates='dense'` (every row, every "
                "update), or keep the tables on the workers (`embedding_tables=None`)")
        if tables.tables and isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            log.warning(
                "tfdist: Keras's LossScaleOptimizer checks every gradient for non-finite "
                "values as a dense tensor: each step makes a mask of every row of the tables "
                "%s on this worker (memory and time that follow the table's size). Training "
                "without loss scaling (float32, or mixed_bfloat16) has no such mask",
                [t._tfdist_path for t in tables.tables])
        for table in tables.tables:
            fields[id(table)] = self._update_options(table)
            if self.engine._policy.delay_compensation is not None:
                fields[id(table)]["read_rows"] = True  # DC-ASGD per row
            if "constraint" in fields[id(table)]:
                raise ValueError(
                    f"the embedding table {table._tfdist_path} has a constraint: the ps tasks "
                    "apply constraints to whole variables (and Keras would apply it to the "
                    "whole table on each worker), while a table is updated on the ps by rows. "
                    "Drop the constraint, or keep the table on the workers "
                    "(`embedding_tables=None`)")
        return fields

    def _update_options(self, variable):
        """What the ps-side optimizer must know of a trained variable: its Keras constraint,
        and whether weight decay skips it (`exclude_from_weight_decay`)."""
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        keras_variables = {id(_tf_compat.keras_variable_storage(kv)): kv
                           for kv in _tf_compat.keras_optimizer_trained_variables(inner)}
        keras_variable = keras_variables.get(id(variable))
        if keras_variable is None:
            return {}
        options = {}
        if (getattr(inner, "weight_decay", None)
                and not _tf_compat.keras_optimizer_decays(inner, keras_variable)):
            options["weight_decay"] = False
        constraint = keras_variable.constraint
        if constraint is not None:
            if not isinstance(constraint, keras.constraints.Constraint):
                raise ValueError(
                    f"the constraint of {variable._tfdist_path} is {constraint!r}; the ps tasks "
                    "apply constraints after each update and need a "
                    "`keras.constraints.Constraint` (a custom one registered with "
                    "`@keras.saving.register_keras_serializable()`)")
            options["constraint"] = keras.constraints.serialize(constraint)
        return options

    def split_optimizer(self):
        return self.optimizer, "the model trains with"

    def spec(self):
        return {"mode": self.mode, "optimizer": keras.optimizers.serialize(self.optimizer),
                "outer_optimizer": None, "delta": False}

    def rebuilt_optimizers(self):
        return [self.optimizer]


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

    def role(self, kwargs, optimizer):
        if self.outer is not None:
            if self.outer.building:
                return protocol.OPTIMIZER  # the outer optimizer's state lives on the ps tasks
            self.outer.attach(optimizer)  # before a checkpoint restores it: in __init__
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
        optimizer_step = _tf_compat.keras_update_step_arguments(args) is not None
        if optimizer_step and self.optimizer is None:
            self.optimizer = _tf_compat.keras_optimizer_in_scope()
            if self.optimizer is not None:
                self.check_optimizer(self.optimizer, self._strategy_name())
                if self.outer is not None:
                    self.outer.attach(self.optimizer)
        if optimizer_step:
            self.rows.track(variable, args[0])  # (a table averaged by rows: its rows)
        step.trained = step.trained or optimizer_step
        return True  # the worker trains its own copy

    def after_step(self):
        engine = self.engine
        if engine._clients is None:
            engine._ensure_run()
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

    def on_reply(self, shard, values):
        layout = self.engine._layouts[shard]
        updates = [self.rows.take(part, ids, rows) for part, (ids, rows) in zip(
            self.engine._row_parts[shard], layout.reply_rows(values))]
        if shard == 0 and self._rates:
            # The learning rate is the master's (the chief's last write), read once the
            # round's reply is here: when every worker's model makes a round, the chief's
            # write before its push is seen by all (a scalar read a round, on ps task 0).
            with tf.control_dependencies([values]):
                updates += [rate.assign(rate.master_value(), read_value=False)
                            for rate in self._rates]
        if self.engine._codec is not None:
            updates.append(self._base(shard).assign(values[:layout.main_size]))
        return updates

    def pushed_rows(self, shard):
        return [piece for part in self.engine._row_parts[shard]
                for piece in self.rows.pushed(part)]

    def joined(self, copy_tables):
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


def check_split(push, partitioner):
    """Whether the push's updates let a variable be split over ps tasks (refuses an explicit
    partitioner where they do not)."""
    applied, words = push.split_optimizer()
    elementwise = applied is None or placement.elementwise_optimizer(applied)
    if not elementwise and partitioner not in (None, placement.AUTO):
        inner = getattr(applied, "inner_optimizer", applied)
        raise ValueError(
            f"`variable_partitioner` splits variables over ps tasks, which is exact only "
            f"for an optimizer whose update is elementwise "
            f"({sorted(placement.ELEMENTWISE_OPTIMIZERS)}); {words} "
            f"{type(inner).__name__}. Pass `variable_partitioner=None`")
    return elementwise
