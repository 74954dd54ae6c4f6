"""The boundary protocol on plain tensors over real gloo groups, against hand-computed sequences."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from megatron_diloco.algorithm.schedule import RoundSchedule
from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.outer import OuterNesterov
from megatron_diloco.algorithm.shard_view import ShardView, fingerprint
from megatron_diloco.algorithm.sync import OuterSync
from tests.dist_utils import run_world

H, ROUNDS = 3, 5


def grad(r: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """A deterministic, replica-dependent, parameter-dependent 'gradient'."""
    return torch.sin(x * (r + 1) + step) + 0.1 * (r - 0.5)


def reference(R: int, overlap: str, x0: torch.Tensor, lr_in: float, cfg: DiLoCoXConfig,
              homogeneous: bool = False) -> list:
    """Straight-line re-statement of the overlap rules (docs/design.md, sync.py), one
    process. Returns, per boundary, the list of the R replicas' params after it. ``homogeneous``:
    every replica sees replica 0's gradients."""
    theta = x0.clone()
    m = torch.zeros_like(theta)
    xs = [x0.clone() for _ in range(R)]
    starts = [x0.clone() for _ in range(R)]
    c = cfg.outer_lr * ((1 + cfg.outer_momentum) if cfg.nesterov else 1.0)
    w = cfg.eager_weight if cfg.eager_weight is not None else 1.0 / R
    pending = None
    trace = []
    step = 0
    for _t in range(ROUNDS):
        for _ in range(H):
            for r in range(R):
                xs[r] = xs[r] - lr_in * grad(0 if homogeneous else r, step, xs[r])
            step += 1
        own = [starts[r] - xs[r] for r in range(R)]
        delta = sum(own) / R
        apply = delta if overlap == "none" else pending
        pending = delta
        if apply is not None:
            m = cfg.outer_momentum * m + apply
            upd = apply + cfg.outer_momentum * m if cfg.nesterov else m
            theta = theta - cfg.outer_lr * upd
        if overlap == "eager":
            starts = [theta - c * w * own[r] for r in range(R)]
        else:
            starts = [theta.clone() for _ in range(R)]
        xs = [s.clone() for s in starts]
        trace.append([x.clone() for x in xs])
    if overlap != "none":
        m = cfg.outer_momentum * m + pending
        theta = theta - cfg.outer_lr * ((pending + cfg.outer_momentum * m) if cfg.nesterov else m)
        trace.append([theta.clone() for _ in range(R)])
    return trace


def eager_paper(R: int, x0: torch.Tensor, lr_in: float, eta: float) -> list:
    """Kale, Douillard, Donchev 2025 (eager updates), outer SGD without momentum, as the paper states
    it: every replica keeps its own outer params and applies its own fresh pseudo-gradient mixed with
    the others' one-round-stale ones. Returns per boundary the replicas' params."""
    thetas = [x0.clone() for _ in range(R)]
    xs = [x0.clone() for _ in range(R)]
    stale = [torch.zeros_like(x0) for _ in range(R)]
    trace, step = [], 0
    for _t in range(ROUNDS):
        for _ in range(H):
            for r in range(R):
                xs[r] = xs[r] - lr_in * grad(r, step, xs[r])
            step += 1
        fresh = [thetas[r] - xs[r] for r in range(R)]
        for r in range(R):
            mixed = (fresh[r] + sum(stale[q] for q in range(R) if q != r)) / R
            thetas[r] = thetas[r] - eta * mixed
        stale = fresh
        xs = [t.clone() for t in thetas]
        trace.append([x.clone() for x in xs])
    return trace


def _worker(rank: int, world: int, overlap: str, nesterov: bool, momentum: float = 0.9,
            eager_weight: float | None = None, homogeneous: bool = False) -> None:
    cfg = DiLoCoXConfig(compression="none", replicas=world, local_steps=H, outer_lr=0.7, outer_momentum=momentum,
                        nesterov=nesterov, overlap=overlap, eager_weight=eager_weight)
    g_rank = 0 if homogeneous else rank
    x0 = torch.linspace(-1, 1, 7)
    # Two shard tensors of odd shapes, as a distributed optimizer would hand them over.
    a, b = x0[:3].clone().view(3, 1), x0[3:].clone()
    view = ShardView([a, b])
    sync = OuterSync(view, cfg, dist.group.WORLD)
    step = 0
    got = []
    for _t in range(ROUNDS):
        for _ in range(H):
            x = torch.cat([a.view(-1), b])
            x = x - 0.05 * grad(g_rank, step, x)
            a.copy_(x[:3].view(3, 1)); b.copy_(x[3:])
            step += 1
        report = sync.boundary()
        assert report.applied == (overlap == "none" or _t > 0)
        got.append(torch.cat([a.view(-1), b]).clone())
        # replicas identical after every boundary, bit for bit: the params (none / delayed), the
        # shared outer state (eager: the params differ by each replica's own look-ahead)
        shared = [sync.theta, sync.outer.momentum_buffer] if momentum else [sync.theta]
        fp = fingerprint(shared if overlap == "eager" else [a, b])
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        assert all(torch.equal(allfp[0], f) for f in allfp), allfp
    if overlap != "none":
        sync.drain()
        got.append(torch.cat([a.view(-1), b]).clone())
    want = reference(world, overlap, x0, 0.05, cfg, homogeneous)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w[rank], rtol=1e-6, atol=1e-6, msg=f"boundary {i}")
    if overlap == "eager":
        if not homogeneous:
            assert not torch.equal(want[0][0], want[0][1])  # the look-ahead is replica-specific
        if momentum == 0.0 and eager_weight is None:  # the paper's own statement of the rule, per-replica outer params
            paper = eager_paper(world, x0, 0.05, cfg.outer_lr)
            for i, (g, w) in enumerate(zip(got, paper)):
                torch.testing.assert_close(g, w[rank], rtol=1e-6, atol=1e-6, msg=f"eager boundary {i}")


def test_delayed_matches_hand_sequence():
    run_world(_worker, 2, "delayed", True)


def test_none_matches_hand_sequence():
    run_world(_worker, 2, "none", True)


def test_delayed_three_replicas_heavy_ball():
    run_world(_worker, 3, "delayed", False)


def test_eager_matches_hand_sequence_nesterov():
    run_world(_worker, 2, "eager", True)


def test_eager_without_momentum_is_kale_et_al():
    """mu = 0: the eager rule equals the paper's own per-replica statement, three replicas."""
    run_world(_worker, 3, "eager", False, 0.0)


def test_eager_weight_matches_hand_sequence():
    """--diloco-x-eager-weight 0.4, Nesterov, two replicas: the look-ahead scales by w, not 1/R."""
    run_world(_worker, 2, "eager", True, 0.9, 0.4)


def test_full_eager_equals_blocking_diloco_when_replicas_agree():
    """Eager weight 1, mu = 0, every replica seeing the same gradients: after every boundary the
    params equal blocking DiLoCo's (overlap none), and the drained result equals its last theta. The
    hand sequences of both are checked against the implementation by the worker; here they are
    compared with each other, so the claim rests on the algorithm, not on one code path."""
    run_world(_worker, 2, "eager", False, 0.0, 1.0, True)
    x0 = torch.linspace(-1, 1, 7)
    eager = reference(2, "eager", x0, 0.05, DiLoCoXConfig(compression="none", replicas=2, local_steps=H, outer_lr=0.7,
                      outer_momentum=0.0, overlap="eager", eager_weight=1.0), homogeneous=True)
    blocking = reference(2, "none", x0, 0.05, DiLoCoXConfig(compression="none", replicas=2, local_steps=H, outer_lr=0.7,
                         outer_momentum=0.0, overlap="none"), homogeneous=True)
    for t in range(ROUNDS):
        for r in range(2):
            torch.testing.assert_close(eager[t][r], blocking[t][r], rtol=1e-6, atol=1e-6, msg=f"round {t}")
    torch.testing.assert_close(eager[ROUNDS][0], blocking[ROUNDS - 1][0], rtol=1e-6, atol=1e-6)
    # and Kale et al.'s weight (1/R) does not: its own progress arrives at 1/R
    kale = reference(2, "eager", x0, 0.05, DiLoCoXConfig(compression="none", replicas=2, local_steps=H, outer_lr=0.7,
                     outer_momentum=0.0, overlap="eager"), homogeneous=True)
    assert not torch.allclose(kale[0][0], blocking[0][0], rtol=1e-3, atol=1e-3)


