"""The tests' recorders: ``harness/run.py --record NAME,...``.

* ``training`` (the Megatron-level tests; :class:`TrainingRecorder`), per rank:

  * ``losses``: the loss of every iteration at full precision (last pipeline stage only), as
    ``[iteration, {loss name: value}]``;
  * ``boundary_identical``: after each DiLoCoX boundary, whether the replicas are bit-identical
    (None with a low-rank codec while its exchange runs on the worker thread);
  * ``cross_replica``: every collective or P2P op issued during the training loop (``train``, setup
    and the final summary excluded) on a process group spanning more than one replica, counted by a
    process-group pre-hook (below every Python alias), with its iteration, whether it ran inside
    ``train_step`` / the outer boundary (``OuterSync``), and the issuing thread;
  * ``replica_gathers``: ``{iteration: n}``, all-gathers issued on groups inside one replica (the
    intra-replica DP group's parameter gathers), counted by the same pre-hooks;
  * ``outer``: sizes of the outer state after the first step, and whether the exchange buffer
    (exchange_buffer) is held in host memory;
  * ``step_ops``: per optimizer step, ``[step_calls, n, outer_work]``: ``n`` the tensor operations
    (aten ops, counted by a dispatch mode on the training thread) that ``DiLoCoXOptimizer.step``
    dispatched outside the inner optimizer's own step, and whether the step ran outer work (a
    boundary or ``partial``'s landing);
  * ``rounds``: per boundary, the rank's ``DiLoCoXOptimizer.round_metrics`` (``step``, ``bytes_sent``:
    the wire bytes of the exchange applied in that round, ...);
  * ``step_time``: per boundary, ``[step_calls, mean inner-step time]`` as the optimizer measured it for
    that round (``OuterSync.step_time_s``); ``train_step_s``: ``[iteration, seconds]``, the wall time
    of every ``train_step`` call (DiLoCoX's own wrapper inside);
  * ``main_fp``: after every optimizer step, a bitwise fingerprint of each fp32 main-parameter shard;
    ``loaded_fp``: the same right after a checkpoint was loaded;
  * ``final_fp``: after the end of training (``DiLoCoXOptimizer.finish``), ``{"main", "model"}``:
    fingerprints of the rank's fp32 main shards and of its model parameters (absent when the run
    did not finish: interrupted, failed);
  * ``refused_attrs``: every name read from the ``DiLoCoXOptimizer`` that it neither has nor forwards
    to Megatron's optimizer (``megatron_adapter.forwarding.FORWARDED``), ``[name, caller file:line]``:
    empty when the forwarded list covers what the run read.

  Environment: ``DILOCO_TEST_PERTURB_REPLICA=R`` perturbs replica R's start weights (a replica that
  loaded other weights); ``DILOCO_TEST_STACKS=1`` adds each cross-replica op's call stack;
  ``DILOCO_TEST_REPLICAS`` the replica blocks of a ``--no-diloco-x`` run (default 2);
  ``DILOCO_TEST_EVAL_SLEEP_S=S`` makes every evaluation (``evaluate_and_print_results``) S seconds
  longer (work between iterations that the round's step time must not count).

* ``checkpoint`` (the checkpoint tests and ``benchmarks/memory/checkpoint_memory.py``;
  :class:`CheckpointRecorder`), per rank:

  * ``scaler``: after every training iteration (global iteration number, also after a resume),
    ``[iteration, update_successful, scale, growth_tracker, hysteresis_tracker]`` of this rank's
    grad scaler (fp16 runs only; DiLoCoX and plain runs alike);
  * ``adam_step``: after every iteration, the torch-Adam ``step`` count of this rank's first main shard;
  * ``save_memory``: one entry per ``save_checkpoint`` call: ``rss_before`` (bytes, VmRSS before),
    ``rss_peak`` (VmHWM during the call, after resetting the high-water mark through
    ``/proc/self/clear_refs``), ``peak_delta`` = peak - before, and ``torch_peak_delta`` (the CUDA
    allocator's peak over the call when on GPU, else None). Linux only (None elsewhere);
  * ``main_shard_numel``: the rank's fp32 main-shard elements (DiLoCoX and plain runs);
  * ``model_fp``: after every iteration, ``[iteration, fingerprint]`` of all the rank's model
    parameters (:func:`megatron_diloco.algorithm.shard_view.fingerprint`); ``loaded_model_fp``: the same right
    after ``load_checkpoint`` returned; ``opt_fp`` / ``loaded_opt_fp``: the same for the shard-sized
    optimizer state (Adam moments) of the rank's main shards;
  * ``save_entries``: per save, what DiLoCoX adds to the sharded state dict: the number of
    ShardedTensors, their bytes, how many of them alias a live tensor (main shard, optimizer state,
    outer state: not a copy), the pickled size of each ShardedObject (skipped with
    ``DILOCO_CKPT_OBJECT_SIZES=0``: serializing them allocates), and the rank's shard numel;
  * ``restart``: the reason string of each ``DiLoCoXOptimizer.restart_outer_loop_from_params`` call;
  * ``timings_saved``: per save (``OuterCheckpoint.replica_meta``), ``[step_calls, timings]`` of the
    rank's ``OuterSync`` (``[step time, [last exchange bytes, seconds] or None, longest exchange]``:
    what auto tau is sized from);
    ``timings_loaded``: the same right after a checkpoint was loaded.

  Environment: ``DILOCO_TEST_RESTART_AFTER_STEP=N`` calls ``restart_outer_loop_from_params`` on every
  rank right after the N-th ``step()`` (once): a new outer loop started mid-run.

Nothing here changes training.
"""

