"""Decentralized (gossip) SGD with compressed model exchange (Tang et al., NeurIPS 2018).

Each worker i holds its own model x_i, mixes with its neighbours through the
topology's W and takes a local gradient step; there is no global reduction.
All methods work on a list of fp32 tensors (the model's parameters, updated in
place) and call ``step(params, grads, lr)`` once per iteration; every worker
calls it the same number of times (each step is one neighbour exchange).

- ``dpsgd``: x_i <- sum_j W_ij x_j - lr g_i, neighbour models sent in full fp32.
- ``naive``: the same with compressed models, x_i <- sum_j W_ij C(x_j) - lr g_i (j = i
  included, with the same C(x_i) its neighbours decode). The compression error
  enters the model at every step and never shrinks: this stalls or diverges
  (the failure mode the paper describes). Kept as the negative control.
- ``dcd`` (difference compression): every worker keeps replicas xhat_j of its
  neighbours' models (its own replica is x_i itself).
      x_half = sum_j W_ij xhat_j - lr g_i;  z = x_half - x_i;  q = C(z)
      x_i += decode(q);  send q;  each neighbour: xhat_i += decode(q)
  Sender and receivers add the *same decoded tensor* with the same float op, so
  replicas stay bit-identical to the true models. z shrinks as training
  converges, so a relative-error quantiser (min-max) suffices.
- ``ecd`` (extrapolation compression), t = 1, 2, ... (the step counter, as in the
  paper's Algorithm 2): every worker keeps estimates y_j of all
  models in its neighbourhood, its own included (y_i is NOT x_i).
      x_half = sum_j W_ij y_j;  x_new = x_half - lr g_i
      z = (1 - t/2) x_i + (t/2) x_new  (computed as x_i + (t/2)(x_new - x_i));  x_i = x_new
      send C(z); everyone holding y_i: y_i <- (1 - 2/t) y_i + (2/t) decode(C(z))
  (1 - 2/t) x_{t-1} + (2/t) z_t = x_t, so y_i = x_i + noise, and the noise is a
  weighted average of all past quantisation errors with variance ~ 4 sigma^2 / (3t):
  it needs a quantiser with bounded *absolute* error (the fixed grid), but z grows
  like t/2 times the model change, so watch the grid's ``clipped`` count.

DCD and ECD start with one full fp32 exchange of the models (``setup_bytes``) so
replicas start exact even if the models were not broadcast. The step's randomness
comes from a torch.Generator seeded with (seed, rank): runs are reproducible.
"""
from __future__ import annotations

import torch

from .exchange import header_bytes
from .quantizers import IdentityQuantizer, Quantizer, build_quantizer

METHODS = ("dpsgd", "naive", "dcd", "ecd")


