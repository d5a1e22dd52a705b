"""A run interrupted five times and resumed each time ends bit-identical to the same run
uninterrupted: under ``horovodrun`` with mpirun (the default launch) and under ``torchrun``
with the DDP engine.

Each interruption comes at a random step of a real 2-worker digits run
(``python -m redsync_hvd.train``), as a user or a scheduler sends it: SIGTERM or SIGINT
(Ctrl-C) to the launcher's process group, or SIGKILL to every process of the job while a
save is half done (a node that fails). Then the run resumes from its run folder. The
random order and steps come from a seed printed with any failure (``REDSYNC_TEST_SEED``
replays it).

A signal must reach the job at the step the seed chose, however loaded the machine: ``HOLD`` (below)
also makes ranks 0 and 1 wait after they log the step named in ``$REDSYNC_TEST_HOLD.step`` until the
test, having sent the signal, removes that file. Polling the log instead let a loaded machine run
several steps past each chosen one, and the last interruptions past the run's end. Both ranks wait:
under local steps (the config's ``local_steps: auto`` takes 8) the ranks meet only every 8 steps, so
one may be several steps, and a save, ahead of the other.

Catching a save half done needs one rank's save to be slow: ``HOLD`` is put on the ranks'
``PYTHONPATH`` as ``sitecustomize``; while the file ``$REDSYNC_TEST_HOLD`` exists, rank 1
waits before it renames its new checkpoint onto its name (a slow disk). Rank 0 finishes
its save of that step meanwhile and then waits too (so a loaded machine cannot let it save
once more before the kill), so the kill leaves latest saves of two consecutive saves, and the
resume must take the newest step every rank holds: rank 0's ``.prev``. The hold is put in
place while both ranks are paused at one step between two saves, so that both ranks' next save
is of one step and meets it. Put in place at any moment, it could come between rank 0's rename
and rank 1's; with rank 0 alone paused, rank 1 could be past the next save already (local
steps), rank 0 then holding its save and rank 1 waiting for it in the next exchange. Neither the
test nor the job would go on.
"""
import json
import os
import random
import signal
import time

import pytest
import torch
from launch import REPO, catches, finish, kill_session, rank_pids, start, start_torchrun, summary, train, train_args

from redsync_hvd import checkpoint

CONFIG = "configs/digits/redsync.yaml"
STEPS = 100
CHECKPOINT_EVERY = 6
# a cosine schedule over STEPS, tbs selection with threshold reuse, density warm-up, sign-mean
# messages (the config's): all of it in the checkpoint; a periodic save every 6 steps to catch
COMMON = (f"training.steps={STEPS}", "training.eval_every=1000", "training.log_every=1",
          f"training.checkpoint_every={CHECKPOINT_EVERY}", "training.checkpoint_every_s=0")
PLAN = ("SIGTERM", "SIGINT", "SIGKILL", "SIGTERM", "SIGINT")
HOLD = '''
import os, time
_hold = os.environ.get("REDSYNC_TEST_HOLD")
_rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", os.environ.get("RANK")))
if _hold and _rank in ("0", "1"):
    _replace = os.replace

    def replace(src, dst, *args, **kwargs):
        name = os.path.basename(str(dst))
        if name == "checkpoint-rank1.pt" and os.path.exists(_hold):     # rank 1: before its rename
            open(_hold + ".held", "w").close()
            while os.path.exists(_hold):
                time.sleep(0.01)
        done = _replace(src, dst, *args, **kwargs)
        if name == "checkpoint-rank0.pt" and os.path.exists(_hold):     # rank 0: after it, no further save
            open(_hold + ".saved", "w").close()
            while os.path.exists(_hold):
                time.sleep(0.01)
        return done
    os.replace = replace
if _hold and _rank in ("0", "1"):
    import redsync_hvd.runlog as _runlog
    _metrics = _runlog.RunLog.metrics

    def metrics(self, record):
        _metrics(self, record)
        at = _hold + ".step"
        if "loss" in record and os.path.exists(at) and open(at).read() == str(record.get("step")):
            open(_hold + ".paused" + _rank, "w").close()
            while os.path.exists(at):
                time.sleep(0.01)
    _runlog.RunLog.metrics = metrics
'''


def _wait(condition, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.01)


def _last_step(run) -> int:
    """The last step rank 0 logged (metrics.jsonl, a line per step)."""
    path = run / "metrics.jsonl"
    step = -1
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "loss" in record:
                step = max(step, int(record["step"]))
    return step


