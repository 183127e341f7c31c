"""The ps side of the parameter-server engine: each ps task updates its own shard.

`PSService` runs in every ps process beside its gRPC server (`tfdist.launch.server`). Workers
say hello on its control queue with the spec of the shard (`tfdist.ps.spec.ShardSpec`:
variables, optimizer config, policy, compression); the first hello of a job starts a run,
a `ShardRun` whose thread:

1. waits until the chief has initialised the run's master variables,
2. builds the shard's update graph (`tfdist.ps.updater.ShardUpdateGraph`): the user's Keras
   optimizer rebuilt from its config on the masters of this shard (its slots are masters
   too, so the chief's checkpoints hold them); model averaging's outer optimizer likewise,
3. serves updates in-graph: one `tf.function` call takes pushes, applies the optimizer (or
   the average, or the outer optimizer to the average's change), and replies to the
   workers, update after update, and returns to Python only when a worker joins, leaves or
   dies (`tfdist.ps.membership`),
4. when every worker has left or died, ends (its resources are freed when a new run
   replaces it).

A run belongs to the job whose worker started it (`ShardSpec.job`): a worker of another job
is refused while it is in progress, and a worker of its job that died in it and comes back
after it finished (a chief restarted by its scheduler) is told so and takes its final
weights, instead of starting the job again (the run's masters outlive the next run's start,
for it to read); any other hello after a run ended starts a new one. A ps task cannot know
what the other shards hold: each answer says whether the chief said hello to the run and
whether it initialised it, and a worker whose answers do not describe one run refuses it
(`tfdist.ps.client.agree_on_one_run`) and tells them: such a run then ends. Which hellos
are answered with an error instead is `tfdist.ps.admission`'s.

Nothing in a ps waits for a particular worker: the chief's death does not stop a soft-sync
job. A worker's death is noticed by the service's `LivenessWatcher`; with N = M (hard sync)
the others are then stopped with an error that names it.
"""

import itertools
import logging
import threading
import time

import tensorflow as tf

from tfdist import compression as compression_lib
from tfdist.ps import protocol
from tfdist.ps import wire
from tfdist.ps.admission import claimed_sender
from tfdist.ps.admission import refusal
from tfdist.ps.admission import refused_import
from tfdist.ps.membership import BadControlMessage
from tfdist.ps.membership import LivenessWatcher
from tfdist.ps.membership import Membership
from tfdist.ps.membership import check_rank
from tfdist.ps.membership import control_message
from tfdist.ps.policies import policy_from_spec
from tfdist.ps.protocol import DIED
from tfdist.ps.protocol import EXPECTED
from tfdist.ps.protocol import LEFT
from tfdist.ps.protocol import LIVE
from tfdist.ps.shard_optimizer import RunFailed
from tfdist.ps.spec import ShardSpec
from tfdist.ps.updater import ShardUpdateGraph
from tfdist.ps.updater import shard_push_dtypes
from tfdist.ps.variables import is_initialized

log = logging.getLogger("tfdist")

# Numbers the runs of this process: two services of one process (a test's) never share a
# run's resources.
_run_numbers = itertools.count(1)


