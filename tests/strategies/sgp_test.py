"""StochasticGradientPushStrategy: the graph schedule, arguments, and two cluster runs.

The cluster runs (`sgp_program.py` through the launcher, 3 workers, each with its courier):
overlap off, a fully connected graph then an irregular one (equal to all-reduce SGD step for
step, push-sum mass conserved, one exact final average), and the default settings with a
worker killed mid-run (the others fail with its name).
"""

import json
import os
import queue
import random
import signal
import threading
import time
import types

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfdist
from tests.strategies import ps_program
from tests.strategies import sgp_program
from tests.strategies.ps_testing import cluster_log
from tests.strategies.ps_testing import load_result
from tests.strategies.ps_testing import make_cluster
from tests.strategies.ps_testing import run_cluster
from tfdist.cluster import ClusterConfig
from tfdist.cluster import pick_free_ports
from tfdist.cluster.probe import ANSWERED
from tfdist.cluster.probe import GONE
from tfdist.cluster.probe import STALLED
from tfdist.gossip import graphs
from tfdist.gossip import node as node_lib
from tfdist.gossip import protocol
from tfdist.gossip.graphs import Schedule
from tfdist.gossip.plans import Plans
from tfdist.strategies.gossip import StochasticGradientPushStrategy

PROGRAM = os.path.join(os.path.dirname(__file__), "sgp_program.py")


