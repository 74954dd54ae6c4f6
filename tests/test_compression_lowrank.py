"""Low-rank codec: fake exact collectives, then real gloo ranks that must agree bit for bit."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_diloco.compression import AdaptivePolicy, get_codec
from megatron_diloco.compression.lowrank import LowRankCodec, init_basis, lowrank_pays_off, matrix_shape
from tests.dist_utils import run_world

LAYOUT_SHAPES = [(64, 48), (32,), (3, 5), (16, 4, 8), (10, 3), (128, 96)]


def _layout(shapes):
    layout, off = [], 0
    for s in shapes:
        layout.append((off, tuple(s)))
        off += math.prod(s)
    return layout, off


def _low_rank_bucket(shapes, rank, seed):
    """A bucket whose matrices have exact rank ``rank`` (1-D/small tensors random)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for s in shapes:
        mn = matrix_shape(s)
        if mn is None:
            parts.append(torch.randn(math.prod(s), generator=g))
        else:
            m, n = mn
            parts.append((torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g)).reshape(-1))
    return torch.cat(parts)


def _twins(t):
    """Fake all-gather over 2 identical replicas: the mean is exact ((t + t) * 0.5 == t)."""
    return torch.stack([t, t])


def test_matrix_view_and_never_inflated():
    assert matrix_shape((16, 4, 8)) == (16, 32) and matrix_shape((7,)) is None
    assert not lowrank_pays_off((32,), 4, 0)  # 1-D
    assert not lowrank_pays_off((10, 3), 4, 0)  # 4 * 13 >= 30
    assert not lowrank_pays_off((64, 48), 4, 4096)  # small
    assert lowrank_pays_off((128, 96), 4, 4096)
    layout, n = _layout(LAYOUT_SHAPES)
    for name in ("lowrank", "lowrank-int8"):
        for rank in (1, 4, 64, 1000):
            codec = get_codec(name, layout, rank=rank)
            codec.min_numel = 0
            assert codec.payload_bytes() <= 4 * n + 16 * len(layout)  # never more than raw (+ alignment)
            for i in codec.lowranked():
                m, k = matrix_shape(layout[i][1])
                assert rank * (m + k) < m * k


def test_shared_basis_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    q1 = init_basis(50, 4, seed=7, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    assert torch.equal(q1, init_basis(50, 4, seed=7, device=torch.device("cpu")))


def test_exact_rank_recovered_with_fake_collective_and_error_feedback():
    layout, n = _layout(LAYOUT_SHAPES)
    v = _low_rank_bucket(LAYOUT_SHAPES, rank=3, seed=1)
    codec = LowRankCodec(layout, rank=3, fallback="none", min_numel=0)
    residual = torch.zeros(n)
    delta = codec.exchange(residual, _twins, pseudo_grad=v)
    low = codec.lowranked()
    assert {layout[i][1] for i in low} == {(64, 48), (16, 4, 8), (128, 96)}
    assert torch.allclose(delta, v, rtol=1e-4, atol=1e-4)  # rank-3 matrices, rank-3 codec
    assert torch.allclose(delta + residual, v, atol=1e-5)  # error feedback: what was not sent
    for i in set(range(len(layout))) - set(low):  # raw fallback: exact
        off, shape = layout[i]
        sl = slice(off, off + math.prod(shape))
        assert torch.equal(delta[sl], v[sl]) and torch.equal(residual[sl], torch.zeros_like(residual[sl]))


def test_warm_start_improves_over_rounds():
    """Power iteration across rounds on a fixed matrix: the rank-2 error falls toward the optimum."""
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(96, 96, generator=g))
    w, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    s = torch.tensor([10.0, 5.0] + [0.5 ** k for k in range(78)])
    m = u[:, :80] @ torch.diag(s) @ w.T
    codec = LowRankCodec([(0, (96, 80))], rank=2, min_numel=0)
    errors = []
    for _ in range(4):
        delta = codec.exchange(torch.zeros(m.numel()), _twins, pseudo_grad=m.reshape(-1))
        errors.append(float((delta.view(96, 80) - m).norm() / m.norm()))
    best = float(s[2:].norm() / s.norm())
    assert errors[-1] < errors[0] and errors[-1] < 1.01 * best


def test_state_dict_round_trip_resumes_exactly():
    layout, n = _layout(LAYOUT_SHAPES)
    a = LowRankCodec(layout, rank=2, factor_format="int8", min_numel=0)
    v1, v2 = torch.randn(n), torch.randn(n)
    ea = torch.zeros(n)
    a.exchange(ea, _twins, pseudo_grad=v1)
    b = LowRankCodec(layout, rank=2, factor_format="int8", min_numel=0)
    b.load_state_dict(a.state_dict())
    eb = ea.clone()
    assert torch.equal(a.exchange(ea, _twins, pseudo_grad=v2), b.exchange(eb, _twins, pseudo_grad=v2))
    assert torch.equal(ea, eb)


