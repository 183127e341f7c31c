"""Codec state (residuals, PowerSGD's Q, DGC's momentum and warm-up step) that checkpoints.

A compressed all-reduce keeps state between steps in replica-local float32 variables, keyed
by the variables whose gradients they code. `CompressionState` holds one optimizer's share
of it, and is saved with that optimizer wherever the optimizer is saved:

* Keras files and `tf.train.Checkpoint`: the state is an attribute of the optimizer
  (`optimizer.tfdist_compression_state`), a `tfdist._saved_state.SavedState`.

Values saved before the state's variables exist (they are made when the train step is
first traced) are kept and become the variables' initial values: loading a checkpoint into a
fresh model before `fit` restores the codec state too.

Each replica's own state (residuals, momentum) is saved under its global replica number;
state that every replica holds alike (PowerSGD's Q, step counters: a compressor's
`capabilities.replicated_state`) once. Under MultiWorkerMirroredStrategy each worker saves its own
replicas; a worker restoring another's file (Keras restores every worker from the chief's)
finds the shared state there and starts its own residuals from zero.
"""

import io
import itertools
import json
import logging
import weakref

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat
from tfdist._saved_state import OnUse
from tfdist._saved_state import SavedState

log = logging.getLogger("tfdist")

ATTRIBUTE = "tfdist_compression_state"


def _key_name(key, positions):
    """The saved name of a state key (`("unit", paths, shape)` or a plain string).

    Variables are named by their place among the optimizer's trainable variables
    (`positions`), as Keras saves an optimizer's slots: a model built again in the same
    process gets new paths (`dense_1` becomes `dense_3`), not a new order.
    """
    if isinstance(key, str):
        return key
    _, paths, shape = key
    names = []
    for path in paths:
        # A part of a variable (the parameter-server path splits one by rows) is its path
        # then `@begin:end`.
        base, at, rows = path.partition("@")
        names.append((f"#{positions[base]}" if base in positions else base) + at + rows)
    return "+".join(names) + "[" + ",".join(str(d) for d in shape) + "]"


