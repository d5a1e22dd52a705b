"""Elastic training with residuals under ``horovodrun --min-np/--max-np --host-discovery-script``.

    elastic_toy.py <steps> <victim host> <kill step> [sum|reset]
    elastic_toy.py <steps> rank=<r> <kill step> [sum|reset]     (the worker of rank r is killed)
    elastic_toy.py <steps> +<flag file> <step> [sum|reset]     (rank 0 creates the file then)

A 2-layer MLP, redsync_hvd's DistributedOptimizer with top-k and residuals, and
:class:`redsync_hvd.torch.elastic.ElasticState`; a commit after every step. The worker
launched on <victim host> kills itself with SIGKILL after step <kill step> (a crash: no
cleanup, mid-job). Every worker prints, tagged with its worker id:

    commit <step> size <n> residual <hash> nonzero <count>    after each commit
    reset size <n> residual <hash> nonzero <count>            after each reset (residuals as kept)
    done step <s> size <n> weights <hash> residual <hash> nonzero <count> resizes <json>
"""
import faulthandler
import hashlib
import json
import os
import signal
import socket
import sys
import time

import horovod.torch as hvd
import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.torch.elastic import ElasticState, run


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    steps, victim, kill_step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rule = sys.argv[4] if len(sys.argv) > 4 else "sum"
    faulthandler.register(signal.SIGUSR1)   # kill -USR1 <pid>: where is a stuck worker?
    me = f"{os.environ.get('HOROVOD_HOSTNAME', socket.gethostname())}:{os.getpid()}"
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression={"method": "topk", "density": 0.1, "policy": {"min_compress_numel": 0}})
    memory = opt.exchange.memory

    def residual_hash() -> str:
        nonzero = sum(int(torch.count_nonzero(t)) for t in memory.residual.values())
        return f"{digest(memory.residual[n] for n in sorted(memory.residual))} nonzero {nonzero}"

    state = ElasticState(model, opt, on_resize=rule, step=0)
    state.register_reset_callbacks([lambda: print(f"{me} reset size {hvd.size()} residual {residual_hash()}",
                                                  flush=True)])

    @run
    def train(state):
        while state.step < steps:
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x = torch.randn(16, 20, generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), (x[:, :3].sum(1) > 0).long()).backward()
            opt.step()
            state.step += 1
            if victim.startswith("+") and hvd.rank() == 0 and state.step == kill_step:
                open(victim[1:], "w").close()   # the discovery script lists one more host from now on
            doomed = victim == f"rank={hvd.rank()}" or os.environ.get("HOROVOD_HOSTNAME") == victim
            if doomed and state.step == kill_step:
                print(f"{me} killing itself after step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
            print(f"{me} commit {state.step} size {hvd.size()} residual {residual_hash()}", flush=True)
            time.sleep(0.05)

    train(state)
    weights = digest(p for p in model.parameters())
    print(f"{me} done step {state.step} size {hvd.size()} weights {weights} residual {residual_hash()} "
          f"resizes {json.dumps(state.resizes)}", flush=True)


if __name__ == "__main__":
    main()
