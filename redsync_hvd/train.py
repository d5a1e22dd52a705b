"""Train a model from a YAML config, under horovodrun (``engine: horovod``, the default) or
torchrun (``engine: ddp``, or ``engine: fsdp``: sharded training, docs/fsdp.md).

    horovodrun -np 2 python -m redsync_hvd.train --config configs/digits/topk.yaml \
        [--set compression.density=0.01 --set training.epochs=5 ...]
    torchrun --nproc_per_node 2 -m redsync_hvd.train --config configs/digits/topk.yaml --set engine=ddp

``framework: torch`` (default) or ``framework: tensorflow`` and ``engine`` pick the adapter;
the loop itself is redsync_hvd/runner.py, the same for all. The engine comes from the config
alone (it is part of the run's record and of its checkpoints); the launcher is only checked
against it, so a config started by the other launcher stops with the command to use.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

# only the standard library and these two at import: Ctrl-C while the frameworks load ends in
# one line (launchers.guard_startup, installed before main() imports them), not a traceback
from . import launchers
from .preemption import EXIT_STOPPED, exit_now

if TYPE_CHECKING:
    from .config import RunConfig

EXIT_BAD_INPUT = 2
# what each launcher leaves in its workers' environment
_TORCHRUN = ("TORCHELASTIC_RUN_ID",)
_HOROVODRUN = ("HOROVOD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m redsync_hvd.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value with its dotted name, e.g. compression.density=0.01")
    return ap.parse_args(argv)


def stop_with(message: str, rank: int | None = None) -> int:
    """A mistake that every rank finds alike: one line, from rank 0 only (``rank``: this rank's,
    else the launcher's variable), and exit code 2."""
    if (launchers.says() if rank is None else rank == 0):
        sys.stderr.write(f"error: {message}\n")   # one write: mpirun tags each write it forwards
        sys.stderr.flush()
    return EXIT_BAD_INPUT


def main(argv=None, framework: str | None = None) -> int:
    """Exit code 2, with the field and the fix on stderr (rank 0), for a bad config or a run folder
    that holds another run, before any collective."""
    args = parse_args(argv)
    # before the framework starts (no threads, no MPI yet): Ctrl-C and SIGTERM to mpirun's process
    # group reach this rank at once, not 1 s later from mpirun, 1 s before its SIGKILL
    relay = launchers.start_relay(os.environ, says_startup=True)
    from .config import ConfigError, load_config
    from .config.errors import Sources
    sources = Sources()
    try:
        cfg = load_config(args.config, args.overrides, sources)
    except ConfigError as exc:
        return stop_with(str(exc))
    if framework is not None and cfg.framework != framework:
        return stop_with(f"{args.config} says framework: {cfg.framework}; this entry point trains framework: "
                         f"{framework} configs (add `framework: {framework}` or --set framework={framework})")
    problem = engine_problem(cfg, args.config, os.environ) or options_problem(cfg, sources) or folder_problem(cfg)
    if problem:
        return stop_with(problem)
    try:
        adapter = _adapter(cfg)
    except ImportError as exc:   # a torch-only install: redsync_hvd.tensorflow's message names the fix
        return stop_with(f"framework: {cfg.framework}: {exc}")
    return launch(cfg, adapter, relayed=relay is not None)


def options_problem(cfg, sources) -> str | None:
    """An unknown key in ``model.options`` or ``data.options`` (``sources``: where it came from):
    the valid ones, and the closest."""
    from .config.errors import unknown_key
    from .data import dataset_options
    from .models import model_options
    for section, valid in (("model", model_options(cfg.model.name)), ("data", dataset_options(cfg.data.name))):
        given = getattr(cfg, section).options
        unknown = sorted(set(given) - set(valid))
        if unknown:
            name = getattr(cfg, section).name
            return (f"invalid configuration in {sources.origin((section, 'options', unknown[0]))}: "
                    + unknown_key(f"{section}.options", unknown[0], valid, what="option", owner=f"{section} {name!r}"))
    return None


def folder_problem(cfg) -> str | None:
    """A new run into a folder that holds another run's files, which would mix with this one's
    (runlog.foreign_files): the three ways on. Every rank sees the folder before any rank writes
    to it (the first write comes after the first collective)."""
    from .runlog import foreign_files, run_dir
    folder = run_dir(cfg.output.dir, cfg.output.name)
    found = foreign_files(folder, cfg.training.resume)
    if cfg.output.overwrite and cfg.training.resume and found is None:
        return (f"output.overwrite=true would delete the checkpoints that training.resume={cfg.training.resume} "
                f"reads ({folder} is that run's folder): drop one of the two")
    if not found or cfg.output.overwrite:
        return None
    listed = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    return (f"{folder} holds the files of another run ({listed}); a new run there would mix with them. Continue "
            f"that run with --set training.resume={folder}, write this one elsewhere with --set output.name=<another "
            f"name>, or replace that run with --set output.overwrite=true (deletes its files, every rank's "
            f"checkpoints included)")


def launcher(environ) -> str | None:
    """"torchrun", "horovodrun" (or mpirun), or None (a plain process), from the environment."""
    if any(k in environ for k in _TORCHRUN):
        return "torchrun"
    if any(k in environ for k in _HOROVODRUN):
        return "horovodrun"
    return None


def engine_problem(cfg: RunConfig, path: str, environ) -> str | None:
    """What stops this config under this launcher before any process group starts (the same on
    every rank), or None: 1. what engine: ddp or fsdp cannot run; 2. a launcher that is not the engine's."""
    if cfg.framework == "tensorflow" and cfg.training.precision != "fp32":
        return (f"training.precision: {cfg.training.precision} runs with framework: torch; TensorFlow trains in "
                "fp32 here (set training.precision: fp32)")
    if cfg.engine in ("ddp", "fsdp"):                                                        # 1.
        if cfg.framework != "torch":
            return (f"engine: {cfg.engine} trains framework: torch models (torch.distributed); framework: "
                    f"{cfg.framework} trains under horovodrun with engine: horovod (the default)")
        if cfg.engine == "fsdp" and cfg.training.precision == "fp16":
            return ("training.precision: fp16 needs a GradScaler, whose skipped steps engine: fsdp does not take "
                    "(FSDP2 reduces each group's gradients as backward goes); set training.precision: bf16")
        from .engine import refuse
        try:
            refuse(cfg.compression, "torch", cfg.engine)
        except ValueError as exc:
            return str(exc)
    started = launcher(environ)                                                              # 2.
    if cfg.engine in ("ddp", "fsdp") and started == "horovodrun":
        return (f"{path} says engine: {cfg.engine} (torch.distributed), but this process was started by horovodrun or "
                f"mpirun. Start it with `torchrun --nproc_per_node N -m redsync_hvd.train --config {path}`, or "
                "set engine: horovod (--set engine=horovod) to train under horovodrun")
    if cfg.engine == "horovod" and started == "torchrun":
        return (f"{path} says engine: horovod, but this process was started by torchrun, which Horovod does not "
                "join (every process would train alone). Start it with `horovodrun -np N python -m "
                f"redsync_hvd.train --config {path}`, or set engine: ddp (--set engine=ddp) to train under torchrun")
    return None


def _adapter(cfg: RunConfig):
    if cfg.framework == "tensorflow":
        from .tensorflow.training import HorovodAdapter
        return HorovodAdapter()
    from .torch.training import DDPAdapter, HorovodAdapter
    if cfg.engine == "fsdp":
        from .torch.training import FSDPAdapter
        return FSDPAdapter()
    return DDPAdapter() if cfg.engine == "ddp" else HorovodAdapter()


def _packages(cfg) -> tuple:
    """What every rank must run in the same version: this package, the framework, and Horovod where it
    carries the exchange."""
    horovod = ("horovod",) if cfg.framework == "tensorflow" or cfg.engine == "horovod" else ()
    return ("redsync_hvd", cfg.framework, *horovod)


def launch(cfg, adapter, relayed: bool = False) -> int:
    """Start the framework, agree on versions and config, build data, resume (agreed by all ranks), build
    the trainer, run the loop. Exit codes: 0 done, 2 bad config or checkpoint (one message, from
    rank 0), 75 stopped by SIGTERM/SIGINT after every rank saved (resume it)."""
    import torch

    from .checkpoint import CheckpointError
    from .data import build_datasets
    from .hosts import identity, version_mismatch
    from .runlog import clear_run, run_dir
    from .runner import resume, run, trainer_config
    rank, size = adapter.init(cfg)
    ranks = adapter.allgather_object({**identity(_packages(cfg)), "config": cfg.fingerprint()}, name="rsync.cfg")
    mismatch = version_mismatch(ranks)
    if mismatch:
        return stop_with(mismatch, rank)
    prints = [r["config"] for r in ranks]
    if len(set(prints)) != 1:
        return stop_with(f"ranks loaded different configs (fingerprints {prints}); start every rank with the same "
                      "--config and --set arguments", rank)
    if cfg.output.overwrite:   # after the collective above: every rank has looked at the folder
        removed = clear_run(run_dir(cfg.output.dir, cfg.output.name), rank)
        if rank == 0 and removed:
            sys.stderr.write(f"[overwrite] removed {removed} files of the previous run in "
                             f"{run_dir(cfg.output.dir, cfg.output.name)}\n")
            sys.stderr.flush()
    torch.manual_seed(cfg.training.seed)
    try:
        data = build_datasets(cfg.data.name, path=cfg.data.path, rank=rank, size=size, seed=cfg.training.seed,
                              **cfg.data.options)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        return stop_with(f"data: {exc}", rank)
    try:   # one collective; a bad or mismatched checkpoint stops every rank with the same error
        resumed = resume(cfg, rank, size, adapter.allgather_object)
    except CheckpointError as exc:
        return stop_with(str(exc), rank)
    try:
        trainer = adapter.trainer(trainer_config(cfg, resumed), data, rank, size)
    except (ValueError, TypeError, NotImplementedError) as exc:   # the same on every rank: nobody waits
        return stop_with(str(exc), rank)
    launchers.end_startup_guard()   # from here the loop's StopController handles Ctrl-C and SIGTERM
    return run(cfg, trainer, rank, size, resumed=resumed, allgather_object=adapter.allgather_object,
               relayed=relayed, data=data.record())


def exit_with(code: int):
    """A stopped run (every rank saved and passed the last collective) ends at once, before its
    launcher's SIGKILL (preemption.exit_now); a refused one without the launcher's report of it
    (launchers.exit_quietly); a finished torch.distributed run, where every rank reached the end,
    through launchers.close_process_group, past Gloo's teardown that can abort a finished job on
    a loaded machine; other codes end as usual."""
    if code == EXIT_STOPPED:
        exit_now(code)
    if code == EXIT_BAD_INPUT:
        launchers.exit_quietly(code)
    dist = sys.modules.get("torch.distributed")
    if code == 0 and dist is not None and dist.is_available() and dist.is_initialized():
        launchers.close_process_group(code)
    sys.exit(code)


if __name__ == "__main__":
    launchers.guard_startup()
    exit_with(main())
