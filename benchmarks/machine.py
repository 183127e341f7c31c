"""What a benchmark's figures depend on besides its settings: the code, the machine, its load."""

import json
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def load_note():
    """The load average (1, 5, 15 minutes) and the core count, to store with the figures:
    the benchmarks share the cores with whatever else runs, and their rates follow it."""
    return {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count()}


def _git(*args):
    done = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def code_note():
    """The commit the benchmarks run from, and whether the code that runs (tfdist/ and
    benchmarks/, the results directory aside: a run writes there) differed from it."""
    commit = _git("rev-parse", "HEAD")
    root = os.path.dirname(HERE)
    status = _git("status", "--porcelain", "--untracked-files=no", "--",
                  os.path.join(root, "tfdist"), HERE,
                  ":(exclude)" + os.path.join(HERE, "results"))
    return {"commit": commit or "unknown", "dirty": bool(status) if status is not None else None}


def machine_note():
    """Cores, memory and CPU model of this machine."""
    model = platform.processor() or platform.machine()
    memory_bytes = memory_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
            memory_bytes, memory_gib = 1024 * kib, round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpus": os.cpu_count(), "memory_bytes": memory_bytes, "memory_gib": memory_gib,
            "cpu_model": model,
            "system": platform.platform()}


# The environment variable through which `run_all.py` names its run to the benchmarks it
# starts: each stamps it, and the report flags results of another run.
RUN_VARIABLE = "TFDIST_BENCHMARK_RUN"


def stamp(settings=None):
    """What a benchmark's JSON carries beside its figures: the commit (and whether the tree
    was dirty), the machine and its load at the start, the run of `run_all.py` it belongs to
    (None: run by hand) and the run's `settings` (a dict). `finish(stamp)` adds the load at
    the end. `settings` None: `script_settings()`."""
    settings = script_settings() if settings is None else settings
    return {**code_note(), "machine": machine_note(), "run": os.environ.get(RUN_VARIABLE),
            "settings": settings, "load_before": load_note()["load_average_1_5_15"]}


def write_json(path, value):
    """Writes `value` to `path` whole or not at all (a run killed while it writes leaves the
    file as it was)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)


def finish(run_stamp):
    """`run_stamp` with the load average at the end of the run."""
    return {**run_stamp, "load_after": load_note()["load_average_1_5_15"]}


def resume_problems(then, now, settings_then=None, settings_now=None, same_machine=True):
    """Why a run stamped `then` (its `code_note` and `machine`) cannot be carried on by one
    stamped `now`: another commit (or none known), a dirty tree (or one not known) on either
    side, another machine (unless `same_machine` is False: run_all.py's runs, whose
    benchmarks each stay on one machine), other settings (each a dict, the key `complete`
    aside). An empty list: it can."""
    problems = []
    if then.get("commit") != now.get("commit"):
        problems.append(f"it was measured at commit {then.get('commit')}, this checkout is "
                        f"{now.get('commit')}")
    elif now.get("commit") in (None, "unknown"):
        problems.append("the commit is not known (no git): a run is only carried on from "
                        "a known commit")
    if then.get("dirty") is not False or now.get("dirty") is not False:
        problems.append("a run is only carried on from a clean tree (tfdist/ and benchmarks/ "
                        "as committed)")
    machine_then, machine_now = then.get("machine"), now.get("machine")
    if same_machine and not same_kind(machine_then, machine_now):
        problems.append(f"it was measured on another machine ({_machine_text(machine_then)}; "
                        f"this one: {_machine_text(machine_now)})")
    old = {k: v for k, v in (settings_then or {}).items() if k != "complete"}
    new = {k: v for k, v in (settings_now or {}).items() if k != "complete"}
    differing = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if differing:
        shown = ", ".join(f"{k} ({old.get(k)!r} then, {new.get(k)!r} now)" for k in differing)
        problems.append(f"its settings differ: {shown}")
    return problems


# What makes two machines the same for a run carried over several sittings: a machine lent
# for a few hours at a time is seldom the same host twice, but one of the same kind (cores,
# CPU model, memory in GiB) gives the same rates; its kernel build and the last kilobytes of
# its memory, which differ between hosts of one kind, do not count (each sitting records
# its own machine in full).
MACHINE_KIND = ("cpus", "cpu_model", "memory_gib")


def machine_kind(machine):
    """The part of a `machine_note` two sittings of one run must share (`MACHINE_KIND`)."""
    return {key: (machine or {}).get(key) for key in MACHINE_KIND}


def kind_text(machine):
    """A `machine_note`'s kind (`MACHINE_KIND`) in words."""
    kind = machine_kind(machine)
    return f"{kind['cpus']} cores, {kind['cpu_model']}, {kind['memory_gib']} GiB"


def same_kind(machine, other):
    """Whether two `machine_note`s are of one kind (`MACHINE_KIND`)."""
    return machine_kind(machine) == machine_kind(other)


def _machine_text(machine):
    if not machine:
        return "not recorded"
    return (f"{machine.get('cpus')} cores ({machine.get('cpu_model')}), "
            f"{machine.get('memory_gib')} GiB, {machine.get('system')}")


def interleaved(keys, repeats, made, once=lambda key: False):
    """The runs still to make of an interleaved benchmark, in order: `(repeat, key)` for
    every repeat and every key of `keys` (each key once, then again), skipping the runs
    `made` (`{key: runs made}`, an earlier sitting's) and, past the first repeat, the keys
    `once` is true of."""
    for repeat in range(repeats):
        for key in keys:
            if (repeat and once(key)) or made.get(key, 0) > repeat:
                continue
            yield repeat, key


