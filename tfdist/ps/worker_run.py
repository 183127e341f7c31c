"""A worker's part in a parameter-server run, from its start to its end.

`WorkerRunMixin` is the half of `ParameterServerExtended` (`tfdist.ps.worker`) that deals
with the run as a whole rather than with one step: joining it at the first training trace
(the placement of the masters, each ps task's spec, the hello, binding the mirrors to the
masters, the chief's writes it keeps), reading the masters (`_pull`, `_take_masters`) and
leaving it (`leave`: waiting for the others, ending the process when a ps task is lost).
Each step's push-and-receive is in `tfdist.ps.worker`. The state these methods use is made
in `ParameterServerExtended.__init__`.
"""

import logging
import time

import tensorflow as tf

from tfdist._process import end_with_last_word
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps import snapshot
from tfdist.ps.client import ShardClient
from tfdist.ps.client import agree_on_one_run
from tfdist.ps.connection import PSWatchdog
from tfdist.ps.push import check_split
from tfdist.ps.spec import RunError
from tfdist.ps.spec import ShardSpec
from tfdist.ps.spec import VariableEntry
from tfdist.ps.variables import Part
from tfdist.ps.variables import replica_step

log = logging.getLogger("tfdist")


class WorkerRunMixin:
    """Joining a run, reading its masters and leaving it: the run-long part of
    `ParameterServerExtended`, which holds the state (`_connection`, `_clients`, `_shards`,
    `_layouts`, `_placement`, `_push`, `_tables`, ...)."""

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
            runs = [a["run"] for a in answers]
            if any(initialize):
                log.info("tfdist: %s initialises the run's master variables",
                         self._connection.task_name)
                # The parts' owner first: a worker still reading a finished run's table
                # (`TableVariable._check_owners`) sees the change before any row changes.
                self._tables.claim(runs)
                self._tables.initialize()  # on the ps tasks
            self._bind_mirrors(clients, initialize)
            self._tables.joined(any(initialize), runs)
            if self.run_finished:
                for table in self._tables.all():
                    table.follow()  # nobody's writes reach a finished run's tables
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
        return placement.plan(items, self._connection.num_ps, partitioner,
                              held=self._tables.held())

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

    # Reading the masters -----------------------------------------------------------------

    def _pull(self, copy_tables=True):
        """Takes the current master weights of every shard (eagerly); `copy_tables`: the
        tables averaged by rows too (read in chunks: a reply carries rows only)."""
        with tf.init_scope(), replica_step():
            self._assign_replies([client.sync() for client in self._clients])
            self._push.joined(copy_tables)

    # Leaving -----------------------------------------------------------------------------

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
        with tf.init_scope(), replica_step(), snapshot.consistent_reads(tables=False):
            # Tables averaged by rows are read in bounded chunks (`ChangedRows`), the rest
            # whole (tables kept on the ps: not at all, nor copied for the snapshot).
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