class ShardRun:
    """One run of one shard: its resources, its members, its update loop's thread.

    Args:
      service: the `PSService`.
      run: the run's name.
      spec: the `ShardSpec` of the worker that started the run.
    """

    def __init__(self, service, run, spec):
        self.service = service
        self.run = run
        self.spec = spec
        self.device = service.device
        self.num_workers = spec.num_workers
        self.policy = policy_from_spec(spec.policy)
        self.graph = None
        self.failure = None
        self.finished = threading.Event()
        self.handed_over = False  # to a worker back after it finished (`PSService._hand_over`)
        self.refused = None  # why a worker refused it before the chief initialised it
        self.chief_said_hello = False  # (rank 0's hello: it initialises the run only after)
        self.created = time.monotonic()
        self.stalls = {}  # rank: how long a worker the watcher found dead did not answer
        self.push_dtypes = shard_push_dtypes(protocol.ShardLayout(spec.variables),
                                             compression_lib.get(spec.compression))
        self.push_queue = protocol.open_push_queue(self.device, run, self.push_dtypes)
        self.reply_queues = [protocol.open_reply_queue(self.device, run, r)
                             for r in range(self.num_workers)]
        self.progress, self.masters = protocol.open_run_variables(self.device, run, spec)
        self.update_lock = protocol.open_update_lock(self.device, run)
        self.members = Membership(self.num_workers, service.lock, self.progress, self.device)
        self._thread = threading.Thread(target=self._run, name=f"tfdist-run-{run}",
                                        daemon=True)

    def start(self):
        self._thread.start()

    def admit(self, rank):
        """Under the service's lock: lets worker `rank` join; False if the run is ending."""
        return self.members.admit(rank, self.finished.is_set())

    @property
    def closing(self):
        return self.members.closing

    @property
    def job(self):
        """The id of the job the run belongs to (its first hello's)."""
        return self.spec.job

    def in_progress(self):
        """Under the service's lock: whether the run still takes workers."""
        return not (self.closing or self.finished.is_set())

    def finished_without(self, rank, job):
        """Whether worker `rank` of `job`, saying hello after this run ended, is one of its
        workers that never came back to it: the run is `job`'s, it finished (did not fail),
        at least one worker saw it through (left), and `rank` died in it (or never joined).

        Such a worker takes the run's final weights: a chief restarted by its scheduler
        after the others finished must not start the job again from its backup.
        """
        status = self.members.status
        return (self.finished.is_set() and self.failure is None and self.graph is not None
                and job == self.job and LEFT in status and status[rank] in (DIED, EXPECTED))

    # Control entries from other threads ---------------------------------------------------

    def send_control(self, kind, rank):
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(
                handle=self.push_queue,
                components=[tf.constant(kind, tf.int64), tf.constant(rank, tf.int32),
                            *[tf.zeros([0], d) for d in self.push_dtypes[2:]]])

    def _reply(self, rank, token, message, values=None):
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.reply_queues[rank], components=[
                tf.constant(token, tf.int64), tf.constant(message),
                self.progress.read_value() if is_initialized(self.progress)
                else tf.zeros([protocol.num_stats(self.num_workers)], tf.int64),
                values if values is not None else tf.zeros([0], tf.float32)])

    # The run --------------------------------------------------------------------------------

    def _run(self):
        try:
            self._wait_until_initialized()
            self.graph = ShardUpdateGraph(self.spec, self.device, self.push_queue,
                                          self.reply_queues, self.progress, self.masters,
                                          self.update_lock, task=self.service.task)
            self.graph.start_from_optimizer_step()
            self._serve()
        except RunFailed as e:
            self.failure = str(e)
            log.error("tfdist: %s: run %s failed: %s", self.service.task, self.run, e)
            self._drain_with_error(str(e))
        except Exception as e:  # The workers must hear of it, or they wait forever.
            self.failure = (f"the updater of {self.service.task} failed: "
                            f"{type(e).__name__}: {e}")
            log.exception("tfdist: %s: the updater of run %s failed", self.service.task,
                          self.run)
            self._drain_with_error(self.failure)
        finally:
            self._close()
            self.finished.set()

    def _close(self):
        """Closes the run's queues: a worker still waiting on them gets an error, not a hang."""
        with tf.device(self.device):
            for queue in (self.push_queue, *self.reply_queues):
                try:
                    tf.raw_ops.QueueCloseV2(handle=queue, cancel_pending_enqueues=True)
                except tf.errors.OpError:
                    pass

    def _wait_until_initialized(self):
        chief = f"the chief {self.spec.worker_tasks[0]} at {self.spec.worker_addresses[0]}"
        deadline = self.created + self.spec.init_timeout
        variables = list(self.masters.values())
        delay = 0.005
        while not all(is_initialized(v) for v in variables):
            if self.refused is not None:
                raise RunFailed(self.refused)
            if self.service.stopping and not all(is_initialized(v) for v in variables):
                raise RunFailed(f"{self.service.task} was stopped before {chief} initialised "
                                "the master variables")
            if time.monotonic() > deadline:
                raise RunFailed(f"{chief} did not initialise the master variables within "
                                f"{self.spec.init_timeout:g} s: is it running the same "
                                "model code? Or was this ps task started again, empty, "
                                "under a run the other ps tasks hold (the chief refuses "
                                "such a run)? Then restart the job from the chief's last "
                                "checkpoint")
            time.sleep(delay)
            delay = min(0.1, delay * 2)
        with tf.device(self.device):
            self.progress.assign(tf.zeros([protocol.num_stats(self.num_workers)], tf.int64))

    def _serve(self):
        graph, members = self.graph, self.members
        empty = graph.empty_state()
        state = empty
        while True:
            required = self.policy.required(len(members.live))
            if required == 0 and members.end_if_nobody_is_left(self.policy):
                graph.record_end(graph.progress[protocol.STAT_STEP],
                                 {**empty, "dropped": state["dropped"]})
                log.info("tfdist: %s: every worker left run %s", self.service.task, self.run)
                return
            if required == 0:
                continue  # a worker said hello as the run was about to end: it is expected
            state, event, rank = graph.serve_updates(tf.constant(required),
                                                     members.live_mask(), state)
            event, rank = int(event), int(rank)
            if not 0 <= rank < self.num_workers:
                # (Any process that reaches the port can enqueue one: it must not end the run.)
                log.error("tfdist: %s: ignored a control entry (tag %d) of rank %d: run %s has "
                          "ranks 0 to %d", self.service.task, -event, rank, self.run,
                          self.num_workers - 1)
                continue
            if event == -protocol.SYNC and not members.may_join(rank):
                # A worker counted out that woke (its fenced push ended its training, and
                # its exit syncs): told so, not taken back into the run.
                self._reply(rank, -1, graph.fenced_message())
                continue
            if event == -protocol.SYNC:
                # A worker joins (or re-joins): it is sent the current weights. A push of an
                # earlier process of its rank is still used, but not answered: the new
                # process waits for a reply to its own pushes only.
                graph.rejoin(tf.constant(rank), members.live_mask())
                members.join(rank)
                state = {**state, "released": tf.tensor_scatter_nd_update(
                    state["released"], [[rank]], [False])}
                graph.release_one(tf.constant(rank))
            elif event == -protocol.LEAVE:
                members.leave(rank)
            elif event == -protocol.DEAD:
                was = members.die(rank)
                if was is None:
                    continue
                graph.forget(tf.constant(rank))
                self._went_away(rank, was)
            elif event == -protocol.STOP:
                return
            if self.policy.defers_release:
                graph.release_caught_up(members.live_mask())
            # Fewer workers may now be enough for the pushes already taken.
            accepted = int(state["accepted"])
            if 0 < accepted >= self.policy.required(len(members.live)):
                graph.apply_now(members.live_mask(), state)
                state = empty

    def _went_away(self, rank, was):
        """Worker `rank` died (`was` LIVE) or never joined: the run fails under hard sync,
        else goes on without it."""
        task = f"{self.spec.worker_tasks[rank]} at {self.spec.worker_addresses[rank]}"
        stall = self.stalls.pop(rank, None)
        what = (f"{task} stopped answering ({stall})" if stall is not None and was == LIVE
                else f"{task} died" if was == LIVE else
                f"{task} never joined the run (its server did not answer within "
                f"init_timeout={self.spec.init_timeout:g} s)")
        if self.policy.fails_on_dead_worker:
            raise RunFailed(
                f"{what}, and with replicas_to_aggregate equal to the number of "
                "workers (hard sync) no update can be made without it")
        log.warning("tfdist: %s: %s; going on with %d worker(s)",
                    self.service.task, what, len(self.members.live))

    def _drain_with_error(self, message):
        """Tells every worker `message` (token -1) until every training one left or died.

        Workers that never joined are told when they say hello, until the run has drained;
        a worker that then says hello starts a new run.
        """
        for rank in self.members.live:
            self._reply(rank, -1, message)
        while LIVE in self.members.status:
            with tf.device(self.device):
                entry = tf.raw_ops.QueueDequeueV2(handle=self.push_queue,
                                                  component_types=self.push_dtypes)
            tag, rank = int(entry[0]), int(entry[1])
            if tag == protocol.LEAVE:
                self.members.leave(rank)
            elif tag == protocol.DEAD:
                self.members.die(rank)
            elif tag == protocol.STOP:
                return
            else:
                self._reply(rank, -1, message)

    def teardown(self):
        """Frees the run's resources (when the next run starts: the telemetry of a finished
        run stays readable until then)."""
        handles = [self.push_queue, *self.reply_queues, self.update_lock, self.progress.handle,
                   *[m.handle for m in self.masters.values()],
                   *[o.handle for o in protocol.open_table_owners(self.device, self.spec)]]
        with tf.device(self.device):
            for handle in handles:
                try:
                    tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
                except tf.errors.OpError:
                    pass