from __future__ import annotations

import faulthandler
import io
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .base import Recorder, proc_status_bytes, wrap

_HOOK_ID = 7211  # our pre-hook's id on every process group


def _replica_blocks() -> int:
    argv = sys.argv
    if "--diloco-x-outer-store" in argv or "--diloco-x-lighthouse" in argv:  # this world is one replica (replicas as separate launches)
        return 1
    if "--no-diloco-x" in argv:
        return int(os.environ.get("DILOCO_TEST_REPLICAS", "2"))
    r = 2
    for i, a in enumerate(argv):
        if a == "--diloco-x-replicas":
            r = int(argv[i + 1])
    return r


def _spawned_helpers_skip_the_example() -> None:
    """Megatron's checkpoint writer starts a ``multiprocessing`` Manager (spawn context) in each rank
    at its first save. A spawned process first re-runs the parent's ``__main__`` module, here the
    example (torch + Megatron imports: ~8 s of CPU per rank, most of a tiny save on 2 cores), which
    the Manager (a queue server) never uses. Test processes only: their spawned helpers start without
    the main module."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = get_preparation_data


class TrainingRecorder(Recorder):
    """Losses, boundary checks, cross-replica traffic and shard fingerprints (module docstring)."""

    name = "training"
    keys = ("losses", "boundary_identical", "cross_replica", "replica_gathers", "outer", "main_fp", "loaded_fp",
            "step_ops", "step_time", "train_step_s", "rounds", "final_fp", "refused_attrs")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record.update(losses=[], boundary_identical=[], cross_replica=[], replica_gathers={}, step_ops=[],
                      step_time=[], train_step_s=[], rounds=[], refused_attrs=[])
        self.ctx = {"in_train": False, "in_train_step": False, "in_boundary": False, "iteration": 0,
                    "instrumenting": False}

    def count_cross_replica_traffic(self) -> None:
        """Register a pre-hook on every process group of this process: each collective or P2P op
        issued on a group spanning several replicas (for send/recv: to a peer in another replica)
        while the training loop runs is recorded with the iteration, whether it ran inside
        ``train_step`` and inside the outer boundary, and the issuing thread. Hooks sit below every
        Python alias (``dist_all_gather_func``, coalescing managers, ...), so nothing issued through
        torch escapes."""
        ctx, record = self.ctx, self.record
        per = dist.get_world_size() // _replica_blocks()
        for group in list(dist.distributed_c10d._world.pg_map):
            ranks = dist.get_process_group_ranks(group)
            spans = len({r // per for r in ranks}) > 1

            def hook(args, ranks=ranks, spans=spans) -> None:
                if not ctx["in_train"] or ctx["instrumenting"]:
                    return
                op = str(args.name).rsplit(".", 1)[-1].lower()
                if not spans:  # inside one replica: count the all-gathers (the params') per iteration
                    if "gather" in op and len(ranks) > 1:
                        it = str(ctx["iteration"])
                        record["replica_gathers"][it] = record["replica_gathers"].get(it, 0) + 1
                    return
                if op in ("send", "recv"):
                    if args.root < 0 or ranks[args.root] // per == dist.get_rank() // per:
                        return
                record["cross_replica"].append({
                    "op": op, "iteration": ctx["iteration"], "in_train_step": ctx["in_train_step"],
                    "in_boundary": ctx["in_boundary"], "thread": threading.current_thread().name,
                    "group_size": len(ranks)})
                if os.environ.get("DILOCO_TEST_STACKS"):  # where each op came from (debugging aid)
                    record["cross_replica"][-1]["stack"] = traceback.format_stack(limit=8)[:-1]

            group.register_pre_hook(_HOOK_ID, hook)

    def install(self) -> None:
        import megatron.training.training as training

        from megatron_diloco.algorithm import sync as sync_mod
        from megatron_diloco.algorithm.config import CODECS
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer
        from megatron_diloco.algorithm.shard_view import fingerprint

        faulthandler.enable()  # a crash in native code (gloo, torch) prints every thread's Python stack
        _spawned_helpers_skip_the_example()
        ctx, record = self.ctx, self.record

        @wrap(training, "train")  # the whole training loop, setup and the final summary excluded
        def train(orig, *a, **k):
            self.count_cross_replica_traffic()
            ctx["in_train"] = True
            try:
                return orig(*a, **k)
            finally:
                ctx["in_train"] = False

        @wrap(training, "setup_model_and_optimizer")
        def setup_model_and_optimizer(orig, *a, **k):
            out = orig(*a, **k)
            replica = os.environ.get("DILOCO_TEST_PERTURB_REPLICA")  # simulate a replica that loaded
            opt = out[1]                                             # other weights than the rest
            if replica is not None and isinstance(opt, DiLoCoXOptimizer) and \
                    opt.topology.replica_index == int(replica):
                opt.view.shards[0].data.add_(1e-3)
                opt.restart_outer_loop_from_params("test: replica perturbed")
            return out

        @wrap(training, "train_step")  # install() wraps it again: DiLoCoX's runs inside ours
        def train_step(orig, *a, **k):
            ctx["iteration"] += 1
            ctx["in_train_step"] = True
            started = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                ctx["in_train_step"] = False
                record["train_step_s"].append([ctx["iteration"], time.perf_counter() - started])

        sleep_s = float(os.environ.get("DILOCO_TEST_EVAL_SLEEP_S", "0"))
        if sleep_s:
            @wrap(training, "evaluate_and_print_results")
            def evaluate_and_print_results(orig, *a, **k):
                time.sleep(sleep_s)
                return orig(*a, **k)

        def mark_boundary(orig, opt_or_sync):
            ctx["in_boundary"] = True
            try:
                return orig(opt_or_sync)
            finally:
                ctx["in_boundary"] = False

        # the boundary itself, and the start-weights check that opens the first one
        for owner, name in ((sync_mod.OuterSync, "boundary"), (DiLoCoXOptimizer, "_check_replicas_started_alike")):
            wrap(owner, name)(mark_boundary)

        @wrap(DiLoCoXOptimizer, "round_metrics")
        def round_metrics(orig, opt, report):
            ctx["in_boundary"] = True
            try:
                out = orig(opt, report)
                record["step_time"].append([opt.step_calls, opt.sync.step_time_s])
                record["rounds"].append(dict(out))
                if CODECS[opt.diloco_config.compression].matrix and opt.sync.pending is not None:
                    # The low-rank exchange runs on a worker thread that owns the outer group until it
                    # completes, and the check all-gathers on that group: skip it (None) rather than
                    # wait, so that a checkpoint can still catch the exchange in flight.
                    record["boundary_identical"].append([opt.step_calls, None])
                else:
                    ctx["instrumenting"] = True  # the check's own collectives are not training traffic
                    try:
                        record["boundary_identical"].append([opt.step_calls, opt.replicas_identical()])
                    finally:
                        ctx["instrumenting"] = False
            finally:
                ctx["in_boundary"] = False
            return out

        @wrap(DiLoCoXOptimizer, "step")
        def opt_step(orig, opt):
            counter, outer_work = _OpCounter(), []
            inner_step, boundary, merge = opt.inner.step, opt._boundary, opt._merge

            def paused(*a, **k):  # the inner optimizer's own step is Megatron's, not counted
                counter.active = False
                try:
                    return inner_step(*a, **k)
                finally:
                    counter.active = True

            def outer(fn):
                def run(*a, **k):
                    outer_work.append(fn.__name__)
                    return fn(*a, **k)
                return run

            opt.inner.step, opt._boundary, opt._merge = paused, outer(boundary), outer(merge)
            try:
                with counter:
                    out = orig(opt)
            finally:
                del opt.inner.step, opt._boundary, opt._merge  # the class's methods again
            record["step_ops"].append([opt.step_calls, counter.n, bool(outer_work)])
            if "outer" not in record:
                theta = opt.sync.theta
                record["outer"] = {
                    "theta_numel": theta.numel(), "theta_dtype": str(theta.dtype),
                    "momentum_numel": (opt.sync.outer.momentum_buffer.numel()
                                       if opt.sync.outer.momentum_buffer is not None else 0),
                    "main_shard_numel": sum(t.numel() for t in opt.view.shards),
                    "delta_held": opt.sync.store.held(opt.sync.exchange_buffer),  # the exchange buffer in host memory
                    # the exchange runs on the outer group's gloo mirror, not on the outer group itself
                    "exchange_on_mirror": opt.sync.exchange_group is not opt.sync.group,
                    # the replica's ranks that share the site's link (--diloco-x-bandwidth-mbps / S each)
                    "link_sharers": opt.sync.link_sharers,
                    "model_params_on_rank": sum(p.numel() for d in opt.dist_opts for c in d.model_chunks
                                                for p in c.parameters()),
                    # distinct model chunks of the rank (virtual pipeline stages)
                    "model_chunks": len({id(c) for d in opt.dist_opts for c in d.model_chunks}),
                }
            record.setdefault("main_fp", []).append(
                [opt.step_calls, [int(fingerprint([t])[0]) for t in opt.view.shards]])
            return out

        @wrap(DiLoCoXOptimizer, "__getattr__")  # reached only for names neither had nor forwarded
        def refused(orig, opt, name):
            caller = sys._getframe(2)  # (1: the harness's wrapper)
            record["refused_attrs"].append([name, f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"])
            return orig(opt, name)

        @wrap(DiLoCoXOptimizer, "finish")
        def finish(orig, opt):
            orig(opt)
            record["final_fp"] = {  # the model every replica ends with (compare across replicas)
                "main": [int(x) for x in fingerprint(opt.view.shards)],
                "model": [int(x) for x in fingerprint([p for d in opt.dist_opts for c in d.model_chunks
                                                       for p in c.parameters()])]}

        @wrap(DiLoCoXOptimizer, "load_state_dict")
        def load_state_dict(orig, opt, state_dict):
            orig(opt, state_dict)
            record["loaded_fp"] = [opt.step_calls, [int(fingerprint([t])[0]) for t in opt.view.shards]]

        _record_losses(training, record)


def _record_losses(training, record: dict[str, Any]) -> None:
    """``record["losses"]``: every iteration's loss at full precision, as Megatron's ``training_log`` gets it."""

    @wrap(training, "training_log")
    def training_log(orig, loss_dict, *a, **k):
        if loss_dict:
            iteration = k["iteration"] if "iteration" in k else a[2]
            record["losses"].append([iteration, {key: float(v) for key, v in loss_dict.items()}])
        return orig(loss_dict, *a, **k)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched on this thread while :attr:`active`."""

    def __init__(self) -> None:
        super().__init__()
        self.n, self.active = 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0: ``5`` to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class CheckpointRecorder(Recorder):
    """Grad scaler, Adam steps, save memory, fingerprints around saves and loads (module docstring)."""

    name = "checkpoint"
    keys = ("scaler", "adam_step", "save_memory", "main_shard_numel", "model_fp", "loaded_model_fp",
            "opt_fp", "loaded_opt_fp", "save_entries", "restart", "timings_saved", "timings_loaded")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        self.iteration = 0  # train_step calls in this process (as the training recorder counts them)

    def install(self) -> None:
        import torch
        from megatron.training import checkpointing, training

        from megatron_diloco.megatron_adapter.checkpoint import OuterCheckpoint
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer, distributed_optimizers
        from megatron_diloco.algorithm.shard_view import fingerprint

        record = self.record

        def opt_fp(opt) -> list[int]:
            """Bitwise fingerprint of the shard-sized optimizer state (e.g. Adam moments) of all main shards."""
            ts = [v for d in distributed_optimizers(getattr(opt, "inner", opt)) for g in d.optimizer.param_groups
                  for p in g["params"] for _, v in sorted(d.optimizer.state.get(p, {}).items())
                  if isinstance(v, torch.Tensor) and v.shape == p.shape]
            return [int(x) for x in fingerprint(ts)] if ts else []

        def model_fp(model) -> list[int]:
            """Bitwise fingerprint of every parameter of this rank's model chunks (its pipeline stage)."""
            return [int(x) for x in fingerprint([p for chunk in model for p in chunk.parameters()])]

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            self.iteration += 1
            out = orig(*a, **k)
            opt = a[3] if len(a) > 3 else k["optimizer"]
            opt = getattr(opt, "inner", opt)  # DiLoCoXOptimizer -> Megatron's optimizer
            d = distributed_optimizers(opt)[0]
            record.setdefault("main_shard_numel", sum(p.numel() for d_ in distributed_optimizers(opt)
                                                      for g in d_.optimizer.param_groups for p in g["params"]))
            # the global iteration this step completes (also after a resume)
            iteration = k["iteration"] + 1 if k.get("iteration") is not None else self.iteration
            if d.grad_scaler is not None:
                sd = d.grad_scaler.state_dict()
                record.setdefault("scaler", []).append([
                    iteration, not bool(out[1]), float(sd["scale"].item()),
                    int(sd.get("growth_tracker", -1)), int(sd.get("hysteresis_tracker", -1))])
            first = next((p for g in d.optimizer.param_groups for p in g["params"]), None)
            st = d.optimizer.state.get(first, {}) if first is not None else {}
            if "step" in st:
                record.setdefault("adam_step", []).append([iteration, float(st["step"])])
            record.setdefault("model_fp", []).append([iteration, model_fp(a[2] if len(a) > 2 else k["model"])])
            record.setdefault("opt_fp", []).append([iteration, opt_fp(a[3] if len(a) > 3 else k["optimizer"])])
            return out

        def load_checkpoint(orig, model, *a, **k):
            out = orig(model, *a, **k)
            record["loaded_model_fp"] = model_fp(model)
            optimizer = a[0] if a else k.get("optimizer")
            if optimizer is not None:
                record["loaded_opt_fp"] = opt_fp(optimizer)
            return out

        for module in (checkpointing, training):
            wrap(module, "load_checkpoint")(load_checkpoint)

        def save_checkpoint(orig, *a, **k):
            on_gpu = torch.cuda.is_available()
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                cuda_before = torch.cuda.memory_allocated()
            before = proc_status_bytes("VmRSS")
            reset = _reset_peak_rss()
            out = orig(*a, **k)
            peak = proc_status_bytes("VmHWM") if reset else None
            entry = {"iteration": self.iteration, "rss_before": before, "rss_peak": peak,
                     "peak_delta": (peak - before) if peak is not None and before is not None else None,
                     "torch_peak_delta": None}
            if on_gpu:
                torch.cuda.synchronize()
                entry["torch_peak_delta"] = torch.cuda.max_memory_allocated() - cuda_before
            record.setdefault("save_memory", []).append(entry)
            return out

        # training.py imported save_checkpoint by name: wrap both references
        for module in (checkpointing, training):
            wrap(module, "save_checkpoint")(save_checkpoint)

        @wrap(DiLoCoXOptimizer, "sharded_state_dict")
        def sharded_state_dict(orig, opt, model_sd, is_loading=False, **k):
            sd = orig(opt, model_sd, is_loading, **k)
            if not is_loading:
                from megatron.core.dist_checkpointing.dict_utils import nested_values
                from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

                live = {t.data_ptr() for d in opt.dist_opts for g in d.optimizer.param_groups for p in g["params"]
                        for t in [p, *[v for v in d.optimizer.state.get(p, {}).values()
                                       if isinstance(v, torch.Tensor)]]}
                live |= {t.data_ptr() for t in (opt.sync.theta, opt.sync.outer.momentum_buffer, opt.sync.exchange_buffer,
                                               opt.sync.residual, opt.sync.eager_anchor) if t is not None}
                ours = [v for key, v in sd.items() if str(key).startswith("diloco_x")]
                tensors = [v for v in nested_values(ours) if isinstance(v, ShardedTensor)]
                objects = [v for v in nested_values(ours) if isinstance(v, ShardedObject)]
                sizes = []  # serializing allocates: off for memory measurements (DILOCO_CKPT_OBJECT_SIZES=0)
                for obj in objects if os.environ.get("DILOCO_CKPT_OBJECT_SIZES", "1") == "1" else ():
                    buf = io.BytesIO()
                    torch.save(obj.data, buf)
                    sizes.append(buf.tell())
                record.setdefault("save_entries", []).append({
                    "tensors": len(tensors),
                    "tensor_bytes": sum(t.data.numel() * t.data.element_size() for t in tensors),
                    "aliased": sum(t.data.data_ptr() in live for t in tensors),
                    "object_bytes": sizes,
                    "shard_numel": opt.view.numel,
                })
            return sd

        @wrap(DiLoCoXOptimizer, "restart_outer_loop_from_params")
        def restart(orig, opt, reason, *a, **k):
            record.setdefault("restart", []).append(str(reason))
            return orig(opt, reason, *a, **k)

        def timings(opt) -> list:
            sync, last = opt.sync, opt.sync.last_completed
            return [sync.step_time_s, None if last is None else [last.bytes_sent, last.exchange_s],
                    sync.longest_exchange_s]

        @wrap(OuterCheckpoint, "replica_meta")  # called when a checkpoint is written
        def replica_meta(orig, codec, counters):
            record.setdefault("timings_saved", []).append([counters.step_calls, timings(codec)])
            return orig(codec, counters)

        @wrap(DiLoCoXOptimizer, "load_state_dict")
        def load_state_dict(orig, opt, state_dict):
            orig(opt, state_dict)
            record["timings_loaded"] = [opt.step_calls, timings(opt)]

        restart_after = int(os.environ.get("DILOCO_TEST_RESTART_AFTER_STEP", "0"))
        if restart_after:
            done = []

            @wrap(DiLoCoXOptimizer, "step")
            def step(orig, opt):
                out = orig(opt)
                if opt.step_calls == restart_after and not done:
                    done.append(True)
                    opt.restart_outer_loop_from_params(f"test: restart after step {restart_after}")
                return out


