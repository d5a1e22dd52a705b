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

import torch

from . import launchers
from .checkpoint import CheckpointError
from .config import ConfigError, RunConfig, load_config
from .data import build_datasets
from .engine import refuse
from .preemption import EXIT_STOPPED, exit_now
from .runner import resume, run, trainer_config

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


def main(argv=None, framework: str | None = None) -> int:
    """Exit code 2, with the field and the fix on stderr, for a bad config (before any collective)."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if framework is not None and cfg.framework != framework:
        print(f"error: {args.config} says framework: {cfg.framework}; this entry point trains framework: {framework} "
              f"configs (add `framework: {framework}` or --set framework={framework})", file=sys.stderr)
        return 2
    problem = engine_problem(cfg, args.config, os.environ)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        adapter = _adapter(cfg)
    except ImportError as exc:   # a torch-only install: redsync_hvd.tensorflow's message names the fix
        print(f"error: framework: {cfg.framework}: {exc}", file=sys.stderr)
        return 2
    # before the framework starts (no threads, no MPI yet): Ctrl-C and SIGTERM to mpirun's process
    # group reach this rank at once, not 1 s later from mpirun, 1 s before its SIGKILL
    relay = launchers.start_relay(os.environ)
    return launch(cfg, adapter, relayed=relay is not None)


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


def launch(cfg: RunConfig, adapter, relayed: bool = False) -> int:
    """Start the framework, agree on the config, build data, resume (agreed by all ranks), build
    the trainer, run the loop. Exit codes: 0 done, 2 bad config or checkpoint (the same message
    on every rank), 75 stopped by SIGTERM/SIGINT after every rank saved (resume it)."""
    rank, size = adapter.init(cfg)
    prints = adapter.allgather_object(cfg.fingerprint(), name="rsync.cfg")
    if len(set(prints)) != 1:
        print(f"error (rank {rank}): ranks loaded different configs (fingerprints {prints}); start every rank with "
              "the same --config and --set arguments", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.training.seed)
    try:
        data = build_datasets(cfg.data.name, path=cfg.data.path, rank=rank, size=size, seed=cfg.training.seed,
                              **cfg.data.options)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error (rank {rank}): data: {exc}", file=sys.stderr)
        return 2
    try:   # one collective; a bad or mismatched checkpoint stops every rank with the same error
        resumed = resume(cfg, rank, size, adapter.allgather_object)
    except CheckpointError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2
    try:
        trainer = adapter.trainer(trainer_config(cfg, resumed), data, rank, size)
    except (ValueError, TypeError, NotImplementedError) as exc:   # the same on every rank: nobody waits
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2
    return run(cfg, trainer, rank, size, resumed=resumed, allgather_object=adapter.allgather_object,
               relayed=relayed, data=data.record())


def exit_with(code: int):
    """A stopped run (every rank saved and passed the last collective) ends at once, before its
    launcher's SIGKILL (preemption.exit_now); other codes end as usual."""
    if code == EXIT_STOPPED:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main())
