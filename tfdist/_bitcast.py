"""int64 and floating values carried exactly in float32 tensors (the ps push and reply, the
gossip messages)."""

import tensorflow as tf


def ints_as_floats(ints):
    """int64 `[n]` as the float32 `[2n]` of the same bits (to travel in a float32 pack)."""
    return tf.reshape(tf.bitcast(ints, tf.float32), [-1])


def floats_as_ints(floats):
    """The inverse of `ints_as_floats`."""
    return tf.bitcast(tf.reshape(floats, [-1, 2]), tf.int64)


def as_float32_words(value):
    """A floating tensor as a float32 vector that carries it exactly: float32 as is, an
    8-byte float as the two float32 words of its bits, a 2-byte float cast (exact)."""
    if not value.dtype.is_floating:
        raise TypeError(f"as_float32_words carries floating tensors. Received: {value.dtype}")
    if value.dtype == tf.float32:
        return tf.reshape(value, [-1])
    if value.dtype.size == 8:
        return tf.reshape(tf.bitcast(value, tf.float32), [-1])
    return tf.reshape(tf.cast(value, tf.float32), [-1])


def float32_words_size(dtype, shape):
    """How many float32 words `as_float32_words` makes of a tensor of `dtype` and `shape`."""
    return tf.TensorShape(shape).num_elements() * (2 if tf.as_dtype(dtype).size == 8 else 1)


def from_float32_words(words, dtype, shape):
    """The inverse of `as_float32_words`, for a tensor of `dtype` and `shape`."""
    dtype = tf.as_dtype(dtype)
    if dtype.size == 8:
        return tf.reshape(tf.bitcast(tf.reshape(words, [-1, 2]), dtype), shape)
    return tf.reshape(tf.cast(words, dtype), shape)
