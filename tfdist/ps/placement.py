"""Where each master variable lives: whole on one ps task, or split by rows over several.

The plan is made once, when a worker joins a run, from what every worker knows alike: the
variables' paths, shapes and dtypes, the optimizer and the constraints. Every worker makes the
same plan, and the ps tasks check it (each shard's spec must match the run's).

A large variable is split along its first axis into parts on distinct ps tasks, the way TF's
`ParameterServerStrategy` shards with a `variable_partitioner`: each part is a master of its
own, with the same Keras path on its ps task, so the ps optimizer gives it slots of the part's
shape. Splitting is exact only for an optimizer whose update is elementwise (SGD, Adam, ...)
and a constraint that is; anything else keeps every variable whole.
"""

import math

import numpy as np
import tensorflow as tf

AUTO = "auto"
# "auto" splits a variable larger than this, or than a quarter of a ps task's fair share of
# the model (so that small models spread too): TF's recommended minimum shard size.
AUTO_MIN_SHARD_BYTES = 256 << 10
# ... but never into parts smaller than this: below it a split adds ops and balances nothing.
AUTO_FLOOR_BYTES = 256

# Keras optimizers whose update of an element reads only that element's gradient and state.
ELEMENTWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Ftrl", "Lion"})


def check_partitioner(variable_partitioner):
    """Validates a strategy's `variable_partitioner` argument."""
    if variable_partitioner is None or variable_partitioner == AUTO:
        return variable_partitioner
    if callable(variable_partitioner) and not isinstance(variable_partitioner, type):
        return variable_partitioner
    raise ValueError(
        "`variable_partitioner` must be None (every variable whole), 'auto', or a "
        "`tf.distribute.experimental.partitioners.Partitioner` (a callable "
        f"`(shape, dtype) -> [shards per axis]`). Received: {variable_partitioner!r}")


def elementwise_optimizer(optimizer):
    """True if the optimizer (or a LossScaleOptimizer's inner one) updates elementwise."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    cls = type(inner)
    return cls.__module__.startswith("keras.") and cls.__name__ in ELEMENTWISE_OPTIMIZERS


def row_splits(rows, parts):
    """`parts` contiguous `(begin, end)` row ranges, the first ones one row longer if uneven
    (as `tf.distribute.experimental.partitioners` shard)."""
    base, extra = divmod(rows, parts)
    splits, begin = [], 0
    for i in range(parts):
        end = begin + base + (1 if i < extra else 0)
        splits.append((begin, end))
        begin = end
    return splits


def nbytes(shape, dtype):
    return int(np.prod(shape)) * tf.as_dtype(dtype).size if shape else tf.as_dtype(dtype).size


class Item:
    """One variable to place.

    Args:
      key: its Keras path (the order of ties).
      shape, dtype: its shape and dtype.
      splittable: whether its rows may go to different ps tasks.
      everywhere: a whole copy on every ps task (the optimizer's own variables).
      colocate_with: the key of the variable it follows (an optimizer slot), or None.
    """

    def __init__(self, key, shape, dtype, splittable=True, everywhere=False,
                 colocate_with=None):
        self.key = key
        self.shape = list(shape)
        self.dtype = tf.as_dtype(dtype)
        self.splittable = splittable and len(self.shape) >= 1 and self.shape[0] >= 2
        self.everywhere = everywhere
        self.colocate_with = colocate_with
        self.bytes = nbytes(self.shape, self.dtype)


def parts_wanted(item, num_ps, partitioner, threshold):
    """How many parts `item` goes in: 1 if it is not splittable, there is one ps task or
    no partitioner; with "auto", about `threshold` bytes each; else what the partitioner
    says for its first axis. At most one part per ps task and per row."""
    if not item.splittable or num_ps < 2 or partitioner is None:
        return 1
    if partitioner == AUTO:
        if item.bytes <= threshold:
            return 1
        wanted = math.ceil(item.bytes / threshold)
    else:
        shards = list(partitioner(tf.TensorShape(item.shape), item.dtype))
        if any(int(n) > 1 for n in shards[1:]):
            raise ValueError(
                f"`variable_partitioner` split {item.key} (shape {item.shape}) as {shards}: "
                "tfdist splits variables along their first axis only")
        wanted = int(shards[0]) if shards else 1
    return max(1, min(wanted, num_ps, item.shape[0]))


def plan(items, num_ps, partitioner=AUTO, held=None):
    """Places `items` on `num_ps` ps tasks.

    Independent variables go largest first, each part to the ps task holding the fewest
    bytes so far (`held`: what each task holds already, the embedding tables' rows; the
    parts of one variable to distinct tasks); a colocated variable of the
    same shape is split as the one it follows, else it goes whole with that one's first part.

    Returns:
      `{key: [(ps_index, rows)]}` where `rows` is `(begin, end)` of a part, or None for the
      whole variable; an `everywhere` item has a whole entry for every ps task.
    """
    items = list(items)
    by_key = {item.key: item for item in items}
    independent = [i for i in items if not i.everywhere and i.colocate_with is None]
    total = sum(i.bytes for i in independent)
    threshold = min(AUTO_MIN_SHARD_BYTES,
                    max(AUTO_FLOOR_BYTES, total // (4 * max(num_ps, 1))))
    held = list(held) if held is not None else [0] * num_ps
    placed = {}
    for item in sorted(independent, key=lambda i: (-i.bytes, i.key)):
        parts = parts_wanted(item, num_ps, partitioner, threshold)
        tasks = sorted(range(num_ps), key=lambda t: (held[t], t))[:parts]
        if parts == 1:
            placed[item.key] = [(tasks[0], None)]
            held[tasks[0]] += item.bytes
            continue
        placed[item.key] = []
        for task, (begin, end) in zip(tasks, row_splits(item.shape[0], parts)):
            placed[item.key].append((task, (begin, end)))
            held[task] += item.bytes * (end - begin) // item.shape[0]
    for item in items:
        if item.everywhere:
            placed[item.key] = [(t, None) for t in range(num_ps)]
        elif item.colocate_with is not None:
            reference = by_key.get(item.colocate_with)
            parts = placed.get(item.colocate_with, [(0, None)])
            if reference is not None and reference.shape == item.shape:
                placed[item.key] = list(parts)
            else:
                placed[item.key] = [(parts[0][0], None)]
    return placed
