"""PowerSGD: rank-r compression by one step of power iteration, with error feedback and warm
start (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019).

Algorithm 1 of the paper, for a layer's update matrix M (n x m) on each worker, with Q
(m x r) kept from the previous step (warm start):

    P  <- M Q
    P  <- ALL-REDUCE-MEAN(P)
    P^ <- ORTHOGONALIZE(P)                  # Gram-Schmidt on the columns
    Q  <- M^T P^
    Q  <- ALL-REDUCE-MEAN(Q)
    return P^ Q^T                           # the same rank-r matrix on every worker

Algorithm 2 (error feedback), on each worker: M <- g + e;  approx <- Algorithm 1 on M;
e <- M - approx;  the optimizer applies approx (with momentum).

Here, per layer (M = x viewed as (shape[0], -1), as torch's ``powerSGD_hook`` does):

  1. ``compress_bucket`` (a bucket's layers at once, in ``finish()``): layers that are vectors
     or too small for rank r to save bytes ((n + m) r * min_compression_rate >= n m), and every
     step before ``start_iter``, are sent whole (allreduce mean). Otherwise:
       Q  = the warm-start Q (the previous step's averaged Q), or a N(0, 1) draw from a
            seed every worker shares; orthogonalised;
       P  = M Q;  every layer's P in one ALL-REDUCE-SUM through ``self.comm`` (``blocking``);
       P^ = orthogonalise(P);  Q = M^T P^;
     the message is Q (the exchange allreduces the bucket's messages together, as torch's hook
     does its Qs); ``ctx`` holds P^, which the decoder needs.
  2. ``decompress_add``: out += alpha * P^ Q_avg^T; Q_avg becomes the next warm start.
  3. the exchange keeps e = M - P^ Q_avg^T (``error_feedback = "aggregate"``): the error of
     the aggregated approximation, as both the paper's code and torch's hook keep it.

Arithmetic follows torch's hook, so the two agree to float rounding on the same seed:
P is summed, not averaged (orthogonalisation removes the scale); Q is orthogonalised before
P = M Q at every step (the paper does not; in exact arithmetic P^ Q^T = P^ (P^)^T M depends
only on span(P), which that changes only by a basis, so the result is the same);
Gram-Schmidt for r <= 2, Householder QR above; Q's first draw takes one seed per step from
``numpy.random.RandomState(seed)`` and draws every new layer's Q from it in the order
layers are compressed. torch draws one seed per DDP bucket and its Qs grouped by shape, so
the draws coincide when the compressed layers share one bucket, have distinct shapes and
are compressed in that bucket's order. Where it differs: a zero column stays zero in
Gram-Schmidt (torch divides by a zero norm and gets NaN), and a warm Q column that became
zero restarts from a fresh draw (torch's would stay zero, or NaN, for good); before
``start_iter`` the residual keeps x - mean(x) (torch keeps no error then): that residual
sums to zero over workers and PowerSGD sees workers only through sums, so it changes
rounding only. The averaged Q decoded in a step becomes the warm start only when the step
commits (``commit``): a step that fails, or that a GradScaler skips because its gradients
overflowed, leaves the warm Q and the seed sequence as they were (``rollback``), as the
residuals are left.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..config.baselines import PowerSGDConfig
from ..core.wire import wide_norm
from .base import Compressor, Layer, Message, Wire


def orthogonalize(matrix: torch.Tensor, method: str = "auto", eps: float = 0.0) -> torch.Tensor:
    """Orthonormal columns, in place, for an (n, r) matrix with r <= n; returns it."""
    rank = matrix.shape[1]
    if method == "qr" or (method == "auto" and rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16)):
        q, _ = torch.linalg.qr(matrix)
        return matrix.copy_(q)
    return gram_schmidt(matrix, eps, read=matrix.device.type == "cpu")


def gram_schmidt(matrix: torch.Tensor, eps: float = 0.0, read: bool = False) -> torch.Tensor:
    """Gram-Schmidt in place. A zero column stays zero (instead of becoming NaN) unless ``eps``
    is given; fp32's sum of squares overflows past 1.8e19, so such a norm is taken in float64.
    ``read``: decide both cases from each column's norm read on the host (free on the CPU: a
    quarter of the calls), else with device-side selects; the values are the same."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        if read:
            norm = torch.linalg.vector_norm(col, dim=0, keepdim=True)
            value = float(norm)
            if math.isinf(value):
                norm = wide_norm(col, dim=0, keepdim=True)
            if eps:
                col /= norm + eps
            elif value > 0:   # else zero (stays zero) or NaN (stays NaN), as the select below
                col /= norm
        else:
            norm = wide_norm(col, dim=0, keepdim=True)
            if eps:
                col /= norm + eps
            else:
                col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
    return matrix


def matrix_shape(layer: Layer) -> tuple[int, int]:
    """(n, m): the layer as shape[0] rows, everything else flattened into columns."""
    n = layer.shape[0] if len(layer.shape) else 1
    return n, layer.numel // n


