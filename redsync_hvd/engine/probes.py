"""Measure what the cost model needs on this machine, for ``policy.mode: cost_model``.

``probe_network`` (policy/costmodel.py) fits the network's alpha and bandwidth from timed
allreduces; ``probe_compute`` measures what compression costs per element here;
``probe_overlap`` how much of a dense allreduce backward-like work hides.

The cost model's default :class:`~redsync_hvd.policy.costmodel.ComputeModel` holds rough CPU
figures; a shared 2-core VM or a GPU can be several times off, and then the policy
compresses layers where it does not pay. ``probe_compute`` times, on the training
device, what the exchange does per step for one compressed layer (compensation, a TBS
selection at density 0.001, the sign-mean message, decoding N messages; no bytes move) on a
4k- and a 4M-element layer, and fits a fixed cost per layer and a cost per element.
Ranks agree on the figure with one allreduce (the mean), so every rank takes the same
per-layer decisions: different decisions would give ranks different bucket layouts.
"""
from __future__ import annotations

import time

import torch

from ..comm.local import LocalCommunicator
from ..compressors import build_compressor
from ..compressors.base import Layer
from ..config.compression import parse_compression
from ..exchange import GradientExchange
from ..memory import ResidualMemory
from ..policy import LayerPolicy
from ..policy.costmodel import ComputeModel, Network, probe_network

REDSYNC_PROBE = {"method": "redsync", "density": 0.001, "selection": "tbs"}


def probe_spec(spec: dict | None) -> dict:
    """The compression ``spec`` (a dict like the YAML section) as the probe runs it: every layer
    compressed, no momentum correction (no optimizer to take it from), nothing pinned."""
    # what would make the probe's steps dense or different from the run's steady state goes
    skip = ("policy", "dgc", "sparse_update", "warmup", "start_iter", "decisions")
    out = {k: v for k, v in dict(spec or REDSYNC_PROBE).items() if k not in skip}
    out["policy"] = {"min_compress_numel": 0}
    if parse_compression(out).corrects_momentum:
        out["dgc"] = {"momentum_correction": False}
    return out


def _fastest(numel: int, device, size: int, repeats: int, spec: dict | None = None) -> float:
    """Seconds of the fastest of ``repeats`` exchange steps of one compressed layer of ``numel``
    elements under ``spec`` (default: RedSync at density 0.001, tbs, sign-mean), with a one-process
    transport that decodes ``size`` ranks' messages: everything the exchange does for such a layer
    except moving bytes."""
    comm = LocalCommunicator(size)
    comp, cfg = build_compressor(probe_spec(spec), comm)
    layer = Layer("probe", (numel,), numel, 0, torch.device(device))
    ex = GradientExchange([layer], comp, comm, LayerPolicy(cfg, comp),
                          ResidualMemory() if cfg.uses_memory else None)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for rep in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        ex.submit("probe", g)
        ex.finish()
        sync()
        if rep:  # the first call warms caches and the allocator
            times.append(time.perf_counter() - t0)
    # the fastest repeat: what the machine does when this job has it (other jobs on a
    # shared host inflate the median at probe time, not necessarily later)
    return min(times)


def fit_rate(small: int, t_small: float, big: int, t_big: float) -> tuple[float, float]:
    """(c0 seconds per layer, c1 seconds per element) through two timed layer sizes."""
    if t_big > t_small and big > small:
        c1 = (t_big - t_small) / (big - small)
        return max(t_small - c1 * small, 0.0), c1
    # noise swamped the difference (a tiny probe, equal sizes): bound the slope by the big layer
    return t_small, t_big / max(big, 1)


def probe_rates(size: int, device="cpu", spec: dict | None = None, sizes=(1 << 12, 1 << 22),
                repeats: int = 5) -> ComputeModel:
    """This process's measured cost of a compressed layer under ``spec`` (select, encode, update
    the residual, decode ``size`` ranks' messages), ``c0 + c1 * n``, fitted through the smallest
    and the largest of ``sizes`` (a model's own layer sizes, where known). Decoding is measured
    with it, so the model's own decompress estimate is zeroed. No collective."""
    small, big = min(sizes), max(sizes)
    t_small = _fastest(small, device, size, repeats, spec)
    t_big = t_small if big == small else _fastest(big, device, size, repeats, spec)
    c0, c1 = fit_rate(small, t_small, big, t_big)
    return ComputeModel(select_c0=c0, select_c1=c1, decompress_c0=0.0, decompress_c1=0.0)


