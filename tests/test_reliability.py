"""Faults and what survives them: checkpoints, resume agreement, preemption, elastic workers.

Real processes throughout: a writer killed with SIGKILL, horovodrun jobs (MPI and Gloo
launchers, elastic with a host-discovery script), torchrun. docs/reliability.md lists
each fault and the outcome these tests check.
"""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import (
    REPO,
    catches,
    finish,
    finish_timed,
    horovodrun_elastic,
    rank_pids,
    run_script,
    start,
    summary,
    train,
    train_args,
)

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
SCENARIOS = ["ok", "missing", "resize", "resize_sum", "resize_reset", "prev", "prev_none"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One 2-rank job runs every scenario of tests/mp/checkpoint_resume.py (each one raises on
    both ranks or succeeds on both; a hang would time the job out). The faults a user meets
    through the runner (truncated, crafted, mismatched files) are tested on it below."""
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


def test_missing_file_names_file_and_rank(resumed):
    folder, lines = resumed
    _same_error_on_both(lines["missing"], f"rank 1: no checkpoint at {folder / 'missing' / 'checkpoint-rank1.pt'}",
                        "Rank 0 saved step", "Start the run again without training.resume")


def test_other_world_size_is_refused_by_default_with_the_two_choices(resumed):
    _same_error_on_both(resumed[1]["resize"], "written by 4 workers and this run has 2",
                        "training.on_resize=sum", "training.on_resize=reset")


def test_resize_sum_conserves_and_reset_counts(resumed):
    lines = resumed[1]
    assert sorted(lines["resize_sum"]) == ["OK sum of old ranks [0, 2], totals conserved",
                                           "OK sum of old ranks [1, 3], totals conserved"]
    counts = {int(re.search(r"dropped (\d+)", l).group(1)) for l in lines["resize_reset"]}
    assert len(lines["resize_reset"]) == 2 and len(counts) == 1 and counts.pop() > 0


def test_latest_saves_of_different_steps_fall_back_to_prev(resumed):
    """Rank 0 saved steps 20 and 26, rank 1 only 20 (killed mid-save): both resume step 20, rank 0
    from its .prev; with rank 0 at 32 (its .prev 26) no step is held by every rank: every rank
    stops with the same error."""
    folder, lines = resumed
    assert lines["prev"] == ["OK step 20 from ['.prev', 'latest'] (latest saves of steps [26, 20]), blob step 20"] * 2
    _same_error_on_both(lines["prev_none"], "step differs: step 32 on rank 0, step 20 on rank 1")


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


def test_stop_controller_decides_from_carried_flags_and_spaces_its_own_polls():
    """The flags any rank sends, combined by sum (the exchange's finite check) or max: a signal
    anywhere stops everyone, a due checkpoint saves only. Its own polls (poll_every_s=1) come
    once per second of the slowest rank's steps: steps of 0.1 s -> polls at steps 1, 2, 12, 22;
    a forced one at any step."""
    from redsync_hvd.preemption import StopController
    now = [0.0]
    polled = []
    ctl = StopController(lambda v: polled.append(list(v)) or v, checkpoint_every_s=10, poll_every_s=1.0,
                         clock=lambda: now[0])
    assert ctl.flags() == [0.0, 0.0, 0.0]
    assert ctl.decide([0.0, 0.0, 2.0]) == (True, False, "checkpoint_every_s")
    assert ctl.decide([0.0, 1.0, 1.0]) == (True, True, "SIGINT")
    for step in range(1, 31):
        now[0] += 0.1
        ctl.poll(step)
    assert len(polled) == 4 and [round(p[-1], 6) for p in polled] == [0.0, 0.1, 0.1, 0.1], polled
    # a forced poll (the runner's step-based saves) collects between planned ones and plans anew
    now[0] += 0.1
    assert ctl.poll(31, force=True) == (False, False, None) and len(polled) == 5
    ctl.request_stop(signal.SIGTERM)
    assert ctl.flags()[:2] == [1.0, 0.0]
    stop = next(step for step in range(32, 60) if ctl.poll(step).stop)   # the next planned poll: 1 s on
    assert stop in (40, 41, 42) and len(polled) == 6 and ctl.reason == "SIGTERM", (stop, polled)


def test_pinned_decisions_follow_the_file_and_refuse_another_model(tmp_path):
    """policy.decisions overrides what the policy would decide (here: the reverse of the size
    floor), nothing is probed, and the record says where it came from; a record of another
    model, or no file, is an error that names the problem."""
    from redsync_hvd.comm.local import LocalCommunicator
    from redsync_hvd.compressors.base import Layer
    from redsync_hvd.engine import build_exchange

    def layers(big=4096):
        return [Layer("fc.weight", (big,), big, 0), Layer("fc.bias", (16,), 16, 1)]
    record = {"layers": [{"name": "fc.weight", "numel": 4096, "compressed": False, "why": "x"},
                         {"name": "fc.bias", "numel": 16, "compressed": True, "why": "y"}]}
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps(record))
    spec = {"method": "topk", "density": 0.1, "policy": {"mode": "cost_model", "min_compress_numel": 100,
                                                         "decisions": str(path)}}
    ex = build_exchange(spec, layers(), LocalCommunicator(2)).exchange
    assert [(d["name"], d["compressed"]) for d in ex.layer_decisions()] == [("fc.weight", False), ("fc.bias", True)]
    assert ex.decision_record()["source"] == f"pinned: {path}" and ex.decision_record()["network"] is None
    with pytest.raises(ValueError, match=r"another model: .*other sizes \['fc.weight'\]"):
        build_exchange(spec, layers(big=4000), LocalCommunicator(2))
    with pytest.raises(ValueError, match="no file"):
        build_exchange({**spec, "policy": {"decisions": str(tmp_path / "nope.json")}}, layers(), LocalCommunicator(2))


def test_resume_of_another_experiment_names_the_keys_that_differ(tmp_path):
    """The checkpoint's experiment fingerprint must be this config's; what a resume may change
    (epochs, output, ...) does not count, anything else is named (one rank, one process)."""
    from redsync_hvd.config import load_config
    from redsync_hvd.runner import resume
    one_rank = lambda obj, name: [obj]   # noqa: E731 - allgather_object of a world of one
    cfg = load_config(REPO / CONFIG, [f"output.dir={tmp_path}"])
    checkpoint.save(tmp_path / "topk", 0, {"step": 5, "world_size": 1, "fingerprint": cfg.experiment_fingerprint(),
                                           "config": cfg.to_dict()})
    longer = load_config(REPO / CONFIG, [f"training.resume={tmp_path / 'topk'}", "training.epochs=40"])
    assert resume(longer, 0, 1, one_rank).agreement.step == 5
    other = load_config(REPO / CONFIG, [f"training.resume={tmp_path / 'topk'}", "compression.density=0.02"])
    with pytest.raises(checkpoint.CheckpointError, match=r"another experiment: compression.density: 0.01 -> 0.02"):
        resume(other, 0, 1, one_rank)


def test_a_checkpoint_of_an_older_version_resumes_where_only_new_keys_differ(tmp_path):
    """A version that adds a key changes every fingerprint. Checkpoints saved before it (their
    config without the key, their fingerprint over that) resume when the saved config, read now
    with the key at its default, is this run's experiment; a saved key whose value differs from
    this run's, or a new key set away from its default, is still another experiment."""
    from redsync_hvd.config import load_config, validate
    from redsync_hvd.runner import resume
    one_rank = lambda obj, name: [obj]   # noqa: E731 - allgather_object of a world of one
    cfg = load_config(REPO / CONFIG, [f"output.dir={tmp_path}"])
    older = cfg.to_dict()
    del older["compression"]["warmup"]["min_sends"]   # a key the older version did not have
    assert validate(older).experiment_fingerprint() == cfg.experiment_fingerprint()
    checkpoint.save(tmp_path / "old", 0, {"step": 7, "world_size": 1, "fingerprint": "0123456789abcdef",
                                          "config": older})
    now = load_config(REPO / CONFIG, [f"training.resume={tmp_path / 'old'}"])
    assert resume(now, 0, 1, one_rank).agreement.step == 7
    for changed in ("compression.density=0.02", "compression.warmup.min_sends=10"):
        other = load_config(REPO / CONFIG, [f"training.resume={tmp_path / 'old'}", changed])
        with pytest.raises(checkpoint.CheckpointError, match=r"another experiment: compression\."):
            resume(other, 0, 1, one_rank)


# -- preemption ------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["gloo", "mpirun"])
def test_sigterm_to_the_launcher_saves_every_rank(tmp_path, launcher):
    """What a scheduler sends to the job, with the launcher's defaults. Gloo launcher: SIGTERM to
    horovodrun's pid, forwarded at once (5 s before SIGKILL). mpirun: horovodrun has exec'd
    /bin/sh -c mpirun, which a signal to that pid alone would kill, orphaning mpirun; so the
    process group is signalled. mpirun would pass SIGTERM on only after 1 s, 1 s before its
    SIGKILL: each rank's relay (launchers.start_relay) passes it on at once."""
    extra = ["--gloo"] if launcher == "gloo" else []
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
    assert sorted(re.findall(r"rank (\d): stopped at step (\d+) on (SIGTERM|SIGINT)", out)) == \
        [("0", "7", "SIGTERM"), ("1", "7", "SIGTERM")], out[-3000:]


# -- the runner (python -m redsync_hvd.train): faults of a real training run ----------------------
CONFIG = "configs/digits/topk.yaml"
# A cosine schedule over 60 steps, lr scaled by the workers, and the cost model on a slow
# made-up network with a compressed layer's cost given: some layers compressed (residuals that
# must survive), the same ones on any machine at any load (a probed cost moves with the load, and
# so would the decisions). The review is off: a bucket it sent dense mid-run because this host
# was slow then would make the uninterrupted run differ from the pinned one, which runs dense from
# the start.
COMMON = ("training.steps=60", "training.checkpoint_every=20", "training.eval_every=30",
          "optimizer.scale_lr_by_workers=true", "compression.policy.mode=cost_model",
          "compression.policy.latency_s=0.0001", "compression.policy.bandwidth_gbit=0.1",
          "compression.policy.compute_s=[1e-4, 1e-9]", "compression.policy.overlap=0.0",
          "compression.policy.review_every=0")


def _wait(condition, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.02)


def logged_past(path: Path, step: int, old_inode: int) -> bool:
    """Whether ``path`` is a new file (not inode ``old_inode``) with a loss logged after ``step``."""
    try:
        if path.stat().st_ino == old_inode:
            return False
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return False
    return any('"loss"' in l and json.loads(l)["step"] > step for l in lines if l.endswith("}"))


@pytest.fixture(scope="module")
def runner_runs(tmp_path_factory):
    """Four launches shared by the tests below. ``ref``: uninterrupted, decided by the cost model.
    ``run``, with ref's decisions pinned: (1) rank 1 killed with SIGKILL once both ranks
    wrote their step-20 checkpoints; (2) resumed from them, SIGTERM to rank 1 alone once its
    handler is installed; (3) resumed from the run folder to the end, saving every 0.05 s too."""
    out = tmp_path_factory.mktemp("runner")
    ref, run = out / "ref", out / "run"
    train(out, CONFIG, *COMMON, "output.name=ref")
    same = (*COMMON, f"compression.policy.decisions={ref / 'decisions.json'}", "output.name=run")
    got = {}
    proc = start(train_args(out, CONFIG, *same))                                           # (1)
    pids = rank_pids(proc, 2)
    _wait(lambda: all((run / f"checkpoint-step20-rank{r}.pt").exists() for r in (0, 1)) or proc.poll() is not None,
          "the step-20 checkpoints")
    os.kill(pids[1], signal.SIGKILL)
    t_kill = time.time()
    got["killed"] = finish(proc, timeout=60, check=False)
    got["killed_exit_s"] = time.time() - t_kill
    got["pinned"] = json.loads((run / "decisions.json").read_text())
    metrics = run / "metrics.jsonl"
    killed_log = metrics.stat().st_ino
    proc = start(train_args(out, CONFIG, *same, f"training.resume={run}/checkpoint-step20-rank{{rank}}.pt"))  # (2)
    pids = rank_pids(proc, 2)
    # The start-up guard catches SIGTERM too (launchers.guard_startup: a launch stopped before its
    # first step ends as "nothing trained"), so a handler is not enough: wait for a step of this
    # launch (the resume rewrites metrics.jsonl, then logs step 30), when the loop's handler is in.
    _wait(lambda: proc.poll() is not None or (logged_past(metrics, 20, killed_log)
                                             and catches(pids[1], signal.SIGTERM)), "a step of the resumed launch")
    os.kill(pids[1], signal.SIGTERM)
    got["stopped"] = finish(proc, timeout=120, check=False)
    got["stopped_steps"] = [checkpoint.load(run, r)["step"] for r in (0, 1)]
    got["resumed"] = train(out, CONFIG, *same, f"training.resume={run}", "training.checkpoint_every_s=0.05")  # (3)
    return ref, run, got


def test_killed_worker_then_sigterm_then_resume_ends_bit_identical(runner_runs):
    """kill -9 of one worker ends the job; resuming from the periodic checkpoints, stopping by
    SIGTERM on one rank and resuming again ends bit-identical to the uninterrupted run:
    weights and residuals of both ranks."""
    ref, run, got = runner_runs
    assert got["killed"].returncode != 0 and "done:" not in got["killed"].stdout, got["killed"].stdout[-3000:]
    assert got["killed_exit_s"] < 30, got["killed_exit_s"]
    stopped = got["stopped"]
    assert stopped.returncode == 75, stopped.stdout[-3000:]
    step = int(re.search(r"stopped at step (\d+) on SIGTERM", stopped.stdout).group(1))
    assert 20 < step < 60 and got["stopped_steps"] == [step, step], (step, got["stopped_steps"])
    assert f"continue with --set training.resume={run}" in stopped.stdout
    assert "[resume] step 20 from" in stopped.stdout and f"[resume] step {step} from" in got["resumed"].stdout
    for rank in (0, 1):
        a, b = checkpoint.load(ref, rank), checkpoint.load(run, rank)
        assert a["step"] == b["step"] == 60
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        ra, rb = (x["optimizer"]["redsync"]["memory"]["residual"] for x in (a, b))
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
        assert any(v.abs().sum() > 0 for v in ra.values())
    s = summary(run)
    assert [(r["step"], r["workers"]) for r in s["resumes"]] == [(20, 2), (step, 2)], s["resumes"]
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [l["step"] for l in lines if "loss" in l]
    assert steps == sorted(set(steps)) and steps[-1] == 60, steps   # no step logged twice
    saves = [(l["step"], l["reason"]) for l in lines if l.get("event") == "checkpoint"]
    assert (step, "SIGTERM") in saves and 40 in dict(saves) and saves[-1] == (60, "end"), saves
    timed = [s for s, reason in saves if reason == "checkpoint_every_s"]
    assert timed and all(step < s <= 60 for s in timed), saves
    # the saves before the last were made at the same step by both ranks (the .prev files)
    assert len({checkpoint.load(run / f"checkpoint-rank{r}.pt.prev", r)["step"] for r in (0, 1)}) == 1


def test_decisions_are_pinned_across_launches_and_reused_on_resume(runner_runs):
    """ref decides from the given link and compute; a new launch pinned to ref's decisions.json and
    both resumes (from the checkpoint, nothing decided again) compress exactly ref's layers."""
    ref, run, got = runner_runs
    decided = json.loads((ref / "decisions.json").read_text())
    assert decided["source"] == "cost model" and decided["compute"] is not None
    flags = [(d["name"], d["compressed"]) for d in decided["layers"]]
    assert any(c for _, c in flags) and not all(c for _, c in flags), flags
    assert got["pinned"]["source"] == f"pinned: {ref / 'decisions.json'}"
    resumed = json.loads((run / "decisions.json").read_text())
    assert resumed["source"].startswith(f"pinned: checkpoint {run}")
    for record in (got["pinned"], resumed, checkpoint.load(run, 1)["decisions"]):
        assert [(d["name"], d["compressed"]) for d in record["layers"]] == flags


def test_mismatched_steps_stop_every_rank_within_30s(runner_runs, tmp_path):
    """Rank 0's checkpoint from step 40, rank 1's from step 20 (a crash between two ranks'
    saves): every rank stops, and rank 0 names both steps once, with a step present on all; the
    job ends non-zero."""
    ref = runner_runs[0]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for rank, step in ((0, 40), (1, 20)):
        os.link(ref / f"checkpoint-step{step}-rank{rank}.pt", mixed / f"checkpoint-rank{rank}.pt")
        os.link(ref / f"checkpoint-step20-rank{rank}.pt", mixed / f"checkpoint-step20-rank{rank}.pt")
    proc = start(train_args(tmp_path, CONFIG, *COMMON, f"training.resume={mixed}"))
    code, lines = finish_timed(proc, timeout=120)
    end, out = time.time(), "".join(l for _, l in lines)
    began = next(t for t, l in lines if "[resume]" in l)
    assert code != 0 and end - began < 30, (code, end - began, out[-3000:])
    errors = [l for l in _untagged(out).splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert "step 40 on rank 0, step 20 on rank 1" in errors[0], errors
    assert f"--set training.resume={mixed}/checkpoint-step20-rank{{rank}}.pt" in errors[0], errors


class Evil:
    """Unpickling this would create a marker file: a crafted checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_truncated_and_crafted_files_are_named_on_every_rank(runner_runs, tmp_path):
    """Rank 0's file cut in half (a crash mid-write by a tool that writes in place), rank 1's a
    pickle that would run a command: both are named, with file and rank, in one line from rank 0
    (every rank stops alike); the command never runs."""
    ref = runner_runs[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    data = (ref / "checkpoint-rank0.pt").read_bytes()
    (bad / "checkpoint-rank0.pt").write_bytes(data[: len(data) // 2])
    torch.save({"step": 60, "world_size": 2, "fingerprint": "x", "x": Evil(tmp_path / "PWNED")},
               bad / "checkpoint-rank1.pt")
    r = train(tmp_path, CONFIG, *COMMON, f"training.resume={bad}", check=False, timeout=120)
    assert r.returncode == 2, r.stdout[-3000:]
    errors = [l for l in _untagged(r.stdout).splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, r.stdout[-3000:]
    assert f"rank 0: {bad / 'checkpoint-rank0.pt'} ({len(data) // 2} bytes) is truncated or corrupt" in errors[0]
    assert f"rank 1: {bad / 'checkpoint-rank1.pt'} is not a checkpoint this program wrote" in errors[0]
    assert "the global posix.system" in errors[0] and "nothing in it ran" in errors[0]
    assert not (tmp_path / "PWNED").exists()


def test_resume_on_fewer_workers_with_reset_reports_what_was_dropped(runner_runs, tmp_path):
    """ref's 2-worker checkpoints resumed on 1 worker with training.on_resize=reset: the
    dropped residual elements (all nonzero ones of both ranks) are logged and in summary.json,
    and the learning rate is this run's (lr x 1 worker), not the checkpoint's (lr x 2)."""
    ref = runner_runs[0]
    r = train(tmp_path, CONFIG, *COMMON, f"training.resume={ref}", "training.on_resize=reset",
              "training.steps=80", "output.name=one", np=1, timeout=180)
    owed = sum(int(torch.count_nonzero(t)) for rank in (0, 1)
               for t in checkpoint.load(ref, rank)["optimizer"]["redsync"]["memory"]["residual"].values())
    assert owed > 0 and f"2 -> 1 workers, on_resize=reset: {owed} residual elements dropped" in r.stdout
    s = summary(tmp_path / "one")
    assert s["steps"] == 80 and s["workers"] == 1 and s["resumes"][-1]["resize"]["dropped_elements"] == owed
    lr = next(json.loads(l)["lr"] for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in l and json.loads(l)["step"] == 70)
    assert lr == pytest.approx(0.05 * 0.5 * (1 + math.cos(math.pi * 70 / 80)), rel=1e-9), lr


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
