#!/usr/bin/env python
"""What one pass over a large gradient costs on a GPU, and what each exact-k stage costs.

    python scripts/bench_passes.py --out passes.json          # CUDA: 16M fp32, triton.testing.do_bench
    python scripts/bench_passes.py --device cpu               # the same kernels checked in Triton's
                                                              # interpreter on 16K elements, no timing

Rows (device time per call, median of do_bench; "TB/s" = bytes the pass must move / time):
- the floor: a read-and-sum, a count of |x| above one threshold, ``x.clone()``;
- ``tl.histogram`` of |x|'s top bits with 256, 2048 and 4096 bins, at 1024 and 4096 elements
  per block, each flushed with one atomic per bin (what a radix pass costs with Triton's
  lowering of the histogram: warp votes, about 3 instructions per element and bin bit);
- ``torch.topk(|x|, n/1000)``, the baseline of the selection;
- the exact-k kernels of core/select/triton_kernels.py on one layer of n elements, k = n/1000:
  ``_pass1`` alone (the histogram), with the compensation (r + g, DGC momentum: five
  streams), at several block sizes and warp counts; then ``_filter``, ``_refine``, ``_count``,
  ``_write`` one by one, each repeated on the state the stages before it left (the refine,
  repeated, narrows its own result: the count and write are timed on a fresh one); the whole
  select, eager and replayed from a CUDA graph.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from redsync_hvd.core.segments import Segments  # noqa: E402
from redsync_hvd.core.select import Contract, select  # noqa: E402
from redsync_hvd.core.select import triton_kernels as tk  # noqa: E402
from redsync_hvd.core.select import triton_select as ts  # noqa: E402
from redsync_hvd.core.select.radix import k_rows  # noqa: E402
from redsync_hvd.experiments.stats import graphed  # noqa: E402

TORCH, TRITON = Contract("radix", backend="torch"), Contract("radix", backend="triton")


@triton.jit
def _read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr, tl.sum(tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0)), axis=0))


@triton.jit
def _count_above(x_ptr, thr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_add(out_ptr, tl.sum((tl.abs(x) > thr).to(tl.int32), axis=0))


@triton.jit
def _histogram(x_ptr, out_ptr, n, BLOCK: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    key = tl.abs(x).to(tl.int32, bitcast=True) >> SHIFT
    tl.atomic_add(out_ptr + tl.arange(0, BINS), tl.histogram(key, BINS, mask=offs < n))


def floor_rows(x, timer):
    """The pass costs of a plain read, a count and histograms; each checked against torch."""
    n, rows = x.numel(), []
    for block in (1024, 4096):
        grid = (triton.cdiv(n, block),)
        s = torch.zeros(1, device=x.device)
        rows.append((f"read and sum, BLOCK {block}", timer(lambda: _read_sum[grid](x, s, n, BLOCK=block)), 4 * n))
        c = torch.zeros(1, dtype=torch.int32, device=x.device)
        _count_above[grid](x, 1.0, c, n, BLOCK=block)
        assert int(c) == int((x.abs() > 1.0).sum()), "count_above"
        count = timer(lambda: _count_above[grid](x, 1.0, c, n, BLOCK=block))
        rows.append((f"count of abs(x) > t, BLOCK {block}", count, 4 * n))
        for bins, shift in ((256, 23), (2048, 20), (4096, 19)):
            h = torch.zeros(bins, dtype=torch.int32, device=x.device)
            _histogram[grid](x, h, n, BLOCK=block, BINS=bins, SHIFT=shift)
            want = torch.bincount((x.abs().view(torch.int32) >> shift).long(), minlength=bins)[:bins]
            assert torch.equal(h.long().cpu(), want.cpu()), ("histogram", bins)
            rows.append((f"tl.histogram {bins} bins, BLOCK {block}",
                         timer(lambda: _histogram[grid](x, h, n, BLOCK=block, BINS=bins, SHIFT=shift)), 4 * n))
    rows.append(("torch.topk(abs(x), n/1000)", timer(lambda: torch.topk(x.abs(), n // 1000)), 4 * n))
    rows.append(("x.clone() (read + write)", timer(lambda: x.clone()), 8 * n))
    return rows


def pass1_rows(x, timer):
    """_pass1 alone and with the compensation, over block sizes and warp counts."""
    n, seg = x.numel(), Segments([x.numel()], [x.numel() // 1000], align=16)
    tab, hist = seg.tables(x.device), torch.zeros(256, dtype=torch.int32, device=x.device)
    r, g, u, uo, out = (torch.randn_like(x) for _ in range(5))
    grid, rows = (len(tab.tile_seg),), []
    for block, warps in ((2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        def launch(comp, block=block, warps=warps):
            tk._pass1[grid](out if comp else x, r, g, u, uo, hist, tab.tile_seg, tab.tile_lo, tab.tile_hi, 0.9,
                            COMPENSATE=comp, MOMENTUM=comp, NESTEROV=False, R=1, ALIGNED=True, BLOCK=block,
                            num_warps=warps, enable_fp_fusion=False)
        rows.append((f"_pass1 histogram, BLOCK {block}, {warps} warps", timer(lambda: launch(False)), 4 * n))
        rows.append((f"_pass1 compensate (momentum) + histogram, BLOCK {block}, {warps} warps",
                     timer(lambda: launch(True)), 20 * n))
    return rows


def stage_rows(x, timer):
    """The stages after histogram 1, one by one, and the whole select (eager, graph)."""
    n = x.numel()
    seg = Segments([n], [n // 1000], align=16)
    k_row = k_rows(seg, x.device, None)
    want = select(seg, x.clone(), TORCH) if not x.is_cuda else None
    sel = select(seg, x, TRITON)          # builds the workspace and leaves its state
    if want is not None:
        assert torch.equal(sel.positions, want.positions) and torch.equal(sel.kth, want.kth), "select"
    ws = ts.workspace(seg, 1, x.device)
    hist = ts.pass1(seg, x, 1)                         # histogram 1 kept (the filter does not consume it)
    out = ts.outputs(seg, x.device, torch.int32, torch.float32)
    stages = ts.stages(seg, ws, x, hist, k_row, out, own=False, s0=0, s1=0, mean=False, update=False, velocity=None)
    for _, launch in stages:
        launch()
    cands = int(ws.cand_n.sum())
    moved = {"_filter": 4 * n + 8 * cands, "_refine": 8 * cands, "_count": 8 * cands, "_write": 8 * cands}
    rows, launches = [], dict(stages)
    for name, launch in stages:
        if name == "_count":   # a repeated refine narrows T further: the filter and refine again give it back,
            for again in ("_filter", "_refine", "_count"):   # so the count and write stay within their slots
                launches[again]()
        rows.append((f"{name} (candidates: {cands / n:.1%} of x)", timer(launch), moved[name]))
    ws.pending = False
    ws.hist1.zero_()
    rows.append(("exact-k select, eager (all launches)", timer(lambda: select(seg, x, TRITON)), 4 * n))
    if x.is_cuda:
        rows.append(("exact-k select, CUDA graph", timer(graphed(lambda: select(seg, x, TRITON))), 4 * n))
    return rows


class Timer:
    """Median device ms of a call by ``triton.testing.do_bench`` on CUDA; on the CPU it runs the
    call once (the interpreter checks the kernels; no time is meaningful there)."""

    def __init__(self, cuda: bool):
        self.repeats = cuda

    def __call__(self, fn) -> float:
        if not self.repeats:
            fn()
            return float("nan")
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--n", type=int, default=0, help="elements (default: 16M on CUDA, 16K on the CPU)")
    p.add_argument("--out", default="", help="also write the rows here (JSON)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    n = args.n or ((1 << 24) if cuda else (1 << 14))
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(args.device)
    timer, rows, done = Timer(cuda), [], []
    for part in (stage_rows, pass1_rows, floor_rows):     # the exact-k rows first
        try:
            rows += part(x, timer)
            done.append(part.__name__)
        except Exception as e:   # noqa: BLE001 - report it and go on: the other rows still count
            print("%s failed: %s: %s" % (part.__name__, type(e).__name__, e), file=sys.stderr)
        save(rows, args, n)
    device = torch.cuda.get_device_name() if cuda else "cpu (interpreter: correctness only)"
    print("Device: %s; torch %s; triton %s; n = %d fp32\n" % (device, torch.__version__, triton.__version__, n))
    print("| pass | device us | TB/s |\n|---|---:|---:|")
    for name, ms, nbytes in rows:
        print("| %s | %.1f | %.2f |" % (name, ms * 1e3, nbytes / (ms * 1e-3) / 1e12 if ms == ms else float("nan")))
    print("correct on %s: %s" % (args.device, ", ".join(done)))
    sys.exit(0 if len(done) == 3 else 1)


def save(rows, args, n):
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n": n, "rows": [{"pass": a, "ms": b, "bytes": c} for a, b, c in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
