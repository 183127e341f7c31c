"""Tables that live on ps devices, read row by row (one process: the suite's logical CPUs
stand for the ps tasks; the shared-name mechanism is the one a ps task serves)."""

import itertools
import os
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps import protocol
from tfdist.ps import table_init
from tfdist.ps import table_set
from tfdist.ps import tables
from tfdist.ps import variables
from tfdist.ps.snapshot import ShardSnapshot
from tfdist.ps.snapshot import consistent_reads
from tfdist.ps.variables import replica_step

ROWS, WIDTH = 30, 4
_names = itertools.count()


def _parts(splits):
    # Two logical CPUs (tests/conftest.py) stand for two ps tasks.
    return [(f"/device:CPU:{i % 2}", rows) for i, rows in enumerate(splits)]


def _table(splits=((0, 12), (12, ROWS)), value=None):
    value = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) if value is None \
        else value
    table = tables.TableVariable.create(f"test{next(_names)}/embeddings", [ROWS, WIDTH],
                                        tf.float32, _parts(splits), initial_value=value)
    table.initialize()
    table.joined(initialized=True)
    return table, value


def _table_creator(splits):
    """Makes every 2-D Keras variable a table, as the ps strategies do for embeddings."""

    def creator(next_creator, **kwargs):
        initial = kwargs["initial_value"]
        keras_variable = _tf_compat.keras_variable_being_initialized()
        table = tables.TableVariable.create(
            f"model{next(_names)}/{kwargs['name']}", keras_variable.shape,
            kwargs.get("dtype") or tf.float32, _parts(splits), initial_value=initial)
        table.initialize()
        keras_variable.sparse_read = table.sparse_read
        return table

    return creator


