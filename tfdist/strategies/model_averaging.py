"""Periodic parameter averaging (local SGD) on the parameter-server engine."""

import logging

import tensorflow as tf

from tfdist import _tf_compat
from tfdist.compression.exchange import compression_logs
from tfdist.ps import sync
from tfdist.ps.connection import ps_device
from tfdist.ps.policies import AveragingPolicy
from tfdist.ps.variables import open_shared_variable
from tfdist.ps.variables import wait_until_initialized
from tfdist.strategies.parameter_server import ParameterServerExtended
from tfdist.strategies.parameter_server import ParameterServerStrategyBase
from tfdist.strategies.parameter_server import _StepTrace
from tfdist.strategies.parameter_server import n_of_m_policy

log = logging.getLogger("tfdist")


class ModelAveragingExtended(ParameterServerExtended):
    """Local SGD with periodic averaging: local variables, a master copy on the ps."""

    def __init__(self, container_strategy, make_policy, period, optimizer_state, **kwargs):
        self._period = period
        self._average_optimizer_state = optimizer_state == "averaged"
        self._pairs = []
        super().__init__(container_strategy, make_policy, **kwargs)
        with tf.init_scope(), tf.device(self._connection.local_device):
            self._local_iterations = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                 name="tfdist_local_iterations")
            self._last_dropped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="tfdist_last_dropped")
            self._last_bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                name="tfdist_last_bytes_sent")

    def _create_variable(self, next_creator, **kwargs):
        local = _tf_compat.OneDeviceExtended._create_variable(self, next_creator, **kwargs)
        if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                or sync.in_updater() or not local.dtype.is_floating):
            return local
        if (_tf_compat.keras_optimizer_in_scope() is not None
                and not self._average_optimizer_state):
            return local
        index = self._connection.place(local.shape, local.dtype)
        name = local.name.split(":")[0].replace("/", "_")
        master = open_shared_variable(
            ps_device(index), f"var/{self._num_master_variables}/{name}", local.shape,
            local.dtype, name)
        self._num_master_variables += 1
        with tf.init_scope():
            if self._connection.is_chief:
                master.assign(local.read_value())
            else:
                wait_until_initialized(master, self._init_timeout,
                                       f"the chief {self._chief_name}")
                local.assign(master.read_value())
        self._pairs.append((local, master))
        return local

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        # Workers train on their own between averaging rounds: no exchange per step.
        return _tf_compat.OneDeviceExtended._batch_reduce_to(
            self, reduce_op, value_destination_pairs, options)

    def _update(self, var, fn, args, kwargs, group):
        trace = getattr(self._tls, "trace", None)
        if trace is not None and len(args) == 2:
            trace.pushed = True  # an optimizer step: this trace is a training step
        return _tf_compat.OneDeviceExtended._update(self, var, fn, args, kwargs, group)

    def _call_for_each_replica(self, fn, args, kwargs):
        trace = _StepTrace()
        self._tls.trace = trace
        try:
            result = _tf_compat.OneDeviceExtended._call_for_each_replica(
                self, fn, args, kwargs)
        finally:
            self._tls.trace = None
        if not trace.pushed or not self._pairs:
            return result
        count = self._local_iterations.assign_add(1)
        round_index = tf.cond(tf.equal(count % self._period, 0), self._average,
                              lambda: self._local_step.read_value())
        self._ensure_updater()
        if isinstance(result, dict):
            result = dict(result)
            result["averaging_round"] = round_index
            with tf.control_dependencies([round_index]):
                result["dropped_models"] = self._last_dropped.read_value()
                if self._compressor is not None:
                    result.update(compression_logs({
                        "bytes_sent": self._last_bytes_sent.read_value(),
                        "bytes_dense": tf.constant(4 * self._layout.total_size, tf.int64)}))
        return result

    def _average(self):
        """Pushes this worker's model, waits for the round's average, and takes it.

        With a compressor the push is the model's change since the last average (a model
        itself does not survive top-k or sign compression; its change does, with error
        feedback), and the updater adds the mean change to the master copy.
        """
        local_vars = [local for local, _ in self._pairs]
        flat = sync.GradientLayout.flatten([v.read_value() for v in local_vars])
        step = self._local_step.read_value()
        payload, before_push, after_pull = (flat,), [], []
        if self._compressor is not None:
            base = self._compressor_states.get(
                ("base", flat.shape.num_elements()),
                lambda: {"base": sync.GradientLayout.flatten(
                    [v.read_value() for v in local_vars])})["base"][0]
            payload, before_push, stats = self._encode(flat - base.read_value(), step)
            before_push.append(self._last_bytes_sent.assign(stats["bytes_sent"]))
        with tf.control_dependencies(before_push):
            token = self._resources.push_and_wait(payload, step)
        with tf.control_dependencies([token]):
            pulled = [master.read_value() for _, master in self._pairs]
            dropped = self._resources.progress[sync.STAT_DROPPED]
        if self._compressor is not None:
            after_pull.append(base.assign(sync.GradientLayout.flatten(pulled)))
        with tf.control_dependencies(
                [local.assign(value) for local, value in zip(local_vars, pulled)] + after_pull
                + [self._last_dropped.assign(dropped), self._local_step.assign(token)]):
            return tf.identity(token)

    def _ensure_updater(self):
        if self._layout is None:
            self._layout = sync.GradientLayout([master for _, master in self._pairs])
        if self._connection.is_chief and self._updater is None:
            self._updater = sync.Updater(
                self._container_strategy(), self._resources, None, self._layout,
                self._policy, self._worker_timeout)
            self._updater.start()

    def leave(self, timeout=None):
        """Ends this worker's training; the local model then takes the final average."""
        was_left = self._left
        super().leave(timeout)
        if not was_left and self._pairs:
            try:
                with tf.init_scope():
                    for local, master in self._pairs:
                        local.assign(master.read_value())
            except (tf.errors.OpError, RuntimeError) as e:
                log.warning("tfdist: could not take the final average: %s", e)


