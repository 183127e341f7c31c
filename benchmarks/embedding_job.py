"""The recommendation job of `embedding.py`: generated data and its model, for every system.

Each example is 8 ids in three tables of different sizes, as a ranking model's features are:

* columns 0-3, the items a user saw, in the large table of V rows;
* columns 4-5, their categories, in a table of V / 10 rows;
* columns 6-7, the context (device, hour, ...), in a table of 1,000 rows.

Ids are Zipf-distributed (exponent 1.2: a few ids are hot, most are rare), then hashed over
the table's rows, so that the hot rows spread over the ps tasks as hashed ids do. The label
depends on the ids: every id has a hidden score (a hash of the id and its table, uniform in
[-1, 1]); an example is positive when the sum of its 8 scores, plus a little noise, is
above the job's median. A model learns the label only by learning the rows of the ids it
sees, so loss and accuracy show whether the tables train (0.5 accuracy before training).

The model: one `Embedding(rows, 16)` per table, the ids' vectors flattened and concatenated
(128 values), `Dense(64, relu)`, `Dense(1, sigmoid)`; Adagrad, binary cross-entropy. The
same code builds it with Keras 3 (tfdist, one process) or tf_keras (the peer): the `keras`
module is an argument. numpy only, no download.
"""

import numpy as np

DESCRIPTION = ("8 Zipf-distributed ids per example (exponent 1.2) in three tables of V, V / 10 "
               "and 1,000 rows, 16 wide; concatenated, Dense 64 relu, Dense 1 sigmoid; Adagrad "
               "0.1, binary cross-entropy; labels from hidden per-id scores (balanced).")
EMBEDDING_DIM = 16
CONTEXT_ROWS = 1000
ZIPF_EXPONENT = 1.2
LEARNING_RATE = 0.1
# (first column, number of columns, table rows as a function of V)
TABLES = (("items", 0, 4, lambda v: v), ("categories", 4, 2, lambda v: max(v // 10, 1)),
          ("context", 6, 2, lambda v: CONTEXT_ROWS))
NUM_COLUMNS = 8
REFERENCE_SEED = 2**31 - 1
_SALTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def table_rows(rows):
    """`{table name: rows}` of the job at V = `rows`."""
    return {name: size(rows) for name, _, _, size in TABLES}


def parameters(rows):
    """Trainable parameters of the model at V = `rows`."""
    embedded = EMBEDDING_DIM * sum(table_rows(rows).values())
    return embedded + (EMBEDDING_DIM * NUM_COLUMNS + 1) * 64 + 65


def _scores(ids, salt):
    """The hidden score of each id: a hash of the id, uniform in [-1, 1]."""
    mixed = (ids.astype(np.uint64) * np.uint64(salt) + np.uint64(0x165667B1)) % np.uint64(2**32)
    mixed = (mixed * np.uint64(0x27D4EB2F)) % np.uint64(2**32)
    return mixed.astype(np.float64) / 2**31 - 1.0


def _ids_and_logits(rows, examples, seed):
    rng = np.random.default_rng(seed)
    ids = np.empty((examples, NUM_COLUMNS), np.int32)
    logit = np.zeros(examples)
    for (_, first, count, size), salt in zip(TABLES, _SALTS):
        n = size(rows)
        ranks = np.minimum(rng.zipf(ZIPF_EXPONENT, (examples, count)), 10**9) - 1
        # Knuth's multiplicative hash spreads the hot ranks over the rows.
        column = (ranks.astype(np.int64) * 2654435761 + salt) % n
        ids[:, first:first + count] = column
        logit += _scores(column, salt).sum(axis=1)
    return ids, logit / np.sqrt(NUM_COLUMNS) + 0.1 * rng.standard_normal(examples)


def generate(rows, examples, seed):
    """`examples` examples of the job at V = `rows`: `(ids int32 [examples, 8], labels
    float32 [examples, 1])`, the same for the same arguments on every machine. The labels are
    balanced: the threshold is the median logit of a reference sample of the same job."""
    ids, logit = _ids_and_logits(rows, examples, seed)
    threshold = np.median(_ids_and_logits(rows, 50000, REFERENCE_SEED)[1])
    return ids, (logit > threshold).astype(np.float32)[:, None]


def unique_rows_per_batch(rows, batch_size, batches=20, seed=0):
    """Mean number of distinct rows a batch touches in each table (for the estimate of a
    rows-only exchange)."""
    ids, _ = generate(rows, batch_size * batches, seed)
    out = {}
    for name, first, count, _ in TABLES:
        per_batch = [len(np.unique(ids[b * batch_size:(b + 1) * batch_size, first:first + count]))
                     for b in range(batches)]
        out[name] = float(np.mean(per_batch))
    return out


def build_model(keras, rows):
    """The model at V = `rows`, with `keras` either Keras 3 or tf_keras (not compiled)."""
    inputs = keras.Input((NUM_COLUMNS,), dtype="int32", name="ids")
    embedded = []
    for name, first, count, size in TABLES:
        table = keras.layers.Embedding(size(rows), EMBEDDING_DIM, name=name)
        embedded.append(keras.layers.Flatten()(table(inputs[:, first:first + count])))
    x = keras.layers.Concatenate()(embedded)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def compile_model(keras, model, steps_per_execution=1):
    model.compile(optimizer=keras.optimizers.Adagrad(LEARNING_RATE),
                  loss="binary_crossentropy", metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
