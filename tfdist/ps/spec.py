"""The spec of a shard, as a worker sends it in its hello and the ps task runs it.

A `ShardSpec` says what one ps task serves for a job: its variables (`VariableEntry`, one
per master variable or part of one), the optimizer the ps rebuilds, the policy, the
compression. Both sides build the same objects; on the wire they are the JSON of
`to_json()`, read back with `from_json()`.
"""

import dataclasses
from typing import Optional

from tfdist._args import check_seconds
from tfdist.cluster.network import DEFAULT_STALL_TIMEOUT

# Roles of a shard's variables.
GRADIENT = "gradient"    # trainable: its gradient is pushed, the optimizer applies the mean
VALUE = "value"          # non-trainable state (BatchNorm statistics): pushed as the change
                         # since its worker last read it, the mean change is added
AVERAGE = "average"      # model averaging: the mean model (or mean change) is assigned
OPTIMIZER = "optimizer"  # the optimizer's own variables: live on the ps, never pushed
TABLE = "table"          # an embedding table living on the ps only: its gradient's rows are
                         # pushed, the rows updated there; never in a reply
ROWS = "rows"            # model averaging: a table (or its slot) every worker trains a copy of,
                         # averaged by the rows changed in a round (pushed and replied as rows)
ROLES = (GRADIENT, VALUE, AVERAGE, OPTIMIZER, TABLE, ROWS)
PUSHED_ROLES = (GRADIENT, VALUE, AVERAGE)


class RunError(RuntimeError):
    """A ps task refused this worker, or its run failed."""


# The fields of an entry that must agree between every worker of a run.
_COMPARED_FIELDS = ("shape", "dtype", "role", "rows", "sparse", "outer", "table",
                    "read_rows")


_PARTITIONER_HINT = " (the same `variable_partitioner` everywhere?)"


def _placed(entry):
    """The hint for a variable one ps task holds and another expects: a part of a split
    variable, or a table (placed where it is made), goes where the partitioner says."""
    return _PARTITIONER_HINT if entry.table or entry.rows is not None else ""


@dataclasses.dataclass(frozen=True)
class VariableEntry:
    """One master variable (or the rows `[begin, end)` of one) of a shard.

    Attributes:
      path: the Keras variable path every worker gives it.
      shape: the shape of the master (of the part, for a split variable).
      dtype: its dtype's name.
      role: one of `ROLES`.
      rows: None, or `(begin, end)`: the rows of a variable split over ps tasks.
      sparse: its gradient is pushed as the rows it touches (an embedding).
      outer: model averaging's outer optimizer updates it.
      weight_decay: False if the optimizer's weight decay skips it.
      constraint: the serialized Keras constraint the ps applies after each update.
      table: its master is a part of an embedding table kept on the ps tasks only (the
        table, or an optimizer slot of it), opened by `tfdist.ps.tables.part_name`.
      read_rows: a table whose push also carries the rows the worker read in its step (their
        ids and values): delay compensation per row (DC-ASGD) compares them with the rows
        the ps holds when it applies the push.
    """

    path: str
    shape: tuple
    dtype: str
    role: str
    rows: Optional[tuple] = None
    sparse: bool = False
    outer: bool = False
    weight_decay: bool = True
    constraint: Optional[dict] = None
    table: bool = False
    read_rows: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"the role of variable {self.path!r} must be one of "
                             f"{list(ROLES)}. Received: {self.role!r}")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.rows is not None:
            object.__setattr__(self, "rows", tuple(int(n) for n in self.rows))

    @property
    def trainable(self):
        return self.role in (GRADIENT, TABLE)

    @property
    def name(self):
        """The last part of its path (a variable's name)."""
        return self.path.rpartition("/")[2]

    def to_json(self):
        entry = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                 "role": self.role, "rows": None if self.rows is None else list(self.rows)}
        if not self.weight_decay:
            entry["weight_decay"] = False
        if self.constraint is not None:
            entry["constraint"] = self.constraint
        if self.sparse:
            entry["sparse"] = True
        if self.outer:
            entry["outer"] = True
        if self.table:
            entry["table"] = True
        if self.read_rows:
            entry["read_rows"] = True
        return entry

    @classmethod
    def from_json(cls, entry):
        return cls(path=entry["path"], shape=entry["shape"], dtype=entry["dtype"],
                   role=entry["role"], rows=entry.get("rows"),
                   sparse=bool(entry.get("sparse")), outer=bool(entry.get("outer")),
                   weight_decay=entry.get("weight_decay", True) is not False,
                   constraint=entry.get("constraint"), table=bool(entry.get("table")),
                   read_rows=bool(entry.get("read_rows")))


