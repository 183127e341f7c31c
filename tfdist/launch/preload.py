"""Tasks started by forking a process that has imported TensorFlow already.

`import tensorflow, keras` costs a Python process about 6 s of CPU before it runs a line of its
own, and a local cluster of one ps and three workers starts four of them: on two cores most of a
short run is TensorFlow starting. With `LocalCluster(..., preload=True)` each Python task is
forked from a server process that has imported `PRELOAD` once (one server per launcher
process, started with the first preloaded cluster), and then runs its program as `python`
would (`runpy`: its own `__main__`, argv, environment, working directory, exit functions and
exit code): the import is paid once per launcher, not per task.

What stays as with a fresh interpreter: every task is its own process group (made before the
launcher learns its pid), starts in the cluster's private network, reads its own TF_CONFIG and
environment (TensorFlow's runtime reads its settings when a program first uses it, after the
fork), and dies with the launcher: the server gets SIGKILL when the launcher dies (Linux's
parent-death signal) and each task its own death signal when the server dies, from the kernel
(a stopped task or one inside TensorFlow's C++ included), and the server ends when the launcher
closes its socket. What differs: the interpreter's start-up settings come from the server (its
hash seed, shared by every task of a launcher; `PYTHONHASHSEED`, `PYTHONWARNINGS` and other
`PYTHON*` variables given to a task are not read again), an environment variable that a
preloaded module reads at import comes from the server (`TF_CPP_MIN_LOG_LEVEL` is set there as
for every task), numpy's global random state is reseeded in each task, and a command with
Python options (`python -u ...`) or that is not `python script.py` / `python -m module` starts
a fresh interpreter, as without `preload`. The server only imports: it never starts
TensorFlow's runtime (its threads, its gRPC servers), which a fork would not carry over.
"""

import atexit
import ctypes
import importlib
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import types

from tfdist._process import die_with
from tfdist._process import flush_standard_streams
from tfdist.launch.isolation import enter_network

# The modules the server imports: what a tfdist task (a ps task, a Keras program under a tfdist
# strategy) imports before it does anything of its own. None defines absl flags: a task's
# program defines its own, as in a fresh interpreter.
PRELOAD = ("numpy", "tensorflow", "keras", "tfdist")
_PR_SET_PDEATHSIG = 1
# Messages on a task's report socket: a tag and a signed 32-bit value.
_MESSAGE = struct.Struct("!ci")
_FORKED, _GROUPED, _EXITED = b"F", b"G", b"X"
# Seconds a task gets to become its own process group once forked (a bound against a hang).
START_TIMEOUT = 120.0

_server_lock = threading.Lock()
_server = None


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


class _Server:
    """This launcher's fork server: a child process that imported `PRELOAD`, reading fork
    requests from `socket`."""

    def __init__(self, environment):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launcher = os.getpid()
        command = [sys.executable, "-c", "import sys; from tfdist.launch.preload import serve; "
                   "serve(int(sys.argv[1]))", str(theirs.fileno())]
        started = []
        done = threading.Event()

        def start():
            # The parent-death signal follows the thread that started the server: a thread
            # that lives as long as this process.
            try:
                started.append(subprocess.Popen(
                    command, env={**os.environ, **environment}, stdin=subprocess.DEVNULL,
                    pass_fds=[theirs.fileno()], start_new_session=True,
                    preexec_fn=lambda: die_with(launcher, signal.SIGKILL)))
            except BaseException as e:  # handed to the caller
                started.append(e)
            done.set()
            if isinstance(started[0], subprocess.Popen):
                threading.Event().wait()

        threading.Thread(target=start, daemon=True, name="tfdist-preload-server").start()
        done.wait()
        theirs.close()
        if not isinstance(started[0], subprocess.Popen):
            ours.close()
            raise started[0]
        self.process, self.socket = started[0], ours
        self.lock = threading.Lock()

    def request(self, message, fds):
        with self.lock:
            socket.send_fds(self.socket, [message], fds)


def _server_for(environment):
    """The fork server, started (again, should it have ended) with `environment`'s variables
    set over this process's, without changing this process's environment."""
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server(environment)
        return _server


