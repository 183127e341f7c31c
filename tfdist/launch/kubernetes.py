"""Kubernetes manifests for a tfdist job: the step from a local cluster to `kubectl apply`.

    tfdist-launch --kubernetes_manifest=job.yaml --image=registry/me/train:1 \\
        --num_ps=2 --num_workers=8 --cpu=2 --memory=4Gi -- python train.py
    kubectl apply -f job.yaml

Two kinds:

* `plain` (no operator needed): the ps tasks and the workers are two Indexed Jobs, each behind
  a headless Service; every pod runs `tfdist-launch --kubernetes`, which derives the pod's
  TF_CONFIG from its index (`tfdist.cluster.kubernetes`).
  - Workers: each index is retried on its own (`backoffLimitPerIndex`), and a pod lost to a
    disruption (a node drained, a pod preempted or evicted) is replaced without counting
    (`podFailurePolicy`: `DisruptionTarget` -> `Ignore`), so a soft-sync or async job goes
    on without the lost worker and takes it back when it returns. A worker whose ps tasks do
    not answer within `connect_timeout` exits 69 before its command starts, which fails the
    whole worker Job (`FailJob`): the ps is gone, and no retry can bring its shard back.
  - ps tasks: exit 0 by themselves once every worker has come and gone
    (`tfdist.launch.server.WorkersGone`), so the ps Job completes after the worker Job.
    A ps pod that fails or is lost fails the ps Job (`backoffLimit: 0`): its shard of the
    model is gone with it, and a new ps would serve an empty one.
* `tfjob`: a Kubeflow `TFJob` (kubeflow.org/v1); the training operator sets TF_CONFIG, marks
  the job succeeded when every worker has (`successPolicy: AllWorkers`) and then deletes the
  pods still running, the ps tasks (`runPolicy.cleanPodPolicy: Running`). Workers restart on
  the exit codes the operator deems retryable (`restartPolicy: ExitCode`: 128 and above, a
  signal such as an OOM kill or a SIGTERM); an error exit (1-127) fails the job, and the
  operator then deletes the pods still running. A deleted pod is created again.

Every pod is locked down: no service-account token, a non-root user, no privilege
escalation, every capability dropped, the runtime's default seccomp profile. A NetworkPolicy
admits traffic to the job's port only from pods that carry the job's labels, one of them a
random token drawn for each manifest (TensorFlow servers run any op any client sends them).
"""

import re
import secrets

from tfdist._args import check_int
from tfdist._args import check_seconds
from tfdist.cluster.kubernetes import CONNECT_TIMEOUT
from tfdist.cluster.kubernetes import WORKERS_GONE_GRACE
from tfdist.cluster.kubernetes import check_job_name
from tfdist.cluster.network import JOB_ID_ENV
from tfdist.cluster.network import STALL_TIMEOUT_ENV

KINDS = ("plain", "tfjob")
JOB_LABEL = "tfdist.job"
TASK_LABEL = "tfdist.task"
# A random value per manifest: a pod outside the job cannot get in by setting the job's name
# label. A speed-bump, not a secret: whoever can read the manifests or the job's pods can
# copy it into a pod of their own.
TOKEN_LABEL = "tfdist.job-token"
# A worker exits with this code (sysexits' EX_UNAVAILABLE) when its ps tasks do not answer
# before its command starts; the plain worker Job fails at once on it.
PS_UNREACHABLE_EXIT_CODE = 69

# Kubernetes' quantity grammar (k8s.io/apimachinery resource.Quantity), without a sign:
# 500m, 2, 1.5, 4Gi, 512Mi, 1e3.
_QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                       r"(?:[KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?")


