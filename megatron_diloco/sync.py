"""Round-boundary logic of DiLoCoX on one rank's shard: blocking (``none``) or one-step delay.

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
import datetime
import logging
import math
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_diloco.collectives import (
    AfterStep, DaemonWorker, ExchangeHandle, ExchangeStats, Outbox, bounded_all_reduce, measure_link_bandwidth,
    start_exchange, wire_bytes,
)
from megatron_diloco.config import CODECS, OUTER_TIMEOUT_HEADROOM, DiLoCoXConfig, link_share_bytes_per_s
from megatron_diloco.outer import OuterNesterov
from megatron_diloco.outer_store import OuterStore, chunk_elements
from megatron_diloco.shard_view import ShardView, fingerprint

logger = logging.getLogger(__name__)

#: ``dist.set_timeout`` (recent torch), else the private form it replaced (torch >= 2.6 as setup.py allows)
_set_group_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout


class ReplicasDivergedError(RuntimeError):
    """The outer parameters theta, which every replica must hold bit for bit, differ between replicas
    at a boundary (:meth:`OuterSync._any_rank_nonfinite` compares their fingerprints). Raised on every
    rank of every replica before anything of the round is launched."""


class OuterGroupError(RuntimeError):
    """An operation over an outer group (or the skip-decision group) did not complete within
    ``--diloco-x-outer-timeout-minutes`` of its start, or the backend reported it failed: a peer
    replica or the slow link stopped answering. Raised on the training loop's thread, before any
    state of the round is written, so the last completed checkpoint stays the one to resume from.
    The raising rank's :class:`OuterSync` is left mid-boundary: end the run, do not save it."""


def backstop_timeout_s(bound_s: float) -> float:
    """The process groups' own (backend) timeout for an outer bound ``bound_s``: ``1.25 x bound +
    60 s``. Larger than the bound, so the bounded wait of :class:`OuterSync` raises its named error
    first; it fires only when the training loop is not waiting when the bound passes (an explicit
    bound shorter than a round's compute), then with the backend's message (NCCL: its watchdog ends
    the process)."""
    return 1.25 * bound_s + 60.0


def _reduces_on_host(group: dist.ProcessGroup | None) -> bool:
    """Whether an all-reduce over ``group`` can run on host memory: none at all (no group, or one
    rank: one replica) or a gloo group (GPU tensors cross it as host copies anyway,
    :func:`megatron_diloco.collectives.host_copy`); not NCCL, which needs the buffer on the device."""
    if group is None or dist.get_world_size(group) <= 1:
        return True
    return dist.get_backend(group) == "gloo"


#: theta's fingerprint in the decision all-reduce: the two int64 sums (a0, a1) of
#: :func:`megatron_diloco.shard_view.fingerprint` folded to (MIX a0 + a1) mod P in [0, 2^52), exact in
#: float64 (P prime). One flipped bit changes a0 by d = +-2^j (j < 32) and a1 by d w (position weight
#: 1 <= w <= 1000003), so the fold by d (MIX + w) mod P, never 0 since 0 < MIX + w < P: it is always
#: seen (but where the 64-bit sums wrap around, a 2^-52 chance)
_FP_PRIME, _FP_MIX = 2**52 - 47, 2**32 + 15


def _fingerprint_value(fp: torch.Tensor) -> float:
    """``fp`` (int64 ``[2]``, :func:`megatron_diloco.shard_view.fingerprint`) as one float64 in
    [0, 2^52), exactly representable; a host sync (16 bytes)."""
    a0, a1 = (v % 2**64 for v in fp.tolist())
    return float((a0 * _FP_MIX + a1) % _FP_PRIME)


def _sum_of_squares(norms: list[torch.Tensor]) -> float:
    """Sum of the squares of fp32 L2 ``norms`` (0-dim tensors), in fp64; a host sync."""
    return float(torch.stack(norms).double().square().sum()) if norms else 0.0


def _sum(parts: list[torch.Tensor]) -> float:
    """Sum of 0-dim tensors (one per chunk), in fp64; a host sync."""
    return float(torch.stack(parts).double().sum()) if parts else 0.0


def _build_codec(config: DiLoCoXConfig, view: ShardView, shapes: list[tuple[int, ...]] | None,
                 name: str | None = None):
    """The codec ``name`` (default ``config.compression``) over the shard bucket. ``shapes``: per shard, a matrix
    shape ``(rows, cols)`` where the shard is whole rows of a >= 2-D parameter, else ``(numel,)``
    (defaults to 1-D shapes: the low-rank codecs then quantize or send everything raw)."""
    from megatron_diloco.compression import AdaptivePolicy, get_codec

    shapes = shapes or [(v.numel(),) for v in view.flat_views]
    if len(shapes) != len(view.flat_views) or any(
            math.prod(sh) != v.numel() for sh, v in zip(shapes, view.flat_views)):
        raise ValueError("shard shapes do not match the shards")
    offsets = [0]
    for v in view.flat_views:
        offsets.append(offsets[-1] + v.numel())
    layout = [(off, tuple(sh)) for off, sh in zip(offsets, shapes)]
    name = name or config.compression
    policy = AdaptivePolicy(energy_target=config.energy) if name == "adaptive" else None
    return get_codec(name, layout, rank=config.rank, policy=policy)


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


