"""The boundary protocols of DiLoCoX on one rank's shard, one per overlap rule (``--diloco-x-overlap``).

Notation (docs/design.md, "Algorithm"): ``theta`` outer params, ``x`` the replica's local params (the fp32
main-parameter shards of the inner optimizer), ``Delta`` the replicas' mean pseudo-gradient.

``overlap="none"`` (plain DiLoCo), at each boundary::

    delta  = theta - x ;  Delta = mean_r delta_r  (blocking)
    theta  = OuterStep(theta, Delta) ;  x <- theta

``overlap="delayed"`` (DiLoCoX), at the boundary ending round t::

    delta_t = theta_{t-1} - x       (against the params round t started from)
    wait for Delta_{t-1}            (launched one boundary ago; had all of round t to finish)
    theta_t = OuterStep(theta_{t-1}, Delta_{t-1})   (nothing to apply at the first boundary)
    launch the exchange of delta_t  (runs during round t+1)
    x <- theta_t

so every replica starts every round from the same ``theta_t``, bit for bit, and staleness is exactly
one outer step. :meth:`OuterSync.drain` applies the last exchange at the end of training.

``overlap="eager"`` (Kale, Douillard, Donchev 2025, "Eager updates for overlapped communication and
computation in DiLoCo"): as ``delayed``, but each replica also takes its own fresh pseudo-gradient
into account at once, instead of waiting a round for it::

    delta_{r,t} = a_r - x           (a_r: the anchor, the point replica r started round t from)
    wait for Delta_{t-1};  theta_t = OuterStep(theta_{t-1}, Delta_{t-1})     (shared, as delayed)
    launch the exchange of delta_{r,t}
    a_r <- theta_t - c w * delta_{r,t} ;  x <- a_r
    c = eta * (1 + mu) with Nesterov, eta with heavy ball (the weight one outer step gives a fresh
    pseudo-gradient); w = 1 / R (the paper's rule, default) or ``--diloco-x-eager-weight``

The eager term is a look-ahead that the next boundary replaces by the real thing: ``Delta_t``
(which holds delta_{r,t} / R) enters ``theta_{t+1}``, and a_r is rebuilt from ``theta_{t+1}``. With
mu = 0 this is exactly the paper's update (its per-replica outer params equal theta_t minus
eta / R * delta_{r,t}: own fresh pseudo-gradient + the others' one-round-stale ones); with momentum
the paper keeps one outer momentum per replica, which drifts apart, where this keeps the one shared
momentum, so ``theta`` and ``m`` stay bit-identical across replicas and checkpoint as shared state.
With w = 1 (``--diloco-x-eager-weight 1``) the look-ahead takes the replica's own pseudo-gradient as
the estimate of the mean: when all replicas' pseudo-gradients agree, a_r equals blocking DiLoCo's
theta after the same round exactly (mu = 0), i.e. the overlap then costs nothing in the parameters;
with 1 / R the own progress of the round enters at 1 / R at once and the rest one round late.
Replicas' local params differ by their look-ahead between boundaries (by design); the drain at the
end of training sets x <- theta on every replica. Cost: the per-replica anchor ``a_r``
(fp32, 4 B per shard element), checkpointed with the replica's own state.

``overlap="partial"`` (Streaming DiLoCo's overlap, Douillard et al. 2025, with its alpha mix, or an
exact delay-corrected merge): the exchange launched at a boundary is applied tau inner steps later,
and the local progress made meanwhile is kept::

    at the boundary:  delta_t = theta_{t-1} - x ;  launch ;  x_L <- x  (x is not reset)
    tau steps later:  theta_t = OuterStep(theta_{t-1}, Delta_t)
                      exact: x <- theta_t + (x - x_L)          (the tau steps' progress, whole)
                      mix:   x <- alpha x + (1 - alpha) theta_t (Streaming DiLoCo's merge)

The next pseudo-gradient is taken against the shared theta (``theta_t - x``): with ``exact`` it is
exactly the H inner steps since x_L. tau = 0 is ``none`` (bit for bit); with ``exact`` tau = H is
``eager`` with weight 1 at eta = 1, mu = 0. theta and m stay bit-identical across replicas; x keeps
each replica's own progress. tau is ``--diloco-x-overlap-steps`` or, ``auto``, the fewest inner
steps that hide the last exchange (:meth:`OuterSync._choose_overlap_steps`), agreed by every rank
in the boundary's one decision all-reduce. Cost with ``exact``: x_L, 4 B per shard element.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_diloco.algorithm.config import CODECS
from megatron_diloco.algorithm.exchange import AfterStep, ExchangeHandle, ExchangeStats, Outbox
from megatron_diloco.algorithm.link import wire_bytes
from megatron_diloco.algorithm.outer import OuterNesterov
from megatron_diloco.algorithm.schedule import auto_local_steps

logger = logging.getLogger(__name__)


def _sum_of_squares(norms: list[torch.Tensor]) -> float:
    """Sum of the squares of fp32 L2 ``norms`` (0-dim tensors), in fp64; a host sync."""
    return float(torch.stack(norms).double().square().sum()) if norms else 0.0


@dataclasses.dataclass
class RoundReport:
    """What happened at one boundary, on this rank (sums over the shard; not reduced across ranks)."""

    round: int
    """1-based index of the boundary."""
    applied: bool
    """Whether an outer step was applied at this boundary (False at the first delayed boundary)."""
    launched: ExchangeStats
    """The exchange launched at this boundary (bytes; times filled when it completes)."""
    completed: ExchangeStats | None
    """The exchange whose result was applied here (the same one for ``none``, the previous for
    ``delayed``), with its exchange and exposed times."""
    pseudo_grad_sq: float
    """Squared L2 norm of this rank's shard of the local pseudo-gradient ``theta - x``."""
    skipped: bool = False
    """True when some replica's pseudo-gradient held a NaN/Inf: nothing was sent this round, on
    every replica alike; the round's local progress was dropped and the residual kept."""


