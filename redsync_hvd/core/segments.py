"""The layout of a bucket: several layers back to back in one flat buffer, each with its own k.

    seg = Segments(sizes=[4096, 10, 250000], ks=[41, 1, 250])
    seg.offsets   # (0, 4096, 4106, 254106): layer i is flat[offsets[i]:offsets[i] + sizes[i]]
    seg.kofs      # (0, 41, 42, 292): layer i's k selected positions are out[kofs[i]:kofs[i+1]]

    seg = Segments([4096, 10, 250000], [41, 1, 250], align=16)
    seg.offsets   # (0, 4096, 4112, 254112): every layer starts at a multiple of 16 elements
    seg.n         # 254112: the flat buffer's length, padding included (a multiple of 16)

With ``align=16`` a layer's start is a multiple of 16 elements (64 bytes of float32), so the
kernels load and store 128 bits at a time; the elements between a layer's end and the next
start are padding: no kernel reads them as data, none is ever selected, and the compensation
writes zeros there, so a flat buffer allocated zeroed keeps zeros in its padding.

Everything a kernel needs about the layout is built once per device (``tables``) and cached,
so a step copies nothing to the device and reads nothing back. The kernels walk the buffer
in *tiles*: runs of at most ``tile`` elements that never cross a layer boundary, so each
program knows its layer from one load and a layer's tiles are consecutive. Every layer has
at least one tile (an empty one for a layer of 0 elements), so per-layer work can be left
to the last of a layer's programs.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

_MAX_LAYER = 2 ** 31 - 1      # positions and counts are int32 inside the kernels
# the radix digits of a non-negative float32's 31 bits (8 + 12 + 11), shared by the torch
# reference (select/radix_ref.py) and the kernels (select/triton_select.py)
SHIFTS = (23, 11, 0)
BINS = (256, 4096, 2048)
NONFINITE_BIN = 0x7F800000 >> 23   # level-1 bin 255 (exponent all ones) holds NaN and Inf
VECTOR = 16                        # elements of the alignment that lets the kernels vectorise


def auto_tile(n: int) -> int:
    """Elements per program: at least 8192 so that a program's fixed costs (its histogram
    flush, its table loads) stay small against its elements; about n/512 above that (several
    waves on an H100's 132 SMs); at most 65536 so that a program stays a few microseconds long."""
    want = max(1, n // 512)
    return min(65536, max(8192, 1 << (want - 1).bit_length()))


@dataclass(frozen=True)
class Tables:
    """Device tensors describing a ``Segments`` layout (built once per device)."""
    offsets: torch.Tensor    # (L+1,) int64: layer starts in the flat buffer, then n
    kofs: torch.Tensor       # (L+1,) int64: layer starts in the selected positions
    ks: torch.Tensor         # (L,) int32
    tile_seg: torch.Tensor   # (T,) int32: the layer of each tile
    tile_lo: torch.Tensor    # (T,) int64: first element of each tile (flat)
    tile_hi: torch.Tensor    # (T,) int64: one past its last element
    seg_tile: torch.Tensor   # (L+1,) int32: first tile of each layer
    slot_seg: torch.Tensor   # (K,) int64: the layer of each selected position


_SERIALS = itertools.count()


class Segments:
    """Layer i occupies ``flat[offsets[i]:offsets[i] + sizes[i]]`` and sends exactly ``ks[i]`` of it.

    sizes: elements per layer (0 allowed); ks: 0 <= ks[i] <= sizes[i]. ``tile``: elements per
    kernel program, a power of two >= 16 (default: ``auto_tile(n)``). ``align``: each layer
    starts at a multiple of this many elements (1: back to back; 16: the kernels' vector width).
    """

    def __init__(self, sizes: Sequence[int], ks: Sequence[int], *, tile: int = 0, align: int = 1):
        sizes, ks = tuple(int(s) for s in sizes), tuple(int(k) for k in ks)
        if not sizes or len(sizes) != len(ks):
            raise ValueError("Segments: give one k per layer and at least one layer "
                             f"(got {len(sizes)} sizes and {len(ks)} ks)")
        bad = [i for i, (n, k) in enumerate(zip(sizes, ks)) if not (0 <= k <= n <= _MAX_LAYER)]
        if bad:
            i = bad[0]
            raise ValueError(f"Segments: layer {i} has size {sizes[i]} and k {ks[i]}; need "
                             f"0 <= k <= size <= 2**31-1 (clamp k to the layer size)")
        tile = int(tile) or auto_tile(sum(sizes))
        if tile < 16 or tile & (tile - 1):
            raise ValueError(f"Segments: tile={tile} must be a power of two >= 16")
        if align < 1 or align & (align - 1) or align > 16:
            raise ValueError(f"Segments: align={align} must be 1, 2, 4, 8 or 16 elements")
        self.sizes, self.ks, self.tile, self.align = sizes, ks, tile, int(align)
        self.offsets = _aligned_starts(sizes, self.align)
        self.kofs = _cumsum(ks)
        self.n, self.k_total = self.offsets[-1], self.kofs[-1]
        self.padded = self.n != sum(sizes)
        self.max_k = max(ks)
        self._tables: dict[str, Tables] = {}
        self._derived: dict[tuple, object] = {}
        # a name no other layout gets, even after this one is freed (id() may be reused): what a
        # captured step is keyed by
        self.serial = next(_SERIALS)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Segments({len(self)} layers, n={self.n}, K={self.k_total}, tile={self.tile}, align={self.align})"

    def views(self, flat: torch.Tensor) -> list:
        """Layer i's elements of a flat buffer of this layout, as views (no copy)."""
        return [flat[o:o + s] for o, s in zip(self.offsets, self.sizes)]

    def tables(self, device) -> Tables:
        """The layout's device tensors, built on the first call per device, then cached."""
        key = device_key(device)
        if key not in self._tables:
            self._tables[key] = self._build(torch.device(device))
        return self._tables[key]

    def derived(self, name: str, device, build: Callable[[], object]):
        """Something derived from the layout, built by ``build()`` on the first call per
        (name, device) and cached: per-mode k tables, the reference's per-element layer, the
        kernels' workspace."""
        key = (name, device_key(device))
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def compact(self) -> "Segments":
        """The same layers and ks back to back (no padding): the torch reference's layout."""
        if not self.padded:
            return self
        return self.derived("compact", "cpu", lambda: Segments(self.sizes, self.ks, tile=self.tile))

    def real(self, device) -> torch.Tensor:
        """(sum(sizes),) int64: the flat index of every element that is not padding, in order."""
        def build():
            idx = torch.cat([torch.arange(o, o + s, dtype=torch.int64) for o, s in zip(self.offsets, self.sizes)])
            return to_device(idx, device)
        return self.derived("real", device, build)

    def seg_of(self, device) -> torch.Tensor:
        """(sum(sizes),) int64: the layer of each element of the compact layout (the torch
        reference's table; the kernels find the layer once per tile and never build it)."""
        def build():
            layers = torch.arange(len(self), dtype=torch.int64)
            sizes = torch.tensor(self.sizes, dtype=torch.int64)
            # output_size: known here, so repeat_interleave reads nothing back
            return to_device(torch.repeat_interleave(layers, sizes, output_size=sum(self.sizes)), device)
        return self.derived("seg_of", device, build)

    def tile_bounds(self) -> tuple[list, list, list, list]:
        """(tile_seg, tile_lo, tile_hi, seg_tile) as host lists: each layer's real elements cut
        into runs of ``tile`` from its start; one empty tile for a layer of 0 elements."""
        tile_seg, tile_lo, tile_hi, seg_tile = [], [], [], [0]
        for i, (start, n) in enumerate(zip(self.offsets, self.sizes)):
            starts = range(start, start + n, self.tile) if n else range(start, start + 1)
            tile_seg += [i] * len(starts)
            tile_lo += list(starts)
            tile_hi += [min(s + self.tile, start + n) for s in starts]
            seg_tile.append(len(tile_seg))
        return tile_seg, tile_lo, tile_hi, seg_tile

    def _build(self, device: torch.device) -> Tables:
        tile_seg, tile_lo, tile_hi, seg_tile = self.tile_bounds()
        layers = torch.arange(len(self), dtype=torch.int64)
        ks = torch.tensor(self.ks, dtype=torch.int64)

        def dev(values, dtype):
            return to_device(torch.as_tensor(values, dtype=dtype), device)
        return Tables(
            offsets=dev(self.offsets, torch.int64), kofs=dev(self.kofs, torch.int64),
            ks=dev(self.ks, torch.int32), tile_seg=dev(tile_seg, torch.int32),
            tile_lo=dev(tile_lo, torch.int64), tile_hi=dev(tile_hi, torch.int64),
            seg_tile=dev(seg_tile, torch.int32),
            slot_seg=to_device(torch.repeat_interleave(layers, ks, output_size=self.k_total), device))


def device_key(device) -> str:
    """One name per device: "cuda" means the current CUDA device, so "cuda" and a tensor's
    "cuda:0" find the same cached tables and workspace (two copies would cost memory and a
    rebuild, with its host copies, inside a step)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on the device without a wait: from pinned memory, queued on the stream
    (a pageable copy would wait for the stream once, at the layout's first use)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _cumsum(values: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


def _aligned_starts(sizes: Sequence[int], align: int) -> tuple[int, ...]:
    """Each layer's start rounded up to a multiple of ``align``, then the padded total."""
    out = [0]
    for s in sizes:
        out.append(-(-(out[-1] + s) // align) * align)
    return tuple(out)
