"""The all-reduce family: Mirrored and MultiWorkerMirrored with compressed gradient exchange.

Both strategies are TF's own engines (MirroredStrategy's cross-device ops in one process, TF
collective ops between processes) with one change: when Keras's optimizer all-reduces the
gradients, a `tfdist.compression` compressor encodes each replica's part, the payloads are
all-reduced (linear compressors) or all-gathered (the others), and every replica decodes
and sums them. With `compression=None` nothing of that runs and the numbers are the
built-in strategy's own whenever the replicas' batches are the same size.

Both give Keras 3 `fit` the gradient of a single process on the same global batches when the
replicas' batches differ in size (a global batch the replicas do not divide, a last partial
batch): each replica's gradient is weighted by its share of the global batch's examples,
where TF's strategies average the replicas' means.

`MultiWorkerMirroredStrategy` also makes Keras 3 `fit` / `evaluate` / `predict` work out of
the box, which TF's does not (keras-team/keras#20585): Keras reduces a whole data batch (a
tuple of per-replica values) to build the model, and scalar logs "along axis 0", through
`Strategy.reduce`; this strategy's `reduce` gives the batch's shapes and accepts both; and
its collectives run inside Keras's `steps_per_execution` loop. No Keras code is patched.
"""

import itertools
import os

import tensorflow as tf

from tfdist import _tf_compat
from tfdist._replica_batches import rank
from tfdist._replica_batches import replica_batch_spec
from tfdist.allreduce.engine import CompressedMirroredExtended
from tfdist.allreduce.engine import MultiWorkerMirroredExtended
from tfdist.cluster import config as cluster_config


class _CompressedStrategyMixin:
    """What both compressed strategies offer beyond TF's."""

    @property
    def compressor(self):
        """The compressor in use, or None."""
        return self.extended.compressor

    def reset_compression_state(self):
        """Sets the codec state of every optimizer of this strategy back to its start
        (residuals and momentum to zero, PowerSGD's Q to its seeded start, warm-up step 0).

        The state is also saved and restored with its optimizer (`model.save`,
        ModelCheckpoint, BackupAndRestore, `tf.train.Checkpoint`): reset it when the model is
        given weights that the residuals do not belong to.
        """
        self.extended.reset_compression_state()

    def reduce(self, reduce_op, value, axis):
        """`Strategy.reduce`; a data batch that Keras 3 reduces to build a model from it
        gives its shapes instead, and crosses no device or network.

        Keras 3 reduces the first batch of `fit` / `evaluate` with
        `reduce("MEAN", batch, axis=None)` and reads only the shape and dtype of the result
        (keras-team/keras#20585). Reduced, the batch would travel between every worker, and
        the replicas' parts of a global batch they do not divide (32 rows over 3 replicas:
        11, 11 and 10) cannot be summed: TF fails with "Shape mismatch in the collective".
        """
        if _tf_compat.keras_builds_from_a_batch():
            return tf.nest.map_structure(replica_batch_spec, value)
        return self._reduce_value(reduce_op, value, axis)

    def _reduce_value(self, reduce_op, value, axis):
        return super().reduce(reduce_op, value, axis)


class CompressedMirroredStrategy(_CompressedStrategyMixin, tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` with compressed gradient exchange (one process).

    >>> strategy = tfdist.strategies.CompressedMirroredStrategy(
    ...     ["/cpu:0", "/cpu:1"], compression="topk")
    >>> strategy.compressor
    TopKCompressor(ratio=0.01, error_feedback=True)

    The Keras logs of `fit` gain `bytes_sent` (one replica's payload bytes per step),
    `bytes_dense` (the same gradients uncompressed) and `compression_ratio`.

    Args:
      devices: the replica devices, as for `MirroredStrategy` (default: all GPUs, or the CPU).
      compression: a compressor, its registry name, a `{"name", "config"}` dict, or None (the
        built-in strategy's exact behaviour).
      cross_device_ops: as for `MirroredStrategy`.
    """

    _instances = itertools.count(1)

    def __init__(self, devices=None, compression=None, cross_device_ops=None):
        # TF keys in-process collectives by group and instance, counted per strategy from the
        # same start: a second strategy in the process whose collectives carry another dtype
        # (an fp16 payload) would meet the first one's keys. Each instance gets its own range.
        self._collective_key_base = 100_000 * next(self._instances)
        extended = CompressedMirroredExtended(self, devices=devices,
                                              cross_device_ops=cross_device_ops,
                                              compression=compression)
        tf.distribute.Strategy.__init__(self, extended)


def _check_tf_config():
    """A clear error for a TF_CONFIG this strategy cannot use (rather than a hang in TF)."""
    if not os.environ.get("TF_CONFIG"):
        return
    config = cluster_config.parse_tf_config()
    if config.num_ps:
        raise cluster_config.TFConfigError(
            "TF_CONFIG: MultiWorkerMirroredStrategy all-reduces between chief and worker "
            f"tasks and has no use for ps tasks; remove the 'ps' job. Received: "
            f"{config.num_ps} ps task(s)")


class MultiWorkerMirroredStrategy(_CompressedStrategyMixin,
                                  tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` that works with Keras 3 `fit`, and
    compresses the gradient exchange when asked to.

    The cluster comes from TF_CONFIG (as written by `tfdist-launch`); every worker runs the
    same script. Linear payloads (fp16, PowerSGD factors, random-k values) are all-reduced
    with TF collectives, the others all-gathered, so the bytes between workers shrink.

        strategy = tfdist.strategies.MultiWorkerMirroredStrategy(compression="fp16")
        with strategy.scope():
            model = build_model()
            model.compile(...)
        model.fit(dataset, epochs=3)

    Args:
      compression: a compressor, its registry name, a `{"name", "config"}` dict, or None.
      cluster_resolver: as for TF's strategy (default: TF_CONFIG).
      communication_options: a `tf.distribute.experimental.CommunicationOptions`.

    Raises:
      TFConfigError: TF_CONFIG is malformed or names ps tasks.
    """

    def __init__(self, compression=None, cluster_resolver=None, communication_options=None):
        if cluster_resolver is None:
            _check_tf_config()
        if communication_options is None:
            communication_options = tf.distribute.experimental.CommunicationOptions()
        extended = MultiWorkerMirroredExtended(self, cluster_resolver, communication_options,
                                               compression=compression)
        tf.distribute.Strategy.__init__(self, extended)


    def _reduce_value(self, reduce_op, value, axis):
        """`Strategy.reduce`, for nested values too, and for scalars with `axis=0`.

        Keras 3 reduces its scalar logs with `axis=0`; reducing a scalar along an axis it
        does not have means reducing it over the replicas (keras-team/keras#20585).
        """
        def reduce_one(v):
            v_axis = axis
            if v_axis is not None and rank(v) == 0:
                v_axis = None
            return tf.distribute.MultiWorkerMirroredStrategy.reduce(self, reduce_op, v,
                                                                     axis=v_axis)

        return tf.nest.map_structure(reduce_one, value)


