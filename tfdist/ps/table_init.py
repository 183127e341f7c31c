"""A table's initial rows, made on the ps task that holds them, a chunk at a time.

A Keras initializer makes a variable's whole value in one tensor. For a table split over
several ps tasks that tensor would sit, whole, on one of them while each part took its rows
from it: a table larger than one ps task could not be split over more of them. Where the
initializer draws every element independently, `rows_initializer` gives a function that makes
any range of rows alone, run on the part's own ps task: Keras's own `Zeros`, `Ones` and a
scalar `Constant` (exact), and, for a floating table with an int seed (Keras draws one when
none is given), `RandomUniform`, `RandomNormal`, `TruncatedNormal` and the variance-scaling
family (Glorot, He, LeCun), whose scale follows the whole table's shape. A subclass that
makes its values its own way, a `Constant` of an array, a `SeedGenerator` seed, an integer
table and any other initializer give None: the value is then made whole, as Keras makes it.

A random initializer's rows come from the same distribution as its one-tensor draw, not the
same numbers: rows are drawn in fixed blocks of `BLOCK_ROWS`, each with TF's stateless random
ops seeded by `[seed, block]`, so a seed gives one table whatever its split over ps tasks and
its chunks, and two seeds never share a block's stream. TF's own `ParameterServerStrategy`
also makes a partitioned variable shard by shard.
"""

import math

import keras
import tensorflow as tf

from tfdist import _tf_compat

BLOCK_ROWS = 4096  # rows drawn with one seed: the table does not depend on its split
# Keras's variance-scaling initializers divide by at least 1 (`VarianceScaling.__call__`).
_MIN_FAN = 1.0
_TRUNCATION_CORRECTION = 0.87962566103423978  # Keras's stddev of a truncated unit normal


def _own_call(initializer, base):
    """Whether `initializer` is a `base` that makes its values as `base` does."""
    return isinstance(initializer, base) and type(initializer).__call__ is base.__call__


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
        return "truncated_normal", 0.0, math.sqrt(scale) / _TRUNCATION_CORRECTION
    if initializer.distribution == "untruncated_normal":
        return "normal", 0.0, math.sqrt(scale)
    limit = math.sqrt(3.0 * scale)
    return "uniform", -limit, limit


def _distribution(initializer, shape):
    """`(name, a, b)` of a random initializer tfdist can draw by blocks (uniform: min, max;
    normal, truncated normal: mean, stddev), or None."""
    if _own_call(initializer, keras.initializers.VarianceScaling):
        return _variance_scaling(initializer, shape)
    if _own_call(initializer, keras.initializers.RandomUniform):
        return "uniform", initializer.minval, initializer.maxval
    if _own_call(initializer, keras.initializers.RandomNormal):
        return "normal", initializer.mean, initializer.stddev
    if _own_call(initializer, keras.initializers.TruncatedNormal):
        return "truncated_normal", initializer.mean, initializer.stddev
    return None


def _draw(name, a, b, shape, seed, dtype):
    if name == "uniform":
        return tf.random.stateless_uniform(shape, seed, minval=a, maxval=b, dtype=dtype)
    draw = (tf.random.stateless_normal if name == "normal"
            else tf.random.stateless_truncated_normal)
    return draw(shape, seed, mean=a, stddev=b, dtype=dtype)


def rows_initializer(initializer, shape, dtype):
    """`make(begin, end)`: the initial rows `begin:end` of a table of `shape` that Keras
    initializer `initializer` initializes, or None where only its whole value is its value
    (see the module's docstring)."""
    shape = [int(n) for n in shape]
    dtype = tf.as_dtype(dtype)
    width = shape[1:]
    constant = (_own_call(initializer, keras.initializers.Zeros)
                or _own_call(initializer, keras.initializers.Ones)
                or (_own_call(initializer, keras.initializers.Constant)
                    and tf.convert_to_tensor(initializer.value).shape.rank == 0))
    if constant:
        return lambda begin, end: tf.convert_to_tensor(
            initializer([end - begin, *width], dtype=dtype.name), dtype)
    distribution = _distribution(initializer, shape)
    seed = getattr(initializer, "seed", None)
    if distribution is None or not dtype.is_floating or not isinstance(seed, int):
        return None
    name, a, b = distribution

    def make(begin, end):
        blocks = []
        for block in range(begin // BLOCK_ROWS, (end - 1) // BLOCK_ROWS + 1):
            first = block * BLOCK_ROWS
            rows = min(BLOCK_ROWS, shape[0] - first)
            value = _draw(name, a, b, [rows, *width], tf.constant([seed, block], tf.int64),
                          dtype)
            blocks.append(value[max(begin, first) - first:min(end, first + rows) - first])
        return tf.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]

    return make
