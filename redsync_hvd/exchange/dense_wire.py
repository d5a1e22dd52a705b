"""How an FSDP group's dense pieces travel (``policy.dense_values``): one interface, two wires.

``DenseValues`` (fp32, fp16): one reduce-scatter of the values, which sums them on the way; the
rank keeps nothing (fp16's rounding, 11 significant bits, is lost).

``DenseCodes`` (int8): a reduce-scatter sums what it carries, so it cannot carry codes whose scale
differs from rank to rank. Each rank sends every other rank's row as int8 codes with one float32
scale per parameter piece, in one alltoall, and the owner decodes and adds them. What the codes
round off stays in the sender's residual and goes out on a later step: error feedback for
quantisation (Seide et al., "1-bit SGD", 2014; Karimireddy et al., "Error Feedback Fixes SignSGD",
2019). One byte an element instead of four or two, and nothing lost over the run. Per row:

    1. encode   per piece j: scale = max |x| / 127, code = round(x / scale); x -= code * scale
    2. send     the codes, then the scales' bytes, to the row's owner (one alltoall)
    3. decode   the owner adds, in rank order, every sender's code * scale

Both give, for the rows of every rank (``buffer``): ``pack`` a row (x keeps what stays home),
``start`` and ``finish`` the collective (the sum over the other ranks of this rank's row),
``reduce`` a group whose parameters are all dense, and ``checked``, what the non-finite check
reads.
"""
from __future__ import annotations

import torch

from ..compressors.codec import INT8_LEVELS
from ..core.wire import to_wire

_TINY = torch.finfo(torch.float32).tiny


class DenseValues:
    """fp32 or fp16 values of ``width`` columns a row by one reduce-scatter."""
    keeps_residual = False

    def __init__(self, width: int, size: int, fp16: bool):
        self.width, self.size, self.fp16 = width, size, fp16
        self.sent = (size - 1) * width * (2 if fp16 else 4)   # bytes a step, self excluded

    def how(self, alone: bool) -> str:
        """For layers.log: how a dense piece travels, in a group of its own kind (``alone``) or not."""
        half = " in fp16" if self.fp16 else ""
        return f"dense: FSDP's own{half}" if alone else f"dense, in the group's dense reduce-scatter{half}"

    def _wire(self, values: torch.Tensor) -> torch.Tensor:
        """fp16: each value clamped so that the sum of N stays finite (the check reads before)."""
        return to_wire(values, torch.float16, summands=self.size) if self.fp16 else values

    def buffer(self, device) -> torch.Tensor:
        return torch.zeros(self.size, self.width, dtype=torch.float32, device=device)

    def pack(self, x: torch.Tensor, row: torch.Tensor) -> None:
        row.copy_(x)
        x.zero_()

    def checked(self, rows: torch.Tensor) -> torch.Tensor | None:
        """fp16's values (fp32's reach the output, which the check reads)."""
        return rows if self.fp16 else None

    def start(self, comm, rows: torch.Tensor, name: str):
        return comm.reduce_scatter_async(self._wire(rows), name=name, average=False)

    def finish(self, comm, handle) -> torch.Tensor:
        return comm.wait(handle).float()

    def reduce(self, comm, x: torch.Tensor, out: torch.Tensor, average: bool, name: str) -> int:
        """All-dense groups: FSDP's own call on x (the gradient), so fp32 reduces bit for bit as FSDP does."""
        got = comm.wait(comm.reduce_scatter_async(self._wire(x), name=name, average=average,
                                                  out=None if self.fp16 else out))
        if self.fp16:
            out.copy_(got)
        return self.sent


class DenseCodes:
    """int8 codes of pieces ``widths`` wide, one scale a piece, by one alltoall; x keeps the rounding."""
    keeps_residual = True

    def __init__(self, widths: list, size: int, rank: int, device="cpu"):
        self.widths = torch.tensor(widths, dtype=torch.int64, device=device)
        self.width, self.size, self.rank = int(sum(widths)), size, rank
        self.row_bytes = self.width + 4 * len(widths)     # codes, then one float32 scale a piece
        self.sent = (size - 1) * self.row_bytes

    def how(self, alone: bool) -> str:
        kept = "their rounding kept in the residual"
        return f"dense: int8 codes by an alltoall, {kept}" if alone else \
            f"dense, as int8 codes by the group's alltoall, {kept}"

    def buffer(self, device) -> torch.Tensor:
        return torch.zeros(self.size, self.row_bytes, dtype=torch.uint8, device=device)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 scales of ``rows`` (copied out: a row's bytes need not align for the view)."""
        return rows[:, self.width:].clone(memory_format=torch.contiguous_format).view(torch.float32)

    def pack(self, x: torch.Tensor, row: torch.Tensor) -> None:
        """1. Row ``x`` (fp32) as codes and scales into ``row``; x keeps what the codes round off."""
        scales = torch.segment_reduce(x.abs(), "max", lengths=self.widths, unsafe=True, initial=0.0) / INT8_LEVELS
        per = scales.repeat_interleave(self.widths, output_size=self.width)
        codes = torch.round(x / per.clamp(min=_TINY)).clamp_(-INT8_LEVELS, INT8_LEVELS)
        x.sub_(codes * per)
        row[:self.width] = codes.to(torch.int8).view(torch.uint8)
        row[self.width:] = scales.float().view(torch.uint8)

    def checked(self, rows: torch.Tensor) -> torch.Tensor:
        """The scales: a piece's largest |x| / 127, NaN or Inf where anything in the piece is."""
        return self.scales(rows)

    def start(self, comm, rows: torch.Tensor, name: str):
        """2. Row o to rank o; this rank's own row stays home."""
        others = [o for o in range(self.size) if o != self.rank]
        return comm.alltoall_async(rows[others], [int(o != self.rank) for o in range(self.size)], name=name)

    def finish(self, comm, handle) -> torch.Tensor:
        """3. The sum over the other ranks of their codes times scales."""
        got, _ = comm.wait(handle)
        per = self.scales(got).repeat_interleave(self.widths, dim=1, output_size=self.width)
        return (got[:, :self.width].view(torch.int8).float() * per).sum(0)

    def reduce(self, comm, x: torch.Tensor, out: torch.Tensor, average: bool, name: str) -> int:
        """All-dense groups: x = r + g of every rank's row (fp32, changed in place to what stays: the
        rounding of the rows sent, 0 in the own row, which never travels); out = this rank's row
        summed over ranks (its own as it is)."""
        x = x.view(self.size, self.width)
        rows = self.buffer(x.device)
        for o in range(self.size):
            if o != self.rank:
                self.pack(x[o], rows[o])
        handle = self.start(comm, rows, name)
        acc = x[self.rank].clone()
        x[self.rank] = 0.0
        acc += self.finish(comm, handle)
        out.copy_(acc.div_(self.size) if average else acc)
        return self.sent


def dense_wire(values: str, widths: list, size: int, rank: int, device="cpu"):
    """The wire of ``policy.dense_values`` for pieces ``widths`` wide."""
    if values == "int8":
        return DenseCodes(widths, size, rank, device)
    return DenseValues(int(sum(widths)), size, values == "fp16")
