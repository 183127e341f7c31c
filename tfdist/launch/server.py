"""Serve one ps task: a `tf.distribute.Server` that runs until SIGTERM or SIGINT."""

import signal
import threading

# Every blocking op a worker sends (a dequeue, an accumulator take) holds one ps thread until
# it returns; with the default pool (the core count) two blocked workers freeze the ps.
DEFAULT_PS_THREADS = 64


def start_server(config, threads=DEFAULT_PS_THREADS):
    """Starts the `tf.distribute.Server` of `config`'s task and returns it.

    The server is given only the ps job: ps tasks never call out to the workers, and each
    worker tells the ps its own address when it connects.
    """
    if config.task_type != "ps":
        raise ValueError(f"`start_server` serves ps tasks. Received task type: "
                         f"{config.task_type!r}")
    import tensorflow as tf

    session_config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1)
    return tf.distribute.Server(
        config.cluster_spec(jobs=["ps"]), job_name="ps", task_index=config.task_index,
        protocol=config.rpc_layer or "grpc", config=session_config, start=True)


def serve(config, threads=DEFAULT_PS_THREADS, ready_callback=None):
    """Runs the ps task of `config` until SIGTERM or SIGINT, then returns 0."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = start_server(config, threads)
        if ready_callback:
            ready_callback(server)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
