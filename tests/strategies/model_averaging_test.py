"""ModelAveragingStrategy: rounds every `period` steps, shared final model, bad arguments.

Equivalence with hard sync for period=1 and plain SGD is in soft_sync_test.py.
"""

import os
import signal
import time

import h5py
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tests.strategies import ps_program
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import make_cluster
from tests.strategies.ps_testing import run_cluster
from tests.strategies.ps_testing import wait_for_line
from tfdist.cluster import ClusterConfig
from tfdist.ps.outer_optimizer import CHECKPOINT_ATTRIBUTE
from tfdist.ps.outer_optimizer import outer_optimizer_config

NESTEROV = {"class_name": "SGD", "config": {"learning_rate": 0.7, "momentum": 0.9,
                                            "nesterov": True}}


def flag(outer_optimizer):
    return f"--strategy_arg=outer_optimizer={outer_optimizer!r}"


def checkpoint_weights(path):
    model = ps_program.build_model("sgd")
    model.load_weights(path)
    return model.get_weights()


def outer_state(path):
    """The outer optimizer's variables in a Keras checkpoint (step, learning rate, slots)."""
    with h5py.File(path, "r") as f:
        group = f["optimizer"][CHECKPOINT_ATTRIBUTE]["vars"]
        return [np.array(group[str(i)]) for i in range(len(group))]