class CompressionState(SavedState):
    """One optimizer's codec state in a compressed all-reduce strategy.

    Args:
      strategy: the strategy whose replicas hold the state.
      replica_offset: the global number of this process's first replica.
      optimizer: the Keras optimizer whose gradients the state codes (its variables' order
        names them in files), or None.
    """

    def __init__(self, strategy, replica_offset=0, optimizer=None, codec=None):
        self._strategy = strategy
        self._replica_offset = replica_offset
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        self._codec = codec or {}  # the compressor's class and config, saved with the state
        self.variables = {}  # key -> {name: replica-local variable}
        self._initial = {}  # key -> make_initial
        self._replicated = {}  # key -> names every replica holds alike
        # Saved name -> value, restored for state not made yet (None: nothing restored).
        self._pending = None
        self._sync_pending = None  # per replica: 1 until replicated state was broadcast

    # Variables ------------------------------------------------------------------------------

    def get(self, key, make_initial, replicated=()):
        """`{name: per-replica components}` of `key`'s state, made from `make_initial()`
        (a dict of tensors) on first use; `replicated` names the entries every replica holds
        alike."""
        if key not in self.variables:
            self._initial[key] = make_initial
            self._replicated[key] = frozenset(replicated)
            with tf.init_scope(), self._strategy.scope():
                initial = make_initial()
                self.variables[key] = {
                    name: tf.Variable(value, trainable=False, name=f"tfdist_{name}",
                                      synchronization=tf.VariableSynchronization.ON_READ,
                                      aggregation=tf.VariableAggregation.NONE)
                    for name, value in initial.items()}
                if self._pending is not None:
                    self._assign(key, self._pending)
        local = self._strategy.experimental_local_results
        return {name: local(v) for name, v in self.variables[key].items()}

    def reset(self):
        """Sets every state back to its value before the first step (residuals to zero)."""
        self._pending = None
        for key in self.variables:
            self._assign(key, {})
        self._mark_unsynchronized()

    @property
    def replica_offset(self):
        """The global number of this process's first replica."""
        return self._replica_offset

    def replicated(self, key):
        """The names of `key`'s state that every replica holds alike."""
        return self._replicated[key]

    def sync_flags(self):
        """Per local replica, an int64 flag that is 1 from the state's start, a restore or a
        reset until the exchange has made the replicated state the same on every worker
        (not saved: a restored state is one to check)."""
        if self._sync_pending is None:
            with tf.init_scope(), self._strategy.scope():
                self._sync_pending = tf.Variable(
                    tf.ones([], tf.int64), trainable=False, name="tfdist_sync_pending",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.NONE)
        return self._strategy.experimental_local_results(self._sync_pending)

    def _mark_unsynchronized(self):
        if self._sync_pending is not None:
            with tf.init_scope():
                for component in self._strategy.experimental_local_results(
                        self._sync_pending):
                    component.assign(1)

    # Saving ---------------------------------------------------------------------------------

    def _positions(self):
        optimizer = None if self._optimizer is None else self._optimizer()
        variables = _tf_compat.keras_optimizer_trained_variables(optimizer)
        paths = [getattr(v, "path", None) or v.name.split(":")[0] for v in variables]
        return {path: i for i, path in enumerate(unique_names(paths))}

    def _saved_name(self, key, name, replica=None, positions=None):
        base = f"{_key_name(key, self._positions() if positions is None else positions)}/{name}"
        return base if replica is None else f"{base}/replica_{replica}"

    def values(self):
        """`{saved name: numpy value}` of this process's state (and of values restored
        for state not made yet)."""
        if self._pending and self.variables:
            self._drop_unmatched()
        values = dict(self._pending or {})
        positions = self._positions()
        for key, variables in self.variables.items():
            for name, variable in variables.items():
                components = self._strategy.experimental_local_results(variable)
                if name in self._replicated[key]:
                    values[self._saved_name(key, name, None, positions)] = (
                        components[0].numpy())
                    continue
                for r, component in enumerate(components):
                    values[self._saved_name(key, name, self._replica_offset + r,
                                            positions)] = component.numpy()
        return values

    def _drop_unmatched(self):
        """Once the model's state is made, restored entries that fit none of it (a model or
        a ps layout other than the one saved: the push units of the parameter-server path
        are named by the variables and rows each ps task holds) are said and dropped, not
        carried into every later file; the state they would have filled started over."""
        names = sorted(self._pending)
        log.warning("tfdist: %d restored compression state entr%s fit no state of this model "
                    "(saved for another model, or another number of ps tasks: %s%s); that "
                    "state started over, and the entries are dropped", len(names),
                    "y" if len(names) == 1 else "ies", ", ".join(names[:3]),
                    ", ..." if len(names) > 3 else "")
        self._pending = {}

    def restore(self, values, codec=None):
        """Replaces the state with saved `values` (from `values()`): state that exists takes
        its saved value, or its start where the file has none for this replica; state made
        later takes its saved value then. Values of other replicas are dropped, and so is
        everything saved under another compressor (`codec`: its class and config)."""
        if codec is not None and self._codec and codec != self._codec:
            log.warning("tfdist: the compression state in this file was saved with %s, this "
                        "strategy compresses with %s: not restored (the state starts over)",
                        codec, self._codec)
            values = {}
        mine = {f"/replica_{self._replica_offset + r}"
                for r in range(len(self._strategy.extended.worker_devices))}
        values = {name: value for name, value in values.items()
                  if "/replica_" not in name or name[name.rindex("/replica_"):] in mine}
        self._pending = dict(values)
        for key in self.variables:
            self._assign(key, values)
        self._mark_unsynchronized()

    def _assign(self, key, values):
        """Sets `key`'s state to its entries in `values`, or to its start; the entries used
        leave `self._pending`."""
        positions = self._positions()
        values = dict(values)  # (it may be `self._pending`, which loses what is used)
        with tf.init_scope():
            initial = self._initial[key]()
        for name, variable in self.variables[key].items():
            components = self._strategy.experimental_local_results(variable)
            for r, component in enumerate(components):
                saved = self._saved_name(
                    key, name, None if name in self._replicated[key] else self._replica_offset + r,
                    positions)
                value = values.get(saved)
                if self._pending is not None:
                    self._pending.pop(saved, None)
                if value is not None and tuple(np.shape(value)) != tuple(component.shape):
                    log.warning("tfdist: compression state %r was saved with shape %s, the "
                                "model's is %s: not restored", saved, np.shape(value),
                                tuple(component.shape))
                    value = None
                with tf.init_scope():
                    component.assign(initial[name] if value is None else
                                     np.asarray(value).astype(component.dtype.as_numpy_dtype))

    def to_bytes(self):
        buffer = io.BytesIO()
        values = self.values()
        names = sorted(values)
        np.savez(buffer, names=np.array(json.dumps(names)),
                 codec=np.array(json.dumps(self._codec, sort_keys=True)),
                 **{str(i): values[name] for i, name in enumerate(names)})
        return buffer.getvalue()

    def from_bytes(self, data):
        """Restores from `to_bytes()`."""
        with np.load(io.BytesIO(data)) as arrays:
            names = json.loads(str(arrays["names"]))
            codec = json.loads(str(arrays["codec"])) if "codec" in arrays else None
            self.restore({name: arrays[str(i)] for i, name in enumerate(names)}, codec)

    def restore_missing(self):
        # A file saved without codec state: the weights are not the residuals' own.
        self.restore({})


