"""Compressors that send a few elements: top-k, random-k, threshold (Strom 2015) and DGC.

Payload sizes for a gradient of n elements of b bytes, k = max(1, floor(ratio * n)):

| name | payload | bytes | linear |
|---|---|---|---|
| `topk` | the k largest |x| values + int32 indices | k (b + 4) | no |
| `randomk` | k values at indices drawn from the shared step key (no indices sent) | k b | yes |
| `threshold` | int32 (index + 1) * sign of the m elements with |x| >= tau | 4 m (varies) | no |
| `dgc` | like top-k, of the momentum-corrected accumulation | k (b + 4) | no |

Indices and threshold codes are int64 (8 bytes) in tensors of 2^31 elements or more.
"""

import dataclasses
import math

import tensorflow as tf

from tfdist._args import check_bool
from tfdist._args import check_fraction
from tfdist._args import check_int
from tfdist._args import check_number
from tfdist.compression.base import Capabilities
from tfdist.compression.base import Compressor
from tfdist.compression.base import num_selected


def _flat(tensor):
    return tf.reshape(tensor, [-1])


# Tensors of more elements than this number their elements with int64 indices (a payload's
# index or threshold code then takes 8 bytes instead of 4).
INT32_LIMIT = 2 ** 31 - 1


def index_dtype(size):
    """The dtype of element indices in a tensor of `size` elements (None: int32)."""
    return tf.int64 if size is not None and size >= INT32_LIMIT else tf.int32


_SAMPLE = 10_000


def top_k_indices(magnitudes, k):
    """Indices of the `k` largest `magnitudes` (a vector), exactly, faster than a full top-k.

    TF's top-k over a long vector costs ~10 ns per element on CPU. As DGC does, a random
    sample estimates the magnitude that a few more than k elements pass; the exact top-k then
    runs on those candidates only. The margin is four standard deviations of the sample's
    estimate (about 1.5 k candidates for k = 1 % of 400k elements, 2.4 k for 0.1 %: the
    top-k of the candidates costs much more with many more of them). With fewer than k
    candidates (an unlucky sample) it falls back to the full top-k, so the result is always
    the exact top k.
    """
    size = magnitudes.shape.num_elements()
    dtype = index_dtype(size)
    if not isinstance(k, int) or size < 5 * _SAMPLE or 4 * k > size:
        return tf.math.top_k(magnitudes, k=k, sorted=False, index_type=dtype).indices
    sample = tf.gather(magnitudes, tf.random.uniform([_SAMPLE], 0, size, dtype))
    expected = k * _SAMPLE / size  # sampled elements among the top k
    margin = 4 / math.sqrt(expected)  # solve (f - 1) / sqrt(f) = margin for the factor f
    factor = ((margin + math.sqrt(margin ** 2 + 4)) / 2) ** 2
    rank = max(1, min(_SAMPLE, math.ceil(factor * expected)))
    threshold = tf.math.top_k(sample, k=rank, sorted=True).values[-1]
    candidates = tf.cast(tf.where(magnitudes >= threshold)[:, 0], dtype)

    def among_candidates():
        best = tf.math.top_k(tf.gather(magnitudes, candidates), k=k, sorted=False).indices
        return tf.gather(candidates, best)

    def full():
        return tf.math.top_k(magnitudes, k=k, sorted=False, index_type=dtype).indices

    return tf.cond(tf.size(candidates) >= k, among_candidates, full)


def _num_elements(shape):
    return tf.TensorShape(shape).num_elements()


def _sum_at(indices, values, shape):
    """A tensor of `shape`, zero but for `values` added at the flat `indices` (duplicates add).

    One `scatter_nd` takes all replicas' parts of an all-gather at once. (A segment sum is
    faster in a fresh process but 3-4x slower than `scatter_nd` once a strategy has trained
    in the process, measured on TF 2.21 CPU.)
    """
    return tf.reshape(tf.scatter_nd(indices[:, None], values, [_num_elements(shape)]), shape)


def _without(compensated, indices, sent=None):
    """`compensated` less what was sent at `indices` (its values there, or `sent`)."""
    flat = _flat(compensated)
    if sent is None:  # those elements were sent as they are: their residual is zero
        flat = tf.tensor_scatter_nd_update(flat, indices[:, None],
                                           tf.zeros(tf.shape(indices), flat.dtype))
    else:
        flat = tf.tensor_scatter_nd_sub(flat, indices[:, None], sent)
    return tf.reshape(flat, compensated.shape)