def entry_of(entry):
    """`entry` as a `VariableEntry` (from its JSON dict, as a hello carries it)."""
    return entry if isinstance(entry, VariableEntry) else VariableEntry.from_json(entry)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What one ps task serves for a job: the spec of its shard.

    Attributes:
      mode: "gradients" or "averaging".
      policy: the policy's `to_spec()` (`tfdist.ps.policies.policy_from_spec`).
      num_workers, num_ps: the cluster's sizes.
      worker_tasks, worker_addresses: each training worker's task name and address.
      shard: the ps task's index.
      variables: the shard's `VariableEntry`s, in the order every worker made them.
      optimizer: the Keras config of the workers' optimizer (None for averaging).
      outer_optimizer: the config of model averaging's outer optimizer, or None.
      imports: the modules (or `module:function`s) the ps must import to rebuild them.
      compression: the serialized compressor, or None.
      delta: pushes are changes since the last average (compressed averaging).
      init_timeout: seconds the run waits for the chief to initialise the masters.
      stall_timeout: seconds a worker whose port accepts connections may go without
        answering the ps's probes before the run treats it as dead (the value of the worker
        that started the run counts).
      table_updates: how the ps updates the rows of its tables: "lazy" (the rows a push
        touched, `tfdist.ps.rowwise`) or "dense" (every row, by the optimizer's own apply).
      job: the id of the worker's job (`tfdist.ps.worker.job_id`): a run belongs to the job
        whose worker started it, on every ps task. None: an older worker's, which names none.
    """

    mode: str
    policy: dict
    num_workers: int
    worker_tasks: tuple
    worker_addresses: tuple
    num_ps: int
    shard: int
    variables: tuple
    optimizer: Optional[dict] = None
    outer_optimizer: Optional[dict] = None
    imports: tuple = ()
    compression: Optional[dict] = None
    delta: bool = False
    init_timeout: float = 60.0
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    table_updates: str = "lazy"
    job: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "variables", tuple(entry_of(e) for e in self.variables))
        for name in ("worker_tasks", "worker_addresses", "imports"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_seconds("stall_timeout", self.stall_timeout)  # a hello's spec is checked too
        if self.job is not None and not isinstance(self.job, str):
            raise ValueError(f"`job` must be a string or None. Received: {self.job!r}")

    def to_json(self):
        return {"mode": self.mode, "policy": self.policy, "num_workers": self.num_workers,
                "worker_tasks": list(self.worker_tasks),
                "worker_addresses": list(self.worker_addresses), "num_ps": self.num_ps,
                "shard": self.shard, "variables": [e.to_json() for e in self.variables],
                "optimizer": self.optimizer, "outer_optimizer": self.outer_optimizer,
                "imports": list(self.imports), "compression": self.compression,
                "delta": self.delta, "init_timeout": self.init_timeout,
                "stall_timeout": self.stall_timeout, "table_updates": self.table_updates,
                "job": self.job}

    @classmethod
    def from_json(cls, spec):
        return cls(mode=spec["mode"], policy=spec["policy"], num_workers=spec["num_workers"],
                   worker_tasks=spec["worker_tasks"],
                   worker_addresses=spec["worker_addresses"], num_ps=spec["num_ps"],
                   shard=spec["shard"], variables=spec["variables"],
                   optimizer=spec.get("optimizer"),
                   outer_optimizer=spec.get("outer_optimizer"),
                   imports=spec.get("imports", ()), compression=spec.get("compression"),
                   delta=spec.get("delta", False), init_timeout=spec["init_timeout"],
                   stall_timeout=spec.get("stall_timeout", DEFAULT_STALL_TIMEOUT),
                   table_updates=spec.get("table_updates", "lazy"), job=spec.get("job"))

    def difference(self, other):
        """None if a worker's spec `other` fits this run's spec, else what differs (for its
        error)."""
        for key in ("mode", "policy", "num_workers", "num_ps", "shard", "optimizer",
                    "outer_optimizer", "compression", "table_updates"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if key in ("optimizer", "outer_optimizer"):
                if _fixed(mine) != _fixed(theirs):
                    return (f"its {key.replace('_', ' ')} is {theirs!r}, the run's is "
                            f"{mine!r}")
            elif mine != theirs:
                return f"its {key} is {theirs!r}, the run's is {mine!r}"
        runs = {e.path: e for e in self.variables}
        its = {e.path: e for e in other.variables}
        for path in sorted(set(runs) | set(its)):
            if path not in runs:
                return f"it has variable {path!r}, which the run does not{_placed(its[path])}"
            if path not in its:
                return (f"the run has variable {path!r}, which it does not"
                        f"{_placed(runs[path])}")
            for field in _COMPARED_FIELDS:
                mine, theirs = getattr(its[path], field), getattr(runs[path], field)
                if mine != theirs:
                    hint = _PARTITIONER_HINT if field == "rows" else ""
                    return (f"variable {path!r} has {field} {_shown(mine)}, in the run "
                            f"{_shown(theirs)}{hint}")
        if [e.path for e in other.variables] != [e.path for e in self.variables]:
            return "it created the same variables in another order"
        return None


def _shown(value):
    return repr(list(value) if isinstance(value, tuple) else value)


def _fixed(optimizer):
    """An optimizer config without what changes while training (a float learning rate a
    callback sets, the name Keras numbers): a restarted worker's must still fit."""
    if not isinstance(optimizer, dict):
        return optimizer
    config = dict(optimizer.get("config", {}))
    if isinstance(config.get("learning_rate"), (int, float)):
        config.pop("learning_rate")
    config.pop("name", None)
    if isinstance(config.get("inner_optimizer"), dict):
        config["inner_optimizer"] = _fixed(config["inner_optimizer"])
    return {**optimizer, "config": config}


def spec_of(spec):
    """`spec` as a `ShardSpec` (from its JSON dict, as a hello carries it)."""
    return spec if isinstance(spec, ShardSpec) else ShardSpec.from_json(spec)