class ScheduleTest(tf.test.TestCase, parameterized.TestCase):

    def test_exponential_graph_cycles_through_powers_of_two(self):
        schedule = Schedule("exponential", 1, 8)
        self.assertEqual([schedule.out_peers(k, 0) for k in range(4)], [[1], [2], [4], [1]])
        self.assertEqual([schedule.out_peers(k, 6) for k in range(3)], [[7], [0], [2]])
        # 4 workers: hops 1 and 2; 5 workers: 1, 2 and 4.
        self.assertEqual(Schedule("exponential", 1, 4).period, 2)
        self.assertEqual(Schedule("exponential", 2, 5).out_peers(1, 0), [4, 1])

    def test_ring(self):
        self.assertEqual(Schedule("ring", 1, 4).out_peers(7, 3), [0])
        self.assertEqual(Schedule("ring", 2, 4).out_peers(0, 1), [2, 3])

    @parameterized.parameters(("exponential", 1, 8), ("exponential", 3, 8), ("ring", 2, 5))
    def test_in_counts_mirror_out_peers(self, graph, peers, workers):
        schedule = Schedule(graph, peers, workers)
        for step in range(6):
            received = sum(schedule.in_counts(step, rank) for rank in range(workers))
            self.assertAllEqual(received, [peers] * workers)  # each sender's p messages
            for rank in range(workers):
                for sender in range(workers):
                    self.assertEqual(schedule.in_counts(step, rank)[sender],
                                     int(rank in schedule.out_peers(step, sender)))
        if schedule.periodic:
            out, counts = schedule.tables(2)
            self.assertEqual(out.shape, (schedule.period, peers))
            self.assertAllEqual(counts[-1], schedule.in_counts(schedule.period - 1, 2))

    def test_callable_graph_is_checked_when_the_schedule_is_made(self):
        schedule = Schedule(sgp_program.phased_graph, 2, 3)
        self.assertEqual(schedule.out_peers(0, 1), [0, 2])
        self.assertEqual(schedule.out_peers(sgp_program.SWITCH, 1), [0])  # hub 0 at step 6
        self.assertAllEqual(schedule.padded_out_peers(sgp_program.SWITCH, 1), [0, -1])
        self.assertAllEqual(schedule.in_counts(sgp_program.SWITCH, 0), [0, 1, 1])
        for bad in ([1], [0, 0], [5], [], "x"):
            with self.assertRaisesRegex(ValueError, r"`graph` must return"):
                Schedule(lambda step, rank, n, bad=bad: bad, 2, 3)
        # A graph that goes wrong only later is still checked at each call.
        schedule = Schedule(lambda step, rank, n: [rank] if step == 100 else [1 - rank], 1, 2)
        with self.assertRaisesRegex(ValueError, r"`graph` must return.*step=100, rank=1"):
            schedule.out_peers(100, 1)

    def test_a_graph_that_takes_a_seed_gets_one_per_step_the_same_on_every_rank(self):
        # A random ring per step: every rank must draw the same permutation, so the seed
        # depends on the step alone (the global generators are seeded per (step, rank)).
        seeds = {}

        def random_ring(step, rank, num_workers, seed):
            seeds.setdefault(step, set()).add(seed)
            order = list(np.random.default_rng(seed).permutation(num_workers))
            return [int(order[(order.index(rank) + 1) % num_workers])]

        workers = [Schedule(random_ring, 1, 5) for _ in range(5)]
        rings = set()
        for step in range(40, 50):
            sent = [workers[rank].out_peers(step, rank) for rank in range(5)]
            rings.add(tuple(p for (p,) in sent))
            for rank, (receiver,) in enumerate(sent):
                self.assertEqual(workers[receiver].in_counts(step, receiver)[rank], 1)
            self.assertAllEqual(sum(w.in_counts(step, r) for r, w in enumerate(workers)),
                                [1] * 5)  # a permutation: each worker hears from one other
        self.assertEqual([len(s) for s in seeds.values()], [1] * len(seeds))
        self.assertEqual(len({s for step in seeds.values() for s in step}), len(seeds))
        self.assertGreater(len(rings), 5)

    def test_a_graph_that_answers_differently_when_called_again_is_refused(self):
        # An unseeded generator of its own, a counter: a receiver would recompute another
        # answer than the sender's and wait for a message that is never sent.
        private = random.Random()

        def draw_privately(step, rank, num_workers):
            return [private.choice([p for p in range(num_workers) if p != rank])]

        calls = []

        def counting(step, rank, num_workers):
            calls.append(step)
            return [(rank + 1 + len(calls) % 2) % num_workers]

        for graph, name in ((draw_privately, "draw_privately"), (counting, "counting")):
            with self.assertRaisesRegex(
                    ValueError, rf"`graph` \(.*{name}\) gave \[\d\] then \[\d\] for "
                                r"step=\d+, rank=\d: .*the same out-peers .*every time.*"
                                r"`seed` argument"):
                Schedule(graph, 1, 4)

    def test_workers_whose_graphs_disagree_fail_at_the_start_naming_the_step(self):
        # Each call repeats in its own process, but the answers differ between processes
        # (a generator seeded from the process id, the host name): found by comparing
        # every worker's answers for the first steps before the first step is taken.
        def graph_of(process):
            def by_process(step, rank, num_workers):
                if step < 7:
                    return [(rank + 1) % num_workers]
                hop = 1 + (step * 31 + process) % (num_workers - 1)
                return [(rank + hop) % num_workers]
            return by_process

        processes = [0, 0, 5]
        schedules = [Schedule(graph_of(p), 1, 3) for p in processes]
        digests = [s.digests(40) for s in schedules]
        self.assertAllEqual(digests[0], digests[1])
        names = [f"/job:worker/task:{r}" for r in range(3)]
        graphs.check_agreement(schedules[0], names, 0, {1: digests[1]})  # no error
        with self.assertRaisesRegex(
                ValueError, r"`graph` \(.*by_process\) gives other out-peers on "
                            r"/job:worker/task:2 than on /job:worker/task:0 at step 7 "
                            r"\(on /job:worker/task:0: \[\[2\], \[0\], \[1\]\], rank by rank"
                            r".*on every worker"):
            graphs.check_agreement(schedules[0], names, 0, {1: digests[1], 2: digests[2]})


    def test_a_random_callable_graph_gives_every_worker_the_same_peers(self):
        # Each worker has its own Schedule and its own global generators' state: the
        # receivers' in-counts must match the senders' draws, or a step waits for ever.
        def draw(step, rank, n):  # no seed of its own: Python's, then NumPy's generator
            others = [p for p in range(n) if p != rank]
            if step % 2:
                return [random.choice(others)]
            return list(np.random.choice(others, size=2, replace=False))

        workers = [Schedule(draw, 2, 6) for _ in range(6)]
        drawn = set()
        for step in range(12):
            for rank, schedule in enumerate(workers):
                random.seed(1000 * step + rank)  # each process's own state, unrelated
                np.random.seed(1000 * step + rank + 1)
                before = random.random()
                random.seed(1000 * step + rank)
                sent = schedule.out_peers(step, rank)
                self.assertEqual(random.random(), before)  # the caller's state is kept
                drawn.add(tuple(sent))
                for receiver in sent:
                    self.assertEqual(workers[receiver].in_counts(step, receiver)[rank], 1)
        self.assertGreater(len(drawn), 6)  # the draws do vary with the step and rank


