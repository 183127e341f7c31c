"""ModelAveragingStrategy: rounds every `period` steps, shared final model, bad arguments.

Equivalence with hard sync for period=1 and plain SGD is in soft_sync_test.py.
"""

import numpy as np
import tensorflow as tf

import tfdist
from tests.strategies import ps_program
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import run_cluster
from tfdist.cluster import ClusterConfig


class ModelAveragingTest(tf.test.TestCase):

    def test_rounds_every_period_and_every_worker_ends_on_the_average(self):
        out = self.get_temp_dir()
        cluster, result, out = run_cluster(out, 2, "--strategy=model_averaging",
                                           "--strategy_arg=period=4",
                                           "--strategy_arg=optimizer_state='averaged'",
                                           "--optimizer=momentum", "--epochs=4")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        steps = 4 * ps_program.ROWS // 2 // ps_program.BATCH
        chief, other = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        self.assertEqual(chief["updates"], steps // 4)
        self.assertEqual(chief["aggregated"], 2 * steps // 4)
        self.assertEqual(chief["history"]["averaging_round"], [1, 2, 3, 4])
        # evaluate() is not a training step: no extra logs, no averaging round.
        self.assertLen(chief["evaluation"], 2)
        self.assertEqual(chief["progress"]["global_step"], steps // 4)
        for a, b in zip(chief["local_weights"], other["local_weights"]):
            self.assertAllClose(np.array(a), np.array(b), rtol=0, atol=0)

    def test_bad_arguments(self):
        config = ClusterConfig.from_hosts(ps_hosts=["localhost:1"], worker_hosts=["localhost:2"],
                                          job_name="worker", task_index=0)
        with self.assertRaisesRegex(ValueError, r"`period` must be an integer >= 1 .* "
                                                r"Received: 0"):
            tfdist.strategies.ModelAveragingStrategy(period=0, cluster=config)
        with self.assertRaisesRegex(ValueError, r"`optimizer_state` must be one of "
                                                r"\['averaged', 'local'\]. Received: 'mean'"):
            tfdist.strategies.ModelAveragingStrategy(optimizer_state="mean", cluster=config)
        with self.assertRaisesRegex(ValueError, "total_replicas=1. Received: 2"):
            tfdist.strategies.ModelAveragingStrategy(replicas_to_aggregate=2, cluster=config)
        self.assertIn("model_averaging", tfdist.strategies.names())


if __name__ == "__main__":
    tf.test.main()
