"""Bench worker: train a reference model on synthetic data for a fixed number of steps and
time every step.

    python -m redsync_hvd.experiments.netbench.worker --spec '{"model": "vgg", "model_options": {"fc_width": 4096},
        "batch_size": 16, "steps": 8, "warmup": 3, "compression": {"method": "none"}}' --out r.json

Modes (``spec["mode"]``):

* ``distributed`` (default): one Horovod rank wrapping SGD in
  ``redsync_hvd.torch.DistributedOptimizer``, launched inside a network namespace by
  ``launcher.py`` (Gloo) or ``mpi_launcher.py`` (MPI: the decentralized methods), or by horovodrun.
  Per step: wall time (forward + backward + ``opt.step()``, which waits for the exchange),
  and from ``opt.communication_stats()["last_step"]`` the seconds in ``select``,
  ``communicate`` and ``decompress`` and the wire bytes; ``compute`` = step - those three.
* ``compute``: no Horovod, no communication: plain SGD, the same forward/backward/update.
  It is the model's compute time (the denominator of the compute/communication ratio).

Several configurations in one process: ``spec["runs"] = [{"label": "dense", "compression":
{...}}, ...]`` with ``spec["rounds"] = R`` trains each of them R times, interleaved (A, B,
A, B), each time from a fresh model and optimizer with ``warmup`` untimed steps (for a method with
local steps, rounded up to whole rounds, as ``steps`` is: ``whole_rounds``); one
start-up (Horovod, rendezvous) serves them all, and a change in background load hits
every configuration alike.

Rank 0 writes one JSON object to ``--out``: per label, medians over the timed steps (the
mean for methods with ``local_steps`` > 1, whose exchange happens every few steps), the
per-step lists, per-layer message sizes and decisions, the allgather buckets; it prints
a short form on its last stdout line after ``RESULT``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ... import launchers  # the standard library alone: safe before pinning

DEFAULTS = {
    "mode": "distributed", "model": "vgg", "model_options": {}, "input_shape": [3, 32, 32],
    "num_classes": 10, "seq_len": 35, "batch_size": 16, "steps": 8, "warmup": 3, "threads": 1,
    "seed": 0, "lr": 0.01, "momentum": 0.9, "compression": {"method": "none"}, "batches": 4,
    "runs": [], "rounds": 1, "probe_network": False, "probe_bytes": 8 << 20,
}
PHASES = ("select", "communicate", "decompress")


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def make_batches(spec, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * spec["seed"] + rank)
    out = []
    for _ in range(spec["batches"]):
        if spec["model"] == "lstm_lm":
            x = torch.randint(0, spec["num_classes"], (spec["batch_size"], spec["seq_len"]), generator=g)
            y = torch.randint(0, spec["num_classes"], (spec["batch_size"], spec["seq_len"]), generator=g)
        else:
            x = torch.randn(spec["batch_size"], *spec["input_shape"], generator=g)
            y = torch.randint(0, spec["num_classes"], (spec["batch_size"],), generator=g)
        out.append((x, y))
    return out


def build(spec):
    import torch

    from redsync_hvd.models import build_model
    torch.manual_seed(spec["seed"])
    shape = (spec["seq_len"],) if spec["model"] == "lstm_lm" else tuple(spec["input_shape"])
    return build_model(spec["model"], spec["num_classes"], shape, **spec["model_options"])


def loss_fn(model, x, y):
    import torch.nn.functional as F
    out = model(x)
    if out.dim() == 3:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(out, y)


def whole_rounds(warmup: int, steps: int, every: int) -> tuple[int, int]:
    """(warm-up, timed steps) for a method that exchanges every ``every`` steps (local steps).
    The warm-up then ends with an exchange (an optimizer's first allocates its buffers: a cost a
    run pays once, not once a round), and the timed steps are whole rounds, each ending with its
    exchange, so their mean is the cost of a step; 3 + 10 steps at 8 local steps timed one
    exchange in 10 steps where a round has one in 8. A method whose exchange falls
    outside the window (the no-exchange rows) keeps both."""
    if not 1 < every <= warmup + steps:
        return warmup, steps
    return every * -(-max(warmup, 1) // every), every * -(-steps // every)


def _train(spec, compression, rank, rhvd, comm_only=False):
    """One fresh model + optimizer; ``warmup`` untimed then ``steps`` timed steps.
    ``comm_only``: no forward/backward; fixed random gradients go through ``opt.step()``
    (the exchange alone, plus the optimizer update)."""
    import torch
    distributed = rhvd is not None
    model = build(spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    if distributed:
        opt = rhvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
        rhvd.allreduce(torch.zeros(1), name="netbench.start")   # start the timed loop together
    batches = make_batches(spec, rank)
    every = getattr(getattr(opt, "compression_config", None), "local_steps", 1) if distributed else 1
    warmup, steps = whole_rounds(spec["warmup"], spec["steps"], every)
    out = {"steps": [], "wire": [], **{p: [] for p in PHASES}}
    if comm_only:
        g = torch.Generator().manual_seed(spec["seed"] * 7919 + rank)
        fixed = [torch.randn(p.shape, generator=g) * 1e-3 for p in model.parameters()]
        loss = torch.zeros(())
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        if comm_only:
            for p, f in zip(model.parameters(), fixed):
                p.grad = f   # no copy: the exchange overwrites it with the average, reused next step
        else:
            loss = loss_fn(model, x, y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {i}: lower spec['lr']")
        if i < warmup:
            continue
        out["steps"].append(dt)
        last = opt.communication_stats()["last_step"] if distributed else {}
        for p in PHASES:
            out[p].append(float(last.get(f"time_{p}", 0.0)))
        out["wire"].append(float(last.get("wire_bytes", 0.0)))
    out["final_loss"] = float(loss.detach())
    out["parameters"] = sum(p.numel() for p in model.parameters())
    if distributed:
        stats = opt.communication_stats()
        out["layers"] = [{"name": name, **v} for name, v in stats["layers"].items()]
        out["layer_decisions"] = opt.layer_decisions()
        ex = getattr(opt, "exchange", None)   # none for the decentralized optimizer
        # how compressed layers were grouped into allgathers (one header + one payload each); a
        # dense bucket that rides in one (policy.dense_in_gather_bytes) is listed with its host
        out["buckets"] = [[l.name for l in b.layers] + [l.name for r in b.riders for l in r.layers]
                          for b in (ex.buckets if ex is not None else []) if b.ride is None]
        out["compression_ratio"] = stats["compression_ratio"]
    del opt, model
    return out


def _summarise(label, compression, parts, rank, size, window: int):
    steps = [s for p in parts for s in p["steps"]]
    phases = {ph: [x for p in parts for x in p[ph]] for ph in PHASES}
    wire = [w for p in parts for w in p["wire"]]
    compute = [s - sum(phases[ph][j] for ph in PHASES) for j, s in enumerate(steps)]
    from redsync_hvd.config import exchange_every  # pydantic: read once the timings are in

    # communication delay (SBC: local steps, then one exchange): only the mean over whole
    # periods is the cost per step; everything else, the no-exchange rows (whose round never
    # ends in the ``window`` of warm-up and timed steps) included: the median, robust to a noisy
    # host (4 ranks on 2 cores: one descheduled step of 5.7 s among 0.15 s ones)
    delayed = 1 < exchange_every(compression) <= window
    agg = statistics.fmean if delayed else _median
    last = parts[-1]
    return {
        "label": label, "compression": compression, "rank": rank, "size": size,
        "parameters": last["parameters"], "statistic": "mean" if delayed else "median",
        "step_time_s": agg(steps), "step_time_median_s": _median(steps), "step_time_mean_s": statistics.fmean(steps),
        "compute_s": agg(compute), **{f"{ph}_s": agg(phases[ph]) for ph in PHASES},
        "wire_bytes_per_step": statistics.fmean(wire) if delayed else _median(wire),
        "dense_bytes_per_step": 4 * last["parameters"], "steps_s": steps, "phases_s": phases,
        "rounds": len(parts), "final_loss": last["final_loss"],
        **{k: last[k] for k in ("layers", "layer_decisions", "buckets", "compression_ratio") if k in last},
    }


def sends_fp16(compression: dict | None) -> bool:
    """Whether a run allreduces fp16 values: the fp16 method, or dense layers under
    ``policy.dense_values: fp16``."""
    c = compression or {}
    return c.get("method") == "fp16" or (c.get("policy") or {}).get("dense_values") == "fp16"


def _probe(spec, runs) -> dict:
    """alpha and B as Horovod itself sees them (negotiation, Gloo, CPU load included): the cost
    model's own fit from timed allreduces of 8 bytes and probe_bytes, the median of 9 after 2
    untimed, so that one slow round on shared cores does not set alpha. Where a run allreduces
    fp16, also what the fp16 sum costs here beyond an fp32 allreduce of the same bytes, at the
    model's size (at most 64 MB): the size its fused fp16 buffer has; the median of 9 paired rounds."""
    from redsync_hvd.comm import HorovodCommunicator
    from redsync_hvd.policy.costmodel import probe_half_sum, probe_network
    t0 = time.perf_counter()
    net = probe_network(HorovodCommunicator(), sizes=(8, int(spec["probe_bytes"])), repeats=9, warmup=2,
                        reduce=statistics.median)
    half = 0.0
    if any(sends_fp16(r.get("compression")) for r in runs):
        numel = sum(p.numel() for p in build(spec).parameters())
        half = probe_half_sum(HorovodCommunicator(), min(2 * numel, 64 << 20), repeats=9, warmup=1,
                              reduce=statistics.median)
    return {"alpha_s": net.alpha, "bandwidth_Bps": net.bandwidth, "half_sum_s": half,
            "seconds": time.perf_counter() - t0}


