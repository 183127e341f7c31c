"""Compressors that keep every element at fewer bits: casts, sign and stochastic quantisers.

Payload sizes are for a gradient of n elements (b bytes each):

| name | payload | bytes | linear |
|---|---|---|---|
| `none` | the gradient | n b | yes |
| `fp16` | float16 cast | 2 n | yes |
| `bf16` | bfloat16 cast | 2 n | yes |
| `onebit` | sign bits + mean of the positive and of the negative entries | ceil(n/8) + 8 | no |
| `signsgd` | sign bits + mean absolute value | ceil(n/8) + 4 | no |
| `signsgd_mv` | as `signsgd`; the replicas' signs combined by majority vote | ceil(n/8) + 4 | no |
| `terngrad` | 2-bit ternary codes + max |x| (clipped at 2.5 rms) | ceil(n/4) + 4 | no |
| `qsgd` | int8 signed levels + the L2 norm of each bucket of d (512) | n + 4 ceil(n/d) | no |
"""

import abc
import math

import numpy as np
import tensorflow as tf

from tfdist._args import check_int
from tfdist._args import check_number
from tfdist.compression.base import Capabilities
from tfdist.compression.base import Compressor
from tfdist.compression.base import saturating_cast

# Lookup tables (byte -> its 8 bits / its 4 ternary values) are made on first use: a tensor
# made at import would start TF's context before a multi-worker strategy configures it.
_TABLES = {}


def _table(name):
    if name not in _TABLES:
        byte = np.arange(256, dtype=np.uint8)[:, None]
        if name == "bits":
            _TABLES[name] = np.unpackbits(byte, axis=1).astype(np.float32)
        else:  # 2-bit codes, minus one: TernGrad's 0, 1, 2 stand for -1, 0, 1
            codes = (byte >> np.array([6, 4, 2, 0], np.uint8)) & 3
            _TABLES[name] = codes.astype(np.float32) - 1
    return tf.constant(_TABLES[name])


def _pack(codes, per_byte):
    """Packs a float vector of small integer codes into uint8, `per_byte` codes per byte.

    The first code takes the most significant bits. A byte is the dot product of its codes
    with the place values (exact in float32), so packing is one matrix-vector product, about
    twice as fast on CPU as shifting and summing uint8 lanes.
    """
    codes = tf.reshape(codes, [-1])
    codes = tf.pad(codes, [[0, (per_byte - tf.size(codes) % per_byte) % per_byte]])
    bits = 8 // per_byte
    places = tf.constant([2.0 ** (bits * i) for i in reversed(range(per_byte))], tf.float32)
    return tf.cast(tf.linalg.matvec(tf.reshape(codes, [-1, per_byte]), places), tf.uint8)


def _unpack(name, packed, size):
    return tf.reshape(tf.gather(_table(name), tf.cast(packed, tf.int32)), [-1])[:size]


def pack_bits(bits):
    """Packs a boolean vector into uint8, eight per byte (most significant first)."""
    return _pack(tf.cast(bits, tf.float32), 8)


def unpack_bits(packed, size):
    """The first `size` booleans of a `pack_bits` vector (one table lookup)."""
    return _unpack("bits", packed, size) > 0


def pack_pairs(codes):
    """Packs a vector of 2-bit codes (ints 0..3) into uint8, four per byte."""
    return _pack(tf.cast(codes, tf.float32), 4)


def unpack_pairs(packed, size):
    """The first `size` 2-bit codes of a `pack_pairs` vector (one table lookup)."""
    return tf.cast(_unpack("pairs", packed, size), tf.int32) + 1


def _size(shape):
    return int(math.prod(shape.as_list()))


class NoCompression(Compressor):
    """Sends the gradient as it is (the reference for every ratio)."""

    name = "none"
    CAPABILITIES = Capabilities(linear=True, lossy=False)


class FP16Compressor(Compressor):
    """Casts to float16 for the exchange and back (Horovod's `Compression.fp16`).

    Linear: the float16 payloads are all-reduced. Payload: 2 bytes per element.
    """

    name = "fp16"
    CAPABILITIES = Capabilities(linear=True)
    wire_dtype = tf.float16

    def __init__(self, error_feedback=False, **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)

    def _compress(self, tensor, state, key):
        del state, key
        if tensor.dtype == self.wire_dtype:
            return (tensor,), {}
        if self.error_feedback:  # (the excess over float16's range waits in the residual)
            return (saturating_cast(tensor, self.wire_dtype),), {}
        return (tf.cast(tensor, self.wire_dtype),), {}

    def payload_dtypes(self, dtype, shape=None):
        del dtype, shape
        return (self.wire_dtype,)

    def payload_bytes(self, shape, dtype):
        return _size(tf.TensorShape(shape)) * self.wire_dtype.size

    def compressible(self, shape, dtype):
        dtype = tf.as_dtype(dtype)
        return dtype.is_floating and dtype.size > self.wire_dtype.size


class BF16Compressor(FP16Compressor):
    """Casts to bfloat16 (float32's exponent range, 8 bits of mantissa). 2 bytes per element."""

    name = "bf16"
    wire_dtype = tf.bfloat16


