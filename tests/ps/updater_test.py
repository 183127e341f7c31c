"""The ps update graph in one process, against numpy: collect (N of M, stale pushes dropped,
counted), apply (the user's optimizer once per update, on the mean), staleness and its
learning-rate factor, SSP's wait and release, DC-ASGD (per row for a table), pushed state,
model averaging (a table by the rows a round changed).

The graph runs on queues and variables created here, on the local CPU, as the ps service
opens them on its task: no cluster.
"""

import itertools
import threading
import time
import types

import keras
import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist import compression as compression_lib
from tfdist.ps import protocol
from tfdist.ps import table_set
from tfdist.ps import tables
from tfdist.ps import wire
from tfdist.ps.client import ShardClient
from tfdist.ps.policies import AsyncPolicy
from tfdist.ps.policies import AveragingPolicy
from tfdist.ps.policies import SoftSyncPolicy
from tfdist.ps.push import GradientPush
from tfdist.ps.push_codec import PushCodec
from tfdist.ps.shard_optimizer import RunFailed
from tfdist.ps.snapshot import consistent_reads
from tfdist.ps.spec import RunError
from tfdist.ps.spec import ShardSpec
from tfdist.ps.updater import ShardUpdateGraph
from tfdist.ps.updater import shard_push_dtypes
from tfdist.ps.variables import MirrorVariable
from tfdist.ps.variables import Part
from tfdist.ps.variables import replica_step
from tfdist.ps.worker import ParameterServerExtended

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
_runs = itertools.count()


class Shard:
    """A shard's run opened in this process: its graph, and a worker's view of its queues."""

    def __init__(self, variables, policy, initial, num_workers=2, optimizer=None,
                 outer_optimizer=None, delta=False, optimizer_masters=True, compressor=None):
        if optimizer is not None and optimizer_masters:
            variables, initial = with_optimizer_masters(variables, initial, optimizer)
        self.spec = ShardSpec(
            mode="averaging" if policy.averages_weights else "gradients",
            policy=policy.to_spec(), num_workers=num_workers,
            worker_tasks=[f"/job:worker/task:{r}" for r in range(num_workers)],
            worker_addresses=[f"localhost:{r}" for r in range(num_workers)], num_ps=1,
            shard=0, variables=variables, optimizer=optimizer,
            outer_optimizer=outer_optimizer, delta=delta, init_timeout=10.0,
            compression=None if compressor is None else compression_lib.serialize(compressor))
        run = self.run = f"updater-test-{next(_runs)}"
        layout = protocol.ShardLayout(self.spec.variables)
        self.layout = layout
        self.push_dtypes = shard_push_dtypes(layout, compressor)
        push_queue = protocol.open_push_queue(DEVICE, run, self.push_dtypes)
        self.reply_queues = [protocol.open_reply_queue(DEVICE, run, r)
                             for r in range(num_workers)]
        self.progress, masters = protocol.open_run_variables(DEVICE, run, self.spec)
        for path, master in masters.items():
            master.assign(initial[path])
        self.progress.assign(tf.zeros([protocol.num_stats(num_workers)], tf.int64))
        self.masters = masters
        self.queue = push_queue
        self.graph = ShardUpdateGraph(self.spec, DEVICE, push_queue, self.reply_queues,
                                      self.progress, masters,
                                      protocol.open_update_lock(DEVICE, run),
                                      task="/job:ps/task:0")
        self.state = self.graph.empty_state()
        self.live = tf.constant([True] * num_workers)

    def push(self, tag, rank, main, values=(), rows=()):
        """A worker's push; `rows`: `(row ids, row values)` of each table's gradient."""
        pairs = [c for ids, rows_values in rows
                 for c in (tf.constant(ids, tf.int64),
                           tf.constant(np.ravel(rows_values), tf.float32))]
        tf.raw_ops.QueueEnqueueV2(handle=self.queue, components=[
            tf.constant(tag, tf.int64), tf.constant(rank, tf.int32),
            tf.constant(np.ravel(main), tf.float32), *pairs,
            tf.constant(np.ravel(values), tf.float32)])

    def serve(self, required=1):
        """Serves the pushes made so far (then returns, at a control entry)."""
        self.stop()
        self.serve_until_stopped(required)

    def stop(self):
        """Puts the control entry at which `serve_until_stopped` returns."""
        tf.raw_ops.QueueEnqueueV2(handle=self.queue, components=[
            tf.constant(protocol.STOP, tf.int64), tf.constant(0, tf.int32),
            *[tf.zeros([0], d) for d in self.push_dtypes[2:]]])

    def serve_until_stopped(self, required=1):
        self.state, event, _ = self.graph.serve_updates(tf.constant(required), self.live,
                                                        self.state)
        assert int(event) == -protocol.STOP

    def replies(self, rank):
        """`[(token, message, values)]` of the replies waiting for worker `rank`."""
        queue = self.reply_queues[rank]
        out = []
        while int(tf.raw_ops.QueueSizeV2(handle=queue)):
            token, message, _, values = tf.raw_ops.QueueDequeueV2(
                handle=queue, component_types=wire.REPLY_DTYPES)
            out.append((int(token), message.numpy().decode(), values.numpy()))
        return out

    def value(self, path):
        return self.masters[path].numpy()

    def optimizer_path(self, name):
        """The path of the optimizer's variable `name` (`iteration`, a slot...)."""
        path, = [e.path for e in self.spec.variables
                 if e.role == "optimizer" and e.path.endswith("/" + name)]
        return path

    def optimizer_master(self, name):
        return self.masters[self.optimizer_path(name)]

    def progress_dict(self):
        """The run's progress, with the pushes dropped since the last update (the next
        update records them)."""
        progress = protocol.progress_dict(self.progress.numpy(), self.spec.num_workers)
        progress["dropped_gradients"] += int(self.state["dropped"])
        return progress


def entry(path, shape, role="gradient", dtype="float32", **fields):
    return {"path": path, "shape": list(shape), "dtype": str(dtype), "role": role, **fields}


def with_optimizer_masters(variables, initial, optimizer):
    """`(variables, initial)` with the masters a worker gives `optimizer`'s own variables
    (its step counter, learning rate and slots, by the Keras paths it makes them at), as a
    worker's spec lists them: the optimizer built here on variables at the trained entries'
    paths."""
    trained, kinds = [], {}
    for e in variables:
        if e["role"] in ("gradient", "table"):
            name = e["path"].rpartition("/")[2]
            with _tf_compat.keras_name_scope_for_path(e["path"]):
                trained.append(keras.Variable(np.zeros(e["shape"], e["dtype"]), name=name))
            kinds[trained[-1].path.replace("/", "_")] = e
    local = keras.optimizers.deserialize(optimizer)
    local.build(trained)
    listed = {e["path"] for e in variables}
    extra = []
    for v in local.variables:
        if v.path in listed:
            continue
        of = next((e for k, e in kinds.items() if v.path.rpartition("/")[2].startswith(k)),
                  None)
        table = {"role": "table", "table": True, "rows": of["rows"]} if of and of.get(
            "table") else {"role": "optimizer"}
        extra.append(entry(v.path, v.shape, dtype=v.dtype, **table))
        initial = {**initial, v.path: v.numpy()}
    return [*variables, *extra], initial


def sgd(learning_rate, **kwargs):
    return keras.optimizers.serialize(keras.optimizers.SGD(learning_rate, **kwargs))