def run(spec) -> dict:
    """Every entry of ``spec["runs"]`` (or the single ``spec["compression"]``), ``rounds`` times,
    interleaved (run A, run B, run A, run B...) so a change in background load hits all alike."""
    import torch
    torch.set_num_threads(int(spec["threads"]))
    rhvd, rank, size = None, 0, 1
    if spec["mode"] == "distributed":
        import redsync_hvd.torch as rhvd
        rhvd.init()
        rank, size = rhvd.rank(), rhvd.size()
    runs = spec["runs"] or [{"label": spec["compression"].get("method", "run"), "compression": spec["compression"]}]
    probe = _probe(spec, runs) if rhvd is not None and spec["probe_network"] else None
    parts = {r["label"]: [] for r in runs}
    for _ in range(int(spec["rounds"])):
        for r in runs:
            parts[r["label"]].append(_train(spec, r.get("compression"), rank, rhvd, bool(r.get("comm_only"))))
    results = {r["label"]: {**_summarise(r["label"], r.get("compression"), parts[r["label"]], rank, size,
                                                       int(spec["warmup"]) + int(spec["steps"])),
                            "comm_only": bool(r.get("comm_only"))} for r in runs}
    if rhvd is not None:
        keys = ("step_time_s", "compute_s", "select_s", "communicate_s", "decompress_s", "statistic",
                "steps_s", "phases_s")   # per-step lists: the step's slowest rank sets its pace
        mine = {label: {k: v[k] for k in keys} for label, v in results.items()}
        everyone = rhvd.allgather_object(mine, name="netbench.gather")
        for label, v in results.items():
            v["per_rank"] = [{"rank": i, **e[label]} for i, e in enumerate(everyone)]
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("HOROVOD_") and k != "HOROVOD_GLOO_RENDEZVOUS_PORT") or k == "GLIBC_TUNABLES"}
    return {"spec": spec, "rank": rank, "size": size, "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "horovod_env": env, "runs": results,
            "network_probe": probe, "loadavg": os.getloadavg()}