def script_settings():
    """The values of the flags the running script (`__main__`) defines, for `stamp`."""
    import sys

    from absl import flags

    own = flags.FLAGS.flags_by_module_dict().get(sys.argv[0], [])
    return {flag.name: flag.value for flag in own}


def apply_quick(settings):
    """Gives each flag of `settings` (`{flag name: value}`: a benchmark's `--quick` size) its
    value there, unless the command line set it."""
    from absl import flags

    for name, value in settings.items():
        if not flags.FLAGS[name].present:
            flags.FLAGS[name].value = value


def commit_label(run_stamp):
    """"<12 hex digits>", with "+dirty" where the tree had uncommitted changes; "not
    recorded" for results without a stamp."""
    if not run_stamp or run_stamp.get("commit") in (None, "unknown"):
        return "not recorded"
    return run_stamp["commit"][:12] + ("+dirty" if run_stamp.get("dirty") else "")


def record_parts(results, run_stamp, measured, kept=()):
    """Notes in `results["part_commits"]` the commit that measured each part of a result
    file (keys of the script's choosing): `measured` by this run, `kept` from the earlier
    run whose figures `results` still holds (call it before replacing `results["stamp"]`).
    A report then never mixes parts of different commits unseen. `results["part_loads"]`
    likewise keeps each part's load average at the start and end of the run that measured it
    (a file measured over several sittings has one stamp, the last's), and
    `results["part_machines"]` its machine (two benchmarks of run_all.py that share a file
    may sit on different machines)."""
    earlier = commit_label(results.get("stamp"))
    commits = {part: results.get("part_commits", {}).get(part, earlier) for part in kept}
    commits.update({part: commit_label(run_stamp) for part in measured})
    results["part_commits"] = commits
    # A kept part that predates per-part loads has none: not the file's last stamp's.
    loads = {part: results["part_loads"][part] for part in kept
             if part in results.get("part_loads", {})}
    now = {"load_before": run_stamp.get("load_before"),
           "load_after": load_note()["load_average_1_5_15"]}
    loads.update({part: now for part in measured})
    results["part_loads"] = loads
    machines = {part: results["part_machines"][part] for part in kept
                if part in results.get("part_machines", {})}
    machines.update({part: run_stamp.get("machine") for part in measured})
    results["part_machines"] = machines


def spread(values):
    """Median, min and max of a cell's runs (None each where there are none)."""
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(ratios):
    """Median, quartiles, min and max of the ratios of neighbouring runs (a ratio's spread:
    with tens of pairs min-max is the machine's worst moment, the quartiles its usual)."""
    import statistics

    if not ratios:
        return None
    if len(ratios) < 2:
        return {"median": ratios[0], "q1": ratios[0], "q3": ratios[0], "min": ratios[0],
                "max": ratios[0], "pairs": len(ratios)}
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios),
            "max": max(ratios), "pairs": len(ratios)}


def run_cluster(command, timeout, **kwargs):
    """Runs `command` on a `LocalCluster` until it ends; `(result, lines)`.

    A benchmark is not a test: on busy cores a ps may take more than the launcher's default
    30 s to start, so the tasks get the run's whole `timeout` to start listening, and a
    cluster that never starts is a failed run (a `LocalClusterResult` saying so), not a
    traceback that ends the benchmark.
    """
    from tfdist.cluster import TaskUnreachableError
    from tfdist.launch import LocalCluster
    from tfdist.launch import LocalClusterResult

    cluster = LocalCluster(command, timeout=timeout, startup_timeout=timeout, output=None,
                           **kwargs)
    try:
        with cluster:
            return cluster.wait(), cluster.lines
    except TaskUnreachableError as e:
        return LocalClusterResult(returncode=1, message=f"the cluster did not start: {e}"), \
            cluster.lines


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


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_counters():
    """Machine-wide counters whose changes over a measurement window say where the cores'
    time went (cumulative, as `ps_worker._measure`'s `counters()` takes them: each becomes
    `<name>_per_second`): `cpu_<field>_seconds` of /proc/stat summed over the cores (user,
    system, idle, iowait, steal: time the hypervisor gave another guest, ...), its context
    switches, the page faults of /proc/vmstat, and the delayed TCP acknowledgements of
    this process's network namespace (/proc/net/netstat): a rate that drops with idle
    cores, no steal and more delayed acks waits on the network stack, not on the CPU."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields[0] == "cpu":
                for name, value in zip(_CPU_FIELDS, fields[1:]):
                    out[f"cpu_{name}_seconds"] = int(value) / ticks
            elif fields[0] == "ctxt":
                out["context_switches"] = int(fields[1])
    with open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name in ("pgfault", "pgmajfault"):
                out[{"pgfault": "page_faults", "pgmajfault": "major_page_faults"}[name]] = \
                    int(value)
    try:
        with open("/proc/self/net/netstat") as f:
            lines = [line.split() for line in f if line.startswith("TcpExt:")]
        if len(lines) == 2:
            tcp = dict(zip(lines[0][1:], lines[1][1:]))
            out["tcp_delayed_acks"] = int(tcp.get("DelayedACKs", 0))
    except FileNotFoundError:
        pass
    return out
