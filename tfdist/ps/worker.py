"""The worker side of the parameter-server engine: one replica per worker process.

Every worker process runs the user's own script and `model.fit` on its compute device (its
GPU when it has one). The model's variables are mirrors (`tfdist.ps.variables`) of master
variables spread over the ps tasks by size (`tfdist.ps.placement`); each ps task runs the
updater of its own shard (`tfdist.ps.service`).

`ParameterServerExtended` runs the worker's part of a run: joining it (the spec, placement,
binding the mirrors to the masters), each step's push-and-receive with every ps task, pulling
the masters, leaving. What a step pushes, and so what a variable is for, is its push's
(`tfdist.ps.push`: the gradient, or the model every `period` steps); the compressed push is
`tfdist.ps.push_codec`.
"""

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading
import time

import tensorflow as tf

from tfdist import _tf_compat
from tfdist._args import check_seconds
from tfdist._process import end_with_last_word
from tfdist._worker import BetweenGraphExtendedMixin
from tfdist.cluster.network import CONNECT_TIMEOUT_ENV
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT
from tfdist.cluster.network import INIT_TIMEOUT_ENV
from tfdist.cluster.network import JOB_ID_ENV
from tfdist.cluster.network import STALL_TIMEOUT_ENV
from tfdist.cluster.network import timeout_from_env
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps import snapshot
from tfdist.ps import tables as tables_lib
from tfdist.ps import wire
from tfdist.ps.client import RunError
from tfdist.ps.client import ShardClient
from tfdist.ps.client import agree_on_one_run
from tfdist.ps.connection import PSConnection
from tfdist.ps.connection import PSWatchdog
from tfdist.ps.push import check_split
from tfdist.ps.push_codec import PushCodec
from tfdist.ps.push_codec import push_compressor
from tfdist.ps.spec import ShardSpec
from tfdist.ps.spec import VariableEntry
from tfdist.ps.table_set import TableRule
from tfdist.ps.table_set import TableSet
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import Part
from tfdist.ps.variables import replica_step

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


