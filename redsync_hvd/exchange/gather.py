"""The allgather bucket: compressed messages that differ per rank (own positions, own counts), packed
into one byte payload (``comm/packing.py``) and allgathered, with a header of their sizes where those
vary (or, on torch.distributed, one row of a bounded size). Dense reduce buckets may ride along in
the same payload (``policy.dense_in_gather_bytes``): a step then has one collective round, not two.
Their sizes are fixed and known to every rank, so no header carries them: the wire's bytes are the
messages', the riders' flat buffers and nothing else.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..comm.packing import pack, pack_row, payload_bytes, unpack_fixed, unpack_gathered, unpack_rows
from .buckets import Bucket, ReduceBucket
from .step import Arrived, StepState


class Sizes(enum.Enum):
    """How every rank of a gather bucket learns the others' message sizes."""
    FIXED = "fixed"     # the counts are known before the step on every rank: no header
    ROWS = "rows"       # torch.distributed with a bounded message: one row of that capacity, sizes inside
    HEADER = "header"   # a fixed-size header of the counts, allgathered beside the payload (on
    #                     torch.distributed, which needs every rank's size first, read before it)


@dataclass
class InFlight:
    """A gather bucket's collectives between ``_start`` and ``finish``: the payload's (or capacity
    rows') allgather, and the header's: still in flight (``header``), already read (``headers``,
    torch.distributed reads them first), or neither (fixed sizes, rows)."""
    data: Any
    header: Any = None
    headers: Optional[torch.Tensor] = None


