"""The two pushes' decisions, in one process: the role of each new variable, what an update
of a train step does, the logs' names, which optimizer a split must suit, the spec's fields."""

import types

import keras
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps.model_push import ModelPush
from tfdist.ps.outer_optimizer import outer_optimizer_config
from tfdist.ps.push import GradientPush
from tfdist.ps.push import check_split
from tfdist.ps.push import check_table_updates
from tfdist.ps.worker import _Step

FLOAT = {"dtype": "float32"}
FROZEN = {"dtype": "float32", "trainable": False}
COUNTER = {"dtype": "int64"}
STATS = tf.constant([7, 9, 2, 0, 0, 0, 0], tf.int64)  # step, updates, dropped, ...


def roles_made_by(push, make):
    """`{name: [roles]}` that `push` gives the variables Keras makes in `make()`, as a
    worker's variable creator asks it (the optimizer is found in Keras's name scope)."""
    roles = {}

    def creator(next_creator, **kwargs):
        value = kwargs["initial_value"]
        kwargs["initial_value"] = tf.convert_to_tensor(value() if callable(value) else value,
                                                       dtype=kwargs.get("dtype"))
        roles.setdefault(kwargs["name"], []).append(
            push.role(kwargs, _tf_compat.keras_optimizer_in_scope()))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        make()
    return roles


