"""Serve one ps task: TensorFlow's gRPC server, run until SIGTERM or SIGINT.

The server is started through the ps process's own eager context
(`tf.config.experimental_connect_to_cluster`), not as a bare `tf.distribute.Server`. TF 2.21's
eager service replaces the server's collective executor manager when it creates a client
context while it holds none (`EagerServiceImpl::CreateContext`), and it checks for "none" before
it registers the new context. When two workers connect at the same moment, both replace the
manager; the first worker's context keeps a pointer to the freed one, and the next eager op
kernel that context builds crashes the ps with SIGSEGV. Started this way, the ps registers its
own (master) context before it serves anyone, no client context ever replaces the manager, and
workers may connect in any order (tests/launch/server_test.py).
"""

import concurrent.futures
import signal
import sys
import threading
import time

from tfdist._args import check_seconds

# Every blocking op (a worker waiting for its reply, the updater waiting for pushes, the
# control loop) holds one ps thread until it returns; with the default pool (the core count)
# two waiting workers freeze the ps.
DEFAULT_PS_THREADS = 64
# Seconds `serve()` waits, as it returns, for the ps service's threads (its control loop,
# liveness watcher and current run) to end.
SHUTDOWN_TIMEOUT = 30.0


def threads_needed(config):
    """The fewest inter-op threads a ps of `config`'s cluster can serve with.

    Each worker may hold one thread waiting for its reply and one for a hello answer; the
    updater, the control loop and the service's own ops hold a few more.
    """
    return 2 * config.num_workers + 8


def ps_threads(config, threads=None):
    """`threads` (None: the default, raised to what the cluster needs), checked."""
    needed = threads_needed(config)
    if threads is None:
        return max(DEFAULT_PS_THREADS, needed)
    if threads < needed:
        raise ValueError(
            f"`threads`={threads} is too few for a ps of a cluster with {config.num_workers} "
            f"workers: every waiting worker holds one; it needs at least {needed}")
    return threads


def start_server(config, threads=None):
    """Starts the gRPC server of `config`'s ps task in this process; returns its target.

    The server knows only its own task: ps tasks never call out to other tasks, and each
    worker tells the ps its own address when it connects. The process can start one server;
    it serves until the process exits.
    """
    if config.task_type != "ps":
        raise ValueError(f"`start_server` serves ps tasks. Received task type: "
                         f"{config.task_type!r}")
    import tensorflow as tf

    from tfdist import _tf_compat

    threads = ps_threads(config, threads)
    try:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError as e:
        raise RuntimeError(
            "`start_server` must run before TensorFlow's runtime starts in this process (it "
            f"sets the ps thread pool to {threads} threads): {e}") from None
    protocol = config.rpc_layer or "grpc"
    spec = tf.train.ClusterSpec({"ps": {config.task_index: config.task_address}})
    tf.config.experimental_connect_to_cluster(spec, job_name="ps", task_index=config.task_index,
                                              protocol=protocol)
    # The server starts with the context, which TensorFlow otherwise starts lazily.
    _tf_compat.start_eager_context()
    return f"{protocol}://{config.task_address}"


