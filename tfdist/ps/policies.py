"""How the updater turns pushes into updates: soft sync (N of M) or asynchronous.

A policy answers three questions for the chief's updater, in-graph:

* how many gradients make an update (`required`),
* whether a push computed at `entry_step` is still usable at global step `step` (`accepts`),
* how the learning rate and the gradient of an update depend on its staleness.

Staleness tau of an update is the number of global steps applied between the read of the
weights its gradient was computed on and its own application.
"""

import importlib
import math

import tensorflow as tf

from tfdist._args import check_int
from tfdist._args import check_number

HISTOGRAM_BUCKETS = 16  # staleness 0 .. 14, and 15 or more


def inverse_staleness(staleness):
    """1 / max(1, tau) (Zhang et al. 2016, "Staleness-aware async-SGD")."""
    staleness = tf.cast(staleness, tf.float32)
    return 1.0 / tf.maximum(1.0, staleness)


def no_staleness_scaling(staleness):
    del staleness
    return tf.constant(1.0)


STALENESS_FUNCTIONS = {"none": no_staleness_scaling, "inverse": inverse_staleness}


def function_reference(function, argument):
    """`module:qualified_name` of a module-level function, which a ps task can import.

    The updater runs in the ps processes, which do not run the user's script: a function
    it calls must be importable there.
    """
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise ValueError(
            f"`{argument}` runs on the ps tasks, which import it by name: pass a function "
            f"defined at the top level of a module they can import (installed, or on their "
            f"PYTHONPATH), not a lambda, a nested function or one defined in the script run "
            f"as __main__. Received: {function!r}")
    return f"{module}:{qualname}"


def resolve_function(reference):
    """The function named by `function_reference`: one defined in the module it names (not
    another module's object reached through its attributes, such as an imported `os`)."""
    module, _, qualname = reference.partition(":")
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    if getattr(value, "__module__", None) != module:
        raise ValueError(f"{reference!r} names {value!r}, which is not defined in {module!r}: "
                         f"a staleness function must be defined in the module it is named by")
    return value


def delay_compensated(gradient, weights_now, weights_read, compensation):
    """DC-ASGD (Zheng et al. 2017): g + lambda * g * g * (w_now - w_read), elementwise."""
    return gradient + compensation * gradient * gradient * (weights_now - weights_read)


def compensated_rows(variable, entry, gradient, read, compensation):
    """DC-ASGD per row: `(rows, flat values)` of a table's pushed gradient (`gradient`, the
    push's `(rows, flat values)`), its repeated rows summed, each compensated with lambda
    `compensation` by the row's value now in `variable` (the table's part on this ps, laid
    out as `entry`) and the value its worker read in the step (`read`, the lookups'
    `(rows, flat values)`; a row read twice was read with one value unless another push came
    between the reads: the first is taken)."""
    width = math.prod(entry.shape[1:])
    rows, index = tf.unique(gradient[0])
    summed = tf.math.unsorted_segment_sum(tf.reshape(gradient[1], [-1, width]), index,
                                          tf.size(rows))
    # A row id -1 that no gradient has keeps the search below from an empty list.
    read_ids = tf.concat([[-1], read[0]], axis=0)
    read_values = tf.concat([tf.zeros([1, width]), tf.reshape(read[1], [-1, width])], 0)
    read_rows, read_index = tf.unique(read_ids)
    first = tf.math.unsorted_segment_min(tf.range(tf.size(read_ids)), read_index,
                                         tf.size(read_rows))
    order = tf.argsort(read_rows)
    sorted_rows = tf.gather(read_rows, order)
    at = tf.minimum(tf.searchsorted(sorted_rows, rows), tf.size(sorted_rows) - 1)
    found = tf.equal(tf.gather(sorted_rows, at), rows)
    now = tf.reshape(tf.cast(tf.gather(variable.value, rows), tf.float32), [-1, width])
    was = tf.gather(read_values, tf.gather(first, tf.gather(order, at)))
    # (a row the step did not read, which a lookup's gradient never has: uncompensated)
    was = tf.where(found[:, None], was, now)
    compensated = delay_compensated(summed, now, was, compensation)
    return rows, tf.reshape(compensated, [-1])


