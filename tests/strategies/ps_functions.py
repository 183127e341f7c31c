"""Functions the parameter-server tests hand to the ps tasks (which import them by name)."""

import tensorflow as tf


def frozen(staleness):
    """A staleness function that zeroes every update."""
    return 0.0 * tf.cast(staleness, tf.float32)


def exponential(staleness):
    """exp(-tau)."""
    return tf.exp(-tf.cast(staleness, tf.float32))
