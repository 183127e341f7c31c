"""`tfdist-launch`: run a ps or worker task, or a whole cluster on this machine.

Classic form, one task per command (as in TF1's examples):

    tfdist-launch --job_name=ps --task_index=0 --ps_hosts=h1:2222 --worker_hosts=h2:2222,h3:2222
    tfdist-launch --job_name=worker --task_index=1 --ps_hosts=... --worker_hosts=... \
        -- python train.py

A ps task serves until SIGTERM / SIGINT and exits 0; a worker (or chief) task sets TF_CONFIG
and runs the command given after `--`.

Inside a Kubernetes pod of the manifests below (TF_CONFIG from the pod's index), or with
TF_CONFIG already set (e.g. by Kubeflow's operator):

    tfdist-launch --kubernetes --name=job --num_ps=1 --num_workers=4 --job_name=worker -- ...
    tfdist-launch --from_tf_config --job_name=ps

Kubernetes manifests from the same flags as a local cluster:

    tfdist-launch --kubernetes_manifest=job.yaml --image=IMAGE --num_ps=1 --num_workers=4 \
        -- python train.py

Local form, a whole cluster in one command:

    tfdist-launch --local --num_ps=1 --num_workers=3 --timeout=600 \
        -- python examples/train_digits.py
"""

import os
import signal
import sys

from absl import app
from absl import flags

from tfdist.cluster import ClusterConfig
from tfdist.cluster import TFConfigError

FLAGS = flags.FLAGS

flags.DEFINE_enum("job_name", None, ["ps", "worker", "chief", "evaluator"],
                  "This task's job, in the one-task form.")
flags.DEFINE_integer("task_index", 0, "This task's index in its job.", lower_bound=0)
flags.DEFINE_list("ps_hosts", [], "Comma-separated host:port of the ps tasks.")
flags.DEFINE_list("worker_hosts", [], "Comma-separated host:port of the worker tasks.")
flags.DEFINE_string("chief_host", None, "host:port of a separate chief task, if any.")
flags.DEFINE_integer("ps_threads", None, "Inter-op threads of a ps server (default: 64, or "
                     "2 per worker + 8 when that is more).",
                     lower_bound=2)
flags.DEFINE_multi_string(
    "ps_import", [], "A module a ps task imports before it serves (repeatable): where custom "
    "optimizers, learning-rate schedules, constraints or staleness functions are registered "
    "(`@keras.saving.register_keras_serializable()`). The optimizer's own module is "
    "imported without it.")
flags.DEFINE_bool("local", False, "Start a whole cluster on this machine.")
flags.DEFINE_integer("num_ps", 1, "With --local: number of ps tasks.", lower_bound=0)
flags.DEFINE_integer("num_workers", 2, "With --local: number of worker tasks.", lower_bound=1)
flags.DEFINE_float("timeout", None, "With --local: seconds the whole run may take.")
flags.DEFINE_bool("stop_on_failure", True,
                  "With --local: stop every task when one fails; --nostop_on_failure lets the "
                  "other workers run on (fault-tolerant jobs).")
flags.DEFINE_bool("isolate_network", True,
                  "With --local: run the tasks in a private network namespace, so that nothing "
                  "outside the cluster can reach its TensorFlow servers (a loud warning where "
                  "the system refuses one). --noisolate_network uses the machine's network.")
flags.DEFINE_bool("outbound_network", True,
                  "With --local: let the tasks in the private network open connections out "
                  "(downloads, logging services) through slirp4netns where it is installed; "
                  "nothing can connect in. --nooutbound_network keeps the network sealed.")
flags.DEFINE_string("bandwidth", None,
                    "With --local: limit the cluster's private network to this rate (e.g. "
                    "100mbit, 1gbit; tc's units), shared by all its tasks, so that "
                    "communication costs show on one machine.")
flags.DEFINE_float("grace_period", 3.0,
                   "With --local: seconds the other tasks get after one fails.", lower_bound=0)