def check_quantity(arg, value):
    """`value` (a resource amount) as Kubernetes' quantity string; None stays None.

    Raises:
      ValueError: naming `arg`, the forms allowed and what was received.
    """
    if value is None:
        return None
    text = value if isinstance(value, str) else (
        repr(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "")
    match = _QUANTITY.fullmatch(text)
    if not match or float(match.group("number")) == 0:
        raise ValueError(f"`{arg}` must be a positive Kubernetes quantity such as '500m', '2', "
                         f"'1.5' (CPUs) or '4Gi', '512Mi' (bytes). Received: {value!r}")
    return text


def _resources(cpu, memory):
    if cpu is None and memory is None:
        return None
    amounts = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(name, image, command, port, resources, env):
    container = {
        "name": name, "image": image, "command": list(command),
        "ports": [{"name": "tfjob-port" if name == "tensorflow" else "grpc",
                   "containerPort": port, "protocol": "TCP"}],
        "env": [{"name": k, "value": str(v)} for k, v in sorted(env.items())],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if resources:
        container["resources"] = resources
    return container


def _pod_template(labels, container, run_as_user, subdomain=None, restart_policy="Never"):
    security = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if run_as_user is not None:
        security["runAsUser"] = run_as_user
    spec = {}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if subdomain:
        spec["subdomain"] = subdomain
    spec.update(automountServiceAccountToken=False, securityContext=security,
                containers=[container])
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def _network_policy(name, namespace, port, token):
    admitted = {JOB_LABEL: name, TOKEN_LABEL: token}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-internal", "namespace": namespace,
                     "labels": {JOB_LABEL: name}},
        "spec": {
            # Every pod that says it belongs to the job is shielded; only those that also
            # carry the token get in.
            "podSelector": {"matchLabels": {JOB_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": admitted}}],
                         "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def _pod_flags(name, namespace, port, num_ps, num_workers, job_name, connect_timeout):
    return ["tfdist-launch", "--kubernetes", f"--name={name}", f"--namespace={namespace}",
            f"--port={port}", f"--num_ps={num_ps}", f"--num_workers={num_workers}",
            f"--job_name={job_name}", f"--connect_timeout={connect_timeout:g}"]


def manifests(name, image, command, num_ps=1, num_workers=2, namespace="default", port=2222,
              kind="plain", cpu=None, memory=None, ps_cpu=None, ps_memory=None, env=None,
              connect_timeout=CONNECT_TIMEOUT, worker_retries=3, max_failed_workers=None,
              exit_after_workers_gone=WORKERS_GONE_GRACE, run_as_user=1000, token=None,
              ps_imports=(), stall_timeout=None):
    """The manifests of a tfdist job, as a list of dicts (see `to_yaml`).

    Args:
      name: job name, a DNS label of at most 40 characters starting with a letter.
      image: the container image (it must have tfdist installed).
      command: argv each worker runs (the training script).
      num_ps: ps tasks; 0 for an all-reduce or decentralised job (no ps Job, Service or
        replica, and a TF_CONFIG without a ps job).
      num_workers: worker tasks, at least 1.
      namespace: Kubernetes namespace.
      port: the gRPC port of every task.
      kind: "plain" or "tfjob".
      cpu, memory: resources of each worker pod (requests = limits), Kubernetes quantities:
        "500m", 2, "1.5" CPUs; "4Gi", "512Mi" bytes.
      ps_cpu, ps_memory: resources of each ps pod (default: those of the workers).
      env: extra environment variables of every pod.
      connect_timeout: seconds a worker waits for its ps tasks before it gives up (exit 69),
        and the default `connect_timeout` / `init_timeout` of the strategies it runs; the
        seconds a ps gives the workers to appear at all. Long enough for image pulls.
      worker_retries: times each worker index is started again after it fails (disruptions
        not counted) - the worker Job's `backoffLimitPerIndex`; the TFJob's
        `runPolicy.backoffLimit`.
      max_failed_workers: None, or the number of worker indexes that may fail for good before
        the worker Job fails as a whole (`maxFailedIndexes`; plain kind only).
      exit_after_workers_gone: seconds without any listening worker after which a ps task of
        the plain kind exits (once every worker has come and gone).
      run_as_user: the user id every container runs as (not 0), or None for the image's
        own user, which must then be a numeric non-root user.
      token: the NetworkPolicy's token label value (None: a fresh random one).
      ps_imports: modules every ps task imports (`--ps_import`), and the only ones a worker's
        hello may ask it to use: a custom optimizer's, schedule's or staleness function's.
      stall_timeout: None, or the default `stall_timeout` of the parameter-server strategies
        the workers run (`TFDIST_STALL_TIMEOUT` in every pod): how long a hung worker or ps
        task is given.

    Raises:
      ValueError: an argument is out of range; the message names it.
    """
    check_job_name(name)
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {list(KINDS)}. Received: {kind!r}")
    if not image or not isinstance(image, str):
        raise ValueError(f"`image` must name a container image. Received: {image!r}")
    if not command or isinstance(command, str):
        raise ValueError(f"`command` must be a non-empty argv list. Received: {command!r}")
    check_int("num_ps", num_ps, "an integer >= 0", low=0)
    check_int("num_workers", num_workers, "an integer >= 1", low=1)
    check_int("port", port, "between 1 and 65535", low=1, high=65535)
    cpu, memory = check_quantity("cpu", cpu), check_quantity("memory", memory)
    ps_cpu, ps_memory = check_quantity("ps_cpu", ps_cpu), check_quantity("ps_memory", ps_memory)
    check_seconds("connect_timeout", connect_timeout)
    check_seconds("exit_after_workers_gone", exit_after_workers_gone)
    check_seconds("stall_timeout", stall_timeout, allow_none=True)
    check_int("worker_retries", worker_retries, "an integer >= 0", low=0)
    check_int("max_failed_workers", max_failed_workers, "an integer >= 0 or None", low=0,
              allow_none=True)
    if max_failed_workers is not None and max_failed_workers > num_workers:
        raise ValueError(f"`max_failed_workers` must be at most num_workers={num_workers} "
                         f"(Kubernetes refuses maxFailedIndexes > completions). Received: "
                         f"{max_failed_workers}")
    if max_failed_workers is not None and kind == "tfjob":
        raise ValueError("`max_failed_workers` is a Job field (maxFailedIndexes): the plain "
                         "kind only. Received: kind='tfjob'")
    check_int("run_as_user", run_as_user, "a user id >= 1 (pods run as non-root), or None for "
              "the image's own non-root user", low=1, allow_none=True)
    token = secrets.token_hex(16) if token is None else token
    # Every pod of this job, and one its Job starts again, is of one job (the run on the ps
    # tasks belongs to it): the job's name and this manifest's token.
    env = {"TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE": "False", "PYTHONUNBUFFERED": "1",
           JOB_ID_ENV: f"{name}-{token}",
           **({} if stall_timeout is None else {STALL_TIMEOUT_ENV: repr(float(stall_timeout))}),
           **(env or {})}
    if isinstance(ps_imports, str) or not all(isinstance(m, str) and m for m in ps_imports):
        raise ValueError(f"`ps_imports` must be a list of module names. Received: "
                         f"{ps_imports!r}")
    job = _Job(name, image, list(command), num_ps, num_workers, namespace, port, env,
               connect_timeout, worker_retries, run_as_user, token,
               worker_resources=_resources(cpu, memory),
               ps_resources=_resources(ps_cpu or cpu, ps_memory or memory),
               ps_imports=list(ps_imports))
    if kind == "tfjob":
        return [job.tfjob(), _network_policy(name, namespace, port, token)]
    return [*job.plain(max_failed_workers, exit_after_workers_gone),
            _network_policy(name, namespace, port, token)]


class _Job:
    """The checked arguments of `manifests`, and the documents of each kind."""

    def __init__(self, name, image, command, num_ps, num_workers, namespace, port, env,
                 connect_timeout, worker_retries, run_as_user, token, worker_resources,
                 ps_resources, ps_imports=()):
        self.name, self.image, self.command = name, image, command
        self.num_ps, self.num_workers = num_ps, num_workers
        self.namespace, self.port, self.env = namespace, port, env
        self.connect_timeout, self.worker_retries = connect_timeout, worker_retries
        self.run_as_user, self.token = run_as_user, token
        self.worker_resources, self.ps_resources = worker_resources, ps_resources
        self.ps_flags = [f"--ps_import={module}" for module in ps_imports]

    def labels(self, task):
        return {JOB_LABEL: self.name, TOKEN_LABEL: self.token, TASK_LABEL: task}

    def _metadata(self, name, task=None):
        labels = {JOB_LABEL: self.name, **({TASK_LABEL: task} if task else {})}
        return {"name": name, "namespace": self.namespace, "labels": labels}

    def _service(self, task):
        return {
            "apiVersion": "v1", "kind": "Service",
            "metadata": self._metadata(f"{self.name}-{task}", task),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {JOB_LABEL: self.name, TASK_LABEL: task},
                     "ports": [{"name": "grpc", "port": self.port, "targetPort": self.port,
                                "protocol": "TCP"}]},
        }

    def _indexed_job(self, task, count, container, **policy):
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": self._metadata(f"{self.name}-{task}", task),
            "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                     **policy,
                     "template": _pod_template(self.labels(task), container, self.run_as_user,
                                               subdomain=f"{self.name}-{task}")},
        }

    def plain(self, max_failed_workers, exit_after_workers_gone):
        flags = (self.name, self.namespace, self.port, self.num_ps, self.num_workers)
        docs = []
        if self.num_ps:
            ps = _container("ps", self.image, [
                *_pod_flags(*flags, "ps", self.connect_timeout),
                f"--exit_after_workers_gone={exit_after_workers_gone:g}", *self.ps_flags],
                self.port, self.ps_resources, self.env)
            ps["readinessProbe"] = {"tcpSocket": {"port": self.port}, "periodSeconds": 2}
            docs += [self._service("ps"),
                     # One lost ps loses its shard of the model: the ps Job fails at once.
                     self._indexed_job("ps", self.num_ps, ps, backoffLimit=0)]
        worker = _container("worker", self.image, [
            *_pod_flags(*flags, "worker", self.connect_timeout), "--", *self.command],
            self.port, self.worker_resources, self.env)
        rules = []
        if self.num_ps:
            rules.append({"action": "FailJob", "onExitCodes": {
                "containerName": "worker", "operator": "In",
                "values": [PS_UNREACHABLE_EXIT_CODE]}})
        rules.append({"action": "Ignore",
                      "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]})
        policy = {"backoffLimitPerIndex": self.worker_retries, "podFailurePolicy": {
            "rules": rules}}
        if max_failed_workers is not None:
            policy["maxFailedIndexes"] = max_failed_workers
        docs += [self._service("worker"),
                 self._indexed_job("worker", self.num_workers, worker, **policy)]
        return docs

    def tfjob(self):
        def replica(replicas, argv, resources, task, restart_policy):
            container = _container("tensorflow", self.image, argv, self.port, resources,
                                   self.env)
            # The operator sets the pods' restartPolicy from the replica's (it warns about
            # one in the template).
            return {"replicas": replicas, "restartPolicy": restart_policy,
                    "template": _pod_template(self.labels(task), container, self.run_as_user,
                                              restart_policy=None)}

        specs = {}
        if self.num_ps:
            specs["PS"] = replica(self.num_ps, ["tfdist-launch", "--from_tf_config",
                                                "--job_name=ps", *self.ps_flags],
                                  self.ps_resources, "ps", "Never")
        specs["Worker"] = replica(
            self.num_workers, ["tfdist-launch", "--from_tf_config",
                               f"--connect_timeout={self.connect_timeout:g}", "--",
                               *self.command],
            self.worker_resources, "worker", "ExitCode")
        return {
            "apiVersion": "kubeflow.org/v1", "kind": "TFJob",
            "metadata": self._metadata(self.name),
            "spec": {"runPolicy": {"cleanPodPolicy": "Running",
                                   "backoffLimit": self.worker_retries},
                     "successPolicy": "AllWorkers",
                     "tfReplicaSpecs": specs},
        }


def to_yaml(docs, header=None):
    """Multi-document YAML for `kubectl apply -f`: each document after a `---` line.

    Args:
      docs: the documents (`manifests(...)`).
      header: None, or text written first as `#` comment lines.
    """
    import yaml

    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) if header \
        else ""
    return comment + yaml.safe_dump_all(docs, explicit_start=True, sort_keys=False,
                                        default_flow_style=False, width=100)
