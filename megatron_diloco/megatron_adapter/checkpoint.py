"""The DiLoCoX state in Megatron's checkpoints: layout, save, load.

:class:`OuterCheckpoint` is the codec of the DiLoCoX entries of a torch_dist checkpoint (and of the
non-sharded state dict), built on explicit inputs: the rank's :class:`OuterSync`, its
:class:`ShardView`, the :class:`DistributedOptimizer` parts whose state it holds per replica, the
:class:`Topology` and the :class:`ShardLayout`. The optimizer's own counters go in as :class:`Counters`
and come back out of a load in :class:`Restored`, with the round schedule the checkpoint was trained
with; what a load means for the outer loop (keep the schedule, restart) is
:mod:`megatron_diloco.megatron_adapter.restart`'s.

Layout of the DiLoCoX entries in a torch_dist checkpoint (:data:`CHECKPOINT_FORMAT` 2; T = the length of
a replica's flat shard vectors, i.e. the sum over the replica's ranks, ordered by rank_in_replica, of
their fp32 main-shard numel, :meth:`ShardLayout.checkpoint_span`; every tensor references the live
buffer, nothing is cloned)::

  diloco_x.outer.<name>     ShardedTensor (T,) fp32 per flat outer tensor of OuterSync.state_dict()
                            (theta, momentum_buffer, pending_delta when an exchange was in flight):
                            identical on every replica, written once (replica_id = replica index).
  diloco_x.replica.<kind>   ShardedTensor (R, T), row r written by replica r: kind 'param' (fp32 main
                            shards), 'opt.<key>' (optimizer state of a shard's shape: opt.exp_avg,
                            opt.exp_avg_sq with Adam), 'residual' (lossy codec), 'anchor' (eager),
                            'launch' (partial with the exact merge: the launch point x_L).
  diloco_x.outer.meta       ShardedObject per rank position: OuterSync's non-tensor state (rounds,
                            codec plan / low-rank bases, measured link, auto tau's measurements),
                            step_calls, totals, the round schedule.
  diloco_x.replica<r>.meta  ShardedObject per rank position of replica r: per-shard 0-dim optimizer
                            state (torch Adam's step), inner param groups (all but 'params'), grad
                            scaler state, the LR-schedule position, the rank's own timings.

Megatron's own model and optimizer entries are written by replica 0 only
(:meth:`OuterCheckpoint._megatron_entries_from_replica_zero`), so a plain Megatron run loading the
checkpoint resumes from replica 0's state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Iterator

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer

from megatron_diloco.algorithm.exchange import ExchangeStats
from megatron_diloco.algorithm.shard_view import ShardView
from megatron_diloco.algorithm.sync import OuterSync
from megatron_diloco.megatron_adapter.shard_layout import ShardLayout
from megatron_diloco.megatron_adapter.topology import Topology

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Counters:
    """The optimizer's own counters that a checkpoint carries."""

    step_calls: int
    """``step()`` calls of the current outer loop (the outer meta; boundaries are counted in them)."""
    totals: ExchangeStats
    """Bytes and times of the exchanges completed in this outer loop (the outer meta)."""
    lr_schedule_steps: int | None = None
    """This replica's ``OptimizerParamScheduler.num_steps`` (its per-replica meta; None: no scheduler)."""


@dataclasses.dataclass
class Restored:
    """What :meth:`OuterCheckpoint.load_state_dict` restored, for the optimizer to apply."""

    counters: Counters | None = None
    """The checkpoint's counters; None when it held no DiLoCoX state."""
    schedule: dict | None = None
    """The round schedule the checkpoint was trained with (``RoundSchedule.state_dict``; None in
    checkpoints written before it was recorded)."""
    without_diloco_state: str | None = None
    """Why the outer loop restarts from the loaded weights (a checkpoint without DiLoCoX state), or None."""


