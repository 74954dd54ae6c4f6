"""Adaptive policy on synthetic matrices with known spectra: ranks follow the decay, bytes obey the cap."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.algorithm.compression.policy import AdaptivePolicy, byte_budget, energy_curve


def _with_spectrum(m, n, sigma, seed):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(sigma), generator=g))
    w, _ = torch.linalg.qr(torch.randn(n, len(sigma), generator=g))
    return u @ torch.diag(sigma) @ w.T  # (m, n)


def _exact_rank(sigma, target):
    energy = sigma.double().square().cumsum(0) / sigma.double().square().sum()
    return int((energy >= target).nonzero()[0]) + 1


@pytest.mark.parametrize("decay", [0.97, 0.9, 0.7, 0.4])
def test_energy_curve_matches_known_spectrum(decay):
    sigma = decay ** torch.arange(60, dtype=torch.float32)
    mat = _with_spectrum(200, 150, sigma, seed=1)
    curve = energy_curve(mat, max_rank=32, seed=5)
    exact = (sigma.double().square().cumsum(0) / sigma.double().square().sum())[:32].float()
    assert torch.allclose(curve, exact, atol=0.02)


def test_rank_falls_as_spectrum_decays():
    layout = [(0, (200, 150))]
    ranks = []
    for decay in (0.97, 0.9, 0.7, 0.4):
        sigma = decay ** torch.arange(60, dtype=torch.float32)
        policy = AdaptivePolicy(energy_target=0.9, max_rank=48, min_numel=0)
        plan = policy.choose(_with_spectrum(200, 150, sigma, seed=2).reshape(-1), layout, round_index=1)
        ranks.append(plan[0].rank)
        assert abs(plan[0].rank - _exact_rank(sigma, 0.9)) <= 1
    assert ranks == sorted(ranks, reverse=True) and ranks[-1] < ranks[0]


def test_reevaluated_every_k_rounds_only():
    layout = [(0, (200, 150))]
    slow = _with_spectrum(200, 150, 0.95 ** torch.arange(60, dtype=torch.float32), seed=3).reshape(-1)
    fast = _with_spectrum(200, 150, 0.3 ** torch.arange(60, dtype=torch.float32), seed=3).reshape(-1)
    policy = AdaptivePolicy(energy_target=0.9, max_rank=48, reevaluate_every=3, min_numel=0)
    r1 = policy.choose(slow, layout, 1)[0].rank
    assert policy.choose(fast, layout, 2)[0].rank == r1  # cached
    assert policy.choose(fast, layout, 3)[0].rank == r1
    assert policy.choose(fast, layout, 4)[0].rank < r1  # re-evaluated


def test_small_and_1d_tensors_are_quantized_not_lowranked():
    layout = [(0, (300,)), (300, (8, 8)), (364, (200, 150))]
    bucket = torch.randn(364 + 200 * 150)
    plan = AdaptivePolicy(energy_target=0.99, max_rank=64).choose(bucket, layout, 1)
    assert plan[0].rank == 0 and plan[1].rank == 0  # 1-D, small
    assert plan[2].rank == 0  # white noise: the needed rank would not pay off -> int8
    assert plan[2].bytes <= 200 * 150 + 4 * 200 * 150 // 256 + 16


def test_byte_budget_caps_the_plan():
    layout, off = [], 0
    for shape in [(256, 192), (128, 64), (512,), (96, 96)]:
        layout.append((off, shape))
        off += shape[0] * (shape[1] if len(shape) > 1 else 1)
    g = torch.Generator().manual_seed(4)
    bucket = torch.randn(off, generator=g)
    for (o, shape), decay in zip(layout, (0.8, 0.9, None, 0.7)):  # matrices with decaying spectra
        if decay is not None:
            m, n = shape
            sigma = decay ** torch.arange(min(m, n), dtype=torch.float32)
            bucket[o: o + m * n] = _with_spectrum(m, n, sigma, seed=o).reshape(-1)
    free = AdaptivePolicy(energy_target=0.95, max_rank=32, min_numel=0).choose(bucket, layout, 1)
    free_bytes = sum(c.bytes for c in free)
    assert [c.rank > 0 for c in free] == [True, True, False, True]
    for frac in (0.8, 0.5, 0.25):
        budget = frac * free_bytes
        policy = AdaptivePolicy(energy_target=0.95, max_rank=32, min_numel=0, budget_bytes=budget)
        plan = policy.choose(bucket, layout, 1)
        assert sum(c.bytes for c in plan) <= budget and not policy.over_budget
        assert all(c.rank <= f.rank for c, f in zip(plan, free))
    tiny = AdaptivePolicy(energy_target=0.95, max_rank=32, min_numel=0, budget_bytes=10)
    plan = tiny.choose(bucket, layout, 1)
    assert tiny.over_budget and all(c.rank in (0, 1) for c in plan)


def test_over_budget_quantized_matrices_fall_back_to_low_rank():
    """White-noise matrices (no rank reaches the energy target: quantized int8) under a cap below
    their int4 size: the plan factors the largest ones instead of giving up over budget."""
    layout, off = [], 0
    for shape in [(256, 192), (192, 128), (128, 96), (300,)]:
        layout.append((off, shape))
        off += shape[0] * (shape[1] if len(shape) > 1 else 1)
    bucket = torch.randn(off, generator=torch.Generator().manual_seed(7))
    free = AdaptivePolicy(energy_target=0.9, max_rank=16, min_numel=0).choose(bucket, layout, 1)
    assert all(c.rank == 0 and c.fmt == "int8" for c in free)
    budget = 0.25 * sum(c.bytes for c in free)  # about half of what all-int4 would take
    policy = AdaptivePolicy(energy_target=0.9, max_rank=16, min_numel=0, budget_bytes=budget)
    plan = policy.choose(bucket, layout, 1)
    assert sum(c.bytes for c in plan) <= budget and not policy.over_budget
    assert any(c.rank > 0 for c in plan)  # factored where int4 was not small enough
    assert plan[3].rank == 0  # 1-D: never factored
    for c, (_, shape) in zip(plan, layout):
        if c.rank:
            assert 1 <= c.rank <= 16 and c.fmt == "int8"


def test_byte_budget_formula_and_validation():
    assert byte_budget(125e6, 100, 0.5) == 125e6 * 50  # 1 Gbit/s, H = 100 steps of 0.5 s
    with pytest.raises(ValueError, match="--diloco-x-energy"):
        AdaptivePolicy(energy_target=1.5)
