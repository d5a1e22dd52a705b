"""Ranks passing different compression configs get the same clear error, not a hang."""
import torch

import redsync_hvd.torch as rhvd

rhvd.init()
model = torch.nn.Linear(4, 2)
density = 0.01 if rhvd.rank() == 0 else 0.02
try:
    rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              compression={"method": "topk", "density": density})
except ValueError as exc:
    assert "different compression config" in str(exc), exc
    print(f"rank {rhvd.rank()}: OK mismatch detected: {exc}")
else:
    raise SystemExit("mismatched configs were not detected")
