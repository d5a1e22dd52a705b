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
    assert rows["trimmed top-k"]["sent"] == k and rows["trimmed top-k"]["floor_B_per_elem"] == 12
    for name, r in rows.items():
        assert k <= r["sent"] <= 8 * k, (name, r["sent"])   # threshold reuse may send up to its cap
        assert r["best_ms"] <= r["ms"] and r["GB_s"] > 0 and r["triad_GB_s"] > 0, r
    assert rows["sampled (DGC)"]["floor_B_per_elem"] == pytest.approx(12.08)


@pytest.mark.skipif(not native_available(), reason="the native kernel fuses the pass")
def test_the_fused_sampled_step_sends_what_the_unfused_one_sends(monkeypatch):
    """The same gradients into a fused and an unfused memory: the same positions every step. The
    fused step samples once (the compensating pass, from r + g), the unfused one once (the search,
    from x): the search takes the fused pass's threshold rather than sample x again."""
    from redsync_hvd.core.select import native, searches
    taken = []

    def counted(where, real):
        def sample(*a, **kw):
            taken.append(where)
            return real(*a, **kw)
        return sample
    monkeypatch.setattr(native, "sample_threshold", counted("pass", native.sample_threshold))
    monkeypatch.setattr(searches, "sample_threshold", counted("search", searches.sample_threshold))
    n, k = 1 << 17, 131
    fused, plain = (roofline.PerLayer("sampled", n, k, "cpu", fuse=f) for f in (True, False))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        taken.clear()
        sent = fused(g)
        assert taken == ["pass"], taken
        assert sent == plain(g) and taken == ["pass", "search"], taken
        assert torch.equal(fused.memory.residual["g"], plain.memory.residual["g"])


def test_the_steady_residual_is_where_the_exchanges_own_loop_settles():
    """From a zero residual, TBS with threshold reuse at density 0.01 settles within a few T**2
    steps to the threshold and spread that ``steady_residual`` starts at. From that start it
    searches only on schedule (every REUSE-th step) from the first step on, where a Gaussian
    residual of that threshold's scale goes stale: its tail is sent in the first steps, so the
    reused thresholds catch too few and it searches nearly every step."""
    n, density, steps, first = 1 << 15, 0.01, 150, 20
    k = math.ceil(density * n)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]

    def run(start, count):
        step = roofline.PerLayer("tbs", n, k, "cpu", reuse=roofline.REUSE)
        step.memory.residual["g"] = start
        for g in grads[:count]:
            step(g)
        return step

    settled = run(torch.zeros(n), steps)
    steady = roofline.steady_residual(n, roofline.SENT_PER_K * k / n, "cpu")
    started = run(steady.clone(), 1)
    assert started.state.threshold == pytest.approx(settled.state.threshold, rel=0.15)
    assert steady.std().item() == pytest.approx(settled.memory.residual["g"].std().item(), rel=0.15)
    on_schedule = run(steady.clone(), first).state.searches
    assert on_schedule <= first // roofline.REUSE + 2, on_schedule
    gaussian = torch.randn(n, generator=torch.Generator().manual_seed(4)) * started.state.threshold
    assert run(gaussian, first).state.searches > 2 * on_schedule
