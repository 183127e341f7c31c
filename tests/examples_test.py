"""The README's main job: digits on a local 1-ps / 3-worker cluster matches one process."""

import json
import os
import subprocess
import sys

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")


class TrainDigitsTest(tf.test.TestCase):

    def _accuracy(self, *launcher, flags=()):
        path = os.path.join(self.get_temp_dir(), "result.json")
        command = [*launcher, sys.executable, EXAMPLE, f"--output_json={path}", "--verbose=0",
                   *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-3000:])
        with open(path) as f:
            return json.load(f)

    def test_soft_sync_on_three_workers_matches_one_process(self):
        single = self._accuracy(flags=["--strategy=one_device"])
        cluster = self._accuracy(sys.executable, "-m", "tfdist.launch", "--local", "--num_ps=1",
                                 "--num_workers=3", "--timeout=300", "--")
        self.assertEqual(cluster["strategy"], "soft_sync")
        self.assertGreater(single["test_accuracy"], 0.93)
        self.assertGreater(cluster["test_accuracy"], single["test_accuracy"] - 0.01)
        self.assertEqual(cluster["history"]["dropped_gradients"][-1], 0)

    def test_async_and_model_averaging_train_digits(self):
        # The example's default 20 epochs: at 10 epochs both modes end at 0.930-0.936 (5 async
        # runs, 2 averaging runs measured), too close to the bound; at 20 epochs 0.953-0.967.
        for strategy, extra in (("async", ["--strategy_arg=staleness=inverse"]),
                                ("model_averaging", ["--strategy_arg=period=4"])):
            # --preload: tasks forked from a server that imported TensorFlow (the README's
            # main job above starts fresh interpreters).
            result = self._accuracy(sys.executable, "-m", "tfdist.launch", "--local",
                                    "--num_ps=1", "--num_workers=2", "--timeout=300",
                                    "--preload", "--",
                                    flags=[f"--strategy={strategy}", *extra])
            self.assertEqual(result["strategy"], strategy)
            self.assertGreater(result["test_accuracy"], 0.93, strategy)

    def test_multi_worker_mirrored_with_compression_trains_digits(self):
        # 20 epochs: 0.964 (10 epochs gave 0.933, too close to the bound).
        result = self._accuracy(sys.executable, "-m", "tfdist.launch", "--local", "--num_ps=0",
                                "--num_workers=2", "--timeout=300", "--preload", "--",
                                flags=["--strategy=multi_worker_mirrored", "--compression=topk",
                                       "--compression_arg=ratio=0.05"])
        self.assertEqual((result["strategy"], result["compression"]),
                         ("multi_worker_mirrored", "topk"))
        self.assertGreater(result["test_accuracy"], 0.93)
        # On the wire (N = 2): the payload (values and indices) after TF's shape word,
        # against the dense ring all-reduce's 4 bytes per parameter.
        self.assertAllClose(result["history"]["compression_ratio"][-1],
                            4 * 4810 / (8 * int(0.05 * 4810) + 4), rtol=1e-6)


if __name__ == "__main__":
    tf.test.main()