class PSService:
    """Answers workers' hellos and runs the shard runs of one ps task.

    Args:
      config: the ps task's `ClusterConfig`.
      liveness_interval: seconds between probes of the workers' servers.
      misses_to_dead: probes in a row finding nothing listening after which a worker is dead.
        A worker whose port accepts connections (a stopped process, a hung machine) is dead
        once it has not answered for its run's `stall_timeout` (the job's strategy
        argument, in the spec of its hello).
      imports: the modules the ps task's command line named (`--ps_import`): with Keras's
        own, the only ones a worker's spec may ask it to import (`refused_import`).
      device: where its queues and runs live (None: the ps task's CPU; a test in one
        process passes its local CPU).
    """

    def __init__(self, config, liveness_interval=0.5, misses_to_dead=4, imports=(),
                 device=None):
        self.config = config
        self.imports = tuple(imports)
        self.task = f"/job:ps/task:{config.task_index}"
        self.device = device or f"/job:ps/replica:0/task:{config.task_index}/device:CPU:0"
        self.current = None
        self._retired = []  # a run handed over, freed when the run after it is replaced
        self._stop = threading.Event()
        # Orders "a worker joins the current run" against "the run ends".
        self.lock = threading.Lock()
        with tf.device(self.device):
            self.control = tf.raw_ops.FIFOQueueV2(
                component_types=[tf.string], shapes=[], capacity=-1,
                container=protocol.CONTAINER, shared_name=protocol.CONTROL_QUEUE)
            self.hello_queues = {}
        self.watcher = LivenessWatcher(lambda: self.current, liveness_interval,
                                       misses_to_dead)
        self._threads = [threading.Thread(target=self._serve_control, name="tfdist-control",
                                          daemon=True),
                         threading.Thread(target=self.watcher.watch, name="tfdist-watch",
                                          daemon=True)]

    def start(self):
        for thread in self._threads:
            thread.start()
        return self

    @property
    def stopping(self):
        return self._stop.is_set()

    def stop(self):
        self._stop.set()
        self.watcher.stopped.set()
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.control,
                                      components=[tf.constant(wire.encode({"type": "stop"}))])

    def shutdown(self, timeout=30.0):
        """Stops the service and its current run, and waits (at most `timeout` seconds) for
        their threads: a process returning from `tfdist.launch.serve()` then exits with
        none of them inside a TF op. True if every thread ended in time."""
        self.stop()
        deadline = time.monotonic() + timeout

        def join(thread):
            if thread.ident is not None:  # (started)
                thread.join(max(0.0, deadline - time.monotonic()))
            return not thread.is_alive()

        # The control thread first: once it has ended, no hello starts another run.
        ended = all([join(thread) for thread in self._threads])
        run = self.current
        if run is not None and run._thread.is_alive():
            try:
                run.send_control(protocol.STOP, 0)
            except tf.errors.OpError:
                pass  # its queues are closed: it is ending
            ended = join(run._thread) and ended
        return ended

    def _answer(self, rank, answer):
        if rank not in self.hello_queues:
            with tf.device(self.device):
                self.hello_queues[rank] = tf.raw_ops.FIFOQueueV2(
                    component_types=[tf.string], shapes=[], capacity=-1,
                    container=protocol.CONTAINER, shared_name=f"hello/{rank}")
        with tf.device(self.device):
            tf.raw_ops.QueueEnqueueV2(handle=self.hello_queues[rank],
                                      components=[tf.constant(wire.encode(answer))])

    def _serve_control(self):
        while not self._stop.is_set():
            with tf.device(self.device):
                text = tf.raw_ops.QueueDequeueV2(handle=self.control,
                                                 component_types=[tf.string])[0]
            if self._stop.is_set():
                return  # stopping: a hello still queued starts no run
            self.handle_control(text.numpy())

    def handle_control(self, text):
        """Acts on one control message; a bad one is logged, with what is wrong, and ignored
        (any process that reaches the port can enqueue one: it must not stop the service)."""
        message = None
        try:
            message = control_message(text)
            if message["type"] == "hello":
                self._hello(message)
            elif message["type"] == "absent" and self.current is not None:
                check_rank(message["rank"], self.current.num_workers, "absent")
                self.current.send_control(protocol.LEAVE, message["rank"])
            elif message["type"] == "refused" and self.current is not None:
                self._refused(self.current, message)
        except BadControlMessage as e:
            log.error("tfdist: %s: ignored a bad control message%s: %s", self.task,
                      claimed_sender(text), e)
        except Exception as e:
            log.exception("tfdist: %s: bad control message", self.task)
            if message is not None and message.get("type") == "hello":
                try:
                    self._answer(message["rank"], {"nonce": message["nonce"],
                                                   "error": f"{type(e).__name__}: {e}"})
                except Exception:  # noqa: BLE001 - the log above says it all
                    log.exception("tfdist: %s: could not answer rank %s", self.task,
                                  message["rank"])

    def _hello(self, message):
        try:
            spec = ShardSpec.from_json(message["spec"])
        except (KeyError, TypeError, ValueError) as e:
            problem = f"the spec of a hello is not a shard's spec ({type(e).__name__}: {e})"
            self._answer(message["rank"], {"nonce": message["nonce"], "error": problem})
            raise BadControlMessage(problem) from None
        rank = message["rank"]
        try:
            check_rank(rank, spec.num_workers, "hello")
        except BadControlMessage as e:
            # A worker's own spec says how many workers there are: its TF_CONFIG is wrong.
            # It waits for an answer: tell it why, or it would time out on a misleading one.
            self._answer(rank, {"nonce": message["nonce"], "error": (
                f"{e}: the worker's task index in TF_CONFIG must be one of the "
                f"{spec.num_workers} workers its cluster lists")})
            raise
        refused = refused_import(spec, self.imports)
        if refused is not None:
            log.error("tfdist: %s: refused the hello of rank %d: %s", self.task, rank, refused)
            self._answer(rank, {"nonce": message["nonce"], "error": refused})
            return
        with self.lock:
            run = self.current
            if run is not None and run.in_progress():
                refused = refusal(run, spec, rank, self.task)
                if refused is not None:
                    self._answer(rank, {"nonce": message["nonce"], "error": refused})
                    return
            if run is not None and not run.admit(rank):
                run = None
        if run is None and self.current is not None:
            self.current.finished.wait(timeout=30)  # a closing run records its end
            ended = self.current
            if ended.finished_without(rank, spec.job):
                self._hand_over(ended, spec, rank, message["nonce"])
                return
            self._retire(ended)
        if run is None:
            run = ShardRun(self, f"{int(time.time())}-{next(_run_numbers)}", spec)
            self.current = run
            run.admit(rank)
            run.start()
            log.info("tfdist: %s: run %s of job %r started by %s", self.task, run.run,
                     run.job, spec.worker_tasks[rank])
        run.chief_said_hello = run.chief_said_hello or rank == 0
        # What the worker compares across the ps tasks (`tfdist.ps.client.check_one_run`):
        # whether the chief said hello to the run here, and whether it initialised it.
        initialized = all(is_initialized(v) for v in run.masters.values())
        self._answer(rank, {"nonce": message["nonce"], "run": run.run, "job": run.job,
                            "initialize": rank == 0 and not initialized,
                            "initialized": initialized, "chief": run.chief_said_hello,
                            "finished": False, "error": run.failure})

    def _retire(self, ended):
        """Frees the resources of the run `ended`, which a new one replaces; a run handed
        over to a worker that came back after it finished (`_hand_over`) is freed only when
        the run after it is replaced in turn: that worker reads its masters (its model's
        final weights, then the model it saves) after its hello, and the next hello (another
        job's, a worker that had left starting its job again) must not free them under it."""
        for run in self._retired:
            run.teardown()
        self._retired = [ended] if ended.handed_over else []
        if not ended.handed_over:
            ended.teardown()

    def _refused(self, run, message):
        """A worker found `run` beside another run of its job on another ps task
        (`tfdist.ps.client.agree_on_one_run`): if its chief has not initialised it, it ends
        with that worker's error, which every worker in it is then told."""
        check_rank(message["rank"], run.num_workers, "refused")
        if message["run"] != run.run:
            raise BadControlMessage(f"it refuses run {message['run']!r}, which is not this "
                                    f"ps task's current run ({run.run})")
        if all(is_initialized(v) for v in run.masters.values()):
            # A race, not a bad message: the worker saw two runs while the chief initialised
            # this one. The run is not ended for it; the worker stops with its error (and
            # the run counts it gone, as any worker that leaves).
            log.warning("tfdist: %s: %s refused run %s after its chief had initialised it: "
                        "the run is not ended for it; that worker stops (%s)", self.task,
                        run.spec.worker_tasks[message["rank"]], run.run, message["error"])
            return
        run.refused = (f"{run.spec.worker_tasks[message['rank']]} refused run {run.run}, "
                       f"which its chief had not initialised: {message['error']}")
        log.error("tfdist: %s: %s", self.task, run.refused)

    def _hand_over(self, run, spec, rank, nonce):
        """Tells worker `rank`, back after `run` of its job finished, to take the run's final
        weights (the run is kept for it: its masters stay readable)."""
        difference = run.spec.difference(spec)
        if difference is not None:
            self._answer(rank, {"nonce": nonce, "error": (
                f"{spec.worker_tasks[rank]} does not fit run {run.run} on {self.task}, "
                f"which its job finished while it was away: {difference}")})
            return
        log.warning("tfdist: %s: %s came back to run %s of job %r after it finished: it "
                    "takes its final weights (no new run starts)", self.task,
                    spec.worker_tasks[rank], run.run, run.job)
        run.handed_over = True
        self._answer(rank, {"nonce": nonce, "run": run.run, "job": run.job,
                            "initialize": False, "initialized": True, "chief": True,
                            "finished": True, "error": None})
