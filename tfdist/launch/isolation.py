"""A private network for a local cluster: nothing outside can reach its servers.

TensorFlow servers listen on every interface and run any op any client sends. A local cluster's
tasks only ever talk to each other over loopback, so tfdist starts them in a network namespace
of their own whose only interface is a loopback: other machines, other namespaces, and even
other processes of this machine outside the cluster cannot connect to their ports.

`SwitchedNetwork` gives each task a namespace of its own instead, with an address on a bridge
in one more private namespace: machines on a switch, each with a link of its own (shaped with
`limit_bandwidth`, as the one loopback of a `PrivateNetwork` is shaped as a hub's shared link).

Creating a network namespace needs CAP_SYS_ADMIN (root, or a user namespace where the system
allows one). Where it is refused, `private_network()` warns loudly and the cluster runs on the
machine's own network, as TensorFlow would.

The namespace's only way out is `slirp4netns`, where it is installed
(`PrivateNetwork.connect_outbound`): the user-mode NAT of rootless containers, a process that
relays the namespace's outgoing connections through this machine's network stack and forwards
nothing inbound. Scripts then download data and reach logging services, while the servers stay
out of reach; no firewall rule or kernel setting of this machine changes. Without it the
namespace has no route out at all.
"""

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import os
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import warnings

from tfdist._args import check_int

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class IsolationUnavailable(OSError):
    """This system does not let tfdist create a private network namespace."""


_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)")
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def parse_bandwidth(rate):
    """Bits per second of a rate in tc's units: "100mbit", "1gbit", "12.5mbps" (bytes)."""
    match = _RATE.fullmatch(rate.strip().lower()) if isinstance(rate, str) else None
    bits = float(match.group(1)) * _BITS[match.group(2)] if match else 0
    if bits < 8000:
        raise ValueError(f"`bandwidth` must be a rate such as '100mbit', '1gbit' or '12.5mbps' "
                         f"(bit, kbit, mbit, gbit, tbit; bps... for bytes), at least 8kbit. "
                         f"Received: {rate!r}")
    return bits


def _iproute2(tool):
    """The path of iproute2's `tool` ("ip", "tc"), or IsolationUnavailable."""
    path = shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}") if os.path.exists(p)), None)
    if path is None:
        raise IsolationUnavailable(errno.ENOENT, f"`bandwidth` and the switched network need "
                                                 f"`{tool}` (iproute2), which this machine "
                                                 "does not have")
    return path


def _shape(network, device, bits, rate):
    """Holds what leaves `device` of `network` to `bits` per second (tc tbf)."""
    # The bucket holds a loopback packet (64 KiB, lo's MTU, and its headers) or 4 ms of
    # traffic, whichever is more: a larger one would let small messages pass unlimited.
    burst = max(70_000, int(bits / 8 / 250))
    try:
        network.run("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{int(bits)}bit",
                    "burst", str(burst), "latency", "50ms")
    except IsolationUnavailable as e:
        raise IsolationUnavailable(errno.EPERM, f"could not limit the private network to "
                                                f"{rate}: {e.strerror}") from None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "unshare") or not hasattr(libc, "setns"):
        raise IsolationUnavailable(errno.ENOSYS, "no unshare/setns in this C library")
    return libc


def _setns(libc, fd):
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


def enter_network(fd):
    """Moves the calling thread into the network namespace that `fd` (an open namespace file,
    a `PrivateNetwork`'s `fd`) names: for a process forked outside `subprocess`."""
    _setns(_libc(), fd)


def _bring_loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