def _stale_worker(rank, world):
    cfg = DiLoCoXConfig(compression="none", replicas=world, local_steps=1, outer_lr=1.0, outer_momentum=0.0,
                        overlap="delayed")
    x = torch.zeros(4)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    thetas = []
    for t in range(4):
        x.sub_(float(10 ** t) * (rank + 1))  # round t moves x by -(10^t)(r+1)
        sync.boundary()
        thetas.append(x.clone())
    # mean over r of (r+1) for world 2 = 1.5; theta_t = sum_{s<t} 1.5 * 10^s
    expect = [0.0, 1.5, 16.5, 166.5]
    for t, th in enumerate(thetas):
        assert torch.equal(th, torch.full((4,), -expect[t])), (t, th)


def test_delayed_is_exactly_one_round_stale():
    """Delayed boundary t applies the mean pseudo-gradient of round t-1 and nothing else."""
    run_world(_stale_worker, 2)


def test_outer_nesterov_matches_torch_sgd():
    torch.manual_seed(0)
    p = torch.randn(10)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterNesterov(p.clone(), 0.7, 0.9, True)
    for _ in range(4):
        g = torch.randn(10)
        ref.grad = g.clone()
        opt.step()
        outer.step(g.clone())
        torch.testing.assert_close(outer.theta, ref.detach(), rtol=0, atol=1e-6)


def _roundtrip_worker(rank, world):
    cfg = DiLoCoXConfig(compression="none", overlap="delayed", replicas=world, local_steps=1, outer_lr=0.5,
                        outer_momentum=0.9)
    x = torch.arange(5, dtype=torch.float32)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    x.sub_(rank + 1.0); sync.boundary()
    x.sub_(2.0 * (rank + 1)); sync.boundary()
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sync.state_dict().items()}
    assert state["pending_delta"] is not None
    y = x.clone()
    sync2 = OuterSync(ShardView([y]), cfg, dist.group.WORLD)
    sync2.load_state_dict(state)
    for s, v in ((sync, x), (sync2, y)):
        v.sub_(0.25 * (rank + 1)); s.boundary(); s.drain()
    assert torch.equal(x, y)


def test_state_dict_roundtrip_with_pending():
    """A checkpoint taken with an exchange in flight resumes to the same bits."""
    run_world(_roundtrip_worker, 2)


def _compressed_worker(rank, world, codec, overlap):
    from megatron_diloco.algorithm.compression.reference import dequantize_reference, payload_layout

    cfg = DiLoCoXConfig(replicas=world, local_steps=1, outer_lr=0.7, outer_momentum=0.9,
                        overlap=overlap, compression=codec)
    torch.manual_seed(0)
    x = torch.randn(1000)
    view = ShardView([x])
    sync = OuterSync(view, cfg, dist.group.WORLD)
    layout = payload_layout(1000, codec)
    # what went over the link: every decode's gathered [R, P] payloads (row r = replica r's bytes)
    gathered = []
    decode = sync.codec.decode

    def spy(payloads, numel, out=None, outer=None):
        gathered.append(payloads.clone())
        return decode(payloads, numel, out=out, outer=outer)

    sync.codec.decode = spy
    half_step = {"int8": 0.5 / 127, "int4": 0.5 / 7}[codec]
    pg_sum = torch.zeros(1000, dtype=torch.float64)  # sum over rounds of this replica's theta - x
    v_abs_sum = torch.zeros(1000, dtype=torch.float64)  # sum over rounds of |pseudo-gradient + residual|
    for t in range(4):
        theta = sync.theta.clone()
        e_old = sync.residual.clone()
        torch.manual_seed(100 * t + rank)
        x.sub_(0.01 * torch.randn(1000))  # replica-specific local progress
        pg = theta - x
        v = pg + e_old  # what error feedback must encode (the codec's own fp32 addition)
        pg_sum += pg.double()
        v_abs_sum += v.double().abs()
        report = sync.boundary()
        assert not report.skipped
        # bit-identical params after every boundary
        fp = fingerprint([x])
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        assert all(torch.equal(allfp[0], f) for f in allfp)
        stats = report.launched
        assert stats.payload_bytes == layout.total_bytes < stats.raw_bytes == 4000
        assert stats.bytes_sent == (world - 1) * layout.total_bytes
        # the round sent its input: what is left is at most half a quantization step of its block
        blocks = torch.nn.functional.pad(v, (0, 1024 - 1000)).view(-1, 256)
        bound = (blocks.abs().amax(dim=1) * half_step * (1 + 1e-6)).repeat_interleave(256)[:1000]
        assert (sync.residual.abs() <= bound).all(), t
    if overlap == "delayed":
        sync.drain()
    assert len(gathered) == 4
    # error feedback over the whole run, from the bytes this replica actually put on the link:
    # sum_t dequant(payload_t) == sum_t (theta_t - x_t) - e_T. Per round dequant + e_new == v exactly
    # and v = fl(pseudo_grad + e_old), so the identity holds up to one fp32 rounding (2^-24
    # relative) of each v; the slack is twice that.
    sent_sum = sum(dequantize_reference(p[rank], layout).double() for p in gathered)
    slack = v_abs_sum * 2.0 ** -23 + 1e-12
    assert ((sent_sum - (pg_sum - sync.residual.double())).abs() <= slack).all()
    # ... and it was sent: the sent sum is the input sum up to the last residual alone (measured
    # 0.003-0.004 for int8, 0.06-0.07 for int4; sending nothing gives 1)
    rel = float((sent_sum - pg_sum).norm() / pg_sum.norm())
    assert rel < {"int8": 0.02, "int4": 0.15}[codec], rel


