"""What a multi-host job checks about its hosts, in one line each (docs/cluster.md).

1. Every rank runs the same versions: :func:`identity` (this rank's host and the versions of
   redsync_hvd and the frameworks it runs) travels in the runner's start-up agreement, and
   :func:`version_mismatch` names the first rank whose versions differ from rank 0's, with its host.
   Ranks that differ there may still exchange (a changed wire format would then decode wrong) or
   hang in a collective that one side no longer makes.
2. A host horovodrun cannot reach over ssh: :func:`hook_ssh_check`, run in horovodrun's process
   (redsync_hvd/_startup.py), makes its ssh check's report (for each host, every line ssh said,
   then a traceback) one line per host with the fix.

Imports nothing outside the standard library at load: horovodrun's process imports it at start-up.
"""
from __future__ import annotations

import contextlib
import io
import socket
import sys

from .launch_patches import after_launch

SAME_VERSIONS = ("install the same versions on every host: one virtualenv on a shared filesystem, or "
                 "scripts/install.sh from the same checkout on each host (docs/cluster.md)")
SSH_FIX = ("make `ssh {host} true` work from this machine without a password or a question (the host's name in "
           "/etc/hosts or DNS, an sshd there, this user's key in its ~/.ssh/authorized_keys; horovodrun -p PORT / "
           "-i KEY for another port or key; docs/cluster.md)")


def identity(packages: tuple = ("redsync_hvd",)) -> dict:
    """This rank's host name and the version of each of ``packages`` (already imported ones)."""
    versions = {}
    for name in packages:
        module = sys.modules.get(name) or __import__(name)
        versions[name] = str(getattr(module, "__version__", "unknown"))
    return {"host": socket.gethostname(), "versions": versions}


def version_mismatch(identities: list) -> str | None:
    """The one-line error for the first rank whose versions differ from rank 0's, or None."""
    first = identities[0]
    for rank, other in enumerate(identities[1:], start=1):
        differ = [name for name in sorted(set(first["versions"]) | set(other["versions"]))
                  if first["versions"].get(name) != other["versions"].get(name)]
        if differ:
            return (f"rank {rank} on host {other['host']} runs {_runs(other, differ)} where rank 0 on host "
                    f"{first['host']} runs {_runs(first, differ)}: {SAME_VERSIONS}")
    return None


def _runs(ident: dict, names: list) -> str:
    return ", ".join(f"{name} {ident['versions'].get(name, 'none')}" for name in names)


# -- horovodrun's ssh check ------------------------------------------------------------------------
def unreachable(report: str) -> list:
    """[(host, what ssh said last)] from the report of horovodrun's ssh check
    (``ssh not successful for host <host>:`` and ssh's output, per host)."""
    out = []
    for part in report.split("ssh not successful for host ")[1:]:
        head, _, said = part.partition(":\n")
        lines = [line.strip() for line in said.splitlines() if line.strip()]
        out.append((head.strip(), lines[-1] if lines else "no output"))
    return out


def one_line_per_host(check):
    """``check`` (horovod.runner.launch._check_all_hosts_ssh_successful) that, where a host cannot
    be reached, says so in one line per host with the fix and ends horovodrun with exit code 1."""
    def checked(hosts, *args, **kwargs):
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            ok = check(hosts, *args, **kwargs)
        if ok:
            return ok
        failed = unreachable(report.getvalue()) or [(",".join(hosts), report.getvalue().strip() or "no output")]
        for host, said in failed:
            sys.stderr.write(f"horovodrun: cannot reach host {host} over ssh ({said}): "
                             + SSH_FIX.format(host=host) + "\n")
        sys.stderr.flush()
        raise SystemExit(1)
    return checked


def _one_line_ssh_check(module) -> None:
    check = getattr(module, "_check_all_hosts_ssh_successful", None)
    if check is not None:
        module._check_all_hosts_ssh_successful = one_line_per_host(check)


def hook_ssh_check() -> None:
    """In horovodrun's process, before it imports its launcher."""
    after_launch(_one_line_ssh_check)
