"""FSDP2 for the YAML runner: wrapping a model, and the checkpoint of a rank's shards.

``shard(model)`` applies ``fully_shard`` as ``engine: fsdp`` does (a group per layer);
``local_state`` / ``load_local_state`` turn the DTensors of a sharded model's and optimizer's
state dicts into this rank's plain tensors and back, so a rank's checkpoint loads with
``torch.load(weights_only=True)`` like the other engines' (checkpoint.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def shard(model, device=None) -> None:
    """``fully_shard`` every module that holds parameters itself (a layer: its weight and bias
    are one group), then the model (one FSDP group per layer; the model's own parameters, if any,
    in its group)."""
    mesh = None
    if device is not None and torch.device(device).type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    kwargs = {} if mesh is None else {"mesh": mesh}
    for name, module in list(model.named_modules()):
        if name and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def local_state(obj):
    """A state dict with every DTensor replaced by a copy of this rank's shard (what a rank saves)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        out = type(obj)((k, local_state(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_state(v) for v in obj)
    return obj


def load_local_state(model, opt, model_state: dict, opt_state: dict) -> None:
    """Load what :func:`local_state` saved on this rank, into the same sharding: the model's shards
    in place; the optimizer's, as DTensors of their parameters' placement."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name not in model_state:
                raise ValueError(f"the checkpoint's model lacks {name!r}: resume with the same model")
            (t.to_local() if isinstance(t, DTensor) else t).copy_(model_state[name])
    opt.load_state_dict(opt_state)
    for p, state in opt.state.items():
        if not isinstance(p, DTensor):
            continue
        for key, v in state.items():
            if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                state[key] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                                stride=p.stride())
