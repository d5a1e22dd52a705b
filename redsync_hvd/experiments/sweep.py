"""Configs x ``--set`` x seeds x launchers, each run a real multi-process job, into one table.

    python -m redsync_hvd.experiments.sweep configs/sweeps/baselines.yaml [--quick] [--only ROW ...]
        [--parts PART ...] [--seeds 0 1 2] [--set KEY=VALUE ...] [--launcher horovodrun torchrun]
        [--np 2 4] [--env KEY=VALUE ...] [--runs DIR] [--out DIR] [--timeout S] [--list]
    python -m redsync_hvd.experiments.sweep --config configs/digits/dense.yaml configs/digits/redsync.yaml \\
        --set training.epochs=1 --launcher horovodrun torchrun

A sweep file (``configs/sweeps/*.yaml``) names rows: a training config, its ``--set`` overrides
(or another row's, by ``base``) and, where a row needs one, its launcher, worker count, module
and module arguments. ``--config`` adds one row per config file (named by its stem). Every row
runs once per seed, part, launcher (``--launcher``: horovodrun, horovodrun-gloo, torchrun, for
the rows that do not fix theirs) and worker count (``--np``), as
``<launcher> python -m redsync_hvd.train --config <config> --set ...`` (``engine=ddp`` under
torchrun). Overrides apply in this order: the row's, the sweep's ``set``, the part's, the
``quick`` ones (sweep, part, row) with ``--quick``, ``--set``; then the run's own (output
folder, seed, ``training.progress=false``).

Each job has a hard timeout (``--timeout``; on expiry its whole session is killed) and a run
folder ``<runs>/<part>/<row>-<launch>-s<seed>``. A folder with a summary.json is read, not run
again, and one stopped part-way goes on from its last checkpoint, so an interrupted sweep
resumes where it stopped; each folder records its job (job.json), and a sweep that finds a
folder made by another job (other overrides, other launcher, ``--quick`` against a full run),
or a finished run whose overrides the code or config file now resolves to another config (a
default changed, a bug fixed), stops before it launches anything. ``--quick`` runs the first seed with the sweep's quick
overrides, by default in ``runs/sweeps/<name>-quick`` (full runs: ``runs/sweeps/<name>``).

Writes, under ``--out`` (default: the runs folder): table.md (one row per row and launch, the
parts' columns side by side), results.json (the table's figures and every run's), results.csv
(one line per run), the plots the sweep asks for, command.txt and machine.json (the machine, the
load average over the sweep). Exit status 0 when every run finished, 1 when some failed or
timed out (rerun the same command to retry them), 2 for a bad sweep or command line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import sweep_report
from .jobs import LAUNCHERS, REPO, job_env, launch, train_command

TOP_KEYS = {"name", "description", "seeds", "launcher", "np", "timeout_s", "set", "quick", "metric", "reference",
            "columns", "plots", "parts", "rows"}
ROW_KEYS = {"label", "config", "set", "quick", "launcher", "np", "module", "args", "base", "reference", "metric"}
PART_KEYS = {"set", "quick", "seeds", "columns", "plots"}
LAUNCH_TAG = {"horovodrun": "hvd", "horovodrun-gloo": "gloo", "torchrun": "torchrun"}


class SweepError(ValueError):
    """A sweep file or command line that cannot run; the message names the problem and the fix."""


@dataclass(frozen=True)
class Job:
    part: str
    row: str
    launcher: str
    np: int
    seed: int
    config: str
    sets: tuple
    module: str = "redsync_hvd.train"
    args: tuple = ()
    env: tuple = ()

    @property
    def launch(self) -> str:
        return f"{LAUNCH_TAG[self.launcher]}{self.np}"

    @property
    def name(self) -> str:
        return f"{folder_name(self.row)}-{self.launch}-s{self.seed}"

    def identity(self) -> dict:
        return {"config": self.config, "sets": list(self.sets), "launcher": self.launcher, "np": self.np,
                "module": self.module, "args": list(self.args), "env": list(self.env), "seed": self.seed}


@dataclass
class Sweep:
    name: str
    rows: dict
    parts: dict = field(default_factory=lambda: {"": {}})
    seeds: list = field(default_factory=lambda: [0])
    launcher: str = "horovodrun"
    np: int = 2
    timeout_s: float = 1800
    sets: list = field(default_factory=list)
    quick: list = field(default_factory=list)
    metric: str = "final_accuracy"
    reference: str | None = None
    columns: list | None = None
    plots: list = field(default_factory=list)


def folder_name(row: str) -> str:
    """A row's name as a folder name: letters, digits and ``._-``; "=" as "-", others as "_"."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in row.replace("=", "-"))


