"""A worker's courier: the process that carries its messages to its peers' inboxes.

A Stochastic Gradient Push worker's own TF server hosts its queues and never connects out:
a TF server whose eager context also connects to its peers deadlocks when they start
together (each waits, inside its own start, for the others' device lists) and crashes when
one peer's context is rebuilt while another talks to it (both checked by hand on TF 2.21).
So each worker starts, beside itself, this small client process, connected to every worker's
server as the parameter-server family's workers are to ps tasks: it takes
`(out-peers, message)` entries from its worker's `outbox` and enqueues the message in each
peer's `inbox/{rank}` (a callable graph's plan: in its `plan/{rank}`), in order, while the
worker computes its next step.

A peer that cannot be reached is reported to the worker: a `DEAD` message naming it goes to
every inbox (and plan queue) of the worker, whose step then fails with the peer's name. The
courier dies with its worker (Linux's parent-death signal) and ends after a `STOP` entry.

Run as `python -m tfdist.gossip.courier SPEC_JSON` (by `tfdist.gossip.node`).
"""

import json
import logging
import os
import sys

log = logging.getLogger("tfdist")

JOB = "sgp_courier"


def serve(spec):
    """Forwards the worker's outbox until STOP; returns the exit code."""
    import tensorflow as tf

    from tfdist.cluster import as_cluster_config
    from tfdist.cluster import is_listening
    from tfdist.cluster import parse_address
    from tfdist.cluster import wait_for_tasks
    from tfdist.gossip import protocol

    config = as_cluster_config(spec["tf_config"])
    rank = config.worker_rank
    tasks = config.training_tasks
    names = [f"/job:{job}/task:{i}" for job, i in tasks]
    addresses = [config.address(job, i) for job, i in tasks]
    cluster = {job: list(config.cluster[job]) for job in ("chief", "worker")
               if job in config.cluster}
    host, _ = parse_address(addresses[rank])
    cluster[JOB] = {rank: f"{host}:{spec['port']}"}
    try:
        wait_for_tasks(dict(zip(names, addresses)), timeout=spec["connect_timeout"])
        tf.config.threading.set_inter_op_parallelism_threads(2)
        tf.config.experimental_connect_to_cluster(
            tf.train.ClusterSpec(cluster), job_name=JOB, task_index=rank,
            protocol=config.rpc_layer or "grpc", make_master_device_default=False)
    except Exception as e:  # a peer died (or never came) while the courier connected
        silent = [f"{names[r]} at {addresses[r]}" for r in range(len(tasks))
                  if r != rank and not is_listening(addresses[r], timeout=0.5)]
        log.error("tfdist: the courier of %s could not connect to the workers (%s: %s)%s",
                  names[rank], type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                  f"; not answering: {', '.join(silent)}" if silent else "")
        return 1
    home = protocol.task_device(tasks[rank])
    outbox = protocol.outbox_queue(home)
    inboxes = {}
    while True:
        try:
            with tf.device(home):
                peers, message = tf.raw_ops.QueueDequeueV2(
                    handle=outbox, component_types=[tf.int32, tf.float32])
            peers = peers.numpy().tolist()
        except tf.errors.OpError:
            return 0  # the worker is gone; its peers learn it from its closed server
        if peers == [protocol.STOP]:
            return 0
        size = int(message.shape[0])
        plan = peers[:1] == [protocol.PLAN]  # a plan, to the peers' plan queues
        for peer in (p for p in peers if p >= 0):
            device = protocol.task_device(tasks[peer])
            key = ("plan", peer) if plan else peer
            try:
                if key not in inboxes:
                    inboxes[key] = (protocol.plan_queue(device, rank) if plan else
                                    protocol.inbox_queue(device, rank, size))
                with tf.device(device):
                    tf.raw_ops.QueueEnqueueV2(handle=inboxes[key], components=[message])
            except tf.errors.OpError as e:
                log.error("tfdist: %s at %s could not be reached: %s", names[peer],
                          addresses[peer], e.message.splitlines()[0])
                report_dead(tf, protocol, home, rank, peer, len(tasks), size)
                return 1


def report_dead(tf, protocol, home, rank, dead, num_workers, size):
    """Puts a DEAD message naming `dead` in every inbox of this courier's worker."""
    poison = protocol.control(protocol.DEAD, rank, dead, size)
    plan = protocol.pack_plan(protocol.PLAN_DEAD, dead, [])
    for sender in range(num_workers):
        if sender != rank:
            with tf.device(home):
                tf.raw_ops.QueueEnqueueV2(
                    handle=protocol.inbox_queue(home, sender, size), components=[poison])
                tf.raw_ops.QueueEnqueueV2(handle=protocol.plan_queue(home, sender),
                                          components=[plan])


def main(argv):
    logging.basicConfig(format="%(message)s")
    os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")
    return serve(json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