def _rounded(values, dtype):
    """Sent `values` in `dtype` if they travel in a narrower one (their rounding is then
    left in the residual), else None (the elements were sent exactly)."""
    return None if values.dtype == dtype else tf.cast(values, dtype)


class TopKCompressor(Compressor):
    """Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018) with error feedback.

    Args:
      ratio: fraction of the elements sent, in (0, 1].
      error_feedback: keep what was not sent and add it to the next gradient (default on).
      per_tensor: select the top k of each gradient (every layer sends its share) instead
        of over the fused gradients (the largest elements of the model, wherever they are).

    Payload: k values + k int32 indices, k = max(1, floor(ratio * n)).
    """

    name = "topk"
    CAPABILITIES = Capabilities()

    def __init__(self, ratio=0.01, error_feedback=True, per_tensor=False, **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)
        self.ratio = check_fraction("ratio", ratio)
        self.per_tensor = check_bool("per_tensor", per_tensor)

    @property
    def capabilities(self):
        # The `per_tensor` argument chooses whether the exchange may fuse gradients.
        return dataclasses.replace(super().capabilities, per_tensor=self.per_tensor)

    def _select(self, flat, state, key):
        del state, key
        return top_k_indices(tf.abs(flat), num_selected(flat.shape.num_elements(), self.ratio))

    def _compress(self, tensor, state, key):
        flat = _flat(tensor)
        indices = self._select(flat, state, key)
        return (tf.gather(flat, indices), indices), {}

    def _decompress(self, payload, shape, dtype, key):
        return self._decompress_sum([payload], shape, dtype, key)

    def _decompress_sum(self, payloads, shape, dtype, key):
        del key
        values = tf.concat([tf.cast(p[0], dtype) for p in payloads], axis=0)
        return _sum_at(tf.concat([p[1] for p in payloads], axis=0), values, shape)

    def _residual(self, compensated, payload, key):
        del key
        return _without(compensated, payload[1], _rounded(payload[0], compensated.dtype))

    def payload_dtypes(self, dtype, shape=None):
        size = None if shape is None else _num_elements(shape)
        return (tf.as_dtype(dtype), index_dtype(size))

    def payload_bytes(self, shape, dtype):
        size = _num_elements(shape)
        k = num_selected(size, self.ratio)
        return k * (tf.as_dtype(dtype).size + index_dtype(size).size)

    def get_config(self):
        return {"ratio": self.ratio, "per_tensor": self.per_tensor, **super().get_config()}


class RandomKCompressor(Compressor):
    """Random-k sparsification (Stich et al. 2018) with error feedback.

    The k indices are drawn from the step key, the same on every replica, so the values are
    all-reduced and no index crosses the wire. Args as `TopKCompressor`, plus `seed`.

    Payload: k values, k = max(1, floor(ratio * n)).
    """

    name = "randomk"
    CAPABILITIES = Capabilities(linear=True, shared_key=True)

    def __init__(self, ratio=0.01, seed=0, error_feedback=True, **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)
        self.ratio = check_fraction("ratio", ratio)
        self.seed = check_int("seed", seed)

    def _indices(self, size, key):
        # Encoding, its error feedback and decoding all need the same indices: drawn once
        # per key and graph.
        graph = tf.compat.v1.get_default_graph()
        if getattr(self, "_cache_graph", None) is not graph or tf.executing_eagerly():
            self._cache_graph, self._cache = graph, {}
        cache_key = (key.ref(), size)
        if cache_key not in self._cache:
            self._cache[cache_key] = self._draw(size, key)
        return self._cache[cache_key]

    def _draw(self, size, key):
        k = num_selected(size, self.ratio)
        seed = key + tf.constant([self.seed, size], tf.int64)
        # Sorted: every replica must lay its values out in the same order.
        return tf.sort(top_k_indices(tf.random.stateless_uniform([size], seed=seed), k))

    def _compress(self, tensor, state, key):
        del state
        flat = _flat(tensor)
        return (tf.gather(flat, self._indices(flat.shape.num_elements(), key)),), {}

    def _decompress(self, payload, shape, dtype, key):
        indices = self._indices(_num_elements(shape), key)
        return _sum_at(indices, tf.cast(payload[0], dtype), shape)

    def _residual(self, compensated, payload, key):
        return _without(compensated, self._indices(compensated.shape.num_elements(), key),
                        _rounded(payload[0], compensated.dtype))

    def payload_bytes(self, shape, dtype):
        return num_selected(_num_elements(shape), self.ratio) * tf.as_dtype(dtype).size

    def get_config(self):
        return {"ratio": self.ratio, "seed": self.seed, **super().get_config()}


