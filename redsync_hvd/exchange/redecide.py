"""The exchange's side of ``policy.mode: cost_model``'s per-bucket review (``policy/review.py``).

    plan        after the buckets are built: price each bucket dense and compressed; a compressed
                bucket the model prices slower than dense goes dense before the first step
    add         the seconds each bucket took this step, on this rank (``GradientExchange`` times
                ``add``, ``flush`` and ``finish`` per bucket)
    after_step  every ``review_every`` steps: one allreduce of the window's sums (their mean
                over ranks), rank 0's verdicts broadcast, and the buckets that flip go dense

A bucket that goes dense is rebuilt as the dense layers' buckets (new buffers: the old ones may
still be some parameter's ``.grad``, whose gradient is then copied in); each of its layers'
residuals waits in ``pending`` and is added to that layer's next gradient, so nothing a worker
kept back is lost (DGC's velocities of those layers are dropped: a dense layer's momentum is
applied to its average).
"""
from __future__ import annotations

import time

import torch

from ..policy.review import BucketVerdict, Review, bucket_prediction
from .buckets import Buffers


def plan(exchange) -> Review | None:
    """Step 1 for every bucket holding layers the cost model decided; None where it decided none
    (another policy mode, pinned decisions, a single worker)."""
    policy = exchange.policy
    p = policy.config.policy
    if policy.source != "cost model" or policy.network is None or exchange.comm.size <= 1:
        return None
    overlap = policy.overlap if policy.overlap is not None else (p.overlap or 0.0)
    review = Review(every=p.review_every, margin=p.review_margin, overlap=overlap, given=p.overlap is not None)
    priced = {d["name"] for d in policy.decisions if str(d["why"]).startswith("cost model")}
    # layers that go dense join the dense bucket that runs anyway: their bytes, no latency of their own
    fused = any(b.kind == "reduce" and not b.layers[0].compressed for b in exchange.buckets)
    for bucket in exchange.buckets:
        if not any(n in priced for n in bucket.names):
            continue
        layers = bucket.layers
        wires = [policy._wire(l, l.base_density) for l in layers]
        full, compressed = bucket_prediction([l.numel for l in layers], wires, exchange.compressor.collective,
                                             exchange.comm.size, policy.network, policy.compute, fused=fused)
        verdict = BucketVerdict(bucket.index, list(bucket.names), sum(l.numel for l in layers),
                                full * (1.0 - review.hidden()), compressed, compressed=layers[0].compressed,
                                full_s=full)
        if not verdict.compressed:
            verdict.why = "cost model: each layer dense predicted faster"
        elif compressed >= verdict.dense_s:
            verdict.compressed, verdict.why = False, "cost model: the bucket compressed predicted no faster than dense"
        review.plan(verdict)
    return review


def start(exchange) -> None:
    """Plan, and rebuild once where the plan sent a compressed bucket dense."""
    review = exchange.policy.review = plan(exchange)
    if review is None:
        return
    names = [n for v in review.verdicts if not v.compressed for n in v.names
             if exchange.layers[n].compressed]
    if names:
        go_dense(exchange, names, review.verdicts)


def after_step(exchange) -> None:
    """Steps 2-5 of ``policy/review.py`` where a window is complete (every step: the clock the
    compute is measured on). Every rank calls this after the same steps, so the two collectives
    meet; the verdicts come from rank 0."""
    review = exchange.policy.review
    if review is None or not review.due(exchange.step, time.perf_counter()):
        return
    comm = exchange.comm
    mine = torch.tensor(review.mine(), dtype=torch.float64)
    means = comm.wait(comm.allreduce_async(mine, name="rsync.review.seconds", average=True)).tolist()
    flips = review.decide(means[:-1], exchange.step, compute=means[-1])
    watched = review.watched()
    flags = torch.tensor([float(v in flips) for v in watched], dtype=torch.float64)
    flags = comm.wait(comm.broadcast_async(flags, root=0, name="rsync.review.flips")).tolist()
    flipped = [v for v, f in zip(watched, flags) if f > 0]
    review.flip(flipped, exchange.step)
    if flipped:
        go_dense(exchange, [n for v in flipped for n in v.names], review.verdicts)


def go_dense(exchange, names: list, verdicts: list) -> None:
    """The layers ``names`` travel dense from the next step: their residuals wait in ``pending``,
    the policy's decisions say why, and the exchange's buckets are built again."""
    residuals = exchange.residuals()
    why = {n: v.why for v in verdicts for n in v.names}
    for name in names:
        layer = exchange.layers[name]
        if name in residuals:
            exchange.pending[name] = residuals[name].detach().clone().reshape(-1)
        layer.compressed = False
    for d in exchange.policy.decisions:
        if d["name"] in names:
            d.update(compressed=False, density=1.0, why=why.get(d["name"], "review"))
    rebuild(exchange, names)


def rebuild(exchange, dropped: list) -> None:
    """The exchange's buckets again, from the layers' current decisions (between steps). Fresh
    buffers (the old ones may still be some parameter's ``.grad``); the memory forgets
    ``dropped`` and its flat blocks go back to layers of their own (``drop``): the new planned
    buckets take their layers' residuals on their first step, whatever their index now;
    ``rebuilt`` counted, so adapters whose ``.grad`` were bucket views take the new ones."""
    exchange.memory.drop(dropped)
    exchange.buffers = Buffers(exchange.buffers.keep)
    exchange.buckets = exchange._build([exchange.layers[n] for n in exchange.order], *exchange._shape)
    exchange._wire()
    exchange._density_key = None
    exchange.rebuilt = getattr(exchange, "rebuilt", 0) + 1


def timed(review, bucket, call: str, *args):
    """``bucket.<call>(*args)``, its seconds counted for ``review`` (a scatter group's seconds are
    shared by its buckets)."""
    t0 = time.perf_counter()
    out = getattr(bucket, call)(*args)
    parts = getattr(bucket, "buckets", [bucket])
    for b in parts:
        review.add(b.index, (time.perf_counter() - t0) / len(parts))
    return out
