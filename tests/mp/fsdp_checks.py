"""FSDP2 with the compressed reduce-scatter (redsync_hvd/torch/fsdp.py) under torchrun (Gloo), one
launch per world size, several checks each (torchrun's start-up dominates a launch):

    equal        at density 1 with values (quantize none), every group's sharded gradient and then
                 the weights after a few steps equal FSDP2's own reduce-scatter (same model, same
                 data), within fp32 rounding: every parameter compressed; mixed groups (biases
                 dense); momentum correction without masking with weight decay (plain momentum
                 SGD with weight decay); bf16 and fp16 reduce dtypes; FSDP's SUM path
                 (force_sum_reduction), with and without momentum correction
    conserve     at low density, every step: what the owners received (N * their averaged shard)
                 plus every rank's new residual equals every rank's old residual plus gradient,
                 for fp32, fp16 and int8 values and sign-mean, with raw and Golomb-coded
                 positions; the coded messages take fewer bytes
    nonfinite    a NaN on one rank: backward raises the same error on every rank, every residual
                 stays as it was, and the next step trains
    state        state_dict / load_state_dict: a second model given the first's state and weights
                 takes the same next step bit for bit (residuals in bf16 storage too)
    policy       the cost model's choice per group, on a slow and a fast link
    dense16      policy.dense_values: fp16: the dense pieces at half the bytes, within fp16's rounding
    dense8       policy.dense_values: int8: the dense pieces as codes and scales, what was sent plus
                 the new residuals conserved, within int8's rounding of FSDP's own; a NaN raises

    torchrun --nproc_per_node 2 tests/mp/fsdp_checks.py equal conserve nonfinite state policy dense16 dense8
    torchrun --nproc_per_node 3 tests/mp/fsdp_checks.py equal-core    (two of equal's layouts)
"""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from redsync_hvd.exchange import NonFiniteGradientError
from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch import fsdp as rfsdp

# local_steps: 1 keeps the message and the dense layers' format as given (auto would code them)
DENSE1 = {"method": "redsync", "density": 1.0, "message": {"quantize": "none"}, "selection": {"method": "radix"},
          "dgc": {"momentum_correction": False}, "policy": {"min_compress_numel": 0}, "local_steps": 1}


def build(mp=None, seed=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 37), nn.ReLU(), nn.Linear(37, 50), nn.ReLU(), nn.Linear(50, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **({"mp_policy": mp} if mp else {}))
    fully_shard(model, **({"mp_policy": mp} if mp else {}))
    return model


def batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 20, generator=gen), torch.randint(0, 5, (16,), generator=gen)


def train_step(model, opt, step, rank, nan=False):
    x, y = batch(step, rank)
    if nan:
        x[0, 0] = float("nan")
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def grads(model):
    return [p.grad.to_local().float().clone() for p in model.parameters()]


def close(a, b, what, tol):
    for i, (u, v) in enumerate(zip(a, b)):
        err = (u - v).abs().max().item() if u.numel() else 0.0
        assert err <= tol * max(1.0, v.abs().max().item() if v.numel() else 1.0), f"{what}: tensor {i} off by {err}"


def equal_case(compression, opt_kw, mp=None, force_sum=False, tol=2e-6, steps=4, sparse=True):
    """Grads compared each step (where the optimizer applies no momentum), weights at the end."""
    rank = dist.get_rank()
    ref, ours = build(mp), build(mp)
    if force_sum:
        for m in (ref, ours):
            for mod in m.modules():
                if isinstance(mod, FSDPModule):
                    mod.set_force_sum_reduction_for_comms(True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, **opt_kw)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, **opt_kw)
    state = rfsdp.register(ours, compression, optimizer=opt)
    assert any(l.compressed for g in state.groups for l in g.layers) == sparse, [g.kind for g in state.groups]
    for step in range(steps):
        train_step(ref, ref_opt, step, rank)
        train_step(ours, opt, step, rank)
        if not opt_kw:   # with momentum correction .grad holds the velocity, compared through the weights
            close(grads(ours), grads(ref), f"step {step} grads", tol)
        ref_opt.step()
        opt.step()
    close([p.to_local().float() for p in ours.parameters()], [p.to_local().float() for p in ref.parameters()],
          "weights", tol)
    return state


