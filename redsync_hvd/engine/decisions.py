"""Pinned per-layer decisions: ``compression.policy.decisions`` (a run folder's decisions.json,
or the record a resume takes from its checkpoint).

The cost-model policy probes network and compute at start, and two launches of one config can
then compress different layers; a resumed run could even switch a layer between dense and
compressed while its residual sits in the checkpoint. A pinned record fixes the choice: the
policy takes it instead of deciding, and nothing is probed.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..policy.costmodel import ComputeModel, Network


def load_record(value) -> tuple[dict, str]:
    """(record, where it came from) for ``policy.decisions``: a path to a decisions.json, or
    the record itself (a dict, as a resume passes it). Raises ValueError naming the file."""
    if isinstance(value, dict):
        record, source = value, str(value.get("pinned_from", "the config"))
    else:
        path = Path(value)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"compression.policy.decisions: no file {path}; point it at the decisions.json "
                             "of a run folder") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"compression.policy.decisions: {path} is not a decisions.json: {exc}") from None
        source = str(path)
    layers = record.get("layers") if isinstance(record, dict) else None
    if not isinstance(layers, list) or not all(isinstance(d, dict) and {"name", "compressed"} <= set(d)
                                               for d in layers):
        raise ValueError(f"compression.policy.decisions: {source} holds no per-layer decisions (a list 'layers' "
                         "of {name, numel, compressed, ...}); use the decisions.json a run writes")
    return record, source


def figures(record: dict) -> tuple[Network | None, ComputeModel | None]:
    """The network and compute figures the pinned decisions were made with (reported again)."""
    net, compute = record.get("network"), record.get("compute")
    return (Network(**net) if isinstance(net, dict) else None,
            ComputeModel(**compute) if isinstance(compute, dict) else None)


def pin(policy, config, comm) -> tuple:
    """Pin ``config.policy.decisions`` into ``policy``; (network, compute) of the record.

    Every rank reads the file itself; one allgather of what each read (or its error) makes
    every rank raise the same error, or none: a file missing on one host must not leave the
    others waiting in the first collective."""
    try:
        record, source = load_record(config.policy.decisions)
        mine = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]
    except ValueError as exc:
        record, source, mine = None, None, f"error: {exc}"
    everyone = comm.allgather_object(mine, name="rsync.decisions")
    errors = sorted({e for e in everyone if e.startswith("error: ")})
    if errors:
        raise ValueError("; ".join(e[7:] for e in errors))
    if len(set(everyone)) > 1:
        bad = [r for r, e in enumerate(everyone) if e != everyone[0]]
        raise ValueError(f"compression.policy.decisions: ranks {bad} read other decisions than rank 0 from "
                         f"{config.policy.decisions!r}; give every host the same file")
    policy.pin(record, source)
    return figures(record)
