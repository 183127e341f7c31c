"""Clusters placed by Kubernetes: every pod derives its TF_CONFIG from its own index.

The plain manifests of `tfdist.launch.kubernetes` run the ps tasks and the workers as two
Indexed Jobs, each behind a headless Service, so that every task has a stable DNS name:

    <job>-ps-<i>.<job>-ps.<namespace>.svc:<port>         (ps Job, index i)
    <job>-worker-<i>.<job>-worker.<namespace>.svc:<port> (worker Job, index i)

`pod_cluster_config` computes the whole cluster and this pod's task from those names, so the
same code that validates a hand-written TF_CONFIG builds the one each pod uses.
"""

import os
import re

from tfdist.cluster.config import ClusterConfig
from tfdist.cluster.config import TFConfigError

# Service names (and a TFJob's name) are RFC 1035 labels: they start with a letter.
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

# Seconds a pod waits for the job's other pods by default: long enough for a node to pull a
# TensorFlow image (hundreds of MB to a few GB) before the task it runs can listen.
CONNECT_TIMEOUT = 600.0
# Seconds a ps pod serves on after the last worker stopped listening: a worker pod being
# restarted by its Job is back well within it.
# Longer than a worker's connect timeout (600 s): workers that all restart at once (a hard-sync
# run fails on every worker when one dies, a drained node held them all) may take that long,
# with image pulls and back-off, to listen again; the ps must still be there.
WORKERS_GONE_GRACE = 660.0


def check_job_name(name):
    """A job name usable in pod and Service names (a DNS label, room for suffixes)."""
    if not isinstance(name, str) or not _DNS_1035_LABEL.fullmatch(name) or len(name) > 40:
        raise TFConfigError(
            f"`name` must be a DNS label of at most 40 characters (lower-case letters, digits, "
            f"'-', starting with a letter), so that '<name>-worker-<i>' stays a valid pod and "
            f"Service name. Received: {name!r}")
    return name


def task_address(name, job, index, namespace, port):
    return f"{name}-{job}-{index}.{name}-{job}.{namespace}.svc:{port}"


def cluster_for_job(name, num_ps, num_workers, namespace="default", port=2222,
                    task_type=None, task_index=None):
    """The `ClusterConfig` of a tfdist Kubernetes job, seen from one task (or from outside)."""
    check_job_name(name)
    cluster = {"worker": [task_address(name, "worker", i, namespace, port)
                          for i in range(num_workers)]}
    if num_ps:  # an all-reduce or decentralised job has no ps job at all
        cluster = {"ps": [task_address(name, "ps", i, namespace, port) for i in range(num_ps)],
                   **cluster}
    return ClusterConfig(cluster=cluster, task_type=task_type, task_index=task_index)


def pod_index(environ=None):
    """This pod's index: `JOB_COMPLETION_INDEX` (an Indexed Job's pod, as every task of
    tfdist's manifests is) or the hostname's ordinal (a StatefulSet's pod)."""
    environ = os.environ if environ is None else environ
    index = environ.get("JOB_COMPLETION_INDEX", "")
    if index.isascii() and index.isdigit():
        return int(index)
    hostname = environ.get("HOSTNAME", "")
    ordinal = hostname.rsplit("-", 1)[-1]
    if not (ordinal.isascii() and ordinal.isdigit()):
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
                           pod_index(environ))