class SoftSyncPolicy:
    """The first `replicas_to_aggregate` fresh gradients of a step; older ones are dropped."""

    name = "soft_sync"
    measures_staleness = False
    delay_compensation = None
    averages_weights = False
    defers_release = False

    def __init__(self, replicas_to_aggregate, num_workers):
        self.replicas_to_aggregate = replicas_to_aggregate
        self.num_workers = num_workers

    @property
    def fails_on_dead_worker(self):
        return self.replicas_to_aggregate == self.num_workers

    def required(self, live_workers):
        return min(self.replicas_to_aggregate, live_workers)

    def to_spec(self):
        return {"name": self.name, "replicas_to_aggregate": self.replicas_to_aggregate,
                "num_workers": self.num_workers}

    def accepts(self, entry_step, step):
        return entry_step >= step

    def learning_rate_factor(self, staleness):
        del staleness
        return None


class AsyncPolicy:
    """Every push is an update; its learning rate is scaled by a function of its staleness.

    Args:
      staleness: "none", "inverse", or a callable mapping the staleness (an int64 tensor) to
        a float32 learning-rate factor, traced into the update.
      max_staleness: None, or the bound s on staleness.
      delay_compensation: None, or lambda of DC-ASGD.
      on_stale: what `max_staleness` bounds. "drop": gradients staler than s are dropped.
        "wait" (stale synchronous parallel): a worker that has pushed more than s times
        more than the slowest live worker waits for it; nothing is dropped.
    """

    name = "async"
    measures_staleness = True
    fails_on_dead_worker = False
    averages_weights = False

    def __init__(self, staleness="none", max_staleness=None, delay_compensation=None,
                 on_stale="drop"):
        if isinstance(staleness, str):
            if staleness not in STALENESS_FUNCTIONS:
                raise ValueError(
                    f"`staleness` must be one of {sorted(STALENESS_FUNCTIONS)} or a callable. "
                    f"Received: {staleness!r}")
            self.staleness_name, self.staleness_fn = staleness, STALENESS_FUNCTIONS[staleness]
        elif callable(staleness):
            self.staleness_name = function_reference(staleness, "staleness")
            self.staleness_fn = staleness
        else:
            raise ValueError(f"`staleness` must be one of {sorted(STALENESS_FUNCTIONS)} or a "
                             f"callable. Received: {staleness!r}")
        check_int("max_staleness", max_staleness, "None or an integer >= 0", low=0,
                  allow_none=True)
        check_number("delay_compensation", delay_compensation, "None or a number >= 0 (lambda "
                     "of DC-ASGD)", low=0, allow_none=True)
        if on_stale not in ("drop", "wait"):
            raise ValueError(f"`on_stale` must be one of ['drop', 'wait']. Received: "
                             f"{on_stale!r}")
        if on_stale == "wait" and max_staleness is None:
            raise ValueError("`on_stale='wait'` bounds how far a worker may run ahead of the "
                             "slowest one and needs `max_staleness`. Received: None")
        self.max_staleness = max_staleness
        self.delay_compensation = delay_compensation
        self.on_stale = on_stale
        self.defers_release = on_stale == "wait"

    def required(self, live_workers):
        return min(1, live_workers)

    def to_spec(self):
        return {"name": self.name, "staleness": self.staleness_name,
                "max_staleness": self.max_staleness,
                "delay_compensation": self.delay_compensation, "on_stale": self.on_stale}

    def accepts(self, entry_step, step):
        if self.max_staleness is None or self.on_stale == "wait":
            return tf.constant(True)
        return step - entry_step <= self.max_staleness

    def learning_rate_factor(self, staleness):
        return tf.cast(self.staleness_fn(staleness), tf.float32)


class AveragingPolicy(SoftSyncPolicy):
    """Periodic model averaging: the pushes are models, the update is their mean.

    Each round averages the first `replicas_to_aggregate` models pushed for it; a model pushed
    for an older round is dropped and its worker takes the new average.
    """

    name = "averaging"
    averages_weights = True


def policy_from_spec(spec):
    """The policy a worker described in its spec (`to_spec()`), rebuilt on a ps task."""
    spec = dict(spec)
    name = spec.pop("name")
    if name == "async":
        staleness = spec.pop("staleness")
        if staleness not in STALENESS_FUNCTIONS:
            staleness = resolve_function(staleness)
        return AsyncPolicy(staleness, **spec)
    return {"soft_sync": SoftSyncPolicy, "averaging": AveragingPolicy}[name](
        spec["replicas_to_aggregate"], spec["num_workers"])