class PrivateNetwork:
    """A network namespace with only a loopback interface, held open by a file descriptor.

    Create it, start processes in it with `preexec_fn=network.enter_in_child`, run code of
    this process in it with `with network.inside(): ...`, and `close()` it when done.
    """

    def __init__(self):
        if not sys.platform.startswith("linux"):
            raise IsolationUnavailable(errno.ENOSYS, "network namespaces are Linux-only")
        self._libc = _libc()
        self.fd = None
        self._outbound = None  # (the slirp4netns process, the write end of its exit pipe)
        result = {}
        # Namespaces belong to threads: build this one on a thread of its own, so that the
        # calling thread never leaves the machine's network.
        worker = threading.Thread(target=self._create, args=(result,), daemon=True)
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        self.fd = result["fd"]

    def _create(self, result):
        try:
            if self._libc.unshare(_CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise IsolationUnavailable(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}")
            _bring_loopback_up()
            result["fd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            result["error"] = e if isinstance(e, IsolationUnavailable) else IsolationUnavailable(
                e.errno or errno.EPERM, f"cannot set up a private network: {e}")

    def enter_in_child(self):
        """For `subprocess.Popen(preexec_fn=...)`: the child starts inside the namespace."""
        _setns(self._libc, self.fd)

    @contextlib.contextmanager
    def inside(self):
        """Runs the block's socket calls (this thread only) inside the namespace."""
        original = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(self._libc, self.fd)
            try:
                yield self
            finally:
                _setns(self._libc, original)
        finally:
            os.close(original)

    def limit_bandwidth(self, rate):
        """Rate-limits the namespace's loopback to `rate` (tc's token bucket filter).

        Every byte between two tasks crosses the one loopback: the tasks share one link of
        `rate`, as machines on one hub would (`SwitchedNetwork` gives each task a link of its
        own, as machines on a switch).

        Raises:
          ValueError: a malformed `rate`.
          IsolationUnavailable: `tc` is missing or the system refuses the qdisc.
        """
        _shape(self, "lo", parse_bandwidth(rate), rate)

    def run(self, *command):
        """Runs an iproute2 `command` (`ip ...`, `tc ...`) inside the namespace.

        Raises:
          IsolationUnavailable: the tool is missing or the command fails (its message).
        """
        argv = [_iproute2(command[0]), *command[1:]]
        done = subprocess.run(argv, preexec_fn=self.enter_in_child, capture_output=True,
                              text=True)
        if done.returncode:
            raise IsolationUnavailable(errno.EPERM, f"`{' '.join(command)}` failed in a private "
                                                    f"network: {done.stderr.strip()}")

    def connect_outbound(self, timeout=10.0):
        """Gives the namespace outbound connections through `slirp4netns`, where installed.

        slirp4netns attaches a tap device to the namespace (address 10.0.2.100, default route
        via 10.0.2.2) and relays what leaves through it as connections of its own process on
        this machine's network. It publishes no port, so nothing outside can connect in, and
        it is started with `--disable-host-loopback`: the cluster does not reach services
        that listen on this machine's loopback only. It exits when its exit pipe closes: at
        `close()`, or when this process dies however it dies.

        Returns:
          None once the namespace has its way out, else why it has none (a sentence).
        """
        slirp = shutil.which("slirp4netns")
        if slirp is None:
            return "slirp4netns, which would give it a way out, is not installed"
        if self._outbound is not None:
            return None
        ready_read, ready_write = os.pipe()
        exit_read, exit_write = os.pipe()
        log = tempfile.TemporaryFile()
        command = [slirp, "--configure", "--mtu=65520", "--disable-host-loopback",
                   f"--ready-fd={ready_write}", f"--exit-fd={exit_read}", "--netns-type=path",
                   f"/proc/{os.getpid()}/fd/{self.fd}", "tap0"]
        try:
            process = subprocess.Popen(command, pass_fds=(ready_write, exit_read),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
        except OSError as e:
            for fd in (ready_read, exit_write):
                os.close(fd)
            log.close()
            return f"slirp4netns did not start ({e})"
        finally:
            os.close(ready_write)
            os.close(exit_read)
        try:
            ready = select.select([ready_read], [], [], timeout)[0]
            ready = bool(ready) and os.read(ready_read, 1) == b"1"
        finally:
            os.close(ready_read)
        if not ready:
            os.close(exit_write)
            process.kill()
            process.wait()
            log.seek(0)
            said = log.read().decode(errors="replace").strip().splitlines()
            log.close()
            return (f"slirp4netns did not set it up within {timeout:g} s"
                    + (f" ({said[-1]})" if said else ""))
        log.close()
        self._outbound = (process, exit_write)
        return None

    @property
    def has_outbound(self):
        """True while `connect_outbound` gives the namespace its way out."""
        return self._outbound is not None

    def close(self):
        if self._outbound is not None:
            process, exit_write = self._outbound
            self._outbound = None
            os.close(exit_write)  # slirp4netns exits when its exit pipe closes
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# The switched network's addresses: the switch (its bridge) .0.1, task k .0.(k + 2) onwards.
SWITCH_SUBNET = ipaddress.ip_network("10.213.0.0/16")
_SWITCH_MTU = 9000  # a data centre's jumbo frames
_BRIDGE = "tfdist0"


def switched_address(slot):
    """The address of the task in `slot` (0, 1, ...) of a `SwitchedNetwork`."""
    return str(SWITCH_SUBNET[slot + 2])


class SwitchedNetwork:
    """Private network namespaces, one per task, joined by a bridge: machines on a switch.

    Each task's namespace has its loopback and an `eth0` of address `switched_address(slot)`;
    the other end of every `eth0` is a port of a bridge in one more private namespace, the
    switch, where nothing runs (`inside()` looks from there, e.g. to see the tasks listen).
    No interface of this machine's own network is in any of them: as with `PrivateNetwork`,
    nothing outside the cluster reaches its tasks.

    `limit_bandwidth(rate)` shapes every port on its own, both ways (tc's token bucket on the
    task's `eth0` for what it sends, on the switch's end for what it receives): each task has
    a full-duplex link of `rate`, so two pairs of tasks talking at once each get the full rate,
    where on one shaped loopback (`PrivateNetwork.limit_bandwidth`, a hub) they share it.

    Raises:
      IsolationUnavailable: the system refuses namespaces, or `ip` is missing or refused.
    """

    def __init__(self, num_tasks):
        check_int("num_tasks", num_tasks, low=1, high=SWITCH_SUBNET.num_addresses - 3)
        self.switch = None
        self.tasks = []
        try:
            self.switch = PrivateNetwork()
            prefix = SWITCH_SUBNET.prefixlen
            self.switch.run("ip", "link", "add", _BRIDGE, "type", "bridge")
            self.switch.run("ip", "addr", "add", f"{SWITCH_SUBNET[1]}/{prefix}", "dev", _BRIDGE)
            self.switch.run("ip", "link", "set", _BRIDGE, "up")
            for slot in range(num_tasks):
                task = PrivateNetwork()
                self.tasks.append(task)
                self.switch.run("ip", "link", "add", f"port{slot}", "mtu", str(_SWITCH_MTU),
                                "type", "veth", "peer", "name", "eth0", "mtu", str(_SWITCH_MTU),
                                "netns", f"/proc/{os.getpid()}/fd/{task.fd}")
                self.switch.run("ip", "link", "set", f"port{slot}", "master", _BRIDGE, "up")
                task.run("ip", "addr", "add", f"{switched_address(slot)}/{prefix}", "dev", "eth0")
                task.run("ip", "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def address(self, slot):
        return switched_address(slot)

    def enter_in_child(self, slot):
        """For `subprocess.Popen(preexec_fn=...)`: the child starts in task `slot`'s namespace."""
        self.tasks[slot].enter_in_child()

    def inside(self):
        """Runs the block's socket calls (this thread only) on the switch, which reaches every
        task's address."""
        return self.switch.inside()

    def limit_bandwidth(self, rate):
        """Gives every task a link of `rate` each way (tc tbf on both ends of its cable)."""
        bits = parse_bandwidth(rate)
        for slot, task in enumerate(self.tasks):
            _shape(task, "eth0", bits, rate)
            _shape(self.switch, f"port{slot}", bits, rate)

    def connect_outbound(self, timeout=10.0):
        """Gives every task's namespace outbound connections through a slirp4netns of its own
        (`PrivateNetwork.connect_outbound`); None, or why not (a sentence)."""
        for task in self.tasks:
            why_not = task.connect_outbound(timeout)
            if why_not is not None:
                return why_not
        return None

    @property
    def has_outbound(self):
        return all(task.has_outbound for task in self.tasks)

    def close(self):
        for task in self.tasks:
            task.close()
        self.tasks = []
        if self.switch is not None:
            self.switch.close()
            self.switch = None


def loopback_resolvers(path="/etc/resolv.conf"):
    """The name servers of `path` that listen on this machine's loopback (127.0.0.53 of
    systemd-resolved...): out of reach from a private network, whose loopback is its own."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                if ipaddress.ip_address(parts[1].split("%")[0]).is_loopback:
                    found.append(parts[1])
            except ValueError:
                pass
    return found


def private_network(required=False):
    """A `PrivateNetwork`, or None with a loud warning where the system refuses one.

    Args:
      required: raise `IsolationUnavailable` instead of warning.
    """
    try:
        return PrivateNetwork()
    except IsolationUnavailable as e:
        if required:
            raise
        message = (
            f"tfdist: WARNING: could not give the local cluster a private network ({e}); its "
            "TensorFlow servers listen on every interface of this machine and run any op any "
            "client sends them. Run it on a machine no one else can reach, or as a user allowed "
            "to create network namespaces.")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        print(message, file=sys.stderr, flush=True)
        return None
