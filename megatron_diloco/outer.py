"""Outer optimizer state and the outer Nesterov step, on one rank's fp32 parameter shard.

Every tensor here is a *flat* fp32 vector over the rank's shard: the concatenation, in a fixed order,
of the fp32 main-parameter shards its inner (distributed) optimizer updates. The shard is the same
on every rank of the rank's outer group (same TP rank, PP stage and intra-DP index in each replica),
so ``theta`` and ``momentum`` are replicated across the outer group, bit for bit.

Memory per parameter of the shard (fp32): ``theta`` 4 B + ``momentum`` 4 B (only when mu > 0)
+ the exchange buffer 4 B (owned by :mod:`megatron_diloco.sync`).
"""

from __future__ import annotations

from typing import Sequence

import torch


class ShardView:
    """The rank's fp32 main-parameter shards seen as one flat vector.

    Args:
        shards: the fp32 main-parameter shard tensors (any shapes; contiguous), in a fixed order that
            is the same on every rank of the outer group. Modified in place by :meth:`scatter_`.
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

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the shards into ``out`` (fp32, ``[numel]``) and return it."""
        if self.flat_views:
            torch.cat(self.flat_views, out=out)
        return out

    def scatter_(self, src: torch.Tensor) -> None:
        """Copy the flat ``src`` (fp32, ``[numel]``) back into the shards, in place."""
        if self.flat_views:
            torch._foreach_copy_(self.flat_views, self.split(src))


class OuterNesterov:
    """Outer SGD with (Nesterov) momentum on a flat fp32 shard; PyTorch ``torch.optim.SGD`` semantics.

    With pseudo-gradient ``Delta`` (the replicas' mean of ``theta - x_r``)::

        m     <- mu * m + Delta
        theta <- theta - eta * (Delta + mu * m)     (Nesterov)
        theta <- theta - eta * m                    (heavy ball)

    Args:
        theta: initial outer parameters, fp32 ``[numel]``; owned (not copied) by this object.
        lr: eta. momentum: mu (0 allocates no momentum buffer). nesterov: Nesterov or heavy ball.
    """

    def __init__(self, theta: torch.Tensor, lr: float, momentum: float, nesterov: bool) -> None:
        self.theta = theta
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.momentum_buffer = torch.zeros_like(theta) if momentum > 0.0 else None

    @torch.no_grad()
    def step(self, delta: torch.Tensor) -> None:
        """Apply one outer step with the averaged pseudo-gradient ``delta`` (fp32 ``[numel]``).

        ``delta`` is used as scratch and holds garbage afterwards (saves a buffer of the shard size).
        """
        m = self.momentum_buffer
        if m is None:
            self.theta.add_(delta, alpha=-self.lr)
            return
        m.mul_(self.momentum).add_(delta)
        if self.nesterov:
            delta.add_(m, alpha=self.momentum)
            self.theta.add_(delta, alpha=-self.lr)
        else:
            self.theta.add_(m, alpha=-self.lr)

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {"theta": self.theta, "momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        self.theta.copy_(state["theta"])
        if self.momentum_buffer is not None:
            if state.get("momentum_buffer") is None:
                raise ValueError("checkpoint has no outer momentum buffer but --diloco-x-outer-momentum > 0")
            self.momentum_buffer.copy_(state["momentum_buffer"])


def fingerprint(tensors: Sequence[torch.Tensor], chunk: int = 1 << 22) -> torch.Tensor:
    """A bitwise fingerprint of ``tensors`` (int64 ``[2]``, on their device).

    Two position-weighted wrap-around sums over the raw bits: equal tensors give equal fingerprints;
    any single changed bit changes the first sum. Used to check that replicas are bit-identical
    without moving parameters off the device.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    acc = torch.zeros(2, dtype=torch.int64, device=device)
    offset = 0
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
