"""Clusters placed by Kubernetes: every pod derives its TF_CONFIG from its own index.

The plain manifests of `tfdist.launch.kubernetes` run the ps tasks as a StatefulSet and the
workers as an Indexed Job, each behind a headless Service, so that every task has a stable
DNS name:

    <job>-ps-<i>.<job>-ps.<namespace>.svc:<port>         (StatefulSet pod i)
    <job>-worker-<i>.<job>-worker.<namespace>.svc:<port> (Indexed Job pod i)

`pod_cluster_config` computes the whole cluster and this pod's task from those names, so the
same code that validates a hand-written TF_CONFIG builds the one each pod uses.
"""

import os
import re

from tfdist.cluster.config import ClusterConfig
from tfdist.cluster.config import TFConfigError

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_job_name(name):
    """A job name usable in pod and Service names (a DNS label, room for suffixes)."""
    if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(name) > 40:
        raise TFConfigError(
            f"`name` must be a DNS label of at most 40 characters (lower-case letters, digits, "
            f"'-'), so that '<name>-worker-<i>' stays a valid pod name. Received: {name!r}")
    return name


def task_address(name, job, index, namespace, port):
    return f"{name}-{job}-{index}.{name}-{job}.{namespace}.svc:{port}"


def cluster_for_job(name, num_ps, num_workers, namespace="default", port=2222,
                    task_type=None, task_index=None):
    """The `ClusterConfig` of a tfdist Kubernetes job, seen from one task (or from outside)."""
    check_job_name(name)
    return ClusterConfig(
        cluster={"ps": [task_address(name, "ps", i, namespace, port) for i in range(num_ps)],
                 "worker": [task_address(name, "worker", i, namespace, port)
                            for i in range(num_workers)]},
        task_type=task_type, task_index=task_index)


def pod_index(task_type, environ=None):
    """This pod's index: `JOB_COMPLETION_INDEX` (Indexed Job) or the hostname's ordinal."""
    environ = os.environ if environ is None else environ
    if task_type == "worker" and environ.get("JOB_COMPLETION_INDEX", "").isdigit():
        return int(environ["JOB_COMPLETION_INDEX"])
    hostname = environ.get("HOSTNAME", "")
    ordinal = hostname.rsplit("-", 1)[-1]
    if not ordinal.isdigit():
        raise TFConfigError(
            f"cannot tell this pod's index: no JOB_COMPLETION_INDEX, and the hostname "
            f"{hostname!r} does not end in '-<ordinal>' as StatefulSet and Indexed Job pods do")
    return int(ordinal)


def pod_cluster_config(name, task_type, num_ps, num_workers, namespace="default", port=2222,
                       environ=None):
    """The TF_CONFIG of the pod running this code, from its index."""
    if task_type not in ("ps", "worker"):
        raise TFConfigError(f"`task_type` must be one of ['ps', 'worker']. Received: "
                            f"{task_type!r}")
    return cluster_for_job(name, num_ps, num_workers, namespace, port, task_type,
                           pod_index(task_type, environ))
