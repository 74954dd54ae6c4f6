"""Rounds over a changing set of replicas: separate jobs that fail, heal and rejoin.

With replicas launched as separate jobs that meet through a coordinator (``--diloco-x-lighthouse``),
the outer group of a boundary is whoever is present then. :class:`FederatedRounds` is the
:class:`~megatron_diloco.algorithm.rounds.RoundRules` of the boundary protocols of
:class:`~megatron_diloco.algorithm.sync.OuterSync` (``none`` and ``partial``) for a changing membership:
the protocols call its hooks and it decides from the round's
:class:`~megatron_diloco.algorithm.rounds.RoundOutcome`, through ``OuterSync``'s public methods only; the
membership itself (who is present, the outer group over them, a job-wide commit, moving state to a job
that is behind) is a :class:`Membership` (:mod:`megatron_diloco.federation.membership` implements it on
torchft).

Every boundary, on every rank of every job, in the same order:

1. **Meet** (:meth:`FederatedRounds.meet`): after the pending exchange landed (``partial`` with
   tau = H), before the pseudo-gradient is taken. The members present form the outer group of this
   boundary. Each job announces its **progress** ``(boundaries reached, rounds committed)``: the run's
   clock is its rounds, not inner steps, so jobs may run rounds of different H (each its own
   ``--diloco-x-local-steps``, warm-up and ``--train-iters``, with the same rounds: the handshake compares
   them). A job behind the most advanced receives, per rank from rank k of an up-to-date job,
   :meth:`state_dict`: theta, the outer momentum, the codec state, the round counters, tau, the timings
   auto tau and the bounds use, and the position in the run (the boundary, from which the receiver
   derives its own inner steps and iteration: :meth:`own_position`).
2. **Decide** (the boundary's decision all-reduce: tau is proposed and agreed as a share of the round,
   :func:`tau_share`, so that every job lands after the same share of its round), then two small collectives: the **tokens** each
   member trained on since the point its pseudo-gradient is taken from (a slot per member, summed over
   the outer group: every member learns every weight), and a job-wide AND of "every rank of this job
   decided": a job launches on all its ranks or on none (:meth:`FederatedRounds.launch` records the
   launch and, ``partial`` with a lossy codec, keeps the residual from before it). The mean is
   **token-weighted**: member r weighs ``w_r = R t_r / sum_s t_s`` (fp32; the decision carries them,
   :mod:`megatron_diloco.algorithm.weights`, also for ``--diloco-x-site-weights normalized``), so jobs with
   different global batches (or a job that trained more steps since its last committed round) count by the
   data they saw; a job that has just joined, or that trained nothing, weighs exactly 0; equal tokens give
   the plain mean, bit for bit.
3. **Land** (:meth:`FederatedRounds.land`; at the boundary with ``none``, tau steps later with
   ``partial``): wait for the exchange into the mean, then the job-wide **commit** (every rank of
   the job completed its exchange, and every member of its outer group landed the same mean: their
   fingerprints of it, authenticated, are compared); only a committed round is applied. A round that failed (a peer
   died or froze mid-exchange, past the bound) or that the job did not commit is a **failed round**:
   theta and m are untouched; x keeps this replica's progress.
4. A failed round is resolved at the next meeting, the same way on every survivor: if another job
   committed it (its progress is then ahead, so this job heals from it), that job's theta holds
   this replica's payload (a job commits only after every member's payload arrived), so this
   replica takes the new theta and keeps only the progress since that exchange was launched
   (``x <- theta + (x - x_L)``; the residual is the one left after that payload). If nobody
   committed it, the residual is restored to the one before that launch and theta stays: the next
   pseudo-gradient ``theta - x`` covers both rounds, so nothing of the replica's progress is lost.

A job whose position differs from the run's after a heal outside its start (it was stopped, cut off or
late past the lighthouse's join timeout) catches up in place where the integration can move it
(``catch_up``: Megatron skips the iterations between) and goes on from the run's boundary. One boundary
behind (it reached its boundary after the others had met there, and met them at their next one), with its
last round intact, it **contributes that round one round stale**, as the delayed overlap's rounds are:
``x <- theta_run + (x - theta_held)`` (its progress since the theta it held moved onto the run's), its
tokens and error feedback kept, so the round goes into this boundary's token-weighted mean. Further behind,
or with its last round failed, it drops its rounds since its last committed state and enters as a joiner
does (weight 0). Without ``catch_up`` it raises :class:`FellBehindError` (restarting it rejoins it at the
next boundary, :meth:`FederatedRounds.join`).

Memory: one buffer of 4 B per shard element (the residual before the launch with a lossy codec under
``partial``; x before the pseudo-gradient with ``none``); nothing more with ``partial`` + ``none``
codec. The landing waits for the mean and then steps (two passes where one world fuses them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from megatron_diloco.algorithm import faults
from megatron_diloco.algorithm.heal import (check_heal, enter_at_theta, landing_tau, own_position, rebase_x,
                                            tau_of_share, tau_share)
from megatron_diloco.algorithm.bounds import OuterGroupError
from megatron_diloco.algorithm.exchange import AfterStep, ExchangeHandle
from megatron_diloco.algorithm.link import bounded_all_reduce, job_reduce
from megatron_diloco.algorithm.pace import paced_round_steps
from megatron_diloco.algorithm.rounds import RoundOutcome
from megatron_diloco.algorithm.weights import member_values, normalized_weights, token_weights

logger = logging.getLogger(__name__)
MAX, MIN = dist.ReduceOp.MAX, dist.ReduceOp.MIN

#: progress = boundaries reached x PROGRESS_RADIX + rounds committed (one integer: the coordinator heals a
#: member whose progress is below the most advanced member's)
PROGRESS_RADIX = 1 << 32
class FellBehindError(SystemExit):
    """This job is behind the run while training (it was stopped or cut off past the bound) and cannot move
    to the run's boundary in place (no ``catch_up``). It leaves the run cleanly; restarting it rejoins it from
    a live peer."""


@dataclasses.dataclass
class Meeting:
    """One boundary's membership, the same on every rank of every member job."""

    group: dist.ProcessGroup | None
    """The outer group of this boundary: rank k of every member job (gloo; None or size 1: alone)."""
    changed: bool
    """The members differ from the previous meeting's (``group`` is a new group)."""
    members: int
    """Jobs present."""
    seconds: float = 0.0
    """Wall time of the meeting (the coordinator's quorum, the heal when there is one)."""
    met: bool = True
    """False: the meeting failed within its bound (the coordinator unreachable, a member stuck): this job
    trains the round alone and its round fails (nothing is committed without a meeting)."""
    slot_groups: tuple[dist.ProcessGroup, ...] | None = None
    """A rank holding k > 1 exchange slots: each slot's outer group (``group`` is the first); else None."""


