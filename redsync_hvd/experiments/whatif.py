"""What would a step cost on a cluster this machine is not? The cost model's answer, from a short probe here.

    python -m redsync_hvd.experiments.whatif --config configs/digits/redsync.yaml --hosts 8 --bandwidth 10gbit

1. builds the config's model and times its forward and backward on one batch of the config's
   batch size, in this one process (the median of ``--repeats``);
2. for the config's method and each baseline (none, fp16, topk, powersgd, redsync, sbc, ...)
   that selects or encodes: times an exchange step of a compressed layer of the model's smallest
   and largest size here (``engine/probes.py:probe_rates``: select, encode, the residual,
   decoding N ranks' messages) and fits a cost per layer and per element, ``--repeats`` times;
3. lays the model out in the method's buckets as the exchange would, for N = hosts x processes
   per host, and prices each: a compressed bucket's selection, collective and decode
   (``policy/review.py:bucket_prediction``), a bucket that sends every element (the dense
   layers; every bucket of none and fp16) as the ring allreduce of its bytes, ``--overlap`` of it
   hidden behind backward, with no measured rate in it (fp16 adds its measured conversions of
   every element to half precision and back: on a CPU they are not free);
4. prints one row per method, the median predicted step over the repeats with their spread, the
   speedup over dense, and the pick (the lowest median).

The link is one alpha-beta network for every pair of processes (``policy/costmodel.py``): with
several processes per host the inter-host link is the ring's slowest and is priced for all.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import torch
from torch.utils.data import default_collate

from redsync_hvd.comm.local import LocalCommunicator
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.config import ConfigError
from redsync_hvd.config.compression import parse_compression
from redsync_hvd.config.run import load_config
from redsync_hvd.data import build_datasets
from redsync_hvd.engine.probes import probe_rates
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.memory import ResidualMemory
from redsync_hvd.models import build_model
from redsync_hvd.policy import LayerPolicy
from redsync_hvd.policy.costmodel import ComputeModel, Network, half_sum, ride_time, ring_allreduce
from redsync_hvd.policy.review import bucket_prediction
from redsync_hvd.torch.training import loss_and_correct

BASELINES = ("none", "fp16", "topk", "powersgd", "redsync", "sbc", "iwp", "qsgd", "signsgd")
_BANDWIDTH = re.compile(r"^(\d+(?:\.\d+)?)(gbit|mbit|kbit)$")
_LATENCY = re.compile(r"^(\d+(?:\.\d+)?)(s|ms|us|ns)$")


def bandwidth(text: str) -> float:
    """Bytes per second of ``10gbit``, ``100mbit``, ``1.5gbit`` (bits per second, decimal)."""
    m = _BANDWIDTH.match(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"--bandwidth {text!r}: write a number and a unit of bits per second, "
                                         "gbit, mbit or kbit (10gbit, 100mbit, 2.5gbit)")
    return float(m.group(1)) * {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}[m.group(2)] / 8.0


def latency(text: str) -> float:
    """Seconds of ``25us``, ``1ms``, ``0.002s``."""
    m = _LATENCY.match(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: write a number and a unit, s, ms, us or ns "
                                         "(25us, 1ms, 0.002s, 20ns)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def model_and_batch(cfg):
    """The config's model and one batch of its batch size (the data's own samples)."""
    data = build_datasets(cfg.data.name, path=cfg.data.path, seed=cfg.training.seed, **cfg.data.options)
    model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
    n = min(cfg.training.batch_size, len(data.train))
    x, y = default_collate([data.train[i] for i in range(n)])
    return model, x, y, data.task


def time_compute(model, x, y, task: str, repeats: int) -> list:
    """Seconds of each of ``repeats`` forward + backward passes of one batch in this process,
    after one untimed (which allocates)."""
    times = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss, _, _ = loss_and_correct(model, x, y, task)
        loss.backward()
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def as_horovod_runs(spec: dict, sgd: bool = False) -> dict:
    """``spec`` with ``local_steps: auto`` settled as DistributedOptimizer settles it under horovodrun
    (``sgd``: the optimizer is torch.optim.SGD, whose RedSync values then travel as int8)."""
    config = parse_compression(spec)
    if getattr(config, "local_steps", None) != "auto":
        return spec
    config = config.settle("torch", "horovod", sgd=sgd)
    spec = {**spec, "local_steps": config.local_steps, "density": config.density}
    if hasattr(config, "message"):   # RedSync's positions Golomb-coded under local steps, its values int8 under SGD
        spec["message"] = config.message.model_dump(mode="json")
    return spec


def dense_seconds(wires: list, numel: int, N: int, net: Network, rides: bool) -> tuple[float, float]:
    """(seconds backward may hide, seconds it cannot) of a bucket that sends every element (``wires``:
    its layers' messages): the ring allreduce of its bytes, or, riding in an allgather
    (``policy.dense_in_gather_bytes``), N-1 copies of them. fp16 adds its sum at ``net.half_sum_s``
    an element (``--half-sum``): the ring's (N-1)/N of the elements, or every rank's N rows riding."""
    nbytes = sum(w.nbytes(N) for w in wires)
    half = half_sum(N, numel, net) if any(d == torch.float16 for w in wires for d in w.dtypes) else 0.0
    if rides:
        return 0.0, ride_time(N, nbytes, net) + N * half
    return ring_allreduce(N, nbytes, net) + half, 0.0


def price(spec: dict, layers: list, N: int, net: Network, rates, compute_s: float, overlap: float) -> dict:
    """Predicted seconds of one step under ``spec`` (step 3): the exchange's own buckets and
    decisions for N workers, each priced. A bucket that sends every element (dense layers, and
    every bucket of a ``dense_wire`` method: none, fp16) is the ring allreduce of its bytes (dense
    layers riding in an allgather, ``policy.dense_in_gather_bytes``: N-1 copies of them); fp16
    also converts every element down and back (``rates``: its measured cost per element; a bucket's
    fixed cost, which none has too and is priced without, is left out; none sends the gradient
    itself and has no rate). ``rates`` prices the selecting methods' buckets."""
    spec = as_horovod_runs(spec)
    config = parse_compression(spec)
    steady = {k: v for k, v in spec.items() if k not in ("warmup", "start_iter", "dgc")}   # no optimizer here
    policy_spec = spec.get("policy")
    if isinstance(policy_spec, dict):
        steady["policy"] = {k: v for k, v in policy_spec.items() if k != "decisions"}
    if parse_compression(steady).corrects_momentum:
        steady["dgc"] = {"momentum_correction": False}
    comm = LocalCommunicator(N)
    comp, cfg = build_compressor(steady, comm)
    policy = LayerPolicy(cfg, comp)
    policy.compute = rates
    mine = [Layer(l.name, l.shape, l.numel, l.index, l.device) for l in layers]
    ex = GradientExchange(mine, comp, comm, policy, ResidualMemory() if cfg.uses_memory else None,
                          fusion_bytes=cfg.fusion_bytes, network=net)
    dense_s, comm_s = 0.0, 0.0
    for bucket in ex.buckets:
        numels = [l.numel for l in bucket.layers]
        if comp.dense_wire or not bucket.layers[0].compressed:
            sender = comp if comp.dense_wire else ex.dense   # the method's, or how its dense layers travel
            hidden, exposed = dense_seconds([sender.wire(l) for l in bucket.layers], sum(numels), N, net,
                                            bucket.ride is not None)
            dense_s, comm_s = dense_s + hidden, comm_s + exposed
            if comp.dense_wire and rates is not None and not comp.passthrough:   # fp16's casts
                comm_s += rates.select_c1 * sum(numels)   # per element: a bucket's fixed cost none has too
        else:
            wires = [policy._wire(l, l.base_density) for l in bucket.layers]
            comm_s += bucket_prediction(numels, wires, comp.collective, N, net, rates, overlap)[1]
    every = config.local_steps if config.delayed else 1   # local steps: an exchange every few
    step = compute_s + (dense_s * (1.0 - overlap) + comm_s) / every
    compressed = 0 if comp.dense_wire else sum(l.compressed for l in mine)   # none, fp16: no layer selects
    return {"method": config.method, "compressed": compressed, "layers": len(mine),
            "exchange_s": step - compute_s, "step_s": step}


def conversion_rate(dtype, numel: int) -> ComputeModel:
    """Seconds per element of converting a gradient of ``numel`` elements to ``dtype`` and back
    here, the fastest of three after one untimed: the work fp16 does beyond none's (every rank's
    sum of the converted values is the collective's). In one thread: a pass over memory, which
    on a shared host would otherwise wait at every op for a second thread another job holds
    (60 ms instead of 0.02 for the digits CNN's 53,002 elements beside two CPU hogs)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    best, threads = float("inf"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rep in range(4):
            t0 = time.perf_counter()
            x.to(dtype).to(torch.float32)
            if rep:
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return ComputeModel(select_c0=0.0, select_c1=best / max(numel, 1), decompress_c0=0.0, decompress_c1=0.0)


def price_repeats(spec: dict, layers: list, N: int, net: Network, compute_s: float, overlap: float,
                  repeats: int) -> dict:
    """``price`` with the rates probed ``repeats`` times here (once for none, which has none: its
    row is the allreduce of the model's bytes alone): the median predicted step, and the spread
    (min, max) of the repeats, so that a probe slowed by another job moves neither the row nor
    the pick. fp16's rate is its conversions timed alone, over the model's size (the exchange
    converts whole fused buckets)."""
    comp = build_compressor(spec, LocalCommunicator(N))[0]
    exact = comp.dense_wire and comp.passthrough
    sizes = [l.numel for l in layers]

    def rates():
        if comp.dense_wire:
            return conversion_rate(comp.wire(layers[0]).dtypes[0], sum(sizes))
        return probe_rates(N, "cpu", spec, sizes, repeats=2)
    rows = [price(spec, layers, N, net, None if exact else rates(), compute_s, overlap)
            for _ in range(1 if exact else repeats)]
    steps = sorted(r["step_s"] for r in rows)
    row = min(rows, key=lambda r: abs(r["step_s"] - statistics.median(steps)))
    return {**row, "exchange_s": statistics.median(steps) - compute_s, "step_s": statistics.median(steps),
            "spread_s": (steps[0], steps[-1])}


def candidates(cfg, names: list) -> list:
    """(label, compression spec): the config's own, then each baseline at its defaults, each as the
    config's optimizer would settle it."""
    sgd = cfg.optimizer.name == "sgd"
    own = cfg.compression.model_dump(mode="json")
    out = [(f"config ({own['method']})", as_horovod_runs(own, sgd))]
    for name in names:
        spec = {"method": name}
        if parse_compression(spec).strategy == "exchange":
            out.append((name, as_horovod_runs(spec, sgd)))
    return out


def table(rows: list, computes: list) -> str:
    dense = next(r["step_s"] for r in rows if r["method"] == "none")
    lines = [f"forward+backward: {statistics.median(computes) * 1e3:.2f} ms (measured here: the median of "
             f"{len(computes)}, {min(computes) * 1e3:.2f}-{max(computes) * 1e3:.2f})", "",
             "| method | compressed layers | exchange ms | step ms | vs dense | step ms over the probes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["spread_s"]
        lines.append(f"| {r['label']} | {r['compressed']}/{r['layers']} | {r['exchange_s'] * 1e3:.2f} | "
                     f"{r['step_s'] * 1e3:.2f} | {dense / r['step_s']:.2f}x | {low * 1e3:.2f}-{high * 1e3:.2f} |")
    best = min(rows, key=lambda r: r["step_s"])
    return "\n".join(lines + ["", f"pick: {best['label']} ({best['step_s'] * 1e3:.2f} ms per step predicted)"])


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m redsync_hvd.experiments.whatif", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a training YAML (python -m redsync_hvd.train's)")
    ap.add_argument("--hosts", type=positive, required=True)
    ap.add_argument("--bandwidth", type=bandwidth, required=True, help="per link: 10gbit, 100mbit, ...")
    ap.add_argument("--latency", type=latency, default=25e-6, help="per collective round: 25us (default), 1ms")
    ap.add_argument("--half-sum", type=latency, default=0.0,
                    help="what summing fp16 adds per element beyond fp32 (0, the default: NCCL on GPUs; about 15-30ns "
                         "for Gloo on a CPU, as the end-to-end bench's probe_half_sum measures)")
    ap.add_argument("--np-per-host", "--gpus-per-host", dest="per_host", type=positive, default=1)
    ap.add_argument("--overlap", type=float, default=0.0, help="fraction of a dense allreduce hidden by backward")
    ap.add_argument("--methods", default=",".join(BASELINES), help="baselines to price, comma-separated")
    ap.add_argument("--repeats", type=positive, default=5,
                    help="timed passes and rate probes per method; each row is their median (default 5)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.overlap <= 1.0:
        ap.error(f"--overlap {args.overlap}: a fraction from 0 to 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config)
        names = ["none"] + [m.strip() for m in args.methods.split(",") if m.strip() not in ("", "none")]
        for name in names:
            parse_compression({"method": name})
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"whatif: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    model, x, y, task = model_and_batch(cfg)
    computes = time_compute(model, x, y, task, args.repeats)
    compute_s = statistics.median(computes)
    layers = [Layer(n, tuple(p.shape), p.numel(), i, torch.device("cpu"))
              for i, (n, p) in enumerate(model.named_parameters()) if p.requires_grad]
    N, net = args.hosts * args.per_host, Network(args.latency, args.bandwidth, args.half_sum)
    rows, skipped = [], []
    for label, spec in candidates(cfg, names):
        try:
            rows.append({"label": label, **price_repeats(spec, layers, N, net, compute_s, args.overlap,
                                                         args.repeats)})
        except (RuntimeError, ValueError, IndexError) as exc:   # a method the one-process probe cannot run
            skipped.append(f"{label}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    print(f"N = {N} ({args.hosts} hosts x {args.per_host}), {args.bandwidth * 8 / 1e9:g} Gbit/s, "
          f"{args.latency * 1e6:g} us per collective round, overlap {args.overlap:g}")
    print(table(rows, computes))
    for line in skipped:
        print(f"not priced (its probe failed in one process): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
