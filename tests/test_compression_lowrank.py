"""Low-rank codec: fake exact collectives, then real gloo ranks that must agree bit for bit."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.compression import AdaptivePolicy, get_codec
from megatron_diloco.algorithm.compression.lowrank import LowRankCodec, init_basis, lowrank_pays_off, matrix_shape
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
    """The basis is ``torch.randn`` after ``torch.manual_seed(seed)`` (the bases of checkpoints
    written so far), drawn without touching any global generator: the CPU one, nor (on a GPU) the
    CUDA default generator that the training loop's dropout draws from while the worker thread
    builds bases."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    q1 = init_basis(50, 4, seed=7, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    if cuda_before is not None:
        init_basis(50, 4, seed=7, device=torch.device("cuda"))
        assert torch.equal(torch.cuda.get_rng_state(), cuda_before)
    torch.manual_seed(99)
    assert torch.equal(q1, init_basis(50, 4, seed=7, device=torch.device("cpu")))
    torch.manual_seed(7)
    assert torch.equal(q1, torch.randn(50, 4))


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


def _shared_subspace_bucket(shapes, seed, replica):
    """Matrices ``U diag(s_r) W^T`` with ``U``, ``W`` (rank 2) shared by all replicas and a flat
    replica-specific spectrum ``s_r`` (the best rank 1 holds < 90 % of the energy), so every replica's
    matrix and the replicas' exact mean have rank 2; 1-D/small tensors random per replica."""
    g = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1 + replica)
    s = torch.tensor([1.0 + 0.3 * replica, 0.8 - 0.2 * replica])  # (2,)
    parts = []
    for shape in shapes:
        mn = matrix_shape(shape)
        if mn is None:
            parts.append(torch.randn(math.prod(shape), generator=own))
        else:
            u, _ = torch.linalg.qr(torch.randn(mn[0], 2, generator=g))
            w, _ = torch.linalg.qr(torch.randn(mn[1], 2, generator=g))
            parts.append((u * s @ w.T * math.sqrt(mn[0] * mn[1])).reshape(-1))
    return torch.cat(parts)


#: Half a quantization step, relative to the block's absmax, of the blockwise formats.
HALF_STEP = {"int8": 0.5 / 127, "int4": 0.5 / 7}
#: Largest ||decoded - exact mean|| / ||exact mean|| of a low-ranked tensor whose replicas' matrices
#: have rank 2 <= its rank (round 0). fp32 factors: P P^T M == M, up to fp32 rounding of the products
#: (measured <= 3e-7). int8 factors: one int8 rounding of P and of Q, in blocks shared with the
#: bucket's other factors: a tensor whose factors are small next to the block's absmax gets a
#: coarser step (measured <= 3.6 %, the (10, 3) tensor; 0.9-1.8 % for the others).
EXACT_RANK_RTOL = {"lowrank": 1e-5, "lowrank-int8": 5e-2}


def _how_sent(codec, index):
    """``(kind, rank)`` of tensor ``index`` in the last round: kind ``"lowrank"``/``"lowrank-int8"``
    (factors), ``"int8"``/``"int4"`` (blockwise) or ``"none"`` (raw fp32)."""
    low = getattr(codec, "lowrank", codec)
    if not isinstance(low, LowRankCodec):  # the blockwise int8 / raw codecs
        return codec.name, 0
    if index in low.lowranked():
        return low.name, low.rank_of(index)
    return low.fallback_of(index), 0


