"""The ps service's control loop in one process: what a malformed control message or a
hello naming a module the ps was not told to import gets (a log line or an error answer,
never a dead control thread or an import).

The service's queues live on the local CPU: no cluster.
"""

import sys
import time
import types

import tensorflow as tf

from tfdist.cluster import ClusterConfig
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.admission import refused_import
from tfdist.ps.client import ShardClient
from tfdist.ps.client import agree_on_one_run
from tfdist.ps.client import check_one_run
from tfdist.ps.membership import BadControlMessage
from tfdist.ps.membership import control_message
from tfdist.ps.service import PSService
from tfdist.ps.spec import RunError
from tfdist.ps.spec import ShardSpec
from tfdist.ps.worker import job_id

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
# Two ps tasks in one process: each on a logical CPU of its own (tests/conftest.py makes
# three), so that their resources do not meet.
TWO_DEVICES = ["/job:localhost/replica:0/task:0/device:CPU:1",
               "/job:localhost/replica:0/task:0/device:CPU:2"]


def spec(**fields):
    base = dict(mode="gradients", policy={"name": "async", "staleness": "none"},
                num_workers=2, worker_tasks=["/job:worker/task:0", "/job:worker/task:1"],
                worker_addresses=["localhost:1", "localhost:2"], num_ps=1, shard=0,
                # (With the masters of the optimizer's own variables, as a worker's spec has.)
                variables=[{"path": "dense/kernel", "shape": [2], "dtype": "float32",
                            "role": "gradient"},
                           {"path": "sgd/iteration", "shape": [], "dtype": "int64",
                            "role": "optimizer"},
                           {"path": "sgd/learning_rate", "shape": [], "dtype": "float32",
                            "role": "optimizer"}],
                optimizer={"class_name": "SGD", "config": {"learning_rate": 0.1}},
                init_timeout=60.0)
    return ShardSpec(**{**base, **fields})


# The fields of the spec of a job of 3 workers and 2 ps tasks.
THREE_WORKERS = dict(num_ps=2, num_workers=3,
                     worker_tasks=[f"/job:worker/task:{r}" for r in range(3)],
                     worker_addresses=[f"localhost:{r + 1}" for r in range(3)])


def hello(rank=0, job=None, nonce=None, **fields):
    """A hello of worker `rank`; `job`: the job id its spec carries."""
    sent = spec(**fields).to_json()
    if job is not None:
        sent["job"] = job
    return wire.encode({"type": "hello", "rank": rank, "nonce": nonce or f"n{rank}",
                        "spec": sent})


class ControlMessageTest(tf.test.TestCase):

    def test_a_malformed_message_is_refused_naming_what_is_wrong(self):
        for text, error in [
                (b"\xff{", r"not JSON"),
                ("{not json", r"not JSON .*Received: '\{not json'"),
                ("[1, 2]", r"not a JSON object but a list"),
                ('"hello"', r"not a JSON object but a str"),
                ('{"rank": 0}', r"`type` must be one of \['absent', 'hello', 'refused', "
                                r"'stop'\]. Received: type=None"),
                ('{"type": "refused", "rank": 1, "run": "r"}', r"a refused message needs a "
                                                               r"`error` field"),
                ('{"type": "bye"}', r"Received: type='bye'"),
                ('{"type": "absent"}', r"an absent message needs a `rank` field"),
                ('{"type": "absent", "rank": "1"}', r"`rank` of an absent message must be an "
                                                    r"integer. Received: rank='1'"),
                ('{"type": "absent", "rank": true}', r"must be an integer. Received: rank=True"),
                ('{"type": "hello", "rank": 0, "nonce": "x", "spec": []}',
                 r"`spec` of a hello message must be a JSON object. Received: spec=\[\]"),
                ('{"type": "absent", "rank": -1}', r"`rank` of an absent message must be "
                                                   r">= 0. Received: rank=-1")]:
            with self.subTest(text=text):
                with self.assertRaisesRegex(BadControlMessage, error):
                    control_message(text)
        with self.assertRaisesRegex(BadControlMessage, r"must be >= 0 and below "
                                                       r"num_workers=2. Received: rank=2"):
            control_message('{"type": "absent", "rank": 2}', num_workers=2)
        self.assertEqual(control_message(b'{"type": "stop"}'), {"type": "stop"})


