"""The ps service's control loop in one process: what a malformed control message or a
hello naming a module the ps was not told to import gets (a log line or an error answer,
never a dead control thread or an import).

The service's queues live on the local CPU: no cluster.
"""

import sys
import types

import tensorflow as tf

from tfdist.ps import wire
from tfdist.ps.membership import BadControlMessage
from tfdist.ps.membership import control_message
from tfdist.ps.service import PSService
from tfdist.ps.service import refused_import
from tfdist.ps.spec import ShardSpec

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


def spec(**fields):
    base = dict(mode="gradients", policy={"name": "async", "staleness": "none"},
                num_workers=2, worker_tasks=["/job:worker/task:0", "/job:worker/task:1"],
                worker_addresses=["localhost:1", "localhost:2"], num_ps=1, shard=0,
                variables=[{"path": "dense/kernel", "shape": [2], "dtype": "float32",
                            "role": "gradient"}],
                optimizer={"class_name": "SGD", "config": {"learning_rate": 0.1}},
                init_timeout=60.0)
    return ShardSpec(**{**base, **fields})


def hello(rank=0, **fields):
    return wire.encode({"type": "hello", "rank": rank, "nonce": f"n{rank}",
                        "spec": spec(**fields).to_json()})


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
        for function in ("keras.utils:get_file", "tfdist.launch.main:main"):
            with self.subTest(staleness=function):
                error = refused_import(spec(policy={"name": "async", "staleness": function}),
                                       allowed)
                self.assertIn("a staleness function, which runs on the ps, must be in a module "
                              "named on the ps task's command line", error)
                self.assertIn(f"--ps_import={function.partition(':')[0]}", error)


if __name__ == "__main__":
    tf.test.main()
