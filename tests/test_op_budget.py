"""The exchange's host work, held to a budget: what a compressed step asks of the device.

On a GPU every kernel launch costs the host a few microseconds, so a step's launches bound its
time from below whatever the kernels take (the H100 profile of a step with ~100 launches spent
most of its time launching). ``core/launches.py`` counts the aten ops a step dispatches that launch a kernel
and the Triton kernels it launches; here, on the CPU with the kernels in Triton's interpreter, a whole
exchange step (every submit, the collectives' start, the decode, the finite agreement) of
RedSync with exactly k per layer (``selection.method: radix``) and DGC momentum correction:

* its device work does not grow with the number of layers (no per-layer launch);
* a whole training step of resnet20 and of a VGG with a 4096-wide-shaped classifier, counted
  over every gradient hook and ``optimizer.step()`` (and over the DDP hook), stays within a
  budget per step and per planned bucket.
"""
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"     # must precede the first import of triton

import pytest  # noqa: E402

from redsync_hvd.comm import LocalCommunicator  # noqa: E402
from redsync_hvd.compressors.base import Layer  # noqa: E402
from redsync_hvd.core.launches import Launches  # noqa: E402
from redsync_hvd.engine import MomentumSpec, build_exchange  # noqa: E402
from redsync_hvd.models import build_model  # noqa: E402

pytest.importorskip("triton", reason="the kernels need triton: pip install -e .[kernels]")
DEV = "cuda" if CUDA else "cpu"
# device launches of one whole training step (every gradient hook and optimizer.step()), and Triton
# launches per planned bucket (compensate, select, decode); what the exchange adds beside the
# kernels is a fixed number of small ops per bucket
BUDGET = {"step": 35, "triton_per_plan": 6}
SPEC = {"method": "redsync", "density": 0.01, "selection": {"method": "radix", "radix_backend": "triton"},
        "dgc": {"momentum_correction": True}, "policy": {"min_compress_numel": 1024}}


def exchange(layers, fusion_bytes=16 << 20):
    mom = MomentumSpec(dict.fromkeys((l.name for l in layers), 0.9))
    return build_exchange({**SPEC, "fusion_bytes": fusion_bytes}, layers, LocalCommunicator(2),
                          take_momentum=lambda: mom, agree=False).exchange


def counted_step(ex, layers, warmup=1) -> Launches:
    """The ops of one step, after ``warmup`` steps (layouts, tables and buffers are built by then)."""
    gen = torch.Generator().manual_seed(0)
    for step in range(warmup + 1):
        grads = {l.name: torch.randn(l.numel, generator=gen).to(DEV) for l in layers}
        with Launches() as ops:
            for layer in reversed(layers):
                ex.submit(layer.name, grads[layer.name])
            ex.finish()
    return ops


def net(n_layers, width):
    """n_layers compressed (width x width) weights and their biases (dense), in one bucket each."""
    return [Layer(f"{kind}{i}", (width, width) if kind == "w" else (width,), width * width if kind == "w" else width,
                  2 * i + (kind == "b"), torch.device(DEV))
            for i in range(n_layers) for kind in ("w", "b")]


def test_no_device_work_per_layer():
    """Twice the layers in the same buckets: the same launches, aten ops and Triton kernels."""
    few, many = net(4, 64), net(8, 64)
    counts = [counted_step(exchange(layers), layers) for layers in (few, many)]
    assert sorted(counts[0].aten) == sorted(counts[1].aten)
    assert counts[0].triton == counts[1].triton


class HookCounter:
    """Counts the launches of every call of ``fn`` (a hook's work), across calls."""

    def __init__(self, fn):
        self.fn, self.names = fn, []

    def __call__(self, *args):
        with Launches() as ops:
            out = self.fn(*args)
        self.names += ops.aten + ops.triton
        return out


def shaped(model, options):
    torch.manual_seed(0)
    return build_model(model, 10, (3, 32, 32), **options).to(DEV)


def horovod_step_launches(net) -> tuple:
    """One training step of ``net`` under ``DistributedOptimizer``: (launches of its gradient hooks,
    launches of ``optimizer.step()``: the finish, the .grad landing and the SGD update), after
    two warm-up steps; and the exchange."""
    import redsync_hvd.torch as rhvd
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    opt = rhvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=SPEC,
                                    communicator=LocalCommunicator(2))
    opt.exchange.submit = hooks = HookCounter(opt.exchange.submit)
    x, y = torch.randn(4, 3, 32, 32, device=DEV), torch.randint(0, 10, (4,), device=DEV)
    for _ in range(3):
        hooks.names = []
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        with Launches() as step:
            opt.step()
    return hooks.names, step.aten + step.triton, opt.exchange


@pytest.mark.parametrize("model,options", [("resnet20", {}), ("vgg", {"fc_width": 256, "width": 0.25})])
def test_a_training_step_stays_within_its_launch_budget(model, options):
    """resnet20 (59 parameters), and the VGG of the GPU benchmarks with a narrower classifier
    (the interpreter is slow; the layer structure and so the launches are the same), under
    ``DistributedOptimizer``: every gradient hook and the whole ``optimizer.step()`` (the finish,
    the averages landing in ``.grad``, the wrapped SGD's update) stay within the step's budget,
    whatever the number of layers."""
    hooks, step, ex = horovod_step_launches(shaped(model, options))
    assert ex.planned, "the compressed layers run as a planned bucket"
    total = hooks + step
    assert len(total) <= BUDGET["step"], (len(hooks), len(step), hooks, step)
    assert sum(n.startswith("_") for n in total) <= BUDGET["triton_per_plan"] * len(ex.planned), total
    assert "aten::copy_" not in step, "the averages land in .grad without a copy per layer"


def test_the_ddp_hook_stays_within_the_same_budget(tmp_path):
    """The same exchange as a DDP communication hook (gloo, one process): every call of the hook,
    the last one finishing the step and writing the averages into DDP's buckets (one foreach copy,
    as every copy of the step: nothing per layer), the collectives included."""
    import torch.distributed as dist

    import redsync_hvd.torch.ddp as rddp
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        net = torch.nn.parallel.DistributedDataParallel(shaped("resnet20", {}))
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
        state = rddp.register(net, compression=SPEC, optimizer=sgd)
        state.submit_bucket = hooks = HookCounter(state.submit_bucket)
        x, y = torch.randn(4, 3, 32, 32, device=DEV), torch.randint(0, 10, (4,), device=DEV)
        for _ in range(3):
            hooks.names = []
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            sgd.step()
    finally:
        dist.destroy_process_group()
    assert state.exchange.planned
    assert len(hooks.names) <= BUDGET["step"], hooks.names
