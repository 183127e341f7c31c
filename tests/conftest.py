"""Test session setup: three logical CPU devices, for the one-process all-reduce tests.

Logical devices can only be set before TensorFlow initialises its context, so this runs
when pytest loads the suite, before any test imports a model.
"""

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
try:
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
except RuntimeError:  # the context already started (a test run on its own, say)
    pass
