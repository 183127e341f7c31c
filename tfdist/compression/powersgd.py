"""PowerSGD (Vogels et al. 2019): rank-r approximation by one step of power iteration.

A gradient matrix M (n x m; a tensor of rank > 2 is seen as prod(shape[:-1]) x shape[-1]) is
sent as two small factors in two all-reduce rounds:

    P = M Q            all-reduce P, orthonormalise it (P^)
    Q = M^T P^         all-reduce Q;   sum of the replicas' M ~ P^ Q^T

Q is kept for the next step (warm start), and with error feedback each replica keeps
M - P^ Q_own^T. Tensors where the factors would not be at least `min_compression_rate` times
smaller than the tensor (vectors, small matrices) are all-reduced as they are, as in
PyTorch's `powerSGD_hook`.

Payload per compressed matrix: (n + m) r float32 values (two rounds). PowerSGD needs both
rounds between all replicas, so it runs on the all-reduce strategies, not on the
parameter-server push.
"""

import tensorflow as tf

from tfdist._args import check_int
from tfdist._args import check_number
from tfdist.compression.base import Capabilities
from tfdist.compression.base import Compressor
from tfdist.compression.base import sum_payload_bytes


def matrix_shape(shape):
    dims = tf.TensorShape(shape).as_list()
    rows = 1
    for d in dims[:-1]:
        rows *= d
    return rows, dims[-1]


class PowerSGDCompressor(Compressor):
    """Low-rank gradient compression with warm start and error feedback.

    Args:
      rank: r, the rank of the approximation (PyTorch's `matrix_approximation_rank`).
      min_compression_rate: compress a matrix only if n m >= rate (n + m) r.
      seed: seed of the initial Q (the same on every replica and worker).
      error_feedback: keep M - P^ Q^T for the next step (default on).
    """

    name = "powersgd"
    # Q is made from the all-reduced factors: every replica holds it alike.
    CAPABILITIES = Capabilities(linear=True, elementwise=False, replicated_state={"q"},
                                rounds=2)

    def __init__(self, rank=1, min_compression_rate=2.0, seed=0, error_feedback=True,
                 **kwargs):
        super().__init__(error_feedback=error_feedback, **kwargs)
        self.rank = check_int("rank", rank, low=1)
        self.min_compression_rate = float(check_number(
            "min_compression_rate", min_compression_rate, "a number >= 1 (a tensor is "
            "compressed only if the factors are that much smaller)", low=1))
        self.seed = check_int("seed", seed)

    def compressible(self, shape, dtype):
        shape = tf.TensorShape(shape)
        if not tf.as_dtype(dtype).is_floating or shape.rank is None or shape.rank < 2:
            return False
        rows, cols = matrix_shape(shape)
        return rows * cols >= self.min_compression_rate * (rows + cols) * self.rank

    def state_spec(self, shape, dtype):
        _, cols = matrix_shape(shape)
        return {"q": ([cols, self.rank], tf.float32)}

    def initial_state(self, shape, dtype):
        state = super().initial_state(shape, dtype)
        if "q" in state:
            rows, cols = matrix_shape(shape)
            state["q"] = tf.random.stateless_normal([cols, self.rank],
                                                    seed=[self.seed, rows * 7919 + cols])
        return state

    def payload_bytes(self, shape, dtype):
        if not self.compressible(shape, dtype):
            return super().payload_bytes(shape, dtype)
        rows, cols = matrix_shape(shape)
        return (rows + cols) * self.rank * 4

    # Single-process form (one replica): the same arithmetic with no exchange.

    def _compress(self, tensor, state, key):
        del key
        matrix = tf.reshape(tf.cast(tensor, tf.float32), matrix_shape(tensor.shape))
        p = orthonormalize(matrix @ state["q"])
        q = tf.transpose(matrix) @ p
        return (p, q), {"q": q}

    def _decompress(self, payload, shape, dtype, key):
        del key
        p, q = payload
        return tf.reshape(tf.cast(p @ tf.transpose(q), dtype), shape)

    def payload_dtypes(self, dtype, shape=None):
        del dtype, shape
        return (tf.float32, tf.float32)

    # The two-round exchange (error feedback and the finite-value guard are the base's).

    def _exchange_rounds(self, compensated, states, communicator, key, dtypes):
        del key, dtypes  # the factors travel in float32 (`payload_dtypes`)
        devices = communicator.devices
        replicas = range(len(devices))
        units = range(len(compensated))
        matrices = [[None] * len(devices) for _ in units]
        for u in units:
            for r in replicas:
                with tf.device(devices[r]):
                    x = compensated[u][r]
                    matrices[u][r] = tf.reshape(tf.cast(x, tf.float32), matrix_shape(x.shape))
        ps = [[matrices[u][r] @ states[u][r]["q"] for u in units] for r in replicas]
        p_sums = communicator.all_reduce(ps)
        p_hats = [[None] * len(compensated) for _ in replicas]
        qs = [[None] * len(compensated) for _ in replicas]
        for r in replicas:
            with tf.device(devices[r]):
                for u in units:
                    p_hats[r][u] = orthonormalize(p_sums[r][u])
                    qs[r][u] = tf.transpose(matrices[u][r]) @ p_hats[r][u]
        q_sums = communicator.all_reduce(qs)
        sums = [[None] * len(devices) for _ in units]
        own = [[None] * len(devices) for _ in units]
        new_states = [[None] * len(devices) for _ in units]
        for u in units:
            for r in replicas:
                with tf.device(devices[r]):
                    x = compensated[u][r]
                    total = p_hats[r][u] @ tf.transpose(q_sums[r][u])
                    sums[u][r] = tf.reshape(tf.cast(total, x.dtype), x.shape)
                    own[u][r] = (p_hats[r][u], qs[r][u])  # decodes to this replica's part
                    new_states[u][r] = {"q": q_sums[r][u]}
        sent = sum_payload_bytes([ps[0], qs[0]])
        return sums, own, new_states, sent

    def get_config(self):
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate,
                "seed": self.seed, **super().get_config()}


def orthonormalize(matrix):
    """An orthonormal basis of the columns of `matrix` (thin QR; zero columns stay finite)."""
    q, _ = tf.linalg.qr(matrix)
    return q
