"""Cluster descriptions: TF_CONFIG parsing, validation, building; ports and readiness."""

from tfdist.cluster.config import JOB_NAMES
from tfdist.cluster.config import ClusterConfig
from tfdist.cluster.config import TFConfigError
from tfdist.cluster.config import as_cluster_config
from tfdist.cluster.config import parse_address
from tfdist.cluster.config import parse_tf_config
from tfdist.cluster.network import TaskUnreachableError
from tfdist.cluster.network import is_listening
from tfdist.cluster.network import pick_free_ports
from tfdist.cluster.network import wait_for_tasks

__all__ = [
    "JOB_NAMES",
    "ClusterConfig",
    "TFConfigError",
    "TaskUnreachableError",
    "as_cluster_config",
    "is_listening",
    "parse_address",
    "parse_tf_config",
    "pick_free_ports",
    "wait_for_tasks",
]
