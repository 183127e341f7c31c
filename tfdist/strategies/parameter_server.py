"""The parameter-server family: between-graph replication of Keras 3 `fit` on TF's runtime.

Every worker process runs the user's own script and `model.fit` on its compute device (its
GPU when it has one). The model's variables are mirrors of master variables spread over the
ps tasks by size; each ps task runs the updater of its own shard, applying the user's Keras
optimizer, rebuilt there from its config.

A training step of a worker is one push-and-receive per ps task: it pushes its gradients for
the shard (with the change its steps made to the non-trainable state, BatchNorm statistics,
since it last read it), tagged with the global step
of the weights it computed them on, and takes the reply: the shard's weights after the update
its push joined, the new global step and the telemetry. Model averaging
(`tfdist.strategies.model_averaging`) pushes the model every `period` steps instead, on the
same engine. The engine is `tfdist.ps` (the worker's side: `tfdist.ps.worker`).
"""

import tensorflow as tf

from tfdist._args import check_int
from tfdist._worker import WorkerTasksMixin
from tfdist.ps.policies import AsyncPolicy
from tfdist.ps.policies import SoftSyncPolicy
from tfdist.ps.push import GradientPush
from tfdist.ps.table_set import TableRule
from tfdist.ps.worker import ParameterServerExtended


def n_of_m_policy(policy_class, replicas_to_aggregate):
    """A `make_policy` for policies that aggregate N of the M workers (None: all of them)."""

    def make_policy(total):
        n = total if replicas_to_aggregate is None else replicas_to_aggregate
        check_int("replicas_to_aggregate", n, f"an integer between 1 and the number of workers "
                  f"total_replicas={total}", low=1, high=total)
        return policy_class(n, total)

    return make_policy



class ParameterServerStrategyBase(WorkerTasksMixin, tf.distribute.Strategy):
    """Shared public surface of the tfdist parameter-server strategies (the chief also
    initialises the run)."""

    def shard(self, *arrays):
        """This worker's contiguous share of each array (or `tf.data.Dataset`).

        Arrays are split into `num_workers` nearly equal contiguous blocks; a dataset is
        sharded with `dataset.shard(num_workers, worker_index)`.
        """
        out = []
        for array in arrays:
            if isinstance(array, tf.data.Dataset):
                out.append(array.shard(self.num_workers, self.worker_index))
                continue
            size = len(array)
            start = size * self.worker_index // self.num_workers
            stop = size * (self.worker_index + 1) // self.num_workers
            out.append(array[start:stop])
        return out[0] if len(out) == 1 else tuple(out)

    def join(self, timeout=None):
        """Ends this worker's training; the model then holds the master weights.

        On the chief, first waits until every other worker has left or died (at most
        `timeout` seconds, None: as long as they are alive), so that the weights are final.
        A worker whose server has not answered the ps tasks for `stall_timeout` (a stopped
        process, a hung machine) is dead: `join()` does not wait for it. What the chief
        wrote to the model after its last train step (`EarlyStopping(restore_best_weights=
        True)` at the end of its `fit`, a `load_weights` before `join()`) is then written
        again over the other workers' later updates: the model ends on the chief's choice.
        """
        self.extended.leave(wait=self.is_chief, timeout=timeout)

    def reset_compression_state(self):
        """Sets this worker's codec state (the push's error-feedback residuals) back to zero.

        The state is saved and restored with the optimizer (`model.save`, ModelCheckpoint,
        BackupAndRestore, `tf.train.Checkpoint`): reset it when the model is given weights
        that the residuals do not belong to.
        """
        self.extended.reset_compression_state()

    def placement(self):
        """Where the master variables live, once training has started: a list with, per ps
        task, `task`, `variables` (`{path: [begin, end]}` for a part of a variable split
        by rows, `{path: None}` for a whole one), `bytes_held` (with the optimizer's slots)
        and `bytes_pushed` (what one push of a worker carries to that task, uncompressed;
        model averaging pushes every `period` steps)."""
        return self.extended.placement()

    def progress(self):
        """The telemetry of ps task 0: global_step, dropped_gradients, aggregated_gradients,
        staleness_mean, staleness_max, staleness_histogram, max_clock_gap, and the workers
        `live`, `left` and `dead`."""
        return self.extended.progress()