class CollectAndApplyTest(tf.test.TestCase):

    def test_n_of_m_applies_the_mean_once_and_drops_a_stale_push(self):
        w0 = np.array([1.0, -2.0, 3.0], np.float32)
        g = np.array([[0.5, 1.0, -1.0], [1.5, -3.0, 2.0], [9.0, 9.0, 9.0]], np.float32)
        shard = Shard([entry("d/w", [3])], SoftSyncPolicy(2, 3), {"d/w": w0},
                      num_workers=3, optimizer=sgd(0.1))
        for rank in range(3):
            shard.push(0, rank, g[rank])
        shard.serve(required=2)
        want = w0 - 0.1 * g[:2].mean(axis=0)
        self.assertAllClose(shard.value("d/w"), want, rtol=1e-6)
        # The first two make update 1 and are answered with its weights; the third was
        # computed at step 0 < 1: dropped, its worker sent the current weights at once, and
        # told so.
        for rank in range(3):
            (token, message, values), = shard.replies(rank)
            self.assertEqual((token, message), (1, protocol.DROPPED_MESSAGE if rank == 2 else ""))
            self.assertAllClose(values, want, rtol=1e-6)
        progress = shard.progress_dict()
        self.assertEqual({k: progress[k] for k in ("global_step", "updates",
                                                   "dropped_gradients",
                                                   "aggregated_gradients")},
                         {"global_step": 1, "updates": 1, "dropped_gradients": 1,
                          "aggregated_gradients": 2})
        self.assertEqual(int(shard.graph.optimizer.iterations), 1)

    def test_adam_steps_once_per_update_on_the_mean(self):
        w0 = np.array([0.3, -0.7], np.float32)
        pushes = np.array([[[1.0, -2.0], [3.0, 0.5]], [[-1.0, 4.0], [0.2, 0.2]]], np.float32)
        shard = Shard([entry("d/w", [2])], SoftSyncPolicy(2, 2), {"d/w": w0},
                      optimizer=keras.optimizers.serialize(keras.optimizers.Adam(0.01)))
        w, m, v = w0.astype(np.float64), 0.0, 0.0
        for step, gradients in enumerate(pushes, start=1):
            for rank in range(2):
                shard.push(step - 1, rank, gradients[rank])
            shard.serve(required=2)
            g = gradients.mean(axis=0)
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            alpha = 0.01 * np.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
            w = w - alpha * m / (np.sqrt(v) + 1e-7)
            self.assertAllClose(shard.value("d/w"), w, rtol=1e-5)
        self.assertEqual(int(shard.graph.optimizer.iterations), 2)
        self.assertEqual(shard.progress_dict()["global_step"], 2)


class StalenessTest(tf.test.TestCase):

    def test_inverse_staleness_scales_the_learning_rate(self):
        w0 = np.array([1.0, 2.0], np.float32)
        g = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32)
        shard = Shard([entry("d/w", [2])], AsyncPolicy("inverse"), {"d/w": w0},
                      optimizer=sgd(0.5))
        # Each push was computed at step 0: staleness 0, 1, 2 when applied.
        for rank, gradient in zip([0, 1, 0], g):
            shard.push(0, rank, gradient)
        shard.serve()
        want = w0 - 0.5 * g[0] - 0.5 * g[1] - 0.5 / 2 * g[2]
        self.assertAllClose(shard.value("d/w"), want, rtol=1e-6)
        progress = shard.progress_dict()
        self.assertEqual((progress["global_step"], progress["staleness_max"],
                          progress["staleness_histogram"][:4]), (3, 2, [1, 1, 1, 0]))
        self.assertAllClose(progress["staleness_mean"], 1.0)
        self.assertEqual([t for t, _, _ in shard.replies(0)], [1, 3])

    def test_max_staleness_drops_a_push_staler_than_the_bound(self):
        w0 = np.zeros([2], np.float32)
        shard = Shard([entry("d/w", [2])], AsyncPolicy(max_staleness=1), {"d/w": w0},
                      optimizer=sgd(1.0))
        shard.push(0, 0, [1.0, 0.0])   # staleness 0: step 1
        shard.push(0, 1, [0.0, 1.0])   # staleness 1: step 2
        shard.push(0, 0, [5.0, 5.0])   # staleness 2 > 1: dropped
        shard.serve()
        self.assertAllClose(shard.value("d/w"), [-1.0, -1.0])
        progress = shard.progress_dict()
        self.assertEqual((progress["global_step"], progress["dropped_gradients"],
                          progress["aggregated_gradients"]), (2, 1, 2))
        # The dropped push is answered at once with the current weights.
        self.assertEqual([(t, list(v)) for t, _, v in shard.replies(0)],
                         [(1, [-1.0, 0.0]), (2, [-1.0, -1.0])])

    def test_ssp_holds_a_worker_ahead_of_the_slowest_until_it_catches_up(self):
        shard = Shard([entry("d/w", [1])], AsyncPolicy(max_staleness=1, on_stale="wait"),
                      {"d/w": np.zeros([1], np.float32)}, optimizer=sgd(1.0))
        shard.push(0, 0, [1.0])   # clocks (1, 0): 1 ahead, released
        shard.push(1, 0, [1.0])   # clocks (2, 0): 2 ahead, waits
        shard.serve()
        self.assertEqual([t for t, _, _ in shard.replies(0)], [1])
        self.assertEqual(shard.progress_dict()["global_step"], 2)  # applied, not answered
        shard.push(0, 1, [1.0])   # clocks (2, 1): both within 1 of the slowest
        shard.serve()
        self.assertEqual([t for t, _, _ in shard.replies(0)], [3])
        self.assertEqual([t for t, _, _ in shard.replies(1)], [3])
        self.assertAllClose(shard.value("d/w"), [-3.0])
        self.assertEqual(shard.progress_dict()["max_clock_gap"], 1)
        # Nothing is dropped under "wait", however stale.
        self.assertEqual(shard.progress_dict()["dropped_gradients"], 0)
        # A worker held back is released when the slowest one is no longer live.
        shard.push(3, 0, [1.0])   # clocks (3, 1): waits
        shard.serve()
        self.assertEqual(shard.replies(0), [])
        shard.graph.forget(tf.constant(1))
        shard.graph.release_caught_up(tf.constant([True, False]))
        self.assertEqual([t for t, _, _ in shard.replies(0)], [4])

    def test_dc_asgd_compensates_each_push_by_what_its_worker_read(self):
        lam, lr = 0.5, 0.1
        w0 = np.array([1.0, -1.0, 2.0], np.float32)
        g0 = np.array([1.0, 2.0, -1.0], np.float32)
        g1 = np.array([-2.0, 0.5, 3.0], np.float32)
        shard = Shard([entry("d/w", [3])], AsyncPolicy(delay_compensation=lam),
                      {"d/w": w0}, optimizer=sgd(lr))
        for rank in range(2):  # each worker joins: it reads w0
            shard.graph.release_one(tf.constant(rank))
        self.assertEqual([m for _, m, _ in shard.replies(1)], [protocol.SYNC_MESSAGE])
        shard.push(0, 0, g0)   # worker 0 read w0: no compensation
        shard.push(0, 1, g1)   # worker 1 read w0, the weights are now w1
        shard.serve()
        w1 = w0 - lr * g0
        w2 = w1 - lr * (g1 + lam * g1 * g1 * (w1 - w0))
        self.assertAllClose(shard.value("d/w"), w2, rtol=1e-6)
        # Worker 0 now reads w1: its next push is compensated by w2 - w1.
        shard.push(1, 0, g0)
        shard.serve()
        w3 = w2 - lr * (g0 + lam * g0 * g0 * (w2 - w1))
        self.assertAllClose(shard.value("d/w"), w3, rtol=1e-6)


