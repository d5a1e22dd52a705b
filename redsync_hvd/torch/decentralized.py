"""DistributedOptimizer for the decentralized methods (dcd, ecd, dpsgd, naive): no allreduce.

The wrapped optimizer computes its usual local update (momentum, weight decay,
schedules); that update is handed to the gossip algorithm as the gradient step
(lr = 1), which mixes the model with its neighbours' (compressed) messages.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..decentralized import build_algorithm
from ..engine import parse
from .params import resolve_names


class _DecentralizedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, config):
        super(self.__class__, self).__init__(params)
        self._dparams = [p for _, p in resolve_names(named_parameters, self.param_groups)]
        self._algo = build_algorithm(config.method, topology=config.topology, quantizer=config.quantizer,
                                     bits=config.bits, step=config.step, density=config.density,
                                     unbiased=config.unbiased, seed=config.seed)
        self.compression_config = config
        self._last = 0
        self._last_times = {"gossip": 0.0, "communicate": 0.0}

    @torch.no_grad()
    def step(self, closure=None):
        before = [p.detach().clone() for p in self._dparams]
        loss = super(self.__class__, self).step(closure)
        grads = [(b - p.detach()).view(-1) for p, b in zip(self._dparams, before)]
        for p, b in zip(self._dparams, before):
            p.copy_(b)
        ex_stats = self._algo.ex.stats   # the exchange's running totals (no summary dict per step)
        comm0, t0 = ex_stats["time_communicate"], time.perf_counter()
        self._algo.step([p.data.view(-1) for p in self._dparams], grads, lr=1.0)
        comm = ex_stats["time_communicate"] - comm0
        self._last_times = {"gossip": time.perf_counter() - t0 - comm, "communicate": comm}
        return loss

    def synchronize(self):
        pass

    def set_grad_scaler(self, scaler):
        pass   # the gradients stay local: the scaler checks them itself

    @contextmanager
    def skip_synchronize(self):
        yield

    def set_steps_per_epoch(self, steps):
        pass   # no density schedule

    def layer_decisions(self):
        return []

    def consensus_distance(self) -> float:
        """Mean over workers of ||x_i - mean x|| (an allreduce, counted as eval bytes)."""
        return self._algo.consensus_distance([p.data for p in self._dparams])

    @contextmanager
    def averaged_parameters(self):
        """Swap in the average of all workers' models (allreduce, counted as eval bytes), then restore."""
        local = [p.detach().clone() for p in self._dparams]
        with torch.no_grad():
            for p, a in zip(self._dparams, self._algo.average_model([p.data for p in self._dparams])):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(self._dparams, local):
                    p.copy_(x)

    def communication_stats(self) -> dict:
        s = self._algo.stats()
        sent = int(s.get("bytes_sent", 0))
        last, self._last = sent - self._last, sent
        return {"wire_bytes": sent, "dense_bytes": int(s["dense_bytes"]), "compression_ratio": s["compression_ratio"],
                "steps": s["steps"], "select": 0.0, "communicate": float(s.get("time_communicate", 0.0)),
                "decompress": 0.0, "setup_bytes": int(s.get("setup_bytes", 0)),
                "eval_bytes": int(s.get("eval_bytes", 0)),
                "message_bytes": int(s.get("message_bytes", 0)), "clipped": s.get("clipped"),
                # the last step: the neighbour exchange, and the gossip step's local work (mixing,
                # compressing, decoding) as "select"; the optimizer's own update counts as compute
                "last_step": {"wire_bytes": last, "time_select": self._last_times["gossip"],
                              "time_communicate": self._last_times["communicate"], "time_decompress": 0.0},
                "layers": {}}

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["decentralized"] = self._algo.state_dict()   # replicas are per rank: one checkpoint per rank
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            self._algo.load_state_dict(extra)


def DecentralizedOptimizer(optimizer, named_parameters=None, algorithm=None):
    """Wrap ``optimizer`` for decentralized training: its local update, then gossip with the
    ring neighbours (``algorithm``: the YAML ``compression:`` dict of dcd, ecd, dpsgd or naive)."""
    config = parse(algorithm)
    if config.strategy != "decentralized":
        raise ValueError(f"compression.method={config.method!r} is not decentralized; use DistributedOptimizer")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DecentralizedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, config)