class SoftSyncStrategy(ParameterServerStrategyBase):
    """n-soft synchronous training through parameter servers (TF1 `SyncReplicasOptimizer`).

    Each update averages the first `replicas_to_aggregate` (N) fresh gradients of the M
    workers; gradients computed at an older global step are dropped and counted. N = M is hard
    synchronous training; N < M gives M - N backup workers, so that slow or dead workers (the
    chief included) do not hold the others back. The user's Keras optimizer is applied once
    per update, on the ps tasks, each to its own shard of the variables.

    ```python
    strategy = tfdist.strategies.SoftSyncStrategy(replicas_to_aggregate=2)  # TF_CONFIG
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    # History carries `global_step` and `dropped_gradients`.
    ```

    Args:
      replicas_to_aggregate: N, gradients per update; None for all the workers (hard sync).
      cluster: a `tfdist.cluster.ClusterConfig`, TF_CONFIG dict / JSON, a cluster resolver,
        or None to read TF_CONFIG. It needs at least one ps task, served by
        `tfdist-launch --job_name=ps`.
      init_timeout: seconds the ps tasks wait for the chief to initialise a new run (and for
        every worker's server to answer once). None: the environment's
        `TFDIST_INIT_TIMEOUT` (set by `tfdist-launch --connect_timeout`; 600 s in the pods
        of its Kubernetes manifests), else 60.
      connect_timeout: seconds the ps tasks get to start listening. None: the environment's
        `TFDIST_CONNECT_TIMEOUT` (set the same way), else 30.
      stall_timeout: seconds a task whose port accepts connections may go without
        answering an RPC before it is treated as dead: a stopped process or a hung machine
        (SIGSTOP, a GPU driver, NFS, a swap storm), which a TCP check takes for alive. The
        ps tasks probe the workers' servers (`tfdist.cluster.probe.ServerProbe`, every half
        second, each probe with a 2 s deadline): a worker silent for `stall_timeout` is
        dead, named in the logs, and treated as a killed one (soft sync and async go on
        without it, hard sync fails naming it, the chief's `join()` stops waiting for
        it). Each worker probes its ps tasks likewise: one silent for `stall_timeout`
        ends the worker with an error naming it, where its ops would wait for ever. A
        slow worker is never cut off: its server's RPC threads answer while it computes,
        sleeps or waits. None: the environment's `TFDIST_STALL_TIMEOUT` (set by
        `tfdist-launch --stall_timeout`), else 60. The value of the worker that starts a
        run is the one its ps tasks use.
      inter_op_threads: inter-op threads of this worker's TF executor (None: TF's default).
        One is fastest when per-step latency dominates (small models, shared cores).
      compression: a `tfdist.compression` compressor (or its name / config) for the push:
        each worker encodes its gradient (keeping its own error-feedback residual) and each
        ps task decodes its shard. The logs then carry `bytes_sent`, `bytes_dense` and
        `compression_ratio`. Compressors that need all-reduce rounds (PowerSGD) are refused.
      variable_partitioner: how large variables are split by rows over the ps tasks, so
        that each task carries a fair share of the traffic and the updates: "auto" (the
        default) splits a variable larger than 256 KiB, or than a quarter of one ps task's
        fair share of the model (and than 256 bytes), into parts of about that size or
        less, one part per ps task at most; a
        `tf.distribute.experimental.partitioners.Partitioner` (e.g.
        `FixedShardsPartitioner(2)`) decides per variable, along the first axis; None keeps
        every variable whole. Splitting is exact for elementwise optimizers (SGD, Adam,
        AdamW, RMSprop, ...); with another one (Lamb, Adafactor, a custom class) "auto"
        keeps every variable whole and a partitioner is refused at the first training step
        (when the optimizer is known). A variable with a
        constraint other than `NonNeg` stays whole. Checkpoints hold whole variables
        either way. `strategy.placement()` tells where every part lives.
      embedding_tables: the variables that live on the ps tasks only, as TF's own
        `ParameterServerStrategy` keeps embeddings: "auto" (the default: the table of every
        `keras.layers.Embedding`), None (every worker mirrors every variable), or a list of
        Keras path patterns (`fnmatch`; a pattern that matches no trainable float
        variable of rank 2 or more is an error at the first step, naming it and the
        model's candidates). A table is split by rows over the ps tasks as
        `variable_partitioner` splits a variable ("auto": as TF's `MinSizePartitioner` of
        256 KiB, parts of at least that, so a table under 512 KiB lives whole on one ps
        task); a step looks up only the distinct rows its batch touches there and pushes
        their gradients, so its cost and the worker's memory follow the rows touched, not
        the table. Hard sync stays exact (a step's lookups follow every update before it).
        Read whole in a step (a regularizer, a custom layer multiplying it), a table is an
        error that names it; `model.save`, checkpoints and `get_weights` read it in chunks.
      embedding_updates: how the ps tasks update a table's rows: "lazy" (the default: only
        the rows an update touched, with their optimizer slots; exact for SGD without
        momentum and Adagrad, TF1's `LazyAdamOptimizer` semantics for Adam, momentum and
        the like, whose untouched rows' moments do not decay; for SGD, Adam, AdamW, Adamax,
        Adagrad, Adadelta, RMSprop, Ftrl, Lion) or "dense" (every row at every update, as
        Keras does in one process: exact for every optimizer, at a table's cost per update).

    Raises:
      ValueError: `replicas_to_aggregate` is not between 1 and the number of workers, the
        cluster has no ps task, or this task is not a chief / worker.
      TaskUnreachableError: a ps task did not answer within `connect_timeout`.
    """

    def __init__(self, replicas_to_aggregate=None, cluster=None, init_timeout=None,
                 connect_timeout=None, inter_op_threads=1, compression=None,
                 variable_partitioner="auto", embedding_tables="auto",
                 embedding_updates="lazy", stall_timeout=None):
        tables = TableRule(embedding_tables, embedding_updates)
        super().__init__(ParameterServerExtended(
            self, n_of_m_policy(SoftSyncPolicy, replicas_to_aggregate), GradientPush(),
            cluster=cluster,
            init_timeout=init_timeout, connect_timeout=connect_timeout,
            inter_op_threads=inter_op_threads, compression=compression,
            variable_partitioner=variable_partitioner, tables=tables,
            stall_timeout=stall_timeout))

    @property
    def replicas_to_aggregate(self):
        return self.extended._policy.replicas_to_aggregate


