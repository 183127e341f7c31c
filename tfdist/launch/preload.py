"""Tasks started by forking a process that has imported TensorFlow already.

`import tensorflow, keras` costs a Python process about 6 s of CPU before it runs a line of its
own, and a local cluster of one ps and three workers starts four of them: on two cores most of a
short run is TensorFlow starting. With `LocalCluster(..., preload=True)` each Python task is
forked from a server process (the standard library's `multiprocessing` fork server) that has
imported `PRELOAD` once, and then runs its program as `python` would (`runpy`, its own argv,
environment, working directory, `__main__`): the import is paid once per launcher, not per
task.

What stays as with a fresh interpreter: every task is its own process group, gets its death
signal when the launcher dies (its parent is the fork server: it watches the launcher's pidfd),
starts in the cluster's private network, reads its own TF_CONFIG and environment (TensorFlow's
runtime reads its settings when a program first uses it, after the fork), and exits with its
program's code or signal. What differs: an environment variable that a preloaded module reads
at import comes from the server (`TF_CPP_MIN_LOG_LEVEL` is set there as for every task), and a
command with Python options (`python -u ...`) or that is not `python script.py` / `python -m
module` starts a fresh interpreter, as without `preload`. The server only imports: it never
starts TensorFlow's runtime (its threads, its gRPC servers), which a fork would not carry over.
"""

import atexit
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import select
import subprocess
import sys
import threading
from multiprocessing import reduction

from tfdist._process import flush_standard_streams
from tfdist.launch.isolation import enter_network

# The modules the fork server imports: everything a tfdist task (a ps task, a Keras program
# under a tfdist strategy) imports before it does anything of its own.
PRELOAD = ("numpy", "tensorflow", "keras", "absl.app", "absl.flags", "tfdist",
           "tfdist.launch.main")
_PR_SET_PDEATHSIG = 1
_server_lock = threading.Lock()
_server_started = False


def command_form(argv):
    """`("path", script)` or `("module", name)` for `python script.py ...` / `python -m
    module ...` run by this interpreter; None for any other command (it starts fresh)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m":
        return ("module", argv[2]) if len(argv) > 2 else None
    if argv[1].startswith("-"):
        return None
    return ("path", argv[1])


def _context(environment):
    """The fork server's context, the server started (once, by the first preloaded cluster)
    with `environment`'s variables set over this process's: what a preloaded module reads at
    import comes from there. (Were this process's fork server started before, by code of its
    own, its tasks still run, importing TensorFlow themselves.)"""
    global _server_started
    context = multiprocessing.get_context("forkserver")
    with _server_lock:
        if not _server_started:
            saved = {name: os.environ.get(name) for name in environment}
            os.environ.update(environment)
            try:
                context.set_forkserver_preload(list(PRELOAD))
                multiprocessing.forkserver.ensure_running()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            _server_started = True
    return context


class _Descriptor:
    """A file descriptor of this process, sent to the forked task (the fork server passes it
    over its socket, as `multiprocessing` passes sockets); the task receives the number of its
    own copy."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate):
    return duplicate.detach()


class ForkedTask:
    """A task forked from the fork server, with the part of `subprocess.Popen`'s interface
    that `LocalCluster` uses: `pid`, `returncode`, `poll()`, `wait(timeout)`, `stdout`."""

    def __init__(self, argv, env, cwd, death_signal, network_fd, server_environment):
        form = command_form(argv)
        if form is None:
            raise ValueError(f"`argv` must be `python script.py ...` or `python -m module ...` "
                             f"with this interpreter to be forked. Received: {argv!r}")
        read, write = os.pipe()
        try:
            self._process = _context(server_environment).Process(
                target=_run_task,
                args=(form, list(argv[3:] if form[0] == "module" else argv[2:]), dict(env),
                      cwd, int(death_signal), os.getpid(), _Descriptor(write),
                      None if network_fd is None else _Descriptor(network_fd)),
                name=f"tfdist-task-{argv[1]}")
            self._process.start()
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self.pid = self._process.pid
        self.stdout = os.fdopen(read, "rb")
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode


def _run_task(form, args, env, cwd, death_signal, launcher, output, network):
    """In the forked child: becomes the task, then runs its program as `python` would."""
    os.setsid()
    # The task's parent is the fork server, which outlives the launcher while any task holds
    # its pipe: the task watches the launcher itself (and gets `death_signal` should the
    # server go first).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
    try:
        watch = os.pidfd_open(launcher)
    except ProcessLookupError:
        os._exit(1)
    threading.Thread(target=_die_with, args=(watch, death_signal), daemon=True,
                     name="tfdist-launcher-watch").start()
    if network is not None:
        enter_network(network)
        os.close(network)
    for target in (1, 2):
        os.dup2(output, target)
    os.close(output)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # As the interpreter builds sys.path: the script's directory (or the working directory
    # for -m) first, then PYTHONPATH's entries, then what the server had.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, name = form
    first = os.path.dirname(os.path.abspath(name)) if kind == "path" else os.getcwd()
    sys.path[:] = [first, *extra] + [p for p in sys.path[1:] if p not in extra]
    sys.argv = [name if kind == "path" else "-m", *args]  # run_module puts the file first
    code = 0
    try:
        if kind == "path":
            runpy.run_path(name, run_name="__main__")
        else:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _die_with(launcher, death_signal):
    """Sends this task `death_signal` once the launcher (`launcher`, its pidfd) has ended."""
    select.select([launcher], [], [])
    os.kill(os.getpid(), death_signal)


def _finish(code):
    """Ends the task as the interpreter ends: its other threads that are not daemons joined,
    its exit functions run (a tfdist worker's leave, the gossip peers'), its streams flushed;
    then `code`, without `multiprocessing`'s own ending."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(code & 0xFF)
