"""The parameter-server family: between-graph replication of Keras 3 `fit` on TF's runtime.

Every worker process runs the user's own script and `model.fit` on its compute device (its
GPU when it has one). The model's variables are mirrors (`tfdist.ps.variables`) of master
variables spread over the ps tasks by size; each ps task runs the updater of its own shard
(`tfdist.ps.service`), applying the user's Keras optimizer, rebuilt there from its config.

A training step of a worker is one push-and-receive per ps task: it pushes its gradients for
the shard (with the non-trainable state, BatchNorm statistics), tagged with the global step
of the weights it computed them on, and takes the reply: the shard's weights after the update
its push joined, the new global step and the telemetry. Model averaging pushes the model
every `period` steps instead, on the same engine.
"""

import atexit
import logging
import threading
import time
import typing

import keras
import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.cluster.network import CONNECT_TIMEOUT_ENV
from tfdist.cluster.network import INIT_TIMEOUT_ENV
from tfdist.cluster.network import timeout_from_env
from tfdist.compression import sparsify
from tfdist.compression import state as compression_state
from tfdist.compression.base import sum_payload_bytes
from tfdist.compression.exchange import compression_logs
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps.client import RunError
from tfdist.ps.client import ShardClient
from tfdist.ps.connection import PSConnection
from tfdist.ps.policies import AsyncPolicy
from tfdist.ps.policies import SoftSyncPolicy
from tfdist.ps.service import push_key
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import replica_step
from tfdist.strategies.outer_optimizer import OuterOptimizer
from tfdist.strategies.worker_tasks import BetweenGraphExtendedMixin
from tfdist.strategies.worker_tasks import WorkerTasksMixin

log = logging.getLogger("tfdist")

GRADIENTS, AVERAGING = "gradients", "averaging"


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"`{name}` must be a positive number of seconds. Received: {value!r}")


def push_compressor(compression):
    """The compressor for the ps push path, or None; refuses those that need all-reduce."""
    compressor = compression_lib.get(compression)
    if compressor is not None and compressor.aggregate != "sum":
        allowed = [name for name in compression_lib.names()
                   if compression_lib.get(name).elementwise
                   and compression_lib.get(name).aggregate == "sum"]
        raise ValueError(
            f"`compression`={compressor.name!r} combines the replicas' payloads by "
            f"{compressor.aggregate}, which every replica takes from all the others (an "
            f"all-gather); a ps averages the pushes it decodes. Allowed here: {allowed}")
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


def check_optimizer(optimizer, mode, strategy_name):
    """Refuses the optimizer features the parameter-server engine cannot give their meaning."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "use_ema", False):
        raise ValueError(
            "`use_ema=True` is not supported by the tfdist parameter-server strategies: at the "
            "end of `fit` Keras would write one worker's moving average into the shared "
            "weights the others train. Compile with `use_ema=False`, and keep an average of "
            "the weights in a callback on the chief if you need one")
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if mode == GRADIENTS and steps and steps > 1:
        raise ValueError(
            f"`gradient_accumulation_steps={steps}` is not supported by "
            f"{strategy_name}: each push is one update on the ps. For a larger "
            "effective batch use a larger batch per worker, or aggregate more workers per "
            "update (`replicas_to_aggregate`)")
    iterations = getattr(getattr(inner, "_iterations", None), "_value", None)
    if mode == GRADIENTS and iterations is not None and not isinstance(iterations,
                                                                       MirrorVariable):
        raise ValueError(
            f"the optimizer {type(inner).__name__} was created outside the scope of "
            f"{strategy_name}: its step counter and slots would stay with each worker instead "
            "of living on the ps tasks (and in the chief's checkpoints). Create it, and "
            "compile the model, inside `with strategy.scope():`")


class _Part(typing.NamedTuple):
    """The rows of a mirror that one ps task holds (`rows` None: the whole variable)."""

    variable: MirrorVariable
    rows: tuple = None

    @property
    def shape(self):
        shape = self.variable.shape.as_list()
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return shape

    def take(self, tensor):
        """This part of `tensor`, a value (or gradient) of the whole variable; of a sparse
        gradient (`tf.IndexedSlices`), the slices of this part's rows, renumbered."""
        if self.rows is None:
            return tensor
        begin, end = self.rows
        if isinstance(tensor, tf.IndexedSlices):
            mine = tf.logical_and(tensor.indices >= begin, tensor.indices < end)
            return tf.IndexedSlices(tf.boolean_mask(tensor.values, mine),
                                    tf.boolean_mask(tensor.indices, mine) - begin,
                                    dense_shape=self.shape)
        return tf.convert_to_tensor(tensor)[begin:end]


class _Step:
    """What one call of the replica function (a trace, or an eager step) did."""

    def __init__(self):
        self.expected = None    # gradients in the last batch all-reduce
        self.recorded = []      # (variable, gradient) of the optimizer's updates
        self.pushed = False
        self.trained = False    # the optimizer updated variables (model averaging)


