"""AsyncStrategy: staleness policies against numpy, measured staleness, bounded staleness."""

import numpy as np
import tensorflow as tf

import tfdist
from tests.strategies import ps_functions
from tests.strategies import ps_program
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import run_cluster
from tfdist.ps import policies


class PolicyTest(tf.test.TestCase):

    def test_inverse_staleness_matches_numpy(self):
        tau = np.arange(0, 10)
        self.assertAllClose(policies.inverse_staleness(tf.constant(tau, tf.int64)),
                            1.0 / np.maximum(1, tau))

    def test_delay_compensation_matches_numpy(self):
        rng = np.random.RandomState(0)
        g, w_now, w_read = (rng.randn(50).astype("float32") for _ in range(3))
        want = g + 0.3 * g * g * (w_now - w_read)
        self.assertAllClose(policies.delay_compensated(g, w_now, w_read, 0.3), want)
        self.assertAllClose(policies.delay_compensated(g, w_now, w_now, 0.3), g)

    def test_async_policy(self):
        policy = policies.AsyncPolicy("inverse", max_staleness=2)
        self.assertEqual(policy.required(4), 1)
        self.assertEqual(policy.required(0), 0)
        step = tf.constant(10, tf.int64)
        self.assertEqual([bool(policy.accepts(tf.constant(s, tf.int64), step))
                          for s in (7, 8, 10)], [False, True, True])
        self.assertAllClose(policy.learning_rate_factor(tf.constant(4, tf.int64)), 0.25)
        unbounded = policies.AsyncPolicy(ps_functions.exponential)
        self.assertEqual(unbounded.to_spec()["staleness"],
                         "tests.strategies.ps_functions:exponential")
        rebuilt = policies.policy_from_spec(unbounded.to_spec())
        self.assertIs(rebuilt.staleness_fn, ps_functions.exponential)
        self.assertTrue(bool(unbounded.accepts(tf.constant(0, tf.int64), step)))
        self.assertAllClose(unbounded.learning_rate_factor(tf.constant(1, tf.int64)),
                            np.exp(-1.0))

    def test_soft_sync_policy(self):
        policy = policies.SoftSyncPolicy(3, 4)
        self.assertEqual(policy.required(2), 2)
        self.assertFalse(policy.fails_on_dead_worker)
        self.assertTrue(policies.SoftSyncPolicy(4, 4).fails_on_dead_worker)
        self.assertIsNone(policy.learning_rate_factor(tf.constant(0, tf.int64)))

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"`staleness` must be one of \['inverse', "
                                                r"'none'\] or a callable. Received: 'sqrt'"):
            policies.AsyncPolicy("sqrt")
        with self.assertRaisesRegex(ValueError, "`max_staleness` must be None or an integer "
                                                ">= 0. Received: -1"):
            policies.AsyncPolicy(max_staleness=-1)
        with self.assertRaisesRegex(ValueError, r"`staleness` runs on the ps tasks, which "
                                                r"import it by name.*not a lambda"):
            policies.AsyncPolicy(lambda tau: 1.0)
        with self.assertRaisesRegex(ValueError, "`delay_compensation`"):
            policies.AsyncPolicy(delay_compensation="big")
        with self.assertRaisesRegex(ValueError, r"`on_stale` must be one of \['drop', 'wait'\]"):
            policies.AsyncPolicy(on_stale="block")
        with self.assertRaisesRegex(ValueError, "needs `max_staleness`. Received: None"):
            policies.AsyncPolicy(on_stale="wait")

    def test_registry_name(self):
        self.assertIn("async", tfdist.strategies.names())