def _warmup_codec_worker(rank, world, overlap):
    """--diloco-x-warmup-compression int2 with int4: H0 2 for 4 steps, then H 4 (boundaries at 2, 4,
    8, 12). The exchange launched at 2 (into a warm-up round) goes as int2, those launched at 4 (into
    a round of H), 8 and 12 as int4; the two codecs share the residual."""
    from megatron_diloco.algorithm.compression.reference import dequantize_reference, payload_layout

    cfg = DiLoCoXConfig(replicas=world, local_steps=4, warmup_local_steps=2, warmup_iters=4, outer_lr=0.7,
                        outer_momentum=0.9, overlap=overlap, compression="int4", warmup_compression="int2",
                        **({"overlap_steps": 1, "warmup_overlap_steps": 1} if overlap == "partial" else {}))
    n = 1000
    torch.manual_seed(0)
    x = torch.randn(n)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    gathered = []  # (format, [R, P] payloads) of every decode, in order
    for codec in (sync.codec, sync.warmup_codec):
        def spy(payloads, numel, out=None, outer=None, _codec=codec, _decode=codec.decode):
            gathered.append((_codec.fmt, payloads.clone()))
            return _decode(payloads, numel, out=out, outer=outer)
        codec.decode = spy
    pg_sum = torch.zeros(n, dtype=torch.float64)
    v_abs_sum = torch.zeros(n, dtype=torch.float64)
    sent_bytes = []
    for step in range(1, 13):
        torch.manual_seed(100 * step + rank)
        x.sub_(0.01 * torch.randn(n))  # replica-specific local progress
        since = RoundSchedule(cfg).steps_since_boundary(step)
        if since:
            if sync.merge_due(since):
                sync.merge()
            continue
        pg = sync.theta - x
        pg_sum += pg.double()
        v_abs_sum += (pg + sync.residual).double().abs()
        sync.before_boundary(0.01, next_round_steps=RoundSchedule(cfg).round_steps(step))
        report = sync.boundary()
        assert not report.skipped
        sent_bytes.append(report.launched.payload_bytes)
    sync.drain()
    fp = fingerprint([x])
    allfp = [torch.zeros_like(fp) for _ in range(world)]
    dist.all_gather(allfp, fp)
    assert all(torch.equal(allfp[0], f) for f in allfp)  # bit-identical replicas at the end
    assert [fmt for fmt, _ in gathered] == ["int2", "int4", "int4", "int4"]
    assert sent_bytes == [payload_layout(n, f).total_bytes for f in ("int2", "int4", "int4", "int4")]
    # error feedback across the switch: what this replica put on the link, summed, is its
    # pseudo-gradients' sum less the last residual (to fp32 rounding of each codec input)
    sent_sum = sum(dequantize_reference(p[rank], payload_layout(n, fmt)).double() for fmt, p in gathered)
    slack = v_abs_sum * 2.0 ** -23 + 1e-12
    assert ((sent_sum - (pg_sum - sync.residual.double())).abs() <= slack).all()


@pytest.mark.parametrize("overlap", ["none", "partial"])
def test_warmup_compression_sends_warmup_rounds_with_its_codec(overlap):
    run_world(_warmup_codec_worker, 2, overlap)


def test_int8_delayed_replicas_identical_and_accounted():
    run_world(_compressed_worker, 2, "int8", "delayed")


def test_int4_none_three_replicas():
    run_world(_compressed_worker, 3, "int4", "none")


def _nonfinite_worker(rank, world, overlap, codec, where="device"):
    cfg = DiLoCoXConfig(replicas=world, local_steps=1, outer_lr=0.5, outer_momentum=0.9,
                        overlap=overlap, compression=codec, outer_state=where,
                        outer_chunk_mb=256 * 4 / 2**20)  # cpu: chunks of 256 and a tail of 44
    x = torch.linspace(0, 1, 300)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    x.sub_(0.1 * (rank + 1)); sync.boundary()  # a normal round
    theta = sync.theta.clone()
    m = sync.outer.momentum_buffer.clone()
    e = sync.residual.clone() if sync.residual is not None else None
    x.sub_(0.1)
    if rank == 1:
        x[7] = float("nan")  # only one replica goes bad
    report = sync.boundary()
    assert report.skipped and report.launched.bytes_sent == 0
    assert torch.isfinite(x).all() and torch.isfinite(sync.theta).all()
    if overlap == "none":  # nothing applied: outer state untouched, x back at theta
        assert torch.equal(sync.theta, theta) and torch.equal(sync.outer.momentum_buffer, m)
    assert torch.equal(x, sync.theta)
    if e is not None:
        assert torch.equal(sync.residual, e)
    fp = fingerprint([x, sync.theta])
    allfp = [torch.zeros_like(fp) for _ in range(world)]
    dist.all_gather(allfp, fp)
    assert torch.equal(allfp[0], allfp[1])
    x.sub_(0.1 * (rank + 1)); assert not sync.boundary().skipped  # training goes on
    sync.drain()
    assert sync.skipped_rounds == 1 and torch.isfinite(sync.theta).all()


@pytest.mark.parametrize("overlap, codec, where", [("none", "none", "device"), ("delayed", "int8", "device"),
                                                   ("delayed", "none", "device"), ("eager", "int8", "device"),
                                                   ("eager", "int8", "host"), ("none", "none", "host"),
                                                   ("partial", "int4", "device"), ("partial", "int4", "host"),
                                                   ("partial", "none", "host")])
def test_nonfinite_pseudo_gradient_skips_round_everywhere(overlap, codec, where):
    """(``where``: --diloco-x-outer-state; cpu: the outer state in host memory, streamed in chunks)"""
    run_world(_nonfinite_worker, 2, overlap, codec, where)


def _matrix_codec_worker(rank, world, codec, overlap):
    cfg = DiLoCoXConfig(replicas=world, local_steps=1, outer_lr=0.7, outer_momentum=0.9, overlap=overlap,
                        compression=codec, rank=2, energy=0.5)
    torch.manual_seed(0)
    w, b = torch.randn(64, 96), torch.randn(96)  # a weight (low-rankable) and a bias (never low-ranked)
    outer = dist.new_group(backend="gloo")  # the exchange's group: its worker thread owns it in flight
    sync = OuterSync(ShardView([w, b]), cfg, outer, shapes=[(64, 96), (96,)])
    for t in range(4):
        torch.manual_seed(10 * t + rank)
        w.sub_(0.01 * torch.randn(64, 1) @ torch.randn(1, 96) + 0.001 * torch.randn(64, 96))
        b.sub_(0.01 * torch.randn(96))
        report = sync.boundary()
        fp = fingerprint([w, b, sync.theta])
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        assert all(torch.equal(allfp[0], f) for f in allfp), (codec, t)
        done = report.completed
        if done is not None:  # fewer bytes than fp32, accounted once the exchange completed
            assert 0 < done.payload_bytes < done.raw_bytes == 4 * (64 * 96 + 96)
            assert done.bytes_sent == (world - 1) * done.payload_bytes
    sync.drain()
    assert torch.isfinite(sync.theta).all()


@pytest.mark.parametrize("codec", ["lowrank", "lowrank-int8", "adaptive"])
@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_matrix_codecs_replicas_identical(codec, overlap):
    run_world(_matrix_codec_worker, 2, codec, overlap)


def _worker_thread_exchange(rank, world, codec_name, device):
    """``start_exchange`` of a matrix codec (its worker thread; on a GPU its own stream and pinned
    host staging over the gloo group) vs ``codec.exchange`` run on this thread with the plain gloo
    all-gather of host copies: the same bits every round (mean, residual), the residual's squared
    norm in the stats, the replicas identical; the caller's current device and RNG untouched."""
    from megatron_diloco.algorithm.exchange import start_exchange
    from megatron_diloco.algorithm.worker import DaemonWorker
    from megatron_diloco.algorithm.compression import get_codec

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    group = dist.new_group(backend="gloo")
    layout = [(0, (64, 96)), (64 * 96, (96,)), (64 * 96 + 96, (40, 3, 10))]
    n = 64 * 96 + 96 + 1200

    def host_allgather(t):  # the reference: blocking host copies, default stream
        src = t.contiguous().cpu()
        out = torch.empty(world * src.numel(), dtype=src.dtype)
        dist.all_gather_into_tensor(out, src, group=group)
        return out.to(dev).view(world, -1)

    ref_codec, codec = get_codec(codec_name, layout, rank=3), get_codec(codec_name, layout, rank=3)
    ref_res, res = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    worker = DaemonWorker("test")
    rng = torch.cuda.get_rng_state() if dev.type == "cuda" else torch.get_rng_state()
    for t in range(3):
        g = torch.Generator().manual_seed(100 * t + rank)
        delta = (torch.randn(n, 1, generator=g) * torch.randn(1, 1, generator=g)).view(-1).to(dev)
        kwargs = {"agree": lambda x: (dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group), x)[1]} \
            if hasattr(ref_codec, "policy") else {}
        ref = ref_codec.exchange(ref_res, host_allgather, pseudo_grad=delta.clone(), out=None, **kwargs)
        buf = delta.clone()
        handle = start_exchange(buf, res, codec, group, worker=worker)
        mean = handle.wait()
        assert torch.equal(mean, ref) and torch.equal(res, ref_res), (codec_name, t)
        assert handle.stats.residual_sq == float(torch.dot(ref_res, ref_res)) > 0
        fp = fingerprint([mean]).cpu()
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        assert all(torch.equal(allfp[0], f) for f in allfp)
    if dev.type == "cuda":
        assert torch.cuda.current_device() == 0
        assert torch.equal(torch.cuda.get_rng_state(), rng)
    else:
        assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the worker's stream and pinned staging need a CUDA GPU"))])
