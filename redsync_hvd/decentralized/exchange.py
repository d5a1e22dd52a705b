"""Point-to-point exchange with the neighbours of a mixing topology.

No allreduce in training: each step a worker sends ONE message (its list of wire
tensors) to each distinct neighbour and receives one from each. A message is a
single uint8 buffer: an int64 header ``[n, dtype_0, numel_0, ..., dtype_n-1,
numel_n-1]`` followed by the tensors' raw bytes, so sizes may differ from rank to
rank and step to step.

Two transports move the buffers:

* :class:`HorovodExchange` (the default under ``hvd.init()``): one Horovod alltoall per
  step whose slices are the message for each neighbour and empty for everyone else, so
  only neighbours receive bytes. Horovod's background thread is then the process's only
  MPI caller. That thread talks to its peers every cycle (its response-cache
  allreduce), so a second thread calling MPI at the same time is always concurrent with
  it, and Open MPI 4.1's shared-memory path can crash under that (a segfault inside
  ``MPI_Allreduce`` on one rank in one run of many). It works the same under ``--gloo``.
  The price: the alltoall is a collective, so each step waits for every rank, not only
  the neighbours.
* :class:`NeighborExchange`: mpi4py ``Isend``/``Mprobe``, waiting only for the
  neighbours, for MPI jobs that do not run Horovod (``build_algorithm(comm=...)``). The
  receiver learns the size with a matched probe, so no separate size round is needed.
  All sends are posted (``Isend``) before any receive, so the exchange cannot deadlock
  whatever the graph.

N=2 ring: a worker's left and right neighbours are the same rank. It is
exchanged with once (one message each way per step) and the topology's single
weight W_01 is used for it (ring(2) uses W = [[1/2, 1/2], [1/2, 1/2]]).

Bytes per worker (``stats``): ``bytes_sent`` counts everything this worker sends
in training (header included) = message bytes x number of distinct neighbours;
``message_bytes`` the size of one message (independent of N);
``payload_bytes_sent`` the wire tensors only. The initial full-model exchange
(``kind="setup"``) and evaluation allreduces (``eval_bytes``) are counted apart.

mpi4py must see the same world as Horovod when both run: under Gloo
(``horovodrun --gloo``) each process is an MPI world of one, so the check in
:class:`NeighborExchange` raises instead of every rank waiting forever.

:class:`ThreadedGroup` runs N workers as threads of one process through the same
interface (simulations, unit tests); the algorithms accept either.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import numpy as np
import torch

from .topology import Topology

_DTYPES = [torch.float32, torch.uint8, torch.int32, torch.float16, torch.int64, torch.float64, torch.int8,
           torch.bfloat16]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
TAG = 7301


def pack(wire: list) -> np.ndarray:
    """List of tensors -> one uint8 buffer (header + payload)."""
    header = [len(wire)]
    parts = []
    for t in wire:
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send dtype {t.dtype}; supported: {_DTYPES}")
        t = t.detach().reshape(-1).contiguous().cpu()
        header += [_CODE[t.dtype], t.numel()]
        parts.append(t.view(torch.uint8))
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, *parts]).numpy()


def unpack(buf) -> list:
    """Inverse of :func:`pack` (copies, so the tensors own their memory)."""
    data = torch.from_numpy(np.asarray(buf, dtype=np.uint8))
    n = int(data[:8].clone().view(torch.int64))
    header = data[8:8 * (2 + 2 * n)].clone().view(torch.int64).tolist()
    pos, out = 8 * (1 + 2 * n), []
    for i in range(n):
        dtype, numel = _DTYPES[header[2 * i]], header[2 * i + 1]
        nbytes = numel * dtype.itemsize
        out.append(data[pos:pos + nbytes].clone().view(dtype))
        pos += nbytes
    if pos != data.numel():
        raise ValueError(f"corrupt message: header describes {pos} bytes, buffer has {data.numel()}")
    return out


def header_bytes(n_tensors: int) -> int:
    return 8 * (1 + 2 * n_tensors)


class ExchangeBase:
    """Neighbour bookkeeping, packing and byte accounting; subclasses move the bytes."""

    def __init__(self, topology: Topology, rank: int):
        self.topology = topology
        self.rank = int(rank)
        self.size = topology.size
        self.neighbors = topology.neighbors(self.rank)
        self.weights = topology.weights(self.rank)
        self.stats = defaultdict(float)

    def exchange(self, wire: list, kind: str = "train") -> dict:
        """Send ``wire`` to every neighbour; return {neighbour rank: its wire list}."""
        buf = pack(wire)
        sent = buf.nbytes * len(self.neighbors)
        t0 = time.perf_counter()
        got = self._send_recv(buf)
        if kind == "train":
            self.stats["bytes_sent"] += sent
            self.stats["payload_bytes_sent"] += (buf.nbytes - header_bytes(len(wire))) * len(self.neighbors)
            self.stats["messages_sent"] += len(self.neighbors)
            self.stats["exchanges"] += 1
            self.stats["message_bytes"] = buf.nbytes
            self.stats["last_bytes_sent"] = sent
            self.stats["time_communicate"] += time.perf_counter() - t0
        else:
            self.stats[f"{kind}_bytes"] += sent
        return {j: unpack(b) for j, b in got.items()}

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over all workers, in float64 (evaluation/logging only; counted as ``eval_bytes``)."""
        arr = t.detach().to(torch.float64).reshape(-1).cpu().numpy().copy()
        self.stats["eval_bytes"] += arr.nbytes
        return torch.from_numpy(self._allreduce(arr)).reshape(t.shape)

    def summary(self) -> dict:
        return {k: (int(v) if k != "time_communicate" else v) for k, v in self.stats.items()}

    def _send_recv(self, buf: np.ndarray) -> dict:
        raise NotImplementedError

    def _allreduce(self, arr: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def horovod_if_initialized():
    """``horovod.torch`` when this process has run ``hvd.init()``, else None."""
    try:
        import horovod.torch as hvd
        return hvd if hvd.is_initialized() else None
    except (ImportError, ValueError, RuntimeError):
        return None


def check_world(comm) -> None:
    """Raise a clear error when mpi4py's world is not Horovod's (e.g. Gloo launch)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    hvd = horovod_if_initialized()
    expected = None if hvd is None else (hvd.size(), hvd.rank())
    if expected is None and os.environ.get("HOROVOD_SIZE"):
        expected = (int(os.environ["HOROVOD_SIZE"]), int(os.environ.get("HOROVOD_RANK", rank)))
    if expected is not None and expected != (size, rank):
        raise RuntimeError(
            f"mpi4py sees an MPI world of size {size} (rank {rank}) but Horovod has size {expected[0]} "
            f"(rank {expected[1]}): the decentralized methods exchange with neighbours through MPI, so "
            "launch under `horovodrun` with the MPI controller (the default; not --gloo) or under `mpirun`")


class NeighborExchange(ExchangeBase):
    """The MPI implementation. ``comm`` defaults to ``mpi4py.MPI.COMM_WORLD`` and is
    duplicated (collective: every rank must construct it at the same point)."""

    def __init__(self, topology: Topology, comm=None):
        from mpi4py import MPI
        self._MPI = MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        check_world(comm)
        if topology.size != comm.Get_size():
            raise ValueError(f"topology has {topology.size} workers but the MPI world has {comm.Get_size()}")
        super().__init__(topology, comm.Get_rank())
        self.comm = comm.Dup()   # a private context: our tags never meet other MPI traffic

    def _send_recv(self, buf):
        MPI = self._MPI
        reqs = [self.comm.Isend([buf, MPI.BYTE], dest=j, tag=TAG) for j in self.neighbors]
        got = {}
        try:
            for j in self.neighbors:
                status = MPI.Status()
                msg = self.comm.Mprobe(source=j, tag=TAG, status=status)
                rbuf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                msg.Recv([rbuf, MPI.BYTE])
                got[j] = rbuf
        finally:
            MPI.Request.Waitall(reqs)
        return got

    def _allreduce(self, arr):
        self.comm.Allreduce(self._MPI.IN_PLACE, [arr, self._MPI.DOUBLE], op=self._MPI.SUM)
        return arr

    def barrier(self) -> None:
        self.comm.Barrier()

    def free(self) -> None:
        """Release the duplicated communicator (collective)."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class HorovodExchange(ExchangeBase):
    """The Horovod implementation: every byte goes through Horovod's own background thread.

    ``hvd`` is the initialised ``horovod.torch`` module. Each message is one alltoall
    slice; since the topology is symmetric, the ranks this worker receives from are its
    neighbours, and a neighbour that sent nothing means the ranks disagree on the graph."""

    NAME = "redsync.decentralized"

    def __init__(self, topology: Topology, hvd):
        if topology.size != hvd.size():
            raise ValueError(f"topology has {topology.size} workers but Horovod has {hvd.size()}")
        super().__init__(topology, hvd.rank())
        self.hvd = hvd

    def _send_recv(self, buf):
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[self.neighbors] = buf.size            # ascending neighbours: the slices' order
        send = torch.from_numpy(np.tile(buf, len(self.neighbors)))
        out, got = self.hvd.alltoall(send, splits=splits, name=f"{self.NAME}.message")
        ends = np.cumsum(got.numpy())
        if any(got[j] == 0 for j in self.neighbors):
            raise RuntimeError(f"rank {self.rank}: a neighbour sent nothing (received sizes {got.tolist()}); "
                               "every rank must build the same topology")
        return {j: out[ends[j] - got[j]:ends[j]].numpy().copy() for j in self.neighbors}

    def _allreduce(self, arr):
        return self.hvd.allreduce(torch.from_numpy(arr), op=self.hvd.Sum, name=f"{self.NAME}.eval").numpy()

    def barrier(self) -> None:
        self.hvd.barrier()

    def free(self) -> None:
        """Nothing to release: Horovod owns the communicator."""


class ThreadedGroup:
    """N workers as threads of one process, for simulations and tests without MPI:
    ``run(fn)`` calls ``fn(exchange)`` on each worker's thread and returns the results by
    rank. Messages go through the same pack/unpack and byte accounting as MPI; a worker
    that raises aborts the others (no hang) and the first error is re-raised."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.barrier = threading.Barrier(topology.size)
        self.box: dict = {}

    def run(self, fn, timeout: float = 600.0) -> list:
        out, errors = [None] * self.topology.size, []

        def worker(rank):
            try:
                out[rank] = fn(ThreadedExchange(self, rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
                self.barrier.abort()
        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(self.topology.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            self.barrier.abort()
            raise TimeoutError(f"ThreadedGroup.run: workers still running after {timeout}s")
        return out


class ThreadedExchange(ExchangeBase):
    """One worker of a :class:`ThreadedGroup`."""

    def __init__(self, group: ThreadedGroup, rank: int):
        super().__init__(group.topology, rank)
        self.group = group

    def _everyone(self, item):
        self.group.box[self.rank] = item
        self.group.barrier.wait()
        got = dict(self.group.box)
        self.group.barrier.wait()     # nobody overwrites the box before everyone has read it
        return got

    def _send_recv(self, buf):
        got = self._everyone(buf)
        return {j: got[j].copy() for j in self.neighbors}

    def _allreduce(self, arr):
        got = self._everyone(arr)
        return sum(got[j] for j in range(self.size))   # rank order: identical on every worker