class DecentralizedAlgorithm:
    """Base: neighbour bookkeeping, mixing, stats, evaluation helpers, state."""
    name = "base"
    needs_replicas = False

    def __init__(self, exchange, quantizer: Quantizer | None = None, seed: int = 0):
        self.ex = exchange
        self.q = quantizer if quantizer is not None else IdentityQuantizer()
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + exchange.rank)
        self.t = 0
        self.replicas: dict = {}          # rank -> list of tensors (neighbours; ECD: self too)
        self._ready = False               # replicas initialised (one full exchange)
        self.dense_bytes = 0              # what fp32 neighbour exchange would have sent

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _flat(params, grads) -> list:
        if len(grads) != len(params):
            raise ValueError(f"got {len(grads)} gradients for {len(params)} parameter tensors")
        out = []
        for p in params:
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"decentralized methods need contiguous fp32 parameters, got {p.dtype} "
                                 f"contiguous={p.is_contiguous()}")
            out.append(p.detach().view(-1))
        return out

    def _setup(self, xs: list) -> None:
        if self._ready or not self.needs_replicas:
            return
        got = self.ex.exchange([x.clone() for x in xs], kind="setup")
        self.replicas = {j: [w.clone() for w in wire] for j, wire in got.items()}
        self._ready = True

    def _mix(self, own: torch.Tensor, values: dict) -> torch.Tensor:
        """sum_j W_ij v_j in ascending j (a fixed order: reproducible); ``own`` stands for j == rank."""
        acc = None
        for j, w in self.ex.weights.items():
            v = own if j == self.ex.rank else values[j]
            acc = v * w if acc is None else acc.add_(v, alpha=w)
        return acc

    def _chunks(self, wire: list) -> list:
        n = self.q.n_wire
        return [wire[i:i + n] for i in range(0, len(wire), n)]

    def _count_dense(self, xs) -> None:
        """What D-PSGD's fp32 message (same header format) would have cost this step."""
        self.dense_bytes += (4 * sum(x.numel() for x in xs) + header_bytes(len(xs))) * len(self.ex.neighbors)

    # -- API -------------------------------------------------------------------------------
    def step(self, params, grads, lr: float) -> None:
        raise NotImplementedError

    def consensus_distance(self, params) -> float:
        """mean_i ||x_i - xbar|| over all workers (two allreduces; counted as eval bytes)."""
        flat = torch.cat([p.detach().reshape(-1) for p in params]).to(torch.float64)
        mean = self.ex.allreduce_sum(flat) / self.ex.size
        d = torch.linalg.vector_norm(flat - mean).reshape(1)
        return float(self.ex.allreduce_sum(d)[0]) / self.ex.size

    def average_model(self, params) -> list:
        """The average of all workers' models (allreduce; for evaluation), shaped like params."""
        flat = torch.cat([p.detach().reshape(-1) for p in params]).to(torch.float64)
        mean = (self.ex.allreduce_sum(flat) / self.ex.size).to(torch.float32)
        return [m.view_as(p) for m, p in zip(torch.split(mean, [p.numel() for p in params]), params)]

    def stats(self) -> dict:
        out = self.ex.summary()
        out.update(method=self.name, steps=self.t, dense_bytes=self.dense_bytes, quantizer=repr(self.q),
                   degree=len(self.ex.neighbors))
        sent = out.get("bytes_sent", 0)
        out["compression_ratio"] = self.dense_bytes / sent if sent else 1.0
        if hasattr(self.q, "clipped"):
            out["clipped"] = self.q.clipped
        return out

    def state_dict(self) -> dict:
        return {"method": self.name, "t": self.t, "generator": self.generator.get_state(),
                "replicas": {j: [r.clone() for r in reps] for j, reps in self.replicas.items()},
                "dense_bytes": self.dense_bytes}

    def load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.name:
            raise ValueError(f"state is for method {state.get('method')!r}, this is {self.name!r}")
        self.t = int(state["t"])
        self.generator.set_state(state["generator"])
        self.replicas = {int(j): [r.clone() for r in reps] for j, reps in state["replicas"].items()}
        self._ready = bool(self.replicas) or self.t > 0
        self.dense_bytes = int(state.get("dense_bytes", 0))


class NaiveCompressed(DecentralizedAlgorithm):
    """x_i <- sum_j W_ij decode(C(x_j)) - lr g_i. With IdentityQuantizer this is D-PSGD."""
    name = "naive"

    def step(self, params, grads, lr):
        xs = self._flat(params, grads)
        self.t += 1
        wire = []
        for x in xs:
            wire += self.q.encode(x, self.generator)
        got = self.ex.exchange(wire)
        got = {j: self._chunks(w) for j, w in got.items()}
        mine = self._chunks(wire)
        for k, (x, g) in enumerate(zip(xs, grads)):
            own = self.q.decode(mine[k], x.numel())
            dec = {j: self.q.decode(c[k], x.numel()) for j, c in got.items()}
            x.copy_(self._mix(own, dec).add_(g.reshape(-1), alpha=-lr))
        self._count_dense(xs)


class DPSGD(NaiveCompressed):
    """Uncompressed D-PSGD: full fp32 models to neighbours."""
    name = "dpsgd"

    def __init__(self, exchange, quantizer=None, seed: int = 0):
        super().__init__(exchange, IdentityQuantizer(), seed)


