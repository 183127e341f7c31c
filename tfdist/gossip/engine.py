"""The engine of Stochastic Gradient Push (Assran et al., ICML 2019): one worker's step.

A worker holds its parameters x (the push-sum numerator) and a push-sum weight w (1 at the
start); its model variables hold the de-biased z = x / w, on which Keras computes the
gradient. A step is:

    x <- x - lr * update(grad f(z))         the user's optimizer, its state local
    send x / (p + 1), w / (p + 1) to each of the step's p out-peers
    x <- x / (p + 1) + the x shares received; w likewise; z <- x / w

Messages travel on TF's own runtime (`tfdist.gossip.node`); `join`'s reading of the inboxes
is `tfdist.gossip.drain`. The public strategy is `tfdist.strategies.gossip`.
"""

import atexit
import logging
import threading

import numpy as np
import tensorflow as tf

from tfdist import _saved_state
from tfdist import _tf_compat
from tfdist._args import check_bool
from tfdist._args import check_int
from tfdist._args import check_seconds
from tfdist._worker import BetweenGraphExtendedMixin
from tfdist.cluster import as_cluster_config
from tfdist.cluster.network import CONNECT_TIMEOUT_ENV
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT
from tfdist.cluster.network import STALL_TIMEOUT_ENV
from tfdist.cluster.network import timeout_from_env
from tfdist.gossip import graphs
from tfdist.gossip import protocol
from tfdist.gossip import state as gossip_state
from tfdist.gossip.drain import Drain
from tfdist.gossip.graphs import Schedule
from tfdist.gossip.node import GossipNode
from tfdist.gossip.node import PeerError
from tfdist.gossip.node import sum_in_rank_order
from tfdist.gossip.plans import Plans

log = logging.getLogger("tfdist")


def check_arguments(graph, peers_per_step, overlap, max_delay, final_average, num_workers):
    """The schedule of a Stochastic Gradient Push run, its arguments checked."""
    check_bool("overlap", overlap)
    check_bool("final_average", final_average)
    check_int("max_delay", max_delay, "an integer >= 1 (steps a message may be late with "
              "`overlap=True`)", low=1)
    if not overlap and max_delay != 1:
        raise ValueError(f"`max_delay` bounds how late a message may be taken with "
                         f"`overlap=True`; with overlap=False every message is taken at the "
                         f"step it was sent. Received: max_delay={max_delay} with overlap=False")
    return Schedule(graph, peers_per_step, num_workers)


class _Step:
    """What one call of the replica function (a trace, or an eager step) trained."""

    def __init__(self):
        self.variables = []  # the optimizer's variables, in the order it updated them


