"""The all-reduce engine: TF's own (MirroredStrategy's cross-device ops in one process, TF
collective ops between processes) with a compressed gradient exchange hooked into its
`_batch_reduce_to`, where Keras's gradient all-reduce lands. The public strategies over it:
`tfdist.strategies.collective`.
"""

import logging

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist._replica_batches import components
from tfdist._replica_batches import examples_per_replica
from tfdist._replica_batches import weighted
from tfdist.compression import sparsify
from tfdist.compression import state as compression_state
from tfdist.compression.exchange import STAT_NAMES
from tfdist.compression.exchange import GradientExchange
from tfdist.compression.exchange import StrategyCommunicator
from tfdist.compression.exchange import compression_logs

log = logging.getLogger("tfdist")


class _CompressedExchangeMixin:
    """Routes the gradient all-reduce of a Mirrored-type extended through a compressor.

    Only the optimizer's gradient exchange is compressed: every other sum (synchronized
    BatchNorm statistics, metrics, a user's own all-reduce) is exact.
    """

    def _init_compression(self, compression):
        compressor = compression_lib.get(compression)
        self._exchange = (None if compressor is None
                          else GradientExchange(compressor, _tf_compat.container_strategy(self)))
        self._step_trace = None  # the outermost step being traced: its example counts, stats
        self._stats = None
        self._codec_states = (None if compressor is None else compression_state.StateRegistry(
            _tf_compat.container_strategy(self), compressor, self._replica_offset))
        # Keras's `steps_per_execution > 1` runs its steps in a tf.while_loop.
        for cross_device_ops in _tf_compat.cross_device_ops(self):
            _tf_compat.use_trace_time_instance_keys_in_loops(cross_device_ops)

    @property
    def compressor(self):
        return None if self._exchange is None else self._exchange.compressor

    def reset_compression_state(self):
        if self._codec_states is not None:
            self._codec_states.reset()

    def _replica_offset(self):
        """The global number of this process's first replica."""
        return _tf_compat.worker_index_in_cluster(self) * len(self.worker_devices)

    def _create_variable(self, next_creator, **kwargs):
        # An optimizer made under this strategy gets its codec state once it is put to use
        # (`StateRegistry.attach`: anything made after it, or its build).
        if self._codec_states is not None:
            self._codec_states.attach(_tf_compat.keras_optimizer_in_scope())
        return super()._create_variable(next_creator, **kwargs)

    def compression_states(self):
        """The codec states of the optimizers made under this strategy that hold state."""
        return [] if self._codec_states is None else self._codec_states.states()

    def _stats_variables(self):
        """Step statistics, written where the gradients are exchanged and read where the
        step's logs are made: a LossScaleOptimizer applies in a nested replica call inside a
        branch, whose tensors the outer step cannot use."""
        if self._stats is None:
            with tf.init_scope(), _tf_compat.container_strategy(self).scope():
                self._stats = {
                    name: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"tfdist_{name}",
                                      synchronization=tf.VariableSynchronization.ON_READ,
                                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                    for name in STAT_NAMES}
        return self._stats

    def _call_for_each_replica(self, fn, args, kwargs):
        outer = self._step_trace is None
        if outer:
            # Keras's own step averages each replica's loss over its own rows; a user's
            # step or a custom loop may already scale by the global batch, and a loss
            # summed over the rows is right as the replicas' gradients add: weighted only
            # the first.
            weigh = self._averages_each_replica(_tf_compat.keras_own_train_step(fn))
            self._step_trace = {"written": False,
                                "examples": examples_per_replica(args) if weigh else None}
            if self._exchange is not None:
                # A step whose exchange does not run logs 0 bytes, not the last step's: a
                # LossScaleOptimizer skips a step with non-finite gradients before it
                # all-reduces them (Keras decides on replica 0's gradients, in a cond whose
                # other branch only lowers the scale), so nothing of the step travels.
                for variable in self._stats_variables().values():
                    variable.assign(tf.zeros([], tf.int64))
        try:
            result = super()._call_for_each_replica(fn, args, kwargs)
        finally:
            trace = self._step_trace
            if outer:
                self._step_trace = None
        if outer and trace["written"] and isinstance(result, dict):
            stats = {name: variable.read_value()
                     for name, variable in self._stats_variables().items()}
            result = {**_metrics_of_every_replica(fn, result), **compression_logs(stats)}
        return result

    def _averages_each_replica(self, model):
        """Whether `model`'s compiled losses all average over each replica's rows
        (`sum_over_batch_size` or `mean`), which the example weights make exact."""
        if model is None or model.loss is None:
            return False
        reductions = {getattr(loss, "reduction", "sum_over_batch_size")
                      if isinstance(loss, keras.losses.Loss) else "sum_over_batch_size"
                      for loss in tf.nest.flatten(model.loss) if loss is not None}
        if "mean_with_sample_weight" in reductions and not getattr(
                self, "_warned_sample_weight", False):
            self._warned_sample_weight = True
            log.warning(
                "tfdist: a loss with reduction='mean_with_sample_weight' divides each "
                "replica's loss by that replica's own sum of sample weights: when the "
                "replicas' parts of a batch differ, the step averages the replicas' losses "
                "as TF's strategies do, and is not the single-process step")
        return bool(reductions) and reductions <= {"sum_over_batch_size", "mean"}

    def _record_stats(self, stats):
        """Adds one exchange's statistics to the step's (two optimizers in a step add)."""
        trace = self._step_trace
        first = trace is None or not trace["written"]
        if trace is not None:
            trace["written"] = True
        variables = self._stats_variables()
        return [variables[name].assign(stats[name]) if first
                else variables[name].assign_add(stats[name]) for name in STAT_NAMES]

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # TF takes this path, around `_batch_reduce_to`, when XLA compiles the step on GPUs
        # (`jit_compile=True`): the gradients would go uncompressed, without a word.
        if (self._exchange is not None and _tf_compat.keras_gradient_all_reduce(
                _tf_compat.container_strategy(self)) not in (None, "outside")):
            raise ValueError(
                f"tfdist: `compression={self._exchange.compressor.name!r}` cannot run inside "
                "an XLA-compiled step: TensorFlow all-reduces the gradients of a "
                "`jit_compile=True` step on GPUs inside XLA, around the strategy's "
                "compressed exchange. Compile the model with jit_compile=False (Keras's "
                "default under a distribution strategy), or use compression=None")
        return super()._replica_ctx_all_reduce(reduce_op, value, options)

    def _gradient_variables(self, values):
        """`(optimizer, variables)` of a Keras optimizer's gradient all-reduce of `values`,
        or None if this batch is something else (synchronized BatchNorm statistics, a
        metric, a user's own all-reduce), which is summed as it is."""
        found = _tf_compat.keras_gradient_all_reduce(_tf_compat.container_strategy(self))
        if found == "outside":
            if self._exchange is not None and not getattr(self, "_warned_outside", False):
                self._warned_outside = True
                log.warning(
                    "tfdist: the Keras optimizer was created outside `strategy.scope()`: its "
                    "gradients are all-reduced uncompressed. Create the optimizer (and compile "
                    "the model) inside `with strategy.scope():` to compress them")
            return None
        if found is None:
            return None
        optimizer, variables = found
        if len(variables) != len(values):
            return None
        for variable, value in zip(variables, values):
            component = components(value)[0]
            if (not isinstance(component, tf.IndexedSlices)
                    and component.shape != variable.shape):
                return None
        return optimizer, variables

    def _check_momentum(self, optimizer):
        """DGC beside an optimizer's own momentum: said once, by name."""
        if getattr(self, "_checked_momentum", False):
            return
        self._checked_momentum = True
        warning = sparsify.momentum_applied_twice(self._exchange.compressor, optimizer)
        if warning:
            log.warning("tfdist: %s", warning)

    def _example_counts(self):
        """Each local replica's examples in the step being traced (float32 scalars on its
        device), or None when they need no weighting.

        Keras averages the loss over each replica's own n_r examples and divides it by the N
        replicas, which is the mean over the global batch's n examples only when every
        replica has n / N of them. A global batch that the replicas do not divide (32 over 3:
        11, 11, 10), or a last partial batch (some replicas get none), would weight some
        examples more than others; weighted by N * n_r / n, the summed gradient is the
        single-process gradient of the same global batch (`tf.nn.compute_average_loss(...,
        global_batch_size=<the true global batch>)`). Only for losses averaged over each
        replica's rows (see `_averages_each_replica`). None when every replica has as many
        examples, known when traced: then every weight is 1 and nothing is added.
        """
        trace = self._step_trace
        examples = None if trace is None else trace["examples"]
        if examples is None:
            return None
        static = [tf.get_static_value(n) for n in examples]
        if (None not in static and len(set(static)) == 1
                and not (self._in_multi_worker_mode() and tf.executing_eagerly())):
            # Equal sizes known when traced: every worker runs the same input pipeline, and
            # a global batch rebatched over the replicas has a known size only if it
            # divides. (An eager step sees every size; the other workers' may differ.)
            return None
        counts = []
        for device, n in zip(self.worker_devices, examples):
            with tf.device(device):  # where the all-reduce runs: one batch with the others
                counts.append(tf.cast(n, tf.float32))
        return counts

    def _example_weights(self, counts, options):
        """Each local replica's gradient weight N * n_r / n, from `_example_counts`; between
        processes the total n is all-reduced on its own."""
        if self._in_multi_worker_mode():
            total = super()._batch_reduce_to(
                tf.distribute.ReduceOp.SUM,
                [(_tf_compat.regroup(tuple(counts)),) * 2], options)[0]
            total = components(total)[0]
        else:
            total = tf.add_n(counts)
        scale = float(_tf_compat.container_strategy(self).num_replicas_in_sync)
        return [tf.math.divide_no_nan(scale * n, total) for n in counts]

    @staticmethod
    def _packed_dtype(value_destination_pairs):
        """The dtype the row counts can travel in with the dense gradients of a batch (one
        float32 or float64 for all: TF concatenates a pack, and counts in float16 or
        bfloat16 would round or overflow), else None."""
        dtypes = {c.dtype for value, _ in value_destination_pairs for c in components(value)
                  if not isinstance(c, tf.IndexedSlices)}
        if dtypes <= {tf.float32} or dtypes == {tf.float64}:
            return dtypes.pop() if dtypes else tf.float32
        return None

    def _weighted_sum(self, reduce_op, value_destination_pairs, counts, dtype, options):
        """The uncompressed gradient exchange between processes, weighted by `counts`: each
        replica's gradient times its n_r, all-reduced in the same batch as the n_r (in a
        traced step TF packs a batch's dense tensors into one collective, or into packs of
        `bytes_per_pack`), then scaled by N / n (SUM) or 1 / n (MEAN): no collective of the
        counts' own before it, as weights computed first would need."""
        strategy = _tf_compat.container_strategy(self)
        local = []
        for n in counts:  # on each replica's device, as the gradients: one batch with them
            with tf.device(n.device):
                local.append(tf.cast(n, dtype))
        local = _tf_compat.regroup(tuple(local))
        summed = super()._batch_reduce_to(
            tf.distribute.ReduceOp.SUM,
            [(weighted(value, counts), destination)
             for value, destination in value_destination_pairs] + [(local, local)], options)
        factor = (float(strategy.num_replicas_in_sync)
                  if reduce_op == tf.distribute.ReduceOp.SUM else 1.0)
        scales = []
        for total in components(summed[-1]):
            with tf.device(total.device):
                scales.append(tf.math.divide_no_nan(tf.constant(factor, dtype), total))
        return [weighted(value, scales, wrap_class=_tf_compat.Mirrored)
                for value in summed[:-1]]

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [value for value, _ in value_destination_pairs]
        local_replicas = len(self.worker_devices)
        found = None
        if (reduce_op in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN)
                and all(not isinstance(v, _tf_compat.Mirrored)
                        and len(components(v)) == local_replicas for v in values)):
            found = self._gradient_variables(values)
        if found is None:
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        counts = self._example_counts()
        if counts is not None and self._exchange is None and self._in_multi_worker_mode():
            dtype = self._packed_dtype(value_destination_pairs)
            if dtype is not None:
                return self._weighted_sum(reduce_op, value_destination_pairs, counts, dtype,
                                          options)
        if counts is not None:
            weights = self._example_weights(counts, options)
            value_destination_pairs = [(weighted(value, weights), destination)
                                       for value, destination in value_destination_pairs]
        if self._exchange is None:
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        strategy = _tf_compat.container_strategy(self)
        optimizer, variables = found
        self._check_momentum(optimizer)
        if (self._exchange.compressor.capabilities.variable_size
                and _tf_compat.in_xla_context()):
            raise ValueError(
                f"tfdist: `compression={self._exchange.compressor.name!r}` cannot run inside "
                "an XLA-compiled step (`jit_compile=True`): its payload's size follows the "
                "data, which XLA cannot compile. Compile the model with jit_compile=False "
                "(Keras's default under a distribution strategy), or use a compressor whose "
                "payload has a fixed size (dgc without warm-up, topk, qsgd, ...)")
        # Keyed (and matched by `exclude`) by the variables' Keras paths.
        names = compression_state.unique_names(
            _tf_compat.keras_variable_paths(optimizer, variables))
        # Sparse gradients (IndexedSlices, e.g. of an embedding) are all-gathered by TF as
        # they are; the dense ones of the same batch are compressed.
        local = [list(strategy.experimental_local_results(v)) for v, _ in value_destination_pairs]
        sparse = [any(isinstance(c, tf.IndexedSlices) for c in row) for row in local]
        if all(sparse):
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        reduced = iter(self._compressed_sum(
            reduce_op, [row for row, s in zip(local, sparse) if not s], options,
            [name for name, s in zip(names, sparse) if not s],
            self._codec_states.state_of(optimizer)))
        if any(sparse):
            sparse_reduced = iter(super()._batch_reduce_to(
                reduce_op, [p for p, s in zip(value_destination_pairs, sparse) if s], options))
            return [next(sparse_reduced) if s else next(reduced) for s in sparse]
        return list(reduced)

    def _compressed_sum(self, reduce_op, local, options, names, state):
        """Sums (or means) `local[i][replica]` over every replica through the compressor."""
        strategy = _tf_compat.container_strategy(self)
        communicator = StrategyCommunicator(strategy, super()._batch_reduce_to, options)
        sums, stats = self._exchange.all_reduce(local, communicator, names, state)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            scale = 1.0 / strategy.num_replicas_in_sync
            sums = [[t * tf.cast(scale, t.dtype) for t in row] for row in sums]
        with tf.control_dependencies(self._record_stats(stats)):
            sums = [[tf.identity(t) for t in row] for row in sums]
        return [_tf_compat.regroup(tuple(row), wrap_class=_tf_compat.Mirrored) for row in sums]


class CompressedMirroredExtended(_CompressedExchangeMixin, _tf_compat.MirroredExtended):

    def __init__(self, container_strategy, devices=None, cross_device_ops=None,
                 compression=None):
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)
        self._init_compression(compression)


class MultiWorkerMirroredExtended(_CompressedExchangeMixin,
                                  _tf_compat.CollectiveAllReduceExtended):

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 compression=None):
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        self._init_compression(compression)


def _metrics_of_every_replica(fn, logs):
    """A Keras step's `logs` with each of its model's metrics computed over every replica's
    examples (its variables summed over the replicas, as Keras's `evaluate` reads them).

    Keras takes a `fit` epoch's history from its metrics only when the step's logs have the
    metrics' keys and no other; the compression statistics add keys, so the history holds
    the last step's logs, where each replica's own running mean would otherwise be averaged
    over the replicas (the rows of a smaller part weighing more).
    """
    model = _tf_compat.keras_model_of_step(fn)
    if model is None:
        return logs
    metrics = model.get_metrics_result()
    return {key: metrics.get(key, value) for key, value in logs.items()}
