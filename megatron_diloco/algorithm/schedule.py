"""The round schedule: for any inner step, where the boundaries fall, how long the round it starts is,
which codec its exchange takes and how many steps (tau) that exchange may overlap.

Rounds of H0 (``--diloco-x-warmup-local-steps``) for the first W steps (``--diloco-x-warmup-iters``),
then rounds of H (``--diloco-x-local-steps``). An exchange launched into a round shorter than H (a
warm-up round) takes the warm-up codec (``--diloco-x-warmup-compression``) and overlaps at most tau_w
steps (``--diloco-x-warmup-overlap-steps``; 0 blocks); one launched into a round of H overlaps at most
H. Within that cap tau is ``--diloco-x-overlap-steps``, or (auto) the fewest steps, at least 1, that
hide the exchange: ceil(exchange seconds / step seconds).

:class:`RoundSchedule` answers these from a :class:`~megatron_diloco.algorithm.config.DiLoCoXConfig`,
read live (a resume that keeps its checkpoint's warm-up, or a run length known late, changes the
config's warm-up fields). The optimizer (boundaries), :class:`~megatron_diloco.algorithm.sync.OuterSync`
(codec, tau) and the planner (``python -m megatron_diloco.plan``) all ask it.
"""

from __future__ import annotations

import math

from megatron_diloco.algorithm.config import DiLoCoXConfig


def steps_to_hide(exchange_s: float, step_s: float) -> int:
    """The fewest inner steps, at least 1, whose time covers ``exchange_s`` (auto tau before its cap)."""
    return max(1, math.ceil(exchange_s / step_s)) if exchange_s > 0 else 1


class RoundSchedule:
    """The round schedule of ``config`` (see the module doc). Local: no communication, no state."""

    def __init__(self, config: DiLoCoXConfig) -> None:
        self.config = config

    def steps_since_boundary(self, steps: int) -> int:
        """Inner steps since the last boundary after ``steps`` inner steps (0: ``steps`` ends a round,
        or is 0): rounds of H0 during the warm-up, then of H. (Validation makes W > 0 exactly when
        H0 is set.)"""
        c = self.config
        w = c.warmup_iters
        return steps % c.warmup_local_steps if w and steps <= w else (steps - w) % c.local_steps

    def is_boundary(self, steps: int) -> bool:
        """Whether a boundary falls after ``steps`` (>= 1) inner steps."""
        return steps > 0 and self.steps_since_boundary(steps) == 0

    def round_steps(self, steps: int) -> int:
        """Inner steps of the round that starts after ``steps`` inner steps (at a boundary)."""
        c = self.config
        return c.warmup_local_steps if steps < c.warmup_iters else c.local_steps

    def is_warmup_round(self, round_steps: int) -> bool:
        """Whether a round of ``round_steps`` is a warm-up round (shorter than H): its exchange takes the
        warm-up codec and overlaps at most tau_w steps."""
        return round_steps < self.config.local_steps

    def tau_cap(self, round_steps: int) -> int:
        """The most inner steps an exchange launched into a round of ``round_steps`` may overlap: the
        round (tau = H: applied at the next boundary), or tau_w for a warm-up round."""
        return self.config.warmup_overlap_steps if self.is_warmup_round(round_steps) else round_steps

    def overlap_steps(self, round_steps: int, exchange_s: float | None, step_s: float | None) -> int:
        """tau of an exchange launched into a round of ``round_steps``: ``--diloco-x-overlap-steps``, or
        (auto) the fewest steps, at least 1, that hide ``exchange_s`` seconds of exchange at
        ``step_s`` seconds per inner step (the cap while either is unknown); never above
        :meth:`tau_cap` (0: the exchange blocks)."""
        cap = self.tau_cap(round_steps)
        if cap == 0:
            return 0
        if self.config.overlap_steps is not None:
            return min(cap, self.config.overlap_steps)
        if not step_s or exchange_s is None:
            return cap
        return min(cap, steps_to_hide(exchange_s, step_s))