class StochasticGradientPushExtended(BetweenGraphExtendedMixin, _tf_compat.OneDeviceExtended):
    """The engine of `StochasticGradientPushStrategy` (one replica per worker process)."""

    def __init__(self, container_strategy, graph="exponential", peers_per_step=1, overlap=True,
                 max_delay=1, final_average=True, cluster=None, connect_timeout=None,
                 peer_timeout=10.0, inter_op_threads=1, stall_timeout=None):
        config = as_cluster_config(cluster)
        if config.task_type not in ("chief", "worker"):
            raise ValueError(f"Stochastic Gradient Push runs in `chief` or `worker` tasks. "
                             f"Received task type: {config.task_type!r}")
        if config.num_ps:
            raise ValueError(f"Stochastic Gradient Push has no parameter server: the cluster "
                             f"must have no ps job (`tfdist-launch --num_ps=0`). Received "
                             f"{config.num_ps} ps task(s)")
        num_workers = config.num_workers
        self._schedule = check_arguments(graph, peers_per_step, overlap, max_delay,
                                         final_average, num_workers)
        if connect_timeout is None:  # tfdist-launch --kubernetes exports a longer one
            connect_timeout = timeout_from_env(CONNECT_TIMEOUT_ENV, 60.0)
        if stall_timeout is None:  # tfdist-launch --stall_timeout exports one
            stall_timeout = timeout_from_env(STALL_TIMEOUT_ENV, DEFAULT_STALL_TIMEOUT)
        for name, value in (("connect_timeout", connect_timeout),
                            ("peer_timeout", peer_timeout), ("stall_timeout", stall_timeout)):
            check_seconds(name, value)
        check_int("inter_op_threads", inter_op_threads, "an integer >= 1", low=1)
        # A callable graph's step waits for its peers' plans in a `tf.py_function`, which
        # holds an inter-op thread while it waits: one more.
        node = GossipNode(config, connect_timeout, peer_timeout,
                          inter_op_threads + (0 if self._schedule.periodic else 1), stall_timeout)
        super().__init__(container_strategy, node.compute_device)
        self._node = self._connection = node  # `_connection`: for WorkerTasksMixin
        self._overlap = overlap
        self._max_delay = max_delay
        self._final_average = final_average
        self._tls = threading.local()
        self._variables = None
        self._left = False
        self._final_weight_sum = None
        self._peer_steps = None
        self._plans = None  # a callable graph's `Plans`, from the first step on
        with tf.init_scope(), tf.device(node.host_device):
            def state(name, value, dtype):
                return tf.Variable(tf.constant(value, dtype), trainable=False,
                                   name=f"tfdist_sgp_{name}")

            self._weight = state("weight", 1.0, tf.float32)
            self._active = state("active", True, tf.bool)  # False once the worker left
            self._step = state("step", 0, tf.int64)
            # The step this worker (re)started at: no message sent before it is waited for
            # (a worker restored from a checkpoint does not get what was in flight then).
            self._start = state("start", 0, tf.int64)
            # Per sender: messages it owes by now (with the overlap, those sent up to
            # max_delay steps ago), messages taken, and the step count of its END (-1: none).
            self._due = state("due", [0] * num_workers, tf.int64)
            self._consumed = state("consumed", [0] * num_workers, tf.int64)
            self._ended = state("ended", [-1] * num_workers, tf.int64)
            # Telemetry: messages taken, taken at a later step than sent, the largest
            # delay (steps), steps that waited for a message, bytes sent.
            self._stats = state("stats", [0, 0, 0, 0, 0], tf.int64)
        self._saved = gossip_state.GossipState(self)
        self._on_use = _saved_state.OnUse(lambda o: gossip_state.attach(o, self._saved))
        # The float variables of the Keras layers made under this strategy's scope (weights,
        # and non-trainable ones such as BatchNormalization's moving statistics), in order.
        self._model_variables = []
        atexit.register(self._leave_at_exit)

    # Checkpoints -------------------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        # The optimizer made under this strategy gets the gossip state once it is put to use
        # (a model, metrics made after it), so that loading a file before the first step
        # restores it, and one revived from its config has the same attributes.
        self._on_use.seen(_tf_compat.keras_optimizer_in_scope())
        variable = super()._create_variable(next_creator, **kwargs)
        if (_tf_compat.keras_layer_in_scope() is not None and variable.dtype.is_floating
                and not self._left):
            self._model_variables.append(variable)
        return variable

    def gossip_state(self):
        """`(push-sum weight, step, rank, num_workers)`, what a checkpoint holds."""
        with tf.init_scope():
            return (float(self._weight.numpy()), int(self._step.numpy()), self._node.rank,
                    self._node.num_workers)

    def restore_gossip_state(self, weight, step):
        """Sets the push-sum weight and (unless None) the step count from a checkpoint;
        messages sent before are not waited for."""
        with tf.init_scope():
            self._weight.assign(weight)
            if step is not None:
                self._step.assign(step)
                self._start.assign(step)
            self._due.assign(self._consumed.read_value())

    # The step ----------------------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        step = _Step()
        previous = getattr(self._tls, "step", None)
        self._tls.step = step
        try:
            result = super()._call_for_each_replica(fn, args, kwargs)
        finally:
            self._tls.step = previous
        if previous is not None:  # a LossScaleOptimizer applies in a replica call of its own
            known = {id(v) for v in previous.variables}
            previous.variables.extend(v for v in step.variables if id(v) not in known)
            return result
        if not step.variables:
            return result  # evaluate / predict: no gossip
        self._gossip(step.variables)
        if isinstance(result, dict):
            return {**result, **self._logs()}
        return result

    def _update(self, var, fn, args, kwargs, group):
        step = getattr(self._tls, "step", None)
        if step is None or _tf_compat.keras_update_step_arguments(args) is None:
            return super()._update(var, fn, args, kwargs, group)
        # The optimizer's step moves x = w z with the gradient taken at z; the variable holds
        # z again after it (a step the optimizer skips, e.g. a non-finite loss-scaled one,
        # leaves z as it was, and the gossip below runs on every step either way).
        if self._left:
            raise ValueError(f"{self._node.task_name} has left the run (`strategy.join()`): it "
                             "cannot train any more")
        gossip_state.attach(_tf_compat.keras_optimizer_in_scope(), self._saved)
        weight = tf.cast(self._weight.read_value(), var.dtype)
        var.assign(var * weight, read_value=False)
        result = super()._update(var, fn, args, kwargs, group)
        var.assign(var / weight, read_value=False)
        if not any(v is var for v in step.variables):
            step.variables.append(var)
        return result

    def _layout(self, variables):
        if self._variables is None:
            self._variables = list(variables)
            self._sizes = [v.shape.num_elements() for v in variables]
            self._node.open_inboxes(protocol.message_size(sum(self._sizes)))
            if not self._schedule.periodic:
                self._agree_on_schedule()
                self._plans = Plans(self._schedule, self._node)
                with tf.init_scope():
                    self._plans.start(int(self._step.numpy()))
        elif [id(v) for v in variables] != [id(v) for v in self._variables]:
            raise ValueError("the train step trains other variables than the run's first step: "
                             "every step of a Stochastic Gradient Push run must train the same "
                             "variables (set `trainable` before the first `fit`)")

    def _agree_on_schedule(self):
        """Sends every peer the digests of this worker's answers of the callable graph for
        the first steps, and compares theirs (each sender's first message) before the first
        step: graphs that answer differently on different workers fail here, named, instead
        of leaving a worker waiting for a message that is never sent."""
        node = self._node
        steps = min(graphs.CHECKED_STEPS, node.size - protocol.HEAD)
        others = [r for r in range(node.num_workers) if r != node.rank]
        digests = self._schedule.digests(steps).astype(np.float32)  # 24 bits: exact
        values = np.zeros([node.size - protocol.HEAD], np.float32)
        values[:steps] = digests
        with tf.init_scope():
            node.send(tf.constant(others), protocol.pack(protocol.SCHEDULE, node.rank, steps,
                                                         0.0, tf.constant(values)))
            theirs = {}
            for sender in others:
                tag, info, _, values = node.take_one(sender)
                if tag == protocol.DEAD:
                    raise PeerError(node.dead_message(info))
                if tag != protocol.SCHEDULE or info != steps:
                    raise PeerError(f"tfdist: an unexpected gossip message (tag {tag}) from "
                                    f"{node.names[sender]} reached {node.task_name} before "
                                    "the first step: every worker must run the same tfdist "
                                    "version, strategy arguments and `graph`")
                theirs[sender] = values.numpy()[:steps].astype(np.int64)
        try:
            graphs.check_agreement(self._schedule, node.names, node.rank, theirs)
        except ValueError:
            self._left = True  # the run cannot start: nothing to take or average at exit
            node.stop(timeout=5.0)
            raise

    def _peers_and_counts(self, step):
        """`(out-peers int32 [p], in-counts function step -> int64 [M])` in-graph."""
        schedule, rank = self._schedule, self._node.rank
        if schedule.periodic:
            out, counts = schedule.tables(rank)
            out, counts = tf.constant(out), tf.constant(counts)
            period = schedule.period
            return (tf.gather(out, step % period),
                    lambda s: tf.gather(counts, s % period))

        # Each worker's own answers, announced in plans; a receiver counts on the senders'
        # plans (`tfdist.gossip.plans`), after it announced its own (its peers may wait).
        plans = self._plans
        out = tf.py_function(lambda k: plans.out_peers(int(k)), [step], tf.int32)
        out.set_shape([schedule.peers_per_step])

        def in_counts(s):
            with tf.control_dependencies([out]):
                value = tf.py_function(lambda k: plans.in_counts(int(k)), [s], tf.int64)
            value.set_shape([schedule.num_workers])
            return value

        return out, in_counts

    def _gossip(self, variables):
        self._layout(variables)
        node, num_workers = self._node, self._node.num_workers
        with tf.device(node.host_device):
            step = self._step.read_value()
            weight = self._weight.read_value()
            x = tf.concat([tf.reshape(tf.cast(v.read_value(), tf.float32), [-1])
                           for v in self._variables], axis=0) * weight
            peers, in_counts = self._peers_and_counts(step)
            share = 1.0 / (tf.reduce_sum(tf.cast(peers >= 0, tf.float32)) + 1.0)
            active = tf.debugging.Assert(self._active.read_value(), [
                f"{node.task_name} has left the run (`strategy.join()`): it cannot train any "
                "more"])
            with tf.control_dependencies([active]):
                sent = node.send(peers, protocol.pack(step, node.rank, 0, weight * share,
                                                      x * share))
            consumed = self._consumed.read_value()
            if self._overlap:
                late_step = step - self._max_delay
                due = self._due.read_value() + tf.where(
                    late_step >= self._start.read_value(), in_counts(tf.maximum(late_step, 0)),
                    tf.zeros([num_workers], tf.int64))
            else:
                due = consumed + in_counts(step)
            ended = self._ended.read_value()
            needed = tf.maximum(due - consumed, 0)
            with tf.control_dependencies([sent]):
                messages, senders, waited = node.take(needed, self._overlap, ended >= 0)
            tags, _, infos, weights, values = protocol.unpack(messages)
            checks = self._check_messages(tags, infos)
            training = tags >= 0
            got = tf.math.unsorted_segment_sum(tf.cast(training, tf.int64), senders,
                                               num_workers)
            weights = tf.where(training, weights, 0.0)
            values = tf.where(training[:, None], values, 0.0)
            new_weight = weight * share + tf.reduce_sum(weights)
            new_x = x * share + tf.reduce_sum(values, axis=0)
            delays = tf.where(training, step - tags, 0)
            is_end = tags == protocol.END
            new_ended = tf.tensor_scatter_nd_max(
                ended, tf.where(is_end, senders, 0)[:, None],
                tf.where(is_end, infos, -1))
            stats = self._stats.read_value()
            new_stats = tf.stack([
                stats[0] + tf.reduce_sum(got),
                stats[1] + tf.reduce_sum(tf.cast(delays > 0, tf.int64)),
                tf.maximum(stats[2], tf.reduce_max(tf.concat([delays, tf.zeros([1], tf.int64)],
                                                              0))),
                stats[3] + tf.cast(waited, tf.int64),
                stats[4] + 4 * node.size * tf.reduce_sum(tf.cast(peers >= 0, tf.int64))])
        with tf.control_dependencies(checks):
            updates = [self._weight.assign(new_weight, read_value=False),
                       self._consumed.assign(consumed + got, read_value=False),
                       self._due.assign(due, read_value=False),
                       self._ended.assign(new_ended, read_value=False),
                       self._stats.assign(new_stats, read_value=False),
                       self._step.assign_add(1, read_value=False)]
            z = new_x / new_weight
            for variable, part in zip(self._variables, tf.split(z, self._sizes)):
                updates.append(variable.assign(
                    tf.cast(tf.reshape(part, variable.shape), variable.dtype), read_value=False))
        return tf.group(updates)

    def _check_messages(self, tags, infos):
        """Asserts that fail the step: a DEAD report (with the peer's name), a message that
        has no place in a training step."""
        node = self._node
        texts = tf.constant([node.dead_message(r) for r in range(node.num_workers + 1)])
        dead = tags == protocol.DEAD
        # (a sentinel keeps argmax off an empty batch)
        first_dead = tf.gather(tf.concat([infos, [0]], 0),
                               tf.argmax(tf.cast(tf.concat([dead, [False]], 0), tf.int32)))
        no_dead = tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(dead)),
            [tf.gather(texts, tf.clip_by_value(first_dead, 0, node.num_workers))])
        # A sender whose END came instead of a message has ended its training (fewer steps,
        # or an EarlyStopping): the step goes on without it. It takes this worker's
        # messages until this worker ends too, so no push-sum mass is lost.
        is_end = tags == protocol.END
        known = tf.reduce_all((tags >= 0) | dead | is_end)
        no_stray = tf.debugging.Assert(known, ["tfdist: an unexpected gossip message (tags ",
                                               tags, ") reached ", node.task_name])
        return [no_dead, no_stray]

    # Logs ------------------------------------------------------------------------------

    def _logs(self):
        stats = self._stats.read_value()
        return {"push_sum_weight": self._weight.read_value(), "messages_late": stats[1],
                "message_delay_max": stats[2], "gossip_waits": stats[3]}

    def progress(self):
        stats = [int(s) for s in self._stats.numpy()]
        # A callable graph's plans travel too (`tfdist.gossip.plans`): counted in
        # `bytes_sent`, and on their own.
        plan_bytes = self._plans.bytes_sent if self._plans is not None else 0
        return {"step": int(self._step.numpy()), "push_sum_weight": float(self._weight.numpy()),
                "messages_received": stats[0], "messages_late": stats[1],
                "message_delay_max": stats[2], "gossip_waits": stats[3],
                "bytes_sent": stats[4] + plan_bytes, "plan_bytes_sent": plan_bytes,
                "final_weight_sum": self._final_weight_sum, "peer_steps": self._peer_steps}

    # Ending ------------------------------------------------------------------------------

    def leave(self):
        """Ends this worker's training: takes every message its peers sent it, and with
        `final_average` averages the models of all the workers exactly (the same weights on
        every worker); then its courier delivers what is left and exits. Called at exit."""
        if self._left:
            return
        self._left = True
        node = self._node
        try:
            self._active.assign(False)
            if node.size is not None:
                with tf.init_scope():
                    self._finish()
        finally:
            node.stop()

    def _leave_at_exit(self):
        if self._node.reported is not None:
            self._left = True  # a peer died: nothing more will come from it
            self._node.stop(timeout=5.0)
            return
        try:
            self.leave()
        except (PeerError, tf.errors.OpError) as e:
            log.error("tfdist: %s could not end its run cleanly: %s", self._node.task_name, e)

    def _finish(self):
        node, num_workers = self._node, self._node.num_workers
        steps = int(self._step.numpy())
        others = [r for r in range(num_workers) if r != node.rank]
        if self._plans is not None:  # first: a peer that took the END waits for no plan
            self._plans.end(steps)
        node.send(tf.constant(others), protocol.control(protocol.END, node.rank, steps,
                                                        node.size))
        weight = self._weight.numpy()
        x = np.concatenate([np.reshape(v.numpy(), [-1]).astype(np.float32)
                            for v in self._variables]) * weight
        state = Drain(self, steps, x, weight)
        for sender in others:
            state.advance(sender, until=1)
        models = {node.rank: (state.x, state.weight)}
        if self._final_average:
            local_variables = self._local_variables()
            local = (np.concatenate([np.reshape(v.numpy(), [-1]).astype(np.float32)
                                     for v in local_variables])
                     if local_variables else np.zeros([0], np.float32))
            state.expect_local(local.size)
            node.send(tf.constant(others), protocol.pack(protocol.AVERAGE, node.rank,
                                                         local.size, state.weight, state.x))
            for index, part in enumerate(state.local_parts(local)):
                node.send(tf.constant(others), protocol.pack(protocol.LOCAL, node.rank, index,
                                                             0.0, part))
            for sender in others:
                state.advance(sender, until=2)
            models.update(state.models)
            total_weight = float(sum_in_rank_order([models[r][1] for r in range(num_workers)]))
            x = sum_in_rank_order([models[r][0] for r in range(num_workers)]) / total_weight
            weight = np.float32(1.0)
            self._final_weight_sum = total_weight
            # Not gossiped, not mixed by push-sum: their plain mean over the workers.
            state.locals[node.rank] = local
            local = sum_in_rank_order([state.locals[r] for r in range(num_workers)])
            _assign_flat(local_variables, local / num_workers)
        else:
            x, weight = state.x / state.weight, state.weight
        _assign_flat(self._variables, x)
        self._weight.assign(weight)
        # The training messages taken here count in `messages_received` as the steps' do.
        taken = int(np.sum(state.consumed - self._consumed.numpy()))
        self._stats.assign(self._stats.numpy() + np.array([taken, 0, 0, 0, 0], np.int64))
        self._consumed.assign(state.consumed)
        self._peer_steps = [state.peer_steps.get(r) for r in range(num_workers)]

    def _local_variables(self):
        """The model's float variables that the steps do not gossip: they stay each worker's
        own in training, and the final average takes their plain mean.

        As in the reference implementation (facebookresearch/stochastic_gradient_push,
        `GossipDataParallel`), only what the optimizer trains is gossiped; module buffers
        (BatchNormalization's running statistics) are never mixed across workers there. Here
        they are averaged once, with the model, so that every worker ends on the same full
        model (the reference leaves them differing).
        """
        trained = {id(v.handle) for v in self._variables}
        return [v for v in self._model_variables if id(v.handle) not in trained]


def _assign_flat(variables, values):
    """Sets `variables` from the float vector `values` (their values one after another)."""
    sizes = [v.shape.num_elements() for v in variables]
    for variable, part in zip(variables, np.split(np.asarray(values, np.float32),
                                                  np.cumsum(sizes)[:-1])):
        variable.assign(np.reshape(part, variable.shape).astype(variable.dtype.as_numpy_dtype))
