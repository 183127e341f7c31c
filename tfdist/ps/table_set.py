"""A worker's embedding tables kept on the ps tasks: which variables they are, and their life.

`TableRule` is what the strategies' `embedding_tables` and `embedding_updates` arguments say;
`TableSet` is the engine's collaborator for the tables of one worker (`tfdist.ps.worker`):
it makes a `tfdist.ps.tables.TableVariable` for each variable the rule names (and for each
optimizer slot of one), has the chief write their initial values on the ps tasks before a
step looks rows up, checks that no step reads one whole, and gives each ps task's spec the
entries of the parts it holds.
"""

import time

import tensorflow as tf

from tfdist import _tf_compat
from tfdist.ps import placement
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.spec import RunError
from tfdist.ps.spec import VariableEntry
from tfdist.ps.tables import TableVariable
from tfdist.ps.tables import check_step_reads
from tfdist.ps.variables import Part

AUTO = "auto"
UPDATES = ("lazy", "dense")
_SHOWN = 10  # candidate paths an unmatched pattern's error lists


class TableRule:
    """Which variables a parameter-server strategy keeps on the ps tasks only, and how the ps
    updates their rows (the strategies' `embedding_tables` and `embedding_updates`).

    Args:
      embedding_tables: "auto" (the `embeddings` of every `keras.layers.Embedding`), None
        (none: every worker mirrors every variable), or a list of Keras path patterns
        (`fnmatch`, e.g. `["*/user_table/embeddings"]`): the trainable float variables of
        rank 2 or more whose path matches.
      embedding_updates: "lazy" (only the rows a step touched, with their slots: exact for
        SGD without momentum and Adagrad, TF1's `LazyAdamOptimizer` rule for Adam, momentum
        and the like) or "dense" (every row every step, as Keras updates a variable: exact for
        every optimizer, at the cost of the whole table per update).
    """

    def __init__(self, embedding_tables=AUTO, embedding_updates="lazy"):
        if embedding_tables is not None and embedding_tables != AUTO and not (
                isinstance(embedding_tables, (list, tuple))
                and all(isinstance(p, str) for p in embedding_tables)):
            raise ValueError(
                "`embedding_tables` must be 'auto' (the tables of `keras.layers.Embedding`), "
                "None (no table: every worker mirrors every variable) or a list of Keras "
                f"variable path patterns. Received: {embedding_tables!r}")
        if embedding_updates not in UPDATES:
            raise ValueError(f"`embedding_updates` must be one of {list(UPDATES)}. "
                             f"Received: {embedding_updates!r}")
        self.embedding_tables = embedding_tables
        self.updates = embedding_updates
        self._matched = set()    # the patterns that matched a variable
        # The first paths of the variables a pattern could have matched (for the error; kept
        # bounded: a scope may build many models).
        self._candidates = {}

    def __bool__(self):
        return self.embedding_tables is not None

    def matches(self, path, layer, shape, dtype, trainable):
        """Whether the variable at `path`, made by `layer` (a Keras layer or None), is a
        table."""
        import fnmatch

        import keras

        if self.embedding_tables is None or not trainable or len(shape) < 2:
            return False
        if not tf.as_dtype(dtype).is_floating:
            return False
        if self.embedding_tables == AUTO:
            return isinstance(layer, keras.layers.Embedding) and path.endswith("/embeddings")
        if len(self._candidates) <= _SHOWN:
            self._candidates[path] = None
        matched = {p for p in self.embedding_tables if fnmatch.fnmatchcase(path, p)}
        self._matched |= matched
        return bool(matched)

    def check_patterns(self):
        """Raises a ValueError naming each pattern of `embedding_tables` that matched no
        variable of the model (a typo would otherwise leave a table on every worker without a
        word); nothing for "auto" or None."""
        if self.embedding_tables in (None, AUTO):
            return
        unmatched = [p for p in self.embedding_tables if p not in self._matched]
        if unmatched:
            shown = list(self._candidates)[:_SHOWN] + (
                ["..."] if len(self._candidates) > _SHOWN else [])
            raise ValueError(
                f"`embedding_tables` patterns {unmatched} match no variable of the model. "
                "A pattern (`fnmatch`, where `*` also matches `/`) names the Keras paths of "
                "trainable float variables of rank 2 or more; this model's are: "
                f"{shown or 'none'}. Received: embedding_tables={self.embedding_tables!r}")


