"""Our PowerSGD against torch's own ``powerSGD_hook`` under torchrun (Gloo), same seed, same data:
after a short run the weights agree to float rounding.

    python powersgd_vs_torch.py direct    # the compressor driven bucket by bucket, as the exchange will
    python powersgd_vs_torch.py register  # through redsync_hvd.torch.ddp.register (method powersgd)

The model registers its layers in the order backward produces their gradients (``head`` is
registered first and used last), so DDP's bucket order after its rebuild, torch's order of
first Q draws, and the exchange's fixed layer order for blocking compressors all coincide;
the two compressed weights have distinct shapes and share one bucket (see the Q draw note
in redsync_hvd/compressors/powersgd.py). ``direct`` mode plays the exchange's part itself:
x = g + e; compress (P allreduced inside); allreduce-mean Q; decode; e = x - decode.
"""
import copy
import gc
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.comm.torch_dist import TorchDistCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.compressors.powersgd import PowerSGDCompressor, PowerSGDConfig
from redsync_hvd.launchers import close_process_group

STEPS, PER, RANK, START = 8, 16, 2, 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(64, 10)     # registered first, its gradients come first
        self.body = torch.nn.Linear(48, 64)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class DirectHook:
    """The exchange's part, per bucket, in bucket order: compensate, compress, average Q, decode;
    commit at the step's end."""

    def __init__(self, model, comm):
        self.comm = comm
        self.comp = PowerSGDCompressor(PowerSGDConfig(rank=RANK, start_iter=START, seed=0), comm)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layers = {n: Layer(n, tuple(p.shape), p.numel(), i) for i, (n, p) in enumerate(model.named_parameters())}
        self.residual, self.step = {}, 0

    def run(self, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            name = self.names[id(p)]
            layer = self.layers[name]
            x = g.reshape(-1) + self.residual.get(name, 0.0)
            msg = self.comp.compress(x, layer, self.step)
            avg = [self.comm.wait(self.comm.allreduce_async(t, name=name)) for t in msg.tensors]
            out = torch.zeros_like(x)
            self.comp.decompress_add(out, avg, layer, 1.0, getattr(msg, "ctx", None))
            self.residual[name] = x - out
            g.copy_(out.view_as(g))
        if bucket.is_last():   # the step is over: its averaged Qs become the warm start
            self.comp.commit()
            self.step += 1
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut


def direct_hook(state, bucket):
    return state.run(bucket)


def train(ddp, batches):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def main(mode):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(PER, 48, generator=gen), torch.randint(0, 10, (PER,), generator=gen))
               for _ in range(STEPS)]
    theirs, ours = DDP(copy.deepcopy(net)), DDP(copy.deepcopy(net))
    theirs.register_comm_hook(torch_psgd.PowerSGDState(None, matrix_approximation_rank=RANK,
                                                       start_powerSGD_iter=START, random_seed=0),
                              torch_psgd.powerSGD_hook)
    if mode == "direct":
        ours.register_comm_hook(DirectHook(ours.module, TorchDistCommunicator()), direct_hook)
    else:
        from redsync_hvd.torch import ddp as rddp
        rddp.register(ours, {"method": "powersgd", "rank": RANK, "start_iter": START, "seed": 0})
    train(theirs, batches)
    train(ours, batches)
    moved = max((p - q).abs().max().item() for p, q in zip(net.parameters(), theirs.parameters()))
    worst = max((p - q).abs().max().item() for p, q in zip(theirs.parameters(), ours.parameters()))
    assert moved > 1e-2, f"training hardly moved the weights ({moved}): the comparison would be empty"
    assert worst < 1e-5, f"{mode}: our PowerSGD differs from torch's powerSGD_hook by {worst}"
    print(f"rank {rank}: OK powersgd {mode} matches torch (max difference {worst:.2e}, weights moved {moved:.2f})",
          flush=True)
    # End the group cleanly: every rank is done with it; nothing holds it any more (the DDP
    # wrappers and their hook states keep it and its Gloo threads alive); destroyed while the
    # interpreter runs, not by destructors at exit, which aborted the process now and then
    # ("terminate called without an active exception") after both ranks had printed OK.
    dist.barrier()
    del theirs, ours
    gc.collect()
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
