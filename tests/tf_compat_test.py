"""TensorFlow's and Keras's private names are used in the package `tfdist/_tf_compat/` only,
so that an upgrade of either touches that package alone (issue 23); and each of its functions
still reaches what it names in the installed TensorFlow and Keras, or fails here naming
itself."""

import ast
import inspect
import os
import pathlib
import re

import keras
import numpy as np
import tensorflow as tf
from keras.saving import save_model as save_model_imported_early

import tfdist
from tfdist import _tf_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfdist"
TESTS = ROOT.parent / "tests"
COMPAT = ROOT / "_tf_compat"  # the one place private names may appear
# Private modules, and the private attributes of Keras optimizers and variables that the
# engines read (through `_tf_compat`'s functions).
PRIVATE = re.compile(
    r"\b(from|import) (tensorflow\.python|keras\.src)\b"
    r"|\._(trainable_variables|use_weight_decay|get_variable_index|apply_weight_decay"
    r"|iterations)\b"
    r"|[\"'](_value|_shape|_trainable_variables|_iterations)[\"']")
# Private names of the standard library that are its public API.
# (`threading._shutdown`, `atexit._run_exitfuncs`: what the interpreter runs at its end, for
# a task forked by `tfdist.launch.preload`, which ends with os._exit.)
STANDARD = {("os", "_exit"), ("threading", "_shutdown"), ("atexit", "_run_exitfuncs")}


def _is_super(node):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _outside_compat():
    """The modules of `tfdist/` outside `tfdist/_tf_compat/`."""
    compat = sorted(COMPAT.rglob("*.py"))
    assert compat, f"{COMPAT} holds no module"
    return [path for path in sorted(ROOT.rglob("*.py")) if path not in compat]


