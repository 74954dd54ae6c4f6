"""An exchange is timed from its launch to its completion on every backend, and auto tau follows.

NCCL completes a collective's future when the collective is *enqueued*, not when it finishes, so a
collective on the device is timed by polling its completion (``ExchangeHandle.poll``, around every inner
step); one on host tensors (gloo) by its future, which completes with it. The fake work below behaves as
NCCL's does; the gloo test measures a real late peer; the GPU test runs the same case over NCCL.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.throughput.exchange_timing import REPO, delayed_launch_case
from megatron_diloco.algorithm.exchange import ExchangeHandle, ExchangeStats
from tests.dist_utils import run_world


class _EnqueuedFutureWork:
    """A ``dist.Work`` as NCCL's behaves: its future is complete at once (the enqueue), while the
    collective itself completes ``after_s`` later (``is_completed``)."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.perf_counter() + after_s

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> bool:
        return True


def test_exchange_time_is_its_completion_not_its_enqueue():
    """Polled once per 20 ms step, a collective that completes 0.3 s after its launch is timed at
    0.3 s (the midpoint of the polls around its completion: within half a step), not at its future's
    ~0 s; the landing after completion exposes nothing."""
    step_s, after_s = 0.02, 0.3
    handle = ExchangeHandle(torch.zeros(4), _EnqueuedFutureWork(after_s), ExchangeStats(),
                            lambda outer, after: None, on_device=True)  # as an NCCL collective on a GPU
    for _ in range(int(after_s / step_s) + 5):  # the inner steps until the landing
        time.sleep(step_s)
        handle.poll()
    handle.wait()
    assert after_s - step_s <= handle.stats.exchange_s <= after_s + step_s, handle.stats
    assert handle.stats.exposed_s < step_s


def test_waiting_blocks_until_the_collective_completes():
    """A wait before completion returns once the collective completed (the host polls it; NCCL's
    ``Work.wait()`` alone returns at once), and counts that wait as exposed."""
    handle = ExchangeHandle(torch.zeros(4), _EnqueuedFutureWork(0.2), ExchangeStats(), lambda outer, after: None,
                            on_device=True)
    handle.wait()
    assert 0.19 <= handle.stats.exchange_s < 0.3 and 0.15 <= handle.stats.exposed_s < 0.3, handle.stats


def _late_peer(rank: int, world: int, delay_s: float, step_s: float, steps: int) -> None:
    got = delayed_launch_case(rank, world, delay_s, step_s, steps, numel=4096)
    if rank == 0:  # its exchange completed when the late peer launched (rank 0 stamps its own launch
        # after encoding, a little after both left the decision all-reduce: hence the 0.05 s slack)
        assert delay_s - 0.05 <= got["exchange_s"] <= delay_s + 4 * step_s, got
        # the next boundary's tau (agreed: the MAX over ranks) hides that exchange
        assert got["taus"][0] == steps, got  # nothing measured at the first boundary: H
        assert got["taus"][1] == math.ceil(got["exchange_s"] / got["step_s"]), got


def test_auto_tau_follows_a_measured_late_peer():
    """gloo, 2 replicas: replica 1 launches 0.5 s late; replica 0 measures ~0.5 s and the next auto
    tau is ceil(0.5 s / step) (a measurement, not made-up statistics)."""
    run_world(_late_peer, 2, 0.5, 0.04, 25)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_exchange_time_follows_a_late_peer(tmp_path):
    """The same over NCCL on 2 GPUs (the path CI cannot run): the measured exchange time follows a
    2 s late launch, and auto tau with it."""
    out = tmp_path / "timing.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(REPO / "benchmarks/throughput/exchange_timing.py"), "--backend", "nccl",
                    "--delay-s", "2.0", "--step-s", "0.05", "--local-steps", "100", "--out", str(out)],
                   check=True, timeout=300, cwd=REPO)
    got = json.loads(out.read_text())
    assert 2.0 - got["step_s"] <= got["measured_exchange_s"] <= 2.0 + 2 * got["step_s"], got
    assert got["auto_tau_after"] == got["expected_tau"] >= 39, got


def test_a_host_collective_is_timed_by_its_future():
    """gloo (host tensors) completes a collective's future when the collective completes: that time is
    taken, not the next poll's (a fast exchange is not rounded up to the polling interval)."""

    class _HostWork(_EnqueuedFutureWork):
        def get_future(self):
            fut = torch.futures.Future()
            self.fut = fut
            return fut

    work = _HostWork(0.0)
    handle = ExchangeHandle(torch.zeros(4), work, ExchangeStats(), lambda outer, after: None)
    time.sleep(0.01)
    work.fut.set_result(None)  # the collective completed (10 ms after the launch)
    time.sleep(0.2)  # the next poll comes much later
    handle.poll()
    handle.wait()
    assert 0.01 <= handle.stats.exchange_s < 0.1, handle.stats