def pin_to_cpu(env=os.environ):
    """With NETBENCH_PIN_WORKERS=1: run on one CPU, the (rank mod #CPUs)-th one allowed, the rank
    as horovodrun or mpirun names it (``launchers.rank``), else the compute-only launch's
    NETBENCH_INDEX. Called before torch or Horovod start a thread, so theirs inherit it."""
    if env.get("NETBENCH_PIN_WORKERS") != "1":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    rank = launchers.rank(env)
    cpu = cpus[(int(env.get("NETBENCH_INDEX", 0)) if rank is None else rank) % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def pinned_launch(setting, procs: int, cpus: int | None = None) -> bool:
    """Whether a launch of ``procs`` processes pins each with ``pin_to_cpu`` (the bench's
    ``pin_workers``: true, false or auto). auto pins where the processes outnumber the CPUs:
    there the scheduler moved which ranks shared a core from launch to launch, and the 4-host
    cells' steps by up to 2x; with a CPU a rank, unpinned ranks' Horovod threads use the other
    core's idle time (docs/benchmarks.md, "The full grid", seventh pass)."""
    if setting != "auto":
        return bool(setting)
    return procs > (cpus if cpus is not None else len(os.sched_getaffinity(0)))


def main(argv=None) -> int:
    pin_to_cpu()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="JSON object (or @file) overriding " + json.dumps(DEFAULTS))
    ap.add_argument("--out", default=None, help="rank 0 writes its JSON result here")
    a = ap.parse_args(argv)
    raw = open(a.spec[1:]).read() if a.spec.startswith("@") else a.spec
    spec = {**DEFAULTS, **json.loads(raw)}
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        print(f"error: unknown spec keys {unknown}; valid: {sorted(DEFAULTS)}", file=sys.stderr)
        return 2
    result = run(spec)
    if result["rank"] == 0:
        text = json.dumps(result)
        if a.out:
            tmp = a.out + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, a.out)
        keys = ("step_time_s", "compute_s", "select_s", "communicate_s", "decompress_s", "wire_bytes_per_step")
        print("RESULT " + json.dumps({label: {k: r[k] for k in keys} for label, r in result["runs"].items()}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
