"""The rank's fp32 main-parameter shards seen as one flat vector, and a bitwise fingerprint of tensors.

The outer state of :mod:`megatron_diloco.algorithm.sync` lives in *flat* fp32 vectors over the rank's shard: the
concatenation, in a fixed order, of the fp32 main-parameter shards its inner (distributed) optimizer
updates. :class:`ShardView` is the bridge between those shards (Megatron's buffers, updated in place)
and a flat vector; both directions are local copies. The shard is the same on every rank of the
rank's outer group (same TP rank, PP stage and intra-DP index in each replica).
"""

from __future__ import annotations

from typing import Sequence

import torch


class ShardView:
    """The rank's fp32 main-parameter shards seen as one flat vector.

    Args:
        shards: the fp32 main-parameter shard tensors (any shapes; contiguous), in a fixed order that
            is the same on every rank of the outer group. Modified in place by :meth:`copy_from_`.
    """

    def __init__(self, shards: Sequence[torch.Tensor]) -> None:
        for s in shards:
            if s.dtype != torch.float32:
                raise TypeError(f"outer state needs fp32 main-parameter shards, got {s.dtype}")
        self.shards = list(shards)
        self.flat_views = [s.detach().view(-1) for s in self.shards]  # same storage, no autograd
        self.numel = sum(s.numel() for s in self.shards)
        self.device = self.shards[0].device if self.shards else torch.device("cpu")

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat ``[numel]`` tensor, one per shard (flattened), in shard order."""
        return list(flat.split([v.numel() for v in self.flat_views]))

    def pieces(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Views of the shards covering the flat range ``[lo, hi)``, in order (the whole
        :attr:`flat_views` for ``[0, numel)``; a shard cut by ``lo`` or ``hi`` contributes its part)."""
        if lo == 0 and hi == self.numel:
            return list(self.flat_views)
        out, start = [], 0
        for v in self.flat_views:
            end = start + v.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out.append(v[a - start:b - start])
            start = end
        return out

    def split_like(self, flat: torch.Tensor, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``flat`` (a chunk ``(hi - lo,)``) split as ``pieces`` (:meth:`pieces` of the chunk)."""
        return list(flat.split([p.numel() for p in pieces]))

    def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the shards into the flat ``out`` (fp32, ``[numel]``) and return it. Local: no
        communication."""
        if self.flat_views:
            torch.cat(self.flat_views, out=out)
        return out

    def copy_from_(self, src: torch.Tensor) -> None:
        """Copy the flat ``src`` (fp32, ``[numel]``) into the shards, in place. Local: no
        communication."""
        if self.flat_views:
            torch._foreach_copy_(self.flat_views, self.split(src))


def fingerprint(tensors: Sequence[torch.Tensor], chunk: int = 1 << 22, start: int = 0,
                acc: torch.Tensor | None = None) -> torch.Tensor:
    """A bitwise fingerprint of ``tensors`` (int64 ``[2]``, on their device).

    Two position-weighted wrap-around sums over the raw bits: equal tensors give equal fingerprints;
    any single changed bit changes the first sum. Used to check that replicas are bit-identical
    without moving parameters off the device.

    ``start``, ``acc``: continue a fingerprint: ``tensors`` begin at element ``start`` of the
    concatenation and are added into ``acc`` (in place; returned). The sums are exact (integer), so
    pieces fingerprinted this way give the value of the whole.
    """
    device = acc.device if acc is not None else tensors[0].device if tensors else torch.device("cpu")
    acc = torch.zeros(2, dtype=torch.int64, device=device) if acc is None else acc
    offset = start
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.dtype in (torch.float32, torch.int32):
            bits_all = flat.view(torch.int32)
        elif flat.dtype in (torch.bfloat16, torch.float16, torch.int16):
            bits_all = flat.view(torch.int16)
        else:
            bits_all = flat.to(torch.float64).view(torch.int64)
        for start in range(0, bits_all.numel(), chunk):
            bits = bits_all[start:start + chunk].to(torch.int64)
            weight = torch.arange(offset + start, offset + start + bits.numel(),
                                  dtype=torch.int64, device=device) % 1_000_003 + 1
            acc[0] += bits.sum()
            acc[1] += (bits * weight).sum()
        offset += bits_all.numel()
    return acc
