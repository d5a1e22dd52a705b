"""Emulated cluster on one machine: hosts are Linux network namespaces behind a bridge.

    with ShapedNetwork(hosts=2, bandwidth_mbit=1000, latency_ms=0) as net:
        net.run_in(0, ["python", "-c", "print('hello from host 0')"])

Topology (every name carries a per-run prefix, e.g. ``rsnb12345``)::

    <prefix>-h0 [eth0 10.77.0.1/24] --veth-- h0 \\
    <prefix>-h1 [eth0 10.77.0.2/24] --veth-- h1  +- br0 [10.77.0.254/24]   in <prefix>-sw
    ...                                         /

* Each host is a namespace with one interface ``eth0``; its peer ``hK`` is a port of
  the Linux bridge ``br0``, which lives in a "switch" namespace of its own. The
  bridge also holds an address, so services started in the switch namespace (the
  Horovod rendezvous server) are reachable from every host. Nothing is created in,
  or routed to, the root namespace.
* Shaping, per host link and per direction: a ``tbf`` qdisc at ``bandwidth_mbit`` on
  the host's ``eth0`` (uplink) and on the switch port ``hK`` (downlink), so each host
  has a full-duplex link of that rate, as behind a non-blocking switch.
  ``latency_ms > 0`` adds a ``netem`` delay on each host's uplink (one-way host-to-host
  latency = ``latency_ms``, RTT = 2x), with tbf as netem's child. ``netem`` needs the
  kernel's ``sch_netem``; when it is missing a latency > 0 raises
  :class:`NetbenchUnavailable` (``netem_available()`` tells up front).
* ``bandwidth_mbit=None`` leaves the links unshaped (veth speed, CPU bound).
* Name resolution: ``/etc/netns/<host ns>/hosts`` (which ``ip netns exec`` bind-mounts
  over ``/etc/hosts`` for the processes it starts, and only for them) maps this
  machine's hostname to the host's own address. Horovod 0.28.1 needs it: the Gloo
  context of its global process set is built with an empty interface name
  (``GlooContext::InitializeForProcessSet`` ignores HOROVOD_GLOO_IFACE), so Gloo falls
  back to ``gethostname()`` + ``getaddrinfo``, which here would give 127.0.0.1 and
  make ranks in different namespaces connect to themselves. With ``names`` (one per host,
  e.g. ``("hostA", "hostB")``) every namespace's file, the switch's too, also maps each name
  to its host's address, as a cluster's /etc/hosts or DNS does (docs/cluster.md).

The context manager tears everything down on exit, on exceptions and on
SIGINT/SIGTERM (through the caller's ``finally``): processes still inside the
namespaces (only ours can be there) are killed by pid, then the namespaces are
deleted, which deletes their veths and the bridge. ``cleanup(prefix)`` removes
leftovers of an earlier crashed run whose names start with ``prefix``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "rsnb"            # every namespace this package creates starts with it
SUBNET = "10.77.0"         # inside our own namespaces only
SWITCH_ADDR = f"{SUBNET}.254"
HOST_IFACE = "eth0"
MAX_HOSTS = 8


class NetbenchUnavailable(RuntimeError):
    """The emulated network cannot be built here (not root, no iproute2, missing qdisc)."""


def _run(cmd: list, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr.strip()}")
    return p


def missing_prerequisites() -> list[str]:
    """Reasons the network cannot be built here; empty when it can."""
    why = []
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return ["Linux network namespaces are needed (Linux only)"]
    if os.geteuid() != 0:
        why.append("root is needed to create network namespaces (run as root, or with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            why.append(f"'{tool}' was not found on PATH: install iproute2 (apt-get install iproute2)")
    return why


def check_prerequisites() -> None:
    """Raise :class:`NetbenchUnavailable` with a clear message unless root and iproute2 are there."""
    why = missing_prerequisites()
    if why:
        raise NetbenchUnavailable("netbench cannot build its emulated network: " + "; ".join(why))


_QDISC_CACHE: dict[str, bool] = {}


def qdisc_available(kind: str) -> bool:
    """Can this kernel attach ``kind`` (e.g. "tbf", "netem")? Probed on a veth pair inside a
    throw-away namespace of ours, deleted right after."""
    if kind in _QDISC_CACHE:
        return _QDISC_CACHE[kind]
    check_prerequisites()
    ns = f"{PREFIX}{os.getpid()}-probe"
    args = {"tbf": ["rate", "1gbit", "burst", "32kb", "latency", "50ms"], "netem": ["delay", "1ms"]}.get(kind, [])
    ok = False
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        ok = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "pa", "root", kind, *args],
                  check=False).returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    _QDISC_CACHE[kind] = ok
    return ok


def netem_available() -> bool:
    return qdisc_available("netem")


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (``ip netns list``)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


NETNS_ETC = "/etc/netns"


def _remove_etc(ns: str) -> None:
    d = os.path.join(NETNS_ETC, ns)
    if os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)
    try:
        os.rmdir(NETNS_ETC)   # only if empty: other users' files stay
    except OSError:
        pass


def delete_namespace(ns: str) -> None:
    """Kill what still runs inside ``ns`` (processes we started there), then delete it
    and its ``/etc/netns/<ns>`` files."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _ns_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not pids:
            break
        deadline = time.time() + 3
        while time.time() < deadline and _ns_pids(ns):
            time.sleep(0.1)
    _run(["ip", "netns", "del", ns], check=False)
    _remove_etc(ns)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with ``prefix`` (leftovers of a crashed run)."""
    gone = list_namespaces(prefix)
    if os.path.isdir(NETNS_ETC):
        gone += [d for d in os.listdir(NETNS_ETC) if d.startswith(prefix) and d not in gone]
    for ns in gone:
        delete_namespace(ns)
    return gone


def _burst_bytes(rate_bit: float) -> int:
    # tbf needs burst >= rate / timer frequency; 1 ms of traffic (>= 32 KB) keeps it
    # accurate at high rates without letting long bursts through
    return max(32 * 1024, int(rate_bit / 8 / 1000))


@dataclass
class ShapedNetwork:
    """``hosts`` namespaces behind a bridge, each link shaped to ``bandwidth_mbit``
    (None: unshaped) with ``latency_ms`` of added one-way delay. Use as a context manager."""
    hosts: int = 2
    bandwidth_mbit: float | None = 1000.0
    latency_ms: float = 0.0
    prefix: str | None = None
    queue_ms: float = 50.0        # tbf queue length, in ms of traffic at the shaped rate
    verbose: bool = False
    names: tuple = ()             # host names every namespace resolves (empty: addresses only)
    namespaces: list = field(default_factory=list, init=False)

    def __post_init__(self):
        if not 1 <= int(self.hosts) <= MAX_HOSTS:
            raise ValueError(f"hosts={self.hosts}: between 1 and {MAX_HOSTS}")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError(f"bandwidth_mbit={self.bandwidth_mbit} must be > 0 (or None: unshaped)")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms={self.latency_ms} must be >= 0")
        self.hosts = int(self.hosts)
        self.names = tuple(self.names)
        if self.names and len(self.names) != self.hosts:
            raise ValueError(f"names={self.names}: one name per host ({self.hosts})")
        self.prefix = self.prefix or f"{PREFIX}{os.getpid()}"
        if not self.prefix.startswith(PREFIX):
            raise ValueError(f"prefix must start with {PREFIX!r} so cleanup can find it")
        self._up = False

    # -- names and addresses ---------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    @staticmethod
    def host_addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch_addr(self) -> str:
        return SWITCH_ADDR

    @property
    def iface(self) -> str:
        """The host-side interface name, identical in every host namespace (HOROVOD_GLOO_IFACE)."""
        return HOST_IFACE

    def describe(self) -> str:
        bw = "unshaped" if self.bandwidth_mbit is None else f"{self.bandwidth_mbit:g} Mbit/s"
        return f"{self.hosts} hosts, {bw}, +{self.latency_ms:g} ms one-way"

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> "ShapedNetwork":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _ip(self, *args, ns: str | None = None):
        cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
        if self.verbose:
            print("+", " ".join(cmd))
        return _run(cmd)

    def _tc(self, ns: str, *args):
        cmd = ["ip", "netns", "exec", ns, "tc"] + list(args)
        if self.verbose:
            print("+", " ".join(cmd))
        return _run(cmd)

    def up(self) -> None:
        check_prerequisites()
        if self.latency_ms > 0 and not netem_available():
            raise NetbenchUnavailable(
                f"latency_ms={self.latency_ms:g} needs the netem qdisc, which this kernel lacks "
                "(sch_netem not built or not loadable: try 'modprobe sch_netem'); use latency_ms=0 here")
        stale = [ns for ns in [self.switch_ns] + [self.host_ns(i) for i in range(self.hosts)]
                 if ns in list_namespaces(self.prefix)]
        for ns in stale:   # same prefix = same pid reused after a crash: ours
            delete_namespace(ns)
        try:
            sw = self.switch_ns
            self._ip("netns", "add", sw)
            self.namespaces.append(sw)
            self._ip("link", "set", "lo", "up", ns=sw)
            self._ip("link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0", ns=sw)
            self._ip("addr", "add", f"{SWITCH_ADDR}/24", "dev", "br0", ns=sw)
            self._ip("link", "set", "br0", "up", ns=sw)
            if self.names:
                self._write_hosts(sw, None)
            for i in range(self.hosts):
                h, port = self.host_ns(i), f"h{i}"
                self._ip("netns", "add", h)
                self.namespaces.append(h)
                self._ip("link", "set", "lo", "up", ns=h)
                # created inside the switch namespace, the host end moved straight into its namespace:
                # the root namespace never sees these interfaces
                self._ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", h, ns=sw)
                self._ip("link", "set", port, "master", "br0", ns=sw)
                self._ip("link", "set", port, "up", ns=sw)
                self._ip("addr", "add", f"{self.host_addr(i)}/24", "dev", HOST_IFACE, ns=h)
                self._ip("link", "set", HOST_IFACE, "up", ns=h)
                self._write_hosts(h, self.host_addr(i))
                self._shape(h, HOST_IFACE, delay=True)
                self._shape(sw, port, delay=False)
            self._up = True
            self._wait_reachable()
        except BaseException:
            self.down()
            raise

    def _write_hosts(self, ns: str, addr: str | None) -> None:
        d = os.path.join(NETNS_ETC, ns)
        os.makedirs(d, exist_ok=True)
        # the names first: a reverse lookup of a host's address (socket.getfqdn, which torchrun's
        # rendezvous hands to the other hosts) takes the first line that has it
        names = "".join(f"{self.host_addr(i)} {name}\n" for i, name in enumerate(self.names))
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + names + (f"{addr} {socket.gethostname()}\n" if addr else ""))

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        if self.bandwidth_mbit is None and not (delay and self.latency_ms > 0):
            return
        tbf = []
        if self.bandwidth_mbit is not None:
            rate = self.bandwidth_mbit * 1e6
            burst = _burst_bytes(rate)
            limit = max(4 * burst, int(rate / 8 * self.queue_ms / 1000))
            tbf = ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]
        if delay and self.latency_ms > 0:
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                     "delay", f"{self.latency_ms:g}ms", "limit", "100000")
            if tbf:
                self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Bridge ports forward at once (STP off); wait until every host link reports carrier."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all("LOWER_UP" in _run(["ip", "-n", self.host_ns(i), "link", "show", HOST_IFACE]).stdout
                   for i in range(self.hosts)):
                return
            time.sleep(0.1)
        raise RuntimeError(f"links of {self.prefix} did not come up within {timeout}s")

    def down(self) -> None:
        """Kill what runs in our namespaces and delete them (idempotent)."""
        for ns in reversed(self.namespaces):
            delete_namespace(ns)
        self.namespaces = []
        # anything with our prefix that an interrupted up() created but did not record
        for ns in list_namespaces(self.prefix + "-"):
            delete_namespace(ns)
        for ns in [self.switch_ns] + [self.host_ns(i) for i in range(self.hosts)]:
            _remove_etc(ns)
        self._up = False

    # -- running things --------------------------------------------------------
    def exec_prefix(self, i: int | None) -> list[str]:
        """Command prefix that runs inside host ``i`` (None: the switch namespace)."""
        return ["ip", "netns", "exec", self.switch_ns if i is None else self.host_ns(i)]

    def run_in(self, i: int | None, cmd: list, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_prefix(i) + [str(c) for c in cmd], timeout=timeout, **kw)

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every link, for logs."""
        lines = []
        for i in range(self.hosts):
            lines.append(f"{self.host_ns(i)} {HOST_IFACE}: " + _run(
                self.exec_prefix(i) + ["tc", "qdisc", "show", "dev", HOST_IFACE]).stdout.strip().replace("\n", " | "))
            lines.append(f"{self.switch_ns} h{i}: " + _run(
                self.exec_prefix(None) + ["tc", "qdisc", "show", "dev", f"h{i}"]).stdout.strip().replace("\n", " | "))
        return "\n".join(lines)
