"""The in-process slow-link model of ``harness/link_model.py`` on 2 gloo ranks.

Each case installs a link of a few Mbit/s. The cases that check the model's timing (a transfer's
duration, overlap with compute, the FIFO queue, a coalesced batch) run on a :class:`ManualClock`: the
link's waits and the test's "compute" advance one exact, reproducible time, so the expected times are
checked exactly whatever the machine's load. One case checks that the wall clock is what a real run
waits on (a lower bound only), and one runs the package's exchanges, with a worker thread, on the wall
clock (a bound halfway between an overlapped and a serial transfer).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import link_model
from harness.link_model import ManualClock
from tests.dist_utils import run_world

MBPS = 8.0  # 1 MB/s: 1 byte = 1 microsecond
LATENCY_MS = 20.0


def _modelled(kind: str, nbytes: int, n: int = 2) -> float:
    wire, hops = link_model.ring_cost(kind, nbytes, n)
    return hops * LATENCY_MS / 1e3 + wire / (MBPS * 1e6 / 8)


def test_ring_cost_formulas():
    B = 1200
    assert link_model.ring_cost("all_reduce", B, 4) == (2 * 3 * B // 4, 6)
    assert link_model.ring_cost("reduce_scatter", B, 4) == (3 * B // 4, 3)
    assert link_model.ring_cost("all_gather", B, 4) == (3 * B, 3)  # B = one rank's input
    assert link_model.ring_cost("broadcast", B, 4) == (B, 3)
    assert link_model.ring_cost("all_reduce", B, 1) == (0, 0)


def test_crosses_replicas():
    assert not link_model.crosses_replicas([0, 1], ranks_per_replica=2)
    assert link_model.crosses_replicas([0, 2], ranks_per_replica=2)
    assert link_model.crosses_replicas([1, 3], ranks_per_replica=2)
    assert not link_model.crosses_replicas([3], ranks_per_replica=1)


def _sync_all_reduce(rank, world):
    clock = ManualClock()
    link = link_model.install(MBPS, LATENCY_MS, replicas=2, clock=clock)
    t = torch.ones(100_000)  # 400 kB -> ring all-reduce over 2 sends 400 kB: 0.4 s + 2 x 20 ms
    expected = _modelled("all_reduce", 400_000)
    t0 = clock.now()
    dist.all_reduce(t)
    assert clock.now() - t0 == pytest.approx(expected)
    assert torch.equal(t, torch.full_like(t, 2.0)), "the real collective must still run"
    assert link.bytes_sent == 400_000 and link.cross_ops == 1
    assert link.modelled_s == pytest.approx(expected) and link.waited_s == pytest.approx(expected)
    # on the wall clock (the default), the op returns no earlier than the model says
    link = link_model.install(MBPS, LATENCY_MS, replicas=2)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    assert time.perf_counter() - t0 >= expected - 1e-3
    assert torch.equal(t, torch.full_like(t, 4.0))


def test_sync_all_reduce_takes_the_modelled_time():
    run_world(_sync_all_reduce, 2)


def _async_overlaps(rank, world):
    clock = ManualClock()
    link = link_model.install(MBPS, LATENCY_MS, replicas=2, clock=clock)
    t = torch.ones(125_000)  # 500 kB all-reduce: 0.5 s + 40 ms on the link
    expected = _modelled("all_reduce", 500_000)
    t0 = clock.now()
    work = dist.all_reduce(t, async_op=True)
    assert clock.now() == t0, "launching an async op must not wait for the transfer"
    clock.sleep(0.3)  # "compute" while the transfer is in flight
    assert not work.is_completed()
    work.wait()
    assert clock.now() - t0 == pytest.approx(expected), "the max of transfer and compute, not their sum"
    assert link.waited_s == pytest.approx(expected - 0.3)  # the rest was hidden under the compute
    t0 = clock.now()
    work = dist.all_reduce(t, async_op=True)
    clock.sleep(0.8)  # compute longer than the transfer: the wait costs nothing
    work.wait()
    assert clock.now() - t0 == pytest.approx(0.8)
    # a future that completes at the modelled finish (ExchangeHandle times exchanges with it)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert not fut.done()
    clock.sleep(expected - 1e-3)
    assert not fut.done()
    clock.sleep(2e-3)
    assert fut.done()
    work.wait()


def test_async_all_reduce_overlaps_with_compute():
    run_world(_async_overlaps, 2)


def _bytes_and_queue(rank, world):
    link = link_model.install(MBPS, LATENCY_MS, replicas=2)
    x = torch.ones(50_000)  # 200 kB
    out_rs = torch.empty(25_000)
    out_ag = torch.empty(100_000)
    lst = [torch.empty(50_000) for _ in range(2)]
    dist.reduce_scatter_tensor(out_rs, x)
    dist.all_gather_into_tensor(out_ag, x)
    dist.all_gather(lst, x)
    dist.broadcast(x, src=0)
    kinds = link.stats()["kinds"]
    assert kinds["reduce_scatter"]["bytes"] == 100_000  # (n-1)/n of the 200 kB input
    assert kinds["all_gather"]["bytes"] == 2 * 200_000  # (n-1) x input, twice
    assert kinds["broadcast"]["bytes"] == 200_000
    assert link.bytes_sent == 100_000 + 400_000 + 200_000
    # Two async transfers queue on the link (FIFO): the second finishes after both.
    clock = ManualClock()
    link = link_model.install(MBPS, LATENCY_MS, replicas=2, clock=clock)
    a, b = torch.ones(50_000), torch.ones(50_000)  # 200 kB each: 0.2 s + 40 ms each
    t0 = clock.now()
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    wb.wait()
    assert clock.now() - t0 == pytest.approx(2 * _modelled("all_reduce", 200_000))
    wa.wait()
    # A coalesced batch (Megatron's DDP buckets) is one transfer: bytes summed, latency once.
    before, t0 = link.modelled_s, clock.now()
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    expected = 2 * LATENCY_MS / 1e3 + 400_000 / (MBPS * 1e6 / 8)
    assert link.modelled_s - before == pytest.approx(expected)
    assert clock.now() - t0 == pytest.approx(expected)


def test_bytes_follow_the_ring_formulas_and_transfers_queue():
    run_world(_bytes_and_queue, 2)


def _intra_replica_untouched(rank, world):
    clock = ManualClock()
    link = link_model.install(1.0, 1000.0, replicas=1, clock=clock)  # 1 Mbit/s, 1 s latency: would be obvious
    t = torch.ones(100_000)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    assert clock.now() == 0.0
    assert link.bytes_sent == 0 and link.cross_ops == 0 and link.local_ops == 2
    # Accounting-only mode (no bandwidth): bytes counted, nothing slowed.
    link = link_model.install(None, 1000.0, replicas=2, clock=clock)
    dist.all_reduce(t)
    assert clock.now() == 0.0
    assert link.bytes_sent == 400_000 and link.modelled_s == 0.0
    link.uninstall()
    assert not hasattr(dist.all_reduce, "_link_model")


def test_intra_replica_group_is_not_slowed():
    run_world(_intra_replica_untouched, 2)


def _exchanges(rank, world):
    """The DiLoCoX exchanges under the model: the fp32 all-reduce and the int8 all-gather
    (``dist.Work`` handles waited by ``ExchangeHandle``) and the low-rank one (blocking
    collectives on a worker thread) all overlap with the caller's compute: 1 s of sleep and a
    ~0.8-1.1 s exchange cost their max, not their sum. The bound sits halfway between the two (a
    loaded 2-core machine added ~0.35 s to 0.6 s exchanges once, past a fixed 0.3 s slack)."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_diloco.algorithm.exchange import start_exchange
    from megatron_diloco.algorithm.compression import get_codec

    link = link_model.install(MBPS, 500.0, replicas=2)  # 500 ms per hop, 1 MB/s
    group = dist.group.WORLD  # the outer group (None would mean a single replica)
    compute_s = 1.0

    def timed(start):
        dist.barrier()
        before, t0 = link.modelled_s, time.perf_counter()
        handle = start()
        time.sleep(compute_s)
        out = handle.wait()
        elapsed, modelled = time.perf_counter() - t0, link.modelled_s - before
        assert modelled >= 0.75, modelled
        overlapped, serial = max(modelled, compute_s), modelled + compute_s
        assert modelled - 1e-3 <= elapsed < (overlapped + serial) / 2, (elapsed, modelled)
        return out

    fp32 = torch.full((16_000,), float(rank))  # 64 kB all-reduce: 2 hops + 64 ms
    out = timed(lambda: start_exchange(fp32, None, get_codec("none"), group))
    assert torch.equal(out, torch.full_like(out, 0.5))
    q = torch.full((300_000,), float(rank))  # ~0.3 MB int8 payload: 1 hop + ~0.3 s
    out = timed(lambda: start_exchange(q, torch.zeros_like(q), get_codec("int8"), group))
    assert torch.allclose(out, torch.full_like(out, 0.5), atol=1e-2)
    m = torch.randn(64 * 64)
    with ThreadPoolExecutor(max_workers=1) as pool:  # two dependent all-gathers (P, then Q)
        timed(lambda: start_exchange(m, torch.zeros_like(m), get_codec("lowrank", [(0, (64, 64))], rank=2),
                                     group, worker=pool))


def test_diloco_exchanges_overlap_under_the_model():
    run_world(_exchanges, 2)