def probe_compute(comm, device="cpu", numel: int = 1 << 22, repeats: int = 5, small: int = 1 << 12,
                  spec: dict | None = None, sizes=None) -> ComputeModel:
    """A ComputeModel whose cost of a compressed layer, ``c0 + c1 * n``, was measured here under
    ``spec`` on the model's smallest and largest layers (``sizes``; else ``small`` and ``numel``
    elements), agreed by all ranks (the mean: every rank then takes the same per-layer decisions,
    different ones would give ranks different bucket layouts). c0 is the fixed cost of a
    compressed layer in the exchange (a dozen small ops and their Python: hundreds of
    microseconds on a loaded CPU, launches and host waits on a GPU); it decides whether
    mid-sized layers pay."""
    size = max(1, int(getattr(comm, "size", 1)))
    picked = (min(sizes), max(sizes)) if sizes else (small, numel)
    rates = probe_rates(size, device, spec, picked, repeats)
    mine = torch.tensor([rates.select_c0, rates.select_c1], dtype=torch.float64)
    if size > 1:
        mine = comm.wait(comm.allreduce_async(mine, name="costmodel.compute_probe", average=True))
    return ComputeModel(select_c0=float(mine[0]), select_c1=float(mine[1]), decompress_c0=0.0, decompress_c1=0.0)


def given_compute(config) -> ComputeModel | None:
    """``policy.compute_s`` as the cost model's ComputeModel where the config gives it (decisions
    that do not move with the machine's load: a compressed layer's whole cost, decoding included),
    else None (the caller probes)."""
    given = getattr(getattr(config, "policy", None), "compute_s", None)
    if given is None:
        return None
    c0, c1 = given
    return ComputeModel(select_c0=c0, select_c1=c1, decompress_c0=0.0, decompress_c1=0.0)


def network_for(config, comm) -> Network | None:
    """The network the cost model plans for: what the config gives, the rest measured here
    (a probed alpha is Horovod's cost per collective round: its cycle, negotiation, the wait,
    often far above the link's latency). None unless ``policy.mode`` is cost_model or
    ``aggregation`` is auto (which prices each bucket's two paths)."""
    p = config.policy
    if p.mode != "cost_model" and getattr(config, "aggregation", "allgather") != "auto":
        return None
    if p.latency_s is not None and p.bandwidth_gbit is not None:
        return Network.from_config(latency_s=p.latency_s, bandwidth_gbit=p.bandwidth_gbit)
    probed = probe_network(comm)
    return Network(alpha=probed.alpha if p.latency_s is None else float(p.latency_s),
                   bandwidth=probed.bandwidth if p.bandwidth_gbit is None else float(p.bandwidth_gbit) * 1e9 / 8.0)


def _burst(device, count: int) -> float:
    """Seconds of ``count`` 256x256 matrix products: backward's kind of work (on a CPU it takes
    the cores a collective's progress thread needs; on a GPU it leaves the link alone)."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(count):
        a = torch.tanh(a @ a)   # tanh: keeps the values finite, as an activation's backward does
    sync()
    return time.perf_counter() - t0


def probe_overlap(comm, numel: int, device="cpu", repeats: int = 5, cap: int = 1 << 20, work=None) -> float:
    """The fraction of a dense allreduce that runs hidden behind backward-like work here,
    measured on the run's own communicator (``policy.overlap`` left unset):

    1. A: an allreduce of the model's dense gradient (``numel`` fp32, at most ``cap``) alone;
    2. W: matrix products sized to last about A, alone;
    3. T: the allreduce started, the same products run, then the allreduce waited for;
    4. hidden = (A + W - T) / min(A, W), clamped to [0, 1]: 1 when T is max(A, W), 0 when T is A + W.

    Steps 1-3 run back to back ``repeats`` times and the median of the fractions is taken (a shared
    host slows some timings; a pair taken together drifts together). Every rank runs the same
    collectives, and the fraction is the mean over ranks, so every rank prices buckets alike.
    ``work(count)``: seconds of ``count`` units of work (default: ``count`` matrix products)."""
    size = max(1, int(getattr(comm, "size", 1)))
    if size <= 1:
        return 0.0
    buf = torch.zeros(max(1, min(int(numel), cap)), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)
    burst = work or (lambda count: _burst(device, count))

    def allreduce(tag: str, count: int = 0) -> float:
        sync()
        t0 = time.perf_counter()
        handle = comm.allreduce_async(buf, name=f"costmodel.overlap.{tag}", average=True)
        if count:
            burst(count)
        comm.wait(handle)
        sync()
        return time.perf_counter() - t0

    alone = min(allreduce(f"w{r}") for r in range(2))
    count, took = 8, burst(8)
    for _ in range(2):   # as many products as last A here now (a loaded host stretches them)
        count = max(1, min(int(count * alone / max(took, 1e-7)), 10_000))
        took = burst(count)
    fractions = []
    for r in range(repeats):
        a, w, t = allreduce(f"a{r}"), burst(count), allreduce(f"t{r}", count)
        fractions.append(min(max((a + w - t) / max(min(a, w), 1e-9), 0.0), 1.0))
    mine = torch.tensor([sorted(fractions)[len(fractions) // 2]], dtype=torch.float64)
    return float(comm.wait(comm.allreduce_async(mine, name="costmodel.overlap.agree", average=True))[0])