class Job:
    """One launch of the run under ``engine`` (horovod: horovodrun; ddp: torchrun)."""

    def __init__(self, engine: str, out, name: str, *extra: str, env: dict | None = None):
        args = train_args(out, CONFIG, *COMMON, f"output.name={name}", *extra)
        if engine == "ddp":
            self.proc = start_torchrun(args[1:] + ["--set", "engine=ddp"], env=env)
        else:
            self.proc = start(args, env=env)

    def running(self) -> dict:
        """{rank: pid} once both ranks handle SIGTERM (training has started)."""
        pids = rank_pids(self.proc, 2)
        _wait(lambda: self.proc.poll() is not None or all(catches(p, signal.SIGTERM) for p in pids.values()),
              "both ranks' SIGTERM handlers")
        return pids


def _interrupt(engine, out, kind: str, at: int, hold, seed) -> tuple:
    """One launch of run, resumed from its folder if it has one, interrupted by ``kind`` once rank 0
    logged step ``at`` (SIGKILL: at the save after it): (its output, its exit code). A failed check
    kills the job, so that no run is left to load the machine for the tests after it."""
    run = out / "run"
    resume = (f"training.resume={run}",) if (run / "checkpoint-rank0.pt").exists() else ()
    env = {"PYTHONPATH": f"{hold.parent}:{REPO}", "REDSYNC_TEST_HOLD": str(hold)}
    pause = hold.with_name(hold.name + ".step")
    paused = [hold.with_name(f"{hold.name}.paused{rank}") for rank in (0, 1)]
    if kind == "SIGKILL":
        at = _between_saves(run, at)
    pause.with_suffix(".tmp").write_text(str(at))   # rank 0 waits at step ``at`` (HOLD)
    pause.with_suffix(".tmp").rename(pause)
    job = Job(engine, out, "run", *resume, env=env)
    try:
        job.running()
        _wait(lambda: all(p.exists() for p in paused) or job.proc.poll() is not None, f"step {at} (seed {seed})")
        if job.proc.poll() is not None:
            raise AssertionError(f"the run ended before step {at} (seed {seed}):\n"
                                 f"{finish(job.proc, timeout=10, check=False).stdout[-4000:]}")
        if kind == "SIGKILL":
            return _kill_during_save(job, hold, pause, paused, seed)
        os.killpg(job.proc.pid, getattr(signal, kind))   # as Ctrl-C or a scheduler's kill -<pgid>
        # a head start for the signal before rank 0 goes on: were a handler to run later, the run
        # would stop a step or two later, which the checks read from the run, not from ``at``
        time.sleep(0.5)
        pause.unlink()
        done = finish(job.proc, timeout=120, check=False)
        for p in paused:
            p.unlink()
        return done.stdout, done.returncode
    finally:
        if job.proc.poll() is None:
            kill_session(job.proc)
            finish(job.proc, timeout=60, check=False)


def _between_saves(run, at: int) -> int:
    """Where rank 0 pauses before the SIGKILL: not at a save step (there rank 1 may be renaming
    its file while rank 0 has yet to save, and the hold would catch one rank only), and past the
    run's first save (the resume needs a step that both ranks saved)."""
    if not (run / "checkpoint-rank0.pt").exists():
        at = max(at, CHECKPOINT_EVERY + 1)
    return at + 1 if at % CHECKPOINT_EVERY == 0 else at


def _kill_during_save(job, hold, pause, paused, seed) -> tuple:
    """Both ranks are paused at the same step between saves, so no save is under way on either
    and their next save is of one step: with ``hold`` in place, rank 1 holds that save before the
    rename and rank 0 finishes its own and waits; then every process of the job is killed."""
    hold.touch()
    pause.unlink()
    held, saved = hold.with_name(hold.name + ".held"), hold.with_name(hold.name + ".saved")
    _wait(lambda: (held.exists() and saved.exists()) or job.proc.poll() is not None,
          f"rank 1 holding its save of a step rank 0 has saved (seed {seed})")
    kill_session(job.proc)
    done = finish(job.proc, timeout=60, check=False)
    for f in (hold, held, saved, *paused):
        f.unlink(missing_ok=True)
    return done.stdout, done.returncode


def _check_signal_stop(run, kind: str, text: str, code: int, seed) -> int:
    """Every rank saved one step, the hint was printed, the exit code is not 0; returns the step."""
    stops = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"stopped"' in l]
    assert stops and stops[-1]["reason"] == kind, (seed, kind, stops, text[-3000:])
    step = stops[-1]["step"]
    assert [checkpoint.load(run, r)["step"] for r in (0, 1)] == [step, step], (seed, text[-3000:])
    assert stops[-1]["files"] == [str(checkpoint.latest_path(run, r)) for r in (0, 1)]
    assert all(s > 0 for s in stops[-1]["save_s"]), stops[-1]
    assert f"stopped at step {step} on {kind}" in text and f"continue with --set training.resume={run}" in text
    assert code != 0, text[-2000:]
    return step


