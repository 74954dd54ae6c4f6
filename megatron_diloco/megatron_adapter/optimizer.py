"""``DiLoCoXOptimizer``: the ``MegatronOptimizer`` interface around Megatron's distributed optimizer.

Each ``step()`` runs the inner (replica-local) optimizer step; every H-th call it also runs the outer
boundary on the rank's fp32 main-parameter shard (:class:`megatron_diloco.algorithm.sync.OuterSync`), writes
the result into the model parameters and re-gathers them inside the replica.

The wrapper is a composition, each part on explicit inputs: :class:`~megatron_diloco.algorithm.sync.OuterSync`
(the outer state), :class:`~megatron_diloco.megatron_adapter.shard_layout.ShardLayout` (the world's shard
table), :class:`~megatron_diloco.megatron_adapter.checkpoint.OuterCheckpoint` (the DiLoCoX entries of its
state dicts), :class:`~megatron_diloco.megatron_adapter.restart.RestartPolicy` and
:class:`~megatron_diloco.megatron_adapter.restart.LRSchedulePosition` (what a load means for the outer loop
and the LR schedule); it forwards to Megatron's optimizer the names of
:data:`~megatron_diloco.megatron_adapter.forwarding.FORWARDED` and nothing else.

Process groups: the outer group (one rank per replica, same shard) carries the pseudo-gradient
exchange and, once, at the first boundary, the start-weights fingerprint; the decision group (gloo,
the whole world) carries the skip decision per boundary (with tau and theta's fingerprints); ``replica_groups``
(intra-replica groups: intra-DP and model-parallel) carry the pseudo-gradient norm for logging and
the param gathers. Nothing else crosses replicas between boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.exchange import ExchangeStats
from megatron_diloco.algorithm.link import host_copy
from megatron_diloco.algorithm.shard_view import ShardView, fingerprint
from megatron_diloco.algorithm.protocols import RoundReport
from megatron_diloco.algorithm.sync import OuterSync
from megatron_diloco.megatron_adapter.by_name import ByName, model_chunks
from megatron_diloco.megatron_adapter.checkpoint import Counters, OuterCheckpoint
from megatron_diloco.megatron_adapter.exchange_slots import exchange_plan, main_ranges
from megatron_diloco.megatron_adapter.forwarding import FORWARDED, forward_to_inner, not_forwarded
from megatron_diloco.megatron_adapter.restart import LRSchedulePosition, RestartPolicy
from megatron_diloco.megatron_adapter.shard_layout import ShardLayout
from megatron_diloco.megatron_adapter.topology import Topology

logger = logging.getLogger(__name__)


def distributed_optimizers(optimizer: MegatronOptimizer) -> list[DistributedOptimizer]:
    """The ``DistributedOptimizer`` instances inside ``optimizer`` (chained or not), in order."""
    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for part in parts:
        if not isinstance(part, DistributedOptimizer):
            raise TypeError(
                f"--diloco-x needs Megatron's distributed optimizer, got {type(part).__name__}; "
                "run with --use-distributed-optimizer (install() sets it)"
            )
    return list(parts)


def _shard_shapes(dist_opts: list[DistributedOptimizer]) -> list[tuple[int, ...]]:
    """Per main shard (same order as :func:`_main_params`): ``(rows, cols)`` when the shard is whole
    rows of a >= 2-D parameter (viewed as first dim x rest), else ``(numel,)``. Low-rank codecs
    compress only the former."""
    shapes = []
    for d in dist_opts:
        for g, group in enumerate(d.optimizer.param_groups):
            # DistributedOptimizer lists a group's fp32-param shards, then its fp16/bf16 ones.
            model_params = [*d.model_fp32_groups[g], *d.model_float16_groups[g]]
            assert len(model_params) == len(group["params"])
            for model_param, shard in zip(model_params, group["params"]):
                span = d._get_model_param_range_map(model_param)["param"]
                cols = math.prod(model_param.shape[1:]) if model_param.dim() >= 2 else 0
                whole_rows = cols > 0 and span.start % cols == 0 and span.size % cols == 0 and span.size > 0
                shapes.append((span.size // cols, cols) if whole_rows else (shard.numel(),))
    return shapes


def _main_params(dist_opts: list[DistributedOptimizer]) -> list[torch.Tensor]:
    """The fp32 main-parameter shards the inner optimizers update, in a replica-independent order."""
    return [p for d in dist_opts for g in d.optimizer.param_groups for p in g["params"]]


@forward_to_inner
class DiLoCoXOptimizer(MegatronOptimizer):
    """DiLoCoX around a Megatron (chained) distributed optimizer.

    Args:
        inner: the optimizer ``get_megatron_optimizer`` built (its DistributedOptimizer parts shard
            the replica's parameters over the intra-replica DP group).
        config: DiLoCoX hyperparameters.
        topology: replica index and the process groups (outer, intra-replica).
        on_round: optional callback receiving each boundary's :meth:`round_metrics` dict
            (called on every rank; used for logging).

    Composed of: ``sync`` (:class:`OuterSync`, the outer state and the boundary protocols),
    ``layout`` (:class:`ShardLayout`, the world's shard table), ``checkpoint`` (:class:`OuterCheckpoint`,
    the DiLoCoX entries of its state dicts), ``restarts`` (:class:`RestartPolicy`, what a load means
    for the outer loop) and ``lr_position`` (:class:`LRSchedulePosition`, the replica's own LR-schedule
    position). Of ``MegatronOptimizer``'s interface it implements ``step``, ``state_dict``,
    ``load_state_dict`` and ``sharded_state_dict``, and forwards to ``inner`` exactly the names of
    :data:`~megatron_diloco.megatron_adapter.forwarding.FORWARDED`; any other name raises
    ``AttributeError``. Boundaries are counted in ``step()`` calls (a skipped fp16 step still counts),
    so all replicas agree on them.
    """

    def __init__(self, inner: MegatronOptimizer, config: DiLoCoXConfig, topology: Topology,
                 on_round: Callable[[dict], None] | None = None) -> None:
        # Deliberately no super().__init__: all optimizer state lives in ``inner``.
        self.inner = inner
        self.diloco_config = config
        self.topology = topology
        self.on_round = on_round
        self.dist_opts = distributed_optimizers(inner)
        self.view = ShardView(_main_params(self.dist_opts))
        # the world's shard table: one all-gather over the world here (link sharers), kept for checkpoints
        self.layout = ShardLayout(topology.replica_index, topology.rank_in_replica, self.view.numel,
                                  self.view.device)
        #: sites of different parallel layout: the parameters by name in chunks, staged (None: the shards themselves)
        self.by_name = ByName(model_chunks(self.dist_opts), main_ranges(self.dist_opts), self.view.shards,
                              topology.exchange_chunks) if topology.exchange_chunks else None
        if self.by_name is not None:
            self.by_name.pull()  # (the outer state starts from x)
        #: sites of different data-parallel size: the outer state slot by slot (None: the shards as they are)
        self.slots = self.by_name.plan() if self.by_name is not None else exchange_plan(
            self.dist_opts, self.view.shards, topology.exchange_slots) if topology.exchange_slots else None
        self.sync = OuterSync(ShardView(self.slots.views) if self.slots else self.view, config, topology.outer_group,
                              None if self.slots else _shard_shapes(self.dist_opts),
                              gloo_group=topology.outer_gloo_group, decision_group=topology.decision_group,
                              link_sharers=self.layout.link_sharers(), segments=self.slots and self.slots.bounds)
        self.checkpoint = OuterCheckpoint(self.sync, self.view, self.dist_opts, topology, self.layout, ShardLayout(
            topology.replica_index, topology.rank_in_replica, self.sync.view.numel, self.view.device) if (
            self.by_name is not None) else None)
        self.restarts = RestartPolicy(self.sync, config)
        self.lr_position = LRSchedulePosition()
        # the round's inner-step time: the sum of its iterations' spans, each from the start of the
        # iteration (mark_iteration_start: Megatron's train_step; else the end of the previous step())
        # to the end of the inner step; evaluations, saves and the outer work between are not in it
        self._iteration_started: float | None = None
        self._last_step_ended: float | None = None
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self.step_calls = 0
        #: Megatron's iteration when ``step_calls`` was 0 (separate jobs: the position a joiner takes)
        self.iteration_offset = 0
        self.totals = ExchangeStats()
        self.last_report: RoundReport | None = None
        #: partial: the exchange that landed tau steps after its launch, until the round's boundary
        #: reports it (its bytes and times; accounted when it landed)
        self._landed: ExchangeStats | None = None
        self._start_checked = False  # whether the replicas' start weights were compared
        self._params_gathered = True  # model params hold the main shards everywhere (not deferred)
        #: separate jobs (``--diloco-x-lighthouse``): this rank's round rules with the run's other jobs
        #: (a :class:`~megatron_diloco.algorithm.federated.FederatedRounds`, installed as
        #: ``sync.round_rules`` by the integration before training), else None
        self.federation = None

    # ------------------------------------------------------------------ interface
    def __getattr__(self, name: str) -> NoReturn:
        """Reached only for a name neither this class nor :data:`FORWARDED` provides (or when reading a
        forwarded one from ``inner`` failed): forwards nothing, raises naming the list."""
        if name in FORWARDED and "inner" in vars(self):
            raise AttributeError(f"Megatron's optimizer ({type(self.inner).__name__}, this "
                                 f"{type(self).__name__}'s .inner) has no attribute {name!r}")
        raise not_forwarded(self, name)

    # ------------------------------------------------------------------ checkpoints
    def _counters(self) -> Counters:
        return Counters(self.step_calls, self.totals, self.lr_position.steps)

    def state_dict(self, *args, **kwargs) -> dict:
        """``inner``'s state dict, and (not loading) the DiLoCoX state beside it
        (:meth:`OuterCheckpoint.state_dict`: ``{"inner", "diloco_x", "diloco_x_replica"}``)."""
        sd = self.inner.state_dict(*args, **kwargs)
        if kwargs.get("is_loading"):
            return sd
        return self.checkpoint.state_dict(sd, self._counters())

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """Megatron's inner sharded state plus the DiLoCoX entries under ``"diloco_x"``
        (:meth:`OuterCheckpoint.sharded_state_dict`; loading requests only what the checkpoint holds)."""
        sd = self.inner.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        return self.checkpoint.sharded_state_dict(sd, model_sharded_state_dict, is_loading, self._counters())

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` or from the loaded :meth:`sharded_state_dict`
        (:meth:`OuterCheckpoint.load_state_dict`: Megatron's inner load, then this replica's own state
        over it), take the checkpoint's counters and round schedule (:meth:`RestartPolicy.keep_schedule`)
        and LR-schedule position, then publish the main params into the model params. A checkpoint
        without DiLoCoX state is noted: :meth:`after_checkpoint_load` then restarts the outer loop
        from the loaded params."""
        restored = self.checkpoint.load_state_dict(state_dict, self.inner)
        if restored.counters is None:
            self.restarts.loaded(restored.without_diloco_state)
            return
        self.step_calls, self.totals = restored.counters.step_calls, restored.counters.totals
        self.restarts.keep_schedule(restored.schedule, self.step_calls)
        # applied right after Megatron restored replica 0's schedule (attach_lr_scheduler)
        self.lr_position.restore_after_scheduler_load(restored.counters.lr_schedule_steps)
        self._publish_params(gather_now=True)  # forward hooks may be off (first step after a load)
        self.restarts.loaded(None)

    def attach_lr_scheduler(self, scheduler) -> None:
        """Checkpoint this replica's own position in the LR schedule (``scheduler``: Megatron's
        ``OptimizerParamScheduler`` built for this optimizer; idempotent; :class:`LRSchedulePosition`).
        Needs to be called before the checkpoint is loaded (``megatron_diloco.install`` wires it where
        Megatron builds the scheduler)."""
        self.lr_position.attach(scheduler)

    def after_checkpoint_load(self, weights_loaded: bool) -> None:
        """The one place the outer loop restarts after a load (call it when Megatron's
        ``load_checkpoint`` has returned, on every rank): :meth:`restart_outer_loop_from_params` when
        :meth:`RestartPolicy.after_checkpoint_load` gives a reason (weights restored without DiLoCoX
        state). ``weights_loaded`` (Megatron's tracker file exists in ``--load`` or
        ``--pretrained-checkpoint``) must be the same on every rank."""
        reason = self.restarts.after_checkpoint_load(weights_loaded)
        if reason is not None:
            self.restart_outer_loop_from_params(reason)

    def restart_outer_loop_from_params(self, reason: str) -> None:
        """Start a new outer loop from the current fp32 main params: the outer state as
        :meth:`RestartPolicy.restart_sync` (theta <- x, momentum 0, residual 0, eager anchor = theta,
        nothing in flight, round counters 0; an exchange in flight is waited for and dropped, so
        collective over the outer group: call it on every rank), and this optimizer's round state: step
        counter 0 (the first boundary comes H ``step()`` calls from now), ``totals``, a landed exchange
        not yet reported, the round's timing; the start weights are checked again at the first
        boundary. Model params are left as they are (they hold x already). Logs one line with
        ``reason`` (global rank 0)."""
        with self._x_staged():
            self.restarts.restart_sync()
        self.step_calls = 0
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self._landed = None  # an exchange of the old loop that landed: not this loop's first round's
        self.totals = ExchangeStats()  # bytes and times of this loop's rounds, as ``rounds`` counts them
        self.last_report = None
        self._start_checked = False  # the new theta: the replicas' start weights are compared again
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[DiLoCoX] outer loop restarted from the current params ({reason}): theta <- fp32 main "
                  "params, outer momentum 0, residual 0, nothing in flight, round 0", flush=True)

    # ------------------------------------------------------------------ the step
    def step(self):
        """Inner step; on every H-th call also the outer boundary. Returns the inner step's
        ``(update_successful, grad_norm, num_zeros_in_grad)``.

        Between boundaries this adds to the inner step a counter, one comparison (``partial``: the
        step the pending exchange lands on) and, while an exchange is in flight, two non-blocking
        queries of its completion (:meth:`OuterSync.poll`): no device work, no host sync, no collective.

        On a step that ends with outer work (a boundary, ``partial``'s landing), the inner step's own
        parameter all-gather is deferred (Megatron's ``_defer_param_sync``): the outer work changes
        the main params, and :meth:`_publish_params` gathers them once."""
        started = self._iteration_started if self._iteration_started is not None else self._last_step_ended
        self._iteration_started = None
        since_boundary = self.sync.schedule.steps_since_boundary(self.step_calls + 1)
        self.sync.poll()  # the exchange in flight: completed during this step's forward and backward?
        land = self.sync.merge_due(since_boundary)  # partial: the exchange lands tau steps after its launch
        outer_work = land or since_boundary == 0
        if outer_work:
            self._defer_inner_param_gather(True)
        try:
            result = self.inner.step()  # Megatron's step runs under its own no_grad
        finally:
            if outer_work:
                self._defer_inner_param_gather(False)
        if started is not None:  # this iteration's inner time (the outer work below is not in it)
            self._round_step_s += time.perf_counter() - started
            self._round_timed_steps += 1
        self.step_calls += 1
        if self.federation is not None:  # the job's tokens: its weight in the round's mean
            self.federation.count_step()
        self.sync.poll()  # ... or during the inner optimizer step (its time; non-blocking)
        if land:
            self._merge()
        elif since_boundary == 0:
            self._boundary()
        self._last_step_ended = time.perf_counter()
        return result

    def position(self) -> dict:
        """Separate jobs: this job's inner steps done and Megatron's iteration (what a joiner takes)."""
        return {"steps": self.step_calls, "iteration": self.step_calls + self.iteration_offset}

    def set_position(self, position: dict) -> None:
        """Take the run's :meth:`position` (a job joining at a boundary), and the round it starts."""
        self.step_calls = int(position["steps"])
        self.iteration_offset = int(position["iteration"]) - self.step_calls
        self.sync.before_boundary(None, steps=self.step_calls)

    def join_federation(self) -> dict | None:
        """Separate jobs, before training (every rank): :meth:`FederatedRounds.join`; the position taken,
        or None. Collective over the job's world and the members' outer groups."""
        with self._x_staged():
            position = self.federation.join()
        self._start_checked = True  # the decision compares theta at every boundary
        if position is not None:
            self._publish_params()
        return position

    def mark_iteration_start(self) -> None:
        """The training iteration whose ``step()`` comes next starts now (``megatron_diloco.install``
        calls it at the start of Megatron's ``train_step``): its forward, backward and inner step
        count towards the round's mean step time; what runs between iterations (evaluation,
        checkpoint saves) does not. Without it an iteration is timed from the end of the previous
        ``step()`` (the first one of a run or after a resume is then not timed)."""
        self._iteration_started = time.perf_counter()

    @contextlib.contextmanager
    def _x_staged(self):
        """Outer work on x: with the exchange by name (:attr:`by_name`), x is pulled from the main shards into the
        staging the outer state reads before it, and pushed back after (collectives over the job's world; every
        rank does the same outer work). Nothing otherwise: the outer state reads the main shards in place."""
        if self.by_name is None:
            yield
            return
        self.by_name.pull()
        yield
        self.by_name.push()

    def _defer_inner_param_gather(self, defer: bool) -> None:
        """Whether the inner step skips its synchronous parameter all-gather (intra-replica DP group;
        without ``--overlap-param-gather``, where Megatron gathers in the next forward instead)."""
        for d in self.dist_opts:
            if not d.ddp_config.overlap_param_gather:
                d._defer_param_sync = defer

    @torch.no_grad()
    def _merge(self) -> None:
        with self._x_staged():
            stats = self.sync.merge()
        self._publish_params()
        self._account(stats)
        self._landed = stats  # reported with the round, at its boundary

    @torch.no_grad()
    def _boundary(self, final: bool = False) -> None:
        """The boundary after this step (``final``: the last, shorter round of a run that ended
        mid-round, :meth:`finish`: its exchange goes with the main codec, whatever the warm-up's)."""
        # mean inner-step time of this round (its iterations only: no evaluation, save, landing or
        # boundary work): auto tau, the adaptive byte budget, the derived timeout; and the next
        # round's length, from the step count (auto tau and the budget hide the exchange within it)
        timed, total = self._round_timed_steps, self._round_step_s
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self.sync.before_boundary(total / timed if timed > 0 else None, steps=None if final else self.step_calls)
        if not self._start_checked:
            self._check_replicas_started_alike()
        with self._x_staged():
            report = self.sync.boundary()
        self._publish_params()
        self._account(report.completed)
        # the exchange this round applied: at the boundary, or (partial, tau < H) at its landing
        if report.completed is None and self._landed is not None:
            report = dataclasses.replace(report, applied=True, completed=self._landed)
        self._landed = None
        self.last_report = report
        if self.on_round is not None:
            self.on_round(self.round_metrics(report))

    def _check_replicas_started_alike(self) -> None:
        """First boundary (after any load): ``theta``, the weights every replica started from, must be
        bit-identical across the outer group; a bitwise fingerprint (2 x int64) is all-gathered over
        it, once. Raises naming the likely cause otherwise, before anything is exchanged."""
        self._start_checked = True
        if self.sync.group is None or dist.get_world_size(self.sync.group) <= 1:
            return
        if not self._same_across_outer_group(self.sync.fingerprint([self.sync.theta])):
            raise RuntimeError(
                f"DiLoCoX: the replicas did not start from the same weights (rank {dist.get_rank()}, "
                f"outer group {dist.get_process_group_ranks(self.sync.group)}): every replica "
                "must initialize with the same --seed and load the same checkpoint (no "
                "--data-parallel-random-init, no per-cluster --load paths)")

    def _publish_params(self, gather_now: bool = False) -> None:
        """Main (fp32) shards -> model params, then re-gather them inside the replica (collectives over
        the intra-replica DP group only).

        With ``--overlap-param-gather`` Megatron gathers in the next forward's pre-hooks; an
        all-gather the inner step already dispatched (``--overlap-param-gather-with-optimizer-step``:
        the first model chunk's, right after its optimizer step) reads the param buffer written
        here, so it is finished first, and the dispatch state is reset so that the new params are
        gathered again (re-dispatched at once for that chunk, as Megatron's step does). ``gather_now``:
        gather synchronously (end of training and after a load, when the forward hooks may be off)."""
        self._params_gathered = gather_now
        for d in self.dist_opts:
            if not d.ddp_config.overlap_param_gather:
                d._copy_main_params_to_model_params()
                d.start_param_sync_for_bucket_group_subset()
                continue
            chunks = list(d.model_chunks)
            for chunk in chunks:
                for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                    if group.param_gather_handle is not None:
                        group.start_param_sync(force_sync=True)  # waits for the one in flight
            d._copy_main_params_to_model_params()
            for chunk in chunks:
                if gather_now:
                    for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                        group.start_param_sync(force_sync=True)
                else:
                    chunk.reset_param_sync_dispatch_state()
                    if getattr(chunk, "overlap_param_gather_with_optimizer_step", False):
                        chunk.start_param_sync(force_dispatch=True)

    def _account(self, completed: ExchangeStats | None) -> None:
        """Add an exchange that completed (its bytes are final then, also for adaptive codecs)."""
        if completed is None:
            return
        for field in ("bytes_sent", "bytes_received", "raw_bytes", "payload_bytes", "exchange_s", "exposed_s"):
            setattr(self.totals, field, getattr(self.totals, field) + getattr(completed, field))

    def round_metrics(self, report: RoundReport) -> dict:
        """This boundary's figures (:func:`round_metrics`)."""
        return round_metrics(self, report)

    def finish(self) -> None:
        """End of training: leave every replica with the one model they all agree on, theta.

        A run that ends mid-round (``--train-iters`` not on a boundary, or before the first one)
        first takes one more boundary over the inner steps since the last (a shorter last round:
        its pseudo-gradient is exchanged, blocking, with the main codec and its error feedback);
        then the exchange still in flight is applied and x <- theta on every replica
        (:meth:`OuterSync.drain`). So the final evaluation and Megatron's final save see the same
        model on every replica, whatever the overlap rule. Collective over the outer groups and the
        decision group."""
        if self.step_calls > 0 and not self.sync.schedule.is_boundary(self.step_calls):
            self._boundary(final=True)
        with self._x_staged():
            stats = self.sync.drain()
        # always: Megatron turned the forward pre-hooks off after its loop, so with
        # --overlap-param-gather nothing would gather the last boundary's params
        self._publish_params(gather_now=True)
        if stats is not None:
            self._account(stats)

    def params_fingerprint(self) -> torch.Tensor:
        """:func:`megatron_diloco.algorithm.shard_view.fingerprint` of this rank's fp32 main-parameter shards
        (int64 ``[2]``, on their device). Local. Over the ranks of a replica, in rank order, they
        identify the model (the shards partition its parameters for a given TP/PP/DP layout)."""
        return fingerprint(self.view.shards) if self.view.shards else torch.zeros(
            2, dtype=torch.int64, device=self.view.device)

    def replicas_identical(self) -> bool:
        """Whether this rank's shard and model params are bit-identical across the outer group.

        With ``--diloco-x-overlap eager`` or ``partial`` the replicas' params differ by design (each
        one's own look-ahead or progress) while x is not theta (:attr:`OuterSync.params_shared`); then
        the shared outer state (theta, momentum) is compared instead. After :meth:`finish` the params are compared. With
        ``--overlap-param-gather`` the model params are gathered by the next forward, not at the
        boundary: until then only the fp32 main shards are compared (the model's own shard is their
        copy; the rest is the previous round's local params by design). Exchange slots: slot by slot; by name: x chunk by
        chunk (pulled: collective over the job's world)."""
        if not self.sync.params_shared:  # theta and m, on the device (streamed when host-held)
            fp = self.sync.fingerprint(self.sync.outer.tensors())
        elif self.by_name is not None:  # x by name, chunk by chunk (the model params' layouts differ by site)
            self.by_name.pull()
            fp = torch.stack([fingerprint(self.sync.view.pieces(a, b)) for a, b in self.sync.segments.ranges()])
        else:
            params = [p for d in self.dist_opts if self._params_gathered or not d.ddp_config.overlap_param_gather
                      for chunk in d.model_chunks for p in chunk.parameters()]
            fp = torch.stack([fingerprint([*self.sync.view.pieces(a, b), *params])
                              for a, b in self.sync.segments.ranges()]) if self.slots else fingerprint(
                [*self.view.shards, *params])
        same = torch.tensor([int(self._same_across_outer_group(fp))], device=self.view.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return bool(same.item())

    def _same_across_outer_group(self, fp: torch.Tensor) -> bool:
        """Whether the fingerprint ``fp`` (int64 ``[2]``; ``[k, 2]``: one per exchange slot, each over its slot's
        group) is the same on every rank of this rank's outer group (True with one replica). Collective over it."""
        return same_across_groups(fp.view(-1, 2), self.sync.slot_groups)  # (separate jobs: the last boundary's)


def same_across_groups(fps: torch.Tensor, groups: tuple) -> bool:
    """Whether ``fps[j]`` (int64 ``[2]``) is the same on every rank of ``groups[j]`` (an all-gather over each, in
    order; a group of one or None: True). Collective over the groups."""
    same = True
    for fp, group in zip(fps, groups):
        if group is None or dist.get_world_size(group) <= 1:
            continue
        fp = host_copy(fp.contiguous(), group)
        gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, fp, group=group)
        same = same and all(torch.equal(gathered[0], g) for g in gathered)
    return same


