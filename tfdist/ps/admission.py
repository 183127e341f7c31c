"""What a ps task lets in: the checks a worker's hello passes before the service acts on it.

Any process that reaches a ps port can enqueue a control message, so a hello is judged on
what it says, and refused with an answer that says why (its worker waits for one): a hello
that would have the ps import code not named on its own command line (`refused_import`),
or a worker that may not join the run in progress (another job's, or a different model:
`refusal`). A message too broken to answer is logged with the sender it claims
(`claimed_sender`). `tfdist.ps.service.PSService` acts on the hellos that pass.
"""

from tfdist.ps import wire
from tfdist.ps.policies import STALENESS_FUNCTIONS
from tfdist.ps.protocol import EXPECTED
from tfdist.ps.protocol import LIVE

# The packages whose modules a worker's spec may name without a `--ps_import`.
OWN_MODULES = ("keras", "tfdist")


def claimed_sender(text):
    """Who a control message says sent it, for the log line of a bad one: `" from
    /job:worker/task:1 (rank 1, as it says)"`, `" from rank 5 (as it says)"`, or "" when it
    does not say (not JSON, no integer rank). Any process can enqueue a message: this is
    what the message claims, not who sent it."""
    try:
        message = wire.decode(text)
    except (UnicodeDecodeError, ValueError):
        return ""
    rank = message.get("rank") if isinstance(message, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int):
        return ""
    spec = message.get("spec")
    tasks = spec.get("worker_tasks") if isinstance(spec, dict) else None
    if isinstance(tasks, list) and 0 <= rank < len(tasks) and isinstance(tasks[rank], str):
        return f" from {tasks[rank]} (rank {rank}, as it says)"
    return f" from rank {rank} (as it says)"


def refused_import(spec, allowed):
    """None if every module the hello's `spec` asks the ps to import is allowed, else why not.

    A hello names modules (a custom optimizer's or schedule's, `spec.imports`) and
    `module:function` staleness functions; importing a module runs its code, and any process
    that reaches the ps port can say hello. So the ps imports only Keras's and tfdist's own
    modules and those named on its own command line (`allowed`: `--ps_import`, and their
    submodules). A staleness function is called on the ps: it must come from a module named
    on the command line, never from Keras's or tfdist's (any of whose functions a message
    could otherwise name; tfdist's own staleness functions go by name, "none", "inverse").
    """
    staleness = spec.policy.get("staleness") if isinstance(spec.policy, dict) else None
    references = [(str(module), OWN_MODULES) for module in spec.imports]
    if staleness is not None and staleness not in STALENESS_FUNCTIONS:
        if not (isinstance(staleness, str) and ":" in staleness):
            return (f"the workers' spec names the staleness function {staleness!r}: it must be "
                    f"one of {sorted(STALENESS_FUNCTIONS)} or `module:function` (a function of "
                    "a module named on the ps task's command line)")
        references.append((staleness, ()))
    for reference, own in references:
        module = reference.partition(":")[0]
        roots = (*own, *allowed)
        if not any(module == root or module.startswith(root + ".") for root in roots):
            what = ("a staleness function, which runs on the ps, must be in a module named on "
                    "the ps task's command line"
                    if reference == staleness else "a ps imports only Keras's and tfdist's own "
                    "modules and those given to it")
            return (f"the workers' spec asks the ps to import {module!r} (for "
                    f"{reference!r}), which was not named on the ps task's command line: "
                    f"{what}. Start the ps tasks with `tfdist-launch --job_name=ps "
                    f"--ps_import={module}` (`LocalCluster(..., ps_imports=[{module!r}])`). "
                    f"Allowed now: {list(roots)}")
    return None


def refusal(run, spec, rank, task):
    """None if worker `rank` (of `spec`) may join `run`, in progress on ps task `task`;
    else why not."""
    worker = spec.worker_tasks[rank]
    if spec.job != run.job:
        in_run = [r for r, s in enumerate(run.members.status) if s in (EXPECTED, LIVE)]
        return (f"{worker} is a worker of job {spec.job!r}, but {task} holds run "
                f"{run.run} of job {run.job!r} in progress (ranks {in_run} in it): a run "
                "belongs to one job, and one run at a time is served. Wait until that "
                "run ends (each ps task ends it once none of its workers is left: a "
                "killed one is noticed within seconds, a hung one after its "
                "stall_timeout), or restart the ps tasks")
    difference = run.spec.difference(spec)
    if difference is not None:
        return (f"{worker} does not fit run {run.run} on {task}: {difference}. Every "
                "worker must build the same model and optimizer under the strategy's "
                "scope")
    return None