class OuterCheckpoint:
    """The DiLoCoX entries of the optimizer's state dicts, saved and loaded (module doc).

    Args:
        sync: the rank's outer state (its ``state_dict`` / ``load_state_dict``, and the per-replica
            tensors it holds: residual, eager anchor, launch point).
        view: the flat view of the rank's fp32 main shards (N elements; ``numel``, ``split``,
            ``copy_from_``).
        dist_opts: Megatron's distributed optimizers whose main shards ``view`` covers, in its order
            (their per-shard state, param groups and grad scalers are checkpointed per replica).
        topology: replica index, replicas R, rank in replica and ranks per replica.
        layout: where the rank's shard sits in its replica's concatenation (offset, T).
    """

    def __init__(self, sync: OuterSync, view: ShardView, dist_opts: list[DistributedOptimizer],
                 topology: Topology, layout: ShardLayout, outer_layout: ShardLayout | None = None) -> None:
        self.sync, self.view, self.dist_opts = sync, view, dist_opts
        #: ``layout``: the main shards' table (``param``, ``opt.*``); ``outer_layout``: the outer state's (theta,
        #: momentum, the exchange in flight, ``residual``, ``anchor``, ``launch``): the same but with the exchange
        #: by name, whose outer state lives over each rank's chunks
        self.topology, self.layout, self.outer_layout = topology, layout, outer_layout or layout
        # loading: what the checkpoint being loaded holds (sharded_state_dict reads its metadata) and the
        # fresh buffer its main shards are read into (load_state_dict copies it over the live shards)
        self._loading_contents: _CheckpointContents | None = None
        self._loading_main_params: torch.Tensor | None = None

    def _shards(self) -> Iterator[tuple[DistributedOptimizer, torch.Tensor]]:
        """(owning DistributedOptimizer, fp32 main shard) in the order of ``view`` (the optimizer's
        ``_main_params``: per optimizer, per param group, its params)."""
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
            kinds["residual"] = [(0, self.sync.committed_residual)]
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

    def replica_meta(self, counters: Counters) -> dict:
        """This replica's small non-tensor inner state (pickled as a ShardedObject): per shard, the
        optimizer state that is not shard-sized (torch Adam's 0-dim ``step``: skipped fp16 steps make it
        differ between replicas), each inner optimizer's param groups without ``params`` (TE/Apex Adam
        keep ``step`` there), its grad scaler state (fp16: scale, growth and hysteresis trackers
        follow the replica's own overflow history), the LR-schedule position and the rank's timings."""
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
            # the LR-schedule position: Megatron advances it on successful steps only (restart.LRSchedulePosition)
            "lr_schedule_steps": counters.lr_schedule_steps,
            # this replica's own timings (auto tau, budget, timeout): the live run agrees on tau by MAX
            # over every rank's, so each replica resumes with its own (the outer meta holds replica 0's)
            "timings": self.sync.timings(),
        }

    def state_dict(self, inner_sd: dict, counters: Counters) -> dict:
        """The non-sharded state dict: ``{"inner": inner_sd, "diloco_x": outer state, "diloco_x_replica":
        clones of this replica's own state}`` (completes an exchange in flight: collective over the outer
        group)."""
        outer = {"sync": self.sync.state_dict(), "step_calls": counters.step_calls,
                 "totals": vars(counters.totals).copy(), "schedule": self.sync.schedule.state_dict(),
                 "exchange_slots": list(self.sync.segments.bounds)}
        per_replica = {"tensors": {name: t.detach().clone() for name, t in self._inner_state_tensors()},
                       "meta": self.replica_meta(counters)}
        return {"inner": inner_sd, "diloco_x": outer, "diloco_x_replica": per_replica}

    def _sharded_diloco_state(self, contents: _CheckpointContents | None, counters: Counters | None) -> dict:
        """The DiLoCoX entries of the sharded state dict (module doc). ``contents``: None when saving
        (then ``counters`` are saved); when loading, what the checkpoint holds (only those entries are
        requested).

        Saving references the live tensors (no copy; completes an in-flight exchange, collective over
        the outer group). Loading reads in place into the live tensors, except the fp32 main shards,
        which are read into one fresh flat buffer (4 B per shard element, freed after the load) because
        with fp32 models they are views of the model parameters that Megatron's model entries load into
        in the same read; :meth:`load_state_dict` copies them over."""
        topo = self.topology
        r, n, m = topo.replica_index, self.view.numel, self.sync.view.numel
        offset, total = self.layout.checkpoint_span()
        spans = {"main": (offset, total), "outer": self.outer_layout.checkpoint_span()}
        pos_shape, pos_offset = (topo.ranks_per_replica,), (topo.rank_in_replica,)
        loading = contents is not None

        def outer_entry(name: str, t: torch.Tensor) -> ShardedTensor:
            at, whole = spans["outer"]
            return ShardedTensor(f"diloco_x.outer.{name}", t.detach(), t.dtype, (m,), (whole,), (at,),
                                 axis_fragmentations=None, replica_id=r)

        def replica_entry(kind: str, t: torch.Tensor, at: int) -> ShardedTensor:
            row = t.detach().view(1, -1)
            start, whole = spans["outer" if kind in OUTER_SIZED else "main"]
            return ShardedTensor(f"diloco_x.replica.{kind}", row, row.dtype, tuple(row.shape),
                                 (topo.replicas, whole), (r, start + at), axis_fragmentations=None, replica_id=0)

        if loading:
            live = {"theta": self.sync.theta, "momentum_buffer": self.sync.outer.momentum_buffer,
                    "pending_delta": self.sync.exchange_buffer}
            outer_tensors = {name: (live[name] if live.get(name) is not None else
                                    torch.empty(m, dtype=torch.float32, device=self.view.device))
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
            outer_tensors = {k: v for k, v in state.items() if _is_flat_shard(v, m)}
            outer_meta = {k: v for k, v in state.items() if k not in outer_tensors}
            outer_meta.update(format=CHECKPOINT_FORMAT, numel=m, tensors=sorted(outer_tensors),
                              exchange_slots=list(self.sync.segments.bounds),
                              step_calls=counters.step_calls, totals=vars(counters.totals).copy(),
                              schedule=self.sync.schedule.state_dict())
            kinds = self._replica_tensors()
            replica_meta = self.replica_meta(counters)
        entries: dict[str, Any] = {
            "outer.meta": ShardedObject("diloco_x.outer.meta", outer_meta, pos_shape, pos_offset, replica_id=r),
            "replica.meta": ShardedObject(f"diloco_x.replica{r}.meta", replica_meta, pos_shape, pos_offset,
                                          replica_id=0),
            "outer": {}, "replica": {},
        }
        if m > 0:  # a rank without main shards (or chunks) contributes no tensor piece
            entries["outer"] = {name: outer_entry(name, t) for name, t in outer_tensors.items()}
        entries["replica"] = {kind: [replica_entry(kind, t, at) for at, t in items] for kind, items in kinds.items()
                              if (m if kind in OUTER_SIZED else n) > 0}
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

    def sharded_state_dict(self, sd: dict, model_sharded_state_dict: dict, is_loading: bool,
                           counters: Counters) -> dict:
        """Megatron's inner sharded state ``sd`` plus the DiLoCoX entries under ``"diloco_x"`` (layout in
        the module doc; disk per model parameter with Adam and fp32 main params: 12 B per replica for its
        own inner state (+4 residual with a lossy codec, +4 anchor with eager) and 4-12 B once for
        theta, momentum and the in-flight exchange, on top of Megatron's own entries). ``counters``:
        what a save writes (unused when loading).

        Loading first reads the checkpoint's metadata (``args.load``) to request only what it holds:

        * a DiLoCoX checkpoint: Megatron's distributed-optimizer parameter state is not requested
          (each replica restores its own from ``diloco_x.replica.*``);
        * a plain Megatron checkpoint (written without ``--diloco-x``): only Megatron's entries, which
          every replica loads; :meth:`load_state_dict` then says the outer loop restarts from them.
        """
        self._loading_contents = None
        if not is_loading:
            sd["diloco_x"] = self._sharded_diloco_state(None, counters)
            self._megatron_entries_from_replica_zero(model_sharded_state_dict, sd)
            return sd
        contents = _read_checkpoint_contents(self)
        self._loading_contents = contents
        if contents.kind == "plain":
            return sd
        _drop_megatron_param_state(sd)
        sd["diloco_x"] = self._sharded_diloco_state(contents, None)
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, inner: MegatronOptimizer) -> Restored:
        """Restore from :meth:`state_dict` or from the loaded :meth:`sharded_state_dict`; returns the
        counters and the schedule for the optimizer to take, or why the outer loop restarts.

        Order: Megatron's inner load (``inner.load_state_dict``: param groups, step, grad scaler of
        replica 0; fp32 main params and moments only for a plain Megatron checkpoint), then this
        replica's own state over it (outer state, per-replica tensors, per-replica meta). The model
        params are not written: the caller publishes the main params."""
        state_dict = dict(state_dict)
        if "inner" in state_dict:  # plain state_dict() format
            per_replica = state_dict.get("diloco_x_replica")
            if per_replica is not None and "tensors" not in per_replica:
                raise RuntimeError(_EARLIER_FORMAT.format(where="this state dict"))
            inner.load_state_dict(state_dict["inner"])
            return self._load_outer_and_replica(state_dict["diloco_x"], per_replica)
        ours = state_dict.pop("diloco_x", None)
        inner.load_state_dict(state_dict)
        contents = self._loading_contents
        if ours is None:  # the outer loop restarts from these params (after_checkpoint_load)
            where = f"checkpoint {contents.path}" if contents is not None else "the state dict"
            return Restored(without_diloco_state=(
                f"{where} holds no DiLoCoX state (written without --diloco-x); inner optimizer state loaded "
                "as Megatron loads it"))
        outer_meta, replica_meta = ours["outer.meta"], ours["replica.meta"]
        if outer_meta.get("format") != CHECKPOINT_FORMAT:
            raise RuntimeError(f"unknown DiLoCoX checkpoint format {outer_meta.get('format')}")
        n, m = self.view.numel, self.sync.view.numel
        if int(outer_meta["numel"]) != m:
            raise ValueError(f"DiLoCoX checkpoint holds an outer shard of {outer_meta['numel']} elements, this "
                             f"rank owns {m}: resume with the same TP/PP/DP layout and --diloco-x-replicas")
        self._check_slots(outer_meta.get("exchange_slots"))
        loaded_outer = ours.get("outer", {})
        sync_state = {k: v for k, v in outer_meta.items() if k not in (
            "format", "numel", "tensors", "step_calls", "totals", "schedule", "exchange_slots")}
        for name in outer_meta["tensors"]:
            sync_state[name] = (loaded_outer[name] if m > 0 else
                                torch.empty(0, dtype=torch.float32, device=self.view.device))
        self.sync.load_state_dict(sync_state)  # copies onto itself where read in place
        fresh, self._loading_main_params = self._loading_main_params, None
        loaded = ours.get("replica", {})
        for kind, entries in self._replica_tensors().items():
            if kind != "param" and (m if kind in OUTER_SIZED else n) > 0:
                for (_, t), src in zip(entries, loaded[kind]):
                    if src.data_ptr() != t.data_ptr():  # not read in place (e.g. state reallocated)
                        t.copy_(src.view_as(t))
        if n > 0:
            if fresh is None:  # loaded through another path: copy the main shards piece by piece
                for (_, p), src in zip(self._replica_tensors()["param"], loaded["param"]):
                    p.detach().copy_(src.view_as(p))
            else:
                self.view.copy_from_(fresh)
        lr_steps = self._load_replica_meta(replica_meta)
        return Restored(Counters(int(outer_meta["step_calls"]), ExchangeStats(**outer_meta["totals"]), lr_steps),
                        outer_meta.get("schedule"))

    def _load_outer_and_replica(self, outer: dict | None, per_replica: dict | None) -> Restored:
        """Restore from the non-sharded :meth:`state_dict` format."""
        if outer is None or per_replica is None:
            raise RuntimeError("checkpoint has no DiLoCoX state for this replica: it was not written with "
                               "--diloco-x and the same --diloco-x-replicas; load it with --no-load-optim to "
                               "start a new outer loop from its weights")
        self._check_slots(outer.get("exchange_slots"))
        self.sync.load_state_dict(outer["sync"])
        tensors = per_replica["tensors"]
        names = [name for name, _ in self._inner_state_tensors()]
        missing = [name for name in names if name not in tensors]
        if missing:
            raise RuntimeError(
                f"checkpoint lacks this run's per-replica DiLoCoX state {missing[:3]}: it was written with "
                "another --diloco-x-compression / --diloco-x-overlap (error-feedback residual, eager "
                "anchor); resume with the flags it was written with, or load it with "
                "--no-load-optim to start a new outer loop from its weights")
        for name, t in self._inner_state_tensors():
            t.detach().copy_(tensors[name])
        lr_steps = self._load_replica_meta(per_replica["meta"])
        return Restored(Counters(int(outer["step_calls"]), ExchangeStats(**outer["totals"]), lr_steps),
                        outer.get("schedule"))

    def _check_slots(self, saved: list | None) -> None:
        """Refuse a checkpoint whose outer state is cut into other exchange slots (``--diloco-x-exchange-slots``:
        the outer vectors keep a rank's slots one after another, so another cut is another order)."""
        saved = tuple(saved) if saved is not None else (0, self.sync.view.numel)  # (older checkpoints: one slot)
        if saved != self.sync.segments.bounds:
            raise ValueError(f"DiLoCoX checkpoint holds this rank's outer state as {len(saved) - 1} exchange slot(s), "
                             f"this job cuts it into {self.sync.segments.k}: resume with the "
                             "--diloco-x-exchange-slots (or --diloco-x-exchange-chunks) and layout it was written with")

    def _load_replica_meta(self, meta: dict) -> int | None:
        """Restore :meth:`replica_meta` (after the inner optimizer's own load, which set replica 0's
        step counts, param groups and grad scaler); returns its LR-schedule position."""
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
        if meta.get("timings") is not None:  # (older checkpoints: replica 0's, from the outer meta)
            self.sync.load_timings(meta["timings"])
        return meta.get("lr_schedule_steps")