class ModelAveragingStrategy(ParameterServerStrategyBase):
    """Periodic parameter averaging (local SGD) through parameter servers.

    Each worker trains its own copy of the model with the user's Keras optimizer; every
    `period` steps it pushes its model to the ps, where the chief's updater averages the first
    `replicas_to_aggregate` models of that round into the master copy, and every worker whose
    model was used (or dropped, being late) continues from the average. With `period=1`, plain
    SGD and every worker aggregated, this is hard-synchronous SGD.

    ```python
    strategy = tfdist.strategies.ModelAveragingStrategy(period=4)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)   # logs carry `averaging_round`
    strategy.join()                              # every local model takes the final average
    ```

    Args:
      period: k, local steps between averaging rounds (at least 1).
      replicas_to_aggregate: models per round; None for every worker.
      optimizer_state: "local" (each worker keeps its optimizer's slots, the default: momentum
        or Adam moments are not averaged) or "averaged" (the slots are averaged with the model).
      compression: a `tfdist.compression` compressor (or its name / config) for the pushes:
        each worker then sends its model's change since the last average, compressed with
        its own residual, and the updater adds the mean decoded change to the master copy.
        Logs gain `bytes_sent` (the last round's push), `bytes_dense` and
        `compression_ratio`. PowerSGD is refused (it needs all-reduce rounds).
      cluster, worker_timeout, init_timeout, connect_timeout, inter_op_threads: as for
        `SoftSyncStrategy`.
    """

    def __init__(self, period=1, replicas_to_aggregate=None, optimizer_state="local",
                 cluster=None, worker_timeout=120.0, init_timeout=60.0, connect_timeout=30.0,
                 inter_op_threads=1, compression=None):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"`period` must be an integer >= 1 (local steps between averaging "
                             f"rounds). Received: {period!r}")
        if optimizer_state not in ("local", "averaged"):
            raise ValueError(f"`optimizer_state` must be one of ['averaged', 'local']. "
                             f"Received: {optimizer_state!r}")

        super().__init__(ModelAveragingExtended(
            self, n_of_m_policy(AveragingPolicy, replicas_to_aggregate), period,
            optimizer_state, cluster=cluster, worker_timeout=worker_timeout,
            init_timeout=init_timeout, connect_timeout=connect_timeout,
            inter_op_threads=inter_op_threads, compression=compression))

    @property
    def period(self):
        return self.extended._period

    @property
    def replicas_to_aggregate(self):
        return self.extended._policy.replicas_to_aggregate