class AsyncTrainingTest(tf.test.TestCase):

    def test_one_worker_is_never_stale(self):
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 1, "--strategy=async", "--epochs=2")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        steps = 2 * ps_program.ROWS // ps_program.BATCH
        self.assertEqual(chief["progress"]["staleness_histogram"][0], steps)
        self.assertEqual(chief["progress"]["staleness_max"], 0)
        self.assertEqual(chief["history"]["staleness_max"], [0, 0])

    def test_forced_interleaving_gives_the_expected_staleness(self):
        # The chief's and worker 1's first steps are updates 1 and 2; the chief's epoch
        # follows alone (its first gradient, computed on the weights of update 1, 1 stale).
        # Worker 1's next gradient, computed on the weights of update 2, is exactly
        # `chief_steps` stale; the two after it are fresh.
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--scenario=late", "--strategy=async",
                                           "--strategy_arg=staleness='inverse'")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief_steps = load_result(out, "chief_done")["step"] - 2
        self.assertEqual(chief_steps, ps_program.ROWS // 2 // ps_program.BATCH)
        progress = load_result(out, "worker0.json")["progress"]
        histogram = [0] * 16
        histogram[0], histogram[1], histogram[chief_steps] = chief_steps + 3, 1, 1
        self.assertEqual(progress["staleness_histogram"], histogram)
        self.assertEqual(progress["staleness_max"], chief_steps)
        self.assertEqual(progress["global_step"], 2 + chief_steps + 3)
        self.assertEqual(progress["dropped_gradients"], 0)

    def test_bounded_staleness_with_a_slow_worker(self):
        # On a model with an embedding table kept on the ps: a dropped push drops its rows.
        out = self.get_temp_dir()
        bound = 2
        cluster, result = run_cluster(out, 3, "--strategy=async", "--model=embedding",
                                      f"--strategy_arg=max_staleness={bound}", "--epochs=4",
                                      "--slow_rank=2", "--slow_delay=0.1")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        self.assertEqual(load_result(out, "worker0.json")["tables_pushed"], [1])
        progress = load_result(out, "worker0.json")["progress"]
        self.assertLessEqual(progress["staleness_max"], bound)
        self.assertEqual(sum(progress["staleness_histogram"][bound + 1:]), 0)
        self.assertGreater(progress["dropped_gradients"], 0)
        self.assertEqual(progress["aggregated_gradients"] + progress["dropped_gradients"],
                         sum(load_result(out, f"worker{r}.json")["pushes"] for r in range(3)))

    def test_wait_mode_keeps_workers_within_the_bound_of_the_slowest(self):
        # SSP with delay compensation, on a model whose embedding table lives on the ps
        # tasks, split over 2 (`ps_program.split_table`): each push to each task also
        # carries the rows its step read there, and each task compensates its rows (the rule
        # itself: tests/ps/updater_test.py).
        out = self.get_temp_dir()
        bound = 1
        cluster, result = run_cluster(out, 3, "--strategy=async", "--model=embedding",
                                      f"--strategy_arg=max_staleness={bound}",
                                      "--strategy_arg=on_stale='wait'", "--epochs=3",
                                      "--strategy_arg=delay_compensation=0.5",
                                      "--slow_rank=2", "--slow_delay=0.1", "--split_table",
                                      num_ps=2)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief = load_result(out, "worker0.json")
        self.assertLessEqual(chief["max_clock_gap"], bound)
        self.assertEqual(chief["dropped"], 0)
        pushes = sum(load_result(out, f"worker{r}.json")["pushes"] for r in range(3))
        self.assertEqual(chief["aggregated"], pushes)
        self.assertEqual(chief["tables_pushed"], [1, 1])
        self.assertEqual(chief["tables_read_rows"], [[True], [True]])  # and the rows read
        split = [task["variables"].get("sequential/embedding/embeddings")
                 for task in chief["placement"]]
        self.assertEqual(sorted(split), [[0, 24], [24, 48]])
        self.assertLess(chief["history"]["loss"][-1], chief["history"]["loss"][0])

    def test_the_chief_waits_for_a_slower_worker_and_a_pause_is_not_death(self):
        # The chief trains its 3 epochs in about a second and joins. Worker 1 sleeps 0.3 s
        # after each step and 6 s after its first epoch (a long validation or checkpoint: no
        # update meanwhile, 3 times the liveness probes' verdict time). It is neither cut
        # off nor taken for dead: every push of both is applied. The chief trains with
        # EarlyStopping(restore_best_weights=True), whose restore at the end of its fit
        # worker 1 trains on over: join() waits, then writes the chief's restore again,
        # so the chief ends on its best epoch's weights, not on worker 1's last update.
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 2, "--strategy=async", "--epochs=3",
                                      "--slow_rank=1", "--slow_delay=0.3", "--pause=6",
                                      "--chief_early_stopping")
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        chief, slow = load_result(out, "worker0.json"), load_result(out, "worker1.json")
        self.assertEqual(chief["dead"], [])
        self.assertLen(slow["history"]["loss"], 3)
        self.assertEqual(chief["aggregated"], chief["pushes"] + slow["pushes"])
        self.assertEqual(chief["updates"], chief["aggregated"])
        best = load_result(out, "best_weights.json")
        # Worker 1's updates went on after the chief's restore ...
        self.assertGreater(chief["updates"], best["updates"])
        # ... and the model ends on the chief's best epoch all the same.
        for a, b in zip(chief["weights"], best["weights"]):
            self.assertAllEqual(a, b)

    def test_learning_rate_factor_reaches_the_optimizer(self):
        out = self.get_temp_dir()
        # The staleness function's module is named on the ps's command line: a ps imports
        # no other module a worker names (tests/ps/service_test.py).
        cluster, result = run_cluster(out, 1, "--strategy=async", "--frozen", "--epochs=1",
                                      ps_imports=["tests.strategies.ps_functions"])
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        initial = load_result(out, "initial.json")["weights"]
        final = load_result(out, "worker0.json")["weights"]
        for a, b in zip(initial, final):
            self.assertAllEqual(np.array(a), np.array(b))
        self.assertGreater(load_result(out, "worker0.json")["updates"], 0)



if __name__ == "__main__":
    tf.test.main()
