"""Run folder: resolved config, metrics.jsonl, summary.json, decisions.json (per-rank
checkpoints are written by redsync_hvd/checkpoint.py)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

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

    def write_config(self, config: dict, resumed_at: int | None = None) -> None:
        """config.yaml, and metrics.jsonl opened for appending; a run resumed at step s in
        its own folder first drops the lines of steps after s (they are trained again)."""
        if self.rank != 0:
            return
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        path = self.dir / "metrics.jsonl"
        if resumed_at is not None and path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= resumed_at]
            tmp = path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self._metrics = open(path, "a", buffering=1)

    def decisions(self, record: dict) -> None:
        """decisions.json: per-layer decisions and the figures behind them (compression.policy.decisions
        pins them for another run)."""
        if self.rank == 0:
            # plain json.dumps: an infinite bandwidth (one worker) must read back as a number
            (self.dir / "decisions.json").write_text(json.dumps(record, indent=2) + "\n")

    def metrics(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(_clean(record)) + "\n")

    def summary(self, record: dict) -> None:
        if self.rank == 0:
            (self.dir / "summary.json").write_text(json.dumps(_clean(record), indent=2) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return math.inf   # a torn last line (the writer was killed): dropped
