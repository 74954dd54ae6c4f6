"""The outer optimizer: outer parameters, momentum and the outer Nesterov step, on one rank's shard.

Every tensor here is a *flat* fp32 vector over the rank's shard (see
:class:`megatron_diloco.algorithm.shard_view.ShardView`). The shard is the same on every rank of the rank's
outer group, so ``theta`` and ``momentum`` are replicated across the outer group, bit for bit.

Memory per parameter of the shard (fp32): ``theta`` 4 B + ``momentum`` 4 B (only when mu > 0);
:class:`megatron_diloco.algorithm.sync.OuterSync` adds ``exchange_buffer`` 4 B, ``residual`` 4 B (lossy codecs) and
``eager_anchor`` 4 B (eager). On the device or in host memory (``--diloco-x-outer-state``,
:mod:`megatron_diloco.algorithm.outer_store`); a step over host-held state runs chunk by chunk on staged
copies (:meth:`OuterNesterov.over`).
"""

from __future__ import annotations

import torch


class OuterNesterov:
    """Outer SGD with (Nesterov) momentum on a flat fp32 shard; PyTorch ``torch.optim.SGD`` semantics.

    With pseudo-gradient ``Delta`` (the replicas' mean of ``theta - x_r``)::

        m     <- mu * m + Delta
        theta <- theta - eta * (Delta + mu * m)     (Nesterov)
        theta <- theta - eta * m                    (heavy ball)

    Args:
        theta: initial outer parameters, fp32 ``[numel]``; owned (not copied) by this object.
        lr: eta. momentum: mu (0 allocates no momentum buffer). nesterov: Nesterov or heavy ball.
        momentum_buffer: the momentum m, fp32 ``[numel]``, owned; None: zeros like ``theta`` (when
            mu > 0). Pass one to keep m elsewhere than theta's allocation (host memory:
            :class:`megatron_diloco.algorithm.outer_store.OuterStore`).
    """

    def __init__(self, theta: torch.Tensor, lr: float, momentum: float, nesterov: bool,
                 momentum_buffer: torch.Tensor | None = None) -> None:
        self.theta = theta
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        if momentum > 0.0 and momentum_buffer is None:
            momentum_buffer = torch.zeros_like(theta)
        self.momentum_buffer = momentum_buffer if momentum > 0.0 else None

    def tensors(self) -> list[torch.Tensor]:
        """``[theta]`` or ``[theta, m]``: the state the step reads and writes."""
        return [self.theta] if self.momentum_buffer is None else [self.theta, self.momentum_buffer]

    def over(self, tensors: list[torch.Tensor]) -> "OuterNesterov":
        """The same outer optimizer over other tensors laid out as :meth:`tensors` (a chunk of
        theta and m staged on the device); nothing is allocated or copied."""
        return OuterNesterov(tensors[0], self.lr, self.momentum, self.nesterov,
                             tensors[1] if self.momentum_buffer is not None else None)

    @torch.no_grad()
    def step(self, avg: torch.Tensor) -> None:
        """Apply one outer step with the averaged pseudo-gradient ``avg`` (fp32 ``[numel]``).

        ``avg`` is used as scratch and holds garbage afterwards (saves a buffer of the shard size).
        """
        m = self.momentum_buffer
        if m is None:
            self.theta.add_(avg, alpha=-self.lr)
            return
        m.mul_(self.momentum).add_(avg)
        if self.nesterov:
            avg.add_(m, alpha=self.momentum)
            self.theta.add_(avg, alpha=-self.lr)
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
