"""One rank's outer state and the round protocol's plumbing: :class:`OuterSync`.

Notation (docs/design.md, "Algorithm"): ``theta`` outer params, ``x`` the replica's local params (the fp32
main-parameter shards of the inner optimizer), ``Delta`` the replicas' mean pseudo-gradient. The
boundary protocols themselves (``none``, ``delayed``, ``eager``, ``partial``) are in
:mod:`megatron_diloco.algorithm.protocols`; the round schedule in :mod:`~megatron_diloco.algorithm.schedule`;
the boundary's decision in :mod:`~megatron_diloco.algorithm.decision`; the bounds on its waits in
:mod:`~megatron_diloco.algorithm.bounds`; how a round is agreed, landed, saved and finished (one world, or
separate jobs) in :mod:`~megatron_diloco.algorithm.rounds`, whose rules use the public methods here.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.exchange import ExchangeHandle, ExchangeStats, Outbox, start_exchange
from megatron_diloco.algorithm.link import measure_link_bandwidth
from megatron_diloco.algorithm.worker import DaemonWorker
from megatron_diloco.algorithm.bounds import OuterBounds
from megatron_diloco.algorithm.config import CODECS, DiLoCoXConfig, link_share_bytes_per_s
from megatron_diloco.algorithm.decision import BoundaryDecision
from megatron_diloco.algorithm.outer import OuterNesterov
from megatron_diloco.algorithm.outer_store import OuterStore, chunk_elements
from megatron_diloco.algorithm.protocols import BoundaryProtocols
from megatron_diloco.algorithm.rounds import OneWorldRounds, RoundRules
from megatron_diloco.algorithm.schedule import RoundSchedule
from megatron_diloco.algorithm.shard_view import ShardView
from megatron_diloco.algorithm.slot_exchange import Segments, SlotOutbox, check_slot_codec

logger = logging.getLogger(__name__)

def _reduces_on_host(group: dist.ProcessGroup | None) -> bool:
    """Whether an all-reduce over ``group`` can run on host memory: none at all (no group, or one
    rank: one replica) or a gloo group (GPU tensors cross it as host copies anyway,
    :func:`megatron_diloco.algorithm.link.host_copy`); not NCCL, which needs the buffer on the device."""
    if group is None or dist.get_world_size(group) <= 1:
        return True
    return dist.get_backend(group) == "gloo"


def _sum(parts: list[torch.Tensor]) -> float:
    """Sum of 0-dim tensors (one per chunk), in fp64; a host sync."""
    return float(torch.stack(parts).double().sum()) if parts else 0.0


def _build_codec(config: DiLoCoXConfig, view: ShardView, shapes: list[tuple[int, ...]] | None,
                 name: str | None = None):
    """The codec ``name`` (default ``config.compression``) over the shard bucket. ``shapes``: per shard, a matrix
    shape ``(rows, cols)`` where the shard is whole rows of a >= 2-D parameter, else ``(numel,)``
    (defaults to 1-D shapes: the low-rank codecs then quantize or send everything raw)."""
    from megatron_diloco.algorithm.compression import AdaptivePolicy, get_codec

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


class OuterSync(BoundaryProtocols):
    """Owns the outer state of one rank's shard and runs the boundary protocol.

    Args:
        view: the rank's fp32 main-parameter shards (``x``), modified in place at each boundary.
        config: DiLoCoX hyperparameters (eta, mu, nesterov, overlap, outer timeout).
        group: the outer process group (one rank per replica, same shard). Every boundary, drain
            and checkpoint call is collective over it: all its ranks must call them in the same order.
        gloo_group: the gloo mirror of ``group``: the low-rank / adaptive worker thread's (GPU), and
            ``none``'s all-reduce with ``--diloco-x-outer-state host`` (on host memory, so that the
            device keeps no fp32 buffer for it).
        decision_group: the group that agrees on skipping a round (a NaN/Inf pseudo-gradient
            anywhere) and compares theta across replicas: it must span **every rank of the model**
            (all replicas, stages and shards), so that no stage applies a round that another skips;
            every boundary is collective over it. A tuple: reduced over in order (the replica's
            world, then the outer group), the first varying fastest in the ranks' numbering.
            None: the default (world) group when ``torch.distributed`` is initialized, else local.
            :func:`megatron_diloco.megatron_adapter.topology.decision_group_of_world` makes a gloo one.
        segments: the bounds of the exchange slots this rank holds in ``view``'s order (``[k + 1]``, separate
            jobs of different data-parallel size, :mod:`~megatron_diloco.algorithm.slot_exchange`); None: one.
            With k > 1 slot j is exchanged over its own outer group (:meth:`regroup`'s ``slot_groups``).

    Every wait on these groups is bounded by :meth:`timeout_s` (``--diloco-x-outer-timeout-minutes``,
    or derived): past it :class:`~megatron_diloco.algorithm.bounds.OuterGroupError` names the round and the group. The groups' own
    timeouts are set to :func:`~megatron_diloco.algorithm.bounds.backstop_timeout_s` of it.
    """

    def __init__(self, view: ShardView, config: DiLoCoXConfig, group: dist.ProcessGroup | None,
                 shapes: list[tuple[int, ...]] | None = None,
                 gloo_group: dist.ProcessGroup | None = None,
                 decision_group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None,
                 link_sharers: int = 1, segments: tuple[int, ...] | None = None) -> None:
        self.view = view
        #: the exchange slots of this rank's shard (one: the shard whole)
        self.segments = Segments(tuple(segments)) if segments is not None else Segments.whole(view.numel)
        if self.segments.numel != view.numel:
            raise ValueError(f"exchange slots cover {self.segments.numel} elements, the shard {view.numel}")
        check_slot_codec(config.compression, self.segments.k)
        #: each slot's outer group, in slot order (one slot: ``group``)
        self.slot_groups: tuple[dist.ProcessGroup | None, ...] = (group,)
        #: S: the ranks of this replica whose exchanges cross the site's slow link at once (those
        #: holding a shard); a rank's share of ``--diloco-x-bandwidth-mbps`` is 1 / S of it
        self.link_sharers = max(1, int(link_sharers))
        self.config = config
        #: the round schedule (boundaries, round lengths, tau's cap, the warm-up codec's rounds)
        self.schedule = RoundSchedule(config)
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
        self.exchange_group = gloo_group if config.exchanges_on_host_mirror and gloo_group is not None else group
        #: where the outer state lives (--diloco-x-outer-state): on the device, or in host memory
        #: streamed through the device chunk by chunk at each boundary (megatron_diloco.algorithm.outer_store)
        self.store = OuterStore(view.numel, view.device, on_host=config.outer_state == "host",
                                chunk=chunk_elements(config.outer_chunk_mb), segments=self.segments.bounds)
        store = self.store
        theta = store.empty()  # (N,) fp32, device or host
        self.x_into(theta)
        self.outer = OuterNesterov(theta, config.outer_lr, config.outer_momentum, config.nesterov,
                                   momentum_buffer=store.zeros() if config.outer_momentum > 0 else None)
        # exchange_buffer: the pseudo-gradient in the exchange, one buffer for both directions: this replica's
        # delta_r goes out, the replicas' mean Delta comes back in place (N,) fp32. ``none``: the
        # all-reduce buffer itself, on the device where the collective needs it there (an NCCL
        # exchange group); with the host layout the all-reduce runs on the host (a gloo group: the
        # outer group of replicas in separate worlds, or the mirror; or no collective, one replica),
        # so it is held with the outer state (no device payload; over gloo the same PCIe bytes as a
        # host copy of a device buffer). The codecs that send an encoded payload keep it with the
        # outer state (it holds a mean only when one is waited for: checkpoints, restarts)
        # (held only matters with the host layout: store.empty allocates on the device otherwise)
        self.exchange_buffer = store.empty(held=spec.lossy or _reduces_on_host(self.exchange_group))
        #: ``none`` with exchange_buffer held on the host: the launch writes this replica's delta_r there and
        #: the all-reduce (gloo) runs on it in place
        self._host_all_reduce = not spec.lossy and store.held(self.exchange_buffer)
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
        #: tau (partial): inner steps after the last boundary at which the pending exchange is applied
        #: (agreed at each boundary, :meth:`_choose_overlap_steps`)
        self.tau = config.local_steps if config.overlap_steps is None else config.overlap_steps
        #: whether x is theta on every replica since the last boundary (not while partial/eager keep own progress)
        self.params_shared = True
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
        #: mean inner-step time of the last round (:meth:`before_boundary`; None until known)
        self.step_time_s: float | None = None
        #: inner steps of the round the next boundary starts (:meth:`before_boundary`; H but during a warm-up)
        self.next_round_steps: int = config.local_steps
        #: inner steps done at the boundary about to run (:meth:`before_boundary`; None: not given, or the
        #: last, shorter round of a run): where an auto H agreed there starts its rounds
        self.boundary_steps: int | None = None
        #: the longest completed exchange so far, launch to completion (s); enters the derived timeout
        self.longest_exchange_s = 0.0
        #: the bound T on the waits across replicas, the groups' backstop timeouts, the errors past T
        self.bounds = OuterBounds(config, group, self.exchange_group, self.decision_groups,
                                  worker=self._executor is not None)
        self.bounds.arm(self.timeout_s())
        #: the boundary's one decision all-reduce (skip, tau, theta's agreement across replicas)
        self.decision = BoundaryDecision(group, self.decision_groups, view.device, self.bounds)
        #: how each round is agreed, landed, saved and finished (:mod:`~megatron_diloco.algorithm.rounds`):
        #: replicas of one world, or separate jobs (a FederatedRounds, installed here by the caller)
        self.round_rules: RoundRules = OneWorldRounds(self)

    def regroup(self, group: dist.ProcessGroup | None, decision_groups: tuple[dist.ProcessGroup, ...],
                slot_groups: tuple[dist.ProcessGroup | None, ...] | None = None) -> None:
        """Separate jobs, new members: exchanges, decision and bounds use these groups from now on.
        ``slot_groups``: each exchange slot's outer group (k > 1 slots; ``group`` is the first), else None."""
        slot_groups = tuple(slot_groups) if slot_groups is not None else (group,) * self.segments.k
        if len(slot_groups) != self.segments.k:
            raise ValueError(f"{len(slot_groups)} outer groups for {self.segments.k} exchange slots")
        self.group = self.exchange_group = group
        self.slot_groups = slot_groups
        self.decision_groups = decision_groups
        self.bounds.regroup(group, group, decision_groups, slot_groups)
        self.bounds.arm(self.timeout_s())
        self.decision.regroup(group, decision_groups, slot_groups)

    def outbox(self, codec, send: torch.Tensor | None = None) -> Outbox | SlotOutbox:
        """The round's :class:`Outbox` for ``codec`` (``send``: ``none``'s all-reduce buffer, see there); a
        :class:`SlotOutbox` when this rank holds several exchange slots."""
        if self.segments.k > 1:
            return SlotOutbox(codec, self.segments, self.view.device, send=send)
        return Outbox(codec, self.view.numel, self.view.device, send=send)

    @property
    def link_mbps(self) -> float | None:
        """The site's slow link in Mbit/s as this rank sizes its exchanges by it (the meaning of
        ``--diloco-x-bandwidth-mbps``): its share x S; None while unknown."""
        return None if self.link_bytes_per_s is None else self.link_bytes_per_s * 8 / 1e6 * self.link_sharers

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
        """:func:`megatron_diloco.algorithm.shard_view.fingerprint` of flat vectors of the store (theta, m),
        computed on the device chunk by chunk (host-held ones are streamed through it): the same
        value, int64 ``[2]`` on the device; ``[k, 2]`` with k exchange slots (:meth:`Segments.fingerprint`).
        Local."""
        return self.segments.fingerprint(self.store, tensors, self.view.device)

    def timeout_s(self) -> float:
        """The bound (s) on the next outer operation: ``--diloco-x-outer-timeout-minutes``, or derived from the
        round's steps (H, or a paced job's longer round) x the step time and the longest exchange
        (:meth:`DiLoCoXConfig.outer_timeout_s`)."""
        return self.config.outer_timeout_s(self.step_time_s, self.longest_exchange_s, self.next_round_steps)

    def _start(self, outbox: Outbox | None, input_sq: list[torch.Tensor],
               residual_sq: list[torch.Tensor], weights: tuple[float, ...] | None = None) -> ExchangeHandle:
        """Launch the exchange of the round whose payload ``outbox`` holds (None: a matrix codec, whose
        worker encodes), bounded by :meth:`timeout_s` from now; the squared norms of the codec's input
        and of the residual it left, as chunk parts; ``weights``: the members' (the decision's; None: equal)."""
        codec = outbox.codec if outbox is not None else self.codec
        if isinstance(outbox, SlotOutbox):
            handle = outbox.launch(self.exchange_buffer, self.slot_groups, store=self.store,
                                   timeout_s=self.timeout_s(), weights=weights)
        else:
            handle = start_exchange(self.exchange_buffer, self.residual, codec, self.exchange_group,
                                    worker=self._executor, timeout_s=self.timeout_s(), outbox=outbox, store=self.store,
                                    weights=weights)
        handle.stats.input_sq = _sum(input_sq)
        if outbox is not None:  # (the matrix codecs' worker measures the residual it leaves itself)
            handle.stats.residual_sq = _sum(residual_sq)
        handle.round = self.rounds
        return handle

    def before_boundary(self, step_time_s: float | None, next_round_steps: int | None = None,
                        steps: int | None = None) -> None:
        """What the boundary about to run needs from the caller, and what it may run for it first: the
        inner-step time measured by the caller (None: not measured this round, e.g. a resume just before a
        boundary; the last one, or the checkpoint's, is kept), and the inner steps done (``steps``: where an
        auto H agreed at the boundary starts its rounds; None: the last, shorter round of a run), which give
        the inner steps of the round that boundary starts (:meth:`RoundSchedule.round_steps`: H0 during a
        warm-up, else H; ``next_round_steps`` overrides it, H without either): sets the adaptive codec's byte
        budget to link bandwidth x those steps x step time (no-op unless adaptive); auto tau hides the
        exchange within them.

        Also the step time of the derived outer timeout (:meth:`timeout_s`), for every codec.

        May communicate: without ``--diloco-x-bandwidth-mbps`` (adaptive only) the first call measures the link
        (:func:`megatron_diloco.algorithm.link.measure_link_bandwidth`: collective over the outer group,
        run at the first boundary with no exchange in flight: the first of a run, or the first after
        a resume, whose pending exchange was completed before the checkpoint). The measured value is
        checkpointed (:meth:`state_dict`), so a resumed run keeps the same budget."""
        if step_time_s is not None:
            self.step_time_s = step_time_s
        self.next_round_steps = next_round_steps or (
            self.schedule.round_steps(steps) if steps is not None else self.config.local_steps)
        self.boundary_steps = steps
        policy = getattr(self.codec, "policy", None)
        if policy is None:
            return
        if self.link_bytes_per_s is None and not self._link_measured:
            if self.pending is not None and not self.pending.finished:
                return  # the worker thread owns the group (and the link); measure next time
            self._link_measured = True
            if self.view.numel == 0:  # an empty shard sends nothing (nor does its outer group: same
                return                # shard position); measuring with the S ranks that send only
            bound = self.timeout_s()
            self.bounds.arm(bound)
            started = time.perf_counter()
            try:
                self.link_bytes_per_s = measure_link_bandwidth(self.group, self.view.device,
                                                               timeout_s=bound)
            except (RuntimeError, TimeoutError) as err:
                raise self.bounds.failure(self.rounds + 1, "the link measurement", self.group, bound,
                                          time.perf_counter() - started, err) from err
            if self.link_bytes_per_s is not None:
                logger.info("DiLoCoX: measured outer link %.1f Mbit/s per rank (all-gather, all outer groups at "
                            "once: about %.1f Mbit/s for the site's %d sending ranks); adaptive byte budget = "
                            "the rank's share x H x step time (set --diloco-x-bandwidth-mbps to fix it)",
                            self.link_bytes_per_s * 8 / 1e6, self.link_mbps, self.link_sharers)
        if self.link_bytes_per_s is None or self.step_time_s is None:
            return
        from megatron_diloco.algorithm.compression import byte_budget

        policy.budget_bytes = byte_budget(self.link_bytes_per_s, self.next_round_steps, self.step_time_s)

    def schedule_changed(self) -> None:
        """The warm-up or the run's length changed (a resume keeping its checkpoint's, the run length known late): the
        schedule follows, and :attr:`warmup_codec` is built, kept or dropped to match ``config.warmup_compression``."""
        self.schedule.changed()
        name = self.config.warmup_compression
        if name is None:
            self.warmup_codec = None
        elif self.warmup_codec is None or self.warmup_codec.name != name:
            self.warmup_codec = _build_codec(self.config, self.view, self._shapes, name)

    def poll(self) -> None:
        """Note whether the exchange in flight has completed (its completion time: auto tau, the
        derived timeout and the round log are sized from it). Call around every inner step (before
        and after its optimizer step): non-blocking, no device sync, no collective
        (:meth:`ExchangeHandle.poll`)."""
        if self.pending is not None and not self.pending.finished:
            self.pending.poll()

    # ---------------- checkpointing ----------------
    def state_dict(self) -> dict:
        """Outer state, identical on every replica (the in-flight exchange is completed, not applied).
        The error-feedback ``residual`` and the ``eager_anchor`` differ per replica and
        are checkpointed by the owner of the per-replica state
        (:class:`megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer`).

        Completing the exchange keeps the trajectory unchanged: a resumed run applies it at the next
        boundary exactly as the uninterrupted run does.
        """
        has_pending = self.round_rules.before_save()  # separate jobs: a failed exchange is a failed round
        return {
            "rounds": self.rounds,
            "skipped_rounds": self.skipped_rounds,
            "theta": self.outer.theta,
            "momentum_buffer": self.outer.momentum_buffer,
            "pending_delta": self.exchange_buffer if has_pending else None,
            "apply_at": self.tau,  # partial: when the pending exchange is applied (the key of older checkpoints)
            # low-rank bases / adaptive plan: identical on every replica
            "codec": self.codec.state_dict() if hasattr(self.codec, "state_dict") else None,
            # the measured outer link (adaptive byte budget; MIN over the group, so identical on every
            # replica); a given --diloco-x-bandwidth-mbps is not stored: the flag of the resumed run wins
            "link_measured": self._link_measured,
            "link_bytes_per_s": self.link_bytes_per_s if self._link_measured else None,
            # what auto tau, the adaptive budget and the derived timeout are sized from (this rank's;
            # the torch_dist checkpoint keeps replica 0's here, and each replica's own in its per-replica
            # state, which a resume restores: OuterCheckpoint.replica_meta)
            **self.timings(),
        }

    @property
    def committed_residual(self) -> torch.Tensor | None:
        """The error-feedback residual a checkpoint holds (:meth:`RoundRules.committed_residual`): :attr:`residual`,
        or with separate jobs while a failed round is unresolved, the one before its launch."""
        return self.round_rules.committed_residual()

    def timings(self) -> dict:
        """This rank's own measurements that auto tau, the adaptive budget and the derived timeout are
        sized from (the step time, the last completed exchange's bytes and duration, the longest
        exchange): checkpointed per replica (``DiLoCoXOptimizer``), so that every replica resumes with
        its own, as the uninterrupted run's next boundary uses them (tau agreed by MAX over all ranks)."""
        return {"step_time_s": self.step_time_s,
                "last_exchange": None if self.last_completed is None else {
                    "bytes_sent": self.last_completed.bytes_sent, "exchange_s": self.last_completed.exchange_s},
                "longest_exchange_s": self.longest_exchange_s}

    def heal_state(self) -> dict:
        """The shared outer state a job that is behind receives from this rank (separate jobs,
        :meth:`FederatedRounds.state_dict`): theta and the outer momentum ((N,) fp32, this rank's shard;
        the momentum None without one), the codec state, and ``meta``: the round counters, tau, the
        :meth:`timings`, the measured link (None unless measured)."""
        return {"theta": self.outer.theta, "momentum_buffer": self.outer.momentum_buffer,
                "codec": self.codec.state_dict() if hasattr(self.codec, "state_dict") else None,
                "meta": {"rounds": self.rounds, "skipped_rounds": self.skipped_rounds, "tau": self.tau,
                         "timings": self.timings(),
                         "link_bytes_per_s": self.link_bytes_per_s if self._link_measured else None}}

    def load_heal_state(self, state: dict) -> None:
        """Take a peer's :meth:`heal_state` (already checked by its receiver; local): the measured link
        unless this run gives ``--diloco-x-bandwidth-mbps``."""
        self.outer.load_state_dict({"theta": state["theta"], "momentum_buffer": state["momentum_buffer"]})
        if hasattr(self.codec, "load_state_dict") and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])
        meta = state["meta"]
        self.rounds, self.skipped_rounds, self.tau = int(meta["rounds"]), int(meta["skipped_rounds"]), int(meta["tau"])
        self.load_timings(meta["timings"])
        if meta.get("link_bytes_per_s") is not None and self.config.bandwidth_mbps is None:
            self._link_measured, self.link_bytes_per_s = True, float(meta["link_bytes_per_s"])

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
        # state holds them, replace these afterwards (OuterCheckpoint._load_replica_meta)
        self.load_timings(state)
        self.outer.load_state_dict(state)
        self.tau = int(state.get("apply_at", self.tau))
        if hasattr(self.codec, "load_state_dict"):
            if state.get("codec") is None:
                raise ValueError(f"checkpoint has no state for --diloco-x-compression "
                                 f"{self.config.compression}: resume with the codec it was written with")
            self.codec.load_state_dict(state["codec"])
        self.pending = None
        if state.get("pending_delta") is not None:
            self.exchange_buffer.copy_(state["pending_delta"])
            self.pending = ExchangeHandle.completed(self.exchange_buffer, self.store)
        # x as loaded: theta for none/delayed; eager with nothing in flight holds a_r = theta; partial
        # keeps its own progress
        self.params_shared = self.config.overlap in ("none", "delayed") or (
            self.config.overlap == "eager" and self.pending is None)