def private_names_outside(sources):
    """`["file:line: name"]` of the private attributes that `sources` (`{file: text}`) read
    from objects not their own: a name tfdist neither assigns nor defines anywhere (a TF or
    Keras object's), read on any object; or a TF hook a tfdist class overrides (`_update`),
    called on anything but `super()` (TF's implementation, which the override extends)."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    own, overrides = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)  # (a class attribute)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
                if any(isinstance(n, ast.Attribute) and n.attr == node.name
                       and _is_super(n.value) for n in ast.walk(node)):
                    overrides.add(node.name)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                own.add(node.args[1].value)
    own -= overrides
    found = []

    class Reads(ast.NodeVisitor):
        def __init__(self, path):
            self.path = path

        def read(self, node, obj, name):
            if not _private(name) or name in own or name.startswith("_tfdist"):
                return
            if isinstance(obj, ast.Name) and (obj.id, name) in STANDARD:
                return
            if name in overrides and _is_super(obj):
                return  # TF's hook, which a tfdist class extends (and which must exist)
            found.append(f"{self.path}:{node.lineno}: {name}")

        def visit_Attribute(self, node):
            self.read(node, node.value, node.attr)
            self.generic_visit(node)

        def visit_Call(self, node):
            if (getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                self.read(node, node.args[0], node.args[1].value)
            self.generic_visit(node)

    for path, tree in trees.items():
        Reads(path).visit(tree)
    return found


class PrivateNamesTest(tf.test.TestCase):

    def test_private_tf_and_keras_names_only_in_tf_compat(self):
        found = []
        for path in _outside_compat():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line):
                    found.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
        self.assertEmpty(found, "private TF / Keras names outside tfdist/_tf_compat/ "
                                "(add a function there):\n" + "\n".join(found))
        # The package itself is scanned the same way, and is where they are.
        inside = [path for path in sorted(COMPAT.rglob("*.py"))
                  if PRIVATE.search(path.read_text())]
        self.assertNotEmpty(inside)

    def test_no_private_attribute_of_a_tf_or_keras_object_outside_tf_compat(self):
        sources = {str(path.relative_to(ROOT.parent)): path.read_text()
                   for path in _outside_compat()}
        found = private_names_outside(sources)
        self.assertEmpty(found, "private attributes of TF / Keras objects outside "
                                "tfdist/_tf_compat/ (add a function there):\n"
                         + "\n".join(found))

    def test_the_scan_finds_what_it_is_for(self):
        planted = '''
class Extended(Base):
    def __init__(self):
        self._exchange = None
    def _update(self, var, fn, args):
        self._exchange = var._update(fn)           # a TF hook on another object
        return super()._update(var, fn, args)      # its own override's parent: fine
    def offset(self):
        index = getattr(self, "_id_in_cluster", 0)  # TF's, not tfdist's
        return self._container_strategy(), index, self._exchange, os._exit
    def other(self, strategy):
        return strategy.extended._update(1, 2, 3)  # a TF hook on another object
'''
        self.assertEqual(private_names_outside({"x.py": planted}),
                         ["x.py:6: _update", "x.py:9: _id_in_cluster",
                          "x.py:10: _container_strategy", "x.py:12: _update"])
        self.assertEmpty(private_names_outside({"y.py": "class A:\n    _count = 0\n"
                                                        "    def f(self):\n"
                                                        "        return self._count\n"}))

    def test_every_tf_hook_tfdist_overrides_is_still_there(self):
        # A tfdist strategy extends TF's by overriding its private hooks (`_update`,
        # `_batch_reduce_to`, ...): a TF that renames one would leave the override uncalled.
        # The overrides that call their parent are found in the source; those that do not
        # are declared (`DECLARED_HOOKS`), and any other private method of a tfdist class
        # that a TF / Keras base class also has must be declared there too.
        overrides = {name: set() for name in DECLARED_HOOKS}
        for path in sorted(ROOT.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and any(
                        isinstance(n, ast.Attribute) and n.attr == node.name
                        and _is_super(n.value) and _private(node.name)
                        for n in ast.walk(node)):
                    overrides.setdefault(node.name, set()).add(path)
        missing, undeclared, checked = [], [], set()
        for cls in _tfdist_classes():
            foreign = [c for c in cls.__mro__
                       if not c.__module__.startswith("tfdist") and c is not object]
            if not foreign:
                continue
            for name in sorted(overrides):
                owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
                if owner is None or not owner.__module__.startswith("tfdist"):
                    continue  # (another class's method of that name)
                checked.add(name)
                if not any(hasattr(c, name) for c in foreign):
                    missing.append(f"{cls.__module__}.{cls.__name__}.{name}")
            undeclared += [f"{cls.__module__}.{cls.__name__}.{name}"
                           for name, value in vars(cls).items()
                           if _private(name) and callable(value) and name not in overrides
                           and any(hasattr(c, name) for c in foreign)]
        # The hooks the strategies, checkpoints and tables are built on are among those
        # checked.
        self.assertContainsSubset({"_batch_reduce_to", "_update", "_create_variable",
                                   "_call_for_each_replica", *DECLARED_HOOKS}, checked)
        self.assertEmpty(missing, f"TF {tf.__version__} / Keras {keras.__version__} no "
                                  f"longer have the hooks these override: {missing}")
        self.assertEmpty(undeclared, "these override TF / Keras private methods without "
                                     "calling them: add their names to DECLARED_HOOKS")


# TF / Keras private hooks tfdist overrides without calling the parent's: TF calls them (a
# checkpoint its `_serialize_to_tensors`, a distributed dataset its strategy's
# `_experimental_distribute_dataset`), so a rename would leave the override silently uncalled
# (the state it saves missing from a checkpoint). Checked against TF 2.21 / Keras 3.15.
DECLARED_HOOKS = {
    "_serialize_to_tensors",            # tfdist/_saved_state.py (tf.train.Checkpoint)
    "_restore_from_tensors",            # tfdist/_saved_state.py
    "_copy_trackable_to_cpu",           # tfdist/_saved_state.py (async checkpoints)
    "_obj_type",                        # tfdist/_saved_state.py, ps/outer_optimizer.py
    "_gather_saveables_for_checkpoint",  # ps/tables.py (a table saved as its parts)
    "_export_to_saved_model_graph",     # ps/tables.py (refused with the route that works)
    "_validate_colocate_with_variable",  # ps/worker.py, ps/shard_optimizer.py
    "_experimental_distribute_dataset",  # _worker.py (ps and gossip workers)
    "_distribute_datasets_from_function",  # _worker.py
}


def _tfdist_classes():
    import importlib
    import pkgutil

    classes = []
    for module in pkgutil.walk_packages(tfdist.__path__, "tfdist."):
        if module.name.endswith("__main__"):
            continue
        loaded = importlib.import_module(module.name)
        classes.extend(c for _, c in inspect.getmembers(loaded, inspect.isclass)
                       if c.__module__ == module.name)
    return classes


def _compat_functions():
    """`{name: function}` of the public functions of `tfdist._tf_compat`'s submodules."""
    import importlib
    import pkgutil

    functions = {}
    for module in pkgutil.iter_modules(_tf_compat.__path__, _tf_compat.__name__ + "."):
        loaded = importlib.import_module(module.name)
        functions.update((name, value) for name, value in vars(loaded).items()
                         if inspect.isfunction(value) and value.__module__ == module.name
                         and not name.startswith("_"))
    return functions


