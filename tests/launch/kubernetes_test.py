"""Kubernetes manifests: schema-valid offline, locked down, and every pod computes the right
TF_CONFIG. No test here starts a TensorFlow server."""

import copy
import json
import os
import subprocess
import sys
from unittest import mock

import jsonschema
import kubernetes_validate
import tensorflow as tf
import yaml
from absl.testing import parameterized

from tfdist.cluster import TFConfigError
from tfdist.cluster import parse_tf_config
from tfdist.cluster.kubernetes import cluster_for_job
from tfdist.cluster.kubernetes import pod_cluster_config
from tfdist.launch.kubernetes import PS_UNREACHABLE_EXIT_CODE
from tfdist.launch.kubernetes import TOKEN_LABEL
from tfdist.launch.kubernetes import check_quantity
from tfdist.launch.kubernetes import manifests
from tfdist.launch.kubernetes import to_yaml

# The oldest Kubernetes the manifests are for (backoffLimitPerIndex is beta, on by default,
# from 1.29; podFailurePolicy's FailJob / Ignore from 1.26), and the newest schema at hand.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
TFJOB_SCHEMA = os.path.join(os.path.dirname(__file__), "tfjob_v1_schema.json")


def _validate(doc):
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _by_kind(docs):
    found = {}
    for doc in docs:
        key = doc["kind"] if doc["kind"] not in ("Job", "Service") else (
            f"{doc['kind']}/{doc['metadata']['labels']['tfdist.task']}")
        found[key] = doc
    return found


def _pod_templates(docs):
    """Every pod template of the documents (plain Jobs and TFJob replicas)."""
    for doc in docs:
        if doc["kind"] == "Job":
            yield doc["spec"]["template"]
        elif doc["kind"] == "TFJob":
            yield from (r["template"] for r in doc["spec"]["tfReplicaSpecs"].values())


def _launch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _tfjob_validator():
    with open(TFJOB_SCHEMA) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


