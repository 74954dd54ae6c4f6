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

The checkpoint tests' recorder: ``checkpoint.py``; the separate jobs': ``federation.py``. Nothing
here changes training.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.link_model import crosses_replicas

from .base import Recorder, fingerprint_ints, record_losses, wrap

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
            spans = crosses_replicas(ranks, per)

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
                [opt.step_calls, [fingerprint_ints([t])[0] for t in opt.view.shards]])
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
                "main": fingerprint_ints(opt.view.shards),
                "model": fingerprint_ints(p for d in opt.dist_opts for c in d.model_chunks for p in c.parameters())}

        @wrap(DiLoCoXOptimizer, "load_state_dict")
        def load_state_dict(orig, opt, state_dict):
            orig(opt, state_dict)
            record["loaded_fp"] = [opt.step_calls, [fingerprint_ints([t])[0] for t in opt.view.shards]]

        record_losses(training, record["losses"])


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched on this thread while :attr:`active`."""

    def __init__(self) -> None:
        super().__init__()
        self.n, self.active = 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.n += 1
        return func(*args, **(kwargs or {}))
