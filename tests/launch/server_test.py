"""A ps task survives workers that connect at the same moment (the TF 2.21 eager-service race).

With a bare `tf.distribute.Server` as the ps, two client contexts created at once both replace
the server's collective executor manager; the first keeps a pointer to the freed one, and the
next new op kernel in it crashes the ps (SIGSEGV in `GetOrCreateKernelAndDevice`). This test
releases 4 clients together against 3 ps tasks, makes each build new kernels on every ps, and
checks that they share the ps resources. Against bare `tf.distribute.Server` ps tasks it caught
the crash in 1 of 3 runs on this machine (a race: it cannot fail every time); a separate
repro with 4 clients and one bare server crashed it in 2 of 3 trials, tfdist's ps in none of 5.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import tensorflow as tf

from tfdist.cluster import pick_free_ports
from tfdist.cluster import wait_for_tasks

NUM_PS = 3  # each ps is a separate chance for the race
NUM_CLIENTS = 4
DEADLINE = 120

CLIENT = textwrap.dedent("""
    import os, sys, time
    import tensorflow as tf

    ps, rank, port = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    barrier, count = sys.argv[4], int(sys.argv[5])
    open(os.path.join(barrier, str(rank)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < count:  # every client imported TF: connect together
        assert time.monotonic() < deadline, "the other clients never started"
        time.sleep(0.001)
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec({"ps": ps, "worker": {rank: "localhost:" + port}}),
        job_name="worker", task_index=rank)
    time.sleep(1.0)  # every client's context exists on the ps tasks before any new kernel
    queues = []
    for task in range(len(ps)):
        with tf.device(f"/job:ps/replica:0/task:{task}/device:CPU:0"):
            for i in range(4):  # new kernels in this client's context
                v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[i + 1], container="test",
                                           shared_name=f"v{rank}/{i}")
                tf.raw_ops.AssignVariableOp(resource=v, value=tf.fill([i + 1], float(rank)))
                tf.raw_ops.ReadVariableOp(resource=v, dtype=tf.float32).numpy()
            queue = tf.raw_ops.FIFOQueueV2(component_types=[tf.int32], shapes=[], capacity=-1,
                                           container="test", shared_name="ranks")
            tf.raw_ops.QueueEnqueueV2(handle=queue, components=[tf.constant(rank)])
            queues.append(queue)
    for task, queue in enumerate(queues):
        with tf.device(f"/job:ps/replica:0/task:{task}/device:CPU:0"):
            while tf.raw_ops.QueueSizeV2(handle=queue).numpy() < count:
                assert time.monotonic() < deadline, "the other clients' ranks never arrived"
                time.sleep(0.05)
    print("client", rank, "saw", count, "ranks on", len(ps), "ps tasks")
""")


class PSServerTest(tf.test.TestCase):

    def test_clients_connecting_together_do_not_crash_the_ps(self):
        ports = pick_free_ports(NUM_PS + NUM_CLIENTS)
        ps = [f"localhost:{port}" for port in ports[:NUM_PS]]
        tmp = self.get_temp_dir()
        script, barrier = os.path.join(tmp, "client.py"), os.path.join(tmp, "barrier")
        os.makedirs(barrier, exist_ok=True)
        with open(script, "w") as f:
            f.write(CLIENT)
        servers = [subprocess.Popen(
            [sys.executable, "-m", "tfdist.launch", "--job_name=ps", f"--ps_hosts={','.join(ps)}",
             f"--task_index={i}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True) for i in range(NUM_PS)]
        clients = []
        try:
            wait_for_tasks({f"/job:ps/task:{i}": a for i, a in enumerate(ps)}, timeout=60)
            clients = [subprocess.Popen(
                [sys.executable, script, ",".join(ps), str(rank), str(port), barrier,
                 str(NUM_CLIENTS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, start_new_session=True)
                for rank, port in enumerate(ports[NUM_PS:])]
            deadline = time.monotonic() + DEADLINE
            while any(c.poll() is None for c in clients):
                for i, server in enumerate(servers):
                    if server.poll() is not None:
                        self.fail(f"ps:{i} exited with {server.returncode} while the clients ran")
                self.assertLess(time.monotonic(), deadline, "the clients did not finish")
                time.sleep(0.2)
            for rank, client in enumerate(clients):
                output = client.stdout.read()
                self.assertEqual(client.returncode, 0, output[-3000:])
                self.assertIn(f"client {rank} saw {NUM_CLIENTS} ranks on {NUM_PS} ps tasks",
                              output)
            for server in servers:
                server.send_signal(signal.SIGTERM)
            self.assertEqual([server.wait(timeout=30) for server in servers], [0] * NUM_PS)
        finally:
            for process in (*clients, *servers):
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                if process.stdout:
                    process.stdout.close()

if __name__ == "__main__":
    tf.test.main()
