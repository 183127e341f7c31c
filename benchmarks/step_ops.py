"""A worker's per-step work, counted exactly: the ops of its traced train step.

Rates on this machine cannot resolve a change of 10-15 % (the all-reduce reference, which no
tfdist change touches, moves by a quarter between runs). A change that must not add work to
a step (a restructure, a refactoring) is checked exactly instead: under each strategy, worker
0 of a 2-worker, 1-ps cluster traces one train step of a small dense model (the step's graph
and every function it calls), and each node's signature is counted: its op type, device,
number of inputs (control inputs included) and attributes (dtypes, shapes, constants; the
names of the functions it calls without their trace numbers). Run it against two checkouts
and compare:

    python benchmarks/step_ops.py --tree=BEFORE_CHECKOUT --out=before.json
    python benchmarks/step_ops.py --tree=AFTER_CHECKOUT --out=after.json
    python benchmarks/step_ops.py --compare=before.json,after.json

`--tree`: the checkout whose tfdist every task imports (the tasks run there, with it first
on their path: the ps task's service included; each task's tfdist is recorded and checked);
default: the tfdist this script imports. What is traced is `strategy.run(model.train_step)`
on one batch, the call Keras's `fit` makes in its step function (without `fit`'s iterator
loop around it, which tfdist does not change). The ps tasks' update graph is not counted, nor
how long each op takes: a change there, or a read that now waits for a reply, shows only in
a rate.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from machine import finish
from machine import run_cluster
from machine import stamp

FLAGS = flags.FLAGS


def define_flags():
    """The script's flags (defined when it runs, not when a test imports it)."""
    flags.DEFINE_list("strategies", ["async", "soft_sync", "model_averaging"],
                      "Strategies whose worker step is traced (tfdist `--strategy` names).")
    flags.DEFINE_string("tree", None, "A checkout whose tfdist the tasks import (default: "
                        "the one this script imports).")
    flags.DEFINE_string("out", None, "Where the counts go (JSON).")
    flags.DEFINE_list("compare", [], "Two JSON files this script wrote: prints, per "
                      "strategy, whether the steps are the same and the op types whose "
                      "counts differ.")
    flags.DEFINE_string("worker_out_dir", None, "(Set by the script itself: run as the "
                        "cluster's worker program, writing there.)")
    flags.DEFINE_string("strategy", None, "(The worker program's strategy.)")
    flags.DEFINE_float("timeout", 300.0, "Seconds each cluster may take.", lower_bound=1.0)


BATCH, FEATURES = 32, 64


def _nodes(graph_def):
    return [*graph_def.node, *[n for f in graph_def.library.function for n in f.node_def]]


def graph_ops(graph_def):
    """`{op type: count}` over a GraphDef's nodes and its function library's."""
    ops = {}
    for node in _nodes(graph_def):
        ops[node.op] = ops.get(node.op, 0) + 1
    return ops


def _untraced(name):
    """A function's name without the number its trace gave it."""
    return re.sub(r"_\d+$", "", name)


def node_signature(node):
    """What a node does, without its name: op type, device, number of inputs, and its
    attributes (a function's name without its trace number; colocation names left out)."""
    attrs = []
    for key in sorted(node.attr):
        if key == "_class":
            continue  # (colocation with other nodes, by their names)
        value = node.attr[key]
        if key == "_gradient_op_type":
            text = re.sub(rb"-\d+$", b"", value.s).decode()  # (a process-wide number)
        elif value.HasField("func"):
            text = _untraced(value.func.name)
        elif value.HasField("list") and value.list.func:
            text = ",".join(_untraced(f.name) for f in value.list.func)
        else:
            text = " ".join(str(value).split())
        attrs.append(f"{key}={text}")
    return f"{_untraced(node.op)} @{node.device} ({len(node.input)} in) {'; '.join(attrs)}"


def graph_signatures(graph_def):
    """`{node signature: count}` over a GraphDef's nodes and its function library's."""
    signatures = {}
    for node in _nodes(graph_def):
        signature = node_signature(node)
        signatures[signature] = signatures.get(signature, 0) + 1
    return signatures