@pytest.mark.parametrize("codec", ["lowrank", "lowrank-int8", "adaptive"])
def test_worker_thread_exchange_matches_host_allgather(codec, device):
    run_world(_worker_thread_exchange, 2, codec, device)


def _error_worker(rank, world):
    cfg = DiLoCoXConfig(replicas=world, local_steps=1, overlap="none", compression="int4")
    torch.manual_seed(0)
    x = torch.randn(2000)  # the replicas start alike (theta is compared at every boundary)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    theta = sync.theta.clone()
    torch.manual_seed(1 + rank)
    x.sub_(0.1 * torch.randn(2000))
    v = theta - x  # residual starts at 0: the codec's input is the pseudo-gradient
    report = sync.boundary()
    stats = report.completed
    torch.testing.assert_close(stats.input_sq, float(v.double().square().sum()), rtol=1e-5, atol=0)
    assert stats.residual_sq == float(torch.dot(sync.residual, sync.residual)) > 0
    assert 0.01 < (stats.residual_sq / stats.input_sq) ** 0.5 < 0.3  # int4: a few percent to tens


def test_compression_error_is_measured():
    run_world(_error_worker, 2)


def _link_worker(rank, world, bandwidth):
    cfg = DiLoCoXConfig(replicas=world, local_steps=2, overlap="delayed", compression="adaptive",
                        bandwidth_mbps=bandwidth, energy=0.5)
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    outer = dist.new_group(backend="gloo")
    sync = OuterSync(ShardView([w]), cfg, outer, shapes=[(32, 48)])
    for _ in range(3):
        w.sub_(0.01 * (rank + 1))
        sync.before_boundary(0.5)
        sync.boundary()
    bw = sync.link_bytes_per_s
    if bandwidth is None:  # measured over the outer group at the first boundary, agreed by MIN
        assert bw is not None and 0 < bw < float("inf")
        got = [None] * world
        dist.all_gather_object(got, bw)
        assert got == [bw] * world
    else:
        assert bw == bandwidth * 1e6 / 8
    assert sync.codec.policy.budget_bytes == bw * 2 * 0.5  # bandwidth x H x step time
    sync.drain()


@pytest.mark.parametrize("bandwidth", [None, 80.0])
def test_adaptive_budget_from_measured_or_given_link(bandwidth):
    run_world(_link_worker, 2, bandwidth)


