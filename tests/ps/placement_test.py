"""Placement of master variables on ps tasks: whole, or split by rows; mirrors of split masters."""

import random
import types

import keras
import numpy as np
import tensorflow as tf

from tfdist.ps import placement
from tfdist.ps import table_set
from tfdist.ps.spec import ShardSpec
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import replica_step

# The digits MLP of the benchmarks: 64 -> 64 -> 10.
DIGITS = [("dense/kernel", [64, 64]), ("dense/bias", [64]), ("dense_1/kernel", [64, 10]),
          ("dense_1/bias", [10])]


def items(shapes=DIGITS, **kwargs):
    return [placement.Item(key, shape, "float32", **kwargs) for key, shape in shapes]


def bytes_per_task(plan, by_key, num_ps):
    held = [0] * num_ps
    for key, places in plan.items():
        item = by_key[key]
        for task, rows in places:
            held[task] += item.bytes if rows is None else (
                item.bytes * (rows[1] - rows[0]) // item.shape[0])
    return held


class PlanTest(tf.test.TestCase):

    def test_row_splits_are_contiguous_and_even(self):
        self.assertEqual(placement.row_splits(8, 3), [(0, 3), (3, 6), (6, 8)])
        self.assertEqual(placement.row_splits(4, 2), [(0, 2), (2, 4)])

    def test_auto_gives_each_of_two_ps_tasks_about_half_the_digits_model(self):
        model = items()
        plan = placement.plan(model, 2)
        held = bytes_per_task(plan, {i.key: i for i in model}, 2)
        self.assertEqual(sum(held), 4 * 4810)
        self.assertAllInRange(np.array(held) / sum(held), 0.45, 0.55)
        self.assertEqual(plan["dense/kernel"], [(0, (0, 32)), (1, (32, 64))])
        # Whole, without splitting: the large kernel alone holds 85 % of the model.
        whole = bytes_per_task(placement.plan(model, 2, None), {i.key: i for i in model}, 2)
        self.assertEqual(max(whole), 4 * 64 * 64)

    def test_every_variable_is_covered_once_with_parts_on_distinct_tasks(self):
        shapes = [(f"layer{i}/kernel", [random.Random(i).randint(1, 300), 7]) for i in range(30)]
        for num_ps in (1, 2, 3, 5):
            plan = placement.plan(items(shapes), num_ps)
            for key, shape in shapes:
                places = plan[key]
                tasks = [t for t, _ in places]
                self.assertEqual(len(set(tasks)), len(tasks))
                self.assertTrue(all(0 <= t < num_ps for t in tasks))
                if places[0][1] is None:
                    self.assertLen(places, 1)
                    continue
                rows = [r for _, r in places]
                self.assertEqual(rows, placement.row_splits(shape[0], len(rows)))

    def test_same_plan_whatever_the_creation_order_of_independent_variables(self):
        model = items()
        shuffled = list(model)
        random.Random(3).shuffle(shuffled)
        self.assertEqual(placement.plan(model, 3), placement.plan(shuffled, 3))

    def test_slots_follow_their_variable_and_counters_are_everywhere(self):
        model = items() + [
            placement.Item("adam/dense_kernel_momentum", [64, 64], "float32",
                           colocate_with="dense/kernel"),
            placement.Item("adafactor/dense_kernel_r", [64], "float32",
                           colocate_with="dense/kernel"),
            placement.Item("adam/iteration", [], "int64", everywhere=True)]
        plan = placement.plan(model, 2)
        self.assertEqual(plan["adam/dense_kernel_momentum"], plan["dense/kernel"])
        # A slot of another shape cannot be split like its variable: whole, with its first part.
        self.assertEqual(plan["adafactor/dense_kernel_r"], [(plan["dense/kernel"][0][0], None)])
        self.assertEqual(plan["adam/iteration"], [(0, None), (1, None)])

    def test_unsplittable_and_tiny_variables_stay_whole(self):
        plan = placement.plan(items(splittable=False), 4)
        self.assertTrue(all(places[0][1] is None and len(places) == 1
                            for places in plan.values()))
        plan = placement.plan(items([("one_row", [1, 4096]), ("scalar", [])]), 2)
        self.assertEqual(plan["one_row"], [(0, None)])
        # "auto" never makes parts below 256 bytes: eight 4-float biases on 8 ps stay whole.
        plan = placement.plan(items([(f"b{i}", [4]) for i in range(8)]), 8)
        self.assertTrue(all(len(places) == 1 for places in plan.values()))

    def test_a_partitioner_is_capped_at_the_ps_tasks_and_splits_rows_only(self):
        partitioners = tf.distribute.experimental.partitioners
        plan = placement.plan(items(), 2, partitioners.FixedShardsPartitioner(3))
        self.assertEqual(plan["dense_1/bias"], [(0, (0, 5)), (1, (5, 10))])
        with self.assertRaisesRegex(ValueError, r"dense/kernel .*first axis only"):
            placement.plan(items(), 2, lambda shape, dtype: [1, 2])
        with self.assertRaisesRegex(ValueError, r"`variable_partitioner` must be None.*"
                                                r"Received: 'even'"):
            placement.check_partitioner("even")
        with self.assertRaisesRegex(ValueError, r"`variable_partitioner` must be"):
            placement.check_partitioner(partitioners.FixedShardsPartitioner)  # not an instance

    def test_embedding_tables_split_as_other_variables_and_balance_by_bytes(self):
        # A table's parts (`TableSet.parts_of`): "auto" splits a table into parts of at
        # least 256 KiB (the recommendation benchmark's 1 M x 16 and 100 k x 16 tables), and
        # keeps a smaller one (its 1,000 x 16; 4,096 x 16 is 256 KiB) whole on the least
        # loaded task; the dense plan starts from the tables' bytes.
        connection = types.SimpleNamespace(num_ps=2)
        tables = table_set.TableSet(table_set.TableRule(), connection, 10.0)
        self.assertEqual(tables.parts_of("a", [1_000_000, 16], "float32"),
                         [(0, (0, 500_000)), (1, (500_000, 1_000_000))])
        self.assertEqual(tables.parts_of("b", [100_000, 16], "float32"),
                         [(0, (0, 50_000)), (1, (50_000, 100_000))])
        self.assertEqual(tables.parts_of("c", [1_000, 16], "float32"), [(0, (0, 1_000))])
        self.assertEqual(tables.parts_of("d", [4_096, 16], "float32"), [(1, (0, 4_096))])
        self.assertEqual(tables.held(), [35_264_000, 35_462_144])
        plan = placement.plan(items(), 2, held=[10**6, 0])
        self.assertEqual(plan["dense/kernel"], [(1, (0, 32)), (0, (32, 64))])
        self.assertEqual(plan["dense/bias"], [(1, None)])
        # A partitioner decides per table; None keeps every table whole.
        partitioners = tf.distribute.experimental.partitioners
        fixed = table_set.TableSet(table_set.TableRule(), connection, 10.0,
                                   partitioners.FixedShardsPartitioner(2))
        self.assertEqual(fixed.parts_of("e", [48, 4], "float32"), [(0, (0, 24)), (1, (24, 48))])
        whole = table_set.TableSet(table_set.TableRule(), connection, 10.0, None)
        self.assertEqual(whole.parts_of("f", [1_000_000, 16], "float32"),
                         [(0, (0, 1_000_000))])
        self.assertEqual(whole.parts_of("g", [1_000, 16], "float32"), [(1, (0, 1_000))])

    def test_specs_that_place_a_variable_differently_do_not_fit(self):
        entry = {"path": "dense/kernel", "shape": [32, 64], "dtype": "float32",
                 "role": "gradient", "rows": [0, 32]}
        bias = {"path": "dense/bias", "shape": [64], "dtype": "float32", "role": "gradient",
                "rows": None}

        def spec(*variables):
            return ShardSpec(mode="gradients", policy={}, num_workers=1, worker_tasks=["w"],
                             worker_addresses=["a"], num_ps=2, shard=0, variables=variables)

        run = spec(entry, bias)
        self.assertIsNone(run.difference(spec(entry, bias)))
        moved = {**entry, "rows": [32, 64]}
        self.assertRegex(run.difference(spec(moved, bias)),
                         r"'dense/kernel' has rows \[32, 64\], in the run \[0, 32\] "
                         r"\(the same `variable_partitioner`")
        self.assertRegex(run.difference(spec(bias, entry)),
                         "in another order")
        # A table this task holds and the run placed on another, and the other way round.
        table = {"path": "e/embeddings", "shape": [48, 4], "dtype": "float32",
                 "role": "table", "rows": [0, 48], "table": True}
        self.assertRegex(run.difference(spec(entry, bias, table)),
                         r"it has variable 'e/embeddings', which the run does not \(the same "
                         r"`variable_partitioner`")
        self.assertRegex(spec(entry, bias, table).difference(run),
                         r"the run has variable 'e/embeddings', which it does not \(the same")
        self.assertNotRegex(run.difference(spec(entry)), "variable_partitioner")

    def test_elementwise_optimizers(self):
        self.assertTrue(placement.elementwise_optimizer(keras.optimizers.Adam()))
        self.assertTrue(placement.elementwise_optimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())))
        self.assertFalse(placement.elementwise_optimizer(keras.optimizers.Lamb()))
        self.assertFalse(placement.elementwise_optimizer(keras.optimizers.Adafactor()))


