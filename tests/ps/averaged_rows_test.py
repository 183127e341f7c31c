"""Tables averaged by rows under model averaging, on a worker: which rows changed since the
last round (set from the gradient's rows), what a round pushes and takes of them, and which
optimizers leave a row without gradient as it is. (The ps side's per-row average is in
tests/ps/updater_test.py; a cluster run in tests/strategies/model_averaging_test.py.)"""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfdist.ps import averaged_rows as averaged_rows_lib
from tfdist.ps.averaged_rows import ChangedRows
from tfdist.ps.averaged_rows import averaged_rows
from tfdist.ps.averaged_rows import rows_exact
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import Part
from tfdist.ps.variables import replica_step

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


class ChangedRowsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
        self.table._tfdist_path = "e/embeddings"
        self.slot = tf.Variable(np.full([6, 2], 0.5, np.float32))
        self.rows = ChangedRows(DEVICE)
        self.rows.add(self.table)
        self.rows.add(self.slot, self.table)  # an averaged slot: the table's rows

    def test_a_round_pushes_the_rows_the_gradients_touched_then_forgets_them(self):
        @tf.function
        def step(ids):
            gradient = tf.IndexedSlices(tf.ones([tf.size(ids), 2]), ids, [6, 2])
            self.rows.track(self.table, gradient)

        step(tf.constant([4, 1, 4], tf.int64))
        step(tf.constant([1], tf.int64))
        self.assertEqual(int(self.rows.count()), 4)  # rows 1 and 4, of the table and slot
        ids, values = self.rows.pushed(Part(self.table))
        self.assertAllEqual(ids, [1, 4])
        self.assertAllEqual(values, [2.0, 3.0, 8.0, 9.0])
        ids, values = self.rows.pushed(Part(self.slot))
        self.assertAllEqual(ids, [1, 4])
        self.assertAllEqual(values, [0.5] * 4)
        # A part of a table split by rows pushes its own rows, numbered from its first.
        ids, values = self.rows.pushed(Part(self.table, (3, 6)))
        self.assertAllEqual(ids, [1])
        self.assertAllEqual(values, [8.0, 9.0])
        self.rows.reset()
        self.assertEqual(int(self.rows.count()), 0)
        self.assertAllEqual(self.rows.pushed(Part(self.table))[0], [])

    def test_a_dense_gradient_marks_its_nonzero_rows(self):
        gradient = np.zeros([6, 2], np.float32)
        gradient[[0, 5], 1] = [1.0, -2.0]
        self.rows.track(self.table, tf.constant(gradient))
        self.assertAllEqual(self.rows.pushed(Part(self.table))[0], [0, 5])

    def test_a_reply_s_rows_are_written_into_the_part_they_belong_to(self):
        self.rows.take(Part(self.table, (3, 6)), tf.constant([0, 2], tf.int64),
                       tf.constant([-1.0, -2.0, -3.0, -4.0]))
        want = np.arange(12, dtype=np.float32).reshape(6, 2)
        want[[3, 5]] = [[-1.0, -2.0], [-3.0, -4.0]]
        self.assertAllEqual(self.table, want)

    def test_copying_the_masters_reads_each_part_in_chunks_and_forgets_the_marks(self):
        # A joining (or leaving) worker's copy of a split table, 2 rows a chunk here.
        mirror = MirrorVariable.create("t/embeddings", "rows", initial_value=tf.zeros([5, 2]))
        parts = [tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2)),
                 tf.Variable(-np.arange(4, dtype=np.float32).reshape(2, 2))]
        mirror.bind(parts[0], (0, 3))
        mirror.bind(parts[1], (3, 5))
        rows = ChangedRows(DEVICE)
        rows.add(mirror)
        rows.track(mirror, tf.IndexedSlices(tf.ones([1, 2]), tf.constant([4]), [5, 2]))
        reads = []
        gather = tf.raw_ops.ResourceGather

        def counted(**kwargs):
            reads.append(kwargs["indices"].numpy().tolist())
            return gather(**kwargs)

        with mock.patch.object(averaged_rows_lib, "CHUNK_BYTES", 2 * 2 * 4), \
                mock.patch.object(tf.raw_ops, "ResourceGather", counted), replica_step():
            rows.copy_masters()
        self.assertEqual(reads, [[0, 1], [2], [0, 1]])
        with replica_step():  # the worker's own copy (outside a step it stands for the master)
            self.assertAllEqual(mirror.read_value(), np.concatenate([parts[0].numpy(),
                                                                     parts[1].numpy()]))
        self.assertEqual(int(rows.count()), 0)

    def test_a_variable_not_averaged_by_rows_is_not_tracked(self):
        self.assertIsNone(self.rows.track(tf.Variable([1.0]), tf.constant([1.0])))


