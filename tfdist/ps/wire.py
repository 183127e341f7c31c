"""The message format between workers and ps tasks: what a push and a reply carry.

A push is a queue entry `tag, rank, payload..., rows and row values of each gradient pushed
sparse, values`; its payload is the shard's main vector, or, compressed, each unit's coded
parts then the raw entries. A reply is `token, message, progress, values`. Control
messages (hello, its answer, absent, stop) are JSON strings.
"""

import json

import tensorflow as tf

from tfdist._bitcast import floats_as_ints
from tfdist._bitcast import ints_as_floats
from tfdist.ps.spec import entry_of

REPLY_DTYPES = [tf.int64, tf.string, tf.int64, tf.float32]


def push_dtypes(payload_dtypes, num_sparse=0):
    """Component dtypes of a push: tag, rank, the main part's payload, rows and row values
    of each gradient pushed sparse, the values."""
    return [tf.int64, tf.int32, *payload_dtypes, *[tf.int64, tf.float32] * num_sparse,
            tf.float32]


def push_key(tag, rank, shard, num_workers):
    """The key a push's compressor draws its random choices from (same on both sides)."""
    return tf.stack([tf.cast(tag, tf.int64),
                     tf.cast(rank, tf.int64) + tf.cast(shard * num_workers, tf.int64)])


def push_units(layout, compressor):
    """How a compressed push codes a shard's main vector: `(units, raw)`.

    `units` are lists of main-entry indices coded together: one per variable where the
    compressor's scale or selection must be each tensor's own (`capabilities.per_tensor`:
    quantisers, DGC), else one for all of them (a top-k over the shard); `raw` are the
    entries sent as they are (`Compressor.takes`: under `min_size`, excluded by path). Both
    sides derive them from the shard's spec.
    """
    taken, raw = [], []
    for i, entry in enumerate(layout.main):
        entry = entry_of(entry)
        (taken if compressor.takes(entry.path, list(entry.shape), tf.float32)
         else raw).append(i)
    if compressor.capabilities.per_tensor:
        return [[i] for i in taken], raw
    units = [taken] if taken else []
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
        gradient = tf.IndexedSlices(gradient, tf.range(entry_of(entry).shape[0]))
    return (tf.cast(gradient.indices, tf.int64),
            tf.reshape(tf.cast(gradient.values, tf.float32), [-1]))


def row_pairs_bytes(pieces):
    """The bytes a push's row pairs take on the wire (`pieces`: ids, flat values, ids, ...):
    8 per id (an int64 as two float32 words), 4 per value, and each piece's size in the
    pack's head (8)."""
    total = tf.constant(0, tf.int64)
    for ids, values in zip(pieces[::2], pieces[1::2]):
        total += (16 + 8 * tf.size(ids, out_type=tf.int64)
                  + 4 * tf.size(values, out_type=tf.int64))
    return total


def rows_section(pairs):
    """The tail of a reply that carries rows (tables averaged by rows): each entry's row
    count, then each entry's ids and flat row values, as one float32 vector (int64s as the
    float32 words of their bits)."""
    if not pairs:
        return tf.zeros([0], tf.float32)
    counts = tf.stack([tf.size(ids, out_type=tf.int64) for ids, _ in pairs])
    pieces = [ints_as_floats(counts)]
    for ids, values in pairs:
        pieces += [ints_as_floats(tf.cast(ids, tf.int64)),
                   tf.reshape(tf.cast(values, tf.float32), [-1])]
    return tf.concat(pieces, axis=0)


def split_rows_section(flat, widths):
    """`[(ids int64, flat float32 values)]` of a `rows_section` whose entries' rows are
    `widths` floats wide."""
    count = len(widths)
    head, rest = tf.split(flat, [2 * count, -1])
    counts = floats_as_ints(head)
    sizes = tf.reshape(tf.stack([2 * counts, counts * tf.constant(widths, tf.int64)], axis=1),
                       [-1])
    pieces = tf.split(rest, sizes, num=2 * count)
    return [(floats_as_ints(pieces[2 * i]), pieces[2 * i + 1]) for i in range(count)]


def encode(message):
    """A control message (a dict) as the JSON string that travels."""
    return json.dumps(message, sort_keys=True)


def decode(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text)
