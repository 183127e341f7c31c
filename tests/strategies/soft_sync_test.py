"""SoftSyncStrategy: hard-sync equivalence, dropped stale gradients, faults, bad arguments.

Multi-process tests run `ps_program.py` on a local cluster; every run has a deadline and the
launcher reaps every process, also when an assertion fails.
"""

import os
import signal
import time
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tests.strategies import ps_program
from tests.strategies import ps_testing
from tests.strategies import ps_users_model
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import make_cluster
from tests.strategies.ps_testing import run_cluster
from tests.strategies.ps_testing import wait_for_line
from tfdist._worker import compute_device
from tfdist.cluster import ClusterConfig
from tfdist.cluster import TaskUnreachableError
from tfdist.cluster import pick_free_ports
from tfdist.ps.model_push import ModelPush
from tfdist.ps.push import GradientPush
from tfdist.ps.push_codec import push_compressor


class HardSyncEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(("soft_sync", "sgd", 1, 5), ("soft_sync", "momentum", 3, 2),
                              ("soft_sync", "adamw", 1, 2),
                              ("soft_sync", "loss_scale", 1, 2), ("model_averaging", "sgd", 1, 2))
    def test_two_workers_match_one_process_on_the_combined_batch(self, strategy, optimizer,
                                                                 steps_per_execution, num_ps):
        # Model averaging every step with plain SGD is hard sync too. Every run halves the
        # learning rate each epoch from a callback (a write that must reach both ps tasks'
        # optimizers); one runs 3 steps per `tf.function` call, 4 steps an epoch. adamw: the
        # ps applies the kernel constraint and skips the biases' weight decay. loss_scale
        # (Adam inside, one run for both): each worker keeps its own dynamic scale (which
        # grows every 2 steps). 2 ps tasks: the first kernel is split by rows. 5 ps tasks
        # for 4 whole variables (`variable_partitioner=None`): one holds only the
        # optimizer's counters.
        out = self.get_temp_dir()
        whole = ["--strategy_arg=variable_partitioner=None"] if num_ps == 5 else []
        cluster, result = run_cluster(out, 2, "--scenario=equivalence", "--epochs=3",
                                      f"--strategy={strategy}", f"--optimizer={optimizer}",
                                      f"--steps_per_execution={steps_per_execution}", *whole,
                                      num_ps=num_ps)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        self.assertEqual(chief["updates"], 3 * (ps_program.ROWS // 2 // ps_program.BATCH))
        self.assertEqual(chief["dropped"], 0)
        if optimizer == "loss_scale":  # 12 finite steps: 6 doublings of 2 ** 4 on each worker
            for rank in (0, 1):
                self.assertEqual(load_result(out, f"worker{rank}.json")["loss_scale"], 2.0 ** 10)
        round_key = "averaging_round" if strategy == "model_averaging" else "global_step"
        self.assertEqual(chief["history"][round_key][-1], chief["updates"])

        for got, want in zip(chief["weights"], one_process_reference(out, optimizer, 3)):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
        placement = chief["placement"]
        kernel = [task["variables"]["sequential/dense/kernel"] for task in placement
                  if "sequential/dense/kernel" in task["variables"]]
        if num_ps == 2 and optimizer != "adamw":
            # Split by rows over the ps tasks; each task carries a fair share.
            self.assertEqual(kernel, [[0, 4], [4, 8]])
            pushed = [task["bytes_pushed"] for task in placement]
            self.assertLessEqual(max(pushed), 1.5 * sum(pushed) / num_ps, placement)
        else:  # one ps, no partitioner, or a MaxNorm constraint (which spans the rows)
            self.assertEqual(kernel, [None])
        # The model trains on the worker's own device (its CPU here: no GPU).
        self.assertEqual(chief["devices"], ["/job:worker/replica:0/task:0/device:CPU:0"])


class EmbeddingTest(tf.test.TestCase):

    def test_a_table_lives_on_the_ps_split_and_is_updated_densely_on_request(self):
        # Adam, hard sync, 2 workers, 2 ps tasks: the 48-row table lives on the ps tasks only
        # (24 / 24 rows: a partitioner splits it, `ps_program.split_table`), each push
        # carries only the rows its batch touches, and with `embedding_updates="dense"` the
        # ps applies Adam to every row. The weights are
        # those of one process on the combined batches, whose table takes a dense gradient
        # (`ps_program.DenseLookup`: Keras's own Adam treats a sparse gradient's repeated
        # rows differently).
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--scenario=equivalence", "--epochs=3",
                                      "--optimizer=adam", "--model=embedding", "--split_table",
                                      "--strategy_arg=embedding_updates=dense", num_ps=2)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        self.assertEqual(chief["tables_pushed"], [1, 1])
        self.assertEqual(chief["sparse_pushed"], [0, 0])
        self.assertIn("/job:ps/replica:0/task:0/device:CPU:0", chief["devices"])
        split = [task["variables"].get("sequential/embedding/embeddings")
                 for task in chief["placement"]]
        self.assertEqual(sorted(split), [[0, 24], [24, 48]])
        for got, want in zip(chief["weights"],
                             one_process_reference(out, "adam", 3, model="dense_lookup")):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)


    def test_a_table_trains_lazily_resumes_from_a_backup_and_reloads_in_plain_keras(self):
        # SGD, hard sync, 2 workers, 2 ps tasks, the table's rows updated lazily (exact for
        # SGD), split over the ps tasks (`ps_program.split_table`). The chief dies after
        # epoch 1; a new cluster (new, empty ps tasks) resumes from the backups with the
        # table whole on the first ps task (768 bytes: `variable_partitioner="auto"` keeps a
        # table under 512 KiB whole): the chief writes the table it restored to the ps before
        # the run starts. The result is one process's on the combined batches, and the
        # chief's ModelCheckpoint loads into a plain Keras model.
        out = self.get_temp_dir()
        flags = ["--scenario=checkpoint", "--epochs=4", "--optimizer=sgd", "--model=embedding"]
        with make_cluster(out, 2, *flags, "--crash_after_epoch=1", "--split_table",
                          num_ps=2) as cluster:
            crashed = cluster.wait()
        self.assertEqual(crashed.failed_task, "worker:0", cluster_log(cluster))
        with make_cluster(out, 2, *flags, num_ps=2) as cluster:
            resumed = cluster.wait()
        self.assertEqual(resumed.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        steps_per_epoch = ps_program.ROWS // 2 // ps_program.BATCH
        self.assertEqual(chief["history"]["global_step"],
                         [3 * steps_per_epoch, 4 * steps_per_epoch])
        self.assertEqual(chief["tables_pushed"], [1, 0])
        self.assertEqual([task["variables"].get("sequential/embedding/embeddings", "none")
                          for task in chief["placement"]], [None, "none"])
        self.assertIn("/job:ps/replica:0/task:0/device:CPU:0", chief["devices"])
        reference = one_process_reference(out, "sgd", 4, model="embedding")
        for got, want in zip(chief["weights"], reference):
            self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
        # The other worker reads the same table from the ps tasks, in evaluate and predict
        # (a last partial batch of 8 rows included).
        worker = load_result(out, "worker1.json")
        for got, want in zip(worker["local_weights"], chief["weights"]):
            self.assertAllClose(got, want, rtol=0, atol=0)
        self.assertEqual(worker["evaluation"], chief["evaluation"])
        self.assertAllClose(worker["predictions"], chief["predictions"], rtol=0, atol=0)
        model = ps_program.build_model("sgd", model="embedding")
        model.load_weights(os.path.join(out, "model.weights.h5"))
        for got, want in zip(model.get_weights(), chief["weights"]):
            self.assertAllClose(got, np.array(want), rtol=0, atol=0)
        x, _ = ps_program.data("embedding")
        self.assertAllClose(model.predict(x[:24], batch_size=16, verbose=0),
                            chief["predictions"], rtol=1e-6, atol=1e-6)
        # A `tf.train.Checkpoint` with the table (its parts written by the ps tasks: the save
        # spans tasks, and reads the other variables in a function of its own) holds the
        # masters too.
        check_tf_checkpoint(self, out, 4 * steps_per_epoch)


def check_tf_checkpoint(test, out, iterations):
    """The chief's `tf.train.Checkpoint` after join() (`ps_program.tf_checkpoint_round_trip`)
    restores in plain Keras to the weights and optimizer variables the chief reads."""
    checkpoint = load_result(out, "tf_checkpoint.json")
    test.assertLen(checkpoint["restored_optimizer"], len(checkpoint["optimizer"]))
    for got, want in zip(checkpoint["restored_weights"] + checkpoint["restored_optimizer"],
                         checkpoint["weights"] + checkpoint["optimizer"]):
        test.assertAllEqual(np.array(got), np.array(want))
    test.assertEqual(checkpoint["optimizer"][0], iterations)


def one_process_reference(out, optimizer, epochs, model="mlp"):
    """One process, same optimizer, on batches made of worker 0's and worker 1's batch j."""
    x, y = ps_program.data(model)
    half, batch = ps_program.ROWS // 2, ps_program.BATCH
    order = np.concatenate([np.r_[j * batch:(j + 1) * batch,
                                  half + j * batch:half + (j + 1) * batch]
                            for j in range(half // batch)])
    model = ps_program.build_model(optimizer, model=model)
    initial = load_result(out, "initial.json")["weights"]
    model.set_weights([np.array(w, "float32") for w in initial])
    model.fit(x[order], y[order], batch_size=2 * batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[ps_program.halve_learning_rate()])
    return model.get_weights()


class CompressedPushTest(tf.test.TestCase, parameterized.TestCase):
    """Compressed pushes: each worker encodes, the updater decodes on ps task 0."""

    @parameterized.parameters(("soft_sync", "fp16", 2), ("async", "randomk", 2))
    def test_compressed_push_trains(self, strategy, compression, num_ps):
        # With 2 ps tasks each compresses and decodes its shard (a kernel split by rows);
        # random-k's ps redraws the worker's choice from the push's key. (A codec that codes
        # each variable apart, qsgd's per-variable norms, makes a payload per variable:
        # `tests/ps/protocol_test.py`'s push units, in one process; its cluster run was
        # folded away for the suite's time.)
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--scenario=equivalence", "--epochs=3",
                                      f"--strategy={strategy}",
                                      f"--strategy_arg=compression={compression}",
                                      num_ps=num_ps)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        history = chief["history"]
        dense = history["bytes_dense"][-1]
        self.assertEqual(dense, 4 * (8 * 16 + 16 + 16 * 2 + 2))
        compressor = tfdist.compression.get(compression)
        self.assertLen(chief["placement"], num_ps)
        want = sum(compressor.payload_bytes([task["bytes_pushed"] // 4], tf.float32)
                   for task in chief["placement"])
        self.assertEqual(history["bytes_sent"][-1], want)
        # On the wire a worker also sends its tag and rank and receives its shard of the
        # model, uncompressed: the ratio is dense over compressed round trips, under 2x.
        wire, sent = history["bytes_on_wire"][-1], history["bytes_sent"][-1]
        self.assertGreater(wire - sent, dense)
        self.assertAllClose(history["compression_ratio"][-1], (wire - sent + dense) / wire)
        self.assertLess(history["compression_ratio"][-1], 2)
        self.assertLess(history["loss"][-1], history["loss"][0])
        if compression == "fp16":
            # Hard sync with fp16 pushes: within 1e-3 of one process on the combined batch.
            for got, want in zip(chief["weights"], one_process_reference(out, "sgd", 3)):
                self.assertAllClose(np.array(got), want, rtol=0, atol=1e-3)

    def test_powersgd_is_refused_on_the_push_path(self):
        with self.assertRaisesRegex(ValueError, r"`compression`='powersgd' needs rounds of "
                                                r"all-reduce.*Allowed here: \[.*'topk'"):
            push_compressor("powersgd")


class DroppedGradientTest(tf.test.TestCase):

    def test_a_gradient_from_an_old_step_is_dropped_and_counted(self):
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--scenario=late",
                                           "--strategy_arg=replicas_to_aggregate=1")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief, late = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        # The chief's and worker 1's first steps are updates 1 and 2. The chief's epoch
        # follows alone: its first push, computed on the weights of update 1, is dropped.
        # Worker 1's next push, computed on the weights of update 2, is dropped too, and the
        # two after it (computed on the weights sent back) are applied.
        chief_steps = ps_program.ROWS // 2 // ps_program.BATCH
        self.assertEqual(load_result(out, "chief_done")["step"], 2 + chief_steps - 1)
        self.assertEqual(chief["dropped"], 2)
        self.assertEqual(chief["updates"], 2 + chief_steps - 1 + 2)
        self.assertEqual(late["history"]["dropped_gradients"][-1], 2)
        self.assertEqual(late["progress"]["global_step"], chief["updates"])
        self.assertEqual(late["progress"]["dropped_gradients"], 2)
        self.assertEqual(late["progress"]["aggregated_gradients"], chief["updates"])
        # DC-ASGD with bound 0 drops the same two pushes and takes only fresh ones. Each
        # worker's weights at its read are recorded with the reply that sent them (a drop's
        # reply too), so its compensation lambda g^2 (w_now - w_read) is exactly zero: the
        # weights are soft sync's, bit for bit.
        dc_out = os.path.join(out, "dc")
        cluster, result = run_cluster(dc_out, 2, "--scenario=late", "--strategy=async",
                                      "--strategy_arg=max_staleness=0",
                                      "--strategy_arg=delay_compensation=2.0")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        dc = load_result(dc_out, "worker0.json")
        self.assertEqual((dc["dropped"], dc["updates"]), (2, chief["updates"]))
        for got, want in zip(dc["weights"], chief["weights"]):
            self.assertAllEqual(got, want)
        # The embedding model, its table on the ps: a dropped push takes its table rows with
        # it. The same drops, and the weights of the same run with the table mirrored on the
        # workers (`embedding_tables=None`, its gradient pushed with the dense part).
        runs = {}
        for name, extra in (("rows", []), ("mirrored", ["--strategy_arg=embedding_tables=None"])):
            table_out = os.path.join(out, name)
            cluster, result = run_cluster(table_out, 2, "--scenario=late", "--model=embedding",
                                          "--strategy_arg=replicas_to_aggregate=1", *extra)
            self.assertEqual(result.returncode, 0, cluster_log(cluster))
            runs[name] = load_result(table_out, "worker0.json")
            self.assertEqual((runs[name]["dropped"], runs[name]["updates"]),
                             (2, chief["updates"]), name)
        self.assertEqual((runs["rows"]["tables_pushed"], runs["mirrored"]["tables_pushed"]),
                         ([1], [0]))
        for got, want in zip(runs["rows"]["weights"], runs["mirrored"]["weights"]):
            self.assertAllClose(np.array(got), want, rtol=1e-6, atol=1e-7)


class FaultTest(tf.test.TestCase, parameterized.TestCase):

    def _kill_during_soft_sync(self, rank, restart=False):
        """Soft sync 2 of 3, 20 epochs; worker `rank` SIGKILLed after the first epoch (and,
        with `restart`, started again once the others finished); returns `(out, cluster)`."""
        out = self.get_temp_dir()
        survivors = [r for r in range(3) if r != rank]
        with make_cluster(out, 3, "--scenario=long", "--epochs=20",
                          "--strategy_arg=replicas_to_aggregate=2", f"--wait_for_dead={rank}",
                          stop_on_failure=False) as cluster:
            wait_for_line(cluster, "READY")
            os.kill(cluster.pid(f"worker:{rank}"), signal.SIGKILL)
            if restart:
                # A worker writes its result after it left the run (`strategy.join()`).
                for survivor in survivors:
                    ps_program.wait_for_file(os.path.join(out, f"worker{survivor}.json"), 150)
                cluster.restart(f"worker:{rank}")
            result = cluster.wait()
        self.assertEqual(result.failed_task, None if restart else f"worker:{rank}",
                         cluster_log(cluster))
        for survivor in survivors:
            self.assertEqual(result.task_returncodes[f"worker:{survivor}"], 0,
                             cluster_log(cluster))
            survived = load_result(out, f"worker{survivor}.json")
            self.assertEqual(len(survived["history"]["loss"]), 20)
            self.assertEqual(survived["progress"]["dead"], [rank])
        return out, cluster

    def test_soft_sync_survives_a_killed_worker(self):
        out, _ = self._kill_during_soft_sync(2)
        self.assertEqual(load_result(out, "worker0.json")["dead"], [2])

    def test_soft_sync_survives_the_killed_chief_and_a_late_restart_takes_the_final_weights(
            self):
        # The updaters live on the ps tasks: losing worker 0 leaves the others training.
        # Issue 22: started again (as by its scheduler) once workers 1 and 2 finished the
        # run, the chief does not initialise a new run from fresh weights and train alone:
        # it is told the run finished, takes its final weights, and its 20-epoch fit ends
        # after one step that changes nothing.
        out, cluster = self._kill_during_soft_sync(0, restart=True)
        results = [load_result(out, f"worker{r}.json") for r in (1, 2)]
        steps = [result["history"]["global_step"] for result in results]
        self.assertGreater(min(s[-1] for s in steps), min(s[0] for s in steps))
        chief = load_result(out, "worker0.json")
        self.assertLen(chief["history"]["loss"], 1, cluster_log(cluster))
        self.assertEqual(load_result(out, "second_fit.json")["epochs"], 1, cluster_log(cluster))
        self.assertEqual((chief["left"], chief["dead"]), ([1, 2], [0]))
        # The weights of the last worker to leave are the run's final ones.
        last = max(results, key=lambda result: result["progress"]["updates"])
        self.assertEqual(chief["updates"], last["progress"]["updates"])
        for got, want in zip(chief["weights"], last["local_weights"]):
            self.assertAllEqual(got, want)
        self.assertRegex(task_lines(cluster, "ps:0"), r"/job:worker/task:0 came back to run "
                                                      r"\S+ of job '\w+' after it finished")
        self.assertRegex(task_lines(cluster, "worker:0"), r"run \S+ of job '\w+' finished "
                                                          r"while /job:worker/task:0 was away")

    def test_a_restarted_chief_takes_only_its_own_replies(self):
        # SSP (async, bound 4, wait): the chief is SIGKILLed while it waits for its reply, and
        # worker 1's next step releases it, so a reply to the dead process sits in the chief's
        # reply queue on the ps, which lives on. The restarted chief joins the same run at the
        # current weights, skips that reply, and each of its 4 steps takes its own: the global
        # step of its last reply is the ps's (13 updates, see `ps_program.restart_scenario`).
        # The model's embedding table lives on the ps: the restarted chief joins the run in
        # progress and ends on the weights worker 1 reads, table included.
        out = self.get_temp_dir()
        with make_cluster(out, 2, "--scenario=restart", "--strategy=async", "--model=embedding",
                          "--strategy_arg=max_staleness=4", "--strategy_arg=on_stale='wait'",
                          stop_on_failure=False) as cluster:
            wait_for_line(cluster, "PAUSED")
            os.kill(cluster.pid("worker:0"), signal.SIGKILL)
            with open(os.path.join(out, "go"), "w"):
                pass
            wait_for_line(cluster, "RELEASED")
            cluster.restart("worker:0")
            result = cluster.wait()
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        # The dead process's reply was there, and skipped (were the dead chief noticed
        # before worker 1's step released it, there would be none: the test would say so).
        self.assertEqual(load_result(out, "restarted"),
                         {"history_step": 13, "progress_step": 13, "skipped": [1]})
        chief, other = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        self.assertEqual((chief["updates"], chief["aggregated"]), (13, 13))
        self.assertEqual(chief["tables_pushed"], [1])
        for a, b in zip(chief["weights"], other["local_weights"]):
            self.assertAllEqual(a, b)

    @parameterized.parameters(None, 1)
    def test_a_worker_that_never_starts(self, replicas_to_aggregate):
        # Worker 1 exits before it makes its strategy: its server never answers. After
        # init_timeout it is dead: hard sync fails naming it, soft sync 1 of 2 goes on.
        out = self.get_temp_dir()
        flags = ["--scenario=absent", "--epochs=2", "--strategy_arg=init_timeout=4"]
        if replicas_to_aggregate:
            flags.append(f"--strategy_arg=replicas_to_aggregate={replicas_to_aggregate}")
        cluster, result = run_cluster(out, 2, *flags, stop_on_failure=False)
        if replicas_to_aggregate:
            self.assertEqual(result.returncode, 0, cluster_log(cluster))
            self.assertEqual(load_result(out, "worker0.json")["dead"], [1])
        else:
            self.assertNotEqual(result.task_returncodes["worker:0"], 0)
            self.assertRegex(cluster_log(cluster), r"/job:worker/task:1 at localhost:\d+ never "
                                                   r"joined the run .*init_timeout=4 s")

    def _kill_once_ready(self, task, *flags, **kwargs):
        """A 400-epoch run whose `task` is SIGKILLed after the first epoch; returns
        `(cluster, result, seconds from the kill to the run's end)`."""
        with make_cluster(self.get_temp_dir(), 2, "--scenario=long", "--epochs=400", *flags,
                          stop_on_failure=False, **kwargs) as cluster:
            wait_for_line(cluster, "READY")
            killed_at = time.monotonic()
            os.kill(cluster.pid(task), signal.SIGKILL)
            result = cluster.wait()
            return cluster, result, time.monotonic() - killed_at

    def test_hard_sync_names_the_dead_worker(self):
        cluster, result, elapsed = self._kill_once_ready("worker:1")
        self.assertEqual(result.failed_task, "worker:1")
        self.assertNotEqual(result.task_returncodes["worker:0"], 0)
        self.assertLess(elapsed, 30, "the survivor should fail within seconds, not hang")
        self.assertRegex(task_lines(cluster, "worker:0"),
                         r"/job:worker/task:1 at localhost:\d+ died, and with "
                         r"replicas_to_aggregate equal to the number of workers")

    def test_a_killed_ps_is_named_and_no_worker_hangs(self):
        # Soft sync 1 of 2 on 2 ps tasks: ps 1 holds half the model, so no worker can go on.
        cluster, result, elapsed = self._kill_once_ready(
            "ps:1", "--strategy_arg=replicas_to_aggregate=1", num_ps=2)
        self.assertLess(elapsed, 60, "the workers should fail within seconds, not hang")
        for rank in (0, 1):
            self.assertNotEqual(result.task_returncodes[f"worker:{rank}"], 0,
                                cluster_log(cluster))
            # The named error is the worker's last line: no TensorFlow teardown noise after it.
            last = [line for line in task_lines(cluster, f"worker:{rank}").splitlines()
                    if line.strip()][-1]
            self.assertRegex(last, r"/job:ps/task:1 at localhost:\d+ stopped answering "
                                   r"\(nothing accepts connections there\): its shard .* is "
                                   r"gone", cluster_log(cluster))


class StallTest(tf.test.TestCase, parameterized.TestCase):
    """Hung processes (SIGSTOP: the port stays open, nothing answers) with a short
    stall_timeout: a stopped worker is dead after it (and fenced if it wakes), a stopped ps
    ends its workers, a paused worker is never cut off. Every stopped task is sent SIGCONT,
    then SIGKILL, as soon as the test is done with it. Cost: four small clusters (3 + 3 + 2 +
    1 workers, one ps each): 144 to 357 s in all over six runs at load 8-15 on 2 cores for
    the three of them before the async one joined (soft sync 44-175 s, hard sync 32-166 s,
    the stopped ps 24-123 s), most of it starting TensorFlow processes."""

    @parameterized.named_parameters(("soft_sync_2_of_3", "--strategy_arg=replicas_to_aggregate=2"),
                                    ("async", "--strategy=async"))
    def test_a_stopped_worker_is_counted_out_fenced_when_it_wakes_a_paused_one_kept(
            self, strategy_flag):
        # stall_timeout=4 s (a strategy argument). Worker 2 stops itself after its first
        # epoch; worker 1 sleeps 6 s after its own (longer than the stall_timeout and the
        # probe's 2 s deadline, its server answering all along), then waits for worker 2's
        # end (the run must outlive it). Once the ps has counted worker 2 out, it is woken:
        # its next push is refused, and it ends with the ps's error (it was applied,
        # silently, before: issue 22), its exit's SYNC refused too (not taken back into the
        # run). Workers 0 and 1 train every epoch; the chief's join() returns (under async
        # it used to wait for the stopped worker for ever), worker 2 dead.
        out = self.get_temp_dir()
        hold = os.path.join(out, "worker2_ended")
        with make_cluster(out, 3, "--scenario=long", "--epochs=8", "--stop_rank=2",
                          "--slow_rank=1", "--slow_delay=0", "--pause=6",
                          f"--hold_file={hold}", strategy_flag,
                          "--strategy_arg=stall_timeout=4", stop_on_failure=False) as cluster:
            try:
                wait_for_line(cluster, "STOPPING")
                wait_for_line(cluster, "); going on with")  # worker 2 counted out
                os.kill(cluster.pid("worker:2"), signal.SIGCONT)
                deadline = time.monotonic() + 120  # a bound against a hang
                while cluster.returncode("worker:2") is None:
                    self.assertLess(time.monotonic(), deadline, cluster_log(cluster))
                    time.sleep(0.1)
                with open(hold, "w"):
                    pass
                for rank in (0, 1):
                    ps_program.wait_for_file(os.path.join(out, f"worker{rank}.json"), 150)
            finally:
                ps_testing.end_stopped(cluster, "worker:2")
            result = cluster.wait()
        log = "\n".join(f"[{task}] {line}" for task, line in cluster.lines)
        self.assertEqual(result.failed_task, "worker:2", cluster_log(cluster))
        for rank in (0, 1):
            self.assertEqual(result.task_returncodes[f"worker:{rank}"], 0, cluster_log(cluster))
            survived = load_result(out, f"worker{rank}.json")
            self.assertEqual(len(survived["history"]["loss"]), 8)
            self.assertEqual(survived["progress"]["dead"], [2])  # worker 1 never was
        self.assertRegex(log, r"/job:worker/task:2 at localhost:\d+ stopped answering \(no "
                              r"answer for \d+ s, stall_timeout=4 s; DeadlineExceeded")
        self.assertNotRegex(log, r"/job:worker/task:[01] at localhost:\d+ stopped answering")
        self.assertRegex(task_lines(cluster, "worker:2"),
                         r"tfdist: /job:ps/task:0: the run counts this worker out",
                         cluster_log(cluster))

    def test_hard_sync_names_a_stopped_worker(self):
        out = self.get_temp_dir()
        with make_cluster(out, 2, "--scenario=long", "--epochs=40", "--stop_rank=1",
                          "--strategy_arg=stall_timeout=4", stop_on_failure=False) as cluster:
            try:
                wait_for_line(cluster, "STOPPING")
                wait_for_line(cluster, "with replicas_to_aggregate equal to the number")
            finally:
                ps_testing.end_stopped(cluster, "worker:1")
            result = cluster.wait()
        self.assertNotEqual(result.task_returncodes["worker:0"], 0, cluster_log(cluster))
        self.assertRegex(task_lines(cluster, "worker:0"),
                         r"/job:worker/task:1 at localhost:\d+ stopped answering \(no answer "
                         r"for \d+ s, stall_timeout=4 s; .*\), and with replicas_to_aggregate "
                         r"equal to the number of workers")

    def test_a_stopped_ps_ends_its_worker_with_its_name(self):
        # stall_timeout from the environment, as `tfdist-launch --stall_timeout` sets it. The
        # ps stops as the worker ends its first epoch: its next one traces a function, which
        # TensorFlow registers on the ps holding Python's lock, so the watchdog's thread
        # cannot run and its fuse ends the worker (the watchdog itself, when a step waits).
        out = self.get_temp_dir()
        with make_cluster(out, 1, "--scenario=long", "--epochs=400", stop_on_failure=False,
                          env={"TFDIST_STALL_TIMEOUT": "4"}) as cluster:
            try:
                wait_for_line(cluster, "READY")
                os.kill(cluster.pid("ps:0"), signal.SIGSTOP)
                stopped_at = time.monotonic()
                wait_for_line(cluster, "stopped answering")
                took = time.monotonic() - stopped_at
            finally:
                ps_testing.end_stopped(cluster, "ps:0")
            result = cluster.wait()
        self.assertNotEqual(result.task_returncodes["worker:0"], 0, cluster_log(cluster))
        self.assertLess(took, 60, "the worker should end within seconds, not hang")
        # The named error is the worker's last line.
        last = [line for line in task_lines(cluster, "worker:0").splitlines()
                if line.strip()][-1]
        self.assertRegex(last, r"/job:ps/task:0 at localhost:\d+ stopped answering \(.*"
                               r"stall_timeout=4 s.*\): its shard of the master variables is "
                               r"gone", cluster_log(cluster))


def task_lines(cluster, task):
    return "\n".join(line for name, line in cluster.lines if name == task)


class CheckpointTest(tf.test.TestCase):

    def test_backup_and_restore_resumes_and_model_checkpoint_loads(self):
        # Adam on 2 ps tasks: each task's optimizer step count must resume with its slots.
        # The pushes are fp16 with error feedback: each worker's residuals (its pushes'
        # rounding errors, one per part of the shards) are saved in its backup and restored.
        out = self.get_temp_dir()
        flags = ["--scenario=checkpoint", "--epochs=4", "--optimizer=adam",
                 "--strategy_arg=compression={'name': 'fp16', 'config': "
                 "{'error_feedback': True}}"]
        with make_cluster(out, 2, *flags, "--crash_after_epoch=1", num_ps=2) as cluster:
            crashed = cluster.wait()
        self.assertEqual(crashed.failed_task, "worker:0", cluster_log(cluster))
        # Hard sync: the survivor is stopped with an error naming the dead chief.
        self.assertRegex(cluster_log(cluster), r"/job:worker/task:0 at localhost:\d+ died, "
                                               r"and with replicas_to_aggregate equal")
        steps_per_epoch = ps_program.ROWS // 2 // ps_program.BATCH
        # A new cluster (new ps) resumes from the backups: epochs 3 and 4 only, and the
        # optimizer's step (the global step) goes on from where the backup left it.
        with make_cluster(out, 2, *flags, num_ps=2) as cluster:
            resumed = cluster.wait()
        self.assertEqual(resumed.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        self.assertEqual(chief["history"]["global_step"],
                         [3 * steps_per_epoch, 4 * steps_per_epoch])
        self.assertEqual(chief["updates"], 2 * steps_per_epoch)
        # Hard sync, resumed: the weights of one process trained without a break, within
        # fp16's rounding of the pushes.
        for got, want in zip(chief["weights"], one_process_reference(out, "adam", 4)):
            self.assertAllClose(np.array(got), want, rtol=0, atol=1e-3)
        # The chief's residuals as its backup saved them, back before its first step; one
        # per ps task's fused push, keyed by the variables it carries (by their place among
        # the optimizer's: the first kernel split by rows over the 2 ps tasks).
        saved = load_result(out, "codec_state_saved.json")["state"]
        restored = load_result(out, "codec_state_restored0.json")["state"]
        self.assertEqual(sorted(saved), ["#0@0:4+#2[96]/residual/replica_0",
                                         "#0@4:8+#1+#3[82]/residual/replica_0"])
        self.assertEqual(sorted(restored), sorted(saved))
        for name, value in saved.items():
            self.assertAllEqual(restored[name], value, msg=name)
        self.assertGreater(max(np.abs(v).max() for v in saved.values()), 0)
        # `reset_compression_state()` sets them back to zero.
        reset = load_result(out, "codec_state_reset0.json")
        self.assertEqual(sorted(reset["after"]), sorted(saved))
        for name, value in reset["after"].items():
            self.assertAllEqual(value, np.zeros_like(reset["before"][name]), msg=name)
        # A `tf.train.Checkpoint` of the model and its optimizer, written by the chief after
        # join(), holds the masters: plain Keras restores the weights, Adam's step and its
        # slots as the chief reads them.
        check_tf_checkpoint(self, out, 4 * steps_per_epoch)
        # The chief's ModelCheckpoint holds the final master weights (and its codec state,
        # which plain Keras does not ask for).
        model = ps_program.build_model("adam")
        model.load_weights(os.path.join(out, "model.weights.h5"))
        for got, want in zip(model.get_weights(), chief["weights"]):
            self.assertAllClose(got, np.array(want), rtol=0, atol=0)


class UsersModelTest(tf.test.TestCase):

    def test_cnn_with_batchnorm_dropout_frozen_layer_adam_tf_data_and_checkpoint(self):
        # Hard sync, 3 workers, 2 ps tasks (the large kernels split by rows).
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 3, "--epochs=2", num_ps=2,
                                      program=ps_testing.USERS_MODEL,
                                      ps_imports=["tests.strategies.ps_functions"])
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        workers = [load_result(out, f"worker{rank}.json") for rank in range(3)]
        chief = workers[0]
        history = chief["history"]
        self.assertEqual(history["global_step"][-1], 2 * (500 // 32))
        # It learns (chance is 0.1; its large Dense layer is frozen at random weights).
        self.assertGreater(history["val_accuracy"][-1], 0.4)
        self.assertLess(history["val_loss"][-1], history["val_loss"][0])
        # Hard sync: every worker ends on the same weights (the last update's reply).
        for worker in workers[1:]:
            for path, value in chief["weights"].items():
                self.assertAllClose(worker["weights"][path], value, rtol=0, atol=0, msg=path)
        # The frozen layer is pushed as state every step (3 workers' mean of equal values)
        # and does not move by a bit; BatchNorm's moving statistics are averaged.
        for got, want in zip([chief["weights"]["frozen/kernel"], chief["weights"]["frozen/bias"]],
                             chief["frozen_before"]):
            self.assertAllEqual(np.array(got), np.array(want))
        moving_mean = np.array(chief["weights"]["batch_normalization/moving_mean"])
        self.assertGreater(np.abs(moving_mean).max(), 1e-3)
        split = [task["variables"]["frozen/kernel"] for task in chief["placement"]]
        self.assertEqual(sorted(split), [[0, 512], [512, 1024]])
        # The chief's checkpoint is a whole Keras model that plain Keras loads.
        model = keras.saving.load_model(os.path.join(out, "model.keras"))
        x_val = ps_users_model.digits()[1][0][:16]
        self.assertAllClose(model.predict(x_val, verbose=0), chief["predictions"], atol=1e-5)


class ConstructionTest(tf.test.TestCase):

    def _config(self, num_ps=1, num_workers=2):
        ports = pick_free_ports(num_ps + num_workers)
        return ClusterConfig.from_hosts(
            ps_hosts=[f"localhost:{p}" for p in ports[:num_ps]],
            worker_hosts=[f"localhost:{p}" for p in ports[num_ps:]], job_name="worker",
            task_index=0)

    def test_replicas_to_aggregate_out_of_range(self):
        for bad in (0, 3, -1, 1.5, True):
            with self.assertRaisesRegex(
                    ValueError, r"`replicas_to_aggregate` must be an integer between 1 and the "
                                r"number of workers total_replicas=2. Received: "):
                tfdist.strategies.SoftSyncStrategy(bad, cluster=self._config())

    def test_cluster_without_ps(self):
        with self.assertRaisesRegex(ValueError, "needs at least one ps task"):
            tfdist.strategies.SoftSyncStrategy(cluster=self._config(num_ps=0))

    def test_ps_task_cannot_train(self):
        config = self._config().with_task("ps", 0)
        with self.assertRaisesRegex(ValueError, "runs in a `chief` or `worker` task"):
            tfdist.strategies.SoftSyncStrategy(cluster=config)

    def test_unreachable_ps_is_named(self):
        config = self._config()
        with self.assertRaisesRegex(TaskUnreachableError,
                                    r"/job:ps/task:0 at localhost:\d+ did not answer in 1 s"):
            tfdist.strategies.SoftSyncStrategy(cluster=config, connect_timeout=1)

    def test_workers_compute_on_their_first_gpu(self):
        # No GPU here: the choice is tested, with the local GPUs given or mocked.
        self.assertEqual(compute_device("worker", 2, gpus=["GPU:0", "GPU:1"]),
                         "/job:worker/replica:0/task:2/device:GPU:0")
        self.assertEqual(compute_device("worker", 2, gpus=[]),
                         "/job:worker/replica:0/task:2/device:CPU:0")
        gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
        with mock.patch.object(tf.config, "list_physical_devices", return_value=[gpu]):
            self.assertEqual(compute_device("chief", 0), "/job:chief/replica:0/task:0/device:GPU:0")

    def test_optimizer_features_the_engine_cannot_honour_are_refused(self):
        strategy = "SoftSyncStrategy"
        gradients, averaging = GradientPush(), ModelPush(period=2)
        with self.assertRaisesRegex(ValueError, r"`use_ema=True` is not supported.*"
                                                r"Compile with `use_ema=False`"):
            gradients.check_optimizer(keras.optimizers.Adam(use_ema=True), strategy)
        with self.assertRaisesRegex(ValueError, r"`gradient_accumulation_steps=4` is not "
                                                r"supported by SoftSyncStrategy.*larger batch"):
            gradients.check_optimizer(keras.optimizers.SGD(gradient_accumulation_steps=4),
                                      strategy)
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(use_ema=True))
        with self.assertRaisesRegex(ValueError, "use_ema"):
            gradients.check_optimizer(lso, strategy)
        with self.assertRaisesRegex(ValueError, "use_ema"):
            averaging.check_optimizer(lso, strategy)
        # Model averaging trains locally: accumulation is the worker's own business.
        averaging.check_optimizer(keras.optimizers.SGD(gradient_accumulation_steps=4), strategy)
        with self.assertRaisesRegex(ValueError, r"the optimizer Adam was created outside the "
                                                r"scope of SoftSyncStrategy.*inside `with"):
            gradients.check_optimizer(keras.optimizers.Adam(), strategy)

    def test_bad_timeouts(self):
        with self.assertRaisesRegex(ValueError, "`init_timeout` must be a positive number"):
            tfdist.strategies.SoftSyncStrategy(cluster=self._config(), init_timeout=0)
        # stall_timeout, an argument of every parameter-server strategy (or the launcher's
        # environment), is checked before any connection.
        for name in ("soft_sync", "async", "model_averaging"):
            for bad in (0, -3, float("inf"), True, "5"):
                with self.assertRaisesRegex(ValueError, r"`stall_timeout` must be a positive "
                                                        r"number of seconds. Received: "):
                    tfdist.strategies.get(name, cluster=self._config(), stall_timeout=bad)
        with mock.patch.dict(os.environ, {"TFDIST_STALL_TIMEOUT": "soon"}):
            with self.assertRaisesRegex(ValueError, r"environment variable TFDIST_STALL_TIMEOUT "
                                                    r"must be a positive number of seconds"):
                tfdist.strategies.SoftSyncStrategy(cluster=self._config())

    def test_registry_name(self):
        self.assertIn("soft_sync", tfdist.strategies.names())
        with self.assertRaisesRegex(ValueError, "needs at least one ps task"):
            tfdist.strategies.get("soft_sync", cluster=self._config(num_ps=0))



if __name__ == "__main__":
    tf.test.main()
