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
import dataclasses
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


_AGGREGATES = ("sum", "majority vote")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a compressor's payloads allow: the one value the exchanges read about a codec.

    Each `Compressor` subclass declares its own as `CAPABILITIES`; an instance's
    `capabilities` is that value as its configuration sets it (`topk`'s `per_tensor`
    argument, `dgc`'s warm-up). Every field says what the exchanges (the all-reduce
    strategies' `GradientExchange`, the parameter-server push) do with it.

    Attributes:
      linear: payloads of several replicas can be summed element by element, then decoded
        once: the all-reduce exchange sums them (one all-reduce); otherwise it all-gathers
        every replica's payload and each replica decodes the parts and sums them.
      elementwise: the compressor treats a tensor as a flat vector: the all-reduce exchange
        may fuse the gradients of one dtype into one vector (buckets, one top-k over them),
        and the ps push codes a shard's flat vector. False (PowerSGD's matrices): each
        gradient is coded alone in its own shape, and the ps push refuses the compressor.
      per_tensor: the compressor's scale or selection must be each gradient's own (a
        quantiser's norm, DGC's per-layer top-k): neither the exchange nor the ps push
        fuses gradients.
      lossy: decoding does not give back the input exactly: error feedback is on by
        default (the constructor's `error_feedback=None`).
      variable_size: a payload's size follows the data (threshold, DGC's warm-up): the
        all-gather sends the sizes first, and an XLA-compiled step is refused.
      own_memory: the compressor keeps what it left out in its own state (DGC's
        accumulation): no `residual` state is made and `ErrorFeedback` is not applied; a
        payload rounded to a narrower dtype goes through `_keep_rounding` instead.
      aggregate: how the replicas' payloads combine: "sum", or "majority vote" (signsgd_mv:
        every replica decodes every part, so the ps push, which averages, refuses it).
      replicated_state: names of state every replica holds alike (PowerSGD's Q, DGC's
        step): saved once, and broadcast from the first replica between workers after a
        start or a restore.
      shared_key: choices drawn from the step key must agree across replicas (random-k's
        indices, which do not travel): the step counter is broadcast between workers after
        a start or a restore, like `replicated_state`.
      rounds: the collective rounds of one exchange. 1: each replica compresses, one
        all-reduce or all-gather, each decodes. More (PowerSGD: two all-reduces): the
        compressor implements `_exchange_rounds`, the exchange keeps error feedback and
        the finite-value guard, and the ps push (one message per step) refuses it.
    """

    linear: bool = False
    elementwise: bool = True
    per_tensor: bool = False
    lossy: bool = True
    variable_size: bool = False
    own_memory: bool = False
    aggregate: str = "sum"
    replicated_state: frozenset = frozenset()
    shared_key: bool = False
    rounds: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.type is bool:
                check_bool(field.name, getattr(self, field.name))
        if self.aggregate not in _AGGREGATES:
            raise ValueError(f"`aggregate` must be one of {list(_AGGREGATES)}. Received: "
                             f"{self.aggregate!r}")
        if isinstance(self.replicated_state, str) or not all(
                isinstance(name, str) for name in self.replicated_state):
            raise ValueError(f"`replicated_state` must be a set of state names. Received: "
                             f"{self.replicated_state!r}")
        object.__setattr__(self, "replicated_state", frozenset(self.replicated_state))
        check_int("rounds", self.rounds, "an integer >= 1 (collective rounds)", low=1)


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

    What the exchanges may do with a compressor's payloads (sum them, fuse gradients, ...)
    is declared once per class as `CAPABILITIES` (a `Capabilities`); `capabilities` is an
    instance's. A compressor with several collective rounds (PowerSGD) implements
    `_exchange_rounds`; `exchange` keeps error feedback and the finite-value guard for it.
    """

    name = None
    CAPABILITIES = Capabilities()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.CAPABILITIES, Capabilities):
            raise TypeError(f"{cls.__name__}.CAPABILITIES must be a "
                            f"tfdist.compression.Capabilities. Received: {cls.CAPABILITIES!r}")
        if (cls.CAPABILITIES.rounds > 1
                and cls._exchange_rounds is Compressor._exchange_rounds):
            raise TypeError(f"{cls.__name__} declares {cls.CAPABILITIES.rounds} rounds of "
                            f"exchange: it must implement `_exchange_rounds`")

    def __init__(self, error_feedback=None, min_size=0, exclude=()):
        if error_feedback is None:
            # (The class's: a subclass's configuration is not set yet.)
            error_feedback = type(self).CAPABILITIES.lossy
        check_bool("error_feedback", error_feedback)
        check_int("min_size", min_size, "an integer >= 0 (elements)", low=0)
        if isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude):
            raise ValueError(f"`exclude` must be a list of strings (parts of variable paths). "
                             f"Received: {exclude!r}")
        self.error_feedback = error_feedback
        self.min_size = min_size
        self.exclude = tuple(exclude)
        self.memory = ErrorFeedback()

    @property
    def capabilities(self):
        """This compressor's `Capabilities`: its class's `CAPABILITIES`, as its
        configuration sets them (subclasses whose arguments change one override this)."""
        return type(self).CAPABILITIES

    @property
    def _uses_memory(self):
        """Whether `ErrorFeedback` keeps this compressor's residual."""
        return self.error_feedback and not self.capabilities.own_memory

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
        """A compressor with its own memory (`capabilities.own_memory`): `new_state` from
        `_compress` given that its payload `exact` travels as `sent` (in a narrower dtype), so
        that the memory keeps what the rounding left out, as `ErrorFeedback` does for the
        others."""
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
        if self._uses_memory:
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
        finite = tf.reduce_all(tf.math.is_finite(tensor))
        tensor = self._compensate(tensor, state)
        payload, new_state = self._compress(tensor, state, key)
        if dtype is not None and tf.as_dtype(dtype) != tensor.dtype:
            exact = tuple(payload)
            payload = _cast_floats(payload, self.payload_dtypes(dtype, tensor.shape))
            if self.capabilities.own_memory and self.error_feedback:
                new_state = self._keep_rounding(new_state, exact, payload)
        new_state = {**state, **new_state}
        if self._uses_memory:
            new_state["residual"] = self._residual(tensor, tuple(payload), key)
        return self._guard_non_finite(finite, payload, new_state, state)

    def _compensate(self, tensor, state):
        """`tensor` plus the residual of earlier steps (error feedback), if kept."""
        if not self._uses_memory:
            return tensor
        return self.memory.compensate(tensor, state["residual"])

    def _guard_non_finite(self, finite, payload, new_state, state):
        """`(payload, new_state)` of a gradient that was not all `finite` (an fp16 overflow):
        the state stays as it was, and the payload's values come out NaN so that the sums
        stay non-finite (a threshold never passes a NaN) and a LossScaleOptimizer skips the
        step, as without compression."""
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
        if self.capabilities.rounds > 1:
            return self._exchange_compensated(tensors, states, communicator, key, dtypes)
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
        if self.capabilities.linear:
            received = [[tensors_r] for tensors_r in communicator.all_reduce(flat)]
        else:
            # [local][global replica][tensor]
            received = communicator.all_gather(flat,
                                               sizes_vary=self.capabilities.variable_size)
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

    def _exchange_compensated(self, tensors, states, communicator, key, dtypes):
        """`exchange` for a compressor of several rounds: error feedback and the
        finite-value guard around its `_exchange_rounds`."""
        devices = communicator.devices
        finite = [[None] * len(unit) for unit in tensors]
        compensated = [[None] * len(unit) for unit in tensors]
        for u, unit in enumerate(tensors):
            for r, tensor in enumerate(unit):
                with tf.device(devices[r]):
                    tensor = tf.convert_to_tensor(tensor)
                    finite[u][r] = tf.reduce_all(tf.math.is_finite(tensor))
                    compensated[u][r] = self._compensate(tensor, states[u][r])
        sums, own, rounds_states, sent = self._exchange_rounds(
            compensated, states, communicator, key, dtypes)
        new_states = [[None] * len(unit) for unit in tensors]
        for u, unit in enumerate(tensors):
            for r in range(len(unit)):
                with tf.device(devices[r]):
                    new_state = {**states[u][r], **rounds_states[u][r]}
                    if self._uses_memory:
                        new_state["residual"] = self._residual(compensated[u][r], own[u][r],
                                                               key)
                    # A non-finite gradient anywhere makes the sum non-finite on every
                    # replica: each keeps its state (the state every replica holds alike
                    # stays alike), and the sum goes on for the loss-scale logic.
                    finite[u][r] = tf.logical_and(
                        finite[u][r], tf.reduce_all(tf.math.is_finite(sums[u][r])))
                    _, new_states[u][r] = self._guard_non_finite(
                        finite[u][r], (), new_state, states[u][r])
        return sums, new_states, sent

    def _exchange_rounds(self, compensated, states, communicator, key, dtypes):
        """The collective rounds of a compressor with `capabilities.rounds > 1`.

        Args:
          compensated: `compensated[unit][replica]`, the tensors with error feedback's
            residual added (`exchange`'s layout).
          states: their states (the residual is `exchange`'s to update).
          communicator, key, dtypes: as for `exchange`.

        Returns:
          `(sums, own, new_states, sent_bytes)`: the decoded sums over every replica, per
          unit and replica the payload that stands for what this replica sent (error
          feedback keeps `compensated` minus what it decodes to), the state this compressor
          changes, and the bytes one replica sent.
        """
        del compensated, states, communicator, key, dtypes
        raise TypeError(f"{type(self).__name__} exchanges in one round: `exchange` does not "
                        f"call `_exchange_rounds`")

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