# Each worker's shard of the 128 rows when there are 3 (`strategy.shard`).
SHARDS = [slice(ps_program.ROWS * r // 3, ps_program.ROWS * (r + 1) // 3) for r in range(3)]


def wait_for_lines(cluster, tasks, text, timeout=120):
    """Waits until each `(task, part)` of `tasks` logged a line holding `part` and `text`."""
    deadline = time.monotonic() + timeout
    while not all(any(t == task and part in line and text in line
                      for t, line in list(cluster.lines)) for task, part in tasks):
        if time.monotonic() > deadline:
            raise AssertionError(f"not every one of {tasks} logged {text!r} within "
                                 f"{timeout} s:\n{cluster_log(cluster)}")
        time.sleep(0.1)


def rows_restart_reference(out):
    """`ps_program.rows_restart_scenario`'s rounds computed whole, in one process: workers 0
    and 1 train an epoch each from the same model, which takes their average (rounds 1 and
    2); then worker 0 and worker 2's new process (never its killed one) do the same (round
    3). Returns the final weights and the table after round 2 (what the new process must
    start from)."""
    x, y = ps_program.data("embedding")
    batch = ps_program.BATCH
    initial = [np.array(w, "float32") for w in load_result(out, "initial.json")["weights"]]
    models = [ps_program.build_model("sgd", model="embedding") for _ in range(2)]
    for model in models:
        model.set_weights(initial)
    before_restart = None
    for partners in ((0, 1), (0, 1), (0, 2)):
        before_restart = models[0].get_weights()[0]
        for model, rank in zip(models, partners):
            rows = np.arange(ps_program.ROWS)[SHARDS[rank]]
            for start in range(0, len(rows), batch):
                model.train_on_batch(x[rows[start:start + batch]], y[rows[start:start + batch]])
        mean = [np.mean(ws, axis=0) for ws in zip(*[m.get_weights() for m in models])]
        for model in models:
            model.set_weights(mean)
    return models[0].get_weights(), before_restart


def averaging_reference(out, period, epochs, outer_optimizer=None, model="mlp"):
    """Two models trained apart on the workers' shards, averaged (whole) after every `period`
    steps and at the end, with the learning rate halved each epoch as in `ps_program.py`.
    With an outer optimizer (a Keras config), it applies each round's `master - mean` to the
    master, which both models then take. Returns the final weights and the outer optimizer."""
    x, y = ps_program.data(model)
    half, batch = ps_program.ROWS // 2, ps_program.BATCH
    initial = [np.array(w, "float32") for w in load_result(out, "initial.json")["weights"]]
    models = [ps_program.build_model("sgd", model=model) for _ in range(2)]
    for model in models:
        model.set_weights(initial)
    outer = None
    if outer_optimizer is not None:
        outer = keras.optimizers.get(outer_optimizer)
        master = [keras.Variable(w) for w in initial]
        outer.build(master)

    def average():
        mean = [np.mean(ws, axis=0) for ws in zip(*[m.get_weights() for m in models])]
        if outer is not None:
            outer.apply([m.numpy() - w for m, w in zip(master, mean)], master)
            mean = [m.numpy() for m in master]
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
    return models[0].get_weights(), outer


class ModelAveragingTest(tf.test.TestCase, parameterized.TestCase):

    def test_rounds_every_period_and_every_worker_ends_on_the_average(self):
        # The optimizer's slots averaged; an outer optimizer with momentum, whose slots are
        # for the model's variables only (the averaged momentum slots are not among them).
        # Only the chief halves the learning rate each epoch: its writes reach worker 1
        # (issue 22: the rates were averaged, 0.1 and 0.05 gave 0.075).
        out = self.get_temp_dir()
        outer = {"class_name": "SGD", "config": {"learning_rate": 1.0, "momentum": 0.5}}
        cluster, result = run_cluster(out, 2, "--strategy=model_averaging",
                                           "--strategy_arg=period=4",
                                           "--strategy_arg=optimizer_state='averaged'",
                                           flag(outer), "--optimizer=momentum", "--epochs=4",
                                           "--chief_halves")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        for rank in (0, 1):
            self.assertAllClose(load_result(out, f"worker{rank}.json")["learning_rate"],
                                0.1 / 2 ** 3, rtol=1e-6, atol=0, msg=f"worker {rank}")
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
        masters = chief["placement"][0]["variables"]
        slots = [f"sequential_{layer}_{kind}_momentum"
                 for layer in ("dense", "dense_1") for kind in ("kernel", "bias")]
        self.assertCountEqual([p for p in masters if p.startswith("outer_optimizer/")],
                              ["outer_optimizer/iteration", "outer_optimizer/learning_rate"]
                              + [f"outer_optimizer/{slot}" for slot in slots])
        inner = [p for p in masters if not p.startswith("outer_optimizer/")]
        self.assertCountEqual([p.partition("/")[2] for p in inner if p.endswith("_momentum")],
                              slots)
        # The learning rate has a master (never pushed); the step counter is each worker's.
        self.assertLen([p for p in inner if p.endswith("/learning_rate")], 1, inner)
        self.assertFalse([p for p in inner if p.endswith("/iteration")], inner)
        self.assertNotIn("bytes_sent", chief["history"])

    @parameterized.parameters((3, {"class_name": "SGD", "config": {"learning_rate": 1.0}}),
                              (100, None))
    def test_steps_after_the_last_round_are_averaged_when_the_workers_join(self, period,
                                                                           outer_optimizer):
        # 2 epochs of 4 steps per worker. Period 3: rounds after steps 3 and 6, and one for
        # the last 2 steps when the workers join. Period 100, longer than the run: one round
        # at the end, of two models trained apart. Every worker ends on the average, as
        # computed here from the same start, data and learning rates. Period 3 has an outer
        # SGD step of learning rate 1 without momentum: master - 1 * (master - mean) is the
        # plain average, to rounding (exact where master and mean are within a factor 2).
        out = self.get_temp_dir()
        cluster, result = run_cluster(
            out, 2, "--strategy=model_averaging", f"--strategy_arg=period={period}",
            "--epochs=2", *([flag(outer_optimizer)] if outer_optimizer else []))
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief, other = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        self.assertEqual(chief["updates"], 3 if period == 3 else 1)
        self.assertEqual(chief["aggregated"], 2 * chief["updates"])
        for got, want in zip(chief["weights"], averaging_reference(out, period, 2)[0]):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
        initial = load_result(out, "initial.json")["weights"]
        self.assertGreater(np.abs(np.array(chief["weights"][0]) - np.array(initial[0])).max(),
                           1e-3)
        for a, b in zip(chief["local_weights"], other["local_weights"]):
            self.assertAllEqual(a, b)
        # The run ends when the workers have left; its updater records the end and stops.
        self.assertNotIn("failed", "\n".join(line for task, line in cluster.lines
                                              if task == "ps:0"))

    def test_a_table_averaged_by_rows_survives_a_killed_and_restarted_worker(self):
        # The embedding model (an Embedding(48, 4) table, split over 2 ps tasks) averaged by
        # rows (`embedding_tables="auto"`), 2 models a round of 3 workers, period 3: a round
        # an epoch of a worker's shard (`ps_program.rows_restart_scenario`). Workers 0 and 1
        # make rounds 1 and 2. Worker 2 trains 2 steps (rows marked, nothing pushed) and is
        # SIGKILLed; once the ps tasks count it dead it is started again, and its new process
        # makes round 3 with worker 0. The result is the whole-model average of each round
        # computed here: the new process started from the masters' table (not its own fresh
        # one), and the rows the killed process marked never reached a round. Each round
        # pushed only the rows its steps looked up.
        out = self.get_temp_dir()
        with make_cluster(out, 3, "--scenario=rows_restart", "--strategy=model_averaging",
                          "--model=embedding", "--strategy_arg=period=3",
                          "--strategy_arg=replicas_to_aggregate=2", num_ps=2,
                          stop_on_failure=False) as cluster:
            wait_for_line(cluster, "MARKED")
            os.kill(cluster.pid("worker:2"), signal.SIGKILL)
            wait_for_lines(cluster, [(f"ps:{i}", "task:2 at localhost") for i in (0, 1)],
                           "died; going on")
            cluster.restart("worker:2")
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        workers = [load_result(out, f"worker{rank}.json") for rank in range(3)]
        chief = workers[0]
        self.assertEqual((chief["updates"], chief["aggregated"]), (3, 6))
        self.assertEqual(chief["dead"], [])  # worker 2 came back, and left at its end
        self.assertIn(2, chief["left"])
        weights, before_restart = rows_restart_reference(out)
        for got, want in zip(chief["weights"], weights):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
        # (The check can fail: the rows worker 2 trains differ between the masters' table
        # it must start from and its own fresh one.)
        x, _ = ps_program.data("embedding")
        initial = np.array(load_result(out, "initial.json")["weights"][0])
        touched = np.unique(x[SHARDS[2]])
        self.assertGreater(np.abs(before_restart[touched] - initial[touched]).max(), 1e-3)
        for worker in workers[1:]:
            for a, b in zip(chief["local_weights"], worker["local_weights"]):
                self.assertAllEqual(a, b)
            self.assertEqual(chief["evaluation"], worker["evaluation"])  # the copies agree
        parts = [task["variables"].get("sequential/embedding/embeddings")
                 for task in chief["placement"]]
        self.assertEqual(parts, [[0, 24], [24, 48]])
        self.assertEqual({path for task in chief["placement"] for path in task["variables"]},
                         {"sequential/embedding/embeddings", "sequential/dense/kernel",
                          "sequential/dense/bias", "sgd/learning_rate"})
        # (no worker's own state: the learning rate's master is the chief's writes)
        # The rows each round of a worker pushed: those its epoch's steps looked up (the new
        # worker 2, its own steps' only).
        rounds = {0: 3, 1: 2, 2: 1}
        for rank, worker in enumerate(workers):
            self.assertEqual(worker["history"]["table_rows_pushed"],
                             [len(np.unique(x[SHARDS[rank]]))] * rounds[rank], rank)

    def test_compressed_rounds_send_model_changes(self):
        # Top-k changes with error feedback. (fp16 changes, on 2 ps tasks with a kernel split
        # by rows, are checked against an uncompressed reference in the outer optimizer's
        # test.)
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--strategy=model_averaging",
                                      "--strategy_arg=period=2", "--epochs=3",
                                      "--strategy_arg=compression='topk'")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief, other = [load_result(out, f"worker{r}.json") for r in range(2)]
        self.check_compressed_rounds(chief, other, "topk")

    def check_compressed_rounds(self, chief, other, compression):
        for a, b in zip(chief["local_weights"], other["local_weights"]):
            self.assertAllEqual(a, b)  # every worker ends on the master copy
        size = sum(np.array(w).size for w in chief["local_weights"])
        history = chief["history"]
        self.assertEqual(history["bytes_dense"][-1], 4 * size)
        self.assertEqual(history["bytes_sent"][-1], tfdist.compression.get(
            compression).payload_bytes([size], tf.float32))
        self.assertLess(history["loss"][-1], history["loss"][0])

    def test_outer_nesterov_step_on_the_ps_checkpointed_and_restored(self):
        # DiLoCo's outer step (SGD, Nesterov momentum 0.9, learning rate 0.7) after every 2
        # steps of the 2 workers (2 rounds an epoch). The chief dies after the first epoch;
        # its ModelCheckpoint then holds the master weights and the outer momentum of the
        # reference computed here, bit for bit.
        out = self.get_temp_dir()
        flags = ["--scenario=checkpoint", "--epochs=3", "--strategy=model_averaging",
                 "--strategy_arg=period=2", flag(NESTEROV)]
        with make_cluster(out, 2, *flags, "--crash_after_epoch=0") as cluster:
            crashed = cluster.wait()
        self.assertEqual(crashed.failed_task, "worker:0", cluster_log(cluster))
        checkpoint = os.path.join(out, "model.weights.h5")
        weights, outer = averaging_reference(out, 2, 1, NESTEROV)
        for got, want in zip(checkpoint_weights(checkpoint), weights):
            self.assertAllEqual(got, want)
        state = outer_state(checkpoint)
        self.assertEqual(int(state[0]), 2)  # the outer optimizer's step: 2 rounds
        for got, want in zip(state, outer.variables):
            self.assertAllEqual(got, want.numpy())
        # A new cluster, with 2 ps tasks (the first kernel, and its outer momentum, split by
        # rows) and fp16 rounds, resumes from the workers' backups: epochs 2 and 3 go on
        # from the restored momentum, within fp16's rounding of the reference.
        with make_cluster(out, 2, *flags, "--strategy_arg=compression='fp16'",
                          num_ps=2) as cluster:
            resumed = cluster.wait()
        self.assertEqual(resumed.returncode, 0, cluster_log(cluster))
        chief, other = [load_result(out, f"worker{r}.json") for r in range(2)]
        self.check_compressed_rounds(chief, other, "fp16")
        self.assertEqual(chief["history"]["averaging_round"], [2, 4])
        weights, outer = averaging_reference(out, 2, 3, NESTEROV)
        for got, want in zip(chief["weights"], weights):
            self.assertAllClose(np.array(got), want, rtol=0, atol=1e-3)
        state = outer_state(checkpoint)
        self.assertEqual(int(state[0]), 6)
        for got, want in zip(state[2:], outer.variables[2:]):
            self.assertAllClose(got, want.numpy(), rtol=0, atol=1e-3)
        parts = {path: rows for task in chief["placement"]
                 for path, rows in task["variables"].items() if rows}
        self.assertEqual(parts["outer_optimizer/sequential_dense_kernel_momentum"],
                         parts["sequential/dense/kernel"])

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

    def test_outer_optimizer_argument(self):
        config = ClusterConfig.from_hosts(ps_hosts=["localhost:1"], worker_hosts=["localhost:2"],
                                          job_name="worker", task_index=0)

        def outer(value):
            return tfdist.strategies.ModelAveragingStrategy(outer_optimizer=value,
                                                            cluster=config)

        # An instance, a name, a dict or JSON (what a --strategy_arg carries), as the
        # strategy keeps it (its construction goes on to connect to the ps tasks).
        self.assertIsNone(outer_optimizer_config(None))
        self.assertEqual(outer_optimizer_config(keras.optimizers.SGD(
            0.7, momentum=0.9, nesterov=True))["config"]["momentum"], 0.9)
        self.assertEqual(outer_optimizer_config("adam")["class_name"], "Adam")
        self.assertEqual(outer_optimizer_config(NESTEROV)["config"]["name"], "outer_optimizer")
        args = tfdist.strategies.parse_strategy_args([
            'outer_optimizer={"class_name": "SGD", "config": {"nesterov": true}}'])
        self.assertIs(outer_optimizer_config(args["outer_optimizer"])["config"]["nesterov"], True)
        for value, message in [
                (3, r"must be None, a Keras optimizer, its name .* Received: 3"),
                ("sgdd", r"Keras could not make one \(ValueError: Could not interpret "
                         r"optimizer identifier: sgdd\). Received: 'sgdd'"),
                ('{"class_name": "SGD"', r"is a JSON string that does not parse"),
                (keras.optimizers.SGD(1.0, global_clipnorm=1.0),
                 r"`global_clipnorm=1.0` is not supported: each ps task applies"),
                (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                 r"cannot be a LossScaleOptimizer")]:
            with self.assertRaisesRegex(ValueError, r"`outer_optimizer`.*" + message):
                outer(value)


if __name__ == "__main__":
    tf.test.main()
