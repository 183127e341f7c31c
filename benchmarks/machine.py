"""What a benchmark's figures depend on besides its settings: the machine and its load."""

import os


def load_note():
    """The load average (1, 5, 15 minutes) and the core count, to store with the figures:
    the benchmarks share the cores with whatever else runs, and their rates follow it."""
    return {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count()}


def machine_note():
    """Cores and memory of this machine."""
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return {"cpus": os.cpu_count(), "memory_bytes": 1024 * total_kib}


def available_memory_bytes():
    """MemAvailable of /proc/meminfo: what can still be allocated without swapping."""
    with open("/proc/meminfo") as f:
        return 1024 * next(int(line.split()[1]) for line in f
                           if line.startswith("MemAvailable:"))


def peak_resident_bytes(pid):
    """The peak resident memory of process `pid` so far (VmHWM of /proc/<pid>/status), or
    None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return 1024 * int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def loopback_counters(pid="self"):
    """`{"loopback_tx_bytes": n, "network_namespace": id}` of the network namespace `pid`
    runs in: the bytes its loopback sent (every byte between two processes of that namespace
    once, TCP/IP headers included). Only a private namespace's counter is one job's traffic:
    compare `network_namespace` with the launcher's."""
    out = {"network_namespace": os.readlink(f"/proc/{pid}/ns/net")}
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                out["loopback_tx_bytes"] = int(counters.split()[8])
    return out
