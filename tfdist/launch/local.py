"""A whole cluster on this machine: ps servers plus worker processes, in one call.

```python
with tfdist.launch.LocalCluster(["python", "train.py"], num_ps=1, num_workers=3) as cluster:
    result = cluster.wait()
print(result.returncode, result.failed_task)
```

Every task is its own process group started with its own TF_CONFIG on free localhost ports,
inside a private network namespace where the system allows one (`tfdist.launch.isolation`):
nothing outside the cluster can reach its servers, and the tasks reach out (downloads, logging
services) through slirp4netns where it is installed.
Output lines are prefixed with the task (`[worker:1] ...`); the latest `max_lines` of them are
kept in `lines` (a long run's output does not pile up in memory). The cluster is torn down on the
first failing task (after `grace_period`), on `timeout`, on Ctrl-C, and on leaving the `with`
block: no process or open port outlives it.
"""

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict
from typing import Optional

from tfdist._args import check_bool
from tfdist._args import check_int
from tfdist._args import check_seconds
from tfdist._process import die_with
from tfdist.cluster import ClusterConfig
from tfdist.cluster import TaskUnreachableError
from tfdist.cluster import pick_free_ports
from tfdist.cluster import wait_for_tasks
from tfdist.cluster.network import JOB_ID_ENV
from tfdist.launch.isolation import IsolationUnavailable
from tfdist.launch.isolation import SwitchedNetwork
from tfdist.launch.isolation import loopback_resolvers
from tfdist.launch.isolation import parse_bandwidth
from tfdist.launch.isolation import private_network
from tfdist.launch.isolation import switched_address
from tfdist.launch.preload import ForkedTask
from tfdist.launch.preload import command_form

# Set for every task: blocking ops across clients hang with streaming enqueue (the ps runs
# each client's eager ops on one thread, so one blocked op freezes every client).
TASK_ENVIRONMENT = {
    "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE": "False",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


def _signal_name(returncode):
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


@dataclasses.dataclass
class LocalClusterResult:
    """How a local cluster ended."""

    returncode: int
    failed_task: Optional[str] = None
    message: str = ""
    task_returncodes: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)
    timed_out: bool = False


class _Task:
    """One child process and the thread that hands its output lines to `record`."""

    def __init__(self, name, process, record):
        self.name = name
        self.process = process  # a subprocess.Popen, or a preload.ForkedTask
        self._reader = threading.Thread(
            target=self._pump, args=(record,), daemon=True, name=f"pump-{name}")
        self._reader.start()

    def _pump(self, record):
        for raw in iter(self.process.stdout.readline, b""):
            record(self.name, raw.decode("utf-8", errors="replace").rstrip("\n"))
        self.process.stdout.close()

    def signal(self, sig):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self, timeout):
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.process.poll()

    def finish_output(self, timeout=2.0):
        self._reader.join(timeout)