class ParameterServerExtended(BetweenGraphExtendedMixin, _tf_compat.OneDeviceExtended):
    """The engine of the parameter-server strategies (one replica per worker process).

    Args:
      container_strategy: the public strategy.
      make_policy: `num_workers -> policy`.
      mode: `"gradients"` (a push per step) or `"averaging"` (the model every `period`).
      period, average_optimizer_state, outer_optimizer: model averaging's settings
        (`outer_optimizer`: the Keras config of `outer_optimizer_config`, or None).
      cluster, init_timeout, connect_timeout, inter_op_threads, compression,
        variable_partitioner: as documented on `SoftSyncStrategy`.
    """

    def __init__(self, container_strategy, make_policy, cluster=None, init_timeout=None,
                 connect_timeout=None, inter_op_threads=1, compression=None,
                 mode=GRADIENTS, period=1, average_optimizer_state=False,
                 variable_partitioner=placement.AUTO, outer_optimizer=None):
        compressor = push_compressor(compression)
        partitioner = placement.check_partitioner(variable_partitioner)
        # None: what the launcher exported (600 s in Kubernetes pods), else 60 / 30 s.
        if init_timeout is None:
            init_timeout = timeout_from_env(INIT_TIMEOUT_ENV, 60.0)
        if connect_timeout is None:
            connect_timeout = timeout_from_env(CONNECT_TIMEOUT_ENV, 30.0)
        for name, value in (("init_timeout", init_timeout),
                            ("connect_timeout", connect_timeout)):
            _check_positive(name, value)
        config = PSConnection.validate(cluster)
        policy = make_policy(config.num_workers)
        connection = PSConnection(config, connect_timeout=connect_timeout,
                                  inter_op_threads=inter_op_threads)
        super().__init__(container_strategy, connection.compute_device)
        self._connection = connection
        self._policy = policy
        self._mode = mode
        self._period = period
        self._average_optimizer_state = average_optimizer_state
        self._outer = None if outer_optimizer is None else OuterOptimizer(outer_optimizer)
        self._init_timeout = init_timeout
        self._compressor = compressor
        self._partitioner = partitioner
        self._placement = None
        self._mirrors = []
        self._paths = {}
        self._tls = threading.local()
        self._clients = None
        self._shards = None
        self._optimizer = None
        self._left = False
        self._bases = {}  # model averaging with compression: each shard's last average
        # Each push unit's error-feedback residual (and other codec state), kept with the
        # optimizer so that Keras files and checkpoints save it (one replica: this worker).
        self._codec_states = (None if compressor is None else compression_state.StateRegistry(
            container_strategy, compressor, lambda: connection.rank))
        num_ps, host = connection.num_ps, connection.host_device
        with tf.init_scope(), tf.device(host):
            # The global step of each shard's weights this worker holds (its pushes' tags).
            self._tags = tf.Variable(tf.zeros([num_ps], tf.int64), trainable=False,
                                     name="tfdist_tags")
            self._stats = tf.Variable(tf.zeros([protocol.num_stats(connection.num_workers)],
                                               tf.int64), trainable=False, name="tfdist_stats")
            self._bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="tfdist_bytes_sent")
            # What this worker sent and received on the wire in its last round trips, and
            # the same with its pushes dense (`bytes_on_wire` / `bytes_on_wire_dense`).
            self._wire = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                     name="tfdist_wire_bytes")
            self._local_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="tfdist_local_steps")
            self._round_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="tfdist_round_steps")
        atexit.register(self.leave)

    # Variables ---------------------------------------------------------------------------

    def _role(self, kwargs, optimizer):
        """What a push does with a new variable (made by `optimizer`, a Keras optimizer or
        None); None keeps it local to this worker."""
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        if self._outer is not None and self._outer.building:
            return protocol.OPTIMIZER  # the outer optimizer's state lives on the ps tasks
        if self._mode == AVERAGING:
            if optimizer is not None and not self._average_optimizer_state:
                return None
            return protocol.AVERAGE if dtype.is_floating else None
        if optimizer is not None:
            # A LossScaleOptimizer's scale is each worker's own (it scales its own loss).
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                return None
            return protocol.OPTIMIZER
        if not dtype.is_floating:
            return None
        return protocol.GRADIENT if kwargs.get("trainable", True) else protocol.VALUE

    def _create_variable(self, next_creator, **kwargs):
        if self._codec_states is not None:
            self._codec_states.attach(_tf_compat.keras_optimizer_in_scope())
        if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                or self._clients is not None):
            # Metric state, and anything made after the run started, stays with the worker.
            return super()._create_variable(next_creator, **kwargs)
        with tf.init_scope():
            initial_value = kwargs.get("initial_value")
            if callable(initial_value):
                initial_value = initial_value()
            initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
        kwargs["initial_value"] = initial_value
        kwargs.setdefault("dtype", initial_value.dtype)
        optimizer = _tf_compat.keras_optimizer_in_scope()
        if self._outer is not None and not self._outer.building:
            self._outer.attach(optimizer)  # before a checkpoint restores it: in __init__
        role = self._role(kwargs, optimizer)
        if role is None:
            return super()._create_variable(next_creator, **kwargs)
        colocate_with = kwargs.pop("colocate_with", None)
        path = _tf_compat.keras_variable_path((kwargs.get("name") or "Variable").split(":")[0])
        count = self._paths.get(path, 0)
        self._paths[path] = count + 1
        if count:
            path = f"{path}#{count}"
        with tf.init_scope(), tf.device(self._device):
            variable = MirrorVariable.create(path, role, **kwargs)
        # Placed when the run starts (`tfdist.ps.placement`), once the optimizer is known.
        variable._tfdist_colocate = (colocate_with._tfdist_path
                                     if isinstance(colocate_with, MirrorVariable) else None)
        # The optimizer's own variables (its step counter, learning rate): a copy on every
        # ps task, each task's optimizer uses its own; worker 0 initialises them all,
        # checkpoints read ps task 0's, its writes (a callback's new learning rate) go to all.
        variable._tfdist_everywhere = (role == protocol.OPTIMIZER
                                       and variable._tfdist_colocate is None)
        self._mirrors.append(variable)
        return variable

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable

    # The step ----------------------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        step = _Step()
        previous = getattr(self._tls, "step", None)
        self._tls.step = step
        try:
            with replica_step():
                result = super()._call_for_each_replica(fn, args, kwargs)
                if self._mode == AVERAGING and step.trained and previous is None:
                    self._count_local_step()
        finally:
            self._tls.step = previous
        if previous is not None:
            # A nested call (a LossScaleOptimizer applies in its own replica call): the
            # outer step's logs tell what it did.
            previous.pushed = previous.pushed or step.pushed
            previous.trained = previous.trained or step.trained
            return result
        if not (step.pushed or step.trained) or not isinstance(result, dict):
            return result
        return {**result, **self._logs()}

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        step = getattr(self._tls, "step", None)
        if step is not None:
            # Keras all-reduces the gradients, then updates each variable: the updates that
            # follow tell which variable each gradient belongs to.
            step.expected = len(value_destination_pairs)
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)

    def _update(self, var, fn, args, kwargs, group):
        step = getattr(self._tls, "step", None)
        if step is None:
            return super()._update(var, fn, args, kwargs, group)
        if self._mode == AVERAGING:
            if len(args) == 2 and self._optimizer is None:
                self._optimizer = _tf_compat.keras_optimizer_in_scope()
                if self._optimizer is not None:
                    check_optimizer(self._optimizer, self._mode,
                                    type(self._container_strategy()).__name__)
                    if self._outer is not None:
                        self._outer.attach(self._optimizer)
            step.trained = step.trained or len(args) == 2
            return super()._update(var, fn, args, kwargs, group)
        # A worker's optimizer step is the ps's job: the gradient is recorded, and pushed
        # once the last gradient of the all-reduce has its variable.
        if len(args) == 2 and step.pushed:
            raise ValueError(
                "a second optimizer update in one train step: tfdist parameter-server "
                "strategies push one `optimizer.apply` per step (a train step with two "
                "optimizers, as in a GAN, is not supported)")
        if len(args) == 2:
            step.recorded.append((var, args[0]))
            if len(step.recorded) == step.expected:
                self._push_gradients(step)
        return var if group else (var,)

    # Joining a run -----------------------------------------------------------------------

    def _ensure_run(self, pushed_variables=(), sparse_variables=()):
        """At the first training trace: joins (or starts) the run on every ps task.

        `sparse_variables` are pushed as the rows their gradient touches (embeddings)."""
        if self._clients is not None:
            return
        pushed = {id(v) for v in pushed_variables}
        sparse = {id(v) for v in sparse_variables}
        outer = self._build_outer() if self._outer is not None else set()
        num_ps = self._connection.num_ps
        options = {}
        for variable in self._mirrors:
            if variable._tfdist_role == protocol.GRADIENT and id(variable) not in pushed:
                variable._tfdist_role = protocol.VALUE  # trainable, but no gradient reaches it
            if variable._tfdist_role == protocol.GRADIENT and self._mode == GRADIENTS:
                options[id(variable)] = self._update_options(variable)
        self._placement = self._plan(options)
        entries = [[] for _ in range(num_ps)]
        self._shards = [[] for _ in range(num_ps)]
        for variable in self._mirrors:
            role = variable._tfdist_role
            entry = {"path": variable._tfdist_path, "shape": variable.shape.as_list(),
                     "dtype": variable.dtype.name, "role": role, **options.get(id(variable), {})}
            if id(variable) in sparse and role == protocol.GRADIENT:
                entry["sparse"] = True
            if id(variable) in outer:
                entry["outer"] = True
            for shard, rows in self._placement[variable._tfdist_path]:
                part = _Part(variable, rows)
                entries[shard].append({**entry, "shape": part.shape,
                                       "rows": None if rows is None else list(rows)})
                if role in protocol.PUSHED_ROLES:
                    self._shards[shard].append(part)
        for parts in self._shards:
            order = {protocol.GRADIENT: 0, protocol.AVERAGE: 0, protocol.VALUE: 1}
            parts.sort(key=lambda p: order[p.variable._tfdist_role])
        clients = [ShardClient(self._connection, s) for s in range(num_ps)]
        answers = []
        with tf.init_scope():
            for shard, client in enumerate(clients):
                answers.append(client.hello(self._spec(shard, entries[shard]),
                                            timeout=self._init_timeout))
            if any(a["initialize"] for a in answers):
                log.info("tfdist: %s initialises the run's master variables",
                         self._connection.task_name)
            mirrors = {v._tfdist_path: v for v in self._mirrors}
            with replica_step():  # the chief's own values, read before any is bound
                initial = ({path: v.read_value() for path, v in mirrors.items()}
                           if any(a["initialize"] for a in answers) else {})
            for shard, (client, answer) in enumerate(zip(clients, answers)):
                for path, places in self._placement.items():
                    variable = mirrors[path]
                    for rows in (rows for s, rows in places if s == shard):
                        master = client.masters[path]
                        if answer["initialize"]:
                            master.assign(_Part(variable, rows).take(initial[path]),
                                          read_value=False)
                        variable.bind(master, rows)
                        if not self._connection.is_chief:
                            # Every worker runs the user's callbacks; only the chief's eager
                            # writes reach the masters (a learning rate halved once, not
                            # once per worker; one worker's best weights restored, not
                            # each one's).
                            variable.follow()
            self._clients = clients
            self._layouts = [protocol.ShardLayout(e) for e in entries]
            for client, layout in zip(clients, self._layouts):
                dtypes = (protocol.compressed_push_dtypes(layout, self._compressor)
                          if self._compressor else [tf.float32])
                client.open_push_queue(dtypes, len(layout.sparse))
            self._pull()

    def _build_outer(self):
        """Model averaging with an outer optimizer: builds this worker's copy of it, whose
        variables are mirrors of masters, on the variables the model's optimizer trains;
        returns their ids. The rest (BatchNorm statistics, the optimizer's slots under
        `optimizer_state="averaged"`) is averaged plainly."""
        inner = getattr(self._optimizer, "inner_optimizer", self._optimizer)
        trained = [v for v in getattr(inner, "_trainable_variables", None) or []
                   if isinstance(getattr(v, "_value", None), MirrorVariable)
                   and v._value._tfdist_role == protocol.AVERAGE]
        if not trained:
            raise ValueError(
                "`outer_optimizer` applies to the variables the model's Keras optimizer "
                "trains, and this train step trains none under the strategy's scope: train "
                "with `model.fit` (or `optimizer.apply`) on a model built and compiled inside "
                "`with strategy.scope():`")
        with tf.init_scope(), self._container_strategy().scope():
            self._outer.build(trained)
        return {id(v._value) for v in trained}

    def _plan(self, options):
        """`{path: [(ps_index, rows)]}`: where each mirror's master parts live."""
        partitioner = self._partitioner
        # Averaging is elementwise; an outer optimizer's update must be too.
        if self._mode == AVERAGING:
            applied, role = (None, None) if self._outer is None else (
                self._outer.optimizer, "the outer optimizer is")
        else:
            applied, role = self._optimizer, "the model trains with"
        elementwise = applied is None or placement.elementwise_optimizer(applied)
        if not elementwise and partitioner not in (None, placement.AUTO):
            inner = getattr(applied, "inner_optimizer", applied)
            raise ValueError(
                f"`variable_partitioner` splits variables over ps tasks, which is exact only "
                f"for an optimizer whose update is elementwise "
                f"({sorted(placement.ELEMENTWISE_OPTIMIZERS)}); {role} "
                f"{type(inner).__name__}. Pass `variable_partitioner=None`")
        items = []
        for variable in self._mirrors:
            constraint = options.get(id(variable), {}).get("constraint")
            splittable = elementwise and (
                constraint is None or constraint.get("class_name") == "NonNeg")
            items.append(placement.Item(
                variable._tfdist_path, variable.shape.as_list(), variable.dtype,
                splittable=splittable, everywhere=variable._tfdist_everywhere,
                colocate_with=variable._tfdist_colocate))
        return placement.plan(items, self._connection.num_ps, partitioner)

    def placement(self):
        """Where the masters live, per ps task: `task`, `variables` (`{path: rows}`, rows
        `[begin, end]` of a part or None for the whole variable), `bytes_held` (with the
        optimizer's slots) and `bytes_pushed` (what one push of a worker carries there; for
        an embedding pushed as rows, its whole size: the most a push can carry)."""
        if self._clients is None:
            raise ValueError("the masters are placed when the first training step starts")
        out = [{"task": name, "variables": {}, "bytes_held": 0, "bytes_pushed": 0}
               for name in self._connection.ps_names]
        mirrors = {v._tfdist_path: v for v in self._mirrors}
        for path, places in self._placement.items():
            for shard, rows in places:
                part = _Part(mirrors[path], rows)
                out[shard]["variables"][path] = None if rows is None else list(rows)
                out[shard]["bytes_held"] += placement.nbytes(part.shape, part.variable.dtype)
        for shard, layout in enumerate(self._layouts):
            out[shard]["bytes_pushed"] = 4 * (layout.main_size + layout.value_size)
        return out

    def _update_options(self, variable):
        """What the ps-side optimizer must know of a trained variable: its Keras constraint,
        and whether weight decay skips it (`exclude_from_weight_decay`)."""
        inner = getattr(self._optimizer, "inner_optimizer", self._optimizer)
        keras_variables = {id(getattr(kv, "_value", None)): kv
                           for kv in getattr(inner, "_trainable_variables", [])}
        keras_variable = keras_variables.get(id(variable))
        if keras_variable is None:
            return {}
        options = {}
        if getattr(inner, "weight_decay", None) and not inner._use_weight_decay(keras_variable):
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

    def _spec(self, shard, entries):
        config = self._connection.config
        optimizer = outer = None
        applied = []  # the optimizers the ps tasks rebuild: they import a custom one's module
        if self._mode == GRADIENTS:
            optimizer = keras.optimizers.serialize(self._optimizer)
            applied.append(self._optimizer)
        if self._outer is not None:
            outer = self._outer.config
            applied.append(self._outer.optimizer)
        imports = [module for module in (type(o).__module__ for o in applied)
                   if not module.startswith("keras.")]
        policy = self._policy.to_spec()
        if ":" in str(policy.get("staleness", "")):
            imports.append(policy["staleness"])
        return {"mode": self._mode, "policy": policy, "num_workers": config.num_workers,
                "worker_tasks": self._connection.training_tasks,
                "worker_addresses": self._connection.training_addresses,
                "num_ps": config.num_ps, "shard": shard, "variables": entries,
                "optimizer": optimizer, "outer_optimizer": outer, "imports": imports,
                "compression": (None if self._compressor is None
                                else compression_lib.serialize(self._compressor)),
                "delta": self._mode == AVERAGING and self._compressor is not None,
                "init_timeout": self._init_timeout}

    def _pull(self):
        """Takes the current master weights of every shard (eagerly)."""
        with tf.init_scope(), replica_step():
            self._assign_replies([client.sync() for client in self._clients])

    def _assign_replies(self, replies):
        """Writes every shard's reply `(token, stats, values)` into the mirrors (the parts of
        a split variable joined), the tags and the telemetry; returns the updates."""
        updates, split = [], {}
        for shard, (_, _, values) in enumerate(replies):
            main, rest = self._layouts[shard].split_reply(values)
            for part, value in zip(self._shards[shard], main + rest):
                if part.rows is None:
                    updates.append(part.variable.assign(value, read_value=False))
                else:
                    split.setdefault(id(part.variable), (part.variable, []))[1].append(
                        (part.rows, value))
            if self._compressor is not None and self._mode == AVERAGING:
                updates.append(self._base(shard).assign(
                    values[:self._layouts[shard].main_size]))
        for variable, parts in split.values():
            parts.sort(key=lambda p: p[0])
            updates.append(variable.assign(tf.concat([v for _, v in parts], axis=0),
                                           read_value=False))
        updates.append(self._tags.assign(tf.stack([token for token, _, _ in replies]),
                                         read_value=False))
        updates.append(self._stats.assign(replies[0][1], read_value=False))
        return updates

    # Pushing -----------------------------------------------------------------------------

    def _push_gradients(self, step):
        step.pushed = True
        variables = [v for v, _ in step.recorded]
        if self._left:
            raise ValueError(f"{self._connection.task_name} has left the run "
                             "(`strategy.join()`): it cannot train any more")
        optimizer = _tf_compat.keras_optimizer_in_scope()
        if self._optimizer is None:
            self._optimizer = optimizer
            if optimizer is None:
                raise ValueError(
                    "tfdist parameter-server strategies train with a Keras optimizer inside "
                    "`model.fit` (or `optimizer.apply` in `strategy.run`)")
            check_optimizer(optimizer, self._mode, type(self._container_strategy()).__name__)
            warning = sparsify.momentum_applied_twice(self._compressor, optimizer)
            if warning:  # (the pushes are gradients: the ps applies the optimizer to them)
                log.warning("tfdist: %s", warning)
        elif optimizer is not self._optimizer:
            raise ValueError(
                "the train step applies another optimizer than the run's first (the model "
                "was compiled again?): the ps tasks apply the optimizer the run started with. "
                "Compile once per strategy")
        unknown = [v.name for v in variables if not isinstance(v, MirrorVariable)]
        if unknown:
            raise ValueError(f"these trained variables were not created under the strategy's "
                             f"scope: {unknown}. Build the model and compile it inside "
                             "`with strategy.scope():`")
        # Without compression, an embedding's gradient travels as the rows it touches; a
        # compressor codes dense vectors.
        sparse = [v for v, g in step.recorded if isinstance(g, tf.IndexedSlices)]
        self._ensure_run(variables, sparse if self._compressor is None else ())
        frozen = [v._tfdist_path for v in variables if v._tfdist_role != protocol.GRADIENT]
        if frozen:
            raise ValueError(
                f"the train step trains {frozen}, which the run's first step did not train "
                "(unfrozen after training began?); the ps tasks keep the variables the run "
                "started with as state. Set `trainable` before the first `fit`")
        pushed_sparse = {id(p.variable) for layout, parts in zip(self._layouts, self._shards)
                         for p, e in zip(parts, layout.main) if e.get("sparse")}
        dense = [v._tfdist_path for v in sparse if id(v) not in pushed_sparse]
        if dense and not getattr(self, "_warned_sparse", False):
            self._warned_sparse = True
            log.warning("tfdist: the gradients of %s are sparse (embedding rows) but are "
                        "pushed dense, the whole variable each step (a compressor codes dense "
                        "vectors; or the run's first trace gave them dense)", dense)
        # A sparse gradient pushed dense is made dense once, not once per part.
        gradients = {id(v): g if id(v) in pushed_sparse or not isinstance(g, tf.IndexedSlices)
                     else tf.convert_to_tensor(g) for v, g in step.recorded}
        missing = sorted({p.variable._tfdist_path for s in self._shards for p in s
                          if p.variable._tfdist_role == protocol.GRADIENT
                          and id(p.variable) not in gradients})
        if missing:
            raise ValueError(f"the train step pushed no gradient for {missing}, which an "
                             "earlier trace trained; every trace must train the same variables")
        self._exchange(lambda part: part.take(gradients[id(part.variable)]))

    def _exchange(self, main_tensor):
        """One push-and-receive per ps task, in parallel; the replies land in the mirrors."""
        updates, sent, pushed_values = [], [], []
        # One read of every shard's tag before any push: a read per shard after the previous
        # shard's reply was written would make each round trip wait for the one before.
        tags = tf.unstack(self._tags.read_value())
        replies = []
        for shard, client in enumerate(self._clients):
            layout = self._layouts[shard]
            parts = self._shards[shard]
            tensors = [main_tensor(p) for p in parts[:len(layout.main)]]
            main = protocol.ShardLayout.flatten(
                [t for t, e in zip(tensors, layout.main) if not e.get("sparse")])
            rows = [protocol.sparse_rows(t, e)
                    for t, e in zip(tensors, layout.main) if e.get("sparse")]
            values = protocol.ShardLayout.flatten(
                [p.take(p.variable.read_value()) for p in parts[len(layout.main):]])
            tag = tags[shard]
            pushed_values.append(values)
            payload, state_updates = (main, *[c for pair in rows for c in pair]), []
            if self._compressor is not None:
                payload, state_updates = self._compress(shard, main, tag)
                sent.append(payload)
            # Shards do not wait for each other: their round trips overlap.
            with tf.control_dependencies(state_updates):
                replies.append(client.push_and_receive(tag, payload, values))
        updates += self._assign_replies(replies)
        if sent:
            payload_bytes = sum_payload_bytes(sent)
            updates.append(self._bytes_sent.assign(payload_bytes))
            updates.append(self._wire.assign(self._wire_bytes(payload_bytes, pushed_values,
                                                              replies)))
        return tf.group(updates)

    def _wire_bytes(self, payload_bytes, pushed_values, replies):
        """`[compressed, dense]` bytes of this worker's round trips to every ps task: each
        push (its tag and rank, the state values it carries, the payload) and each reply
        (its token, progress and the worker's shard of the model: replies are never
        compressed, so the push path's ratio is at most about 2x)."""
        header = 16 + 8 * (1 + protocol.num_stats(self._connection.num_workers))
        common = tf.constant(header * len(self._clients), tf.int64)
        for values, (_, _, reply) in zip(pushed_values, replies):
            common += 4 * (tf.size(values, out_type=tf.int64)
                           + tf.size(reply, out_type=tf.int64))
        dense = 4 * sum(layout.main_size for layout in self._layouts)
        return tf.stack([common + payload_bytes, common + dense])

    def _compress(self, shard, flat, tag):
        """Compresses this worker's part for `shard`, variable by variable where the codec's
        scale is each tensor's own (`protocol.push_units`). The residuals stay with the
        worker, in its optimizer's `CompressionState`, keyed by the parts' paths (and rows)."""
        compressor = self._compressor
        layout = self._layouts[shard]
        units, _ = protocol.push_units(layout, compressor)
        state = self._codec_states.state_of(self._optimizer)
        states = []
        for unit in units:
            size = sum(layout.main_sizes[i] for i in unit)
            paths = tuple(layout.main[i]["path"] + (
                "" if layout.main[i].get("rows") is None else
                "@{}:{}".format(*layout.main[i]["rows"])) for i in unit)
            variables = state.get(
                ("unit", paths, (size,)),
                lambda size=size: compressor.initial_state([size], tf.float32),
                replicated=compressor.replicated_state)
            states.append({name: components[0] for name, components in variables.items()})
        key = push_key(tag, self._connection.rank, shard, self._connection.num_workers)
        payload, new_states = protocol.encode_push(
            layout, compressor, flat, [{n: v.read_value() for n, v in unit.items()}
                                       for unit in states], key)
        return payload, [unit[n].assign(new[n]) for unit, new in zip(states, new_states)
                         for n in unit]

    def _base(self, shard):
        """Model averaging with compression: the shard's model at the last average."""
        if shard not in self._bases:
            size = self._layouts[shard].main_size
            with tf.init_scope(), tf.device(self._device):
                self._bases[shard] = tf.Variable(tf.zeros([size]), trainable=False,
                                                 name="tfdist_base")
        return self._bases[shard]

    # Model averaging ------------------------------------------------------------------------

    def _count_local_step(self):
        if self._clients is None:
            self._ensure_run()
        count = self._local_steps.assign_add(1)
        since = self._round_steps.assign_add(1)
        with tf.control_dependencies([since]):
            tf.cond(tf.equal(count % self._period, 0), self._average, tf.no_op)

    def _average(self):
        """Pushes this worker's model (or its change), and takes the round's average."""
        def model_part(part):
            return part.take(part.variable.read_value())

        if self._compressor is None:
            done = self._exchange(model_part)
        else:
            offsets = {}
            for shard, parts in enumerate(self._shards):
                start = 0
                for part in parts:
                    size = int(np.prod(part.shape))
                    offsets[id(part)] = (shard, start, size)
                    start += size

            def change(part):
                shard, start, size = offsets[id(part)]
                base = self._base(shard).read_value()[start:start + size]
                return tf.reshape(tf.cast(model_part(part), tf.float32), [-1]) - base

            done = self._exchange(change)
        with tf.control_dependencies([done]):
            return tf.group(self._round_steps.assign(0))

    # Logs ------------------------------------------------------------------------------------

    def _logs(self):
        stats = self._stats.read_value()
        if self._mode == AVERAGING:
            logs = {"averaging_round": stats[protocol.STAT_STEP],
                    "dropped_models": stats[protocol.STAT_DROPPED]}
        else:
            logs = {"global_step": stats[protocol.STAT_STEP],
                    "dropped_gradients": stats[protocol.STAT_DROPPED]}
        if self._policy.measures_staleness:
            aggregated = tf.maximum(stats[protocol.STAT_AGGREGATED], 1)
            logs["staleness_mean"] = (tf.cast(stats[protocol.STAT_STALENESS_SUM], tf.float32)
                                      / tf.cast(aggregated, tf.float32))
            logs["staleness_max"] = stats[protocol.STAT_STALENESS_MAX]
        if self._compressor is not None:
            dense = 4 * sum(layout.main_size for layout in self._layouts)
            wire = self._wire.read_value()
            logs.update(compression_logs({"bytes_sent": self._bytes_sent.read_value(),
                                          "bytes_dense": tf.constant(dense, tf.int64),
                                          "bytes_on_wire": wire[0],
                                          "bytes_on_wire_dense": wire[1]}))
        return logs

    # Lifecycle ---------------------------------------------------------------------------

    def leave(self, wait=False, timeout=None):
        """Ends this worker's part in training.

        Model averaging first pushes the steps taken since the last round. With `wait`
        (the chief's `join()`), leaves, then waits until every other worker has left or
        died, so that the weights this worker then takes are final. The local model ends on
        the master weights. Called at exit (without waiting).
        """
        if self._left:
            return
        self._left = True
        try:
            if self._clients is None:
                for shard in range(self._connection.num_ps):
                    ShardClient(self._connection, shard).absent()
                return
            if self._mode == AVERAGING and int(self._round_steps.numpy()):
                # The steps since the last round make one more round (a period longer than
                # the run makes only this one).
                def last_round():
                    self._average()  # a tf.function returns tensors, not the round's op

                with replica_step():
                    tf.function(last_round)()
            if not wait:
                try:
                    self._pull()
                finally:
                    self._send_leave()
                return
            # Leave first: a worker whose last push waits for a partner must not wait for
            # this one. Once the others are gone nothing changes the masters: read them.
            self._send_leave()
            self._wait_for_others(timeout)
            self._take_masters()
        except (tf.errors.OpError, RunError) as e:
            gone = self._connection.unreachable_ps()
            if not gone:
                log.warning("tfdist: %s could not leave the run cleanly: %s",
                            self._connection.task_name, e)
                return
            log.error("tfdist: %s stopped answering: its shard of the master variables is "
                      "gone, and no worker can train on without it (TensorFlow's "
                      "UnavailableError above is that). Restart the job; the chief's last "
                      "checkpoint holds the model",
                      ", ".join(f"{name} at {address}" for name, address in gone))

    def _send_leave(self):
        for client in self._clients:
            try:
                client.send_control(protocol.LEAVE)
            except tf.errors.OpError:
                pass  # the run has ended (its queues are closed)

    def _take_masters(self):
        with tf.init_scope(), replica_step():
            variables = {id(p.variable): p.variable for parts in self._shards for p in parts}
            for variable in variables.values():
                variable.assign(variable.master_value(), read_value=False)
            self._stats.assign(self._clients[0].progress.read_value(), read_value=False)

    def _wait_for_others(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        me = self._connection.rank
        while True:
            live = set(self._clients[0].read_progress()["live"]) - {me}
            if not live:
                return
            if deadline is not None and time.monotonic() > deadline:
                log.warning("tfdist: %s stops waiting for %s after %g s",
                            self._connection.task_name,
                            [self._connection.training_tasks[r] for r in sorted(live)], timeout)
                return
            time.sleep(0.1)

    def compression_states(self):
        """The codec states (push residuals) of the optimizers made under this strategy."""
        return [] if self._codec_states is None else self._codec_states.states()

    def reset_compression_state(self):
        if self._codec_states is not None:
            self._codec_states.reset()

    def progress(self):
        if self._clients is None:
            return protocol.progress_dict([0] * protocol.num_stats(self._connection.num_workers),
                                          self._connection.num_workers)
        return self._clients[0].read_progress()



class ParameterServerStrategyBase(WorkerTasksMixin, tf.distribute.Strategy):
    """Shared public surface of the tfdist parameter-server strategies (the chief also
    initialises the run)."""

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
        """Ends this worker's training; the model then holds the master weights.

        On the chief, first waits until every other worker has left or died (at most
        `timeout` seconds, None: as long as they are alive), so that the weights are final.
        """
        self.extended.leave(wait=self.is_chief, timeout=timeout)

    def reset_compression_state(self):
        """Sets this worker's codec state (the push's error-feedback residuals) back to zero.

        The state is saved and restored with the optimizer (`model.save`, ModelCheckpoint,
        BackupAndRestore, `tf.train.Checkpoint`): reset it when the model is given weights
        that the residuals do not belong to.
        """
        self.extended.reset_compression_state()

    def placement(self):
        """Where the master variables live, once training has started: a list with, per ps
        task, `task`, `variables` (`{path: [begin, end]}` for a part of a variable split
        by rows, `{path: None}` for a whole one), `bytes_held` (with the optimizer's slots)
        and `bytes_pushed` (what one push of a worker carries to that task, uncompressed;
        model averaging pushes every `period` steps)."""
        return self.extended.placement()

    def progress(self):
        """The telemetry of ps task 0: global_step, dropped_gradients, aggregated_gradients,
        staleness_mean, staleness_max, staleness_histogram, max_clock_gap, and the workers
        `live`, `left` and `dead`."""
        return self.extended.progress()


class SoftSyncStrategy(ParameterServerStrategyBase):
    """n-soft synchronous training through parameter servers (TF1 `SyncReplicasOptimizer`).

    Each update averages the first `replicas_to_aggregate` (N) fresh gradients of the M
    workers; gradients computed at an older global step are dropped and counted. N = M is hard
    synchronous training; N < M gives M - N backup workers, so that slow or dead workers (the
    chief included) do not hold the others back. The user's Keras optimizer is applied once
    per update, on the ps tasks, each to its own shard of the variables.

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
        or None to read TF_CONFIG. It needs at least one ps task, served by
        `tfdist-launch --job_name=ps`.
      init_timeout: seconds the ps tasks wait for the chief to initialise a new run (and for
        every worker's server to answer once). None: the environment's
        `TFDIST_INIT_TIMEOUT` (set by `tfdist-launch --connect_timeout`; 600 s in the pods
        of its Kubernetes manifests), else 60.
      connect_timeout: seconds the ps tasks get to start listening. None: the environment's
        `TFDIST_CONNECT_TIMEOUT` (set the same way), else 30.
      inter_op_threads: inter-op threads of this worker's TF executor (None: TF's default).
        One is fastest when per-step latency dominates (small models, shared cores).
      compression: a `tfdist.compression` compressor (or its name / config) for the push:
        each worker encodes its gradient (keeping its own error-feedback residual) and each
        ps task decodes its shard. The logs then carry `bytes_sent`, `bytes_dense` and
        `compression_ratio`. Compressors that need all-reduce rounds (PowerSGD) are refused.
      variable_partitioner: how large variables are split by rows over the ps tasks, so
        that each task carries a fair share of the traffic and the updates: "auto" (the
        default) splits a variable larger than 256 KiB, or than a quarter of one ps task's
        fair share of the model (and than 256 bytes), into parts of about that size or
        less, one part per ps task at most; a
        `tf.distribute.experimental.partitioners.Partitioner` (e.g.
        `FixedShardsPartitioner(2)`) decides per variable, along the first axis; None keeps
        every variable whole. Splitting is exact for elementwise optimizers (SGD, Adam,
        AdamW, RMSprop, ...); with another one (Lamb, Adafactor, a custom class) "auto"
        keeps every variable whole and a partitioner is refused at the first training step
        (when the optimizer is known). A variable with a
        constraint other than `NonNeg` stays whole. Checkpoints hold whole variables
        either way. `strategy.placement()` tells where every part lives.

    Raises:
      ValueError: `replicas_to_aggregate` is not between 1 and the number of workers, the
        cluster has no ps task, or this task is not a chief / worker.
      TaskUnreachableError: a ps task did not answer within `connect_timeout`.
    """

    def __init__(self, replicas_to_aggregate=None, cluster=None, init_timeout=None,
                 connect_timeout=None, inter_op_threads=1, compression=None,
                 variable_partitioner="auto"):
        super().__init__(ParameterServerExtended(
            self, n_of_m_policy(SoftSyncPolicy, replicas_to_aggregate), cluster=cluster,
            init_timeout=init_timeout, connect_timeout=connect_timeout,
            inter_op_threads=inter_op_threads, compression=compression,
            variable_partitioner=variable_partitioner))

    @property
    def replicas_to_aggregate(self):
        return self.extended._policy.replicas_to_aggregate


class AsyncStrategy(ParameterServerStrategyBase):
    """Asynchronous SGD through parameter servers, staleness-aware.

    Every worker's gradient becomes an update as soon as the ps takes it, with the user's
    Keras optimizer. The staleness tau of an update (global steps applied between the weights
    its gradient was computed on, which the worker was sent with its last reply, and its own
    application) is measured for every update and reported (`staleness_mean`,
    `staleness_max` in the Keras logs; the histogram in `strategy.progress()`).

    ```python
    strategy = tfdist.strategies.AsyncStrategy(staleness="inverse", max_staleness=8)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    ```

    Args:
      staleness: how the learning rate of an update depends on its staleness: "none" (plain
        async SGD), "inverse" (lr / max(1, tau), Zhang et al. 2016), or a function taking
        the int64 staleness tensor and returning a float factor, traced into the update on
        the ps tasks: it must be importable there (a module-level function).
      max_staleness: None, or a bound s. With `on_stale="drop"` a gradient staler than s
        is dropped, counted, and its worker goes on from the current weights; with
        `on_stale="wait"` (stale synchronous parallel) a worker more than s pushes ahead of
        the slowest live worker waits for it.
      delay_compensation: None, or lambda of delay-compensated ASGD (Zheng et al. 2017):
        g + lambda * g * g * (w_now - w_read), where w_read are the weights the worker was
        sent with its last reply (kept per worker on each ps task).
      on_stale: "drop" or "wait", see `max_staleness`.
      cluster, init_timeout, connect_timeout, inter_op_threads, compression,
        variable_partitioner: as for `SoftSyncStrategy`.
    """

    def __init__(self, staleness="none", max_staleness=None, delay_compensation=None,
                 on_stale="drop", cluster=None, init_timeout=None, connect_timeout=None,
                 inter_op_threads=1, compression=None, variable_partitioner="auto"):
        policy = AsyncPolicy(staleness, max_staleness, delay_compensation, on_stale)
        super().__init__(ParameterServerExtended(
            self, lambda total: policy, cluster=cluster, init_timeout=init_timeout,
            connect_timeout=connect_timeout, inter_op_threads=inter_op_threads,
            compression=compression, variable_partitioner=variable_partitioner))

    @property
    def policy(self):
        return self.extended._policy