class PowerSGDCompressor(Compressor):
    collective = "allreduce"
    blocking = True                 # waits on the P allreduce inside compress
    error_feedback = "aggregate"    # e = M - P^ Q_avg^T, after the collective

    def __init__(self, config=None, comm=None):
        super().__init__(config if config is not None else PowerSGDConfig())
        self.comm = comm            # set by the exchange: the P allreduce happens inside compress
        self._q: dict = {}          # warm start: each layer's last averaged Q (of a committed step)
        self._next: dict = {}       # this step's averaged Qs, the warm start once it commits
        self._rng = np.random.RandomState(self.config.seed)
        self._draw = None           # (step, generator): this step's shared seed for first draws
        self._rng_before = None     # the seed sequence before this step's draw, for rollback

    def wire(self, layer: Layer) -> Wire:
        """Once compression has started: Q (m x r) by the bucket's allreduce, after P (n x r) by its
        own; the layer whole where it does not factorise."""
        if not self.factorizes(layer, self.config.start_iter):
            return Wire((torch.float32,), ("values",), (layer.numel,), fixed=True)
        (n, m), r = matrix_shape(layer), self.rank_for(layer)
        return Wire((torch.float32,), ("values",), (m * r,), fixed=True, extra=(("allreduce", 4 * n * r),))

    def rank_for(self, layer: Layer) -> int:
        n, m = matrix_shape(layer)
        return min(n, m, self.config.rank)

    def factorizes(self, layer: Layer, step: int) -> bool:
        """Whether this layer travels as factors at ``step`` (else whole, by allreduce mean)."""
        n, m = matrix_shape(layer)
        if step < self.config.start_iter or len(layer.shape) < 2 or min(n, m) < 2:
            return False
        return (n + m) * self.rank_for(layer) * self.config.min_compression_rate < n * m

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        return self.compress_bucket([x], [layer], step)[0]

    def compress_bucket(self, xs: list, layers: list, step: int, firsts: list | None = None) -> list:
        """A bucket's messages, its P allreduce batched as torch's hook batches it: 1. P_i = M_i Q_i
        for every factorised layer, back to back in one buffer, summed by one allreduce; 2. per
        layer P^ = orthogonalise(P), the message Q = M^T P^ (the exchange allreduces the bucket's
        Qs together), ``ctx`` P^; layers sent whole get a copy of x (never a view: the contract)."""
        factor = [i for i, layer in enumerate(layers) if self.factorizes(layer, step)]
        msgs = [None if i in factor else Message([x.clone()], ("values",)) for i, x in enumerate(xs)]
        if not factor:
            return msgs
        mats = [xs[i].view(*matrix_shape(layers[i])) for i in factor]
        ps = [m @ self._start_q(layers[i], step, m.shape[1], m.device) for i, m in zip(factor, mats)]      # 1.
        flat = torch.cat([p.reshape(-1) for p in ps])
        flat = self.comm.wait(self.comm.allreduce_async(flat, name=f"rsync.powersgd.{layers[factor[0]].name}.p",
                                                        average=False))
        for i, m, p in zip(factor, mats, flat.split([p.numel() for p in ps])):                            # 2.
            p = p.view(m.shape[0], -1)
            orthogonalize(p, self.config.orthogonalization, self.config.orthogonalization_epsilon)
            msgs[i] = Message([m.t() @ p], ("values",), ctx=p, extra_bytes={"values": p.numel() * p.element_size()})
        return msgs

    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0,
                       ctx=None) -> None:
        if not isinstance(ctx, torch.Tensor):
            if tensors[0].numel() != layer.numel:
                raise RuntimeError(f"PowerSGD's factor message of {layer.name!r} decodes only with its P "
                                   "(the message's ctx); this exchange passed none: it needs ctx support")
            out.add_(tensors[0].to(out), alpha=alpha)
            return
        n, m = matrix_shape(layer)
        q = tensors[0].to(out).view(m, -1)
        if self.config.warm_start:
            self._remember(layer.name, q)
        out.view(n, m).addmm_(ctx.to(out), q.t(), alpha=alpha)

    # -- Q ------------------------------------------------------------------------
    def _start_q(self, layer: Layer, step: int, m: int, device) -> torch.Tensor:
        r = self.rank_for(layer)
        q = self._q.get(layer.name) if self.config.warm_start else None
        if q is None or q.shape != (m, r):
            q = torch.randn(m, r, generator=self._generator(step)).to(device)
        else:
            q = q.clone()   # the warm start changes only when the step commits
            self._revive(q, layer, step)
        return orthogonalize(q, self.config.orthogonalization, self.config.orthogonalization_epsilon)

    def _revive(self, q: torch.Tensor, layer: Layer, step: int) -> None:
        """A warm Q column that is zero (the layer's whole gradient was zero, e.g. a branch not
        taken) would stay zero for good: P = M Q, Q = M^T P^. Such columns restart from a
        draw seeded by (seed, step, layer), the same on every worker since Q_avg is; columns that
        are not zero are left bit for bit. On an accelerator there is no host read (the draw is
        made every step); on the CPU, where reading is free, only when a column is zero."""
        alive = torch.linalg.vector_norm(q, dim=0, keepdim=True) > 0
        if q.device.type == "cpu" and bool(alive.all()):
            return
        seed = (self.config.seed * 1_000_003 + step) * 1_000_003 + layer.index
        fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed % (2 ** 61 - 1))).to(q.device)
        q.copy_(torch.where(alive, q, fresh))

    def _generator(self, step: int) -> torch.Generator:
        """One seed per step for every Q drawn in it, the same on every worker (torch's hook
        draws one per bucket)."""
        if self._draw is None or self._draw[0] != step:
            if self._rng_before is None:
                self._rng_before = self._rng.get_state()
            self._draw = (step, torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000))))
        return self._draw[1]

    def _remember(self, name: str, q: torch.Tensor) -> None:
        self._next[name] = q.clone()   # q is the collective's buffer, reused next step

    def commit(self) -> None:
        self._q.update(self._next)
        self._next, self._rng_before = {}, None

    def rollback(self) -> None:
        self._next = {}
        if self._rng_before is not None:   # the retried step draws what this one drew
            self._rng.set_state(self._rng_before)
            self._draw = self._rng_before = None

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"q": {k: v.detach().clone() for k, v in self._q.items()}, "rng": self._rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._q = {k: v.detach().clone() for k, v in state.get("q", {}).items()}
        if "rng" in state:
            self._rng.set_state(state["rng"])
        self._draw, self._next, self._rng_before = None, {}, None