class GradientPushTest(tf.test.TestCase):

    def test_roles_of_new_variables(self):
        push = GradientPush()
        sgd = keras.optimizers.SGD()
        self.assertEqual(push.role(FLOAT, None), protocol.GRADIENT)
        self.assertEqual(push.role({}, None), protocol.GRADIENT)  # float32 by default
        self.assertEqual(push.role(FROZEN, None), protocol.VALUE)
        self.assertIsNone(push.role(COUNTER, None))  # an int counter stays with the worker
        # The optimizer's slots and step counter live on the ps tasks; a loss scale, each
        # worker's own.
        self.assertEqual(push.role(FLOAT, sgd), protocol.OPTIMIZER)
        self.assertEqual(push.role(COUNTER, sgd), protocol.OPTIMIZER)
        self.assertIsNone(push.role(FLOAT, keras.optimizers.LossScaleOptimizer(sgd)))

    def test_an_optimizer_update_is_recorded_not_applied_and_only_one_per_step(self):
        push, step = GradientPush(), _Step()
        step.expected = 3  # the push itself waits for the third gradient
        variable, gradient = tf.Variable(1.0), tf.constant(0.5)
        self.assertFalse(push.update(step, variable, (gradient, None)))
        self.assertFalse(push.update(step, variable, ()))  # any other update: the ps's too
        self.assertEqual(step.recorded, [(variable, gradient)])
        self.assertFalse(step.trained)
        step.trained = True  # a push already ran in this step
        with self.assertRaisesRegex(ValueError, "a second optimizer update in one train step"):
            push.update(step, variable, (gradient, None))

    def test_logs_spec_and_split(self):
        push = GradientPush()
        logs = push.logs(STATS)
        self.assertEqual(sorted(logs), ["dropped_gradients", "global_step"])
        self.assertEqual((int(logs["global_step"]), int(logs["dropped_gradients"])), (7, 2))
        push.optimizer = keras.optimizers.Adafactor()
        spec = push.spec()
        self.assertEqual(spec["mode"], "gradients")
        self.assertEqual(spec["optimizer"]["class_name"], "Adafactor")
        self.assertIsNone(spec["outer_optimizer"])
        self.assertFalse(spec["delta"])
        self.assertEqual(push.rebuilt_optimizers(), [push.optimizer])
        # A non-elementwise optimizer keeps variables whole, and refuses a partitioner.
        self.assertFalse(check_split(push, placement.AUTO))
        with self.assertRaisesRegex(ValueError, r"the model trains with Adafactor"):
            check_split(push, tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        push.optimizer = keras.optimizers.Adam()
        self.assertTrue(check_split(push, placement.AUTO))

    def test_the_tables_updates_need_a_fitting_optimizer(self):
        # Lazy updates need a row-local optimizer; a table split over ps tasks, an
        # elementwise one (each task applies it to its part); a whole table, any one with
        # `embedding_updates="dense"`.
        whole = types.SimpleNamespace(_tfdist_path="m/whole", parts=[("ps0", (0, 8))])
        split = types.SimpleNamespace(_tfdist_path="m/split",
                                      parts=[("ps0", (0, 4)), ("ps1", (4, 8))])

        def check(optimizer, updates, *tables):
            check_table_updates(optimizer, types.SimpleNamespace(tables=list(tables),
                                                                 updates=updates))

        check(keras.optimizers.Adagrad(), "lazy", whole, split)
        check(keras.optimizers.Lamb(), "dense", whole)
        check(keras.optimizers.Lamb(), "lazy")  # no table
        with self.assertRaisesRegex(ValueError, r"lazy\) updates of the embedding tables "
                                                r"\['m/whole'\].*Received: Lamb"):
            check(keras.optimizers.Lamb(), "lazy", whole)
        with self.assertRaisesRegex(ValueError, r"tables \['m/split'\] are split .* apply "
                                                r"Lamb .*`variable_partitioner=None`"):
            check(keras.optimizers.Lamb(), "dense", whole, split)


class ModelPushTest(tf.test.TestCase):

    def test_roles_of_new_variables(self):
        local, averaged = ModelPush(period=4), ModelPush(average_optimizer_state=True)
        sgd = keras.optimizers.SGD()
        for push in (local, averaged):
            self.assertEqual(push.role(FLOAT, None), protocol.AVERAGE)
            self.assertEqual(push.role(FROZEN, None), protocol.AVERAGE)
            self.assertIsNone(push.role(COUNTER, None))
        # A variable of the optimizer that is not a slot of a weight it was built on (its
        # scalars): never averaged.
        self.assertIsNone(local.role(FLOAT, sgd))
        self.assertIsNone(averaged.role(FLOAT, sgd))
        self.assertIsNone(averaged.role(COUNTER, sgd))

    def test_only_slots_are_averaged_and_the_learning_rate_is_a_master(self):
        # Issue 22: the chief's learning rate 0.1 halved gave 0.0875 on 4 workers after the
        # next round: it was averaged with the slots. As Keras makes them: the learning rate
        # lives on the ps (the chief's writes reach every worker), the step counters and the
        # loss scale stay each worker's own, the per-weight slots alone are averaged.
        weights = [keras.Variable(tf.ones([3, 2]), name="kernel"),
                   keras.Variable(tf.ones([2]), name="bias")]
        for push, slot_role in ((ModelPush(average_optimizer_state=True), protocol.AVERAGE),
                                (ModelPush(), None)):
            with self.subTest(averaged=push.average_optimizer_state):
                roles = roles_made_by(push, lambda: keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.SGD(0.1, momentum=0.9)).build(weights))
                self.assertEqual(roles, {
                    "iteration": [None, None],  # the wrapper's and the inner optimizer's
                    # (the wrapper's own, unused, is a master too)
                    "learning_rate": [protocol.OPTIMIZER, protocol.OPTIMIZER],
                    "step_counter": [None], "dynamic_scale": [None],
                    "kernel_momentum": [slot_role], "bias_momentum": [slot_role]})

    def test_the_outer_optimizers_state_lives_on_the_ps(self):
        push = ModelPush(outer_optimizer=outer_optimizer_config("sgd"))
        push.outer.building = True  # what `OuterOptimizer.build` makes meanwhile
        self.assertEqual(push.role(FLOAT, None), protocol.OPTIMIZER)
        self.assertEqual(push.role(COUNTER, None), protocol.OPTIMIZER)
        push.outer.building = False
        self.assertEqual(push.role(FLOAT, None), protocol.AVERAGE)

    def test_an_update_trains_the_local_model(self):
        push, step = ModelPush(), _Step()
        variable = tf.Variable(1.0)
        self.assertTrue(push.update(step, variable, ()))
        self.assertFalse(step.trained)
        self.assertTrue(push.update(step, variable, (tf.constant(0.5), None)))
        self.assertTrue(step.trained)
        self.assertEqual(step.recorded, [])

    def test_logs_and_split(self):
        logs = ModelPush().logs(STATS)
        self.assertEqual(sorted(logs), ["averaging_round", "dropped_models"])
        self.assertEqual(int(logs["averaging_round"]), 7)
        # Averaging is elementwise whatever the model's optimizer; an outer one must be too.
        plain = ModelPush()
        plain.optimizer = keras.optimizers.Adafactor()
        self.assertTrue(check_split(plain, placement.AUTO))
        self.assertEqual(plain.rebuilt_optimizers(), [])
        outer = ModelPush(outer_optimizer=outer_optimizer_config("adafactor"))
        outer.outer.optimizer = keras.optimizers.Adafactor()
        with self.assertRaisesRegex(ValueError, r"the outer optimizer is Adafactor"):
            check_split(outer, tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
