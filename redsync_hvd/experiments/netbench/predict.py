"""Predicted step time of a measured run, from ``redsync_hvd.policy.costmodel``.

    predicted = costmodel.step_time(layers, N, net, compute_s = compute + select + decompress,
                                    buckets=the run's allgather buckets, finite_check=True)

* ``compute``: measured with no communication (``worker.py`` mode ``compute``), ideally
  with N such processes running at once, so CPU sharing matches the distributed run;
* ``select``, ``decompress``: the run's own measured medians (``communication_stats``);
* ``layers``: one ``(numel, density, method)`` per parameter, from the run's actual
  messages: layers sent dense -> ``dense`` (``dense_fp16`` for fp16); compressed layers ->
  the cost model's wire format (``sign_mean``, ``pairs``, ``pairs_fp16``, ``golomb``,
  ``iwp``) with the density that reproduces the measured bytes of that layer
  (``message_bytes(n, density) == measured``). Dense layers are packed into Horovod
  fusion buffers of ``fusion_bytes`` (Horovod 0.28's default 128 MiB, or
  HOROVOD_FUSION_THRESHOLD), one ring allreduce each;
* ``net``: the shaped network, ``alpha = added latency + base one-way latency``
  (half the measured RTT of the unloaded link), ``B`` = the tbf rate (an unshaped link's
  measured TCP goodput), and the launch's measured ``half_sum_s`` (what
  an fp16 allreduce's sum costs beyond an fp32 one of its bytes: ``costmodel.probe_half_sum``);
* decentralized methods (DCD/ECD, under ``mpi_launcher``): one message of the measured size
  to each distinct ring neighbour, sent one after the other (``costmodel.neighbor_exchange``);
* ``buckets``: the run's buckets (``buckets_from_run``; one of dense layers is one ring
  allreduce, fp16 ones with their sum), each of compressed layers one collective
  round for all its layers' messages and headers, as the exchange sends them (one
  header + one payload allgather, issued together), or with ``aggregation`` the sparse
  reduce-scatter's alltoall and allgather; the one-float finite check rides in
  the last dense fusion buffer (``step_time(buckets=..., finite_check=True)``).

No overlap of backward and communication is assumed (``step_time(overlap=False)``),
so it is an upper bound where Horovod overlaps the dense allreduce with backward;
``predicted_overlap_s`` gives the other extreme (``max(compute, comm)``).
"""
from __future__ import annotations

import math
import os

from redsync_hvd.compressors import Layer, build_compressor
from redsync_hvd.config import exchange_every, parse_compression
from redsync_hvd.policy import costmodel as cm

HOROVOD_DEFAULT_FUSION = 128 * 1024 * 1024
ZERO = cm.ComputeModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def fusion_bytes(env: dict | None = None) -> int:
    v = (env or os.environ).get("HOROVOD_FUSION_THRESHOLD")
    return int(v) if v else HOROVOD_DEFAULT_FUSION


def wire_method(compression: dict | None) -> str:
    """The cost model's message format of what a compressed layer of this method puts on the wire,
    from its compressor's ``wire`` (``costmodel.message_format``)."""
    config = parse_compression(compression or {"method": "none"})
    if config.strategy == "decentralized":
        return "decentralized"
    compressor, _ = build_compressor(config)
    layer = Layer("probe", (1 << 20,), 1 << 20, 0, density=config.layer_density())
    return cm.message_format(compressor.wire(layer), compressor.collective)


def _density_for_bytes(n: int, nbytes: float, method: str) -> float:
    """Smallest density whose ``message_bytes(n, d, method)`` reaches the measured bytes."""
    lo, hi = 1e-12, 1.0
    if cm.message_bytes(n, hi, method) <= nbytes:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if cm.message_bytes(n, mid, method) < nbytes:
            lo = mid
        else:
            hi = mid
    return hi


def plan_from_run(run: dict) -> list:
    """(numel, density, method) per layer, from the measured per-layer messages of a run."""
    method = wire_method(run.get("compression"))
    dense = "dense_fp16" if method == "dense_fp16" else "dense"
    plan = []
    for layer in run.get("layers", []):
        n = int(layer["dense_bytes"]) // 4
        if method == "dense" and layer["group"] != "dense":
            # a compressed layer whose message is fp32 allreduced (PowerSGD's factors): its measured bytes
            n = max(1, int(layer["wire_bytes"]) // 4)
        if layer["group"] == "dense" or method.startswith("dense"):
            # a dense layer of a compressed method travels as fp16 under policy.dense_values: fp16
            half = layer["group"] == "dense" and 2 * int(layer["wire_bytes"]) == int(layer["dense_bytes"])
            plan.append((n, 1.0, "dense_fp16" if half else dense))
        else:
            plan.append((n, _density_for_bytes(n, float(layer["wire_bytes"]), method), method))
    return plan


def buckets_from_run(run: dict) -> list:
    """The run's allgather buckets (layer names, as the exchange built them) as indices
    into ``plan_from_run(run)``."""
    index = {layer["name"]: i for i, layer in enumerate(run.get("layers", []))}
    return [[index[name] for name in bucket if name in index] for bucket in run.get("buckets", [])]


def predict(run: dict, N: int, net: cm.Network, compute_s: float, fusion: int | None = None) -> dict:
    """Predicted seconds per step of ``run`` (a ``worker.py`` result for one label)."""
    plan = plan_from_run(run)
    fusion = fusion or fusion_bytes(run.get("horovod_env"))
    overhead = float(run.get("select_s", 0.0)) + float(run.get("decompress_s", 0.0))
    check = (run.get("compression") or {}).get("check_finite", True) is not False   # the flag rides unless off
    if wire_method(run.get("compression")) == "decentralized":
        # one message to each distinct ring neighbour (one at N=2, two beyond), one after
        # the other; the measured bytes per step are that message times the neighbours
        degree = 1 if N == 2 else 2
        comm = cm.neighbor_exchange(float(run.get("wire_bytes_per_step", 0.0)) / degree, net, degree=degree, N=N)
    else:
        aggregation = getattr(parse_compression(run.get("compression") or {"method": "none"}), "aggregation",
                              "allgather")
        comm = cm.step_time(plan, N, net, 0.0, compute=ZERO, fusion_bytes=fusion, buckets=buckets_from_run(run),
                            finite_check=check, aggregation=aggregation)
    local = exchange_every(run.get("compression"))
    comm_per_step = comm / local   # SBC: one exchange every local_steps steps
    total = compute_s + overhead + comm_per_step
    return {"predicted_step_time_s": total, "predicted_comm_s": comm_per_step,
            "predicted_overlap_s": max(compute_s, comm_per_step) + overhead,
            "predicted_compute_s": compute_s, "predicted_overhead_s": overhead}


def network(bandwidth_mbit: float | None, latency_ms: float, base_latency_s: float = 0.0,
            goodput_mbit: float | None = None, half_sum_s: float = 0.0) -> cm.Network:
    """alpha = added one-way latency + base; B = the shaped rate (or measured goodput); the
    measured fp16 sum (``half_sum_s``, 0: not priced)."""
    mbit = goodput_mbit if goodput_mbit else bandwidth_mbit
    bw = math.inf if not mbit else mbit * 1e6 / 8
    return cm.Network(alpha=latency_ms / 1e3 + base_latency_s, bandwidth=bw, half_sum_s=half_sum_s)