class LocalCluster:
    """Starts and supervises a ps/worker cluster on localhost.

    Args:
      command: argv of the worker program (a leading `python` / `python3` is replaced by this
        interpreter, so workers run in the same environment as the launcher).
      num_ps: number of ps tasks (0 for an all-reduce job).
      num_workers: number of worker tasks, at least 1.
      timeout: seconds the whole run may take, or None.
      grace_period: seconds the other tasks get to finish on their own after one fails.
      env: extra environment variables for every task. `TFDIST_JOB_ID` is set to a new id
        per cluster unless given here: its tasks, restarted ones included, are one job (a
        run on the ps tasks belongs to one job).
      output: where prefixed output lines go (`sys.stdout` by default, None for nowhere).
      max_lines: how many of the latest output lines `lines` keeps, as `(task, text)`; older
        ones are dropped (counted in `dropped_lines`), so that memory stays bounded however
        long and chatty the run.
      host: the host name written into TF_CONFIG.
      ps_threads: inter-op threads of each ps server.
      ps_imports: modules each ps task imports before it serves (custom optimizers,
        schedules, constraints or staleness functions the ps must rebuild).
      startup_timeout: seconds the ps tasks get to start listening.
      cwd: working directory of the tasks.
      stop_on_failure: stop every task when one fails (default). With False the other
        workers run on (a fault-tolerant job), and the run still ends non-zero naming the
        first task that failed.
      isolate_network: "auto" (default) runs the tasks in a private network namespace, or
        warns loudly where the system refuses one; True requires it; False runs them on the
        machine's network.
      bandwidth: None, or a rate such as "100mbit" or "1gbit" that the private network is
        limited to (tc's token bucket), so that communication costs show on one machine: on
        a switched network (the default with a bandwidth) every task's own link, each way;
        on a hub the one loopback that every task's traffic crosses, so the tasks share its
        rate. Needs the private network (and `tc`): refused with `isolate_network=False`, an
        error where the system refuses.
      topology: how the tasks are connected. "switched": each task in a private network
        namespace of its own, with an address of its own on a bridge (`SwitchedNetwork`), as
        machines on a switch; `host` is then ignored. "hub": every task in one private
        namespace, on its loopback. None (default): "switched" with a `bandwidth`, else
        "hub".
      outbound_network: "auto" (default) gives the private network outbound connections
        through slirp4netns where it is installed (nothing can connect in); False keeps it
        sealed: the tasks reach each other and nothing else.
      preload: False (default) starts every task as a fresh interpreter. True forks each
        Python task (`python script.py ...`, `python -m module ...`) from a server that has
        imported TensorFlow, Keras and tfdist once (`tfdist.launch.preload`, one server per
        launcher process): about 6 s of CPU less per task. The interpreter's start-up
        settings (hash seed, `PYTHON*` variables) and the variables a preloaded module reads
        at import come from the first cluster started with `preload`.
    """

    def __init__(self, command, num_ps=1, num_workers=1, timeout=None, grace_period=3.0,
                 env=None, output=sys.stdout, host="localhost", ps_threads=None,
                 startup_timeout=30.0, cwd=None, stop_on_failure=True,
                 isolate_network="auto", ps_imports=(), bandwidth=None, max_lines=10000,
                 outbound_network="auto", topology=None, preload=False):
        if not command or isinstance(command, str):
            raise ValueError(f"`command` must be a non-empty argv list. Received: {command!r}")
        check_int("num_ps", num_ps, "an integer >= 0", low=0)
        check_int("num_workers", num_workers, "an integer >= 1", low=1)
        check_int("max_lines", max_lines, "an integer >= 1", low=1)
        check_seconds("timeout", timeout, allow_none=True)
        command = list(command)
        if os.path.basename(command[0]) in ("python", "python3"):
            command[0] = sys.executable
        self.command = command
        self.timeout = timeout
        self.grace_period = grace_period
        self.startup_timeout = startup_timeout
        self.ps_threads = ps_threads
        if isinstance(ps_imports, str):
            raise ValueError(f"`ps_imports` must be a list of module names. Received: "
                             f"{ps_imports!r}")
        self.ps_imports = list(ps_imports)
        self.env = dict(env or {})
        self.env.setdefault(JOB_ID_ENV, uuid.uuid4().hex)
        self.output = output
        self.cwd = cwd
        self.stop_on_failure = stop_on_failure
        if isolate_network not in ("auto", True, False):
            raise ValueError(f"`isolate_network` must be 'auto', True or False. Received: "
                             f"{isolate_network!r}")
        self.isolate_network = isolate_network
        if outbound_network not in ("auto", False):
            raise ValueError(f"`outbound_network` must be 'auto' or False. Received: "
                             f"{outbound_network!r}")
        self.outbound_network = outbound_network
        self.preload = check_bool("preload", preload)
        if bandwidth is not None:
            parse_bandwidth(bandwidth)
            if isolate_network is False:
                raise ValueError(f"`bandwidth`={bandwidth!r} limits the cluster's private "
                                 "network: it needs `isolate_network` 'auto' or True. "
                                 "Received: isolate_network=False")
        self.bandwidth = bandwidth
        if topology not in (None, "switched", "hub"):
            raise ValueError(f"`topology` must be 'switched', 'hub' or None. Received: "
                             f"{topology!r}")
        if topology is None:
            topology = "switched" if bandwidth is not None else "hub"
        if topology == "switched" and isolate_network is False:
            raise ValueError("`topology`='switched' connects private network namespaces: it "
                             "needs `isolate_network` 'auto' or True. Received: "
                             "isolate_network=False")
        self.topology = topology
        self.network = None
        ports = pick_free_ports(num_ps + num_workers)
        hosts = ([switched_address(slot) for slot in range(num_ps + num_workers)]
                 if topology == "switched" else [host] * (num_ps + num_workers))
        self.config = ClusterConfig.from_hosts(
            ps_hosts=[f"{h}:{p}" for h, p in zip(hosts[:num_ps], ports[:num_ps])],
            worker_hosts=[f"{h}:{p}" for h, p in zip(hosts[num_ps:], ports[num_ps:])])
        self._lines = collections.deque(maxlen=max_lines)
        self._recorded = 0
        self._lock = threading.Lock()
        self._tasks: Dict[str, _Task] = {}
        self._start_time = None

    # Lifecycle ----------------------------------------------------------------------------

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def _spawn(self, name, argv, config):
        env = dict(os.environ)
        env.update(TASK_ENVIRONMENT)
        env.update(self.env)
        env["TF_CONFIG"] = config.to_json()
        network, launcher = self.network, os.getpid()
        death_signal = signal.SIGKILL if config.task_type == "ps" else signal.SIGTERM
        # The task's place on a switched network: the ps tasks first, then the workers.
        slot = config.task_index + (config.num_ps if config.task_type == "worker" else 0)

        if self.preload and command_form(argv) is not None:
            process = ForkedTask(argv, env, self.cwd, death_signal, network_fd=(
                network.tasks[slot].fd if isinstance(network, SwitchedNetwork)
                else None if network is None else network.fd),
                server_environment=TASK_ENVIRONMENT)
        else:
            def preexec():
                die_with(launcher, death_signal)
                if isinstance(network, SwitchedNetwork):
                    network.enter_in_child(slot)
                elif network is not None:
                    network.enter_in_child()

            process = subprocess.Popen(
                argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
        self._tasks[name] = _Task(name, process, self._record)

    def start(self):
        """Starts the ps tasks, waits until they listen, then starts the workers."""
        self._start_time = time.monotonic()
        try:
            if self.isolate_network and self.network is None:
                try:
                    if self.topology == "switched":
                        self.network = SwitchedNetwork(
                            self.config.num_ps + len(self.config.cluster["worker"]))
                    else:
                        self.network = private_network(
                            required=self.isolate_network is True or self.bandwidth is not None)
                except IsolationUnavailable as e:
                    if self.bandwidth is None and self.topology == "hub":
                        raise
                    needs = (f"`bandwidth`={self.bandwidth!r} limits"
                             if self.bandwidth is not None else "`topology`='switched' needs")
                    message = f"{needs} a private network namespace: {e}"
                    raise IsolationUnavailable(e.errno, message) from None
                if self.bandwidth is not None:
                    self.network.limit_bandwidth(self.bandwidth)
                if self.network is not None:
                    self._announce(self._connect_outbound())
            for i in range(self.config.num_ps):
                argv = [sys.executable, "-m", "tfdist.launch", "--job_name=ps",
                        f"--task_index={i}", "--ps_hosts=" + ",".join(self.config.cluster["ps"])]
                if self.ps_threads:
                    argv.append(f"--ps_threads={self.ps_threads}")
                argv += [f"--ps_import={module}" for module in self.ps_imports]
                self._spawn(f"ps:{i}", argv, self.config.with_task("ps", i))
            if self.config.num_ps:
                self._wait_for_ps()
            for i in range(len(self.config.cluster["worker"])):
                self._spawn(f"worker:{i}", self.command, self.config.with_task("worker", i))
        except BaseException:
            self.stop()
            raise

    def _connect_outbound(self):
        """Gives the private network its way out where it can; says what the tasks reach."""
        why_not = ("--nooutbound_network / outbound_network=False keeps it sealed"
                   if self.outbound_network is False else self.network.connect_outbound())
        if why_not is None:
            resolvers = loopback_resolvers()
            return ("the tasks run in a private network: they reach each other, and the "
                    "outside through slirp4netns (outgoing connections only; nothing can "
                    "connect in, and this machine's loopback services are out of reach"
                    + (f", its name server {resolvers[0]} too: host names do not resolve "
                       "there" if resolvers else "") + ")")
        where = ("private networks joined by a switch of their own"
                 if self.topology == "switched" else "a private network with only a loopback")
        return (f"the tasks run in {where}: they reach each "
                f"other, and nothing else (no downloads, no logging services: {why_not}); "
                "--noisolate_network / isolate_network=False gives them this machine's "
                "network")

    def _wait_for_ps(self):
        addresses = {f"/job:ps/task:{i}": a for i, a in enumerate(self.config.cluster["ps"])}
        deadline = time.monotonic() + self.startup_timeout
        while True:
            for i in range(self.config.num_ps):
                code = self._tasks[f"ps:{i}"].process.poll()
                if code is not None:
                    raise TaskUnreachableError(
                        f"/job:ps/task:{i} exited with {_signal_name(code)} before it listened "
                        f"at {self.config.cluster['ps'][i]}")
            try:
                with self.network.inside() if self.network else contextlib.nullcontext():
                    wait_for_tasks(addresses,
                                   timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                return
            except TaskUnreachableError:
                if time.monotonic() > deadline:
                    raise

    @property
    def lines(self):
        """The latest output lines, `(task, text)`, oldest first: a list of its own."""
        with self._lock:
            return list(self._lines)

    @property
    def dropped_lines(self):
        """How many output lines were dropped from `lines` to keep it within `max_lines`."""
        with self._lock:
            return self._recorded - len(self._lines)

    def _record(self, task, line):
        with self._lock:
            self._lines.append((task, line))
            self._recorded += 1
            if self.output is not None:
                self.output.write(f"[{task}] {line}\n")
                self.output.flush()

    @property
    def task_names(self):
        return list(self._tasks)

    def pid(self, task):
        """The process id of a task, e.g. `pid("worker:1")`."""
        return self._tasks[task].process.pid

    def returncode(self, task):
        """The exit code of `task`'s process (its latest, after a `restart`), None while it
        runs; negative: the signal that ended it."""
        return self._tasks[task].process.poll()

    def restart(self, task):
        """Starts worker `task` again, as a scheduler restarts a preempted worker.

        The task is SIGKILLed if it still runs, then its program starts again with the same
        TF_CONFIG (same address); its output goes on under the same name, and only the new
        process's exit counts in the run's result. Call it before `wait()`. ps tasks cannot be
        restarted: a restarted ps would have lost its shard of the model.
        """
        workers = sorted(name for name in self._tasks if name.startswith("worker:"))
        if task not in workers:
            raise ValueError(f"`task` must be one of this cluster's workers {workers}. "
                             f"Received: {task!r}")
        old = self._tasks[task]
        old.signal(signal.SIGKILL)
        old.reap(5.0)
        old.finish_output()
        index = int(task.partition(":")[2])
        self._spawn(task, self.command, self.config.with_task("worker", index))

    def wait(self, timeout=None):
        """Supervises the run until it ends, and tears the cluster down.

        Returns:
          A `LocalClusterResult`: returncode 0 when every worker exited 0, else non-zero with
          `failed_task` naming the first task that failed (or `timed_out`).
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else self._start_time + timeout
        workers = [t for name, t in self._tasks.items() if name.startswith("worker")]
        ps_tasks = [t for name, t in self._tasks.items() if name.startswith("ps")]
        result = None
        first_failure = None
        try:
            while result is None:
                failed = [t for t in workers if t.process.poll() not in (None, 0)]
                failed += [t for t in ps_tasks if t.process.poll() is not None]
                if failed and first_failure is None:
                    task = failed[0]
                    code = task.process.returncode
                    # As a POSIX shell reports it: a task killed by signal n gives 128 + n.
                    first_failure = LocalClusterResult(
                        returncode=code if code and code > 0 else 128 - code if code else 1,
                        failed_task=task.name,
                        message=f"task {task.name} exited with {_signal_name(code)}")
                    if self.stop_on_failure or task in ps_tasks:
                        self._announce(f"{first_failure.message}; stopping the other tasks")
                        self._grace(workers)
                        result = first_failure
                        continue
                    self._announce(f"{first_failure.message}; the other workers go on")
                if all(t.process.poll() is not None for t in workers):
                    result = first_failure or LocalClusterResult(
                        returncode=0, message="all workers finished")
                elif deadline is not None and time.monotonic() > deadline:
                    running = [t.name for t in workers if t.process.poll() is None]
                    result = LocalClusterResult(
                        returncode=124, timed_out=True, failed_task=running[0] if running else None,
                        message=f"timed out after {timeout:g} s with {', '.join(running)} "
                                "still running")
                    self._announce(result.message + "; stopping every task")
                else:
                    time.sleep(0.05)
        finally:
            self.stop()
        result.task_returncodes = {name: t.process.returncode for name, t in self._tasks.items()}
        return result

    def _grace(self, workers):
        deadline = time.monotonic() + self.grace_period
        while time.monotonic() < deadline and any(t.process.poll() is None for t in workers):
            time.sleep(0.05)

    def _announce(self, message):
        self._record("tfdist-launch", message)

    def stop(self, kill_after=5.0):
        """Stops every task that still runs: SIGTERM, then SIGKILL after `kill_after` s."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.signal(signal.SIGTERM)
        deadline = time.monotonic() + kill_after
        for task in tasks:
            if task.reap(max(0.0, deadline - time.monotonic())) is None:
                task.signal(signal.SIGKILL)
                task.reap(5.0)
            else:
                # The group may hold grandchildren (a shell's children) that outlived the leader.
                task.signal(signal.SIGKILL)
        for task in tasks:
            try:
                os.killpg(task.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            task.finish_output()
        if self.network is not None:
            self.network.close()
            self.network = None


def run_local_cluster(command, **kwargs):
    """Runs `command` on a local cluster until it ends; returns a `LocalClusterResult`."""
    cluster = LocalCluster(command, **kwargs)
    with cluster:
        return cluster.wait()