class FenceTest(tf.test.TestCase):
    """A worker the run counts out (declared dead: it stopped answering for stall_timeout)
    that wakes up and pushes (issue 22): before, its pushes were applied, and counted toward
    an update's N, silently."""

    def test_a_push_of_a_worker_counted_out_is_refused_and_its_worker_told(self):
        w0 = np.array([1.0, -2.0], np.float32)
        g = np.array([[0.5, 1.0], [8.0, 8.0]], np.float32)
        for policy in (SoftSyncPolicy(1, 2), AsyncPolicy(),
                       AsyncPolicy(delay_compensation=0.5)):
            with self.subTest(policy=type(policy).__name__, spec=policy.to_spec()):
                shard = Shard([entry("d/w", [2])], policy, {"d/w": w0}, optimizer=sgd(0.1))
                shard.graph.release_one(tf.constant(0))  # worker 0 joins: it reads w0
                self.assertEqual([m for _, m, _ in shard.replies(0)], [protocol.SYNC_MESSAGE])
                shard.live = tf.constant([True, False])  # worker 1 was declared dead
                shard.push(0, 1, g[1])
                shard.push(0, 0, g[0])
                shard.serve(required=1)
                want = w0 - 0.1 * g[0]
                self.assertAllClose(shard.value("d/w"), want, rtol=1e-6)
                (token, message, values), = shard.replies(1)
                self.assertEqual(token, protocol.FENCED)
                self.assertRegex(message, r"^tfdist: /job:ps/task:0: the run counts this "
                                          r"worker out \(it was declared dead .*its pushes are "
                                          r"refused. If it was declared dead, restart it")
                self.assertEqual(values.size, 0)
                (token, message, values), = shard.replies(0)
                self.assertEqual((token, message), (1, ""))
                self.assertAllClose(values, want, rtol=1e-6)
                progress = shard.progress_dict()
                self.assertEqual((progress["aggregated_gradients"],
                                  progress["dropped_gradients"]), (1, 1))
        # Under stale synchronous parallel, a worker held back (its push applied, its reply
        # deferred) when it is counted out is told the fence's error when it wakes: it would
        # wait on its reply until the run closed (issue 22 review).
        shard = Shard([entry("d/w", [1])], AsyncPolicy(max_staleness=1, on_stale="wait"),
                      {"d/w": np.zeros([1], np.float32)}, optimizer=sgd(1.0))
        shard.push(0, 0, [1.0])   # clocks (1, 0): released
        shard.push(1, 0, [1.0])   # clocks (2, 0): held back
        shard.serve()
        self.assertEqual([t for t, _, _ in shard.replies(0)], [1])
        shard.graph.forget(tf.constant(0))  # worker 0 declared dead
        (token, message, _), = shard.replies(0)
        self.assertEqual(token, protocol.FENCED)
        self.assertRegex(message, r"the run counts this worker out")
        shard.graph.forget(tf.constant(1))  # (not held: told nothing)
        self.assertEqual(shard.replies(1), [])
        # A rank out of range (a forged push) is dropped, with nobody to tell.
        shard = Shard([entry("d/w", [2])], AsyncPolicy(), {"d/w": w0}, optimizer=sgd(0.1))
        shard.push(0, 7, g[1])
        shard.push(0, 0, g[0])
        shard.serve()
        self.assertAllClose(shard.value("d/w"), w0 - 0.1 * g[0], rtol=1e-6)
        self.assertEqual(shard.replies(1), [])
        self.assertEqual(shard.progress_dict()["dropped_gradients"], 1)


class GlobalStepTest(tf.test.TestCase):
    """The global step (pushes' tags, staleness, stale-push dropping) is the updater's own
    count of updates, not the optimizer's `iterations`, which a user's load rewinds."""

    def rewound(self, policy):
        """A shard after 3 updates of worker 0, then the chief's `load_weights` of an older
        checkpoint (its `iterations` 0), then one more update."""
        shard = Shard([entry("d/w", [1])], policy, {"d/w": np.zeros([1], np.float32)},
                      optimizer=sgd(1.0))
        for step in range(3):
            shard.push(step, 0, [1.0])
            shard.serve()
        shard.optimizer_master("iteration").assign(0)  # what the chief's load writes
        shard.push(3, 0, [1.0])
        shard.serve()
        return shard

    def test_a_load_that_rewinds_iterations_leaves_the_global_step_monotone(self):
        shard = self.rewound(SoftSyncPolicy(1, 2))
        self.assertEqual(shard.progress_dict()["global_step"], 4)
        self.assertEqual(int(shard.optimizer_master("iteration").numpy()), 1)  # Keras's count
        # Soft sync: a push computed on the weights of step 1 is stale, dropped.
        shard.push(1, 1, [5.0])
        shard.serve()
        self.assertAllClose(shard.value("d/w"), [-4.0])
        self.assertEqual(shard.progress_dict()["dropped_gradients"], 1)
        self.assertEqual([t for t, _, _ in shard.replies(0)], [1, 2, 3, 4])

    def test_async_measures_staleness_against_the_monotone_step(self):
        shard = self.rewound(AsyncPolicy("inverse"))
        shard.push(2, 1, [4.0])  # computed at step 2, applied at 5: staleness 2, lr / 2
        shard.serve()
        self.assertAllClose(shard.value("d/w"), [-4.0 - 2.0])
        progress = shard.progress_dict()
        self.assertEqual((progress["global_step"], progress["staleness_max"]), (5, 2))


class OptimizerMastersTest(tf.test.TestCase):

    def test_an_optimizer_variable_without_a_master_refuses_the_run_naming_it(self):
        # Two weights at one Keras path (`add_weight(name="w")` twice in a layer): a worker
        # numbers the second `d/w#1`, and its slot `sgd/d_w_momentum#1`; rebuilt on the ps,
        # the optimizer names that slot `sgd/d_w#1_momentum`, which no master is. It must not
        # live on the ps alone, out of every checkpoint.
        momentum = keras.optimizers.serialize(keras.optimizers.SGD(0.1, momentum=0.9))
        name = momentum["config"]["name"]
        variables = [entry("d/w", [2]), entry("d/w#1", [2]),
                     entry(f"{name}/iteration", [], role="optimizer", dtype="int64"),
                     entry(f"{name}/learning_rate", [], role="optimizer"),
                     entry(f"{name}/d_w_momentum", [2], role="optimizer"),
                     entry(f"{name}/d_w_momentum#1", [2], role="optimizer")]
        initial = {e["path"]: np.zeros(e["shape"], e["dtype"]) for e in variables}
        with self.assertRaisesRegex(
                RunFailed, rf"(?s)/job:ps/task:0: .*{name}/d_w#1_momentum\b.* no master.*"
                r"never in a checkpoint.*same Keras path.*'d/w'.*distinct names"):
            Shard(variables, SoftSyncPolicy(1, 2), initial, optimizer=momentum,
                  optimizer_masters=False)


