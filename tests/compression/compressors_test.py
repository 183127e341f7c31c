"""Tests of the compressors: shapes, payload sizes, error feedback, registry round trips."""

import dataclasses
import re
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tfdist.compression import quantize
from tfdist.compression.base import Capabilities
from tfdist.compression.base import Communicator
from tfdist.compression.base import Compressor
from tfdist.ps.push_codec import push_compressor

ALL = [(name,) for name in ["none", "fp16", "bf16", "topk", "randomk", "threshold", "onebit",
                            "signsgd", "signsgd_mv", "terngrad", "qsgd", "powersgd", "dgc"]]
GENERIC_MEMORY = [(name,) for name in ["fp16", "bf16", "topk", "randomk", "threshold",
                                       "onebit", "signsgd", "terngrad", "qsgd", "powersgd"]]


def nbytes(payload):
    return sum(int(tf.size(t)) * t.dtype.size for t in payload)


class LocalCommunicator(Communicator):
    """`num_replicas` replicas on this process's CPU: sums and gathers in memory."""

    def __init__(self, num_replicas):
        self.devices = ("/cpu:0",) * num_replicas
        self.num_replicas = num_replicas

    def all_reduce(self, tensors):
        sums = [tf.add_n(list(column)) for column in zip(*tensors)]
        return [list(sums) for _ in tensors]

    def all_gather(self, tensors, sizes_vary=False):
        del sizes_vary  # (the parts stay apart in memory)
        return [[list(part) for part in tensors] for _ in tensors]


