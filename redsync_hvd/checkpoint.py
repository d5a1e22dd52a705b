"""Per-rank checkpoints that survive crashes, load without running code, and agree on resume.

One file per rank (residuals are per worker), in the run folder:

    checkpoint-rank<r>.pt             the latest complete save
    checkpoint-rank<r>.pt.prev        the save before it (kept whole, a hard link)
    checkpoint-step<s>-rank<r>.pt     step copies (``keep_step=True``)

The runner's calls:

    checkpoint.save(run_dir, rank, blob)                   # blob: step, world_size, fingerprint, ...
    r = checkpoint.resume(path, rank, size, allgather_object, on_resize=...)
    r.blob, r.agreement.step, r.report                     # report: what a resize did (or None)

``resume`` = ``try_load`` + ``agree`` (one collective) [+ a resize step, one more].
Every failure becomes a :class:`CheckpointError` raised on *every* rank with the same text:
a rank that could not read its file still takes part in the collective and sends its error,
so no rank waits for one that gave up. Latest saves of different steps (a job killed between
two ranks' saves) fall back, in one more collective, to the newest step every rank holds as
its latest file or its ``.prev``.
"""
from __future__ import annotations

import glob
import os
import pickle
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from . import resize

REQUIRED = ("step", "world_size", "fingerprint")
# torch.load(weights_only=True) already admits tensors, torch.Size/dtype/device, dict, OrderedDict,
# list, tuple, set and scalars: all a normalised blob holds (see _plain). Nothing else is allowed.
EXTRA_SAFE_GLOBALS: tuple = ()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; ``kind``: missing | corrupt | unsafe | invalid | mismatch.
    ``steps_only``: a mismatch of steps alone (same world size and fingerprint everywhere)."""

    def __init__(self, message: str, path=None, rank: int | None = None, kind: str = "invalid",
                 steps_only: bool = False):
        super().__init__(message)
        self.path, self.rank, self.kind, self.steps_only = path, rank, kind, steps_only


# -- names ----------------------------------------------------------------------------------
def latest_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / f"checkpoint-rank{rank}.pt"


def step_path(run_dir, rank: int, step: int) -> Path:
    return Path(run_dir) / f"checkpoint-step{step}-rank{rank}.pt"


def resolve(path, rank: int) -> Path:
    """A run folder (its latest checkpoint), a name with ``{rank}`` in it, or any rank's
    ``checkpoint-rank<r>.pt[.prev]`` / ``checkpoint-step<s>-rank<r>.pt`` (this rank's is
    used) -> this rank's file."""
    p = Path(str(path).format(rank=rank))
    if p.is_dir():
        return latest_path(p, rank)
    m = re.fullmatch(r"checkpoint-(step\d+-)?rank\d+\.pt(\.prev)?", p.name)
    return p.with_name(f"checkpoint-{m.group(1) or ''}rank{rank}.pt{m.group(2) or ''}") if m else p