def _mirror_worker(rank, world):
    from megatron_diloco.megatron_adapter.topology import host_mirror_of_outer_groups

    group = host_mirror_of_outer_groups(2)  # replicas {0,1} and {2,3}: outer groups {0,2}, {1,3}
    assert dist.get_backend(group) == "gloo"
    assert dist.get_process_group_ranks(group) == [rank % 2, rank % 2 + 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    assert t.item() == 2 * (rank % 2) + 2


def test_host_mirror_of_outer_groups():
    """The gloo mirrors the GPU worker thread uses are exactly the outer groups."""
    run_world(_mirror_worker, 4)


def _host_none_worker(rank, world):
    from unittest import mock

    from megatron_diloco.megatron_adapter.topology import host_mirror_of_outer_groups

    mirror = host_mirror_of_outer_groups(2)  # outer groups {0,2}, {1,3}
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # every rank creates both
    real = dist.get_backend
    as_nccl = lambda g=None: "nccl" if g is outer else real(g)  # noqa: E731  (the outer group of one NCCL world)
    x0 = torch.linspace(-1, 1, 40)
    with mock.patch.object(dist, "get_backend", as_nccl):
        for where, gloo_group, held in (("device", mirror, False), ("host", None, False), ("host", mirror, True)):
            cfg = DiLoCoXConfig(replicas=2, local_steps=H, compression="none", outer_state=where,
                                outer_lr=1.0, outer_momentum=0.0)
            x = x0.clone()
            sync = OuterSync(ShardView([x]), cfg, outer, gloo_group=gloo_group)
            assert sync.store.held(sync.exchange_buffer) == held, (where, gloo_group)
            assert (sync.exchange_group is mirror) == held  # NCCL's device buffer, or the mirror on the host
            x.sub_(0.1 * (rank // 2 + 1))  # replica r's progress; the mean 0.15
            sync.boundary()
            sync.drain()
            torch.testing.assert_close(sync.theta, x0 - 0.15, msg=where)


def test_host_layout_all_reduces_none_on_the_mirror_of_an_nccl_outer_group():
    """``none`` with ``--diloco-x-outer-state host`` in one world whose outer group is NCCL: its fp32
    all-reduce runs on the gloo mirror in host memory (the device keeps no buffer for it); without a
    mirror (or with the device layout) the buffer stays on the device, as NCCL needs."""
    run_world(_host_none_worker, 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused Triton decode + outer kernel needs a CUDA GPU"))])
@pytest.mark.parametrize("name", ["none", "int8", "int4", "lowrank-int8"])
@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (True, 0.0)])
def test_apply_is_wait_then_outer_step_and_fuses_the_decode(name, nesterov, momentum, device):
    """``ExchangeHandle.apply(outer)`` leaves theta and momentum bit-identical to
    ``outer.step(handle.wait())`` for every kind of codec (all-reduce, all-gather, worker thread),
    and for the all-gather codecs hands the outer step to the codec's decode (on a GPU the fused
    Triton decode + outer kernel; on CPU the reference) instead of materializing the mean first."""
    from megatron_diloco.algorithm.exchange import start_exchange
    from megatron_diloco.algorithm.worker import DaemonWorker
    from megatron_diloco.algorithm.compression import get_codec

    torch.manual_seed(0)
    layout = [(0, (48, 40)), (48 * 40, (100,))]
    n = 48 * 40 + 100
    delta, theta0 = torch.randn(n, device=device), torch.randn(n, device=device)
    results, fused_calls = [], []
    for use_apply in (True, False):
        codec = get_codec(name, layout, rank=3)
        decode = getattr(codec, "decode", None)
        if decode is not None:
            def spy(*a, _decode=decode, **k):
                fused_calls.append(k.get("outer") is not None)
                return _decode(*a, **k)
            codec.decode = spy
        outer = OuterNesterov(theta0.clone(), 0.7, momentum, nesterov)
        outer.step(torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device))  # momentum != 0
        buf, residual = delta.clone(), torch.zeros(n, device=device) if codec.lossy else None
        worker = DaemonWorker("test") if name.startswith("lowrank") else None
        handle = start_exchange(buf, residual, codec, None, worker=worker)
        if use_apply:
            handle.apply(outer)
        else:
            outer.step(handle.wait())
        results.append((outer.theta, outer.momentum_buffer, residual))
    (t1, m1, e1), (t2, m2, e2) = results
    assert torch.equal(t1, t2)
    assert (m1 is None and m2 is None) or torch.equal(m1, m2)
    assert (e1 is None and e2 is None) or torch.equal(e1, e2)
    if name in ("int8", "int4"):
        assert fused_calls == [True, False], fused_calls


# ---------------------------------------------------------------- partial overlap (tau)

def _outer_step(theta, m, delta, cfg):
    m = cfg.outer_momentum * m + delta
    upd = delta + cfg.outer_momentum * m if cfg.nesterov else m
    return theta - cfg.outer_lr * upd, m


def partial_reference(R: int, x0: torch.Tensor, lr_in: float, cfg: DiLoCoXConfig, tau: int,
                      homogeneous: bool = False) -> list:
    """Straight-line statement of ``partial`` (sync.py module doc), one process: the exchange
    launched at a boundary is applied tau inner steps later and merged into the local params.
    Returns per boundary (and after the drain) the R replicas' params."""
    theta, m = x0.clone(), torch.zeros_like(x0)
    xs = [x0.clone() for _ in range(R)]
    launch = [None] * R
    pending, trace, step = None, [], 0

    def apply_and_merge(fresh: bool):
        nonlocal theta, m, xs
        theta, m = _outer_step(theta, m, pending, cfg)
        for r in range(R):
            if fresh:
                xs[r] = theta.clone()
            elif cfg.merge == "exact":
                xs[r] = theta + (xs[r] - launch[r])
            else:
                xs[r] = torch.lerp(xs[r], theta, 1.0 - cfg.mix_alpha)

    for _t in range(ROUNDS):
        for k in range(1, H + 1):
            for r in range(R):
                xs[r] = xs[r] - lr_in * grad(0 if homogeneous else r, step, xs[r])
            step += 1
            if pending is not None and k == tau and k < H:
                apply_and_merge(False)
                pending = None
        if pending is not None:  # tau == H: applied at the next boundary, before its pseudo-gradient
            apply_and_merge(False)
        pending = sum(theta - x for x in xs) / R
        launch = [x.clone() for x in xs]
        if tau == 0:
            apply_and_merge(True)
            pending = None
        trace.append([x.clone() for x in xs])
    if pending is not None:
        theta, m = _outer_step(theta, m, pending, cfg)
        trace.append([theta.clone() for _ in range(R)])
    return trace


def _run_schedule(sync: OuterSync, params: list[torch.Tensor], g_rank: int, world: int,
                  check_shared: bool = True) -> list[torch.Tensor]:
    """Inner steps as DiLoCoXOptimizer.step() drives OuterSync: after each, the partial merge when
    due, else the boundary every H-th step; returns x after every boundary (and after the drain)."""
    a, b = params
    got, step = [], 0
    for _t in range(ROUNDS):
        for k in range(1, H + 1):
            x = torch.cat([a.view(-1), b])
            x = x - 0.05 * grad(g_rank, step, x)
            a.copy_(x[:3].view(3, 1)); b.copy_(x[3:])
            step += 1
            if sync.merge_due(k % H):
                sync.merge()
            elif k == H:
                sync.boundary()
        got.append(torch.cat([a.view(-1), b]).clone())
        if check_shared:  # theta and m bit-identical across replicas after every boundary
            shared = [sync.theta] + ([sync.outer.momentum_buffer] if sync.outer.momentum_buffer is not None else [])
            fp = fingerprint(shared)
            allfp = [torch.zeros_like(fp) for _ in range(world)]
            dist.all_gather(allfp, fp)
            assert all(torch.equal(allfp[0], f) for f in allfp), allfp
    if sync.drain() is not None:
        got.append(torch.cat([a.view(-1), b]).clone())
    return got


def _partial_worker(rank: int, world: int, tau: int, merge: str, momentum: float) -> None:
    cfg = DiLoCoXConfig(compression="none", replicas=world, local_steps=H, outer_lr=0.7, outer_momentum=momentum,
                        overlap="partial", overlap_steps=tau, merge=merge)
    x0 = torch.linspace(-1, 1, 7)
    params = [x0[:3].clone().view(3, 1), x0[3:].clone()]
    got = _run_schedule(OuterSync(ShardView(params), cfg, dist.group.WORLD), params, rank, world)
    want = partial_reference(world, x0, 0.05, cfg, tau)
    assert len(got) == len(want) == ROUNDS + (tau > 0)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w[rank], rtol=1e-6, atol=1e-6, msg=f"boundary {i}")
    if 0 < tau:  # x keeps each replica's own progress after the merge (it differs between replicas)
        assert not torch.equal(want[1][0], want[1][1])
    if tau == 0:  # tau = 0 is blocking DiLoCo, bit for bit
        none_cfg = DiLoCoXConfig(compression="none", replicas=world, local_steps=H, outer_lr=0.7, outer_momentum=momentum,
                                 overlap="none")
        ref = [x0[:3].clone().view(3, 1), x0[3:].clone()]
        blocking = _run_schedule(OuterSync(ShardView(ref), none_cfg, dist.group.WORLD), ref, rank, world)
        assert all(torch.equal(g, w) for g, w in zip(got, blocking))


def _partial_compressed_worker(rank: int, world: int, codec: str, where: str) -> None:
    def run(overlap: str) -> tuple[list[torch.Tensor], OuterSync]:
        cfg = DiLoCoXConfig(compression=codec, replicas=world, local_steps=H, outer_lr=0.7, outer_momentum=0.9,
                            overlap=overlap, overlap_steps=0 if overlap == "partial" else None, outer_state=where,
                            outer_chunk_mb=256 * 4 / 2**20)  # cpu: the 7 elements staged as one chunk
        x0 = torch.linspace(-1, 1, 7)
        params = [x0[:3].clone().view(3, 1), x0[3:].clone()]
        sync = OuterSync(ShardView(params), cfg, dist.group.WORLD)
        return _run_schedule(sync, params, rank, world), sync

    got, partial = run("partial")
    want, blocking = run("none")
    assert len(got) == len(want) == ROUNDS and all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(partial.residual, blocking.residual) and partial.residual.abs().sum() > 0


@pytest.mark.parametrize("codec, where", [("int4", "device"), ("int4", "host"), ("int8", "device")])
def test_partial_compressed_at_tau_0_is_blocking_bit_for_bit(codec, where):
    """partial with a blockwise codec at tau = 0 is blocking DiLoCo with the same codec bit for bit,
    the error-feedback residual included, whichever pass encodes and whichever buffer receives e_new
    (``where``: --diloco-x-outer-state)."""
    run_world(_partial_compressed_worker, 2, codec, where)


@pytest.mark.parametrize("tau,merge,momentum", [(0, "exact", 0.9), (1, "exact", 0.9), (2, "exact", 0.0),
                                                (H, "exact", 0.9), (1, "mix", 0.9), (H, "mix", 0.0)])
def test_partial_overlap_matches_hand_sequence(tau, merge, momentum):
    """partial: the exchange lands exactly tau inner steps after its boundary, merged exactly
    (theta_new + own progress since the launch) or mixed; theta and m bit-identical across replicas;
    tau = 0 equals blocking DiLoCo bit for bit."""
    run_world(_partial_worker, 2, tau, merge, momentum)


def test_partial_exact_at_tau_h_is_full_eager():
    """With the exact merge, tau = H equals eager with weight 1 at eta = 1, mu = 0 (the identity the
    module doc states); the two hand sequences are compared, each checked against the code above."""
    x0 = torch.linspace(-1, 1, 7)
    common = dict(replicas=2, local_steps=H, outer_lr=1.0, outer_momentum=0.0)
    partial = partial_reference(2, x0, 0.05, DiLoCoXConfig(compression="none", overlap="partial", overlap_steps=H, **common), H)
    eager = reference(2, "eager", x0, 0.05, DiLoCoXConfig(compression="none", overlap="eager", eager_weight=1.0, **common))
    for t in range(ROUNDS + 1):
        for r in range(2):
            torch.testing.assert_close(partial[t][r], eager[t][r], rtol=1e-6, atol=1e-6, msg=f"round {t}")