def coded(compression: dict, quantize: str, coding: str) -> dict:
    """``compression`` with this message; FSDP selects exactly k on the device whatever
    selection.method says, which under int8 or Golomb coding is left to its default (the
    config refuses radix there: the other engines would code on the host); DENSE1's
    ``local_steps: 1`` keeps the message as given (``local_steps: auto`` codes positions here)."""
    out = {**compression, "message": {"quantize": quantize, "index_coding": coding}}
    if quantize == "int8" or coding == "golomb":
        out.pop("selection", None)
    return out


MIXED = {**DENSE1, "policy": {"min_compress_numel": 60}}   # the biases go dense: two collectives a group
DGC = {**DENSE1, "dgc": {"momentum_correction": True, "momentum_masking": False}}


def check_equal_core():
    """Every parameter compressed, positions Golomb-coded in their owners' shards; mixed groups
    with momentum correction and weight decay."""
    equal_case(coded(DENSE1, "none", "golomb"), {})
    state = equal_case({**MIXED, "dgc": DGC["dgc"]}, {"momentum": 0.9, "weight_decay": 0.01})
    assert {g.kind for g in state.groups} == {"sparse"} and any(g.dense for g in state.groups)
    print(f"rank {dist.get_rank()}: OK equal-core of {dist.get_world_size()}", flush=True)


def check_equal():
    equal_case(DENSE1, {})
    state = equal_case(MIXED, {})
    assert {g.kind for g in state.groups} == {"sparse"} and any(g.dense for g in state.groups)
    dgc = DGC
    equal_case(dgc, {"momentum": 0.9, "weight_decay": 0.01})
    equal_case({**dgc, "policy": {"min_compress_numel": 10_000}}, {"momentum": 0.9, "nesterov": True,
                                                                   "weight_decay": 0.01}, sparse=False)   # all dense
    equal_case(DENSE1, {}, mp=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), tol=2e-2)
    # fp16 reduce dtype: FSDP divides before the reduce-scatter and after it (op SUM)
    equal_case(DENSE1, {}, mp=MixedPrecisionPolicy(reduce_dtype=torch.float16), tol=5e-3)
    equal_case(DENSE1, {}, force_sum=True)
    equal_case(dgc, {"momentum": 0.9, "weight_decay": 0.01}, force_sum=True)   # the decay in SUM's units
    equal_case({"method": "none"}, {}, tol=0.0, sparse=False)   # FSDP's own call: bit for bit
    print(f"rank {dist.get_rank()}: OK equal of {dist.get_world_size()}", flush=True)


def check_dense16():
    """policy.dense_values: fp16: the biases of a mixed group and every parameter of an all-dense
    group travel fp16, at half the bytes of fp32, and the steps stay within fp16's rounding of
    FSDP's own; dense_bytes still counts FSDP's fp32 reduce-scatter."""
    for base, sparse in ((MIXED, True), ({**DENSE1, "policy": {"min_compress_numel": 10_000}}, False)):
        fp32 = equal_case(base, {}, sparse=sparse).communication_stats()
        fp16 = equal_case({**base, "policy": {**base["policy"], "dense_values": "fp16"}}, {}, tol=2e-3,
                          sparse=sparse).communication_stats()
        assert fp16["bytes_values"] * 2 == fp32["bytes_values"] > 0, (fp16, fp32)
        assert fp16["dense_bytes"] == fp32["dense_bytes"] and fp16["wire_bytes"] < fp32["wire_bytes"], (fp16, fp32)
    print(f"rank {dist.get_rank()}: OK dense16 of {dist.get_world_size()}", flush=True)