class _CountingTwins:
    """Fake all-gather over 2 identical replicas that counts the bytes this rank hands it."""

    def __init__(self):
        self.bytes = 0

    def __call__(self, t):
        self.bytes += t.numel() * t.element_size()
        return torch.stack([t, t])


def test_payload_bytes_are_the_bytes_all_gathered():
    """``payload_bytes()`` is exactly what one replica puts into the round's all-gathers: the factors
    quantized as one P and one Q payload, the fallback as one payload per format (scale headers and
    16-byte alignment included), for every codec, rank and fallback mix."""
    layout, n = _layout(LAYOUT_SHAPES + [(300, 7), (40, 40, 2)])
    v = torch.randn(n, generator=torch.Generator().manual_seed(5))
    codecs = [get_codec(name, layout, rank=rank) for name in ("lowrank", "lowrank-int8") for rank in (1, 3, 9)]
    codecs.append(LowRankCodec(layout, rank={0: 2, 5: 7}, factor_format="int8", fallback={1: "int4", 2: "none"},
                               min_numel=0))
    for budget in (None, 6000):  # adaptive: the budget brings in int4 fallbacks and halved ranks
        codecs.append(get_codec("adaptive", layout, policy=AdaptivePolicy(max_rank=16, min_numel=0,
                                                                           budget_bytes=budget)))
    for codec in codecs:
        low = getattr(codec, "lowrank", codec)
        low.min_numel = 0
        residual = torch.zeros(n)
        for _ in range(2):
            ag = _CountingTwins()
            codec.exchange(residual, ag, pseudo_grad=v)
            assert ag.bytes == codec.payload_bytes() > 0, (codec.name, low.rank, low.fallback)


def test_exchange_writes_out_and_reads_pseudo_grad_first():
    """``out`` may be the pseudo-gradient buffer itself (the exchange buffer of OuterSync), and the
    residual holds v during the round: the result equals a run with separate buffers."""
    layout, n = _layout(LAYOUT_SHAPES)
    v = torch.randn(n, generator=torch.Generator().manual_seed(6))
    e0 = 1e-3 * torch.randn(n, generator=torch.Generator().manual_seed(7))
    a, b = get_codec("lowrank-int8", layout, rank=2), get_codec("lowrank-int8", layout, rank=2)
    ea, eb = e0.clone(), e0.clone()
    da = a.exchange(ea, _twins, pseudo_grad=v.clone())
    buf = v.clone()
    db = b.exchange(eb, _twins, pseudo_grad=buf, out=buf)
    assert db is buf and torch.equal(da, db) and torch.equal(ea, eb)


def _gloo_allgather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _gloo_max(t):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def _worker(rank, world, names):
    for name in names:
        _run_codec(rank, world, name)


def _run_codec(rank, world, name):
    layout, n = _layout(LAYOUT_SHAPES)
    budget = name == "adaptive-budget"
    name = "adaptive" if budget else name
    codec = get_codec(name, layout, rank=3)
    codec_min = getattr(codec, "lowrank", codec)
    codec_min.min_numel = 0
    if name == "adaptive":
        codec.policy.min_numel = 0
        codec.policy.reevaluate_every = 2
    if budget:  # each replica measures its own step time: budgets differ, the plan must not
        codec.policy.budget_bytes = 1200 + 400 * rank  # the free plan is ~1.7 KB
    residual = torch.zeros(n)
    for rnd in range(3):
        anchor = torch.randn(n, generator=torch.Generator().manual_seed(100 + rnd))
        x = anchor - _low_rank_bucket(LAYOUT_SHAPES, 4, seed=10 * rank + rnd) - 0.01 * torch.randn(n)
        extra = {"agree": _gloo_max} if name == "adaptive" else {}
        delta = codec.exchange(residual, _gloo_allgather, anchor=anchor, x=x.to(torch.bfloat16), **extra)
        everyone = _gloo_allgather(delta)
        for r in range(world):
            assert torch.equal(everyone[r].view(torch.int32), delta.view(torch.int32)), (name, rnd, r)
        assert torch.isfinite(delta).all() and delta.abs().sum() > 0
        if budget:  # the group's smallest budget binds everyone
            assert sum(c.bytes for c in codec.policy.plan) <= 1200 and not codec.policy.over_budget


def test_gloo_replicas_decode_bit_identical():
    """Different pseudo-gradients per replica; every rank decodes the same Delta, bit for bit
    (adaptive-budget: with a different byte budget on each replica)."""
    run_world(_worker, 2, ("lowrank", "lowrank-int8", "adaptive", "adaptive-budget", "int8", "none"))
