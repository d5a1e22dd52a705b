"""Alpha-beta communication cost model of the collectives (Hockney's model; Thakur et al., IJHPCA 2005).

Framework-neutral, pure Python (``probe_network`` imports torch on demand).
Sending m bytes costs ``alpha + m/B`` (alpha: seconds of latency per message,
B: bytes/s). Assumes a homogeneous, full-duplex, contention-free network,
no Horovod negotiation cycle (fold it into alpha), and no reduction arithmetic beyond what an
fp32 allreduce does at its bytes (``Network.half_sum_s`` prices what an fp16 one adds).
Every collective takes 0 s for N = 1; sizes are bytes per worker per step.

Why per-layer decisions: a ring allgather of m bytes per worker moves (N-1)*m bytes
into each worker, growing with N, while a ring allreduce of M bytes moves about 2*M
whatever N. A sparse reduce-scatter (``reduce_scatter_time``: an alltoall to the
positions' owners, then an allgather of their re-selection of k/N each) moves about
2*(N-1)/N of the message into each worker, flat in N, for one more collective round.
With k = D*n selected elements of b bytes (dense: 4), sparse allgather beats dense
allreduce on bandwidth only while ``N * D * (b/4) < 2`` (``crossover_workers``); for
64-bit pairs, N*D < 1. IWP escapes this: its values go through allreduce (constant in
N) plus a log2(N) index broadcast.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..core import layout
from .paper_models import PAPER_MODELS  # noqa: F401 (the projection's models, re-exported)

PHI = (1.0 + math.sqrt(5.0)) / 2.0  # golden ratio (Golomb parameter choice)
PAIR_HEADER_BYTES = 8  # per layer and worker: element count + layer id
FUSION_BYTES = 64 * 1024 * 1024  # Horovod's default HOROVOD_FUSION_THRESHOLD


@dataclass
class Network:
    """alpha: seconds of latency per message; bandwidth: bytes per second per link; half_sum_s:
    seconds per fp16 element that an allreduce's sum costs beyond an fp32 allreduce of the same
    bytes (``probe_half_sum``). Horovod sums fp16 on a CPU one element at a time through float
    conversions, tens of ns each: on a fast link that, not the halved bytes, sets fp16's time.
    0 where not measured (NCCL sums fp16 on the GPU at about fp32's cost)."""
    alpha: float
    bandwidth: float
    half_sum_s: float = 0.0

    @classmethod
    def from_config(cls, latency_s: float = 25e-6, bandwidth_gbit: float = 10.0) -> "Network":
        """Build from a latency in seconds and a bandwidth in Gbit/s (1e9 bits/s)."""
        return cls(alpha=float(latency_s), bandwidth=float(bandwidth_gbit) * 1e9 / 8.0)

    def send(self, m: float) -> float:
        """Time of one point-to-point message of m bytes."""
        return self.alpha + m / self.bandwidth


def _log2ceil(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def ring_allreduce(N: int, M: float, net: Network) -> float:
    """Ring allreduce (reduce-scatter + allgather): ``2(N-1)*alpha + 2(N-1)/N * M/B``."""
    return 0.0 if N <= 1 else 2 * (N - 1) * net.alpha + 2.0 * (N - 1) / N * M / net.bandwidth


def half_sum(N: int, n: float, net: Network) -> float:
    """What an fp16 ring allreduce of n elements adds to ``ring_allreduce`` of its bytes: each rank
    sums (N-1)/N of the elements (its reduce-scatter), ``(N-1)/N * n * half_sum_s``."""
    return 0.0 if N <= 1 else (N - 1) / N * n * net.half_sum_s


def ride_cap(net: Network) -> float:
    """``policy.dense_in_gather_bytes: auto``: dense bytes that may ride in an allgather, alpha x B.
    Riding b bytes adds N-1 copies received, ``(N-1) * b / B``, and saves a ring allreduce,
    ``2(N-1) * alpha`` and more; at b <= alpha x B the cost is at most half that latency, at any N."""
    return net.alpha * net.bandwidth


def ride_time(N: int, nbytes: float, net: Network) -> float:
    """What ``nbytes`` of dense layers add to the allgather they ride in: N-1 copies, no round."""
    return 0.0 if N <= 1 else (N - 1) * nbytes / net.bandwidth


def layers_half_sum(N: int, layers, net: Network) -> float:
    """``half_sum`` of the fp16 dense layers among ``layers`` ((n, density, method))."""
    return half_sum(N, sum(n for n, _, m in layers if canonical(m) == "dense_fp16"), net)


def tree_allreduce(N: int, M: float, net: Network) -> float:
    """Binary-tree reduce then broadcast, whole message per hop:
    ``2*ceil(log2 N)*(alpha + M/B)`` (ceil: a tree over N ranks has that depth;
    equals ``2*log2(N)*(alpha + M/B)`` for powers of two). Latency-optimal,
    bandwidth-poor: it wins over the ring only for small M or large N."""
    return 0.0 if N <= 1 else 2 * _log2ceil(N) * net.send(M)


def ring_allgather(N: int, m: float, net: Network) -> float:
    """Ring allgather of m bytes per worker: ``(N-1)*alpha + (N-1)*m/B``.
    Every worker receives the (N-1) other pieces: volume grows linearly with N."""
    return 0.0 if N <= 1 else (N - 1) * (net.alpha + m / net.bandwidth)


def recursive_doubling_allgather(N: int, m: float, net: Network) -> float:
    """Recursive doubling: ``ceil(log2 N)*alpha + (N-1)*m/B``. Fewer messages than
    the ring, same volume (ceil: non-powers of two need one extra round)."""
    return 0.0 if N <= 1 else _log2ceil(N) * net.alpha + (N - 1) * m / net.bandwidth


def tree_broadcast(N: int, m: float, net: Network) -> float:
    """Binomial-tree broadcast of m bytes from one root: ``ceil(log2 N)*(alpha + m/B)``."""
    return 0.0 if N <= 1 else _log2ceil(N) * net.send(m)


def neighbor_exchange(m: float, net: Network, degree: int = 2, N: int = 2) -> float:
    """Decentralized exchange with ``degree`` neighbours (ring: 2), messages sent
    one after another: ``degree*(alpha + m/B)``. Independent of N (N = 1: 0)."""
    return 0.0 if N <= 1 else degree * net.send(m)


def alltoall(N: int, m: float, net: Network) -> float:
    """Pairwise alltoall of m bytes per worker spread evenly over the N ranks (its own share
    stays): ``(N-1)*alpha + (N-1)/N*m/B``. Each worker sends and receives (N-1)/N of m."""
    return 0.0 if N <= 1 else (N - 1) * net.alpha + (N - 1) / N * m / net.bandwidth


def crossover_workers(density: float, bytes_per_element: float) -> float:
    """Bandwidth-only N above which a sparse ring allgather of ``D*n`` elements
    of ``b`` bytes costs more than a dense fp32 ring allreduce of n elements:
    ``(N-1)*D*n*b = 2(N-1)/N*4n``  =>  ``N = 8/(D*b)``, i.e. ``N*D*(b/4) = 2``."""
    return 8.0 / (density * bytes_per_element)


def num_selected(n: int, density: float) -> int:
    """k = ceil(D*n), at least 1 for a non-empty layer, at most n: what the exchange sends."""
    return layout.k_of(n, density)


def dense_bytes(n: int, fp16: bool = False) -> int:
    """Dense gradient: 4n bytes (fp32) or 2n bytes (fp16)."""
    return (2 if fp16 else 4) * n


def sparse_pair_bytes(n: int, density: float, fp16: bool = False) -> int:
    """(int32 index, value) pairs: ``k*(4 + 4|2) + 8`` header bytes."""
    return num_selected(n, density) * (4 + (2 if fp16 else 4)) + PAIR_HEADER_BYTES


def sign_mean_bytes(n: int, density: float) -> int:
    """Sign-mean quantised residual: 4 bytes per int32 index + 4 bytes (the mean)."""
    return 4 * num_selected(n, density) + 4


def golomb_bits_per_position(p: float) -> float:
    """Expected bits per position of a Golomb-Rice code for gaps of a Bernoulli(p)
    mask (SBC): ``b* + 1/(1-(1-p)^(2^b*))`` with
    ``b* = 1 + floor(log2(ln(phi-1)/ln(1-p)))``. Approx. 8.11 at p=0.01, 11.49 at 0.001."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    b = max(0, 1 + math.floor(math.log2(math.log(PHI - 1.0) / math.log1p(-p))))
    return b + 1.0 / (1.0 - (1.0 - p) ** (2 ** b))


def golomb_bytes(n: int, density: float) -> int:
    """Golomb-coded positions plus one fp32 mean (SBC): ``ceil(k*bits/8) + 4``."""
    k = num_selected(n, density)
    p = min(max(k / n, 1e-12), 1 - 1e-12) if n else 0.5
    return math.ceil(k * golomb_bits_per_position(p) / 8.0) + 4


def coded_bytes(k: int, n: int, method: str) -> float:
    """Bytes of k entries among n positions in ``method``'s coding (``ENTRY_CODING``), without
    the count: Golomb-coded or int32 positions, the values, the per-layer scale or mean."""
    golomb, value, per_layer = ENTRY_CODING[method]
    if not k:
        return per_layer
    p = min(max(k / n, 1e-12), 1 - 1e-12)
    positions = math.ceil(k * golomb_bits_per_position(p) / 8.0) + 4 if golomb else 4 * k   # 4: the code's bytes
    return positions + k * value + per_layer


def iwp_bytes(n: int, density: float) -> tuple[int, int]:
    """IWP: (bytes of int32 indices broadcast once, bytes of fp32 values allreduced)."""
    return 4 * num_selected(n, density), 4 * num_selected(n, density)


def quantized_bytes(n: int, bits: int = 8) -> int:
    """Min-max quantised full tensor (decentralized): ``ceil(n*bits/8)`` + fp32 min, max."""
    return math.ceil(n * bits / 8) + 8


# The message formats the model prices where no compressor is at hand (the scaling projection of
# paper-scale models, the network benchmark's predictions): what a method's compressor sends is
# named by ``message_format`` from its ``wire``; the exchange's own decisions price the wire itself.
METHODS = ("dense", "dense_fp16", "pairs", "pairs_fp16", "pairs_int8", "sign_mean", "golomb", "golomb_pairs",
           "golomb_pairs_fp16", "golomb_pairs_int8", "iwp", "decentralized")
# per entry and layer: (Golomb-coded positions, bytes of a value, bytes per layer besides the count:
# int8's scale or sign-mean's mean). "golomb" is SBC's and RedSync's sign-mean with coded positions.
ENTRY_CODING = {"pairs": (False, 4, 0), "pairs_fp16": (False, 2, 0), "pairs_int8": (False, 1, 4),
                "sign_mean": (False, 0, 4), "golomb": (True, 0, 4), "golomb_pairs": (True, 4, 0),
                "golomb_pairs_fp16": (True, 2, 0), "golomb_pairs_int8": (True, 1, 4)}


def canonical(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown message format {method!r}; one of {METHODS}")
    return method


def message_format(wire, collective: str) -> str:
    """The format of ``METHODS`` a compressor's ``wire`` (one layer's message) and ``collective`` have."""
    if any(kind == "broadcast" for kind, _ in wire.extra):
        return "iwp"
    if collective == "allreduce" and tuple(wire.kinds) == ("values",):
        return "dense_fp16" if "float16" in str(wire.dtypes[0]) else "dense"
    return scatter_format(wire)


def message_bytes(n: int, density: float, method: str) -> float:
    """Bytes per worker per step for one layer (IWP: indices + values)."""
    m = canonical(method)
    if m.startswith("dense"):
        return dense_bytes(n, m == "dense_fp16")
    if m in ("pairs", "pairs_fp16"):
        return sparse_pair_bytes(n, density, m == "pairs_fp16")
    if m in ENTRY_CODING and m not in ("sign_mean", "golomb"):
        return coded_bytes(num_selected(n, density), n, m) + PAIR_HEADER_BYTES
    return {"sign_mean": sign_mean_bytes, "golomb": golomb_bytes, "decentralized":
            lambda n, d: quantized_bytes(n), "iwp": lambda n, d: sum(iwp_bytes(n, d)),
            }[m](n, density)


@dataclass
class ComputeModel:
    """Linear ``c0 + c1*x`` estimates of the extra work compression adds, used
    when nothing was measured. Defaults are rough CPU numbers, not measurements:
    threshold-binary-search selection ~0.5 ns per element (a few counting passes
    over memory) + 10 us fixed; IWP's importance |r|/(|w|+eps) adds ~0.5 ns per
    element; decompression is a scatter-add of the N*k gathered elements at
    ~2 ns each + 5 us (IWP scatters only its k reduced values); 8-bit min-max
    quantisation ~1 ns per element + 5 us. Override for GPUs (far cheaper per
    element, larger fixed launch cost)."""
    select_c0: float = 10e-6  # s per call
    select_c1: float = 0.5e-9  # s per element of the layer
    importance_c1: float = 0.5e-9  # IWP only, s per element
    decompress_c0: float = 5e-6  # s per call
    decompress_c1: float = 2e-9  # s per received element (N*k; IWP: k)
    quantize_c0: float = 5e-6  # decentralized only
    quantize_c1: float = 1e-9

    def select(self, n: int, method: str = "sign_mean") -> float:
        m = canonical(method)
        if m.startswith("dense"):
            return 0.0
        if m == "decentralized":
            return self.quantize_c0 + self.quantize_c1 * n
        return self.select_c0 + (self.select_c1 + (self.importance_c1 if m == "iwp" else 0)) * n

    def decompress(self, n: int, density: float, N: int, method: str = "sign_mean",
                   aggregation: str = "allgather") -> float:
        m = canonical(method)
        if m.startswith("dense"):
            return 0.0
        if m == "decentralized":  # dequantise the two neighbours' messages
            return self.quantize_c0 + self.quantize_c1 * 2 * n
        k = num_selected(n, density)
        if aggregation == "sparse_reduce_scatter" and m in REDUCE_SCATTER_METHODS:
            # the owner sums about k received entries, every rank decodes about k kept ones and
            # looks up its own k: three passes over k elements, two calls
            return 2 * self.decompress_c0 + self.decompress_c1 * 3 * k
        return self.decompress_c0 + self.decompress_c1 * (k if m == "iwp" else N * k)


@dataclass
class LayerCost:
    """Predicted seconds of one layer per step; ``total_s`` = select + comm + decompress."""
    method: str
    n: int
    k: int
    bytes_per_worker: float
    select_s: float
    comm_s: float
    decompress_s: float
    dense_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.select_s + self.comm_s + self.decompress_s


def comm_time(n: int, density: float, N: int, net: Network, method: str,
              allgather: str = "ring", aggregation: str = "allgather") -> float:
    """Wire time of one layer: dense -> ring allreduce of 4n (2n) bytes; sparse
    -> allgather (``ring`` or ``doubling``) of the per-worker message, or with
    ``aggregation="sparse_reduce_scatter"`` an alltoall and an allgather of the owners'
    re-selection (``reduce_scatter_time``); IWP ->
    tree broadcast of 4k index bytes + ring allreduce of 4k value bytes;
    decentralized -> ring neighbour exchange of the 8-bit quantised tensor."""
    m = canonical(method)
    if N > 1 and aggregation == "sparse_reduce_scatter" and m in REDUCE_SCATTER_METHODS:
        return reduce_scatter_time([(n, density, m)], N, net, allgather)
    if N <= 1 or m.startswith("dense"):
        return ring_allreduce(N, message_bytes(n, density, m), net) + (half_sum(N, n, net) if m == "dense_fp16" else 0)
    if m == "iwp":  # indices once from the leader, then the values reduce
        return tree_broadcast(N, 4 * num_selected(n, density), net) + ring_allreduce(
            N, 4 * num_selected(n, density), net)
    if m == "decentralized":
        return neighbor_exchange(message_bytes(n, density, m), net, N=N)
    gather = ring_allgather if allgather == "ring" else recursive_doubling_allgather
    return gather(N, message_bytes(n, density, m), net)


def predict_layer(n: int, density: float, N: int, net: Network, method: str = "sign_mean",
                  select_time_s: float | None = None, decompress_time_s: float | None = None,
                  compute: ComputeModel | None = None, allgather: str = "ring",
                  aggregation: str = "allgather") -> LayerCost:
    """Predicted cost of one layer: dense allreduce, sparse (select + allgather +
    decompress) or IWP (select + broadcast + allreduce + scatter). Measured
    select/decompress times override the ``ComputeModel`` estimates. With N = 1
    nothing is communicated (and nothing is selected or decompressed)."""
    m = canonical(method)
    if aggregation == "auto":   # the cheaper path, as the exchange's auto picks per bucket
        both = [predict_layer(n, density, N, net, m, select_time_s, decompress_time_s, compute, allgather, a)
                for a in ("allgather", "sparse_reduce_scatter")]
        return min(both, key=lambda c: c.total_s)
    cm = compute or ComputeModel()
    dense = ring_allreduce(N, dense_bytes(n), net)
    sel = cm.select(n, m) if select_time_s is None else select_time_s
    dec = cm.decompress(n, density, N, m, aggregation) if decompress_time_s is None else decompress_time_s
    sel, dec = (0.0, 0.0) if N <= 1 else (sel, dec)
    k = n if m.startswith("dense") or m == "decentralized" else num_selected(n, density)
    return LayerCost(m, n, k, message_bytes(n, density, m), sel,
                     comm_time(n, density, N, net, m, allgather, aggregation), dec, dense)


def predict_message(n: int, wire, collective: str, N: int, net: Network, compute: ComputeModel | None = None,
                    allgather: str = "ring", aggregation: str = "allgather", shared: bool = False) -> LayerCost:
    """Predicted cost of one compressed layer of n elements whose message is ``wire`` (what its
    compressor says it sends: ``Compressor.wire``, duck-typed here) over ``collective``: select,
    the collective of the message (allgather of every rank's, or allreduce of the same-shaped ones;
    the sparse reduce-scatter where ``aggregation`` says so and the message is position-value pairs
    or sign-mean), the compressor's own collectives (``wire.extra``: a broadcast, an allreduce),
    and the decode of what arrived (every rank's k, or the one averaged message). ``shared``: the
    layer's marginal cost in a bucket whose collective it shares with other layers (the collective's
    latency is paid once for the bucket; the compressor's own collectives keep theirs)."""
    fmt = scatter_format(wire)
    k = int(wire.counts[0]) if wire.counts else 0
    if aggregation == "auto":   # the cheaper path, as the exchange's auto picks per bucket
        return min((predict_message(n, wire, collective, N, net, compute, allgather, a, shared)
                    for a in ("allgather", "sparse_reduce_scatter")), key=lambda c: c.total_s)
    cm = compute or ComputeModel()
    dense = ring_allreduce(N, dense_bytes(n), net)
    message = wire.nbytes(max(N, 1)) - sum(b / max(N, 1) if kind == "broadcast" else b for kind, b in wire.extra)
    if N <= 1:
        return LayerCost("wire", n, k, wire.nbytes(1), 0.0, 0.0, 0.0, dense)
    sel, dec = cm.select_c0 + cm.select_c1 * n, cm.decompress_c0 + cm.decompress_c1 * k
    bucket = Network(0.0, net.bandwidth) if shared else net
    if collective == "allreduce":
        comm = ring_allreduce(N, message, bucket)
    elif aggregation == "sparse_reduce_scatter" and fmt in REDUCE_SCATTER_METHODS:
        comm, dec = reduce_scatter_time([(n, k / n, fmt)], N, bucket, allgather), 2 * cm.decompress_c0 + 3 * k * \
            cm.decompress_c1
    else:
        gather = ring_allgather if allgather == "ring" else recursive_doubling_allgather
        comm, dec = gather(N, message, bucket), cm.decompress_c0 + cm.decompress_c1 * N * k
    for kind, nbytes in wire.extra:
        comm += tree_broadcast(N, nbytes, net) if kind == "broadcast" else ring_allreduce(N, nbytes, net)
    return LayerCost("wire", n, k, wire.nbytes(N), sel, comm, dec, dense)


def scatter_format(wire) -> str:
    """The message format of ``wire`` as the pricing knows it (``ENTRY_CODING``): position-value
    pairs (fp32, fp16 or int8 values) or positions with one mean (sign-mean), each with int32 or
    Golomb-coded positions; "golomb" for coded positions and one mean."""
    kinds, dtypes = tuple(wire.kinds), [str(d).replace("torch.", "") for d in wire.dtypes]
    golomb = "headers" in kinds
    if "scalars" in kinds:
        return "golomb" if golomb else "sign_mean"
    value = {"float16": "_fp16", "int8": "_int8"}.get(dtypes[kinds.index("values")], "") if "values" in kinds else ""
    return ("golomb_pairs" if golomb else "pairs") + value


def decide(n: int, density: float, N: int, net: Network, method: str = "sign_mean",
           fused: bool = False, **kw) -> bool:
    """Compress this layer? True iff the compressed path's predicted time is below
    the dense ring allreduce time (RedSync's per-layer rule). ``fused=True``
    compares with the layer's marginal cost inside a Horovod fusion buffer (the
    bandwidth term only; the latency is shared), so small layers (biases, norms)
    stay dense. Unfused, a tiny layer's allgather ((N-1) alphas) can beat its own
    ring allreduce (2(N-1) alphas): an artefact of not fusing."""
    c = predict_layer(n, density, N, net, method, **kw)
    return c.total_s < (fused_dense_share(n, N, net) if fused else c.dense_s)


def fused_dense_share(n: int, N: int, net: Network, fp16: bool = False) -> float:
    """A dense layer's marginal cost inside a Horovod fusion buffer: the ring allreduce's
    bandwidth term for its bytes (the buffer's latency is shared by all its layers); ``fp16``:
    it would travel as fp16 (``policy.dense_values: fp16``)."""
    return ring_allreduce(N, dense_bytes(n, fp16), Network(0.0, net.bandwidth)) + (half_sum(N, n, net) if fp16 else 0)


ALLGATHER_METHODS = tuple(ENTRY_CODING)
BUCKET_BYTES = 16 * 1024 * 1024  # the exchange's default compression.fusion_bytes
#: messages of (position, value) pairs or sign-mean that a sparse reduce-scatter can carry
REDUCE_SCATTER_METHODS = tuple(ENTRY_CODING)
AGGREGATIONS = ("allgather", "sparse_reduce_scatter")


def reduce_scatter_bytes(layers, N: int) -> tuple[float, float]:
    """Bytes of one bucket's sparse reduce-scatter (``exchange/reduce_scatter.py``) for
    ``layers`` ((n, density, method)): (what a worker puts into the alltoall, its own share
    included: per layer and owner an int32 count and k/N entries in the method's coding; what
    each owner puts into the allgather: ceil(k/N) int32 positions and values per layer, fp16 for
    fp16 messages, else fp32, or where positions or values are coded, a count and ceil(k/N)
    entries in that coding)."""
    alltoall_bytes, owner_bytes = 0.0, 0.0
    for n, d, m in layers:
        m = canonical(m)
        k, (golomb, value, per_layer) = num_selected(n, d), ENTRY_CODING[m]
        if golomb:   # each owner's k/N entries coded apart, as places among its n/N: at density k/n
            alltoall_bytes += N * (4 + coded_bytes(math.ceil(k / N), math.ceil(n / N), m))
        else:
            alltoall_bytes += k * (4 + value) + N * (4 + per_layer)
        c = math.ceil(k / N)
        if golomb or m == "pairs_int8":
            owner_bytes += 4 + coded_bytes(c, math.ceil(n / N), "golomb_pairs" if m == "golomb" else m)
        else:
            owner_bytes += c * (4 + (2 if m == "pairs_fp16" else 4))
    return alltoall_bytes, owner_bytes


def sharded_group_time(params, N: int, net: Network, compute: ComputeModel | None = None,
                       dense_bytes_per_element: int = 4) -> tuple[float, float]:
    """(compressed, dense) seconds of one FSDP group's reduce-scatter (``exchange/sharded.py``):
    ``params`` as (n, density, method), density None for a parameter that stays dense. Dense:
    FSDP's reduce-scatter of the flat group, (N-1) rounds of 1/N of it. Compressed: every
    compressed parameter's selection and the owner's sum of about k received entries, the
    alltoall of the selected entries (per parameter and owner an int32 count and its share in the
    message's coding, ``coded_bytes``) and, when some parameters stay dense, their own
    reduce-scatter. The own shard never travels, on either path."""
    if N <= 1:
        return 0.0, 0.0
    cm = compute or ComputeModel()
    total = sum(n for n, _, _ in params) * dense_bytes_per_element
    dense = alltoall(N, total, net)
    work, sparse, rest = 0.0, 0.0, 0
    for n, d, m in params:
        if d is None:
            rest += n * dense_bytes_per_element
            continue
        m = canonical(m)
        k = num_selected(n, d)
        work += cm.select(n, m) + cm.decompress_c0 + cm.decompress_c1 * k
        # per owner: an int32 count and its share of k among its shard's places, coded
        sparse += N * (4 + coded_bytes(-(-k // N), -(-n // N), m))
    compressed = work + alltoall(N, sparse, net) + (alltoall(N, rest, net) if rest else 0.0)
    return compressed, dense


def reduce_scatter_time(layers, N: int, net: Network, allgather: str = "ring") -> float:
    """Wire time of one bucket's sparse reduce-scatter: an alltoall of every worker's selected
    entries to their owners, then an allgather (``ring`` or ``doubling``) of every owner's
    re-selection. Each worker receives about (N-1)/N of k entries twice: flat in N, where an
    allgather's (N-1)*k grows, for one more collective round."""
    if N <= 1:
        return 0.0
    alltoall_bytes, owner_bytes = reduce_scatter_bytes(layers, N)
    gather = ring_allgather if allgather == "ring" else recursive_doubling_allgather
    return alltoall(N, alltoall_bytes, net) + gather(N, owner_bytes, net)


def bucket_time(layers, N: int, net: Network, aggregation: str = "allgather",
                compute: ComputeModel | None = None, allgather: str = "ring") -> float:
    """Seconds of one bucket of compressed layers ((n, density, method)): every layer's select
    and decompress, plus the bucket's collectives: one allgather of every message and an
    8-byte header per layer, or the sparse reduce-scatter; ``auto``: the cheaper of the two."""
    if aggregation == "auto":
        return min(bucket_time(layers, N, net, a, compute, allgather) for a in AGGREGATIONS)
    if N <= 1:
        return 0.0
    rs = aggregation == "sparse_reduce_scatter" and all(canonical(m) in REDUCE_SCATTER_METHODS
                                                         for _, _, m in layers)
    local = 0.0
    for n, d, m in layers:
        c = predict_layer(n, d, N, net, m, compute=compute, allgather=allgather,
                          aggregation="sparse_reduce_scatter" if rs else "allgather")
        local += c.select_s + c.decompress_s
    if rs:
        return local + reduce_scatter_time(layers, N, net, allgather)
    gather = ring_allgather if allgather == "ring" else recursive_doubling_allgather
    return local + gather(N, sum(message_bytes(*layer) + PAIR_HEADER_BYTES for layer in layers), net)


def choose_aggregation(layers, N: int, net: Network, compute: ComputeModel | None = None,
                       allgather: str = "ring") -> tuple[str, dict]:
    """``aggregation: auto`` for one bucket: (the faster path, {path: predicted seconds})."""
    times = {a: bucket_time(layers, N, net, a, compute, allgather) for a in AGGREGATIONS}
    eligible = all(canonical(m) in REDUCE_SCATTER_METHODS for _, _, m in layers)
    pick = "sparse_reduce_scatter" if eligible and times["sparse_reduce_scatter"] < times["allgather"] \
        else "allgather"
    return pick, times


def sparse_buckets(layers, bucket_bytes: float = BUCKET_BYTES) -> list[list[int]]:
    """The exchange's allgather buckets for ``layers`` ((n, density, method) in
    registration order): allgather-compressed layers in reverse order (the order
    backward produces them), a new bucket whenever the next layer would take the
    bucket past ``bucket_bytes`` of dense fp32 bytes. Indices into ``layers``."""
    return layout.buckets([n for n, _, _ in layers], bucket_bytes,
                   include=lambda i: canonical(layers[i][2]) in ALLGATHER_METHODS)


def step_time(layers, N: int, net: Network, compute_s: float, overlap: bool = False,
              compute: ComputeModel | None = None, allgather: str = "ring",
              fusion_bytes: float = 0, buckets=None, finite_check: bool = False,
              aggregation: str = "allgather") -> float:
    """One step: ``compute_s + comm``, or ``max(compute_s, comm)`` with ``overlap``
    (perfect overlap of backward and communication: a lower bound). ``comm`` sums
    the layers' ``predict_layer`` totals; ``layers``: iterable of (n, density,
    method). With ``fusion_bytes > 0`` the dense layers, in order, are packed
    greedily into buffers of at most that many bytes (Horovod tensor fusion,
    default 64 MiB), one ring allreduce per buffer.

    ``buckets``: lists of indices into ``layers`` that travel as one allgather
    (the exchange's buckets, ``sparse_buckets``; a bucket of dense layers, as the exchange
    records for dense methods and for a method's dense layers, is one ring allreduce of their
    bytes, fp16 ones with their sum): a bucket pays one collective's
    latency for the sum of its layers' messages plus an 8-byte header per layer
    (the header allgather is issued with the payload, so it shares the round);
    its layers still pay their own select and decompress (``bucket_time``; with
    ``aggregation`` sparse_reduce_scatter or auto, a bucket travels by the sparse
    reduce-scatter, or by the path ``choose_aggregation`` picks; the reduce-scatter buckets'
    second steps share one allgather round, as in the exchange). Layers in no bucket travel alone.
    Dense layers in a bucket of compressed ones ride in its allgather (``policy.dense_in_gather_bytes``):
    no round of their own, N-1 copies of their bytes (``ride_time``).
    ``finite_check``: the exchange's one-float agreement that every
    gradient was finite, fused by Horovod into the last dense buffer (or alone; with riders
    and no other dense layer, in their allgather)."""
    layers = list(layers)
    in_bucket = {i for b in (buckets or ()) for i in b}
    comm, buf = 0.0, 0
    for i, (n, d, m) in enumerate(layers):
        if i in in_bucket:
            continue
        if not canonical(m).startswith("dense"):
            comm += predict_layer(n, d, N, net, m, compute=compute, allgather=allgather,
                                  aggregation=aggregation).total_s
            continue
        nb = message_bytes(n, d, m)
        if buf and buf + nb > fusion_bytes:
            comm, buf = comm + ring_allreduce(N, buf, net), 0
        buf += nb
    rides = any(0 < len(_riders(layers, b)) < len(b) for b in buckets or ())
    if finite_check and not (rides and not buf):   # with riders and no other dense buffer it rides too
        buf += 4
    comm += ring_allreduce(N, buf, net) if buf else 0.0
    comm += layers_half_sum(N, [layer for i, layer in enumerate(layers) if i not in in_bucket], net)
    comm += _buckets_time(layers, buckets or (), N, net, compute, allgather, aggregation)
    return max(compute_s, comm) if overlap else compute_s + comm


def _riders(layers, bucket) -> list:
    """The dense layers among a bucket's: all of them for a dense bucket, else the riders
    (``policy.dense_in_gather_bytes``), which travel in the bucket's allgather."""
    return [i for i in bucket if canonical(layers[i][2]).startswith("dense")]


def _buckets_time(layers, buckets, N: int, net: Network, compute, allgather: str, aggregation: str) -> float:
    """``step_time``'s buckets: every bucket's collectives and its layers' select and decode (see there)."""
    comm, scattered = 0.0, 0
    for b in buckets:
        dense = _riders(layers, b)
        if len(dense) == len(b):   # a dense bucket is one fused allreduce
            shapes = [layers[i] for i in b]
            comm += ring_allreduce(N, sum(message_bytes(*s) for s in shapes), net) + layers_half_sum(N, shapes, net)
            continue
        riders = [layers[i] for i in dense]   # every rank sums all N rows of what rode
        comm += ride_time(N, sum(message_bytes(*s) for s in riders), net) + N * layers_half_sum(N, riders, net)
        shapes = [layers[i] for i in b if i not in dense]
        path = choose_aggregation(shapes, N, net, compute, allgather)[0] if aggregation == "auto" else aggregation
        comm += bucket_time(shapes, N, net, path, compute, allgather)
        scattered += path == "sparse_reduce_scatter" and all(canonical(m) in REDUCE_SCATTER_METHODS
                                                            for _, _, m in shapes)
    # the exchange sends every reduce-scatter bucket's kept entries in one allgather: one round
    gather = ring_allgather if allgather == "ring" else recursive_doubling_allgather
    return comm - max(scattered - 1, 0) * gather(N, 0.0, net)


def plan_layers(numels, method: str, density: float, N: int, net: Network,
                per_layer: bool = True, compute: ComputeModel | None = None,
                fused: bool = True, aggregation: str = "allgather"):
    """(n, density, method) per layer; with ``per_layer`` a layer that ``decide``
    rejects goes dense (never for the decentralized method: it replaces allreduce)."""
    m = canonical(method)
    skip = not per_layer or m in ("dense", "decentralized")
    return [(n, density, m if skip or decide(n, density, N, net, m, fused, compute=compute,
                                             aggregation=aggregation)
             else "dense") for n in numels]


def seat_riders(layers, buckets: list, cap: float) -> list:
    """The exchange's riders (``policy.dense_in_gather_bytes``) in ``step_time``'s terms: where the
    dense layers' bytes total at most ``cap``, they join the allgather bucket holding the lowest
    index (in backward, the one that starts last anyway). ``buckets``: lists of indices into
    ``layers`` ((n, density, method)), of compressed layers; the same lists, riders added."""
    dense = [i for i, (_, _, m) in enumerate(layers) if canonical(m).startswith("dense")]
    if not (buckets and dense) or sum(message_bytes(*layers[i]) for i in dense) > cap:
        return buckets
    host = min(range(len(buckets)), key=lambda j: min(buckets[j]))
    return [b + dense if j == host else b for j, b in enumerate(buckets)]


def project_speedup(layer_shapes, N_values, bandwidths, method: str, density: float,
                    compute_s, latency_s: float = 25e-6, overlap: bool = False,
                    per_layer: bool = True, compute: ComputeModel | None = None,
                    fusion_bytes: float = FUSION_BYTES, bucket_bytes: float = BUCKET_BYTES,
                    aggregation: str = "allgather", ride: bool = True) -> list[dict]:
    """Predicted speedup of ``method`` over dense fp32 ring allreduce.

    ``layer_shapes``: {model name: [numel per parameter tensor]}; ``bandwidths``
    in Gbit/s; ``compute_s``: seconds of compute per step, a float or {model: s}.
    Dense layers (the whole baseline, and layers the per-layer rule leaves dense)
    go through ``fusion_bytes`` fusion buffers; allgather-compressed layers travel
    in the exchange's buckets of ``bucket_bytes`` dense bytes (``sparse_buckets``;
    0: one allgather per layer), with the exchange's finite check and, with ``ride``, the dense
    layers riding in an allgather where ``dense_in_gather_bytes: auto`` seats them; ``aggregation``:
    allgather | sparse_reduce_scatter | auto (per bucket, the cheaper). One row per
    (model, bandwidth, N): model, N, bandwidth_gbit, method, density, dense_s,
    method_s, speedup, compressed_layers."""
    rows = []
    for model, numels in layer_shapes.items():
        cs = compute_s[model] if isinstance(compute_s, dict) else compute_s
        for bw in bandwidths:
            net = Network.from_config(latency_s=latency_s, bandwidth_gbit=bw)
            for N in N_values:
                plan = plan_layers(numels, method, density, N, net, per_layer, compute,
                                   fused=fusion_bytes > 0, aggregation=aggregation)
                kw = dict(overlap=overlap, compute=compute, fusion_bytes=fusion_bytes)
                dense = step_time([(n, 1.0, "dense") for n in numels], N, net, cs, **kw)
                buckets = sparse_buckets(plan, bucket_bytes) if bucket_bytes else None
                if buckets and ride and aggregation == "allgather":
                    buckets = seat_riders(plan, buckets, ride_cap(net))
                t = step_time(plan, N, net, cs, buckets=buckets, finite_check=True, aggregation=aggregation, **kw)
                rows.append(dict(model=model, N=N, bandwidth_gbit=bw, method=canonical(method),
                                 density=density, dense_s=dense, method_s=t, speedup=dense / t,
                                 compressed_layers=sum(p[2] != "dense" for p in plan)))
    return rows


def probe_network(comm, sizes=(8, 1 << 20), repeats: int = 5, warmup: int = 1,
                  reduce=max) -> Network:
    """Fit alpha and B from timed allreduces of ``sizes`` bytes (fp32 tensors).

    ``comm`` is duck-typed: ``allreduce_async(tensor, name, average)``,
    ``wait(handle)``, ``size``. Per size, ``reduce`` (default ``max``: the slowest,
    conservative; ``min`` resists a noisy shared host) of ``repeats`` timings after
    ``warmup`` untimed calls. Solving the ring formula
    ``t = 2(N-1)*alpha + 2(N-1)/N*M/B`` for the smallest and the largest size gives
    ``1/B = (t_l - t_s) / (2(N-1)/N*(M_l - M_s))`` and
    ``alpha = (t_s - 2(N-1)/N*M_s/B) / (2(N-1))``. The two timings are averaged
    over ranks by one more allreduce, so every rank fits the same Network
    (the caller may still broadcast rank 0's). N = 1 gives alpha 0, B = inf.
    """
    import torch  # on demand: the model itself is framework-neutral
    N = int(comm.size)
    if N <= 1:
        return Network(0.0, math.inf)
    lo, hi = (4 * max(1, s // 4) for s in (min(sizes), max(sizes)))  # whole fp32 elements
    bufs = [torch.zeros(s // 4, dtype=torch.float32) for s in (lo, hi)]
    (t_s, t_l), f = _agreed_times(comm, bufs, repeats, warmup, reduce, "costmodel.probe"), 2.0 * (N - 1) / N
    inv_b = max((t_l - t_s) / (f * (hi - lo)), 1e-15)
    alpha = max((t_s - f * lo * inv_b) / (2 * (N - 1)), 0.0)
    return Network(alpha=alpha, bandwidth=1.0 / inv_b)


def _timed_rounds(comm, bufs, repeats: int, warmup: int, name: str) -> list[list[float]]:
    """``repeats`` rounds after ``warmup`` untimed ones, each timing one allreduce of every tensor of
    ``bufs`` in turn: interleaved, so a change in the machine's load hits every tensor alike. Per
    round, the seconds of each tensor."""
    rounds = []
    for r in range(warmup + repeats):
        times = []
        for i, buf in enumerate(bufs):
            t0 = time.perf_counter()
            comm.wait(comm.allreduce_async(buf, name=f"{name}.{i}.{buf.numel()}.{r}", average=True))
            times.append(time.perf_counter() - t0)
        rounds.append(times)
    return rounds[warmup:]


def _agreed(comm, values: list[float], name: str) -> list[float]:
    """``values`` averaged over ranks by one allreduce, so every rank fits the same figures."""
    import torch
    agreed = comm.wait(comm.allreduce_async(torch.tensor(values, dtype=torch.float64), name=f"{name}.agree",
                                            average=True))
    return [float(x) for x in agreed]


def _agreed_times(comm, bufs, repeats: int, warmup: int, reduce, name: str) -> list[float]:
    """Per tensor of ``bufs``: ``reduce`` of its ``_timed_rounds``, agreed over ranks."""
    rounds = _timed_rounds(comm, bufs, repeats, warmup, name)
    return _agreed(comm, [reduce(ts) for ts in zip(*rounds)], name)


def probe_half_sum(comm, nbytes: int = 8 << 20, repeats: int = 5, warmup: int = 1, reduce=max) -> float:
    """``Network.half_sum_s`` measured on ``comm`` (duck-typed as for ``probe_network``): an
    allreduce of ``nbytes`` as fp32 (nbytes/4 elements) and as fp16 (nbytes/2 elements) move the
    same bytes over the same link, so what the fp16 one takes beyond the fp32 one is its sum:
    ``reduce`` over rounds of ``(t16 - t32) / ((N-1)/N * nbytes/2)``, at least 0. N = 1 gives 0
    (nothing is summed)."""
    import torch
    N = int(comm.size)
    if N <= 1:
        return 0.0
    n32 = max(1, nbytes // 4)
    # gradient-like values, not zeros: Gloo converts a zero by a shortcut, 3-4x faster than a normal float
    values = torch.randn(2 * n32, generator=torch.Generator().manual_seed(0))
    bufs = [values[:n32].clone(), values.half()]
    # one fp32 and one fp16 allreduce a round, the difference per round: the link's and the load's
    # drift between rounds cancels within a pair, where separate figures per dtype kept it
    extra = [t16 - t32 for t32, t16 in _timed_rounds(comm, bufs, repeats, warmup, "costmodel.probe_half")]
    (added,) = _agreed(comm, [reduce(extra)], "costmodel.probe_half")
    return max(added, 0.0) / ((N - 1) / N * 2 * n32)
