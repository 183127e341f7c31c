"""What workers and ps tasks say to each other: shared names, the job spec, queue layouts.

Every ps task serves its own shard of the model. Its shared resources (container `tfdist`):

* `control`: a string queue the ps creates when it starts. A worker says `hello` there with
  its rank, a nonce and the spec of the shard (variables, optimizer config, policy); the ps
  answers on `hello/{rank}` with the run the worker belongs to.
* per run, under `run/{run}/`: the master variables (`var/{path}`, keyed by the Keras
  variable path), the `push` queue (`tag, rank, payload..., values`), one `reply/{rank}`
  queue per worker (`token, message, progress, values`) and the `progress` vector.

A worker step is one push and one reply per ps task: the reply carries the global step
(token), the shard's new values (the weights the worker computes its next gradient on) and
the shard's telemetry; a negative token carries an error message instead. Tags below zero on
the push queue are control entries (`LEAVE`, `DEAD`, `STOP`, `SYNC`).
"""

import json

import numpy as np
import tensorflow as tf

from tfdist.ps.policies import HISTOGRAM_BUCKETS
from tfdist.ps.variables import open_shared_variable

CONTAINER = "tfdist"
CONTROL_QUEUE = "control"

# Control tags of the push queue.
LEAVE, DEAD, STOP, SYNC = -1, -2, -3, -4
# The message of the reply to a SYNC: a worker that (re)joins waits for it, and discards
# replies meant for an earlier process of its rank.
SYNC_MESSAGE = "sync"

# Layout of the progress vector (then one membership entry per worker rank).
(STAT_STEP, STAT_UPDATES, STAT_DROPPED, STAT_AGGREGATED, STAT_STALENESS_SUM,
 STAT_STALENESS_MAX, STAT_CLOCK_GAP) = range(7)
STAT_HISTOGRAM = 7
STAT_MEMBERS = STAT_HISTOGRAM + HISTOGRAM_BUCKETS
# Membership of a rank: not seen yet, training, left, died.
EXPECTED, LIVE, LEFT, DIED = 0, 1, 2, 3

# Roles of a shard's variables.
GRADIENT = "gradient"    # trainable: its gradient is pushed, the optimizer applies the mean
VALUE = "value"          # non-trainable state (BatchNorm statistics): the mean is assigned
AVERAGE = "average"      # model averaging: the mean model (or mean change) is assigned
OPTIMIZER = "optimizer"  # the optimizer's own variables: live on the ps, never pushed
PUSHED_ROLES = (GRADIENT, VALUE, AVERAGE)


def num_stats(num_workers):
    return STAT_MEMBERS + num_workers


def progress_dict(values, num_workers):
    """The progress vector as a dict (global_step, dropped, staleness, membership...)."""
    values = [int(v) for v in values]
    aggregated = values[STAT_AGGREGATED]
    members = values[STAT_MEMBERS:STAT_MEMBERS + num_workers]
    return {
        "global_step": values[STAT_STEP],
        "updates": values[STAT_UPDATES],
        "dropped_gradients": values[STAT_DROPPED],
        "aggregated_gradients": aggregated,
        "staleness_mean": values[STAT_STALENESS_SUM] / aggregated if aggregated else 0.0,
        "staleness_max": values[STAT_STALENESS_MAX],
        "staleness_histogram": values[STAT_HISTOGRAM:STAT_MEMBERS],
        "max_clock_gap": values[STAT_CLOCK_GAP],
        "live": [r for r, m in enumerate(members) if m in (EXPECTED, LIVE)],
        "left": [r for r, m in enumerate(members) if m == LEFT],
        "dead": [r for r, m in enumerate(members) if m == DIED],
    }


def run_name(run, name):
    return f"run/{run}/{name}"


def variable_name(run, path):
    return run_name(run, f"var/{path}")


def open_run_variables(device, run, spec):
    """`(progress, {path: master})` of run `run` on `device`, as both sides open them."""
    progress = open_shared_variable(device, run_name(run, "progress"),
                                    [num_stats(spec["num_workers"])], tf.int64, "progress",
                                    container=CONTAINER)
    masters = {
        e["path"]: open_shared_variable(
            device, variable_name(run, e["path"]), e["shape"], e["dtype"],
            e["path"].rpartition("/")[2], container=CONTAINER, trainable=e["role"] == GRADIENT)
        for e in spec["variables"]}
    return progress, masters