def worker(strategy_name, out_dir):
    """The cluster's worker program: trains one epoch, then worker 0 traces one train step
    (outside `fit`'s loop: `strategy.run(model.train_step)` on one batch) and writes its
    counts."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    strategy = tfdist.strategies.get(strategy_name)
    x = np.random.RandomState(0).rand(8 * BATCH, FEATURES).astype("float32")
    y = (x.sum(axis=1) > FEATURES / 2).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        step = tf.function(lambda x, y: strategy.run(model.train_step, args=((x, y),)))
        graph_def = step.get_concrete_function(
            tf.TensorSpec([BATCH, FEATURES], tf.float32),
            tf.TensorSpec([BATCH], tf.int32)).graph.as_graph_def()
        with open(os.path.join(out_dir, "ops.json"), "w") as f:
            json.dump({"nodes": len(graph_def.node),
                       "functions": len(graph_def.library.function),
                       "function_nodes": sum(len(f.node_def)
                                             for f in graph_def.library.function),
                       "ops": graph_ops(graph_def),
                       "signatures": graph_signatures(graph_def),
                       "tfdist": os.path.dirname(os.path.abspath(tfdist.__file__))},
                      f, sort_keys=True)
    strategy.join()


def count(tree):
    """`{strategy: counts}` of each strategy's worker step, the tasks importing `tree`'s
    tfdist (None: this script's)."""
    env = {"PYTHONPATH": os.path.abspath(tree)} if tree else {}
    results = {}
    for name in FLAGS.strategies:
        with tempfile.TemporaryDirectory() as out_dir:
            command = [sys.executable, os.path.abspath(__file__), f"--strategy={name}",
                       f"--worker_out_dir={out_dir}"]
            result, lines = run_cluster(command, FLAGS.timeout, num_ps=1, num_workers=2,
                                        env=env, cwd=os.path.abspath(tree) if tree else None)
            if result.returncode:
                tail = "\n".join(f"[{task}] {line}" for task, line in lines[-20:])
                raise SystemExit(f"{name}: the cluster failed ({result.message}):\n{tail}")
            with open(os.path.join(out_dir, "ops.json")) as f:
                results[name] = json.load(f)
        imported = results[name].pop("tfdist")  # (a path of this machine: not kept)
        if tree and not imported.startswith(os.path.abspath(tree)):
            raise SystemExit(f"{name}: the worker imported tfdist from {imported}, not from "
                             f"--tree={tree}")
        print(f"{name}: {results[name]['nodes']} nodes, {results[name]['functions']} "
              f"functions of {results[name]['function_nodes']} nodes", flush=True)
    return results


def compare(before, after, shown=10):
    """Lines saying, per strategy, whether the two steps are the same node for node (by
    `node_signature`), and else which op types' counts and which signatures differ (the
    first `shown`); a strategy only one file has is named."""
    lines = []
    for name in sorted(set(before["steps"]) | set(after["steps"])):
        if name not in before["steps"] or name not in after["steps"]:
            side = "before" if name in before["steps"] else "after"
            lines.append(f"{name}: only {side}")
            continue
        steps = before["steps"][name], after["steps"][name]
        ops = _differences(*[s["ops"] for s in steps])
        signatures = _differences(*[s.get("signatures", {}) for s in steps])
        if not ops and not signatures:
            lines.append(f"{name}: the same step, node for node")
            continue
        lines.append(f"{name}: differs: " + (", ".join(
            f"{op} {x} -> {y}" for op, (x, y) in ops.items()) or "the same op counts"))
        lines += [f"  {x} -> {y}: {signature}"
                  for signature, (x, y) in list(signatures.items())[:shown]]
    return lines


def _differences(a, b):
    return {key: (a.get(key, 0), b.get(key, 0)) for key in sorted(set(a) | set(b))
            if a.get(key, 0) != b.get(key, 0)}


def tree_commit(tree):
    if not tree:
        return None
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                          text=True)
    return done.stdout.strip() or None


def main(argv):
    del argv
    if FLAGS.worker_out_dir:
        worker(FLAGS.strategy, FLAGS.worker_out_dir)
        return
    if FLAGS.compare:
        if len(FLAGS.compare) != 2:
            raise SystemExit(f"--compare takes two JSON files. Received: {FLAGS.compare}")
        with open(FLAGS.compare[0]) as f, open(FLAGS.compare[1]) as g:
            print("\n".join(compare(json.load(f), json.load(g))))
        return
    if not FLAGS.out:
        raise SystemExit("--out (where the counts go) is needed, or --compare")
    run_stamp = stamp({"strategies": FLAGS.strategies, "tree_commit": tree_commit(FLAGS.tree)})
    steps = count(FLAGS.tree)
    result = {"stamp": finish(run_stamp), "steps": steps}
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
