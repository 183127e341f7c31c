"""The Compressor interface, the error-feedback memory, and the communicator they talk to.

Compression is kept apart from communication (Horovod, GRACE): a compressor turns one tensor
into a *payload* (a tuple of tensors, the bytes that cross between workers) and back; an
`ErrorFeedback` memory keeps what a lossy compressor left out and adds it to the next
gradient; a `Communicator` (all-reduce, all-gather; see `tfdist.compression.exchange`, or the
parameter-server push) moves payloads. A compressor whose payloads can be summed before they
are decoded (`linear`) is all-reduced; every other payload is all-gathered and each replica's
part decoded, so that the bytes on the wire really shrink.

Compressors are functional: the state they keep between steps (residual, momentum, warm
start) is passed in and returned, and the caller keeps it in replica-local variables.
"""

import abc
import math

import tensorflow as tf

from tfdist._args import check_bool
from tfdist._args import check_int


class ErrorFeedback:
    """Error-feedback memory (Seide et al. 2014; Karimireddy et al. 2019).

    The residual is what was left out of the last payloads. The invariant, checked by the
    tests, is `sent + new_residual == gradient + old_residual`.
    """

    def compensate(self, tensor, residual):
        return tensor + residual

    def update(self, compensated, sent):
        return compensated - sent


