"""What Stochastic Gradient Push workers send each other: queues, message layout, tags.

Every worker's TF server holds, in container `tfdistsgp`:

* `outbox`: what the worker's courier forwards (`tfdist.gossip.courier`), entries
  `(out-peers int32 [p], message float32 [L])`;
* `inbox/{sender}`: one FIFO queue per other worker, messages float32 `[L]`. A sender's
  messages arrive in the order it sent them, so a receiver knows which step each one is from.
* `plan/{sender}`: under a callable graph, the sender's plans (`tfdist.gossip.plans`): int64
  `[kind, value, out-peers...]` as float32 pairs; an outbox entry whose out-peers start
  with `PLAN` goes there.

A message is one float32 vector (one tensor per message: the per-message overhead, not the
bytes, dominates a small model): three int64 words as the float32 pairs of their bits (`tag`,
the sender's `rank`, an `info` word), the push-sum weight share, then the parameter shares.
A tag >= 0 is the sender's step; negative tags are control messages.
"""

import tensorflow as tf

from tfdist._bitcast import floats_as_ints
from tfdist._bitcast import ints_as_floats

CONTAINER = "tfdistsgp"
OUTBOX = "outbox"

# Control tags. DEAD: `info` is the rank that stopped answering (or COURIER); END: the sender
# took its last training step, `info` is how many it took; AVERAGE: the sender's (x, w) after
# it took every message sent to it, for the final average (`info`: how many values its LOCAL
# messages carry); LOCAL: the `info`-th part of the sender's model variables that are not
# gossiped (BatchNormalization's moving statistics, frozen weights), for the final average;
# STOP: the courier's last entry; SCHEDULE: a callable graph's digests of its first `info`
# steps (`tfdist.gossip.graphs.check_agreement`), the first message of every sender.
DEAD, END, AVERAGE, STOP, LOCAL, SCHEDULE = -2, -3, -4, -5, -6, -7
# Plans: an outbox entry `([PLAN, peer, ...], plan)`; a plan's kind: PLAN_PEERS (`value`:
# the chunk, then its out-peers step by step), PLAN_END (`value`: the sender's step count
# when it ended), PLAN_DEAD (`value`: the rank that stopped answering, as DEAD's `info`).
PLAN = -8
PLAN_PEERS, PLAN_END, PLAN_DEAD = 0, 1, 2
HEAD = 7  # 3 int64 words (6 floats) and the weight
WEIGHT = 6


def inbox_name(sender):
    return f"inbox/{sender}"


def task_device(task, kind="CPU"):
    """`/job:worker/replica:0/task:2/device:CPU:0` of a task named `(job, index)`."""
    job, index = task
    return f"/job:{job}/replica:0/task:{index}/device:{kind}:0"


def message_size(num_values):
    return HEAD + num_values


def inbox_queue(device, sender, size):
    """The handle of the inbox of the worker on `device` for messages from `sender`."""
    with tf.device(device):
        return tf.raw_ops.FIFOQueueV2(component_types=[tf.float32], shapes=[[size]],
                                      capacity=-1, container=CONTAINER,
                                      shared_name=inbox_name(sender))


def plan_name(sender):
    return f"plan/{sender}"


def plan_queue(device, sender):
    """The handle of the plan queue of the worker on `device` for plans from `sender`."""
    with tf.device(device):
        return tf.raw_ops.FIFOQueueV2(component_types=[tf.float32], shapes=[], capacity=-1,
                                      container=CONTAINER, shared_name=plan_name(sender))


def pack_plan(kind, value, peers):
    """A plan: float32, the bits of int64 `[kind, value, *peers]`."""
    return ints_as_floats(tf.concat([tf.constant([kind, value], tf.int64),
                                     tf.reshape(tf.cast(peers, tf.int64), [-1])], 0))


def unpack_plan(plan):
    """`(kind, value, peers int64 numpy)` of a plan (eager)."""
    words = floats_as_ints(plan).numpy()
    return int(words[0]), int(words[1]), words[2:]


def outbox_queue(device):
    with tf.device(device):
        return tf.raw_ops.FIFOQueueV2(component_types=[tf.int32, tf.float32], shapes=[],
                                      capacity=-1, container=CONTAINER, shared_name=OUTBOX)


def pack(tag, rank, info, weight, values):
    """One message: float32 `[HEAD + n]`."""
    head = ints_as_floats(tf.stack([tf.cast(tag, tf.int64), tf.cast(rank, tf.int64),
                                    tf.cast(info, tf.int64)]))
    return tf.concat([head, tf.reshape(tf.cast(weight, tf.float32), [1]),
                      tf.reshape(values, [-1])], axis=0)


def unpack(messages):
    """`(tags, ranks, infos, weights, values)` of float32 messages `[n, L]`."""
    words = tf.reshape(floats_as_ints(messages[:, :6]), [-1, 3])
    return words[:, 0], words[:, 1], words[:, 2], messages[:, WEIGHT], messages[:, HEAD:]


def control(tag, rank, info, size):
    """A control message of `size` floats (values zero)."""
    return pack(tag, rank, info, 0.0, tf.zeros([size - HEAD], tf.float32))
