#!/usr/bin/env python
"""Compression overhead against compute, per step, with no network (CPU or CUDA).

    python scripts/bench_overhead.py                                  # CPU, 1 thread
    python scripts/bench_overhead.py --device cuda --out overhead.md  # a lone GPU, no Horovod

For each model it times a training step's compute (forward, backward and the
optimizer update; the same SGD in every variant) and, separately, the gradient
exchange's local work: residual compensation, selection, quantisation and packing,
then decoding and averaging ``--world`` messages as a worker of a ``--world``-rank
job would (``LocalCommunicator``: every rank sends what this one sends; no bytes
move). ``exchange / compute`` is that local work (select, pack, decompress) as a share
of a step's compute. For methods with a residual, ``r + g alone`` times just
the error-feedback update over the layers they compress (read two layer-sized buffers,
write one): no exchange over those layers can cost less on this memory system, so it is
the floor under that share. Each variant's steps are interleaved with the others
in rounds, and medians are taken over all steps after ``--warmup`` per round.

After the timed rounds one more step of each variant runs under a host-read count
(``redsync_hvd/core/host_reads.py``: every op or Python call that reads a tensor value back
to the host; on a GPU each one waits for the device), split into the compressed path (the
hooks' submits, the collectives' start, the decode) and the exchange's one agreed finite
check in ``finish()``; on CUDA ``torch.cuda.set_sync_debug_mode`` also counts the device
syncs of that step. ``--json`` writes every row. Methods whose name contains ``exact_k``
select exactly k per layer of a bucket on the device (``selection.method: radix``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.host_reads import HostReads
from redsync_hvd.engine import MomentumSpec, build_exchange
from redsync_hvd.experiments.machine import cpu_name
from redsync_hvd.experiments.netbench import allocator
from redsync_hvd.experiments.stats import sync
from redsync_hvd.experiments.tables import markdown
from redsync_hvd.models import build_model

MODELS = {
    # the end-to-end benchmark's communication-bound model (configs/bench/quick.yaml)
    "vgg_fc4096": dict(model="vgg", options={"fc_width": 4096, "width": 0.25}, batch=16),
    "resnet20": dict(model="resnet20", options={}, batch=16),
}
METHODS = {
    "dense": {"method": "none"},
    "topk": {"method": "topk", "density": 0.001},
    "redsync": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": False},
    },
    "redsync_noreuse": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 1},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": False},
    },
    # DGC momentum correction (RedSync's default, and the end-to-end benchmark's setting)
    "redsync_mc": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
    },
    # per-layer searches in the gradient hooks against one selection per bucket (the CUDA default,
    # core/bucket_select.py): on a GPU the difference is host waits, on a CPU the native passes
    "redsync_mc_layer": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5, "scope": "layer"},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
    },
    "redsync_mc_bucket": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5, "scope": "bucket"},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
    },
    # exactly k per layer of a bucket on the device, no host wait (selection.method: radix):
    # the Triton kernels on CUDA (torch ops on the CPU), and the same steps in torch ops
    "redsync_mc_exact_k": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "radix"},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
        "cuda_graph": "off",
    },
    "redsync_mc_exact_k_torch": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "radix", "radix_backend": "torch"},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
    },
    # the same two without the compensation fused into the selection's first pass
    # (torch.add, then a separate native pass): what the fused kernel saves
    "redsync_unfused": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": False},
    },
    "redsync_mc_unfused": {
        "method": "redsync",
        "density": 0.001,
        "selection": {"method": "tbs", "threshold_reuse": 5},
        "message": {"quantize": "sign_mean"},
        "dgc": {"momentum_correction": True},
    },
}


# eager against graph: redsync_mc_exact_k with each bucket's steps replayed from one CUDA graph
# (compression.cuda_graph, exchange/graph.py); redsync_mc_exact_k itself runs with cuda_graph: off
METHODS["redsync_mc_exact_k_graph"] = {**METHODS["redsync_mc_exact_k"], "cuda_graph": "on"}

AGREEMENT = "redsync_hvd.exchange.exchange:_read"   # the one read finish() makes


def count_reads(step, device) -> dict:
    """Host reads of one call of ``step``: in the compressed path, in the finite agreement, and
    (CUDA) the device syncs torch reports."""
    sync(device)
    with HostReads() as reads, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    sync(device)
    where = reads.where()
    return {"host_reads": sum(w != AGREEMENT for w in where), "agreement_reads": where.count(AGREEMENT),
            "read_sites": sorted(set(w for w in where if w != AGREEMENT)),
            "device_syncs": sum("synchroniz" in str(w.message) for w in caught) if device == "cuda" else None}


class Variant:
    def __init__(self, name, spec, model, world):
        self.name = name
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        layers = [Layer(n, tuple(p.shape), p.numel(), i, p.device, param=p)
                  for i, (n, p) in enumerate(self.named)]
        # the same SGD steps every variant, so a memory with momentum correction gets it by hand here
        momentum = MomentumSpec(dict.fromkeys((n for n, _ in self.named), 0.9))
        self.fused = not name.endswith("_unfused")
        self.ex = build_exchange(dict(spec), layers, LocalCommunicator(world), take_momentum=lambda: momentum,
                                 fuse=self.fused).exchange
        memory = self.ex.memory if spec["method"] != "none" else None
        self.compressed = sum(l.compressed for l in layers)
        self.exchange_s, self.phases = [], {p: [] for p in ("select", "communicate", "decompress")}
        # the floor of any error-feedback exchange over the same layers: r + g alone, one pass
        # reading two layer-sized buffers and writing one, no selection, nothing decoded
        on = {l.name for l in layers if l.compressed} if memory is not None else set()
        self.floor_layers = [(p, torch.zeros_like(p), torch.empty_like(p)) for n, p in self.named if n in on]
        self.floor_s = []

    def floor(self):
        t0 = time.perf_counter()
        for p, r, out in self.floor_layers:
            torch.add(r, p.grad, out=out)
        return time.perf_counter() - t0

    def exchange(self):
        for n, p in self.named:
            self.ex.submit(n, p.grad)
        # what DistributedOptimizer.synchronize does: decode into .grad, copy the rest
        out = self.ex.finish(into={n: p.grad.view(-1) for n, p in self.named}).averages
        for n, p in self.named:
            if out[n].data_ptr() != p.grad.data_ptr():
                p.grad.copy_(out[n].view(p.shape))
        last = self.ex.stats.last
        for ph in self.phases:
            self.phases[ph].append(last.get("time_" + ph, 0.0))


def bench_model(mname, args):
    """Rows of one model, for each batch size of --batches (default: the model's own)."""
    spec = MODELS[mname]
    torch.manual_seed(0)
    model = build_model(spec["model"], 10, (3, 32, 32), **spec["options"]).to(args.device)
    rows = []
    for batch in [int(b) for b in (args.batches or str(spec["batch"])).split(",")]:
        rows += bench_batch(mname, model, batch, args)
    return rows


def bench_batch(mname, model, batch, args):
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=args.device)
    y = torch.randint(0, 10, (batch,), device=args.device)
    lossf = torch.nn.CrossEntropyLoss()
    variants = []
    for m in args.methods.split(","):
        try:
            variants.append(Variant(m, METHODS[m], model, args.world))
        except Exception as e:   # report it and go on: the other rows still count
            print("  %-10s %-24s cannot run: %s: %s" % (mname, m, type(e).__name__, e), file=sys.stderr)
    compute = []
    for rnd in range(args.rounds):
        for v in list(variants):
            try:
                time_steps(v, model, opt, lambda: lossf(model(x), y).backward(), compute, args)
            except Exception as e:   # this variant loses its row, the others keep theirs
                print("  %-10s %-24s failed: %s: %s" % (mname, v.name, type(e).__name__, e), file=sys.stderr)
                variants.remove(v)
    c = statistics.median(compute) if compute else float("nan")
    rows = []
    for v in variants:
        try:
            model.zero_grad(set_to_none=True)
            lossf(model(x), y).backward()
            reads = count_reads(v.exchange, args.device)
        except Exception as e:
            print("  %-10s %-24s failed: %s: %s" % (mname, v.name, type(e).__name__, e), file=sys.stderr)
            continue
        e = statistics.median(v.exchange_s)
        rows.append(dict(model=mname, params=nparams, batch=batch, method=v.name, compressed=v.compressed,
                         layers=len(v.named), compute_ms=c * 1e3, exchange_ms=e * 1e3,
                         ratio=e / c, floor_ms=statistics.median(v.floor_s) * 1e3 if v.floor_s else None,
                         **{ph + "_ms": statistics.median(t) * 1e3 for ph, t in v.phases.items()}, **reads))
        print("  %-10s b%-4d %-24s compute %8.2f ms  exchange %8.2f ms  (%5.1f%% of compute)  host reads %d (+%d)%s"
              % (mname, batch, v.name, c * 1e3, e * 1e3, 100 * e / c, reads["host_reads"], reads["agreement_reads"],
                 "" if reads["device_syncs"] is None else ", device syncs %d" % reads["device_syncs"]),
              file=sys.stderr)
    return rows


