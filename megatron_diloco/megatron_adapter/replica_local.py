"""Keep Megatron's own per-step collectives inside the replica.

Between two outer boundaries nothing may cross the slow link: each cross-cluster collective is a
blocking round trip over the WAN that puts the clusters in lockstep. Stock Megatron-Core 0.19 issues
several on groups that span every replica, in every iteration or at every ``--log-interval``:

=====================================================  =======================================
Megatron call site                                     what this module does
=====================================================  =======================================
``train_step`` logged-loss all-reduce (``dp_cp``)      the model's ``pg_collection.dp_cp`` is the
                                                       replica's DP group during ``train_step``
``finalize_model_grads`` token count                   ``dp_cp`` swapped likewise (only issued
(``--calculate-per-token-loss``)                       with per-token loss)
``RerunStateMachine._reduce_any`` (default             all-reduce over the replica group
``--rerun-mode validate_results``): world all-reduce
``Timers`` barrier + all-gather (``--log-interval``)   over the replica group (the timing lines
                                                       show the replica of the logging rank)
``checkpoint_and_decide_exit``: ``--exit-duration-     taken at outer boundaries only: one world
in-mins`` all-reduce, ``--exit-signal-handler``        collective each per boundary, at most H
all-gather, both over the world                        inner steps late
``evaluate``: ``--exit-duration-in-mins`` after each   not taken: the evaluation runs to its end and
batch (drops the evaluation)                           the next boundary exits
=====================================================  =======================================

The *replica group* is Megatron's intra-distributed-optimizer-instance group: every rank of one
replica (TP x PP x CP x intra-replica DP), a contiguous block of ``world / R`` ranks.

Exit decisions must stay world-wide (the checkpoint saved before an exit is collective over every
rank), so they move to the boundaries instead of becoming replica-local. A result-validation failure
of the rerun state machine is decided inside one replica; if it asks for a checkpoint, that save
would be collective over all replicas while only one takes it, so DiLoCoX exits without it (the last
periodic checkpoint is the resume point) and says so; the other replicas then stop at the next
boundary with the outer-group timeout error.

Everything here patches Megatron process-wide, once, from :func:`install_replica_local_collectives`
(called when the DiLoCoX optimizer is built, after Megatron's groups exist).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def replica_group() -> dist.ProcessGroup:
    """Every rank of this rank's replica (Megatron's intra-distributed-optimizer-instance group)."""
    from megatron.core import parallel_state as ps

    return ps.get_intra_distributed_optimizer_instance_group()


def _replica_dp_group() -> dist.ProcessGroup:
    """The replica's own data-parallel (x context-parallel) group."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def install_replica_local_collectives(args: argparse.Namespace, at_boundary: Callable[[], bool]) -> None:
    """Patch Megatron's rerun state machine, timers and exit checks to stay inside the replica (see
    the module docstring). ``at_boundary()`` tells whether the optimizer step just taken ended an
    outer round. Idempotent; needs Megatron's parallel groups."""
    from megatron.core import rerun_state_machine as rsm
    from megatron.core import timers as timers_mod
    from megatron.training import training

    if getattr(rsm.RerunStateMachine._reduce_any, "_diloco_x", False):
        return
    group = replica_group()

    # 1. Rerun state machine: "any rank asked for a rerun", decided inside the replica.
    def _reduce_any(self, value):
        values = value if isinstance(value, list) else [value]
        flags = torch.tensor([int(bool(v)) for v in values], dtype=torch.int32, device=_device())
        dist.all_reduce(flags, group=group)
        out = tuple(int(x) > 0 for x in flags.tolist())
        return out if isinstance(value, list) else out[0]

    _reduce_any._diloco_x = True
    rsm.RerunStateMachine._reduce_any = _reduce_any

    original_checkpoint_and_exit = rsm.RerunStateMachine.should_checkpoint_and_exit

    @functools.wraps(original_checkpoint_and_exit)
    def should_checkpoint_and_exit(self):
        should_checkpoint, should_exit, code = original_checkpoint_and_exit(self)
        if should_checkpoint:
            logger.error("DiLoCoX: the rerun state machine asked for a checkpoint after a result-"
                         "validation failure in this replica; a checkpoint is collective over all "
                         "replicas, so this replica exits without it (resume from the last periodic "
                         "checkpoint); the other replicas stop at the next outer boundary")
            should_checkpoint = False
        return should_checkpoint, should_exit, code

    rsm.RerunStateMachine.should_checkpoint_and_exit = should_checkpoint_and_exit

    # 2. Timers: barriers and the per-rank time gather inside the replica.
    def _get_elapsed_time_all_ranks(self, names, reset, barrier):
        """As Megatron's, over the replica group: [world, len(names)] fp32, rows of the other
        replicas' ranks zero (Megatron's min/max skip zero entries)."""
        if len(names) == 0:
            return None
        if barrier:
            dist.barrier(group=group)
        times = torch.zeros((dist.get_world_size(), len(names)), dtype=torch.float, device=_device())
        rank = dist.get_rank()
        for i, name in enumerate(names):
            if name in self._timers:
                times[rank, i] = self._timers[name].elapsed(reset=reset)
        dist.all_reduce(times, group=group)
        return times

    timers_mod.Timers._get_elapsed_time_all_ranks = _get_elapsed_time_all_ranks
    original_timer_init = timers_mod.Timer.__init__

    @functools.wraps(original_timer_init)
    def timer_init(self, *a, **k):
        original_timer_init(self, *a, **k)
        self.set_barrier_group(group)

    timers_mod.Timer.__init__ = timer_init
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    for timer in getattr(timers, "_timers", {}).values():
        if isinstance(timer, timers_mod.Timer):
            timer.set_barrier_group(group)

    # 3. Exit decisions (world-wide) at boundaries only.
    @contextlib.contextmanager
    def exits_off(**cleared):
        """Megatron's exit flags set to ``cleared`` (name -> value) inside the block, restored after it."""
        saved = {name: getattr(args, name) for name in cleared}
        for name, value in cleared.items():
            setattr(args, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(args, name, value)

    original_decide_exit = training.checkpoint_and_decide_exit

    @functools.wraps(original_decide_exit)
    def checkpoint_and_decide_exit(*a, **k):
        if at_boundary():
            return original_decide_exit(*a, **k)
        with exits_off(exit_signal_handler=False, exit_duration_in_mins=None):
            return original_decide_exit(*a, **k)

    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit

    # An evaluation's own check of --exit-duration-in-mins (after each batch) would drop the evaluation and
    # leave Megatron's ``evaluate`` timer running while the exit waits for the boundary: the next evaluation
    # then fails ("timer has already been started"). The evaluation runs to its end; the boundary exits.
    original_evaluate = training.evaluate

    @functools.wraps(original_evaluate)
    def evaluate(*a, **k):
        with exits_off(exit_duration_in_mins=None):
            return original_evaluate(*a, **k)

    training.evaluate = evaluate


def replica_local_finalize(finalize: Callable) -> Callable:
    """Wrap Megatron's ``finalize_model_grads`` so that the token count of
    ``--calculate-per-token-loss`` is summed over the replica's data-parallel ranks, not all
    replicas' (the gradient is reduced inside the replica, so must be its divisor)."""
    if getattr(finalize, "_diloco_x", False):
        return finalize

    cache: list = [None, None]  # [the model's collection, its replica-local copy]: built once, not every step

    @functools.wraps(finalize)
    def wrapped(*a, pg_collection=None, **k):
        if pg_collection is not None and getattr(pg_collection, "dp_cp", None) is not None:
            if cache[0] is not pg_collection:
                cache[:] = [pg_collection, _local_collection(pg_collection)]
            pg_collection = cache[1]
        return finalize(*a, pg_collection=pg_collection, **k)

    wrapped._diloco_x = True
    return wrapped


def _local_collection(pgc):
    """A shallow copy of a ``ProcessGroupCollection`` whose data-parallel groups are the replica's."""
    intra = _replica_dp_group()
    local = copy.copy(pgc)
    local.dp_cp = intra
    if getattr(local, "dp_cp_gtp_remat", None) is not None:
        local.dp_cp_gtp_remat = intra
    return local


@contextlib.contextmanager
def replica_local_loss_reduction(model):
    """During ``train_step``, let the model's process-group collection name the replica's own
    data-parallel group as ``dp_cp``: Megatron then reduces the logged loss inside the replica
    instead of across the slow link every step.

    ``train_step`` reads ``pg_collection`` from the outermost wrapper that has one
    (``get_attr_wrapped_model``): with ``--bf16``/``--fp16`` that is ``Float16Module``, which keeps
    its own reference, so every level of the wrapper chain is switched, not only the bare model."""
    saved = []
    for chunk in model:
        level = chunk
        while level is not None:
            pgc = level.__dict__.get("pg_collection")
            if pgc is not None:
                cached = level.__dict__.get("_diloco_x_local_pgc")
                if cached is None or cached[0] is not pgc:  # built once per collection, not every step
                    cached = level._diloco_x_local_pgc = (pgc, _local_collection(pgc))
                saved.append((level, pgc))
                level.pg_collection = cached[1]
            level = getattr(level, "module", None)
    try:
        yield
    finally:
        for level, pgc in saved:
            level.pg_collection = pgc
