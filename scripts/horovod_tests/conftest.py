"""Horovod 0.28.1's own test/parallel/test_torch.py with ``hvd.DistributedOptimizer`` and
``hvd.broadcast_optimizer_state`` replaced by ours (``REDSYNC_METHOD``: unset for plain Horovod,
none, redsync; ``REDSYNC_CHECK_FINITE=0`` or ``1`` sets the finite check, unset leaves the method's
default: off for none, as Horovod, on for RedSync, which keeps a residual). run.sh copies Horovod's
test file next to this one and starts it; see docs/horovod_api.md."""
import os

import horovod.torch as hvd
import torch

# RedSync at density 1, unquantised, no momentum correction, every layer compressed: an exact average
EXACT = {"method": "redsync", "density": 1.0, "message": {"quantize": "none"}, "dgc": {"momentum_correction": False},
         "policy": {"min_compress_numel": 0}, "selection": {"method": "tbs"}}
METHOD = os.environ.get("REDSYNC_METHOD")

if METHOD:
    import redsync_hvd.torch as rhvd

    compression = EXACT if METHOD == "redsync" else {"method": METHOD}
    if os.environ.get("REDSYNC_CHECK_FINITE"):
        compression = {**compression, "check_finite": os.environ["REDSYNC_CHECK_FINITE"] != "0"}

    def DistributedOptimizer(optimizer, named_parameters=None, compression_=None, *args, **kwargs):
        """horovod.torch's signature; its ``compression`` (Horovod's fp16 cast) gives way to ours."""
        kwargs.pop("compression", None)
        return rhvd.DistributedOptimizer(optimizer, named_parameters, compression, *args, **kwargs)

    hvd.DistributedOptimizer = DistributedOptimizer
    hvd.broadcast_optimizer_state = rhvd.broadcast_optimizer_state

# torch >= 2.9's Muon takes only 2D parameters, which these tests' models do not all have (plain
# Horovod fails on it too): leave it out of the optimizer lists they build by module name
if hasattr(torch.optim, "Muon"):
    torch.optim.Muon.__module__ = "excluded"
