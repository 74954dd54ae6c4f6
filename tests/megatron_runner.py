"""Run ``examples/pretrain_gpt_diloco.py`` under test instrumentation (one process per rank).

Used by the Megatron-level tests (ranks started by ``megatron_utils.launch``). On top of the
unmodified example it records, per rank, into ``$DILOCO_TEST_OUT/rank{R}.json``:

* ``losses``: the loss of every iteration at full precision (last pipeline stage only);
* ``boundary_identical``: after each DiLoCoX boundary, whether the replicas are bit-identical
  (None with a low-rank codec while its exchange runs on the worker thread);
* ``cross_replica``: every collective or P2P op issued during the training loop (``train``, setup
  and the final summary excluded) on a process group spanning more than one replica, counted by a
  process-group pre-hook (below every Python alias), with its iteration, whether it ran inside
  ``train_step`` / the outer boundary (``OuterSync``), and the issuing thread;
* ``main_fp``: after every optimizer step, a bitwise fingerprint of each fp32 main-parameter shard;
  ``loaded_fp``: the same right after a checkpoint was loaded.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from megatron_diloco.harness import run_script, wrap  # noqa: E402

record = {"losses": [], "boundary_identical": [], "cross_replica": []}
ctx = {"in_train": False, "in_train_step": False, "in_boundary": False, "iteration": 0, "instrumenting": False}
_HOOK_ID = 7211  # our pre-hook's id on every process group


def _replica_blocks() -> int:
    argv = sys.argv
    if "--no-diloco-x" in argv:
        return int(os.environ.get("DILOCO_TEST_REPLICAS", "2"))
    r = 2
    for i, a in enumerate(argv):
        if a == "--diloco-x-replicas":
            r = int(argv[i + 1])
    return r


def _count_cross_replica_traffic() -> None:
    """Register a pre-hook on every process group of this process: each collective or P2P op
    issued on a group spanning several replicas (for send/recv: to a peer in another replica) while
    the training loop runs is recorded with the iteration, whether it ran inside ``train_step`` and
    inside the outer boundary, and the issuing thread. Hooks sit below every Python alias
    (``dist_all_gather_func``, coalescing managers, ...), so nothing issued through torch escapes."""
    per = dist.get_world_size() // _replica_blocks()
    for group in list(dist.distributed_c10d._world.pg_map):
        ranks = dist.get_process_group_ranks(group)
        spans = len({r // per for r in ranks}) > 1

        def hook(args, ranks=ranks, spans=spans) -> None:
            if not ctx["in_train"] or ctx["instrumenting"] or not spans:
                return
            op = str(args.name).rsplit(".", 1)[-1].lower()
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


def instrument() -> None:
    import megatron.training.training as training

    from megatron_diloco import sync as sync_mod
    from megatron_diloco.optimizer import DiLoCoXOptimizer
    from megatron_diloco.shard_view import fingerprint
    from megatron_diloco.config import CODECS

    @wrap(training, "train")  # the whole training loop, setup and the final summary excluded
    def train(orig, *a, **k):
        _count_cross_replica_traffic()
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
        try:
            return orig(*a, **k)
        finally:
            ctx["in_train_step"] = False

    def mark_boundary(orig, self):
        ctx["in_boundary"] = True
        try:
            return orig(self)
        finally:
            ctx["in_boundary"] = False

    # the boundary itself, and the start-weights check that opens the first one
    for owner, name in ((sync_mod.OuterSync, "boundary"), (DiLoCoXOptimizer, "_check_replicas_started_alike")):
        wrap(owner, name)(mark_boundary)

    @wrap(DiLoCoXOptimizer, "round_metrics")
    def round_metrics(orig, self, report):
        ctx["in_boundary"] = True
        try:
            out = orig(self, report)
            if CODECS[self.diloco_config.compression].matrix and self.sync.pending is not None:
                # The low-rank exchange runs on a worker thread that owns the outer group until it
                # completes, and the check all-gathers on that group: skip it (None) rather than
                # wait, so that a checkpoint can still catch the exchange in flight.
                record["boundary_identical"].append([self.step_calls, None])
            else:
                ctx["instrumenting"] = True  # the check's own collectives are not training traffic
                try:
                    record["boundary_identical"].append([self.step_calls, self.replicas_identical()])
                finally:
                    ctx["instrumenting"] = False
        finally:
            ctx["in_boundary"] = False
        return out

    @wrap(DiLoCoXOptimizer, "step")
    def opt_step(orig, self):
        out = orig(self)
        if "outer" not in record:
            theta = self.sync.theta
            record["outer"] = {
                "theta_numel": theta.numel(), "theta_dtype": str(theta.dtype),
                "momentum_numel": (self.sync.outer.momentum_buffer.numel()
                                   if self.sync.outer.momentum_buffer is not None else 0),
                "main_shard_numel": sum(t.numel() for t in self.view.shards),
                "model_params_on_rank": sum(p.numel() for d in self.dist_opts for c in d.model_chunks
                                            for p in c.parameters()),
            }
        record.setdefault("main_fp", []).append([self.step_calls, [int(fingerprint([t])[0]) for t in self.view.shards]])
        return out

    @wrap(DiLoCoXOptimizer, "load_state_dict")
    def load_state_dict(orig, self, state_dict):
        orig(self, state_dict)
        record["loaded_fp"] = [self.step_calls, [int(fingerprint([t])[0]) for t in self.view.shards]]

    @wrap(training, "training_log")
    def training_log(orig, loss_dict, *a, **k):
        if loss_dict:
            iteration = k["iteration"] if "iteration" in k else a[2]
            record["losses"].append([iteration, {key: float(v) for key, v in loss_dict.items()}])
        return orig(loss_dict, *a, **k)


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


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code (gloo, torch) prints every thread's Python stack
    # The example applies the CPU shim on import; instrument after Megatron is importable.
    from megatron_diloco.compat import cpu as cpu_compat

    if cpu_compat.cpu_mode():
        cpu_compat.apply()
    instrument()
    _spawned_helpers_skip_the_example()
    run_script(sys.argv[1:], record, os.environ.get("DILOCO_TEST_OUT"))


if __name__ == "__main__":
    main()