def drain_service_queues():
    """Empties the control and hello queues of every device the tests' ps tasks use. Those
    queues belong to the device, not to a `PSService`: a message an earlier test left there
    (an answer never read, a control message no thread took) would reach the next test's
    service or client, and the order the tests run in would decide what they see."""
    for device in [DEVICE, *TWO_DEVICES]:
        with tf.device(device):
            names = [(protocol.CONTROL_QUEUE, [tf.string])] + [
                (f"hello/{rank}", [tf.string]) for rank in range(8)]
            for name, dtypes in names:
                queue = tf.raw_ops.FIFOQueueV2(component_types=dtypes, shapes=[], capacity=-1,
                                               container=protocol.CONTAINER, shared_name=name)
                for _ in range(int(tf.raw_ops.QueueSizeV2(handle=queue))):
                    tf.raw_ops.QueueDequeueV2(handle=queue, component_types=dtypes)


class ServiceTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        drain_service_queues()

    def service(self, imports=()):
        return PSService(types.SimpleNamespace(task_index=0), imports=imports, device=DEVICE)

    def answer(self, service, rank):
        with tf.device(DEVICE):
            self.assertEqual(int(tf.raw_ops.QueueSizeV2(handle=service.hello_queues[rank])), 1)
            text = tf.raw_ops.QueueDequeueV2(handle=service.hello_queues[rank],
                                             component_types=[tf.string])[0]
        return wire.decode(text.numpy())

    def test_bad_messages_are_logged_and_a_later_hello_still_starts_a_run(self):
        service = self.service()
        spec_json = spec().to_json()
        for text, logged in [
                (b"\x00garbage", ": not JSON"), (b"7", ": not a JSON object"),
                (b'{"type": "hello", "rank": 0}', r" from rank 0 \(as it says\): .*needs a "
                                                  r"`nonce` field"),
                (wire.encode({"type": "hello", "rank": 1, "nonce": 3, "spec": spec_json}),
                 r" from /job:worker/task:1 \(rank 1, as it says\): `nonce` of a hello "
                 r"message must be a string"),
                (hello(rank=5), r" from rank 5 \(as it says\): .*below num_workers=2. "
                                r"Received: rank=5"),
                (b'{"type": "absent", "rank": 0}', None)]:
            with self.subTest(text=text):
                if logged is None:  # no run yet: an absent worker changes nothing
                    service.handle_control(text)
                    continue
                with self.assertLogs("tfdist", "ERROR") as logs:
                    service.handle_control(text)
                self.assertRegex("\n".join(logs.output),
                                 "/job:ps/task:0: ignored a bad control message" + logged)
        # A worker whose rank its own spec does not have (a wrong TF_CONFIG) is told why,
        # not left to wait for an answer (issue 22); nobody else was answered.
        self.assertEqual(list(service.hello_queues), [5])
        self.assertRegex(self.answer(service, 5)["error"],
                         r"`rank` of a hello message must be >= 0 and below num_workers=2. "
                         r"Received: rank=5")
        # A hello whose spec is not a shard's spec is answered with what is wrong.
        with self.assertLogs("tfdist", "ERROR"):
            service.handle_control(wire.encode({"type": "hello", "rank": 1, "nonce": "z",
                                                "spec": {"mode": "gradients"}}))
        self.assertRegex(self.answer(service, 1)["error"],
                         r"the spec of a hello is not a shard's spec \(KeyError")
        # (Its run waits 1 s for a chief that never comes, then ends with a logged error.)
        service.handle_control(hello(rank=0, init_timeout=1.0))
        answer = self.answer(service, 0)
        self.assertIsNone(answer["error"])
        self.assertEqual(answer["nonce"], "n0")
        self.assertTrue(answer["initialize"])
        self.assertEqual(answer["run"], service.current.run)
        # An absent rank out of the run's range is refused; one in range reaches the run.
        with self.assertLogs("tfdist", "ERROR") as logs:
            service.handle_control(b'{"type": "absent", "rank": 9}')
        self.assertRegex(logs.output[0], r"from rank 9 \(as it says\): .*below "
                                         r"num_workers=2. Received: rank=9")

    def test_a_hello_naming_a_module_not_given_to_the_ps_is_refused_not_imported(self):
        module = "tests.ps.not_imported_by_the_ps"
        service = self.service(imports=["tests.strategies"])
        with self.assertLogs("tfdist", "ERROR"):
            service.handle_control(hello(imports=[module]))
        error = self.answer(service, 0)["error"]
        self.assertIn(f"asks the ps to import {module!r}", error)
        self.assertIn(f"--ps_import={module}", error)
        self.assertIsNone(service.current)  # no run was built
        self.assertNotIn(module, sys.modules)
        # A staleness function is a module too.
        with self.assertLogs("tfdist", "ERROR"):
            service.handle_control(hello(policy={"name": "async",
                                                 "staleness": "os:system"}))
        self.assertIn("import 'os' (for 'os:system')", self.answer(service, 0)["error"])

    def test_the_modules_a_ps_may_import(self):
        allowed = ["tests.strategies.ps_functions"]
        self.assertIsNone(refused_import(spec(imports=["keras.src.optimizers.adam"]), allowed))
        self.assertIsNone(refused_import(spec(imports=["tfdist.ps.outer_optimizer"]), []))
        self.assertIsNone(refused_import(spec(
            imports=["tests.strategies.ps_functions"],
            policy={"name": "async", "staleness": "tests.strategies.ps_functions:frozen"}),
            allowed))
        self.assertIsNone(refused_import(spec(policy={"name": "async",
                                                      "staleness": "inverse"}), []))
        for imports in (["kerasx"], ["tfdistx"], ["tests.strategies"],
                        ["tests.strategies.ps_functionsx"]):
            with self.subTest(imports=imports):
                self.assertIn("was not named on the ps task's command line",
                              refused_import(spec(imports=imports), allowed))
        # A staleness function runs on the ps: Keras's and tfdist's functions are not ones
        # (a message could name any of them); tfdist's own go by name.
        # Only a function defined in the module named: not an object it imported.
        from tfdist.ps.policies import resolve_function
        self.assertEqual(resolve_function("tests.strategies.ps_functions:frozen").__name__,
                         "frozen")
        with self.assertRaisesRegex(ValueError, r"'tfdist.ps.policies:math.prod' names .* "
                                                r"not defined in 'tfdist.ps.policies'"):
            resolve_function("tfdist.ps.policies:math.prod")
        # A name that is neither tfdist's own nor `module:function` would be imported as is.
        self.assertIn("must be one of ['inverse', 'none'] or `module:function`",
                      refused_import(spec(policy={"name": "async", "staleness": "this"}),
                                     allowed))
        for function in ("keras.utils:get_file", "tfdist.launch.main:main"):
            with self.subTest(staleness=function):
                error = refused_import(spec(policy={"name": "async", "staleness": function}),
                                       allowed)
                self.assertIn("a staleness function, which runs on the ps, must be in a module "
                              "named on the ps task's command line", error)
                self.assertIn(f"--ps_import={function.partition(':')[0]}", error)