class WorkersGone:
    """Tells a ps task when the workers of its job are gone for good.

    A Kubernetes job ends when its workers' Job completes, but nothing stops a ps pod: its
    server would serve (and hold its node) until someone deletes it. With a `WorkersGone`,
    `serve` ends the ps by itself: it probes the training tasks' servers with an RPC under a
    deadline, as the ps's liveness watcher does (`tfdist.cluster.probe.ServerProbe`: a
    stopped process, or a hung machine, whose port still accepts connections, does not
    answer), and once none has answered for `grace` seconds, the job is over:

    * every worker was seen answering, then none for `grace` s: exit code 0;
    * some were never seen: the ps waits until `startup + grace` s after its start for them
      (pods pulling images, pending for room), then exits 0 if any worker came and went;
    * no worker ever answered by then: exit code 1 (nothing was trained).

    While one worker is away (its pod retried or moved off a drained node) the others keep
    the ps up; only when every worker is away at once does `grace` (2 minutes in the
    manifests) decide, so it must cover a pod's restart: the Job waits 10 s, 20 s, 40 s...
    before each retry of an index, then the pod starts TensorFlow. `grace` is also how long
    a ps outlives the last worker.

    Args:
      addresses: `{task name: "host:port"}` of the training tasks (chief and workers).
      grace: seconds without any answering worker that end the job.
      startup: seconds the tasks get to appear at all (image pulls, scheduling).
      interval: seconds between probes (None: half of `grace`, at most 2).
      log: called with a line when every task has been seen (None: nowhere).
      probe: `probe(address) -> bool`, whether the server at `address` answers (None: a
        `ServerProbe`'s answer; tests pass their own).
      clock: for tests (`time.monotonic`).
    """

    def __init__(self, addresses, grace, startup, interval=None, log=None, probe=None,
                 clock=None):
        if interval is None and isinstance(grace, (int, float)):
            interval = min(2.0, grace / 2)
        for arg, value in (("grace", grace), ("startup", startup), ("interval", interval)):
            check_seconds(arg, value)
        if not addresses:
            raise ValueError("`addresses` must name at least one training task to watch")
        self.addresses = dict(addresses)
        self.grace, self.startup, self.interval = grace, startup, interval
        if probe is None:
            from tfdist.cluster.probe import ServerProbe  # TensorFlow: imported by a ps only

            self._server_probe = ServerProbe()
            probe = self._answers
        self._probe = probe
        self._clock = clock or time.monotonic
        self._log = log or (lambda line: None)
        self.started = self._last_heard = self._clock()
        self.seen = set()
        self._tasks = {address: name for name, address in self.addresses.items()}

    def _answers(self, address):
        from tfdist.cluster.probe import ANSWERED

        return self._server_probe(address, self._tasks[address]) == ANSWERED

    def _listening(self):
        """The names of the tasks whose server answers (or listens, for a test's probe)."""
        names = list(self.addresses)
        # Probed together: one unreachable or stopped server must not hold up the others.
        with concurrent.futures.ThreadPoolExecutor(min(32, len(names))) as pool:
            answers = list(pool.map(lambda n: self._probe(self.addresses[n]), names))
        return {name for name, answer in zip(names, answers) if answer}

    def poll(self):
        """Probes once. Returns None (serve on), or `(exit_code, reason)`."""
        now = self._clock()
        listening = self._listening()
        if listening:
            self._last_heard = now
            everyone_before = len(self.seen) == len(self.addresses)
            self.seen |= listening
            if not everyone_before and len(self.seen) == len(self.addresses):
                self._log(f"every training task ({len(self.addresses)}) has answered; the ps "
                          f"exits once none has for {self.grace:g} s")
        quiet = now - self._last_heard
        if quiet < self.grace:
            return None
        if len(self.seen) == len(self.addresses):
            return 0, (f"every training task has come and gone (none answered for "
                       f"{quiet:.0f} s): the job is over")
        if now - self.started < self.startup + self.grace:
            return None  # some may still be pulling their image, or waiting for a node
        missing = [f"{name} at {self.addresses[name]}" for name in self.addresses
                   if name not in self.seen]
        never = (f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                    else ""))
        if self.seen:
            return 0, (f"{len(self.seen)} of {len(self.addresses)} training tasks came and "
                       f"went (none answered for {quiet:.0f} s); {never} never answered "
                       f"within {self.startup + self.grace:g} s: the job is over")
        return 1, (f"no training task answered within {now - self.started:.0f} s of the ps's "
                   f"start ({never}): giving up")


def serve(config, threads=None, ready_callback=None, workers_gone=None, imports=()):
    """Runs the ps task of `config` until SIGTERM or SIGINT, then returns 0.

    Beside the gRPC server runs the task's `PSService`, which updates its shard of every
    run the workers start (`tfdist.ps.service`).

    Args:
      config: the ps task's `ClusterConfig`.
      threads: inter-op threads (see `ps_threads`).
      ready_callback: called with the server's target once it serves.
      workers_gone: None, or a `WorkersGone` whose verdict also ends the task (with its exit
        code, and a line on stderr that says why).
      imports: the modules named with `--ps_import`: besides Keras's and tfdist's own, the
        only modules a worker's hello may ask the ps to import (custom optimizers,
        schedules, staleness functions); a hello naming any other is answered with an error.
    """
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    task = f"/job:ps/task:{config.task_index}"
    service = None
    try:
        target = start_server(config, threads)
        from tfdist.ps.service import PSService

        service = PSService(config, imports=imports).start()
        if ready_callback:
            ready_callback(target)
        next_probe = time.monotonic()
        while not stop.wait(0.5):
            if workers_gone is None or time.monotonic() < next_probe:
                continue
            verdict = workers_gone.poll()
            next_probe = time.monotonic() + workers_gone.interval
            if verdict is not None:
                code, reason = verdict
                print(f"[tfdist-launch] {task}: {reason}", file=sys.stderr, flush=True)
                return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if service is not None:
            try:
                ended = service.shutdown(SHUTDOWN_TIMEOUT)
            except Exception as e:  # not to hide what ended the task
                print(f"[tfdist-launch] {task}: stopping the ps service failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            else:
                if not ended:
                    print(f"[tfdist-launch] {task}: the ps service's threads did not end "
                          f"within {SHUTDOWN_TIMEOUT:g} s", file=sys.stderr, flush=True)
    return 0
