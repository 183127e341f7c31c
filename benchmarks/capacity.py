"""A small capacity model: projected step time of each exchange at 8 to 1024 workers.

Inputs, all measured on this machine except the network:

* `compute_s`: one worker's compute per step (forward, backward, its share of the optimizer);
* `per_push_s`: what one more worker adds to an update of the parameter server on this
  machine (the updater's serial work per push plus core sharing), fitted by least squares to
  the measured hard-sync update rates;
* `model_bytes`: 4 x parameters (float32);
* `bandwidth_bytes_s`, `latency_s`: the network assumed past one machine (flags).

Per update (one step of every worker for the synchronous exchanges), with M workers and S ps
tasks, B = model_bytes:

    parameter server, hard sync   T = c + H(M, M) j c + M (2B / S) / bw + 2 lat + M p
    soft sync, N of M             T = c + H(M, N) j c + N (2B / S) / bw + 2 lat + N p
    ring all-reduce               T = c + H(M, M) j c + 2 (M - 1) / M B / bw + 2 (M - 1) lat
    compressed all-gather, x r    T = c + H(M, M) j c + (M - 1) (B / r) / bw + (M - 1) lat + e

H(M, N) = sum_{i=M-N+1..M} 1/i is the expected N-th fastest of M exponential delays (the
straggler tail, relative jitter j); a ps task receives N gradients and sends N models per
update (so its link carries 2NB/S); ring all-reduce moves 2(M-1)/M of the model through every
link; all-gather of payloads compressed r times moves (M-1)/M of all M payloads; e is the
encode + decode time. p is the ps's serial work per push (measured here); a synchronous
all-reduce has no central server. The on-machine check compares the parameter-server line,
with bandwidth terms dropped (loopback), against the measured update rates at 2 to 8 workers.
"""

import dataclasses
import math


def expected_order_statistic(m, n):
    """E of the n-th smallest of m i.i.d. unit exponentials: sum_{i=m-n+1}^{m} 1/i."""
    return sum(1.0 / i for i in range(m - n + 1, m + 1))


@dataclasses.dataclass
class CapacityModel:
    compute_s: float
    per_push_s: float
    model_bytes: float
    bandwidth_bytes_s: float = 10e9 / 8
    latency_s: float = 50e-6
    jitter: float = 0.1
    num_ps: int = 1
    compression_ratio: float = 100.0
    codec_s: float = 0.0

    def _tail(self, m, n):
        return self.compute_s * (1 + self.jitter * expected_order_statistic(m, n))

    def parameter_server(self, m, n=None):
        n = m if n is None else n
        transfer = n * 2 * self.model_bytes / self.num_ps / self.bandwidth_bytes_s
        return self._tail(m, n) + transfer + 2 * self.latency_s + n * self.per_push_s

    def ring_all_reduce(self, m):
        transfer = 2 * (m - 1) / m * self.model_bytes / self.bandwidth_bytes_s
        return self._tail(m, m) + transfer + 2 * (m - 1) * self.latency_s

    def compressed_all_gather(self, m):
        transfer = (m - 1) * self.model_bytes / self.compression_ratio / self.bandwidth_bytes_s
        return self._tail(m, m) + transfer + (m - 1) * self.latency_s + self.codec_s

    def projections(self, worker_counts, soft_fraction=0.9):
        rows = []
        for m in worker_counts:
            n = max(1, math.floor(soft_fraction * m))
            rows.append({
                "workers": m,
                "ps_hard_sync_s": self.parameter_server(m),
                f"ps_soft_sync_{soft_fraction:g}_s": self.parameter_server(m, n),
                "ring_all_reduce_s": self.ring_all_reduce(m),
                f"compressed_all_gather_x{self.compression_ratio:g}_s":
                    self.compressed_all_gather(m),
            })
        return rows


def fit_local(rates):
    """Fits compute and per-push cost from measured hard-sync update rates on this machine.

    Least squares of 1 / rate(M) = compute_s + M * per_push_s over every measured M. On a
    machine whose few cores every worker shares, the per-push term also absorbs that sharing,
    so a projection from it is pessimistic for the parameter-server lines.

    Args:
      rates: {workers: updates per second}, with at least two worker counts.

    Returns:
      (compute_s, per_push_s).
    """
    ms = sorted(rates)
    ts = [1.0 / rates[m] for m in ms]
    mean_m, mean_t = sum(ms) / len(ms), sum(ts) / len(ts)
    var = sum((m - mean_m) ** 2 for m in ms)
    per_push = sum((m - mean_m) * (t - mean_t) for m, t in zip(ms, ts)) / var
    per_push = max(per_push, 1e-6)
    return max(mean_t - per_push * mean_m, 1e-6), per_push


def check_local(rates, compute_s, per_push_s):
    """Predicted vs measured step time on this machine (loopback: no bandwidth term)."""
    rows = []
    for m, rate in sorted(rates.items()):
        predicted = compute_s + m * per_push_s
        rows.append({"workers": m, "measured_s": 1.0 / rate, "predicted_s": predicted,
                     "error": predicted * rate - 1.0})
    return rows