class ConsistentReadTest(tf.test.TestCase):
    """A worker's whole-model read (`get_weights`, a checkpoint) while the updater applies
    update after update: every variable of a shard from the same update."""

    def test_get_weights_reads_each_shard_between_two_updates(self):
        layers, reads = 4, 5
        variables = [entry(f"model/dense{i}/{name}", shape) for i in range(layers)
                     for name, shape in (("kernel", [3, 2]), ("bias", [2]))]
        shard = Shard(variables, AsyncPolicy(), {e["path"]: np.zeros(e["shape"], np.float32)
                                                 for e in variables}, optimizer=sgd(1.0))
        # A worker's view of the run: its client's masters, a Keras model whose variables
        # are mirrors bound to them (as `ParameterServerExtended` makes and binds them).
        connection = types.SimpleNamespace(rank=1, ps_devices=[DEVICE],
                                           ps_names=["/job:ps/task:0"], host_device=DEVICE)
        client = ShardClient(connection, 0)
        client.open_run(shard.run, shard.spec)

        def mirror(next_creator, **kwargs):
            del next_creator
            path = _tf_compat.keras_variable_path(kwargs["name"])
            variable = MirrorVariable.create(path, "gradient", **kwargs)
            variable.bind(client.masters[path])
            return variable

        with tf.variable_creator_scope(mirror):
            model = keras.Sequential([keras.Input([3])] + [
                keras.layers.Dense(2 if i == 0 else 3, name=f"dense{i}")
                for i in range(layers)], name="model")
        self.assertEqual([v.path for v in model.weights], [e["path"] for e in variables])
        # The optimizer's step counter, which a checkpoint holds too.
        path = shard.optimizer_path("iteration")
        iteration = MirrorVariable.create(path, "optimizer",
                                          initial_value=tf.constant(0, tf.int64))
        iteration.bind(client.masters[path])
        model.get_weights()  # traced before the updates start
        # Worker 0 pushes a gradient of 1 everywhere, again and again: after n updates each
        # value is -n. The updater applies them while this thread reads the model.
        size = sum(int(np.prod(e["shape"])) for e in variables)
        reading = threading.Event()
        reading.set()

        def push():
            while reading.is_set():
                if int(tf.raw_ops.QueueSizeV2(handle=shard.queue)) < 20:
                    shard.push(0, 0, np.ones([size], np.float32))
                else:
                    time.sleep(0.001)

        threads = [threading.Thread(target=push, daemon=True),
                   threading.Thread(target=shard.serve_until_stopped, daemon=True)]
        for thread in threads:
            thread.start()
        seen = []
        try:
            deadline = time.monotonic() + 120
            while len(set(seen)) < reads:  # the reads overlap the updates
                self.assertLess(time.monotonic(), deadline, f"no updates: {seen}")
                with consistent_reads():  # as a checkpoint reads the model and optimizer
                    steps = sorted({int(round(-x)) for w in model.get_weights()
                                    for x in w.ravel()} | {int(iteration.numpy())})
                self.assertLen(steps, 1, f"one read saw the weights of updates {steps}")
                seen.append(steps[0])
        finally:
            reading.clear()
            threads[0].join(timeout=60)
            shard.stop()
            threads[1].join(timeout=60)
        self.assertFalse(threads[1].is_alive(), "the updater did not stop")
        self.assertEqual(seen, sorted(seen))


class StateAndAveragingTest(tf.test.TestCase):

    def test_pushed_state_takes_its_mean_and_frozen_state_stays_exact(self):
        w0, mean0 = np.array([1.0], np.float32), np.array([0.1, 0.2, 0.3], np.float32)
        shard = Shard([entry("d/w", [1]), entry("bn/moving_mean", [3], role="value")],
                      SoftSyncPolicy(2, 2), {"d/w": w0, "bn/moving_mean": mean0},
                      optimizer=sgd(1.0))
        # Each worker read mean0 and pushes its statistics' change since: the mean of
        # their statistics (as the worker computes the change, in float32).
        v0, v1 = np.array([1.0, 2.0, 3.0]), np.array([3.0, 0.0, 1.0])
        shard.push(0, 0, [1.0], np.float32(v0) - mean0)
        shard.push(0, 1, [3.0], np.float32(v1) - mean0)
        shard.serve(required=2)
        self.assertAllClose(shard.value("d/w"), [-1.0])
        self.assertAllClose(shard.value("bn/moving_mean"), (v0 + v1) / 2, rtol=1e-6)
        # A reply carries the main variables, then the state.
        (_, _, values), = shard.replies(0)
        self.assertAllClose(values, [-1.0, 2.0, 1.0, 2.0])
        held = shard.value("bn/moving_mean")
        for _ in range(3):
            for rank in range(2):  # frozen: no change
                shard.push(int(shard.progress_dict()["global_step"]), rank, [0.0],
                           np.zeros([3], np.float32))
            shard.serve(required=2)
        self.assertAllEqual(shard.value("bn/moving_mean"), held)

    def test_model_averaging_assigns_the_mean_model_or_adds_the_mean_change(self):
        m0, m1 = np.array([1.0, 3.0]), np.array([2.0, -1.0])
        for delta, want in ((False, (m0 + m1) / 2), (True, 5.0 + (m0 + m1) / 2)):
            shard = Shard([entry("k", [2], role="average")], AveragingPolicy(2, 2),
                          {"k": np.full([2], 5.0, np.float32)}, delta=delta)
            shard.push(0, 0, m0)
            shard.push(0, 1, m1)
            shard.serve(required=2)
            self.assertAllClose(shard.value("k"), want)
            self.assertEqual(shard.progress_dict()["global_step"], 1)

    def test_outer_optimizer_steps_on_master_minus_the_mean(self):
        outer = keras.optimizers.SGD(0.7, momentum=0.5)
        local = keras.Variable(np.zeros([2], np.float32), name="k")
        outer.build([local])
        slots = [entry(v.path, v.shape, role="optimizer", dtype=v.dtype)
                 for v in outer.variables]
        initial = {v.path: v.numpy() for v in outer.variables}
        w0 = np.array([1.0, 1.0], np.float32)
        shard = Shard([entry("k", [2], role="average", outer=True), *slots],
                      AveragingPolicy(2, 2), {"k": w0, **initial},
                      outer_optimizer=keras.optimizers.serialize(outer))
        w, velocity = w0.astype(np.float64), 0.0
        for round_ in range(2):
            models = np.array([[0.0, 2.0], [1.0, -2.0]]) + round_
            for rank in range(2):
                shard.push(round_, rank, models[rank])
            shard.serve(required=2)
            outer_gradient = w - models.mean(axis=0)
            velocity = 0.5 * velocity - 0.7 * outer_gradient
            w = w + velocity
            self.assertAllClose(shard.value("k"), w, rtol=1e-6)
        self.assertEqual(int(shard.graph.outer_optimizer.iterations), 2)


