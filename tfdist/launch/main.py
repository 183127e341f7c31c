"""`tfdist-launch`: run a ps or worker task, or a whole cluster on this machine.

Classic form, one task per command (as in TF1's examples):

    tfdist-launch --job_name=ps --task_index=0 --ps_hosts=h1:2222 --worker_hosts=h2:2222,h3:2222
    tfdist-launch --job_name=worker --task_index=1 --ps_hosts=... --worker_hosts=... \
        -- python train.py

A ps task serves until SIGTERM / SIGINT and exits 0 (or, with --exit_after_workers_gone,
once its workers have come and gone); a worker (or chief) task sets TF_CONFIG and runs the
command given after `--` (with --connect_timeout, once its ps tasks answer: exit code 69 if
they never do).

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

import logging
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
    "(`@keras.saving.register_keras_serializable()`). A ps imports no module a worker names "
    "but Keras's and tfdist's own and these: a custom optimizer's own module must be named too.")
flags.DEFINE_bool("local", False, "Start a whole cluster on this machine.")
flags.DEFINE_integer("num_ps", 1, "With --local, --kubernetes or --kubernetes_manifest: "
                     "number of ps tasks (0 for an all-reduce or decentralised job).",
                     lower_bound=0)
flags.DEFINE_integer("num_workers", 2, "With --local, --kubernetes or --kubernetes_manifest: "
                     "number of worker tasks.", lower_bound=1)
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
                    "100mbit, 1gbit; tc's units), so that communication costs show on one "
                    "machine: each task's own link, each way, on the switched network (the "
                    "default with --bandwidth); the one link all tasks share with "
                    "--topology=hub.")
flags.DEFINE_enum("topology", None, ["switched", "hub"],
                  "With --local: 'switched' gives every task a private network namespace and "
                  "an address of its own on a bridge, as machines on a switch; 'hub' runs "
                  "every task in one namespace, on its loopback. Default: switched with "
                  "--bandwidth, else hub.")
flags.DEFINE_bool("check_links", False,
                  "With --local: before the job, measure the rate pairs of workers get at once "
                  "on a cluster of the job's network (tfdist.launch.links) and print it: on "
                  "few cores a high --bandwidth over many links may not be reached. A "
                  "measurement that cannot finish stops the launch (exit code 1).")
flags.DEFINE_float("grace_period", 3.0,
                   "With --local: seconds the other tasks get after one fails.", lower_bound=0)
flags.DEFINE_bool("preload", False,
                  "With --local: fork every Python task (`python script.py`, `python -m "
                  "module`) from a server that imported TensorFlow, Keras and tfdist once, "
                  "about 6 s of CPU less per task (tfdist.launch.preload).")


flags.DEFINE_bool("from_tf_config", False,
                  "Take the cluster and this task from TF_CONFIG instead of the host flags.")
flags.DEFINE_bool("kubernetes", False,
                  "Inside a pod of tfdist's plain manifests: derive TF_CONFIG from the pod's "
                  "index, --name, --namespace, --port, --num_ps and --num_workers; "
                  "--connect_timeout defaults to 600 and --exit_after_workers_gone to 660.")
flags.DEFINE_string("kubernetes_manifest", None,
                    "Write the Kubernetes manifests of this job to this file ('-': stdout) "
                    "and exit; uses --image, --k8s_kind, --name, --namespace, --port, "
                    "--num_ps, --num_workers, --cpu, --memory, --ps_cpu, --ps_memory, "
                    "--worker_retries, --max_failed_workers, --run_as_user, "
                    "--connect_timeout, --exit_after_workers_gone, --stall_timeout and the "
                    "command after `--`.")
flags.DEFINE_string("image", None, "With --kubernetes_manifest: the container image.")
flags.DEFINE_enum("k8s_kind", "plain", ["plain", "tfjob"],
                  "With --kubernetes_manifest: two Indexed Jobs (ps, workers) + headless "
                  "Services (plain), or a Kubeflow TFJob.")
flags.DEFINE_string("name", "tfdist", "Kubernetes job name (a DNS label).")
flags.DEFINE_string("namespace", "default", "Kubernetes namespace.")
flags.DEFINE_integer("port", 2222, "gRPC port of every task in Kubernetes.", lower_bound=1,
                     upper_bound=65535)
flags.DEFINE_string("cpu", None, "Kubernetes CPU of each worker pod (requests = limits), a "
                    "quantity such as 500m, 2 or 1.5.")
flags.DEFINE_string("memory", None, "Kubernetes memory of each worker pod, a quantity such as "
                    "4Gi or 512Mi.")
flags.DEFINE_string("ps_cpu", None, "Kubernetes CPU of each ps pod (default: --cpu).")
flags.DEFINE_string("ps_memory", None, "Kubernetes memory of each ps pod (default: --memory).")
flags.DEFINE_integer("worker_retries", 3,
                     "With --kubernetes_manifest: times each worker is started again after it "
                     "fails (a pod lost to a drained node or a preemption is replaced without "
                     "counting).", lower_bound=0)
flags.DEFINE_integer("max_failed_workers", None,
                     "With --kubernetes_manifest (plain kind): the worker Job fails as a whole "
                     "once more than this many workers have failed for good (default: the "
                     "others go on).", lower_bound=0)
flags.DEFINE_string("run_as_user", "1000",
                    "With --kubernetes_manifest: the user id every container runs as (pods "
                    "run as non-root), or 'image' for the image's own user, which must then "
                    "be a numeric non-root user.")
flags.DEFINE_float("connect_timeout", None,
                   "Seconds a task waits for the others to start. A worker waits this long "
                   "for its ps tasks before its command runs (exit code 69 if they never "
                   "answer), and its command's strategies get it as their default "
                   "connect_timeout and init_timeout (TFDIST_CONNECT_TIMEOUT, "
                   "TFDIST_INIT_TIMEOUT); a ps with --exit_after_workers_gone gives its "
                   "workers this long to appear; with --local, the ps tasks get this long to "
                   "start listening. Default: 600 with --kubernetes and in "
                   "manifests (image pulls), else unset (the strategies' 30 and 60 s, and "
                   "30 s for a local cluster's ps tasks).")
flags.DEFINE_float("stall_timeout", None,
                   "Seconds a task whose port accepts connections may go without answering an "
                   "RPC before it is treated as dead (a stopped process, a hung machine): the "
                   "default stall_timeout of the parameter-server and SGP strategies its "
                   "worker commands make (TFDIST_STALL_TIMEOUT). A ps drops a silent worker "
                   "after it (soft sync and async go on, hard sync fails naming it); a worker "
                   "whose ps, or SGP peer, is silent that long ends with an error naming it. "
                   "Default: the "
                   "strategies' 60 s (or their stall_timeout argument).")
flags.DEFINE_float("exit_after_workers_gone", None,
                   "ps tasks: exit once every worker has answered and then none has for this "
                   "many seconds, so that a Kubernetes job ends by itself. Default: 660 with "
                   "--kubernetes and in manifests, else serve until SIGTERM.")


@flags.validator("timeout", message="--timeout must be a positive number of seconds")
def _check_timeout(value):
    return value is None or value > 0


@flags.validator("connect_timeout",
                 message="--connect_timeout must be a positive number of seconds")
def _check_connect_timeout(value):
    return value is None or 0 < value < float("inf")


@flags.validator("stall_timeout",
                 message="--stall_timeout must be a positive number of seconds")
def _check_stall_timeout(value):
    return value is None or 0 < value < float("inf")


@flags.validator("exit_after_workers_gone",
                 message="--exit_after_workers_gone must be a positive number of seconds")
def _check_exit_after_workers_gone(value):
    return value is None or 0 < value < float("inf")


def _connect_timeout():
    """--connect_timeout, or its Kubernetes default, or None."""
    from tfdist.cluster.kubernetes import CONNECT_TIMEOUT

    if FLAGS.connect_timeout is not None:
        return FLAGS.connect_timeout
    return CONNECT_TIMEOUT if FLAGS.kubernetes else None


def _stall_timeout_env():
    """The environment that carries --stall_timeout to the strategies of a worker's
    command (empty without the flag)."""
    from tfdist.cluster.network import STALL_TIMEOUT_ENV

    if FLAGS.stall_timeout is None:
        return {}
    return {STALL_TIMEOUT_ENV: repr(FLAGS.stall_timeout)}


def _workers_gone_grace():
    """--exit_after_workers_gone, or its Kubernetes default, or None."""
    from tfdist.cluster.kubernetes import WORKERS_GONE_GRACE

    if FLAGS.exit_after_workers_gone is not None:
        return FLAGS.exit_after_workers_gone
    return WORKERS_GONE_GRACE if FLAGS.kubernetes else None


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


def _check_links():
    """Prints the rates pairs of workers get at once on the job's network; 1 where it cannot
    be measured (said why), else None."""
    from tfdist.launch.isolation import IsolationUnavailable
    from tfdist.launch.links import measure_links

    workers = max(2, FLAGS.num_workers)
    try:
        rates = measure_links(FLAGS.bandwidth, num_workers=workers, topology=FLAGS.topology,
                              isolate_network="auto" if FLAGS.isolate_network else False,
                              **({} if FLAGS.timeout is None else {"timeout": FLAGS.timeout}))
    except KeyboardInterrupt:
        print("[tfdist-launch] SIGINT; every task stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    except (IsolationUnavailable, RuntimeError) as e:
        print(f"[tfdist-launch] --check_links: cannot measure the links: {e}", file=sys.stderr)
        return 1
    print(f"[tfdist-launch] links of {workers} workers: {rates.text()}", file=sys.stderr,
          flush=True)
    return None


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
                               outbound_network="auto" if FLAGS.outbound_network else False,
                               topology=FLAGS.topology, env=_stall_timeout_env(),
                               preload=FLAGS.preload,
                               **({} if FLAGS.connect_timeout is None
                                  else {"startup_timeout": FLAGS.connect_timeout}))
    except ValueError as e:
        raise app.UsageError(
            str(e).replace("`bandwidth`", "--bandwidth").replace("`topology`", "--topology")
            .replace("`isolate_network` 'auto' or True. Received: isolate_network=False",
                     "the private network. Received: --noisolate_network")) from None

    if FLAGS.check_links:
        status = _check_links()
        if status:
            return status
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


# The manifests' arguments that are flags of another name, for the CLI's messages.
_MANIFEST_FLAGS = {"kind": "k8s_kind", "command": "the command after `--`"}


def _as_flags(message):
    """A `manifests` error, in flag names: `cpu` -> --cpu."""
    import re

    def flag(match):
        name = _MANIFEST_FLAGS.get(match.group(1), match.group(1))
        return name if name.startswith("the ") else f"--{name}"

    return re.sub(r"`([a-z_]+)`", flag, message)


def _run_as_user():
    value = FLAGS.run_as_user.strip()
    if value == "image":
        return None
    if value.isascii() and value.isdigit() and int(value) >= 1:
        return int(value)
    raise app.UsageError(f"--run_as_user must be a user id >= 1 (pods run as non-root), or "
                         f"'image' for the image's own non-root user. Received: "
                         f"{FLAGS.run_as_user!r}")


def _write_manifests(command):
    from tfdist.cluster.kubernetes import CONNECT_TIMEOUT
    from tfdist.cluster.kubernetes import WORKERS_GONE_GRACE
    from tfdist.launch.kubernetes import manifests
    from tfdist.launch.kubernetes import to_yaml

    if not FLAGS.image:
        raise app.UsageError("--kubernetes_manifest needs --image=IMAGE (an image with tfdist "
                             "and your script installed)")
    if not command:
        raise app.UsageError("--kubernetes_manifest needs the worker command after `--`, "
                             "e.g. `-- python train.py`")
    try:
        docs = manifests(
            FLAGS.name, FLAGS.image, command, num_ps=FLAGS.num_ps,
            num_workers=FLAGS.num_workers, namespace=FLAGS.namespace, port=FLAGS.port,
            kind=FLAGS.k8s_kind, cpu=FLAGS.cpu, memory=FLAGS.memory, ps_cpu=FLAGS.ps_cpu,
            ps_memory=FLAGS.ps_memory, connect_timeout=FLAGS.connect_timeout or CONNECT_TIMEOUT,
            worker_retries=FLAGS.worker_retries, max_failed_workers=FLAGS.max_failed_workers,
            exit_after_workers_gone=FLAGS.exit_after_workers_gone or WORKERS_GONE_GRACE,
            run_as_user=_run_as_user(), ps_imports=FLAGS.ps_import,
            stall_timeout=FLAGS.stall_timeout)
    except ValueError as e:
        raise app.UsageError(_as_flags(str(e))) from None
    text = to_yaml(docs, header=(
        f"tfdist job {FLAGS.name!r}, written by tfdist-launch --kubernetes_manifest.\n"
        "The tfdist.job-token label admits the job's own pods through its NetworkPolicy:\n"
        "a speed-bump, not a secret (whoever can read this file or the pods can copy it).\n"
        "It is drawn anew each time this file is written: delete a running job before\n"
        "you apply a new file for it."))
    if FLAGS.kubernetes_manifest == "-":
        sys.stdout.write(text)
    else:
        with open(FLAGS.kubernetes_manifest, "w") as f:
            f.write(text)
        print(f"[tfdist-launch] wrote {len(docs)} manifests to {FLAGS.kubernetes_manifest}; "
              f"run: kubectl apply -f {FLAGS.kubernetes_manifest}", file=sys.stderr)
    return 0


def _serve_ps(config, command):
    if command:
        raise app.UsageError(f"a ps task runs no command. Received: {' '.join(command)}")
    from tfdist.launch.server import WorkersGone
    from tfdist.launch.server import ps_threads
    from tfdist.launch.server import serve

    try:
        threads = ps_threads(config, FLAGS.ps_threads)
    except ValueError as e:
        raise app.UsageError(str(e).replace("`threads`", "--ps_threads")) from None
    workers_gone = None
    grace = _workers_gone_grace()
    if grace is not None:
        addresses = {f"/job:{job}/task:{i}": config.address(job, i)
                     for job, i in config.training_tasks}
        if not addresses:
            raise app.UsageError("--exit_after_workers_gone watches the workers' ports: give "
                                 "--worker_hosts (or a TF_CONFIG that lists them)")
        task = f"/job:ps/task:{config.task_index}"
        workers_gone = WorkersGone(
            addresses, grace=grace, startup=_connect_timeout() or 30.0,
            log=lambda line: print(f"[tfdist-launch] {task}: {line}", file=sys.stderr,
                                   flush=True))
    _import_modules(FLAGS.ps_import)
    code = serve(config, threads=threads, workers_gone=workers_gone, imports=FLAGS.ps_import)
    # TensorFlow's native teardown (the gRPC server, the eager context) takes seconds - over
    # 5 s on busy cores, where a launcher gives up and SIGKILLs the task. A ps has nothing
    # to save: say what there is to say, and end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_task(config, command):
    """Runs a worker's (chief's) command with TF_CONFIG set, once its ps tasks answer."""
    from tfdist.cluster import TaskUnreachableError
    from tfdist.cluster import wait_for_tasks
    from tfdist.cluster.network import CONNECT_TIMEOUT_ENV
    from tfdist.cluster.network import INIT_TIMEOUT_ENV
    from tfdist.launch.kubernetes import PS_UNREACHABLE_EXIT_CODE
    from tfdist.launch.local import TASK_ENVIRONMENT

    if not command:
        raise app.UsageError(f"a {config.task_type} task needs its command after `--`, e.g. "
                             "`-- python train.py`")
    env = dict(os.environ)
    for key, value in TASK_ENVIRONMENT.items():
        env.setdefault(key, value)
    env["TF_CONFIG"] = config.to_json()
    env.update(_stall_timeout_env())
    timeout = _connect_timeout()
    if timeout is not None:
        env[CONNECT_TIMEOUT_ENV] = env[INIT_TIMEOUT_ENV] = repr(timeout)
        ps = {f"/job:ps/task:{i}": a for i, a in enumerate(config.cluster.get("ps", ()))}
        try:
            wait_for_tasks(ps, timeout=timeout)
        except TaskUnreachableError as e:
            # A distinct code, so that a Kubernetes Job can fail at once rather than retry a
            # worker whose ps is gone for good.
            print(f"[tfdist-launch] the ps tasks are not there: {e} (--connect_timeout); "
                  f"exit code {PS_UNREACHABLE_EXIT_CODE}", file=sys.stderr)
            return PS_UNREACHABLE_EXIT_CODE
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise app.UsageError(f"cannot run {command[0]!r}: {e.strerror}") from None


def main(argv):
    command = _worker_command(argv)
    if FLAGS.bandwidth is not None and not FLAGS.local:
        raise app.UsageError(f"--bandwidth limits the private network of a --local cluster; "
                             f"a cluster of separate machines runs on their own network. "
                             f"Received: --bandwidth={FLAGS.bandwidth} without --local")
    if FLAGS.check_links and not FLAGS.local:
        raise app.UsageError("--check_links measures a --local cluster's network. Received: "
                             "--check_links without --local")
    if FLAGS.topology is not None and not FLAGS.local:
        raise app.UsageError(f"--topology connects the tasks of a --local cluster; a cluster "
                             f"of separate machines runs on their own network. Received: "
                             f"--topology={FLAGS.topology} without --local")
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
        return _serve_ps(config, command)
    return _run_task(config, command)


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
