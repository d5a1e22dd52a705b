"""Who talks to whom, and with what weight: the mixing matrix W.

Decentralized SGD replaces the global average by x_i <- sum_j W_ij x_j. W must be
N x N, symmetric, non-negative and doubly stochastic (rows and columns sum to 1),
so the average of all models is preserved and repeated mixing converges to it;
the graph must also be connected (|second eigenvalue| < 1), or the models
never agree. Worker i's neighbours are the j != i with W_ij > 0.

- :func:`ring`: W_ii = W_i,i-1 = W_i,i+1 = 1/3 (Tang et al.'s setting). Small cases:
  N=1: W = [[1]]; N=2: both neighbours of a worker are the same rank, and we use
  W = [[1/2, 1/2], [1/2, 1/2]] (exact averaging in one exchange; the literal
  i+-1 formula would give [[1/3, 2/3], [2/3, 1/3]], available through
  :func:`from_matrix`); N=3: all-to-all 1/3.
- :func:`from_matrix`: any W as a list of lists (e.g. read from YAML), validated.
- :func:`from_config`: ``"ring"``, a list of lists, or a path to a YAML file
  holding a list of lists (or ``{mixing_matrix: [[...]]}``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Topology:
    """A validated mixing matrix. ``W`` is a float64 tensor of shape (N, N)."""

    def __init__(self, W: torch.Tensor, name: str = "custom"):
        self.W = W
        self.name = name

    @property
    def size(self) -> int:
        return self.W.shape[0]

    def neighbors(self, rank: int) -> list:
        """Distinct ranks j != rank with W[rank, j] > 0, ascending."""
        return [j for j in range(self.size) if j != rank and self.W[rank, j] > 0]

    def weights(self, rank: int) -> dict:
        """{j: W[rank, j]} over the rank itself and its neighbours, ascending by j (the
        summation order of the mixing step, fixed so results are reproducible)."""
        return {j: float(self.W[rank, j]) for j in range(self.size) if j == rank or self.W[rank, j] > 0}

    def degree(self, rank: int) -> int:
        return len(self.neighbors(rank))

    @property
    def second_eigenvalue(self) -> float:
        """max |lambda| over eigenvalues other than the 1 of the consensus vector (0 for N=1);
        1 - this is the spectral gap, which sets how fast mixing reaches consensus."""
        if self.size == 1:
            return 0.0
        ev = torch.linalg.eigvalsh(self.W).abs().sort(descending=True).values
        return float(ev[1])

    def __repr__(self) -> str:
        return f"Topology({self.name}, N={self.size}, |lambda2|={self.second_eigenvalue:.4f})"


def ring(n: int) -> Topology:
    """Ring mixing matrix for ``n`` workers (see the module docstring for n <= 3)."""
    if int(n) < 1:
        raise ValueError(f"ring size {n!r} must be >= 1")
    n = int(n)
    W = torch.zeros(n, n, dtype=torch.float64)
    if n == 1:
        W[0, 0] = 1.0
    elif n == 2:
        W.fill_(0.5)
    else:
        for i in range(n):
            for j in (i - 1, i, i + 1):
                W[i, j % n] = 1.0 / 3.0
    return Topology(W, name="ring")


def from_matrix(matrix: Any, size: int | None = None, tol: float = 1e-6, name: str = "custom") -> Topology:
    """Validate a mixing matrix given as a list of lists (or tensor). ``size``: the number of
    workers it must cover. Raises ValueError naming the first problem found."""
    fix = "a symmetric, non-negative N x N matrix whose rows sum to 1 (e.g. ring: W_ii = W_i,i+-1 = 1/3)"
    if isinstance(matrix, torch.Tensor):
        rows = matrix.tolist()
    else:
        rows = matrix
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
        raise ValueError(f"mixing matrix must be a non-empty list of lists (rows), got {type(matrix).__name__}; "
                         f"expected {fix}")
    n = len(rows)
    bad = [i for i, r in enumerate(rows) if len(r) != n]
    if bad:
        raise ValueError(f"mixing matrix is not square: it has {n} rows but row {bad[0]} has "
                         f"{len(rows[bad[0]])} entries; expected {fix}")
    if size is not None and n != int(size):
        raise ValueError(f"mixing matrix is {n} x {n} but there are {size} workers; give one row per worker")
    try:
        W = torch.tensor([[float(v) for v in r] for r in rows], dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"mixing matrix entries must be numbers: {exc}") from None
    if not torch.isfinite(W).all():
        raise ValueError("mixing matrix has NaN or infinite entries")
    neg = (W < -tol).nonzero()
    if len(neg):
        i, j = neg[0].tolist()
        raise ValueError(f"mixing matrix has a negative entry W[{i}][{j}] = {W[i, j].item():g}; weights must be >= 0")
    asym = ((W - W.T).abs() > tol).nonzero()
    if len(asym):
        i, j = asym[0].tolist()
        raise ValueError(f"mixing matrix is not symmetric: W[{i}][{j}] = {W[i, j].item():g} but "
                         f"W[{j}][{i}] = {W[j, i].item():g}; neighbours must weight each other equally")
    sums = W.sum(dim=1)
    off = ((sums - 1).abs() > tol).nonzero()
    if len(off):
        i = off[0].item()
        raise ValueError(f"mixing matrix is not doubly stochastic: row {i} sums to {sums[i].item():g}, not 1 "
                         "(with symmetry, rows summing to 1 make columns sum to 1 too)")
    W = W.clamp_min(0.0)
    W[W <= tol] = 0.0   # tiny entries would create neighbours that exchange for nothing
    _check_connected(W)
    topo = Topology(W, name=name)
    if n > 1 and topo.second_eigenvalue >= 1 - 1e-9:
        raise ValueError("mixing matrix has an eigenvalue -1 (e.g. a bipartite graph with zero diagonal): "
                         "repeated mixing oscillates instead of reaching consensus; give each worker a "
                         "positive self-weight W_ii")
    return topo


def _check_connected(W: torch.Tensor) -> None:
    n = W.shape[0]
    seen, todo = {0}, [0]
    while todo:
        i = todo.pop()
        for j in range(n):
            if W[i, j] > 0 and j not in seen:
                seen.add(j)
                todo.append(j)
    if len(seen) != n:
        missing = sorted(set(range(n)) - seen)
        raise ValueError(f"mixing matrix graph is not connected: workers {missing[:8]} never exchange (even "
                         "indirectly) with worker 0, so their models never agree")


def from_yaml(text_or_path: str | Path, size: int | None = None) -> Topology:
    """A YAML list of lists, or a mapping with key ``mixing_matrix``; a path or the YAML text."""
    import yaml
    p = Path(text_or_path)
    try:
        is_file = p.is_file()
    except OSError:
        is_file = False
    data = yaml.safe_load(p.read_text() if is_file else str(text_or_path))
    if isinstance(data, dict):
        if "mixing_matrix" not in data:
            raise ValueError(f"YAML mapping needs the key 'mixing_matrix' (a list of lists); got keys {sorted(data)}")
        data = data["mixing_matrix"]
    return from_matrix(data, size=size, name=str(text_or_path) if is_file else "yaml")


def from_config(value: Any, size: int) -> Topology:
    """``"ring"`` | list of lists | path to a YAML file -> Topology for ``size`` workers."""
    if isinstance(value, Topology):
        if value.size != size:
            raise ValueError(f"topology has {value.size} workers but there are {size}")
        return value
    if value is None or value == "ring":
        return ring(size)
    if isinstance(value, (list, tuple, torch.Tensor)):
        return from_matrix(value, size=size)
    if isinstance(value, (str, Path)):
        return from_yaml(value, size=size)
    raise ValueError(f"topology={value!r}: use 'ring', a list of lists, or a YAML file path")
