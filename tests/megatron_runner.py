"""Run ``examples/pretrain_gpt_diloco.py`` under test instrumentation (one process per rank).

Used by the Megatron-level tests through torchrun. On top of the unmodified example it records, per
rank, into ``$DILOCO_TEST_OUT/rank{R}.json``:

* ``losses``: the loss of every iteration at full precision (last pipeline stage only);
* ``boundary_identical``: after each DiLoCoX boundary, whether the replicas are bit-identical
  (None with a low-rank codec while its exchange runs on the worker thread);
* ``cross_replica``: every collective launched inside ``train_step`` on a group that spans more than
  one replica, tagged with whether it ran inside the outer boundary (``OuterSync``);
* ``main_fp``: after every optimizer step, a bitwise fingerprint of each fp32 main-parameter shard;
  ``loaded_fp``: the same right after a checkpoint was loaded.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from megatron_diloco.harness import run_script, wrap  # noqa: E402

record = {"losses": [], "boundary_identical": [], "cross_replica": []}
ctx = {"in_train_step": False, "in_boundary": False, "iteration": 0}

# isend/irecv are not wrapped: P2POp checks their identity. Pipeline P2P goes through
# batch_isend_irecv, whose ops name their peers.
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce_scatter", "_reduce_scatter_base", "_all_gather_base", "all_to_all_single",
               "barrier", "reduce", "gather", "scatter", "batch_isend_irecv")


def _replica_blocks() -> int:
    argv = sys.argv
    if "--no-diloco-x" in argv:
        return int(os.environ.get("DILOCO_TEST_REPLICAS", "2"))
    r = 2
    for i, a in enumerate(argv):
        if a == "--diloco-x-replicas":
            r = int(argv[i + 1])
    return r


def _spans_replicas(group) -> bool:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    per = dist.get_world_size() // _replica_blocks()
    return len({r // per for r in ranks}) > 1


def _monitor(name, fn):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        if ctx["in_train_step"]:
            group = k.get("group")
            if group is None:
                # positional group argument: the first ProcessGroup among the arguments
                group = next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
            if name == "batch_isend_irecv":
                ranks = [dist.get_rank()] + [op.peer for op in a[0]]
                per = dist.get_world_size() // _replica_blocks()
                crosses = len({r // per for r in ranks}) > 1
            else:
                crosses = _spans_replicas(group)
            if crosses:
                record["cross_replica"].append({"op": name, "iteration": ctx["iteration"],
                                                "in_boundary": ctx["in_boundary"]})
        return fn(*a, **k)
    return wrapped


def instrument() -> None:
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _monitor(name, getattr(dist, name)))
    import megatron.training.training as training

    from megatron_diloco import sync as sync_mod
    from megatron_diloco.optimizer import DiLoCoXOptimizer
    from megatron_diloco.outer import fingerprint
    from megatron_diloco.sync import MATRIX_CODECS

    @wrap(training, "train_step")  # install() wraps it again: DiLoCoX's runs inside ours
    def train_step(orig, *a, **k):
        ctx["iteration"] += 1
        ctx["in_train_step"] = True
        try:
            return orig(*a, **k)
        finally:
            ctx["in_train_step"] = False

    @wrap(sync_mod.OuterSync, "boundary")
    def boundary(orig, self):
        ctx["in_boundary"] = True
        try:
            return orig(self)
        finally:
            ctx["in_boundary"] = False

    @wrap(DiLoCoXOptimizer, "round_metrics")
    def round_metrics(orig, self, report):
        ctx["in_boundary"] = True
        try:
            out = orig(self, report)
            if self.diloco_config.compression in MATRIX_CODECS and self.sync.pending is not None:
                # The low-rank exchange runs on a worker thread that owns the outer group until it
                # completes, and the check all-gathers on that group: skip it (None) rather than
                # wait, so that a checkpoint can still catch the exchange in flight.
                record["boundary_identical"].append([self.step_calls, None])
            else:
                record["boundary_identical"].append([self.step_calls, self.replicas_identical()])
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


def allow_sgd_with_distributed_optimizer() -> None:
    """Megatron 0.19's DistributedOptimizer refuses SGD only because SGD has no ``init_state_fn``
    (needed for checkpointing). The degenerate-case test needs inner SGD without momentum, which has
    no state at all: give it a no-op ``init_state_fn``. Test harness only."""
    from megatron.core.optimizer import distrib_optimizer

    @wrap(distrib_optimizer.DistributedOptimizer, "__init__")
    def __init__(orig, self, optimizer, config, grad_scaler, init_state_fn, *a, **k):
        if isinstance(optimizer, distrib_optimizer.torch.optim.SGD) and init_state_fn is None:
            init_state_fn = lambda opt, config=None: None  # noqa: E731
        orig(self, optimizer, config, grad_scaler, init_state_fn, *a, **k)


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code (gloo, torch) prints every thread's Python stack
    # The example applies the CPU shim on import; instrument after Megatron is importable.
    from megatron_diloco.compat import cpu as cpu_compat

    if cpu_compat.cpu_mode():
        cpu_compat.apply()
    instrument()
    if "sgd" in sys.argv:
        allow_sgd_with_distributed_optimizer()
    run_script(sys.argv[1:], record, os.environ.get("DILOCO_TEST_OUT"))


if __name__ == "__main__":
    main()
