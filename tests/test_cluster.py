"""Multi-host launches as users start them (docs/cluster.md), on one machine.

Three hosts are network namespaces behind a bridge (redsync_hvd/experiments/netbench/netns.py),
named hostA, hostB and hostC in each one's /etc/hosts, each with a hostname of its own; hostA and
hostB run Debian's sshd with a throw-away key (netbench/sshd.py), hostC runs none. The launches are
the scripts of examples/cluster/, run as they are: horovodrun from hostA over ssh, Open MPI's
mpirun with a hostfile, and one torchrun per host meeting at hostA's c10d rendezvous. Each must
train to the very weights the same job gives on one host (``horovodrun -np 2 -H localhost:2``,
``torchrun --standalone``), and what goes wrong between hosts ends in one line.

Needs root and iproute2 (namespaces) and openssh-server (scripts/install.sh installs it as root);
skipped with the reason otherwise. The ssh check of an unknown host name runs anywhere.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, _env, finish, horovodrun, job_env, start, torchrun, train_args

sys.path.insert(0, str(REPO / "tests" / "golden"))
from record import weights_hash  # noqa: E402

from redsync_hvd.experiments.netbench import netns, sshd  # noqa: E402

NAMES = ("hostA", "hostB", "hostC")
CONFIG = "configs/digits/redsync.yaml"
SCRIPTS = REPO / "examples" / "cluster"
# torch's threads per rank default to the host's cores over its ranks: 1 with both ranks on this
# machine, 2 with one rank per emulated host; a different thread count sums a convolution's
# gradient in another order, so both runs take 1 to compare weights bit for bit
STEPS = ("training.epochs=2", "training.threads=1")   # 44 steps on 2 workers


def _why_not() -> str | None:
    why = netns.missing_prerequisites() + sshd.missing()
    if why:
        return "; ".join(why)
    probe = subprocess.run(["ip", "netns", "add", "rsnbclcap"], capture_output=True, text=True, timeout=10)
    subprocess.run(["ip", "netns", "del", "rsnbclcap"], capture_output=True, timeout=10)
    return f"cannot create a network namespace: {probe.stderr.strip()}" if probe.returncode else None


WHY = _why_not()
needs_hosts = pytest.mark.skipif(WHY is not None, reason=f"emulated hosts need root, iproute2 and sshd: {WHY}")


@pytest.fixture(scope="module")
def hosts():
    with netns.ShapedNetwork(hosts=3, bandwidth_mbit=None, names=NAMES, prefix=f"rsnb{os.getpid()}cl") as net, \
            sshd.SshHosts(net, serve=(0, 1)) as served:
        yield served


def weights(folder: Path) -> list:
    return [weights_hash(torch.load(folder / f"checkpoint-rank{r}.pt", map_location="cpu",
                                    weights_only=False)["model"]) for r in (0, 1)]


def run_args(out: Path, *overrides: str) -> list:
    """``<config> --set ...`` for a script of examples/cluster/ (it runs ``python -m redsync_hvd.train --config``)."""
    return [str(REPO / CONFIG), *train_args(out, CONFIG, *STEPS, *overrides)[5:]]


def on_host(hosts, i: int, argv: list, env: dict, timeout: float = 240, check: bool = True):
    return finish(subprocess.Popen(hosts.on(i, argv), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True),
                  timeout=timeout, check=check)


@pytest.fixture(scope="module")
def one_host_horovod(tmp_path_factory):
    out = tmp_path_factory.mktemp("one-host")
    horovodrun(train_args(out, CONFIG, *STEPS), np=2, timeout=240)
    return weights(out / "redsync")


def test_example_scripts_are_valid_bash_and_the_batch_scripts_run_the_tested_ones():
    for script in sorted(SCRIPTS.iterdir()):
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script.name}: {check.stderr}"
    assert "bash examples/cluster/horovodrun.sh" in (SCRIPTS / "slurm_horovod.sbatch").read_text()
    assert "bash examples/cluster/torchrun_node.sh" in (SCRIPTS / "slurm_torchrun.sbatch").read_text()


@needs_hosts
@pytest.mark.parametrize("how", ["horovodrun -H", "mpirun --hostfile"])
def test_two_hosts_over_ssh_train_to_the_weights_of_one(hosts, one_host_horovod, tmp_path, how):
    """horovodrun -np 2 -H hostA:1,hostB:1 (its ssh check, its NIC probe, mpirun's daemon on hostB
    over ssh), and mpirun with a hostfile, both from hostA."""
    (tmp_path / "hosts.txt").write_text("hostA slots=1\nhostB slots=1\n")
    script = "horovodrun.sh" if how.startswith("horovodrun") else "mpirun.sh"
    env = job_env({"HOSTS": "hostA:1,hostB:1"} if script == "horovodrun.sh"
                  else {"HOSTFILE": str(tmp_path / "hosts.txt")})
    res = on_host(hosts, 0, ["bash", SCRIPTS / script, *run_args(tmp_path)], env)
    assert weights(tmp_path / "redsync") == one_host_horovod, res.stdout[-3000:]


@needs_hosts
def test_one_torchrun_per_host_trains_to_the_weights_of_standalone(hosts, tmp_path):
    torchrun(train_args(tmp_path / "one", CONFIG, *STEPS, "engine=ddp")[1:], nproc=2, timeout=240)
    env = _env({"HEAD": "hostA", "NNODES": "2", "JOB_ID": "test-cluster"})
    argv = ["bash", SCRIPTS / "torchrun_node.sh", *run_args(tmp_path / "two")]
    head = subprocess.Popen(hosts.on(0, argv), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    on_host(hosts, 1, argv, env)
    finish(head, timeout=60)
    assert weights(tmp_path / "two" / "redsync") == weights(tmp_path / "one" / "redsync")


@needs_hosts
@pytest.mark.parametrize("host, said", [("hostC", "Connection refused"), ("nohost", "Could not resolve hostname")])
def test_a_host_without_sshd_or_a_name_ends_horovodrun_in_one_line(hosts, host, said):
    res = finish(start(["python", "-c", "pass"], launcher_args=["-np", 2, "-H", f"hostA:1,{host}:1"],
                       on=hosts.on(0, [])), timeout=120, check=False)
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert res.returncode != 0 and len(lines) == 1, res.stdout
    assert f"cannot reach host {host} over ssh" in lines[0] and said in lines[0] and "docs/cluster.md" in lines[0]


def test_an_unknown_host_name_ends_horovodrun_in_one_line():
    """The same check from this machine, no namespaces needed."""
    res = finish(start(["python", "-c", "pass"], launcher_args=["-np", 1, "-H", "nohost.invalid:1"]), timeout=120,
                 check=False)
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert res.returncode != 0 and len(lines) == 1, res.stdout
    assert lines[0].startswith("horovodrun: cannot reach host nohost.invalid over ssh ("), lines[0]


@needs_hosts
def test_hosts_with_different_versions_stop_in_one_line_naming_the_host(hosts, tmp_path):
    """hostB's torchrun imports a copy of redsync_hvd whose version differs."""
    other = tmp_path / "other"
    shutil.copytree(REPO / "redsync_hvd", other / "redsync_hvd", ignore=shutil.ignore_patterns("__pycache__"))
    init = other / "redsync_hvd" / "__init__.py"
    init.write_text(re.sub(r'__version__ = "([^"]+)"', r'__version__ = "\1+other"', init.read_text()))
    argv = ["bash", SCRIPTS / "torchrun_node.sh", *run_args(tmp_path / "run")]
    env = {"HEAD": "hostA", "NNODES": "2", "JOB_ID": "test-versions"}
    head = subprocess.Popen(hosts.on(0, argv), cwd=REPO, env=_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    b = on_host(hosts, 1, argv, _env({**env, "PYTHONPATH": str(other)}), check=False)
    a = finish(head, timeout=60, check=False)
    said = [line for line in (a.stdout + b.stdout).splitlines() if line.startswith("error:")]
    assert a.returncode != 0 and b.returncode != 0 and len(said) == 1, a.stdout[-3000:] + b.stdout[-3000:]
    match = re.match(r"error: rank 1 on host (host[AB]) runs redsync_hvd (\S+) where rank 0 on host (host[AB]) runs "
                     r"redsync_hvd (\S+): install the same versions on every host", said[0])
    assert match and match[1] != match[3], said[0]
    hostb_runs = match[2] if match[1] == "hostB" else match[4]
    assert hostb_runs.endswith("+other") and match[2] != match[4], said[0]
