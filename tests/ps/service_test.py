"""The ps service's control loop in one process: what a malformed control message or a
hello naming a module the ps was not told to import gets (a log line or an error answer,
never a dead control thread or an import).

The service's queues live on the local CPU: no cluster.
"""

import sys
import types

import tensorflow as tf

from tfdist.cluster import ClusterConfig
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.client import RunError
from tfdist.ps.client import check_one_run
from tfdist.ps.membership import BadControlMessage
from tfdist.ps.membership import control_message
from tfdist.ps.service import PSService
from tfdist.ps.service import refused_import
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
                ('{"rank": 0}', r"`type` must be one of \['absent', 'hello', 'stop'\]. "
                                r"Received: type=None"),
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


class ServiceTest(tf.test.TestCase):

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


if __name__ == "__main__":
    tf.test.main()


class RunOwnershipTest(tf.test.TestCase):
    """Issue 22: a run belongs to a job. A chief back after its run finished takes the run's
    final weights (it never initialises it again); a new job starts afresh; a ps restarted
    empty under a run in progress is refused by the chief, naming it."""

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

    def test_a_chief_back_after_its_run_finished_takes_its_final_weights(self):
        service = PSService(types.SimpleNamespace(task_index=0), device=DEVICE)
        run = self.start_run(service, "job-1")
        # The chief dies; worker 1 trains on, finishes and leaves: the run has ended.
        with self.assertLogs("tfdist", "WARNING"):
            run.send_control(protocol.DEAD, 0)
            run.send_control(protocol.LEAVE, 1)
            self.assertTrue(run.finished.wait(120))  # a bound against a hang
        self.assertIsNone(run.failure)
        # Its scheduler starts the chief again: it is told the run finished, and takes its
        # final weights; nothing is initialised or torn down.
        with self.assertLogs("tfdist", "WARNING") as logs:
            service.handle_control(hello(rank=0, job="job-1", nonce="again"))
        answer = self.answer(service, 0)
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
