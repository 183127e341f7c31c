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

# Every blocking op a worker sends (a dequeue, an accumulator take) holds one ps thread until
# it returns; with the default pool (the core count) two blocked workers freeze the ps.
DEFAULT_PS_THREADS = 64


def start_server(config, threads=DEFAULT_PS_THREADS):
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


def serve(config, threads=DEFAULT_PS_THREADS, ready_callback=None):
    """Runs the ps task of `config` until SIGTERM or SIGINT, then returns 0."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        target = start_server(config, threads)
        if ready_callback:
            ready_callback(target)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