def state_of(optimizer, strategy, replica_offset=0, codec=None):
    """The `CompressionState` of `optimizer` (made and attached on first use)."""
    state = getattr(optimizer, ATTRIBUTE, None)
    if state is None:
        state = CompressionState(strategy, replica_offset, optimizer, codec)
        setattr(optimizer, ATTRIBUTE, state)
    return state


class StateRegistry:
    """The codec states of the optimizers made under one strategy, in order of creation.

    A state lives as long as its optimizer (the registry holds it weakly).

    Args:
      strategy: the container strategy.
      compressor: the strategy's compressor (its class and config are saved with the state).
      replica_offset: a function returning the global number of this process's first
        replica (known once the strategy has joined its cluster).
    """

    def __init__(self, strategy, compressor, replica_offset):
        self._strategy = weakref.ref(strategy)
        self._codec = json.loads(json.dumps(
            {"class": type(compressor).__name__, "config": compressor.get_config()}))
        self._replica_offset = replica_offset
        self._states = weakref.WeakValueDictionary()
        self._count = itertools.count()
        self._default = None
        self._on_use = OnUse(self.state_of)

    def state_of(self, optimizer):
        """The state of `optimizer` (None: one state of the strategy's own)."""
        if optimizer is None:
            if self._default is None:
                self._default = CompressionState(self._strategy(), self._replica_offset(),
                                                 None, self._codec)
                self._states[next(self._count)] = self._default
            return self._default
        state = state_of(optimizer, self._strategy(), self._replica_offset(), self._codec)
        if state not in self._states.values():
            self._states[next(self._count)] = state
        return state

    def attach(self, optimizer):
        """Called for each variable made under the strategy (`optimizer`: the one making it,
        or None): gives the optimizers made under it their state once they are put to use
        (`tfdist._saved_state.OnUse`)."""
        self._on_use.seen(optimizer)

    def states(self):
        """The states that hold state (a LossScaleOptimizer's own holds none: its inner
        optimizer's gradients are coded)."""
        states = [self._states.get(i) for i in sorted(self._states.keys())]
        return [s for s in states if s is not None and (s.variables or s.values())]

    def reset(self):
        for state in self.states():
            state.reset()


def unique_names(names):
    """`names`, with `#1`, `#2`... after repeats (state is keyed by them)."""
    seen, out = {}, []
    for name in names:
        count = seen.get(name, 0)
        seen[name] = count + 1
        out.append(f"{name}#{count}" if count else name)
    return out
