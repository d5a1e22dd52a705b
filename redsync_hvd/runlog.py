"""Run folder: resolved config, metrics.jsonl, summary.json, per-rank checkpoints."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import yaml


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunLog:
    """Only rank 0 writes the shared files; every rank writes its own checkpoint."""

    def __init__(self, root: str, name: str, rank: int):
        self.dir = Path(root) / name
        self.rank = rank
        self.dir.mkdir(parents=True, exist_ok=True)  # every rank: each writes its own checkpoint here
        self._metrics = None

    def write_config(self, config: dict) -> None:
        if self.rank == 0:
            (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)

    def metrics(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(_clean(record)) + "\n")

    def summary(self, record: dict) -> None:
        if self.rank == 0:
            (self.dir / "summary.json").write_text(json.dumps(_clean(record), indent=2) + "\n")

    def checkpoint_path(self, rank: int | None = None) -> Path:
        return self.dir / f"checkpoint-rank{self.rank if rank is None else rank}.pt"

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def rank_checkpoint(path: str, rank: int) -> str:
    """``resume`` may name a run folder (its latest checkpoint), a file with ``{rank}`` in it
    (e.g. ``runs/x/checkpoint-step30-rank{rank}.pt``), or any rank's ``checkpoint-rank<r>.pt``."""
    p = Path(path.format(rank=rank))
    if p.is_dir():
        p = p / f"checkpoint-rank{rank}.pt"
    elif p.name.startswith("checkpoint-rank"):
        p = p.with_name(f"checkpoint-rank{rank}.pt")
    if not p.is_file():
        raise FileNotFoundError(f"training.resume: no checkpoint for rank {rank} at {p}. Point it at a run folder "
                                "written by a run with the same number of workers (checkpoint-rank<r>.pt per rank)")
    return os.fspath(p)


def save_checkpoint(path, blob: dict) -> None:
    torch.save(blob, path)


def load_checkpoint(path) -> dict:
    return torch.load(path, weights_only=False)
