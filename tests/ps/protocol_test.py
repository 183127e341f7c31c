"""The worker/ps message format: int64s travel exactly as the float32 words of their bits; a sparse
gradient's rows land in place on the ps."""

import numpy as np
import tensorflow as tf

import tfdist
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.variables import Part


class PackTest(tf.test.TestCase):

    def test_ints_travel_exactly_in_a_float_pack(self):
        # Tags past 2^31, the int64 extremes, and bit patterns that are NaNs as float32 words.
        ints = np.array([0, -1, 2 ** 31 + 5, 2 ** 62, -2 ** 63, 2 ** 63 - 1,
                         0x7FC00001FFC00001, 0x7F8000017F800001], np.int64)

        @tf.function
        def round_trip(ints, values):
            packed = tf.concat([wire.ints_as_floats(ints), values], axis=0)
            head, rest = tf.split(packed, [2 * len(ints), -1])
            return wire.floats_as_ints(head), rest

        for values in (tf.zeros([0]), tf.constant([1.5, -2.0, np.nan])):
            got, rest = round_trip(tf.constant(ints), values)
            self.assertAllEqual(got, ints)
            self.assertAllEqual(tf.bitcast(rest, tf.int32), tf.bitcast(values, tf.int32))


class SparseRowsTest(tf.test.TestCase):

    def test_rows_are_added_in_place_and_repeated_rows_sum(self):
        entries = [{"path": "a", "shape": [2, 3], "dtype": "float32", "role": "gradient"},
                   {"path": "e", "shape": [4, 2], "dtype": "float32", "role": "gradient",
                    "sparse": True},
                   {"path": "b", "shape": [3], "dtype": "float32", "role": "gradient"}]
        layout = protocol.ShardLayout(entries)
        self.assertEqual(layout.sparse, [(6, 2)])
        gradient = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [10.0, 20.0]]),
                                    tf.constant([3, 0, 3]), dense_shape=[4, 2])
        rows = wire.sparse_rows(gradient, entries[1])
        got = layout.densify(tf.range(9, dtype=tf.float32), [rows])
        want = np.concatenate([np.arange(6), [3, 4, 0, 0, 0, 0, 11, 22], [6, 7, 8]])
        self.assertAllEqual(got, want)
        # The part of a split table (rows 2 to 4) takes its own slices, renumbered.
        variable = tf.Variable(tf.zeros([4, 2]))
        part = Part(variable, (2, 4)).take(gradient)
        self.assertAllEqual(part.indices, [1, 1])
        self.assertAllEqual(part.values, [[1.0, 2.0], [10.0, 20.0]])


class CompressedPushTest(tf.test.TestCase):

    def _layout(self):
        return protocol.ShardLayout([
            {"path": "model/big/kernel", "shape": [64, 32], "dtype": "float32",
             "role": "gradient"},
            {"path": "model/small/kernel", "shape": [16, 8], "dtype": "float32",
             "role": "gradient"},
            {"path": "model/big/bias", "shape": [32], "dtype": "float32", "role": "gradient"}])

    def test_each_variable_gets_its_own_scale_and_small_ones_go_raw(self):
        # A layer whose gradient is 1000x smaller than the other's keeps its direction: the
        # quantiser codes it with its own norm. The bias, under min_size, travels exactly.
        layout = self._layout()
        qsgd = tfdist.compression.get("qsgd", min_size=64)
        self.assertEqual(wire.push_units(layout, qsgd), ([[0], [1]], [2]))
        self.assertEqual(wire.compressed_push_dtypes(layout, qsgd),
                         [tf.int8, tf.float32, tf.int8, tf.float32, tf.float32])
        big, small, bias = (tf.random.stateless_normal(s, seed=[i, 1]) * scale
                            for i, (s, scale) in enumerate([([2048], 1.0), ([128], 1e-3),
                                                            ([32], 1.0)]))
        main = tf.concat([big, small, bias], 0)
        key = tf.constant([5, 1], tf.int64)
        states = [qsgd.initial_state([2048], tf.float32), qsgd.initial_state([128], tf.float32)]
        payload, _ = wire.encode_push(layout, qsgd, main, states, key)
        decoded = wire.decode_push(layout, qsgd, payload, key)
        got_small = decoded[2048:2176]
        cosine = float(tf.reduce_sum(got_small * small)
                       / (tf.norm(got_small) * tf.norm(small)))
        self.assertGreater(cosine, 0.9)
        self.assertAllEqual(decoded[2176:], bias)
        # A top-k ranks over the whole shard: one unit.
        topk = tfdist.compression.get("topk")
        self.assertEqual(wire.push_units(layout, topk), ([[0, 1, 2]], []))


if __name__ == "__main__":
    tf.test.main()