class TableVariableTest(tf.test.TestCase):

    def test_lookups_equal_a_gather_of_the_whole_table(self):
        for splits in (((0, ROWS),), ((0, 12), (12, ROWS)), ((0, 10), (10, 20), (20, ROWS))):
            table, value = _table(splits)
            ids = np.array([[29, 0, 11], [12, 12, 5]])
            self.assertAllEqual(table.sparse_read(ids), value[ids])
            self.assertAllEqual(tf.function(table.sparse_read)(ids), value[ids])

    def test_a_repeated_id_crosses_once(self):
        # The ids sent to each part's gather, and the bytes a step's lookups moved, count
        # each distinct id once (two lookups of one row: twice).
        table, value = _table()
        sent = []
        gather = tf.raw_ops.ResourceGather

        def counting(**kwargs):
            sent.append(kwargs["indices"].numpy().tolist())
            return gather(**kwargs)

        with tables.step_lookups(), mock.patch.object(tf.raw_ops, "ResourceGather", counting):
            rows = table.sparse_read([[5, 17, 5], [17, 5, 29]])
            table.sparse_read([5])
            moved = tables.take_read_bytes()
        self.assertAllEqual(rows, value[[[5, 17, 5], [17, 5, 29]]])
        # Part 1 holds rows 0-11, part 2 rows 12-29 (ids 17 and 29 are its 5 and 17).
        self.assertEqual(sorted(sent), [[], [5], [5], [5, 17]])
        self.assertEqual(int(moved), 4 * (4 + 4 * WIDTH))

    def test_only_rows_cross_to_the_worker_in_a_traced_lookup(self):
        table, _ = _table()
        graph = tf.function(table.sparse_read).get_concrete_function(
            tf.TensorSpec([None], tf.int32)).graph
        gathers = [op for op in graph.get_operations() if op.type == "ResourceGather"]
        self.assertEqual(sorted(op.device[-5:] for op in gathers), ["CPU:0", "CPU:1"])
        self.assertEmpty([op for op in graph.get_operations() if op.type == "ReadVariableOp"])

    def test_the_gradient_is_the_rows_gradient(self):
        table, value = _table()
        ids = tf.constant([3, 17, 3])

        @tf.function
        def gradient():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(table.sparse_read(ids) ** 2)
            return tape.gradient(loss, table)

        grad = gradient()
        self.assertIsInstance(grad, tf.IndexedSlices)
        self.assertAllEqual(grad.indices, [3, 17])  # a repeated id's rows summed: one row
        expected = np.zeros_like(value)
        np.add.at(expected, ids.numpy(), 2 * value[ids.numpy()])
        self.assertAllEqual(tf.convert_to_tensor(grad), expected)

    def test_a_step_that_records_lookups_hands_the_rows_it_read_to_its_push(self):
        # Delay compensation per row: the push of a step carries the rows its lookups read
        # (ids and values, each lookup's distinct ids once: a row two lookups read there
        # twice), once, also from inside a branch
        # (a LossScaleOptimizer pushes inside a `tf.cond`); outside a step nothing is kept.
        table, value = _table()
        table.record_lookups()
        table.sparse_read([1, 2])  # eager, outside a step

        @tf.function
        def step(first, second, finite):
            with tables.step_lookups():
                rows = table.sparse_read(first) + table.sparse_read(second)

                def push():
                    read = table.take_lookups()
                    return read.indices, read.values

                ids, values = tf.cond(finite, push, lambda: (tf.zeros([0], tf.int64),
                                                             tf.zeros([0, WIDTH])))
                again = table.take_lookups()
            return rows, ids, values, tf.size(again.indices)

        _, ids, rows, again = step(tf.constant([[3, 17], [17, 3]]), tf.constant([[17, 29]]),
                                   tf.constant(True))
        self.assertAllEqual(ids, [3, 17, 17, 29])
        self.assertAllEqual(rows, value[[3, 17, 17, 29]])
        self.assertEqual(int(again), 0)

    def test_eager_steps_keep_no_lookups_past_their_end(self):
        # `run_eagerly=True`: an evaluate step's lookups are gone when it ends; a train
        # step's push takes only its own.
        table, value = _table()
        table.record_lookups()
        for _ in range(3):
            with tables.step_lookups():
                table.sparse_read([3, 17])
        with tables.step_lookups():
            table.sparse_read([5])
            read = table.take_lookups()
        self.assertAllEqual(read.indices, [5])
        self.assertAllEqual(read.values, value[[5]])

    def test_a_keras_embedding_trains_through_row_lookups(self):
        with tf.variable_creator_scope(_table_creator(((0, 12), (12, ROWS)))):
            layer = keras.layers.Embedding(ROWS, WIDTH)
            layer.build((None, 2))
        self.assertIsInstance(layer.embeddings.value, tables.TableVariable)
        before = layer.embeddings.numpy()
        ids = np.array([[1, 20], [20, 29]])

        @tf.function
        def step():
            with replica_step(), tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids))
            grad = tape.gradient(loss, layer.trainable_variables)[0]
            tables.check_step_reads([layer.embeddings.value])
            return layer(ids), grad

        rows, grad = step()
        self.assertAllEqual(rows, before[ids])
        self.assertIsInstance(grad, tf.IndexedSlices)
        self.assertAllEqual(grad.indices, [1, 20, 29])  # id 20's two rows summed: one
        self.assertAllEqual(grad.values, [[1.0] * WIDTH, [2.0] * WIDTH, [1.0] * WIDTH])
        graph = step.get_concrete_function().graph
        self.assertEmpty([op for op in graph.get_operations() if op.type == "GatherV2"
                          and op.inputs[0].shape.as_list() == [ROWS, WIDTH]])

    def test_a_savedmodel_is_refused_with_the_route_that_works(self):
        # `model.export` of a model whose table lives on the ps would otherwise end in TF's
        # "untracked resource" assertion; the route the error gives (a Keras file, loaded
        # without a strategy, exported) serves what the model predicts.
        with tf.variable_creator_scope(_table_creator(((0, 12), (12, ROWS)))):
            embedding = keras.layers.Embedding(ROWS, WIDTH)
            embedding.build((None, 2))
        ids_input = keras.Input((2,), dtype="int32")
        model = keras.Model(ids_input, keras.layers.Dense(1)(
            keras.layers.Flatten()(embedding(ids_input))))
        ids = np.array([[1, 20], [20, 29]], np.int32)
        want = model.predict(ids, verbose=0)
        out = self.get_temp_dir()
        with self.assertRaisesRegex(ValueError, r"(?s)embedding table model\d+/embeddings "
                                                r"\(\[30, 4\]\) lives on the ps.*load_model"):
            model.export(os.path.join(out, "refused"))
        model.save(os.path.join(out, "model.keras"))
        keras.models.load_model(os.path.join(out, "model.keras")).export(
            os.path.join(out, "exported"), verbose=False)
        exported = tf.saved_model.load(os.path.join(out, "exported"))
        self.assertAllClose(exported.serve(ids), want)

    def test_a_whole_read_in_a_step_names_the_table(self):
        table, _ = _table()

        @tf.function
        def step():
            with replica_step():
                total = tf.reduce_sum(table)  # a regularizer would do this
            tables.check_step_reads([table])
            return total

        with self.assertRaisesRegex(ValueError, f"{table._tfdist_path}.*read whole"):
            step()
        with replica_step(), self.assertRaisesRegex(ValueError, "run_eagerly=True"):
            table.read_value()

    def test_reading_the_static_shape_in_a_step_is_not_a_whole_read(self):
        table, _ = _table()

        @tf.function
        def step():
            with replica_step():
                rows = tf.shape(table)[0]
            tables.check_step_reads([table])
            return rows

        self.assertEqual(int(step()), ROWS)

    def test_whole_reads_and_writes_outside_a_step_go_in_chunks(self):
        table, value = _table()
        with mock.patch.object(tables, "CHUNK_BYTES", 5 * WIDTH * 4):
            chunks = list(table._chunks())
            self.assertEqual([(b, e) for _, b, e in chunks],
                             [(0, 5), (5, 10), (10, 12), (12, 17), (17, 22), (22, 27),
                              (27, 30)])
            self.assertAllEqual(table.numpy(), value)
            table.assign(-value)
            self.assertAllEqual(table.read_value(), -value)
        for master, (begin, end) in table.parts:
            self.assertAllEqual(master.read_value(), -value[begin:end])

    def test_a_checkpoint_reads_every_chunk_from_one_snapshot_of_each_part(self):
        # An update lands on the ps between two chunks of the read.
        table, value = _table()
        for device in ("/device:CPU:0", "/device:CPU:1"):  # each "ps task"'s shard
            ShardSnapshot(device, protocol.open_update_lock(device, f"tables-test-{device}"),
                          []).add_tables(
                [m for m, _ in table.parts if m.device.endswith(device[-5:])])
        chunks = table._chunks

        def chunks_with_an_update_after_the_first(parts=None):
            for i, chunk in enumerate(chunks(parts)):
                yield chunk
                if i == 0:
                    for master, _ in table.parts:
                        master.assign_add(tf.ones(master.shape))

        with mock.patch.object(tables, "CHUNK_BYTES", 5 * WIDTH * 4), \
                mock.patch.object(table, "_chunks", chunks_with_an_update_after_the_first):
            with consistent_reads():
                self.assertAllEqual(table.numpy(), value)
                # Each part's copy stays on its ps task: only chunks cross.
                for master, _ in table.parts:
                    copy = variables.consistent_value(master)
                    self.assertEqual(copy.device[-5:], master.device[-5:])
            # Outside, each chunk is read as it is then: the first before the update.
            torn = table.numpy()
        self.assertAllEqual(torn[:5], value[:5] + 1)
        self.assertAllEqual(torn[5:], value[5:] + 2)

    def test_a_tf_train_checkpoint_saves_and_restores_every_part(self):
        table, value = _table()
        path = tf.train.Checkpoint(table=table).write(
            os.path.join(self.get_temp_dir(), "ckpt"))
        table.assign(np.zeros_like(value))
        tf.train.Checkpoint(table=table).read(path).assert_consumed()
        self.assertAllEqual(table.numpy(), value)
        # A plain variable restores from it too (a table's checkpoint is a variable's).
        plain = tf.Variable(tf.zeros([ROWS, WIDTH]))
        tf.train.Checkpoint(table=plain).read(path).assert_consumed()
        self.assertAllEqual(plain.numpy(), value)

    def test_a_checkpoint_restores_into_another_split(self):
        # A table saved split restores whole and the other way round (another
        # `variable_partitioner` or number of ps tasks, or a table grown past 256 KiB).
        for saved, restored in ((((0, 12), (12, ROWS)), ((0, ROWS),)),
                                (((0, ROWS),), ((0, 10), (10, 20), (20, ROWS)))):
            table, value = _table(saved)
            path = tf.train.Checkpoint(table=table).write(
                os.path.join(self.get_temp_dir(), f"ckpt{len(saved)}"))
            other, _ = _table(restored, value=np.zeros_like(value))
            tf.train.Checkpoint(table=other).read(path).assert_consumed()
            self.assertAllEqual(other.numpy(), value)

    def test_a_follower_ignores_writes_and_in_step_writes_are_refused(self):
        table, value = _table()
        table.follow()
        table.assign(np.zeros_like(value))
        self.assertAllEqual(table.numpy(), value)
        with self.assertRaisesRegex(ValueError, "updated there by the optimizer"):
            table.assign_add(value)

    def test_a_value_written_before_the_run_is_the_chief_s_until_a_new_run_takes_it(self):
        table, value = _table()
        again = tables.TableVariable.create(table._tfdist_path, [ROWS, WIDTH], tf.float32,
                                            _parts(((0, 12), (12, ROWS))),
                                            initial_value=lambda: tf.zeros([ROWS, WIDTH]))
        again.assign(-value)  # `load_weights` before the run: kept on the chief
        self.assertAllEqual(again.numpy(), -value)
        for master, (begin, end) in table.parts:  # the ps tasks' table is untouched
            self.assertAllEqual(master.read_value(), value[begin:end])
        # A run in progress keeps its table; a new run takes the chief's value.
        self.assertEqual(again.initialize(force=True), 2)
        again.joined(initialized=True)
        self.assertAllEqual(table.numpy(), -value)

    def test_a_whole_read_or_write_refuses_parts_a_later_run_took(self):
        # Issue 22: a worker back after its run finished takes the run's final weights, its
        # tables read from the ps tasks when it saves; a later run of the same model (this
        # job started again, another job) rewrites the parts in between. Its save must not
        # hold the later run's table as if it were its own run's, nor write over it.
        table, value = _table()
        runs = {id(master): f"run-a{shard}" for shard, (master, _) in enumerate(table.parts)}
        table.claim(runs)
        table.joined(initialized=True, runs=runs)
        self.assertAllEqual(table.numpy(), value)

        def later_run():
            later = tables.TableVariable.create(table._tfdist_path, [ROWS, WIDTH], tf.float32,
                                                _parts(((0, 12), (12, ROWS))),
                                                initial_value=lambda: tf.zeros([ROWS, WIDTH]))
            later_runs = {id(master): f"run-b{shard}"
                          for shard, (master, _) in enumerate(later.parts)}
            later.claim(later_runs)  # its chief: the owners first, then the rows
            later.initialize(force=True)
            later.joined(initialized=True, runs=later_runs)
            return later

        # The later run starts while the read is under way (after its first chunk): the
        # chunks read before are the finished run's, those after the later run's.
        chunks, started = table._chunks, []

        def overlapped(parts=None):
            for chunk in chunks(parts):
                yield chunk
                if not started:
                    started.append(later_run())

        refused = (r"embedding table test\d+/embeddings: its rows 0:12 on \S+CPU:0 belong to "
                   r"run run-b0 now, not to run run-a0 this worker is in.*ModelCheckpoint")
        with mock.patch.object(table, "_chunks", overlapped):
            with self.assertRaisesRegex(tables.RunError, refused):
                table.numpy()
        self.assertAllEqual(started[0].numpy(), np.zeros([ROWS, WIDTH]))
        for read in (table.numpy, lambda: table.assign(value),
                     lambda: tf.train.Checkpoint(table=table).write(
                         os.path.join(self.get_temp_dir(), "ckpt"))):
            with self.assertRaisesRegex(tables.RunError, refused):
                read()
        self.assertAllEqual(started[0].numpy(), np.zeros([ROWS, WIDTH]))

    def test_initialize_writes_only_parts_that_hold_nothing(self):
        table, value = _table()
        path = table._tfdist_path
        again = tables.TableVariable.create(path, [ROWS, WIDTH], tf.float32,
                                            _parts(((0, 12), (12, ROWS))),
                                            initial_value=lambda: tf.zeros([ROWS, WIDTH]))
        self.assertTrue(again.is_initialized())
        self.assertEqual(again.initialize(), 0)
        self.assertAllEqual(again.numpy(), value)

    def test_a_new_run_computes_and_writes_the_initial_value_once(self):
        # The chief's first step writes the tables' initial values (`ready()`, before its
        # lookups), then starts a new run, which writes every part (`initialize(force=True)`:
        # an earlier run may have left other values there). The parts it wrote since it last
        # joined a run are not computed and written again: on a ps task each pass holds the
        # initializer's value, and its temporaries, beside the table.
        calls = []

        def initial():
            calls.append(None)
            return tf.fill([ROWS, WIDTH], float(len(calls)))

        table = tables.TableVariable.create(f"test{next(_names)}/embeddings", [ROWS, WIDTH],
                                            tf.float32, _parts(((0, 12), (12, ROWS))),
                                            initial_value=initial)
        self.assertEqual(table.initialize(), 2)
        self.assertEqual(table.initialize(force=True), 0)
        self.assertLen(calls, 1)
        # A value the chief writes before the run becomes the new run's all the same.
        table.assign(np.full([ROWS, WIDTH], 7.0, np.float32))
        self.assertEqual(table.initialize(force=True), 2)
        self.assertAllEqual(np.concatenate([m.numpy() for m, _ in table.parts]),
                            np.full([ROWS, WIDTH], 7.0))
        # Once it joined a run, the next new run writes every part again.
        table.joined(initialized=True)
        self.assertEqual(table.initialize(force=True), 2)
        self.assertLen(calls, 2)
        self.assertAllEqual(table.numpy(), np.full([ROWS, WIDTH], 2.0))
        # A table of one part takes the initial value as it is (no copy written in chunks).
        whole = tables.TableVariable.create(f"test{next(_names)}/embeddings", [ROWS, WIDTH],
                                            tf.float32, _parts(((0, ROWS),)),
                                            initial_value=initial)
        self.assertEqual(whole.initialize(), 1)
        self.assertAllEqual(whole.numpy(), np.full([ROWS, WIDTH], 3.0))

    def _split_variable(self, initializer, splits=((0, 15), (15, ROWS))):
        """The parts of a Keras variable of `initializer` made as a table of `splits`."""
        with tf.variable_creator_scope(_table_creator(splits)):
            variable = keras.Variable(initializer=initializer, shape=(ROWS, WIDTH))
        return [m.numpy() for m, _ in variable.value.parts]

    def test_a_split_table_s_parts_are_made_on_their_own_ps_task(self):
        # A Keras initializer that draws each element alone makes each part's rows on the
        # part's device, a chunk at a time: no ps task holds the whole table's value.
        created = []
        real_write = tables.TableVariable._write_parts

        devices = {}

        def write_parts(table, value, parts):
            created.append(callable(value))
            if callable(value):
                def make(begin, end, make=value):
                    rows = make(begin, end)
                    devices[begin] = rows.device[-5:]
                    return rows
                return real_write(table, make, parts)
            return real_write(table, value, parts)

        uniform = keras.initializers.RandomUniform(-0.1, 0.1, seed=7)
        with mock.patch.object(tables.TableVariable, "_write_parts", write_parts), \
                mock.patch.object(tables, "CHUNK_BYTES", 5 * WIDTH * 4), \
                mock.patch.object(table_init, "BLOCK_ROWS", 8):
            values = np.concatenate(self._split_variable(uniform))
            # A seed gives one table, whatever the split and the chunks.
            other_split = np.concatenate(self._split_variable(uniform, ((0, 9), (9, ROWS))))
            constant = self._split_variable(keras.initializers.Constant(0.1))
            glorot = np.concatenate(self._split_variable(keras.initializers.GlorotUniform(3)))
            other_seed = np.concatenate(self._split_variable(
                keras.initializers.RandomUniform(-0.1, 0.1, seed=8)))
        self.assertEqual(created, [True] * 5)
        # Each chunk made on the device of its part (rows 0-14 on CPU:0, 15-29 on CPU:1).
        self.assertEqual({b: devices[b] for b in (0, 5, 10, 15, 20, 25)},
                         {0: "CPU:0", 5: "CPU:0", 10: "CPU:0",
                          15: "CPU:1", 20: "CPU:1", 25: "CPU:1"})
        # The same distribution, not the same numbers as one draw; no row repeated.
        self.assertAllInRange(values, -0.1, 0.1)
        self.assertLen(np.unique(values, axis=0), ROWS)
        self.assertAllEqual(other_split, values)
        self.assertFalse(np.isin(other_seed, values).any())
        # A constant is exact; variance scaling takes the whole table's fans, not a part's.
        self.assertAllEqual(np.concatenate(constant), np.full([ROWS, WIDTH], 0.1, np.float32))
        limit = np.sqrt(6.0 / (ROWS + WIDTH))
        self.assertAllInRange(glorot, -limit, limit)
        self.assertGreater(np.abs(glorot).max(), 0.8 * limit)

    def test_a_split_table_of_another_initializer_is_made_whole_as_keras_makes_it(self):
        class Shifted(keras.initializers.RandomNormal):
            def __call__(self, shape, dtype=None):
                return super().__call__(shape, dtype) + 100.0

        matrix = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH)
        for initializer, splits in (
                (keras.initializers.Orthogonal(seed=5), ((0, 15), (15, ROWS))),
                (Shifted(seed=2), ((0, 15), (15, ROWS))),     # its own values, as Keras's
                (keras.initializers.Constant(matrix), ((0, 15), (15, ROWS))),
                (keras.initializers.RandomUniform(seed=11), ((0, ROWS),))):  # one part
            parts = self._split_variable(initializer, splits)
            self.assertAllClose(np.concatenate(parts), initializer((ROWS, WIDTH)))
        self.assertIsNone(table_init.rows_initializer(
            keras.initializers.RandomUniform(0, 10, seed=1), [ROWS, WIDTH], tf.int32))

    def test_join_s_snapshot_of_the_mirrors_copies_no_table(self):
        # `join()` reads the masters of the mirrors only: its snapshot of a shard leaves the
        # shard's table parts out (a copy of each is its size again on its ps task). A
        # checkpoint's takes them, between the same two updates as the rest.
        table, value = _table(splits=((0, ROWS),))
        master, _ = table.parts[0]
        dense = tf.Variable([1.0, 2.0])
        ShardSnapshot("/device:CPU:0", protocol.open_update_lock("/device:CPU:0",
                                                                 f"join-test-{next(_names)}"),
                      [dense]).add_tables([master])
        for tables_too, want in ((True, value), (False, value + 2)):
            with consistent_reads(tables=tables_too):
                self.assertAllEqual(variables.consistent_value(dense), [1.0, 2.0])
                master.assign_add(tf.ones(master.shape))  # an update after the snapshot
                self.assertAllEqual(variables.consistent_value(master), want)

    def test_parts_must_cover_the_rows(self):
        with self.assertRaisesRegex(ValueError, "must cover its 30 rows"):
            tables.TableVariable.create("t/embeddings", [ROWS, WIDTH], tf.float32,
                                        _parts(((0, 12), (13, ROWS))))


