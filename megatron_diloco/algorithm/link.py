"""The outer link: bytes on the wire per collective, bounded waits, the link measurement, host staging.

What every exchange and check over an outer group shares: :func:`wire_bytes` (what a collective puts
on the link per rank), :func:`wait_within` (poll a collective to completion, not past a deadline),
:func:`bounded_all_reduce`, :func:`measure_link_bandwidth` (once per run) and :func:`host_copy` (GPU
tensors crossing a gloo group as page-locked host copies).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def wire_bytes(collective: str, payload_bytes: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) to exchange one ``payload_bytes`` payload over a group of
    ``group_size``: ``all-reduce`` (ring), or ``all-gather`` (R-1 payloads out, R-1 in)."""
    if collective == "all-reduce":
        return ring_allreduce_bytes(payload_bytes, group_size)
    return max(0, group_size - 1) * payload_bytes


def ring_allreduce_bytes(payload_bytes: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes``."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * payload_bytes // group_size


def wait_within(work, deadline: float | None, is_done: Callable[[], bool] | None = None) -> None:
    """Wait for ``work`` (a ``dist.Work``, or anything with ``is_completed()`` and ``wait()``) to
    complete, but not past ``deadline`` (a ``time.perf_counter()`` value; None: unbounded).

    Polls ``is_done`` (default ``work.is_completed``; sleeping 0.1 ms, doubling up to 10 ms) and raises
    ``TimeoutError`` once the deadline passes; then ``wait()``, which re-raises the backend's own error
    (a gloo timeout, a closed connection) and, for NCCL, makes the current stream wait for the
    collective. The host returns once the collective itself completed (NCCL: its end event on the
    communicator's stream; never a sync of the caller's stream). Polling works the same on every
    backend: ``Work.wait(timeout)`` returns at once on NCCL (it only orders the current stream) and, on
    expiry, may abort the communicator instead of returning to the caller.
    """
    done = is_done or work.is_completed
    pause = 1e-4
    while not done():
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError("did not complete before its deadline")
            time.sleep(min(pause, left))
        else:
            time.sleep(pause)
        pause = min(2 * pause, 1e-2)
    work.wait()


def bounded_all_reduce(tensor: torch.Tensor, op, group: dist.ProcessGroup | None,
                       timeout_s: float | None) -> None:
    """``dist.all_reduce`` of ``tensor`` in place over ``group``, raising ``TimeoutError`` when it has
    not completed ``timeout_s`` seconds after its start (None: unbounded). Collective over ``group``."""
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    wait_within(dist.all_reduce(tensor, op=op, group=group, async_op=True), deadline)


def measure_link_bandwidth(group: dist.ProcessGroup | None, device: torch.device,
                           sizes: tuple[int, int] = (128 << 10, 2 << 20), repeats: int = 2,
                           timeout_s: float | None = None) -> float | None:
    """Measure the outer group's link: bytes/s one rank sends in an all-gather, latency removed.

    Times blocking ``all_gather_into_tensor`` of a small and a large uint8 payload per rank (best of
    ``repeats`` each) and returns ``(R - 1) * (large - small) / (t_large - t_small)``, the MIN over the
    group so every replica agrees on it. Collective over ``group``; nothing else may use the group
    meanwhile. Cost: about ``2 * repeats`` transfers of ``sizes[1]`` bytes per rank (at 10 Mbit/s
    ~3.5 s, once). Returns None for a group of one rank (no link).

    ``timeout_s``: the whole measurement must complete within it (``TimeoutError`` otherwise: a peer
    that never joins, a link that stopped answering); None: unbounded.
    """
    size = dist.get_world_size(group) if group is not None else 1
    if size <= 1:
        return None
    if dist.get_backend(group) == "gloo":  # a gloo group's payloads are host tensors
        device = torch.device("cpu")
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    best = []
    for n in sizes:
        payload = torch.zeros(n, dtype=torch.uint8, device=device)
        out = torch.empty(size * n, dtype=torch.uint8, device=device)  # (R*n,)
        times = []
        for _ in range(repeats):
            wait_within(dist.barrier(group=group, async_op=True,
                                     **({"device_ids": [device.index]} if device.type == "cuda" else {})),
                        deadline)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            wait_within(dist.all_gather_into_tensor(out, payload, group=group, async_op=True), deadline)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        best.append(min(times))
    dt = max(best[1] - best[0], 1e-9)
    bw = torch.tensor([(size - 1) * (sizes[1] - sizes[0]) / dt], dtype=torch.float64, device=device)
    wait_within(dist.all_reduce(bw, op=dist.ReduceOp.MIN, group=group, async_op=True), deadline)
    return float(bw.item())


def host_copy(t: torch.Tensor, group, copy: bool = True) -> torch.Tensor:
    """``t`` itself, or, for a GPU tensor crossing a gloo group of several ranks (replicas in separate
    worlds, whose outer groups are gloo: :func:`megatron_diloco.megatron_adapter.topology.from_outer_store`; the
    matrix codecs' worker over the gloo mirror of an NCCL outer group), a page-locked host tensor of
    its shape holding a copy of it (``copy``: the caller's thread waits for it on its current
    stream, as for ``t.cpu()``) or nothing yet (an output). The one staging mechanism of every
    exchange.

    Page-locked through PyTorch's caching host allocator, so the copy back (``dst.copy_(staged,
    non_blocking=True)``) is only enqueued on the current stream: the training thread does not
    stall on it (a pageable copy waits for all the work queued before it: a bubble in the inner
    step where an exchange lands), and the allocator keeps the block until that copy has run. Its
    blocks are reused across rounds; sizes are rounded up to a power of two."""
    if group is None or not t.is_cuda or dist.get_world_size(group) <= 1 or dist.get_backend(group) != "gloo":
        return t
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    if copy:
        staged.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()  # the collective reads it on gloo's thread
    return staged


def job_reduce(value: float, op, job_group, timeout_s: float | None) -> float:
    """``value`` (a number; a bool as 0 / 1) reduced with ``op`` over ``job_group``, a job's own world, as float64
    (bounded by ``timeout_s``; collective over it); ``value`` itself without a group of more than one rank."""
    if job_group is None or dist.get_world_size(job_group) <= 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    bounded_all_reduce(t, op, job_group, timeout_s)
    return float(t.item())