class ShardLayout:
    """How one shard's pushed variables are flattened into float32 vectors, and back.

    `main` are the variables whose part of a push goes through the compressor (gradients, or
    the averaged model); `values` the non-trainable state pushed as it is. A reply carries
    the values of `main + values`, in that order.

    Args:
      entries: the shard's spec entries (dicts with `path`, `shape`, `dtype`, `role`).
    """

    def __init__(self, entries):
        self.main = [e for e in entries if e["role"] in (GRADIENT, AVERAGE)]
        self.values = [e for e in entries if e["role"] == VALUE]
        self.main_sizes = [_size(e["shape"]) for e in self.main]
        self.value_sizes = [_size(e["shape"]) for e in self.values]
        self.main_size = int(sum(self.main_sizes))
        self.value_size = int(sum(self.value_sizes))
        self.reply_size = self.main_size + self.value_size
        # Gradients pushed as the rows they touch: `(offset in the main vector, row size)`.
        offsets = np.cumsum([0] + self.main_sizes[:-1]).tolist()
        self.sparse = [(int(offset), _size(e["shape"][1:]))
                       for offset, e in zip(offsets, self.main) if e.get("sparse")]
        self.dense_sizes = [n for n, e in zip(self.main_sizes, self.main)
                            if not e.get("sparse")]

    def densify(self, dense, sparse):
        """The main vector of a push: `dense` (the other gradients, flat) with each sparse
        gradient's rows `(rows, flat row values)` added at its place (repeated rows sum)."""
        if not self.sparse:
            return tf.reshape(dense, [self.main_size])
        pieces = iter(tf.split(dense, self.dense_sizes) if self.dense_sizes else [])
        full = tf.concat([tf.zeros([n]) if e.get("sparse") else next(pieces)
                          for n, e in zip(self.main_sizes, self.main)], axis=0)
        for (offset, width), (rows, values) in zip(self.sparse, sparse):
            positions = (offset + rows[:, None] * width
                         + tf.range(width, dtype=tf.int64)[None, :])
            full = tf.tensor_scatter_nd_add(full, tf.reshape(positions, [-1, 1]),
                                            tf.reshape(values, [-1]))
        return full

    @staticmethod
    def flatten(tensors):
        if not tensors:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
                          for t in tensors], axis=0)

    def unflatten(self, flat, entries, sizes):
        if not entries:
            return []
        return [tf.cast(tf.reshape(part, e["shape"]), e["dtype"])
                for part, e in zip(tf.split(flat, sizes), entries)]

    def split_reply(self, flat):
        """`(main values, value values)` of a reply's flat vector, in each variable's dtype."""
        main, values = tf.split(flat, [self.main_size, self.value_size])
        return (self.unflatten(main, self.main, self.main_sizes),
                self.unflatten(values, self.values, self.value_sizes))


def _size(shape):
    return int(np.prod(shape)) if shape else 1


def push_dtypes(payload_dtypes, num_sparse=0):
    """Component dtypes of a push: tag, rank, the main part's payload, rows and row values
    of each gradient pushed sparse, the values."""
    return [tf.int64, tf.int32, *payload_dtypes, *[tf.int64, tf.float32] * num_sparse,
            tf.float32]


def push_units(layout, compressor):
    """How a compressed push codes a shard's main vector: `(units, raw)`.

    `units` are lists of main-entry indices coded together: one per variable where the
    compressor's scale or selection must be each tensor's own (`per_tensor`: quantisers,
    DGC), else one for all of them (a top-k over the shard); `raw` are the entries sent as
    they are (`Compressor.takes`: under `min_size`, excluded by path). Both sides derive
    them from the shard's spec.
    """
    taken, raw = [], []
    for i, entry in enumerate(layout.main):
        (taken if compressor.takes(entry["path"], entry["shape"], tf.float32)
         else raw).append(i)
    units = [[i] for i in taken] if compressor.per_tensor else ([taken] if taken else [])
    return units, raw