class SplitMirrorTest(tf.test.TestCase):
    """A mirror whose master is split in parts (plain local variables stand for the ps)."""

    def _mirror(self):
        mirror = MirrorVariable.create("dense/kernel", "gradient",
                                       initial_value=tf.zeros([4, 3]))
        parts = [tf.Variable(tf.zeros([2, 3])), tf.Variable(tf.zeros([2, 3]))]
        mirror.bind(parts[1], (2, 4))  # bound in any order, read in row order
        mirror.bind(parts[0], (0, 2))
        return mirror, parts

    def test_reads_join_the_parts_and_writes_split_them(self):
        mirror, parts = self._mirror()
        value = np.arange(12, dtype=np.float32).reshape(4, 3)
        mirror.assign(value)
        self.assertAllEqual(parts[0], value[:2])
        self.assertAllEqual(parts[1], value[2:])
        parts[1].assign_add(tf.ones([2, 3]))  # the ps updates a part
        self.assertAllEqual(mirror.numpy(), np.concatenate([value[:2], value[2:] + 1]))
        mirror.assign_sub(tf.ones([4, 3]))
        self.assertAllEqual(parts[0], value[:2] - 1)
        self.assertAllEqual(parts[1], value[2:])
        mirror.scatter_update(tf.IndexedSlices(tf.fill([1, 3], 7.0), tf.constant([3])))
        self.assertAllEqual(parts[1][1], [7.0, 7.0, 7.0])
        self.assertAllEqual(parts[0], value[:2] - 1)

    def test_inside_a_step_the_mirror_is_local_and_a_follower_never_writes(self):
        mirror, parts = self._mirror()
        with replica_step():
            mirror.assign(tf.ones([4, 3]))
            self.assertAllEqual(mirror.read_value(), tf.ones([4, 3]))
        self.assertAllEqual(parts[0], tf.zeros([2, 3]))
        self.assertAllEqual(mirror.numpy(), tf.zeros([4, 3]))
        mirror.follow()
        mirror.assign(tf.ones([4, 3]))
        self.assertAllEqual(parts[0], tf.zeros([2, 3]))

    def test_a_write_to_a_table_averaged_by_rows_is_said_once(self):
        # The chief's write mid-run reaches the master, not the other workers' untouched
        # rows: a warning naming the table, once.
        mirror = MirrorVariable.create("embedding/embeddings", "rows",
                                       initial_value=tf.zeros([4, 3]))
        mirror.bind(tf.Variable(tf.zeros([4, 3])))
        with self.assertLogs("tfdist", "WARNING") as logs:
            mirror.assign(tf.ones([4, 3]))
            mirror.scatter_update(tf.IndexedSlices(tf.fill([1, 3], 2.0), tf.constant([1])))
        self.assertLen(logs.records, 1)
        self.assertRegex(logs.output[0], r"embedding/embeddings is averaged by the rows a "
                                         r"round changed.*embedding_tables=None")
        plain, _ = self._mirror()
        with self.assertNoLogs("tfdist", "WARNING"):
            plain.assign(tf.ones([4, 3]))

    def test_whole_masters_after_the_first_are_copies(self):
        mirror = MirrorVariable.create("adam/learning_rate", "optimizer", initial_value=0.1)
        first, copy = tf.Variable(0.5), tf.Variable(0.25)
        mirror.bind(first)
        mirror.bind(copy)
        self.assertAllClose(mirror.numpy(), 0.5)
        mirror.assign_add(0.25)
        self.assertAllClose([first.numpy(), copy.numpy()], [0.75, 0.75])


if __name__ == "__main__":
    tf.test.main()