class Compressor:
    """Turns one gradient tensor into a payload and back.

    Subclasses implement `_compress(tensor, state, key) -> (payload, new_state)`,
    `_decompress(payload, shape, dtype, key) -> tensor`, `payload_dtypes(dtype)` and
    `payload_bytes(shape, dtype)` (the documented size of one payload). `key` is an int64
    vector of two that is the same where a payload is made and where it is decoded (the
    exchange's step counter; on the ps path the push's step and worker rank): compressors
    that choose elements at random (random-k) derive their choice from it, so that the
    indices need not travel. They may override `_residual` (error feedback's new residual)
    and `_decompress_sum` (several payloads decoded and summed) with cheaper computations of
    the same values.

    Args (of every compressor):
      error_feedback: whether `encode` adds the residual of earlier steps and keeps the new
        one (default: on for lossy compressors).
      min_size: gradients with fewer elements (biases, normalisation scales) are sent as
        they are, uncompressed (default 0: every one is compressed).
      exclude: gradients of variables whose path contains one of these strings (e.g.
        `["bias", "embedding"]`) are sent uncompressed.

    Attributes:
      linear: payloads of several replicas can be summed, then decoded once (all-reduce).
      elementwise: the compressor treats a tensor as a flat vector, so the exchange may fuse
        gradients of one dtype into one vector first (one top-k over them).
      per_tensor: the compressor's scale or selection must be each gradient's own (a
        quantiser's norm, DGC's per-layer top-k): the exchange never fuses gradients.
      lossy: decoding does not give back the input exactly.
      replicated_state: names of the state every replica holds alike (PowerSGD's Q, DGC's
        step), saved once and broadcast from replica 0 after a restore.
      shared_key: the compressor draws choices from the step key that every replica must
        draw alike (random-k's indices, which do not travel).
    """

    name = None
    linear = False
    elementwise = True
    lossy = True
    variable_size = False  # the payload's size follows the data
    own_memory = False  # the compressor keeps its own residual (DGC's accumulation)
    per_tensor = False
    aggregate = "sum"  # how the replicas' payloads combine (signsgd_mv: "majority vote")
    replicated_state = frozenset()  # state every replica holds alike (saved once)
    shared_key = False  # choices drawn from the step key must agree across replicas

    def __init__(self, error_feedback=None, min_size=0, exclude=()):
        if error_feedback is None:
            error_feedback = self.lossy
        check_bool("error_feedback", error_feedback)
        check_int("min_size", min_size, "an integer >= 0 (elements)", low=0)
        if isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude):
            raise ValueError(f"`exclude` must be a list of strings (parts of variable paths). "
                             f"Received: {exclude!r}")
        self.error_feedback = error_feedback
        self.min_size = min_size
        self.exclude = tuple(exclude)
        self.memory = ErrorFeedback()

    def takes(self, path, shape, dtype):
        """Whether the exchange compresses the gradient of variable `path` (else sends it as
        it is): `compressible`, at least `min_size` elements, and not excluded by name."""
        if not self.compressible(shape, dtype):
            return False
        if _num_elements(shape) < self.min_size:
            return False
        return not any(part in (path or "") for part in self.exclude)

    # What subclasses implement -----------------------------------------------------------

    def _compress(self, tensor, state, key):
        del state, key
        return (tensor,), {}

    def _decompress(self, payload, shape, dtype, key):
        del key
        return tf.reshape(tf.cast(payload[0], dtype), shape)

    def _residual(self, compensated, payload, key):
        """What error feedback keeps: `compensated` minus what `payload` decodes to.

        Subclasses may compute the same tensor more cheaply (a sparsifier zeroes the sent
        elements instead of decoding and subtracting).
        """
        sent = self._decompress(payload, compensated.shape, compensated.dtype, key)
        return self.memory.update(compensated, sent)

    def _decompress_sum(self, payloads, shape, dtype, key):
        return tf.add_n([self._decompress(p, shape, dtype, key) for p in payloads])

    def _keep_rounding(self, new_state, exact, sent):
        """A compressor with its own memory (`own_memory`): `new_state` from `_compress`
        given that its payload `exact` travels as `sent` (in a narrower dtype), so that the
        memory keeps what the rounding left out, as `ErrorFeedback` does for the others."""
        del exact, sent
        return new_state

    def payload_dtypes(self, dtype, shape=None):
        """The dtypes of a payload's tensors, for a gradient of `dtype` (and `shape`: index
        payloads of tensors past 2^31 elements are int64)."""
        del shape
        return (tf.as_dtype(dtype),)

    def payload_bytes(self, shape, dtype):
        """The bytes of one payload for a gradient of `shape` and `dtype` (documented size).

        For compressors whose payload size depends on the data this is the upper bound; the
        telemetry always counts the bytes actually sent.
        """
        return _num_elements(shape) * tf.as_dtype(dtype).size

    def state_spec(self, shape, dtype):
        """Extra state this compressor keeps per tensor: `{name: (shape, dtype)}`, zeros."""
        del shape, dtype
        return {}

    def compressible(self, shape, dtype):
        """Whether tensors of this shape and dtype are compressed (else sent as they are)."""
        del shape
        return tf.as_dtype(dtype).is_floating

    # The public protocol -----------------------------------------------------------------

    def initial_state(self, shape, dtype):
        """The state of one tensor before the first step: zeros of `state_spec`."""
        if not self.compressible(shape, dtype):
            return {}
        spec = dict(self.state_spec(shape, dtype))
        if self.error_feedback and not self.own_memory:
            spec["residual"] = (shape, dtype)
        return {name: tf.zeros(s, d) for name, (s, d) in spec.items()}

    def compress(self, tensor, state=None, key=None, dtype=None):
        """Returns `(payload, new_state)` for `tensor` (error feedback included).

        `dtype` is the gradient's own dtype when `tensor` is its float32 copy (the exchange
        codes, and keeps state, in float32): the payload then travels in the dtypes
        `payload_dtypes(dtype)` declares (a float16 model's top-k values in float16), and
        error feedback keeps what that rounding left out too.
        """
        tensor = tf.convert_to_tensor(tensor)
        state = dict(self.initial_state(tensor.shape, tensor.dtype) if state is None else state)
        if not self.compressible(tensor.shape, tensor.dtype):
            return (tensor,), state
        key = _key(key)
        # A non-finite gradient (an fp16 overflow) leaves the state as it was, and its
        # payload's values come out NaN, so that the sums stay non-finite (a threshold never
        # passes a NaN) and a LossScaleOptimizer skips the step, as without compression.
        finite = tf.reduce_all(tf.math.is_finite(tensor))
        memory = self.error_feedback and not self.own_memory
        if memory:
            tensor = self.memory.compensate(tensor, state["residual"])
        payload, new_state = self._compress(tensor, state, key)
        if dtype is not None and tf.as_dtype(dtype) != tensor.dtype:
            exact = tuple(payload)
            payload = _cast_floats(payload, self.payload_dtypes(dtype, tensor.shape))
            if self.own_memory and self.error_feedback:
                new_state = self._keep_rounding(new_state, exact, payload)
        new_state = {**state, **new_state}
        if memory:
            new_state["residual"] = self._residual(tensor, tuple(payload), key)
        payload = tuple(tf.where(finite, p, tf.constant(float("nan"), p.dtype))
                        if p.dtype.is_floating else p for p in payload)
        new_state = {name: tf.where(finite, value, state[name]) if name in state else value
                     for name, value in new_state.items()}
        return payload, new_state

    def decompress(self, payload, shape, dtype, key=None):
        """The tensor of `shape` and `dtype` that `payload` stands for."""
        if not self.compressible(shape, dtype):
            return tf.reshape(payload[0], shape)
        return self._decompress(tuple(payload), tf.TensorShape(shape), tf.as_dtype(dtype),
                                _key(key))

    def decompress_sum(self, payloads, shape, dtype, key=None):
        """The sum of what several replicas' `payloads` decode to (one decode if possible).

        What a replica does with an all-gather's parts. Sparse compressors add all parts'
        values in one scatter instead of decoding each part to a dense tensor.
        """
        payloads = [tuple(p) for p in payloads]
        if not self.compressible(shape, dtype):
            return tf.reshape(tf.add_n([p[0] for p in payloads]), shape)
        if len(payloads) == 1:
            return self.decompress(payloads[0], shape, dtype, key)
        return self._decompress_sum(payloads, tf.TensorShape(shape), tf.as_dtype(dtype),
                                    _key(key))

    def exchange(self, tensors, states, communicator, key, dtypes=None):
        """Sums `tensors` over every replica of the job through `communicator`.

        Args:
          tensors: one list per unit (a gradient or a fused vector) of this process's
            replicas' tensors, `tensors[unit][replica]`.
          states: the states of the same units and replicas.
          communicator: moves payloads (`all_reduce`, `all_gather`).
          key: the step key, the same on every replica.
          dtypes: per unit, the gradients' own dtype, in which payload values travel (see
            `compress`); None: the tensors' dtype.

        Returns:
          `(sums, new_states, sent_bytes)`: `sums[unit][replica]` the sum over all replicas,
          the new states, and the bytes one replica sent (a scalar tensor).
        """
        payloads = [[None] * len(unit) for unit in tensors]
        new_states = [[None] * len(unit) for unit in tensors]
        devices = communicator.devices
        for u, unit in enumerate(tensors):
            for r, tensor in enumerate(unit):
                with tf.device(devices[r]):
                    payloads[u][r], new_states[u][r] = self.compress(
                        tensor, states[u][r], key, None if dtypes is None else dtypes[u])
        sent = sum_payload_bytes([p[0] for p in payloads])
        # Every unit's payload tensors go in one collective call: summed when the payloads
        # are linear (decoded once), else gathered (each replica's part decoded, then summed).
        flat = [[t for unit in payloads for t in unit[r]] for r in range(len(devices))]
        if self.linear:
            received = [[tensors_r] for tensors_r in communicator.all_reduce(flat)]
        else:
            # [local][global replica][tensor]
            received = communicator.all_gather(flat, sizes_vary=self.variable_size)
        sums = [[None] * len(unit) for unit in tensors]
        for r in range(len(devices)):
            at = 0
            for u, unit in enumerate(tensors):
                n = len(payloads[u][r])
                with tf.device(devices[r]):
                    sums[u][r] = self.decompress_sum([part[at:at + n] for part in received[r]],
                                                     unit[r].shape, unit[r].dtype, key)
                at += n
        return sums, new_states, sent

    # Configuration -----------------------------------------------------------------------

    def get_config(self):
        return {"error_feedback": self.error_feedback, "min_size": self.min_size,
                "exclude": list(self.exclude)}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Communicator(abc.ABC):
    """Moves payloads between the replicas of a job (TF collectives or cross-device copies).

    `devices` are this process's replica devices; `num_replicas` counts every replica of
    the job. Both methods take one list of tensors per local replica.
    """

    devices = ()
    num_replicas = 1

    @abc.abstractmethod
    def all_reduce(self, tensors):
        """Returns, per local replica, the element-wise sums over all replicas."""

    @abc.abstractmethod
    def all_gather(self, tensors, sizes_vary=False):
        """Returns, per local replica, every replica's list of tensors (global order).

        With `sizes_vary` (or shapes unknown at trace time) the tensors' first dimension
        may differ between replicas; they then come back flat.
        """


