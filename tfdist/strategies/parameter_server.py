"""The parameter-server family: between-graph replication of Keras 3 `fit` on TF's runtime.

Every worker process runs the user's own script and `model.fit`. Model variables and
optimizer slots are master variables on the ps tasks (shared resources, balanced by size over
the ps tasks); metric variables stay local to each worker. A worker's train step reads the
master weights, computes its gradients, pushes them tagged with the global step it read, and
waits for the chief's updater to release it; the optimizer step a worker's Keras `fit` would
make is left to the updater, which applies the user's optimizer once per aggregated update on
the ps devices.
"""

import atexit
import contextlib
import logging
import threading

import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.compression.base import sum_payload_bytes
from tfdist.compression.exchange import ReplicaStates
from tfdist.compression.exchange import compression_logs
from tfdist.ps import sync
from tfdist.ps.connection import PSConnection
from tfdist.ps.connection import ps_device
from tfdist.ps.policies import AsyncPolicy
from tfdist.ps.policies import SoftSyncPolicy
from tfdist.ps.variables import MasterVariable
from tfdist.ps.variables import master_writes_suppressed
from tfdist.ps.variables import open_shared_variable
from tfdist.ps.variables import wait_until_initialized

log = logging.getLogger("tfdist")


class _StepTrace:
    """What one trace of a worker's train step did (trace-time, Python only)."""

    def __init__(self):
        self.pushed = False
        self.num_pushed = 0
        self.token = None
        self.stats = None
        self.compression = None
        self.update_vars = []
        self.optimizer = None
        self.exit_stack = contextlib.ExitStack()


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"`{name}` must be a positive number of seconds. Received: {value!r}")


def push_compressor(compression):
    """The compressor for the ps push path, or None; refuses those that need all-reduce."""
    compressor = compression_lib.get(compression)
    if compressor is not None and not compressor.elementwise:
        allowed = [name for name in compression_lib.names()
                   if compression_lib.get(name).elementwise]
        raise ValueError(
            f"`compression`={compressor.name!r} needs rounds of all-reduce between the "
            f"replicas; a parameter-server push carries one message per step. Allowed "
            f"here: {allowed}")
    return compressor


def n_of_m_policy(policy_class, replicas_to_aggregate):
    """A `make_policy` for policies that aggregate N of the M workers (None: all of them)."""

    def make_policy(total):
        n = total if replicas_to_aggregate is None else replicas_to_aggregate
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
            raise ValueError(
                f"`replicas_to_aggregate` must be an integer between 1 and the number of "
                f"workers total_replicas={total}. Received: {replicas_to_aggregate!r}")
        return policy_class(n, total)

    return make_policy


