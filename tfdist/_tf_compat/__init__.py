"""Every TensorFlow / Keras private API tfdist cannot avoid, in one place.

The public `tf.distribute` API has no way to write a new strategy, and Keras 3 exposes no
hook for where its optimizer lives. Each import and function in this package says why it is
needed and what it was checked against, so that the next TensorFlow or Keras upgrade touches
this package only (`tests/tf_compat_test.py` fails on a private name anywhere else in
`tfdist/`, and runs each function against the installed versions). The rest of tfdist uses
these names as `_tf_compat.NAME`, re-exported here from the module that holds them:

- `distribute`: TF's strategy engines (`OneDeviceExtended`, `MirroredExtended`,
  `CollectiveAllReduceExtended`), their private state, and their collectives in loops;
- `runtime`: TF's resource variables, checkpoint saveables, eager context, remote sessions,
  `tf.data` datasets and iterators (and Keras's saveable base);
- `keras_state`: Keras optimizers' and variables' private attributes, variable paths;
- `keras_calls`: what Keras is doing now (open name scopes, stack frames, the model's step,
  its whole-model reads).
"""

# ruff: noqa: F401  (this module only re-exports its submodules' names)

from tfdist._tf_compat.distribute import CollectiveAllReduceExtended
from tfdist._tf_compat.distribute import Mirrored
from tfdist._tf_compat.distribute import MirroredExtended
from tfdist._tf_compat.distribute import OneDeviceExtended
from tfdist._tf_compat.distribute import OneDeviceReplicaContext
from tfdist._tf_compat.distribute import PerReplica
from tfdist._tf_compat.distribute import container_strategy
from tfdist._tf_compat.distribute import cross_device_ops
from tfdist._tf_compat.distribute import in_xla_context
from tfdist._tf_compat.distribute import inside_while_loop
from tfdist._tf_compat.distribute import one_device
from tfdist._tf_compat.distribute import regroup
from tfdist._tf_compat.distribute import use_trace_time_instance_keys_in_loops
from tfdist._tf_compat.distribute import worker_index_in_cluster
from tfdist._tf_compat.keras_calls import keras_builds_from_a_batch
from tfdist._tf_compat.keras_calls import keras_gradient_all_reduce
from tfdist._tf_compat.keras_calls import keras_layer_in_scope
from tfdist._tf_compat.keras_calls import keras_model_of_step
from tfdist._tf_compat.keras_calls import keras_optimizer_in_scope
from tfdist._tf_compat.keras_calls import keras_own_train_step
from tfdist._tf_compat.keras_calls import keras_whole_model_reads
from tfdist._tf_compat.keras_state import keras_initializer_fans
from tfdist._tf_compat.keras_state import keras_initializer_of
from tfdist._tf_compat.keras_state import keras_name_scope_for_path
from tfdist._tf_compat.keras_state import keras_optimizer_apply_weight_decay
from tfdist._tf_compat.keras_state import keras_optimizer_decays
from tfdist._tf_compat.keras_state import keras_optimizer_knows
from tfdist._tf_compat.keras_state import keras_optimizer_learning_rate
from tfdist._tf_compat.keras_state import keras_optimizer_makes_learning_rate
from tfdist._tf_compat.keras_state import keras_optimizer_slot
from tfdist._tf_compat.keras_state import keras_optimizer_step_storage
from tfdist._tf_compat.keras_state import keras_optimizer_trained_variables
from tfdist._tf_compat.keras_state import keras_update_step_arguments
from tfdist._tf_compat.keras_state import keras_variable_being_initialized
from tfdist._tf_compat.keras_state import keras_variable_declared_shape
from tfdist._tf_compat.keras_state import keras_variable_path
from tfdist._tf_compat.keras_state import keras_variable_paths
from tfdist._tf_compat.keras_state import keras_variable_storage
from tfdist._tf_compat.runtime import VARIABLE_VALUE_KEY
from tfdist._tf_compat.runtime import BaseResourceVariable
from tfdist._tf_compat.runtime import DatasetAsIs
from tfdist._tf_compat.runtime import HandingOverIterator
from tfdist._tf_compat.runtime import KerasSaveable
from tfdist._tf_compat.runtime import ResourceVariable
from tfdist._tf_compat.runtime import ResourceVariableSaveable
from tfdist._tf_compat.runtime import Trackable
from tfdist._tf_compat.runtime import create_remote_session
from tfdist._tf_compat.runtime import discard_remote_session
from tfdist._tf_compat.runtime import set_handle_shape_and_dtype
from tfdist._tf_compat.runtime import start_eager_context
from tfdist._tf_compat.runtime import variable_accessed
