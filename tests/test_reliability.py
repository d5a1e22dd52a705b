"""Faults and what survives them: checkpoints, resume agreement, preemption, elastic workers.

Real processes throughout: a writer killed with SIGKILL, horovodrun jobs (MPI and Gloo
launchers, elastic with a host-discovery script), torchrun. docs/reliability.md lists
each fault and the outcome these tests check.
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from launch import REPO, finish, horovodrun_elastic, run_script, start

from redsync_hvd import checkpoint, resize

MP = REPO / "tests" / "mp"


# -- atomic save ------------------------------------------------------------------------------
KILLED_WRITER = """
import sys, torch
from redsync_hvd import checkpoint
folder = sys.argv[1]
checkpoint.save(folder, 0, {"step": 1, "world_size": 1, "fingerprint": "x", "w": torch.ones(10)})
big = {f"t{i}": torch.full((25_000,), float(i)) for i in range(2000)}   # 200 MB: a write that takes a while
print("ready", flush=True)
checkpoint.save(folder, 0, {"step": 2, "world_size": 1, "fingerprint": "x", "big": big})
"""


def test_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL while the new checkpoint is half written: the name still holds the old one, the
    partial file is only a temporary, and the next save clears it."""
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "ready"
    deadline, partial = time.time() + 30, []
    while time.time() < deadline and p.poll() is None:
        partial = glob.glob(str(tmp_path / ".checkpoint-rank0.pt.*.tmp"))
        if partial and os.path.getsize(partial[0]) > 1_000_000:
            os.kill(p.pid, signal.SIGKILL)
            break
    assert p.wait() == -signal.SIGKILL, "the writer finished before it could be killed mid-write"
    assert 1_000_000 < os.path.getsize(partial[0]) < 200_000_000
    assert checkpoint.load(tmp_path, 0)["step"] == 1
    checkpoint.save(tmp_path, 0, {"step": 3, "world_size": 1, "fingerprint": "x"})
    assert not glob.glob(str(tmp_path / ".*.tmp"))
    assert checkpoint.load(tmp_path, 0)["step"] == 3
    assert checkpoint.load(tmp_path / "checkpoint-rank0.pt.prev", 0)["step"] == 1


def test_save_refuses_what_a_safe_load_could_not_read(tmp_path):
    with pytest.raises(TypeError, match=r"blob\['opt'\] is a builtins.object"):
        checkpoint.save(tmp_path, 0, {"step": 1, "world_size": 1, "fingerprint": "x", "opt": object()})
    with pytest.raises(ValueError, match="lacks"):
        checkpoint.save(tmp_path, 0, {"step": 1})
    np = pytest.importorskip("numpy")
    checkpoint.save(tmp_path, 0, {"step": 1, "world_size": 1, "fingerprint": "x", "w": np.arange(3.0),
                                  "t": np.int64(7)})
    blob = checkpoint.load(tmp_path, 0)    # numpy became torch: no numpy pickles to allow
    assert torch.equal(blob["w"], torch.arange(3.0, dtype=torch.float64)) and blob["t"] == 7