class ParameterServerExtended(_tf_compat.OneDeviceExtended):
    """The engine of the parameter-server strategies (one replica per worker process)."""

    def __init__(self, container_strategy, make_policy, cluster=None, worker_timeout=120.0,
                 init_timeout=60.0, connect_timeout=30.0, inter_op_threads=1,
                 compression=None):
        compressor = push_compressor(compression)
        for name, value in (("worker_timeout", worker_timeout), ("init_timeout", init_timeout),
                            ("connect_timeout", connect_timeout)):
            _check_positive(name, value)
        config = PSConnection.validate(cluster)
        policy = make_policy(config.num_workers)
        connection = PSConnection(config, connect_timeout=connect_timeout,
                                  inter_op_threads=inter_op_threads)
        super().__init__(container_strategy, connection.local_device)
        self._connection = connection
        self._policy = policy
        self._worker_timeout = worker_timeout
        self._init_timeout = init_timeout
        self._chief_name = connection.training_tasks[0]
        self._resources = sync.SyncResources(connection, compressor=compressor)
        self._compressor = compressor
        self._compressor_states = ReplicaStates(container_strategy)
        self._resources.initialize(init_timeout)
        with tf.init_scope(), tf.device(connection.local_device):
            self._local_step = tf.Variable(self._resources.read_progress()["global_step"],
                                           dtype=tf.int64,
                                           trainable=False, name="tfdist_local_step")
        self._num_master_variables = 0
        self._tls = threading.local()
        self._layout = None
        self._optimizer = None
        self._updater = None
        self._left = False
        self._chief_watch = None if connection.is_chief else sync.ChiefWatch(self._resources)
        atexit.register(self.leave)

    # Variables ---------------------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                or sync.in_updater()):
            # Metric state stays with each worker, as in the built-in strategies.
            return super()._create_variable(next_creator, **kwargs)
        colocate_with = kwargs.pop("colocate_with", None)
        with tf.init_scope():
            initial_value = kwargs.get("initial_value")
            if callable(initial_value):
                initial_value = initial_value()
            initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
        if isinstance(colocate_with, MasterVariable):
            index = colocate_with._tfdist_ps_index
        else:
            index = self._connection.place(initial_value.shape, initial_value.dtype)
        name = (kwargs.get("name") or "Variable").split(":")[0]
        variable = open_shared_variable(
            ps_device(index), f"var/{self._num_master_variables}/{name}", initial_value.shape,
            initial_value.dtype, name, trainable=kwargs.get("trainable"),
            synchronization=kwargs.get("synchronization"),
            aggregation=kwargs.get("aggregation"),
            distribute_strategy=self._container_strategy())
        self._num_master_variables += 1
        variable._tfdist_ps_index = index
        if self._connection.is_chief:
            with tf.init_scope():
                variable.assign(initial_value)
        else:
            wait_until_initialized(variable, self._init_timeout, f"the chief {self._chief_name}")
        return variable

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable

    # The train step ----------------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        trace = _StepTrace()
        self._tls.trace = trace
        try:
            with trace.exit_stack:
                result = super()._call_for_each_replica(fn, args, kwargs)
        finally:
            self._tls.trace = None
        if trace.pushed:
            self._on_training_trace(trace)
            if isinstance(result, dict):
                result = dict(result)
                result["global_step"] = trace.token
                result["dropped_gradients"] = trace.stats[sync.STAT_DROPPED]
                if self._policy.measures_staleness:
                    aggregated = tf.maximum(trace.stats[sync.STAT_AGGREGATED], 1)
                    result["staleness_mean"] = (
                        tf.cast(trace.stats[sync.STAT_STALENESS_SUM], tf.float32)
                        / tf.cast(aggregated, tf.float32))
                    result["staleness_max"] = trace.stats[sync.STAT_STALENESS_MAX]
                if trace.compression is not None:
                    result.update(compression_logs(trace.compression))
        return result

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        trace = getattr(self._tls, "trace", None)
        if trace is None or trace.pushed or sync.in_updater():
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        values = [value for value, _ in value_destination_pairs]
        flat = sync.GradientLayout.flatten(values)
        local_step = self._local_step.read_value()
        payload, state_updates = (flat,), []
        if self._compressor is not None:
            payload, state_updates, trace.compression = self._encode(flat, local_step)
        with tf.control_dependencies(state_updates):
            token = self._resources.push_and_wait(payload, local_step)
        set_step = self._local_step.assign(token, read_value=False)
        with tf.control_dependencies([token]):
            trace.stats = self._resources.progress.read_value()
        trace.pushed, trace.token, trace.num_pushed = True, token, len(values)
        # From here on this trace's writes to master variables are the updater's job.
        trace.exit_stack.enter_context(master_writes_suppressed())
        with tf.control_dependencies([set_step]):
            return [tf.identity(tf.convert_to_tensor(v)) for v in values]

    def _encode(self, flat, local_step):
        """Compresses this worker's flat gradient; its residual stays with the worker."""
        compressor = self._compressor
        states = self._compressor_states.get(
            ("push", flat.shape.num_elements()),
            lambda: compressor.initial_state(flat.shape, flat.dtype))
        state = {name: tf.identity(v[0]) for name, v in states.items()}
        key = tf.stack([local_step, tf.constant(self._connection.rank, tf.int64)])
        payload, new_state = compressor.compress(flat, state, key)
        updates = [states[name][0].assign(new_state[name]) for name in states]
        stats = {"bytes_sent": sum_payload_bytes([payload]),
                 "bytes_dense": tf.constant(flat.shape.num_elements() * 4, tf.int64)}
        return payload, updates, stats

    def _update(self, var, fn, args, kwargs, group):
        trace = getattr(self._tls, "trace", None)
        if trace is not None and not sync.in_updater():
            # A worker's optimizer step: recorded, not run; the updater applies it.
            if trace.pushed and len(args) == 2:
                trace.update_vars.append(var)
                trace.optimizer = trace.optimizer or _tf_compat.keras_optimizer_in_scope()
            return var if group else (var,)
        factor = getattr(sync._applier, "learning_rate_factor", None)
        if sync.in_updater() and factor is not None and len(args) == 2:
            # A staleness-aware policy scales this update's learning rate.
            gradient, learning_rate = args
            args = (gradient, tf.cast(learning_rate, factor.dtype) * factor)
        with tf.device(var.device), _tf_compat.distribute_lib.UpdateContext(var.device):
            result = fn(var, *args, **kwargs)
        if group:
            return result
        return tf.nest.map_structure(self._local_results, result)

    def _use_merge_call(self):
        return not sync.in_updater()

    def _on_training_trace(self, trace):
        if trace.optimizer is None or len(trace.update_vars) != trace.num_pushed:
            raise ValueError(
                "tfdist parameter-server strategies train with a Keras optimizer inside "
                f"`model.fit` (or `optimizer.apply`): {trace.num_pushed} gradients were "
                f"pushed but {len(trace.update_vars)} variable updates followed")
        variables = [v.value if hasattr(v, "value") and not isinstance(v, tf.Variable)
                     else v for v in trace.update_vars]
        if self._layout is None:
            self._layout = sync.GradientLayout(variables)
            self._optimizer = trace.optimizer
        elif [id(v) for v in variables] != [id(v) for v in self._layout.variables]:
            raise ValueError("the trainable variables of the model changed between two traces "
                             "of its train step; every trace must push the same variables")
        if self._connection.is_chief and self._updater is None:
            self._updater = sync.Updater(
                self._container_strategy(), self._resources, self._optimizer, self._layout,
                self._policy, self._worker_timeout)
            self._updater.start()

    # Lifecycle ---------------------------------------------------------------------------

    def leave(self, timeout=None):
        """Ends this worker's part in training; on the chief, waits for the others too.

        Called at exit; call it yourself to wait, on the chief, until every worker has
        finished (the master weights are final afterwards).
        """
        if self._left:
            return
        self._left = True
        if self._chief_watch is not None:
            self._chief_watch.stop()
        try:
            self._resources.send_control(sync.LEAVE, self._connection.rank)
        except (tf.errors.OpError, RuntimeError, ValueError) as e:
            log.warning("tfdist: could not tell the chief that %s left: %s",
                        self._connection.task_name, e)
        updater = self._updater
        if updater is not None:
            timeout = self._worker_timeout + 10 if timeout is None else timeout
            if not updater.join(timeout):
                log.warning("tfdist: the updater did not finish within %g s; stopping it",
                            timeout)
                updater.stop()
                updater.join(5)

    # Properties --------------------------------------------------------------------------

    def _in_multi_worker_mode(self):
        return False

    @property
    def experimental_between_graph(self):
        return True

    @property
    def should_checkpoint(self):
        return self._connection.is_chief

    @property
    def should_save_summary(self):
        return self._connection.is_chief