class ArgumentsTest(tf.test.TestCase):

    def _config(self, num_workers=4, num_ps=0, task=("worker", 0)):
        ports = pick_free_ports(num_ps + num_workers)
        return ClusterConfig.from_hosts(
            ps_hosts=[f"localhost:{p}" for p in ports[:num_ps]],
            worker_hosts=[f"localhost:{p}" for p in ports[num_ps:]], job_name=task[0],
            task_index=task[1])

    def test_errors_name_the_argument_the_allowed_values_and_what_was_received(self):
        config = self._config()
        cases = [
            (dict(peers_per_step=5),
             r"`peers_per_step` must be between 1 and num_workers-1=3\. Received: 5"),
            (dict(peers_per_step=0), r"between 1 and num_workers-1=3\. Received: 0"),
            (dict(peers_per_step=1.0), r"`peers_per_step` must be an integer\. Received: 1.0"),
            (dict(peers_per_step=3),
             r"between 1 and 2 with graph='exponential' and 4 workers: its out-peers are "
             r"i \+ \[1, 2\].*Received: 3"),
            (dict(graph="star"), r"`graph` must be one of \['exponential', 'ring'\] or a "
                                 r"callable.*Received: 'star'"),
            (dict(overlap="yes"), r"`overlap` must be True or False\. Received: 'yes'"),
            (dict(final_average=1), r"`final_average` must be True or False"),
            (dict(max_delay=0), r"`max_delay` must be an integer >= 1.*Received: 0"),
            (dict(overlap=False, max_delay=2), r"with overlap=False every message is taken at "
                                               r"the step it was sent.*max_delay=2"),
            (dict(connect_timeout=0), r"`connect_timeout` must be a positive number"),
            (dict(peer_timeout=-1), r"`peer_timeout` must be a positive number"),
            (dict(stall_timeout=0), r"`stall_timeout` must be a positive number"),
            (dict(inter_op_threads=0), r"`inter_op_threads` must be an integer >= 1"),
        ]
        for kwargs, message in cases:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaisesRegex(ValueError, message):
                    StochasticGradientPushStrategy(cluster=config, **kwargs)

    def test_cluster_errors(self):
        with self.assertRaisesRegex(ValueError, r"needs at least 2 workers.*num_workers=1"):
            StochasticGradientPushStrategy(cluster=self._config(num_workers=1))
        with self.assertRaisesRegex(ValueError, r"no parameter server.*--num_ps=0.*1 ps"):
            StochasticGradientPushStrategy(cluster=self._config(num_ps=1))
        with self.assertRaisesRegex(ValueError, r"runs in `chief` or `worker` tasks"):
            StochasticGradientPushStrategy(
                cluster=self._config(num_ps=1, task=("ps", 0)))

    def test_registry_and_flags(self):
        self.assertIn("sgp", tfdist.strategies.names())
        with self.assertRaisesRegex(ValueError, r"`peers_per_step` must be between 1 and "
                                                r"num_workers-1=3\. Received: 4"):
            tfdist.strategies.get("sgp", cluster=self._config(), peers_per_step=4)
        self.assertEqual(tfdist.strategies.parse_strategy_args(
            ["graph=ring", "overlap=False", "peers_per_step=2"]),
            {"graph": "ring", "overlap": False, "peers_per_step": 2})

    def test_shard_gives_every_worker_the_same_rows(self):
        class Fake:
            num_workers, worker_index = 3, 2

        x = np.arange(10)
        self.assertAllEqual(StochasticGradientPushStrategy.shard(Fake(), x), [6, 7, 8])
        Fake.worker_index = 0
        a, b = StochasticGradientPushStrategy.shard(Fake(), x, -x)
        self.assertAllEqual(b, [0, -1, -2])

    def test_message_round_trip(self):
        message = protocol.pack(2 ** 40 + 3, 5, -7, 0.25, tf.constant([1.5, -2.0]))
        tags, ranks, infos, weights, values = protocol.unpack(message[None])
        self.assertEqual([int(tags[0]), int(ranks[0]), int(infos[0])], [2 ** 40 + 3, 5, -7])
        self.assertAllEqual(weights, [0.25])
        self.assertAllEqual(values, [[1.5, -2.0]])