class FederationRecorder(Recorder):
    """Separate jobs (``--diloco-x-lighthouse``), per rank, with no collective of its own (a peer may die
    at any time): ``losses`` (as the training recorder's), ``fed_rounds``: per boundary ``[step_calls,
    theta fingerprint, members, failed, committed rounds, wall time, the meeting's seconds, the
    replica's exchange seconds of the round]`` after the boundary (theta as every member
    must hold it then); ``final_fp``: the fp32 main shards' fingerprint after the end of training;
    ``heals``: per heal received, its transfer's seconds and the bytes of the tensors in it.
    ``DILOCO_TEST_STEP_SLEEP_S=S``: every iteration S seconds longer (time to kill, stop and restart
    jobs mid-run without more compute). Faults at named protocol points: ``DILOCO_X_FAULT``
    (:mod:`megatron_diloco.algorithm.faults`)."""

    name = "federation"
    keys = ("losses", "fed_rounds", "final_fp", "heals")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record.update(losses=[], fed_rounds=[])

    def install(self) -> None:
        from megatron.training import training

        from megatron_diloco.algorithm.shard_view import fingerprint
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        record = self.record

        @wrap(DiLoCoXOptimizer, "round_metrics")
        def round_metrics(orig, opt, report):
            out = orig(opt, report)
            fed = opt.federation
            if fed is None:  # one world (the benchmark's comparison runs)
                return out
            record["fed_rounds"].append([opt.step_calls, [int(x) for x in opt.sync.fingerprint([opt.sync.theta])],
                                         fed.members, fed.failed, fed.committed, time.time(),
                                         fed.stats["last_meeting_s"], out.get("replica_exchange_s")])
            return out

        from megatron_diloco.federation.transport import SealedTransport

        @wrap(SealedTransport, "fetch")
        def fetch(orig, transport, *a, **k):  # a heal's transfer: its seconds and bytes
            started = time.perf_counter()
            state = orig(transport, *a, **k)
            tensors = [t for t in (state.get("theta"), state.get("momentum_buffer"), state.get("pending"))
                       if t is not None]
            record.setdefault("heals", []).append({"s": time.perf_counter() - started, "at": time.time(),
                                                   "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors)})
            return state

        @wrap(DiLoCoXOptimizer, "finish")
        def finish(orig, opt):
            orig(opt)
            record["final_fp"] = {"main": [int(x) for x in fingerprint(opt.view.shards)], "steps": opt.step_calls}

        _record_losses(training, record)

        pause = float(os.environ.get("DILOCO_TEST_STEP_SLEEP_S", "0"))
        if pause > 0:  # longer iterations without more compute (the jobs share two cores)
            @wrap(training, "train_step")
            def train_step(orig, *a, **k):
                time.sleep(pause)
                return orig(*a, **k)

