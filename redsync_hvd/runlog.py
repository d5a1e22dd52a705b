"""Run folder: resolved config, metrics.jsonl, summary.json, decisions.json, layers.log (per-rank
checkpoints are written by redsync_hvd/checkpoint.py)."""
from __future__ import annotations

import glob
import json
import math
import os
import re
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


# what a run writes into its folder (rank 0 the shared files, every rank its checkpoints, with
# their .prev, step copies and hidden temporaries): another run's files there would mix with a new one's
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "decisions.json", "layers.log", ".metrics.jsonl.tmp")
CHECKPOINT_FILES = ("checkpoint-*.pt", "checkpoint-*.pt.prev", ".checkpoint-*")


def run_dir(root: str, name: str | None) -> Path:
    """The folder of run ``name`` under ``output.dir`` (RunLog's)."""
    return Path(root) / (name or "run")


def run_files(folder, rank: int | None = None) -> list:
    """The names of the run files in ``folder``, sorted (``rank``: only that rank's checkpoints)."""
    folder = Path(folder)
    names = [n for n in RUN_FILES if (folder / n).exists()] if rank is None else []
    for pattern in CHECKPOINT_FILES:
        found = (os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(str(folder)), pattern)))
        names += [n for n in found if rank is None or re.search(rf"-rank{rank}\.pt(\.|$)", n)]
    return sorted(set(names))


def foreign_files(folder, resume: str | None = None) -> list | None:
    """The files of another run in ``folder`` ([]: none), or None when ``resume`` is this folder
    or a checkpoint in it: the run goes on in its own folder."""
    folder = Path(folder)
    if resume:
        target = Path(str(resume)).resolve()
        if target == folder.resolve() or folder.resolve() in target.parents:
            return None
    return run_files(folder) if folder.is_dir() else []


def clear_run(folder, rank: int) -> int:
    """``output.overwrite``: delete the previous run's files; rank 0 all of them (the checkpoints
    of every rank of that run included, whatever its number of workers), every other rank its own
    checkpoints (a folder that is not shared between hosts). The number of files deleted."""
    folder = Path(folder)
    removed = 0
    for name in run_files(folder, None if rank == 0 else rank):
        try:
            (folder / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass   # another rank's, deleted by that rank first
    return removed


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

    def events(self, kind: str) -> list:
        """The ``{"event": kind}`` records in metrics.jsonl, oldest first (rank 0; others: [])."""
        path = self.dir / "metrics.jsonl"
        if self.rank != 0 or not path.exists():
            return []
        if self._metrics is not None:
            self._metrics.flush()
        out = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue   # a torn last line (the writer was killed)
            if record.get("event") == kind:
                out.append(record)
        return out

    def stops(self) -> list:
        """The stops on SIGTERM/SIGINT recorded in metrics.jsonl (rank 0; others: [])."""
        return self.events("stopped")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return math.inf   # a torn last line (the writer was killed): dropped


def write_layer_decisions(decisions, path, notes=()) -> None:
    """The per-layer decision (compressed or dense, and why), written once by rank 0 to the run
    folder's layers.log (summary.json has them too), not to the terminal; ``notes`` (what the
    engine changed of the config, and why) first, one ``[note]`` line each."""
    with open(path, "w") as f:
        for note in notes:
            print(f"[note] {note}", file=f)
        for d in decisions:
            message = f", {d['quantize']}" if "quantize" in d else ""
            path = f"; aggregation {d['aggregation']} ({d['aggregation_why']})" if d.get("aggregation") else ""
            print(f"[layers] {d['name']}: {'compressed' if d['compressed'] else 'dense'} "
                  f"(numel {d['numel']}, density {d['density']:g}{message}; {d['why']}){path}", file=f)


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy per token), capped at exp(50) so a diverged run stays a number."""
    return math.exp(min(loss, 50.0))


def test_figures(trainer) -> dict:
    """The trainer's evaluation; a language model's also has ``test_perplexity``."""
    result = trainer.evaluate()
    if trainer.task == "lm" and "test_loss" in result:
        result["test_perplexity"] = perplexity(result["test_loss"])
    return result


def build_summary(loop) -> dict:
    """summary.json: final test figures (``final_loss``; a language model's ``final_perplexity``:
    both on the data's evaluation split, ``data.eval_split``), bytes, time per phase, per-layer
    figures and decisions, stops, and what the data was (``DataBundle.record()``)."""
    stats = loop.trainer.communication_stats()
    stats.pop("last_step", None)
    layers = stats.pop("layers", {})
    phases = {p: stats.pop(p) for p in ("select", "communicate", "decompress")}
    result = loop.result
    extra = {"final_perplexity": perplexity(result["test_loss"])} if loop.trainer.task == "lm" and result else {}
    return {
        "final_accuracy": result.get("test_accuracy"), "final_loss": result.get("test_loss"), **extra,
        "wire_bytes": stats["wire_bytes"], "dense_bytes": stats["dense_bytes"],
        "compression_ratio": stats["compression_ratio"], "steps": loop.step, "workers": loop.size,
        "wall_time_s": loop.wall,
        "time_breakdown": {**phases, "eval": loop.t_eval,
                           "compute": max(0.0, loop.wall - loop.t_eval - sum(phases.values()))},
        "compression": loop.cfg.compression.model_dump(mode="json"), "comm_detail": stats,
        "layers": layers, "layer_decisions": loop.trainer.layer_decisions(),
        "decisions_source": loop.record.get("source"), "resumes": loop.resumes, "stops": loop.log.stops(),
        "data": loop.data,
    }