def _quantization_bound(codec, layout, vs):
    """fp64 ``[N]``: for each element sent blockwise, mean_r of half the quantization step of the
    block replica r's value fell in (0 elsewhere): a bound on |mean_r e_r|, the decoded mean's error.
    The tensors of one format are concatenated in layout order and blocked together, as sent."""
    block = getattr(getattr(codec, "lowrank", codec), "block_size", None)
    bound = torch.zeros(vs.shape[1], dtype=torch.float64)
    groups: dict[str, list[tuple[int, int]]] = {}
    for i, (off, shape) in enumerate(layout):
        kind, _ = _how_sent(codec, i)
        if kind in HALF_STEP:
            groups.setdefault(kind, []).append((off, math.prod(shape)))
    for fmt, spans in groups.items():
        sub = torch.cat([vs[:, o: o + k] for o, k in spans], dim=1).abs()  # (R, K)
        k_all = sub.shape[1]
        nb = -(-k_all // block)
        absmax = torch.nn.functional.pad(sub, (0, nb * block - k_all)).view(len(vs), nb, block).amax(2)
        half = (absmax * HALF_STEP[fmt]).mean(0).repeat_interleave(block)[:k_all]  # (K,)
        start = 0
        for o, k in spans:
            bound[o: o + k] = half[start: start + k]
            start += k
    return bound


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
    for rnd in range(4):
        extra = {"agree": _gloo_max} if name == "adaptive" else {}
        if rnd == 0:  # rank-2 matrices (the same column/row spaces on every replica), fp32
            pg = {"pseudo_grad": _shared_subspace_bucket(LAYOUT_SHAPES, seed=50, replica=rank)}
            v = residual + pg["pseudo_grad"]
        else:  # general: different rank-4 matrices per replica + noise, params in bf16
            anchor = torch.randn(n, generator=torch.Generator().manual_seed(100 + rnd))
            x = anchor - _low_rank_bucket(LAYOUT_SHAPES, 4, seed=10 * rank + rnd) - 0.01 * torch.randn(n)
            pg = {"anchor": anchor, "x": x.to(torch.bfloat16)}
            v = residual + (anchor - pg["x"].float())  # the codec's own fp32 operations
        vs = _gloo_allgather(v).double()  # (R, n): every replica's codec input
        delta = codec.exchange(residual, _gloo_allgather, **pg, **extra)
        # (a) every rank decoded the same bits
        everyone = _gloo_allgather(delta)
        for r in range(world):
            assert torch.equal(everyone[r].view(torch.int32), delta.view(torch.int32)), (name, rnd, r)
        assert torch.isfinite(delta).all()
        exact = vs.mean(0)  # (n,) the exact mean of the replicas' inputs
        # (b) the codec's own accounting: replica r sent v_r - e_r, so Delta == mean_r(v_r - e_r)
        sent = exact - _gloo_allgather(residual).double().mean(0)
        quant = _quantization_bound(codec, layout, vs)
        for i, (off, shape) in enumerate(layout):
            sl = slice(off, off + math.prod(shape))
            d, ex = delta[sl].double(), exact[sl]
            kind, r = _how_sent(codec, i)
            where = (name, budget, rnd, i, kind, r)
            # a few fp32 roundings of the products and sums (measured <= 6.4e-8 of the norm)
            assert float((d - sent[sl]).norm()) <= 1e-6 * float(vs[:, sl].norm(dim=1).max()), where
            # (c) against the exact mean
            rel = float((d - ex).norm() / ex.norm())
            if kind in HALF_STEP:  # |Delta - exact| = |mean_r e_r| <= mean_r half step (+ the mean's rounding)
                assert ((d - ex).abs() <= quant[sl] * (1 + 1e-6) + 2.0 ** -23 * d.abs()).all(), where
            elif kind == "none":  # raw fp32: one rounding of the sum
                assert rel <= 1e-6, (where, rel)
            elif rnd == 0 and r >= 2:  # rank-2 inputs, rank-r factors: the exact mean, up to rounding
                assert rel <= EXACT_RANK_RTOL[kind], (where, rel)
            else:  # general inputs: a projection of the mean, closer to it than sending nothing
                assert rel < 1.0, (where, rel)
                if kind == "lowrank":  # fp32 factors: Delta = P P^T mean(M), the error is orthogonal to it
                    assert abs(float(torch.dot(d, ex - d))) <= 1e-6 * float(ex.norm()) ** 2, where  # measured 7e-8
        if budget:  # the group's smallest budget binds everyone
            assert sum(c.bytes for c in codec.policy.plan) <= 1200 and not codec.policy.over_budget


def test_gloo_replicas_decode_bit_identical():
    """Different pseudo-gradients per replica; every rank decodes the same Delta, bit for bit
    (adaptive-budget: with a different byte budget on each replica), and it is the replicas' mean
    input minus their mean residual; against the exact mean: exact for rank-2 inputs (round 0, up to
    rounding / the int8 factors), within half a step for blockwise-sent tensors, and for general
    inputs closer than sending nothing (fp32 factors: an orthogonal projection of it)."""
    run_world(_worker, 2, ("lowrank", "lowrank-int8", "adaptive", "adaptive-budget", "int8", "none"))
