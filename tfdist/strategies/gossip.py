"""The decentralised family: Stochastic Gradient Push (Assran et al., ICML 2019).

No server: every worker process runs the user's `model.fit` on its own copy of the model and
talks to a few peers per step, on TF's own runtime. The engine (the step's push-sum gossip,
`join`'s final average) is `tfdist.gossip.engine`.
"""


import tensorflow as tf

from tfdist._worker import WorkerTasksMixin
from tfdist.gossip.engine import StochasticGradientPushExtended


class StochasticGradientPushStrategy(WorkerTasksMixin, tf.distribute.Strategy):
    """Stochastic Gradient Push: decentralised training, each worker pushing to a few peers.

    Every worker process runs the user's own `model.fit` on its own copy of the model (on
    its GPU when it has one); there is no parameter server. A step takes the user's
    optimizer step on x = w z with the gradient at the de-biased weights z (the model's
    weights), then push-sum gossip: the worker keeps 1/(p+1) of (x, w), sends 1/(p+1) to each
    of its p out-peers, and adds the shares it received. The weights of all the workers
    approach their average (Assran et al., "Stochastic Gradient Push for Distributed Deep
    Learning", ICML 2019). The optimizer's state stays with each worker.

    ```python
    strategy = tfdist.strategies.StochasticGradientPushStrategy()   # cluster from TF_CONFIG
    keras.utils.set_random_seed(0)   # the same initial weights on every worker: none are sent
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    strategy.join()   # every worker ends on the same (averaged) weights
    # History carries push_sum_weight, messages_late, message_delay_max, gossip_waits.
    ```

    Args:
      graph: who sends to whom. "exponential" (the paper's: at step k worker i sends to
        i + 2^(k mod L) mod M, L = ceil(log2 M), and with p peers per step the next p hops),
        "ring" (i sends to i + 1, ..., i + p), or a callable
        `(step, rank, num_workers) -> list of out-peers` (between 1 and `peers_per_step`
        distinct other ranks; called from the step through `tf.py_function`). Each
        worker calls it for its own rank and announces its answers to the others, 32 steps
        at a time (a receiver waits only for what was announced); it must answer the same
        for the same `(step, rank)` everywhere, or the workers make another graph than the
        one it describes. A callable with a
        parameter `seed` is called with `seed=`, the same at a step on every worker and for
        every rank (`np.random.default_rng(seed)`); each call also runs with Python's
        `random` and NumPy's global generator seeded from `(step, rank)`. A callable that
        answers differently when called again, or on another worker, is refused before the
        first step (its first 32 steps are checked), naming it and the step.
      peers_per_step: p, out-peers per step (for "exponential", at most L).
      overlap: True (the paper's overlap SGP): the messages of step k travel while the
        worker computes step k+1, and a step takes whatever messages have arrived; a
        worker waits only for messages sent `max_delay` steps ago or earlier. False: each
        step waits for every message sent to it at that step (synchronous SGP).
      max_delay: with `overlap`, how many steps late a message may be taken (default 1).
      final_average: `join()` (and exit) ends with one exact average of every worker's
        model, x summed over the workers divided by w summed, and the model's float variables
        that the steps do not gossip (BatchNormalization's moving statistics) by their plain
        mean, so that all end on the same weights. It runs in `join()`, not at the end of
        `fit` (see the README for why).

    The push-sum weight and the step count are saved with the model's optimizer (Keras files
    and `tf.train.Checkpoint`, at `optimizer/tfdist_gossip_state`) and restored with it.
      cluster: a `tfdist.cluster.ClusterConfig`, TF_CONFIG dict / JSON, a cluster resolver,
        or None to read TF_CONFIG. Chief and worker tasks only (`--num_ps=0`).
      connect_timeout: seconds the peers get to start listening (None: the
        `TFDIST_CONNECT_TIMEOUT` that `tfdist-launch` exports, else 60).
      peer_timeout: seconds a peer may refuse connections before it is taken for dead: a
        step (or `join`) waiting for its messages then fails with an error naming it.
      stall_timeout: seconds a peer whose port still accepts connections may go without
        answering an RPC before it is taken for dead the same way (a stopped process, a hung
        machine; its server's RPC threads answer while it computes, so a slow peer is never
        cut off). None: the `TFDIST_STALL_TIMEOUT` that `tfdist-launch --stall_timeout`
        exports, else 60.
      inter_op_threads: inter-op threads of this worker's TF executor (one more is added
        for the courier's waiting dequeue, and with a callable `graph` one for the wait for
        the peers' plans).

    Raises:
      ValueError: an argument out of range (the message names it), a cluster with ps tasks
        or fewer than 2 workers, a task that is not a chief / worker, or a `graph` callable
        whose answers change when called again (here) or differ between the workers (at
        the first step).
      TaskUnreachableError: a peer did not listen within `connect_timeout`.
    """

    def __init__(self, graph="exponential", peers_per_step=1, overlap=True, max_delay=1,
                 final_average=True, cluster=None, connect_timeout=None, peer_timeout=10.0,
                 inter_op_threads=1, stall_timeout=None):
        super().__init__(StochasticGradientPushExtended(
            self, graph=graph, peers_per_step=peers_per_step, overlap=overlap,
            max_delay=max_delay, final_average=final_average, cluster=cluster,
            connect_timeout=connect_timeout, peer_timeout=peer_timeout,
            inter_op_threads=inter_op_threads, stall_timeout=stall_timeout))

    def shard(self, *arrays):
        """This worker's block of each array, every worker's the same size.

        Workers that take the same number of steps gossip to the end (a worker that ends
        early leaves the others to go on without its messages): arrays are cut into
        `num_workers` blocks of `len // num_workers` rows (the last `len % num_workers` rows
        are left out). A `tf.data.Dataset` is sharded with `dataset.shard(num_workers, index)`.
        """
        out = []
        for array in arrays:
            if isinstance(array, tf.data.Dataset):
                out.append(array.shard(self.num_workers, self.worker_index))
                continue
            rows = len(array) // self.num_workers
            out.append(array[self.worker_index * rows:(self.worker_index + 1) * rows])
        return out[0] if len(out) == 1 else tuple(out)

    def join(self):
        """Ends this worker's training (once): takes every message sent to it, and with
        `final_average` averages the workers' models exactly; waits for every peer to end
        too. Raises `PeerError` naming a peer that died."""
        self.extended.leave()

    # What `TelemetryCallback` writes from `progress()`.
    telemetry_scalars = ("push_sum_weight", "messages_received", "messages_late",
                         "message_delay_max", "gossip_waits")

    def progress(self):
        """This worker's gossip: its step, push_sum_weight, messages_received (the
        training messages it took, in its steps and in `join`: summed over the workers
        after `join`, what they sent), messages_late, message_delay_max, gossip_waits,
        bytes_sent (the training messages this worker's courier carries, one per out-peer
        a step, and under a callable graph its plans), plan_bytes_sent (those plans: each
        chunk of its answers, sent to every other worker) and,
        after `join`, peer_steps (the training steps each peer took, by rank) and with a
        final average final_weight_sum (the push-sum mass of all the workers, num_workers
        in exact arithmetic)."""
        return self.extended.progress()
