"""TensorFlow's private runtime names: resource variables around shared handles, what a
checkpoint saves, the eager context, remote sessions.

tfdist's master variables are resource variables around handles opened by shared name on a
ps task, its mirrors and tables subclasses of TF's variable classes, its codec state an
object that TF's checkpoints and Keras's saving walk into; a liveness probe drives a remote
session by hand. Part of `tfdist._tf_compat`, which re-exports every name here.
"""

# Model averaging's outer optimizer state, like codec state, saves itself with its
# optimizer (an attribute, which Keras saving walks; Keras exports no public name for it).
# Codec state saves itself with its optimizer: the class Keras's saving walks into (and,
# below, the base class whose `_serialize_to_tensors` a `tf.train.Checkpoint` calls). Its
# variables are made while a step is traced, maybe after a checkpoint was restored, so it
# saves itself as one entry rather than as variables.
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: F401

# A between-graph worker's `fit` reads a `tf.data.Dataset` whose iterators are destroyed on a
# thread of their own (`tfdist._worker.WorkerDataset`): a dataset class (Keras takes a
# dataset by the names of its classes, `DatasetV2` among them, and AutoGraph loops over one
# in-graph), and an iterator class that hands its state over as it dies.
from tensorflow.python.data.ops.dataset_ops import UnaryUnchangedStructureDataset  # noqa: F401
from tensorflow.python.data.ops.iterator_ops import OwnedIterator  # noqa: F401
from tensorflow.python.framework import ops as _ops  # noqa: F401

# A master variable is a resource variable around a handle that every worker opens by shared
# name on a ps task; only the private base class accepts an existing handle.
from tensorflow.python.ops import handle_data_util  # noqa: F401
from tensorflow.python.ops import resource_variable_ops  # noqa: F401
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable  # noqa: F401

# A worker's mirror of a master variable is a local resource variable whose eager reads and
# writes outside a step go to the master: a subclass of the concrete class.
from tensorflow.python.ops.resource_variable_ops import ResourceVariable  # noqa: F401

# (Codec state, as above: what `tf.train.Checkpoint` saves.)
from tensorflow.python.trackable.base import VARIABLE_VALUE_KEY  # noqa: F401
from tensorflow.python.trackable.base import Trackable  # noqa: F401

# A table kept on the ps saves itself as slices of its parts (`tfdist.ps.tables`), as TF's
# own `ShardedVariable` does, through the saveable of a resource variable.
from tensorflow.python.training.saving.saveable_object_util import ResourceVariableSaveable  # noqa: F401


def set_handle_shape_and_dtype(handle, shape, dtype):
    """Gives a raw `VarHandleOp` handle the shape metadata a `tf.Variable` needs.

    Without it Keras fails on "unknown rank" (DESIGN.md, checked by hand).
    """
    import tensorflow as tf

    handle_data = handle_data_util.create_handle_data(tf.TensorShape(shape), tf.as_dtype(dtype))
    resource_variable_ops._set_handle_shapes_and_types(  # pylint: disable=protected-access
        handle, handle_data, graph_mode=not tf.executing_eagerly())


def variable_accessed(variable):
    """Records a read of `variable` on the tapes and the `tf.function` being traced, as
    TF's own variables do in their reads: a table kept on the ps reads its parts' handles
    itself, and a gradient tape must still watch the table (checked on TF 2.21)."""
    resource_variable_ops.variable_accessed(variable)


def start_eager_context():
    """Starts this process's eager context now (with it, the server of a cluster it was
    connected to), which TensorFlow otherwise starts at the first op."""
    from tensorflow.python.eager import context

    context.context().ensure_initialized()


def create_remote_session(session):
    """Creates `session` (a `tf.compat.v1.Session` on a `grpc://` target) on its server now.

    A session on a remote server is created there (a CreateSession RPC, with the session's
    `operation_timeout_in_ms`) by its first run. The liveness probe
    (`tfdist.cluster.probe.ServerProbe`) creates it without running anything, so that no op
    of the probed process needs a thread; TF's `Session` has only this private method for it
    (checked on TF 2.21).
    """
    session._extend_graph()  # pylint: disable=protected-access


def discard_remote_session(session):
    """Drops `session` without the CloseSession RPC that closing it sends.

    For a session whose server is gone, or restarted and no longer knows it: the RPC would
    take its whole deadline to fail (retries of a refused connection) or would be useless.
    `Session.close` and `__del__` skip the RPC of a session marked closed; `__del__` still
    frees it in this process (checked on TF 2.21).
    """
    session._closed = True  # pylint: disable=protected-access



class DatasetAsIs(UnaryUnchangedStructureDataset):
    """A `tf.data.Dataset` that is `dataset` as it is (the same graph), for a subclass to
    change how it is iterated. TF builds its own unary datasets so (checked on TF 2.21)."""

    def __init__(self, dataset):
        super().__init__(dataset, dataset._variant_tensor)  # pylint: disable=protected-access


class HandingOverIterator(OwnedIterator):
    """An eager iterator of `dataset` that, as it dies, gives what keeps its TensorFlow
    iterator alive (its resource tensor, and the dataset whose Python functions the
    iterator's threads may call) to `hand_over(state)`: the resource is destroyed where the
    last reference to them goes.

    `OwnedIterator` keeps them as private attributes, and `__del__` runs before the dying
    object's attributes are released (checked on TF 2.21)."""

    def __init__(self, dataset, hand_over):
        self._hand_over = hand_over
        with _ops.colocate_with(dataset._variant_tensor):  # as `Dataset.__iter__` does
            super().__init__(dataset)

    def __del__(self):
        resource = self.__dict__.pop("_iterator_resource", None)
        dataset = self.__dict__.pop("_dataset", None)
        if resource is not None:
            self._hand_over((resource, dataset))
