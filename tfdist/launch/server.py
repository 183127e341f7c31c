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

import signal
import threading

# Every blocking op (a worker waiting for its reply, the updater waiting for pushes, the
# control loop) holds one ps thread until it returns; with the default pool (the core count)
# two waiting workers freeze the ps.
DEFAULT_PS_THREADS = 64


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
    from tensorflow.python.eager import context

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
    context.context().ensure_initialized()
    return f"{protocol}://{config.task_address}"


def serve(config, threads=None, ready_callback=None):
    """Runs the ps task of `config` until SIGTERM or SIGINT, then returns 0.

    Beside the gRPC server runs the task's `PSService`, which updates its shard of every
    run the workers start (`tfdist.ps.service`).
    """
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        target = start_server(config, threads)
        from tfdist.ps.service import PSService

        PSService(config).start()
        if ready_callback:
            ready_callback(target)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