class _SignBitsCompressor(Compressor, abc.ABC):
    """Sends each element's sign as one bit, plus `num_scales` float32 reconstruction values.

    A set bit decodes to `high`, a clear one to `low` (from `_levels`).
    Payload: ceil(n/8) bytes of bits + 4 * num_scales bytes.
    """

    num_scales = 1
    CAPABILITIES = Capabilities(per_tensor=True)  # the scales are each tensor's own

    @abc.abstractmethod
    def _scales(self, flat, positive):
        """The float32 values sent with the bits, shape [num_scales] (`positive`: x >= 0)."""

    @abc.abstractmethod
    def _levels(self, scales):
        """(high, low): what a set and a clear bit decode to."""

    def _compress(self, tensor, state, key):
        del state, key
        flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
        positive = tf.cast(flat >= 0, tf.float32)
        return (_pack(positive, 8), self._scales(flat, positive)), {}

    def _decompress(self, payload, shape, dtype, key):
        del key
        bits, scales = payload
        high, low = self._levels(scales)
        flat = tf.where(_unpack("bits", bits, _size(shape)) > 0, high, low)
        return tf.reshape(tf.cast(flat, dtype), shape)

    def _residual(self, compensated, payload, key):
        # What the payload decodes to, from the signs at hand instead of the packed bits.
        high, low = self._levels(payload[1])
        flat = tf.cast(compensated, tf.float32)
        sent = tf.cast(tf.where(flat >= 0, high, low), compensated.dtype)
        return self.memory.update(compensated, sent)

    def payload_dtypes(self, dtype, shape=None):
        del dtype, shape
        return (tf.uint8, tf.float32)

    def payload_bytes(self, shape, dtype):
        return math.ceil(_size(tf.TensorShape(shape)) / 8) + 4 * self.num_scales


class OneBitCompressor(_SignBitsCompressor):
    """1-bit quantisation with error feedback (Seide et al. 2014).

    Each element is sent as its sign; a positive one decodes to the mean of the positive
    entries, a negative one to the mean of the negative entries (the two reconstruction
    values of the paper). Payload: ceil(n/8) bytes of bits + 8 bytes.
    """

    name = "onebit"
    num_scales = 2

    def _scales(self, flat, positive):
        count = tf.reduce_sum(positive)
        size = tf.cast(tf.size(flat), tf.float32)
        positive_sum = tf.reduce_sum(tf.nn.relu(flat))
        negative_sum = tf.reduce_sum(tf.minimum(flat, 0.0))
        return tf.stack([tf.math.divide_no_nan(positive_sum, count),
                         tf.math.divide_no_nan(negative_sum, size - count)])

    def _levels(self, scales):
        return scales[0], scales[1]


class SignSGDCompressor(_SignBitsCompressor):
    """Scaled sign (EF-SignSGD, Karimireddy et al. 2019): sign(x) * mean|x|.

    Payload: ceil(n/8) bytes of bits + 4 bytes of scale.
    """

    name = "signsgd"

    def _scales(self, flat, positive):
        del positive
        return tf.reduce_mean(tf.abs(flat))[None]

    def _levels(self, scales):
        return scales[0], -scales[0]


class MajorityVoteCompressor(SignSGDCompressor):
    """signSGD with majority vote (Bernstein et al. 2018, 2019).

    Each replica sends the signs of its gradient (and its mean |x|); every replica then takes
    the sign the majority voted for, element by element, as the direction of the update: a
    replica's wrong or adversarial signs are outvoted, and only one bit per element per
    replica crosses the network. What comes back stands for the sum of the replicas'
    gradients: the vote times the sum of their mean magnitudes (a tie gives 0). Without error
    feedback by default, as in the paper (whose update is lr * vote: set the learning rate
    for a step of mean |g| per replica). Payload as `signsgd`: ceil(n/8) + 4 bytes; all-gathered.
    Not on the parameter-server push path (the ps sums decoded pushes; it takes no vote).
    """

    name = "signsgd_mv"
    CAPABILITIES = Capabilities(per_tensor=True, aggregate="majority vote")

    def __init__(self, error_feedback=False, **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)

    def _decompress_sum(self, payloads, shape, dtype, key):
        del key
        size = _size(shape)
        votes = tf.add_n([_unpack("bits", bits, size) * 2 - 1 for bits, _ in payloads])
        scale = tf.add_n([scales[0] for _, scales in payloads])
        return tf.reshape(tf.cast(tf.sign(votes) * scale, dtype), shape)