class DCD(DecentralizedAlgorithm):
    """Difference compression; see the module docstring."""
    name = "dcd"
    needs_replicas = True

    def step(self, params, grads, lr):
        xs = self._flat(params, grads)
        self._setup(xs)
        self.t += 1
        wire = []
        for k, (x, g) in enumerate(zip(xs, grads)):
            z = self._mix(x, {j: r[k] for j, r in self.replicas.items()}).add_(g.reshape(-1), alpha=-lr).sub_(x)
            w = self.q.encode(z, self.generator)
            x.add_(self.q.decode(w, x.numel()))     # exactly what the neighbours will add
            wire += w
        got = self.ex.exchange(wire)
        for j, w in got.items():
            for k, chunk in enumerate(self._chunks(w)):
                self.replicas[j][k].add_(self.q.decode(chunk, xs[k].numel()))
        self._count_dense(xs)


class ECD(DecentralizedAlgorithm):
    """Extrapolation compression; see the module docstring. ``replicas[rank]`` is y_i."""
    name = "ecd"
    needs_replicas = True

    def _setup(self, xs):
        if not self._ready:
            super()._setup(xs)
            self.replicas[self.ex.rank] = [x.clone() for x in xs]

    def step(self, params, grads, lr):
        xs = self._flat(params, grads)
        self._setup(xs)
        self.t += 1
        t = self.t
        wire = []
        for k, (x, g) in enumerate(zip(xs, grads)):
            y = {j: r[k] for j, r in self.replicas.items()}
            x_new = self._mix(y[self.ex.rank], y).add_(g.reshape(-1), alpha=-lr)
            z = x + (x_new - x) * (t / 2.0)
            wire += self.q.encode(z, self.generator)
            x.copy_(x_new)
        got = self.ex.exchange(wire)
        got[self.ex.rank] = wire
        for j, w in got.items():
            for k, chunk in enumerate(self._chunks(w)):
                self.replicas[j][k].mul_(1.0 - 2.0 / t).add_(self.q.decode(chunk, xs[k].numel()), alpha=2.0 / t)
        self._count_dense(xs)


ALGORITHMS = {"dpsgd": DPSGD, "naive": NaiveCompressed, "dcd": DCD, "ecd": ECD}


def build_algorithm(method: str, exchange=None, topology="ring", quantizer: str = "minmax", bits: int = 8,
                    step: float = 0.01, density: float = 0.1, unbiased: bool = True, seed: int = 0,
                    comm=None) -> DecentralizedAlgorithm:
    """One call from the config knobs: ``compression: {method: dcd|ecd|dpsgd|naive, bits, quantizer:
    minmax|grid|topk|none, step (grid spacing), density (topk), unbiased (topk), topology, seed}``.
    ``exchange`` defaults to a :class:`HorovodExchange` when Horovod is initialised and
    ``comm`` is not given, else to an mpi4py :class:`NeighborExchange` on ``comm`` (COMM_WORLD)."""
    if method not in ALGORITHMS:
        raise ValueError(f"decentralized method {method!r} is unknown; choose one of {list(METHODS)}")
    if exchange is None:
        exchange = default_exchange(topology, comm)
    q = None if method == "dpsgd" else build_quantizer(quantizer, bits, step, density, unbiased)
    return ALGORITHMS[method](exchange, q, seed)


def default_exchange(topology, comm=None):
    """Horovod's transport when Horovod runs (one MPI caller per process), else mpi4py's."""
    from .exchange import HorovodExchange, NeighborExchange, check_world, horovod_if_initialized
    from .topology import from_config
    hvd = horovod_if_initialized() if comm is None else None
    if hvd is not None:
        return HorovodExchange(from_config(topology, hvd.size()), hvd)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    check_world(comm)   # before anything that could wait on a rank that is not there
    return NeighborExchange(from_config(topology, comm.Get_size()), comm)


@torch.no_grad()
def optimizer_step_as_gradient(optimizer, params) -> list:
    """Run a torch optimizer's local step and turn its displacement into a 'gradient'.

    Returns g = x_before - x_after per param and restores the params, so that
    ``algo.step(params, g, lr=1.0)`` applies the optimizer's full update (momentum,
    weight decay, Adam, schedules) as the local step of the decentralized method:
    x_half = sum_j W_ij x_j - (x_before - x_after)."""
    before = [p.detach().clone() for p in params]
    optimizer.step()
    out = []
    for p, b in zip(params, before):
        out.append(b - p.detach())
        p.copy_(b)
    return out