class TableTest(tf.test.TestCase):
    """Embedding tables kept on the ps: a push carries the rows of their gradient."""

    def shard(self, policy, num_workers=2, learning_rate=0.5, **table_fields):
        self.table0 = np.arange(12, dtype=np.float32).reshape(6, 2)
        self.w0 = np.array([1.0, 2.0], np.float32)
        return Shard([entry("d/w", [2]),
                      entry("e/embeddings", [6, 2], role="table", table=True, rows=[0, 6],
                            **table_fields)],
                     policy, {"d/w": self.w0, "e/embeddings": self.table0},
                     num_workers=num_workers, optimizer=sgd(learning_rate))

    def test_rows_take_the_mean_of_n_pushes_and_a_table_stays_out_of_replies(self):
        shard = self.shard(SoftSyncPolicy(2, 2))
        shard.push(0, 0, [1.0, 1.0], rows=[([1, 3], [[1.0, 1.0], [2.0, 2.0]])])
        shard.push(0, 1, [3.0, 3.0], rows=[([3, 3], [[1.0, 0.0], [0.0, 1.0]])])  # repeated
        shard.serve(required=2)
        want = self.table0.copy()
        want[1] -= 0.5 * np.array([0.5, 0.5])
        want[3] -= 0.5 * np.array([1.5, 1.5])
        self.assertAllClose(shard.value("e/embeddings"), want, rtol=1e-6)
        self.assertAllClose(shard.value("d/w"), self.w0 - 0.5 * np.array([2.0, 2.0]))
        for rank in range(2):
            (token, _, values), = shard.replies(rank)
            self.assertEqual(token, 1)
            self.assertAllClose(values, shard.value("d/w"))  # the dense part only

    def test_staleness_scales_a_table_rows_step_and_a_stale_push_adds_no_rows(self):
        shard = self.shard(AsyncPolicy("inverse"))
        zero = [0.0, 0.0]
        shard.push(0, 0, zero, rows=[([], np.zeros([0, 2]))])
        shard.push(0, 1, zero, rows=[([], np.zeros([0, 2]))])
        shard.push(0, 0, zero, rows=[([2], [[1.0, 1.0]])])  # staleness 2: lr 0.5 / 2
        shard.serve(required=1)
        want = self.table0.copy()
        want[2] -= 0.25
        self.assertAllClose(shard.value("e/embeddings"), want, rtol=1e-6)
        self.assertEqual(shard.progress_dict()["global_step"], 3)
        # A push refused as too stale leaves the table as it is.
        bounded = self.shard(AsyncPolicy("none", max_staleness=0), learning_rate=0.1)
        bounded.push(0, 0, zero, rows=[([0], [[1.0, 1.0]])])
        bounded.push(0, 1, zero, rows=[([5], [[1.0, 1.0]])])  # stale by 1: dropped
        bounded.serve(required=1)
        want = self.table0.copy()
        want[0] -= 0.1
        self.assertAllClose(bounded.value("e/embeddings"), want, rtol=1e-6)

    def test_dc_asgd_compensates_each_table_row_by_the_value_its_worker_read(self):
        # With `read_rows` a push carries, after its gradient's rows, the rows its worker's
        # lookups read: each row's gradient (repeated rows summed) is compensated by the
        # row's value now minus the value read (Zheng et al. 2017, per row).
        lam, lr = 0.5, 0.5
        shard = self.shard(AsyncPolicy(delay_compensation=lam), learning_rate=lr,
                           read_rows=True)
        table0, zero = self.table0, [0.0, 0.0]
        # Worker 0 read the table as it is: nothing to compensate.
        shard.push(0, 0, zero, rows=[([1, 3, 1], [[1.0, 1.0], [2.0, 2.0], [1.0, 0.0]]),
                                     ([1, 3, 1], table0[[1, 3, 1]])])
        # Worker 1 read the same table; row 3 has moved since, row 4 has not. Its lookups
        # read rows in another order, row 3 twice.
        g3, g4 = np.array([1.0, -1.0]), np.array([0.5, 0.5])
        shard.push(0, 1, zero, rows=[([3, 4], [g3, g4]), ([4, 3, 3], table0[[4, 3, 3]])])
        # A gradient row its push says it did not read stays uncompensated.
        shard.push(0, 0, zero, rows=[([5], [[1.0, 1.0]]), ([], np.zeros([0, 2]))])
        shard.serve(required=1)
        want = table0.copy()
        want[1] -= lr * np.array([2.0, 1.0])
        want[3] -= lr * np.array([2.0, 2.0])
        moved = want[3] - table0[3]
        want[3] -= lr * (g3 + lam * g3 * g3 * moved)
        want[4] -= lr * g4
        want[5] -= lr * np.array([1.0, 1.0])
        self.assertAllClose(shard.value("e/embeddings"), want, rtol=1e-6)
        self.assertAllClose(shard.value("d/w"), self.w0)


class RowsAveragingTest(tf.test.TestCase):
    """Model averaging of a table by the rows a round changed (`tfdist.ps.averaged_rows`): a
    push carries the rows its worker changed, the reply the rows the round changed."""

    def shard(self, policy, num_workers=2):
        self.table0 = np.arange(12, dtype=np.float32).reshape(6, 2) / 7
        self.w0 = np.array([1.0, 2.0], np.float32)
        shard = Shard([entry("d/w", [2], role="average"),
                       entry("e/embeddings", [6, 2], role="rows")], policy,
                      {"d/w": self.w0, "e/embeddings": self.table0}, num_workers=num_workers)
        self.layout = protocol.ShardLayout(shard.spec.variables)
        return shard

    def reply(self, shard, rank):
        """`(token, dense values, {row: values})` of each reply to worker `rank`."""
        out = []
        for token, _, values in shard.replies(rank):
            (ids, rows), = self.layout.reply_rows(tf.constant(values))
            rows = rows.numpy().reshape(-1, 2)
            out.append((token, values[:self.layout.reply_size],
                        {int(i): r for i, r in zip(ids.numpy(), rows)}))
        return out

    def test_rows_average_equals_the_whole_table_average_and_only_changed_rows_travel(self):
        shard = self.shard(AveragingPolicy(2, 2))
        # Both workers started the round from the master; each changed some rows (row 3
        # both).
        local = [self.table0.copy(), self.table0.copy()]
        local[0][[1, 3]] += [[0.3, 0.1], [0.5, -0.2]]
        local[1][[3, 4]] += [[-0.1, 0.7], [0.25, 0.25]]
        shard.push(0, 0, [1.0, 1.0], rows=[([1, 3], local[0][[1, 3]])])
        shard.push(0, 1, [3.0, 5.0], rows=[([3, 4], local[1][[3, 4]])])
        shard.serve(required=2)
        # Bit for bit the mean of the two whole tables (two workers: a sum's order does
        # not round), the dense part averaged as before.
        self.assertAllEqual(shard.value("e/embeddings"), (local[0] + local[1]) / 2)
        self.assertAllEqual(shard.value("d/w"), [2.0, 3.0])
        for rank in range(2):
            (token, values, rows), = self.reply(shard, rank)
            self.assertEqual(token, 1)
            self.assertAllEqual(values, [2.0, 3.0])
            self.assertEqual(sorted(rows), [1, 3, 4])  # the rows the round changed only
            for row, value in rows.items():
                self.assertAllEqual(value, shard.value("e/embeddings")[row])

    def test_three_workers_a_row_nobody_else_touched_counts_their_master_value(self):
        shard = self.shard(AveragingPolicy(3, 3), num_workers=3)
        local = [self.table0.copy() for _ in range(3)]
        local[0][2] += [3.0, -3.0]
        local[2][[2, 5]] += [[1.0, 1.0], [0.6, 0.3]]
        shard.push(0, 0, [0.0, 0.0], rows=[([2], local[0][[2]])])
        shard.push(0, 1, [0.0, 0.0], rows=[([], np.zeros([0, 2]))])  # touched nothing
        shard.push(0, 2, [0.0, 0.0], rows=[([5, 2], local[2][[5, 2]])])
        shard.serve(required=3)
        self.assertAllClose(shard.value("e/embeddings"), np.mean(local, axis=0), rtol=1e-6)
        (_, _, rows), = self.reply(shard, 1)
        self.assertEqual(sorted(rows), [2, 5])

    def test_a_dropped_worker_takes_every_row_changed_since_its_weights_and_its_own(self):
        # One of two per round: worker 0 makes rounds 1 and 2 alone (rows 1, then 2); worker
        # 1's push from step 0 (row 5 changed) is dropped. Its reply carries rows 1 and 2 (it
        # missed them) and row 5 at the master's value (its own change is dropped).
        shard = self.shard(AveragingPolicy(1, 2))
        changed = self.table0.copy()
        changed[[1, 2]] += 1.0
        shard.push(0, 0, self.w0, rows=[([1], changed[[1]])])
        shard.push(1, 0, self.w0, rows=[([2], changed[[2]])])
        shard.push(0, 1, self.w0 + 1, rows=[([5], self.table0[[5]] + 9.0)])
        shard.serve(required=1)
        self.assertAllEqual(shard.value("e/embeddings"), changed)
        self.assertEqual([sorted(rows) for _, _, rows in self.reply(shard, 0)], [[1], [2]])
        (token, values, rows), = self.reply(shard, 1)
        self.assertEqual(token, 2)
        self.assertAllEqual(values, self.w0)
        self.assertEqual(sorted(rows), [1, 2, 5])
        for row, value in rows.items():
            self.assertAllEqual(value, changed[row])
        self.assertEqual(shard.progress_dict()["dropped_gradients"], 1)
        # A worker (re)joining is sent no row: it copies the master tables itself.
        shard.graph.release_one(tf.constant(1))
        (_, _, rows), = self.reply(shard, 1)
        self.assertEqual(rows, {})