class Membership(Protocol):
    """Who is present at a boundary (implemented on torchft: :class:`megatron_diloco.federation.membership.TorchftMembership`)."""

    job_group: dist.ProcessGroup | None
    """This job's own world (gloo; None: one rank): the job-wide agreements."""

    def meet(self, progress: int) -> Meeting:
        """Meet the other jobs present (collective over this job's ranks, blocking until the run's
        members reach their boundary). ``progress``: this job's; a member behind the most advanced
        receives its state through the state callbacks given at construction."""

    def commit(self, ok: bool, mean: bytes | None = None) -> bool:
        """Whether this job commits the round: ``ok`` on every rank of the job (collective over it) and,
        ``mean`` given (the fingerprint of the mean this rank is about to apply, bytes), the same mean landed on
        every member of this rank's outer group (collective over it; authenticated)."""

    def abandon(self) -> None:
        """A round failed on this job: never use the current outer group again (a collective that failed on it
        may still be queued there; the next meeting forms a new one). Local."""


class FederatedRounds:
    """The membership side of one rank's boundaries (module doc): the
    :class:`~megatron_diloco.algorithm.rounds.RoundRules` of separate jobs, installed as
    ``OuterSync.round_rules``.

    Args:
        sync: the rank's :class:`~megatron_diloco.algorithm.sync.OuterSync` (its outer state, groups).
        membership: who is present at each boundary.
        position: this job's position in the run, for the heal (a small JSON-able dict with at least
            ``"steps"``, the inner steps done); ``set_position``: applies a healed one.
        catch_up: moves this job, while it trains, to its inner steps at the run's boundary when a heal found it
            behind (the integration skips the iterations between); None: :class:`FellBehindError` instead.
    """

    def __init__(self, sync, membership: Membership, position: Callable[[], dict],
                 set_position: Callable[[dict], None], catch_up: Callable[[int], None] | None = None) -> None:
        self.sync = sync
        self.membership = membership
        if membership is not None:
            membership.rounds = lambda: sync.rounds
        self.position = position
        self.set_position = set_position
        self.catch_up = catch_up
        if (why := sync.config.separate_jobs_problem()) is not None:
            raise ValueError(why)
        #: rounds this job committed (with the rounds healed in): part of its progress
        self.committed = 0
        #: the last round failed on this job (not committed); resolved at the next meeting
        self.failed = False
        #: this job contributes a pseudo-gradient at this boundary (not on the boundary it joins at)
        self.contributing = True
        self.members = 1
        #: tokens trained on since the point the next pseudo-gradient is taken from (:meth:`count_step`);
        #: ``tokens_per_step``: the tokens of an inner step of this job (set by the integration; None: every
        #: contributing member weighs the same)
        self.tokens, self.tokens_per_step = 0, None
        #: this boundary's tokens and weight of this job (round metrics), every member's weight
        self.round_tokens, self.round_weight, self._weights = 0, 1.0, None
        lossy = sync.residual is not None
        #: ``none``: x before the pseudo-gradient, (N,) fp32 with the outer state (a failed round restores it)
        self.x_rollback = sync.store.empty() if sync.config.overlap == "none" else None
        #: lossy codecs: the residual before this round's launch, (N,) fp32 with the outer state (``partial``:
        #: rotated in at the launch; ``none``: copied before it); what a round nobody committed restores
        self.rollback = sync.store.empty() if lossy else None
        #: where a round's progress is counted from: x_L (``partial``, exact merge) or :attr:`x_rollback`
        self.x_before = sync.launch_point if sync.config.overlap == "partial" else self.x_rollback
        #: the last round on this rank (launched, the buffers from before the launch, committed): what a
        #: failed round is resolved from (before any decision: an exchange a checkpoint or a heal restored)
        self.outcome = RoundOutcome(x_before=self.x_before)
        self._healed: dict | None = None
        self._healed_pending: torch.Tensor | None = None
        #: this meeting's heal found the job one boundary behind, its last round intact: x holds x - theta_held
        self._late_round = False
        self._joining = False
        #: what this job's run and configuration are (a digest); a heal from a peer with another is refused
        self.identity: str | None = None
        #: the meetings, failed rounds and heals so far (summary and metrics)
        self.stats = {"meetings": 0, "failed_meetings": 0, "membership_changes": 0, "failed_rounds": 0, "heals": 0,
                      "meeting_s": 0.0, "last_meeting_s": 0.0, "caught_up_rounds": 0, "stale_rounds": 0}

    def count_step(self) -> None:
        """An inner step was taken (:attr:`tokens_per_step`: its global batch x sequence length). Local."""
        if self.tokens_per_step is not None:
            self.tokens += int(self.tokens_per_step())

    # ---------------- progress, heal ----------------
    def boundaries(self) -> int:
        """The boundaries this job has reached (its inner steps on its own schedule): the run's clock."""
        return self.sync.schedule.boundaries_reached(int(self.position()["steps"]))

    def progress(self) -> int:
        """This job's progress: boundaries reached x :data:`PROGRESS_RADIX` + rounds committed."""
        return self.boundaries() * PROGRESS_RADIX + self.committed

    def heal_bytes(self) -> int:
        """The largest heal this rank accepts (bytes): theta, momentum, a pending mean (fp32), 1 MiB of the rest."""
        return 3 * 4 * self.sync.theta.numel() + (1 << 20)

    def state_dict(self) -> dict:
        """What a member that is behind receives from this rank (its shard's outer state and the run's
        position), as this rank holds it at the meeting."""
        sync = self.sync
        state = sync.heal_state()  # theta, the momentum, the codec state, the counters, tau, timings, link
        boundaries = self.boundaries()
        state["meta"].update(committed=self.committed, position={**self.position(), "boundaries": boundaries},
                             identity=self.identity,
                             # the round tau counts (a receiver of another H takes the same share of its own)
                             round_steps=sync.schedule.round_steps_at_boundary(boundaries),
                             # False at a job's start: no boundary follows this meeting on that job
                             in_boundary=not self._joining)
        # at a job's start, the exchange its checkpoint restored (its mean), applied tau steps in
        state["pending"] = sync.exchange_buffer if self._joining and sync.pending is not None else None
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take a peer's :meth:`state_dict` (called during :meth:`meet` when this job is behind), once
        :meth:`check_heal` accepts it (nothing is taken otherwise)."""
        self.check_heal(state)
        meta = state["meta"]
        if (self.catch_up is not None and not self._joining and not self.failed and not self._late_round and
                int(meta["position"]["boundaries"]) - self.boundaries() == 1):  # late by less than a round:
            self._late_round = True  # its round is kept (x - theta_held, before theta is replaced; :meth:`_caught_up`)
            rebase_x(self.sync, sub=self.sync.theta)
        self.sync.load_heal_state(state)
        self.committed = int(meta["committed"])
        self._healed = {**meta["position"], "in_boundary": bool(meta.get("in_boundary", True)),
                        "tau_share": tau_share(int(meta["tau"]), int(meta["round_steps"]))}
        self._healed_pending = state.get("pending")
        self.stats["heals"] += 1

    def check_heal(self, state: Any) -> None:
        """Refuse a heal that is not this rank's outer state (:func:`check_heal`)."""
        check_heal(self.sync, self.identity, state)

    # ---------------- the boundary ----------------
    def meet(self) -> Meeting:
        """Step 1 of the module doc: meet, regroup when the members changed, resolve a failed round.
        When a heal moved this job's position while it trained: it catches up in place (:meth:`_caught_up`), or
        raises :class:`FellBehindError` without :attr:`catch_up`."""
        sync = self.sync
        self._healed, self._late_round = None, False
        before = self.boundaries()
        faults.point("meeting", sync.rounds)
        meeting = self.membership.meet(self.progress())
        self.stats["meetings"] += 1
        self.stats["meeting_s"] += meeting.seconds
        self.stats["last_meeting_s"] = meeting.seconds
        self.members = meeting.members
        if not meeting.met:
            self.stats["failed_meetings"] += 1
        if meeting.changed:
            self.stats["membership_changes"] += 1
        if meeting.changed or sync.group is not meeting.group:
            sync.regroup(meeting.group, self._decision_groups(meeting.group), meeting.slot_groups)
        healed = self._healed
        if healed is not None and not self._joining and int(healed["boundaries"]) != before:
            if self.catch_up is None:
                raise FellBehindError(
                    f"megatron-diloco: this job is {int(healed['boundaries']) - before} rounds behind the run (it was "
                    "stopped or cut off for more than a round); it leaves the run with its outer state intact. Restart "
                    "it (with --load to keep its inner optimizer state) to rejoin at the next boundary.")
            self._caught_up(healed, before)
            return meeting
        if self.failed:
            self._resolve_failed_round(healed is not None)
        return meeting

    @torch.no_grad()
    def _caught_up(self, healed: dict, before: int) -> None:
        """Found behind the run while training, its outer state taken: move to the run's boundary in place (the
        iterations between skipped by :attr:`catch_up`), its last round kept one round stale when
        :attr:`_late_round`, else entering as a joiner does (weight 0). Local."""
        pos = self.position()
        steps, target = int(pos["steps"]), int(own_position(self.sync.schedule, healed, pos)["steps"])
        behind = int(healed["boundaries"]) - before
        self.stats["caught_up_rounds"] += behind
        if self._late_round:  # x <- theta_run + (x - theta_held); tokens and error feedback kept
            rebase_x(self.sync, add=self.sync.theta)
            self.sync.pending, self.sync.params_shared, self._late_round = None, False, False
            self.stats["stale_rounds"] += 1
            kept = f"its last round ({self.tokens} tokens) goes into this round's mean one round stale"
        else:
            enter_at_theta(self.sync)  # (as a joiner: no tokens)
            self.tokens, self.failed, kept = 0, False, "its rounds since its last committed state are dropped"
        self.catch_up(target)  # (x is whole by now)
        logger.warning("megatron-diloco: this job was %d round(s) behind the run (stopped, cut off or late); it took "
                       "the run's outer state and goes on from the run's boundary, %s; %d inner steps from step %d "
                       "are skipped (their data is not trained on)", behind, kept, target - steps, steps)

    def _decision_groups(self, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, ...]:
        return tuple(g for g in (self.membership.job_group, group) if g is not None)

    @torch.no_grad()
    def _resolve_failed_round(self, healed: bool) -> None:
        """Step 4 of the module doc, from the failed round's :attr:`outcome`."""
        sync = self.sync
        self.failed = False
        if healed:  # another job committed it, with this replica's payload: x <- theta + (x - x_L)
            rebase_x(sync, add=sync.theta, sub=self.outcome.x_before)
            logger.warning("DiLoCoX round %d: the last round failed on this job and another job committed it; "
                           "took its theta (this replica's payload is in it), kept the progress since", sync.rounds)
        else:
            if self.outcome.residual_before is not None:  # it launched: the residual before that launch
                sync.residual.copy_(self.outcome.residual_before)  # (untouched if it did not)
            self.tokens += self.outcome.tokens  # the next pseudo-gradient covers that round's tokens too
            logger.warning("DiLoCoX round %d: the last round was committed by no job; theta unchanged, this "
                           "boundary's pseudo-gradient covers both rounds", sync.rounds)
        sync.params_shared = False

    def before_pseudo_gradient(self) -> None:
        """``none``: keep x and, with a lossy codec, the residual (the rollback of a failed round)."""
        sync = self.sync
        if sync.config.overlap == "none":
            sync.x_into(self.x_rollback)
            if self.rollback is not None:
                self.rollback.copy_(sync.residual)

    def committed_residual(self) -> torch.Tensor | None:
        """The residual of the committed state (what a checkpoint holds): while a failed round is unresolved
        and it had launched, the one before that launch (as if nobody committed it); else the residual."""
        if self.failed and self.outcome.residual_before is not None:
            return self.outcome.residual_before
        return self.sync.residual

    def decide(self, sq: float, tau: int, theta_fp: torch.Tensor | None, local_steps: int = 0):
        """The boundary's decision (:meth:`BoundaryDecision.decide`; ``local_steps`` is 0: H is fixed), or None
        when not every member decided (a member lost here fails the round; it does not end the run). Opens
        this round's :attr:`outcome` (x_L with ``partial``, x before the pseudo-gradient with ``none``)."""
        sync = self.sync
        self.outcome = RoundOutcome(sync.rounds, x_before=self.x_before)
        steps = sync.next_round_steps  # tau travels as a share of this job's round (jobs may differ in H)
        try:
            decision = sync.decision.decide(sync.rounds, sq, tau_share(tau, steps), theta_fp, sync.timeout_s,
                                            local_steps)
        except OuterGroupError as err:
            logger.warning("%s", err)
            decision = None
        if not self.agree(decision is not None):
            return None
        faults.point("decision", sync.rounds, company=self.members > 1)
        steps = sync.next_round_steps  # (--diloco-x-site-pace: as agreed)
        decision = dataclasses.replace(decision, tau=tau_of_share(decision.tau, steps, sync.schedule.tau_cap(steps)))
        if decision.skip:  # x <- theta: the round's progress is dropped, and its tokens with it
            self.tokens = 0
            return decision
        return dataclasses.replace(decision, weights=self._weights)

    def agree(self, decided: bool) -> bool:
        """Step 2 of the module doc: every member's tokens (and its inner steps, its step time: the slots of
        :func:`~megatron_diloco.algorithm.weights.member_values`, float64, exact below 2^53 tokens) into the round's
        weights, and whether every rank of this job decided (MIN over its world). False: nobody of this job launches."""
        sync = self.sync
        ok = decided
        per_step = self.tokens_per_step() if self.tokens_per_step is not None else None
        mine = (float(self.tokens) if per_step is not None else 1.0) if self.contributing else 0.0
        self._weights, pace, paced = None, sync.schedule.pace, None  # pace: the job's step time, its slowest rank's
        own_s = job_reduce((sync.step_time_s or 0.0) if self.contributing else 0.0,  # (a joiner's: not measured)
                           MAX, self.membership.job_group, sync.timeout_s()) if pace else 0.0
        normalized = sync.config.site_weights == "normalized"  # and the inner steps behind the tokens
        fields = [mine] + ([mine / per_step if per_step else mine] if normalized else []) + ([own_s] if pace else [])
        if ok and sync.group is not None and dist.get_world_size(sync.group) > 1:
            try:  # (a value that is no count fails the round on every member alike: they all see the same)
                values = member_values(sync.group, sync.slot_groups, fields, sync.timeout_s())
                self._weights = normalized_weights(*values[:2]) if normalized else token_weights(values[0])
                if pace is not None:
                    paced = paced_round_steps(pace, sync.boundary_steps, values[-1], own_s, sync.config.site_pace)
            except (RuntimeError, TimeoutError, ValueError) as err:
                logger.warning("DiLoCoX round %d: the decision failed (%s)", sync.rounds, err)
                ok = False
        self.round_tokens = self.tokens if self.contributing else 0
        self.round_weight = self._weights[sync.group.rank()] if self._weights is not None else 1.0
        ok = bool(job_reduce(ok, MIN, self.membership.job_group, sync.timeout_s()))
        if pace is not None and sync.boundary_steps is not None:  # the job's next round begins, agreed or not
            sync.next_round_steps = pace.begin(sync.boundary_steps, paced if ok else None)
        if not ok:
            self.fail("the decision did not reach every member")
            self.membership.commit(False)
        return ok

    def fail(self, why: str) -> None:
        """Mark this round failed on this rank (resolved at the next meeting)."""
        sync = self.sync
        self.failed = True
        self.outcome.committed = False
        self.stats["failed_rounds"] += 1
        self.membership.abandon()  # no operation is ever issued again on the group this round failed on
        sync.regroup(None, self._decision_groups(None))
        if sync.config.overlap == "none":
            sync.x_from(self.x_rollback)  # x as before the pseudo-gradient
            sync.params_shared = False
        logger.warning("DiLoCoX round %d failed on this job: %s; theta and m unchanged, resolved at the next "
                       "boundary", sync.rounds, why)

    def launch(self, rotate: bool) -> None:
        """The round's exchange launches now (after a decision to go ahead): the :attr:`outcome` records it and,
        with a lossy codec, the residual from before the launch (``none``: copied by
        :meth:`before_pseudo_gradient`; ``rotate``, ``partial``: e <- e_new and e_old kept in the rollback
        buffer, whose storage becomes the exchange buffer, :meth:`OuterSync.rotate_residual`)."""
        if rotate:
            self.rollback = self.sync.rotate_residual(keep=self.rollback)
        self.outcome.launched = True
        self.outcome.residual_before = self.rollback
        self.outcome.tokens, self.tokens = self.tokens, 0  # tokens from here on belong to the next round

    @torch.no_grad()
    def land(self, handle: ExchangeHandle, after: AfterStep | None = None) -> bool:
        """Step 3 of the module doc: wait for the mean, commit, apply (the outer step, ``after`` fused
        into its pass) only when committed. Returns whether it was applied."""
        sync = self.sync
        ok = True
        faults.point("exchange", handle.round, company=self.members > 1)
        try:
            sync.complete(handle)  # the mean into the exchange buffer (bounded)
        except OuterGroupError as err:
            ok = False
            why = str(err).split(". Nothing of this round")[0]
            # a collective that timed out may still write into its buffer: a fresh one (no operation on that
            # group follows: the failed commit makes the coordinator form a new quorum, a new group)
            sync.renew_exchange_buffer()
        faults.point("commit", handle.round, target=sync.exchange_buffer if ok else None, company=self.members > 1)
        mean = None
        if ok and sync.group is not None and dist.get_world_size(sync.group) > 1:
            mean = sync.fingerprint([sync.exchange_buffer]).cpu().numpy().tobytes()
        committed = self.membership.commit(ok, mean)
        if not committed:
            self.fail(why if not ok else "the commit was refused (another rank of this job did not complete its "
                                         "exchange, or the members landed different means)")
            return False
        self.committed += 1
        sync.complete(handle, sync.outer, after)  # the step from the mean in the exchange buffer
        self.outcome.committed = True
        return True

    # ---------------- joining ----------------
    def join(self) -> dict | None:
        """At the start of a job (every rank, before training): meet the run. When the run is ahead
        (it has started, or this job resumed from an older checkpoint), this job has received the
        run's outer state and position: x <- theta, and the rest of the run's current boundary runs
        here with this job contributing nothing (:meth:`OuterSync.boundary` ``joined=True``).
        Returns the position received, or None (this job is at the run's position: nothing to do)."""
        if self.tokens_per_step is not None:  # a resumed job's x holds the steps since its last boundary
            since = self.sync.schedule.steps_since_boundary(int(self.position()["steps"]))
            self.tokens = since * int(self.tokens_per_step())
        self._joining = True
        try:
            self.meet()
        finally:
            self._joining = False
        healed, self._healed = self._healed, None
        self.failed = False
        if healed is None:
            return None
        self.set_position(healed := own_position(self.sync.schedule, healed, self.position()))
        sync = self.sync
        enter_at_theta(sync)
        self.tokens = 0
        if not healed["in_boundary"]:  # the run's jobs are starting too (resumed): start with them
            if self._healed_pending is not None:  # the exchange their checkpoints hold lands tau steps in
                sync.tau = landing_tau(healed["tau_share"], sync.schedule, int(healed["steps"]))  # (as decided)
                sync.exchange_buffer.copy_(self._healed_pending)
                sync.pending = ExchangeHandle.completed(sync.exchange_buffer, sync.store)
                if sync.launch_point is not None:
                    sync.launch_point.copy_(sync.theta)
                sync.params_shared = False
            return healed
        self.contributing = False
        try:
            sync.boundary(joined=True)
        finally:
            self.contributing = True
        return healed

    def finish(self) -> None:
        """The end of training (after the drain, every rank of every job that had company at its last meeting,
        or whose last round failed): one more meeting resolves a last round that failed anywhere, as any
        failed round is resolved (a job that committed it heals the others), and every job ends with the run's
        committed theta: x <- theta, so the jobs that end together end identical (jobs in step reach the end
        together; the meeting is bounded)."""
        if not self.failed and self.members <= 1:
            return
        sync = self.sync
        failed = self.failed
        self.meet()
        sync.x_from(sync.theta)
        sync.params_shared = True
        if failed:
            logger.warning("DiLoCoX: the last round failed on this job; after a last meeting it ends with the "
                           "run's committed outer parameters")

    def before_save(self) -> bool:
        """A checkpoint is being written (every rank of the job, the same save). With an exchange in flight:
        complete it, bounded, and agree job-wide whether every rank did. If so the checkpoint holds
        the mean, applied tau steps into a resume as in this run; if not, the round fails here on every rank
        of the job (as at its landing) and the checkpoint holds the committed state (no pending exchange,
        :meth:`committed_residual`). Returns whether the exchange stays pending. Collective over the job."""
        sync = self.sync
        faults.point("save", sync.rounds)
        handle = sync.pending
        if handle is None:
            return False
        ok = True
        try:
            sync.complete(handle)
        except OuterGroupError as err:
            ok = False
            why = str(err).split(". Nothing of this round")[0]
            sync.renew_exchange_buffer()  # (land's reason: the stale collective keeps the old one)
        if not job_reduce(ok, MIN, self.membership.job_group, sync.timeout_s()) and ok:
            ok, why = False, "another rank of this job did not complete its exchange"
        if ok:
            return True
        sync.pending = None
        self.membership.commit(False)
        self.fail(f"{why} (found while saving a checkpoint)")
        return False

    def summary(self) -> dict[str, Any]:
        return {**self.stats, "committed_rounds": self.committed, "members": self.members}