def encode_varints(values):
    """Non-negative int64 `values` as a uint8 stream of variable-length codes (LEB128: 7 bits
    a byte, least significant first, the high bit set on every byte but a value's last)."""
    values = tf.cast(values, tf.int64)
    lengths = tf.ones_like(values)
    for group in range(1, _GROUPS):
        lengths += tf.cast(values >= (1 << (7 * group)), tf.int64)
    groups = tf.range(_GROUPS, dtype=tf.int64)[None, :]
    parts = tf.bitwise.bitwise_and(tf.bitwise.right_shift(values[:, None], 7 * groups), 0x7F)
    more = tf.cast(groups < lengths[:, None] - 1, tf.int64) * 0x80
    return tf.cast(tf.boolean_mask(parts + more, groups < lengths[:, None]), tf.uint8)


def decode_varints(stream):
    """The int64 values of an `encode_varints` stream."""
    stream = tf.cast(stream, tf.int64)
    last = tf.equal(tf.bitwise.right_shift(stream, 7), 0)
    value = tf.cumsum(tf.cast(last, tf.int64), exclusive=True)  # each byte's value
    count = tf.reduce_sum(tf.cast(last, tf.int64))
    starts = tf.concat([[0], tf.where(last)[:, 0] + 1], axis=0)
    place = tf.range(tf.size(stream, out_type=tf.int64)) - tf.gather(starts, value)
    parts = tf.bitwise.left_shift(tf.bitwise.bitwise_and(stream, 0x7F), 7 * place)
    return tf.math.unsorted_segment_sum(parts, value, count)


_GROUPS = 9  # 7-bit groups of a value below 2^63