@dataclasses.dataclass
class LaunchPass:
    """What :meth:`BoundaryProtocols._launch_pass` measured, as chunk parts (0-dim fp32 tensors)."""

    input_sq: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """||pseudo-gradient + residual||^2 per chunk (lossy codecs)."""
    residual_sq: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """||residual left||^2 per chunk (encoded here)."""
    pseudo_grad_sq: float = 0.0
    """||theta - x||^2 over the shard, when the pass took it (``partial``)."""


class BoundaryProtocols:
    """The boundary protocols of :class:`megatron_diloco.algorithm.sync.OuterSync` (module doc): what
    happens at a boundary, at ``partial``'s landing, and at the drain, over the state ``OuterSync``
    owns. How each round is agreed, landed, saved and finished is :attr:`round_rules`'s
    (:class:`~megatron_diloco.algorithm.rounds.RoundRules`), whose hooks are called here at fixed points.
    Every method here is collective over the outer group and the decision group."""

    # ---------------- the decision: skip, tau, auto H ----------------
    def _decide(self, sq: float, tau: int, theta_fp: torch.Tensor | None, local_steps: int = 0):
        """This boundary's :class:`~megatron_diloco.algorithm.decision.Decision` (skip, agreed tau and
        auto H), theta compared across replicas (:meth:`RoundRules.decide`: :meth:`BoundaryDecision.decide`,
        collective over the decision groups, bounded; None when the rules do not let the round go ahead,
        separate jobs whose members did not all decide). ``local_steps``: this rank's proposed H
        (:meth:`_propose_local_steps`). An agreed H is the schedule's from here
        (:meth:`RoundSchedule.take_agreed_local_steps`, at the step count the caller gave
        :meth:`before_boundary`: its rounds begin, or a warm-up that follows H lengthens), which gives the
        :attr:`next_round_steps`."""
        decision = self.round_rules.decide(sq, tau, theta_fp, local_steps)
        if decision is not None and decision.local_steps and self.boundary_steps is not None:
            self.next_round_steps = self.schedule.take_agreed_local_steps(self.boundary_steps, decision.local_steps)
        return decision

    def _exchange_seconds(self, codec) -> float | None:
        """How long an exchange with ``codec`` will take on this rank: its wire bytes at the link
        bandwidth when that is known (``--diloco-x-bandwidth-mbps`` or measured; the bytes of this
        exchange where the codec fixes them, else of the last completed exchange); else the last
        exchange's measured duration, scaled to this codec's bytes where both are known (the first
        exchange after a warm-up of another codec); None while nothing is known."""
        last = self.last_completed
        wire = self._fixed_wire_bytes(codec)
        sent = last.bytes_sent if last is not None else 0
        if self.link_bytes_per_s and (wire or sent):
            return (wire or sent) / self.link_bytes_per_s
        if last is None:
            return None
        return last.exchange_s * wire / sent if wire and sent else last.exchange_s

    def _choose_overlap_steps(self, local_steps: int = 0) -> int:
        """This rank's tau for the exchange about to launch (:meth:`RoundSchedule.overlap_steps`) into a
        round of ``local_steps`` (this rank's auto-H proposal), or of :attr:`next_round_steps`: auto tau
        sized by the exchange's seconds (:meth:`_exchange_seconds`) over the last round's mean step
        time; the cap while either is unknown (the first exchange of a run without a known link)."""
        if self.boundary_steps is not None and self.boundary_steps < self.config.warmup_iters:
            local_steps = 0  # a proposal inside the warm-up sizes the warm-up, not the round it starts
        return self.schedule.overlap_steps(local_steps or self.next_round_steps,
                                           self._exchange_seconds(self._round_codec()), self.step_time_s)

    def _propose_local_steps(self) -> int:
        """``--diloco-x-local-steps auto``: this rank's H for the round this boundary starts
        (:func:`~megatron_diloco.algorithm.schedule.auto_local_steps`), sized by an exchange of the main
        codec; inside a warm-up that follows H (:meth:`RoundSchedule.warmup_follows_h`) the H that sizes
        the warm-up. 0 (no proposal) with a fixed H, inside a warm-up that does not follow H (even one
        whose H0 equals the starting H), at a boundary whose step count the caller did not give (the
        last, shorter round of a run), or while nothing is measured."""
        steps = self.boundary_steps
        if not self.config.local_steps_auto or steps is None or (
                steps < self.config.warmup_iters and not self.schedule.warmup_follows_h(steps)):
            return 0
        return auto_local_steps(self._exchange_seconds(self.codec), self.step_time_s)

    def _round_codec(self):
        """The codec of the exchange about to launch: :attr:`warmup_codec` when it launches into a
        warm-up round (:attr:`next_round_steps` < H), else :attr:`codec`."""
        if self.warmup_codec is not None and self.schedule.is_warmup_round(self.next_round_steps):
            return self.warmup_codec
        return self.codec

    def _fixed_wire_bytes(self, codec) -> int | None:
        """Bytes this rank sends in an exchange with ``codec`` where the codec fixes them in advance
        (every codec but the matrix ones, whose ranks vary); None otherwise."""
        spec = CODECS[codec.name]
        if spec.matrix:
            return None
        members = dist.get_world_size(self.group) if self.group is not None else self.config.replicas
        return wire_bytes(spec.collective, codec.payload_bytes(self.view.numel), members)

    def _pseudo_gradient_into_x(self, theta_fp: torch.Tensor | None = None) -> float:
        """x <- start - x on the shards, in place; returns the squared norm (a host sync).
        ``theta_fp``: also fingerprint the anchor into it (int64 ``[2]``, in place; the anchor is
        theta but with eager)."""
        norms: list[torch.Tensor] = []
        for lo, hi, (a,) in self.store.stream(self.anchor):
            if theta_fp is not None:
                self.segments.fingerprint_into(a, lo, theta_fp)
            xs = self.view.pieces(lo, hi)
            if xs:
                torch._foreach_neg_(xs)
                torch._foreach_add_(xs, self.view.split_like(a, xs))
                norms += torch._foreach_norm(xs, 2)
        return _sum_of_squares(norms)

    def _fingerprinting(self, theta_fp: torch.Tensor | None) -> AfterStep | None:
        """Fingerprint the new theta into ``theta_fp`` inside the outer step's pass (None: nothing)."""
        if theta_fp is None:
            return None
        return AfterStep([], lambda lo, hi, th, extra: self.segments.fingerprint_into(th, lo, theta_fp))

    def _launch_pass(self, *, outbox: Outbox | None, theta: torch.Tensor | None, from_x: bool,
                     theta_fp: torch.Tensor | None = None, launch_point: torch.Tensor | None = None,
                     residual_out: bool = False, eager_scale: float | None = None,
                     reset_x: torch.Tensor | None = None, write_buffer: bool = False) -> "LaunchPass":
        """The one pass over the shard (chunk by chunk through :attr:`store`) that readies a round's
        exchange, shared by every overlap rule; per chunk, in this order:

        - the pseudo-gradient into the exchange buffer: ``from_x`` x holds it already
          (none / delayed / eager, :meth:`_pseudo_gradient_into_x`), else ``theta - x`` without
          touching x (``partial``: ``theta`` is read, fingerprinted into ``theta_fp``, and x copied
          into ``launch_point`` first: x_L of the exact merge) with its norms;
        - ||pseudo-gradient + residual||^2, the codec's input (not materialized);
        - ``eager_scale`` (eager): the look-ahead a_r <- theta_t + eager_scale x delta;
        - ``outbox`` (None: nothing encoded here): encoded with error feedback, the residual updated
          in place, or (``residual_out``) e_new written over the buffer's chunk (``partial``: the
          residual stays intact until the round is known to go ahead);
        - ``reset_x`` (theta_t or a_r; delayed / eager): x <- it.

        ``write_buffer``: the exchange buffer's chunks are copied back where the store holds it (it
        receives e_new, or it is the host all-reduce buffer). Local: no communication."""
        buf, e, ea = self.exchange_buffer, self.residual, self.eager_anchor if eager_scale is not None else None
        read_theta = theta if theta is not None else reset_x
        written = [launch_point, ea, buf if write_buffer else None,
                   e if outbox is not None and not residual_out else None]
        norms: list[torch.Tensor] = []
        out = LaunchPass()
        for lo, hi, (th, d, lp, r, a) in self.store.stream(read_theta, buf, launch_point, e, ea, write=written,
                                                           scratch=[buf, launch_point, ea]):
            if theta_fp is not None:
                self.segments.fingerprint_into(th, lo, theta_fp)
            xs = self.view.pieces(lo, hi)
            if xs:  # the pseudo-gradient chunk, contiguous
                torch.cat(xs, out=d)
                if not from_x:
                    if lp is not None:  # x_L <- x (exact merge)
                        lp.copy_(d)
                    d.neg_().add_(th)  # theta - x, the same bits as x <- theta + (-x)
                    norms += torch._foreach_norm(self.view.split_like(d, xs), 2)
            if r is not None:  # ||pseudo-gradient + residual||^2: the codec's input, not materialized
                out.input_sq.append(torch.dot(d, d) + 2 * torch.dot(d, r) + torch.dot(r, r))
            if a is not None:  # a_r <- theta_t - c w delta_{r,t}
                torch.mul(d, eager_scale, out=a).add_(th)
            if outbox is not None:
                if residual_out:  # e_new into d
                    outbox.put(lo, d, r, residual_out=d)
                    out.residual_sq.append(torch.dot(d, d))
                else:
                    outbox.put(lo, d, r)
                    if r is not None:
                        out.residual_sq.append(torch.dot(r, r))
            if reset_x is not None and xs:
                torch._foreach_copy_(xs, self.view.split_like(a if a is not None else th, xs))
        out.pseudo_grad_sq = _sum_of_squares(norms)
        return out

    def _launch(self, weights: tuple[float, ...] | None = None) -> ExchangeHandle:
        """none / delayed / eager, once the round goes ahead (x holds its pseudo-gradient): the launch
        pass (:meth:`_launch_pass`: encode with error feedback, the eager look-ahead, x <- a_r or
        theta_t for delayed / eager), then the exchange (``weights``: the decision's), bounded by
        :meth:`timeout_s` from now."""
        reset = self.config.overlap in ("delayed", "eager")
        resident = not self.store.held(self.exchange_buffer)  # the buffer on the device: it is the chunk itself
        host_send = self._host_all_reduce  # the host all-reduce buffer: the pass writes it back
        eager_scale = None
        if self.eager_anchor is not None:  # -c w: c = eta (1 + mu) with Nesterov, else eta; w = 1 / R by default
            c = self.config.outer_lr * ((1.0 + self.config.outer_momentum) if self.config.nesterov else 1.0)
            w = self.config.eager_weight
            if w is None:
                w = 1.0 / (dist.get_world_size(self.group) if self.group is not None else 1)
            eager_scale = -c * w
        outbox = None if self._executor is not None else self.outbox(
            self._round_codec(), send=self.exchange_buffer if resident or host_send else None)
        done = self._launch_pass(outbox=None if host_send else outbox, theta=None, from_x=True,
                                 eager_scale=eager_scale, reset_x=self.theta if reset else None,
                                 write_buffer=host_send)
        return self._start(outbox, done.input_sq, done.residual_sq, weights)

    @torch.no_grad()
    def boundary(self, joined: bool = False) -> RoundReport:
        """Run the boundary ending the current round (collective over the outer group and the
        decision group). Raises :class:`~megatron_diloco.algorithm.bounds.OuterGroupError` when a wait passes :meth:`timeout_s`.

        The round's rules (:attr:`round_rules`) meet first (after ``partial``'s pending exchange landed;
        separate jobs: the members present). ``joined``: this job has just met the run at this boundary and
        received its state (:meth:`FederatedRounds.join`): the rest of the boundary, contributing nothing."""
        if not joined:
            self.rounds += 1
        self.bounds.arm(self.timeout_s())
        if self.config.overlap == "partial":
            return self._partial_boundary(joined)
        if not joined:
            self.round_rules.meet()
        theta_fp = self.decision.theta_accumulator()  # theta as the decision sees it (None: not compared)
        if self.config.overlap == "none":
            with record_function("megatron_diloco::prepare"):
                self.round_rules.before_pseudo_gradient()
                sq = self._pseudo_gradient_into_x(theta_fp)  # theta: the anchor
                decision = self._decide(sq, 0, theta_fp)
                if decision is None:  # the round does not go ahead here (separate jobs: a failed round)
                    return RoundReport(self.rounds, False, ExchangeStats(), None, sq)
                if decision.skip:
                    return self._skip(sq, completed=None)
                self.round_rules.launch(rotate=False)
                handle = self._launch(decision.weights)
            with record_function("megatron_diloco::perform"):
                if not self._land(handle):
                    return RoundReport(self.rounds, False, handle.stats, None, sq)
                self.x_from(self.theta)
            return RoundReport(self.rounds, True, handle.stats, handle.stats, sq)

        # delayed / eager: x holds delta_t after this; ``delta`` still holds Delta_{t-1} (in flight).
        # theta's fingerprint: from the outer step's pass when an exchange is applied here, else from
        # the pseudo-gradient's (delayed: theta is its anchor; eager: not known, not compared)
        applies = self.pending is not None
        if not applies and self.eager_anchor is not None:
            theta_fp = None
        with record_function("megatron_diloco::prepare"):
            sq = self._pseudo_gradient_into_x(None if applies else theta_fp)
        completed = None
        with record_function("megatron_diloco::perform"):
            if self.pending is not None:
                self.complete(self.pending, self.outer, self._fingerprinting(theta_fp))
                completed = self.pending.stats
                self.pending = None
        with record_function("megatron_diloco::launch"):
            if self._decide(sq, 0, theta_fp, self._propose_local_steps()).skip:  # (one world: never None)
                return self._skip(sq, completed)
            self.round_rules.launch(rotate=False)
            self.pending = self._launch()  # also a_r (eager) and x <- a_r
            self.params_shared = self.eager_anchor is None
        return RoundReport(self.rounds, completed is not None, self.pending.stats, completed, sq)

    def _partial_boundary(self, joined: bool = False) -> RoundReport:
        """``partial`` (module doc): apply an exchange still pending (tau = H, or restored), take
        delta = theta - x and x_L (exact merge) without touching x, agree on skip and tau, launch;
        with tau = 0 apply at once. x_L is taken in the same pass as delta: with the host layout its
        copy out overlaps theta's copy in (a skipped round leaves it unused: nothing is pending).

        With a blockwise codec the same pass also encodes (one pass over the shard, not two: with
        the host layout the shard crosses PCIe once): e_new is written into the exchange buffer, not over
        e, so that a skipped round leaves the residual intact; when the round goes ahead the two
        buffers swap roles (e <- e_new; the buffer is scratch until the mean comes back). ``none``: the
        buffer holds delta_r, the all-reduce buffer itself (written back where the store holds it); the
        matrix codecs' worker encodes it."""
        completed = None
        if self.pending is not None:
            completed = self.merge()
        if not joined:
            self.round_rules.meet()
        theta_fp = self.decision.theta_accumulator()  # theta as the decision sees it: fingerprinted in this pass
        with record_function("megatron_diloco::prepare"):
            encode = self.residual is not None and self._executor is None  # blockwise codecs encode here
            outbox = self.outbox(self._round_codec()) if encode else None
            done = self._launch_pass(outbox=outbox, theta=self.theta, from_x=False, theta_fp=theta_fp,
                                     launch_point=self.launch_point, residual_out=True,
                                     write_buffer=encode or self._host_all_reduce)
            sq, input_sq, residual_sq = done.pseudo_grad_sq, done.input_sq, done.residual_sq
        with record_function("megatron_diloco::launch"):
            h = self._propose_local_steps()
            decision = self._decide(sq, self._choose_overlap_steps(h), theta_fp, h)
            if decision is None:  # the round does not go ahead here (separate jobs: a failed round; e untouched)
                return RoundReport(self.rounds, completed is not None, ExchangeStats(), completed, sq)
            self.tau = decision.tau
            if decision.skip:
                return self._skip(sq, completed)  # e untouched; the payload and e_new are dropped
            self.round_rules.launch(rotate=encode)  # encode: e <- e_new (the rules keep e_old, or not)
            if not encode and self._executor is None:  # none: the buffer holds delta_r, the all-reduce buffer
                outbox = self.outbox(self.codec, send=self.exchange_buffer)
            self.pending = self._start(outbox, input_sq, residual_sq, decision.weights)
            self.params_shared = False
        if self.tau == 0:
            completed = self.merge(at_launch=True)
        return RoundReport(self.rounds, completed is not None,
                           completed if self.tau == 0 else self.pending.stats, completed, sq)

    def merge_due(self, steps_since_boundary: int) -> bool:
        """Whether the pending exchange is to be applied after this inner step (``partial``: tau
        steps after the boundary that launched it; ``steps_since_boundary`` in 1..H-1)."""
        return self.pending is not None and self.config.overlap == "partial" and self.tau == steps_since_boundary

    @torch.no_grad()
    def merge(self, at_launch: bool = False) -> ExchangeStats:
        """``partial``: complete the pending exchange into the outer step (collective wait over the
        outer group, bounded) and merge it into x (module doc). ``at_launch``: no inner step since
        the launch (tau = 0): x <- theta. Returns the completed exchange's stats."""
        handle, self.pending = self.pending, None

        def merge_chunk(lo: int, hi: int, th: torch.Tensor, extra: list[torch.Tensor]) -> None:
            xs = self.view.pieces(lo, hi)
            if not xs:
                return
            if extra:  # exact: theta_new + (x - x_L)
                torch._foreach_sub_(xs, self.view.split_like(extra[0], xs))
                torch._foreach_add_(xs, self.view.split_like(th, xs))
            else:  # mix: alpha x + (1 - alpha) theta_new
                torch._foreach_lerp_(xs, self.view.split_like(th, xs), 1.0 - self.config.mix_alpha)

        with record_function("megatron_diloco::perform"):
            if at_launch:
                if self._land(handle):
                    self.x_from(self.theta)
                    self.params_shared = True
            else:  # the merge in the outer step's own pass (the host layout: theta crosses PCIe once)
                lp = self.launch_point
                self._land(handle, AfterStep([] if lp is None else [lp], merge_chunk))
                self.params_shared = False
        return handle.stats

    def _land(self, handle: ExchangeHandle, after: AfterStep | None = None) -> bool:
        """Complete ``handle`` into the outer step (``after`` fused into its pass), as the rules land it
        (:meth:`RoundRules.land`; separate jobs: only when every rank of this job completed and committed it,
        :meth:`FederatedRounds.land`); returns whether the step was applied."""
        return self.round_rules.land(handle, after)

    def _skip(self, sq: float, completed: ExchangeStats | None) -> RoundReport:
        """Drop this round's pseudo-gradient everywhere: x <- theta, residual untouched."""
        self.skipped_rounds += 1
        logger.warning("DiLoCoX round %d: non-finite pseudo-gradient on some rank (%s); round skipped on "
                       "every rank of every replica (local progress of this round dropped; nothing sent)", self.rounds, "this one" if not math.isfinite(sq) else "another one")
        if self.eager_anchor is not None:  # eager: no fresh pseudo-gradient to look ahead with
            self.eager_anchor.copy_(self.theta)
        self.x_from(self.theta)
        self.params_shared = True
        return RoundReport(self.rounds, completed is not None, ExchangeStats(), completed, sq, skipped=True)

    @torch.no_grad()
    def drain(self) -> ExchangeStats | None:
        """Wait for the exchange in flight (if any), apply it, and set x <- theta. Collective. With
        nothing in flight (``none``, or no boundary yet) it does nothing: x keeps the local progress
        since the last boundary. Then the rules finish (:meth:`RoundRules.finish`; separate jobs whose last
        round failed: a last meeting resolves it, and every job ends with the run's committed theta)."""
        stats = None
        if self.pending is not None:
            with record_function("megatron_diloco::drain"):
                stats = self.pending.stats
                landed = self._land(self.pending)
                self.pending = None
            if landed:
                if self.eager_anchor is not None:  # the look-ahead is now part of theta
                    self.eager_anchor.copy_(self.theta)
                self.x_from(self.theta)
                self.params_shared = True
        self.round_rules.finish()
        return stats

    # ---------------- completing an exchange; the buffers the round rules place ----------------
    def complete(self, handle: ExchangeHandle, outer: OuterNesterov | None = None,
                 after: AfterStep | None = None) -> None:
        """Complete ``handle`` (not past its bound: :class:`~megatron_diloco.algorithm.bounds.OuterGroupError` then): the mean into
        ``exchange_buffer`` (``outer`` None), or straight into ``outer``'s step, ``after`` fused into its pass
        (:meth:`ExchangeHandle.apply`). With a lossy codec its stats hold the squared norm of the
        residual it left (what was not sent; measured at the launch, or by the matrix codecs' worker
        thread): relative compression error = sqrt(residual_sq / input_sq)."""
        try:
            if outer is None:
                handle.wait()
            else:
                handle.apply(outer, after)
        except (RuntimeError, TimeoutError) as err:
            what = f"the exchange of round {handle.round}" if handle.round != self.rounds else "the exchange"
            raise self.bounds.failure(self.rounds, what, self.exchange_group, handle.timeout_s, handle.elapsed_s,
                                      err) from err
        if not handle.restored:  # a restored exchange's measurement is the checkpoint's (load_state_dict)
            self.longest_exchange_s = max(self.longest_exchange_s, handle.stats.exchange_s)
            self.last_completed = handle.stats

    def renew_exchange_buffer(self) -> None:
        """After an exchange that failed past its bound: a collective that timed out is never cancelled
        (gloo) and may still write into the buffer it was given, so leave that buffer to it and take a
        fresh :attr:`exchange_buffer` ((N,) fp32 with the outer state; its contents undefined). Local."""
        self.exchange_buffer = self.store.empty()

    def rotate_residual(self, keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """At a launch whose pass wrote e_new into :attr:`exchange_buffer` (``partial``, blockwise codec):
        e <- e_new. e_old's storage becomes the exchange buffer (scratch until the mean comes back); or,
        ``keep`` given (a spare (N,) fp32 buffer of the store, contents dropped), ``keep`` becomes the
        exchange buffer and e_old is returned untouched (the residual before the launch). Local."""
        e_old, self.residual = self.residual, self.exchange_buffer
        self.exchange_buffer = e_old if keep is None else keep
        return None if keep is None else e_old
