"""``DiLoCoXOptimizer``: the ``MegatronOptimizer`` interface around Megatron's distributed optimizer.

Each ``step()`` runs the inner (replica-local) optimizer step; every H-th call it also runs the outer
boundary on the rank's fp32 main-parameter shard (:class:`megatron_diloco.sync.OuterSync`), writes
the result into the model parameters and re-gathers them inside the replica.

Process groups: the outer group (one rank per replica, same shard) carries the pseudo-gradient
exchange and, once, at the first boundary, the start-weights fingerprint; the decision group (gloo,
the whole world) carries the skip decision per boundary (with tau and theta's fingerprints); ``replica_groups``
(intra-replica groups: intra-DP and model-parallel) carry the pseudo-gradient norm for logging and
the param gathers. Nothing else crosses replicas between boundaries.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer

from megatron_diloco.arguments import resolve_kept_warmup
from megatron_diloco.collectives import ExchangeStats, host_copy
from megatron_diloco.config import DiLoCoXConfig
from megatron_diloco.shard_view import ShardView, fingerprint
from megatron_diloco.sync import OuterSync, RoundReport
from megatron_diloco.topology import Topology

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


class DiLoCoXOptimizer(MegatronOptimizer):
    """DiLoCoX around a Megatron (chained) distributed optimizer.

    Args:
        inner: the optimizer ``get_megatron_optimizer`` built (its DistributedOptimizer parts shard
            the replica's parameters over the intra-replica DP group).
        config: DiLoCoX hyperparameters.
        topology: replica index and the process groups (outer, intra-replica).
        on_round: optional callback receiving each boundary's :meth:`round_metrics` dict
            (called on every rank; used for logging).

    The wrapper forwards every ``MegatronOptimizer`` method to ``inner`` except ``step``,
    ``state_dict``, ``load_state_dict``, ``sharded_state_dict`` and ``reload_model_params``. Boundaries are counted in
    ``step()`` calls (a skipped fp16 step still counts), so all replicas agree on them.
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
        self.sync = OuterSync(self.view, config, topology.outer_group, _shard_shapes(self.dist_opts),
                              host_group=topology.outer_host_group, decision_group=topology.decision_group,
                              link_sharers=self._link_sharers())
        # the round's inner-step time: the sum of its iterations' spans, each from the start of the
        # iteration (mark_iteration_start: Megatron's train_step; else the end of the previous step())
        # to the end of the inner step; evaluations, saves and the outer work between are not in it
        self._iteration_started: float | None = None
        self._last_step_ended: float | None = None
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self.step_calls = 0
        self.totals = ExchangeStats()
        self.last_report: RoundReport | None = None
        #: partial: the exchange that landed tau steps after its launch, until the round's boundary
        #: reports it (its bytes and times; accounted when it landed)
        self._landed: ExchangeStats | None = None
        self._start_checked = False  # whether the replicas' start weights were compared
        # what the last load_state_dict restored, for after_checkpoint_load: DiLoCoX state, or (the
        # restart reason) a checkpoint without it
        self._loaded_diloco_state = False
        self._loaded_without_diloco_state: str | None = None
        self._params_gathered = True  # model params hold the main shards everywhere (not deferred)

    # ------------------------------------------------------------------ interface
    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here (e.g. chained_optimizers, model_chunks).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def config(self):  # Megatron's OptimizerConfig of the inner optimizer
        return self.inner.config

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    def get_parameters(self):
        return self.inner.get_parameters()

    def prepare_model_params_for_param_sync(self) -> None:
        self.inner.prepare_model_params_for_param_sync()

    def get_grads_for_grad_norm(self, *a, **k):
        return self.inner.get_grads_for_grad_norm(*a, **k)

    def has_grad_norm_group(self, *a, **k):
        return self.inner.has_grad_norm_group(*a, **k)

    def get_grad_stats_parallel_group(self):
        return self.inner.get_grad_stats_parallel_group()

    def prepare_grads(self) -> bool:
        return self.inner.prepare_grads()

    def step_with_ready_grads(self) -> bool:
        return self.inner.step_with_ready_grads()

    def get_grad_norm(self):
        return self.inner.get_grad_norm()

    def clip_grad_norm(self, clip_grad: float) -> float:
        return self.inner.clip_grad_norm(clip_grad)

    def count_zeros(self) -> float:
        return self.inner.count_zeros()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.inner.get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.scale_loss(loss)

    def reload_model_params(self, state_dict=None) -> None:
        """Megatron calls this after loading model weights without the optimizer state
        (``--no-load-optim``, ``--finetune``, ``--pretrained-checkpoint`` with fp16/bf16): the main
        shards take the loaded weights; the outer loop restarts from them once the load is over
        (:meth:`after_checkpoint_load`)."""
        self.inner.reload_model_params(state_dict)

    def offload_to_cpu(self):
        return self.inner.offload_to_cpu()

    def restore_from_cpu(self):
        return self.inner.restore_from_cpu()

    # ------------------------------------------------------------------ the step
    def step(self):
        """Inner step; on every H-th call also the outer boundary. Returns the inner step's
        ``(update_successful, grad_norm, num_zeros_in_grad)``.

        Between boundaries this adds to the inner step a counter, one comparison (``partial``: the
        step the pending exchange lands on) and, while an exchange is in flight, one non-blocking
        query of its completion (:meth:`OuterSync.poll`): no device work, no host sync, no collective.

        On a step that ends with outer work (a boundary, ``partial``'s landing), the inner step's own
        parameter all-gather is deferred (Megatron's ``_defer_param_sync``): the outer work changes
        the main params, and :meth:`_publish_params` gathers them once."""
        started = self._iteration_started if self._iteration_started is not None else self._last_step_ended
        self._iteration_started = None
        since_boundary = self.diloco_config.steps_since_boundary(self.step_calls + 1)
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
        self.sync.poll()  # the exchange in flight: completed yet? (its time; non-blocking)
        if land:
            self._merge()
        elif since_boundary == 0:
            self._boundary()
        self._last_step_ended = time.perf_counter()
        return result

    def mark_iteration_start(self) -> None:
        """The training iteration whose ``step()`` comes next starts now (``megatron_diloco.install``
        calls it at the start of Megatron's ``train_step``): its forward, backward and inner step
        count towards the round's mean step time; what runs between iterations (evaluation,
        checkpoint saves) does not. Without it an iteration is timed from the end of the previous
        ``step()`` (the first one of a run or after a resume is then not timed)."""
        self._iteration_started = time.perf_counter()

    def _defer_inner_param_gather(self, defer: bool) -> None:
        """Whether the inner step skips its synchronous parameter all-gather (intra-replica DP group;
        without ``--overlap-param-gather``, where Megatron gathers in the next forward instead)."""
        for d in self.dist_opts:
            if not d.ddp_config.overlap_param_gather:
                d._defer_param_sync = defer

    @torch.no_grad()
    def _merge(self) -> None:
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
        # round's length (auto tau and the budget hide the exchange within it)
        cfg = self.diloco_config
        timed, total = self._round_timed_steps, self._round_step_s
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self.sync.set_step_time(total / timed if timed > 0 else None,
                                next_round_steps=cfg.local_steps if final else cfg.round_steps(self.step_calls))
        if not self._start_checked:
            self._check_replicas_started_alike()
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
        if self.topology.replicas <= 1:
            return
        fp = host_copy(self.sync.fingerprint([self.sync.theta]), self.topology.outer_group)
        gathered = [torch.empty_like(fp) for _ in range(self.topology.replicas)]
        dist.all_gather(gathered, fp, group=self.topology.outer_group)
        if not all(torch.equal(gathered[0], g) for g in gathered):
            raise RuntimeError(
                f"DiLoCoX: the replicas did not start from the same weights (rank {dist.get_rank()}, "
                f"outer group {dist.get_process_group_ranks(self.topology.outer_group)}): every replica "
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
        """This boundary's figures; the pseudo-gradient norm is reduced over the replica only."""
        done = report.completed  # the exchange applied here (launched one round ago when delayed)
        sq = torch.tensor([report.pseudo_grad_sq, done.input_sq if done else 0.0,
                           done.residual_sq if done else 0.0], dtype=torch.float64, device=self.view.device)
        for group in self.topology.replica_groups:
            dist.all_reduce(sq, group=group)
        return {
            "round": report.round,
            "step": self.step_calls,
            "applied": report.applied,
            "bytes_sent": done.bytes_sent if done else 0,
            "bytes_received": done.bytes_received if done else 0,
            "exchange_s": done.exchange_s if done else 0.0,
            "exposed_s": done.exposed_s if done else 0.0,
            "pseudo_grad_norm": float(sq[0].sqrt()),
            # ||not sent|| / ||encoded|| over the replica (this replica's payloads; 0 when lossless)
            "compression_error": float((sq[2] / sq[1]).sqrt()) if sq[1] > 0 else 0.0,
            "skipped": report.skipped,
            "compression_ratio": (done.raw_bytes / done.payload_bytes
                                  if done and done.payload_bytes else 0.0),
        }

    def finish(self) -> None:
        """End of training: leave every replica with the one model they all agree on, theta.

        A run that ends mid-round (``--train-iters`` not on a boundary, or before the first one)
        first takes one more boundary over the inner steps since the last (a shorter last round:
        its pseudo-gradient is exchanged, blocking, with the main codec and its error feedback);
        then the exchange still in flight is applied and x <- theta on every replica
        (:meth:`OuterSync.drain`). So the final evaluation and Megatron's final save see the same
        model on every replica, whatever the overlap rule. Collective over the outer groups and the
        decision group."""
        if self.step_calls > 0 and self.diloco_config.steps_since_boundary(self.step_calls) != 0:
            self._boundary(final=True)
        stats = self.sync.drain()
        # always: Megatron turned the forward pre-hooks off after its loop, so with
        # --overlap-param-gather nothing would gather the last boundary's params
        self._publish_params(gather_now=True)
        if stats is not None:
            self._account(stats)

    def params_fingerprint(self) -> torch.Tensor:
        """:func:`megatron_diloco.shard_view.fingerprint` of this rank's fp32 main-parameter shards
        (int64 ``[2]``, on their device). Local. Over the ranks of a replica, in rank order, they
        identify the model (the shards partition its parameters for a given TP/PP/DP layout)."""
        return fingerprint(self.view.shards) if self.view.shards else torch.zeros(
            2, dtype=torch.int64, device=self.view.device)

    def replicas_identical(self) -> bool:
        """Whether this rank's shard and model params are bit-identical across the outer group.

        With ``--diloco-x-overlap eager`` or ``partial`` the replicas' params differ by design (each
        one's own look-ahead or progress) while x is not theta (:attr:`OuterSync.x_is_theta`); then
        the shared outer state (theta, momentum) is compared instead. After :meth:`finish` the params are compared. With
        ``--overlap-param-gather`` the model params are gathered by the next forward, not at the
        boundary: until then only the fp32 main shards are compared (the model's own shard is their
        copy; the rest is the previous round's local params by design)."""
        if not self.sync.x_is_theta:  # theta and m, on the device (streamed when host-held)
            fp = self.sync.fingerprint(self.sync.outer.tensors())
        else:
            tensors = list(self.view.shards)
            for d in self.dist_opts:
                if self._params_gathered or not d.ddp_config.overlap_param_gather:
                    tensors += [p for chunk in d.model_chunks for p in chunk.parameters()]
            fp = fingerprint(tensors)
        fp = host_copy(fp, self.topology.outer_group)
        gathered = [torch.empty_like(fp) for _ in range(self.topology.replicas)]
        if self.topology.replicas > 1:
            dist.all_gather(gathered, fp, group=self.topology.outer_group)
        else:
            gathered = [fp]
        same = torch.tensor([int(all(torch.equal(gathered[0], g) for g in gathered))],
                            device=self.view.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return bool(same.item())

    # ------------------------------------------------------------------ checkpointing
    # Layout of the DiLoCoX entries in a torch_dist checkpoint (CHECKPOINT_FORMAT 2; T = the length of
    # a replica's flat shard vectors, i.e. the sum over the replica's ranks, ordered by rank_in_replica,
    # of their fp32 main-shard numel; every tensor references the live buffer, nothing is cloned):
    #
    #   diloco_x.outer.<name>     ShardedTensor (T,) fp32 per flat outer tensor of OuterSync.state_dict()
    #                             (theta, momentum_buffer, pending_delta when an exchange was in flight):
    #                             identical on every replica, written once (replica_id = replica index).
    #   diloco_x.replica.<kind>   ShardedTensor (R, T), row r written by replica r: kind 'param' (fp32 main
    #                             shards), 'opt.<key>' (optimizer state of a shard's shape: opt.exp_avg,
    #                             opt.exp_avg_sq with Adam), 'residual' (lossy codec), 'anchor' (eager),
    #                             'launch' (partial with the exact merge: the launch point x_L).
    #   diloco_x.outer.meta       ShardedObject per rank position: OuterSync's non-tensor state (rounds,
    #                             codec plan / low-rank bases, measured link, auto tau's measurements),
    #                             step_calls, totals.
    #   diloco_x.replica<r>.meta  ShardedObject per rank position of replica r: per-shard 0-dim optimizer
    #                             state (torch Adam's step), inner param groups (all but 'params'), grad
    #                             scaler state.
    #
    # Megatron's own model and optimizer entries are written by replica 0 only (see
    # _megatron_entries_from_replica_zero), so a plain Megatron run loading the checkpoint resumes from
    # replica 0's state.

    def _shards(self) -> Iterator[tuple[DistributedOptimizer, torch.Tensor]]:
        """(owning DistributedOptimizer, fp32 main shard) in the order of :func:`_main_params`."""
        for d in self.dist_opts:
            for g in d.optimizer.param_groups:
                for p in g["params"]:
                    yield d, p

    def _replica_tensors(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """This replica's own shard-sized tensors by kind, each as ``(offset, tensor)``: ``offset`` is
        the tensor's start in the rank's flat shard vector (the order of ``theta``).

        Kinds: ``param`` (fp32 main shards), ``opt.<key>`` (every optimizer state tensor of a shard's
        shape, e.g. ``opt.exp_avg`` / ``opt.exp_avg_sq`` (fp32) with Adam), ``residual`` (error feedback)
        ``anchor`` (eager: the replica's anchor a_r) and ``launch`` (partial with the exact merge: x_L),
        flat ``(N,)`` fp32 at offset 0, when present. No copies.
        """
        kinds: dict[str, list[tuple[int, torch.Tensor]]] = {"param": []}
        offset, count = 0, 0
        for d, p in self._shards():
            kinds["param"].append((offset, p))
            for k, v in sorted(d.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    kinds.setdefault(f"opt.{k}", []).append((offset, v))
            offset += p.numel()
            count += 1
        uneven = [k for k, entries in kinds.items() if len(entries) != count]
        if uneven:
            raise RuntimeError(f"optimizer state {uneven} exists for some main shards only; cannot checkpoint "
                               "it per replica (is the inner optimizer initialized?)")
        if self.sync.residual is not None:
            kinds["residual"] = [(0, self.sync.residual)]
        if self.sync.eager_anchor is not None:
            kinds["anchor"] = [(0, self.sync.eager_anchor)]
        if self.sync.launch_point is not None:
            kinds["launch"] = [(0, self.sync.launch_point)]
        return kinds

    def _inner_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every per-replica shard-sized tensor (see :meth:`_replica_tensors`), in a
        fixed order; names as in the non-sharded :meth:`state_dict`."""
        for kind, entries in self._replica_tensors().items():
            for i, (_, t) in enumerate(entries):
                yield f"{kind}.{i}", t

    def _replica_meta(self) -> dict:
        """This replica's small non-tensor inner state (pickled as a ShardedObject): per shard, the
        optimizer state that is not shard-sized (torch Adam's 0-dim ``step``: skipped fp16 steps make it
        differ between replicas), each inner optimizer's param groups without ``params`` (TE/Apex Adam
        keep ``step`` there) and its grad scaler state (fp16: scale, growth and hysteresis trackers
        follow the replica's own overflow history)."""
        def small(v):
            return v.detach().clone() if isinstance(v, torch.Tensor) else v

        return {
            "format": CHECKPOINT_FORMAT,
            "numel": self.view.numel,
            "shard_state": [{k: small(v) for k, v in d.optimizer.state.get(p, {}).items()
                             if not (isinstance(v, torch.Tensor) and v.shape == p.shape)}
                            for d, p in self._shards()],
            "param_groups": [[{k: small(v) for k, v in g.items() if k != "params"}
                              for g in d.optimizer.param_groups] for d in self.dist_opts],
            "grad_scaler": [({k: small(v) for k, v in d.grad_scaler.state_dict().items()}
                             if d.grad_scaler is not None else None) for d in self.dist_opts],
            # the LR-schedule position: Megatron advances it on successful steps only (see attach_lr_scheduler)
            "lr_schedule_steps": (self.__dict__["lr_scheduler"].num_steps
                                  if self.__dict__.get("lr_scheduler") is not None else None),
            # this replica's own timings (auto tau, budget, timeout): the live run agrees on tau by MAX
            # over every rank's, so each replica resumes with its own (the outer meta holds replica 0's)
            "timings": self.sync.timings(),
        }

    def _load_replica_meta(self, meta: dict) -> None:
        """Restore :meth:`_replica_meta` (after the inner optimizer's own load, which set replica 0's
        step counts, param groups and grad scaler)."""
        shards = list(self._shards())
        if len(meta["shard_state"]) != len(shards) or len(meta["param_groups"]) != len(self.dist_opts):
            raise RuntimeError("checkpoint's per-replica DiLoCoX state has another number of main shards or "
                               "optimizers: resume with the TP/PP/DP layout and optimizer it was written with")
        for (d, p), saved in zip(shards, meta["shard_state"]):
            state = d.optimizer.state[p]
            for k, v in saved.items():
                old = state.get(k)
                if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor):
                    v = v.to(device=old.device, dtype=old.dtype)
                state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        for d, groups in zip(self.dist_opts, meta["param_groups"]):
            if len(groups) != len(d.optimizer.param_groups):
                raise RuntimeError("checkpoint's inner optimizer has another number of param groups")
            for g, saved in zip(d.optimizer.param_groups, groups):
                g.update({k: v for k, v in saved.items() if k != "params"})
        for d, scaler in zip(self.dist_opts, meta["grad_scaler"]):
            if scaler is not None and d.grad_scaler is not None:
                d.grad_scaler.load_state_dict(scaler)
        # applied right after Megatron restored replica 0's schedule (attach_lr_scheduler)
        self._lr_schedule_steps_to_restore = meta.get("lr_schedule_steps")
        if meta.get("timings") is not None:  # (older checkpoints: replica 0's, from the outer meta)
            self.sync.load_timings(meta["timings"])

    def attach_lr_scheduler(self, scheduler: Any) -> None:
        """Checkpoint this replica's own position in the LR schedule (``scheduler``: Megatron's
        ``OptimizerParamScheduler`` built for this optimizer; idempotent).

        Megatron's ``train_step`` advances the scheduler only after a successful step, and with fp16 each
        replica skips the steps its own loss-scale overflows hit, so the replicas' schedules (``num_steps``,
        hence LR and weight decay) drift apart; Megatron's checkpoint keeps one schedule (replica 0's).
        The per-replica checkpoint state records ``scheduler.num_steps``, and this wraps the scheduler
        instance's ``load_state_dict`` so that, right after Megatron restored replica 0's schedule, this
        replica's own ``num_steps`` is set and the LR / weight decay of every param group re-applied.
        Needs to be called before the checkpoint is loaded (``megatron_diloco.install`` wires it where
        Megatron builds the scheduler)."""
        self.lr_scheduler = scheduler
        original = scheduler.load_state_dict
        if getattr(original, "_diloco_x", False):
            return

        def load_state_dict(state_dict: dict) -> None:
            original(state_dict)
            self._restore_lr_schedule()

        load_state_dict._diloco_x = True
        scheduler.load_state_dict = load_state_dict

    def _restore_lr_schedule(self) -> None:
        steps = self.__dict__.pop("_lr_schedule_steps_to_restore", None)
        scheduler = self.__dict__.get("lr_scheduler")
        if steps is None or scheduler is None or steps == scheduler.num_steps:
            return
        scheduler.num_steps = steps
        scheduler.step(increment=0)  # sets lr and weight decay of every param group for ``steps``

    def _outer_state(self) -> dict:
        return {"sync": self.sync.state_dict(), "step_calls": self.step_calls,
                "totals": vars(self.totals).copy(), "schedule": self.diloco_config.schedule()}

    def _keep_schedule(self, saved: dict | None) -> None:
        """On a resume: the round schedule the checkpoint was trained with (``saved``, None in
        checkpoints written before it was recorded) against this run's. An ``auto`` warm-up (it
        depends on ``--train-iters``, which a resume may extend) takes the checkpoint's, so that the
        boundaries stay where they were; explicit flags that differ win, with a warning (the rounds
        after this step follow them; the replicas agree, as every rank resolves the same flags)."""
        cfg = self.diloco_config
        if saved is None or saved == cfg.schedule():
            return
        if cfg.warmup_auto and saved["local_steps"] == cfg.local_steps:
            had_warmup = bool(cfg.warmup_iters)
            cfg.warmup_local_steps, cfg.warmup_iters = saved["warmup_local_steps"], saved["warmup_iters"]
            try:  # tau_w and the warm-up codec were resolved for the other warm-up: fit them to this one
                resolve_kept_warmup(cfg, had_warmup)
            except ValueError as err:
                raise ValueError(f"resuming with the checkpoint's auto warm-up (H0 {cfg.warmup_local_steps}, "
                                 f"{cfg.warmup_iters} steps): {err}") from None
            self.sync.schedule_changed()
            logger.info("DiLoCoX: the auto warm-up keeps the checkpoint's schedule: H0 %s for %s steps",
                        cfg.warmup_local_steps, cfg.warmup_iters)
            return
        logger.warning("DiLoCoX: the checkpoint was trained with rounds %s, this run's flags give %s: the rounds "
                       "after step %d follow the flags (--diloco-x-local-steps, --diloco-x-warmup-local-steps, "
                       "--diloco-x-warmup-iters)", saved, cfg.schedule(), self.step_calls)

    def _per_replica_state(self) -> dict:
        """Clones of this replica's own state (non-sharded :meth:`state_dict` only)."""
        return {"tensors": {name: t.detach().clone() for name, t in self._inner_state_tensors()},
                "meta": self._replica_meta()}

    def state_dict(self, *args, **kwargs) -> dict:
        sd = self.inner.state_dict(*args, **kwargs)
        if kwargs.get("is_loading"):
            return sd
        return {"inner": sd, "diloco_x": self._outer_state(),
                "diloco_x_replica": self._per_replica_state()}

    def _layout_table(self) -> list[tuple[int, int, int]]:
        """``(replica index, rank in replica, shard numel)`` of every rank of the world. The first call
        all-gathers 3 int64 per rank over the default (world) group, so it must be made on every rank
        (construction, checkpoint save / load are); cached afterwards."""
        cached = self.__dict__.get("_layout_rows")
        if cached is not None:
            return cached
        topo = self.topology
        mine = torch.tensor([topo.replica_index, topo.rank_in_replica, self.view.numel], dtype=torch.int64,
                            device=self.view.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = self._layout_rows = [tuple(int(x) for x in row.tolist()) for row in rows]
        return table

    def _link_sharers(self) -> int:
        """S: the ranks of this rank's replica that hold a shard, i.e. whose outer groups' exchanges
        cross the site's slow link at the same time (each counts on 1 / S of
        ``--diloco-x-bandwidth-mbps``). Collective over the world on the first call
        (:meth:`_layout_table`)."""
        if not dist.is_initialized():
            return 1
        replica = self.topology.replica_index
        return sum(1 for r, _, n in self._layout_table() if r == replica and n > 0)

    def _checkpoint_layout(self) -> tuple[int, int]:
        """``(offset, T)``: where this rank's flat shard vector starts in its replica's concatenation
        (ranks ordered by ``rank_in_replica``) and that concatenation's length T (the same on every
        replica). Collective over the world on the first call (:meth:`_layout_table`); cached."""
        cached = self.__dict__.get("_ckpt_layout")
        if cached is not None:
            return cached
        topo = self.topology
        table = self._layout_table()
        totals: dict[int, int] = {}
        for replica, _, n in table:
            totals[replica] = totals.get(replica, 0) + n
        if len(set(totals.values())) != 1:
            raise RuntimeError(f"replicas hold different numbers of main-shard elements {totals}: "
                               "DiLoCoX needs one TP/PP/DP layout for every replica")
        offset = sum(n for replica, k, n in table
                     if replica == topo.replica_index and k < topo.rank_in_replica)
        cached = self._ckpt_layout = (offset, totals[topo.replica_index])
        return cached

    def _sharded_diloco_state(self, contents: "_CheckpointContents | None") -> dict:
        """The DiLoCoX entries of the sharded state dict (layout above). ``contents``: None when saving;
        when loading, what the checkpoint holds (only those entries are requested).

        Saving references the live tensors (no copy; completes an in-flight exchange, collective over
        the outer group). Loading reads in place into the live tensors, except the fp32 main shards,
        which are read into one fresh flat buffer (4 B per shard element, freed after the load) because
        with fp32 models they are views of the model parameters that Megatron's model entries load into
        in the same read; :meth:`load_state_dict` copies them over."""
        topo = self.topology
        r, n = topo.replica_index, self.view.numel
        offset, total = self._checkpoint_layout()
        pos_shape, pos_offset = (topo.ranks_per_replica,), (topo.rank_in_replica,)
        loading = contents is not None

        def outer_entry(name: str, t: torch.Tensor) -> ShardedTensor:
            return ShardedTensor(f"diloco_x.outer.{name}", t.detach(), t.dtype, (n,), (total,), (offset,),
                                 axis_fragmentations=None, replica_id=r)

        def replica_entry(kind: str, t: torch.Tensor, at: int) -> ShardedTensor:
            row = t.detach().view(1, -1)
            return ShardedTensor(f"diloco_x.replica.{kind}", row, row.dtype, tuple(row.shape),
                                 (topo.replicas, total), (r, offset + at), axis_fragmentations=None, replica_id=0)

        if loading:
            live = {"theta": self.sync.theta, "momentum_buffer": self.sync.outer.momentum_buffer,
                    "pending_delta": self.sync.delta}
            outer_tensors = {name: (live[name] if live.get(name) is not None else
                                    torch.empty(n, dtype=torch.float32, device=self.view.device))
                             for name in contents.outer}
            outer_meta = None
            kinds = self._replica_tensors()
            missing = [k for k in kinds if k not in contents.replica]
            if missing:
                raise RuntimeError(
                    f"checkpoint {contents.path} lacks this run's per-replica DiLoCoX state {missing}: it was "
                    "written with another optimizer, --diloco-x-compression (error-feedback 'residual') or "
                    "--diloco-x-overlap ('anchor' of eager, 'launch' of partial); resume with the flags it was written with, or "
                    "load it with --no-load-optim to start a new outer loop from its weights")
            fresh = torch.empty(n, dtype=torch.float32, device=self.view.device)
            kinds["param"] = [(at, v.view_as(p)) for (at, p), v in zip(kinds["param"], self.view.split(fresh))]
            self._loading_main_params = fresh
            replica_meta = None
        else:
            state = self.sync.state_dict()
            outer_tensors = {k: v for k, v in state.items() if _is_flat_shard(v, n)}
            outer_meta = {k: v for k, v in state.items() if k not in outer_tensors}
            outer_meta.update(format=CHECKPOINT_FORMAT, numel=n, tensors=sorted(outer_tensors),
                              step_calls=self.step_calls, totals=vars(self.totals).copy(),
                              schedule=self.diloco_config.schedule())
            kinds = self._replica_tensors()
            replica_meta = self._replica_meta()
        entries: dict[str, Any] = {
            "outer.meta": ShardedObject("diloco_x.outer.meta", outer_meta, pos_shape, pos_offset, replica_id=r),
            "replica.meta": ShardedObject(f"diloco_x.replica{r}.meta", replica_meta, pos_shape, pos_offset,
                                          replica_id=0),
            "outer": {}, "replica": {},
        }
        if n > 0:  # a rank without main shards contributes no tensor piece
            entries["outer"] = {name: outer_entry(name, t) for name, t in outer_tensors.items()}
            entries["replica"] = {kind: [replica_entry(kind, t, at) for at, t in items]
                                  for kind, items in kinds.items()}
        return entries

    def _megatron_entries_from_replica_zero(self, model_sharded_state_dict: dict, inner_sd: dict) -> None:
        """Saving: on ranks of replicas 1..R-1, drop Megatron's own model tensors and distributed-
        optimizer parameter state from the sharded state dict, so that those checkpoint entries are
        replica 0's, whole (every replica's ranks hold them as data-parallel copies, and with fully
        parallel save Megatron would let any of them write each piece: a per-shard mix of replicas, which
        mid-round differ). Costs nothing (fewer bytes written); DiLoCoX itself restores every replica from
        its own entries. Megatron's small objects (param groups, grad scaler, iteration) are already
        written by data-parallel rank 0, i.e. replica 0."""
        if self.topology.replica_index == 0:
            return
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        def drop(node: Any) -> Any:
            if isinstance(node, dict):
                for key in list(node):
                    if isinstance(node[key], (ShardedTensor, ShardedTensorFactory)):
                        del node[key]
                    else:
                        drop(node[key])
            elif isinstance(node, list):
                for i, item in enumerate(node):
                    if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                        node[i] = None
                    else:
                        drop(item)
            return node

        for key, value in model_sharded_state_dict.items():
            if key != "optimizer":
                drop(value)
        _drop_megatron_param_state(inner_sd)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """Megatron's inner sharded state plus the DiLoCoX entries under ``"diloco_x"`` (layout at the
        top of this section; disk per model parameter with Adam and fp32 main params: 12 B per replica
        for its own inner state (+4 residual with a lossy codec, +4 anchor with eager) and 4-12 B once
        for theta, momentum and the in-flight exchange, on top of Megatron's own entries).

        Loading first reads the checkpoint's metadata (``args.load``) to request only what it holds:

        * a DiLoCoX checkpoint: Megatron's distributed-optimizer parameter state is not requested
          (each replica restores its own from ``diloco_x.replica.*``);
        * a plain Megatron checkpoint (written without ``--diloco-x``): only Megatron's entries, which
          every replica loads; :meth:`load_state_dict` then restarts the outer loop from them.
        """
        sd = self.inner.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        self._loading_contents = None
        if not is_loading:
            sd["diloco_x"] = self._sharded_diloco_state(None)
            self._megatron_entries_from_replica_zero(model_sharded_state_dict, sd)
            return sd
        contents = _read_checkpoint_contents(self)
        self._loading_contents = contents
        if contents.kind == "plain":
            return sd
        _drop_megatron_param_state(sd)
        if contents.kind == "legacy":
            r, topo = self.topology.replica_index, self.topology
            shape, offset = (topo.ranks_per_replica,), (topo.rank_in_replica,)
            sd["diloco_x"] = {
                "legacy.outer": ShardedObject("diloco_x.outer", None, shape, offset, replica_id=r),
                "legacy.replica": ShardedObject(f"diloco_x.replica{r}", None, shape, offset, replica_id=0)}
        else:
            sd["diloco_x"] = self._sharded_diloco_state(contents)
        return sd

    def restart_outer_loop_from_params(self, reason: str) -> None:
        """Start a new outer loop from the current fp32 main params: theta <- x (this rank's shard),
        outer momentum 0, error-feedback residual 0, eager anchor = theta, nothing in flight, round
        and step counters 0 (the first boundary comes H ``step()`` calls from now). Logs one line (rank
        0) with ``reason``. An exchange in flight is waited for and dropped (then collective over the
        outer group: call it on every rank). Model params are left as they are (they hold x already).

        Resets :class:`OuterSync` through its attributes (``theta``, ``outer.momentum_buffer``,
        ``residual``, ``anchor``, ``pending``, ``apply_at``, ``rounds``, ``skipped_rounds``) and this
        optimizer's round state (a landed exchange not yet reported, ``totals``, the round's timing; the
        start weights are checked again at the first boundary); codec state (low-rank warm-start bases,
        adaptive plan) and the measurements of the link and the step time are kept. The log line is printed on global rank 0 only."""
        sync = self.sync
        if sync.pending is not None:
            sync.pending.wait()
            sync.pending = None
        sync.x_into(sync.theta)
        if sync.outer.momentum_buffer is not None:
            sync.outer.momentum_buffer.zero_()
        if sync.residual is not None:
            sync.residual.zero_()
        if sync.eager_anchor is not None:
            sync.eager_anchor.copy_(sync.theta)
        sync.x_is_theta = True
        sync.rounds = 0
        sync.skipped_rounds = 0
        # partial: when the (now dropped) exchange was to land; a fresh loop's value
        sync.apply_at = self.diloco_config.local_steps if self.diloco_config.overlap_steps is None \
            else self.diloco_config.overlap_steps
        self.step_calls = 0
        self._round_step_s, self._round_timed_steps = 0.0, 0
        self._landed = None  # an exchange of the old loop that landed: not this loop's first round's
        self.totals = ExchangeStats()  # bytes and times of this loop's rounds, as ``rounds`` counts them
        self.last_report = None
        self._start_checked = False  # the new theta: the replicas' start weights are compared again
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[DiLoCoX] outer loop restarted from the current params ({reason}): theta <- fp32 main "
                  "params, outer momentum 0, residual 0, nothing in flight, round 0", flush=True)

    def after_checkpoint_load(self, weights_loaded: bool) -> None:
        """The one place the outer loop restarts after a load (call it when Megatron's
        ``load_checkpoint`` has returned, on every rank): when the load restored weights but no
        DiLoCoX state, :meth:`restart_outer_loop_from_params` from them. That is a checkpoint
        written without ``--diloco-x`` (its inner optimizer state loaded as Megatron loads it; noted
        by :meth:`load_state_dict`), or weights loaded without any optimizer state
        (``--no-load-optim``, ``--finetune``, ``--pretrained-checkpoint``: ``weights_loaded`` True and
        :meth:`load_state_dict` not called). A load that restored DiLoCoX state changes nothing.
        ``weights_loaded`` must be the same on every rank (it decides a collective restart)."""
        plain, self._loaded_without_diloco_state = self._loaded_without_diloco_state, None
        if plain is not None:
            self.restart_outer_loop_from_params(plain)
        elif weights_loaded and not self._loaded_diloco_state:
            self.restart_outer_loop_from_params("model weights loaded without optimizer state")
        self._loaded_diloco_state = False

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` or from the loaded :meth:`sharded_state_dict`.

        Order: Megatron's inner load (param groups, step, grad scaler of replica 0; fp32 main params
        and moments only for a plain Megatron checkpoint), then this replica's own state over it, then
        the main params are published into the model params. A checkpoint without DiLoCoX state is
        noted: :meth:`after_checkpoint_load` then restarts the outer loop from the loaded params."""
        state_dict = dict(state_dict)
        if "inner" in state_dict:  # plain state_dict() format
            self.inner.load_state_dict(state_dict["inner"])
            per_replica = state_dict.get("diloco_x_replica")
            if per_replica is not None and "tensors" not in per_replica:  # written before format 2
                per_replica = {"tensors": per_replica, "meta": None}
            self._load_outer_and_replica(state_dict["diloco_x"], per_replica)
            return
        ours = state_dict.pop("diloco_x", None)
        self.inner.load_state_dict(state_dict)
        contents = self.__dict__.get("_loading_contents")
        if ours is None:  # the outer loop restarts from these params (after_checkpoint_load)
            where = f"checkpoint {contents.path}" if contents is not None else "the state dict"
            self._loaded_without_diloco_state = (
                f"{where} holds no DiLoCoX state (written without --diloco-x); inner optimizer state loaded "
                "as Megatron loads it")
            return
        if "legacy.outer" in ours:
            legacy = ours["legacy.replica"]
            self._load_outer_and_replica(ours["legacy.outer"], {"tensors": legacy, "meta": None})
            return
        outer_meta, replica_meta = ours["outer.meta"], ours["replica.meta"]
        if outer_meta.get("format") != CHECKPOINT_FORMAT:
            raise RuntimeError(f"unknown DiLoCoX checkpoint format {outer_meta.get('format')}")
        n = self.view.numel
        if int(outer_meta["numel"]) != n:
            raise ValueError(f"DiLoCoX checkpoint holds an outer shard of {outer_meta['numel']} elements, this "
                             f"rank owns {n}: resume with the same TP/PP/DP layout and --diloco-x-replicas")
        loaded_outer = ours.get("outer", {})
        sync_state = {k: v for k, v in outer_meta.items()
                      if k not in ("format", "numel", "tensors", "step_calls", "totals", "schedule")}
        for name in outer_meta["tensors"]:
            sync_state[name] = (loaded_outer[name] if n > 0 else
                                torch.empty(0, dtype=torch.float32, device=self.view.device))
        self.sync.load_state_dict(sync_state)  # copies onto itself where read in place
        self.step_calls = int(outer_meta["step_calls"])
        self.totals = ExchangeStats(**outer_meta["totals"])
        self._keep_schedule(outer_meta.get("schedule"))
        fresh = self.__dict__.pop("_loading_main_params", None)
        if n > 0:
            loaded = ours["replica"]
            for kind, entries in self._replica_tensors().items():
                if kind == "param":
                    continue
                for (_, t), src in zip(entries, loaded[kind]):
                    if src.data_ptr() != t.data_ptr():  # not read in place (e.g. state reallocated)
                        t.copy_(src.view_as(t))
            if fresh is None:  # loaded through another path: copy the main shards piece by piece
                for (_, p), src in zip(self._replica_tensors()["param"], loaded["param"]):
                    p.detach().copy_(src.view_as(p))
            else:
                self.view.copy_from_(fresh)
        self._load_replica_meta(replica_meta)
        self._publish_params(gather_now=True)  # forward hooks may be off (first step after a load)
        self._loaded_diloco_state = True

    def _load_outer_and_replica(self, outer: dict | None, per_replica: dict | None) -> None:
        """Restore from the pickled formats (non-sharded :meth:`state_dict`; torch_dist checkpoints
        written before format 2, whose ShardedObjects held clones of every tensor)."""
        if outer is None or per_replica is None:
            raise RuntimeError("checkpoint has no DiLoCoX state for this replica: it was not written with "
                               "--diloco-x and the same --diloco-x-replicas; load it with --no-load-optim to "
                               "start a new outer loop from its weights")
        self.sync.load_state_dict(outer["sync"])
        self.step_calls = int(outer["step_calls"])
        self.totals = ExchangeStats(**outer["totals"])
        self._keep_schedule(outer.get("schedule"))
        tensors, legacy = per_replica["tensors"], per_replica["meta"] is None
        names = [name for name, _ in (self._legacy_state_tensors() if legacy else self._inner_state_tensors())]
        missing = [name for name in names if name not in tensors]
        if missing:
            raise RuntimeError(
                f"checkpoint lacks this run's per-replica DiLoCoX state {missing[:3]}: it was written with "
                "another --diloco-x-compression / --diloco-x-overlap (error-feedback residual, eager "
                "anchor); resume with the flags it was written with, or load it with "
                "--no-load-optim to start a new outer loop from its weights")
        for name, t in (self._legacy_state_tensors() if legacy else self._inner_state_tensors()):
            t.detach().copy_(tensors[name])
        if not legacy:
            self._load_replica_meta(per_replica["meta"])
        self._publish_params(gather_now=True)  # forward hooks may be off (first step after a load)
        self._loaded_diloco_state = True

    def _legacy_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The per-replica tensors under the names of checkpoint format 1 (``{i}.param``, ``{i}.<state
        key>`` including Adam's 0-dim ``step``, ``diloco_x.residual``, ``diloco_x.anchor``)."""
        for i, (d, p) in enumerate(self._shards()):
            yield f"{i}.param", p
            for k, v in sorted(d.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    yield f"{i}.{k}", v
        if self.sync.residual is not None:
            yield "diloco_x.residual", self.sync.residual
        if self.sync.eager_anchor is not None:
            yield "diloco_x.anchor", self.sync.eager_anchor


# ---------------------------------------------------------------------- checkpoint helpers

#: Version of the DiLoCoX entries in a torch_dist checkpoint (1: pickled ShardedObjects, before
#: per-replica ShardedTensors; 2: the layout described in DiLoCoXOptimizer's checkpointing section).
CHECKPOINT_FORMAT = 2


def _is_flat_shard(value: Any, numel: int) -> bool:
    """Whether ``value`` is a flat fp32 tensor over the rank's shard (``(numel,)``)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _drop_megatron_param_state(sd: Any) -> None:
    """Remove the ``param_state`` of every DistributedOptimizer sharded state dict inside ``sd``
    (ChainedOptimizer nests one per sub-optimizer); their common entries (param groups, step, grad
    scaler) stay."""
    if isinstance(sd, dict):
        if "param_state_sharding_type" in sd:
            sd.pop("param_state", None)
        for value in sd.values():
            _drop_megatron_param_state(value)


@dataclasses.dataclass
class _CheckpointContents:
    """What a torch_dist checkpoint holds, as far as DiLoCoX is concerned."""

    path: str
    kind: str
    """``"diloco"`` (format 2), ``"legacy"`` (format 1: pickled ShardedObjects) or ``"plain"``
    (no DiLoCoX state: written without ``--diloco-x``)."""
    outer: tuple[str, ...] = ()
    """Names of the ``diloco_x.outer.<name>`` tensors."""
    replica: tuple[str, ...] = ()
    """Kinds of the ``diloco_x.replica.<kind>`` tensors."""


def _checkpoint_dir_being_loaded() -> str | None:
    """The checkpoint directory Megatron's ``load_checkpoint`` reads: ``args.load`` at the iteration
    of its tracker file (or ``--ckpt-step``). None when that cannot be told (no ``args.load``; a
    non-persistent checkpoint may be newer)."""
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    args = get_args()
    load_dir = getattr(args, "load", None)
    if not load_dir or getattr(args, "non_persistent_ckpt_type", None):
        return None
    if getattr(args, "ckpt_step", None):
        iteration, release = int(args.ckpt_step), False
    else:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if not os.path.isfile(tracker):
            return None
        text = open(tracker).read().strip()
        release = text == "release"
        iteration = 0 if release else int(text)
    return get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)


def _read_checkpoint_contents(opt: DiLoCoXOptimizer) -> _CheckpointContents:
    """Read the checkpoint's metadata (the ``.metadata`` file; no tensor data) and check that its
    DiLoCoX entries fit this run's layout (errors name the flags). Called on every rank."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    path = _checkpoint_dir_being_loaded()
    if path is None:
        raise RuntimeError(
            "DiLoCoX cannot tell which checkpoint is being loaded (needs --load with its "
            "latest_checkpointed_iteration.txt, or --ckpt-step; non-persistent checkpoints are not "
            "supported with --diloco-x): load with --no-load-optim to start a new outer loop from the weights")
    metadata = load_sharded_metadata(path)
    outer, replica, legacy = {}, {}, False
    for key, entry in metadata.items():
        if key.startswith("diloco_x.outer.") and isinstance(entry, ShardedTensor):
            outer[key[len("diloco_x.outer."):]] = tuple(entry.global_shape)
        elif key.startswith("diloco_x.replica.") and isinstance(entry, ShardedTensor):
            replica[key[len("diloco_x.replica."):]] = tuple(entry.global_shape)
        elif key.startswith("diloco_x.outer/"):
            legacy = True  # format 1: one pickled ShardedObject per rank position
    if outer:
        _, total = opt._checkpoint_layout()
        want_outer, want_replica = (total,), (opt.topology.replicas, total)
        bad = {k: s for k, s in outer.items() if s != want_outer}
        bad.update({k: s for k, s in replica.items() if s != want_replica})
        if bad:
            raise RuntimeError(
                f"DiLoCoX checkpoint {path} was written with another layout: entries {bad} vs this run's outer "
                f"{want_outer} / per-replica {want_replica} (replicas, main-shard elements per replica); resume "
                "with the --diloco-x-replicas and TP/PP/DP layout it was written with, or load it with "
                "--no-load-optim to start a new outer loop from its weights")
        return _CheckpointContents(path, "diloco", tuple(sorted(outer)), tuple(sorted(replica)))
    if legacy:
        return _CheckpointContents(path, "legacy")
    return _CheckpointContents(path, "plain")
