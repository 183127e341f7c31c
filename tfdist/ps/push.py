"""What a parameter-server worker's step sends its ps tasks: one interface, two pushes.

`GradientPush` (soft sync, async): a worker's optimizer step is the ps's job; the gradients
of the step are recorded and pushed, and the ps tasks apply the user's optimizer to them.
`ModelPush` (model averaging, local SGD, DiLoCo; `tfdist.ps.model_push`): the worker trains
its own copy with its optimizer and pushes the model (or, compressed, its change) every
`period` steps; the ps tasks average the models, or apply an outer optimizer to the round's
mean change.

The engine (`tfdist.ps.worker.ParameterServerExtended`) runs the run (joining it, placement,
the mirrors, the exchange with every ps task, leaving) and asks its push every question whose
answer depends on what is pushed: the role of a new variable, what an optimizer update of a
step does, what the step exchanges, the spec's fields, the logs.
"""

import abc
import logging

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.compression import sparsify
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps.rowwise import ROWWISE_OPTIMIZERS
from tfdist.ps.rowwise import rowwise_optimizer
from tfdist.ps.tables import TableVariable
from tfdist.ps.variables import MirrorVariable

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

    def variable_made(self, optimizer):
        """Called before each variable made under the strategy (`optimizer`: the Keras
        optimizer making it, or None), metrics' included; by default, nothing."""
        del optimizer

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

    def reply_reads(self, shard):
        """Variables on `shard`'s ps task whose values come back with its reply
        (`ShardClient.push_and_receive`'s `reads`; `on_reply` gets them)."""
        return []

    def on_reply(self, shard, values, reads):
        """Updates to run when `shard`'s reply (its flat values, and the values of the
        variables `reply_reads` named) lands."""
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
        if engine.run_finished:
            return  # nothing trains any more: this step pushes nothing
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
        check_table_updates(self.optimizer, tables)
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


def check_table_updates(optimizer, tables):
    """Refuses an optimizer the ps tasks cannot apply to the embedding tables `tables` (a
    `TableSet`) as asked: row-wise ("lazy") updates need a row-local one; a table split
    over ps tasks, an elementwise one (each task applies it to its part alone)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if tables.tables and tables.updates == "lazy" and not rowwise_optimizer(optimizer):
        raise ValueError(
            f"row-wise (lazy) updates of the embedding tables "
            f"{[t._tfdist_path for t in tables.tables]} need an optimizer whose update of "
            f"a row reads only that row: one of {sorted(ROWWISE_OPTIMIZERS)}. Received: "
            f"{type(inner).__name__}. Pass `embedding_updates='dense'` (every row, every "
            "update), or keep the tables on the workers (`embedding_tables=None`)")
    split = [t._tfdist_path for t in tables.tables if len(t.parts) > 1]
    if split and not placement.elementwise_optimizer(optimizer):
        raise ValueError(
            f"the embedding tables {split} are split over ps tasks, and each task would "
            f"apply {type(inner).__name__} to its part alone: exact only for an optimizer "
            f"whose update is elementwise ({sorted(placement.ELEMENTWISE_OPTIMIZERS)}). "
            "Tables are placed when they are made, before the optimizer is known, and "
            "`variable_partitioner='auto'` splits every table of 512 KiB or more. Pass "
            "`variable_partitioner=None` (every table whole on one ps task), or use one of "
            "those optimizers")


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
