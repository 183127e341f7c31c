"""The shard spec: typed on both sides, today's JSON on the wire, and what must agree."""

import tensorflow as tf

from tfdist.ps.spec import ShardSpec
from tfdist.ps.spec import VariableEntry


def spec(variables, **fields):
    base = dict(mode="gradients", policy={"name": "async", "staleness": "none"},
                num_workers=2, worker_tasks=["/job:worker/task:0", "/job:worker/task:1"],
                worker_addresses=["localhost:1", "localhost:2"], num_ps=1, shard=0,
                variables=variables)
    return ShardSpec(**{**base, **fields})


class SpecTest(tf.test.TestCase):

    def test_json_is_the_dict_a_worker_sends_and_round_trips(self):
        # The dicts the worker side makes (`_ensure_run`, `_spec`): optional fields only
        # when set, rows always.
        entries = [
            {"path": "d/kernel", "shape": [4, 3], "dtype": "float32", "role": "gradient",
             "weight_decay": False, "constraint": {"class_name": "NonNeg", "config": {}},
             "rows": [0, 4]},
            {"path": "e/embeddings", "shape": [10, 2], "dtype": "float32",
             "role": "gradient", "sparse": True, "rows": None},
            {"path": "k", "shape": [2], "dtype": "float32", "role": "average",
             "outer": True, "rows": None},
            {"path": "bn/moving_mean", "shape": [3], "dtype": "float32", "role": "value",
             "rows": None},
            {"path": "u/embeddings", "shape": [5, 2], "dtype": "float32", "role": "table",
             "rows": [5, 10], "table": True}]
        sent = {"mode": "gradients", "policy": {"name": "soft_sync", "num_workers": 2,
                                                "replicas_to_aggregate": 1},
                "num_workers": 2, "worker_tasks": ["a", "b"], "worker_addresses": ["x", "y"],
                "num_ps": 1, "shard": 0, "variables": entries,
                "optimizer": {"class_name": "SGD", "config": {"learning_rate": 0.1}},
                "outer_optimizer": None, "imports": ["my.module"], "compression": None,
                "delta": False, "init_timeout": 30.0, "stall_timeout": 5.0,
                "table_updates": "lazy", "job": "a1b2"}
        typed = ShardSpec.from_json(sent)
        self.assertEqual(typed.to_json(), sent)
        self.assertEqual(ShardSpec.from_json(typed.to_json()), typed)
        kernel, table, outer, state, kept = typed.variables
        self.assertEqual((kernel.rows, kernel.weight_decay, kernel.sparse), ((0, 4), False, False))
        self.assertTrue(table.sparse and outer.outer and state.role == "value")
        self.assertEqual(kernel.shape, (4, 3))
        # A table kept on the ps: its part's rows, trained there.
        self.assertEqual((kept.rows, kept.table, kept.trainable), ((5, 10), True, True))

    def test_the_job_travels_and_an_older_worker_names_none(self):
        sent = spec([], job="a1b2").to_json()
        self.assertEqual(ShardSpec.from_json(sent).job, "a1b2")
        del sent["job"]
        self.assertIsNone(ShardSpec.from_json(sent).job)
        with self.assertRaisesRegex(ValueError, r"`job` must be a string or None. "
                                                r"Received: 7"):
            spec([], job=7)

    def test_stall_timeout_travels_and_is_checked(self):
        # A worker of an earlier release sends no stall_timeout: the default counts.
        sent = spec([]).to_json()
        del sent["stall_timeout"]
        self.assertEqual(ShardSpec.from_json(sent).stall_timeout, 60.0)
        for bad in (0, -1.0, float("inf"), "5", True, None):
            with self.assertRaisesRegex(ValueError, r"`stall_timeout` must be a positive "
                                                    r"number of seconds. Received: "):
                spec([], stall_timeout=bad)

    def test_an_unknown_role_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, r"the role of variable 'v' must be one of "
                                                r"\['gradient', .*Received: 'weights'"):
            VariableEntry("v", [1], "float32", "weights")

    def test_a_worker_pushing_an_embedding_otherwise_is_refused_by_name(self):
        entry = {"path": "e", "shape": [4, 2], "dtype": "float32", "role": "gradient"}
        self.assertEqual(spec([entry]).difference(spec([{**entry, "sparse": True}])),
                         "variable 'e' has sparse True, in the run False")

    def test_a_worker_with_another_outer_optimizer_is_refused(self):
        # Model averaging: the outer optimizer, and the variables it updates, must agree; a
        # learning rate a callback may set differs harmlessly, as for the optimizer.
        entry = {"path": "k", "shape": [2], "dtype": "float32", "role": "average",
                 "outer": True}
        sgd = {"class_name": "SGD", "config": {"learning_rate": 0.7, "momentum": 0.9}}
        run = spec([entry], outer_optimizer=sgd)
        self.assertIsNone(run.difference(spec([entry], outer_optimizer={
            **sgd, "config": {"learning_rate": 0.1, "momentum": 0.9}})))
        self.assertRegex(run.difference(spec([entry], outer_optimizer=None)),
                         r"^its outer optimizer is None, the run's is \{'class_name': 'SGD'")
        self.assertEqual(run.difference(spec([{**entry, "outer": None}],
                                             outer_optimizer=sgd)),
                         "variable 'k' has outer False, in the run True")
        self.assertEqual(run.difference(spec([entry], outer_optimizer=sgd, num_workers=3)),
                         "its num_workers is 3, the run's is 2")


if __name__ == "__main__":
    tf.test.main()
