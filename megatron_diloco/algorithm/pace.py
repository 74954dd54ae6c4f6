"""A job's own rounds when the jobs of a run differ in speed (``--diloco-x-site-pace P``, separate jobs).

The flags give the run's rounds, as for jobs of equal speed: rounds of H0 for the first W *run steps*, then of H,
the run ending at ``--train-iters`` run steps (:class:`~megatron_diloco.algorithm.schedule.RoundSchedule`'s fixed-H
formulas). A job does not run the run's steps: a run round of L steps is, for this job, ``floor(L x T / t)`` of its
own inner steps, between L and ``P x L`` (:func:`own_round_steps`), T the slowest member's mean inner-step time and t
this job's, as the members agreed at the boundary that starts the round (the decision's per-member slots,
:meth:`~megatron_diloco.algorithm.federated.FederatedRounds.agree`). The slowest job runs L, a job twice as fast 2 L:
every job's round takes about the slowest one's time, so none waits at the boundary, and each weighs by the tokens
it trained on.

The run's clock is its boundaries, counted here and checkpointed; the job's inner steps (and Megatron's iteration,
its data position) are its own and never taken from a peer. :class:`Pace` maps between the two: where the job's
current round began (its own steps, the run's boundary and run steps), how long it is in both, and the job's
position in run steps at any of its own steps, fractional inside a round (:meth:`Pace.run_position`): the LR
schedule follows it, so every job's LR is the same function of the run's progress whatever its pace, and a job
ends at the run's last boundary. Local: no communication.
"""

from __future__ import annotations

import dataclasses
import math


def own_round_steps(run_steps: int, slowest_s: float | None, own_s: float | None, most: float) -> int:
    """This job's inner steps for a run round of ``run_steps``: ``floor(run_steps x slowest_s / own_s)`` within
    ``[run_steps, floor(most x run_steps)]`` (``most``: ``--diloco-x-site-pace``); ``run_steps`` while either time
    is unknown (0 or None) or not finite."""
    if not (slowest_s and own_s and math.isfinite(slowest_s) and math.isfinite(own_s)):
        return run_steps
    fit = math.floor(run_steps * slowest_s / own_s + 1e-9)  # (a ratio of exactly 2 gives 2 L, not 2 L - 1)
    return max(run_steps, min(math.floor(most * run_steps), fit))


def paced_round_steps(pace: "Pace", steps: int, step_times: list[float], own_s: float, most: float) -> int:
    """The job's inner steps for the round its boundary after ``steps`` inner steps starts (:func:`own_round_steps`)
    from the members' step times (``step_times``: one per member as the decision delivered them, 0 where not known
    or not contributing; a peer's, so checked first: ValueError) and this job's (``own_s``)."""
    if not all(math.isfinite(t) and t >= 0 for t in step_times):
        raise ValueError(f"a member's inner-step time is not a finite number >= 0: {step_times}")
    return own_round_steps(pace.reach(steps).steps, max(step_times, default=0.0), own_s, most)


@dataclasses.dataclass
class RunRound:
    """A round of the run: it starts at run boundary :attr:`boundary` (0: the run's start), after :attr:`start`
    run steps, and lasts :attr:`steps` run steps; :attr:`warmup`: a warm-up round (H0)."""

    boundary: int
    start: int
    steps: int
    warmup: bool


