"""ModelAveragingStrategy: rounds every `period` steps, shared final model, bad arguments.

Equivalence with hard sync for period=1 and plain SGD is in soft_sync_test.py.
"""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tests.strategies import ps_program
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import run_cluster
from tfdist.cluster import ClusterConfig


def averaging_reference(out, period, epochs):
    """Two models trained apart on the workers' shards, averaged after every `period` steps
    and at the end, with the learning rate halved each epoch as in `ps_program.py`."""
    x, y = ps_program.data()
    half, batch = ps_program.ROWS // 2, ps_program.BATCH
    initial = [np.array(w, "float32") for w in load_result(out, "initial.json")["weights"]]
    models = [ps_program.build_model("sgd") for _ in range(2)]
    for model in models:
        model.set_weights(initial)

    def average():
        mean = [np.mean(ws, axis=0) for ws in zip(*[m.get_weights() for m in models])]
        for model in models:
            model.set_weights(mean)

    steps = 0
    for epoch in range(epochs):
        for model in models:
            model.optimizer.learning_rate.assign(0.1 / 2 ** epoch)
        for j in range(half // batch):
            for rank, model in enumerate(models):
                rows = slice(rank * half + j * batch, rank * half + (j + 1) * batch)
                model.train_on_batch(x[rows], y[rows])
            steps += 1
            if steps % period == 0:
                average()
    if steps % period:
        average()
    return models[0].get_weights()


class ModelAveragingTest(tf.test.TestCase, parameterized.TestCase):

    def test_rounds_every_period_and_every_worker_ends_on_the_average(self):
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--strategy=model_averaging",
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

    @parameterized.parameters(3, 100)
    def test_steps_after_the_last_round_are_averaged_when_the_workers_join(self, period):
        # 2 epochs of 4 steps per worker. Period 3: rounds after steps 3 and 6, and one for
        # the last 2 steps when the workers join. Period 100, longer than the run: one round
        # at the end, of two models trained apart. Every worker ends on the average, as
        # computed here from the same start, data and learning rates.
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--strategy=model_averaging",
                                      f"--strategy_arg=period={period}", "--epochs=2")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief, other = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        self.assertEqual(chief["updates"], 3 if period == 3 else 1)
        self.assertEqual(chief["aggregated"], 2 * chief["updates"])
        for got, want in zip(chief["weights"], averaging_reference(out, period, 2)):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
        initial = load_result(out, "initial.json")["weights"]
        self.assertGreater(np.abs(np.array(chief["weights"][0]) - np.array(initial[0])).max(),
                           1e-3)
        for a, b in zip(chief["local_weights"], other["local_weights"]):
            self.assertAllEqual(a, b)

    def test_compressed_rounds_send_model_changes(self):
        # fp16 changes: within 1e-3 of the uncompressed averaging on the same data, with the
        # model on 2 ps tasks (a kernel split by rows, each task's change decoded alone).
        runs = {}
        for compression in ("none", "fp16", "topk"):
            out = self.get_temp_dir() + "/" + compression
            flags = ["--strategy=model_averaging", "--strategy_arg=period=2", "--epochs=3"]
            if compression != "none":
                flags.append(f"--strategy_arg=compression='{compression}'")
            cluster, result = run_cluster(out, 2, *flags,
                                          num_ps=2 if compression == "fp16" else 1)
            self.assertEqual(result.returncode, 0, cluster_log(cluster))
            runs[compression] = [load_result(out, f"worker{r}.json") for r in range(2)]
        size = sum(np.array(w).size for w in runs["none"][0]["local_weights"])
        for compression in ("fp16", "topk"):
            chief, other = runs[compression]
            for a, b in zip(chief["local_weights"], other["local_weights"]):
                self.assertAllEqual(a, b)  # every worker ends on the master copy
            history = chief["history"]
            self.assertEqual(history["bytes_dense"][-1], 4 * size)
            self.assertEqual(history["bytes_sent"][-1], tfdist.compression.get(
                compression).payload_bytes([size], tf.float32))
            self.assertLess(history["loss"][-1], history["loss"][0])
        for want, got in zip(runs["none"][0]["local_weights"],
                             runs["fp16"][0]["local_weights"]):
            self.assertAllClose(np.array(want), np.array(got), rtol=0, atol=1e-3)
        self.assertNotIn("bytes_sent", runs["none"][0]["history"])

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
        with self.assertRaisesRegex(ValueError, "`compression`='powersgd' needs rounds"):
            tfdist.strategies.ModelAveragingStrategy(compression="powersgd", cluster=config)
        self.assertIn("model_averaging", tfdist.strategies.names())


if __name__ == "__main__":
    tf.test.main()
