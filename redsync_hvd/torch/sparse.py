"""Sparse gradients (``nn.Embedding(sparse=True)``) exchanged as horovod.torch exchanges them.

Horovod's ``sparse_allreduce_async`` allgathers every rank's COO indices and values, divides the
values by N for an average, and hands the optimizer the uncoalesced result (SparseAdam coalesces
it). These rows are already a sparse message, so they travel beside the compressed exchange, not
through it, and the result is bit for bit Horovod's; the rest of the model is compressed as
configured. ``sparse_as_dense=True`` densifies them into the exchange instead (compressed with
the rest, and made sparse again for the optimizer, as horovod.torch does).
"""
from __future__ import annotations

import torch


def makes_sparse_grads(optimizer, p: torch.Tensor) -> bool:
    """Whether ``p``'s gradients are known to be sparse when the optimizer is wrapped: every
    parameter of SparseAdam (it takes nothing else), or one whose ``.grad`` is sparse already."""
    return isinstance(optimizer, torch.optim.SparseAdam) or (p.grad is not None and p.grad.is_sparse)


class SparseRows:
    """One step's allgathers of the sparse-gradient parameters ``params`` ({name: parameter}):
    ``start`` from the gradient hook, ``finish`` in ``synchronize``, ``write`` once the step
    succeeded. ``average``: divide the values by N (op=Average) or not (op=Sum)."""

    def __init__(self, comm, params: dict, average: bool, stats):
        self.comm, self.params, self.average, self.stats = comm, params, average, stats
        self.handles: dict = {}

    def start(self, name: str, grad) -> None:
        """This rank's rows of ``name`` into two allgathers (indices as rows, then values), as
        Horovod starts them; a parameter without a gradient on this rank sends no rows."""
        rows = self._rows(self.params[name], grad)
        indices = rows._indices().transpose(0, 1).contiguous()
        values = rows._values()
        base = f"rsync.sparse.{name}"
        self.handles[name] = (self.comm.allgather_async(indices, name=f"{base}.indices"),
                              self.comm.allgather_async(values, name=f"{base}.values"))
        wire = {"indices": indices.numel() * indices.element_size(), "values": values.numel() * values.element_size()}
        dense = 4 * self.params[name].numel()
        self.stats.add_bytes(wire, "sparse")
        self.stats.add("dense_bytes", dense)
        self.stats.layer(name, "sparse", indices.shape[0], None, sum(wire.values()), dense)

    @staticmethod
    def _rows(p: torch.Tensor, grad) -> torch.Tensor:
        """The gradient as COO rows (sparse_dim 1, what an embedding's backward gives), so every
        rank's indices and values have the same trailing shape."""
        if grad is None:
            return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                           torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape,
                                           check_invariants=False)
        if not grad.is_sparse:
            return grad.to_sparse(1)
        return grad if grad.sparse_dim() == 1 else grad.to_dense().to_sparse(1)

    def finish(self) -> dict:
        """{name: the sum or average of every rank's rows, uncoalesced}; parameters whose hook did
        not run this step (no gradient, or fewer backward passes) send what ``.grad`` holds."""
        for name, p in self.params.items():
            if name not in self.handles:
                self.start(name, p.grad)
        handles, self.handles = self.handles, {}
        out = {}
        with self.stats.timer("communicate", "allgather"):
            for name, (indices, values) in handles.items():
                values = self.comm.wait(values)   # values first, as Horovod waits
                indices = self.comm.wait(indices)
                if self.average:
                    values = values / self.comm.size
                out[name] = torch.sparse_coo_tensor(indices.transpose(0, 1), values, self.params[name].shape,
                                                    check_invariants=False)   # Horovod's t.new(...) checks none
        return out

    def abort(self) -> None:
        """Forget a step that failed (started allgathers are left to finish unread)."""
        self.handles = {}

    @staticmethod
    def nonfinite(rows: dict) -> list:
        """The parameters whose gathered values hold NaN/Inf: every rank received the same rows,
        so every rank finds the same names without a collective of its own."""
        return [name for name, t in rows.items() if not bool(torch.isfinite(t._values()).all())]

    def write(self, rows: dict) -> None:
        """Into ``.grad``, as horovod.torch writes a sparse result (zero_ then add_: the same tensor)."""
        for name, aggregated in rows.items():
            p = self.params[name]
            if p.grad is not None and p.grad.is_sparse:
                p.grad.zero_().add_(aggregated)
            else:
                p.grad = aggregated