class ParameterServerStrategyBase(tf.distribute.Strategy):
    """Shared public surface of the tfdist parameter-server strategies."""

    @property
    def is_chief(self):
        """True on the task that initialises variables and runs the updater."""
        return self.extended._connection.is_chief

    @property
    def worker_index(self):
        """This worker's rank among the training tasks (0 = chief)."""
        return self.extended._connection.rank

    @property
    def num_workers(self):
        return self.extended._connection.num_workers

    @property
    def cluster_config(self):
        return self.extended._connection.config

    def shard(self, *arrays):
        """This worker's contiguous share of each array (or `tf.data.Dataset`).

        Arrays are split into `num_workers` nearly equal contiguous blocks; a dataset is
        sharded with `dataset.shard(num_workers, worker_index)`.
        """
        out = []
        for array in arrays:
            if isinstance(array, tf.data.Dataset):
                out.append(array.shard(self.num_workers, self.worker_index))
                continue
            size = len(array)
            start = size * self.worker_index // self.num_workers
            stop = size * (self.worker_index + 1) // self.num_workers
            out.append(array[start:stop])
        return out[0] if len(out) == 1 else tuple(out)

    def join(self, timeout=None):
        """Ends this worker's training; on the chief, waits until every worker has finished."""
        self.extended.leave(timeout)

    def progress(self):
        """The telemetry the ps holds now: global_step, dropped_gradients,
        aggregated_gradients, staleness_mean, staleness_max, staleness_histogram."""
        return self.extended._resources.read_progress()

    @property
    def updater_stats(self):
        """On the chief, the updater's counters (updates, dropped, left, dead), else None."""
        updater = self.extended._updater
        return None if updater is None else updater.stats