class ForkedTask:
    """A task forked from the fork server, with the part of `subprocess.Popen`'s interface
    that `LocalCluster` uses: `pid`, `returncode`, `poll()`, `wait(timeout)`, `stdout`.

    Returns once the task is its own process group (or has ended)."""

    def __init__(self, argv, env, cwd, death_signal, network_fd, server_environment):
        form = command_form(argv)
        if form is None:
            raise ValueError(f"`argv` must be `python script.py ...` or `python -m module ...` "
                             f"with this interpreter to be forked. Received: {argv!r}")
        args = list(argv[3:] if form[0] == "module" else argv[2:])
        request = pickle.dumps((form, args, dict(env), cwd, int(death_signal),
                                network_fd is not None))
        server = _server_for(server_environment)
        self._report, theirs = socket.socketpair()
        read, write = os.pipe()
        try:
            server.request(request, [theirs.fileno(), write]
                           + ([network_fd] if network_fd is not None else []))
        except BaseException:
            os.close(read)
            self._report.close()
            raise
        finally:
            theirs.close()
            os.close(write)
        self.stdout = os.fdopen(read, "rb")
        self.pid = self.returncode = None
        self._grouped = self._server_gone = False
        self._death_signal = int(death_signal)
        self._lock = threading.Lock()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                self.poll()  # first: what has come may already say the task started
                if self.pid is not None and (self._grouped or self.returncode is not None):
                    return
                if self._server_gone:
                    raise OSError("the preload server ended before the task started (its "
                                  f"errors are on the launcher's stderr): {argv!r}")
                if not self._read(max(0.0, deadline - time.monotonic())):
                    if self.pid is not None:
                        os.kill(self.pid, signal.SIGKILL)  # not reaped: no exit code came
                    raise TimeoutError(f"a task forked from the preload server did not start "
                                       f"within {START_TIMEOUT:g} s: {argv!r}")
        except BaseException:
            # Closed: a task forked after this finds nobody to report to, and exits.
            self._report.close()
            self.stdout.close()
            raise

    def _read(self, timeout):
        """Reads one message within `timeout` s (None: without bound); False if none came.
        (`poll` and `wait` may be called from several threads: one reads at a time.)"""
        if self._server_gone:
            return False
        if not select.select([self._report], [], [], timeout)[0]:
            return False
        with self._lock:
            if self._server_gone or not select.select([self._report], [], [], 0)[0]:
                return True  # another thread read it
            data = b""
            while len(data) < _MESSAGE.size:
                chunk = self._report.recv(_MESSAGE.size - len(data))
                if not chunk:
                    # The server ended (not the launcher: an OOM kill, say). The kernel has
                    # sent the task its death signal, which a worker may handle: its end is
                    # seen from here on by its process group's going (`poll`).
                    self._server_gone = True
                    return True
                data += chunk
            tag, value = _MESSAGE.unpack(data)
            if tag == _FORKED:
                self.pid = value
            elif tag == _GROUPED:
                self._grouped = True
            else:
                self.returncode = value
                self._server_gone = True  # nothing more comes: the server closed its end
            return True

    def poll(self):
        while self.returncode is None and self._read(0):
            pass
        if self.returncode is None and self._server_gone and self._grouped:
            # Orphaned, its exit code is its new parent's to read: ended once its process
            # group is gone, with its death signal's code.
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -self._death_signal
            except PermissionError:
                pass  # the group is there (a member changed its user)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            if self._server_gone:
                time.sleep(0.05 if left is None else min(0.05, left))
            else:
                self._read(left)
        return self.returncode

    def __del__(self):
        report = getattr(self, "_report", None)
        if report is not None:
            report.close()


def serve(control_fd):
    """The fork server's main: imports `PRELOAD`, then forks a task for every request on
    `control_fd` and reports each task's pid, process group and exit code on the task's own
    socket; ends when the launcher closes its socket (or dies: the server's death signal)."""
    for module in PRELOAD:
        importlib.import_module(module)
    control = socket.socket(fileno=control_fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    reports = {}  # pid -> the socket its exit code goes to
    while True:
        ready = select.select([control, wake_read], [], [])[0]
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(reports)
        if control in ready:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
            if not message:
                return  # the launcher closed its socket
            report = socket.socket(fileno=fds[0])
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                try:  # never back into the server's loop
                    for fd in [control.detach(), wake_read, wake_write,
                               *(r.detach() for r in reports.values())]:
                        os.close(fd)
                    _task(server, report, fds[1], fds[2] if len(fds) > 2 else None,
                          *pickle.loads(message))
                finally:
                    os._exit(1)
            for fd in fds[1:]:
                os.close(fd)
            reports[pid] = report
            _send(report, _FORKED, pid)
            _reap(reports)


def _send(report, tag, value):
    """Sends one message; False if the launcher has closed the task's socket."""
    try:
        report.sendall(_MESSAGE.pack(tag, value))
        return True
    except OSError:
        return False


def _reap(reports):
    while reports:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = reports.pop(pid, None)
        if report is not None:
            _send(report, _EXITED, os.waitstatus_to_exitcode(status))
            report.close()


def _task(server, report, output, network, form, args, env, cwd, death_signal, has_network):
    """In the forked child: becomes the task, then runs its program as `python` would."""
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
        if os.getppid() != server:
            os._exit(1)  # the server ended before the death signal was set
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target in (1, 2):
            os.dup2(output, target)
        os.close(output)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
        if not _send(report, _GROUPED, 0):
            os._exit(1)  # the launcher gave up on this task (its start timed out)
        report.close()
        if has_network:
            enter_network(network)
            os.close(network)
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "numpy" in sys.modules:  # each fresh interpreter seeds it from the OS
            sys.modules["numpy"].random.seed()
        # As the interpreter builds sys.path: the script's directory (or the working
        # directory for -m) first, then PYTHONPATH's entries, then the rest of the server's.
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        kind, name = form
        first = os.path.dirname(os.path.abspath(name)) if kind == "path" else os.getcwd()
        sys.path[:] = [first, *extra] + [p for p in sys.path[1:] if p not in extra]
        sys.argv = [name if kind == "path" else "-m", *args]  # run_module puts the file first
    except BaseException:
        traceback.print_exc()
        flush_standard_streams()
        os._exit(1)
    code = 0
    try:
        if kind == "path":
            _keep_main(runpy.run_path(name, run_name="__main__"), [name, *args])
        else:
            _keep_main(runpy.run_module(name, run_name="__main__", alter_sys=True),
                       [None, *args])
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


def _keep_main(namespace, argv):
    """After the program ran: its namespace stays `__main__` and its argv stays, for what
    runs at exit (runpy puts the server's back), as in an interpreter that ran it."""
    module = types.ModuleType("__main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = module
    sys.argv = [argv[0] or namespace.get("__file__", "-m"), *argv[1:]]


def _finish(code):
    """Ends the task as the interpreter ends: threading's shutdown (its exit hooks, which stop
    `concurrent.futures` pools, then the threads that are not daemons joined), its exit
    functions run (a tfdist worker's leave, the gossip peers'), its streams flushed; then
    `code`."""
    threading._shutdown()
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(code & 0xFF)
