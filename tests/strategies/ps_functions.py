"""Functions the parameter-server tests hand to the ps tasks (which import them by name)."""

import keras
import tensorflow as tf


def frozen(staleness):
    """A staleness function that zeroes every update."""
    return 0.0 * tf.cast(staleness, tf.float32)


def exponential(staleness):
    """exp(-tau)."""
    return tf.exp(-tf.cast(staleness, tf.float32))


@keras.saving.register_keras_serializable(package="tfdist_tests")
class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warm-up to `peak` over `steps` steps: a custom schedule the ps tasks rebuild
    from its config, so they must import this module (`tfdist-launch --ps_import`)."""

    def __init__(self, peak, steps):
        self.peak, self.steps = peak, steps

    def __call__(self, step):
        fraction = tf.minimum(tf.cast(step + 1, tf.float32) / self.steps, 1.0)
        return self.peak * fraction

    def get_config(self):
        return {"peak": self.peak, "steps": self.steps}