def check_dense8():
    """policy.dense_values: int8: the biases of a mixed group and every parameter of an all-dense
    group travel as int8 codes with one fp32 scale per piece (the bytes the layout gives); what
    the owners received plus every rank's new residual is every rank's old residual plus its
    gradient, step by step (the codes' rounding waits in the residual); the steps stay within
    int8's rounding of FSDP's own; a NaN raises on every rank and keeps the residuals."""
    size = dist.get_world_size()
    for base, sparse in ((MIXED, True), ({**DENSE1, "policy": {"min_compress_numel": 10_000}}, False)):
        int8 = {**base, "policy": {**base["policy"], "dense_values": "int8"}}
        state = equal_case(int8, {}, tol=2e-2, sparse=sparse)
        stats, coded_groups = state.communication_stats(), [g for g in state.groups if g.dense]
        assert coded_groups and all(g.wire.sent == (size - 1) * (sum(g.layout.shards[j] for j in g.dense)
                                                                 + 4 * len(g.dense)) for g in coded_groups)
        assert stats["bytes_values"] == 4 * sum(g.wire.sent for g in coded_groups), stats   # 4 steps
        said = [d["aggregation_why"] for d in state.layer_decisions() if not d["compressed"]]
        assert said and all("int8 codes" in why for why in said), said   # layers.log says how they travel
        conserved(int8, "int8 dense")
        nan_keeps_state(int8)
    print(f"rank {dist.get_rank()}: OK dense8 of {size}", flush=True)


def conserved(compression: dict, what: str, steps: int = 5):
    """Train ``steps`` steps; each step, every group's sent (N x the averaged shards) plus the new
    residuals equals the old residuals plus the gradients, summed over ranks. Returns the state."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rfsdp.register(model, compression, optimizer=opt)
    log = []
    for g in state.groups:
        recorder(g, log)
    for step in range(steps):
        log.clear()
        train_step(model, opt, step, rank)
        opt.step()
        for group, g, r_old, r_new, out, average in log:
            lhs = r_old + g - r_new
            dist.all_reduce(lhs)
            every = [torch.empty_like(out) for _ in range(size)]
            dist.all_gather(every, out)
            rhs = torch.cat(every) * (size if average else 1)
            err = (lhs - rhs).abs().max().item()
            assert err <= 1e-5 * max(1.0, rhs.abs().max().item()), f"{what} {group.name} step {step}: {err}"
    return state


def nan_keeps_state(compression: dict, opt_kw: dict | None = None, steps: int = 1):
    """``steps`` steps, then a NaN on the last rank: the same error on every rank, every carried
    buffer and the step count as they were. Returns (model, optimizer, state) to go on with."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **(opt_kw or {}))
    state = rfsdp.register(model, compression, optimizer=opt)
    for step in range(steps):
        train_step(model, opt, step, rank)
        opt.step()
    before = state.state_dict()
    try:
        train_step(model, opt, steps, rank, nan=rank == size - 1)
        raise AssertionError("a NaN on one rank did not stop the step")
    except NonFiniteGradientError as exc:
        everyone = [None] * size
        dist.all_gather_object(everyone, str(exc))
        assert len(set(everyone)) == 1 and "non-finite" in everyone[0], everyone
    after = state.state_dict()
    assert after["steps"] == before["steps"] == steps
    for name, held in before["groups"].items():
        for key, t in held.items():
            assert torch.equal(t, after["groups"][name][key]), f"{name} {key} changed by a failed step"
    return model, opt, state


def recorder(group, log):
    run = group.reduce_scatter

    def recorded(out, grad, step, average, factor, decay=None, scratch=None):
        r_old = group.residual.cur.clone() if group.residual is not None else None
        g = grad.float().clone()
        result = run(out, grad, step, average, factor, decay, scratch)
        log.append((group, g, r_old if r_old is not None else torch.zeros_like(g), group.residual.spare.clone(),
                    out.float().clone(), average))
        return result
    group.reduce_scatter = recorded


CONSERVE = [("none", "raw"), ("fp16", "raw"), ("sign_mean", "raw"), ("int8", "raw"), ("fp16", "golomb"),
            ("int8", "golomb"), ("sign_mean", "golomb")]