class TableRuleTest(tf.test.TestCase):

    def test_a_pattern_that_matches_no_variable_is_an_error_naming_it(self):
        rule = table_set.TableRule(["*/user_table/embeddings", "*/item_tabel/*"])
        self.assertTrue(rule.matches("model/user_table/embeddings", None, [100, 8], "float32",
                                     True))
        self.assertFalse(rule.matches("model/item_table/embeddings", None, [100, 8],
                                      "float32", True))
        self.assertFalse(rule.matches("model/dense/kernel", None, [8], "float32", True))
        with self.assertRaisesRegex(ValueError, r"patterns \['\*/item_tabel/\*'\] match no "
                                                r"variable.*'model/item_table/embeddings'"):
            rule.check_patterns()
        table_set.TableRule("auto").check_patterns()
        table_set.TableRule(None).check_patterns()

    def test_the_paths_kept_for_the_error_stay_bounded_over_many_models(self):
        # A scope that builds many models (a search loop) does not grow the rule's memory;
        # the error lists the first paths, then "...".
        rule = table_set.TableRule(["*/missing/*"])
        for model in range(1000):
            for layer in range(3):
                rule.matches(f"model_{model}/dense_{layer}/kernel", None, [4, 4], "float32",
                             True)
        self.assertLen(rule._candidates, table_set._SHOWN + 1)
        with self.assertRaisesRegex(ValueError, r"'model_3/dense_0/kernel', '\.\.\.'\]"):
            rule.check_patterns()


if __name__ == "__main__":
    tf.test.main()