class AveragedRowsTest(tf.test.TestCase):

    def test_each_row_averages_its_pushes_and_the_master_for_the_others(self):
        master = tf.Variable([[1.0, 1.0], [2.0, 2.0], [4.0, 0.0]])
        rows, mean = averaged_rows(tf.constant([2, 0, 2], tf.int64),
                                   tf.constant([6.0, 3.0, 1.0, 1.0, 2.0, 3.0]), master, 3)
        self.assertAllEqual(rows, [2, 0])
        self.assertAllClose(tf.reshape(mean, [2, 2]),
                            [[(6.0 + 2.0 + 4.0) / 3, (3.0 + 3.0 + 0.0) / 3],
                             [(1.0 + 1.0 + 1.0) / 3, (1.0 + 1.0 + 1.0) / 3]])


class RowsExactTest(tf.test.TestCase, parameterized.TestCase):
    """`rows_exact` says which local optimizers leave a row without gradient as it is: checked
    here on Keras's own update of a sparse gradient."""

    @parameterized.parameters(
        (keras.optimizers.SGD(0.1), False, None),
        (keras.optimizers.Adagrad(0.1), True, None),
        (keras.optimizers.RMSprop(0.1), False, None),
        (keras.optimizers.Adadelta(0.1), False, None),
        (keras.optimizers.RMSprop(0.1), True, "slots decay on every row"),
        (keras.optimizers.SGD(0.1, momentum=0.9), False, "momentum=0.9 moves every row"),
        (keras.optimizers.Adam(0.1), False, "not one of"),
        (keras.optimizers.SGD(0.1, weight_decay=0.1), False, "weight decay moves every row"))
    def test_keras_moves_an_untouched_row_exactly_when_rows_exact_says_so(
            self, optimizer, averaged, why):
        table = keras.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
        optimizer.build([table])
        self.assertRegex(str(rows_exact(optimizer, table, averaged)), why or "None")

        def step(ids):
            optimizer.apply([tf.IndexedSlices(tf.ones([len(ids), 2]), tf.constant(ids),
                                              [6, 2])], [table])
            slots = [v for v in optimizer.variables if v.shape == table.shape]
            return [table.numpy()] + ([v.numpy() for v in slots] if averaged else [])

        before = step([1, 3])  # row 1 touched once: momentum would move it again
        after = step([3])
        untouched = [0, 1, 2, 4, 5]
        moved = any(np.any(a[untouched] != b[untouched]) for a, b in zip(before, after))
        self.assertEqual(moved, why is not None)

    def test_a_moving_average_of_the_weights_is_not_averaged_by_rows(self):
        # Keras writes the average into every row (`finalize_variable_values` at the end of
        # `fit`, and every `ema_overwrite_frequency` steps).
        table = keras.Variable(np.zeros([6, 2], np.float32))
        self.assertRegex(rows_exact(keras.optimizers.SGD(0.1, use_ema=True), table, False),
                         "use_ema=True keeps a moving average")

    def test_a_constraint_on_the_table_moves_every_row(self):
        table = keras.layers.Embedding(6, 2, embeddings_constraint="max_norm")
        table.build()
        table = table.embeddings
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([table])
        self.assertRegex(rows_exact(optimizer, table, False), "constraint is applied to every")


if __name__ == "__main__":
    tf.test.main()
