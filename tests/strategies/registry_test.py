"""Tests of the strategy registry and the --strategy flag helper."""

import tensorflow as tf
from absl import flags

import tfdist


class RegistryTest(tf.test.TestCase):

    def test_builtin_names(self):
        for name in ("one_device", "mirrored", "multi_worker_mirrored", "central_storage",
                     "parameter_server", "tpu"):
            self.assertIn(name, tfdist.strategies.names())

    def test_get_builds_builtins(self):
        self.assertIsInstance(tfdist.strategies.get("one_device"), tf.distribute.OneDeviceStrategy)
        self.assertIsInstance(tfdist.strategies.get("Mirrored"), tf.distribute.MirroredStrategy)
        strategy = tfdist.strategies.get({"name": "one_device", "config": {"device": "/cpu:0"}})
        self.assertIsInstance(strategy, tf.distribute.OneDeviceStrategy)
        self.assertIs(tfdist.strategies.get(strategy), strategy)

    def test_unknown_name_lists_valid_names(self):
        with self.assertRaisesRegex(ValueError, r"Unknown strategy 'horovod'. Valid names: \[.*"
                                                r"'mirrored'.*\]"):
            tfdist.strategies.get("horovod")

    def test_bad_arguments_name_the_strategy(self):
        with self.assertRaisesRegex(ValueError, "strategy 'one_device' does not take"):
            tfdist.strategies.get("one_device", replicas=3)
        with self.assertRaisesRegex(ValueError, "keys 'name' and 'config'"):
            tfdist.strategies.get({"kind": "mirrored"})

    def test_tpu_without_tpu_is_a_clear_error(self):
        with self.assertRaisesRegex(ValueError, "strategy 'tpu' needs a reachable TPU"):
            tfdist.strategies.get("tpu")

    def test_register_rejects_bad_names_and_duplicates(self):
        with self.assertRaisesRegex(ValueError, "lower-case snake_case"):
            tfdist.strategies.register("MyStrategy", lambda: None)
        with self.assertRaisesRegex(ValueError, "already registered as 'mirrored'"):
            tfdist.strategies.register("mirrored", lambda: None)

    def test_parse_strategy_args(self):
        self.assertEqual(
            tfdist.strategies.parse_strategy_args(["a=3", "b=0.5", "c=True", "d=text"]),
            {"a": 3, "b": 0.5, "c": True, "d": "text"})
        with self.assertRaisesRegex(ValueError, "key=value. Received: 'oops'"):
            tfdist.strategies.parse_strategy_args(["oops"])

    def test_flags(self):
        flag_values = flags.FlagValues()
        tfdist.strategies.define_flags(default="one_device", flag_values=flag_values)
        flag_values(["prog", "--strategy=one_device", "--strategy_arg=device='/cpu:0'"])
        strategy = tfdist.strategies.from_flags(flag_values)
        self.assertIsInstance(strategy, tf.distribute.OneDeviceStrategy)
        bad = flags.FlagValues()
        tfdist.strategies.define_flags(flag_values=bad)
        with self.assertRaisesRegex(flags.IllegalFlagValueError, "--strategy must be one of"):
            bad(["prog", "--strategy=nope"])

    def test_compression_flags(self):
        flag_values = flags.FlagValues()
        tfdist.strategies.define_flags(flag_values=flag_values)
        flag_values(["prog", "--strategy=compressed_mirrored", "--compression=topk",
                     "--compression_arg=ratio=0.05", "--strategy_arg=devices=['/cpu:0']"])
        strategy = tfdist.strategies.from_flags(flag_values)
        self.assertIsInstance(strategy, tfdist.strategies.CompressedMirroredStrategy)
        self.assertEqual(strategy.compressor.ratio, 0.05)
        bad = flags.FlagValues()
        tfdist.strategies.define_flags(flag_values=bad)
        with self.assertRaisesRegex(flags.IllegalFlagValueError,
                                    "--compression must be one of .*'topk'.* Received: 'zip'"):
            bad(["prog", "--compression=zip"])
        orphan = flags.FlagValues()
        tfdist.strategies.define_flags(flag_values=orphan)
        orphan(["prog", "--compression_arg=ratio=0.1"])
        with self.assertRaisesRegex(ValueError, "--compression_arg needs --compression"):
            tfdist.strategies.from_flags(orphan)


if __name__ == "__main__":
    tf.test.main()