def compressed_push_dtypes(layout, compressor):
    """The payload dtypes of a compressed push: each unit's, then the raw entries'."""
    units, _ = push_units(layout, compressor)
    return [d for unit in units for d in compressor.payload_dtypes(
        tf.float32, [sum(layout.main_sizes[i] for i in unit)])] + [tf.float32]


def _unit_key(key, unit):
    return key + tf.constant([0, unit << 32], tf.int64)


def encode_push(layout, compressor, main, states, key):
    """`(payload, new_states)`: the flat main vector `main` coded unit by unit, each with
    its own state (`states[u]`, a dict of tensors) and key."""
    units, raw = push_units(layout, compressor)
    pieces = tf.split(main, layout.main_sizes) if layout.main else []
    payload, new_states = [], []
    for u, unit in enumerate(units):
        flat = tf.concat([pieces[i] for i in unit], axis=0)
        coded, state = compressor.compress(flat, states[u], _unit_key(key, u))
        payload += list(coded)
        new_states.append(state)
    payload.append(tf.concat([pieces[i] for i in raw], axis=0) if raw else tf.zeros([0]))
    return tuple(payload), new_states


def decode_push(layout, compressor, payload, key):
    """The flat main vector a compressed push stands for (`encode_push` undone)."""
    units, raw = push_units(layout, compressor)
    per_unit = len(compressor.payload_dtypes(tf.float32))
    pieces = [None] * len(layout.main)
    for u, unit in enumerate(units):
        sizes = [layout.main_sizes[i] for i in unit]
        decoded = compressor.decompress(payload[u * per_unit:(u + 1) * per_unit],
                                        [sum(sizes)], tf.float32, _unit_key(key, u))
        for i, piece in zip(unit, tf.split(decoded, sizes)):
            pieces[i] = piece
    if raw:
        for i, piece in zip(raw, tf.split(payload[-1], [layout.main_sizes[i] for i in raw])):
            pieces[i] = piece
    return tf.concat(pieces, axis=0) if pieces else tf.zeros([0])


def sparse_rows(gradient, entry):
    """`(rows int64, flat float32 row values)` of the gradient of a variable pushed sparse."""
    if not isinstance(gradient, tf.IndexedSlices):  # a trace whose gradient came dense
        gradient = tf.IndexedSlices(gradient, tf.range(entry["shape"][0]))
    return (tf.cast(gradient.indices, tf.int64),
            tf.reshape(tf.cast(gradient.values, tf.float32), [-1]))


REPLY_DTYPES = [tf.int64, tf.string, tf.int64, tf.float32]


def encode(message):
    return json.dumps(message, sort_keys=True)


def decode(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text)


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


def compare_specs(run_spec, spec):
    """None if a worker's shard spec fits the run's, else what differs (for its error)."""
    keys = ("mode", "policy", "num_workers", "num_ps", "shard", "optimizer", "outer_optimizer",
            "compression")
    for key in keys:
        if key in ("optimizer", "outer_optimizer"):
            if _fixed(run_spec.get(key)) != _fixed(spec.get(key)):
                return (f"its {key.replace('_', ' ')} is {spec.get(key)!r}, the run's is "
                        f"{run_spec.get(key)!r}")
            continue
        if run_spec.get(key) != spec.get(key):
            return (f"its {key} is {spec.get(key)!r}, the run's is {run_spec.get(key)!r}")
    mine = {e["path"]: e for e in spec["variables"]}
    theirs = {e["path"]: e for e in run_spec["variables"]}
    for path in sorted(set(mine) | set(theirs)):
        if path not in theirs:
            return f"it has variable {path!r}, which the run does not"
        if path not in mine:
            return f"the run has variable {path!r}, which it does not"
        for field in ("shape", "dtype", "role", "rows", "sparse", "outer"):
            if mine[path].get(field) != theirs[path].get(field):
                return (f"variable {path!r} has {field} {mine[path].get(field)!r}, in the run "
                        f"{theirs[path].get(field)!r} (the same `variable_partitioner` "
                        "everywhere?)" if field == "rows" else
                        f"variable {path!r} has {field} {mine[path].get(field)!r}, in the run "
                        f"{theirs[path].get(field)!r}")
    if [e["path"] for e in spec["variables"]] != [e["path"] for e in run_spec["variables"]]:
        return "it created the same variables in another order"
    return None
