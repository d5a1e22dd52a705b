"""Which rank owns which position of a layer in a sparse reduce-scatter (``reduce_scatter.py``).

**Regions: a fixed permutation, then equal ranges.** Position p of an n-element layer belongs
to owner ``floor(((a * p) mod n) * N / n)``, with a near n times the golden ratio's fraction and
coprime with n (Fibonacci hashing, as ZEN hashes positions: Wang et al., OSDI 2025). The map
p -> (a * p) mod n is a bijection, so every region has ceil(n/N) or floor(n/N) positions, and it
scatters what clusters (a row of an FC layer, a band of an embedding) over all owners, where
ranges of positions would send a cluster to one owner. It depends on n and N only: no state,
nothing to rebalance or checkpoint, and every rank computes the same regions.

**Shards**: FSDP's contiguous shards, where a rank owns what its optimizer updates.

Both give each position's place in its owner's region (``local``) and back (``position``):
coded positions travel as places, whose density in the region is the layer's whatever N.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class Regions:
    """The owners of one n-element layer's positions among ``size`` ranks."""
    numel: int
    size: int
    multiplier: int

    @classmethod
    def of(cls, numel: int, size: int) -> "Regions":
        a = max(1, round(numel * _GOLDEN))
        while math.gcd(a, numel) != 1:
            a += 1
        return cls(numel, size, a % max(numel, 1))

    def owners(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 owner of every position (int64, in [0, numel))."""
        q = positions.to(torch.int64) * self.multiplier % self.numel
        return q * self.size // self.numel

    def sizes(self) -> list:
        """Positions each owner holds: ceil((o+1) n / N) - ceil(o n / N)."""
        n, N = self.numel, self.size
        return [-(-(o + 1) * n // N) + (-o * n // N) for o in range(N)]

    def local(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's place in its owner's region, [0, sizes()[owner]): what coded positions
        carry, so an owner's share keeps the layer's density whatever N (int64)."""
        q = positions.to(torch.int64) * self.multiplier % self.numel
        starts = torch.tensor([-(-o * self.numel // self.size) for o in range(self.size)], device=q.device)
        return q - starts[q * self.size // self.numel]

    def position(self, local: torch.Tensor, owner: int) -> torch.Tensor:
        """The inverse of :meth:`local` for ``owner``'s region (int64)."""
        start = -(-owner * self.numel // self.size)
        return (local.to(torch.int64) + start) * pow(self.multiplier, -1, max(self.numel, 1)) % max(self.numel, 1)


@dataclass(frozen=True)
class Shards:
    """The owners of one layer cut into ``size`` contiguous shards of ceil(n/size) positions
    (FSDP's dim-0 sharding of a padded parameter: rank o updates positions [o*s, (o+1)*s))."""
    numel: int
    size: int

    @property
    def shard(self) -> int:
        return max(1, -(-self.numel // self.size))

    def owners(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 owner of every position (int64, in [0, numel))."""
        return positions.to(torch.int64) // self.shard

    def sizes(self) -> list:
        """Positions each owner holds (the last shards may be short or empty)."""
        return [max(0, min(self.shard, self.numel - o * self.shard)) for o in range(self.size)]

    def local(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's place in its owner's shard (int64)."""
        return positions.to(torch.int64) % self.shard

    def position(self, local: torch.Tensor, owner: int) -> torch.Tensor:
        """The inverse of :meth:`local` for ``owner``'s shard (int64)."""
        return local.to(torch.int64) + owner * self.shard
