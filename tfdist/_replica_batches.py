"""The replicas' parts of a step's data: their example counts, and values weighted by them.

The all-reduce strategies weigh each replica's gradient by its share of the global batch's
examples when the replicas' batches differ in size (`tfdist.strategies.collective`).
"""

import tensorflow as tf

from tfdist import _tf_compat


def components(value):
    """A value's per-replica components (a plain tensor is the one of a single replica)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values
    return (value,)


def examples_per_replica(args):
    """The number of examples in each local replica's part of a step's data (the leading
    dimension of its first input, as Keras counts them: an int where the shape says it, a
    tensor otherwise; a sparse input's dense_shape[0], a ragged one's rows), or None if
    `args` holds no per-replica data."""
    def rows(part):
        if isinstance(part, tf.SparseTensor):
            return part.dense_shape[0]
        if isinstance(part, tf.RaggedTensor):
            return part.nrows()
        if isinstance(part, tf.Tensor) and part.shape.rank:
            return part.shape[0] if part.shape[0] is not None else tf.shape(part)[0]
        return None

    for leaf in tf.nest.flatten(args, expand_composites=False):
        if leaf is None:
            continue
        if not isinstance(leaf, tf.distribute.DistributedValues):
            return None
        counts = [rows(part) for part in leaf.values]
        return None if any(n is None for n in counts) else counts
    return None


def weighted(value, weights, wrap_class=None):
    """`value`'s per-replica components, each multiplied by its replica's weight (regrouped
    as `wrap_class`, default PerReplica).

    A replica with no examples (weight 0) gives zeros: its gradient may be NaN (a
    BatchNormalization's over an empty batch), and 0 * NaN would spread through the sum.
    One elementwise op per tensor (`multiply_no_nan`), on every step whose batch size is not
    known when traced: a weight of 1 leaves every value as it is.
    """
    def scaled(tensor, weight):
        return tf.math.multiply_no_nan(tensor, tf.cast(weight, tensor.dtype))

    parts = []
    for part, weight in zip(components(value), weights):
        with tf.device(part.device):
            if isinstance(part, tf.IndexedSlices):
                part = tf.IndexedSlices(scaled(part.values, weight), part.indices,
                                        part.dense_shape)
            else:
                part = scaled(part, weight)
        parts.append(part)
    if wrap_class is None:
        return _tf_compat.regroup(tuple(parts))
    return _tf_compat.regroup(tuple(parts), wrap_class=wrap_class)


def replica_batch_spec(value):
    """The type of one replica's part of `value`, with its batch size left open."""
    spec = tf.type_spec_from_value(components(value)[0])
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        spec = tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
    return spec


def rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank
