"""The roofline benchmark's modes run the exchange's own compensation and selection: what they
send and the byte floors they are measured against (redsync_hvd/experiments/roofline.py)."""
import math

import pytest
import torch

from redsync_hvd.core.select import native_available
from redsync_hvd.experiments import roofline


def test_every_mode_sends_what_its_contract_says_and_carries_its_floor():
    n, density = 1 << 16, 0.001
    k = math.ceil(density * n)
    rows = {r["mode"]: r for r in roofline.run_size(n, density, "cpu", "torch", steps=2, warmup=1)}
    assert len(rows) == 6, sorted(rows)
    assert rows["exact-k (radix)"]["sent"] == k and rows["exact-k (radix)"]["floor_B_per_elem"] == 16
    assert rows["trimmed top-k"]["sent"] == k and rows["trimmed top-k"]["floor_B_per_elem"] == 16
    for name, r in rows.items():
        assert k <= r["sent"] <= 8 * k, (name, r["sent"])   # threshold reuse may send up to its cap
        assert r["best_ms"] <= r["ms"] and r["GB_s"] > 0 and r["triad_GB_s"] > 0, r
    assert rows["sampled (DGC)"]["floor_B_per_elem"] == pytest.approx(12.08)


@pytest.mark.skipif(not native_available(), reason="the native kernel fuses the pass")
def test_the_fused_sampled_step_sends_what_the_unfused_one_sends():
    """The same gradients into a fused and an unfused memory: the same positions every step."""
    n, k = 1 << 17, 131
    fused, plain = (roofline.PerLayer("sampled", n, k, "cpu", fuse=f) for f in (True, False))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        assert fused(g) == plain(g)
        assert torch.equal(fused.memory.residual["g"], plain.memory.residual["g"])