# -- resume under horovodrun ------------------------------------------------------------------
SCENARIOS = ["ok", "truncated", "crafted", "missing", "mismatch", "resize", "resize_sum", "resize_reset"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One 2-rank job runs every scenario of tests/mp/checkpoint_resume.py (each one raises on
    both ranks or succeeds on both; a hang would time the job out)."""
    folder = tmp_path_factory.mktemp("resume")
    out = _untagged(run_script("checkpoint_resume.py", folder, *SCENARIOS, np=2, timeout=120).stdout)
    assert out.count("all scenarios done") == 2, out
    lines = {}
    for scenario in SCENARIOS:
        lines[scenario] = [l.split(f" {scenario}: ", 1)[1] for l in out.splitlines()
                           if re.search(rf"rank \d {scenario}: ", l)]
    return folder, lines


def _untagged(out: str) -> str:
    """mpirun's output without its ``[job,rank]<stdout>:`` tags, one rank's line per line
    (a tag can land mid-line when two ranks print at once)."""
    return re.sub(r"\[\d+,\d+\]<std(?:out|err)>:", "\n", out)


def _same_error_on_both(lines, *fragments):
    assert len(lines) == 2 and all(l.startswith("ERROR") for l in lines), lines
    assert lines[0].split(") ", 1)[1] == lines[1].split(") ", 1)[1], lines    # the same text on every rank
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_resume_of_matching_checkpoints(resumed):
    assert resumed[1]["ok"] == ["OK step 20"] * 2


def test_truncated_file_names_file_and_rank(resumed):
    folder, lines = resumed
    _same_error_on_both(lines["truncated"], f"rank 1: {folder / 'truncated' / 'checkpoint-rank1.pt'}",
                        "truncated or corrupt", "checkpoint-step<s>-rank1.pt for steps [20]")


def test_crafted_pickle_runs_no_code(resumed):
    folder, lines = resumed
    _same_error_on_both(lines["crafted"], f"rank 1: {folder / 'crafted' / 'checkpoint-rank1.pt'}",
                        "the global posix.system", "nothing in it ran")
    assert not (folder / "crafted" / "PWNED").exists()


def test_missing_file_names_file_and_rank(resumed):
    folder, lines = resumed
    _same_error_on_both(lines["missing"], f"rank 1: no checkpoint at {folder / 'missing' / 'checkpoint-rank1.pt'}")


def test_mismatched_steps_name_ranks_steps_and_a_common_step(resumed):
    folder, lines = resumed
    _same_error_on_both(lines["mismatch"], "step 40 on rank 0, step 20 on rank 1",
                        f"--set training.resume={folder / 'mismatch'}/checkpoint-step20-rank{{rank}}.pt")


def test_other_world_size_is_refused_by_default_with_the_two_choices(resumed):
    _same_error_on_both(resumed[1]["resize"], "written by 4 workers and this run has 2",
                        "training.on_resize=sum", "training.on_resize=reset")


def test_resize_sum_conserves_and_reset_counts(resumed):
    lines = resumed[1]
    assert sorted(lines["resize_sum"]) == ["OK sum of old ranks [0, 2], totals conserved",
                                           "OK sum of old ranks [1, 3], totals conserved"]
    counts = {int(re.search(r"dropped (\d+)", l).group(1)) for l in lines["resize_reset"]}
    assert len(lines["resize_reset"]) == 2 and len(counts) == 1 and counts.pop() > 0


def test_mismatched_steps_exit_nonzero_within_30s(tmp_path):
    """From the moment the ranks start resuming to the end of the job (start-up excluded:
    on a loaded machine importing torch and Horovod alone can take tens of seconds)."""
    r = run_script("checkpoint_resume.py", tmp_path, "exit", np=2, timeout=120, check=False)
    ended = time.time()
    starts = [float(t) for t in re.findall(r"resuming at ([\d.]+)", r.stdout)]
    assert r.returncode != 0 and len(starts) == 2, (r.returncode, r.stdout[-3000:])
    assert ended - min(starts) < 30, (ended - min(starts), r.stdout[-3000:])
    assert r.stdout.count("step 40 on rank 0, step 20 on rank 1") == 2, r.stdout[-3000:]


def test_remap_conserves_the_total_and_scales():
    """5 old workers onto 2 and onto 3: per layer, the new residuals add up to the old ones
    (velocities too); with a scale, to scale times them; reset drops and counts everything."""
    g = torch.Generator().manual_seed(0)
    old = [{"residual": {"a": torch.randn(7, generator=g), "b": torch.randn(3, generator=g) * (i % 2)},
            "velocity": {"a": torch.randn(7, generator=g)}} for i in range(5)]
    for n in (2, 3, 7):
        new, dropped = resize.remap(old, n, "sum")
        assert len(new) == n and dropped == {"residual": 0, "velocity": 0}
        for key, name in (("residual", "a"), ("residual", "b"), ("velocity", "a")):
            total = sum(s[key][name] for s in old)
            assert torch.allclose(sum(s.get(key, {}).get(name, torch.zeros_like(total)) for s in new), total,
                                  atol=1e-6)
    scale = resize.pending_update_scale(5, 2, lr_old=0.5, lr_new=0.5)
    new, _ = resize.remap(old, 2, "sum", scale=scale)
    assert torch.allclose(new[0]["residual"]["a"] + new[1]["residual"]["a"],
                          0.4 * sum(s["residual"]["a"] for s in old), atol=1e-6)
    new, dropped = resize.remap(old, 2, "reset")
    assert all(s == {"residual": {}, "velocity": {}} for s in new)
    assert dropped["residual"] == sum(int(torch.count_nonzero(t)) for s in old for t in s["residual"].values())
    with pytest.raises(resize.ResizeError, match="one of"):
        resize.check_rule("average")


# -- preemption ------------------------------------------------------------------------------
def _rank_lines(out: str, pattern: str) -> list:
    return [m.groups() for m in re.finditer(pattern, _untagged(out))]


def test_sigterm_on_one_rank_stops_both_at_one_step_and_resume_is_exact(tmp_path):
    """SIGTERM reaches rank 1 only: both ranks save at the same step and exit with the
    'stopped' code; a resume from there ends bit-identical to an uninterrupted run, which
    also saved every 0.5 s of wall time at steps both ranks agreed on."""
    full = run_script("preempt_toy.py", tmp_path / "full", 30, "--every-s", 0.5, "--step-sleep", 0.05).stdout
    periodic = _rank_lines(full, r"rank (\d): saved at step (\d+) \(checkpoint_every_s\)")
    steps = {r: sorted(int(s) for rr, s in periodic if rr == r) for r in ("0", "1")}
    assert steps["0"] and steps["0"] == steps["1"], periodic
    final = re.search(r"final (\w+) at step 30", full).group(1)

    run = tmp_path / "run"
    stopped = run_script("preempt_toy.py", run, 30, "--signal-rank", 1, "--signal-step", 12, check=False)
    assert stopped.returncode == 75, stopped.stdout[-3000:]
    assert sorted(_rank_lines(stopped.stdout, r"rank (\d): saved at step (\d+) \((\w+)\)")) == \
        [("0", "12", "SIGTERM"), ("1", "12", "SIGTERM")], stopped.stdout[-3000:]
    assert _untagged(stopped.stdout).count(f"continue with --set training.resume={run}") == 2
    resumed = run_script("preempt_toy.py", run, 30, "--resume").stdout
    assert _untagged(resumed).count("resumed at step 12") == 2, resumed[-3000:]
    assert re.search(r"final (\w+) at step 30", resumed).group(1) == final


@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_sigterm_to_the_launcher_saves_every_rank(tmp_path, launcher):
    """What a scheduler sends to the job. Gloo launcher: SIGTERM to horovodrun's pid, forwarded
    at once (5 s before SIGKILL). mpirun: horovodrun has exec'd /bin/sh -c mpirun, which a
    signal to that pid alone would kill, orphaning mpirun; so the process group is signalled,
    and mpirun passes SIGTERM on after odls_base_sigkill_timeout seconds (set to 3 here; the
    default 1 s is also the grace before SIGKILL)."""
    extra = ["--gloo"] if launcher == "gloo" else ["--mpi-args=--mca odls_base_sigkill_timeout 3"]
    proc = start(["python", MP / "preempt_toy.py", tmp_path, 400, "--step-sleep", 0.1],
                 launcher_args=["-np", 2, "-H", "localhost:2", *extra])
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    deadline = time.time() + 60
    while time.time() < deadline and not all(p.exists() for p in logs):
        time.sleep(0.2)
    assert all(p.exists() for p in logs), "the job did not start training within 60 s"
    os.kill(proc.pid, signal.SIGTERM) if launcher == "gloo" else os.killpg(proc.pid, signal.SIGTERM)
    finish(proc, timeout=40, check=False)
    saved = [re.findall(r"saved at step (\d+) \(SIGTERM\)", p.read_text()) for p in logs]
    assert saved[0] and saved[0] == saved[1], saved
    assert {checkpoint.load(tmp_path, r)["step"] for r in (0, 1)} == {int(saved[0][0])}


def test_stop_controller_over_torch_distributed():
    from launch import run_torch_script
    out = run_torch_script("preempt_torchrun.py", 7, check=False, timeout=90).stdout
    assert sorted(re.findall(r"rank (\d): stopped at step (\d+) on (\w+)", out)) == \
        [("0", "7", "SIGTERM"), ("1", "7", "SIGTERM")], out[-3000:]


# -- Horovod Elastic ---------------------------------------------------------------------------
def _local_host_names() -> tuple:
    """Three names of this machine, one slot each. Horovod blacklists the *host* of a failed
    worker; with one name for all three, the first failure would blacklist every slot and end
    the job. Names that resolve to a local address are launched without ssh."""
    import socket

    import psutil
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    names = ["localhost", "127.0.0.1"]
    for candidate in [socket.gethostname(), *sorted(local - {"127.0.0.1"})]:
        try:
            if socket.gethostbyname(candidate) in local and candidate not in names:
                return (*names, candidate)
        except OSError:
            continue
    pytest.skip("no third name of this machine resolves to a local address (hostname or an interface's IPv4)")


def _discovery(tmp_path, hosts, join_flag=None):
    script = tmp_path / "discover.sh"
    lines = [f"echo {h}:1" for h in hosts]
    if join_flag is not None:   # one more host once the flag file exists
        lines[-1] = f"[ -e {join_flag} ] && {lines[-1]}"
    script.write_text("#!/bin/sh\n" + "\n".join(lines) + "\nexit 0\n")
    script.chmod(0o755)
    return script


def _elastic_events(out: str) -> dict:
    """{worker: [(event, step or None, size, residual hash, nonzero)]} from elastic_toy.py's lines."""
    events: dict = {}
    pattern = r"^(?:\[\d+\]<stdout>:)?(\S+:\d+) (commit (\d+)|reset|done step (\d+)) size (\d) .*?residual (\w+) " \
              r"nonzero (\d+)"
    for m in re.finditer(pattern, out, re.M):
        worker, what, commit_step, done_step, size, digest, nonzero = m.groups()
        kind = what.split()[0]
        events.setdefault(worker, []).append((kind, int(commit_step or done_step or -1), int(size), digest,
                                              int(nonzero)))
    return events


@pytest.mark.parametrize("rule", ["sum", "reset"])
def test_elastic_kill_one_of_three_finishes_with_two(tmp_path, rule):
    """kill -9 of one of three workers after step 10: the two others roll back to their own
    last commit (not rank 0's residual), go on as two, and finish with the same model; what the
    dead worker held ("sum") or everyone held ("reset") is reported as dropped."""
    victim = "127.0.0.1"
    r = horovodrun_elastic(["python", MP / "elastic_toy.py", 30, victim, 10, rule], min_np=2, max_np=3,
                           discovery_script=_discovery(tmp_path, _local_host_names()), timeout=150,
                           launcher_args=["--gloo-timeout-seconds", 10])
    events = _elastic_events(r.stdout)
    survivors = [w for w in events if not w.startswith(victim + ":")]
    dead = next(w for w in events if w.startswith(victim + ":"))
    assert len(survivors) == 2 and "killing itself after step 10" in r.stdout, r.stdout[-4000:]
    done = [next(e for e in events[w] if e[0] == "done") for w in survivors]
    assert all(d[1] == 30 and d[2] == 2 for d in done), done
    weights = set(re.findall(r"done step 30 size 2 weights (\w+)", r.stdout))
    assert len(weights) == 1, weights
    last_dead = [e for e in events[dead] if e[0] == "commit"][-1]
    resets = []
    for w in survivors:
        i = next(i for i, e in enumerate(events[w]) if e[0] == "reset")
        before, after = events[w][i - 1], events[w][i]
        assert before[0] == "commit" and before[1] == last_dead[1] and after[2] == 2, events[w][i - 2:i + 2]
        if rule == "sum":
            assert after[3] == before[3], (w, before, after)      # its own residual, as committed
        else:
            assert after[4] == 0, (w, after)
        resets.append((before, after))
    if rule == "sum":
        assert resets[0][1][3] != resets[1][1][3]                  # residuals stayed per worker
    reports = re.findall(r"resizes (\[.*\])", r.stdout)
    report = json.loads(reports[0])
    assert len(reports) == 2 and report[0]["departed"] == 1 and report[0]["new_world_size"] == 2
    expect = last_dead[4] if rule == "sum" else last_dead[4] + sum(b[4] for b, _ in resets)
    assert report[0]["dropped_elements"] == expect, (report, last_dead, resets)


def test_elastic_worker_joins_with_its_own_residual(tmp_path):
    """A third host appears at step 10: the joiner runs the constructor's config check with
    the survivors (no deadlock), takes the model from rank 0, starts with no residual, and all
    three finish with the same model; the survivors keep their residuals."""
    flag = tmp_path / "join"
    r = horovodrun_elastic(["python", MP / "elastic_toy.py", 40, f"+{flag}", 10], min_np=2, max_np=3, np=2,
                           discovery_script=_discovery(tmp_path, _local_host_names(), join_flag=flag), timeout=150,
                           launcher_args=["--gloo-timeout-seconds", 10])
    events = _elastic_events(r.stdout)
    done = {w: next(e for e in ev if e[0] == "done") for w, ev in events.items()}
    assert len(done) == 3 and all(d[1] == 40 and d[2] == 3 for d in done.values()), r.stdout[-4000:]
    assert len(set(re.findall(r"done step 40 size 3 weights (\w+)", r.stdout))) == 1
    assert len({d[3] for d in done.values()}) == 3                  # three different residuals
    assert "2 -> 3 workers (0 left, 1 joined; on_resize=sum): 0 residual elements dropped" in r.stdout
