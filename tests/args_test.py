"""The shared argument checks (`tfdist/_args.py`): a bool is no number, inf and NaN are no
finite number, and the error names the argument, what it must be and what it received."""

import math

import tensorflow as tf

from tfdist import _args


class ArgsTest(tf.test.TestCase):

    def test_bools_infinities_and_nans_are_refused_with_the_argument_named(self):
        for bad in (True, math.inf, math.nan, "1", 0, -1.0):
            with self.assertRaisesRegex(ValueError, r"`timeout` must be a positive number of "
                                                    r"seconds or None\. Received: "):
                _args.check_seconds("timeout", bad, allow_none=True)
        self.assertIsNone(_args.check_seconds("timeout", None, allow_none=True))
        self.assertEqual(_args.check_seconds("timeout", 2.5), 2.5)
        for bad in (True, 1.0, 0, 128):
            with self.assertRaisesRegex(ValueError, r"`levels` must be an integer between 1 "
                                                    r"and 127\. Received: "):
                _args.check_int("levels", bad, low=1, high=127)
        self.assertEqual(_args.check_int("count", 3, low=1), 3)
        with self.assertRaisesRegex(ValueError, r"`count` must be a positive integer\. "
                                                r"Received: False"):
            _args.check_int("count", False, low=1)
        with self.assertRaisesRegex(ValueError, r"`ratio` must be a number in \(0, 1\]\. "
                                                r"Received: 0"):
            _args.check_fraction("ratio", 0)
        self.assertEqual(_args.check_fraction("ratio", 0, low_open=False), 0.0)
        with self.assertRaisesRegex(ValueError, r"`overlap` must be True or False\. "
                                                r"Received: 1"):
            _args.check_bool("overlap", 1)


if __name__ == "__main__":
    tf.test.main()
