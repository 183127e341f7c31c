"""Periodic parameter averaging (local SGD) on the parameter-server engine (its push is
`tfdist.ps.model_push.ModelPush`)."""

from tfdist._args import check_int
from tfdist.ps.model_push import ModelPush
from tfdist.ps.outer_optimizer import outer_optimizer_config
from tfdist.ps.policies import AveragingPolicy
from tfdist.ps.table_set import TableRule
from tfdist.ps.worker import ParameterServerExtended
from tfdist.strategies.parameter_server import ParameterServerStrategyBase
from tfdist.strategies.parameter_server import n_of_m_policy


class ModelAveragingStrategy(ParameterServerStrategyBase):
    """Periodic parameter averaging (local SGD) through parameter servers.

    Each worker trains its own copy of the model with the user's Keras optimizer; every
    `period` steps it pushes its model to the ps tasks, which average the first
    `replicas_to_aggregate` models of that round into the master copy, and every worker whose
    model was used (or dropped, being late) continues from the average. With `period=1`, plain
    SGD and every worker aggregated, this is hard-synchronous SGD. `strategy.join()` (or the
    end of the process) pushes the steps taken since the last round, so none is lost.

    ```python
    strategy = tfdist.strategies.ModelAveragingStrategy(period=4)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)   # logs carry `averaging_round`
    strategy.join()                              # every local model takes the final average
    ```

    With an outer optimizer (DiLoCo, Douillard et al. 2023), a round does not replace the
    master copy by the mean: the round's change `master - mean(local models)` is an outer
    gradient, which the outer optimizer applies to the master copy on the ps tasks. The
    paper's setting, 500 local AdamW steps between rounds:

    ```python
    strategy = tfdist.strategies.ModelAveragingStrategy(
        period=500, outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True))
    ```

    Args:
      period: k, local steps between averaging rounds (at least 1).
      replicas_to_aggregate: models per round; None for every worker.
      optimizer_state: "local" (each worker keeps its optimizer's slots, the default: momentum
        or Adam moments are not averaged) or "averaged" (the slots are averaged with the model).
        Scalars are never averaged: the step count and a loss scale stay each worker's, the
        learning rate has a master that worker 0's writes reach, taken at every round.
      compression: a `tfdist.compression` compressor (or its name / config) for the pushes:
        each worker then sends its model's change since the last average, compressed with
        its own residual, and the ps adds the mean decoded change to the master copy.
        Logs gain `bytes_sent` (the last round's push), `bytes_dense` and
        `compression_ratio`. PowerSGD is refused (it needs all-reduce rounds).
      outer_optimizer: None (the round's mean replaces the master copy), or a Keras
        optimizer, its name or its config (a dict, or that dict as a JSON string, as a
        `--strategy_arg` flag carries it), applied on the ps tasks to the round's outer
        gradient `master - mean(local)` (with `compression`, the mean decoded change,
        negated). Its config is what counts: every task builds its own copy. It updates the
        variables the model's optimizer trains; the rest (BatchNorm statistics, and the
        optimizer's slots under `optimizer_state="averaged"`) is averaged plainly. Its
        state (momentum, step count) lives on the ps tasks, one slot per part of a split
        variable, and the chief's Keras checkpoints (`ModelCheckpoint`,
        `BackupAndRestore`, `save_weights`) hold and restore it with the model's
        optimizer. `keras.optimizers.SGD(1.0)` gives plain averaging (up to rounding).
      embedding_tables: the embedding tables averaged by the rows a round changed: "auto"
        (the default: the table of every `keras.layers.Embedding`), None (every table
        averaged whole, every round), or a list of Keras path patterns (`fnmatch`; a pattern
        that matches no trainable float variable of rank 2 or more is an error at the first
        step). Each worker still trains its own copy of a table (local SGD needs it), and
        marks the rows its steps' gradients touch; a round pushes only those rows (ids and
        values), the ps averages each pushed row over the round's workers (one that did not
        touch it counts with the master's value, which it started the round from) and the
        reply carries only the rows the round changed. A round's cost then follows the rows
        touched, not the table (logs gain `table_rows_pushed`); the result is the whole
        table's average. That holds when a row without gradient keeps its value: the local
        optimizer is SGD without momentum, Adagrad, RMSprop or Adadelta without momentum
        (SGD or Adagrad with `optimizer_state="averaged"`: their slots are averaged by the
        same rows), without weight decay or a constraint on the table, and there is no
        `outer_optimizer`.
        Otherwise a table "auto" found is averaged whole, with a warning, and a table a
        pattern names is an error that says why. With `compression`, the rest of the model
        is compressed and the rows travel as they are.
      cluster, init_timeout, connect_timeout, inter_op_threads, variable_partitioner,
        stall_timeout: as for `SoftSyncStrategy` (averaging is elementwise: "auto" splits
        with any optimizer). A worker stopped between two rounds is dead `stall_timeout`
        after it stopped answering, whether or not a round was waiting for it.
    """

    def __init__(self, period=1, replicas_to_aggregate=None, optimizer_state="local",
                 cluster=None, init_timeout=None, connect_timeout=None, inter_op_threads=1,
                 compression=None, variable_partitioner="auto", outer_optimizer=None,
                 embedding_tables="auto", stall_timeout=None):
        check_int("period", period, "an integer >= 1 (local steps between averaging rounds)",
                  low=1)
        if optimizer_state not in ("local", "averaged"):
            raise ValueError(f"`optimizer_state` must be one of ['averaged', 'local']. "
                             f"Received: {optimizer_state!r}")
        push = ModelPush(period, average_optimizer_state=optimizer_state == "averaged",
                         outer_optimizer=outer_optimizer_config(outer_optimizer))
        super().__init__(ParameterServerExtended(
            self, n_of_m_policy(AveragingPolicy, replicas_to_aggregate), push, cluster=cluster,
            init_timeout=init_timeout, connect_timeout=connect_timeout,
            inter_op_threads=inter_op_threads, compression=compression,
            variable_partitioner=variable_partitioner, tables=TableRule(embedding_tables),
            stall_timeout=stall_timeout))

    @property
    def period(self):
        return self.extended._push.period

    @property
    def outer_optimizer(self):
        """The Keras config of the outer optimizer (None: plain averaging)."""
        outer = self.extended._push.outer
        return None if outer is None else outer.config

    @property
    def replicas_to_aggregate(self):
        return self.extended._policy.replicas_to_aggregate