def sum_payload_bytes(payloads):
    """The bytes in a list of payloads (a scalar int64 tensor, counted at run time)."""
    total = tf.constant(0, tf.int64)
    for payload in payloads:
        for t in payload:
            total += tf.size(t, out_type=tf.int64) * t.dtype.size
    return total


def _cast_floats(payload, dtypes):
    """`payload` with each floating tensor cast to its declared floating dtype."""
    return tuple(saturating_cast(t, d) if t.dtype.is_floating and d.is_floating
                 and t.dtype != d else t for t, d in zip(payload, dtypes))


def saturating_cast(tensor, dtype):
    """`tensor` cast to `dtype`, a finite value past `dtype`'s range sent as its largest.

    What error feedback sends then stays finite and the excess waits in its residual: a
    residual grown past float16's 65504 would otherwise go out as an infinity and come back
    as -inf, then NaN, for good. (A non-finite input stays non-finite.)
    """
    dtype = tf.as_dtype(dtype)
    if dtype.max < tensor.dtype.max:
        finite = tf.math.is_finite(tensor)
        tensor = tf.where(finite, tf.clip_by_value(tensor, dtype.min, dtype.max), tensor)
    return tf.cast(tensor, dtype)


def _num_elements(shape):
    return int(math.prod(tf.TensorShape(shape).as_list()))


def _key(key):
    if key is None:
        return tf.zeros([2], tf.int64)
    if isinstance(key, tf.Tensor) and key.dtype == tf.int64 and key.shape == [2]:
        return key  # the same tensor, so that what is derived from it can be reused
    return tf.cast(tf.reshape(key, [2]), tf.int64)


def num_selected(size, ratio):
    """How many of `size` elements a sparsifier with `ratio` sends: max(1, floor(ratio*size))."""
    return max(1, int(math.floor(ratio * size)))
