"""CuPy kernels for selection on CUDA float32 tensors (the GPU twin of ``_native``).

On a GPU the passes themselves are cheap (16M fp32 = 64 MB, ~20 us at HBM speed); what
costs is the number of kernel launches and host syncs per selection. So:

* ``abs_stats``: one pass giving max|x|, sum|x| (float64 partials) and a non-finite flag,
  one sync for all three (torch needs |x| materialised, then two reductions).
* ``count_above``: one pass counting |x| > t_j for 15 thresholds at once (held in
  registers, warp-shuffle then shared-memory reduction), so four levels of the TBS tree
  cost one launch and one sync instead of four; no |x| or mask tensor is allocated.

The kernels run on torch's current stream and read torch memory in place
(``__cuda_array_interface__``), so no copy or stream sync is added. ``load()`` returns
None when CuPy or a GPU is missing (``load.error`` says why); selection then uses plain
torch ops, which give the same results (the torch reference of each pass is
``passes.py:TorchPasses``; of the histograms, ``reference.py``).
"""
from __future__ import annotations

import struct
from typing import Any, List, Optional

import torch

from .reference import BINS, above, histogram_threshold
from .registry import Loader, Unavailable

SLOTS = 15  # thresholds per count pass: 4 TBS levels (2**4 - 1 nodes)
_THREADS = 256

_SOURCE = r"""
#define SLOTS %(slots)d
extern "C" __global__ void abs_stats(const float* __restrict__ x, const long long n,
                                     unsigned long long* __restrict__ out) {
    // out[0]: bits of max|x| (non-negative floats order like their bit patterns),
    // out[1]: sum|x| as a double, out[2]: 1 when any element is NaN or Inf.
    float m = 0.f; double s = 0.0; int bad = 0;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float a = fabsf(x[i]);
        if (isfinite(a)) { m = fmaxf(m, a); s += a; } else { bad = 1; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
        s += __shfl_down_sync(0xffffffffu, s, o);
        bad |= __shfl_down_sync(0xffffffffu, bad, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax((unsigned int*)&out[0], __float_as_uint(m));
        atomicAdd((double*)&out[1], s);
        if (bad) atomicOr((unsigned int*)&out[2], 1u);
    }
}

extern "C" __global__ void count_above(const float* __restrict__ x, const long long n,
                                       unsigned long long* __restrict__ out, %(params)s) {
    // Thresholds come by value: no host-to-device copy before each pass.
    __shared__ unsigned long long block[SLOTS];
    const float t[SLOTS] = {%(names)s};
    unsigned int c[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) c[j] = 0u;
    if (threadIdx.x < SLOTS) block[threadIdx.x] = 0ull;
    __syncthreads();
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float a = fabsf(x[i]);
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) c[j] += (a > t[j]);
    }
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        unsigned int v = c[j];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if ((threadIdx.x & 31) == 0 && v) atomicAdd(&block[j], (unsigned long long)v);
    }
    __syncthreads();
    if (threadIdx.x < SLOTS && block[threadIdx.x]) atomicAdd(&out[threadIdx.x], block[threadIdx.x]);
}

// Radix-style threshold search on the bit patterns of |x| (non-negative floats order like
// their bits). Level 1 bins by the top 12 bits (exponent + 4 mantissa bits), level 2 bins
// the chosen level-1 bin by the next 12 bits: 2 x 4096 thresholds, one pass each, with
// the bin chosen on the device, so the host waits once for the threshold.
extern "C" __global__ void hist_hi(const float* __restrict__ x, const long long n,
                                   unsigned long long* __restrict__ hist, unsigned int* __restrict__ bad) {
    __shared__ unsigned int h[4096];
    for (int i = threadIdx.x; i < 4096; i += blockDim.x) h[i] = 0u;
    __syncthreads();
    int nb = 0;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int u = __float_as_uint(x[i]) & 0x7fffffffu;
        if (u >= 0x7f800000u) { nb = 1; continue; }
        atomicAdd(&h[u >> 19], 1u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 4096; i += blockDim.x)
        if (h[i]) atomicAdd(&hist[i], (unsigned long long)h[i]);
    if (nb) atomicOr(bad, 1u);
}

extern "C" __global__ void hist_lo(const float* __restrict__ x, const long long n,
                                   unsigned long long* __restrict__ hist, const long long* __restrict__ bin) {
    __shared__ unsigned int h[4096];
    for (int i = threadIdx.x; i < 4096; i += blockDim.x) h[i] = 0u;
    __syncthreads();
    const unsigned int b = (unsigned int)bin[0];
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int u = __float_as_uint(x[i]) & 0x7fffffffu;
        if ((u >> 19) == b) atomicAdd(&h[(u >> 7) & 4095u], 1u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 4096; i += blockDim.x)
        if (h[i]) atomicAdd(&hist[i], (unsigned long long)h[i]);
}
""" % {"slots": SLOTS, "params": ", ".join("const float t%d" % j for j in range(SLOTS)),
       "names": ", ".join("t%d" % j for j in range(SLOTS))}

