"""The exchange's host work, held to a budget: what a compressed step asks of the device.

On a GPU every kernel launch costs the host a few microseconds, so a step's launches bound its
time from below whatever the kernels take (the H100 profile of a step with ~100 launches spent
most of its time launching). ``core/launches.py`` counts the aten ops a step dispatches that launch a kernel
and the Triton kernels it launches; here, on the CPU with the kernels in Triton's interpreter, a whole
exchange step (every submit, the collectives' start, the decode, the finite agreement) of
RedSync with exactly k per layer (``selection.method: radix``) and DGC momentum correction:

* its device work does not grow with the number of layers (no per-layer launch);
* resnet20's and a VGG with 4096-wide-shaped classifier's steps stay within a budget per step
  and per planned bucket.
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
from redsync_hvd.torch.params import layers_of  # noqa: E402

pytest.importorskip("triton", reason="the kernels need triton: pip install -e .[kernels]")
DEV = "cuda" if CUDA else "cpu"
# device launches of one whole step, and Triton launches per planned bucket (compensate, select,
# decode); what the exchange adds beside the kernels is a fixed number of small ops per bucket
BUDGET = {"step": 36, "triton_per_plan": 6}


def exchange(layers, fusion_bytes=16 << 20):
    spec = {"method": "redsync", "density": 0.01, "fusion_bytes": fusion_bytes,
            "selection": {"method": "radix", "radix_backend": "triton"},
            "dgc": {"momentum_correction": True}, "policy": {"min_compress_numel": 1024}}
    mom = MomentumSpec(dict.fromkeys((l.name for l in layers), 0.9))
    return build_exchange(spec, layers, LocalCommunicator(2), take_momentum=lambda: mom, agree=False).exchange


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


@pytest.mark.parametrize("model,options", [("resnet20", {}), ("vgg", {"fc_width": 256, "width": 0.25})])
def test_a_step_stays_within_its_launch_budget(model, options):
    """resnet20 (59 parameters), and the VGG of the GPU benchmarks with a narrower classifier
    (the interpreter is slow; the layer structure and so the launches are the same)."""
    net_ = build_model(model, 10, (3, 32, 32), **options)
    layers = [Layer(l.name, l.shape, l.numel, l.index, torch.device(DEV))
              for l in layers_of(list(net_.named_parameters()))]
    ex = exchange(layers)
    ops = counted_step(ex, layers)
    assert ex.planned, "the compressed layers run as a planned bucket"
    assert ops.total <= BUDGET["step"], (ops.total, ops.aten, ops.triton)
    assert len(ops.triton) <= BUDGET["triton_per_plan"] * len(ex.planned), ops.triton
