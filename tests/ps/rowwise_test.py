"""Row-wise updates of embedding tables against Keras's own dense updates (one process)."""

import functools

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfdist.ps import rowwise

ROWS, WIDTH = 40, 3


def _table(name="embeddings"):
    rng = np.random.default_rng(0)
    return keras.Variable(rng.normal(size=[ROWS, WIDTH]).astype("float32"), name=name)


def _gradient(seed, ids=(3, 7, 7, 11, 39, 0)):
    rng = np.random.default_rng(seed)
    ids = np.array(ids, np.int64)
    return ids, rng.normal(size=[len(ids), WIDTH]).astype("float32")


def _dense(ids, values):
    dense = np.zeros([ROWS, WIDTH], np.float32)
    np.add.at(dense, ids, values)
    return dense


def _slots(optimizer, table):
    prefix = table.path.replace("/", "_") + "_"
    return {v.path: v.numpy() for v in optimizer.variables
            if v.path.rpartition("/")[2].startswith(prefix)}


class RowwiseUpdateTest(tf.test.TestCase, parameterized.TestCase):

    def _pair(self, make_optimizer, chunk_rows=None):
        """A table updated row-wise and its twin updated densely by Keras."""
        lazy, dense = _table(), _table()
        lazy_opt, dense_opt = make_optimizer(), make_optimizer()
        lazy_opt.build([lazy])
        dense_opt.build([dense])
        update = rowwise.RowwiseUpdate(lazy_opt, [lazy], chunk_rows=chunk_rows)
        return lazy, dense, lazy_opt, dense_opt, update

    @parameterized.named_parameters(
        ("sgd", lambda: keras.optimizers.SGD(0.1)),
        ("adagrad", lambda: keras.optimizers.Adagrad(0.1)),
    )
    def test_sgd_and_adagrad_rows_bit_equal_a_dense_update(self, make_optimizer):
        lazy, dense, lazy_opt, dense_opt, update = self._pair(make_optimizer, chunk_rows=4)
        step = tf.function(lambda i, v: update.apply(lazy, i, v))
        # Both traced: TF rewrites a traced function's arithmetic (x / sqrt(y) as
        # x * rsqrt(y)), which changes the last bit against eager ops.
        dense_step = tf.function(lambda g: dense_opt.apply([g], [dense]))
        for seed in range(3):
            ids, values = _gradient(seed)
            step(ids, values)
            lazy_opt.iterations.assign_add(1)
            dense_step(tf.constant(_dense(ids, values)))
        self.assertAllEqual(lazy.numpy(), dense.numpy())
        self.assertAllEqual(list(_slots(lazy_opt, lazy).values()),
                            list(_slots(dense_opt, dense).values()))

    def test_lazy_adam_updates_touched_rows_only_and_keeps_untouched_slots(self):
        lazy, dense, lazy_opt, dense_opt, update = self._pair(
            lambda: keras.optimizers.Adam(0.05), chunk_rows=5)
        step = tf.function(lambda i, v: update.apply(lazy, i, v))
        before = lazy.numpy()
        ids, values = _gradient(0)
        step(ids, values)
        lazy_opt.iterations.assign_add(1)
        touched = sorted(set(ids.tolist()))
        untouched = [r for r in range(ROWS) if r not in touched]
        # Touched rows: Adam's first step on those rows, as Keras computes it densely.
        dense_opt.apply([tf.constant(_dense(ids, values))], [dense])
        self.assertAllClose(lazy.numpy()[touched], dense.numpy()[touched], rtol=1e-6)
        self.assertAllEqual(lazy.numpy()[untouched], before[untouched])
        # A second step touching other rows: the first rows' moments do not decay.
        m_before = {k: v.copy() for k, v in _slots(lazy_opt, lazy).items()}
        step(*_gradient(1, ids=(20, 21)))
        for value_before, value_after in zip(m_before.values(),
                                             _slots(lazy_opt, lazy).values()):
            self.assertAllEqual(value_after[touched], value_before[touched])
        # Its bias correction used the shared step counter (2nd step), by the lazy rule.
        m = (1 - 0.9) * _gradient(1, ids=(20, 21))[1]
        v = (1 - 0.999) * _gradient(1, ids=(20, 21))[1] ** 2
        lr = 0.05 * np.sqrt(1 - 0.999 ** 2) / (1 - 0.9 ** 2)
        expected = before[[20, 21]] - lr * m / (np.sqrt(v) + 1e-7)
        self.assertAllClose(lazy.numpy()[[20, 21]], expected, rtol=1e-5)

    def test_chunks_give_the_same_update_as_one_chunk(self):
        one = self._pair(lambda: keras.optimizers.SGD(0.1, momentum=0.9), chunk_rows=ROWS)
        many = self._pair(lambda: keras.optimizers.SGD(0.1, momentum=0.9), chunk_rows=2)
        for table, _, _, _, update in (one, many):
            step = tf.function(functools.partial(update.apply, table))
            for seed in range(2):
                step(*_gradient(seed))
        self.assertAllEqual(one[0].numpy(), many[0].numpy())

    def test_learning_rate_factor_scales_the_step(self):
        lazy, _, _, _, update = self._pair(lambda: keras.optimizers.SGD(0.1))
        before = lazy.numpy()
        ids, values = _gradient(0, ids=(5,))
        tf.function(lambda i, v: update.apply(lazy, i, v, learning_rate_factor=0.5))(ids, values)
        self.assertAllClose(lazy.numpy()[5], before[5] - 0.05 * values[0])

    def test_adamw_decays_touched_rows_only(self):
        lazy, _, _, _, update = self._pair(
            lambda: keras.optimizers.AdamW(0.1, weight_decay=0.5))
        before = lazy.numpy()
        ids, values = _gradient(0, ids=(2,))
        tf.function(lambda i, v: update.apply(lazy, i, v))(ids, np.zeros_like(values))
        self.assertAllClose(lazy.numpy()[2], before[2] * (1 - 0.5 * 0.1), rtol=1e-6)
        self.assertAllEqual(lazy.numpy()[3], before[3])

    def test_a_schedule_reads_the_shared_step_counter(self):
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
        lazy, _, lazy_opt, _, update = self._pair(lambda: keras.optimizers.SGD(schedule))
        lazy_opt.iterations.assign(2)  # learning rate 0.1 * 0.5 ** 2
        before = lazy.numpy()
        ids, values = _gradient(0, ids=(1,))
        tf.function(lambda i, v: update.apply(lazy, i, v))(ids, values)
        self.assertAllClose(lazy.numpy()[1], before[1] - 0.025 * values[0], rtol=1e-6)

    def test_an_id_past_the_table_is_an_error(self):
        lazy, _, _, _, update = self._pair(lambda: keras.optimizers.SGD(0.1))
        ids, values = _gradient(0, ids=(ROWS,))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "past the last row"):
            tf.function(lambda i, v: update.apply(lazy, i, v))(ids, values)

    def test_an_optimizer_that_is_not_row_local_is_refused(self):
        table = _table()
        optimizer = keras.optimizers.Nadam()
        optimizer.build([table])
        with self.assertRaisesRegex(ValueError, "Received: Nadam.*embedding_updates='dense'"):
            rowwise.RowwiseUpdate(optimizer, [table])


if __name__ == "__main__":
    tf.test.main()
