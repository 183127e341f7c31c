"""Kubernetes manifests: schema-valid offline, and every pod computes the right TF_CONFIG."""

import json
import os
import subprocess
import sys

import kubernetes_validate
import tensorflow as tf
from absl.testing import parameterized

from tfdist.cluster import TFConfigError
from tfdist.cluster import parse_tf_config
from tfdist.cluster.kubernetes import cluster_for_job
from tfdist.cluster.kubernetes import pod_cluster_config
from tfdist.launch.kubernetes import manifests
from tfdist.launch.kubernetes import to_yaml

K8S_VERSION = "1.30"


def _validate(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _by_kind(docs):
    return {doc["kind"]: doc for doc in docs}


def _launch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], capture_output=True,
                          text=True, timeout=60, env=env)


class ManifestTest(tf.test.TestCase, parameterized.TestCase):

    def test_plain_manifests_are_valid(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"], num_ps=2,
                         num_workers=3, namespace="ml", cpu=2, memory="4Gi")
        self.assertEqual([d["kind"] for d in docs],
                         ["Service", "Service", "StatefulSet", "Job", "NetworkPolicy"])
        for doc in docs:
            _validate(doc)
        kinds = _by_kind(docs)
        job = kinds["Job"]["spec"]
        self.assertEqual(job["completionMode"], "Indexed")
        self.assertEqual(job["completions"], 3)
        self.assertEqual(job["template"]["spec"]["subdomain"], "digits-worker")
        worker = job["template"]["spec"]["containers"][0]
        self.assertEqual(worker["command"][-3:], ["--", "python", "train.py"])
        self.assertEqual(worker["resources"]["limits"], {"cpu": "2", "memory": "4Gi"})
        self.assertEqual(kinds["StatefulSet"]["spec"]["serviceName"], "digits-ps")
        self.assertEqual(kinds["StatefulSet"]["spec"]["replicas"], 2)

    def test_network_policy_admits_only_the_jobs_own_pods(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"])
        policy = _by_kind(docs)["NetworkPolicy"]["spec"]
        selector = {"tfdist.job": "digits"}
        self.assertEqual(policy["podSelector"]["matchLabels"], selector)
        self.assertEqual(policy["policyTypes"], ["Ingress"])
        self.assertEqual(policy["ingress"], [{"from": [{"podSelector": {"matchLabels": selector}}],
                                              "ports": [{"protocol": "TCP", "port": 2222}]}])
        # Every pod of the job carries the label the policy selects.
        for doc in docs:
            template = doc.get("spec", {}).get("template")
            if template:
                self.assertEqual(template["metadata"]["labels"]["tfdist.job"], "digits")

    def test_tfjob_is_valid(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"], num_ps=1,
                         num_workers=4, kind="tfjob", cpu=1)
        tfjob, policy = docs
        _validate(policy)
        self.assertEqual(tfjob["apiVersion"], "kubeflow.org/v1")
        self.assertEqual(tfjob["kind"], "TFJob")
        specs = tfjob["spec"]["tfReplicaSpecs"]
        self.assertEqual(specs["PS"]["replicas"], 1)
        self.assertEqual(specs["Worker"]["replicas"], 4)
        self.assertEqual(specs["PS"]["template"]["spec"]["containers"][0]["command"],
                         ["tfdist-launch", "--from_tf_config", "--job_name=ps"])
        # The TFJob schema lives in the operator's CRD; its pod templates are core objects.
        for replica in specs.values():
            self.assertEqual(replica["template"]["spec"]["containers"][0]["name"], "tensorflow")
            _validate({"apiVersion": "batch/v1", "kind": "Job",
                       "metadata": {"name": "check"},
                       "spec": {"template": {**replica["template"],
                                             "spec": {**replica["template"]["spec"],
                                                      "restartPolicy": "Never"}}}})

    def test_yaml_documents_parse(self):
        import yaml

        docs = manifests("digits", "me/train:1", ["python", "train.py"])
        self.assertEqual(list(yaml.safe_load_all(to_yaml(docs))), docs)

    @parameterized.named_parameters(
        ("bad_name", {"name": "Digits_Job"}, "`name` must be a DNS label"),
        ("bad_kind", {"kind": "helm"}, r"`kind` must be one of \['plain', 'tfjob'\]"),
        ("no_workers", {"num_workers": 0}, "`num_workers` must be an integer >= 1"),
        ("bad_port", {"port": 0}, "`port` must be between 1 and 65535"),
        ("command_string", {"command": "python train.py"}, "`command` must be a non-empty"),
    )
    def test_bad_arguments(self, overrides, message):
        kwargs = {"name": "digits", "image": "me/train:1", "command": ["python", "t.py"]}
        kwargs.update(overrides)
        with self.assertRaisesRegex(ValueError, message):
            manifests(**kwargs)


class PodConfigTest(tf.test.TestCase):

    def test_every_pod_derives_its_task_from_its_index(self):
        for i in range(3):
            config = pod_cluster_config("digits", "worker", 2, 3, "ml",
                                        environ={"JOB_COMPLETION_INDEX": str(i),
                                                 "HOSTNAME": f"digits-worker-{i}-xyz"})
            self.assertEqual((config.task_type, config.task_index), ("worker", i))
            self.assertEqual(config.task_address, f"digits-worker-{i}.digits-worker.ml.svc:2222")
        for i in range(2):
            config = pod_cluster_config("digits", "ps", 2, 3, "ml",
                                        environ={"HOSTNAME": f"digits-ps-{i}"})
            self.assertEqual(config.task_address, f"digits-ps-{i}.digits-ps.ml.svc:2222")
        self.assertEqual(config.cluster_spec().as_dict(),
                         cluster_for_job("digits", 2, 3, "ml").cluster_spec().as_dict())
        with self.assertRaisesRegex(TFConfigError, "cannot tell this pod's index"):
            pod_cluster_config("digits", "ps", 1, 1, environ={"HOSTNAME": "laptop"})

    def test_manifest_commands_give_each_pod_the_right_tf_config(self):
        # Run the worker pod's own command line, as the pod would, with the index the Job
        # gives pod 2, and read the TF_CONFIG the training command sees.
        docs = manifests("digits", "me/train:1", [sys.executable, "-c",
                                                  "import os; print(os.environ['TF_CONFIG'])"],
                         num_ps=2, num_workers=3, namespace="ml")
        container = _by_kind(docs)["Job"]["spec"]["template"]["spec"]["containers"][0]
        env = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "digits-worker-2-abcde",
               "PATH": "/usr/bin:/bin"}
        result = _launch(*container["command"][1:], env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        config = parse_tf_config(result.stdout.strip().splitlines()[-1])
        self.assertEqual((config.task_type, config.task_index), ("worker", 2))
        self.assertEqual(config.cluster["ps"], ("digits-ps-0.digits-ps.ml.svc:2222",
                                                "digits-ps-1.digits-ps.ml.svc:2222"))

    def test_cli_writes_manifests(self):
        path = os.path.join(self.get_temp_dir(), "job.yaml")
        result = _launch(f"--kubernetes_manifest={path}", "--image=me/train:1", "--num_ps=1",
                         "--num_workers=2", "--name=digits", "--", "python", "train.py")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("kubectl apply -f", result.stderr)
        with open(path) as f:
            text = f.read()
        docs = [json.loads(part) for part in text.split("---\n") if part.strip()]
        self.assertLen(docs, 5)
        missing = _launch("--kubernetes_manifest=-", "--", "python", "train.py")
        self.assertNotEqual(missing.returncode, 0)
        self.assertIn("--kubernetes_manifest needs --image=IMAGE", missing.stderr)
        self.assertNotIn("Traceback", missing.stderr)


if __name__ == "__main__":
    tf.test.main()
