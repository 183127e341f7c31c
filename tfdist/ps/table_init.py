"""A table's initial rows, made on the ps task that holds them, a chunk at a time.

A Keras initializer makes a variable's whole value in one tensor. For a table split over
several ps tasks that tensor would sit, whole, on one of them while each part took its rows
from it: a table larger than one ps task could not be split over more of them. Where the
initializer draws every element independently (the constant ones, the random uniform,
normal and truncated normal ones, and the variance-scaling family, whose scale follows the
whole table's shape), `rows_initializer` gives a function that makes any range of rows alone,
run on the part's own ps task.

A random initializer's rows then come from the same distribution as its one-tensor draw, not
the same numbers: each chunk draws with a seed of its own, made from the initializer's seed
and the chunk's first row (an initializer with a `SeedGenerator` draws from it chunk after
chunk). TF's own `ParameterServerStrategy` initializes a partitioned variable shard by shard
alike. Any other initializer (`Orthogonal`, `Identity`, a function of your own) gives None.
"""

import math

import keras
import tensorflow as tf

from tfdist import _tf_compat

# Keras's variance-scaling initializers divide by at least 1 (`VarianceScaling.__call__`).
_MIN_FAN = 1.0


def _constant(initializer):
    return isinstance(initializer, (keras.initializers.Zeros, keras.initializers.Ones,
                                    keras.initializers.Constant))


def _chunk_seed(initializer, begin):
    """The seed of the chunk that starts at row `begin`."""
    seed = initializer.seed
    if isinstance(seed, int):
        # (A deterministic stream per chunk: the same seed gives the same table.)
        return (seed * 1_000_003 + begin) % (2**31 - 1)
    return seed  # a SeedGenerator: its next draw


def _variance_scaling(initializer, shape):
    """`(distribution, stddev or limit)` of a variance-scaling initializer on the whole
    table's `shape`, as Keras 3.15's `VarianceScaling.__call__` computes them."""
    fan_in, fan_out = _tf_compat.keras_initializer_fans(initializer, shape)
    scale = initializer.scale
    if initializer.mode == "fan_in":
        scale /= max(_MIN_FAN, fan_in)
    elif initializer.mode == "fan_out":
        scale /= max(_MIN_FAN, fan_out)
    else:
        scale /= max(_MIN_FAN, (fan_in + fan_out) / 2.0)
    if initializer.distribution == "truncated_normal":
        return "truncated_normal", math.sqrt(scale) / 0.87962566103423978
    if initializer.distribution == "untruncated_normal":
        return "normal", math.sqrt(scale)
    return "uniform", math.sqrt(3.0 * scale)


def rows_initializer(initializer, shape, dtype):
    """`make(begin, end)`: the initial rows `begin:end` of a table of `shape` that Keras
    initializer `initializer` initializes, or None if its elements are not independent draws
    (then only its whole value is its value)."""
    shape = [int(n) for n in shape]
    dtype = tf.as_dtype(dtype)

    def rows_shape(begin, end):
        return [end - begin, *shape[1:]]

    if _constant(initializer):
        return lambda begin, end: tf.convert_to_tensor(
            initializer(rows_shape(begin, end), dtype=dtype.name), dtype)
    random = keras.random
    if isinstance(initializer, keras.initializers.VarianceScaling):
        distribution, size = _variance_scaling(initializer, shape)

        def draw(begin, end):
            seed = _chunk_seed(initializer, begin)
            if distribution == "uniform":
                return random.uniform(rows_shape(begin, end), minval=-size, maxval=size,
                                      dtype=dtype.name, seed=seed)
            return getattr(random, distribution)(rows_shape(begin, end), mean=0.0,
                                                 stddev=size, dtype=dtype.name, seed=seed)
    elif isinstance(initializer, keras.initializers.RandomUniform):
        def draw(begin, end):
            return random.uniform(rows_shape(begin, end), minval=initializer.minval,
                                  maxval=initializer.maxval, dtype=dtype.name,
                                  seed=_chunk_seed(initializer, begin))
    elif isinstance(initializer, (keras.initializers.RandomNormal,
                                  keras.initializers.TruncatedNormal)):
        name = ("truncated_normal" if isinstance(initializer, keras.initializers.TruncatedNormal)
                else "normal")

        def draw(begin, end):
            return getattr(random, name)(rows_shape(begin, end), mean=initializer.mean,
                                         stddev=initializer.stddev, dtype=dtype.name,
                                         seed=_chunk_seed(initializer, begin))
    else:
        return None
    return lambda begin, end: tf.convert_to_tensor(draw(begin, end), dtype)