def test_partial_auto_overlap_steps_hides_the_last_exchange():
    """auto tau: the fewest inner steps (>= 1, <= H) covering the last exchange, from its wire bytes
    at the link bandwidth when known, else its measured duration; H before anything is measured."""
    from megatron_diloco.algorithm.exchange import ExchangeStats

    cfg = DiLoCoXConfig(compression="none", replicas=1, local_steps=10, overlap="partial")
    sync = OuterSync(ShardView([torch.zeros(8)]), cfg, None)
    assert sync._choose_overlap_steps() == 10  # nothing measured yet
    sync.step_time_s = 0.1
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.25)
    assert sync._choose_overlap_steps() == 3
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.001)
    assert sync._choose_overlap_steps() == 1
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=50.0)
    assert sync._choose_overlap_steps() == 10
    sync.link_bytes_per_s = 1e6  # the wire bytes at the link, not the (loopback) measured time
    sync.last_completed = ExchangeStats(bytes_sent=450_000, exchange_s=0.001)
    assert sync._choose_overlap_steps() == 5
    # before any exchange completed, with the link known: this exchange's own wire bytes where the
    # codec fixes them (all-gather: R - 1 payloads; fp32 all-reduce: the ring's 2 (R - 1) / R)
    n = 1 << 20
    for codec, wire in (("int4", None), ("none", 4 * n)):
        first = OuterSync(ShardView([torch.zeros(n)]), DiLoCoXConfig(replicas=2, local_steps=10, overlap="partial",
                                                                      compression=codec), None)
        wire = wire or first.codec.payload_bytes(n)
        assert first._choose_overlap_steps() == 10  # no step time yet
        first.step_time_s = 0.1
        assert first._choose_overlap_steps() == 10  # no link known: nothing to size it by
        first.link_bytes_per_s = 2e6
        assert first._choose_overlap_steps() == min(10, math.ceil(wire / 2e6 / 0.1)), codec
    fixed = OuterSync(ShardView([torch.zeros(8)]), DiLoCoXConfig(compression="none", replicas=1, local_steps=10, overlap="partial",
                                                                  overlap_steps=4), None)
    fixed.step_time_s, fixed.last_completed = 0.1, ExchangeStats(exchange_s=50.0)
    assert fixed._choose_overlap_steps() == 4

def test_bandwidth_flag_is_the_sites_link_shared_by_the_replicas_ranks():
    """``--diloco-x-bandwidth-mbps`` is the site's link, shared by the S ranks of a replica that send
    their outer groups' exchanges at once: a rank counts on 1 / S of it, for auto tau and the adaptive
    budget alike, and the planner sizes an exchange by the same share (its ``--link-mbps`` with
    ``--link-scope cluster``, at link efficiency 1)."""
    from megatron_diloco.plan import PlanConfig, plan

    n, mbps, step = 1 << 16, 80.0, 0.002
    cfg = DiLoCoXConfig(replicas=2, local_steps=30, overlap="partial", compression="int4", bandwidth_mbps=mbps)
    taus = {}
    for sharers in (1, 4):
        sync = OuterSync(ShardView([torch.zeros(n)]), cfg, None, link_sharers=sharers)
        assert sync.link_bytes_per_s == mbps * 1e6 / 8 / sharers and sync.link_mbps == pytest.approx(mbps)
        sync.step_time_s = step
        wire = sync.codec.payload_bytes(n)  # R - 1 = 1 payload out
        taus[sharers] = sync._choose_overlap_steps()
        assert taus[sharers] == min(30, math.ceil(sharers * wire / (mbps * 1e6 / 8) / step)), sharers
    assert taus[4] > taus[1]  # 4 ranks crossing the one link take longer than 1
    # the planner: 4 ranks per replica (dp 4) on one cluster link of the same rate
    p = plan(PlanConfig(params=4 * n, dp=4, replicas=2, link_mbps=mbps, link_efficiency=1.0, codec="int4",
                        tokens_per_step=1, local_steps=30, step_time_s=step, boundary_s=0.0, warmup_iters=0))
    assert p.min_hidden_local_steps == taus[4] and p.bandwidth_flag_mbps == pytest.approx(mbps)
    budget = OuterSync(ShardView([torch.zeros(32, 48)]), DiLoCoXConfig(
        replicas=1, local_steps=2, overlap="delayed", compression="adaptive", bandwidth_mbps=mbps), None,
        shapes=[(32, 48)], link_sharers=4)
    budget.before_boundary(0.5)
    assert budget.codec.policy.budget_bytes == mbps * 1e6 / 8 / 4 * 2 * 0.5  # the share x H x step time


def test_checkpoint_keeps_what_auto_tau_is_sized_from():
    """A resumed run's next boundary chooses tau as the uninterrupted run's does: the checkpoint
    holds the step time and the last exchange's bytes and duration (else a resume chose H, or 1
    after a restored in-flight exchange, whose stats are empty), and applying a restored exchange
    does not replace them."""
    from megatron_diloco.algorithm.exchange import ExchangeHandle, ExchangeStats

    cfg = DiLoCoXConfig(compression="none", replicas=1, local_steps=10, overlap="partial")
    sync = OuterSync(ShardView([torch.zeros(8)]), cfg, None)
    sync.step_time_s, sync.longest_exchange_s = 0.1, 2.0
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.35)
    assert sync._choose_overlap_steps() == 4
    state = sync.state_dict()
    resumed = OuterSync(ShardView([torch.zeros(8)]), cfg, None)
    assert resumed._choose_overlap_steps() == 10  # fresh: nothing measured
    resumed.load_state_dict(state)
    assert resumed._choose_overlap_steps() == 4 and resumed.timeout_s() == sync.timeout_s()
    resumed.before_boundary(None)  # no whole iteration timed since the resume: the checkpoint's stays
    assert resumed.step_time_s == 0.1
    resumed.pending = ExchangeHandle.completed(resumed.exchange_buffer, resumed.store)  # as restored in flight
    resumed.drain()
    assert resumed.last_completed.exchange_s == 0.35 and resumed._choose_overlap_steps() == 4


@pytest.mark.parametrize("fixed_tau", [None, 3])
def test_partial_warmup_rounds_block(fixed_tau):
    """A boundary that starts a warm-up round (shorter than H) launches with tau = 0, auto or fixed;
    one that starts a round of H gets auto tau (the exchange's 0.35 s over 0.1 s steps: 4) or the
    fixed tau. A warm-up with H0 = H is no warm-up."""
    from megatron_diloco.algorithm.exchange import ExchangeStats

    cfg = DiLoCoXConfig(compression="none", replicas=1, local_steps=10, overlap="partial",
                        warmup_local_steps=2, warmup_iters=4, overlap_steps=fixed_tau)
    sync = OuterSync(ShardView([torch.zeros(8)]), cfg, None)
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.35)
    sync.before_boundary(0.1, next_round_steps=2)
    assert sync._choose_overlap_steps() == 0
    sync.before_boundary(0.1, next_round_steps=10)
    assert sync._choose_overlap_steps() == (fixed_tau or 4)
    sync.before_boundary(0.1)  # default: H
    assert sync.next_round_steps == 10
    same = OuterSync(ShardView([torch.zeros(8)]), dataclasses.replace(cfg, warmup_local_steps=10, warmup_iters=10), None)
    same.last_completed = sync.last_completed
    same.before_boundary(0.1, next_round_steps=10)
    assert same._choose_overlap_steps() == (fixed_tau or 4)