flags.DEFINE_bool("from_tf_config", False,
                  "Take the cluster and this task from TF_CONFIG instead of the host flags.")
flags.DEFINE_bool("kubernetes", False,
                  "Inside a pod of tfdist's plain manifests: derive TF_CONFIG from the pod's "
                  "index, --name, --namespace, --port, --num_ps and --num_workers.")
flags.DEFINE_string("kubernetes_manifest", None,
                    "Write the Kubernetes manifests of this job to this file ('-': stdout) "
                    "and exit; uses --image, --k8s_kind, --name, --namespace, --port, "
                    "--num_ps, --num_workers, --cpu, --memory and the command after `--`.")
flags.DEFINE_string("image", None, "With --kubernetes_manifest: the container image.")
flags.DEFINE_enum("k8s_kind", "plain", ["plain", "tfjob"],
                  "With --kubernetes_manifest: StatefulSet + Indexed Job + Services (plain), "
                  "or a Kubeflow TFJob.")
flags.DEFINE_string("name", "tfdist", "Kubernetes job name (a DNS label).")
flags.DEFINE_string("namespace", "default", "Kubernetes namespace.")
flags.DEFINE_integer("port", 2222, "gRPC port of every task in Kubernetes.", lower_bound=1,
                     upper_bound=65535)
flags.DEFINE_string("cpu", None, "Kubernetes CPU of each pod (requests = limits), e.g. 2.")
flags.DEFINE_string("memory", None, "Kubernetes memory of each pod, e.g. 4Gi.")


@flags.validator("timeout", message="--timeout must be a positive number of seconds")
def _check_timeout(value):
    return value is None or value > 0


def _worker_command(argv):
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    return command


