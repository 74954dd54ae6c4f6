"""The round schedule: for any inner step, where the boundaries fall, how long the round it starts is,
which codec its exchange takes and how many steps (tau) that exchange may overlap.

Rounds of H0 (``--diloco-x-warmup-local-steps``) for the first W steps (``--diloco-x-warmup-iters``),
then rounds of H (``--diloco-x-local-steps``). An exchange launched into a round shorter than H (a
warm-up round) takes the warm-up codec (``--diloco-x-warmup-compression``) and overlaps at most tau_w
steps (``--diloco-x-warmup-overlap-steps``; 0 blocks); one launched into a round of H overlaps at most
H. Within that cap tau is ``--diloco-x-overlap-steps``, or (auto) the fewest steps, at least 1, that
hide the exchange: ceil(exchange seconds / step seconds).

``--diloco-x-local-steps auto`` (:attr:`DiLoCoXConfig.local_steps_auto`): H itself is chosen at every
boundary after the warm-up, :data:`AUTO_H_PER_TAU` x the steps that hide the exchange (tau at most an eighth of a round),
within [:data:`AUTO_H_MIN`, :data:`AUTO_H_MAX`] (:func:`auto_local_steps`); every rank proposes one and
the decision all-reduce agrees on the largest (:class:`~megatron_diloco.algorithm.decision.Decision`).
The rounds of H then start at the boundary of the last change (:attr:`RoundSchedule.anchor`), which a
checkpoint records (:meth:`RoundSchedule.state_dict`). With a fixed H the anchor stays at the warm-up's
end and the boundaries are those of plain modular arithmetic.

:class:`RoundSchedule` answers these from a :class:`~megatron_diloco.algorithm.config.DiLoCoXConfig`,
read live (a resume that keeps its checkpoint's warm-up, or a run length known late, changes the
config's warm-up fields; auto H changes ``local_steps``). With ``--diloco-x-site-pace`` (separate jobs of different
speed) the formulas give the run's rounds in run steps, and the job's own rounds come from its
:class:`~megatron_diloco.algorithm.pace.Pace` (:attr:`RoundSchedule.pace`): the questions about the job's steps
(where its boundaries fall, how long the round it starts is, whether it is a warm-up round) are answered there.
The optimizer (boundaries), :class:`~megatron_diloco.algorithm.sync.OuterSync` (codec, tau, the proposed H) and the planner
(``python -m megatron_diloco.plan``) all ask it.
"""

from __future__ import annotations

import math

from megatron_diloco.algorithm.config import (AUTO_H_MAX, AUTO_H_MIN, AUTO_H_PER_TAU, WARMUP_H_MULTIPLE,
                                              WARMUP_MAX_SHARE, DiLoCoXConfig)
from megatron_diloco.algorithm.pace import Pace, RunRound


def steps_to_hide(exchange_s: float, step_s: float) -> int:
    """The fewest inner steps, at least 1, whose time covers ``exchange_s`` (auto tau before its cap)."""
    return max(1, math.ceil(exchange_s / step_s)) if exchange_s > 0 else 1


def auto_local_steps(exchange_s: float | None, step_s: float | None) -> int:
    """``--diloco-x-local-steps auto``: the H a rank proposes for an exchange of ``exchange_s`` seconds at
    ``step_s`` seconds per inner step: :data:`AUTO_H_PER_TAU` x the steps that hide it (auto tau),
    within [:data:`AUTO_H_MIN`, :data:`AUTO_H_MAX`]; 0 (no proposal) while either is unknown."""
    if not step_s or exchange_s is None:
        return 0
    return min(AUTO_H_MAX, max(AUTO_H_MIN, AUTO_H_PER_TAU * steps_to_hide(exchange_s, step_s)))