def _strings(value, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SweepError(f"{where} must be a list of KEY=VALUE strings, got {value!r}")
    return list(value)


def _row(rows: dict, key: str, path, seen=()) -> dict:
    """Row ``key`` with its ``base`` chain resolved: the base's config, launch and overrides, then its own."""
    own = rows[key]
    if not isinstance(own, dict) or set(own) - ROW_KEYS:
        raise SweepError(f"{path}: row {key!r}: expected a mapping with keys from {sorted(ROW_KEYS)}, got {own!r}")
    base = {}
    if own.get("base") is not None:
        if own["base"] not in rows or own["base"] in seen:
            raise SweepError(f"{path}: row {key!r}: base {own['base']!r} is not another row of the sweep")
        base = _row(rows, own["base"], path, (*seen, key))
    row = {**{k: v for k, v in base.items() if k not in ("label", "reference")}, **own}
    row["set"] = base.get("set", []) + _strings(own.get("set"), f"row {key!r}: set")
    row["quick"] = base.get("quick", []) + _strings(own.get("quick"), f"row {key!r}: quick")
    row["args"] = [str(a) for a in row.get("args") or []]
    row.setdefault("label", key)
    if not row.get("config"):
        raise SweepError(f"{path}: row {key!r} has no config (give one, or a base row that has one)")
    if not (REPO / row["config"]).is_file() and not Path(row["config"]).is_file():
        raise SweepError(f"{path}: row {key!r}: config {row['config']} not found")
    if row.get("launcher") is not None and row["launcher"] not in LAUNCHERS:
        raise SweepError(f"{path}: row {key!r}: launcher must be one of {', '.join(LAUNCHERS)}")
    return row


def load_sweep(path) -> Sweep:
    """A sweep file, checked: unknown keys, rows without a config, configs that do not exist,
    bad bases and rows whose run folders would collide are errors that name the row."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"cannot read sweep {path}: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - TOP_KEYS or not isinstance(raw.get("rows"), dict):
        raise SweepError(f"{path}: a sweep is a mapping with rows (ROW: {{config: ..., set: [...]}}) and keys "
                         f"from {sorted(TOP_KEYS)}")
    rows = {str(k): _row(raw["rows"], k, path) for k in raw["rows"]}
    parts = raw.get("parts") or {"": {}}
    for name, part in parts.items():
        if not isinstance(part, dict) or set(part) - PART_KEYS:
            raise SweepError(f"{path}: part {name!r}: expected a mapping with keys from {sorted(PART_KEYS)}")
        part["set"] = _strings(part.get("set"), f"part {name!r}: set")
        part["quick"] = _strings(part.get("quick"), f"part {name!r}: quick")
    sweep = Sweep(name=raw.get("name", Path(path).stem), rows=rows, parts=parts, sets=_strings(raw.get("set"), "set"),
                  quick=_strings(raw.get("quick"), "quick"),
                  **{k: raw[k] for k in ("seeds", "launcher", "np", "timeout_s", "metric", "reference", "columns",
                                         "plots") if raw.get(k) is not None})
    _check(sweep, path)
    return sweep


def _check(sweep: Sweep, path) -> None:
    """What would otherwise fail only after the runs: the table's and plots' names, references."""
    names = [folder_name(k) for k in sweep.rows]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise SweepError(f"{path}: rows {clash} share a run folder name; rename one of them")
    refs = [sweep.reference] + [r.get("reference") for r in sweep.rows.values()]
    bad = sorted({r for r in refs if r is not None and r not in sweep.rows})
    if bad:
        raise SweepError(f"{path}: reference {bad} is not a row of the sweep")
    for metric in {sweep.metric} | {r["metric"] for r in sweep.rows.values() if "metric" in r}:
        if metric not in sweep_report.METRICS:
            raise SweepError(f"{path}: metric must be one of {', '.join(sweep_report.METRICS)}, got {metric!r}")
    if sweep.launcher not in LAUNCHERS or not isinstance(sweep.np, int) or not all(
            isinstance(s, int) for s in sweep.seeds):
        raise SweepError(f"{path}: launcher must be one of {', '.join(LAUNCHERS)}, np a whole number and seeds "
                         "a list of whole numbers")
    for where in [sweep.__dict__, *sweep.parts.values()]:
        unknown = set(where.get("columns") or []) - set(sweep_report.COLUMNS)
        unknown |= set(where.get("plots") or []) - {"bytes", "steps"}
        if unknown:
            raise SweepError(f"{path}: unknown columns or plots {sorted(unknown)}; columns: "
                             f"{', '.join(sweep_report.COLUMNS)}; plots: bytes, steps")


def build(args) -> Sweep:
    """The sweep of the command line: the file's rows and one per ``--config``, filtered by ``--only``."""
    if not args.sweep and not args.configs:
        raise SweepError("name a sweep file (configs/sweeps/*.yaml) or training configs with --config")
    sweep = load_sweep(args.sweep) if args.sweep else Sweep(name="configs", rows={})
    for config in args.configs:
        sweep.rows[Path(config).stem] = _row({Path(config).stem: {"config": config}}, Path(config).stem, "--config")
    sweep.rows = _pick("--only", "rows", sweep.rows, args.only)
    sweep.parts = _pick("--parts", "parts", sweep.parts, args.parts)
    return sweep


def _pick(option: str, what: str, have: dict, names: list | None) -> dict:
    """``have`` restricted to ``names`` (all of it without), in the order given."""
    if not names:
        return have
    missing = [n for n in names if n not in have]
    if missing:
        raise SweepError(f"{option}: no {what} {missing}; the {what} are: {', '.join(have)}")
    return {n: have[n] for n in names}


def plan(sweep: Sweep, args) -> list:
    """Every job, in order: part, row, launcher, worker count, seed."""
    seeds = (args.seeds or sweep.seeds)[:1 if args.quick else None]
    env = tuple(args.env)
    jobs = []
    for pname, part in sweep.parts.items():
        for key, row in sweep.rows.items():
            launchers = [row["launcher"]] if row.get("launcher") else args.launcher or [sweep.launcher]
            quick = (sweep.quick + part.get("quick", []) + row["quick"]) if args.quick else []
            sets = tuple(row["set"] + sweep.sets + part.get("set", []) + quick + args.overrides)
            for launcher in launchers:
                for np in args.np or [row.get("np", sweep.np)]:
                    jobs += [Job(pname, key, launcher, int(np), seed, row["config"], sets,
                                 row.get("module", "redsync_hvd.train"), tuple(row["args"]), env)
                             for seed in seeds[:part.get("seeds")]]
    return jobs


def folder_of(job: Job, runs: Path) -> Path:
    return runs / job.part / job.name if job.part else runs / job.name


def conflicts(jobs: list, runs: Path) -> list:
    """Run folders that another job made (job.json differs, or results without one), and finished
    runs whose config is not what the job's overrides resolve to now. A finished training run
    whose overrides were written otherwise (a row that now spells out a default) but resolve to
    the config it ran is the job's own: its job.json is brought up to date."""
    bad = []
    for job in jobs:
        folder = folder_of(job, runs)
        record, done = folder / "job.json", (folder / "summary.json").is_file()
        if not record.is_file():
            if done:
                bad.append(f"{folder} holds a run this command did not start (no job.json)")
            continue
        old = json.loads(record.read_text())
        if old != job.identity() and not _spelled_otherwise(old, job, folder, done):
            bad.append(f"{folder} holds a run of another job (other overrides, launcher or --quick)")
        elif done and (moved := resolved_elsewhere(job, folder)):
            bad.append(f"{folder} holds a run of the same overrides that the code or {job.config} now resolves "
                       f"differently ({moved})")
        elif old != job.identity():
            record.write_text(json.dumps(job.identity(), indent=1) + "\n")
    return bad


def _spelled_otherwise(old: dict, job: Job, folder: Path, done: bool) -> bool:
    """Only the overrides differ, and the finished run's config is what they resolve to now."""
    same_rest = {k: v for k, v in old.items() if k != "sets"} == \
        {k: v for k, v in job.identity().items() if k != "sets"}
    return same_rest and done and (folder / "config.yaml").is_file() and job.module == "redsync_hvd.train" \
        and not resolved_elsewhere(job, folder)


# What a run folder's config.yaml records of its own launch (besides output), not of the job.
_LAUNCH_KEYS = ("resume", "progress")


def _job_part(config: dict) -> dict:
    config = {k: v for k, v in config.items() if k != "output"}
    config["training"] = {k: v for k, v in config.get("training", {}).items() if k not in _LAUNCH_KEYS}
    return config


def resolved_elsewhere(job: Job, folder: Path) -> str:
    """The keys whose value in the finished run's config.yaml differs from what ``job``'s
    overrides resolve to now (a default changed, a bug fixed, the config file edited), so that
    a sweep never reads an old run as a run of the new code; "" when they agree or when the run
    records no config (another module's job)."""
    recorded = folder / "config.yaml"
    if job.module != "redsync_hvd.train" or not recorded.is_file():
        return ""
    from redsync_hvd.config.run import load_config  # pydantic only; a --list need not load it
    config = REPO / job.config if (REPO / job.config).is_file() else Path(job.config)
    sets = train_command(job.launcher, job.np, config, [*job.sets, f"training.seed={job.seed}"])
    sets = [a for flag, a in zip(sets, sets[1:]) if flag == "--set"]
    now, then = _job_part(load_config(config, sets).to_dict()), _job_part(yaml.safe_load(recorded.read_text()))
    return ", ".join(_differing(now, then)[:4])


def _differing(a, b, prefix="") -> list:
    """Where ``a`` (now) and ``b`` (then) differ; a key the run's code did not have yet is left out:
    a new key's default is what the code did before it (a default changed later is caught)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) if k in b for d in _differing(a.get(k), b[k], f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]}: {b!r} then, {a!r} now"]


def run_job(job: Job, runs: Path, timeout: float) -> dict:
    """One job: its results if its folder has them, else launched (from its last checkpoint if a
    launch of it stopped part-way), then read back."""
    folder = folder_of(job, runs)
    summary = folder / "summary.json"
    if not summary.is_file():
        extra = [f"output.dir={folder.parent}", f"output.name={folder.name}", "training.progress=false",
                 f"training.seed={job.seed}"]
        if job.module == "redsync_hvd.train" and (folder / "checkpoint-rank0.pt").is_file():
            extra.append(f"training.resume={folder}")
        else:   # none, or a launch stopped before its first save: the row again, from the start
            extra.append("output.overwrite=true")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "job.json").write_text(json.dumps(job.identity(), indent=1) + "\n")
        config = REPO / job.config if (REPO / job.config).is_file() else Path(job.config).resolve()
        cmd = train_command(job.launcher, job.np, config, [*job.sets, *extra], job.module, job.args)
        env = job_env(OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", **dict(e.split("=", 1) for e in job.env))
        load0 = os.getloadavg()[0]
        status = launch(cmd, runs / "logs" / job.part / f"{job.name}.log", timeout, env)
        print(f"{job.part + ' ' if job.part else ''}{job.name}: {status}", flush=True)
        if status != "ok" or not summary.is_file():
            return {"status": status}
        for ckpt in folder.glob("checkpoint-*"):   # hundreds of MB for the large models; the run is done
            ckpt.unlink()
        (folder / "load.json").write_text(json.dumps({"load_before": load0, "load_after": os.getloadavg()[0]}))
    return sweep_report.read_run(folder)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m redsync_hvd.experiments.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", nargs="?", help="a sweep file, e.g. configs/sweeps/baselines.yaml")
    ap.add_argument("--config", dest="configs", nargs="+", default=[], metavar="CFG",
                    help="training configs, one row each")
    ap.add_argument("--only", nargs="+", metavar="ROW", help="these rows only (--list shows them)")
    ap.add_argument("--parts", nargs="+", metavar="PART", help="these parts only")
    ap.add_argument("--seeds", type=int, nargs="+", help="default: the sweep's (with --quick: the first)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run, after the sweep's own")
    ap.add_argument("--launcher", nargs="+", choices=LAUNCHERS, help="for the rows that do not fix theirs")
    ap.add_argument("--np", type=int, nargs="+", help="workers per job (default: the sweep's, 2)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for every job's processes")
    ap.add_argument("--quick", action="store_true", help="first seed, the sweep's quick overrides (smoke test)")
    ap.add_argument("--runs", help="run folders (resumable); default runs/sweeps/<name>[-quick]")
    ap.add_argument("--out", help="tables, plots and records; default: the runs folder")
    ap.add_argument("--timeout", type=float, help="seconds per job before its session is killed")
    ap.add_argument("--list", action="store_true", help="print the rows and parts, run nothing")
    args = ap.parse_args(argv)
    bad = [e for e in args.env + args.overrides if "=" not in e]
    if bad:
        ap.error(f"--set and --env take KEY=VALUE, got {bad}")
    return args


def main(argv=None) -> int:
    """1. the sweep and its jobs; 2. every job not done yet; 3. table, plots and records."""
    args = parse_args(argv)
    try:
        sweep = build(args)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for key, row in sweep.rows.items():
            print(f"{key!r}: {row['label']} ({row['config']} {' '.join(row['set'])})")
        print(f"parts: {', '.join(p or '(one)' for p in sweep.parts)}")
        return 0
    runs = Path(args.runs or REPO / "runs/sweeps" / f"{sweep.name}{'-quick' if args.quick else ''}").resolve()
    jobs = plan(sweep, args)
    bad = conflicts(jobs, runs)
    if bad:
        print(f"error: {bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; give another --runs "
              "folder or delete it", file=sys.stderr)
        return 2
    t0, loads, results = time.time(), [os.getloadavg()[0]], []
    for job in jobs:
        results.append((job, run_job(job, runs, args.timeout or sweep.timeout_s)))
        loads.append(os.getloadavg()[0])
    out = Path(args.out).resolve() if args.out else runs
    sweep_report.write(out, sweep, results, argv, {"seeds": sorted({j.seed for j in jobs}), "quick": args.quick,
                                                   "load_average_1min": {"min": min(loads), "max": max(loads)},
                                                   "invocation_s": round(time.time() - t0)})
    failed = [f"{j.part + '/' if j.part else ''}{j.name}" for j, r in results if r["status"] != "ok"]
    if failed:
        print(f"failed or timed out (rerun the same command to retry them): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