class ThresholdCompressor(Compressor):
    """Threshold quantisation with residual (Strom 2015).

    Adds the residual to the gradient; every element whose magnitude reaches `threshold` is
    sent as +tau or -tau, and tau is taken off its residual; the rest waits in the residual.
    The payload is one int32 per sent element, (index + 1) * sign, so its size follows the
    data: 4 m bytes for m sent elements (at most 4 n).

    With `entropy_coding` the sent elements are coded as Strom codes them: each index as its
    distance from the previous one (small where elements are dense), sign in the lowest bit,
    in a variable-length code of 7 bits a byte. A distance under 64 takes one byte, under
    8192 two: at 1 % density about 2 bytes an element instead of 4 (at most n + 1 bytes in
    all). Decoded values are the same.

    Args:
      threshold: tau > 0, in gradient units.
      error_feedback: keep the residual (Strom's scheme; default on).
      entropy_coding: code indices by distance in a variable-length code (default off).
    """

    name = "threshold"
    CAPABILITIES = Capabilities(variable_size=True)

    def __init__(self, threshold=0.01, error_feedback=True, entropy_coding=False, **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)
        check_number("threshold", threshold, "a positive number", low=0, low_open=True)
        check_bool("entropy_coding", entropy_coding)
        self.threshold = float(threshold)
        self.entropy_coding = entropy_coding

    def _pack(self, codes):
        """Signed codes (ascending indices, maybe a 0 marker last) as distance varints."""
        if not self.entropy_coding:
            return codes
        codes = tf.cast(codes, tf.int64)
        valid = tf.not_equal(codes, 0)
        indices = tf.abs(codes) - 1
        previous = tf.concat([[-1], indices[:-1]], axis=0)
        distance = tf.where(valid, indices - previous, 0)
        negative = tf.cast(codes < 0, tf.int64)
        return encode_varints(tf.where(valid, 2 * distance + negative, 0))

    def _unpack(self, payload):
        """The signed codes of one replica's payload (a marker stays 0)."""
        if not self.entropy_coding:
            return payload
        values = decode_varints(payload)
        indices = tf.cumsum(tf.bitwise.right_shift(values, 1)) - 1
        signs = 1 - 2 * tf.bitwise.bitwise_and(values, 1)
        return tf.where(tf.equal(values, 0), tf.zeros_like(values), (indices + 1) * signs)

    def _compress(self, tensor, state, key):
        del state, key
        flat = _flat(tensor)
        dtype = index_dtype(flat.shape.num_elements())
        indices = tf.cast(tf.where(tf.abs(flat) >= self.threshold)[:, 0], dtype)
        signs = tf.cast(tf.sign(tf.gather(flat, indices)), dtype)
        # A NaN never passes the threshold: a non-finite input adds the code 0 (never an
        # element's), which decodes to NaN everywhere.
        poisoned = 1 - tf.cast(tf.reduce_all(tf.math.is_finite(flat)), tf.int32)
        codes = tf.concat([(indices + 1) * signs, tf.zeros([poisoned], dtype)], 0)
        return (self._pack(codes),), {}

    def _values(self, codes, dtype):
        return tf.cast(tf.sign(codes), dtype) * tf.cast(self.threshold, dtype)

    def _decompress(self, payload, shape, dtype, key):
        return self._decompress_sum([payload], shape, dtype, key)

    def _decompress_sum(self, payloads, shape, dtype, key):
        del key
        # (Each replica's distances start from its own first index: decoded one by one.)
        codes = tf.concat([self._unpack(p[0]) for p in payloads], axis=0)
        valid = tf.boolean_mask(codes, tf.not_equal(codes, 0))
        total = _sum_at(tf.abs(valid) - 1, self._values(valid, dtype), shape)
        return tf.where(tf.reduce_all(tf.not_equal(codes, 0)), total,
                        tf.constant(float("nan"), dtype))

    def _residual(self, compensated, payload, key):
        del key
        codes = self._unpack(payload[0])
        codes = tf.boolean_mask(codes, tf.not_equal(codes, 0))
        return _without(compensated, tf.abs(codes) - 1, self._values(codes, compensated.dtype))

    def payload_dtypes(self, dtype, shape=None):
        if self.entropy_coding:
            return (tf.uint8,)
        return (index_dtype(None if shape is None else _num_elements(shape)),)

    def payload_bytes(self, shape, dtype):
        size = _num_elements(shape)
        if self.entropy_coding:  # a distance d takes at most d bytes; the distances sum to n
            return size + 1
        return index_dtype(size).size * size

    def get_config(self):
        return {"threshold": self.threshold, "entropy_coding": self.entropy_coding,
                **super().get_config()}


