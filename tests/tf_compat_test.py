"""TensorFlow's and Keras's private names are used in `tfdist/_tf_compat.py` only, so that
an upgrade of either touches that file alone (issue 23)."""

import pathlib
import re

import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfdist"
# Private modules, and the private attributes of Keras optimizers and variables that the
# engines read (through `_tf_compat`'s functions).
PRIVATE = re.compile(
    r"\b(from|import) (tensorflow\.python|keras\.src)\b"
    r"|\._(trainable_variables|use_weight_decay|get_variable_index|apply_weight_decay"
    r"|iterations)\b"
    r"|[\"'](_value|_shape|_trainable_variables|_iterations)[\"']")


class PrivateNamesTest(tf.test.TestCase):

    def test_private_tf_and_keras_names_only_in_tf_compat(self):
        found = []
        for path in sorted(ROOT.rglob("*.py")):
            if path.name == "_tf_compat.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line):
                    found.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
        self.assertEmpty(found, "private TF / Keras names outside tfdist/_tf_compat.py "
                                "(add a function there):\n" + "\n".join(found))


if __name__ == "__main__":
    tf.test.main()