# Accessors whose use needs a cluster, a traced Keras step or a gradient all-reduce: pinned
# by the named test, which fails when the installed TF / Keras moves what they reach.
PINNED_ELSEWHERE = {
    "keras_gradient_all_reduce": ("strategies/collective_test.py",
                                  "test_a_gradient_sum_in_another_thread_is_not_taken"),
    "keras_builds_from_a_batch": ("strategies/collective_test.py",
                                  "test_the_build_reduce_is_found_by_keras_315s_own_method"),
}


class AccessorsTest(tf.test.TestCase):
    """Each `_tf_compat` function run against the installed TF / Keras: it returns a real
    value, or the test fails naming it."""

    # Accessors exercised in the test of another, with which they work.
    TESTED_TOGETHER = {
        "keras_variable_being_initialized":
            "test_keras_variable_being_initialized_and_keras_variable_path",
        "keras_variable_path": "test_keras_variable_being_initialized_and_keras_variable_path",
        "cross_device_ops": "test_cross_device_ops_and_use_trace_time_instance_keys_in_loops",
        "use_trace_time_instance_keys_in_loops":
            "test_cross_device_ops_and_use_trace_time_instance_keys_in_loops",
        "create_remote_session": "test_create_remote_session_and_discard_remote_session",
        "discard_remote_session": "test_create_remote_session_and_discard_remote_session",
        "keras_optimizer_makes_learning_rate":
            "test_keras_optimizer_makes_learning_rate_and_keras_optimizer_learning_rate",
        "keras_optimizer_learning_rate":
            "test_keras_optimizer_makes_learning_rate_and_keras_optimizer_learning_rate",
    }

    def exercise(self, name, *args):
        try:
            return getattr(_tf_compat, name)(*args)
        except Exception as error:  # pylint: disable=broad-except
            self.fail(f"_tf_compat.{name} fails on TF {tf.__version__} / Keras "
                      f"{keras.__version__}: {error!r} (its docstring says what it reaches)")

    def test_every_accessor_is_exercised_here_or_pinned_by_a_named_test(self):
        functions = _compat_functions()
        self.assertNotEmpty(functions)
        # Every accessor of a submodule is one name of `_tf_compat`, as tfdist calls it.
        self.assertEmpty([name for name, value in functions.items()
                          if getattr(_tf_compat, name, None) is not value],
                         "re-export these in tfdist/_tf_compat/__init__.py")
        unexercised = [name for name in functions if not hasattr(self, f"test_{name}")
                       and name not in PINNED_ELSEWHERE and name not in self.TESTED_TOGETHER]
        self.assertEmpty(unexercised, "add a test_<accessor> here, or pin it in "
                                      "PINNED_ELSEWHERE")
        for name, (path, test) in PINNED_ELSEWHERE.items():
            self.assertIn(f"def {test}", (TESTS / path).read_text(), name)
        for name, test in self.TESTED_TOGETHER.items():
            self.assertTrue(hasattr(self, test), name)

    def optimizer_on(self, optimizer, variables):
        optimizer.build(variables)
        return optimizer

    def test_keras_optimizer_trained_variables(self):
        variables = [keras.Variable(np.ones([2, 3]), name="w"), keras.Variable(2.0, name="b")]
        optimizer = self.optimizer_on(keras.optimizers.SGD(), variables)
        got = self.exercise("keras_optimizer_trained_variables", optimizer)
        self.assertEqual([id(v) for v in got], [id(v) for v in variables])
        self.assertEqual(self.exercise("keras_optimizer_trained_variables",
                                       keras.optimizers.SGD()), [])

    def test_keras_variable_storage(self):
        variable = keras.Variable(np.ones([2]), dtype="float32")
        storage = self.exercise("keras_variable_storage", variable)
        self.assertIsInstance(storage, tf.Variable)
        self.assertAllEqual(storage, [1.0, 1.0])

    def test_keras_optimizer_step_storage(self):
        optimizer = self.optimizer_on(keras.optimizers.SGD(), [keras.Variable(1.0)])
        storage = self.exercise("keras_optimizer_step_storage", optimizer)
        self.assertIsInstance(storage, tf.Variable)
        self.assertEqual(storage.dtype, optimizer.iterations.dtype)

    def test_keras_variable_declared_shape(self):
        variable = keras.Variable(initializer="zeros", shape=(2, 3))
        self.assertEqual(tuple(self.exercise("keras_variable_declared_shape", variable)),
                         (2, 3))

    def test_keras_initializer_of(self):
        made = []

        def creator(next_creator, **kwargs):
            made.append(kwargs["initial_value"])
            return next_creator(**kwargs)

        initializer = keras.initializers.RandomUniform(-0.1, 0.1, seed=3)
        with tf.variable_creator_scope(creator):
            keras.Variable(initializer=initializer, shape=(2, 3))
            keras.Variable(np.ones([2]))
        self.assertIs(self.exercise("keras_initializer_of", made[0]), initializer)
        self.assertIsNone(self.exercise("keras_initializer_of", made[1]))
        self.assertIsNone(self.exercise("keras_initializer_of", lambda: tf.zeros([2])))

    def test_keras_initializer_fans(self):
        fans = self.exercise("keras_initializer_fans", keras.initializers.GlorotUniform(),
                             (30, 4))
        self.assertEqual(tuple(fans), (30, 4))

    def test_keras_optimizer_decays(self):
        kernel, bias = keras.Variable(np.ones([2]), name="kernel"), keras.Variable(1.0,
                                                                                   name="bias")
        optimizer = keras.optimizers.AdamW(weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        self.optimizer_on(optimizer, [kernel, bias])
        self.assertTrue(self.exercise("keras_optimizer_decays", optimizer, kernel))
        self.assertFalse(self.exercise("keras_optimizer_decays", optimizer, bias))

    def test_keras_optimizer_slot(self):
        weight = keras.Variable(np.ones([2, 3]), name="w")
        optimizer = self.optimizer_on(keras.optimizers.SGD(0.1, momentum=0.9), [weight])
        slots = [v for v in optimizer.variables
                 if tuple(v.shape) == (2, 3)]  # the momentum, made from the weight
        self.assertLen(slots, 1)
        self.assertTrue(self.exercise("keras_optimizer_slot", optimizer, slots[0].name,
                                      slots[0].shape))
        self.assertFalse(self.exercise("keras_optimizer_slot", optimizer,
                                       optimizer.iterations.name, []))

    def test_keras_optimizer_makes_learning_rate_and_keras_optimizer_learning_rate(self):
        optimizer = keras.optimizers.SGD(0.25)
        rate = self.exercise("keras_optimizer_learning_rate", optimizer)
        self.assertIsInstance(rate, keras.Variable)
        self.assertAllClose(rate, 0.25)
        self.assertTrue(self.exercise("keras_optimizer_makes_learning_rate", rate.name))
        self.assertFalse(self.exercise("keras_optimizer_makes_learning_rate",
                                       optimizer.iterations.name))
        wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5))
        self.assertAllClose(self.exercise("keras_optimizer_learning_rate", wrapped), 0.5)
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        self.assertIsNone(self.exercise("keras_optimizer_learning_rate",
                                        keras.optimizers.SGD(schedule)))

    def test_keras_optimizer_knows(self):
        known, other = keras.Variable(1.0), keras.Variable(2.0)
        optimizer = self.optimizer_on(keras.optimizers.SGD(), [known])
        self.assertTrue(self.exercise("keras_optimizer_knows", optimizer, known))
        self.assertFalse(self.exercise("keras_optimizer_knows", optimizer, other))

    def test_keras_optimizer_apply_weight_decay(self):
        variable = keras.Variable(np.ones([2]), dtype="float32")
        optimizer = self.optimizer_on(
            keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1), [variable])
        self.exercise("keras_optimizer_apply_weight_decay", optimizer, [variable])
        self.assertAllClose(variable.numpy(), [0.95, 0.95])  # w - lr * wd * w

    def test_keras_optimizer_in_scope(self):
        optimizer = keras.optimizers.SGD()
        self.assertIsNone(self.exercise("keras_optimizer_in_scope"))
        with keras.name_scope(optimizer.name, caller=optimizer):
            self.assertIs(self.exercise("keras_optimizer_in_scope"), optimizer)

    def test_keras_layer_in_scope(self):
        layer = keras.layers.Dense(2)
        with keras.name_scope(layer.name, caller=layer):
            self.assertIs(self.exercise("keras_layer_in_scope"), layer)

    def test_in_xla_context(self):
        seen = []

        def probe():
            seen.append(self.exercise("in_xla_context"))
            return tf.constant(0)

        tf.function(probe, jit_compile=True)()
        tf.function(probe)()
        self.assertEqual(seen, [True, False])

    def test_inside_while_loop(self):
        seen = []

        def body(i):
            seen.append(self.exercise("inside_while_loop"))
            return (i + 1,)

        tf.function(lambda: tf.while_loop(lambda i: i < 2, body, [tf.constant(0)]))()
        seen_outside = self.exercise("inside_while_loop")
        self.assertEqual((seen[:1], seen_outside), ([True], False))

    def tiny_model(self):
        model = keras.Sequential([keras.Input([3]), keras.layers.Dense(2, name="dense")],
                                 name="tiny")
        model.compile(optimizer="sgd", loss="mse")
        return model

    def test_keras_model_of_step(self):
        model = self.tiny_model()
        self.assertIs(self.exercise("keras_model_of_step", model.train_step), model)
        self.assertIsNone(self.exercise("keras_model_of_step", lambda: None))

    def test_keras_own_train_step(self):
        model = self.tiny_model()
        self.assertIs(self.exercise("keras_own_train_step", model.train_step), model)
        self.assertIsNone(self.exercise("keras_own_train_step", model.test_step))

    def test_keras_variable_paths(self):
        model = self.tiny_model()
        optimizer = self.optimizer_on(model.optimizer, model.trainable_variables)
        storages = [v.value for v in model.trainable_variables]
        self.assertEqual(self.exercise("keras_variable_paths", optimizer, storages),
                         ["tiny/dense/kernel", "tiny/dense/bias"])

    def test_keras_variable_being_initialized_and_keras_variable_path(self):
        seen = []

        def creator(next_creator, **kwargs):
            owner = self.exercise("keras_variable_being_initialized")
            seen.append((owner, self.exercise("keras_variable_path", kwargs.get("name"))))
            return next_creator(**kwargs)

        with tf.variable_creator_scope(creator), keras.name_scope("outer"):
            variable = keras.Variable(1.0, name="v")
        self.assertIs(seen[0][0], variable)
        self.assertEqual(seen[0][1], "outer/v")

    def test_keras_whole_model_reads(self):
        from tfdist.ps import snapshot

        self.exercise("keras_whole_model_reads", snapshot.consistent_reads)
        self.exercise("keras_whole_model_reads", snapshot.consistent_reads)  # wrapped once
        reads = []

        class Probe(keras.layers.Layer):
            def build(self, shape):
                self.w = self.add_weight(shape=[2], name="w")

            def call(self, x):
                return x * self.w

            @property
            def weights(self):
                reads.append(("weights", snapshot.active()))
                return super().weights

            @property
            def trainable_weights(self):
                reads.append(("weights", snapshot.active()))
                return super().trainable_weights

            def save_own_variables(self, store):
                reads.append(("saved", snapshot.active()))
                super().save_own_variables(store)

        model = keras.Sequential([keras.Input([2]), Probe()])
        self.assertLen(model.get_weights(), 1)
        model.layers[0].get_weights()
        directory = self.get_temp_dir()
        model.save_weights(os.path.join(directory, "m.weights.h5"))
        model.save(os.path.join(directory, "m.keras"))
        self.assertEqual({name for name, _ in reads}, {"weights", "saved"})
        self.assertTrue(all(active for _, active in reads), reads)
        # Every route to a file as well: the functions, their names in `keras.models` and
        # `tf.keras`, and one imported before the wrapping (as a user's module would).
        del reads[:]
        keras.saving.save_model(model, os.path.join(directory, "f.keras"))
        keras.models.save_model(model, os.path.join(directory, "g.keras"))
        tf.keras.models.save_model(model, os.path.join(directory, "h.keras"))
        save_model_imported_early(model, os.path.join(directory, "i.keras"))
        keras.saving.save_weights(model, os.path.join(directory, "j.weights.h5"))
        self.assertEqual([name for name, _ in reads].count("saved"), 5)
        self.assertTrue(all(active for _, active in reads), reads)
        del reads[:]
        model.save(os.path.join(directory, "k.h5"))  # the legacy HDF5 format
        self.assertNotEmpty(reads)
        self.assertTrue(all(active for _, active in reads), reads)

        # TensorFlow's checkpoints: `save`, `write` and a manager's `save` read every
        # variable inside one context (a snapshot per shard).
        class Recorded(_tf_compat.Trackable):
            def _serialize_to_tensors(self):
                reads.append(("checkpoint", snapshot.active()))
                return {"x": tf.constant(1.0)}

            def _restore_from_tensors(self, restored_tensors):
                return tf.no_op()

        checkpoint = tf.train.Checkpoint(recorded=Recorded())
        manager = tf.train.CheckpointManager(checkpoint, os.path.join(directory, "managed"), 1)
        for save in (lambda: checkpoint.write(os.path.join(directory, "written")),
                     lambda: checkpoint.save(os.path.join(directory, "saved")), manager.save):
            del reads[:]
            save()
            self.assertNotEmpty(reads)
            self.assertEqual(set(reads), {("checkpoint", True)})
        self.assertFalse(snapshot.active())

    def test_keras_name_scope_for_path(self):
        with self.exercise("keras_name_scope_for_path", "a/b/kernel"):
            variable = keras.Variable(1.0, name="kernel")
        self.assertEqual(variable.path, "a/b/kernel")

    def test_container_strategy(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        self.assertIs(self.exercise("container_strategy", strategy.extended), strategy)

    def test_one_device(self):
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        self.assertEqual(self.exercise("one_device", strategy.extended),
                         "/job:localhost/replica:0/task:0/device:CPU:0")

    def test_worker_index_in_cluster(self):
        # A multi-worker strategy of one process (no TF_CONFIG) is worker 0 of 1.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        index = self.exercise("worker_index_in_cluster", strategy.extended)
        self.assertIsInstance(index, int)
        self.assertEqual(index, 0)
        mirrored = tf.distribute.MirroredStrategy(["/cpu:0"])
        self.assertEqual(self.exercise("worker_index_in_cluster", mirrored.extended), 0)

    def test_cross_device_ops_and_use_trace_time_instance_keys_in_loops(self):
        for strategy in (tf.distribute.MirroredStrategy(["/cpu:0"]),
                         tf.distribute.MultiWorkerMirroredStrategy()):
            found = self.exercise("cross_device_ops", strategy.extended)
            self.assertNotEmpty(found, type(strategy).__name__)
            for ops in found:
                self.assertIsInstance(ops, tf.distribute.CrossDeviceOps)
        collective = [ops for ops in found if type(ops).__name__ == "CollectiveAllReduce"]
        self.assertNotEmpty(collective)
        changed = self.exercise("use_trace_time_instance_keys_in_loops", collective[0])
        self.assertGreater(changed, 0, "use_trace_time_instance_keys_in_loops found no "
                                       "collective launcher to change")

    def test_keras_update_step_arguments(self):
        # What Keras's optimizer hands `StrategyExtended.update` is found as its gradient
        # and learning rate; Keras's other updates are not.
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            variable = keras.Variable(np.ones([2]), dtype="float32")
            optimizer = keras.optimizers.SGD(learning_rate=0.25)
            optimizer.build([variable])
        found = []
        update = strategy.extended.update

        def recording_update(var, fn, args=(), kwargs=None, group=True):
            found.append(self.exercise("keras_update_step_arguments", args))
            return update(var, fn, args=args, kwargs=kwargs, group=group)

        strategy.extended.update = recording_update
        try:
            strategy.run(lambda: optimizer.apply([tf.constant([1.0, 2.0])], [variable]))
        finally:
            del strategy.extended.update
        self.assertIsNotNone(found[0], "Keras's update step no longer passes "
                                       "(gradient, learning_rate)")
        self.assertEqual(found[1:], [None] * (len(found) - 1))  # (its step counter's)
        gradient, learning_rate = found[0]
        self.assertAllClose(gradient, [1.0, 2.0])
        self.assertAllClose(learning_rate, 0.25)
        self.assertAllClose(variable.numpy(), [0.75, 0.5])
        self.assertIsNone(self.exercise("keras_update_step_arguments", (tf.constant(1.0),)))

    def test_set_handle_shape_and_dtype(self):
        # A raw handle has no shape until it is given one: a read traced from it then has it.
        handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2, 3], container="tfdist",
                                        shared_name="tf_compat_test_probe")
        self.exercise("set_handle_shape_and_dtype", handle, [2, 3], tf.float32)
        shapes = []

        @tf.function
        def read():
            value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
            shapes.append(value.shape.as_list())
            return value

        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.ones([2, 3]))
        self.assertAllEqual(read(), np.ones([2, 3]))
        self.assertEqual(shapes, [[2, 3]])

    def test_variable_accessed(self):
        # A variable whose reads bypass TF's own read (a table's parts) is watched by a
        # gradient tape once its read is recorded.
        variable = tf.Variable(2.0)
        with tf.GradientTape(watch_accessed_variables=True) as tape:
            self.exercise("variable_accessed", variable)
        self.assertEqual([v.name for v in tape.watched_variables()], [variable.name])

    def test_start_eager_context(self):
        self.exercise("start_eager_context")
        self.assertTrue(tf.executing_eagerly())

    def test_create_remote_session_and_discard_remote_session(self):
        server = tf.distribute.Server.create_local_server()
        graph = tf.Graph()
        with graph.as_default():
            value = tf.constant(3)
        session = tf.compat.v1.Session(server.target, graph=graph)
        self.exercise("create_remote_session", session)
        self.assertEqual(session.run(value), 3)
        self.exercise("discard_remote_session", session)
        with self.assertRaisesRegex(RuntimeError, "closed Session"):
            session.run(value)


if __name__ == "__main__":
    tf.test.main()
