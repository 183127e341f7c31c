"""BUILD must list every module and test of the tree (Bazel cannot run offline here)."""

import pathlib
import subprocess
import sys

import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parent.parent


class BuildFileTest(tf.test.TestCase):

    def test_build_file_is_in_step_with_the_tree(self):
        result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_file.py"), "--check"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        build = (ROOT / "BUILD").read_text()
        self.assertIn('"tfdist/cluster/config.py"', build)
        self.assertIn('srcs = ["tests/cluster/config_test.py"]', build)


if __name__ == "__main__":
    tf.test.main()