class ParameterServerExtended(BetweenGraphExtendedMixin, _tf_compat.OneDeviceExtended):
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
                                connection, init_timeout)
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

    # Joining a run -----------------------------------------------------------------------

    def _ensure_run(self, pushed_variables=(), sparse_variables=()):
        """At the first training trace: joins (or starts) the run on every ps task.

        `sparse_variables` are pushed as the rows their gradient touches (embeddings)."""
        if self._clients is not None:
            return
        self._tables.rule.check_patterns()
        pushed = {id(v) for v in pushed_variables}
        num_ps = self._connection.num_ps
        for variable in self._mirrors:
            if variable._tfdist_role == protocol.GRADIENT and id(variable) not in pushed:
                variable._tfdist_role = protocol.VALUE  # trainable, but no gradient reaches it
        # What the push adds to the spec's entries (update options, `sparse`, `outer`).
        fields = self._push.prepare_run({id(v) for v in sparse_variables})
        self._placement = self._plan(fields)
        entries = [[] for _ in range(num_ps)]
        self._shards = [[] for _ in range(num_ps)]
        self._row_parts = [[] for _ in range(num_ps)]  # of tables averaged by rows
        for variable in self._mirrors:
            role = variable._tfdist_role
            entry = {"path": variable._tfdist_path, "shape": variable.shape.as_list(),
                     "dtype": variable.dtype.name, "role": role, **fields.get(id(variable), {})}
            for shard, rows in self._placement[variable._tfdist_path]:
                part = Part(variable, rows)
                entries[shard].append(VariableEntry(**{**entry, "shape": part.shape,
                                                       "rows": rows}))
                if role in protocol.PUSHED_ROLES:
                    self._shards[shard].append(part)
                elif role == protocol.ROWS:
                    self._row_parts[shard].append(part)
        for parts in self._shards:
            order = {protocol.GRADIENT: 0, protocol.AVERAGE: 0, protocol.VALUE: 1}
            parts.sort(key=lambda p: order[p.variable._tfdist_role])
        # Tables (and their slots) after the mirrors, each part on its own ps task.
        self._tables.add_entries(entries, fields)
        # From the first hello on, a ps task that stops answering ends this worker, named,
        # instead of leaving it waiting for ever.
        self._watchdog = PSWatchdog(self._connection, self._stall_timeout,
                                    self._end_on_stalled_ps, self._end_on_replaced_ps).start()
        clients = [ShardClient(self._connection, s) for s in range(num_ps)]
        answers = []
        with tf.init_scope():
            for shard, client in enumerate(clients):
                answers.append(client.hello(self._spec(shard, entries[shard]),
                                            timeout=self._init_timeout))
            # Refused: this worker exits, and each ps task then counts it dead.
            answers = agree_on_one_run(clients, answers, self._job)
            self.run_finished = bool(answers[0].get("finished"))
            if self.run_finished:
                log.warning("tfdist: run %s of job %r finished while %s was away: it takes "
                            "the run's final weights and trains no more (its fit ends after "
                            "this step)", answers[0]["run"], self._job,
                            self._connection.task_name)
            initialize = [a["initialize"] for a in answers]
            if any(initialize):
                log.info("tfdist: %s initialises the run's master variables",
                         self._connection.task_name)
                self._tables.initialize()  # on the ps tasks
            self._bind_mirrors(clients, initialize)
            self._tables.joined(any(initialize))
            # A checkpoint reads each table part with the rest of its shard, between two
            # updates (`tfdist.ps.snapshot`).
            for client, parts in zip(clients, self._tables.part_masters(num_ps)):
                client.snapshot.add_tables(parts)
            self._clients = clients
            self._layouts = [protocol.ShardLayout(e) for e in entries]
            if self.run_finished:
                self._take_masters()  # nothing trains any more: no push queue, no sync
                return
            for client, layout in zip(clients, self._layouts):
                dtypes = (self._codec.queue_dtypes(layout) if self._codec is not None
                          else [tf.float32])
                client.open_push_queue(dtypes, layout.num_row_pairs)
            self._pull(copy_tables=not any(initialize))

    def _bind_mirrors(self, clients, initialize):
        """Binds every mirror to its masters on `clients`' ps tasks; those of the shards
        where `initialize[shard]` first take this worker's own values (the chief's)."""
        mirrors = {v._tfdist_path: v for v in self._mirrors}
        with replica_step():  # the chief's own values, read before any is bound
            initial = ({path: v.read_value() for path, v in mirrors.items()}
                       if any(initialize) else {})
        for shard, client in enumerate(clients):
            for path, places in self._placement.items():
                variable = mirrors[path]
                for rows in (rows for s, rows in places if s == shard):
                    master = client.masters[path]
                    if initialize[shard]:
                        master.assign(Part(variable, rows).take(initial[path]),
                                      read_value=False)
                    variable.bind(master, rows)
                    if self.run_finished:
                        variable.follow()  # nobody's writes reach a finished run's masters
                    else:
                        self._after_bind(variable)

    def _after_bind(self, variable):
        """Every worker runs the user's callbacks; only the chief's eager writes reach the
        masters (a learning rate halved once, not once per worker; one worker's best weights
        restored, not each one's), and it remembers them (`_keep_chief_writes`)."""
        if self._connection.is_chief:
            variable.on_write(self._chief_wrote)
        else:
            variable.follow()

    def _chief_wrote(self, variable):
        with replica_step():
            value = variable.read_value()  # its own copy, which took the value written
        self._chief_writes[id(variable)] = (variable, int(self._steps_trained.numpy()), value)

    def _count_trained_step(self):
        """In a step that trained (in-graph)."""
        return self._steps_trained.assign_add(1, read_value=False)

    def _plan(self, fields):
        """`{path: [(ps_index, rows)]}`: where each mirror's master parts live."""
        partitioner = self._partitioner
        elementwise = check_split(self._push, partitioner)
        items = []
        for variable in self._mirrors:
            constraint = fields.get(id(variable), {}).get("constraint")
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
        optimizer's slots; a table kept on the ps tasks and its slots count where their rows
        are) and `bytes_pushed` (what one push of a worker carries there; for an embedding
        mirrored and pushed as rows, its whole size: the most a push can carry; a table's
        rows are not counted, nor those of a table model averaging averages by rows: a push
        carries the rows its step (round) touched, 8 bytes of index and the row's values
        each)."""
        if self._clients is None:
            raise ValueError("the masters are placed when the first training step starts")
        out = [{"task": name, "variables": {}, "bytes_held": 0, "bytes_pushed": 0}
               for name in self._connection.ps_names]
        mirrors = {v._tfdist_path: v for v in self._mirrors}
        places = [(mirrors[path], shard, rows) for path, parts in self._placement.items()
                  for shard, rows in parts]
        places += self._tables.places()
        for variable, shard, rows in places:
            part = Part(variable, rows)
            out[shard]["variables"][variable._tfdist_path] = (None if rows is None
                                                               else list(rows))
            out[shard]["bytes_held"] += placement.nbytes(part.shape, variable.dtype)
        for shard, layout in enumerate(self._layouts):
            out[shard]["bytes_pushed"] = 4 * (layout.main_size + layout.value_size)
        return out

    def _spec(self, shard, entries):
        config = self._connection.config
        # The optimizers the ps tasks rebuild: they import a custom one's module.
        applied = self._push.rebuilt_optimizers()
        imports = [module for module in (type(o).__module__ for o in applied)
                   if not module.startswith("keras.")]
        policy = self._policy.to_spec()
        if ":" in str(policy.get("staleness", "")):
            imports.append(policy["staleness"])
        return ShardSpec(**self._push.spec(), policy=policy, num_workers=config.num_workers,
                         worker_tasks=self._connection.training_tasks,
                         worker_addresses=self._connection.training_addresses,
                         num_ps=config.num_ps, shard=shard, variables=entries,
                         imports=imports,
                         compression=None if self._codec is None else self._codec.spec(),
                         init_timeout=self._init_timeout,
                         stall_timeout=self._stall_timeout,
                         table_updates=self._tables.updates, job=self._job)

    def _pull(self, copy_tables=True):
        """Takes the current master weights of every shard (eagerly); `copy_tables`: the
        tables averaged by rows too (read in chunks: a reply carries rows only)."""
        with tf.init_scope(), replica_step():
            self._assign_replies([client.sync() for client in self._clients])
            self._push.joined(copy_tables)

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
            updates += self._push.on_reply(shard, values)
        for variable, parts in split.values():
            parts.sort(key=lambda p: p[0])
            updates += variable.assign_read(tf.concat([v for _, v in parts], axis=0))
        updates.append(self._tags.assign(tf.stack([reply.token for reply in replies]),
                                         read_value=False))
        updates.append(self._stats.assign(replies[0].stats, read_value=False))
        return updates

    # The exchange ----------------------------------------------------------------------

    def _exchange(self, main_tensor):
        """One push-and-receive per ps task, in parallel; the replies land in the mirrors."""
        updates, sent, pushed_values = [], [], []
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
            payload = (*payload, *self._tables.pushed_rows(shard, layout, main_tensor, lookups),
                       *self._push.pushed_rows(shard))
            # Shards do not wait for each other: their round trips overlap.
            replies.append(client.push_and_receive(tag, payload, values))
            if keep_state is not None:
                # The codec state of a push the ps dropped stays as it was (`push_codec`).
                updates += keep_state(replies[-1].dropped)
        updates += self._assign_replies(replies)
        if sent:
            updates += self._codec.measure(self._layouts, sent, pushed_values, replies)
        return tf.group(updates)

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

    # Lifecycle ---------------------------------------------------------------------------

    def leave(self, wait=False, timeout=None):
        """Ends this worker's part in training.

        The push first sends what it owes (model averaging: the steps taken since the
        last round). With `wait`
        (the chief's `join()`), leaves, then waits until every other worker has left or
        died, so that the weights this worker then takes are final. The local model ends on
        the master weights. Called at exit (without waiting).
        """
        if self._left:
            return
        self._left = True
        try:
            if self.run_finished:
                self._take_masters()  # nobody trains: they are the final weights
                return
            if self._clients is None:
                for shard in range(self._connection.num_ps):
                    ShardClient(self._connection, shard).absent()
                return
            self._push.before_leave()
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
            self._keep_chief_writes()
            self._take_masters()
        except (tf.errors.OpError, RunError) as e:
            gone = self._connection.unreachable_ps()
            replaced = [] if gone or self._watchdog is None else self._watchdog.replaced()
            if replaced:
                self._end_on_replaced_ps(replaced)
            if not gone:
                log.warning("tfdist: %s could not leave the run cleanly: %s",
                            self._connection.task_name, e)
                return
            self._end_on_lost_ps(gone, "TensorFlow's error above is that")
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()

    def _end_on_stalled_ps(self, stalled):
        """The watchdog's verdict: a ps task has not answered for stall_timeout."""
        self._end_on_lost_ps(stalled, "this worker's ops on it would wait for ever")

    def _end_on_replaced_ps(self, replaced):
        """The watchdog's verdict: a new, empty process answers in place of a ps task."""
        self._end_on_lost_ps(replaced, "a new process started there holds no shard of this "
                             "run", happened="was restarted and lost its shard")

    def _end_on_lost_ps(self, lost, because, happened="stopped answering"):
        """Logs which ps tasks (`[(name, address, why)]`) stopped answering (or what else
        `happened` to them) and ends the process: their shards are out of reach, and nothing
        can go on without them."""
        log.error("tfdist: %s: its shard of the master variables is gone, and no worker can "
                  "train on without it (%s). Restart the job; the chief's last checkpoint "
                  "holds the model",
                  "; ".join(f"{name} at {address} {happened}" + (f" ({why})" if why else "")
                            for name, address, why in lost), because)
        end_with_last_word(1)  # issue 22: the error above stays the user's last screen

    def _send_leave(self):
        for client in self._clients:
            try:
                client.send_control(protocol.LEAVE)
            except tf.errors.OpError:
                pass  # the run has ended (its queues are closed)

    def _keep_chief_writes(self):
        """Writes again, over the masters, what the chief wrote after its last train step
        (EarlyStopping's `restore_best_weights` at the end of `fit`, a `load_weights` before
        `join()`): the other workers trained on over it, and the weights `join()` leaves
        (and the chief then saves) are its choice. The values are those written (a reply
        may have come since: model averaging's last round). A write followed by a step was
        training, and is not kept."""
        steps = int(self._steps_trained.numpy())
        kept = [(v, value) for v, at, value in self._chief_writes.values() if at == steps]
        if not kept:
            return
        with tf.init_scope():
            for variable, value in kept:
                variable.assign(value, read_value=False)  # outside a step: the masters
        log.info("tfdist: %s wrote %s after its last train step: kept over the other "
                 "workers' later updates", self._connection.task_name,
                 [v._tfdist_path for v, _ in kept])

    def _take_masters(self):
        with tf.init_scope(), replica_step(), snapshot.consistent_reads():
            # Tables averaged by rows are read in bounded chunks (`ChangedRows`), the rest
            # whole.
            variables = {id(p.variable): p.variable for parts in self._shards for p in parts}
            for variable in variables.values():
                variable.assign_read(variable.master_value())
            self._push.joined(copy_tables=True)
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
        return [] if self._codec is None else self._codec.states()

    def reset_compression_state(self):
        if self._codec is not None:
            self._codec.reset()

    def progress(self):
        if self._clients is None:
            return protocol.progress_dict([0] * protocol.num_stats(self._connection.num_workers),
                                          self._connection.num_workers)
        return self._clients[0].read_progress()