class ClientPackTest(tf.test.TestCase):
    """A worker's push travels packed in one float32 vector (`ShardClient.push_and_receive`),
    table rows included: sizes known only when the step runs, int64 ids as float32 words."""

    def test_a_push_with_table_rows_arrives_whole_and_its_reply_comes_back(self):
        table0 = np.arange(12, dtype=np.float32).reshape(6, 2)
        # Variables on the ps task read once the reply is taken travel in its pack, each
        # exactly: float32, the two words of a float64, a float16 (model averaging's
        # learning rate).
        with tf.device(DEVICE):
            reads = [tf.Variable(0.1, dtype=tf.float32),
                     tf.Variable([0.1, 1e-300], dtype=tf.float64),
                     tf.Variable([[0.1]], dtype=tf.float16)]
        shard = Shard([entry("d/w", [2]),
                       entry("e/embeddings", [6, 2], role="table", table=True, rows=[0, 6])],
                      SoftSyncPolicy(1, 2), {"d/w": [1.0, 2.0], "e/embeddings": table0},
                      optimizer=sgd(0.5))
        connection = types.SimpleNamespace(rank=1, ps_devices=[DEVICE],
                                           ps_names=["/job:ps/task:0"], host_device=DEVICE)
        client = ShardClient(connection, 0)
        client.num_workers, client.push_queue = 2, shard.queue
        client.reply_queue = shard.reply_queues[1]

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([None], tf.float32)])
        def push(rows, row_values):
            return client.push_and_receive(0, [tf.constant([1.0, -1.0]), rows, row_values],
                                           tf.zeros([0]), reads)

        replies = []
        thread = threading.Thread(daemon=True, target=lambda: replies.append(push(
            tf.constant([5, 3, 5], tf.int64),
            tf.constant([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))))
        thread.start()
        deadline = time.monotonic() + 60
        while int(tf.raw_ops.QueueSizeV2(handle=shard.queue)) == 0:
            self.assertTrue(thread.is_alive(), "the push raised before it was enqueued")
            self.assertLess(time.monotonic(), deadline, "the push never arrived")
            time.sleep(0.01)
        shard.serve(required=1)
        thread.join(timeout=60)
        self.assertFalse(thread.is_alive(), "no reply came back")
        token, _, values, dropped, read = replies[0]
        for variable, value in zip(reads, read, strict=True):
            self.assertEqual(value.dtype, variable.dtype)
            self.assertAllEqual(value, variable.numpy())
        self.assertEqual(int(token), 1)
        self.assertFalse(bool(dropped))
        self.assertAllClose(values, [0.5, 2.5])   # the dense part: w - 0.5 * g
        want = table0.copy()
        want[5] -= 0.5 * np.array([4.0, 4.0])    # repeated row 5: summed
        want[3] -= 0.5 * np.array([2.0, 2.0])
        self.assertAllClose(shard.value("e/embeddings"), want)


    def test_sync_says_the_run_ended_only_when_its_queues_closed_or_freed(self):
        def client_of(shard):
            connection = types.SimpleNamespace(rank=1, ps_devices=[DEVICE],
                                               ps_names=["/job:ps/task:0"], host_device=DEVICE)
            client = ShardClient(connection, 0)
            client.num_workers, client.push_queue = 2, shard.queue
            client.reply_queue, client.run = shard.reply_queues[1], shard.run
            client.push_dtypes = shard.push_dtypes
            return client

        closed, freed = (Shard([entry("d/w", [2])], SoftSyncPolicy(1, 2), {"d/w": [1.0, 2.0]},
                               optimizer=sgd(0.5)) for _ in range(2))
        client = client_of(closed)
        # Another error (here the push's components of the wrong types; a ps task out of
        # reach, stopped) is raised as it is, for the caller to name the ps task.
        client.push_dtypes = [tf.int64, tf.int32, tf.int64]
        with self.assertRaises(tf.errors.InvalidArgumentError):
            client.sync()
        client.push_dtypes = closed.push_dtypes
        for queue in (closed.queue, closed.reply_queues[1]):  # the run ended
            tf.raw_ops.QueueCloseV2(handle=queue)
        with self.assertRaisesRegex(RunError, f"/job:ps/task:0: run {closed.run} has ended"):
            client.sync()
        for queue in (freed.queue, freed.reply_queues[1]):  # a later run tore it down
            tf.raw_ops.DestroyResourceOp(resource=queue)
        with self.assertRaisesRegex(RunError, f"/job:ps/task:0: run {freed.run} has ended"):
            client_of(freed).sync()


def worker_of(shard, rank, compressor=None):
    """The exchange of a worker of rank `rank` with `shard` (a one-shard run opened in this
    process): `(engine, mirrors, exchange)`; `mirrors` are the worker's `{path: mirror}`,
    bound to the shard's masters; `exchange(gradient)` runs one step's push-and-receive as
    `ParameterServerExtended._exchange` does (in a `tf.function`, in a thread: `shard.serve`
    answers it), and returns once its reply has landed."""
    connection = types.SimpleNamespace(rank=rank, num_workers=shard.spec.num_workers,
                                       ps_devices=[DEVICE], ps_names=["/job:ps/task:0"],
                                       host_device=DEVICE, is_chief=rank == 0,
                                       task_name=f"/job:worker/task:{rank}")
    client = ShardClient(connection, 0)
    client.num_workers, client.push_queue = shard.spec.num_workers, shard.queue
    client.push_dtypes = shard.push_dtypes
    client.reply_queue, client.progress = shard.reply_queues[rank], shard.progress
    # The engine's state that `_exchange` and `leave` read, without a cluster to join.
    engine = ParameterServerExtended.__new__(ParameterServerExtended)
    engine._connection = connection
    engine._steps_trained = tf.Variable(0, dtype=tf.int64)
    engine._chief_writes = {}
    engine.run_finished = False
    mirrors = {}
    for e in shard.layout.main + shard.layout.values:
        mirrors[e.path] = MirrorVariable.create(e.path, e.role,
                                                initial_value=shard.value(e.path))
        mirrors[e.path].bind(shard.masters[e.path])
        engine._after_bind(mirrors[e.path])
    engine._clients, engine._layouts = [client], [shard.layout]
    engine._shards = [[Part(mirror) for mirror in mirrors.values()]]
    engine._tags = tf.Variable(tf.zeros([1], tf.int64))
    engine._stats = tf.Variable(tf.zeros([protocol.num_stats(connection.num_workers)],
                                         tf.int64))
    engine._tables = types.SimpleNamespace(take_lookups=dict, pushed_rows=lambda *_: [])
    engine._push = GradientPush()
    engine._left, engine._watchdog = False, None
    engine._codec = (None if compressor is None
                     else PushCodec(compressor, tf.distribute.get_strategy(), connection))

    def exchange(gradient, serve=True):
        @tf.function
        def step():  # as a train step does (`_call_for_each_replica`)
            engine._exchange(lambda part: tf.constant(gradient))
            engine._count_trained_step()

        started = StartedStep(step)
        if serve:
            serve_steps(shard, [started], required=1)
        return started

    return engine, mirrors, exchange


class StartedStep:
    """`step()` running in a thread (its push waits for its reply)."""

    def __init__(self, step):
        self.errors = []
        self.thread = threading.Thread(daemon=True, target=self._run, args=(step,))
        self.thread.start()

    def _run(self, step):
        try:
            step()
        except Exception as e:  # noqa: BLE001  (raised in the test's thread: `check`)
            self.errors.append(e)

    def check(self):
        if self.errors:
            raise self.errors[0]

    def finish(self):
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "no reply came back"
        self.check()


def serve_steps(shard, started, required):
    """Waits until the pushes of the `started` steps are in `shard`'s queue, serves them
    (`required` pushes an update), and waits for their replies."""
    deadline = time.monotonic() + 60
    while int(tf.raw_ops.QueueSizeV2(handle=shard.queue)) < len(started):
        for step in started:
            step.check()
            assert step.thread.is_alive(), "a step ended before its push was enqueued"
        assert time.monotonic() < deadline, "the pushes never arrived"
        time.sleep(0.01)
    shard.serve(required=required)
    for step in started:
        step.finish()


def local_value(mirror):
    """A mirror's own value (outside a step a bound mirror reads its master)."""
    with replica_step():
        return mirror.numpy()


class DroppedPushTest(tf.test.TestCase):
    """A compressed push the ps drops as stale leaves the worker's codec state as it was
    before that step: error feedback keeps what was computed but not applied of the pushes
    the ps accepted, and nothing of a dropped one (`tfdist.ps.push_codec`)."""

    def test_a_dropped_push_leaves_the_residual_as_before_and_no_stale_mass_returns(self):
        lr, w0 = 1.0, np.zeros([4], np.float32)
        compressor = compression_lib.get("topk", ratio=0.25)  # one element of four a push
        shard = Shard([entry("d/w", [4])], SoftSyncPolicy(1, 2), {"d/w": w0},
                      optimizer=sgd(lr), compressor=compressor)
        engine, mirrors, exchange = worker_of(shard, 1, compressor)

        def residual():
            state, = engine._codec.states()
            (variables,) = state.variables.values()
            return variables["residual"].numpy()

        g1 = np.array([4.0, 1.0, 2.0, 0.0], np.float32)
        exchange(g1)   # accepted: update 1 applies [4, 0, 0, 0]
        w1 = w0 - lr * np.array([4.0, 0.0, 0.0, 0.0])
        self.assertAllClose(shard.value("d/w"), w1)
        self.assertAllClose(residual(), [0.0, 1.0, 2.0, 0.0])
        # Other workers' updates move the global step on: the next push, computed at step 1,
        # is stale (soft sync accepts only pushes of the current step) and dropped.
        shard.progress.scatter_nd_update([[protocol.STAT_STEP]], [5])
        exchange(np.array([0.0, 0.0, 3.0, 9.0], np.float32))  # sends the 9, keeps the 3
        self.assertEqual(shard.progress_dict()["dropped_gradients"], 1)
        self.assertAllClose(shard.value("d/w"), w1)
        self.assertAllClose(residual(), [0.0, 1.0, 2.0, 0.0])  # the 3 of the dropped push too
        self.assertEqual(int(engine._tags[0]), 5)  # the worker took the current step
        # The next push, fresh, sends the largest of its gradient plus the residual of g1
        # only: nothing of the dropped push reaches the weights.
        exchange(np.array([0.0, 0.5, 0.0, 0.0], np.float32))
        self.assertAllClose(shard.value("d/w"), w1 - lr * np.array([0.0, 0.0, 2.0, 0.0]))
        self.assertAllClose(residual(), [0.0, 1.5, 0.0, 0.0])
        self.assertAllClose(local_value(mirrors["d/w"]), shard.value("d/w"))



class WireBytesTest(tf.test.TestCase):
    """`bytes_on_wire` (the Keras log of a compressed push) counts what a step moves of a
    table kept on the ps: the ids its lookups send and the rows they bring back, and the
    gradient rows and ids its push carries, beside the push and reply of the dense part."""

    def test_a_step_counts_the_rows_its_lookups_read_and_its_push_carries(self):
        compressor = compression_lib.get("fp16")
        table0 = np.arange(12, dtype=np.float32).reshape(6, 2)
        shard = Shard([entry("d/w", [2]),
                       entry("bytes/embeddings", [6, 2], role="table", table=True, rows=[0, 6])],
                      SoftSyncPolicy(1, 2), {"d/w": [1.0, 2.0], "bytes/embeddings": table0},
                      optimizer=sgd(0.5), compressor=compressor)
        engine, _, _ = worker_of(shard, 0, compressor)
        table = tables.TableVariable.create("bytes/embeddings", [6, 2], tf.float32,
                                            [(DEVICE, (0, 6))])
        engine._tables = table_set.TableSet(table_set.TableRule(), None, 10.0)
        engine._tables.tables, engine._tables.parts = [table], [[Part(table, (0, 6))]]
        # A batch of 3 examples of 2 ids each, some repeated: each distinct id is looked up
        # once, and the push carries one gradient row for it (its positions' sum).
        batch = np.array([[5, 3], [5, 0], [1, 5]], np.int32)

        @tf.function
        def step():
            with tables.step_lookups():
                with tf.GradientTape() as tape:
                    rows = table.sparse_read(batch)  # the forward pass: one gather on the ps
                    loss = tf.reduce_sum(rows * rows) / 2  # each position's gradient: its row
                gradient = tape.gradient(loss, table)
                engine._exchange(lambda part: gradient if part.variable is table
                                 else tf.constant([1.0, -1.0]))

        serve_steps(shard, [StartedStep(step)], required=1)
        distinct, row_bytes = len(np.unique(batch)), 2 * 4
        reads = distinct * (batch.itemsize + row_bytes)     # ids out, rows back
        pushed = distinct * (8 + row_bytes) + 2 * 8         # int64 ids and rows, 2 sizes
        header = 16 + 8 * (2 + protocol.num_stats(2))       # tag, rank; token, flag, stats
        reply = 4 * 2                                       # the dense part (no table)
        logs = engine._codec.logs(engine._layouts)
        self.assertEqual(int(logs["bytes_sent"]), compressor.payload_bytes([2], tf.float32))
        self.assertEqual(int(logs["bytes_on_wire"]),
                         header + reply + reads + pushed + int(logs["bytes_sent"]))
        # The ratio: the same traffic with the push's dense part uncompressed over it.
        self.assertAllClose(logs["compression_ratio"],
                            (header + reply + reads + pushed + 4 * 2)
                            / int(logs["bytes_on_wire"]))
        # The push applied the rows' gradients (summed per row): the table on the ps moved.
        want = table0.copy()
        np.add.at(want, batch.ravel(), -0.5 * table0[batch.ravel()])
        self.assertAllClose(shard.value("bytes/embeddings"), want)


class PushedStateTest(tf.test.TestCase):
    """Non-trainable state (BatchNorm's moving statistics) travels as the change a worker's
    steps made to it since the worker last took the master's value: concurrent workers'
    changes add up instead of the last push overwriting the others'."""

    def test_async_workers_statistics_combine_instead_of_overwriting(self):
        m0 = np.array([1.0, -1.0], np.float32)
        shard = Shard([entry("d/w", [1]), entry("bn/moving_mean", [2], role="value")],
                      AsyncPolicy(), {"d/w": np.zeros([1], np.float32), "bn/moving_mean": m0},
                      optimizer=sgd(1.0))
        (_, mirrors0, exchange0), (_, mirrors1, exchange1) = [worker_of(shard, rank)
                                                              for rank in range(2)]
        # Both workers read m0; each step moves the statistics its own way (BatchNorm's
        # moving average of its batches).
        a, b = np.array([1.5, -1.0], np.float32), np.array([1.0, 0.0], np.float32)
        with replica_step():
            mirrors0["bn/moving_mean"].assign(a)
            mirrors1["bn/moving_mean"].assign(b)
        exchange0([1.0])
        self.assertAllClose(shard.value("bn/moving_mean"), a)
        exchange1([1.0])  # computed on m0, one update ago: its change counts all the same
        want = m0 + (a - m0) + (b - m0)
        self.assertAllClose(shard.value("bn/moving_mean"), want)
        self.assertAllClose(local_value(mirrors1["bn/moving_mean"]), want)
        self.assertAllClose(shard.value("d/w"), [-2.0])
        # Worker 0 last read `a` (its reply): its next change is counted from there.
        c = a + np.array([0.0, 0.25], np.float32)
        with replica_step():
            mirrors0["bn/moving_mean"].assign(c)
        exchange0([0.0])
        self.assertAllClose(shard.value("bn/moving_mean"), want + (c - a))
        self.assertAllClose(local_value(mirrors0["bn/moving_mean"]), want + (c - a))
        # The chief's eager write (a restore, `set_weights`) is where its next change starts.
        written = np.array([5.0, 5.0], np.float32)
        mirrors0["bn/moving_mean"].assign(written)
        self.assertAllClose(shard.value("bn/moving_mean"), written)
        with replica_step():
            mirrors0["bn/moving_mean"].assign(written + 1.0)
        exchange0([0.0])
        self.assertAllClose(shard.value("bn/moving_mean"), written + 1.0)

    def test_sync_workers_statistics_take_the_mean_of_the_pushed_values(self):
        m0 = np.array([0.1, 0.7, -0.3], np.float32)
        shard = Shard([entry("d/w", [1]), entry("bn/moving_mean", [3], role="value")],
                      SoftSyncPolicy(2, 2), {"d/w": np.zeros([1], np.float32),
                                             "bn/moving_mean": m0}, optimizer=sgd(1.0))
        workers = [worker_of(shard, rank) for rank in range(2)]
        pushed = [np.array([0.3, 0.11, 1e-3], np.float32), np.array([7.0, -0.2, 0.9],
                                                                    np.float32)]
        for (_, mirrors, _), value in zip(workers, pushed):
            with replica_step():
                mirrors["bn/moving_mean"].assign(value)
        serve_steps(shard, [exchange([1.0], serve=False) for _, _, exchange in workers],
                    required=2)
        # Both read m0: the master plus the mean change is their mean (to float32 rounding:
        # the ps sums the changes the workers computed, in float32).
        want = m0 + ((pushed[0] - m0) + (pushed[1] - m0)) / np.float32(2)
        self.assertAllEqual(shard.value("bn/moving_mean"), want)
        self.assertAllClose(want, (pushed[0] + pushed[1]) / 2, rtol=1e-6, atol=0)
        for _, mirrors, _ in workers:
            self.assertAllEqual(local_value(mirrors["bn/moving_mean"]), want)



class ChiefWritesTest(tf.test.TestCase):
    """What the chief writes after its last train step (EarlyStopping's
    `restore_best_weights` at the end of `fit`) is what `join()` leaves in the masters and its
    model, though other workers trained on after it."""

    def test_the_chiefs_restore_after_its_last_step_survives_join(self):
        w0 = np.array([1.0, 2.0], np.float32)
        shard = Shard([entry("d/w", [2]), entry("bn/moving_mean", [2], role="value")],
                      AsyncPolicy(), {"d/w": w0, "bn/moving_mean": np.zeros([2], np.float32)},
                      optimizer=sgd(1.0))
        (chief, chiefs, chief_step), (_, workers, worker_step) = [worker_of(shard, rank)
                                                                  for rank in range(2)]
        # A write followed by a step of the chief is training, not its last word.
        chiefs["bn/moving_mean"].assign([9.0, 9.0])
        chief_step([0.5, 0.5])
        best = shard.value("d/w").copy()
        chief_step([1.0, 0.0])
        # The end of the chief's fit: EarlyStopping restores the best weights (eagerly,
        # through the mirrors, to the masters); worker 1 trains on over them.
        chiefs["d/w"].assign(best)
        with replica_step():
            # A reply may land in the chief's copy after its write (model averaging's last
            # round, pushed at join()).
            chiefs["d/w"].assign([0.0, 0.0])
            # Worker 1's step moves its statistics by one.
            workers["bn/moving_mean"].assign([1.0, 1.0])
        worker_step([0.0, 2.0])
        self.assertAllClose(shard.value("d/w"), best - [0.0, 2.0])
        # Worker 1 leaves; the chief's join() waits for that, then takes the masters.
        shard.progress.scatter_nd_update([[protocol.STAT_MEMBERS + 1]], [protocol.LEFT])
        chief.leave(wait=True, timeout=60)
        self.assertAllClose(shard.value("d/w"), best)
        self.assertAllClose(local_value(chiefs["d/w"]), best)
        # Worker 1's change of the statistics stays: the chief wrote them before a step.
        self.assertAllClose(shard.value("bn/moving_mean"), [10.0, 10.0])
        self.assertAllClose(local_value(chiefs["bn/moving_mean"]), [10.0, 10.0])


if __name__ == "__main__":
    tf.test.main()