def _compile() -> Any:
    """(cupy, abs_stats, count_above, hist_hi, hist_lo)."""
    if not torch.cuda.is_available():
        raise Unavailable("CUDA is not available")
    import cupy  # optional: pip install cupy-cuda12x (or the build matching your CUDA)
    mod = cupy.RawModule(code=_SOURCE)
    return (cupy, mod.get_function("abs_stats"), mod.get_function("count_above"),
            mod.get_function("hist_hi"), mod.get_function("hist_lo"))


load = Loader(_compile)   # None where CuPy or a GPU is missing, or CuPy cannot compile for it


def passes(flat: torch.Tensor, err: ValueError, scan=None) -> "CudaPasses":
    """The backend's form in the registry: passes over ``flat`` (a scan is the CPU's only)."""
    return CudaPasses(load(), flat.contiguous(), err)


_streams: dict = {}


def _stream(cupy: Any, ptr: int) -> Any:
    """CuPy's handle on torch's current stream (cached: one per stream)."""
    st = _streams.get(ptr)
    if st is None:
        st = _streams[ptr] = cupy.cuda.ExternalStream(ptr)
    return st


def _grid(n: int) -> int:
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, min((n + _THREADS - 1) // _THREADS, sms * 8))


class CudaPasses:
    """Fused passes over a contiguous 1-D CUDA float32 tensor; the interface of
    ``passes.py:TorchPasses`` (stats/count/select/sub), and ``histogram_search``."""

    levels = 4  # 15 thresholds per count pass

    def __init__(self, kernels: Any, flat: torch.Tensor, err: ValueError):
        self.k, self.x, self.err = kernels, flat, err
        self._a: Optional[torch.Tensor] = None

    def _view(self, t: torch.Tensor) -> Any:
        """A CuPy array over torch's memory: no copy and, unlike __cuda_array_interface__
        (which makes CuPy synchronise the producer stream), no sync."""
        cupy = self.k[0]
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, t.device.index)
        dtype = {torch.float32: cupy.float32, torch.int64: cupy.int64, torch.int32: cupy.int32}[t.dtype]
        return cupy.ndarray((t.numel(),), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def _launch(self, fn, out: torch.Tensor, *extra) -> None:
        cupy = self.k[0]
        args = (self._view(self.x), cupy.int64(self.x.numel()), self._view(out)) + extra
        with _stream(cupy, torch.cuda.current_stream().cuda_stream):
            fn((_grid(self.x.numel()),), (_THREADS,), args)

    def stats(self):
        out = torch.zeros(3, dtype=torch.int64, device=self.x.device)
        self._launch(self.k[1], out)
        mx_bits, sum_bits, bad = out.tolist()
        if bad:
            raise self.err
        mx = struct.unpack("<f", struct.pack("<I", mx_bits & 0xFFFFFFFF))[0]
        total = struct.unpack("<d", struct.pack("<q", sum_bits))[0]
        return mx, total / self.x.numel()

    def count(self, thr: List[float]) -> List[int]:
        cupy = self.k[0]
        res: List[int] = []
        for i in range(0, len(thr), SLOTS):
            chunk = thr[i:i + SLOTS]
            pad = chunk + [float("inf")] * (SLOTS - len(chunk))  # |x| > inf never counts
            out = torch.zeros(SLOTS, dtype=torch.int64, device=self.x.device)
            self._launch(self.k[2], out, *[cupy.float32(t) for t in pad])
            res += out.tolist()[:len(chunk)]
        return res

    def histogram_search(self, k: int):
        """(indices of |x| > t, t, their |x|) for the largest t, to 128 float ulps, with at
        least k elements above it; None when k reaches into the near-zero values (then the
        caller takes the exact route). Two histogram passes (the kernels ``hist_hi`` and
        ``hist_lo``; their torch reference: ``reference.py:torch_histograms``), the bins chosen on
        the device by ``reference.py:histogram_threshold``, two host waits in all."""
        dev = self.x.device
        bad = torch.zeros(1, dtype=torch.int32, device=dev)

        def first():
            h1 = torch.zeros(BINS, dtype=torch.int64, device=dev)
            self._launch(self.k[3], h1, self._view_u32(bad))
            return h1

        def second(b1):
            h2 = torch.zeros(BINS, dtype=torch.int64, device=dev)
            self._launch(self.k[4], h2, self._view(b1.reshape(1)))
            return h2
        edge, count = histogram_threshold(first, second, k, count=True)
        edge, count, nonfinite = torch.stack([edge, count, bad[0].to(torch.int64)]).tolist()
        if nonfinite:
            raise self.err
        if edge == 0 or count < k:
            return None
        t = struct.unpack("<f", struct.pack("<I", edge - 1))[0]   # |x| > t  <=>  bits(|x|) >= edge
        idx, c, vals = self.select(t, self.x.numel(), False, True)
        return idx, t, vals

    def _view_u32(self, t: torch.Tensor) -> Any:
        cupy = self.k[0]
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * 4, t, t.device.index)
        return cupy.ndarray((t.numel(),), dtype=cupy.uint32, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def select(self, thr: float, cap: int, check: bool, values: bool = False):
        if check:
            self.stats()  # raises on NaN/Inf
        if self._a is None:
            self._a = self.x.abs()
        return above(self._a, thr, cap, values)

    def sub(self, vals: torch.Tensor) -> "CudaPasses":
        return CudaPasses(self.k, vals.contiguous(), self.err)