def check_conserve():
    rank, size = dist.get_rank(), dist.get_world_size()
    ratios = {}
    for quantize, coding in CONSERVE:
        compression = {**coded(DENSE1, quantize, coding), "density": 0.05, "policy": {"min_compress_numel": 60}}
        state = conserved(compression, f"{quantize} {coding}")
        ratios[quantize, coding] = state.communication_stats()["compression_ratio"]
        assert ratios[quantize, coding] > 2.0, state.communication_stats()
    # the same entries (Golomb codes losslessly, so the runs select alike) in fewer bytes
    assert ratios["fp16", "golomb"] > ratios["fp16", "raw"] and ratios["int8", "raw"] > ratios["fp16", "raw"], ratios
    assert ratios["int8", "golomb"] > ratios["int8", "raw"], ratios
    print(f"rank {rank}: OK conserve of {size}", flush=True)


def check_nonfinite():
    rank, size = dist.get_rank(), dist.get_world_size()
    model, opt, state = nan_keeps_state({**DENSE1, "density": 0.1, "dgc": {"momentum_correction": True}},
                                        {"momentum": 0.9}, steps=2)
    train_step(model, opt, 3, rank)
    opt.step()
    assert state.steps == 3 and all(torch.isfinite(p.to_local()).all() for p in model.parameters())
    print(f"rank {rank}: OK nonfinite of {size}", flush=True)


def check_state():
    """Residuals, velocities and counters restored take the same next step bit for bit: in fp32 and
    bf16 storage, and under policy.dense_values: int8, whose all-dense group keeps a residual too."""
    rank = dist.get_rank()
    for storage, dense in (("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "int8")):
        compression = {**DENSE1, "density": 0.05, "message": {"quantize": "sign_mean"},
                       "dgc": {"momentum_correction": True}, "residual_dtype": storage,
                       "policy": {"min_compress_numel": 300 if dense == "int8" else 0, "dense_values": dense}}
        models, states, opts = [], [], []
        for _ in range(2):
            model = build()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            models.append(model)
            opts.append(opt)
            states.append(rfsdp.register(model, compression, optimizer=opt))
        for step in range(3):
            train_step(models[0], opts[0], step, rank)
            opts[0].step()
        saved = rfsdp.local_state(models[0].state_dict()), rfsdp.local_state(opts[0].state_dict())
        rfsdp.load_local_state(models[1], opts[1], *saved)
        states[1].load_state_dict(states[0].state_dict())
        held = states[1].groups[0].residual.cur
        assert held.dtype == (torch.bfloat16 if storage == "bf16" else torch.float32), held.dtype
        assert dense == "fp32" or (not states[1].groups[-1].compressed and states[1].groups[-1].residual.cur.abs().sum()
                                   > 0), "the all-dense group's int8 rounding was not carried over"
        for m, o in zip(models, opts):
            train_step(m, o, 3, rank)
            o.step()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p.to_local(), q.to_local()), "a restored state took another step"
    print(f"rank {rank}: OK state of {dist.get_world_size()}", flush=True)


def check_policy():
    """policy.mode: cost_model prices each group (network and compute given, nothing probed): on a
    1 Mbit/s link the two larger layers' groups compress; on a fast one every group stays dense
    and takes FSDP's own reduce-scatter; the decisions name the group and why."""
    kinds = {}
    for link, (latency, gbit) in {"slow": (1e-3, 0.001), "fast": (1e-6, 1000.0)}.items():
        model = build()
        compression = {**DENSE1, "density": 0.05, "policy": {"mode": "cost_model", "latency_s": latency,
                                                              "bandwidth_gbit": gbit, "compute_s": [1e-4, 1e-9]}}
        state = rfsdp.register(model, compression, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        kinds[link] = [g.kind for g in state.groups]
        decisions = state.layer_decisions()
        assert all("cost model: group" in d["why"] and d["fsdp_group"] for d in decisions), decisions
    assert kinds["slow"].count("sparse") >= 2 and set(kinds["fast"]) == {"dense"}, kinds
    print(f"rank {dist.get_rank()}: OK policy of {dist.get_world_size()}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for check in sys.argv[1:]:
        {"equal": check_equal, "equal-core": check_equal_core, "conserve": check_conserve,
         "nonfinite": check_nonfinite, "dense16": check_dense16, "dense8": check_dense8, "state": check_state,
         "policy": check_policy}[check]()
    close_process_group()
