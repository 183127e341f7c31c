"""The worker side of the parameter-server engine: one replica per worker process.

Every worker process runs the user's own script and `model.fit` on its compute device (its
GPU when it has one). The model's variables are mirrors (`tfdist.ps.variables`) of master
variables spread over the ps tasks by size (`tfdist.ps.placement`); each ps task runs the
updater of its own shard (`tfdist.ps.service`).

`ParameterServerExtended` runs the worker's part of a run: joining it (the spec, placement,
binding the mirrors to the masters), each step's push-and-receive with every ps task, pulling
the masters, leaving. This module holds the engine's state, the variables it makes and each
step (the replica call, the push-and-receive, the step's logs); joining the run, reading the
masters and leaving are `WorkerRunMixin`'s (`tfdist.ps.worker_run`). What a step pushes, and
so what a variable is for, is its push's (`tfdist.ps.push`: the gradient, or the model every
`period` steps); the compressed push is `tfdist.ps.push_codec`.
"""

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading

import tensorflow as tf

from tfdist import _tf_compat
from tfdist._args import check_seconds
from tfdist._worker import BetweenGraphExtendedMixin
from tfdist.cluster.network import CONNECT_TIMEOUT_ENV
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT
from tfdist.cluster.network import INIT_TIMEOUT_ENV
from tfdist.cluster.network import JOB_ID_ENV
from tfdist.cluster.network import STALL_TIMEOUT_ENV
from tfdist.cluster.network import timeout_from_env
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps import tables as tables_lib
from tfdist.ps import wire
from tfdist.ps.connection import PSConnection
from tfdist.ps.push_codec import PushCodec
from tfdist.ps.push_codec import push_compressor
from tfdist.ps.table_set import TableRule
from tfdist.ps.table_set import TableSet
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import replica_step
from tfdist.ps.worker_run import WorkerRunMixin

log = logging.getLogger("tfdist")


def job_id(config, environ=None):
    """The id of the job this task belongs to: `TFDIST_JOB_ID` where set (`tfdist-launch` and
    `LocalCluster` set a new one per launch, kept by a restarted task), else one made from
    the cluster's addresses, the same for every task of the cluster and across restarts."""
    environ = os.environ if environ is None else environ
    named = environ.get(JOB_ID_ENV, "").strip()
    if named:
        return named
    cluster = json.dumps({job: list(addresses.values()) if isinstance(addresses, dict)
                          else list(addresses) for job, addresses in config.cluster.items()},
                         sort_keys=True)
    return "cluster-" + hashlib.sha256(cluster.encode()).hexdigest()[:16]


class _Step:
    """What one call of the replica function (a trace, or an eager step) did."""

    def __init__(self):
        self.expected = None    # gradients in the last batch all-reduce
        self.recorded = []      # (variable, gradient) of the optimizer's updates
        self.trained = False    # the step trained: its push ran, or its model was updated


