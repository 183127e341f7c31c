"""State that tfdist keeps beside a Keras optimizer, saved wherever the optimizer is saved.

A strategy's own state between steps (a compressor's residuals, Stochastic Gradient Push's
push-sum weight) is not a Keras variable of the model, yet a checkpoint must hold it for a
resumed run to go on where it stopped. `SavedState` is the one mechanism for it: an object
set as an attribute of the Keras optimizer, which

* Keras files (`model.save`, `ModelCheckpoint`, `BackupAndRestore`, `save_weights`) walk like
  any other saveable of the optimizer, at `optimizer/<attribute>`; plain Keras, loading the
  same file into an optimizer without the attribute, never visits the entry;
* `tf.train.Checkpoint(model=model, optimizer=optimizer)` saves as a trackable.

The state is one byte string (`to_bytes` / `from_bytes`): its entries may change as the run
makes its variables, and a checkpoint restores the names a trackable has now.
"""

import abc
import weakref

import numpy as np
import tensorflow as tf

from tfdist import _tf_compat


class SavedState(_tf_compat.Trackable, _tf_compat.KerasSaveable, metaclass=abc.ABCMeta):
    """Base of a state saved with an optimizer: subclasses give `to_bytes`, `from_bytes`
    and `restore_missing` (a file saved without this state)."""

    @abc.abstractmethod
    def to_bytes(self):
        """The whole state as bytes."""

    @abc.abstractmethod
    def from_bytes(self, data):
        """Restores the state from `to_bytes()`'s bytes."""

    def restore_missing(self):
        """A Keras file without this state is loaded: the state goes back to its start."""

    # tf.train.Checkpoint. A SavedModel export traces this in a graph, where the state is
    # not read: empty.
    def _serialize_to_tensors(self):
        data = self.to_bytes() if tf.executing_eagerly() else b""
        return {"state": tf.constant(data)}

    def _restore_from_tensors(self, restored_tensors):
        data = restored_tensors["state"].numpy() if tf.executing_eagerly() else b""
        if data:  # (empty: a graph-mode save, nothing to restore)
            self.from_bytes(data)
        return tf.no_op()

    def _copy_trackable_to_cpu(self, object_map):
        # An asynchronous checkpoint saves a copy made now, in another thread later.
        object_map[self] = _Snapshot(self.to_bytes())

    # Keras saving (`model.save`, `save_weights`, ModelCheckpoint, BackupAndRestore).
    def _obj_type(self):
        # Keras walks a saveable's attributes for children, skipping those of a reference
        # object of a type it knows; this object has no saveable children, and "Loss" is the
        # type whose reference object is the plainest.
        return "Loss"

    def save_own_variables(self, store):
        store["state"] = np.frombuffer(self.to_bytes(), np.uint8)

    def load_own_variables(self, store):
        if "state" in store.keys():
            data = np.asarray(store["state"]).tobytes()
            if data:
                self.from_bytes(data)
        else:
            self.restore_missing()


def _bare(optimizer):
    # Keras's loading makes a bare `Optimizer` to learn which attributes to skip.
    return type(optimizer).__name__ == "Optimizer"


def attach(optimizer, attribute, state):
    """Puts `state` in the checkpoints that hold `optimizer` (a Keras optimizer, or None),
    as its attribute `attribute`. A bare `Optimizer`, which Keras's loading makes to learn
    which attributes to skip, gets none."""
    if (optimizer is not None and not _bare(optimizer)
            and getattr(optimizer, attribute, None) is not state):
        setattr(optimizer, attribute, state)


class OnUse:
    """Gives each Keras optimizer made under a strategy its state once it is put to use.

    `seen` is called for each variable made under the strategy, with the optimizer making
    it (or None). An optimizer is put to use when anything else is made under the strategy
    after it (`compile`'s metrics, a model), or when it is built on its weights: from then on
    a Keras file or a checkpoint loaded before its first step finds the state. An optimizer
    only made has no state yet, so the one Keras revives from its config, outside the
    strategy, has the same attributes (Keras's own serialization test); a bare `Optimizer`
    gets none.

    Args:
      give: called with each optimizer put to use (again for one already given its state).
    """

    def __init__(self, give):
        self._give = give
        self._unused = weakref.WeakValueDictionary()  # id -> an optimizer not yet put to use

    def seen(self, optimizer):
        if optimizer is not None and not getattr(optimizer, "built", False):
            if not _bare(optimizer):
                self._unused[id(optimizer)] = optimizer  # its constructor's own variables
            return
        for unused in list(self._unused.values()):
            self._give(unused)
        self._unused.clear()
        if optimizer is not None and not _bare(optimizer):
            self._give(optimizer)


class _Snapshot(_tf_compat.Trackable):
    """A `SavedState`'s bytes at one moment (an asynchronous checkpoint's copy)."""

    def __init__(self, data):
        self._data = data

    def _serialize_to_tensors(self):
        return {"state": tf.constant(self._data)}