class GatherBucket(Bucket):
    """Per-rank messages, packed into one payload and allgathered.

    wire: how every rank learns the sizes (:class:`Sizes`), chosen once from the compressor's ``wire``.
    riders: dense reduce buckets whose flat buffers travel in this payload, after the messages
        (``take_rider``): the step then has one collective round where it had two.
    """
    kind = "gather"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        wires = [self.compressor.wire(l) for l in self.layers]
        self.riders: list = []
        self._rider_sizes: list = []   # [(dtype, elements)] of every rider's flat buffers, in order
        self.dtypes = [d for w in wires for d in w.dtypes] + [torch.int32]
        needs_sizes = getattr(self.comm, "needs_sizes", False)
        if all(w.fixed for w in wires):
            self.wire = Sizes.FIXED
        elif needs_sizes and all(w.capacity is not None for w in wires):
            self.wire = Sizes.ROWS
        else:
            self.wire = Sizes.HEADER

    @property
    def control_bytes(self) -> int:
        return 4 if self.wire is Sizes.FIXED else 8   # the count, and its size in the header (riders': none)

    def clear(self) -> None:
        super().clear()
        self._flight: InFlight | None = None
        self._sent = []
        self._waiting = None        # (step state, own messages) until every rider is loaded
        self._loaded: list = []     # riders whose flat buffers are ready this step
        self._rows: list = []       # after finish: every rank's rider tensors, in rank order

    # -- dense buckets that ride along ----------------------------------------------------------
    def take_rider(self, rider: ReduceBucket) -> None:
        """``rider``'s flat buffers travel in this payload from now on (fixed sizes, known to all)."""
        sizes = rider.flat_sizes()
        rider.ride, rider.seat = self, slice(len(self._rider_sizes), len(self._rider_sizes) + len(sizes))
        self.riders.append(rider)
        self._rider_sizes += sizes
        self.dtypes[-1:-1] = [d for d, _ in sizes]   # before the count of non-finite inputs

    def rider_loaded(self, rider: ReduceBucket) -> None:
        self._loaded.append(rider)
        self._start_when_ready()

    def rider_rows(self, rider: ReduceBucket) -> list:
        """[per rank: ``rider``'s flat buffers as that rank sent them], once ``finish`` has run."""
        return [rows[rider.seat] for rows in self._rows]

    def _start(self, st: StepState, messages: list) -> None:
        self._waiting = (st, messages)
        self._start_when_ready()

    def _start_when_ready(self) -> None:
        if self._waiting is not None and len(self._loaded) == len(self.riders):
            st, messages = self._waiting
            self._waiting = None
            self._send(st, messages, [flat for r in self.riders for flat, _ in r._flats])

    def _send(self, st: StepState, messages: list, riding: list) -> None:
        """1. the wire tensors, the riders' buffers and the count of non-finite inputs; 2. the sizes:
        none (fixed), in a capacity row, or a header allgather (read now where the transport needs
        sizes first); 3. the payload's allgather."""
        tensors = [t for m in messages for t in m.tensors] + riding + [self._count(messages).to(torch.int32)]   # 1.
        size, sizes = self.comm.size, None
        self._sent = messages
        if self.wire is Sizes.ROWS:                                                                      # 2.
            row = self._capacity_row(tensors)
            self._flight = InFlight(self.comm.allgather_async(row, name=self.name, sizes=[row.numel()] * size))
            return
        header, payload = pack(tensors, device=self.layers[0].device)
        header = self._without_riders(header)
        flight = InFlight(None)
        if self.wire is Sizes.FIXED:
            counts = self._counts()
            if [t.numel() for t in tensors] != counts:
                raise RuntimeError(f"{type(self.compressor).__name__} declared fixed message sizes {counts[:-1]} "
                                   f"for bucket {self.index} but sent {[t.numel() for t in tensors[:-1]]}")
            sizes = [payload.numel()] * size
        else:
            self.stats.add_bytes({"headers": header.numel() * 4})
            flight.header = self.comm.allgather_async(header, name=f"{self.name}.hdr", sizes=[header.numel()] * size)
            if getattr(self.comm, "needs_sizes", False):
                flight.headers, flight.header = self._with_riders(self.comm.wait(flight.header)), None
                sizes = [payload_bytes(c, self.dtypes) for c in flight.headers.view(size, -1).tolist()]
        self.stats.add_bytes({"scalars": 4})
        flight.data = self.comm.allgather_async(payload, name=self.name, sizes=sizes)                     # 3.
        self._flight = flight

    def _without_riders(self, header: torch.Tensor) -> torch.Tensor:
        """The header as sent: the riders' counts left out (fixed, known to every rank)."""
        riders = len(self._rider_sizes)
        return torch.cat([header[:-1 - riders], header[-1:]]) if riders else header

    def _with_riders(self, headers: torch.Tensor) -> torch.Tensor:
        """Every rank's header as received, with the riders' counts put back in their place."""
        if not self._rider_sizes:
            return headers
        rows = headers.view(self.comm.size, -1)
        fixed = torch.tensor([n for _, n in self._rider_sizes], dtype=rows.dtype, device=rows.device)
        return torch.cat([rows[:, :-1], fixed.expand(rows.shape[0], -1), rows[:, -1:]], dim=1).reshape(-1)

    def _counts(self) -> list:
        return [n for l in self.layers for n in self.compressor.wire(l).counts] + \
            [n for _, n in self._rider_sizes] + [1]

    def _capacity_row(self, tensors: list) -> torch.Tensor:
        """[the header's int32 counts | the payload | zeros up to the capacity's payload], uint8: the
        same size on every rank, so one allgather carries sizes and data (``_arrived`` cuts it). The
        header leaves the riders' counts out (fixed, known to every rank)."""
        counts = [t.numel() for t in tensors]
        header = counts[:len(counts) - 1 - len(self._rider_sizes)] + counts[-1:]
        capacity = [n for l in self.layers for n in self.compressor.wire(l).capacity]
        if any(c > cap for c, cap in zip(header, capacity)):
            raise RuntimeError(f"{type(self.compressor).__name__} declared at most {capacity} elements per wire "
                               f"tensor for bucket {self.index} but sent {header[:-1]}")
        self.stats.add_bytes({"headers": 4 * len(header), "scalars": 4})
        most = payload_bytes(capacity + [n for _, n in self._rider_sizes] + [1], self.dtypes)
        row = torch.zeros(4 * len(header) + most, dtype=torch.uint8, device=self.layers[0].device)
        pack_row(row, header, tensors)
        return row

    def _open_rows(self, rows: torch.Tensor) -> list:
        """Every rank's capacity row -> its wire tensors (views into the row where aligned)."""
        rows = rows.view(self.comm.size, -1)
        width = 4 * (len(self.dtypes) - len(self._rider_sizes))
        riders = [n for _, n in self._rider_sizes]
        counts = [c[:-1] + riders + c[-1:] for c in rows.view(torch.int32)[:, :width // 4].tolist()]
        return unpack_rows(rows, width, counts, self.dtypes)

    def _wait(self) -> tuple:
        """(the gathered headers, or None where the sizes are fixed or inside the rows; the gathered
        payload or rows)."""
        flight = self._flight
        headers = flight.headers if flight.header is None else self._with_riders(self.comm.wait(flight.header))
        return headers, self.comm.wait(flight.data)

    def _arrived(self, header, payload) -> list:
        """Every rank's wire tensors, cut out of the gathered payload (by its header, or by the sizes
        known in advance)."""
        if self.wire is Sizes.ROWS:
            return self._open_rows(payload)
        if self.wire is Sizes.FIXED:
            return unpack_fixed(payload, self._counts(), self.dtypes, self.comm.size)
        return unpack_gathered(header, payload, self.dtypes, self.comm.size)

    def _own(self, i: int, arrived: list) -> list:
        """This rank's message for its ``i``-th layer as it sent it, where it knows the positions it
        encoded (``codec.Encoded``): the bytes that came back, without decoding their Golomb code
        again (half the decoding at N = 2); else ``arrived``."""
        sent = self._sent[i].tensors
        return sent if getattr(sent, "positions", None) is not None else arrived

    def finish(self, into: dict, apply: dict) -> Arrived:
        """1. every rank's message and non-finite count; 2. layers to apply to the weights become
        updates; 3. the others decoded into zeroed buffers (``into``'s where given), rank by rank."""
        with self.stats.timer("communicate", "allgather"):
            gathered = self._wait()
        with self.stats.timer("decompress", "allgather"):
            per_rank = self._arrived(*gathered)                                                     # 1.
            got = Arrived(flags=torch.cat([p[-1] for p in per_rank]))
            self._rows = [p[len(p) - 1 - len(self._rider_sizes):-1] for p in per_rank]   # the riders'; they sum them
            size = self.comm.size
            # a power-of-two size scales each term exactly (subnormals aside), so adding v/size
            # equals dividing the sum bit for bit, and saves a pass over every output
            exact = size & (size - 1) == 0
            alpha = 1.0 / size if exact else 1.0
            out = {l.name: self.buffers.zeroed(l, into) for l in self.layers if l.name not in apply}
            for rank, tensors in enumerate(per_rank):
                at = 0
                for i, layer in enumerate(self.layers):
                    n = len(self.compressor.wire(layer).dtypes)
                    part, at = tensors[at:at + n], at + n
                    if layer.name in apply:                                                         # 2.
                        got.updates.append((layer, part, -apply[layer.name][1] / size))
                    else:                                                                           # 3.
                        part = self._own(i, part) if rank == self.comm.rank else part
                        self.compressor.decompress_add(out[layer.name], part, layer, alpha=alpha)
            if not exact:
                for t in out.values():
                    t.div_(size)
            got.averages.update(out)
        return got
