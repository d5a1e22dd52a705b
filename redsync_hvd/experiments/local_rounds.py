"""What an exchange of local steps costs beside a local step, on the bench's VGG-FC.

    horovodrun -np 2 --gloo .venv/bin/python -m redsync_hvd.experiments.local_rounds --rounds 10
    horovodrun -np 2 --gloo .venv/bin/python -m redsync_hvd.experiments.local_rounds --cprofile 25

1. Build the bench's VGG-FC (``netbench/worker.py``'s model and synthetic batches) under
   ``redsync_hvd.torch.DistributedOptimizer`` with ``--compression`` (RedSync's default with a
   static policy, so every launch compresses the same layers), one torch thread per rank.
2. Train one untimed round, then ``--rounds`` rounds, timing every step (forward, backward and
   ``step()``); after each exchange, read the exchange's timed phases.
3. Rank 0 prints one line: the mean exchange step, the mean local step and the mean step of a
   round; with ``--cprofile N``, the N functions with the most own time inside the exchange
   steps' ``step()``.

Compare commits by running the same command at each (the ranks share the machine's cores, so run
it on a quiet machine, twice, alternating).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

import redsync_hvd.torch as rhvd

from .netbench import worker

DEFAULT = {"method": "redsync", "policy": {"mode": "static"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds after one untimed")
    ap.add_argument("--compression", default=json.dumps(DEFAULT), help="JSON compression config")
    ap.add_argument("--cprofile", type=int, default=0, help="print this many functions by own time")
    a = ap.parse_args()
    torch.set_num_threads(1)                                                                    # 1.
    rhvd.init()
    spec = {**worker.DEFAULTS, "model_options": {"fc_width": 4096, "width": 0.25}}
    model = worker.build(spec)
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=json.loads(a.compression))
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    every = opt.compression_config.local_steps
    batches, profile = worker.make_batches(spec, rhvd.rank()), cProfile.Profile()
    exchanges, local, phases = [], [], []
    for i in range(every * (a.rounds + 1)):                                                     # 2.
        x, y = batches[i % len(batches)]
        ends_round, timed = (i + 1) % every == 0, i >= every
        t0 = time.perf_counter()
        loss = worker.loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        if a.cprofile and ends_round and timed:
            profile.enable()
        opt.step()
        profile.disable()
        dt = time.perf_counter() - t0
        if timed:
            (exchanges if ends_round else local).append(dt)
        if timed and ends_round:
            last = opt.communication_stats()["last_step"]
            phases.append({k[5:]: v for k, v in last.items() if k.startswith("time_") and "[" not in k})
    if rhvd.rank() == 0:                                                                        # 3.
        mean = {k: statistics.fmean(p[k] for p in phases) for k in phases[0]}
        print(json.dumps({"local_steps": every, "exchange_step_s": statistics.fmean(exchanges),
                          "local_step_s": statistics.fmean(local) if local else None,
                          "round_step_s": (sum(exchanges) + sum(local)) / (len(exchanges) + len(local)),
                          "exchange_phases_s": mean}), flush=True)
        if a.cprofile:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.cprofile)
            print(out.getvalue())


if __name__ == "__main__":
    main()
