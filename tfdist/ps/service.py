"""The ps side of the parameter-server engine: each ps task updates its own shard.

`PSService` runs in every ps process beside its gRPC server (`tfdist.launch.server`). Workers
say hello on its control queue with the spec of the shard (variables, optimizer config,
policy, compression); the first hello of a job starts a run, whose `ShardUpdater` thread:

1. waits until the chief has initialised the run's master variables,
2. rebuilds the user's Keras optimizer from its config on the masters of this shard (its
   slots are masters too, so the chief's checkpoints hold them); model averaging's outer
   optimizer likewise,
3. serves updates in-graph: one `tf.function` call takes pushes, applies the optimizer (or
   the average, or the outer optimizer to the average's change), and replies to the
   workers, update after update, and returns to Python
   only when a worker joins, leaves or dies,
4. when every worker has left or died, destroys the run's resources.

Nothing in a ps waits for a particular worker: the chief's death does not stop a soft-sync
job. A worker's death is noticed by the service's watcher (the worker's server port closes);
with N = M (hard sync) the others are then stopped with an error that names it.
"""

import logging
import threading
import time

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.cluster import is_listening
from tfdist.ps import protocol
from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.policies import delay_compensated
from tfdist.ps.policies import policy_from_spec
from tfdist.ps.policies import resolve_function
from tfdist.ps.push_codec import push_key
from tfdist.ps.variables import is_initialized

log = logging.getLogger("tfdist")

# The parts of an optimizer's config that a worker has already applied to its gradient
# before pushing it (Keras's `apply` unscales and clips before the all-reduce).
_APPLIED_BY_WORKERS = {"loss_scale_factor": None, "clipnorm": None, "clipvalue": None,
                       "global_clipnorm": None, "gradient_accumulation_steps": None}


def ps_optimizer_config(config):
    """The optimizer config a ps applies: what workers did before the push taken out.

    A `LossScaleOptimizer`'s scaling lives with each worker (it unscales and skips
    non-finite steps there); the ps applies its inner optimizer.
    """
    if config is None:
        return None
    config = dict(config)
    if config.get("class_name") == "LossScaleOptimizer":
        config = dict(config["config"]["inner_optimizer"])
    inner = dict(config.get("config", {}))
    inner.update({k: v for k, v in _APPLIED_BY_WORKERS.items() if k in inner})
    config["config"] = inner
    return config


class _ShardExtended(_tf_compat.OneDeviceExtended):
    """Where the ps-side optimizer's variables live, and how staleness scales its step."""

    def __init__(self, container_strategy, device, masters):
        super().__init__(container_strategy, device)
        self.masters = masters
        self.learning_rate_factor = None

    def _create_variable(self, next_creator, **kwargs):
        path = _tf_compat.keras_variable_path(kwargs.get("name") or "Variable")
        master = self.masters.get(path)
        if master is not None:
            return master
        return super()._create_variable(next_creator, **kwargs)

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable  # masters are made outside the scope, by shared name

    def _update(self, var, fn, args, kwargs, group):
        if self.learning_rate_factor is not None and len(args) == 2:
            gradient, learning_rate = args
            args = (gradient, tf.cast(learning_rate, tf.float32) * self.learning_rate_factor)
        return super()._update(var, fn, args, kwargs, group)


class _ShardStrategy(tf.distribute.Strategy):
    def __init__(self, device, masters):
        super().__init__(_ShardExtended(self, device, masters))


_NO_CLOCK = 2 ** 62  # above any SSP clock


class RunFailed(Exception):
    """The run cannot go on; the message is what every worker is told."""