class Pace:
    """One job's rounds against the run's (module doc). ``run_round(b)``: the run's round that starts at run
    boundary b (:meth:`RoundSchedule.run_round`). The first round is the run's first, at the job's pace 1.

    State (the same on every rank of the job): :attr:`current` (the run round in progress), :attr:`own_start`
    (the job's inner steps when it began) and :attr:`own_steps` (its length in the job's steps); between reaching a
    boundary and the agreement on the next round's length, :attr:`pending` (the run round that boundary starts)."""

    def __init__(self, run_round) -> None:
        self.run_round = run_round
        self.current: RunRound = run_round(0)
        self.own_start, self.own_steps = 0, self.current.steps
        self.pending: RunRound | None = None

    # ---------------- the job's steps ----------------
    def since(self, steps: int) -> int:
        """Inner steps since the job's last boundary after ``steps`` of its own (0: ``steps`` ends its round)."""
        return (steps - self.own_start) % self.own_steps

    def boundaries_in(self, steps: int) -> int:
        """The run's boundaries the job has reached after ``steps`` of its own inner steps: the run's clock."""
        return self.current.boundary + max(0, steps - self.own_start) // self.own_steps

    def run_position(self, steps: int) -> float:
        """Where the job stands in run steps after ``steps`` of its own: the current round's start plus its share
        of the round done (the LR schedule's position)."""
        done = min(max(0, steps - self.own_start), self.own_steps)
        return self.current.start + done * self.current.steps / self.own_steps

    def own_end(self, run_steps: int) -> int:
        """The job's own inner steps when the run of ``run_steps`` run steps ends: where its current round ends, plus
        the run's steps after it at the current pace (rounded up; exact once the last round began). A round that
        begins at the run's end (the one after its last boundary) is never run: the job ended where it began."""
        c = self.current
        if c.start >= run_steps:
            return self.own_start
        return self.own_start + self.own_steps + math.ceil(max(0, run_steps - c.start - c.steps) * self.ratio)

    @property
    def ratio(self) -> float:
        """The current round's own steps per run step (the job's pace; 1: the run's)."""
        return self.own_steps / self.current.steps

    # ---------------- boundaries ----------------
    def reach(self, steps: int) -> RunRound:
        """The job has reached the boundary after ``steps`` inner steps of its own: the run round it starts, held
        as :attr:`pending` until :meth:`begin` (a boundary the round already began at gives the current one)."""
        if steps == self.own_start and self.pending is None:
            return self.current
        if self.pending is None:
            self.pending = self.run_round(self.boundaries_in(steps))
        return self.pending

    def rebase(self, boundary: int, steps: int) -> None:
        """A heal moved the job to the run's ``boundary`` (a joiner, a job resumed behind the run, or one that fell
        behind) after ``steps`` of its own inner steps: the round that boundary starts begins there, at the job's
        current pace until the members agree on it (at that boundary's decision, when it runs on this job)."""
        ratio = self.ratio
        self.current, self.own_start, self.pending = self.run_round(boundary), steps, None
        self.own_steps = max(self.current.steps, round(self.current.steps * ratio))

    def projected_steps(self, steps: int) -> int:
        """The own steps of the round the boundary after ``steps`` starts, before the members agree on it: at the
        current pace (the one that was agreed last)."""
        nxt = self.reach(steps)
        if nxt is self.current:
            return self.own_steps
        return max(nxt.steps, round(nxt.steps * self.ratio))

    def begin(self, steps: int, own_steps: int | None) -> int:
        """The round that the boundary after ``steps`` inner steps starts begins, ``own_steps`` of the job's steps
        long (the agreed :func:`own_round_steps`, every rank of the job alike; None: nothing agreed, at the current
        pace, :meth:`projected_steps`). Returns its length."""
        own_steps = self.projected_steps(steps) if own_steps is None else int(own_steps)
        if own_steps < 1:
            raise ValueError(f"a round of {own_steps} inner steps")
        self.current, self.own_start, self.own_steps, self.pending = self.reach(steps), steps, own_steps, None
        return own_steps

    def refresh(self) -> None:
        """The run's rounds changed (its warm-up resolved, a resume keeping its checkpoint's): the rounds held
        recomputed from their boundaries; before the job's first step its first round follows."""
        first = self.own_start == 0 and self.current.boundary == 0 and self.own_steps == self.current.steps
        self.current = self.run_round(self.current.boundary)
        if self.pending is not None:
            self.pending = self.run_round(self.pending.boundary)
        if first:
            self.own_steps = self.current.steps

    def start_at(self, steps: int, boundary: int) -> None:
        """A job that ran the run's rounds so far (its steps are the run's) goes on at its pace: its current round
        is the run's round that starts at ``boundary``, begun after ``steps - (steps into it)`` steps."""
        self.current = self.run_round(boundary)
        self.own_start, self.own_steps, self.pending = self.current.start, self.current.steps, None
        if not self.own_start <= steps <= self.own_start + self.own_steps:
            raise ValueError(f"inner step {steps} is not in the run's round {boundary} ({self.current})")

    # ---------------- checkpoints ----------------
    def state_dict(self) -> dict:
        c = self.current
        return {"boundary": c.boundary, "own_start": self.own_start, "own_steps": self.own_steps,
                "pending": None if self.pending is None else self.pending.boundary}

    def load_state_dict(self, state: dict) -> None:
        """Take a checkpoint's :meth:`state_dict` (the run round recomputed from its boundary; ValueError when a
        field is not a count)."""
        for name in ("boundary", "own_start", "own_steps"):
            if not isinstance(state.get(name), int) or state[name] < (1 if name == "own_steps" else 0):
                raise ValueError(f"the checkpoint's --diloco-x-site-pace state has {name} = {state.get(name)!r}")
        self.current = self.run_round(state["boundary"])
        self.own_start, self.own_steps = state["own_start"], state["own_steps"]
        self.pending = None if state.get("pending") is None else self.run_round(int(state["pending"]))
