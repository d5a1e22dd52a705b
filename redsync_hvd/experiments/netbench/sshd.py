"""Hosts that answer ssh, on one machine: Debian's sshd in namespaces of a :class:`ShapedNetwork`.

    with ShapedNetwork(hosts=2, bandwidth_mbit=None, names=("hostA", "hostB")) as net, SshHosts(net) as hosts:
        subprocess.run(hosts.on(0, ["horovodrun", "-np", "2", "-H", "hostA:1,hostB:1", "python", "train.py"]))

What a cluster's administrator sets up, done in a temporary folder:

* a throw-away host key (one for every host) and client key (``ssh-keygen``), the client key
  authorized for root;
* on each served host, ``/usr/sbin/sshd -D -f <tmp config>`` inside the host's namespace, listening on
  the host's address, port 22 (each namespace has ports of its own), public keys only;
* an ssh client configuration, ``/etc/netns/<ns>/ssh/ssh_config`` in every namespace (which
  ``ip netns exec`` bind-mounts over ``/etc/ssh`` for the processes it starts, and only for
  them): the client key, and the host key as known for every host name, so that ``ssh hostB``
  works without a password or a question, for horovodrun's ssh check and mpirun's daemons alike.
  Nothing is written to ``~/.ssh``.

Each host also gets a hostname of its own (:meth:`SshHosts.on`: ``unshare --uts``, then
``hostname``; sshd's sessions inherit it), as separate machines have: Open MPI tells nodes apart
by it, and torchrun's rendezvous gives it to the other nodes as the address to reach this one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .netns import NETNS_ETC, ShapedNetwork

SSHD = "/usr/sbin/sshd"   # sshd refuses to start from a relative path
PRIVSEP_DIR = "/run/sshd"  # Debian's sshd needs it and creates it only from its service unit

_SSHD_CONFIG = """ListenAddress {addr}
Port 22
HostKey {tmp}/host_key
AuthorizedKeysFile {tmp}/authorized_keys
PidFile none
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
LogLevel ERROR
"""

_SSH_CONFIG = """Host *
    IdentityFile {tmp}/id_ed25519
    GlobalKnownHostsFile {tmp}/known_hosts
    UserKnownHostsFile /dev/null
    BatchMode yes
    ConnectTimeout 5
"""


def missing() -> list[str]:
    """Why ssh hosts cannot be built here (besides :func:`netns.missing_prerequisites`); empty when they can."""
    why = []
    if not os.access(SSHD, os.X_OK):
        why.append(f"{SSHD} is missing: apt-get install openssh-server (scripts/install.sh does, as root)")
    for tool in ("ssh", "ssh-keygen", "unshare", "hostname"):
        if shutil.which(tool) is None:
            why.append(f"'{tool}' was not found on PATH (apt-get install openssh-client util-linux hostname)")
    return why


class SshHosts:
    """An sshd on each host of ``net`` listed in ``serve`` (default: all); ``net`` needs ``names``."""

    def __init__(self, net: ShapedNetwork, serve: tuple | None = None, timeout: float = 30.0):
        if not net.names:
            raise ValueError("SshHosts needs host names: ShapedNetwork(..., names=('hostA', 'hostB'))")
        self.net, self.timeout = net, timeout
        self.serve = tuple(range(net.hosts)) if serve is None else tuple(serve)
        self.tmp: Path | None = None
        self.daemons: list = []

    def on(self, i: int, cmd: list) -> list:
        """argv that runs ``cmd`` on host ``i``: in its network namespace, under its own hostname."""
        name = self.net.names[i]
        return self.net.exec_prefix(i) + ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name,
                                          *map(str, cmd)]

    def __enter__(self) -> "SshHosts":
        try:
            self._keys()
            os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
            for i in range(self.net.hosts):
                self._client_config(self.net.host_ns(i))
            self._client_config(self.net.switch_ns)
            for i in self.serve:
                self._start(i)
            self._wait()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait(timeout=10)
        self.daemons = []
        for ns in [self.net.switch_ns] + [self.net.host_ns(i) for i in range(self.net.hosts)]:
            shutil.rmtree(os.path.join(NETNS_ETC, ns, "ssh"), ignore_errors=True)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _keys(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="redsync-ssh-"))
        for key in ("host_key", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "redsync-test", "-f",
                            str(self.tmp / key)], check=True, capture_output=True, timeout=30)
        (self.tmp / "authorized_keys").write_text((self.tmp / "id_ed25519.pub").read_text())
        names = ",".join([*self.net.names, *(self.net.host_addr(i) for i in range(self.net.hosts))])
        (self.tmp / "known_hosts").write_text(f"{names} {(self.tmp / 'host_key.pub').read_text()}")

    def _client_config(self, ns: str) -> None:
        etc = Path(NETNS_ETC, ns, "ssh")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "ssh_config").write_text(_SSH_CONFIG.format(tmp=self.tmp))

    def _start(self, i: int) -> None:
        config = self.tmp / f"sshd_config.{self.net.names[i]}"
        config.write_text(_SSHD_CONFIG.format(addr=self.net.host_addr(i), tmp=self.tmp))
        log = open(self.tmp / f"sshd.{self.net.names[i]}.log", "w")
        self.daemons.append(subprocess.Popen(self.on(i, [SSHD, "-D", "-e", "-f", config]), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait(self) -> None:
        """Until ``ssh <name> true`` works from the switch namespace to every served host."""
        deadline = time.time() + self.timeout
        for i in self.serve:
            name = self.net.names[i]
            while True:
                probe = subprocess.run(self.net.exec_prefix(None) + ["ssh", name, "true"], capture_output=True,
                                       text=True, timeout=30)
                if probe.returncode == 0:
                    break
                if time.time() > deadline:
                    log = (self.tmp / f"sshd.{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"sshd on {name} did not answer within {self.timeout:.0f}s: "
                                       f"{probe.stderr.strip()}\n{log}")
                time.sleep(0.2)