# ---------------------------------------------------------------------- checkpoint helpers

#: Version of the DiLoCoX entries in a torch_dist checkpoint (2: the layout in the module doc; 1, pickled
#: ShardedObjects, is not read).
CHECKPOINT_FORMAT = 2

#: The error for a checkpoint in the first DiLoCoX format (written by megatron-diloco before its
#: per-replica ShardedTensors), which this version does not read.
_EARLIER_FORMAT = ("{where} holds DiLoCoX state in the first checkpoint format (pickled objects, written by an "
                   "earlier megatron-diloco), which this version does not read: load it with --no-load-optim to "
                   "start a new outer loop from its weights, or resume with the version that wrote it")


#: the per-replica kinds laid out as the outer state (over the rank's chunks with the exchange by name)
OUTER_SIZED = ("residual", "anchor", "launch")


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
    """``"diloco"`` (format 2) or ``"plain"`` (no DiLoCoX state: written without ``--diloco-x``)."""
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


def _read_checkpoint_contents(ckpt: OuterCheckpoint) -> _CheckpointContents:
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
    outer, replica = {}, {}
    for key, entry in metadata.items():
        if key.startswith("diloco_x.outer.") and isinstance(entry, ShardedTensor):
            outer[key[len("diloco_x.outer."):]] = tuple(entry.global_shape)
        elif key.startswith("diloco_x.replica.") and isinstance(entry, ShardedTensor):
            replica[key[len("diloco_x.replica."):]] = tuple(entry.global_shape)
        elif key.startswith("diloco_x.outer/"):  # format 1: one pickled ShardedObject per rank position
            raise RuntimeError(_EARLIER_FORMAT.format(where=f"checkpoint {path}"))
    if outer:
        _, total = ckpt.layout.checkpoint_span()
        _, outer_total = ckpt.outer_layout.checkpoint_span()  # (the exchange by name: every chunk's elements)
        want_outer, want_replica = (outer_total,), (ckpt.topology.replicas, total)
        bad = {k: s for k, s in outer.items() if s != want_outer}
        bad.update({k: s for k, s in replica.items()
                    if s != ((ckpt.topology.replicas, outer_total) if k in OUTER_SIZED else want_replica)})
        if bad:
            raise RuntimeError(
                f"DiLoCoX checkpoint {path} was written with another layout: entries {bad} vs this run's outer "
                f"{want_outer} / per-replica {want_replica} (replicas, main-shard elements per replica); resume "
                "with the --diloco-x-replicas and TP/PP/DP layout it was written with, or load it with "
                "--no-load-optim to start a new outer loop from its weights")
        return _CheckpointContents(path, "diloco", tuple(sorted(outer)), tuple(sorted(replica)))
    return _CheckpointContents(path, "plain")
