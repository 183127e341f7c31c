"""int64 words carried in float32 tensors (the ps push and reply, the gossip messages)."""

import tensorflow as tf


def ints_as_floats(ints):
    """int64 `[n]` as the float32 `[2n]` of the same bits (to travel in a float32 pack)."""
    return tf.reshape(tf.bitcast(ints, tf.float32), [-1])


def floats_as_ints(floats):
    """The inverse of `ints_as_floats`."""
    return tf.bitcast(tf.reshape(floats, [-1, 2]), tf.int64)