def auto_warmup_iters(local_steps: int, h0: int, train_iters: int | None = None) -> int:
    """W of the auto warm-up for rounds of ``local_steps`` after it: :data:`WARMUP_H_MULTIPLE` x H inner
    steps, at most 1 / :data:`WARMUP_MAX_SHARE` of ``train_iters`` (when known), rounded down to a
    multiple of ``h0`` (0: none)."""
    w = WARMUP_H_MULTIPLE * local_steps
    if train_iters:
        w = min(w, train_iters // WARMUP_MAX_SHARE)
    return max(0, w - w % h0)


class RoundSchedule:
    """The round schedule of ``config`` (see the module doc). Local: no communication. Its one state is
    :attr:`anchor` (auto H only)."""

    def __init__(self, config: DiLoCoXConfig) -> None:
        self.config = config
        #: the inner step after which the current rounds of H began (auto H: the boundary that agreed
        #: on H); None: the warm-up's end (every fixed-H run)
        self.anchor: int | None = None
        #: ``--diloco-x-site-pace``: the run's length in run steps (``--train-iters``; None while unknown)
        self.run_steps: int | None = None
        #: ``--diloco-x-site-pace``: this job's rounds against the run's (None: the job runs the run's rounds)
        self.pace: Pace | None = Pace(self.run_round) if config.site_pace is not None else None

    def run_round(self, boundary: int) -> RunRound:
        """The run's round that starts at run ``boundary`` (fixed H): its start and length in run steps, the last
        one cut at :attr:`run_steps` (past the run's end, as if it went on)."""
        start = self.steps_at_boundary(boundary)
        steps = self.round_steps_of_run(start)
        if self.run_steps is not None and 0 < self.run_steps - start < steps:
            steps = self.run_steps - start
        return RunRound(boundary, start, steps, start < self.config.warmup_iters)

    def begin_rounds(self, steps: int, local_steps: int) -> None:
        """auto H: rounds of ``local_steps`` from the boundary after ``steps`` inner steps on (every rank
        alike: ``local_steps`` is the decision's). 0 keeps the current H. Local."""
        if not local_steps:
            return
        if not self.config.local_steps_auto:
            raise RuntimeError("the round length changes at run time with --diloco-x-local-steps auto only")
        if steps < self.config.warmup_iters or not self.is_boundary(steps):
            raise RuntimeError(f"auto H agreed after {steps} inner steps, not at a boundary after the warm-up "
                               f"({self.config.warmup_iters} steps)")
        self.config.local_steps, self.anchor = int(local_steps), steps

    def take_agreed_local_steps(self, steps: int, local_steps: int) -> int:
        """auto H agreed at the boundary after ``steps`` inner steps (every rank alike): inside a warm-up
        that follows H it lengthens the warm-up (:meth:`extend_warmup`), else its rounds begin there
        (:meth:`begin_rounds`). Returns the inner steps of the round that boundary starts. Local."""
        if self.warmup_follows_h(steps):
            self.extend_warmup(steps, local_steps)
        else:
            self.begin_rounds(steps, local_steps)
        return self.round_steps(steps)

    def warmup_follows_h(self, steps: int) -> bool:
        """Whether the warm-up may still lengthen after ``steps`` inner steps: auto H with an auto
        warm-up (:attr:`DiLoCoXConfig.warmup_iters_max`), inside it, below its longest."""
        c = self.config
        return bool(c.local_steps_auto and c.warmup_iters_max) and steps < c.warmup_iters < c.warmup_iters_max

    def extend_warmup(self, steps: int, local_steps: int) -> None:
        """auto H inside the warm-up (:meth:`warmup_follows_h`): the warm-up lengthens to the one of the
        agreed ``local_steps`` (:func:`auto_warmup_iters`, at most ``warmup_iters_max``); it never
        shortens, so the round that starts after ``steps`` stays a warm-up round, as its tau and codec
        were chosen. Every rank alike (``local_steps`` is the decision's). Local."""
        c = self.config
        if not self.warmup_follows_h(steps):
            raise RuntimeError(f"the warm-up lengthens with auto H inside an auto warm-up only (after {steps} "
                               f"inner steps of {c.warmup_iters})")
        c.warmup_iters = max(c.warmup_iters, min(auto_warmup_iters(local_steps, c.warmup_local_steps),
                                                 c.warmup_iters_max))

    def restart(self) -> None:
        """The outer loop starts anew at inner step 0 (its warm-up again); H stays as it is. Local."""
        self.anchor = None
        if self.pace is not None:
            self.pace = Pace(self.run_round)

    def changed(self) -> None:
        """The run's rounds changed (its warm-up or its length, before training or at a resume): :attr:`pace`
        follows them. Local."""
        if self.pace is not None:
            self.pace.refresh()

    def state_dict(self) -> dict:
        """What a checkpoint records, so that a resume keeps the boundaries: H, H0, W; with auto H also
        ``local_steps_auto`` and :attr:`anchor`; with :attr:`pace` also its state (``"pace"``)."""
        state = self.rounds_state()
        if self.pace is not None:
            state["pace"] = self.pace.state_dict()
        return state

    def rounds_state(self) -> dict:
        """The run's rounds as :meth:`state_dict` records them (without :attr:`pace`'s state): what a resume
        compares with its own flags."""
        c = self.config
        state = {"local_steps": c.local_steps, "warmup_local_steps": c.warmup_local_steps,
                 "warmup_iters": c.warmup_iters}
        if c.local_steps_auto:
            state.update(local_steps_auto=True, anchor=self.anchor)
        return state

    def load_pace(self, saved: dict, steps: int) -> dict:
        """A resume after ``steps`` inner steps (``saved``: the checkpoint's :meth:`state_dict`): take its
        :attr:`pace` state; a checkpoint of a job that ran the run's rounds starts its pace where it stands (its
        steps were the run's). Returns ``saved`` without the pace state. ValueError: the checkpoint was trained with
        ``--diloco-x-site-pace`` and this run is not (its steps are not the run's). Local."""
        saved = dict(saved)
        state = saved.pop("pace", None)
        if self.pace is None:
            if state is not None:
                raise ValueError("this checkpoint was trained with --diloco-x-site-pace (its inner steps are its own, "
                                 "not the run's): resume it with --diloco-x-site-pace")
            return saved
        if state is not None:
            self.pace.load_state_dict(state)
        else:
            self.pace.start_at(steps, self.boundaries_in(max(0, steps - 1)))  # (the round that holds step ``steps``)
        return saved

    def load_auto(self, saved: dict) -> bool:
        """A resume of an auto-H run with auto H (``saved``: a checkpoint's :meth:`state_dict`): take its
        H and anchor, and its warm-up's length where the warm-up follows H (it may have lengthened);
        whether it did. Local."""
        c = self.config
        if not (c.local_steps_auto and saved.get("local_steps_auto")):
            return False
        c.local_steps, self.anchor = int(saved["local_steps"]), saved.get("anchor")
        if c.warmup_iters_max and saved.get("warmup_local_steps") == c.warmup_local_steps:
            c.warmup_iters = int(saved["warmup_iters"])
            c.warmup_iters_max = max(c.warmup_iters_max, c.warmup_iters)
        return True

    def steps_since_boundary(self, steps: int) -> int:
        """Inner steps since the last boundary after ``steps`` inner steps (0: ``steps`` ends a round,
        or is 0): rounds of H0 during the warm-up, then of H. (Validation makes W > 0 exactly when
        H0 is set.) With auto H, for ``steps`` from the last change of H (:attr:`anchor`) on: the
        boundaries before it are history the schedule does not keep. With :attr:`pace`, the job's own."""
        if self.pace is not None:
            return self.pace.since(steps)
        return self.run_steps_since_boundary(steps)

    def run_steps_since_boundary(self, steps: int) -> int:
        """:meth:`steps_since_boundary` of the run's rounds (the flags' schedule, whatever the job's pace)."""
        c = self.config
        w = c.warmup_iters
        if w and steps <= w:
            return steps % c.warmup_local_steps
        return (steps - (w if self.anchor is None else self.anchor)) % c.local_steps

    def boundaries_reached(self, steps: int) -> int:
        """The run's boundaries this job has reached after ``steps`` of its inner steps (separate jobs: the run's
        clock): :meth:`boundaries_in`, or with :attr:`pace` the job's count."""
        return self.pace.boundaries_in(steps) if self.pace is not None else self.boundaries_in(steps)

    def boundaries_in(self, steps: int) -> int:
        """The boundaries that fall within the first ``steps`` inner steps (``steps`` itself included): the
        run's clock in rounds, which jobs of different H share (separate jobs: :meth:`steps_at_boundary`
        is its inverse). Fixed H only (auto H keeps no history before its :attr:`anchor`); in run steps."""
        c, warm = self.config, self._warmup_rounds()
        if c.warmup_iters and steps <= c.warmup_iters:
            return steps // c.warmup_local_steps
        return warm + (steps - c.warmup_iters) // c.local_steps

    def steps_at_boundary(self, boundaries: int) -> int:
        """The inner steps done at the ``boundaries``-th boundary (0: the start): the inverse of
        :meth:`boundaries_in` on the boundaries. Fixed H only."""
        c, warm = self.config, self._warmup_rounds()
        if c.warmup_iters and boundaries <= warm:
            return boundaries * c.warmup_local_steps
        return c.warmup_iters + (boundaries - warm) * c.local_steps

    def _warmup_rounds(self) -> int:
        """The boundaries within the warm-up (W // H0; 0 without one). Fixed H only: the boundaries are counted
        from the start (auto H keeps no history before its :attr:`anchor`)."""
        c = self.config
        if c.local_steps_auto:
            raise RuntimeError("boundaries are counted from the start with a fixed --diloco-x-local-steps only")
        return c.warmup_iters // c.warmup_local_steps if c.warmup_iters else 0

    def round_steps_at_boundary(self, boundaries: int) -> int:
        """Separate jobs: the inner steps of the job's round at its ``boundaries``-th boundary, which the tau of
        a heal counts (with :attr:`pace`, the job's current round)."""
        if self.pace is not None:
            return self.pace.own_steps
        return self.round_steps(self.steps_at_boundary(boundaries))

    def is_boundary(self, steps: int) -> bool:
        """Whether a boundary falls after ``steps`` (>= 1) inner steps."""
        return steps > 0 and self.steps_since_boundary(steps) == 0

    def round_steps(self, steps: int) -> int:
        """Inner steps of the round that starts after ``steps`` inner steps (at a boundary). With :attr:`pace`, the
        job's own: as agreed, or before the agreement at the job's current pace (:meth:`Pace.projected_steps`)."""
        if self.pace is not None:
            return self.pace.projected_steps(steps)
        return self.round_steps_of_run(steps)

    def round_steps_of_run(self, steps: int) -> int:
        """Run steps of the run's round that starts after ``steps`` run steps (H0 in the warm-up, else H)."""
        c = self.config
        return c.warmup_local_steps if steps < c.warmup_iters else c.local_steps

    def is_warmup_round(self, round_steps: int) -> bool:
        """Whether a round of ``round_steps`` is a warm-up round (shorter than H: with auto H, than the H
        it starts at, since the rounds of H it chooses later may be shorter than the current ones): its
        exchange takes the warm-up codec and overlaps at most tau_w steps. With :attr:`pace`: whether the
        run's round the job's last boundary starts is one (whatever its own length)."""
        c = self.config
        if self.pace is not None:
            return (self.pace.pending or self.pace.current).warmup
        return round_steps < (AUTO_H_MIN if c.local_steps_auto else c.local_steps)

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