class DGCCompressor(TopKCompressor):
    """Deep Gradient Compression (Lin et al. 2018).

    Top-k of a momentum-corrected accumulation: u <- m u + g, v <- v + u, send the k largest
    |v|, then clear v and u where sent (momentum factor masking). With momentum done here,
    train with plain SGD. Optional local gradient clipping (the paper clips each worker's
    gradient at `clip_norm`, i.e. the global threshold times N^-1/2) and a warm-up in which
    the density falls exponentially from `initial_ratio` to `ratio` over `warmup_steps`.

    Args:
      ratio: final fraction of elements sent (default 0.001, the paper's 99.9 % sparsity).
      momentum: m in [0, 1).
      clip_norm: clip each gradient's L2 norm to this before accumulating (None: off).
      warmup_steps: steps of the density warm-up (0: `ratio` from the start).
      initial_ratio: density at step 0 of the warm-up.
      error_feedback: keep the accumulation v between steps (DGC's own residual).
      per_tensor: top-k of each gradient (the paper's per-layer selection, default), or
        over the fused gradients.

    Payload: k values + k int32 indices (k from the current density; variable during the
    warm-up).
    """

    name = "dgc"
    # The step (of the warm-up) is counted alike on every replica.
    CAPABILITIES = Capabilities(own_memory=True, replicated_state={"step"})

    def __init__(self, ratio=0.001, momentum=0.9, clip_norm=None, warmup_steps=0,
                 initial_ratio=0.25, error_feedback=True, per_tensor=True, **kwargs):
        super().__init__(ratio=ratio, error_feedback=error_feedback, per_tensor=per_tensor,
                         **kwargs)
        check_number("momentum", momentum, "a float in [0, 1)", low=0, high=1, high_open=True)
        check_number("clip_norm", clip_norm, "None or a positive number", low=0, low_open=True,
                     allow_none=True)
        check_int("warmup_steps", warmup_steps, "a non-negative integer", low=0)
        self.momentum = float(momentum)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_steps = warmup_steps
        self.initial_ratio = check_fraction("initial_ratio", initial_ratio)

    @property
    def capabilities(self):
        # The payload's size follows the density, which changes during a warm-up.
        return dataclasses.replace(super().capabilities, variable_size=self.warmup_steps > 0)

    def state_spec(self, shape, dtype):
        return {"velocity": (shape, dtype), "accumulation": (shape, dtype),
                "step": ([], tf.int64)}

    def _density(self, step):
        if self.warmup_steps == 0:
            return tf.constant(self.ratio, tf.float64)
        progress = tf.minimum(tf.cast(step, tf.float64) / self.warmup_steps, 1.0)
        return self.initial_ratio * (self.ratio / self.initial_ratio) ** progress

    def _compress(self, tensor, state, key):
        del key
        flat = _flat(tensor)
        size = flat.shape.num_elements()
        if self.clip_norm is not None:
            flat = tf.clip_by_norm(flat, self.clip_norm)
        velocity = self.momentum * _flat(state["velocity"]) + flat
        accumulation = velocity
        if self.error_feedback:
            accumulation = _flat(state["accumulation"]) + velocity
        magnitudes = tf.abs(accumulation)
        final_k = num_selected(size, self.ratio)
        if self.warmup_steps == 0:
            indices = top_k_indices(magnitudes, final_k)
        else:
            # During the warm-up k follows the step (a full top-k); after it, the sampled
            # top-k of the final k.
            def warming_up():
                k = tf.maximum(1, tf.cast(tf.floor(self._density(state["step"]) * size),
                                          tf.int32))
                return tf.math.top_k(magnitudes, k=k, sorted=False,
                                     index_type=index_dtype(size)).indices

            indices = tf.cond(state["step"] < self.warmup_steps, warming_up,
                              lambda: top_k_indices(magnitudes, final_k))
        shape = tensor.shape
        new_state = {  # both cleared where sent (momentum factor masking)
            "velocity": _without(tf.reshape(velocity, shape), indices),
            "accumulation": _without(tf.reshape(accumulation, shape), indices),
            "step": state["step"] + 1,
        }
        return (tf.gather(accumulation, indices), indices), new_state

    def _keep_rounding(self, new_state, exact, sent):
        # The accumulation was cleared where sent: it keeps what the rounding left out.
        values, indices = exact[0], exact[1]
        rounding = values - tf.cast(sent[0], values.dtype)
        accumulation = new_state["accumulation"]
        kept = tf.tensor_scatter_nd_add(_flat(accumulation), indices[:, None], rounding)
        return {**new_state, "accumulation": tf.reshape(kept, accumulation.shape)}

    def payload_bytes(self, shape, dtype):
        if self.warmup_steps:
            size = _num_elements(shape)
            k = num_selected(size, max(self.ratio, self.initial_ratio))
            return k * (tf.as_dtype(dtype).size + index_dtype(size).size)
        return super().payload_bytes(shape, dtype)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, clip_norm=self.clip_norm,
                      warmup_steps=self.warmup_steps, initial_ratio=self.initial_ratio)
        return config


def momentum_applied_twice(compressor, optimizer):
    """Why `compressor` (DGC, with its momentum correction) beside `optimizer`'s own momentum
    applies momentum twice, which can cost accuracy (Lin et al. train DGC with plain SGD);
    None if it does not."""
    if not getattr(compressor, "momentum", 0) or optimizer is None:
        return None
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    # An SGD (or a subclass) has only the momentum it is given; other optimizers keep
    # moment estimates of their own.
    momentum = (getattr(inner, "momentum", None)
                if isinstance(inner, keras.optimizers.SGD) else None)
    if momentum == 0:
        return None
    what = (f"SGD with momentum={momentum}" if momentum is not None
            else f"{type(inner).__name__} (its own moment estimates)")
    return (f"`dgc` applies momentum correction itself (momentum={compressor.momentum}), "
            f"and the model trains with {what}: momentum is applied twice, which can cost "
            "accuracy. Train with plain SGD (momentum=0) under dgc, as its paper does, or "
            "give dgc momentum=0")
