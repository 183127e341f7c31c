"""TF_CONFIG: parse, validate and build cluster descriptions.

TensorFlow describes a cluster with the `TF_CONFIG` environment variable:

```python
{"cluster": {"ps": ["host:2222"], "worker": ["host:2223", "host:2224"]},
 "task": {"type": "worker", "index": 1}}
```

`ClusterConfig` is the typed, validated form of it. Every part of tfdist that needs to know
about the cluster goes through this module, so that a malformed cluster is reported once, with
the field, the allowed values and what was received.
"""

import dataclasses
import ipaddress
import json
import os
import re
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import Union

JOB_NAMES = ("chief", "worker", "ps", "evaluator")
# Jobs that hold at most one task, as in TensorFlow's own multi-worker utilities.
SINGLE_TASK_JOBS = ("chief", "evaluator")

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class TFConfigError(ValueError):
    """A cluster description (TF_CONFIG, host lists, flags) is malformed."""


def parse_address(address, field="address"):
    """Splits and validates a `host:port` address.

    IPv6 hosts are written in brackets: `[::1]:2222`.

    Args:
      address: the `host:port` string.
      field: how to name the value in an error message (e.g. `cluster.worker[1]`).

    Returns:
      A `(host, port)` tuple, with the brackets of an IPv6 host removed.

    Raises:
      TFConfigError: the address is not a string, has no port, a bad host, or a port
        outside 1..65535.
    """
    if not isinstance(address, str):
        raise TFConfigError(
            f"`{field}` must be a 'host:port' string. Received: {address!r} "
            f"of type {type(address).__name__}"
        )
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise TFConfigError(
                f"`{field}` must be 'host:port' ('[v6addr]:port' for IPv6). Received: {address!r}"
            )
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TFConfigError(
                f"`{field}` has a malformed IPv6 host {host!r}. Received: {address!r}"
            ) from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not host:
            raise TFConfigError(f"`{field}` must be 'host:port'. Received: {address!r}")
        # A fully qualified name may end in the root's dot (w-0.job.svc.cluster.local.).
        if not _HOSTNAME_RE.match(host[:-1] if host.endswith(".") else host):
            raise TFConfigError(
                f"`{field}` has a malformed host {host!r} (letters, digits, '.', '-', '_'; "
                f"IPv6 in brackets). Received: {address!r}"
            )
    if not (port_text.isascii() and port_text.isdigit()):
        raise TFConfigError(
            f"`{field}` must end in a numeric port (ASCII digits 0-9). Received: {address!r}"
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise TFConfigError(
            f"`{field}` port must be between 1 and 65535. Received: {port} in {address!r}"
        )
    return host, port


def _normalize_job(job, addresses):
    """Returns a job's addresses as a dense list, validating each one."""
    if isinstance(addresses, Mapping):
        indices = []
        for key in addresses:
            try:
                indices.append(int(key))
            except (TypeError, ValueError):
                raise TFConfigError(
                    f"`cluster.{job}` index map keys must be task indices. Received key {key!r}"
                ) from None
        if sorted(indices) != list(range(len(indices))):
            raise TFConfigError(
                f"`cluster.{job}` index map must cover tasks 0..{len(indices) - 1} without gaps. "
                f"Received indices {sorted(indices)}"
            )
        by_index = {int(k): v for k, v in addresses.items()}
        addresses = [by_index[i] for i in range(len(by_index))]
    elif isinstance(addresses, str) or not isinstance(addresses, Sequence):
        raise TFConfigError(
            f"`cluster.{job}` must be a list of 'host:port' strings or a map from task index to "
            f"'host:port'. Received: {addresses!r}"
        )
    addresses = list(addresses)
    for i, address in enumerate(addresses):
        parse_address(address, field=f"cluster.{job}[{i}]")
    if job in SINGLE_TASK_JOBS and len(addresses) > 1:
        raise TFConfigError(
            f"`cluster.{job}` holds at most one task. Received {len(addresses)}: {addresses}"
        )
    return addresses


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster description and the task this process plays in it.

    `cluster` maps job names (`chief`, `worker`, `ps`, `evaluator`) to dense lists of
    `host:port` addresses. `task_type` / `task_index` name this process's task; both are None
    for a process outside the cluster (a launcher, a test).

    Example:

    >>> config = ClusterConfig.from_hosts(ps_hosts=["localhost:2222"],
    ...     worker_hosts=["localhost:2223", "localhost:2224"], job_name="worker", task_index=1)
    >>> config.num_workers, config.num_ps, config.is_chief, config.task_address
    (2, 1, False, 'localhost:2224')
    """

    cluster: Mapping[str, Sequence[str]]
    task_type: Optional[str] = None
    task_index: Optional[int] = None
    rpc_layer: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.cluster, Mapping):
            raise TFConfigError(
                f"`cluster` must be a map from job name to addresses. Received: {self.cluster!r}"
            )
        cluster = {}
        for job, addresses in self.cluster.items():
            if job not in JOB_NAMES:
                raise TFConfigError(
                    f"`cluster` job names must be among {list(JOB_NAMES)}. Received: {job!r}"
                )
            normalized = _normalize_job(job, addresses)
            if normalized:
                cluster[job] = tuple(normalized)
        seen = {}
        for job, addresses in cluster.items():
            for i, address in enumerate(addresses):
                host, port = parse_address(address)
                key = (host.lower(), port)
                if key in seen:
                    raise TFConfigError(
                        f"`cluster` lists the address {address!r} twice: for {seen[key]} and for "
                        f"{job}:{i}"
                    )
                seen[key] = f"{job}:{i}"
        object.__setattr__(self, "cluster", cluster)
        if self.task_type is None:
            if self.task_index is not None:
                raise TFConfigError(
                    f"`task.index` is given ({self.task_index}) but `task.type` is missing"
                )
            return
        if self.task_type not in JOB_NAMES:
            raise TFConfigError(
                f"`task.type` must be one of {list(JOB_NAMES)}. Received: {self.task_type!r}"
            )
        if self.task_type not in cluster:
            raise TFConfigError(
                f"`task.type` {self.task_type!r} is not a job of the cluster, whose jobs are "
                f"{sorted(cluster)}"
            )
        index = 0 if self.task_index is None else self.task_index
        if isinstance(index, bool) or not isinstance(index, int):
            raise TFConfigError(
                f"`task.index` must be an integer. Received: {self.task_index!r}"
            )
        size = len(cluster[self.task_type])
        if not 0 <= index < size:
            raise TFConfigError(
                f"`task.index` must be between 0 and {size - 1} for job {self.task_type!r} "
                f"with {size} task(s). Received: {index}"
            )
        object.__setattr__(self, "task_index", index)

    # Construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, value):
        """Builds a config from a TF_CONFIG dict (`cluster`, optional `task`, `rpc_layer`)."""
        if not isinstance(value, Mapping):
            raise TFConfigError(f"TF_CONFIG must be a JSON object. Received: {value!r}")
        unknown = set(value) - {"cluster", "task", "rpc_layer", "environment"}
        if unknown:
            raise TFConfigError(
                f"TF_CONFIG keys must be among ['cluster', 'task', 'rpc_layer', 'environment']. "
                f"Received unknown key(s): {sorted(unknown)}"
            )
        if "cluster" not in value:
            raise TFConfigError("TF_CONFIG has no `cluster` key. Received keys: "
                                f"{sorted(value)}")
        task = value.get("task")
        task = {} if task is None else task
        if not isinstance(task, Mapping):
            raise TFConfigError(f"`task` must be an object ({{'type': ..., 'index': ...}}). "
                                f"Received: {task!r}")
        unknown = set(task) - {"type", "index", "trial"}
        if unknown:
            raise TFConfigError(
                f"`task` keys must be among ['type', 'index', 'trial']. Received unknown "
                f"key(s): {sorted(unknown)}"
            )
        for key in ("rpc_layer", "environment"):
            if value.get(key) is not None and not isinstance(value[key], str):
                raise TFConfigError(f"`{key}` must be a string. Received: {value[key]!r} of "
                                    f"type {type(value[key]).__name__}")
        config = cls(
            cluster=value["cluster"],
            task_type=task.get("type"),
            task_index=task.get("index"),
            rpc_layer=value.get("rpc_layer"),
        )
        # (A ps started from host flags may know only the ps job; a TF_CONFIG describes the
        # whole cluster.)
        if not set(config.cluster) & {"chief", "worker"}:
            raise TFConfigError(
                f"`cluster` has no task that trains: it needs a 'chief' or 'worker' job. "
                f"Received jobs: {sorted(config.cluster)}")
        return config

    @classmethod
    def from_hosts(cls, ps_hosts=(), worker_hosts=(), chief_host=None, job_name=None,
                   task_index=None, evaluator_host=None):
        """Builds a config from host lists, as TF1's `--ps_hosts` / `--worker_hosts` flags.

        Args:
          ps_hosts: `host:port` strings of the ps tasks, or one comma-separated string.
          worker_hosts: `host:port` strings of the worker tasks, or one comma-separated string.
          chief_host: optional `host:port` of a separate chief task.
          job_name: this process's job (`ps`, `worker`, `chief`, `evaluator`) or None.
          task_index: this process's index in `job_name`.
          evaluator_host: optional `host:port` of an evaluator task.
        """
        cluster = {}
        for job, hosts in (("chief", chief_host), ("worker", worker_hosts), ("ps", ps_hosts),
                           ("evaluator", evaluator_host)):
            if isinstance(hosts, str):
                hosts = [h.strip() for h in hosts.split(",") if h.strip()]
            hosts = list(hosts or ())
            if hosts:
                cluster[job] = hosts
        return cls(cluster=cluster, task_type=job_name, task_index=task_index)

    def with_task(self, task_type, task_index=0):
        """Returns the same cluster seen from another task."""
        return ClusterConfig(self.cluster, task_type, task_index, self.rpc_layer)

    # Views --------------------------------------------------------------------------------

    @property
    def num_ps(self):
        return len(self.cluster.get("ps", ()))

    @property
    def num_workers(self):
        """Tasks that train: the chief (if any) plus the workers."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def training_tasks(self):
        """`(task_type, task_index)` of every training task, chief first."""
        return [(job, i) for job in ("chief", "worker")
                for i in range(len(self.cluster.get(job, ())))]

    @property
    def worker_rank(self):
        """This task's position among `training_tasks` (0 = chief), or None."""
        key = (self.task_type, self.task_index)
        tasks = self.training_tasks
        return tasks.index(key) if key in tasks else None

    @property
    def is_chief(self):
        """True for the `chief` task, or for worker 0 when the cluster has no chief."""
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and (
            "chief" not in self.cluster)

    @property
    def task_address(self):
        if self.task_type is None:
            return None
        return self.cluster[self.task_type][self.task_index]

    def address(self, task_type, task_index):
        """The address of a task, with an error naming it if it is not in the cluster."""
        addresses = self.cluster.get(task_type, ())
        if not 0 <= task_index < len(addresses):
            raise TFConfigError(
                f"/job:{task_type}/task:{task_index} is not in the cluster, whose jobs are "
                f"{ {job: len(a) for job, a in self.cluster.items()} }"
            )
        return addresses[task_index]

    def to_dict(self):
        value = {"cluster": {job: list(a) for job, a in self.cluster.items()}}
        if self.task_type is not None:
            value["task"] = {"type": self.task_type, "index": self.task_index}
        if self.rpc_layer:
            value["rpc_layer"] = self.rpc_layer
        return value

    def to_json(self):
        """The TF_CONFIG JSON string of this config."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def cluster_spec(self, jobs=None):
        """The cluster as a `tf.train.ClusterSpec`, optionally restricted to some jobs."""
        import tensorflow as tf

        return tf.train.ClusterSpec(
            {job: list(a) for job, a in self.cluster.items() if jobs is None or job in jobs})


def parse_tf_config(value=None):
    """Parses and validates TF_CONFIG.

    Args:
      value: None to read the `TF_CONFIG` environment variable, a JSON string, or a dict.

    Returns:
      A `ClusterConfig`.

    Raises:
      TFConfigError: TF_CONFIG is missing, not JSON, or describes an invalid cluster; the
        message names the field, what is allowed and what was received.
    """
    if value is None:
        value = os.environ.get("TF_CONFIG")
        if not value:
            raise TFConfigError(
                "TF_CONFIG is not set: set it to the cluster's JSON description, or start the "
                "task with `tfdist-launch`")
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise TFConfigError(f"TF_CONFIG is not valid JSON ({e}). Received: {value!r}") from None
    return ClusterConfig.from_dict(value)


def config_from_resolver(resolver):
    """A `ClusterConfig` from a `tf.distribute.cluster_resolver.ClusterResolver`."""
    spec = resolver.cluster_spec().as_dict()
    return ClusterConfig(cluster=spec, task_type=resolver.task_type,
                         task_index=resolver.task_id, rpc_layer=resolver.rpc_layer or None)


ConfigLike = Union[ClusterConfig, Mapping, str, None]


def as_cluster_config(value: ConfigLike = None):
    """Accepts a `ClusterConfig`, a TF_CONFIG dict or string, a resolver, or None (env)."""
    if isinstance(value, ClusterConfig):
        return value
    if hasattr(value, "cluster_spec") and hasattr(value, "task_type"):
        return config_from_resolver(value)
    return parse_tf_config(value)
