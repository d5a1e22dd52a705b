"""Parameters as the exchange sees them: names, Layer objects, and the optimizer hyper-parameters
that DGC's momentum correction moves into the compression memory."""
from __future__ import annotations

import torch

from ..compressors.base import Layer
from ..engine import MomentumSpec


def resolve_names(named_parameters, param_groups) -> list:
    """[(name, parameter)] of the optimizer's trainable parameters, named by ``named_parameters``."""
    params = [p for g in param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    names = [n for n, _ in named]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"named_parameters has duplicate names {sorted(dupes)[:5]}; pass model.named_parameters()")
    known = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in known]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameters are missing from named_parameters; "
                         "pass named_parameters=model.named_parameters() for the same model the optimizer holds")
    in_opt = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in in_opt]


def layers_of(named: list) -> list:
    return [Layer(n, tuple(p.shape), p.numel(), i, p.device, param=p) for i, (n, p) in enumerate(named)]


def take_momentum(param_groups, names: dict) -> MomentumSpec | None:
    """Move momentum and weight decay out of torch param groups (set to 0 there), by layer name:
    with momentum correction the compression memory applies them, so they must not apply twice.
    None, and the groups untouched, for an optimizer without momentum (no ``momentum`` in its
    groups: Adam, AdamW): there is no velocity to correct, so the memory keeps plain error
    feedback, and Adam's moments and (decoupled) weight decay stay in Adam."""
    if not any("momentum" in group for group in param_groups):
        return None
    spec = MomentumSpec()
    for group in param_groups:
        for p in group["params"]:
            if p in names:
                spec.momentum[names[p]] = group.get("momentum", 0.0)
                spec.weight_decay[names[p]] = group.get("weight_decay", 0.0)
        spec.nesterov = spec.nesterov or group.get("nesterov", False)
        for key in ("momentum", "weight_decay", "nesterov"):
            if key in group:
                group[key] = False if key == "nesterov" else 0.0
    return spec


def check_plain_sgd(opt) -> None:
    """``sparse_update`` does the optimizer's job for compressed layers: only right for plain SGD."""
    problems = plain_sgd_problems(opt)
    if problems:
        raise ValueError("compression.sparse_update applies the averaged sparse gradient straight to the weights, "
                         "which is a plain SGD step, but " + "; ".join(problems) + ". Use torch.optim.SGD with "
                         "dgc: {momentum_correction: true} (it moves momentum and weight decay into the compressor), "
                         "or momentum 0 and weight_decay 0; or set sparse_update: false")


def plain_sgd_problems(opt) -> list:
    """Why ``opt`` is not a plain SGD step (none: it is)."""
    problems = []
    if not isinstance(opt, torch.optim.SGD):
        problems.append(f"the optimizer is {type(opt).__mro__[1].__name__}, not torch.optim.SGD")
    for i, group in enumerate(opt.param_groups):
        for key in ("momentum", "weight_decay"):
            if group.get(key, 0.0):
                problems.append(f"param group {i} has {key}={group[key]}")
        if group.get("maximize", False):
            problems.append(f"param group {i} has maximize=True")
    return problems