class TableSet:
    """The embedding tables of a worker's model (and their optimizer slots).

    Args:
      rule: the `TableRule`.
      connection: the worker's `tfdist.ps.connection.PSConnection`.
      init_timeout: seconds a worker waits for the chief to write the tables.
      partitioner: the strategy's `variable_partitioner` (`placement.check_partitioner`),
        which splits tables as it splits other variables (`parts_of`).
    """

    def __init__(self, rule, connection, init_timeout, partitioner=placement.AUTO):
        self.rule = rule
        self.connection = connection
        self.init_timeout = init_timeout
        self.partitioner = partitioner
        # The bytes of tables' rows (and their slots) each ps task holds so far: a table
        # goes to the least loaded ones (`parts_of`).
        self._held = None
        self.tables = []   # looked up by the model, trained on the ps
        self.slots = []    # the optimizer's state of a table: beside its rows
        self.parts = None  # per ps task, the `Part`s of the tables it holds, once joined
        self._ready = False

    @property
    def updates(self):
        return self.rule.updates

    def all(self):
        return self.tables + self.slots

    def make(self, kwargs, new_path):
        """A `TableVariable` for the variable being made with `kwargs` if the rule names it (or
        if it is an optimizer's slot of a table), else None. Its initial value is never made
        on this worker. `new_path()` gives the variable's Keras path."""
        if not self.rule:
            return None
        keras_variable, shape, dtype = self._being_made(kwargs)
        if keras_variable is None:
            return None
        colocate_with = kwargs.get("colocate_with")
        if isinstance(colocate_with, TableVariable):
            # An optimizer's slot of a table: rows beside the table's, never on a worker.
            path = new_path()
            shards = colocate_with._tfdist_shards
            self._hold(shards, shape, dtype)
            role = protocol.OPTIMIZER
        elif self._named(keras_variable, shape, dtype, kwargs):
            path = new_path()
            shards = self.parts_of(path, shape, dtype)
            role = protocol.TABLE
        else:
            return None
        table = TableVariable.create(
            path, shape, dtype, [(self.connection.ps_devices[s], rows) for s, rows in shards],
            initial_value=kwargs.get("initial_value"), trainable=role == protocol.TABLE,
            name=path.rpartition("/")[2])
        table._tfdist_role = role
        table._tfdist_shards = tuple(shards)
        # Keras's `ops.take` gathers from the Keras variable: through the table's lookup.
        keras_variable.sparse_read = table.sparse_read
        if not self.connection.is_chief:
            table.follow()  # the chief writes the tables (a restore, `load_weights`)
        table.before_read = self.ready
        (self.tables if role == protocol.TABLE else self.slots).append(table)
        self._ready = False
        return table

    def parts_of(self, path, shape, dtype):
        """`[(ps index, (begin, end))]`: where the parts of a new table go.

        With "auto", as TF's `MinSizePartitioner` of 256 KiB (TF's recommended minimum
        shard, which users of its `ParameterServerStrategy` give it): parts of at least
        256 KiB, one per ps task at most, so a table of less than 512 KiB stays whole (each
        part costs a step one lookup message to its ps task: splitting a small table
        balances nothing and adds messages). A partitioner decides per table, as for other
        variables (`tfdist.ps.placement`); None keeps every table whole. A table is placed
        when it is made, before the optimizer is known (`check_table_updates` refuses one
        that cannot update a split table). The parts go to the ps tasks holding the fewest
        table bytes so far (slots included), the first part to the least loaded; every
        worker builds the same model in the same order, so places its tables alike.
        """
        num_ps = self.connection.num_ps
        item = placement.Item(path, shape, dtype)
        partitioner = self.partitioner
        if partitioner == placement.AUTO:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=placement.AUTO_MIN_SHARD_BYTES, max_shards=num_ps)
        parts = placement.parts_wanted(item, num_ps, partitioner,
                                       placement.AUTO_MIN_SHARD_BYTES)
        held = self.held()
        tasks = sorted(range(num_ps), key=lambda t: (held[t], t))[:parts]
        shards = list(zip(tasks, placement.row_splits(shape[0], parts)))
        self._hold(shards, shape, dtype)
        return shards

    def _hold(self, shards, shape, dtype):
        """Counts the rows `shards` (`[(ps index, (begin, end))]`) of a variable of `shape`
        and `dtype` as held by their ps tasks."""
        if self._held is None:
            self._held = [0] * self.connection.num_ps
        size = placement.nbytes(shape, dtype)
        for task, (begin, end) in shards:
            self._held[task] += size * (end - begin) // shape[0]

    def held(self):
        """The bytes of the tables' rows and their slots on each ps task (the placement of
        the other variables starts from them)."""
        return list(self._held or [0] * self.connection.num_ps)

    @staticmethod
    def _being_made(kwargs):
        """`(Keras variable, shape, dtype)` of the variable being made (None, None, None if
        it is no Keras variable of a declared shape)."""
        keras_variable = _tf_compat.keras_variable_being_initialized()
        # (A Keras variable made from a value learns its shape after its storage is made:
        # the optimizer's step counter. A table is made from an initializer.)
        shape = _tf_compat.keras_variable_declared_shape(keras_variable)
        if keras_variable is None or shape is None:
            return None, None, None
        return (keras_variable, [int(n) for n in shape],
                tf.as_dtype(kwargs.get("dtype") or keras_variable.dtype))

    def _named(self, keras_variable, shape, dtype, kwargs):
        return self.rule.matches(keras_variable.path, _tf_compat.keras_layer_in_scope(), shape,
                                 dtype, kwargs.get("trainable", True))

    def names(self, kwargs):
        """Whether the rule names the variable being made with `kwargs` a table (model
        averaging keeps it on the workers and averages it by rows, `tfdist.ps.averaged_rows`).
        """
        if not self.rule:
            return False
        keras_variable, shape, dtype = self._being_made(kwargs)
        return keras_variable is not None and self._named(keras_variable, shape, dtype, kwargs)

    def ready(self):
        """Before a step looks rows up (or a whole read): the chief writes the tables' initial
        values on the ps tasks where nothing is there yet; another worker waits until it has."""
        if self._ready or not self.tables:
            return
        tables = self.all()
        with tf.init_scope():
            if self.connection.is_chief:
                for table in tables:
                    table.initialize()
            else:
                deadline = time.monotonic() + self.init_timeout
                while not all(table.is_initialized() for table in tables):
                    if time.monotonic() > deadline:
                        raise RunError(
                            f"the chief {self.connection.training_tasks[0]} did not write the "
                            f"embedding tables {[t._tfdist_path for t in self.tables]} on the "
                            f"ps tasks within {self.init_timeout:g} s (`init_timeout`): is "
                            "it running, with the same model?")
                    time.sleep(0.05)
        self._ready = True

    def check_step(self):
        """After a step was traced: no table was read whole in it."""
        check_step_reads(self.tables)

    def initialize(self):
        """A new run, on the chief: every part takes its table's initial value (the value
        the chief wrote before the run, a loaded file or a restored backup; else the
        initializer's), whatever an earlier run left on the ps tasks."""
        for table in self.all():
            table.initialize(force=True)

    def claim(self, runs):
        """A new run, on its chief, before `initialize` writes it: every part is marked as
        the run's (`runs`: the run on each ps task), so that a worker still reading an
        earlier run's table sees the change before any row changes."""
        by_part = self._by_part(runs)
        for table in self.all():
            table.claim(by_part)

    def joined(self, initialized, runs):
        """The worker joined a run (`initialized`: a new one, which `initialize` wrote;
        `runs`: the run on each ps task, which a whole read of a part checks it belongs to).
        """
        by_part = self._by_part(runs)
        for table in self.all():
            table.joined(initialized, by_part)

    def _by_part(self, runs):
        return {id(master): runs[shard]
                for shard, masters in enumerate(self.part_masters(len(runs)))
                for master in masters}

    def add_entries(self, entries, fields):
        """Joining a run: appends each part's spec entry to its ps task's `entries`
        (`fields`: what the push adds per variable id), and lists the parts each push
        carries rows for."""
        self.parts = [[] for _ in entries]
        for table in self.all():
            entry = {"path": table._tfdist_path, "dtype": table.dtype.name,
                     "role": table._tfdist_role, "table": True, **fields.get(id(table), {})}
            for shard, rows in table._tfdist_shards:
                part = Part(table, rows)
                entries[shard].append(VariableEntry(**{**entry, "shape": part.shape,
                                                       "rows": rows}))
                if table._tfdist_role == protocol.TABLE:
                    self.parts[shard].append(part)

    def take_lookups(self):
        """`{id(table): the rows its lookups read}` of the step being traced, for the tables
        that keep them (`TableVariable.record_lookups`); once per push."""
        return {id(table): table.take_lookups() for table in self.tables
                if table._tfdist_record_lookups}

    def pushed_rows(self, shard, layout, gradient_of, lookups):
        """What a push to ps task `shard` (laid out as `layout`) carries of its tables: per
        part, `(rows, flat row values)` of its gradient (`gradient_of(part)`), then, where
        the entry has `read_rows`, the same of the rows the step read (`lookups`, from
        `take_lookups`)."""
        out = []
        for part, entry in zip(self.parts[shard], layout.tables):
            out += wire.sparse_rows(gradient_of(part), entry)
            if entry.read_rows:
                out += wire.sparse_rows(part.take(lookups[id(part.variable)]), entry)
        return out

    def part_masters(self, num_ps):
        """Per ps task, the masters of the table parts it holds."""
        out = [[] for _ in range(num_ps)]
        for table in self.all():
            shards = {tuple(rows): shard for shard, rows in table._tfdist_shards}
            for master, rows in table.parts:
                out[shards[tuple(rows)]].append(master)
        return out

    def places(self):
        """`(table, ps index, rows)` of every part (rows None: the table is whole there)."""
        return [(table, shard, rows if len(table._tfdist_shards) > 1 else None)
                for table in self.all() for shard, rows in table._tfdist_shards]