def round_metrics(opt: DiLoCoXOptimizer, report: RoundReport) -> dict:
    """``opt``'s figures of this boundary (:data:`megatron_diloco.summary.ROUND_METRICS` names and explains
    each); the ``replica_*`` ones and the pseudo-gradient norm are reduced over the replica (two small
    all-reduces over the intra-replica groups: the fast network), the others are this rank's."""
    done = report.completed  # the exchange applied in this round (launched one round ago when delayed)
    sums = torch.tensor([report.pseudo_grad_sq, done.input_sq if done else 0.0,
                         done.residual_sq if done else 0.0, done.bytes_sent if done else 0,
                         done.bytes_received if done else 0], dtype=torch.float64, device=opt.view.device)
    maxes = torch.tensor([done.exchange_s if done else 0.0, done.exposed_s if done else 0.0],
                         dtype=torch.float64, device=opt.view.device)
    for group in opt.topology.replica_groups:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    sync = opt.sync
    tau = {"none": 0, "partial": sync.tau}.get(opt.diloco_config.overlap, sync.next_round_steps)
    return {
        "round": report.round,
        "step": opt.step_calls,
        "applied": report.applied,
        "bytes_sent": done.bytes_sent if done else 0,
        "bytes_received": done.bytes_received if done else 0,
        "replica_bytes_sent": float(sums[3]),
        "replica_bytes_received": float(sums[4]),
        "exchange_s": done.exchange_s if done else 0.0,
        "exposed_s": done.exposed_s if done else 0.0,
        "replica_exchange_s": float(maxes[0]),
        "replica_exposed_s": float(maxes[1]),
        "pseudo_grad_norm": float(sums[0].sqrt()),
        # ||not sent|| / ||encoded|| over the replica (this replica's payloads; 0 when lossless)
        "compression_error": float((sums[2] / sums[1]).sqrt()) if sums[1] > 0 else 0.0,
        "skipped": report.skipped,
        "compression_ratio": (done.raw_bytes / done.payload_bytes
                              if done and done.payload_bytes else 0.0),
        "overlap_steps": tau,
        "round_steps": sync.next_round_steps,
        "step_s": sync.step_time_s or 0.0,
        "link_mbps": sync.link_mbps or 0.0,
        "tokens": opt.federation.round_tokens if opt.federation is not None else 0,
        "weight": opt.federation.round_weight if opt.federation is not None else 1.0,
    }
