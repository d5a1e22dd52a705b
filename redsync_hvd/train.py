"""Train a model from a YAML config under horovodrun.

    horovodrun -np 2 python -m redsync_hvd.train --config configs/digits/topk.yaml \
        [--set compression.density=0.01 --set training.epochs=5 ...]

``framework: torch`` (default) or ``framework: tensorflow`` picks the adapter; the loop itself
is redsync_hvd/runner.py, the same for both.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .checkpoint import CheckpointError
from .config import ConfigError, RunConfig, load_config
from .data import build_datasets
from .runner import resume, run, trainer_config


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
    try:
        adapter = _adapter(cfg.framework)
    except ImportError as exc:   # a torch-only install: redsync_hvd.tensorflow's message names the fix
        print(f"error: framework: {cfg.framework}: {exc}", file=sys.stderr)
        return 2
    return launch(cfg, adapter)


def _adapter(framework: str):
    if framework == "tensorflow":
        from .tensorflow.training import HorovodAdapter
    else:
        from .torch.training import HorovodAdapter
    return HorovodAdapter()


def launch(cfg: RunConfig, adapter) -> int:
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
    return run(cfg, trainer, rank, size, resumed=resumed, allgather_object=adapter.allgather_object)


if __name__ == "__main__":
    sys.exit(main())
