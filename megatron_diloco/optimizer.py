"""``DiLoCoXOptimizer``: the ``MegatronOptimizer`` interface around Megatron's distributed optimizer.

Each ``step()`` runs the inner (replica-local) optimizer step; every H-th call it also runs the outer
boundary on the rank's fp32 main-parameter shard (:class:`megatron_diloco.sync.OuterSync`), writes
the result into the model parameters and re-gathers them inside the replica.

Process groups: the outer group (one rank per replica, same shard) carries the pseudo-gradient
exchange; ``replica_groups`` (intra-replica groups: intra-DP and model-parallel) carry only the
pseudo-gradient norm for logging. Nothing else crosses replicas.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer

from megatron_diloco.collectives import ExchangeStats
from megatron_diloco.config import DiLoCoXConfig
from megatron_diloco.outer import ShardView, fingerprint
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
        on_round: optional callback receiving each boundary's :class:`RoundSummary`-like dict
            (called on every rank; used for logging).

    The wrapper forwards every ``MegatronOptimizer`` method to ``inner`` except ``step``,
    ``state_dict``, ``load_state_dict`` and ``sharded_state_dict``. Boundaries are counted in
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
                              host_group=topology.outer_host_group)
        self._round_started: float | None = None
        self.step_calls = 0
        self.totals = ExchangeStats()
        self.last_report: RoundReport | None = None

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
        self.inner.reload_model_params(state_dict)

    def offload_to_cpu(self):
        return self.inner.offload_to_cpu()

    def restore_from_cpu(self):
        return self.inner.restore_from_cpu()

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self):
        """Inner step; on every H-th call also the outer boundary. Returns the inner step's
        ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if self._round_started is None:
            self._round_started = time.perf_counter()
        result = self.inner.step()
        self.step_calls += 1
        if self.step_calls % self.diloco_config.local_steps == 0:
            # mean inner-step time of this round (boundary work excluded): the adaptive byte budget
            now = time.perf_counter()
            self.sync.set_step_time((now - self._round_started) / self.diloco_config.local_steps)
            report = self.sync.boundary()
            self._publish_params()
            self._account(report.completed)
            self.last_report = report
            if self.on_round is not None:
                self.on_round(self.round_metrics(report))
            self._round_started = time.perf_counter()
        return result

    def _publish_params(self) -> None:
        """Main (fp32) shards -> model params, then re-gather them inside the replica."""
        for d in self.dist_opts:
            d._copy_main_params_to_model_params()
            if not d.ddp_config.overlap_param_gather:
                d.start_param_sync_for_bucket_group_subset()
            # With --overlap-param-gather the next forward's pre-hooks gather the new params.

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
        """End of training: apply the exchange still in flight (collective over the outer group)."""
        stats = self.sync.drain()
        if stats is not None:
            self._publish_params()
            self._account(stats)

    def replicas_identical(self) -> bool:
        """Whether this rank's shard and model params are bit-identical across the outer group.

        With ``--diloco-x-overlap eager`` the replicas' params differ between boundaries by design
        (each one's own look-ahead) while an exchange is in flight; then the shared outer state
        (theta, momentum) is compared instead. After :meth:`finish` the params are compared."""
        if self.sync.anchor is not None and self.sync.pending is not None:
            tensors = [self.sync.theta]
            if self.sync.outer.momentum_buffer is not None:
                tensors.append(self.sync.outer.momentum_buffer)
        else:
            tensors = list(self.view.shards)
            for d in self.dist_opts:
                tensors += [p for chunk in d.model_chunks for p in chunk.parameters()]
        fp = fingerprint(tensors)
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
    def _inner_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every per-replica inner tensor: fp32 main shards and their
        optimizer state (Adam moments), in a fixed order."""
        i = 0
        for d in self.dist_opts:
            for g in d.optimizer.param_groups:
                for p in g["params"]:
                    yield f"{i}.param", p
                    for k, v in sorted(d.optimizer.state.get(p, {}).items()):
                        if isinstance(v, torch.Tensor):
                            yield f"{i}.{k}", v
                    i += 1
        if self.sync.residual is not None:
            yield "diloco_x.residual", self.sync.residual
        if self.sync.anchor is not None:
            yield "diloco_x.anchor", self.sync.anchor

    def _outer_state(self) -> dict:
        return {"sync": self.sync.state_dict(), "step_calls": self.step_calls,
                "totals": vars(self.totals).copy()}

    def _per_replica_state(self) -> dict:
        return {name: t.detach().clone() for name, t in self._inner_state_tensors()}

    def state_dict(self, *args, **kwargs) -> dict:
        sd = self.inner.state_dict(*args, **kwargs)
        if kwargs.get("is_loading"):
            return sd
        return {"inner": sd, "diloco_x": self._outer_state(),
                "diloco_x_replica": self._per_replica_state()}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict:
        """Inner sharded state plus two DiLoCoX entries, one piece per rank position in the replica:

        * ``diloco_x.outer``: theta, momentum, the completed in-flight exchange; identical across
          replicas, so only replica 0 writes it (``replica_id`` = replica index).
        * ``diloco_x.replica{r}``: replica r's own fp32 main shards and inner optimizer state.
          Replicas differ there (mid-round parameters, Adam moments), while Megatron's checkpoint
          treats the data-parallel copies of its optimizer and model entries as identical: with
          fully parallel save any replica may write them. Every replica therefore writes its own
          piece, and loading restores it over whatever Megatron's entries held. Disk cost: the
          inner state (12 B per parameter with Adam) once per replica on top of Megatron's copy.
        """
        sd = self.inner.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        topo = self.topology
        shape, offset = (topo.ranks_per_replica,), (topo.rank_in_replica,)
        sd["diloco_x.outer"] = ShardedObject(
            "diloco_x.outer", None if is_loading else self._outer_state(), shape, offset,
            replica_id=topo.replica_index)
        key = f"diloco_x.replica{topo.replica_index}"
        sd[key] = ShardedObject(key, None if is_loading else self._per_replica_state(),
                                shape, offset, replica_id=0)
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        if "inner" in state_dict:  # plain state_dict() format
            outer, per_replica = state_dict["diloco_x"], state_dict.get("diloco_x_replica")
            self.inner.load_state_dict(state_dict["inner"])
        else:
            outer = state_dict.pop("diloco_x.outer", None)
            per_replica = state_dict.pop(f"diloco_x.replica{self.topology.replica_index}", None)
            for k in [k for k in state_dict if k.startswith("diloco_x.replica")]:
                state_dict.pop(k)
            self.inner.load_state_dict(state_dict)
        if outer is None or per_replica is None:
            raise RuntimeError("checkpoint has no DiLoCoX state for this replica: it was not written "
                               "with --diloco-x and the same --diloco-x-replicas; load it with "
                               "--no-load-optim to start a new outer loop from its weights")
        self.sync.load_state_dict(outer["sync"])
        self.step_calls = int(outer["step_calls"])
        self.totals = ExchangeStats(**outer["totals"])
        names = [name for name, _ in self._inner_state_tensors()]
        missing = [n for n in names if n not in per_replica]
        if missing:
            raise RuntimeError(
                f"checkpoint lacks this run's per-replica DiLoCoX state {missing[:3]}: it was written with "
                "another --diloco-x-compression / --diloco-x-overlap (error-feedback residual, eager "
                "start point); resume with the flags it was written with, or load it with "
                "--no-load-optim to start a new outer loop from its weights")
        for name, t in self._inner_state_tensors():
            t.copy_(per_replica[name])
        self._publish_params()