class RunOwnershipTest(tf.test.TestCase):
    """Issue 22: a run belongs to a job. A chief back after its run finished takes the run's
    final weights (it never initialises it again); a new job starts afresh; a ps restarted
    empty under a run in progress is refused by the chief, naming it."""

    def setUp(self):
        super().setUp()
        drain_service_queues()

    def answer(self, service, rank):
        return ServiceTest.answer(self, service, rank)

    def start_run(self, service, job, **fields):
        """Rank 0 starts a run of `job` and initialises its masters; rank 1 joins; both
        train (their SYNC came). Returns the run."""
        service.handle_control(hello(rank=0, job=job, **fields))
        self.assertTrue(self.answer(service, 0)["initialize"])
        run = service.current
        with tf.device(service.device):
            run.masters["dense/kernel"].assign([1.0, 2.0])
            run.masters["sgd/iteration"].assign(0)
            run.masters["sgd/learning_rate"].assign(0.1)
        service.handle_control(hello(rank=1, job=job, **fields))
        self.assertFalse(self.answer(service, 1)["initialize"])
        for rank in (0, 1):
            run.send_control(protocol.SYNC, rank)
        self.addCleanup(self.stop, run)
        return run

    def stop(self, run):
        """Ends the thread of `run` (a thread left in a TensorFlow call aborts the process at
        exit): its update loop if it serves; a run waiting for a chief that never
        initialises fails after its `init_timeout`."""
        if not run.finished.is_set():
            run.send_control(protocol.STOP, 0)
        self.assertTrue(run.finished.wait(120))  # a bound against a hang

    def test_shutdown_ends_the_service_and_its_run(self):
        # `tfdist.launch.serve()` returns through it: a thread left in a TensorFlow call
        # could abort the process at exit. A run serving updates stops at once...
        service = PSService(types.SimpleNamespace(task_index=0), liveness_interval=3600,
                            device=DEVICE)
        run = self.start_run(service, "job-1")
        service.start()
        self.assertTrue(service.shutdown(120))  # a bound against a hang
        self.assertTrue(run.finished.is_set())
        self.assertIsNone(run.failure)
        self.assertFalse(any(t.is_alive() for t in service._threads))
        # ... and one still waiting for its chief to initialise it fails, saying why.
        service = PSService(types.SimpleNamespace(task_index=0), liveness_interval=3600,
                            device=DEVICE)
        service.handle_control(hello(rank=0, job="job-2", init_timeout=3600.0))
        self.assertTrue(self.answer(service, 0)["initialize"])
        run = service.current
        service.start()
        with self.assertLogs("tfdist", "ERROR"):
            self.assertTrue(service.shutdown(120))
        self.assertRegex(run.failure, r"^/job:ps/task:0 was stopped before the chief "
                                      r"/job:worker/task:0 at \S+ initialised the master "
                                      r"variables$")

    def hand_over(self):
        """Job 1's run; the chief dies, worker 1 trains on, finishes and leaves: the run has
        ended. Its scheduler starts the chief again, which says hello. Returns `(service,
        run, the chief's answer, the warnings its hello logged)`."""
        service = PSService(types.SimpleNamespace(task_index=0), device=DEVICE)
        run = self.start_run(service, "job-1")
        with self.assertLogs("tfdist", "WARNING"):
            run.send_control(protocol.DEAD, 0)
            run.send_control(protocol.LEAVE, 1)
            self.assertTrue(run.finished.wait(120))  # a bound against a hang
        self.assertIsNone(run.failure)
        with self.assertLogs("tfdist", "WARNING") as logs:
            service.handle_control(hello(rank=0, job="job-1", nonce="again"))
        return service, run, self.answer(service, 0), logs

    def test_a_chief_back_after_its_run_finished_takes_its_final_weights(self):
        # The chief is told the run finished, and takes its final weights; nothing is
        # initialised or torn down.
        service, run, answer, logs = self.hand_over()
        self.assertFalse(answer["initialize"])
        self.assertTrue(answer["finished"])
        self.assertEqual((answer["run"], answer["job"]), (run.run, "job-1"))
        self.assertIs(service.current, run)
        self.assertRegex(logs.output[0], r"/job:worker/task:0 came back to run \S+ of job "
                                         r"'job-1' after it finished: it takes its final "
                                         r"weights")
        with tf.device(service.device):
            self.assertAllEqual(run.masters["dense/kernel"].read_value(), [1.0, 2.0])
        # Worker 1 left the finished run: its rank starts a new run (a new job of the same
        # cluster), and so does another job's chief.
        service.handle_control(hello(rank=0, job="job-2", nonce="new", init_timeout=1.0))
        answer = self.answer(service, 0)
        self.assertTrue(answer["initialize"])
        self.assertFalse(answer["finished"])
        self.assertIsNot(service.current, run)
        self.addCleanup(self.stop, service.current)

    def test_a_job_is_named_by_its_launch_or_else_by_its_cluster(self):
        cluster = {"ps": ["h:1"], "worker": ["h:2", "h:3"]}
        chief, other = (ClusterConfig(cluster, "worker", index) for index in (0, 1))
        self.assertEqual(job_id(chief, {"TFDIST_JOB_ID": " launch-7 "}), "launch-7")
        # Unnamed: every task of one cluster (a restarted one too) is one job; another
        # cluster is another job.
        named = job_id(chief, {})
        self.assertRegex(named, r"^cluster-[0-9a-f]{16}$")
        self.assertEqual(job_id(other, {"TFDIST_JOB_ID": ""}), named)
        moved = ClusterConfig({**cluster, "worker": ["h:2", "h:4"]}, "worker", 0)
        self.assertNotEqual(job_id(moved, {}), named)

    def test_another_job_cannot_join_a_run_in_progress(self):
        service = PSService(types.SimpleNamespace(task_index=0), device=DEVICE)
        run = self.start_run(service, "job-a")
        service.handle_control(hello(rank=1, job="job-b", nonce="b"))
        self.assertRegex(self.answer(service, 1)["error"],
                         r"/job:worker/task:1 is a worker of job 'job-b', but /job:ps/task:0 "
                         r"holds run \S+ of job 'job-a' in progress \(ranks \[0, 1\] in it\)")
        self.assertIs(service.current, run)

    def test_a_ps_restarted_empty_under_a_run_in_progress_is_refused_naming_it(self):
        # ps:0 holds a run in progress; ps:1 was restarted: a new process, empty. The chief,
        # restarted too, says hello to both: ps:0 lets it rejoin, ps:1 would have it
        # initialise its shard afresh (its optimizer's iterations included).
        fields = dict(num_ps=2)
        ps0 = PSService(types.SimpleNamespace(task_index=0), device=TWO_DEVICES[0])
        self.start_run(ps0, "job-1", shard=0, **fields)
        ps1 = PSService(types.SimpleNamespace(task_index=1), device=TWO_DEVICES[1])
        ps0.handle_control(hello(rank=0, job="job-1", nonce="again", shard=0, **fields))
        ps1.handle_control(hello(rank=0, job="job-1", nonce="again", shard=1, init_timeout=1.0,
                                 **fields))
        self.addCleanup(self.stop, ps1.current)
        answers = [self.answer(ps0, 0), self.answer(ps1, 0)]
        self.assertEqual([a["initialize"] for a in answers], [False, True])
        with self.assertRaisesRegex(
                RunError, r"/job:ps/task:1 at host:1 holds no run of job 'job-1' \(started "
                          r"empty: a replacement ps task\?\), while /job:ps/task:0 at host:0 "
                          r"holds run \S+ of job 'job-1' in progress.*Restart the job from the "
                          r"chief's last checkpoint"):
            check_one_run(answers, ["/job:ps/task:0", "/job:ps/task:1"], ["host:0", "host:1"],
                          "job-1")
        # Shards that agree pass: every one new, every one in progress, every one finished.
        for state in ({"initialize": True}, {"initialize": False},
                      {"initialize": False, "finished": True}):
            agreeing = [{"run": f"r{shard}", "job": "job-1", **state} for shard in (0, 1)]
            check_one_run(agreeing, ["/job:ps/task:0", "/job:ps/task:1"],
                          ["host:0", "host:1"], "job-1")

    def serving(self, index, device):
        """ps task `index` on `device`, its control thread answering hellos (its liveness
        watcher idle: the workers here have no servers)."""
        service = PSService(types.SimpleNamespace(task_index=index), liveness_interval=3600,
                            device=device).start()
        self.addCleanup(self.end, service)
        return service

    def serves(self, run, ranks):
        """Waits until `run` serves: the replies to the SYNCs `ranks` sent. (Its thread
        starts serving with eager ops, which once failed under load while another thread
        of the process ran its own: a shape-mismatched `progress` assign.)"""
        for rank in ranks:
            with tf.device(run.device):
                tf.raw_ops.QueueDequeueV2(handle=run.reply_queues[rank],
                                          component_types=wire.REPLY_DTYPES)

    def end(self, service):
        """Stops `service`'s threads, and waits for them: the control queue of its device
        outlives it, and the next test's service must be the only one reading it."""
        self.assertTrue(service.shutdown(120))  # a bound against a hang
        self.assertFalse(any(thread.is_alive() for thread in service._threads))

    def clients(self, rank, services):
        """Worker `rank`'s `ShardClient` of each ps task of `services`."""
        connection = types.SimpleNamespace(
            rank=rank, ps_devices=[s.device for s in services],
            ps_names=[s.task for s in services],
            ps_addresses=[f"host:{s.config.task_index}" for s in services])
        return [ShardClient(connection, shard) for shard in range(len(services))]

    def say_hello(self, clients):
        """Each client's hello (its worker's spec for its shard); returns the answers."""
        return [c.hello(spec(job="job-1", shard=c.shard, **THREE_WORKERS), timeout=120)
                for c in clients]

    def replaced(self):
        """ps:0 holds job 1's run in progress (`THREE_WORKERS`); ps:1 was restarted: empty.
        Returns the two services, serving."""
        ps0 = PSService(types.SimpleNamespace(task_index=0), liveness_interval=3600,
                        device=TWO_DEVICES[0])
        self.serves(self.start_run(ps0, "job-1", shard=0, **THREE_WORKERS), ranks=(0, 1))
        ps0.start()  # (its liveness watcher idle, as `serving`'s)
        self.addCleanup(self.end, ps0)
        return ps0, self.serving(1, TWO_DEVICES[1])

    def test_workers_finding_a_replaced_ps_are_refused_or_told_at_once(self):
        # The chief, restarted, says hello to both: ps:1 tells it to initialise its shard,
        # ps:0 not. Worker 2 joins ps:1's run before the chief compares its answers, and its
        # own pass (the chief said hello there, and initialises the shards one after the
        # other). The chief refuses the run, and ps:1's run ends with its error: worker 2's
        # first sync is told at once. Before, worker 2 waited init_timeout, then failed
        # saying the chief did not initialise.
        ps0, ps1 = self.replaced()
        chief, worker2 = self.clients(0, [ps0, ps1]), self.clients(2, [ps0, ps1])
        answers = self.say_hello(chief)
        replacement = ps1.current
        self.addCleanup(self.stop, replacement)
        agree_on_one_run(worker2, self.say_hello(worker2), "job-1")
        with self.assertLogs("tfdist", "ERROR"):
            with self.assertRaisesRegex(RunError, r"/job:ps/task:1 at host:1 holds no run of "
                                                  r"job 'job-1' \(started empty"):
                agree_on_one_run(chief, answers, "job-1")
            self.assertTrue(replacement.finished.wait(30), "it waits for init_timeout")
        worker2[1].open_push_queue([tf.float32])  # (as a worker without compression does)
        with self.assertRaisesRegex(RunError, r"^/job:ps/task:1: /job:worker/task:0 refused "
                                              r"run \S+, which its chief had not initialised: "
                                              r"the ps tasks do not hold one run"):
            worker2[1].sync()  # (after the run closed its queues: why is kept for it)
        # Then worker 1 (not the chief), restarted too: its hello starts a run on ps:1, which
        # the chief never joins. Before, it passed (only the chief is told to initialise).
        # It refuses it, naming ps:1, and that run ends at once with its error.
        worker1 = self.clients(1, [ps0, ps1])
        answers = self.say_hello(worker1)
        replacement = ps1.current
        self.addCleanup(self.stop, replacement)
        self.assertEqual([(a["initialized"], a["chief"]) for a in answers],
                         [(True, True), (False, False)])
        with self.assertLogs("tfdist", "ERROR"):
            with self.assertRaisesRegex(
                    RunError, r"/job:ps/task:1 at host:1 holds run \S+ of job 'job-1', which "
                              r"its chief never joined \(started empty: a replacement ps "
                              r"task\?\), while /job:ps/task:0 at host:0 holds run \S+ of job "
                              r"'job-1' in progress.*Restart the job from the chief's last "
                              r"checkpoint"):
                agree_on_one_run(worker1, answers, "job-1")
            self.assertTrue(replacement.finished.wait(30), "it waits for init_timeout")
        self.assertRegex(replacement.failure, r"^/job:worker/task:1 refused run \S+, which "
                                              r"its chief had not initialised: the ps tasks "
                                              r"do not hold one run")

    def test_a_worker_counted_out_that_syncs_without_a_hello_is_fenced(self):
        # Worker 1 was declared dead (a stopped process), then wakes: its push is fenced
        # (tests/ps/updater_test.py), and its exit syncs. That SYNC, with no hello since,
        # used to take it back into the run (LIVE again: the chief's join() waited for it).
        # It is told it is counted out instead; a new process (hello, then SYNC) rejoins.
        service = PSService(types.SimpleNamespace(task_index=0), device=DEVICE)
        run = self.start_run(service, "job-1")
        self.serves(run, ranks=(0, 1))
        with self.assertLogs("tfdist", "WARNING") as logs:
            run.send_control(protocol.DEAD, 1)
            deadline = time.monotonic() + 60  # a bound against a hang
            while not any("going on with" in line for line in logs.output):
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.01)
        self.assertRegex("\n".join(logs.output), r"/job:worker/task:1 at localhost:2 died; "
                                                 r"going on with 1 worker")
        self.assertEqual(run.members.status[1], protocol.DIED)
        run.send_control(protocol.SYNC, 1)
        deadline = time.monotonic() + 60  # a bound against a hang
        with tf.device(run.device):
            while not int(tf.raw_ops.QueueSizeV2(handle=run.reply_queues[1])):
                self.assertLess(time.monotonic(), deadline, "the SYNC was not answered")
                time.sleep(0.01)
            token, message, _, _ = tf.raw_ops.QueueDequeueV2(
                handle=run.reply_queues[1], component_types=wire.REPLY_DTYPES)
        self.assertEqual(int(token), -1)
        self.assertRegex(message.numpy().decode(), r"the run counts this worker out")
        self.assertEqual(run.members.status[1], protocol.DIED)
        service.handle_control(hello(rank=1, job="job-1"))
        self.assertIsNone(self.answer(service, 1)["error"])
        run.send_control(protocol.SYNC, 1)
        self.serves(run, ranks=(1,))
        self.assertEqual(run.members.status[1], protocol.LIVE)
        # A control entry of a rank the run does not have (anyone reaching the port can
        # enqueue one) is logged and ignored: it ended the run before.
        with self.assertLogs("tfdist", "ERROR") as logs:
            run.send_control(protocol.SYNC, 7)
            deadline = time.monotonic() + 60  # a bound against a hang
            while not logs.output:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.01)
        self.assertRegex(logs.output[0], r"ignored a control entry \(tag -4\) of rank 7: run "
                                         r"\S+ has ranks 0 to 1")
        self.assertFalse(run.finished.is_set())

    def test_workers_starting_a_job_at_once_may_start_its_run_on_different_ps_tasks(self):
        # Worker 1's hello starts the run on ps:0; then the chief says hello to both (it
        # starts the run on ps:1) and initialises them; then worker 1's hello reaches ps:1.
        # Worker 1 finds ps:1's run initialised and ps:0's not claimed by the chief when it
        # answered: it asks ps:0 again, where the chief has said hello since. Not a ps
        # started empty: nobody is refused.
        ps0, ps1 = self.serving(0, TWO_DEVICES[0]), self.serving(1, TWO_DEVICES[1])
        chief, worker1 = self.clients(0, [ps0, ps1]), self.clients(1, [ps0, ps1])
        first = self.say_hello(worker1[:1])
        self.assertEqual((first[0]["initialized"], first[0]["chief"]), (False, False))
        answers = agree_on_one_run(chief, self.say_hello(chief), "job-1")
        self.assertEqual([a["initialize"] for a in answers], [True, True])
        for service in (ps0, ps1):
            self.addCleanup(self.stop, service.current)
            with tf.device(service.device):
                for master in service.current.masters.values():
                    master.assign(tf.zeros(master.shape, master.dtype))
            service.current.send_control(protocol.SYNC, 0)
            self.serves(service.current, ranks=(0,))
        answers = agree_on_one_run(worker1, first + self.say_hello(worker1[1:]), "job-1")
        self.assertEqual([(a["initialized"], a["chief"]) for a in answers],
                         [(True, True), (True, True)])
        # A refusal that comes after the chief initialised the run (a worker that saw two
        # runs meanwhile) is a race, not a bad message: a warning, and the run goes on. One
        # naming another run is ignored as bad.
        run = ps0.current
        with self.assertLogs("tfdist", "WARNING") as logs:
            ps0.handle_control(wire.encode({"type": "refused", "rank": 1, "run": run.run,
                                            "error": "two runs"}))
        self.assertEqual([r.levelname for r in logs.records], ["WARNING"])
        self.assertRegex(logs.output[0], r"/job:worker/task:1 refused run \S+ after its chief "
                                         r"had initialised it: the run is not ended for it; "
                                         r"that worker stops \(two runs\)")
        self.assertIsNone(run.refused)
        with self.assertLogs("tfdist", "ERROR") as logs:
            ps0.handle_control(wire.encode({"type": "refused", "rank": 1, "run": "other",
                                            "error": "two runs"}))
        self.assertRegex(logs.output[0], r"ignored a bad control message.*it refuses run "
                                         r"'other', which is not this ps task's current run")
        self.assertIs(ps0.current, run)

    def test_a_run_handed_to_its_chief_outlives_the_next_hello(self):
        # The chief, back after its run finished, is handed it: it reads the masters after
        # its hello (its model's final weights, then the model it saves). Another job's
        # hello coming in between (here: before the chief's first read) freed them before:
        # the chief's reads, its save's, failed (the variable does not exist).
        service, run, answer, _ = self.hand_over()
        self.assertTrue(answer["finished"])
        # The chief opens the run's masters, as its client does (`ShardClient.open_run`).
        _, masters = protocol.open_run_variables(service.device, run.run, spec())
        service.handle_control(hello(rank=0, job="job-2", nonce="new", init_timeout=1.0))
        newer = service.current
        self.addCleanup(self.stop, newer)
        self.assertIsNot(newer, run)
        self.assertTrue(self.answer(service, 0)["initialize"])
        with tf.device(service.device):
            self.assertAllEqual(masters["dense/kernel"].read_value(), [1.0, 2.0])
            self.assertEqual(int(masters["sgd/iteration"].read_value()), 0)
        # Freed once the run after it is replaced in turn (job 2's chief never initialised
        # its run: it failed after its init_timeout).
        with self.assertLogs("tfdist", "ERROR"):
            self.stop(newer)
        service.handle_control(hello(rank=0, job="job-3", nonce="third", init_timeout=1.0))
        self.addCleanup(self.stop, service.current)
        self.assertTrue(self.answer(service, 0)["initialize"])
        with tf.device(service.device), self.assertRaises(tf.errors.OpError):
            masters["dense/kernel"].read_value()


if __name__ == "__main__":
    # The suite's logical CPUs (tests/conftest.py, which pytest loads): two ps tasks here
    # need a device each.
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 3)
    tf.test.main()