class ManifestTest(tf.test.TestCase, parameterized.TestCase):

    def test_plain_manifests_are_valid_jobs_that_end(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"], num_ps=2,
                         num_workers=3, namespace="ml", cpu=2, memory="4Gi", ps_cpu="500m")
        self.assertEqual([d["kind"] for d in docs],
                         ["Service", "Job", "Service", "Job", "NetworkPolicy"])
        for doc in docs:
            _validate(doc)
        kinds = _by_kind(docs)
        # The ps tasks are an Indexed Job too: they exit 0 once the workers are gone, so the
        # job completes; one ps lost fails it (its shard is gone).
        ps_job = kinds["Job/ps"]["spec"]
        self.assertEqual((ps_job["completionMode"], ps_job["completions"],
                          ps_job["parallelism"], ps_job["backoffLimit"]), ("Indexed", 2, 2, 0))
        self.assertEqual(ps_job["template"]["spec"]["subdomain"], "digits-ps")
        ps = ps_job["template"]["spec"]["containers"][0]
        self.assertContainsSubset(["--job_name=ps", "--exit_after_workers_gone=660",
                                   "--connect_timeout=600", "--num_ps=2", "--num_workers=3"],
                                  ps["command"])
        self.assertEqual(ps["resources"]["limits"], {"cpu": "500m", "memory": "4Gi"})
        # Workers: retried per index; a disrupted pod (drained node, preemption) is replaced
        # without counting; a worker whose ps never answers fails the whole Job.
        job = kinds["Job/worker"]["spec"]
        self.assertEqual((job["completionMode"], job["completions"], job["parallelism"]),
                         ("Indexed", 3, 3))
        self.assertEqual(job["backoffLimitPerIndex"], 3)
        self.assertNotIn("backoffLimit", job)  # it would bound the retries of all indexes
        self.assertNotIn("maxFailedIndexes", job)
        self.assertEqual(job["podFailurePolicy"]["rules"], [
            {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                  "values": [PS_UNREACHABLE_EXIT_CODE]}},
            {"action": "Ignore",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}])
        self.assertEqual(job["template"]["spec"]["restartPolicy"], "Never")
        self.assertEqual(job["template"]["spec"]["subdomain"], "digits-worker")
        worker = job["template"]["spec"]["containers"][0]
        self.assertEqual(worker["command"][-3:], ["--", "python", "train.py"])
        self.assertIn("--connect_timeout=600", worker["command"])
        self.assertEqual(worker["resources"]["limits"], {"cpu": "2", "memory": "4Gi"})
        # A ps imports only the modules its command line names (a custom optimizer's).
        imported = _by_kind(manifests("digits", "me/train:1", ["python", "t.py"],
                                      ps_imports=["my_optimizers"]))["Job/ps"]
        self.assertIn("--ps_import=my_optimizers",
                      imported["spec"]["template"]["spec"]["containers"][0]["command"])
        tfjob, _ = manifests("digits", "me/train:1", ["python", "t.py"], kind="tfjob",
                             ps_imports=["my_optimizers"])
        self.assertEqual(
            tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0][
                "command"][-1], "--ps_import=my_optimizers")
        capped = _by_kind(manifests("digits", "me/train:1", ["python", "t.py"],
                                    worker_retries=1, max_failed_workers=2))["Job/worker"]
        _validate(capped)
        self.assertEqual((capped["spec"]["backoffLimitPerIndex"],
                          capped["spec"]["maxFailedIndexes"]), (1, 2))

    def test_every_pod_is_locked_down(self):
        for kind in ("plain", "tfjob"):
            docs = manifests("digits", "me/train:1", ["python", "train.py"], kind=kind)
            templates = list(_pod_templates(docs))
            self.assertLen(templates, 2)
            for template in templates:
                spec = template["spec"]
                self.assertIs(spec["automountServiceAccountToken"], False)
                self.assertEqual(spec["securityContext"], {
                    "runAsNonRoot": True, "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"}})
                for container in spec["containers"]:
                    self.assertEqual(container["securityContext"], {
                        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}})
        # The image's own user: still refused by the kubelet if it is root.
        docs = manifests("digits", "me/train:1", ["python", "train.py"], run_as_user=None)
        for template in _pod_templates(docs):
            self.assertEqual(template["spec"]["securityContext"], {
                "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}})

    def test_network_policy_admits_only_pods_with_the_jobs_token(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"])
        policy = _by_kind(docs)["NetworkPolicy"]
        _validate(policy)
        token = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
            "tfdist.job-token"]
        self.assertRegex(token, r"^[0-9a-f]{32}$")
        self.assertEqual(policy["spec"]["podSelector"]["matchLabels"], {"tfdist.job": "digits"})
        self.assertEqual(policy["spec"]["policyTypes"], ["Ingress"])
        self.assertEqual(policy["spec"]["ingress"], [{
            "from": [{"podSelector": {"matchLabels": {"tfdist.job": "digits",
                                                      "tfdist.job-token": token}}}],
            "ports": [{"protocol": "TCP", "port": 2222}]}])
        # Every pod of the job carries both labels; a pod with the name label alone is
        # shielded by the policy but not admitted.
        for template in _pod_templates(docs):
            labels = template["metadata"]["labels"]
            self.assertEqual((labels["tfdist.job"], labels["tfdist.job-token"]),
                             ("digits", token))
        # Drawn anew for every manifest.
        again = _by_kind(manifests("digits", "me/train:1", ["python", "train.py"]))
        self.assertNotEqual(again["NetworkPolicy"]["spec"]["ingress"][0]["from"][0][
            "podSelector"]["matchLabels"]["tfdist.job-token"], token)

    def test_no_ps_for_all_reduce_jobs(self):
        docs = manifests("ring", "me/train:1", ["python", "train.py"], num_ps=0,
                         num_workers=4)
        self.assertEqual([d["kind"] for d in docs], ["Service", "Job", "NetworkPolicy"])
        for doc in docs:
            _validate(doc)
        job = _by_kind(docs)["Job/worker"]["spec"]
        self.assertIn("--num_ps=0", job["template"]["spec"]["containers"][0]["command"])
        # No ps to wait for: no rule for a missing one.
        self.assertEqual([r["action"] for r in job["podFailurePolicy"]["rules"]], ["Ignore"])
        config = pod_cluster_config("ring", "worker", 0, 4, environ={"JOB_COMPLETION_INDEX": "3"})
        self.assertEqual(list(config.cluster), ["worker"])
        self.assertEqual(config.task_index, 3)
        tfjob, _ = manifests("ring", "me/train:1", ["python", "train.py"], num_ps=0,
                             kind="tfjob")
        self.assertEqual(list(tfjob["spec"]["tfReplicaSpecs"]), ["Worker"])
        _tfjob_validator().validate(tfjob)

    def test_tfjob_matches_the_tfjob_v1_schema(self):
        validator = _tfjob_validator()
        tfjob, policy = manifests("digits", "me/train:1", ["python", "train.py"], num_ps=1,
                                  num_workers=4, kind="tfjob", cpu=1, worker_retries=2)
        validator.validate(tfjob)
        _validate(policy)
        self.assertEqual((tfjob["apiVersion"], tfjob["kind"]), ("kubeflow.org/v1", "TFJob"))
        spec = tfjob["spec"]
        # Succeeded when every worker has; then the operator deletes the running ps pods.
        self.assertEqual(spec["successPolicy"], "AllWorkers")
        self.assertEqual(spec["runPolicy"], {"cleanPodPolicy": "Running", "backoffLimit": 2})
        specs = spec["tfReplicaSpecs"]
        self.assertEqual((specs["PS"]["replicas"], specs["PS"]["restartPolicy"]), (1, "Never"))
        self.assertEqual((specs["Worker"]["replicas"], specs["Worker"]["restartPolicy"]),
                         (4, "ExitCode"))
        self.assertEqual(specs["PS"]["template"]["spec"]["containers"][0]["command"],
                         ["tfdist-launch", "--from_tf_config", "--job_name=ps"])
        self.assertEqual(specs["Worker"]["template"]["spec"]["containers"][0]["command"],
                         ["tfdist-launch", "--from_tf_config", "--connect_timeout=600", "--",
                          "python", "train.py"])
        # The templates are core PodTemplateSpecs (the operator sets their restartPolicy).
        for replica in specs.values():
            self.assertNotIn("restartPolicy", replica["template"]["spec"])
            _validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "check"},
                       "spec": {"template": {**replica["template"],
                                             "spec": {**replica["template"]["spec"],
                                                      "restartPolicy": "Never"}}}})
        # The schema is not vacuous: each of these mistakes is refused.
        for path, value in [(("spec", "tfReplicaSpecs", "Worker", "restartPolicy"), "Sometimes"),
                            (("spec", "tfReplicaSpecs", "Boss"), specs["PS"]),
                            (("spec", "runPolicy", "cleanPodPolicy"), "Finished"),
                            (("spec", "runPolicy", "backoffLimit"), "3"),
                            (("spec", "successPolicy"), "AnyWorker"),
                            (("spec", "tfReplicaSpec"), {}),
                            (("spec", "tfReplicaSpecs", "PS", "replicas"), 2**31),
                            (("metadata", "name"), "9digits"),
                            (("spec", "tfReplicaSpecs", "PS", "template", "spec", "containers",
                              0, "name"), "ps")]:
            broken = copy.deepcopy(tfjob)
            target = broken
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
            with self.assertRaises(jsonschema.ValidationError, msg=path):
                validator.validate(broken)

    def test_yaml_documents(self):
        docs = manifests("digits", "me/train:1", ["python", "train.py"], cpu=2,
                         env={"DEBUG": "true", "SEED": "007", "EMPTY": ""}, stall_timeout=90)
        text = to_yaml(docs, header="a job\nof two lines")
        self.assertTrue(text.startswith("# a job\n# of two lines\n---\n"), text[:80])
        self.assertEqual(text.count("\n---\n"), len(docs))
        self.assertNotIn("{", text)  # block style, not JSON
        parsed = list(yaml.safe_load_all(text))
        self.assertEqual(parsed, docs)
        # Strings that read as other types in YAML stay strings.
        env = {e["name"]: e["value"] for e in
               _by_kind(parsed)["Job/worker"]["spec"]["template"]["spec"]["containers"][0]["env"]}
        self.assertEqual((env["DEBUG"], env["SEED"], env["EMPTY"]), ("true", "007", ""))
        # stall_timeout reaches the workers' strategies as their default.
        self.assertEqual(env["TFDIST_STALL_TIMEOUT"], "90.0")
        # Every pod is of one job (the run on the ps tasks belongs to it): name and token.
        token = parsed[-1]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        self.assertEqual(env["TFDIST_JOB_ID"], f"digits-{token[TOKEN_LABEL]}")

    @parameterized.named_parameters(
        ("name_digit_first", {"name": "9digits"}, "`name` must be a DNS label.*starting with a "
                                                  "letter.*Received: '9digits'"),
        ("name_upper", {"name": "Digits_Job"}, "`name` must be a DNS label"),
        ("bad_kind", {"kind": "helm"}, r"`kind` must be one of \['plain', 'tfjob'\]"),
        ("no_workers", {"num_workers": 0}, "`num_workers` must be an integer >= 1"),
        ("negative_ps", {"num_ps": -1}, "`num_ps` must be an integer >= 0. Received: -1"),
        ("bad_port", {"port": 0}, "`port` must be between 1 and 65535"),
        ("command_string", {"command": "python train.py"}, "`command` must be a non-empty"),
        ("cpu_word", {"cpu": "two"}, r"`cpu` must be a positive Kubernetes quantity such as "
                                     r"'500m', '2', '1.5' \(CPUs\) or '4Gi', '512Mi' \(bytes\). "
                                     r"Received: 'two'"),
        ("cpu_negative", {"cpu": "-1"}, "`cpu` must be a positive Kubernetes quantity"),
        ("cpu_zero", {"cpu": 0}, r"`cpu` must be a positive.*Received: 0"),
        ("cpu_bool", {"cpu": True}, r"`cpu` must be a positive.*Received: True"),
        ("memory_gb", {"memory": "4GB"}, r"`memory` must be.*Received: '4GB'"),
        ("ps_memory", {"ps_memory": "lots"}, r"`ps_memory` must be.*Received: 'lots'"),
        ("connect_timeout", {"connect_timeout": 0}, "`connect_timeout` must be a positive"),
        ("stall_timeout", {"stall_timeout": -5}, r"`stall_timeout` must be a positive number "
                                                 r"of seconds or None. Received: -5"),
        ("retries", {"worker_retries": -1}, "`worker_retries` must be an integer >= 0"),
        ("root", {"run_as_user": 0}, r"`run_as_user` must be a user id >= 1.*Received: 0"),
        ("tfjob_max_failed", {"kind": "tfjob", "max_failed_workers": 1},
         "`max_failed_workers` is a Job field"),
        ("too_many_failed", {"max_failed_workers": 9},
         r"`max_failed_workers` must be at most num_workers=2.*Received: 9"),
    )
    def test_bad_arguments(self, overrides, message):
        kwargs = {"name": "digits", "image": "me/train:1", "command": ["python", "t.py"]}
        kwargs.update(overrides)
        with self.assertRaisesRegex(ValueError, message):
            manifests(**kwargs)

    def test_kubernetes_quantities_pass_as_written(self):
        for value, text in [("500m", "500m"), (2, "2"), (1.5, "1.5"), ("4Gi", "4Gi"),
                            ("512Mi", "512Mi"), ("1e3", "1e3"), (".5", ".5"), ("2.", "2.")]:
            self.assertEqual(check_quantity("cpu", value), text)
            _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                       "spec": {"containers": [{"name": "c", "image": "i", "resources": {
                           "limits": {"cpu": text}}}]}})


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
                                        environ={"JOB_COMPLETION_INDEX": str(i),
                                                 "HOSTNAME": f"digits-ps-{i}-abcde"})
            self.assertEqual(config.task_address, f"digits-ps-{i}.digits-ps.ml.svc:2222")
        self.assertEqual(config.cluster_spec().as_dict(),
                         cluster_for_job("digits", 2, 3, "ml").cluster_spec().as_dict())
        # A StatefulSet's pod (earlier manifests) still finds its ordinal.
        config = pod_cluster_config("digits", "ps", 2, 3, "ml", environ={"HOSTNAME": "digits-ps-1"})
        self.assertEqual(config.task_index, 1)
        with self.assertRaisesRegex(TFConfigError, "cannot tell this pod's index"):
            pod_cluster_config("digits", "ps", 1, 1, environ={"HOSTNAME": "laptop"})

    def test_worker_pods_get_their_tf_config_and_the_long_connect_timeout(self):
        # Run the worker pod's own command line, as the pod would, with the index the Job
        # gives pod 2, and read what the training command sees.
        docs = manifests("ring", "me/train:1", [
            sys.executable, "-c", "import json, os; print(json.dumps({k: os.environ[k] for k in "
            "('TF_CONFIG', 'TFDIST_CONNECT_TIMEOUT', 'TFDIST_INIT_TIMEOUT')}))"],
            num_ps=0, num_workers=3, namespace="ml")
        container = _by_kind(docs)["Job/worker"]["spec"]["template"]["spec"]["containers"][0]
        env = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "ring-worker-2-abcde",
               "PATH": "/usr/bin:/bin"}
        result = _launch(*container["command"][1:], env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        config = parse_tf_config(seen["TF_CONFIG"])
        self.assertEqual((config.task_type, config.task_index), ("worker", 2))
        self.assertEqual(config.cluster["worker"][0], "ring-worker-0.ring-worker.ml.svc:2222")
        # The strategies' defaults: long enough for the other pods' image pulls.
        self.assertEqual((float(seen["TFDIST_CONNECT_TIMEOUT"]),
                          float(seen["TFDIST_INIT_TIMEOUT"])), (600.0, 600.0))

    def test_a_worker_whose_ps_never_answers_exits_69_before_its_command(self):
        docs = manifests("digits", "me/train:1", [sys.executable, "-c", "print('TRAINED')"],
                         num_ps=2, num_workers=2, namespace="ml", connect_timeout=0.5)
        container = _by_kind(docs)["Job/worker"]["spec"]["template"]["spec"]["containers"][0]
        self.assertIn("--connect_timeout=0.5", container["command"])
        result = _launch(*container["command"][1:], env={"JOB_COMPLETION_INDEX": "0",
                                                         "PATH": "/usr/bin:/bin"})
        self.assertEqual(result.returncode, PS_UNREACHABLE_EXIT_CODE, result.stderr)
        self.assertNotIn("TRAINED", result.stdout)
        self.assertRegex(result.stderr, r"/job:ps/task:0 at digits-ps-0\.digits-ps\.ml\.svc:2222 "
                                        r"did not answer in 0\.5 s \(nor did 1 other")
        self.assertNotIn("Traceback", result.stderr)

    def test_the_strategies_take_their_timeouts_from_the_launcher(self):
        from tfdist.cluster import TaskUnreachableError
        from tfdist.cluster import pick_free_ports
        from tfdist.cluster.network import timeout_from_env
        from tfdist.strategies import SoftSyncStrategy

        ps, worker = pick_free_ports(2)  # nothing listens at the ps's port
        cluster = {"cluster": {"ps": [f"localhost:{ps}"], "worker": [f"localhost:{worker}"]},
                   "task": {"type": "worker", "index": 0}}
        unreachable = rf"/job:ps/task:0 at localhost:{ps} did not answer in 0.3 s"
        with mock.patch.dict(os.environ, {"TFDIST_CONNECT_TIMEOUT": "0.3"}):
            with self.assertRaisesRegex(TaskUnreachableError, unreachable):
                SoftSyncStrategy(cluster=cluster)
        with mock.patch.dict(os.environ, {"TFDIST_CONNECT_TIMEOUT": "soon"}):
            with self.assertRaisesRegex(ValueError, "environment variable "
                                                    "TFDIST_CONNECT_TIMEOUT must be a positive "
                                                    "number of seconds, e.g. 600. Received: "
                                                    "'soon'"):
                SoftSyncStrategy(cluster=cluster)
            with self.assertRaisesRegex(TaskUnreachableError, unreachable):  # an argument wins
                SoftSyncStrategy(cluster=cluster, connect_timeout=0.3)
        self.assertEqual(timeout_from_env("TFDIST_INIT_TIMEOUT", 60.0, {}), 60.0)
        self.assertEqual(timeout_from_env("TFDIST_INIT_TIMEOUT", 60.0,
                                          {"TFDIST_INIT_TIMEOUT": "600.0"}), 600.0)
        for bad in ("0", "-5", "nan", "inf"):
            with self.assertRaisesRegex(ValueError, "TFDIST_INIT_TIMEOUT must be a positive"):
                timeout_from_env("TFDIST_INIT_TIMEOUT", 60.0, {"TFDIST_INIT_TIMEOUT": bad})

    def test_cli_writes_manifests(self):
        path = os.path.join(self.get_temp_dir(), "job.yaml")
        result = _launch(f"--kubernetes_manifest={path}", "--image=me/train:1", "--num_ps=0",
                         "--num_workers=2", "--name=digits", "--cpu=1.5", "--memory=512Mi",
                         "--worker_retries=5", "--run_as_user=image", "--", "python",
                         "train.py")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("kubectl apply -f", result.stderr)
        with open(path) as f:
            text = f.read()
        self.assertIn("speed-bump, not a secret", text)
        docs = list(yaml.safe_load_all(text))
        self.assertEqual([d["kind"] for d in docs], ["Service", "Job", "NetworkPolicy"])
        for doc in docs:
            _validate(doc)
        job = docs[1]["spec"]
        self.assertEqual(job["backoffLimitPerIndex"], 5)
        self.assertNotIn("runAsUser", job["template"]["spec"]["securityContext"])
        self.assertEqual(job["template"]["spec"]["containers"][0]["resources"]["requests"],
                         {"cpu": "1.5", "memory": "512Mi"})
        for args, message in [
            ([], "--kubernetes_manifest needs --image=IMAGE"),
            (["--image=x", "--cpu=two"], r"--cpu must be a positive Kubernetes quantity such "
                                         r"as '500m', '2', '1.5' \(CPUs\) or '4Gi', '512Mi' "
                                         r"\(bytes\). Received: 'two'"),
            (["--image=x", "--ps_memory=4GB"], r"--ps_memory must be .*Received: '4GB'"),
            (["--image=x", "--name=9x"], r"--name must be a DNS label"),
            (["--image=x", "--run_as_user=root"], r"--run_as_user must be a user id >= 1.*"
                                                  r"or 'image'.*Received: 'root'"),
            (["--image=x", "--k8s_kind=tfjob", "--max_failed_workers=1"],
             r"--max_failed_workers is a Job field"),
            (["--image=x", "--connect_timeout=0"], "--connect_timeout must be a positive"),
        ]:
            failed = _launch("--kubernetes_manifest=-", *args, "--", "python", "train.py")
            self.assertNotEqual(failed.returncode, 0, args)
            self.assertRegex(failed.stderr, message)
            self.assertNotIn("Traceback", failed.stderr)
            self.assertEqual(failed.stdout, "")


if __name__ == "__main__":
    tf.test.main()