class ShardUpdater:
    """One run of one shard: its resources, its optimizer, its update loop.

    Args:
      service: the `PSService`.
      run: the run's name.
      spec: the shard spec of the worker that started the run.
    """

    def __init__(self, service, run, spec):
        self.service = service
        self.run = run
        self.spec = spec
        self.device = service.device
        self.num_workers = spec["num_workers"]
        self.worker_tasks = spec["worker_tasks"]
        self.worker_addresses = spec["worker_addresses"]
        self.policy = policy_from_spec(spec["policy"])
        self.layout = protocol.ShardLayout(spec["variables"])
        self.compressor = compression_lib.get(spec["compression"])
        self.delta = spec.get("delta", False)
        self.members = [protocol.EXPECTED] * self.num_workers
        self.closing = False  # set under the service's lock: no worker may join any more
        self.failure = None
        self.finished = threading.Event()
        self.created = time.monotonic()
        payload_dtypes = (protocol.compressed_push_dtypes(self.layout, self.compressor)
                          if self.compressor else [tf.float32])
        self.push_dtypes = protocol.push_dtypes(payload_dtypes, len(self.layout.sparse))
        name = lambda n: protocol.run_name(run, n)  # noqa: E731
        with tf.device(self.device):
            self.push_queue = tf.raw_ops.FIFOQueueV2(
                component_types=self.push_dtypes, shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=name("push"))
            self.reply_queues = [tf.raw_ops.FIFOQueueV2(
                component_types=protocol.REPLY_DTYPES, shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=name(f"reply/{r}"))
                for r in range(self.num_workers)]
        self.progress, self.masters = protocol.open_run_variables(self.device, run, spec)
        self._thread = threading.Thread(target=self._run, name=f"tfdist-run-{run}",
                                        daemon=True)

    def start(self):
        self._thread.start()

    @property
    def live(self):
        return [r for r, m in enumerate(self.members) if m in (protocol.EXPECTED,
                                                                 protocol.LIVE)]

    # Control entries from other threads ---------------------------------------------------

    def send_control(self, kind, rank):
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(
                handle=self.push_queue,
                components=[tf.constant(kind, tf.int64), tf.constant(rank, tf.int32),
                            *[tf.zeros([0], d) for d in self.push_dtypes[2:]]])

    def _reply(self, rank, token, message, values=None):
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.reply_queues[rank], components=[
                tf.constant(token, tf.int64), tf.constant(message),
                self.progress.read_value() if is_initialized(self.progress)
                else tf.zeros([protocol.num_stats(self.num_workers)], tf.int64),
                values if values is not None else tf.zeros([0], tf.float32)])

    # The run --------------------------------------------------------------------------------

    def _run(self):
        try:
            self._wait_until_initialized()
            self._build()
            if self.optimizer is not None:
                # A run resumed from a checkpoint goes on from the restored optimizer step.
                with tf.device(self.device):
                    self.progress.scatter_nd_update(
                        [[protocol.STAT_STEP]],
                        [tf.cast(self.optimizer.iterations.value, tf.int64)])
            self._serve()
        except RunFailed as e:
            self.failure = str(e)
            log.error("tfdist: %s: run %s failed: %s", self.service.task, self.run, e)
            self._drain_with_error(str(e))
        except Exception as e:  # The workers must hear of it, or they wait forever.
            self.failure = (f"the updater of {self.service.task} failed: "
                            f"{type(e).__name__}: {e}")
            log.exception("tfdist: %s: the updater of run %s failed", self.service.task,
                          self.run)
            self._drain_with_error(self.failure)
        finally:
            self._close()
            self.finished.set()

    def _close(self):
        """Closes the run's queues: a worker still waiting on them gets an error, not a hang."""
        with tf.device(self.device):
            for queue in (self.push_queue, *self.reply_queues):
                try:
                    tf.raw_ops.QueueCloseV2(handle=queue, cancel_pending_enqueues=True)
                except tf.errors.OpError:
                    pass

    def _wait_until_initialized(self):
        chief = f"the chief {self.worker_tasks[0]} at {self.worker_addresses[0]}"
        deadline = self.created + self.spec["init_timeout"]
        variables = list(self.masters.values())
        delay = 0.005
        while not all(is_initialized(v) for v in variables):
            if time.monotonic() > deadline:
                raise RunFailed(f"{chief} did not initialise the master variables within "
                                f"{self.spec['init_timeout']:g} s: is it running the same "
                                "model code?")
            time.sleep(delay)
            delay = min(0.1, delay * 2)
        with tf.device(self.device):
            self.progress.assign(tf.zeros([protocol.num_stats(self.num_workers)], tf.int64))

    def _build(self):
        """The shard's Keras variables and optimizer, and the update loop's functions."""
        self.strategy = _ShardStrategy(self.device, self.masters)
        entries = self.layout.main + self.layout.values
        with self.strategy.scope():
            self.variables = []
            for e in entries:
                with _tf_compat.keras_name_scope_for_path(e["path"]):
                    self.variables.append(keras.Variable(
                        "zeros", shape=e["shape"], dtype=e["dtype"],
                        name=e["path"].rpartition("/")[2],
                        trainable=e["role"] == protocol.GRADIENT))
            for variable, e in zip(self.variables, entries):
                if e.get("constraint") is not None:
                    variable.constraint = self._deserialize(
                        keras.constraints.get, e["constraint"], f"the constraint of {e['path']}")
            self.main_variables = self.variables[:len(self.layout.main)]
            self.value_variables = self.variables[len(self.layout.main):]
            self.optimizer = self.outer_optimizer = None
            outer = [v for v, e in zip(self.main_variables, self.layout.main) if e.get("outer")]
            if (self.spec["optimizer"] is not None and self.main_variables) or outer:
                for module in self.spec.get("imports", []):
                    self._import(module)
            if self.spec["optimizer"] is not None and self.main_variables:
                self.optimizer = self._rebuild_optimizer()
                excluded = [v for v, e in zip(self.main_variables, self.layout.main)
                            if e.get("weight_decay") is False]
                if excluded:
                    self.optimizer.exclude_from_weight_decay(var_list=excluded)
                self.optimizer.build(self.main_variables)
            if outer:
                self.outer_optimizer = self._deserialize(
                    keras.optimizers.deserialize, self.spec["outer_optimizer"],
                    f"the outer optimizer {self.spec['outer_optimizer'].get('class_name')!r}")
                self.outer_optimizer.build(outer)
                self._check_masters(self.outer_optimizer)
        with tf.device(self.device):
            self.clocks = tf.Variable(tf.zeros([self.num_workers], tf.int64))
            self.waiting = tf.Variable(tf.zeros([self.num_workers], tf.bool))
            self.weights_read = None
            if self.policy.delay_compensation is not None:
                # DC-ASGD: per worker, the weights it was last sent (what it computes on).
                self.weights_read = tf.Variable(tf.zeros(
                    [self.num_workers, self.layout.main_size], tf.float32))
        self._serve_updates = tf.function(self._serve_updates_fn)
        self._apply_now = tf.function(self._apply_fn)
        self._release_one = tf.function(self._release_one_fn)
        self._rejoin = tf.function(self._rejoin_fn)
        self._forget = tf.function(self._forget_fn)
        self._release_caught_up = tf.function(self._release_caught_up_fn)
        self._record_end = tf.function(self._record_end_fn)

    def _check_masters(self, optimizer):
        """Every variable of an optimizer rebuilt here must be a master (its state on the ps,
        in the chief's checkpoints), found by the Keras path every worker gave it."""
        masters = {id(m) for m in self.masters.values()}
        local = [v.path for v in optimizer.variables if id(v.value) not in masters]
        if local:
            raise RunFailed(f"{self.service.task} found no master variable of {local} in "
                            f"the run's spec (the workers name the variables of "
                            f"{optimizer.name!r} otherwise)")

    def _rebuild_optimizer(self):
        config = ps_optimizer_config(self.spec["optimizer"])
        name = config.get("class_name") if isinstance(config, dict) else config
        return self._deserialize(keras.optimizers.deserialize, config,
                                 f"the workers' optimizer {name!r}")

    def _deserialize(self, get, config, what):
        try:
            return get(config)
        except Exception as e:
            raise RunFailed(
                f"{self.service.task} could not rebuild {what} from its Keras config "
                f"({type(e).__name__}: {e}). A custom class (optimizer, learning rate "
                "schedule, constraint) must be registered with "
                "`@keras.saving.register_keras_serializable()` in a module the ps tasks "
                "import: tfdist imports the optimizer's own module there; name any other with "
                "`tfdist-launch --job_name=ps --ps_import=MODULE`") from None

    def _import(self, module):
        try:
            resolve_function(module) if ":" in module else __import__(module)
        except Exception as e:
            raise RunFailed(
                f"{self.service.task} could not import {module!r}, which the workers' "
                f"optimizer or staleness function needs ({type(e).__name__}: {e}). Install "
                f"it where the ps tasks run, or put it on their PYTHONPATH") from None

    # In-graph parts ------------------------------------------------------------------------

    def _flat_values(self):
        return protocol.ShardLayout.flatten([v.value for v in self.variables])

    def _current_values(self):
        return protocol.ShardLayout.flatten([v.value for v in self.value_variables])

    def _empty_state(self):
        zero = tf.constant(0, tf.int64)
        return {"total": tf.zeros([self.layout.main_size]),
                "values": tf.zeros([self.layout.value_size]),
                "accepted": tf.constant(0), "dropped": zero,
                "released": tf.zeros([self.num_workers], tf.bool),
                "staleness_sum": zero, "staleness_max": zero,
                "histogram": tf.zeros([HISTOGRAM_BUCKETS], tf.int64),
                "last_rank": tf.constant(0)}

    def _decode(self, payload, tag, rank):
        if self.compressor is None:
            pairs = list(zip(payload[1::2], payload[2::2]))
            return self.layout.densify(payload[0], pairs)
        return protocol.decode_push(self.layout, self.compressor, payload,
                                    push_key(tag, rank, self.spec["shard"], self.num_workers))

    def _send(self, rank, step, values, message=""):
        """Enqueues a reply to worker `rank` with `values` at global step `step`; with
        delay compensation, records them as the weights that worker reads.

        `rank` is a Python int where the caller knows it (one enqueue), else a tensor (one
        branch per worker)."""
        stats = self.progress.read_value()

        def put(r):
            ops = [tf.raw_ops.QueueEnqueueV2(
                handle=self.reply_queues[r],
                components=[step, tf.constant(message), stats, values])]
            if self.weights_read is not None:
                ops.append(self.weights_read.scatter_nd_update(
                    [[r]], values[None, :self.layout.main_size]))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        if isinstance(rank, int):
            return put(rank)
        return tf.switch_case(rank, [lambda r=r: put(r) for r in range(self.num_workers)])

    def _step(self):
        return self.progress[protocol.STAT_STEP]

    def _collect(self, required, state):
        """Takes pushes until `required` usable ones, or a control entry."""
        step = self._step()
        main_dtypes = self.push_dtypes[2:-1]
        # State values are summed as changes from the masters: pushes that all carry the
        # master's value (frozen weights) leave it exactly as it is, step after step.
        current = self._current_values()

        def cond(state, event, rank):
            return tf.logical_and(state["accepted"] < required, tf.equal(event, 0))

        def body(state, event, rank):
            tag, entry_rank, *rest = tf.raw_ops.QueueDequeueV2(
                handle=self.push_queue, component_types=self.push_dtypes)
            payload, values = rest[:len(main_dtypes)], rest[-1]
            tag, entry_rank = tf.reshape(tag, []), tf.reshape(entry_rank, [])
            control = tag < 0
            usable = tf.logical_and(tf.logical_not(control), self.policy.accepts(tag, step))
            stale = tf.logical_and(tf.logical_not(control), tf.logical_not(usable))
            staleness = tf.maximum(step - tag, 0)
            taken = tf.cast(usable, tf.int64)
            new = dict(state)
            new["total"], new["values"] = tf.cond(
                usable,
                lambda: (state["total"] + self._decode(payload, tag, entry_rank),
                         state["values"] + tf.reshape(values, [self.layout.value_size])
                         - current),
                lambda: (state["total"], state["values"]))
            new["accepted"] = state["accepted"] + tf.cast(usable, tf.int32)
            new["dropped"] = state["dropped"] + tf.cast(stale, tf.int64)
            new["staleness_sum"] = state["staleness_sum"] + taken * staleness
            new["staleness_max"] = tf.maximum(state["staleness_max"], taken * staleness)
            new["histogram"] = state["histogram"] + taken * tf.one_hot(
                tf.minimum(staleness, HISTOGRAM_BUCKETS - 1), HISTOGRAM_BUCKETS, dtype=tf.int64)
            new["last_rank"] = tf.where(usable, entry_rank, state["last_rank"])
            new["released"] = tf.logical_or(state["released"], tf.logical_and(
                usable, tf.one_hot(entry_rank, self.num_workers, on_value=True,
                                   off_value=False)))
            # A stale push is dropped and its worker sent the current weights at once.
            sent = tf.cond(stale, lambda: self._send(entry_rank, step, self._flat_values()),
                           lambda: tf.constant(True))
            with tf.control_dependencies([sent]):
                new["total"] = tf.identity(new["total"])
            return new, tf.where(control, tf.cast(-tag, tf.int32), 0), entry_rank

        return tf.while_loop(cond, body, [state, tf.constant(0), tf.constant(-1)],
                             parallel_iterations=1)

    def _apply(self, state):
        """Applies the mean of the accepted pushes; returns the new global step."""
        count = tf.cast(state["accepted"], tf.float32)
        mean = state["total"] / count
        updates = []
        if self.layout.value_size:
            values = self.layout.unflatten(self._current_values() + state["values"] / count,
                                           self.layout.values, self.layout.value_sizes)
            updates += [v.assign(x) for v, x in zip(self.value_variables, values)]
        parts = self.layout.unflatten(mean, self.layout.main, self.layout.main_sizes)
        if self.policy.averages_weights:
            outer_gradients, outer_variables = [], []
            for variable, part, entry in zip(self.main_variables, parts, self.layout.main):
                if entry.get("outer"):
                    # The round's outer gradient: master - mean(local), the mean change
                    # negated (a compressed round's `part` is that mean change).
                    outer_gradients.append(-part if self.delta else variable.value - part)
                    outer_variables.append(variable)
                else:
                    updates.append(variable.assign_add(part) if self.delta
                                   else variable.assign(part))
            if outer_variables:
                with tf.control_dependencies(updates):
                    self.outer_optimizer.apply(outer_gradients, outer_variables)
                updates.append(self.outer_optimizer.iterations.value)
            with tf.control_dependencies(updates):
                return self._step() + 1
        if self.weights_read is not None:
            mean = delay_compensated(
                mean, protocol.ShardLayout.flatten([v.value for v in self.main_variables]),
                self.weights_read[state["last_rank"]], self.policy.delay_compensation)
            parts = self.layout.unflatten(mean, self.layout.main, self.layout.main_sizes)
        if self.optimizer is None:  # a shard with no trained variable: state only
            with tf.control_dependencies(updates):
                return self._step() + 1
        extended = self.strategy.extended
        extended.learning_rate_factor = self.policy.learning_rate_factor(
            state["staleness_sum"] // tf.maximum(tf.cast(state["accepted"], tf.int64), 1))
        try:
            with tf.control_dependencies(updates):
                self.optimizer.apply(parts, self.main_variables)
        finally:
            extended.learning_rate_factor = None
        return tf.cast(self.optimizer.iterations.value, tf.int64)

    def _record_fn(self, step, state, clock_gap=None, updated=True):
        old = self.progress.read_value()
        gap = old[protocol.STAT_CLOCK_GAP] if clock_gap is None else tf.maximum(
            old[protocol.STAT_CLOCK_GAP], clock_gap)
        return self.progress.assign(tf.concat([
            tf.stack([step, old[protocol.STAT_UPDATES] + int(updated),
                      old[protocol.STAT_DROPPED] + state["dropped"],
                      old[protocol.STAT_AGGREGATED] + tf.cast(state["accepted"], tf.int64),
                      old[protocol.STAT_STALENESS_SUM] + state["staleness_sum"],
                      tf.maximum(old[protocol.STAT_STALENESS_MAX], state["staleness_max"]),
                      gap]),
            old[protocol.STAT_HISTOGRAM:protocol.STAT_MEMBERS] + state["histogram"],
            old[protocol.STAT_MEMBERS:]], axis=0), read_value=False)

    def _record_end_fn(self, step, state):
        """The record of a run's end (pushes dropped since its last update); a `tf.function`
        returns tensors, not the assign op `_record_fn` gives its in-graph callers."""
        self._record_fn(step, state, updated=False)

    def _apply_and_release(self, state, live):
        """One update: apply, record, and reply to the workers whose pushes it used."""
        step = self._apply(state)
        if not self.policy.defers_release:
            with tf.control_dependencies([self._record_fn(step, state)]):
                values = self._flat_values()
            for rank in range(self.num_workers):
                tf.cond(state["released"][rank], lambda rank=rank: self._send(rank, step, values),
                        lambda: tf.constant(True))
            return
        # Stale synchronous parallel: the worker waits until it is at most `max_staleness`
        # pushes ahead of the slowest live worker.
        rank = state["last_rank"]
        ticked = [self.clocks.scatter_nd_add([[rank]], [1]),
                  self.waiting.scatter_nd_update([[rank]], [True])]
        with tf.control_dependencies(ticked):
            self._release_caught_up_fn(live, step, state, updated=True)

    @staticmethod
    def _slowest_clock(clocks, mask):
        """The smallest clock of the workers in `mask` (`_NO_CLOCK` if none)."""
        none = tf.fill(tf.shape(clocks), tf.constant(_NO_CLOCK, tf.int64))
        return tf.reduce_min(tf.where(mask, clocks, none))

    def _release_caught_up_fn(self, live, step=None, state=None, updated=False):
        step = self._step() if step is None else step
        clocks = self.clocks.read_value()
        slowest = self._slowest_clock(clocks, live)
        gaps = clocks - slowest
        release = tf.logical_and(tf.logical_and(self.waiting.read_value(), live),
                                 gaps <= self.policy.max_staleness)
        gap = tf.reduce_max(tf.where(release, gaps, tf.zeros_like(gaps)))
        if state is None:
            state = self._empty_state()
        with tf.control_dependencies([self._record_fn(step, state, gap, updated)]):
            values = self._flat_values()
            cleared = self.waiting.assign(tf.logical_and(self.waiting.read_value(),
                                                         tf.logical_not(release)))
        with tf.control_dependencies([cleared]):
            for r in range(self.num_workers):
                tf.cond(release[r], lambda r=r: self._send(r, step, values),
                        lambda: tf.constant(True))

    def _serve_updates_fn(self, required, live, state):
        """Update after update, in-graph, until a control entry arrives."""

        def cond(state, event, rank):
            return tf.equal(event, 0)

        def body(state, event, rank):
            state, event, rank = self._collect(required, state)
            complete = tf.logical_and(tf.equal(event, 0), state["accepted"] >= required)

            def apply():
                self._apply_and_release(state, live)
                return self._empty_state()

            state = tf.cond(complete, apply, lambda: state)
            return state, event, rank

        with tf.device(self.device):
            return tf.while_loop(cond, body, [state, tf.constant(0), tf.constant(-1)],
                                 parallel_iterations=1)

    def _apply_fn(self, live, state):
        with tf.device(self.device):
            self._apply_and_release(state, live)

    def _release_one_fn(self, rank):
        with tf.device(self.device):
            self._send(rank, self._step(), self._flat_values(), message=protocol.SYNC_MESSAGE)

    def _rejoin_fn(self, rank, live):
        """A worker (re)joins: SSP counts it from the slowest other live worker's clock."""
        with tf.device(self.device):
            others = tf.logical_and(live, tf.logical_not(tf.one_hot(
                rank, self.num_workers, on_value=True, off_value=False)))
            slowest = self._slowest_clock(self.clocks.read_value(), others)
            clock = tf.where(slowest == _NO_CLOCK, tf.constant(0, tf.int64), slowest)
            self.clocks.scatter_nd_update([[rank]], [clock])
            self._forget_fn(rank)

    def _forget_fn(self, rank):
        with tf.device(self.device):
            self.waiting.scatter_nd_update([[rank]], [False])

    # Python loop ------------------------------------------------------------------------

    def _set_member(self, rank, status):
        with self.service.lock:
            self.members[rank] = status
        with tf.device(self.device):
            self.progress.scatter_nd_update([[protocol.STAT_MEMBERS + rank]], [status])

    def admit(self, rank):
        """Under the service's lock: lets worker `rank` join; False if the run is ending.

        A rank that left or died is expected again (a restarted worker), so the run does not
        end before its SYNC arrives.
        """
        if self.closing or self.finished.is_set():
            return False
        if self.members[rank] in (protocol.LEFT, protocol.DIED):
            self.members[rank] = protocol.EXPECTED
        return True

    def _end_if_nobody_is_left(self):
        with self.service.lock:
            if self.policy.required(len(self.live)) == 0:
                self.closing = True
        return self.closing

    def _live_mask(self):
        return tf.constant([m in (protocol.EXPECTED, protocol.LIVE) for m in self.members])

    def _serve(self):
        empty = self._empty_state()
        state = empty
        while True:
            required = self.policy.required(len(self.live))
            if required == 0 and self._end_if_nobody_is_left():
                self._record_end(self._step(), {**empty, "dropped": state["dropped"]})
                log.info("tfdist: %s: every worker left run %s", self.service.task, self.run)
                return
            if required == 0:
                continue  # a worker said hello as the run was about to end: it is expected
            state, event, rank = self._serve_updates(tf.constant(required), self._live_mask(),
                                                     state)
            event, rank = int(event), int(rank)
            if event == -protocol.SYNC:
                # A worker joins (or re-joins): it is sent the current weights. A push of an
                # earlier process of its rank is still used, but not answered: the new
                # process waits for a reply to its own pushes only.
                self._rejoin(tf.constant(rank), self._live_mask())
                if self.members[rank] != protocol.LIVE:
                    self._set_member(rank, protocol.LIVE)
                state = {**state, "released": tf.tensor_scatter_nd_update(
                    state["released"], [[rank]], [False])}
                self._release_one(tf.constant(rank))
            elif event == -protocol.LEAVE:
                if self.members[rank] in (protocol.EXPECTED, protocol.LIVE):
                    self._set_member(rank, protocol.LEFT)
            elif event == -protocol.DEAD:
                was = self.members[rank]
                if was not in (protocol.EXPECTED, protocol.LIVE):
                    continue
                self._set_member(rank, protocol.DIED)
                self._forget(tf.constant(rank))
                task = f"{self.worker_tasks[rank]} at {self.worker_addresses[rank]}"
                what = (f"{task} died" if was == protocol.LIVE else
                        f"{task} never joined the run (its server did not answer within "
                        f"init_timeout={self.spec['init_timeout']:g} s)")
                if self.policy.fails_on_dead_worker:
                    raise RunFailed(
                        f"{what}, and with replicas_to_aggregate equal to the number of "
                        "workers (hard sync) no update can be made without it")
                log.warning("tfdist: %s: %s; going on with %d worker(s)",
                            self.service.task, what, len(self.live))
            elif event == -protocol.STOP:
                return
            if self.policy.defers_release:
                self._release_caught_up(self._live_mask())
            # Fewer workers may now be enough for the pushes already taken.
            accepted = int(state["accepted"])
            if 0 < accepted >= self.policy.required(len(self.live)):
                self._apply_now(self._live_mask(), state)
                state = empty

    def _drain_with_error(self, message):
        """Tells every worker `message` (token -1) until every training one left or died.

        Workers that never joined are told when they say hello, until the run has drained;
        a worker that then says hello starts a new run.
        """
        for rank in self.live:
            self._reply(rank, -1, message)
        while protocol.LIVE in self.members:
            with tf.device(self.device):
                entry = tf.raw_ops.QueueDequeueV2(handle=self.push_queue,
                                                  component_types=self.push_dtypes)
            tag, rank = int(entry[0]), int(entry[1])
            if tag in (protocol.LEAVE, protocol.DEAD):
                if self.members[rank] in (protocol.EXPECTED, protocol.LIVE):
                    self._set_member(rank, protocol.LEFT if tag == protocol.LEAVE
                                     else protocol.DIED)
            elif tag == protocol.STOP:
                return
            else:
                self._reply(rank, -1, message)

    def teardown(self):
        """Frees the run's resources (when the next run starts: the telemetry of a finished
        run stays readable until then)."""
        handles = [self.push_queue, *self.reply_queues, self.progress.handle,
                   *[m.handle for m in self.masters.values()]]
        with tf.device(self.device):
            for handle in handles:
                try:
                    tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
                except tf.errors.OpError:
                    pass


class PSService:
    """Answers workers' hellos and runs the shard updaters of one ps task.

    Args:
      config: the ps task's `ClusterConfig`.
      liveness_interval: seconds between probes of the workers' servers.
      misses_to_dead: failed probes in a row after which a worker is dead.
    """

    def __init__(self, config, liveness_interval=0.5, misses_to_dead=4):
        self.config = config
        self.misses_to_dead = misses_to_dead
        self.task = f"/job:ps/task:{config.task_index}"
        self.device = f"/job:ps/replica:0/task:{config.task_index}/device:CPU:0"
        self.liveness_interval = liveness_interval
        self.current = None
        self._runs = 0
        self._stop = threading.Event()
        # Orders "a worker joins the current run" against "the run ends".
        self.lock = threading.Lock()
        with tf.device(self.device):
            self.control = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.string], shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=protocol.CONTROL_QUEUE)
            self.hello_queues = {}
        self._threads = [threading.Thread(target=self._serve_control, name="tfdist-control",
                                          daemon=True),
                         threading.Thread(target=self._watch, name="tfdist-watch",
                                          daemon=True)]

    def start(self):
        for thread in self._threads:
            thread.start()
        return self

    def stop(self):
        self._stop.set()
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.control,
                                      components=[tf.constant(protocol.encode({"type": "stop"}))])

    def _answer(self, rank, answer):
        if rank not in self.hello_queues:
            with tf.device(self.device):
                self.hello_queues[rank] = tf.raw_ops.FIFOQueueV2(
                    component_types=[tf.string], shapes=[], capacity=-1,
                    container=protocol.CONTAINER, shared_name=f"hello/{rank}")
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.hello_queues[rank],
                                      components=[tf.constant(protocol.encode(answer))])

    def _serve_control(self):
        while not self._stop.is_set():
            with tf.device(self.device):
                text = tf.raw_ops.QueueDequeueV2(handle=self.control,
                                                 component_types=[tf.string])[0]
            message = protocol.decode(text.numpy())
            try:
                if message["type"] == "hello":
                    self._hello(message)
                elif message["type"] == "absent" and self.current is not None:
                    self.current.send_control(protocol.LEAVE, message["rank"])
            except Exception as e:  # A bad message must not stop the service.
                log.exception("tfdist: %s: bad control message", self.task)
                if "rank" in message:
                    self._answer(message["rank"], {"nonce": message.get("nonce"),
                                                   "error": f"{type(e).__name__}: {e}"})

    def _hello(self, message):
        rank, spec = message["rank"], message["spec"]
        with self.lock:
            run = self.current
            if run is not None and not (run.closing or run.finished.is_set()):
                difference = protocol.compare_specs(run.spec, spec)
                if difference is not None:
                    self._answer(rank, {"nonce": message["nonce"], "error": (
                        f"{spec['worker_tasks'][rank]} does not fit run {run.run} on "
                        f"{self.task}: {difference}. Every worker must build the same model "
                        "and optimizer under the strategy's scope")})
                    return
            if run is not None and not run.admit(rank):
                run = None
        if run is None:
            if self.current is not None:
                self.current.finished.wait(timeout=30)  # a closing run records its end
                self.current.teardown()
            self._runs += 1
            run = ShardUpdater(self, f"{int(time.time())}-{self._runs}", spec)
            self.current = run
            run.start()
            log.info("tfdist: %s: run %s started by %s", self.task, run.run,
                     spec["worker_tasks"][rank])
        initialize = rank == 0 and not all(is_initialized(v) for v in run.masters.values())
        self._answer(rank, {"nonce": message["nonce"], "run": run.run,
                            "initialize": initialize, "error": run.failure})

    def _watch(self):
        """Finds workers whose server went away, or never came, and tells their run.

        A worker that has joined, or whose server was seen, is dead after `misses_to_dead`
        missed probes in a row;
        one whose server never answered is dead `init_timeout` after the run started. A
        slow worker whose server answers is never cut off.
        """
        misses, seen, told = {}, set(), set()
        while not self._stop.wait(self.liveness_interval):
            run = self.current
            if run is None or run.finished.is_set():
                continue
            for rank, status in enumerate(list(run.members)):
                key = (run.run, rank)
                if status not in (protocol.EXPECTED, protocol.LIVE):
                    misses.pop(key, None)
                    told.discard(key)
                    continue
                if is_listening(run.worker_addresses[rank], timeout=0.5):
                    misses[key] = 0
                    seen.add(key)
                    continue
                misses[key] = misses.get(key, 0) + 1
                late = time.monotonic() - run.created > run.spec["init_timeout"]
                if key not in told and (misses[key] >= self.misses_to_dead if (
                        status == protocol.LIVE or key in seen) else late):
                    told.add(key)
                    try:
                        run.send_control(protocol.DEAD, rank)
                    except tf.errors.OpError:
                        pass  # the run ended meanwhile