class SoftSyncStrategy(ParameterServerStrategyBase):
    """n-soft synchronous training through parameter servers (TF1 `SyncReplicasOptimizer`).

    Each update averages the first `replicas_to_aggregate` (N) fresh gradients of the M
    workers; gradients computed at an older global step are dropped and counted. N = M is hard
    synchronous training; N < M gives M - N backup workers, so that slow or dead workers do not
    hold the others back. The user's Keras optimizer is applied once per update, on the ps.

    ```python
    strategy = tfdist.strategies.SoftSyncStrategy(replicas_to_aggregate=2)  # TF_CONFIG
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    # History carries `global_step` and `dropped_gradients`.
    ```

    Args:
      replicas_to_aggregate: N, gradients per update; None for all the workers (hard sync).
      cluster: a `tfdist.cluster.ClusterConfig`, TF_CONFIG dict / JSON, a cluster resolver,
        or None to read TF_CONFIG. It needs at least one ps task.
      worker_timeout: seconds the chief waits without any update before it stops the run.
        A worker whose server goes away is noticed within about a second.
      init_timeout: seconds a worker waits for the chief to initialise the variables.
      connect_timeout: seconds the ps tasks get to start listening.
      inter_op_threads: inter-op threads of this worker's TF executor (None: TF's default).
        One is fastest when per-step latency dominates (small models, shared cores).
      compression: a `tfdist.compression` compressor (or its name / config) for the push:
        each worker encodes its gradient (keeping its own error-feedback residual) and the
        updater decodes it on ps task 0. The logs then carry `bytes_sent`, `bytes_dense`
        and `compression_ratio`. Compressors that need all-reduce rounds (PowerSGD) are
        refused.

    Raises:
      ValueError: `replicas_to_aggregate` is not between 1 and the number of workers, the
        cluster has no ps task, or this task is not a chief / worker.
      TaskUnreachableError: a ps task did not answer within `connect_timeout`.
    """

    def __init__(self, replicas_to_aggregate=None, cluster=None, worker_timeout=120.0,
                 init_timeout=60.0, connect_timeout=30.0, inter_op_threads=1,
                 compression=None):
        super().__init__(ParameterServerExtended(
            self, n_of_m_policy(SoftSyncPolicy, replicas_to_aggregate), cluster=cluster,
            worker_timeout=worker_timeout, init_timeout=init_timeout,
            connect_timeout=connect_timeout, inter_op_threads=inter_op_threads,
            compression=compression))

    @property
    def replicas_to_aggregate(self):
        return self.extended._policy.replicas_to_aggregate


class AsyncStrategy(ParameterServerStrategyBase):
    """Asynchronous SGD through parameter servers, staleness-aware.

    Every worker's gradient becomes an update as soon as the chief's updater takes it, with the
    user's Keras optimizer on the ps. The staleness tau of an update (global steps applied
    between the read of the weights it was computed on and its own application) is measured
    for every update and reported (`staleness_mean`, `staleness_max` in the Keras logs; the
    histogram in `strategy.progress()`).

    ```python
    strategy = tfdist.strategies.AsyncStrategy(staleness="inverse", max_staleness=8)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    ```

    Args:
      staleness: how the learning rate of an update depends on its staleness: "none" (plain
        async SGD), "inverse" (lr / max(1, tau), Zhang et al. 2016), or a callable taking the
        int64 staleness tensor and returning a float factor (traced into the update).
      max_staleness: None, or a bound s. With `on_stale="drop"` a gradient staler than s
        is dropped, counted, and its worker goes on from the current weights; with
        `on_stale="wait"` (stale synchronous parallel) a worker more than s pushes ahead of
        the slowest live worker waits for it.
      delay_compensation: None, or lambda of delay-compensated ASGD (Zheng et al. 2017):
        g + lambda * g * g * (w_now - w_read), where w_read are the weights the worker was
        last released with (kept per worker on ps task 0).
      on_stale: "drop" or "wait", see `max_staleness`.
      cluster, worker_timeout, init_timeout, connect_timeout, inter_op_threads, compression:
        as for `SoftSyncStrategy`.
    """

    def __init__(self, staleness="none", max_staleness=None, delay_compensation=None,
                 on_stale="drop", cluster=None, worker_timeout=120.0, init_timeout=60.0,
                 connect_timeout=30.0, inter_op_threads=1, compression=None):
        policy = AsyncPolicy(staleness, max_staleness, delay_compensation, on_stale)
        super().__init__(ParameterServerExtended(
            self, lambda total: policy, cluster=cluster, worker_timeout=worker_timeout,
            init_timeout=init_timeout, connect_timeout=connect_timeout,
            inter_op_threads=inter_op_threads, compression=compression))

    @property
    def policy(self):
        return self.extended._policy