class Wire:
    """In-memory plan queues and inboxes between the `Plans` of workers run as threads."""

    def __init__(self, num_workers):
        pairs = [(r, s) for r in range(num_workers) for s in range(num_workers) if r != s]
        self.plans = {pair: queue.Queue() for pair in pairs}  # (receiver, sender)
        self.inboxes = {pair: queue.Queue() for pair in pairs}

    def node(self, rank, num_workers):
        wire = self

        class Node:
            def send_plan(self, kind, value, peers):
                for receiver in range(num_workers):
                    if receiver != rank:
                        wire.plans[receiver, rank].put(
                            (kind, value, np.asarray(peers, np.int64).reshape([-1])))
                # As `GossipNode.send_plan`: the bytes of the plan (int64 kind, value and
                # peers) to each other worker.
                return 8 * (2 + np.size(peers)) * (num_workers - 1)

            def take_plan(self, sender):
                return wire.plans[rank, sender].get(timeout=HANG_BOUND)

            def dead_message(self, dead):
                return f"tfdist: /job:worker/task:{dead} stopped answering"

        node = Node()
        node.rank, node.num_workers = rank, num_workers
        return node


# Seconds a wait in the in-process tests may take: a bound against a hang.
HANG_BOUND = 20


class PlansTest(tf.test.TestCase):

    def test_a_graph_that_diverges_at_step_40_leaves_no_receiver_waiting(self):
        # The first 40 steps a ring on every worker (so the checks before the first step
        # pass); then each process answers its own way (hops of 1 and 2 in turn, in a phase
        # of its own: a function reading its host or process id). A receiver counting on its
        # own answers would wait at step 40 for a message never sent (tested: a cluster run
        # of 3 workers hung there). Here each worker counts on its senders' plans: every
        # step takes exactly what was sent to it at that step, nothing waits. Worker 2 ends
        # after 70 steps; its peers count nothing from it after that.
        num_workers, steps = 3, {0: 100, 1: 100, 2: 70}

        def graph_of(process):
            def by_process(step, rank, num_workers):
                if step < 40:
                    return [(rank + 1) % num_workers]
                return [(rank + 1 + (process + step) % 2) % num_workers]
            return by_process

        schedules = [Schedule(graph_of(r), 1, num_workers) for r in range(num_workers)]
        # The receiver's own answer differs from its sender's at step 40: worker 1 sends to
        # worker 0, which expects worker 2 only.
        self.assertEqual(schedules[1].out_peers(40, 1), [0])
        self.assertEqual(schedules[0].in_counts(40, 0).tolist(), [0, 0, 1])

        wire = Wire(num_workers)
        failures, taken = [], {r: [] for r in range(num_workers)}
        plan_bytes = {}

        def work(rank):
            # The engine's step with overlap=False: send, count, take (an END in place of
            # a message: that sender ended, nothing more is taken from it); then its join.
            plans, ended = Plans(schedules[rank], wire.node(rank, num_workers)), set()
            try:
                plans.start(0)
                for step in range(steps[rank]):
                    for peer in plans.out_peers(step):
                        if peer >= 0:
                            wire.inboxes[peer, rank].put(step)
                    counts = plans.in_counts(step)
                    for sender in set(range(num_workers)) - ended:
                        for _ in range(counts[sender]):
                            tag = wire.inboxes[rank, sender].get(timeout=HANG_BOUND)
                            if tag == "END":
                                ended.add(sender)
                                break
                            taken[rank].append((step, sender, tag))
                plans.end(steps[rank])
                plan_bytes[rank] = plans.bytes_sent
                for peer in range(num_workers):
                    if peer != rank:
                        wire.inboxes[peer, rank].put("END")
            except Exception as e:  # noqa: BLE001 - reported by the test's thread
                failures.append((rank, repr(e)))

        threads = [threading.Thread(target=work, args=(r,), daemon=True)
                   for r in range(num_workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(3 * HANG_BOUND)
        self.assertFalse(any(t.is_alive() for t in threads), "a worker waits for ever")
        self.assertEqual(failures, [])
        for rank in range(num_workers):
            self.assertTrue(all(step == tag for step, _, tag in taken[rank]), taken[rank])
        # Every message was taken at its step, except those sent to worker 2 after its end
        # (its join takes them).
        left = {pair: [t for t in q.queue if t != "END"] for pair, q in wire.inboxes.items()}
        left = {pair: tags for pair, tags in left.items() if tags}
        self.assertEqual(set(left), {(2, 0), (2, 1)})
        self.assertGreaterEqual(min(t for tags in left.values() for t in tags), 70)
        self.assertEqual(sum(len(t) for t in taken.values()) + sum(map(len, left.values())),
                         sum(steps.values()))
        # At step 40 worker 0 hears from worker 1 too, as worker 1 decided.
        self.assertIn((40, 1, 40), taken[0])
        # The plans' bytes (in `progress()["bytes_sent"]`): chunks 0-4 of 32 steps (100
        # steps: the chunk after the last step's is announced too; worker 2, 70 steps: 0-3)
        # of 2 + 32 int64 words to each of 2 peers, and an end of 2 words to each.
        self.assertEqual(plan_bytes, {0: 5 * 544 + 32, 1: 5 * 544 + 32, 2: 4 * 544 + 32})
        self.assertEqual(protocol.pack_plan(protocol.PLAN_PEERS, 3,
                                            np.zeros([32, 1], np.int32)).shape, [2 * 34])

    def test_a_dead_sender_fails_the_receivers_wait_for_its_plan_naming_it(self):
        wire = Wire(2)
        plans = Plans(Schedule(lambda step, rank, n: [1 - rank], 1, 2), wire.node(0, 2))
        plans.start(0)
        wire.plans[0, 1].put((protocol.PLAN_DEAD, 1, np.zeros([0], np.int64)))
        with self.assertRaisesRegex(node_lib.PeerError, r"/job:worker/task:1 stopped"):
            plans.in_counts(0)


class PeerWatchTest(tf.test.TestCase):
    """The watcher of a node made by hand (no server, no courier), with a scripted probe."""

    def watch(self, probe_class, peer_timeout, stall_timeout, courier_exited=False):
        """Runs the watcher of worker 0 of 3 (peers 1 and 2 at localhost:1 and :2) until it
        reports a peer, within a bound; returns `(node, reported, seconds)`."""
        node = node_lib.GossipNode.__new__(node_lib.GossipNode)
        node.rank, node.num_workers, node.task_name = 0, 3, "/job:worker/task:0"
        node.names = [f"/job:worker/task:{r}" for r in range(3)]
        node.addresses = ["localhost:0", "localhost:1", "localhost:2"]
        node.expected, node.peer_timeout, node.stall_timeout = {1, 2}, peer_timeout, stall_timeout
        node.courier = types.SimpleNamespace(poll=lambda: 1 if courier_exited else None)
        node._lock, node._stop, node._why = threading.Lock(), threading.Event(), {}
        reported = []
        node._report = reported.append
        original = node_lib.ServerProbe
        node_lib.ServerProbe = probe_class
        try:
            start = time.monotonic()
            watcher = threading.Thread(target=node._watch, daemon=True)
            watcher.start()  # it returns once it has reported
            watcher.join(60)
            took = time.monotonic() - start
        finally:
            node._stop.set()
            node_lib.ServerProbe = original
        self.assertFalse(watcher.is_alive(), "the watcher reported no peer within 60 s")
        return node, reported, took

    def test_a_peer_that_stops_answering_is_reported_after_stall_timeout(self):
        # A peer whose port accepts connections but whose server does not answer (a stopped
        # process, a hung machine: `ServerProbe` says STALLED, tests/ps/membership_test.py)
        # is reported after `stall_timeout`, named with why; one that answers never is.
        answers = {"localhost:1": STALLED, "localhost:2": ANSWERED}

        class Probe:
            def __init__(self, timeout):
                self.timeout = timeout
                self.errors = {"localhost:1": "DeadlineExceededError: Deadline Exceeded"}

            def __call__(self, address, task):
                return answers[address]

            def close(self):
                pass

        node, reported, took = self.watch(Probe, peer_timeout=10.0, stall_timeout=1.0)
        self.assertEqual(reported, [1])
        self.assertGreaterEqual(took, 1.0)
        self.assertRegex(node.dead_message(1),
                         r"/job:worker/task:1 at localhost:1 stopped answering \(no answer for "
                         r"\d+ s, stall_timeout=1 s; DeadlineExceededError: Deadline Exceeded\)")

    def test_an_exited_courier_names_the_peer_that_does_not_answer_else_itself(self):
        # The courier exits when a peer dies or hangs under it (its connection fails, or
        # never opens): the worker names that peer, gone or stopped with its port open. (A
        # TCP connect, which the kernel answers for a stopped process, named the courier:
        # issue 22.) With every peer answering, the courier itself.
        for answers, blamed, why in (
                ({"localhost:1": ANSWERED, "localhost:2": STALLED}, 2,
                 r"/job:worker/task:2 at localhost:2 stopped answering \(DeadlineExceeded"),
                ({"localhost:1": GONE, "localhost:2": ANSWERED}, 1,
                 r"/job:worker/task:1 at localhost:1 stopped answering \(nothing accepts"),
                ({"localhost:1": ANSWERED, "localhost:2": ANSWERED}, 3,
                 r"^tfdist: the courier of /job:worker/task:0 \(the process that carries its "
                 r"messages to its peers\) exited")):
            with self.subTest(answers=answers):
                class Probe:
                    def __init__(self, timeout):
                        self.timeout = timeout
                        self.errors = {"localhost:1": "nothing accepts connections there",
                                       "localhost:2": "DeadlineExceededError: Deadline"}

                    def __call__(self, address, task, answers=answers):
                        return answers[address]

                    def close(self):
                        pass

                node, reported, _ = self.watch(Probe, peer_timeout=60.0, stall_timeout=60.0,
                                               courier_exited=True)
                self.assertEqual(reported, [blamed])
                self.assertRegex(node.dead_message(blamed), why)

    def test_a_stalled_peer_does_not_delay_another_peers_gone_verdict(self):
        # Peer 1 hangs: a probe of it takes its whole deadline, here until peer 2 has been
        # probed as often (at most 3 s, a probe's deadline). Peer 2 was killed: nothing
        # listens there. The peers are probed at once, so peer 2 is reported after
        # `peer_timeout` without a probe of peer 1 ever waiting out its deadline. (Probed
        # one after the other, each probe of peer 2 waited for peer 1's: 7 s, two waits.)
        probes = {"localhost:1": 0, "localhost:2": 0}
        change = threading.Condition()
        waited_out = []

        class Probe:
            def __init__(self, timeout):
                self.timeout, self.errors = timeout, {}

            def __call__(self, address, task):
                with change:
                    probes[address] += 1
                    change.notify_all()
                    if address == "localhost:2":
                        return GONE
                    if not change.wait_for(
                            lambda: probes["localhost:2"] >= probes["localhost:1"], timeout=3.0):
                        waited_out.append(probes[address])
                    return STALLED

            def close(self):
                pass

        node, reported, took = self.watch(Probe, peer_timeout=1.0, stall_timeout=60.0)
        self.assertEqual(reported, [2])
        self.assertEqual(waited_out, [])
        self.assertGreaterEqual(took, 1.0)
        self.assertIn("/job:worker/task:2 at localhost:2 stopped answering (nothing accepts "
                      "connections there)", node.dead_message(2))


class ClusterTest(tf.test.TestCase):

    def test_connected_graph_equals_all_reduce_and_push_sum_mass_is_conserved(self):
        # About 45 s (3 workers and their couriers starting on 2 cores). Overlap off. The
        # first fit, fully connected with plain SGD, is all-reduce SGD: each worker's
        # weights equal one process's on the three workers' batches taken together. The
        # second, on an irregular graph, moves the push-sum weights away from 1 while their
        # sum stays 3 at every epoch end (every message of a step is taken at that step).
        # Worker 0 takes a 13th step alone (the others' end markers come instead of their
        # messages); `join` then averages the models once, all the mass kept (sum of w = 3):
        # the same bits on every worker, the BatchNormalization statistics that no step
        # gossips included (their plain mean). Each worker saved a `.keras` file before its
        # join: loading it restores its push-sum weight and step, and plain Keras loads it.
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 3, "--strategy=sgp", "--epochs=2",
                                      "--sgp_scenario=equivalence", num_ps=0, program=PROGRAM)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        workers = [load_result(out, f"worker{r}.json") for r in range(3)]
        reference = one_process_reference(workers[0]["initial"], epochs=2)
        for rank, worker in enumerate(workers):
            self.assertEqual(worker["devices"], [f"/job:worker/replica:0/task:{rank}/"
                                                 "device:CPU:0"])
            for got, want in zip(worker["connected"], reference):
                self.assertAllClose(np.array(got), want, rtol=1e-5, atol=1e-6)
            self.assertAllClose(worker["first"]["push_sum_weight"], [1.0, 1.0])
            self.assertEqual(worker["progress"]["messages_late"], 0)
            self.assertEqual(worker["progress"]["message_delay_max"], 0)
            # 6 x 2 + 6 x 1 in the steps; worker 1 takes worker 0's 13th-step message (hub 0
            # sends to 1) in its join.
            self.assertEqual(worker["before_join"]["messages_received"], 18)
            # ... and after it, every message sent to it (the sum equals the sends, 55).
            self.assertEqual(worker["progress"]["messages_received"], 19 if rank == 1 else 18)
            # Nothing connects to a courier's own port (it only connects out to the peers'
            # ports): a firewall admitting only the job's port, as the Kubernetes manifests'
            # NetworkPolicy does, lets SGP run.
            self.assertEqual(worker["courier_inbound"], 0)
            # Not when the optimizer is made, once compile puts it to use.
            self.assertEqual(worker["gossip_state_attached"], [False, True])
            # 6 steps to 2 peers, 6 (worker 0: 7) to 1; 4 bytes x (7 head words + 178
            # parameters) each. And the plans of the callable graph (`tfdist.gossip.plans`):
            # chunks 0 and 1 of 32 steps of 2 peers (2 + 64 int64 words), and the end (2
            # words), to each of 2 peers.
            plans = 2 * (2 * 8 * (2 + 64) + 8 * 2)
            self.assertEqual(worker["progress"]["plan_bytes_sent"], plans)
            self.assertEqual(worker["progress"]["bytes_sent"],
                             (19 if rank == 0 else 18) * 4 * (7 + 178) + plans)
            self.assertEqual(worker["progress"]["peer_steps"],
                             [None if r == rank else 13 if r == 0 else 12 for r in range(3)])
            self.assertAllClose(worker["progress"]["final_weight_sum"], 3.0, rtol=1e-6)
            for got, want in zip(worker["final"], workers[0]["final"]):
                self.assertAllEqual(got, want)
            self.assertIn("has left the run", worker["fit_after_join"])
        weights = np.array([w["second"]["push_sum_weight"] for w in workers])
        self.assertAllClose(weights.sum(axis=0), [3.0, 3.0], rtol=1e-6)
        self.assertGreater(np.abs(weights - 1).max(), 0.2, weights)
        # The last two arrays: the moving mean and variance, each worker's own until `join`.
        statistics = [[np.array(a) for a in w["at_join"][-2:]] for w in workers]
        self.assertGreater(np.abs(statistics[0][0] - statistics[1][0]).max(), 1e-4)
        for got, part in zip(workers[0]["final"][-2:], zip(*statistics)):
            self.assertAllClose(got, np.mean(part, axis=0), rtol=1e-6, atol=1e-7)
        for worker in workers:
            saved = worker["before_join"]
            self.assertEqual(worker["restored"]["push_sum_weight"], saved["push_sum_weight"])
            self.assertEqual(worker["restored"]["step"], saved["step"])
            for got, want in zip(worker["restored_weights"], worker["before_join_weights"]):
                self.assertAllEqual(got, want)
        # Plain Keras (no strategy) loads the file with the gossip state in it.
        plain = keras.models.load_model(os.path.join(out, "worker1.keras"),
                                        custom_objects={"Observe": sgp_program.Observe})
        for got, want in zip(plain.get_weights(), workers[1]["before_join_weights"]):
            self.assertAllEqual(got, np.array(want, "float32"))

    def test_a_graph_answering_differently_on_each_worker_leaves_nobody_waiting(self):
        # After step 40 each process answers the graph function its own way (issue 22: a
        # cluster of 3 hung there when receivers computed their senders' answers). Each
        # sender's plan says what it sends: every worker ends, every message sent is taken,
        # and the push-sum mass is whole.
        out = self.get_temp_dir()
        cluster, result = run_cluster(out, 3, "--strategy=sgp", "--epochs=4",
                                      "--sgp_scenario=diverging", num_ps=0, program=PROGRAM)
        self.assertEqual(result.returncode, 0, cluster_log(cluster))
        progress = [load_result(out, f"worker{r}.json")["progress"] for r in range(3)]
        steps = 4 * (ps_program.ROWS // 3 // 2)
        self.assertGreater(steps, sgp_program.DIVERGE + 20)
        sent = [(p["bytes_sent"] - p["plan_bytes_sent"]) // (4 * (7 + 178)) for p in progress]
        self.assertEqual(sent, [steps] * 3)  # one peer a step
        self.assertEqual(sum(p["messages_received"] for p in progress), sum(sent))
        for p in progress:
            self.assertEqual(p["step"], steps)
            # Chunks 0-3 of 32 steps (84 steps: the chunk after the last step's too) of
            # 2 + 32 int64 words, and the end of 2, to each of 2 peers.
            self.assertEqual(p["plan_bytes_sent"], 4 * 544 + 32)
            self.assertAllClose(p["final_weight_sum"], 3.0, rtol=1e-6)

    def test_a_killed_worker_is_named_and_no_peer_hangs(self):
        # About 40 s. The default settings (overlap, exponential graph: with 3 workers every
        # worker hears from both others); worker 1 is killed after an epoch.
        out = self.get_temp_dir()
        with make_cluster(out, 3, "--strategy=sgp", "--epochs=400", "--sgp_scenario=long",
                          "--strategy_arg=peer_timeout=2", num_ps=0, program=PROGRAM,
                          stop_on_failure=False) as cluster:
            # Every worker has trained an epoch, so every courier has connected: the kill
            # lands mid-run, not in a courier's start (where the courier exits and its worker
            # must still name the dead peer, not its courier: tfdist/gossip/node.py).
            deadline = time.monotonic() + 180  # a bound against a hang
            while {name for name, line in list(cluster.lines)
                   if line.startswith("READY ")} != {"worker:0", "worker:1", "worker:2"}:
                self.assertLess(time.monotonic(), deadline, cluster_log(cluster))
                time.sleep(0.1)
            killed_at = time.monotonic()
            os.kill(cluster.pid("worker:1"), signal.SIGKILL)
            result = cluster.wait()
            elapsed = time.monotonic() - killed_at
        self.assertEqual(result.failed_task, "worker:1")
        self.assertLess(elapsed, 60, "the survivors should fail within seconds, not hang")
        for rank in (0, 2):
            self.assertNotEqual(result.task_returncodes[f"worker:{rank}"], 0)
            lines = "\n".join(line for name, line in cluster.lines if name == f"worker:{rank}")
            self.assertRegex(lines, r"/job:worker/task:1 at localhost:\d+ stopped answering",
                             cluster_log(cluster))
        ready = [line for _, line in cluster.lines if line.startswith("READY ")]
        logs = json.loads(ready[0][len("READY "):])
        self.assertLessEqual(logs["message_delay_max"], 1)  # max_delay
        self.assertIn("push_sum_weight", logs)


def one_process_reference(initial, epochs):
    """One process, SGD, each batch made of the three workers' batch j."""
    x, y = ps_program.data()
    rows, batch = ps_program.ROWS // 3, sgp_program.BATCH
    order = np.concatenate([np.r_[r * rows + j * batch:r * rows + (j + 1) * batch]
                            for j in range(rows // batch) for r in range(3)])
    model = ps_program.build_model("sgd")
    model.set_weights([np.array(w, "float32") for w in initial[:len(model.weights)]])
    model.fit(x[order], y[order], batch_size=3 * batch, epochs=epochs, shuffle=False,
              verbose=0)
    return model.get_weights()


if __name__ == "__main__":
    tf.test.main()