def _config_from_flags():
    try:
        if FLAGS.kubernetes:
            from tfdist.cluster.kubernetes import pod_cluster_config

            return pod_cluster_config(FLAGS.name, FLAGS.job_name, FLAGS.num_ps,
                                      FLAGS.num_workers, FLAGS.namespace, FLAGS.port)
        if FLAGS.from_tf_config:
            from tfdist.cluster import parse_tf_config

            config = parse_tf_config()
            if FLAGS.job_name and config.task_type != FLAGS.job_name:
                raise TFConfigError(f"--job_name={FLAGS.job_name} but TF_CONFIG's task type "
                                    f"is {config.task_type!r}")
            return config
        return ClusterConfig.from_hosts(
            ps_hosts=FLAGS.ps_hosts, worker_hosts=FLAGS.worker_hosts,
            chief_host=FLAGS.chief_host, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
    except TFConfigError as e:
        raise app.UsageError(f"bad cluster flags: {e}") from None


def _import_modules(modules):
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise app.UsageError(
                f"--ps_import={module}: cannot import it ({type(e).__name__}: {e}). Install "
                "it where the ps tasks run, or put it on their PYTHONPATH") from None


def _run_local(command):
    from tfdist.launch.local import LocalCluster

    if not command:
        raise app.UsageError("--local needs the worker command after `--`, e.g. "
                             "`tfdist-launch --local -- python train.py`")
    from tfdist.cluster import TaskUnreachableError
    from tfdist.launch.isolation import IsolationUnavailable

    try:
        cluster = LocalCluster(command, num_ps=FLAGS.num_ps, num_workers=FLAGS.num_workers,
                               timeout=FLAGS.timeout, grace_period=FLAGS.grace_period,
                               ps_threads=FLAGS.ps_threads,
                               stop_on_failure=FLAGS.stop_on_failure,
                               isolate_network="auto" if FLAGS.isolate_network else False,
                               ps_imports=FLAGS.ps_import, bandwidth=FLAGS.bandwidth,
                               outbound_network="auto" if FLAGS.outbound_network else False)
    except ValueError as e:
        raise app.UsageError(str(e).replace("`bandwidth`", "--bandwidth").replace(
            "`isolate_network` 'auto' or True. Received: isolate_network=False",
            "the private network. Received: --noisolate_network")) from None

    received = []

    def _terminate(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    # A closed terminal (SIGHUP) stops the cluster as SIGTERM does.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        with cluster:
            result = cluster.wait()
    except KeyboardInterrupt:
        sig = received[0] if received else signal.SIGINT
        print(f"[tfdist-launch] {signal.Signals(sig).name}; every task stopped",
              file=sys.stderr)
        return 128 + sig  # as a POSIX shell reports a signal: 130 SIGINT, 143 SIGTERM
    except (IsolationUnavailable, TaskUnreachableError) as e:
        print(f"[tfdist-launch] cannot start the cluster: {e}", file=sys.stderr)
        return 1
    if result.returncode:
        print(f"[tfdist-launch] FAILED: {result.message}", file=sys.stderr)
    else:
        print(f"[tfdist-launch] {result.message}", file=sys.stderr)
    return result.returncode


def _write_manifests(command):
    from tfdist.launch.kubernetes import manifests
    from tfdist.launch.kubernetes import to_yaml

    if not FLAGS.image:
        raise app.UsageError("--kubernetes_manifest needs --image=IMAGE (an image with tfdist "
                             "and your script installed)")
    if not command:
        raise app.UsageError("--kubernetes_manifest needs the worker command after `--`, "
                             "e.g. `-- python train.py`")
    try:
        docs = manifests(FLAGS.name, FLAGS.image, command, num_ps=FLAGS.num_ps,
                         num_workers=FLAGS.num_workers, namespace=FLAGS.namespace,
                         port=FLAGS.port, kind=FLAGS.k8s_kind, cpu=FLAGS.cpu,
                         memory=FLAGS.memory)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    text = to_yaml(docs)
    if FLAGS.kubernetes_manifest == "-":
        sys.stdout.write(text)
    else:
        with open(FLAGS.kubernetes_manifest, "w") as f:
            f.write(text)
        print(f"[tfdist-launch] wrote {len(docs)} manifests to {FLAGS.kubernetes_manifest}; "
              f"run: kubectl apply -f {FLAGS.kubernetes_manifest}", file=sys.stderr)
    return 0


def main(argv):
    command = _worker_command(argv)
    if FLAGS.bandwidth is not None and not FLAGS.local:
        raise app.UsageError(f"--bandwidth limits the private network of a --local cluster; "
                             f"a cluster of separate machines runs on their own network. "
                             f"Received: --bandwidth={FLAGS.bandwidth} without --local")
    if FLAGS.kubernetes_manifest:
        return _write_manifests(command)
    if FLAGS.local:
        if FLAGS.job_name:
            raise app.UsageError("--local starts every task itself: drop --job_name")
        return _run_local(command)
    if FLAGS.job_name is None and not FLAGS.from_tf_config:
        raise app.UsageError("give --job_name=ps|worker|chief with the cluster's host flags, "
                             "or --local to start a whole cluster on this machine")
    config = _config_from_flags()
    if config.task_type == "ps":
        if command:
            raise app.UsageError(f"a ps task runs no command. Received: {' '.join(command)}")
        from tfdist.launch.server import ps_threads
        from tfdist.launch.server import serve

        try:
            threads = ps_threads(config, FLAGS.ps_threads)
        except ValueError as e:
            raise app.UsageError(str(e).replace("`threads`", "--ps_threads")) from None
        _import_modules(FLAGS.ps_import)
        return serve(config, threads=threads)
    if not command:
        raise app.UsageError(f"a {config.task_type} task needs its command after `--`, e.g. "
                             "`-- python train.py`")
    from tfdist.launch.local import TASK_ENVIRONMENT

    env = dict(os.environ)
    for key, value in TASK_ENVIRONMENT.items():
        env.setdefault(key, value)
    env["TF_CONFIG"] = config.to_json()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise app.UsageError(f"cannot run {command[0]!r}: {e.strerror}") from None


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