class ParameterServerExtended(WorkerRunMixin, BetweenGraphExtendedMixin,
                              _tf_compat.OneDeviceExtended):
    """The engine of the parameter-server strategies (one replica per worker process).

    Args:
      container_strategy: the public strategy.
      make_policy: `num_workers -> policy`.
      push: what a step pushes (`tfdist.ps.push`: `GradientPush()` or `ModelPush(...)`).
      tables: a `tfdist.ps.tables.TableRule`: the variables kept on the ps tasks only (None:
        none).
      cluster, init_timeout, connect_timeout, stall_timeout, inter_op_threads, compression,
        variable_partitioner: as documented on `SoftSyncStrategy`.
    """

    def __init__(self, container_strategy, make_policy, push, cluster=None, init_timeout=None,
                 connect_timeout=None, inter_op_threads=1, compression=None,
                 variable_partitioner=placement.AUTO, tables=None, stall_timeout=None):
        compressor = push_compressor(compression)
        partitioner = placement.check_partitioner(variable_partitioner)
        # None: what the launcher exported (600 s in Kubernetes pods), else 60 / 30 s.
        if init_timeout is None:
            init_timeout = timeout_from_env(INIT_TIMEOUT_ENV, 60.0)
        if connect_timeout is None:
            connect_timeout = timeout_from_env(CONNECT_TIMEOUT_ENV, 30.0)
        if stall_timeout is None:
            stall_timeout = timeout_from_env(STALL_TIMEOUT_ENV, DEFAULT_STALL_TIMEOUT)
        for name, value in (("init_timeout", init_timeout),
                            ("connect_timeout", connect_timeout),
                            ("stall_timeout", stall_timeout)):
            check_seconds(name, value)
        config = PSConnection.validate(cluster)
        policy = make_policy(config.num_workers)
        connection = PSConnection(config, connect_timeout=connect_timeout,
                                  inter_op_threads=inter_op_threads)
        super().__init__(container_strategy, connection.compute_device)
        self._connection = connection
        self._policy = policy
        self._init_timeout = init_timeout
        self._stall_timeout = stall_timeout
        self._watchdog = None
        self._partitioner = partitioner
        self._placement = None
        self._mirrors = []
        self._paths = {}
        self._tls = threading.local()
        self._clients = None
        self._shards = None
        self._row_parts = None
        self._layouts = None
        self._left = False
        self._job = job_id(config)
        # The run had finished when this worker said hello (it died in it and came back):
        # it holds the run's final weights and trains no more.
        self.run_finished = False
        self._codec = (None if compressor is None
                       else PushCodec(compressor, container_strategy, connection))
        with tf.init_scope(), tf.device(connection.host_device):
            # The global step of each shard's weights this worker holds (its pushes' tags).
            self._tags = tf.Variable(tf.zeros([connection.num_ps], tf.int64), trainable=False,
                                     name="tfdist_tags")
            self._stats = tf.Variable(tf.zeros([protocol.num_stats(connection.num_workers)],
                                               tf.int64), trainable=False, name="tfdist_stats")
            # The train steps this worker took: the chief's writes after its last one are
            # its last word on the weights (`_keep_chief_writes`).
            self._steps_trained = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="tfdist_steps_trained")
        # id(mirror) -> (mirror, steps trained when the chief last wrote it, the value)
        self._chief_writes = {}
        # Embedding tables: on the ps tasks only (`tfdist.ps.tables`); lookups, and their
        # optimizer slots.
        self._tables = TableSet(tables if tables is not None else TableRule(None),
                                connection, init_timeout, partitioner)
        self._push = push
        push.attach(self)
        atexit.register(self.leave)

    # Variables ---------------------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        optimizer = _tf_compat.keras_optimizer_in_scope()
        if self._codec is not None:
            self._codec.attach(optimizer)
        self._push.variable_made(optimizer)
        if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                or self._clients is not None):
            # Metric state, and anything made after the run started, stays with the worker.
            return super()._create_variable(next_creator, **kwargs)
        table = (self._tables.make(kwargs, lambda: self._new_path(kwargs))
                 if self._push.keeps_tables else None)
        if table is not None:
            if self._policy.delay_compensation is not None:
                table.record_lookups()  # a push carries the rows its step read (per row DC)
            return table
        with tf.init_scope():
            initial_value = kwargs.get("initial_value")
            if callable(initial_value):
                initial_value = initial_value()
            initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
        kwargs["initial_value"] = initial_value
        kwargs.setdefault("dtype", initial_value.dtype)
        role = self._push.role(kwargs, optimizer)
        if role is None:
            return super()._create_variable(next_creator, **kwargs)
        colocate_with = kwargs.pop("colocate_with", None)
        # Model averaging: a table stays on every worker, averaged by the rows a round
        # changed (`tfdist.ps.averaged_rows`), and an averaged slot of it by the same rows.
        rows_of = None
        if role == protocol.AVERAGE and self._push.averages_rows:
            if (isinstance(colocate_with, MirrorVariable)
                    and colocate_with._tfdist_role == protocol.ROWS):
                role, rows_of = protocol.ROWS, colocate_with
            elif self._tables.names(kwargs):
                role = protocol.ROWS
        path = self._new_path(kwargs)
        with tf.init_scope(), tf.device(_tf_compat.one_device(self)):
            variable = MirrorVariable.create(path, role, **kwargs)
        # Placed when the run starts (`tfdist.ps.placement`), once the optimizer is known.
        variable._tfdist_colocate = (colocate_with._tfdist_path
                                     if isinstance(colocate_with, MirrorVariable) else None)
        # The optimizer's own variables (its step counter, learning rate): a copy on every
        # ps task, each task's optimizer uses its own; worker 0 initialises them all,
        # checkpoints read ps task 0's, its writes (a callback's new learning rate) go to all.
        variable._tfdist_everywhere = (role == protocol.OPTIMIZER
                                       and variable._tfdist_colocate is None)
        if role == protocol.ROWS:
            self._push.rows.add(variable, rows_of)
        self._mirrors.append(variable)
        return variable

    def _new_path(self, kwargs):
        """The Keras path of the variable being made, numbered if another has it already."""
        path = _tf_compat.keras_variable_path((kwargs.get("name") or "Variable").split(":")[0])
        count = self._paths.get(path, 0)
        self._paths[path] = count + 1
        return f"{path}#{count}" if count else path

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable

    # The step ----------------------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        step = _Step()
        previous = getattr(self._tls, "step", None)
        if previous is None:
            self._tables.ready()
        self._tls.step = step
        try:
            with replica_step(), (tables_lib.step_lookups() if previous is None
                                  else contextlib.nullcontext()):
                result = super()._call_for_each_replica(fn, args, kwargs)
                if step.trained and previous is None:
                    self._push.after_step()
                    self._count_trained_step()
        finally:
            self._tls.step = previous
        if previous is None and not tf.executing_eagerly():
            self._tables.check_step()
        if previous is None and self.run_finished and step.trained:
            model = _tf_compat.keras_model_of_step(fn)
            if model is not None:
                log.warning("tfdist: %s: its run finished; this fit trains nothing and ends "
                            "after one step", self._connection.task_name)
                model.stop_training = True  # `fit` ends after this (untrained) step
                # (Set as the step is traced: a later `fit` traces it again, and ends too.)
                model.train_function = None
            return result
        if previous is not None:
            # A nested call (a LossScaleOptimizer applies in its own replica call): the
            # outer step's logs tell what it did.
            previous.trained = previous.trained or step.trained
            return result
        if not step.trained or not isinstance(result, dict):
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
        if step is None or self._push.update(step, var, args):
            return super()._update(var, fn, args, kwargs, group)
        return var if group else (var,)  # the push took it: the ps applies it

    # The exchange ----------------------------------------------------------------------

    def _exchange(self, main_tensor):
        """One push-and-receive per ps task, in parallel; the replies land in the mirrors."""
        updates, sent, pushed_values, pushed_rows = [], [], [], []
        # One read of every shard's tag before any push: a read per shard after the previous
        # shard's reply was written would make each round trip wait for the one before.
        tags = tf.unstack(self._tags.read_value())
        replies, lookups = [], self._tables.take_lookups()
        for shard, client in enumerate(self._clients):
            layout = self._layouts[shard]
            parts = self._shards[shard]
            tensors = [main_tensor(p) for p in parts[:len(layout.main)]]
            main = protocol.ShardLayout.flatten(
                [t for t, e in zip(tensors, layout.main) if not e.sparse])
            rows = [wire.sparse_rows(t, e)
                    for t, e in zip(tensors, layout.main) if e.sparse]
            # Non-trainable state travels as the change this worker's steps made to it since
            # it last took the masters' (the ps adds the mean change).
            values = protocol.ShardLayout.flatten(
                [p.take(p.variable.change_since_read()) for p in parts[len(layout.main):]])
            tag = tags[shard]
            pushed_values.append(values)
            payload, keep_state = (main, *[c for pair in rows for c in pair]), None
            if self._codec is not None:
                payload, keep_state = self._codec.compress(layout, shard, main, tag,
                                                           self._push.optimizer)
                sent.append(payload)
            # The rows of each table's gradient on this ps task (never compressed).
            pushed_rows.append((*self._tables.pushed_rows(shard, layout, main_tensor, lookups),
                                *self._push.pushed_rows(shard)))
            payload = (*payload, *pushed_rows[-1])
            # Shards do not wait for each other: their round trips overlap.
            replies.append(client.push_and_receive(tag, payload, values,
                                                   self._push.reply_reads(shard)))
            if keep_state is not None:
                # The codec state of a push the ps dropped stays as it was (`push_codec`).
                updates += keep_state(replies[-1].dropped)
        updates += self._assign_replies(replies)
        if sent:
            updates += self._codec.measure(self._layouts, sent, pushed_values, replies, pushed_rows)
        return tf.group(updates)

    def _assign_replies(self, replies):
        """Writes every shard's reply (`client.Reply`) into the mirrors (the parts of a split
        variable joined), the tags and the telemetry; returns the updates."""
        updates, split = [], {}
        for shard, reply in enumerate(replies):
            values = reply.values
            main, rest = self._layouts[shard].split_reply(values)
            for part, value in zip(self._shards[shard], main + rest):
                if part.rows is None:
                    updates += part.variable.assign_read(value)
                else:
                    split.setdefault(id(part.variable), (part.variable, []))[1].append(
                        (part.rows, value))
            updates += self._push.on_reply(shard, values, reply.reads)
        for variable, parts in split.values():
            parts.sort(key=lambda p: p[0])
            updates += variable.assign_read(tf.concat([v for _, v in parts], axis=0))
        updates.append(self._tags.assign(tf.stack([reply.token for reply in replies]),
                                         read_value=False))
        updates.append(self._stats.assign(replies[0].stats, read_value=False))
        return updates

    def _logs(self):
        stats = self._stats.read_value()
        logs = self._push.logs(stats)
        if self._policy.measures_staleness:
            aggregated = tf.maximum(stats[protocol.STAT_AGGREGATED], 1)
            logs["staleness_mean"] = (tf.cast(stats[protocol.STAT_STALENESS_SUM], tf.float32)
                                      / tf.cast(aggregated, tf.float32))
            logs["staleness_max"] = stats[protocol.STAT_STALENESS_MAX]
        if self._codec is not None:
            logs.update(self._codec.logs(self._layouts))
        return logs

    # Codec state and progress ------------------------------------------------------------

    def compression_states(self):
        """The codec states (push residuals) of the optimizers made under this strategy."""
        return [] if self._codec is None else self._codec.states()

    def reset_compression_state(self):
        if self._codec is not None:
            self._codec.reset()

    def progress(self):
        if self._clients is None:
            return protocol.progress_dict([0] * protocol.num_stats(self._connection.num_workers),
                                          self._connection.num_workers)
        return self._clients[0].read_progress()
