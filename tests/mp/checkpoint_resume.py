"""Resume from per-rank checkpoints under real Horovod: agreement, a missing file, world-size changes,
latest saves of different steps (a job killed between two ranks' saves).

    checkpoint_resume.py <folder> <scenario>...     (each scenario in <folder>/<scenario>)

Every scenario writes real checkpoints with redsync_hvd.checkpoint.save, removes one the
way the scenario says, then calls checkpoint.resume on every rank. An expected error is
printed as ``rank R <scenario>: ERROR <text>``; a success as ``rank R <scenario>: OK ...``.
(Truncated, crafted and mismatched files are tested through the runner,
tests/test_reliability.py.)
"""
import os
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from redsync_hvd import checkpoint
from redsync_hvd.resize import nonzero

OLD_SIZE = 4   # the resize scenarios write checkpoints of a 4-worker run


def residual(old_rank: int) -> dict:
    """A distinct, partly zero residual per old rank, reproducible anywhere."""
    g = torch.Generator().manual_seed(100 + old_rank)
    r = torch.randn(50, generator=g)
    r[torch.rand(50, generator=g) < 0.5] = 0.0
    return {"fc.weight": r, "fc.bias": torch.full((3,), float(old_rank))}


def blob(step: int, world_size: int, old_rank: int) -> dict:
    return {"step": step, "world_size": world_size, "fingerprint": "f00d", "model": {"w": torch.ones(3)},
            "optimizer": {"state": {}, "param_groups": [],
                          "redsync": {"step": step, "memory": {"residual": residual(old_rank), "velocity": {}},
                                      "compressor": {}, "stats": {"total": {}, "steps": step}}},
            "generator": torch.Generator().manual_seed(old_rank).get_state()}


def prepare(folder: Path, scenario: str, rank: int, size: int) -> dict:
    """Write this rank's files for ``scenario``; returns resume() keyword arguments."""
    if scenario.startswith("resize"):
        for old in range(rank, OLD_SIZE, size):   # the old 4-rank run's files, shared out
            checkpoint.save(folder, old, blob(30, OLD_SIZE, old))
        return {"on_resize": scenario.split("_")[1]} if "_" in scenario else {}
    if scenario.startswith("prev"):   # rank 1's save of step 26 (and 32) was cut short; rank 0's were not
        for step in (20, 26, 32)[:1 if rank else (2 if scenario == "prev" else 3)]:
            checkpoint.save(folder, rank, blob(step, size, rank))
        return {}
    checkpoint.save(folder, rank, blob(20, size, rank), keep_step=True)
    if rank == 1 and scenario == "missing":
        os.unlink(checkpoint.latest_path(folder, rank))
    return {}


def check_resize(scenario: str, r: checkpoint.Resumed, rank: int, size: int) -> str:
    """The merged residual is the sum of the old ranks i % size == rank; totals are conserved."""
    mine = r.blob["optimizer"]["redsync"]["memory"]
    olds = [residual(i) for i in range(OLD_SIZE)]
    if scenario == "resize_reset":
        expect = sum(nonzero({"residual": o})["residual"] for o in olds)
        assert mine["residual"] == {} and r.report["dropped_elements"] == expect, (r.report, expect)
        return f"reset dropped {r.report['dropped_elements']} elements"
    for name in ("fc.weight", "fc.bias"):
        want = sum(olds[i][name] for i in range(rank, OLD_SIZE, size))
        assert torch.equal(mine["residual"][name], want), name
        total = hvd.allreduce(mine["residual"][name], op=hvd.Sum, name=f"total.{name}")
        assert torch.allclose(total, sum(o[name] for o in olds), atol=1e-6), name
    assert r.report["dropped_elements"] == 0, r.report
    return f"sum of old ranks {r.report['from_old_ranks']}, totals conserved"


def run(folder: Path, scenario: str, rank: int, size: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = prepare(folder, scenario, rank, size)
    hvd.allreduce(torch.zeros(1), name=f"ready.{scenario}")   # every file is written before anyone reads
    t0 = time.time()
    try:
        r = checkpoint.resume(folder, rank, size, lambda obj: hvd.allgather_object(obj, name=f"ag.{scenario}"),
                              **kwargs)
    except checkpoint.CheckpointError as exc:
        print(f"rank {rank} {scenario}: ERROR ({time.time() - t0:.1f}s) {exc}", flush=True)
        return
    done = check_resize(scenario, r, rank, size) if scenario.startswith("resize") else f"step {r.agreement.step}"
    if r.fallback is not None:
        done += (f" from {r.fallback['files']} (latest saves of steps {r.fallback['latest']}), "
                 f"blob step {r.blob['step']}")
    print(f"rank {rank} {scenario}: OK {done}", flush=True)


def main() -> None:
    hvd.init()
    root = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        run(root / scenario, scenario, hvd.rank(), hvd.size())
    print(f"rank {hvd.rank()}: all scenarios done", flush=True)


if __name__ == "__main__":
    main()