@pytest.mark.parametrize("fixed_tau", [None, 1, 3])
def test_partial_warmup_overlap_is_capped(fixed_tau):
    """``--diloco-x-warmup-overlap-steps 2``: a boundary that starts a warm-up round launches with
    the smaller of 2 and the tau the rounds of H take (auto: the exchange's 0.35 s over 0.1 s steps,
    4; or the fixed tau); H0 while nothing is measured is capped too. Rounds of H are not capped."""
    from megatron_diloco.algorithm.exchange import ExchangeStats

    cfg = DiLoCoXConfig(compression="none", replicas=1, local_steps=10, overlap="partial",
                        warmup_local_steps=5, warmup_iters=10, warmup_overlap_steps=2, overlap_steps=fixed_tau)
    sync = OuterSync(ShardView([torch.zeros(8)]), cfg, None)
    sync.before_boundary(None, next_round_steps=5)
    assert sync._choose_overlap_steps() == min(2, fixed_tau or 2)  # auto: nothing measured yet: H0, capped
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.35)
    sync.before_boundary(0.1, next_round_steps=5)
    assert sync._choose_overlap_steps() == min(2, fixed_tau or 4)
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.05)  # a fast link: auto takes 1
    assert sync._choose_overlap_steps() == min(2, fixed_tau or 1)
    sync.last_completed = ExchangeStats(bytes_sent=0, exchange_s=0.35)
    sync.before_boundary(0.1, next_round_steps=10)
    assert sync._choose_overlap_steps() == (fixed_tau or 4)


def test_partial_auto_tau_of_one_replica_is_one_step():
    """One replica (no collective): its exchange completes at its launch, so after the first round
    (nothing measured: tau = H) auto tau is one step, however long the landing waited for it.
    Timing the exchange to its wait (H steps) would keep tau at H for the whole run."""
    import time

    cfg = DiLoCoXConfig(compression="int8", replicas=1, local_steps=H, overlap="partial")
    params = [torch.linspace(-1, 1, 7)]
    sync = OuterSync(ShardView(params), cfg, None)
    sync.before_boundary(0.001)
    landings, taus = [], []
    for t in range(3):
        for k in range(1, H + 1):
            time.sleep(0.005)  # an inner step of 5 step times: the wait comes >= 5 H ms after a launch
            params[0].sub_(0.01)
            if sync.merge_due(k % H):
                landings.append((t, k))
                sync.merge()
            elif k == H:
                sync.boundary()
                taus.append(sync.tau)
    sync.drain()
    assert taus == [H, 1, 1] and landings == [(2, 1)], (taus, landings)
    assert sync.last_completed.exchange_s < 0.005


def _auto_worker(rank: int, world: int) -> None:
    cfg = DiLoCoXConfig(replicas=world, local_steps=H, overlap="partial", compression="int8")
    x0 = torch.linspace(-1, 1, 7)
    params = [x0[:3].clone().view(3, 1), x0[3:].clone()]
    sync = OuterSync(ShardView(params), cfg, dist.group.WORLD)
    sync.before_boundary(1.0 if rank == 0 else 1e-9)  # rank 1 would pick H, rank 0 one step
    taus = []
    a, b = params
    for t in range(ROUNDS):
        for k in range(1, H + 1):
            a.sub_(0.01 * (rank + 1)); b.sub_(0.02)
            if sync.merge_due(k % H):
                taus.append((t, k))
                sync.merge()
            elif k == H:
                sync.boundary()
                agreed = torch.tensor([sync.tau])
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
                assert agreed.item() == sync.tau  # one tau on every rank
    sync.drain()
    # round 1 has nothing measured (tau = H); afterwards rank 1's tiny step time makes it ask for H,
    # rank 0 for 1: the largest wins, so no rank applies before its exchange is hidden
    assert sync.tau == H and taus == [], taus


def test_partial_auto_overlap_steps_agreed_by_all_ranks():
    run_world(_auto_worker, 2)


def test_auto_local_steps_proposal_from_the_main_codecs_exchange():
    """auto H: a rank proposes 8 x the steps that hide an exchange of the main codec: its wire bytes
    at the known link; else the last exchange's measured time scaled to the main codec's bytes (the
    first round after an int2 warm-up: int4 sends twice its bytes). Nothing with a fixed H, into a
    warm-up round, or before anything is measured; tau is sized within the proposed round."""
    from megatron_diloco.algorithm.exchange import ExchangeStats

    n = 1 << 16
    common = dict(replicas=2, overlap="partial", compression="int4", warmup_local_steps=10, warmup_iters=900,
                  warmup_compression="int2")
    sync = OuterSync(ShardView([torch.zeros(n)]), DiLoCoXConfig(local_steps=30, local_steps_auto=True, **common), None)
    int4, int2 = sync._fixed_wire_bytes(sync.codec), sync._fixed_wire_bytes(sync.warmup_codec)
    assert int4 > 1.9 * int2
    sync.before_boundary(None, next_round_steps=30, steps=900)
    assert sync._propose_local_steps() == 0  # nothing measured
    sync.before_boundary(0.01, next_round_steps=10, steps=890)  # into a warm-up round: no proposal
    sync.last_completed = ExchangeStats(bytes_sent=int2, exchange_s=0.06)
    assert sync._propose_local_steps() == 0
    sync.before_boundary(0.01, next_round_steps=30)  # the last round of a run (no step count): none
    assert sync._propose_local_steps() == 0
    sync.before_boundary(0.01, next_round_steps=30, steps=900)  # the warm-up's end: int4 takes ~0.117 s = 12 steps
    hide = math.ceil(0.06 * int4 / int2 / 0.01)
    want = 8 * hide
    assert sync._propose_local_steps() == want and 90 <= want <= 100
    assert sync._choose_overlap_steps(want) == hide  # hidden within the round, an eighth of it
    # a shorter H than the current one (agreed earlier: 142) is a round of H, not a warm-up round:
    # its exchange overlaps (tau hides it), with the main codec
    sync.config.local_steps = 142
    assert sync._propose_local_steps() == want and sync._choose_overlap_steps(want) == hide
    assert sync._round_codec() is sync.codec and not sync.schedule.is_warmup_round(want)
    sync.config.local_steps = 30
    sync.link_bytes_per_s = int4 / 0.25  # a known link: 0.25 s per int4 exchange = 25 steps, x 8
    assert sync._propose_local_steps() == 200
    sync.link_bytes_per_s = int4 / 0.5  # 50 steps, x 8 = 400: the upper bound
    assert sync._propose_local_steps() == 300
    sync.link_bytes_per_s = int4 / 0.03  # 3 steps, x 8 = 24: the lower bound
    assert sync._propose_local_steps() == 30
    fixed = OuterSync(ShardView([torch.zeros(n)]), DiLoCoXConfig(local_steps=30, **common), None)
    fixed.before_boundary(0.01, next_round_steps=30, steps=900)
    fixed.last_completed = ExchangeStats(bytes_sent=int2, exchange_s=0.06)
    assert fixed._propose_local_steps() == 0
    # a warm-up whose H0 is the starting H (rounds of 30 up to 300): no proposal inside it, one at its end
    same = OuterSync(ShardView([torch.zeros(n)]), DiLoCoXConfig(local_steps=30, local_steps_auto=True, **{
        **common, "warmup_local_steps": 30, "warmup_iters": 300}), None)
    same.last_completed = ExchangeStats(bytes_sent=int2, exchange_s=0.06)
    same.before_boundary(0.01, next_round_steps=30, steps=270)
    assert same._propose_local_steps() == 0
    same.before_boundary(0.01, next_round_steps=30, steps=300)
    assert same._propose_local_steps() > 30


