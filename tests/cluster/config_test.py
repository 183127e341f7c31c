"""Tests of TF_CONFIG parsing, validation and building."""

import json
import random
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tfdist.cluster import ClusterConfig
from tfdist.cluster import TFConfigError
from tfdist.cluster import network
from tfdist.cluster import parse_address
from tfdist.cluster import parse_tf_config
from tfdist.cluster import pick_free_ports

GOOD = {
    "cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                "ps": ["host3:2222", "[::1]:2223"]},
    "task": {"type": "worker", "index": 1},
}


class ParseTest(tf.test.TestCase, parameterized.TestCase):

    def test_parses_json_string_dict_and_environment(self):
        from_dict = parse_tf_config(GOOD)
        self.assertEqual(parse_tf_config(json.dumps(GOOD)), from_dict)
        with tf.compat.v1.test.mock.patch.dict("os.environ", {"TF_CONFIG": json.dumps(GOOD)}):
            self.assertEqual(parse_tf_config(), from_dict)
        self.assertEqual(from_dict.task_type, "worker")
        self.assertEqual(from_dict.task_index, 1)
        self.assertEqual(from_dict.num_workers, 3)
        self.assertEqual(from_dict.num_ps, 2)
        self.assertFalse(from_dict.is_chief)
        self.assertTrue(from_dict.with_task("chief", 0).is_chief)
        self.assertEqual(from_dict.worker_rank, 2)
        self.assertEqual(from_dict.task_address, "host2:2222")

    def test_worker_zero_is_chief_without_a_chief_job(self):
        config = ClusterConfig.from_hosts(ps_hosts="a:1", worker_hosts="b:1,c:1",
                                          job_name="worker", task_index=0)
        self.assertTrue(config.is_chief)
        self.assertFalse(config.with_task("worker", 1).is_chief)
        self.assertFalse(config.with_task("ps", 0).is_chief)

    def test_index_map_is_accepted(self):
        config = parse_tf_config({"cluster": {"worker": {"1": "b:1", "0": "a:1"}},
                                  "task": {"type": "worker", "index": 0}})
        self.assertEqual(config.cluster["worker"], ("a:1", "b:1"))

    def test_round_trips_through_json_and_cluster_spec(self):
        config = parse_tf_config(GOOD)
        self.assertEqual(parse_tf_config(config.to_json()), config)
        spec = config.cluster_spec()
        self.assertEqual(spec.task_address("ps", 1), "[::1]:2223")
        self.assertEqual(config.cluster_spec(jobs=["ps"]).jobs, ["ps"])

    def test_from_hosts_matches_tf_config(self):
        built = ClusterConfig.from_hosts(
            ps_hosts=["host3:2222", "[::1]:2223"], worker_hosts=["host1:2222", "host2:2222"],
            chief_host="host0:2222", job_name="worker", task_index=1)
        self.assertEqual(built, parse_tf_config(GOOD))

    @parameterized.named_parameters(
        ("not_json", "{cluster:", "not valid JSON"),
        ("not_object", "[1, 2]", "must be a JSON object"),
        ("no_cluster", {"task": {"type": "worker"}}, "no `cluster` key"),
        ("unknown_key", {"cluster": {}, "tasks": {}}, r"Received unknown key\(s\): \['tasks'\]"),
        ("unknown_job", {"cluster": {"workers": ["a:1"]}}, "job names must be among"),
        ("index_out_of_range", {"cluster": {"worker": ["a:1"]},
                                "task": {"type": "worker", "index": 1}},
         r"between 0 and 0 for job 'worker' with 1 task\(s\). Received: 1"),
        ("negative_index", {"cluster": {"worker": ["a:1"]},
                            "task": {"type": "worker", "index": -1}}, "Received: -1"),
        ("index_not_int", {"cluster": {"worker": ["a:1"]},
                           "task": {"type": "worker", "index": "0"}}, "must be an integer"),
        ("task_type_missing", {"cluster": {"worker": ["a:1"]}, "task": {"type": "ps"}},
         "'ps' is not a job of the cluster"),
        ("bad_task_type", {"cluster": {"worker": ["a:1"]}, "task": {"type": "boss"}},
         "`task.type` must be one of"),
        ("no_port", {"cluster": {"worker": ["a"]}}, r"`cluster.worker\[0\]` must be 'host:port'"),
        ("port_text", {"cluster": {"worker": ["a:http"]}}, "numeric port"),
        ("port_range", {"cluster": {"ps": ["a:70000"]}}, "between 1 and 65535. Received: 70000"),
        ("port_zero", {"cluster": {"ps": ["a:0"]}}, "between 1 and 65535. Received: 0"),
        ("bad_host", {"cluster": {"ps": ["a b:1"]}}, "malformed host"),
        ("bad_ipv6", {"cluster": {"ps": ["[zz::1]:1"]}}, "malformed IPv6"),
        ("duplicate", {"cluster": {"ps": ["a:1"], "worker": ["a:1"]}},
         "lists the address 'a:1' twice: for ps:0 and for worker:0"),
        ("job_is_string", {"cluster": {"worker": "a:1,b:1"}}, "must be a list of 'host:port'"),
        ("job_is_number", {"cluster": {"worker": 3}}, "must be a list of 'host:port'"),
        ("gap_in_index_map", {"cluster": {"worker": {"0": "a:1", "2": "b:1"}}}, "without gaps"),
        ("two_chiefs", {"cluster": {"chief": ["a:1", "b:1"]}}, "holds at most one task"),
        ("address_not_string", {"cluster": {"worker": [2222]}}, "must be a 'host:port' string"),
        ("port_arabic_indic_digit", {"cluster": {"worker": ["a:\u0663"]}}, "ASCII digits"),
        ("port_superscript", {"cluster": {"worker": ["a:\u00b2"]}}, "ASCII digits"),
        ("only_ps", {"cluster": {"ps": ["a:1"]}}, "no task that trains: it needs a 'chief' or "
                                                  "'worker' job. Received jobs: \\['ps'\\]"),
        ("rpc_layer_not_string", {"cluster": {"worker": ["a:1"]}, "rpc_layer": 5},
         "`rpc_layer` must be a string. Received: 5 of type int"),
        ("environment_not_string", {"cluster": {"worker": ["a:1"]}, "environment": ["x"]},
         "`environment` must be a string"),
        ("task_is_list", {"cluster": {"worker": ["a:1"]}, "task": []}, "`task` must be an object"),
        ("unknown_task_key", {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "id": 0}},
         r"among \['type', 'index', 'trial'\]. Received unknown key\(s\): \['id'\]"),
    )
    def test_bad_config_names_the_field(self, value, message):
        if isinstance(value, dict):
            value = json.dumps(value)
        with self.assertRaisesRegex(TFConfigError, message):
            parse_tf_config(value)

    def test_valid_configs_that_look_odd(self):
        # A fully qualified name ending in the root's dot, a trial key, a string environment.
        config = parse_tf_config({"cluster": {"worker": ["w-0.job.svc.cluster.local.:2222"]},
                                  "task": {"type": "worker", "index": 0, "trial": "1"},
                                  "environment": "cloud", "rpc_layer": "grpc"})
        self.assertEqual(config.task_address, "w-0.job.svc.cluster.local.:2222")

    def test_missing_environment_variable(self):
        with tf.compat.v1.test.mock.patch.dict("os.environ", {}, clear=True):
            with self.assertRaisesRegex(TFConfigError, "TF_CONFIG is not set"):
                parse_tf_config()

    def test_error_is_a_value_error(self):
        self.assertTrue(issubclass(TFConfigError, ValueError))

    def test_parse_address(self):
        self.assertEqual(parse_address("localhost:2222"), ("localhost", 2222))
        self.assertEqual(parse_address("[::1]:80"), ("::1", 80))

    @settings(max_examples=200, deadline=None)
    @given(st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=12),
        lambda children: st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["cluster", "task", "type", "index", "worker", "ps",
                                           "chief", "0", "x"]), children, max_size=4),
        max_leaves=12))
    def test_generated_configs_parse_or_raise_tf_config_error(self, value):
        # Any JSON value either parses into a consistent config or raises TFConfigError:
        # never another exception type.
        try:
            config = parse_tf_config(json.dumps(value))
        except TFConfigError as e:
            self.assertTrue(str(e))
        else:
            self.assertEqual(parse_tf_config(config.to_json()), config)

    @settings(max_examples=200, deadline=None)
    @given(st.text(max_size=20))
    def test_generated_addresses_parse_or_raise(self, address):
        try:
            host, port = parse_address(address)
        except TFConfigError as e:
            self.assertIn("`address`", str(e))
        else:
            self.assertTrue(host)
            self.assertBetween(port, 1, 65535)


class FreePortsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(((32768, 60999), (15000, 30000)), ((1024, 60999), (61000, 65535)),
                              ((10000, 65535), (1024, 9999)), ((1024, 65535), (1024, 65535)),
                              ((14000, 64999), (1024, 13999)))
    def test_ports_come_from_outside_any_ephemeral_range(self, ephemeral, expected):
        # Ports are picked outside the range where outgoing connections take theirs, wherever
        # the machine puts it (`ip_local_port_range` starting below 15000 once failed).
        with mock.patch.object(network, "_ephemeral_range", return_value=ephemeral), \
                mock.patch.object(network, "_port_is_free", return_value=True):
            self.assertEqual(network._port_range(), expected)
            ports = pick_free_ports(5, rng=random.Random(0))
        self.assertLen(set(ports), 5)
        for port in ports:
            self.assertBetween(port, *expected)


if __name__ == "__main__":
    tf.test.main()
