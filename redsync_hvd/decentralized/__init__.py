"""Decentralized compressed training (DCD-PSGD, ECD-PSGD; Tang et al., NeurIPS 2018).

No global reduction: each worker mixes its model with its neighbours' through a
mixing matrix W (``topology``), exchanging compressed messages with its
neighbours only (``exchange``: through Horovod, or mpi4py without it), with the
quantisers in ``quantizers``; the update rules are in ``algorithms``.
Framework-neutral: flat fp32 torch tensors in, in-place updates out. Importing this package does not initialise MPI.

    import horovod.torch as hvd; hvd.init()
    from redsync_hvd.decentralized import build_algorithm
    algo = build_algorithm("dcd", quantizer="minmax", bits=8)       # ring over Horovod's ranks
    params = [p.data.view(-1) for p in model.parameters()]
    ... loss.backward(); algo.step(params, [p.grad for p in model.parameters()], lr)
"""
from .algorithms import (
                         ALGORITHMS,
                         DCD,
                         DPSGD,
                         ECD,
                         METHODS,
                         DecentralizedAlgorithm,
                         NaiveCompressed,
                         build_algorithm,
                         optimizer_step_as_gradient,
)
from .exchange import (
                       ExchangeBase,
                       HorovodExchange,
                       NeighborExchange,
                       ThreadedExchange,
                       ThreadedGroup,
                       check_world,
                       pack,
                       unpack,
)
from .quantizers import (
                         FixedGridQuantizer,
                         IdentityQuantizer,
                         MinMaxQuantizer,
                         Quantizer,
                         TopKSparsifier,
                         build_quantizer,
)
from .topology import Topology, from_config, from_matrix, from_yaml, ring

__all__ = ["ALGORITHMS", "DCD", "DPSGD", "ECD", "METHODS", "DecentralizedAlgorithm", "NaiveCompressed",
           "build_algorithm", "optimizer_step_as_gradient", "ExchangeBase", "HorovodExchange",
           "NeighborExchange", "ThreadedExchange",
           "ThreadedGroup", "check_world",
           "pack", "unpack", "FixedGridQuantizer", "IdentityQuantizer", "MinMaxQuantizer", "Quantizer",
           "TopKSparsifier", "build_quantizer", "Topology", "from_config", "from_matrix", "from_yaml", "ring"]
