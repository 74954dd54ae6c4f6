"""Exchange slots: a rank's fp32 main-parameter shard cut into the pieces that ranks of a larger data-parallel
size hold, so that sites of different DP can exchange the same vectors.

Megatron's distributed optimizer gives rank r of a data-parallel group of d the contiguous range
``[r L / d, (r + 1) L / d)`` of every bucket of its grad buffers (L: the bucket's padded length). Where two
sites build the same buckets (the same model and the same L: the bucket's end is padded to a multiple of
lcm(d, 128), the same for every power of two d <= 128; the bucket size is max(40M, 1M x d) elements unless
``--ddp-bucket-size`` is given, the same for every d <= 40), the range of rank r at DP d is the union of the
ranges of ranks r k .. r k + k - 1 at DP d k, bucket by bucket. **Slot** s of G is the range rank s holds at
DP G; a rank of a site of DP d (d divides G) holds the k = G / d slots r k .. (r + 1) k - 1.

:func:`slot_pieces` lists, per slot of this rank, the pieces of its fp32 main-parameter shards (the tensors
of :class:`~megatron_diloco.algorithm.shard_view.ShardView`, in its order) that fall in the slot, in that
order. A slot's concatenation is then the same vector on a rank of any DP (the main shards of a DP-G rank,
in order, are exactly its one slot): ``tests/test_exchange_slots.py`` checks it on real Megatron buffers at
DP 1, 2 and 4, element by element. Local: no communication.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of the ``main``-th fp32 main-parameter shard (ShardView order)."""

    main: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class MainRange:
    """Where one fp32 main-parameter shard sits in its grad buffer (Megatron's "world" index of the buffer)."""

    param: torch.nn.Parameter
    """The model parameter it is a shard of."""
    param_start: int
    """The shard's first element in the parameter (flattened)."""
    buffer: tuple[int, int]
    """(the distributed optimizer's index in the chain, the buffer's index in it)."""
    start: int
    end: int
    """The shard's elements ``[start, end)`` of the buffer (element i of the shard is element start + i)."""
    bucket: tuple[int, int]
    """The bucket's ``(offset, padded length)`` in the buffer."""


def main_ranges(dist_opts: list) -> list[MainRange]:
    """Each fp32 main-parameter shard of ``dist_opts`` (Megatron ``DistributedOptimizer`` parts of one chain), in
    the order the inner optimizers list them (``ShardView``'s), with its place in its grad buffer. Local."""
    out = []
    for k, d in enumerate(dist_opts):
        for g, group in enumerate(d.optimizer.param_groups):
            model = [*d.model_fp32_groups[g], *d.model_float16_groups[g]]
            mains = group["params"]
            if len(model) != len(mains):  # (a precision-aware optimizer lists its shards otherwise)
                raise ValueError("exchange slots: the optimizer's parameter groups are not Megatron's fp32 main "
                                 "shards (a precision-aware optimizer is not supported)")
            for param, main in zip(model, mains):
                gbuf, dtype, b = d.model_param_gbuf_map[param]
                ranges = d._get_model_param_range_map(param)
                world = ranges["gbuf_world"]
                if main.numel() != world.size:
                    raise ValueError(f"exchange slots: a main shard of {main.numel()} elements for a buffer range of "
                                     f"{world.size}")
                bucket = d.buffers[gbuf].buckets[b]
                out.append(MainRange(param, ranges["param"].start, (k, gbuf), world.start, world.end,
                                     (bucket.offset, bucket.grad_data.numel())))
    return out


def slot_pieces(ranges: list[MainRange], dp_rank: int, dp_size: int, slots: int) -> list[list[Piece]]:
    """The pieces of each of this rank's ``slots // dp_size`` slots (slot ``dp_rank * k + j`` for j = 0..k-1), each
    in main-shard order. ``ranges``: :func:`main_ranges` of this rank (DP rank ``dp_rank`` of ``dp_size``).
    ValueError when ``slots`` is not a multiple of ``dp_size`` or a bucket's padded length is not a multiple of
    ``slots`` (the sites' buckets could not be cut alike). Local."""
    if slots < dp_size or slots % dp_size:
        raise ValueError(f"exchange slots: {slots} slots are not a multiple of this site's data-parallel size "
                         f"{dp_size}")
    k = slots // dp_size
    out: list[list[Piece]] = [[] for _ in range(k)]
    for i, r in enumerate(ranges):
        offset, length = r.bucket
        if length % slots:
            raise ValueError(f"exchange slots: a bucket of {length} elements does not split into {slots} slots "
                             "(its padding is a multiple of lcm(DP, 128) elements: use a power of two <= 128)")
        width = length // slots
        for j in range(k):
            lo = offset + (dp_rank * k + j) * width
            a, b = max(r.start, lo), min(r.end, lo + width)
            if a < b:
                out[j].append(Piece(i, a - r.start, b - r.start))
    return out


def slot_views(shards: list[torch.Tensor], pieces: list[Piece]) -> list[torch.Tensor]:
    """Views (1-D, same storage) of the fp32 main shards ``shards`` (ShardView order) for one slot's ``pieces``."""
    return [shards[p.main].detach().view(-1)[p.lo:p.hi] for p in pieces]


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """How one rank takes part in a run of sites of different data-parallel size (``--diloco-x-exchange-slots``
    G): its slots, in the order the outer state keeps them."""

    views: list[torch.Tensor]
    """The fp32 main shards' pieces, slot by slot (the :class:`~megatron_diloco.algorithm.shard_view.ShardView`
    of the outer state: slot-major)."""
    bounds: tuple[int, ...]
    """Where each slot starts and ends in that order (``[k + 1]``)."""
    virtual_ranks: tuple[int, ...]
    """Each slot's rank in every job of the run: ``tp + TP x (pp + PP x slot)`` (Megatron's tp-pp-dp order at
    DP G: a rank of a site of DP G keeps its own rank)."""
    virtual_world: int
    """TP x PP x G: the world of every job of the run, counted in slots."""
    layouts: list[list[tuple[tuple[int, ...], int, int]]]
    """Per slot: (its parameter's shape, the piece's start in the flattened parameter, its length), per piece:
    what the handshake compares with the other sites' ranks of the same virtual rank."""


def exchange_plan(dist_opts: list, shards: list[torch.Tensor], slots: int) -> ExchangePlan:
    """This rank's :class:`ExchangePlan` for ``slots`` = G (``shards``: its fp32 main shards in ShardView
    order). Reads its tensor- and pipeline-parallel ranks from Megatron's ``parallel_state`` and its
    data-parallel rank from the distributed optimizer's group (context parallelism must be 1). Local."""
    from megatron.core import parallel_state as ps

    group = dist_opts[0].buffers[0].data_parallel_group
    dp_rank, dp_size = group.rank(), group.size()
    ranges = main_ranges(dist_opts)
    pieces = slot_pieces(ranges, dp_rank, dp_size, slots)
    views = [v for slot in pieces for v in slot_views(shards, slot)]
    bounds = [0]
    for slot in pieces:
        bounds.append(bounds[-1] + sum(p.hi - p.lo for p in slot))
    tp, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    k = slots // dp_size
    virtual = tuple(tp + tp_size * (pp + pp_size * (dp_rank * k + j)) for j in range(k))
    layouts = [[(tuple(ranges[p.main].param.shape), ranges[p.main].param_start + p.lo, p.hi - p.lo) for p in slot]
               for slot in pieces]
    return ExchangePlan(views, tuple(bounds), virtual, tp_size * pp_size * slots, layouts)