def _first_difference(ref, run, rank: int):
    """The first step whose step copies (every 6 steps) differ between the two runs, for the message."""
    for step in checkpoint.step_copies(ref, rank):
        a, b = (checkpoint.step_path(folder, rank, step) for folder in (ref, run))
        if b.exists() and not _equal(torch.load(a, weights_only=True), torch.load(b, weights_only=True)):
            return step
    return None


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _same_state(ref, run, seed) -> None:
    """Model, residuals and byte counters of every rank, bit for bit."""
    for rank in (0, 1):
        a, b = checkpoint.load(ref, rank), checkpoint.load(run, rank)
        assert a["step"] == b["step"] == STEPS
        assert _equal(a, b), f"seed {seed}: rank {rank}'s weights differ from step {_first_difference(ref, run, rank)}"
        ea, eb = checkpoint.exchange_state(a), checkpoint.exchange_state(b)
        ra, rb = ea["memory"]["residual"], eb["memory"]["residual"]
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra), rank
        assert any(v.abs().sum() > 0 for v in ra.values())
        counters = [{k: v for k, v in e["stats"]["total"].items() if not k.startswith("time_")} for e in (ea, eb)]
        assert counters[0] == counters[1] and counters[0]["wire_bytes"] > 0, rank


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_five_interruptions_end_bit_identical_to_an_uninterrupted_run(tmp_path, engine):
    """SIGTERM and SIGINT to the launcher's process group twice each, and one SIGKILL of the whole
    job during a save, at random steps; each time the run resumes from its folder. It ends with
    the uninterrupted run's model, residuals and byte counters on every rank, and summary.json
    lists every resume (the one after the SIGKILL from rank 0's .prev) and every stop."""
    seed = int(os.environ.get("REDSYNC_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    plan = rng.sample(PLAN, len(PLAN))
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(HOLD)
    hold = tmp_path / "inject" / "hold"
    launcher = "torchrun" if engine == "ddp" else "horovodrun"
    train(tmp_path, CONFIG, *COMMON, "output.name=ref", *(("engine=ddp",) if engine == "ddp" else ()),
          launcher=launcher)
    run, resumed_at = tmp_path / "run", []
    for kind in plan:
        at = max(_last_step(run), 0) + rng.randint(2, 12)
        text, code = _interrupt(engine, tmp_path, kind, at, hold, seed)
        if resumed_at and kind != "SIGKILL":
            assert f"[resume] step {resumed_at[-1]} from {run}" in text, (seed, text[-3000:])
        if kind == "SIGKILL":
            steps = [checkpoint.load(run, r)["step"] for r in (0, 1)]
            assert steps[0] > steps[1], (seed, steps)          # a save of one rank only: latest files differ
            resumed_at.append(steps[1])
        else:
            resumed_at.append(_check_signal_stop(run, kind, text, code, seed))
    final = train(tmp_path, CONFIG, *COMMON, "output.name=run", f"training.resume={run}",
                  *(("engine=ddp",) if engine == "ddp" else ()), launcher=launcher)
    assert f"[resume] step {resumed_at[-1]} from {run}" in final.stdout
    _same_state(tmp_path / "ref", run, seed)
    s = summary(run)
    assert [r["step"] for r in s["resumes"]] == resumed_at, (seed, s["resumes"], resumed_at)
    kill_resume = s["resumes"][plan.index("SIGKILL")]   # resumes[j]: the launch after interruption j
    assert kill_resume["fallback"]["files"] == [".prev", "latest"], (seed, kill_resume)
    assert [(x["reason"], x["step"]) for x in s["stops"]] == \
        [(k, st) for k, st in zip(plan, resumed_at) if k != "SIGKILL"], (seed, s["stops"])


def test_a_resume_at_the_end_of_an_epoch_continues_with_the_next_epochs_order(tmp_path):
    """A checkpoint of an epoch's last step (a stop or a periodic save that falls there) resumes
    into the next epoch's order, not the finished one's again: the sampler draws once more when
    it runs out, which the resume replays. Resumed from the ref run's copy of that step, the run
    ends with the ref run's weights."""
    common = ("training.steps=40", "training.log_every=1", "training.eval_every=1000",
              "training.checkpoint_every_s=0", "training.checkpoint_every=1")   # a copy of every step
    train(tmp_path, CONFIG, *common, "output.name=ref")
    logged = next(json.loads(l) for l in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in l)
    spe = round(logged["step"] / logged["epoch"])                 # steps per epoch of this run
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):   # the ref run's save of the epoch's last step, as the latest of a run folder
        checkpoint.step_path(tmp_path / "ref", rank, spe).rename(checkpoint.latest_path(run, rank))
    done = train(tmp_path, CONFIG, *common, "output.name=run", f"training.resume={run}")
    assert f"[resume] step {spe} from {run}" in done.stdout
    for rank in (0, 1):
        assert _equal(checkpoint.load(tmp_path / "ref", rank), checkpoint.load(run, rank)), rank
