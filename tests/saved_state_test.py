"""`tfdist._saved_state.OnUse`: an optimizer gets its state once it is put to use."""

import keras
import tensorflow as tf

from tfdist._saved_state import OnUse


class OnUseTest(tf.test.TestCase):

    def test_an_optimizer_gets_its_state_once_put_to_use(self):
        given = []
        on_use = OnUse(given.append)
        made = keras.optimizers.SGD(0.1)
        on_use.seen(made)  # its constructor's own variables: only made
        self.assertEqual(given, [])
        on_use.seen(None)  # anything else made after it (a model, metrics): put to use
        self.assertEqual(given, [made])
        built = keras.optimizers.Adam()
        built.build([keras.Variable(1.0)])
        on_use.seen(built)  # built on its weights: at once
        self.assertEqual(given, [made, built])
        # Keras's loading makes a bare `Optimizer` to learn which attributes to skip.
        bare = keras.optimizers.Optimizer(learning_rate=0.1)
        on_use.seen(bare)
        on_use.seen(None)
        self.assertEqual(given, [made, built])


if __name__ == "__main__":
    tf.test.main()
