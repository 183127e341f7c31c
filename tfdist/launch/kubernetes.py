"""Kubernetes manifests for a tfdist job: the step from a local cluster to `kubectl apply`.

    tfdist-launch --kubernetes_manifest=job.yaml --image=registry/me/train:1 \\
        --num_ps=2 --num_workers=8 --cpu=2 --memory=4Gi -- python train.py
    kubectl apply -f job.yaml

Two kinds:

* `plain` (no operator needed): the ps tasks are a StatefulSet, the workers an Indexed Job,
  each behind a headless Service; every pod runs `tfdist-launch --kubernetes`, which derives
  the pod's TF_CONFIG from its index (`tfdist.cluster.kubernetes`).
* `tfjob`: a Kubeflow `TFJob` (kubeflow.org/v1); the training operator sets TF_CONFIG, and the
  ps pods run `tfdist-launch --from_tf_config --job_name=ps`.

Both come with a NetworkPolicy that admits traffic to the job's port only from the job's own
pods: TensorFlow servers run any op any client sends them.
"""

import json

from tfdist.cluster.kubernetes import check_job_name

KINDS = ("plain", "tfjob")
JOB_LABEL = "tfdist.job"
TASK_LABEL = "tfdist.task"


def _resources(cpu, memory):
    if cpu is None and memory is None:
        return None
    amounts = {k: str(v) for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(name, image, command, port, resources, env):
    container = {"name": name, "image": image, "command": list(command),
                 "ports": [{"name": "grpc" if name != "tensorflow" else "tfjob-port",
                            "containerPort": port, "protocol": "TCP"}]}
    if resources:
        container["resources"] = resources
    if env:
        container["env"] = [{"name": k, "value": str(v)} for k, v in sorted(env.items())]
    return container


def _labels(name, task):
    return {JOB_LABEL: name, TASK_LABEL: task}


def _network_policy(name, namespace, port):
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-internal", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: name}}}],
                         "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def _pod_flags(name, namespace, port, num_ps, num_workers, job_name):
    return ["tfdist-launch", "--kubernetes", f"--name={name}", f"--namespace={namespace}",
            f"--port={port}", f"--num_ps={num_ps}", f"--num_workers={num_workers}",
            f"--job_name={job_name}"]


def manifests(name, image, command, num_ps=1, num_workers=2, namespace="default", port=2222,
              kind="plain", cpu=None, memory=None, ps_cpu=None, ps_memory=None, env=None):
    """The manifests of a tfdist job, as a list of dicts (see `to_yaml`).

    Args:
      name: job name, a DNS label of at most 40 characters.
      image: the container image (it must have tfdist installed).
      command: argv each worker runs (the training script).
      num_ps, num_workers: task counts.
      namespace: Kubernetes namespace.
      port: the gRPC port of every task.
      kind: "plain" or "tfjob".
      cpu, memory: resources of each worker pod (requests = limits), e.g. 2, "4Gi".
      ps_cpu, ps_memory: resources of each ps pod (default: those of the workers).
      env: extra environment variables of every pod.

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
    for arg, value, low in (("num_ps", num_ps, 1), ("num_workers", num_workers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{arg}` must be an integer >= {low}. Received: {value!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`port` must be between 1 and 65535. Received: {port!r}")
    env = {"TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE": "False", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    worker_resources = _resources(cpu, memory)
    ps_resources = _resources(ps_cpu or cpu, ps_memory or memory)
    if kind == "tfjob":
        return [_tfjob(name, image, command, num_ps, num_workers, namespace, port,
                       worker_resources, ps_resources, env),
                _network_policy(name, namespace, port)]
    docs = []
    for task in ("ps", "worker"):
        docs.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{name}-{task}", "namespace": namespace,
                         "labels": _labels(name, task)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": _labels(name, task),
                     "ports": [{"name": "grpc", "port": port, "targetPort": port,
                                "protocol": "TCP"}]},
        })
    ps_container = _container(
        "ps", image, _pod_flags(name, namespace, port, num_ps, num_workers, "ps"), port,
        ps_resources, env)
    ps_container["readinessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 2}
    docs.append({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": f"{name}-ps", "namespace": namespace,
                     "labels": _labels(name, "ps")},
        "spec": {"serviceName": f"{name}-ps", "replicas": num_ps,
                 "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": _labels(name, "ps")},
                 "template": {"metadata": {"labels": _labels(name, "ps")},
                              "spec": {"containers": [ps_container]}}},
    })
    worker_command = [*_pod_flags(name, namespace, port, num_ps, num_workers, "worker"), "--",
                      *command]
    docs.append({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"{name}-worker", "namespace": namespace,
                     "labels": _labels(name, "worker")},
        "spec": {"completionMode": "Indexed", "completions": num_workers,
                 "parallelism": num_workers, "backoffLimit": 0,
                 "template": {"metadata": {"labels": _labels(name, "worker")},
                              "spec": {"subdomain": f"{name}-worker", "restartPolicy": "Never",
                                       "containers": [_container(
                                           "worker", image, worker_command, port,
                                           worker_resources, env)]}}},
    })
    docs.append(_network_policy(name, namespace, port))
    return docs


def _tfjob(name, image, command, num_ps, num_workers, namespace, port, worker_resources,
           ps_resources, env):
    def replica(replicas, argv, resources, task):
        return {"replicas": replicas, "restartPolicy": "Never",
                "template": {"metadata": {"labels": _labels(name, task)},
                             "spec": {"containers": [_container(
                                 "tensorflow", image, argv, port, resources, env)]}}}

    return {
        "apiVersion": "kubeflow.org/v1", "kind": "TFJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"runPolicy": {"cleanPodPolicy": "Running"},
                 "tfReplicaSpecs": {
                     "PS": replica(num_ps, ["tfdist-launch", "--from_tf_config",
                                            "--job_name=ps"], ps_resources, "ps"),
                     "Worker": replica(num_workers, list(command), worker_resources,
                                       "worker")}},
    }


def to_yaml(docs):
    """Multi-document YAML for `kubectl apply -f` (each document written as JSON, which YAML
    reads as it is: no YAML library needed)."""
    return "".join(f"---\n{json.dumps(doc, indent=2, sort_keys=True)}\n" for doc in docs)