def step_copies(run_dir, rank: int) -> list:
    """Steps of this rank's step copies in ``run_dir``, ascending."""
    steps = []
    for name in glob.glob(str(Path(run_dir) / f"checkpoint-step*-rank{rank}.pt")):
        m = re.search(r"checkpoint-step(\d+)-rank\d+\.pt$", name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


# -- saving ---------------------------------------------------------------------------------
def save(run_dir, rank: int, blob: dict, keep_step: bool = False) -> Path:
    """Write this rank's checkpoint so that a crash at any moment leaves a complete one.

    1. Normalise the blob to what a safe load admits (numpy arrays -> tensors, numpy scalars
       -> Python numbers); anything else is refused here, not at resume time.
    2. ``torch.save`` into a temporary file in the same folder; flush and fsync it.
    3. Keep the current file as ``.prev`` (a hard link: both stay complete files throughout).
    4. ``os.replace`` the temporary file onto the name (atomic within a file system) and fsync
       the folder so the rename itself is durable.
    5. ``keep_step``: also link the new file as ``checkpoint-step<s>-rank<r>.pt``.
    """
    missing = [k for k in REQUIRED if k not in blob]
    if missing:
        raise ValueError(f"checkpoint blob lacks {missing}: agreement on resume compares {list(REQUIRED)}")
    blob = _plain(blob, "blob")
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = latest_path(folder, rank)
    _remove_stale_temporaries(folder, target.name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes 0600; give it a normal file's mode
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        if target.exists():
            _link_over(target, target.with_name(target.name + ".prev"))
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if keep_step:
        _link_over(target, step_path(folder, rank, int(blob["step"])))
    _fsync_dir(folder)
    return target


def _plain(value: Any, where: str) -> Any:
    """``value`` with numpy data turned into torch tensors / Python numbers; only the types a
    weights-only load admits remain (the reason ``EXTRA_SAFE_GLOBALS`` can stay empty)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, torch.Size,
                                           torch.dtype, torch.device)):
        return value
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[_plain(k, where)] = _plain(v, f"{where}[{k!r}]")
        if hasattr(value, "_metadata"):   # a module state_dict's version info (load_state_dict reads it)
            out._metadata = value._metadata
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items) if isinstance(value, tuple) else set(items)
    if type(value).__module__ == "numpy":
        import numpy as np
        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(value).copy())
        if isinstance(value, np.generic):
            return value.item()
    raise TypeError(f"checkpoint {where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint "
                    "holds tensors, numpy arrays, numbers, strings, lists and dicts only (it is loaded with "
                    "torch.load(weights_only=True)). Store its state_dict() or convert it to one of these")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _link_over(src: Path, dst: Path) -> None:
    """Make ``dst`` a second name of ``src``, replacing ``dst`` atomically (copy where links fail)."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.link")
    try:
        os.link(src, tmp)
    except OSError:   # a file system without hard links
        import shutil
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:   # some file systems refuse fsync on a folder; the data files are synced
        pass
    finally:
        os.close(fd)


def _remove_stale_temporaries(folder: Path, name: str) -> None:
    """Temporaries of this rank left by a save that was killed (never any other rank's)."""
    stale_names = glob.glob(str(folder / f".{glob.escape(name)}.*.tmp"))
    stale_names += glob.glob(str(folder / f".{glob.escape(name)}.prev.*.link"))
    for stale in stale_names:
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass


# -- loading --------------------------------------------------------------------------------
def load(path, rank: int, map_location=None) -> dict:
    """This rank's checkpoint (see :func:`resolve`), loaded with ``weights_only=True``: a file
    that asks to import anything beyond tensors and plain containers is refused, never run.
    Raises :class:`CheckpointError` naming the rank, the file and the way out."""
    p = resolve(path, rank)
    if not p.is_file():
        raise CheckpointError(f"rank {rank}: no checkpoint at {p}{_alternatives(p, rank)}", p, rank, "missing")
    try:
        with torch.serialization.safe_globals(list(EXTRA_SAFE_GLOBALS)):
            blob = torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        what = re.search(r"GLOBAL (\S+)|Unsupported operand \d+", str(exc))
        need = f"the global {what.group(1)}" if what and what.group(1) else \
            (what.group(0).lower() if what else "objects beyond tensors and plain containers")
        raise CheckpointError(
            f"rank {rank}: {p} is not a checkpoint this program wrote: unpickling it would need {need}, which "
            f"could run code, so it was refused and nothing in it ran (weights-only loading). Do not load it "
            f"with weights_only=False unless you wrote it yourself; resume from a checkpoint written by "
            f"redsync_hvd{_alternatives(p, rank)}", p, rank, "unsafe") from exc
    except Exception as exc:   # noqa: BLE001 - torch reports truncation as EOFError/RuntimeError/OSError
        first = str(exc).split(". ")[0].splitlines()[0][:200] if str(exc) else "unexpected end of file"
        raise CheckpointError(
            f"rank {rank}: {p} ({p.stat().st_size} bytes) is truncated or corrupt and cannot be read "
            f"({type(exc).__name__}: {first}). A crash while a file is being written leaves this (checkpoint.save "
            f"never leaves a partial file under a checkpoint's name){_alternatives(p, rank)}",
            p, rank, "corrupt") from exc
    missing = [k for k in REQUIRED if not isinstance(blob, dict) or k not in blob]
    if missing and isinstance(blob, dict) and "step" in blob and "config" in blob:
        raise CheckpointError(f"rank {rank}: {p} was written by an older redsync_hvd that did not record "
                              f"{missing}, so resuming from it cannot be checked against the other ranks and this "
                              "config. Start the run again (torch.load(path, weights_only=True)['model'] still "
                              "reads its weights)", p, rank, "invalid")
    if missing:
        raise CheckpointError(f"rank {rank}: {p} is not a redsync_hvd checkpoint (it lacks {missing}); point "
                              "training.resume at a run folder or a checkpoint-rank<r>.pt", p, rank, "invalid")
    return blob


def _alternatives(p: Path, rank: int) -> str:
    """'; resume from ...' naming the complete files next to ``p``, if any."""
    found = []
    prev = latest_path(p.parent, rank).with_name(f"checkpoint-rank{rank}.pt.prev")
    if prev.is_file() and prev != p:
        found.append(f"{prev} (the save before the latest)")
    steps = step_copies(p.parent, rank)
    if steps:
        found.append(f"the step copies checkpoint-step<s>-rank{rank}.pt for steps {steps[-5:]}")
    return ("; other saves: " + ", ".join(found)) if found else ""


def try_load(path, rank: int, map_location=None) -> tuple[dict | None, CheckpointError | None]:
    """(blob, None) or (None, error): for callers that must reach the collective regardless."""
    try:
        return load(path, rank, map_location), None
    except CheckpointError as exc:
        return None, exc
    except Exception as exc:   # noqa: BLE001 - anything else must also reach the other ranks
        return None, CheckpointError(f"rank {rank}: reading {path}: {type(exc).__name__}: {exc}", path, rank)


def meta(blob: dict) -> dict:
    return {k: blob[k] for k in REQUIRED}


# -- agreement ------------------------------------------------------------------------------
class Agreement(NamedTuple):
    step: int
    old_size: int        # workers that wrote the checkpoints
    size: int            # workers of this run
    fingerprint: str

    @property
    def resized(self) -> bool:
        return self.old_size != self.size


def agree(allgather_object: Callable, meta_or_error, rank: int, *, on_resize: str = "error",
          path=None, expect_fingerprint: str | None = None) -> Agreement:
    """Check, in one collective, that every rank resumes the same state; raise on every rank if not.

    ``meta_or_error``: this rank's ``meta(blob)`` ({step, world_size, fingerprint}), or the
    :class:`CheckpointError` it got (it must still be sent: the others stop on it too).
    ``allgather_object(obj) -> [obj of rank 0, 1, ...]`` (Horovod's ``allgather_object``,
    ``torch.distributed.all_gather_object`` wrapped to return the list).

    1. Gather every rank's meta or error (and its step copies, to suggest a common step).
    2. Any error other than a missing file: raise them all.
    3. Fingerprint, step and world size must be equal on the ranks that loaded a file.
    4. A world size other than this run's: refused unless ``on_resize`` is "sum" or "reset";
       then only ranks beyond the old world may lack a file. Same size: none may.
    The raised text depends on the gathered list alone, so every rank raises the same error.
    """
    resize.check_rule(on_resize)
    mine = {"rank": rank, "steps_available": step_copies(resolve(path, rank).parent, rank) if path else []}
    if isinstance(meta_or_error, BaseException):
        kind = getattr(meta_or_error, "kind", "invalid")
        mine.update(ok=False, kind=kind, error=str(meta_or_error))
    else:
        mine.update(ok=True, **{k: meta_or_error[k] for k in REQUIRED})
    everyone = list(allgather_object(mine))
    size = len(everyone)
    failed = [e for e in everyone if not e["ok"] and e["kind"] != "missing"]
    if failed:
        raise CheckpointError("cannot resume: " + "; ".join(e["error"] for e in failed), path, rank, failed[0]["kind"])
    loaded = [e for e in everyone if e["ok"]]
    missing = [e for e in everyone if not e["ok"]]
    if not loaded:
        raise CheckpointError(f"cannot resume: no rank found its checkpoint ({missing[0]['error']})", path, rank,
                              "missing")
    _check_same(loaded, everyone, path, rank)
    first = loaded[0]
    if expect_fingerprint is not None and first["fingerprint"] != expect_fingerprint:
        raise CheckpointError(f"cannot resume: the checkpoints come from config fingerprint {first['fingerprint']}, "
                              f"this run's is {expect_fingerprint}; resume with the config that wrote them",
                              path, rank, "mismatch")
    old = int(first["world_size"])
    if old != size and on_resize == "error":
        raise CheckpointError(f"cannot resume: {resize.explain(old, size)}", path, rank, "mismatch")
    lacking = [e for e in missing if e["rank"] < old]
    if lacking:
        saved = ", ".join(str(e["rank"]) for e in loaded)
        raise CheckpointError("cannot resume: " + "; ".join(e["error"] for e in lacking) +
                              f". Rank{'s' if len(loaded) > 1 else ''} {saved} saved step {first['step']} there; a job "
                              "killed during its first save leaves this. Start the run again without "
                              "training.resume, or resume from a folder where every rank saved", path, rank, "missing")
    return Agreement(int(first["step"]), old, size, str(first["fingerprint"]))


def _check_same(loaded: list, everyone: list, path, rank: int) -> None:
    """Raise one error listing every key on which the loaded checkpoints differ, rank by rank."""
    problems = []
    for key in ("step", "world_size", "fingerprint"):
        groups: dict = {}
        for e in loaded:
            groups.setdefault(e[key], []).append(e["rank"])
        if len(groups) > 1:
            problems.append(f"{key} differs: " + ", ".join(f"{key} {v} on rank{'s' if len(r) > 1 else ''} "
                                                          f"{', '.join(map(str, r))}" for v, r in groups.items()))
    if not problems:
        return
    common = set.intersection(*(set(e["steps_available"]) for e in everyone))
    run = resolve(path, 0).parent if path is not None else "<run>"
    hint = (f"step copies of step{'s' if len(common) > 1 else ''} {sorted(common)[-3:]} exist on every rank: "
            f"--set training.resume={run}/checkpoint-step{max(common)}-rank{{rank}}.pt") if common else \
        "no step present on every rank was found; resume every rank from files of one step (<file>.prev " \
        "holds each rank's save before the latest)"
    raise CheckpointError("cannot resume: the ranks' checkpoints are not from the same save (a crash between "
                          f"two ranks' saves does this): {'; '.join(problems)}. {hint}", path, rank, "mismatch",
                          steps_only=len(problems) == 1 and problems[0].startswith("step differs"))


# -- resume ---------------------------------------------------------------------------------
class Resumed(NamedTuple):
    blob: dict
    agreement: Agreement
    report: dict | None   # what a resize did (rule, sizes, dropped elements): for the log and summary.json
    fallback: dict | None = None   # latest saves of different steps: {"latest": steps per rank, "files": used}


def resume(path, rank: int, size: int, allgather_object: Callable, *, on_resize: str = "error",
           scale: float | Callable[[int, int], float] = 1.0, map_location=None,
           expect_fingerprint: str | None = None) -> Resumed:
    """Load this rank's checkpoint and agree with the others; every rank gets the same outcome.

    1. ``try_load`` this rank's file (an error is kept, not raised).
    2. ``agree``: one collective; raises on every rank on any error or disagreement.
    3. Same world size: done (no further collective).
    4. Resized (``on_resize`` "sum" or "reset", see :mod:`redsync_hvd.resize`): new rank j takes
       model, optimizer and the rest from old rank ``j % M`` and the residuals of old ranks
       ``i % N == j`` (merged or dropped; summed ones times ``scale``, or ``scale(M, N)``).
       The files of other ranks must be readable here (one host, or a shared file system). A
       second collective shares errors and dropped counts, so the report holds the totals on
       every rank.
    """
    blob, error = try_load(path, rank, map_location)
    fallback = None
    try:
        agreement = agree(allgather_object, error or meta(blob), rank, on_resize=on_resize, path=path,
                          expect_fingerprint=expect_fingerprint)
    except CheckpointError as exc:   # the same on every rank: all of them fall back, or none
        if not exc.steps_only or not _names_latest(path):
            raise
        blob, agreement, fallback = fall_back_to_prev(path, rank, allgather_object, blob, exc, map_location)
    if not agreement.resized:
        return Resumed(blob, agreement, None, fallback)
    report, error = None, None
    if callable(scale):
        scale = float(scale(agreement.old_size, agreement.size))
    try:
        blob, report = _resized(path, rank, agreement, on_resize, scale, blob, map_location)
    except Exception as exc:   # noqa: BLE001 - it must reach the other ranks
        error = str(exc) if isinstance(exc, CheckpointError) else f"rank {rank}: {type(exc).__name__}: {exc}"
    everyone = list(allgather_object({"error": error, "dropped": report and report["dropped"]}))
    errors = [e["error"] for e in everyone if e["error"]]
    if errors:
        raise CheckpointError("cannot resume with a different world size: " + "; ".join(errors), path, rank)
    dropped = {k: sum(e["dropped"][k] for e in everyone) for k in resize.MEMORY_KEYS}
    report.update(dropped=dropped, dropped_elements=sum(dropped.values()))
    return Resumed(blob, agreement, report)


def _names_latest(path) -> bool:
    """Whether ``path`` names the latest saves (a run folder or ``checkpoint-rank<r>.pt``): only
    then may a resume fall back to the ``.prev`` files; a named step copy or ``.prev`` is kept."""
    p = Path(str(path))
    return p.is_dir() or re.fullmatch(r"checkpoint-rank(\d+|\{rank\})\.pt", p.name) is not None


def fall_back_to_prev(path, rank: int, allgather_object: Callable, blob: dict, error: CheckpointError,
                      map_location=None) -> tuple:
    """Latest saves of different steps (every rank raised ``error``): (blob, agreement, fallback).

    1. Each rank reads the step of its ``.prev`` (the save before its latest).
    2. One allgather of (latest step, .prev step, world size, fingerprint).
    3. The newest step that every rank holds in one of its two files, with one world size and
       fingerprint, is resumed: each rank takes the file that holds it. None: ``error``."""
    prev_path = resolve(path, rank).with_name(f"checkpoint-rank{rank}.pt.prev")
    prev, _ = try_load(prev_path, rank, map_location)                                              # 1.
    mine = {"latest": meta(blob) if blob is not None else None, "prev": meta(prev) if prev is not None else None}
    everyone = list(allgather_object(mine))                                                         # 2.
    if any(e["latest"] is None for e in everyone):   # a rank without a latest file: no fallback anywhere
        raise error
    same = {(e["latest"]["world_size"], e["latest"]["fingerprint"]) for e in everyone}
    held = [{m["step"] for m in (e["latest"], e["prev"]) if m is not None and
             (m["world_size"], m["fingerprint"]) in same} for e in everyone]
    common = set.intersection(*held) if len(same) == 1 else set()
    if not common:
        raise error
    step = max(common)                                                                              # 3.
    files = ["latest" if e["latest"]["step"] == step else ".prev" for e in everyone]
    chosen = blob if files[rank] == "latest" else prev
    first = everyone[0]["latest"]
    agreement = Agreement(step, int(first["world_size"]), len(everyone), str(first["fingerprint"]))
    return chosen, agreement, {"latest": [e["latest"]["step"] for e in everyone], "files": files}


def _resized(path, rank: int, agreement: Agreement, rule: str, scale: float, own: dict | None, map_location):
    """This rank's blob for the new world and its share of the report (see ``resume`` step 4)."""
    old, size = agreement.old_size, agreement.size

    def read(i: int) -> dict:
        if i == rank and own is not None:
            return own
        blob = load(path, i, map_location)
        if meta(blob) != {"step": agreement.step, "world_size": old, "fingerprint": agreement.fingerprint}:
            raise CheckpointError(f"rank {rank}: {resolve(path, i)} (old rank {i}) is from step {blob['step']}, "
                                  f"world size {blob['world_size']}, not step {agreement.step} of the others",
                                  resolve(path, i), rank, "mismatch")
        return blob

    base = read(rank % old)
    if base.get("engine") == "fsdp":
        raise CheckpointError(f"engine: fsdp checkpoints hold each rank's shard of the weights, the optimizer and the "
                              f"residuals, cut for {old} workers; they cannot resume on {size}. Start {old} workers",
                              path, rank)
    if "decentralized" in (base.get("optimizer") or {}):
        raise CheckpointError("decentralized methods keep a model and neighbour replicas per worker; they "
                              f"cannot resume on {size} workers from {old}. Start {old} workers", path, rank)
    states = []
    for i in resize.assignment(old, size, rank):
        exchange = exchange_state(read(i))
        states.append(exchange.get("memory") if exchange else None)
    merged, dropped = resize.merge(states, rule, scale)
    exchange = exchange_state(base)
    if exchange is not None and exchange.get("memory") is not None:
        exchange["memory"] = merged
    hook = base.get("compression")
    if isinstance(hook, dict) and "world_size" in hook:   # the DDP hook's state says which world it is for
        hook["world_size"] = size
    report = {"rule": rule, "old_world_size": old, "new_world_size": size, "scale": scale,
              "from_old_ranks": resize.assignment(old, size, rank), "dropped": dropped}
    return base, report


def exchange_state(blob: dict) -> dict | None:
    """The exchange's ``state_dict()`` inside a blob: ``optimizer.redsync`` (torch under Horovod),
    ``compression.exchange`` (the DDP hook), ``redsync`` (TensorFlow) or ``exchange``; None for
    methods without one."""
    for keys in (("optimizer", "redsync"), ("compression", "exchange"), ("redsync",), ("exchange",)):
        node = blob
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return node
    return None