class AsyncStrategy(ParameterServerStrategyBase):
    """Asynchronous SGD through parameter servers, staleness-aware.

    Every worker's gradient becomes an update as soon as the ps takes it, with the user's
    Keras optimizer. The staleness tau of an update (global steps applied between the weights
    its gradient was computed on, which the worker was sent with its last reply, and its own
    application) is measured for every update and reported (`staleness_mean`,
    `staleness_max` in the Keras logs; the histogram in `strategy.progress()`).

    ```python
    strategy = tfdist.strategies.AsyncStrategy(staleness="inverse", max_staleness=8)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(*strategy.shard(x, y), epochs=5)
    ```

    Args:
      staleness: how the learning rate of an update depends on its staleness: "none" (plain
        async SGD), "inverse" (lr / max(1, tau), Zhang et al. 2016), or a function taking
        the int64 staleness tensor and returning a float factor, traced into the update on
        the ps tasks: it must be importable there (a module-level function).
      max_staleness: None, or a bound s. With `on_stale="drop"` a gradient staler than s
        is dropped, counted, and its worker goes on from the current weights; with
        `on_stale="wait"` (stale synchronous parallel) a worker more than s pushes ahead of
        the slowest live worker waits for it.
      delay_compensation: None, or lambda of delay-compensated ASGD (Zheng et al. 2017):
        g + lambda * g * g * (w_now - w_read), where w_read are the weights the worker was
        sent with its last reply (kept per worker on each ps task); for a table's rows
        (`embedding_tables`), the rows its step's lookups read, which the push carries.
      on_stale: "drop" or "wait", see `max_staleness`.
      cluster, init_timeout, connect_timeout, inter_op_threads, compression,
        variable_partitioner, embedding_tables, embedding_updates, stall_timeout: as for
        `SoftSyncStrategy`.
    """

    def __init__(self, staleness="none", max_staleness=None, delay_compensation=None,
                 on_stale="drop", cluster=None, init_timeout=None, connect_timeout=None,
                 inter_op_threads=1, compression=None, variable_partitioner="auto",
                 embedding_tables="auto", embedding_updates="lazy", stall_timeout=None):
        policy = AsyncPolicy(staleness, max_staleness, delay_compensation, on_stale)
        tables = TableRule(embedding_tables, embedding_updates)
        super().__init__(ParameterServerExtended(
            self, lambda total: policy, GradientPush(), cluster=cluster, init_timeout=init_timeout,
            connect_timeout=connect_timeout, inter_op_threads=inter_op_threads,
            compression=compression, variable_partitioner=variable_partitioner,
            tables=tables, stall_timeout=stall_timeout))

    @property
    def policy(self):
        return self.extended._policy