class OuterSync:
    """Owns the outer state of one rank's shard and runs the boundary protocol.

    Args:
        view: the rank's fp32 main-parameter shards (``x``), modified in place at each boundary.
        config: DiLoCoX hyperparameters (eta, mu, nesterov, overlap, outer timeout).
        group: the outer process group (one rank per replica, same shard). Every boundary, drain
            and checkpoint call is collective over it: all its ranks must call them in the same order.
        host_group: the gloo mirror of ``group``: the low-rank / adaptive worker thread's (GPU), and
            ``none``'s all-reduce with ``--diloco-x-outer-state cpu`` (on host memory, so that the
            device keeps no fp32 buffer for it).
        decision_group: the group that agrees on skipping a round (a NaN/Inf pseudo-gradient
            anywhere) and compares theta across replicas: it must span **every rank of the model**
            (all replicas, stages and shards), so that no stage applies a round that another skips;
            every boundary is collective over it. A tuple: reduced over in order (the replica's
            world, then the outer group), the first varying fastest in the ranks' numbering.
            None: the default (world) group when ``torch.distributed`` is initialized, else local.
            :func:`megatron_diloco.topology.decision_group_of_world` makes a gloo one.

    Every wait on these groups is bounded by :meth:`timeout_s` (``--diloco-x-outer-timeout-minutes``,
    or derived): past it :class:`OuterGroupError` names the round and the group. The groups' own
    timeouts are set to :func:`backstop_timeout_s` of it.
    """

    def __init__(self, view: ShardView, config: DiLoCoXConfig, group: dist.ProcessGroup | None,
                 shapes: list[tuple[int, ...]] | None = None,
                 host_group: dist.ProcessGroup | None = None,
                 decision_group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None,
                 link_sharers: int = 1) -> None:
        self.view = view
        #: S: the ranks of this replica whose exchanges cross the site's slow link at once (those
        #: holding a shard); a rank's share of ``--diloco-x-bandwidth-mbps`` is 1 / S of it
        self.link_sharers = max(1, int(link_sharers))
        self.config = config
        self.group = group
        if decision_group is None and dist.is_available() and dist.is_initialized():
            decision_group = dist.group.WORLD
        #: the skip decision's groups, reduced over in order (one group; or, with replicas in separate
        #: worlds, the replica's world then the outer group)
        self.decision_groups: tuple[dist.ProcessGroup, ...] = (
            tuple(decision_group) if isinstance(decision_group, (tuple, list))
            else (decision_group,) if decision_group is not None else ())
        spec = CODECS[config.compression]
        self._shapes = shapes
        self.codec = _build_codec(config, view, shapes)
        #: --diloco-x-warmup-compression: the codec of the exchanges launched into a warm-up round
        #: (blockwise, like ``codec``; the two share ``residual``), else None
        self.warmup_codec = (_build_codec(config, view, shapes, config.warmup_compression)
                             if config.warmup_compression else None)
        # worker thread of the matrix codecs' exchanges (several dependent collectives): a daemon, so
        # that one stuck in a collective with a peer that stopped answering never keeps the process
        # from exiting. Those exchanges, and ``none``'s with the host layout, run on the gloo mirror of
        # ``group`` when given (DiLoCoXConfig.exchanges_on_host_mirror; GPU tensors travel as host
        # copies); the other codecs' one collective runs on ``group`` itself.
        self._executor = DaemonWorker("diloco_x") if spec.matrix else None
        self.exchange_group = host_group if config.exchanges_on_host_mirror and host_group is not None else group
        #: where the outer state lives (--diloco-x-outer-state): on the device, or in host memory
        #: streamed through the device chunk by chunk at each boundary (megatron_diloco.outer_store)
        self.store = OuterStore(view.numel, view.device, on_host=config.outer_state == "cpu",
                                chunk=chunk_elements(config.outer_chunk_mb))
        store = self.store
        theta = store.empty()  # (N,) fp32, device or host
        self.x_into(theta)
        self.outer = OuterNesterov(theta, config.outer_lr, config.outer_momentum, config.nesterov,
                                   momentum_buffer=store.zeros() if config.outer_momentum > 0 else None)
        # delta: the pseudo-gradient in the exchange, one buffer for both directions: this replica's
        # delta_r goes out, the replicas' mean Delta comes back in place (N,) fp32. ``none``: the
        # all-reduce buffer itself, on the device where the collective needs it there (an NCCL
        # exchange group); with the host layout the all-reduce runs on the host (a gloo group: the
        # outer group of replicas in separate worlds, or the mirror; or no collective, one replica),
        # so it is held with the outer state (no device payload; over gloo the same PCIe bytes as a
        # host copy of a device buffer). The codecs that send an encoded payload keep it with the
        # outer state (it holds a mean only when one is waited for: checkpoints, restarts)
        # (held only matters with the host layout: store.empty allocates on the device otherwise)
        self.delta = store.empty(held=spec.lossy or _reduces_on_host(self.exchange_group))
        #: ``none`` with delta held on the host: the launch writes this replica's delta_r there and
        #: the all-reduce (gloo) runs on it in place
        self._host_all_reduce = not spec.lossy and store.held(self.delta)
        # e: what the lossy codec did not send yet (per replica; fp32, one per shard element).
        self.residual = store.zeros() if spec.lossy else None  # (N,) fp32
        # eager only: this replica's own anchor a_r (its look-ahead; per replica) (N,) fp32
        self.eager_anchor = store.empty() if config.overlap == "eager" else None
        if self.eager_anchor is not None:
            self.eager_anchor.copy_(theta)
        # partial + exact merge only: x_L, the local params when the pending exchange was launched
        # (per replica) (N,) fp32
        self.launch_point = (store.empty()
                             if config.overlap == "partial" and config.merge == "exact" else None)
        #: partial: inner steps after the last boundary at which the pending exchange is applied
        self.apply_at = config.local_steps if config.overlap_steps is None else config.overlap_steps
        #: whether x equals theta on this rank now (False while partial/eager keep own progress)
        self.x_is_theta = True
        #: the last exchange completed on this rank (partial auto tau sizes the next one by it)
        self.last_completed: ExchangeStats | None = None
        self.pending: ExchangeHandle | None = None
        self.rounds = 0
        self.skipped_rounds = 0
        #: payload bytes/s this rank can count on over the slow link: its share of
        #: --diloco-x-bandwidth-mbps (the site's link / S), else measured at the first boundary (by every
        #: outer group at once: a share directly; adaptive only; None until then, or without an outer link)
        self.link_bytes_per_s: float | None = (link_share_bytes_per_s(config.bandwidth_mbps, self.link_sharers)
                                               if config.bandwidth_mbps is not None else None)
        self._link_measured = False
        #: mean inner-step time of the last round (:meth:`set_step_time`; None until known)
        self.step_time_s: float | None = None
        #: inner steps of the round the next boundary starts (:meth:`set_step_time`; H but during a warm-up)
        self.next_round_steps: int = config.local_steps
        #: the longest completed exchange so far, launch to completion (s); enters the derived timeout
        self.longest_exchange_s = 0.0
        self._backstop_s: float | None = None  # the groups' own timeout as last set
        self._arm_timeouts()
        #: the per-boundary theta agreement (:meth:`_any_rank_nonfinite`): (this rank's slot, slots,
        #: its outer group's id) among the decision groups' ranks; None: nothing to compare
        self._agreement = self._agreement_slot()

    @property
    def link_mbps(self) -> float | None:
        """The site's slow link in Mbit/s as this rank sizes its exchanges by it (the meaning of
        ``--diloco-x-bandwidth-mbps``): its share x S; None while unknown."""
        return None if self.link_bytes_per_s is None else self.link_bytes_per_s * 8 / 1e6 * self.link_sharers

    # ---------------- timeouts ----------------
    def timeout_s(self) -> float:
        """The bound (s) on the next outer operation: ``--diloco-x-outer-timeout-minutes``, or derived
        from H x the step time and the longest exchange (:meth:`DiLoCoXConfig.outer_timeout_s`)."""
        return self.config.outer_timeout_s(self.step_time_s, self.longest_exchange_s)

    def _groups(self) -> list[dist.ProcessGroup]:
        """The distinct multi-rank groups this rank waits on (outer, its gloo mirror, decision)."""
        out: list[dist.ProcessGroup] = []
        for g in (self.group, self.exchange_group, *self.decision_groups):
            if g is not None and dist.get_world_size(g) > 1 and not any(g is h for h in out):
                out.append(g)
        return out

    def _arm_timeouts(self) -> None:
        """Set the groups' own timeout to the backstop of the current bound (when it grew, or shrank
        by more than 10%: the derived bound follows the step time). Only operations issued
        afterwards get it (NCCL reads it when a collective is enqueued)."""
        backstop = backstop_timeout_s(self.timeout_s())
        if self._backstop_s is not None and 0.9 * self._backstop_s <= backstop <= self._backstop_s:
            return
        for g in self._groups():
            _set_group_timeout(datetime.timedelta(seconds=backstop), g)
        self._backstop_s = backstop

    def _describe(self, group: dist.ProcessGroup | None) -> str:
        """``group`` in words, with its global ranks (for the errors)."""
        if group is not None and any(group is g for g in self.decision_groups) and group is not self.group:
            return f"the skip-decision group (all {dist.get_world_size(group)} ranks)"
        ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        mirror = ((" (its gloo mirror, worker thread)" if self._executor is not None else " (its gloo mirror)")
                  if group is self.exchange_group and group is not self.group else "")
        return f"outer group [ranks {', '.join(map(str, ranks))}]{mirror}"

    def _failure(self, what: str, group: dist.ProcessGroup | None, bound_s: float | None,
                 elapsed_s: float, err: BaseException, round_: int | None = None) -> OuterGroupError:
        """The error naming the round (default: the current boundary's), the operation, the group,
        the bound and the way out."""
        given = self.config.outer_timeout_minutes
        k = f"{OUTER_TIMEOUT_HEADROOM:g}"
        flag = (f"--diloco-x-outer-timeout-minutes {given:g}" if given is not None else
                f"--diloco-x-outer-timeout-minutes, derived: max(--distributed-timeout-minutes, {k} x H x "
                f"step time, {k} x longest exchange)")
        if isinstance(err, TimeoutError):
            how = (f"did not complete within {bound_s:.0f} s ({flag}); the slow link or a peer replica "
                   "stopped answering")
        else:
            how = (f"failed after {elapsed_s:.1f} s: {type(err).__name__}: {err}; a peer replica stopped "
                   "or the link broke")
        return OuterGroupError(
            f"DiLoCoX round {self.rounds if round_ is None else round_}: {what} over "
            f"{self._describe(group)} {how}. Nothing of this round was written: the last completed "
            "checkpoint (--save) is intact; resume from it with --load once the link is back, or raise "
            "--diloco-x-outer-timeout-minutes if the exchange is only slower than that bound.")

    @property
    def theta(self) -> torch.Tensor:
        return self.outer.theta

    @property
    def anchor(self) -> torch.Tensor:
        """a_r, the anchor: the params this replica's round starts from (pseudo-gradient = a_r - x):
        ``theta`` (shared), or with eager the replica's own :attr:`eager_anchor`."""
        return self.eager_anchor if self.eager_anchor is not None else self.outer.theta

    def x_into(self, t: torch.Tensor) -> None:
        """``t`` <- x: the shards into a flat vector of the store (local)."""
        for lo, hi, (c,) in self.store.stream(t, write=[t], scratch=[t]):
            if self.view.flat_views:
                torch.cat(self.view.pieces(lo, hi), out=c)

    def x_from(self, t: torch.Tensor) -> None:
        """x <- ``t`` (a flat vector of the store), on the shards in place (local)."""
        for lo, hi, (c,) in self.store.stream(t):
            xs = self.view.pieces(lo, hi)
            if xs:
                torch._foreach_copy_(xs, self.view.split_like(c, xs))

    def fingerprint(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """:func:`megatron_diloco.shard_view.fingerprint` of flat vectors of the store (theta, m),
        computed on the device chunk by chunk (host-held ones are streamed through it): the same
        value, int64 ``[2]`` on the device. Local."""
        acc = torch.zeros(2, dtype=torch.int64, device=self.view.device)
        offset = 0
        for t in tensors:
            for lo, _, (c,) in self.store.stream(t):
                fingerprint([c], start=offset + lo, acc=acc)
            offset += t.numel()
        return acc

    def _pseudo_gradient_into_x(self, theta_fp: torch.Tensor | None = None) -> float:
        """x <- start - x on the shards, in place; returns the squared norm (a host sync).
        ``theta_fp``: also fingerprint the anchor into it (int64 ``[2]``, in place; the anchor is
        theta but with eager)."""
        norms: list[torch.Tensor] = []
        for lo, hi, (a,) in self.store.stream(self.anchor):
            if theta_fp is not None:
                fingerprint([a], start=lo, acc=theta_fp)
            xs = self.view.pieces(lo, hi)
            if xs:
                torch._foreach_neg_(xs)
                torch._foreach_add_(xs, self.view.split_like(a, xs))
                norms += torch._foreach_norm(xs, 2)
        return _sum_of_squares(norms)

    def _any_rank_nonfinite(self, sq: float, overlap_steps: int = 0,
                            theta_fp: torch.Tensor | None = None) -> tuple[bool, int]:
        """Whether any rank's pseudo-gradient shard, in any replica, stage or shard, holds a NaN/Inf.

        ``sq`` is this rank's squared norm of it (already on the host, no extra pass over the shard):
        non-finite when the shard holds a NaN/Inf, or when its fp32 norm overflows (entries near
        1e19: a diverged round, skipped as well). One MAX all-reduce over the decision group
        (every rank of the model; blocking, bounded by :meth:`timeout_s`) makes every rank take the
        same decision before anything is sent: a NaN in one stage skips the round of all stages.

        The same all-reduce agrees on ``overlap_steps`` (partial: this rank's tau; the largest wins,
        so that the slowest rank's exchange is hidden), and compares theta across replicas:
        ``theta_fp`` is the fingerprint (int64 ``[2]``) of this rank's theta as it stands at the
        decision, taken in the boundary's pass that last read or wrote it (None: not known this
        boundary, then not compared). The float64 vector is ``[skip, tau, fp[W], gid[W]]`` over the W
        ranks of the decision groups: each rank writes its slot (fp folded to 52 bits, its outer
        group's id), the others hold -1, so the MAX delivers every rank's to every rank, and every
        rank raises :class:`ReplicasDivergedError` alike when the members of some outer group
        disagree (:meth:`_check_theta_agrees`), before anything of the round is launched.

        Cost per boundary: the all-reduce carries 16 B per rank of the world instead of 8 B in all
        (16 KB at 1024 ranks: still latency-bound, one collective as before); the fingerprint is two
        int64 sums over the rank's theta shard inside a pass that streams theta anyway (no extra
        PCIe crossing with the host layout); one 16-byte device-to-host copy. Nothing with one
        replica. Returns ``(skip, agreed tau)``."""
        groups = [g for g in self.decision_groups if dist.get_world_size(g) > 1]
        on_host = all(dist.get_backend(g) == "gloo" for g in groups)
        slots = self._agreement[1] if self._agreement is not None else 0
        flag = torch.full((2 + 2 * slots,), -1.0, dtype=torch.float64)  # [skip, tau, fp[W], gid[W]]
        flag[0], flag[1] = 0.0 if math.isfinite(sq) else 1.0, float(overlap_steps)
        if self._agreement is not None:
            slot, _, gid = self._agreement
            flag[2 + slot] = _fingerprint_value(theta_fp) if theta_fp is not None else -1.0
            flag[2 + slots + slot] = float(gid)
        if not on_host:
            flag = flag.to(self.view.device)
        for group in groups:
            bound = self.timeout_s()
            started = time.perf_counter()
            try:
                bounded_all_reduce(flag, dist.ReduceOp.MAX, group, bound)
            except (RuntimeError, TimeoutError) as err:
                raise self._failure("the skip decision (non-finite check)", group, bound,
                                    time.perf_counter() - started, err) from err
        values = flag.tolist()
        if self._agreement is not None:
            self._check_theta_agrees(values[2:2 + slots], values[2 + slots:])
        return bool(values[0]), int(values[1])

    def _agreement_slot(self) -> tuple[int, int, int] | None:
        """This rank's place in the theta agreement of :meth:`_any_rank_nonfinite`: (its slot among
        the decision groups' ranks, their number W, the id of its outer group), or None where there
        is nothing to compare (one replica, no decision group). The slot numbers ranks as the outer
        group lists them (:func:`dist.get_process_group_ranks`): the global rank in one world; with
        replicas in separate worlds, whose decision groups are the replica's world then the outer
        group, ``replica x world + rank``. The outer group's id is its lowest member. Local."""
        if self.group is None or dist.get_world_size(self.group) <= 1 or not self.decision_groups:
            return None
        slot, slots = 0, 1
        for g in self.decision_groups:  # mixed radix: the first group varies fastest
            slot += g.rank() * slots
            slots *= g.size()
        members = dist.get_process_group_ranks(self.group)
        if slot not in members or max(members) >= slots:
            return None  # groups numbered otherwise than topology.py's (not compared)
        return slot, slots, min(members)

    def _check_theta_agrees(self, fps: list[float], gids: list[float]) -> None:
        """Raise :class:`ReplicasDivergedError` when the members of some outer group hold different
        theta fingerprints (``fps``, ``gids``: per slot, as the decision delivered them; -1: not
        known). Replica r of a group is its r-th member. The same lists on every rank: all raise."""
        members: dict[int, list[tuple[int, float]]] = {}
        for slot, (fp, gid) in enumerate(zip(fps, gids)):
            if gid >= 0:
                members.setdefault(int(gid), []).append((slot, fp))
        odd: set[int] = set()
        where: list[str] = []  # the disagreeing outer groups, by their ranks
        for group in members.values():
            known = [fp for _, fp in group if fp >= 0]
            if len(set(known)) <= 1:
                continue
            common = max(known, key=lambda v: (known.count(v), -known.index(v)))  # ties: lowest replica
            odd.update(r for r, (_, fp) in enumerate(group) if fp >= 0 and fp != common)
            where.append("[ranks " + ", ".join(str(slot) for slot, _ in group) + "]")
        if not odd:
            return
        listed = ", ".join(map(str, sorted(odd)))
        raise ReplicasDivergedError(
            f"DiLoCoX round {self.rounds}: the outer parameters theta differ across replicas at this "
            f"boundary: replica{'s' if len(odd) > 1 else ''} {listed} differ{'' if len(odd) > 1 else 's'} from "
            f"the others in {len(where)} of {len(members)} outer groups ({', '.join(where[:4])}"
            f"{', ...' if len(where) > 4 else ''}); theta must be bit-identical "
            "on every replica. Likely causes: a payload corrupted on the outer link, a decode or outer step "
            "that is not bit-reproducible across the replicas' devices (other GPU generations, library or "
            "package versions), or memory corruption. Nothing of this round was launched; resume from the "
            "last checkpoint with --load (it holds one theta for every replica) on hardware and software "
            "that agree.")

    def _new_theta_fp(self) -> torch.Tensor | None:
        """A zero fingerprint accumulator (int64 ``[2]``, on the shard's device) when theta is compared
        at the boundaries (:meth:`_any_rank_nonfinite`), else None."""
        return torch.zeros(2, dtype=torch.int64, device=self.view.device) if self._agreement is not None else None

    @staticmethod
    def _fingerprinting(theta_fp: torch.Tensor | None) -> AfterStep | None:
        """Fingerprint the new theta into ``theta_fp`` inside the outer step's pass (None: nothing)."""
        if theta_fp is None:
            return None
        return AfterStep([], lambda lo, hi, th, extra: fingerprint([th], start=lo, acc=theta_fp))

    def _complete(self, handle: ExchangeHandle, outer: OuterNesterov | None = None,
                  after: AfterStep | None = None) -> None:
        """Complete ``handle`` (not past its bound: :class:`OuterGroupError` then): the mean into
        ``delta`` (``outer`` None), or straight into ``outer``'s step, ``after`` fused into its pass
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
            raise self._failure(what, self.exchange_group, handle.timeout_s, handle.elapsed_s, err) from err
        if not handle.restored:  # a restored exchange's measurement is the checkpoint's (load_state_dict)
            self.longest_exchange_s = max(self.longest_exchange_s, handle.stats.exchange_s)
            self.last_completed = handle.stats

    def _launch(self) -> ExchangeHandle:
        """none / delayed / eager: one pass over the shard (chunk by chunk through :attr:`store`) that
        takes this round's pseudo-gradient (x holds it), encodes it with error feedback into the
        exchange's payload (:class:`Outbox`), builds the eager look-ahead a_r <- theta_t - c w delta,
        and sets x <- a_r (delayed/eager); then launches the exchange, bounded by :meth:`timeout_s`
        from now. (``partial`` does all of this in its own prepare pass: :meth:`_partial_boundary`.)"""
        overlap = self.config.overlap
        eager = self.eager_anchor is not None
        reset_x = overlap in ("delayed", "eager")
        resident = not self.store.held(self.delta)  # delta on the device: it is the chunk itself
        host_send = self._host_all_reduce  # delta is the host all-reduce buffer: the pass writes it back
        c = self.config.outer_lr * ((1.0 + self.config.outer_momentum) if self.config.nesterov else 1.0)
        w = self.config.eager_weight
        if w is None:
            w = 1.0 / (dist.get_world_size(self.group) if self.group is not None else 1)
        outbox = None if self._executor is not None else Outbox(
            self._round_codec(), self.view.numel, self.view.device, send=self.delta if resident or host_send else None)
        tensors = [self.theta if reset_x else None, self.delta, self.residual, self.eager_anchor]
        write_only = [self.eager_anchor, self.delta if host_send else None]
        input_sq: list[torch.Tensor] = []
        residual_sq: list[torch.Tensor] = []
        for lo, hi, (th, d, e, ea) in self.store.stream(
                *tensors, write=[self.residual, *write_only], scratch=[self.delta, *write_only]):
            xs = self.view.pieces(lo, hi)
            if xs:  # the pseudo-gradient chunk, contiguous
                torch.cat(xs, out=d)
            if e is not None:  # ||pseudo-gradient + residual||^2: the codec's input, not materialized
                input_sq.append(torch.dot(d, d) + 2 * torch.dot(d, e) + torch.dot(e, e))
            if ea is not None:  # a_r <- theta_t - c w delta_{r,t}
                torch.mul(d, -c * w, out=ea).add_(th)
            if outbox is not None and not host_send:  # (host_send: the store copies d back into delta)
                outbox.put(lo, d, e)
                if e is not None:
                    residual_sq.append(torch.dot(e, e))
            if reset_x and xs:
                torch._foreach_copy_(xs, self.view.split_like(ea if eager else th, xs))
        return self._start(outbox, input_sq, residual_sq)

    def _start(self, outbox: Outbox | None, input_sq: list[torch.Tensor],
               residual_sq: list[torch.Tensor]) -> ExchangeHandle:
        """Launch the exchange of the round whose payload ``outbox`` holds (None: a matrix codec, whose
        worker encodes), bounded by :meth:`timeout_s` from now; the squared norms of the codec's input
        and of the residual it left, as chunk parts."""
        codec = outbox.codec if outbox is not None else self.codec
        handle = start_exchange(self.delta, self.residual, codec, self.exchange_group, worker=self._executor,
                                timeout_s=self.timeout_s(), outbox=outbox, store=self.store)
        handle.stats.input_sq = _sum(input_sq)
        if outbox is not None:  # (the matrix codecs' worker measures the residual it leaves itself)
            handle.stats.residual_sq = _sum(residual_sq)
        handle.round = self.rounds
        return handle

    def set_step_time(self, step_time_s: float | None, next_round_steps: int | None = None) -> None:
        """Inner-step time measured by the caller, before each boundary (None: not measured this
        round, e.g. a resume just before a boundary; the last one, or the checkpoint's, is kept), and
        the inner steps of the round that boundary starts (``next_round_steps``; default H: it
        differs during a warm-up of shorter rounds, :attr:`DiLoCoXConfig.warmup_local_steps`): sets
        the adaptive codec's byte
        budget to link bandwidth x those steps x step time (no-op unless adaptive); auto tau hides
        the exchange within them.

        Also the step time of the derived outer timeout (:meth:`timeout_s`), for every codec.

        Without ``--diloco-x-bandwidth-mbps`` the first call measures the link
        (:func:`megatron_diloco.collectives.measure_link_bandwidth`: collective over the outer group,
        run at the first boundary with no exchange in flight: the first of a run, or the first after
        a resume, whose pending exchange was completed before the checkpoint). The measured value is
        checkpointed (:meth:`state_dict`), so a resumed run keeps the same budget."""
        if step_time_s is not None:
            self.step_time_s = step_time_s
        self.next_round_steps = next_round_steps or self.config.local_steps
        policy = getattr(self.codec, "policy", None)
        if policy is None:
            return
        if self.link_bytes_per_s is None and not self._link_measured:
            if self.pending is not None and not self.pending.finished:
                return  # the worker thread owns the group (and the link); measure next time
            self._link_measured = True
            if self.view.numel == 0:  # an empty shard sends nothing (nor does its outer group: same
                return                # shard position); measuring with the S ranks that send only
            self._arm_timeouts()
            bound = self.timeout_s()
            started = time.perf_counter()
            try:
                self.link_bytes_per_s = measure_link_bandwidth(self.group, self.view.device,
                                                               timeout_s=bound)
            except (RuntimeError, TimeoutError) as err:
                raise self._failure("the link measurement", self.group, bound,
                                    time.perf_counter() - started, err, round_=self.rounds + 1) from err
            if self.link_bytes_per_s is not None:
                logger.info("DiLoCoX: measured outer link %.1f Mbit/s per rank (all-gather, all outer groups at "
                            "once: about %.1f Mbit/s for the site's %d sending ranks); adaptive byte budget = "
                            "the rank's share x H x step time (set --diloco-x-bandwidth-mbps to fix it)",
                            self.link_bytes_per_s * 8 / 1e6, self.link_mbps, self.link_sharers)
        if self.link_bytes_per_s is None or self.step_time_s is None:
            return
        from megatron_diloco.compression import byte_budget

        policy.budget_bytes = byte_budget(self.link_bytes_per_s, self.next_round_steps, self.step_time_s)

    @torch.no_grad()
    def boundary(self) -> RoundReport:
        """Run the boundary ending the current round (collective over the outer group and the
        decision group). Raises :class:`OuterGroupError` when a wait passes :meth:`timeout_s`."""
        self.rounds += 1
        self._arm_timeouts()
        if self.config.overlap == "partial":
            return self._partial_boundary()
        theta_fp = self._new_theta_fp()  # theta as the decision sees it (None: not compared)
        if self.config.overlap == "none":
            with record_function("megatron_diloco::prepare"):
                sq = self._pseudo_gradient_into_x(theta_fp)  # theta: the anchor
                if self._any_rank_nonfinite(sq, theta_fp=theta_fp)[0]:
                    return self._skip(sq, completed=None)
                handle = self._launch()
            with record_function("megatron_diloco::perform"):
                self._complete(handle, self.outer)
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
                self._complete(self.pending, self.outer, self._fingerprinting(theta_fp))
                completed = self.pending.stats
                self.pending = None
        with record_function("megatron_diloco::launch"):
            if self._any_rank_nonfinite(sq, theta_fp=theta_fp)[0]:
                return self._skip(sq, completed)
            self.pending = self._launch()  # also a_r (eager) and x <- a_r
            self.x_is_theta = self.eager_anchor is None
        return RoundReport(self.rounds, completed is not None, self.pending.stats, completed, sq)

    def _partial_boundary(self) -> RoundReport:
        """``partial`` (module doc): apply an exchange still pending (tau = H, or restored), take
        delta = theta - x and x_L (exact merge) without touching x, agree on skip and tau, launch;
        with tau = 0 apply at once. x_L is taken in the same pass as delta: with the host layout its
        copy out overlaps theta's copy in (a skipped round leaves it unused: nothing is pending).

        With a blockwise codec the same pass also encodes (one pass over the shard, not two: with
        the host layout the shard crosses PCIe once): e_new is written into delta's buffer, not over
        e, so that a skipped round leaves the residual intact; when the round goes ahead the two
        buffers swap roles (e <- e_new; delta is scratch until the mean comes back). ``none``: delta
        holds delta_r, the all-reduce buffer itself (written back where the store holds it); the
        matrix codecs' worker encodes it."""
        completed = None
        if self.pending is not None:
            completed = self.merge()
        theta_fp = self._new_theta_fp()  # theta as the decision sees it: fingerprinted in this pass
        with record_function("megatron_diloco::prepare"):
            norms: list[torch.Tensor] = []
            x_l = self.launch_point  # None unless partial + exact
            encode = self.residual is not None and self._executor is None  # blockwise codecs encode here
            outbox = Outbox(self._round_codec(), self.view.numel, self.view.device) if encode else None
            input_sq: list[torch.Tensor] = []
            residual_sq: list[torch.Tensor] = []
            # delta is copied back where it is held: it receives e_new (blockwise), or it is the host
            # all-reduce buffer (none over gloo) and holds delta_r
            d_out = self.delta if encode or self._host_all_reduce else None
            for lo, hi, (th, d, lp, e) in self.store.stream(self.theta, self.delta, x_l, self.residual,
                                                            write=[x_l, d_out], scratch=[self.delta, x_l]):
                if theta_fp is not None:
                    fingerprint([th], start=lo, acc=theta_fp)
                xs = self.view.pieces(lo, hi)
                if xs:
                    torch.cat(xs, out=d)
                    if lp is not None:  # x_L <- x (exact merge)
                        lp.copy_(d)
                    d.neg_().add_(th)  # theta - x, the same bits as x <- theta + (-x)
                    norms += torch._foreach_norm(self.view.split_like(d, xs), 2)
                if e is not None:  # ||pseudo-gradient + residual||^2: the codec's input, not materialized
                    input_sq.append(torch.dot(d, d) + 2 * torch.dot(d, e) + torch.dot(e, e))
                if encode:  # e_new into d
                    outbox.put(lo, d, e, residual_out=d)
                    residual_sq.append(torch.dot(d, d))
            sq = _sum_of_squares(norms)
        with record_function("megatron_diloco::launch"):
            skip, self.apply_at = self._any_rank_nonfinite(sq, self._choose_overlap_steps(), theta_fp)
            if skip:
                return self._skip(sq, completed)  # e untouched; the payload and e_new are dropped
            if encode:
                self.residual, self.delta = self.delta, self.residual
            elif self._executor is None:  # none: delta holds delta_r, the all-reduce buffer
                outbox = Outbox(self.codec, self.view.numel, self.view.device, send=self.delta)
            self.pending = self._start(outbox, input_sq, residual_sq)
            self.x_is_theta = False
        if self.apply_at == 0:
            completed = self.merge(at_launch=True)
        return RoundReport(self.rounds, completed is not None,
                           completed if self.apply_at == 0 else self.pending.stats, completed, sq)

    def _choose_overlap_steps(self) -> int:
        """This rank's tau for the exchange about to launch: ``--diloco-x-overlap-steps``, or (auto)
        the fewest inner steps, at least 1, that hide the exchange, over the last round's mean step
        time: its wire bytes at the link bandwidth when that is known (``--diloco-x-bandwidth-mbps``
        or measured; the bytes of this exchange where its codec fixes them, else of the last completed
        exchange), else the last exchange's measured duration. H while
        neither is known (the first exchange of a run without a known link). At most the steps of the
        round it hides behind; when that is a warm-up round shorter than H
        (``--diloco-x-warmup-local-steps``), at most ``--diloco-x-warmup-overlap-steps`` (0: it
        blocks; there a few steps of staleness are a large share of the round:
        benchmarks/RESULTS.md §2.1)."""
        H = self.next_round_steps  # the steps the exchange can hide behind (tau = H: the next boundary)
        cap = H if H >= self.config.local_steps else self.config.warmup_overlap_steps
        if cap == 0:
            return 0
        if self.config.overlap_steps is not None:
            return min(cap, self.config.overlap_steps)
        last = self.last_completed
        if not self.step_time_s:
            return cap
        wire = self._fixed_wire_bytes() or (last.bytes_sent if last is not None else None)
        if self.link_bytes_per_s and wire:
            seconds = wire / self.link_bytes_per_s
        elif last is not None:
            seconds = last.exchange_s
        else:
            return cap
        return min(cap, max(1, math.ceil(seconds / self.step_time_s)))

    def schedule_changed(self) -> None:
        """The warm-up of :attr:`config` changed (a resume keeping its checkpoint's, or the run length
        known late): build, keep or drop :attr:`warmup_codec` to match ``config.warmup_compression``."""
        name = self.config.warmup_compression
        if name is None:
            self.warmup_codec = None
        elif self.warmup_codec is None or self.warmup_codec.name != name:
            self.warmup_codec = _build_codec(self.config, self.view, self._shapes, name)

    def _round_codec(self):
        """The codec of the exchange about to launch: :attr:`warmup_codec` when it launches into a
        warm-up round (:attr:`next_round_steps` < H), else :attr:`codec`."""
        if self.warmup_codec is not None and self.next_round_steps < self.config.local_steps:
            return self.warmup_codec
        return self.codec

    def _fixed_wire_bytes(self) -> int | None:
        """Bytes this rank sends in the exchange about to launch where its codec fixes them in advance
        (every codec but the matrix ones, whose ranks vary); None otherwise."""
        codec = self._round_codec()
        spec = CODECS[codec.name]
        if spec.matrix:
            return None
        # the outer group: one rank per replica
        return wire_bytes(spec.collective, codec.payload_bytes(self.view.numel), self.config.replicas)

    def poll(self) -> None:
        """Note whether the exchange in flight has completed (its completion time: auto tau, the
        derived timeout and the round log are sized from it). Call once per inner step, after it:
        non-blocking, no device sync, no collective (:meth:`ExchangeHandle.poll`)."""
        if self.pending is not None and not self.pending.finished:
            self.pending.poll()

    def merge_due(self, steps_since_boundary: int) -> bool:
        """Whether the pending exchange is to be applied after this inner step (``partial``: tau
        steps after the boundary that launched it; ``steps_since_boundary`` in 1..H-1)."""
        return self.pending is not None and self.config.overlap == "partial" and self.apply_at == steps_since_boundary

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
                self._complete(handle, self.outer)
                self.x_from(self.theta)
            else:  # the merge in the outer step's own pass (the host layout: theta crosses PCIe once)
                lp = self.launch_point
                self._complete(handle, self.outer, AfterStep([] if lp is None else [lp], merge_chunk))
            self.x_is_theta = at_launch
        return handle.stats

    def _skip(self, sq: float, completed: ExchangeStats | None) -> RoundReport:
        """Drop this round's pseudo-gradient everywhere: x <- theta, residual untouched."""
        self.skipped_rounds += 1
        logger.warning("DiLoCoX round %d: non-finite pseudo-gradient on some rank (%s); round skipped on "
                       "every rank of every replica (local progress of this round dropped; nothing sent)", self.rounds, "this one" if not math.isfinite(sq) else "another one")
        if self.eager_anchor is not None:  # eager: no fresh pseudo-gradient to look ahead with
            self.eager_anchor.copy_(self.theta)
        self.x_from(self.theta)
        self.x_is_theta = True
        return RoundReport(self.rounds, completed is not None, ExchangeStats(), completed, sq, skipped=True)

    @torch.no_grad()
    def drain(self) -> ExchangeStats | None:
        """Wait for the exchange in flight (if any), apply it, and set x <- theta. Collective. With
        nothing in flight (``none``, or no boundary yet) it does nothing: x keeps the local progress
        since the last boundary."""
        if self.pending is None:
            return None
        with record_function("megatron_diloco::drain"):
            self._complete(self.pending, self.outer)
            stats = self.pending.stats
            self.pending = None
            if self.eager_anchor is not None:  # the look-ahead is now part of theta
                self.eager_anchor.copy_(self.theta)
            self.x_from(self.theta)
            self.x_is_theta = True
        return stats

    # ---------------- checkpointing ----------------
    def state_dict(self) -> dict:
        """Outer state, identical on every replica (the in-flight exchange is completed, not applied).
        The error-feedback ``residual`` and the ``eager_anchor`` differ per replica and
        are checkpointed by the owner of the per-replica state
        (:class:`megatron_diloco.optimizer.DiLoCoXOptimizer`).

        Completing the exchange keeps the trajectory unchanged: a resumed run applies it at the next
        boundary exactly as the uninterrupted run does.
        """
        has_pending = self.pending is not None
        if has_pending:
            self._complete(self.pending)  # bounded: a hung link raises before anything is written
        return {
            "rounds": self.rounds,
            "skipped_rounds": self.skipped_rounds,
            "theta": self.outer.theta,
            "momentum_buffer": self.outer.momentum_buffer,
            "pending_delta": self.delta if has_pending else None,
            "apply_at": self.apply_at,  # partial: when the pending exchange is applied
            # low-rank bases / adaptive plan: identical on every replica
            "codec": self.codec.state_dict() if hasattr(self.codec, "state_dict") else None,
            # the measured outer link (adaptive byte budget; MIN over the group, so identical on every
            # replica); a given --diloco-x-bandwidth-mbps is not stored: the flag of the resumed run wins
            "link_measured": self._link_measured,
            "link_bytes_per_s": self.link_bytes_per_s if self._link_measured else None,
            # what auto tau, the adaptive budget and the derived timeout are sized from (this rank's;
            # the torch_dist checkpoint keeps replica 0's here, and each replica's own in its per-replica
            # state, which a resume restores: DiLoCoXOptimizer._replica_meta)
            **self.timings(),
        }

    def timings(self) -> dict:
        """This rank's own measurements that auto tau, the adaptive budget and the derived timeout are
        sized from (the step time, the last completed exchange's bytes and duration, the longest
        exchange): checkpointed per replica (``DiLoCoXOptimizer``), so that every replica resumes with
        its own, as the uninterrupted run's next boundary uses them (tau agreed by MAX over all ranks)."""
        return {"step_time_s": self.step_time_s,
                "last_exchange": None if self.last_completed is None else {
                    "bytes_sent": self.last_completed.bytes_sent, "exchange_s": self.last_completed.exchange_s},
                "longest_exchange_s": self.longest_exchange_s}

    def load_timings(self, state: dict) -> None:
        """Restore :meth:`timings` (absent entries keep what is there)."""
        if state.get("step_time_s") is not None:
            self.step_time_s = float(state["step_time_s"])
        if state.get("last_exchange") is not None:
            last = state["last_exchange"]
            self.last_completed = ExchangeStats(bytes_sent=int(last["bytes_sent"]),
                                                exchange_s=float(last["exchange_s"]))
        self.longest_exchange_s = float(state.get("longest_exchange_s", self.longest_exchange_s))

    def load_state_dict(self, state: dict) -> None:
        if state["theta"].numel() != self.theta.numel():
            raise ValueError(
                f"DiLoCoX checkpoint holds an outer shard of {state['theta'].numel()} elements, this rank "
                f"owns {self.theta.numel()}: resume with the same TP/PP/DP layout and --diloco-x-replicas"
            )
        self.rounds = int(state["rounds"])
        self.skipped_rounds = int(state.get("skipped_rounds", 0))
        # the measured link, unless this run gives --diloco-x-bandwidth-mbps; checkpoints without it
        # (older ones) measure again at the next boundary (the restored exchange is complete)
        if self.config.bandwidth_mbps is None and state.get("link_measured", False):
            self._link_measured = True
            value = state.get("link_bytes_per_s")
            self.link_bytes_per_s = float(value) if value is not None else None
        # the measurements auto tau and the adaptive budget use (absent from older checkpoints: measured
        # anew, auto tau = H until an exchange completes); the replica's own, where its checkpoint
        # state holds them, replace these afterwards (DiLoCoXOptimizer._load_replica_meta)
        self.load_timings(state)
        self.outer.load_state_dict(state)
        self.apply_at = int(state.get("apply_at", self.apply_at))
        if hasattr(self.codec, "load_state_dict"):
            if state.get("codec") is None:
                raise ValueError(f"checkpoint has no state for --diloco-x-compression "
                                 f"{self.config.compression}: resume with the codec it was written with")
            self.codec.load_state_dict(state["codec"])
        self.pending = None
        if state.get("pending_delta") is not None:
            self.delta.copy_(state["pending_delta"])
            self.pending = ExchangeHandle.completed(self.delta, self.store)
        # x as loaded: theta for none/delayed; eager with nothing in flight holds a_r = theta; partial
        # keeps its own progress
        self.x_is_theta = self.config.overlap in ("none", "delayed") or (
            self.config.overlap == "eager" and self.pending is None)