class CompressorTest(tf.test.TestCase, parameterized.TestCase):

    def test_registry_has_every_builtin(self):
        self.assertEqual(sorted(n for (n,) in ALL), tfdist.compression.names())

    @parameterized.parameters(ALL)
    def test_config_round_trips(self, name):
        compressor = tfdist.compression.get(name)
        config = tfdist.compression.serialize(compressor)
        again = tfdist.compression.get(config)
        self.assertEqual(type(again), type(compressor))
        self.assertEqual(again.get_config(), compressor.get_config())

    @parameterized.parameters(ALL)
    def test_shape_and_dtype_preserved(self, name):
        compressor = tfdist.compression.get(name)
        for dtype in (tf.float32, tf.float16):
            x = tf.cast(tf.random.stateless_normal([12, 9, 5], seed=[1, 2]), dtype)
            payload, _ = compressor.compress(x)
            y = compressor.decompress(payload, x.shape, x.dtype)
            self.assertEqual(y.shape, x.shape)
            self.assertEqual(y.dtype, x.dtype)

    @parameterized.parameters(ALL)
    def test_non_float_tensors_untouched(self, name):
        compressor = tfdist.compression.get(name)
        x = tf.range(24, dtype=tf.int32)
        payload, state = compressor.compress(x)
        self.assertEqual(state, {})
        self.assertAllEqual(compressor.decompress(payload, x.shape, x.dtype), x)

    @parameterized.parameters(ALL)
    def test_payload_size_is_as_documented(self, name):
        compressor = tfdist.compression.get(name)
        x = tf.random.stateless_normal([300, 40], seed=[3, 4])
        payload, _ = compressor.compress(x)
        documented = compressor.payload_bytes(x.shape, x.dtype)
        if compressor.capabilities.variable_size:
            self.assertLessEqual(nbytes(payload), documented)
        else:
            self.assertEqual(nbytes(payload), documented)
        self.assertEqual(tuple(t.dtype for t in payload), compressor.payload_dtypes(x.dtype))

    def test_documented_ratios(self):
        shape, dtype = [1000, 1000], tf.float32
        dense = 4 * 1000 * 1000

        def ratio(name, **kwargs):
            return dense / tfdist.compression.get(name, **kwargs).payload_bytes(shape, dtype)

        self.assertEqual(ratio("fp16"), 2.0)
        self.assertGreaterEqual(ratio("topk", ratio=0.01), 50)
        self.assertGreaterEqual(ratio("onebit"), 30)
        self.assertGreaterEqual(ratio("dgc"), 270)
        self.assertGreaterEqual(ratio("terngrad"), 15)

    @parameterized.parameters(ALL)
    def test_a_float16_gradients_payload_travels_in_float16(self, name):
        # The exchange codes a float16 gradient's float32 copy (state stays float32): the
        # payload's values go back to float16, as `payload_dtypes` and `payload_bytes` say,
        # and error feedback keeps their rounding.
        compressor = tfdist.compression.get(name)
        x = tf.cast(tf.cast(tf.random.stateless_normal([300, 40], seed=[3, 4]), tf.float16),
                    tf.float32)
        key = tf.constant([3, 0], tf.int64)
        state = compressor.initial_state(x.shape, x.dtype)
        if "residual" in state:  # (a float32 residual: what is sent is not float16 already)
            state["residual"] = 1e-3 * tf.random.stateless_normal(x.shape, seed=[7, 8])
        payload, new_state = compressor.compress(x, state, key, dtype=tf.float16)
        self.assertEqual(tuple(t.dtype for t in payload),
                         compressor.payload_dtypes(tf.float16, x.shape))
        documented = compressor.payload_bytes(x.shape, tf.float16)
        if compressor.capabilities.variable_size:
            self.assertLessEqual(nbytes(payload), documented)
        elif name != "fp16":  # (fp16 does not compress what is float16 already)
            self.assertEqual(nbytes(payload), documented)
        for state_name, value in new_state.items():
            self.assertEqual(value.dtype, state[state_name].dtype, state_name)
        if "residual" in new_state:
            sent = compressor.decompress(payload, x.shape, tf.float32, key)
            self.assertAllClose(sent + new_state["residual"], x + state["residual"],
                                atol=1e-6)
            if name in ("topk", "randomk"):  # the rounding of the values sent stays
                self.assertGreater(float(tf.reduce_max(tf.abs(new_state["residual"]) * tf.cast(
                    sent != 0, tf.float32))), 0)

    @parameterized.parameters(["fp16", "topk", "randomk", "dgc"])
    def test_a_residual_past_float16s_range_is_sent_saturated_and_kept(self, name):
        # A float32 residual may grow past float16's 65504 (an element left out for many
        # steps): the payload carries float16's largest and the memory keeps the excess,
        # instead of sending +inf and keeping -inf (then NaN, for good).
        config = {"error_feedback": True} if name == "fp16" else {"ratio": 0.5}
        if name == "dgc":
            config["momentum"] = 0.0
        compressor = tfdist.compression.get(name, **config)
        key = tf.constant([0, 0], tf.int64)
        x = tf.constant([1.0, -2.0, 3.0, 4.0])
        memory = "accumulation" if name == "dgc" else "residual"
        state = compressor.initial_state(x.shape, x.dtype)
        state[memory] = tf.constant([7e4, -7e4, 7e4, -7e4])
        for _ in range(3):
            payload, new_state = compressor.compress(x, state, key, dtype=tf.float16)
            sent = compressor.decompress(payload, x.shape, tf.float32, key)
            self.assertAllLessEqual(tf.abs(sent), 65504.0)
            self.assertTrue(np.all(np.isfinite(new_state[memory].numpy())), name)
            self.assertAllClose(sent + new_state[memory], x + state[memory], rtol=0, atol=0)
            state = new_state

    @parameterized.parameters(GENERIC_MEMORY)
    def test_error_feedback_invariant(self, name):
        compressor = tfdist.compression.get(name, error_feedback=True)
        x = tf.random.stateless_normal([64, 32], seed=[5, 6])
        state = compressor.initial_state(x.shape, x.dtype)
        state["residual"] = tf.random.stateless_normal(x.shape, seed=[7, 8])
        key = tf.constant([3, 0], tf.int64)
        payload, new_state = compressor.compress(x, state, key)
        sent = compressor.decompress(payload, x.shape, x.dtype, key)
        # sent + new residual == gradient + old residual
        self.assertAllClose(sent + new_state["residual"], x + state["residual"], atol=1e-5)

    @parameterized.parameters(ALL)
    def test_decompress_sum_is_the_sum_of_the_parts(self, name):
        # What a replica does with the parts of an all-gather (sparse ones: one segment sum).
        compressor = tfdist.compression.get(name)
        key = tf.constant([4, 0], tf.int64)
        payloads = [compressor.compress(tf.random.stateless_normal([64, 32], seed=[i, 9]),
                                        key=key)[0] for i in range(3)]
        parts = [compressor.decompress(p, [64, 32], tf.float32, key) for p in payloads]
        if compressor.capabilities.aggregate == "majority vote":  # the vote, summed magnitude
            votes = tf.sign(tf.add_n([tf.sign(p) for p in parts]))
            scale = sum(float(p[1][0]) for p in payloads)
            parts = [votes * scale]
        self.assertAllClose(compressor.decompress_sum(payloads, [64, 32], tf.float32, key),
                            tf.add_n(parts), atol=1e-6)

    @parameterized.parameters(ALL)
    def test_a_non_finite_gradient_leaves_the_state_and_stays_non_finite(self, name):
        # An fp16 overflow: the state (residual, momentum...) is left as it was, and what the
        # payload decodes to is not finite, so the loss-scale logic sees it.
        compressor = tfdist.compression.get(name)
        x = tf.random.stateless_normal([64, 32], seed=[5, 6])
        key = tf.constant([3, 0], tf.int64)
        _, state = compressor.compress(x, key=key)  # a state that is not all zeros
        for bad in (float("nan"), float("inf")):
            poisoned = tf.tensor_scatter_nd_update(x, [[3, 4]], [bad])
            payload, new_state = compressor.compress(poisoned, state, key)
            for state_name, value in state.items():
                self.assertAllEqual(new_state[state_name], value, msg=f"{name} {state_name}")
            decoded = compressor.decompress(payload, x.shape, x.dtype, key)
            self.assertFalse(np.all(np.isfinite(decoded.numpy())), f"{name} with {bad}")

    @parameterized.parameters(ALL)
    def test_a_non_finite_gradient_in_the_exchange_goes_through_the_base_guard(self, name):
        # Two replicas, the first's gradient overflowed: every replica's sum is non-finite
        # (the loss-scale logic skips the step) and the first keeps its state, through the
        # base's finite-value guard for every compressor, PowerSGD's two rounds included.
        compressor = tfdist.compression.get(name, error_feedback=True)  # a state to keep
        capabilities = compressor.capabilities
        shape = ([48 * 20] if capabilities.elementwise and not capabilities.per_tensor
                 else [48, 20])
        communicator = LocalCommunicator(2)
        key = tf.constant([1, 0], tf.int64)
        states = [[compressor.initial_state(shape, tf.float32) for _ in range(2)]]
        warm = [[tf.random.stateless_normal(shape, seed=[r, 7]) for r in range(2)]]
        _, states, _ = compressor.exchange(warm, states, communicator, key)
        gradients = [[tf.random.stateless_normal(shape, seed=[r, 8]) for r in range(2)]]
        flat = tf.reshape(gradients[0][0], [-1])
        gradients[0][0] = tf.reshape(
            tf.tensor_scatter_nd_update(flat, [[5]], [float("nan")]), shape)
        guard = Compressor._guard_non_finite
        with mock.patch.object(Compressor, "_guard_non_finite", autospec=True,
                               side_effect=guard) as guarded:
            sums, new_states, _ = compressor.exchange(gradients, states, communicator,
                                                      key + 1)
        self.assertLen(guarded.call_args_list, 2)  # once per replica
        for r in range(2):
            self.assertFalse(np.all(np.isfinite(sums[0][r].numpy())), f"{name} replica {r}")
        self.assertNotEmpty(states[0][0])
        for state_name, value in states[0][0].items():
            self.assertAllEqual(new_states[0][0][state_name], value,
                                msg=f"{name} {state_name}")
        self.assertNotIn("exchange", type(compressor).__dict__)  # one exchange: the base's

    @parameterized.parameters([None, tf.float16])
    def test_dgc_accumulation_invariant(self, payload_dtype):
        # (Values that travel in float16 leave their rounding in the accumulation.)
        compressor = tfdist.compression.get("dgc", ratio=0.05, momentum=0.9)
        x = tf.random.stateless_normal([50, 20], seed=[9, 1])
        state = compressor.initial_state(x.shape, x.dtype)
        state["velocity"] = tf.random.stateless_normal(x.shape, seed=[2, 2])
        state["accumulation"] = tf.random.stateless_normal(x.shape, seed=[3, 3])
        payload, new_state = compressor.compress(x, state, dtype=payload_dtype)
        self.assertEqual(payload[0].dtype, payload_dtype or x.dtype)
        sent = compressor.decompress(payload, x.shape, x.dtype)
        velocity = 0.9 * state["velocity"] + x
        self.assertAllClose(sent + new_state["accumulation"], state["accumulation"] + velocity,
                            rtol=0, atol=1e-5)
        # Momentum factor masking: the velocity is cleared where a value was sent.
        self.assertAllEqual(tf.cast(sent != 0, tf.int32) * tf.cast(
            new_state["velocity"] != 0, tf.int32), tf.zeros_like(x, tf.int32))
        self.assertEqual(int(tf.math.count_nonzero(sent)), 50)

    def test_dgc_beside_an_optimizers_momentum_is_named(self):
        # (Both strategy families log this once: the all-reduce and the ps push path.)
        import keras

        from tfdist.compression.sparsify import momentum_applied_twice

        dgc = tfdist.compression.get("dgc")
        self.assertRegex(momentum_applied_twice(dgc, keras.optimizers.Adam()),
                         r"`dgc` applies momentum correction itself \(momentum=0.9\), and "
                         r"the model trains with Adam \(its own moment estimates\)")
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(momentum=0.5))
        self.assertRegex(momentum_applied_twice(dgc, scaled), "SGD with momentum=0.5")
        self.assertIsNone(momentum_applied_twice(dgc, keras.optimizers.SGD()))
        self.assertIsNone(momentum_applied_twice(tfdist.compression.get("dgc", momentum=0.0),
                                                 keras.optimizers.Adam()))
        self.assertIsNone(momentum_applied_twice(tfdist.compression.get("topk"),
                                                 keras.optimizers.Adam()))

    def test_dgc_warmup_lowers_density(self):
        compressor = tfdist.compression.get("dgc", ratio=0.001, warmup_steps=4,
                                            initial_ratio=0.25)
        x = tf.random.stateless_normal([100, 100], seed=[1, 1])
        state = compressor.initial_state(x.shape, x.dtype)
        sizes = []
        for _ in range(6):
            payload, state = compressor.compress(x, state)
            sizes.append(int(tf.size(payload[0])))
        self.assertEqual(sizes[0], 2500)
        self.assertEqual(sizes[4:], [10, 10])
        self.assertEqual(sizes, sorted(sizes, reverse=True))

    def test_dgc_leaves_the_full_top_k_after_its_warm_up(self):
        # The sampled top-k (fast past 50 k elements) needs k known when the step is traced:
        # during the warm-up k follows the step, after it k is the final one.
        from tfdist.compression import sparsify

        compressor = tfdist.compression.get("dgc", ratio=0.01, warmup_steps=2)
        x = tf.random.stateless_normal([60_000], seed=[2, 2])
        state = compressor.initial_state(x.shape, x.dtype)
        calls = []
        original = sparsify.top_k_indices

        def spy(magnitudes, k):
            calls.append(k)
            return original(magnitudes, k)

        sparsify.top_k_indices = spy
        try:
            sizes = []
            for _ in range(4):
                payload, state = compressor.compress(x, state)
                sizes.append(int(tf.size(payload[0])))
        finally:
            sparsify.top_k_indices = original
        self.assertEqual(calls, [600, 600])  # steps 2 and 3, eagerly one branch each
        self.assertEqual(sizes[2:], [600, 600])

    def test_dgc_leaves_the_full_top_k_after_its_warm_up_in_a_traced_step(self):
        # Traced, both branches of the warm-up's cond are in the graph: a counter in the
        # sampled top-k's branch tells which one each step runs.
        from tfdist.compression import sparsify

        compressor = tfdist.compression.get("dgc", ratio=0.01, warmup_steps=2)
        x = tf.random.stateless_normal([60_000], seed=[2, 2])
        state = {name: tf.Variable(value) for name, value in
                 compressor.initial_state(x.shape, x.dtype).items()}
        sampled = tf.Variable(0)
        original = sparsify.top_k_indices

        def spy(magnitudes, k):
            with tf.control_dependencies([sampled.assign_add(1)]):
                return tf.identity(original(magnitudes, k))

        @tf.function
        def step():
            payload, new_state = compressor.compress(x, {n: v.read_value()
                                                         for n, v in state.items()})
            for name, value in new_state.items():
                state[name].assign(value)
            return tf.size(payload[0])

        sparsify.top_k_indices = spy
        try:
            sizes, counts = [], []
            for _ in range(4):
                sizes.append(int(step()))
                counts.append(int(sampled.numpy()))
        finally:
            sparsify.top_k_indices = original
        self.assertEqual(counts, [0, 0, 1, 2])  # the full top-k in steps 0 and 1 only
        self.assertEqual(sizes[2:], [600, 600])
        self.assertGreater(sizes[0], sizes[1])
        self.assertEqual(int(state["step"].numpy()), 4)

    def test_indices_past_two_to_the_31_are_int64(self):
        # A tensor of 2^31 elements takes 8 GiB; the limit is lowered to show the int64 path.
        from tfdist.compression import sparsify

        x = tf.random.stateless_normal([5000], seed=[5, 5])
        expected = {}
        for limit in (sparsify.INT32_LIMIT, 1000):
            original, sparsify.INT32_LIMIT = sparsify.INT32_LIMIT, limit
            try:
                for name, config in (("topk", {}), ("randomk", {}), ("dgc", {}),
                                     ("threshold", {"threshold": 1.5})):
                    compressor = tfdist.compression.get(name, **config)
                    payload, _ = compressor.compress(x)
                    index = tf.int32 if limit > 5000 else tf.int64
                    if name != "randomk":  # (no indices travel)
                        self.assertEqual(payload[-1].dtype, index)
                    self.assertEqual(tuple(t.dtype for t in payload),
                                     compressor.payload_dtypes(tf.float32, x.shape))
                    varies = compressor.capabilities.variable_size
                    self.assertEqual(nbytes(payload) if not varies else 0,
                                     0 if varies
                                     else compressor.payload_bytes(x.shape, tf.float32))
                    decoded = compressor.decompress_sum([payload, payload], x.shape, x.dtype)
                    if name in expected:
                        self.assertAllEqual(decoded, expected[name])
                    expected[name] = decoded
            finally:
                sparsify.INT32_LIMIT = original

    def test_varints_round_trip(self):
        from tfdist.compression.sparsify import decode_varints
        from tfdist.compression.sparsify import encode_varints

        values = tf.constant([0, 1, 63, 64, 127, 128, 300, 16384, 2 ** 40, 2 ** 62 + 5, 7],
                             tf.int64)
        stream = encode_varints(values)
        self.assertEqual(stream.dtype, tf.uint8)
        self.assertAllEqual(stream[:6], [0, 1, 63, 64, 127, 128])  # one byte below 128
        self.assertAllEqual(decode_varints(stream), values)
        self.assertAllEqual(decode_varints(encode_varints(tf.zeros([0], tf.int64))), [])

    def test_threshold_entropy_coding_sends_the_same_in_fewer_bytes(self):
        plain = tfdist.compression.get("threshold", threshold=2.3)
        coded = tfdist.compression.get("threshold", threshold=2.3, entropy_coding=True)
        self.assertEqual(tfdist.compression.get(tfdist.compression.serialize(coded))
                         .get_config(), coded.get_config())
        x = tf.random.stateless_normal([100_000], seed=[7, 7])  # about 2 % pass
        payload, state = plain.compress(x)
        coded_payload, coded_state = coded.compress(x)
        self.assertAllEqual(coded_state["residual"], state["residual"])
        other = plain.compress(-x)[0], coded.compress(-x)[0]
        self.assertAllEqual(coded.decompress_sum([coded_payload, other[1]], x.shape, x.dtype),
                            plain.decompress_sum([payload, other[0]], x.shape, x.dtype))
        sent = int(tf.size(payload[0]))
        self.assertBetween(sent / x.shape[0], 0.015, 0.03)
        # Distances of ~50 take one byte, the rarer long ones two: under half of int32's 4.
        self.assertLess(nbytes(coded_payload), 0.5 * nbytes(payload))
        self.assertLessEqual(nbytes(coded_payload), coded.payload_bytes(x.shape, x.dtype))
        poisoned, kept = coded.compress(tf.tensor_scatter_nd_update(x, [[3]], [np.nan]),
                                        coded_state)
        self.assertAllEqual(kept["residual"], coded_state["residual"])
        self.assertTrue(np.all(np.isnan(coded.decompress(poisoned, x.shape, x.dtype))))

    def test_topk_sends_the_largest(self):
        x = tf.constant([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05, 0.0, 0.0])
        compressor = tfdist.compression.get("topk", ratio=0.2)
        payload, state = compressor.compress(x)
        sent = compressor.decompress(payload, x.shape, x.dtype)
        self.assertAllClose(sent, [0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 0])
        self.assertAllClose(state["residual"], x - sent)

    def test_fast_top_k_is_exact(self):
        from tfdist.compression.sparsify import top_k_indices

        for size, k in ((200_000, 2000), (200_000, 20), (60_000, 1), (1000, 10)):
            x = tf.abs(tf.random.stateless_normal([size], seed=[size, k]))
            self.assertAllEqual(tf.sort(top_k_indices(x, k)),
                                tf.sort(tf.math.top_k(x, k).indices))
        ties = tf.zeros([100_000])  # every candidate passes: still exactly k
        self.assertLen(top_k_indices(ties, 50), 50)

    def test_randomk_indices_agree_across_replicas(self):
        compressor = tfdist.compression.get("randomk", ratio=0.01)
        key = tf.constant([4, 0], tf.int64)
        first = compressor._indices(300_000, key)
        self.assertAllEqual(first, compressor._indices(300_000, key))
        self.assertAllEqual(first, tf.sort(first))
        self.assertLen(set(first.numpy().tolist()), 3000)

    def test_threshold_sends_plus_minus_tau(self):
        x = tf.constant([0.5, -0.05, 0.2, -0.3])
        compressor = tfdist.compression.get("threshold", threshold=0.25)
        payload, state = compressor.compress(x)
        self.assertAllEqual(payload[0], [1, -4])
        self.assertAllClose(compressor.decompress(payload, x.shape, x.dtype),
                            [0.25, 0, 0, -0.25])
        self.assertAllClose(state["residual"], [0.25, -0.05, 0.2, -0.05])

    def test_majority_vote_outvotes_a_replica(self):
        # Three replicas; the third's signs are all wrong: the vote keeps the other two's.
        compressor = tfdist.compression.get("signsgd_mv")
        x = tf.constant([1.0, -2.0, 3.0, -4.0])
        payloads = [compressor.compress(t)[0] for t in (x, 2 * x, -10 * x)]
        got = compressor.decompress_sum(payloads, x.shape, x.dtype)
        scale = 2.5 + 5.0 + 25.0  # each replica's mean |x|
        self.assertAllClose(got, np.sign(x.numpy()) * scale)
        with self.assertRaisesRegex(ValueError, r"`compression`='signsgd_mv' combines the "
                                                r"replicas' payloads by majority vote.*"
                                                r"Allowed here: \["):
            push_compressor("signsgd_mv")

    def test_onebit_reconstruction_values(self):
        x = tf.constant([1.0, 3.0, -2.0, -4.0, 2.0])
        compressor = tfdist.compression.get("onebit", error_feedback=False)
        payload, _ = compressor.compress(x)
        self.assertAllClose(compressor.decompress(payload, x.shape, x.dtype),
                            [2.0, 2.0, -3.0, -3.0, 2.0])

    @parameterized.parameters(("terngrad", {"clip": None}), ("qsgd", {}),
                              ("qsgd", {"bucket_size": None}), ("qsgd", {"bucket_size": 7}))
    def test_stochastic_quantisers_are_unbiased(self, name, config):
        tf.random.set_seed(0)
        compressor = tfdist.compression.get(name, **config)
        x = tf.random.stateless_normal([200], seed=[4, 4])
        mean = tf.add_n([compressor.decompress(compressor.compress(x)[0], x.shape, x.dtype)
                         for _ in range(400)]) / 400
        scale = float(tf.reduce_max(tf.abs(x)))
        self.assertLess(float(tf.reduce_max(tf.abs(mean - x))), 0.2 * scale)
        self.assertLess(abs(float(tf.reduce_mean(mean - x))), 0.01 * scale)

    def test_qsgd_buckets_have_their_own_norm(self):
        # One large element coarsens only its bucket of 4: the others keep their levels.
        x = tf.constant([100.0, 0.1, 0.2, 0.3, 1.0, 2.0, 3.0, 4.0, 0.5])
        compressor = tfdist.compression.get("qsgd", bucket_size=4)
        codes, norms = compressor.compress(x)[0]
        self.assertAllClose(norms, [np.linalg.norm([100, .1, .2, .3]),
                                    np.linalg.norm([1, 2, 3, 4]), 0.5])
        self.assertEqual(compressor.payload_bytes([9], tf.float32), 9 + 4 * 3)
        decoded = compressor.decompress((codes, norms), x.shape, x.dtype).numpy()
        self.assertAllClose(decoded[4:], x.numpy()[4:], atol=float(norms[1]) / 127)
        self.assertEqual(tfdist.compression.get("qsgd").payload_bytes([1000], tf.float32),
                         1000 + 4 * 2)

    def test_terngrad_clips_at_its_root_mean_square(self):
        # One outlier among small values: unclipped, the scale is the outlier's and almost
        # every other element becomes 0; clipped at 2.5 rms the scale is 2.5 rms.
        x = tf.concat([tf.constant([50.0]), tf.random.stateless_normal([999], seed=[1, 2])], 0)
        rms = float(tf.sqrt(tf.reduce_mean(tf.square(x))))
        _, scale = tfdist.compression.get("terngrad").compress(x)[0]
        self.assertAllClose(scale, [2.5 * rms], rtol=1e-5)
        # A one-element or constant gradient (a Dense(1) bias) is not clipped to zero.
        for flat in ([3.0], [1.0, 1.0, 1.0]):
            _, scale = tfdist.compression.get("terngrad").compress(tf.constant(flat))[0]
            self.assertAllClose(scale, [max(flat)])
        _, raw = tfdist.compression.get("terngrad", clip=None).compress(x)[0]
        self.assertAllClose(raw, [50.0])
        with self.assertRaisesRegex(ValueError, "`clip` must be None or a positive number"):
            tfdist.compression.get("terngrad", clip=0)
        with self.assertRaisesRegex(ValueError, "`bucket_size` must be None or a positive"):
            tfdist.compression.get("qsgd", bucket_size=0)

    @parameterized.parameters(("fp16",), ("randomk",), ("none",))
    def test_linear_payloads_sum(self, name):
        compressor = tfdist.compression.get(name, error_feedback=False)
        self.assertTrue(compressor.capabilities.linear)
        key = tf.constant([7, 0], tf.int64)
        xs = [tf.random.stateless_normal([30, 10], seed=[i, 0]) for i in range(3)]
        payloads = [compressor.compress(x, None, key)[0] for x in xs]
        summed = [tf.add_n(list(parts)) for parts in zip(*payloads)]
        direct = tf.add_n([compressor.decompress(p, [30, 10], tf.float32, key)
                           for p in payloads])
        self.assertAllClose(compressor.decompress(summed, [30, 10], tf.float32, key), direct,
                            atol=1e-2)

    def test_powersgd_recovers_low_rank_exactly(self):
        a = tf.random.stateless_normal([40, 2], seed=[1, 2])
        b = tf.random.stateless_normal([25, 2], seed=[3, 4])
        m = a @ tf.transpose(b)
        compressor = tfdist.compression.get("powersgd", rank=2)
        payload, state = compressor.compress(m)
        self.assertAllClose(compressor.decompress(payload, m.shape, m.dtype), m, atol=1e-4)
        self.assertAllClose(state["residual"], tf.zeros_like(m), atol=1e-4)
        self.assertEqual(nbytes(payload), (40 + 25) * 2 * 4)

    def test_powersgd_leaves_vectors_dense(self):
        compressor = tfdist.compression.get("powersgd")
        self.assertFalse(compressor.compressible([100], tf.float32))
        self.assertFalse(compressor.compressible([3, 2], tf.float32))
        self.assertTrue(compressor.compressible([64, 64], tf.float32))

    def test_bit_packing_round_trips(self):
        rng = np.random.default_rng(0)
        for n in (1, 7, 8, 9, 100):
            bits = rng.random(n) < 0.5
            self.assertAllEqual(quantize.unpack_bits(quantize.pack_bits(bits), n), bits)
            codes = rng.integers(0, 4, n)
            self.assertAllEqual(quantize.unpack_pairs(quantize.pack_pairs(codes), n), codes)

    @parameterized.parameters(ALL)
    def test_capabilities_are_declared_complete_and_documented(self, name):
        compressor = tfdist.compression.get(name)
        capabilities = compressor.capabilities
        self.assertIsInstance(capabilities, Capabilities)
        # Declared by the compressor's own class (or a codec family's base), not inherited
        # from `Compressor`'s defaults by omission.
        declared_by = next(c for c in type(compressor).__mro__ if "CAPABILITIES" in c.__dict__)
        self.assertIsNot(declared_by, Compressor, name)
        documented = Capabilities.__doc__.split("Attributes:")[1]
        config = compressor.get_config()
        for field in dataclasses.fields(Capabilities):
            value = getattr(capabilities, field.name)
            self.assertIsInstance(value, field.type, f"{name}: {field.name}")
            self.assertRegex(documented, rf"\n      {field.name}: \S", field.name)
            # A capability is no attribute of its own beside `capabilities`, unless it is
            # the compressor's configuration (`topk`'s `per_tensor` argument).
            self.assertTrue(not hasattr(compressor, field.name) or field.name in config,
                            f"{name}.{field.name}")
        self.assertCountEqual(re.findall(r"^      (\w+): ", documented, re.M),
                              [f.name for f in dataclasses.fields(Capabilities)])
        with self.assertRaisesRegex(ValueError, r"`aggregate` must be one of \['sum', "
                                                r"'majority vote'\]. Received: 'mean'"):
            Capabilities(aggregate="mean")
        with self.assertRaisesRegex(ValueError, "`linear` must be True or False. Received: 1"):
            Capabilities(linear=1)

    def test_configuration_sets_capabilities_apart_from_the_declaration(self):
        topk = tfdist.compression.get("topk", per_tensor=True)
        self.assertTrue(topk.capabilities.per_tensor)
        self.assertFalse(tfdist.compression.TopKCompressor.CAPABILITIES.per_tensor)
        self.assertTrue(tfdist.compression.get("dgc", warmup_steps=5)
                        .capabilities.variable_size)
        self.assertFalse(tfdist.compression.get("dgc").capabilities.variable_size)
        self.assertTrue(tfdist.compression.get("topk", error_feedback=None).error_feedback)
        self.assertFalse(tfdist.compression.get("none", error_feedback=None).error_feedback)
        with self.assertRaisesRegex(TypeError, "declares 2 rounds of exchange: it must "
                                               "implement `_exchange_rounds`"):
            type("TwoRounds", (Compressor,), {"CAPABILITIES": Capabilities(rounds=2)})

    def test_errors_name_the_argument(self):
        get = tfdist.compression.get
        with self.assertRaisesRegex(ValueError, r"Unknown compressor 'gzip'. Valid names: "
                                                r"\[.*'topk'.*\]"):
            get("gzip")
        with self.assertRaisesRegex(ValueError, r"`ratio` must be a number in \(0, 1\]. "
                                                r"Received: 2"):
            get("topk", ratio=2)
        with self.assertRaisesRegex(ValueError, "`levels` must be an integer between 1 and 127"):
            get("qsgd", levels=300)
        with self.assertRaisesRegex(ValueError, "`momentum` must be a float in"):
            get("dgc", momentum=1.5)
        with self.assertRaisesRegex(ValueError, "`rank` must be a positive integer"):
            get("powersgd", rank=0)
        with self.assertRaisesRegex(ValueError, "compressor 'fp16' does not take"):
            get("fp16", ratio=0.1)
        with self.assertRaisesRegex(ValueError, "`error_feedback` must be True or False"):
            get("topk", error_feedback="yes")
        self.assertIsNone(get(None))


if __name__ == "__main__":
    tf.test.main()