class TernGradCompressor(Compressor):
    """TernGrad (Wen et al. 2017): s * t with t in {-1, 0, 1}, s = max|x|, per tensor.

    Each gradient is first clipped at `clip` times its root mean square (the paper's c = 2.5
    standard deviations of its zero-mean gradients; about 0 rather than about the mean, so
    that a one-element or constant gradient is not clipped to 0): a few large elements would
    otherwise set a scale at which almost every other element rounds to 0. Then
    t_i = sign(x_i) with probability |x_i| / s, else 0, unbiased for the clipped gradient.
    Error feedback is off by default, as in the paper. Payload: ceil(n/4) bytes of
    2-bit codes + 4 bytes of scale.

    Args:
      clip: c, clip at c * sqrt(mean(x^2)) before ternarising; None: no clipping (then
        unbiased).
    """

    name = "terngrad"
    CAPABILITIES = Capabilities(per_tensor=True)  # the scale is each tensor's own max

    def __init__(self, clip=2.5, error_feedback=False, **kwargs):
        check_number("clip", clip, "None or a positive number of standard deviations", low=0,
                     low_open=True, allow_none=True)
        super().__init__(error_feedback=error_feedback, **kwargs)
        self.clip = None if clip is None else float(clip)

    def _compress(self, tensor, state, key):
        del state, key
        flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
        if self.clip is not None:
            bound = self.clip * tf.sqrt(tf.reduce_mean(tf.square(flat)))
            flat = tf.clip_by_value(flat, -bound, bound)
        magnitude = tf.abs(flat)
        scale = tf.reduce_max(magnitude)
        # P(keep) = |x| / s, without a division (s = 0 keeps nothing).
        keep = tf.random.uniform(tf.shape(flat)) * scale < magnitude
        codes = tf.where(keep, tf.sign(flat) + 1, 1.0)  # 0, 1, 2 for -1, 0, 1
        return (_pack(codes, 4), scale[None]), {}

    def _decompress(self, payload, shape, dtype, key):
        del key
        codes, scale = payload
        flat = _unpack("pairs", codes, _size(shape)) * scale[0]
        return tf.reshape(tf.cast(flat, dtype), shape)

    def payload_dtypes(self, dtype, shape=None):
        del dtype, shape
        return (tf.uint8, tf.float32)

    def payload_bytes(self, shape, dtype):
        return math.ceil(_size(tf.TensorShape(shape)) / 4) + 4

    def get_config(self):
        return {"clip": self.clip, **super().get_config()}


class QSGDCompressor(Compressor):
    """QSGD (Alistarh et al. 2017): ||x||_b * sign(x) * l / s per bucket b, unbiased.

    The gradient is cut into buckets of `bucket_size` elements (the paper's d = 512), each
    quantised against its own L2 norm: one large element then coarsens only its bucket.
    l is stochastic in 0..s with E[l / s] = |x| / ||x||_b.

    Args:
      levels: s, the number of quantisation levels per sign, 1..127 (int8 codes).
      bucket_size: d, elements per bucket (default 512); None: one bucket per tensor.
      error_feedback: off by default (QSGD is unbiased).

    Payload: n bytes of int8 codes + 4 bytes of norm per bucket.
    """

    name = "qsgd"
    CAPABILITIES = Capabilities(per_tensor=True)  # the norms are each tensor's own

    def __init__(self, levels=127, bucket_size=512, error_feedback=False, **kwargs):
        check_int("levels", levels, "an integer between 1 and 127 (int8 codes)", low=1,
                  high=127)
        check_int("bucket_size", bucket_size, "None or a positive integer (elements)", low=1,
                  allow_none=True)
        super().__init__(error_feedback=error_feedback, **kwargs)
        self.levels = levels
        self.bucket_size = bucket_size

    def _width(self, size):
        return max(1, size if self.bucket_size is None else min(self.bucket_size, size))

    @staticmethod
    def _rows(flat, width):
        """`flat` zero-padded to whole buckets, one per row."""
        pad = (width - tf.size(flat) % width) % width
        return tf.reshape(tf.pad(flat, [[0, pad]]), [-1, width])

    def _compress(self, tensor, state, key):
        del state, key
        flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
        size = flat.shape.num_elements()
        width = self._width(size) if size is not None else self.bucket_size
        if width is None:  # one bucket of a size known only at run time
            rows = flat[None, :]
        else:
            rows = self._rows(flat, width)
        norms = tf.norm(rows, axis=1)
        scaled = tf.abs(rows) * tf.math.divide_no_nan(float(self.levels), norms[:, None])
        level = tf.minimum(tf.floor(scaled + tf.random.uniform(tf.shape(rows))), self.levels)
        codes = tf.cast(tf.where(rows < 0, -level, level), tf.int8)
        return (tf.reshape(codes, [-1])[:tf.size(flat)], norms), {}

    def _decompress(self, payload, shape, dtype, key):
        del key
        codes, norms = payload
        size = _size(shape)
        rows = self._rows(tf.cast(codes, tf.float32), self._width(size))
        flat = tf.reshape(rows * (norms[:, None] / self.levels), [-1])[:size]
        return tf.reshape(tf.cast(flat, dtype), shape)

    def payload_dtypes(self, dtype, shape=None):
        del dtype, shape
        return (tf.int8, tf.float32)

    def payload_bytes(self, shape, dtype):
        size = _size(tf.TensorShape(shape))
        return size + 4 * math.ceil(size / self._width(size))

    def get_config(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size,
                **super().get_config()}