def _auto_h_worker(rank: int, world: int) -> None:
    """Two replicas driven as the optimizer drives OuterSync (boundaries from the schedule, the step
    count given at each): rank 1's link share is half rank 0's, so it proposes the longer H."""
    steps_total = 385  # the last exchange (launched at 380) still in flight at the end: the drain lands it
    cfg = DiLoCoXConfig(replicas=world, local_steps=30, local_steps_auto=True, overlap="partial", compression="int8",
                        warmup_local_steps=10, warmup_iters=60)
    x = torch.linspace(-1, 1, 4096) + 0.0
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    wire = sync._fixed_wire_bytes(sync.codec)
    sync.link_bytes_per_s = wire / (0.05 if rank == 0 else 0.1)  # 0.05 s / 0.1 s per exchange
    step_s = 0.01  # the step time a rank reports (the proposals do not depend on this test's pace)
    boundaries, taus, landings = [], [], []
    for step in range(1, steps_total + 1):
        since = sync.schedule.steps_since_boundary(step)
        x.sub_(0.001 * (rank + 1) * torch.sin(x * step))
        if sync.merge_due(since):
            landings.append(step)
            sync.merge()
        elif since == 0:
            sync.before_boundary(step_s, next_round_steps=sync.schedule.round_steps(step), steps=step)
            sync.boundary()
            boundaries.append((step, cfg.local_steps))
            taus.append(sync.tau)
    sync.drain()
    # warm-up: rounds of 10 to 60 (no proposal, H 30 stays); at 60 rank 1 asks 8 x 10 = 80, rank 0
    # 8 x 5 = 40: 80 wins on both ranks, and the tau of the slower link (10 steps)
    assert boundaries == [(10, 30), (20, 30), (30, 30), (40, 30), (50, 30), (60, 80), (140, 80), (220, 80), (300, 80),
                          (380, 80)], boundaries
    # (warm-up rounds block: tau_w 0); the exchanges of the rounds of 80 land 10 steps after their launch
    assert taus == [0] * 5 + [10] * 5 and landings == [70, 150, 230, 310], (taus, landings)
    got = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(got, x)
    assert torch.equal(got[0], got[1])  # one model at the end
    theta = [torch.empty_like(sync.theta) for _ in range(world)]
    dist.all_gather(theta, sync.theta)
    assert torch.equal(theta[0], theta[1])


def test_auto_local_steps_agreed_by_all_ranks():
    run_world(_auto_h_worker, 2)


def _auto_h_warmup_worker(rank: int, world: int) -> None:
    """auto H with an auto warm-up that may grow to 200 steps: the ranks' proposals inside the warm-up
    (80, as in :func:`_auto_h_worker`) lengthen it from 60 to 200 steps; its rounds keep tau_w and the
    warm-up codec (a proposal inside the warm-up does not size their tau); rounds of 80 follow."""
    cfg = DiLoCoXConfig(replicas=world, local_steps=30, local_steps_auto=True, overlap="partial", compression="int8",
                        warmup_local_steps=10, warmup_iters=60, warmup_auto=True, warmup_iters_max=200,
                        warmup_overlap_steps=1, warmup_compression="int4")
    x = torch.linspace(-1, 1, 4096) + 0.0
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    sync.link_bytes_per_s = sync._fixed_wire_bytes(sync.codec) / (0.05 if rank == 0 else 0.1)
    boundaries, taus, codecs = [], [], []
    for step in range(1, 366):
        since = sync.schedule.steps_since_boundary(step)
        x.sub_(0.001 * (rank + 1) * torch.sin(x * step))
        if sync.merge_due(since):
            sync.merge()
        elif since == 0:
            sync.before_boundary(0.01, steps=step)
            codecs.append(sync._round_codec().name)
            sync.boundary()
            boundaries.append(step)
            taus.append(sync.tau)
    sync.drain()
    assert cfg.warmup_iters == 200 and cfg.local_steps == 80, (cfg.warmup_iters, cfg.local_steps)
    assert boundaries == [*range(10, 201, 10), 280, 360], boundaries
    # warm-up rounds: tau_w 1 and int4 (the tau of the slower link, 10, only for the rounds of 80), int8 after
    assert taus == [1] * 19 + [10] * 3 and codecs == ["int4"] * 19 + ["int8"] * 3, (taus, codecs)
    theta = [torch.empty_like(sync.theta) for _ in range(world)]
    dist.all_gather(theta, sync.theta)
    assert torch.equal(theta[0], theta[1])


def test_an_auto_warmup_lengthens_with_the_agreed_h():
    run_world(_auto_h_warmup_worker, 2)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(overlap="delayed", overlap_steps=2), "--diloco-x-overlap-steps applies to --diloco-x-overlap partial"),
    (dict(overlap="partial", overlap_steps=11), "--diloco-x-overlap-steps must be"),
    (dict(overlap="partial", merge="avg"), "--diloco-x-merge must be one of"),
    (dict(overlap="partial", mix_alpha=1.5), "--diloco-x-mix-alpha must be in"),
])
def test_partial_flags_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DiLoCoXConfig(compression="none", local_steps=10, **kwargs)


# ------------------------------------------------------------------ theta agreement per boundary
def _diverged_theta_worker(rank: int, world: int, overlap: str, codec: str, where: str, decision: str) -> None:
    from megatron_diloco.algorithm.decision import ReplicasDivergedError

    # 2 replicas {0, 1}, {2, 3} x 2 shards: outer groups {0, 2} and {1, 3}
    outer = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")][rank % 2]
    kwargs = {}
    if decision == "separate":  # as topology.from_outer_store wires it: the replica's world, then the outer group
        replica = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")][rank // 2]
        kwargs["decision_group"] = (replica, outer)
    cfg = DiLoCoXConfig(replicas=2, local_steps=1, outer_lr=0.7, outer_momentum=0.9, overlap=overlap,
                        overlap_steps=1 if overlap == "partial" else None, compression=codec, outer_state=where,
                        outer_chunk_mb=256 * 4 / 2**20)  # cpu: chunks of 256 elements, a tail chunk
    x = torch.linspace(0, 1, 600) + rank % 2
    sync = OuterSync(ShardView([x]), cfg, outer, **kwargs)
    for _ in range(3):  # the replicas agree: the check passes every boundary
        x.sub_(0.01 * (rank + 1))
        assert not sync.boundary().skipped
    if rank == 3:  # one bit of one element of replica 1's theta at one shard (rank 1 holds its peer)
        sync.theta.view(torch.int32)[300] ^= 1 << 20
    x.sub_(0.01 * (rank + 1))
    with pytest.raises(ReplicasDivergedError) as raised:
        sync.boundary()
    msg = str(raised.value)
    assert msg.startswith("DiLoCoX round 4: the outer parameters theta differ across replicas at this boundary: "
                          "replica 1 differs from the others in 1 of 2 outer groups ([ranks 1, 3])"), msg
    assert sync.pending is None  # nothing of the round was launched


@pytest.mark.parametrize("overlap, codec, where, decision", [
    ("none", "none", "device", "world"),
    ("delayed", "int8", "device", "separate"),
    ("eager", "int4", "host", "world"),
    ("partial", "int8", "host", "separate"),
])
def test_a_diverged_theta_stops_the_next_boundary_on_every_rank(overlap, codec, where, decision):
    """theta of one replica at one shard loses one bit between boundaries (as a corrupted transfer or
    a decode that differs across devices would leave it): the next boundary raises on every rank of
    both replicas and both shards, naming the round, the replica and the group, before anything of the
    round is launched; the three boundaries before it, with the replicas agreeing, pass. Every way theta
    is fingerprinted: the pseudo-gradient's pass (``none``), the outer step's (``delayed``, ``eager``),
    ``partial``'s prepare pass; the host layout in chunks; the decision over the world, or over the
    replica's world then the outer group (separate launches)."""
    run_world(_diverged_theta_worker, 4, overlap, codec, where, decision)