def time_steps(v, model, opt, backward, compute, args):
    """One round of a variant: --warmup + --steps training steps, the exchange timed apart."""
    for s in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        sync(args.device)
        t0 = time.perf_counter()
        backward()
        sync(args.device)
        t1 = time.perf_counter()
        v.exchange()
        sync(args.device)
        t2 = time.perf_counter()
        opt.step()
        sync(args.device)
        t3 = time.perf_counter()
        if s >= args.warmup:
            compute.append((t1 - t0) + (t3 - t2))
            v.exchange_s.append(t2 - t1)
            if v.floor_layers and args.device == "cpu":
                v.floor_s.append(v.floor())
        else:  # warm-up steps do not count in the phase medians either
            for ph in v.phases:
                v.phases[ph].pop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=2, help="ranks whose messages each worker decodes")
    p.add_argument("--batches", default="", help="comma list of batch sizes (default: each model's own)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU); 0 leaves torch's default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="", help="also write the markdown table here")
    p.add_argument("--json", default="", help="also write every row here (JSON)")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (default: keep large freed blocks for the next "
                        "step, as the end-to-end benchmark does; redsync_hvd/experiments/netbench/allocator.py)")
    args = p.parse_args()
    kept = False if args.default_malloc else allocator.apply_in_process()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = (torch.cuda.get_device_name() if args.device == "cuda"
           else "%s, %d torch threads" % (cpu_name(), torch.get_num_threads()))
    head = ("Device: %s; torch %s; world %d; load average %.2f; large blocks kept by malloc: %s."
            % (dev, torch.__version__, args.world, os.getloadavg()[0], "yes" if kept else "no"))
    rows = []
    for m in args.models.split(","):
        rows += bench_model(m, args)
        write(rows, head, args, last=m == args.models.split(",")[-1])   # what is done survives a time limit


def write(rows, head, args, last):
    cols = ["model", "params", "batch", "method", "compressed layers", "compute ms", "exchange ms", "select ms",
            "decompress ms", "exchange / compute", "r + g alone, ms", "r + g alone / compute",
            "host reads / step (+ finite check)", "device syncs / step"]
    cells = [[r["model"], "%.2fM" % (r["params"] / 1e6), r["batch"], r["method"],
              "%d/%d" % (r["compressed"], r["layers"]),
              *("%.2f" % r[k] for k in ("compute_ms", "exchange_ms", "select_ms", "decompress_ms")),
              "%.1f%%" % (100 * r["ratio"]), "" if r["floor_ms"] is None else "%.2f" % r["floor_ms"],
              "" if r["floor_ms"] is None else "%.1f%%" % (100 * r["floor_ms"] / r["compute_ms"]),
              "%d (+%d)" % (r["host_reads"], r["agreement_reads"]),
              "-" if r["device_syncs"] is None else r["device_syncs"]] for r in rows]
    md = head + "\n\n" + markdown(cols, cells, "lrrlrrrrrrrrrr")
    if last:
        print(md, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": head, "world": args.world, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
