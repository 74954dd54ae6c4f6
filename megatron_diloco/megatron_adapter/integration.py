"""``install(args)``: plug DiLoCoX into Megatron's training loop without editing Megatron.

Megatron's ``megatron.training.training`` looks its helpers up as module globals at call time, so
wrapping them from outside is enough:

* ``get_megatron_optimizer``: builds Megatron's optimizer, removes the per-step gradient all-reduce
  across optimizer instances (DDP bucket surgery), rescales gradients to the replica's own DP size,
  and wraps the result in :class:`DiLoCoXOptimizer`.
* ``train_step``: reduces the logged loss over the replica, not the whole data-parallel group (the
  stock code all-reduces it across replicas every step), and records it for the summary.
* ``train``: at the end of training drains the last exchange, checks that replicas are identical and
  prints ``DILOCOX SUMMARY {json}`` on rank 0.

It also registers :func:`destroy_process_groups_at_exit`. Every Megatron function it replaces (and those
the other modules replace) is an entry of :mod:`megatron_diloco.megatron_adapter.patches`, which names the
Megatron call site each relies on and the megatron-core versions it was checked against; ``install``
verifies them against the installed Megatron before it changes anything.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_diloco.megatron_adapter import data_split, patches
from megatron_diloco.megatron_adapter.arguments import config_from_args, validate_megatron_args
from megatron_diloco.algorithm.config import CODECS, DiLoCoXConfig, ineffective_settings, outer_step_warning
from megatron_diloco.summary import format_round_line, format_summary, params_digest, warmup_exposure_warning
from megatron_diloco.megatron_adapter.replica_local import install_replica_local_collectives, replica_local_loss_reduction

logger = logging.getLogger(__name__)


def _destroy_process_groups() -> None:
    from megatron_diloco.algorithm.worker import stop_workers_at_exit

    stop_workers_at_exit()  # first the matrix codecs' worker threads, then the groups they use
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@functools.cache  # registered once per process, however often it is called
def destroy_process_groups_at_exit() -> None:
    """Destroy every process group at interpreter exit (once per process, idempotent).

    Why: gloo groups whose threads are still alive when the interpreter tears itself down aborted
    finished runs now and then ("terminate called without an active exception", SIGABRT, exit
    status -6 after training); a DiLoCoX run has more of them (the outer groups, their gloo
    mirrors). Megatron's ``pretrain`` does not destroy its groups. ``atexit`` runs after the
    callers' ``finally`` blocks, so a harness that writes records there still has its groups.
    :func:`install` registers it, so the launcher (``megatron_diloco.launch``), the example and a
    patched ``pretrain_gpt.py`` all get it."""
    atexit.register(_destroy_process_groups)


def install(args: argparse.Namespace) -> DiLoCoXConfig | None:
    """Enable DiLoCoX for this process if ``args.diloco_x`` is set.

    Call after Megatron's ``parse_and_validate_args`` and before ``pretrain_cfg_container_from_args``
    / ``pretrain``. Exits with a message naming the flag on any invalid or incompatible setting.
    Returns the config (``None`` when ``--diloco-x`` is off).
    """
    if not getattr(args, "diloco_x", False):
        return None
    if getattr(args, "_diloco_x_config", None) is not None:
        return args._diloco_x_config  # already installed for these args (script + launcher)
    try:
        config = config_from_args(args)
        validate_megatron_args(args, config)
        if (args.save or args.load) and getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
            raise ValueError(f"--ckpt-format {args.ckpt_format} cannot be used with --diloco-x; use "
                             "--ckpt-format torch_dist (per-replica state is saved as sharded objects)")
    except ValueError as err:
        raise SystemExit(f"megatron-diloco: error: {err}") from None
    patches.check(args)  # before anything is patched: a Megatron whose call sites moved stops here
    from megatron_diloco.compat import distopt_resume, distopt_sgd, wheel

    distopt_resume.apply()  # exact resume of the inner distributed optimizer (Megatron fixes)
    wheel.apply()
    if args.optimizer == "sgd":  # Megatron's distributed optimizer lacks SGD's state initializer
        distopt_sgd.apply()
    _Installation(config, args).patch()
    destroy_process_groups_at_exit()
    _show_package_logs(args)
    args._diloco_x_config = config
    if os.environ.get("RANK", "0") == "0":
        for warning in [*ineffective_settings(config), *filter(None, [outer_step_warning(config)])]:
            print(f"megatron-diloco: warning: {warning}", flush=True)
        print(f"megatron-diloco: DiLoCoX on: {config}; set --use-distributed-optimizer, "
              f"--num-distributed-optimizer-instances {config.replicas}, --use-tp-pp-dp-mapping "
              "(Megatron's argument table above predates these)", flush=True)
    return config


def _show_package_logs(args: argparse.Namespace) -> None:
    """Let megatron_diloco's INFO lines (measured link speed, adaptive plans) and warnings (skipped
    rounds) reach the user at Megatron's default log level: without ``--logging-level`` /
    ``MEGATRON_LOGGING_LEVEL`` Megatron leaves Python's root logger at WARNING with no handler, which
    would drop them. An explicit level is respected (the package then logs through the root logger)."""
    if getattr(args, "logging_level", None) is not None or os.environ.get("MEGATRON_LOGGING_LEVEL"):
        return
    pkg = logging.getLogger("megatron_diloco")
    if pkg.handlers:
        return
    import sys

    handler = logging.StreamHandler(sys.stdout)
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter(f"[megatron-diloco rank {rank}] %(levelname)s %(message)s"))
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
    pkg.propagate = False


def _data_slots(args) -> int | None:
    """The data-parallel ranks every job reads as (:mod:`~megatron_diloco.megatron_adapter.data_split`), a multiple
    of every site's DP: ``--diloco-x-exchange-slots``, or with ``--diloco-x-exchange-chunks`` its
    ``--diloco-x-data-slots`` (default the chunks), else None."""
    return getattr(args, "diloco_x_exchange_slots", None) or getattr(args, "diloco_x_data_slots", None) or getattr(
        args, "diloco_x_exchange_chunks", None)


class _Installation:
    """The state one ``install`` call wires into Megatron (kept in closures, not module globals)."""

    def __init__(self, config: DiLoCoXConfig, args: argparse.Namespace) -> None:
        self.config = config
        self.args = args
        self.optimizer = None  # the DiLoCoXOptimizer, once built
        self.first_loss = None  # loss of the first iteration this process trained (last PP stage)
        self.last_loss = None
        self.rounds: list[dict] = []
        self.warned_warmup = False  # the warm-up's exposed exchanges are reported once
        self.membership = None  # separate jobs (--diloco-x-lighthouse): this rank's membership of the run
        self.iterations_behind = 0  # separate jobs: iterations to skip after this one (catch_up)

    def patch(self) -> None:
        """Apply the entries of :data:`~megatron_diloco.megatron_adapter.patches.INSTALL` that this run
        needs, each through :func:`~megatron_diloco.megatron_adapter.patches.replace` with the method its
        ``replacement`` names (every one verified against the installed Megatron first)."""
        from megatron.training import training

        if getattr(training.get_megatron_optimizer, "_diloco_x", False):
            raise RuntimeError("megatron_diloco.install() was called twice in one process")
        entries = patches.applying_to(self.args, patches.INSTALL)
        for entry in entries:  # all of them hold before the first is applied
            patches.verify(entry)
        for entry in entries:
            patches.replace(entry, getattr(self, entry.replacement))

    def wrap_get_megatron_optimizer(self, get_opt: Callable) -> Callable:
        @functools.wraps(get_opt)
        def get_megatron_optimizer(config, model_chunks, *a, **k):
            return self.build_optimizer(get_opt(config, model_chunks, *a, **k), model_chunks)

        get_megatron_optimizer._diloco_x = True  # install() and the launcher read it: DiLoCoX is installed
        return get_megatron_optimizer

    def wrap_train_step(self, train_step: Callable) -> Callable:
        @functools.wraps(train_step)
        def diloco_train_step(*a, **k):
            model = a[2] if len(a) > 2 else k["model"]
            if self.optimizer is not None:  # the round's step time counts iterations, not what runs between
                self.optimizer.mark_iteration_start()
            with replica_local_loss_reduction(model):
                out = train_step(*a, **k)
            if self.iterations_behind:
                self.skip_iterations(k.get("iteration"), a[4] if len(a) > 4 else k.get("opt_param_scheduler"))
            self.record_loss(out[0])
            return out

        return diloco_train_step

    def catch_up(self, steps: int) -> None:
        """Separate jobs, in a boundary's ``step()``: a heal found this job behind the run. The optimizer moves to
        its own ``steps`` at the run's boundary; Megatron's loop skips the iterations between (:meth:`skip_iterations`)."""
        opt = self.optimizer
        self.iterations_behind += steps - opt.step_calls
        opt.set_position({"steps": steps, "iteration": steps + opt.iteration_offset})  # (its own offset kept)

    def skip_iterations(self, iteration: int | None, scheduler) -> None:
        """Separate jobs: a heal in this iteration's boundary moved this job to the run's boundary
        (:meth:`catch_up`). Megatron's loop skips the iterations between, as it does for
        ``--iterations-to-skip`` (it reads and drops their micro-batches and counts their samples as consumed);
        the LR schedule is advanced by their samples, as a joiner's is set from its iteration: they stay those of
        the job's own steps. ``iteration``: Megatron's count before this one."""
        args = self.args
        n, self.iterations_behind = self.iterations_behind, 0
        first = (args.curr_iteration if iteration is None else iteration) + 2
        if args.iterations_to_skip is None:
            args.iterations_to_skip = []
        args.iterations_to_skip.extend(range(first, first + n))
        if scheduler is not None:
            scheduler.step(increment=n * args.global_batch_size)
        if dist.get_rank() == 0:
            print(f"megatron-diloco: caught up with run {args.diloco_x_run!r}: iterations {first} to "
                  f"{first + n - 1} are skipped (their data is not trained on)", flush=True)

    def wrap_train(self, train: Callable) -> Callable:
        from megatron.training import training

        from megatron_diloco.megatron_adapter.replica_local import replica_local_finalize

        @functools.wraps(train)
        def diloco_train(*a, **k):
            config = a[7] if len(a) > 7 else k["config"]  # the model's TransformerConfig
            config.finalize_model_grads_func = replica_local_finalize(
                config.finalize_model_grads_func or training.finalize_model_grads)
            start = time.perf_counter()
            out = train(*a, **k)
            self.finish(iteration=out[0], wall_s=time.perf_counter() - start)
            return out

        return diloco_train

    def wrap_setup_model_and_optimizer(self, setup: Callable) -> Callable:
        """Separate jobs: a job that joins a run under way starts at its position (:meth:`join_run`)."""
        @functools.wraps(setup)
        def setup_model_and_optimizer(*a, **k):
            out = setup(*a, **k)
            self.join_run(out[2])
            return out

        return setup_model_and_optimizer

    def wrap_get_optimizer_param_scheduler(self, get_scheduler: Callable) -> Callable:
        @functools.wraps(get_scheduler)
        def get_optimizer_param_scheduler(optimizer, *a, **k):
            # Megatron advances the LR schedule on successful steps only: with fp16 each replica's
            # position differs, and the optimizer checkpoints it per replica
            scheduler = get_scheduler(optimizer, *a, **k)
            self.run_length_known()  # --train-samples: Megatron has just set args.train_iters
            if hasattr(optimizer, "attach_lr_scheduler"):
                optimizer.attach_lr_scheduler(scheduler)
                if self.config.site_pace is not None:  # the LR follows the run's progress, in samples
                    gbs, sync = self.args.global_batch_size, optimizer.sync
                    optimizer.lr_position.follow(lambda: sync.schedule.pace.run_position(optimizer.step_calls) * gbs)
            return scheduler

        return get_optimizer_param_scheduler

    def wrap_load_checkpoint(self, load_checkpoint: Callable) -> Callable:
        @functools.wraps(load_checkpoint)
        def diloco_load_checkpoint(*a, **k):
            out = load_checkpoint(*a, **k)
            self.after_load()
            return out

        return diloco_load_checkpoint

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(self, inner, model_chunks):
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer
        from megatron_diloco.megatron_adapter.topology import from_outer_store, from_parallel_state

        if self.args.diloco_x_lighthouse is not None:  # this job is one replica of a run of separate jobs
            from megatron_diloco.megatron_adapter.topology import from_federation

            topology = from_federation(getattr(self.args, "diloco_x_exchange_slots", None),
                                       getattr(self.args, "diloco_x_exchange_chunks", None))
            self.optimizer = opt = DiLoCoXOptimizer(inner, self.config, topology, on_round=self.log_round)
            self.membership = self.join_federation(opt, self.describe_launch(inner, separate_jobs=True))
            opt.federation.tokens_per_step = self.tokens_per_step
            install_replica_local_collectives(
                self.args, at_boundary=lambda: opt.sync.schedule.steps_since_boundary(opt.step_calls) == 0)
            return opt
        if self.args.diloco_x_outer_store is not None:  # this world is one replica
            try:  # the join handshake refuses launches whose flags differ, before anything is trained
                topology = from_outer_store(self.config.replicas, self.args.diloco_x_replica_index,
                                            self.args.diloco_x_outer_store, self.config.distributed_timeout_minutes,
                                            description=self.describe_launch(inner),
                                            worker_group=CODECS[self.config.compression].matrix)
            except ValueError as err:
                raise SystemExit(f"megatron-diloco: error: {err}") from None
        else:
            for chunk in model_chunks:
                make_gradient_reduction_replica_local(chunk, self.config.replicas)
            topology = from_parallel_state(self.config.replicas, host_mirror=self.config.exchanges_on_host_mirror)
        self.optimizer = opt = DiLoCoXOptimizer(inner, self.config, topology, on_round=self.log_round)
        install_replica_local_collectives(
            self.args, at_boundary=lambda: opt.sync.schedule.steps_since_boundary(opt.step_calls) == 0)
        return self.optimizer

    def join_federation(self, opt, description: dict):
        """Separate jobs (``--diloco-x-lighthouse``): this rank's membership of the run (torchft, one
        manager per rank; collective over the job's world), attached to the optimizer's boundaries."""
        from megatron_diloco.algorithm.federated import FederatedRounds
        from megatron_diloco.federation import handshake
        from megatron_diloco.federation.auth import RunKey
        from megatron_diloco.federation.membership import TorchftMembership

        args = self.args
        key = RunKey.from_file(args.diloco_x_secret_file, args.diloco_x_run)
        description = {**description, handshake.RUN: args.diloco_x_run}
        fed = opt.federation = opt.sync.round_rules = FederatedRounds(opt.sync, None, opt.position, opt.set_position,
                                                                      self.catch_up)
        fed.identity = handshake.identity(description)
        name = args.diloco_x_replica_id or f"replica{args.diloco_x_replica_index}"
        timeout_s = 60.0 * (self.config.outer_timeout_minutes or self.config.distributed_timeout_minutes)
        job = opt.topology.decision_group[0] if opt.topology.decision_group else None
        membership = TorchftMembership(
            args.diloco_x_lighthouse, name, args.diloco_x_advertise_host, args.diloco_x_federation_port,
            key=key, timeout_s=timeout_s, meeting_timeout_s=60.0 * args.diloco_x_meeting_timeout_minutes,
            alone_timeout_s=60.0 * args.diloco_x_alone_timeout_minutes, min_replicas=1, job_group=job,
            state_dict=fed.state_dict, load_state_dict=fed.load_state_dict, heal_bytes=fed.heal_bytes,
            **({} if opt.slots is None else dict(segments=opt.slots.bounds, virtual_ranks=opt.slots.virtual_ranks,
                                                 virtual_world=opt.slots.virtual_world)))
        if opt.slots is not None:  # the theta agreement counts slots as the run's jobs do
            opt.sync.decision.virtual = (opt.slots.virtual_ranks, opt.slots.virtual_world)
        membership.handshake = lambda group, progress, quorum, heal_url, first: handshake.agree(
            group, key, quorum, progress, description, args.diloco_x_replica_index, name, heal_url, first, timeout_s,
            fresh_start_heals=opt.by_name is not None)  # (sites of other layouts start from other weights)
        membership.rounds = lambda: opt.sync.rounds  # (the fault drills' clock)
        fed.membership = membership
        return membership

    def join_run(self, scheduler) -> None:
        """Separate jobs, once Megatron built the model and optimizer and loaded this job's checkpoint (if
        any): meet the run; when it is ahead, this job takes its outer state, its iteration, data
        position and LR schedule, and enters training at the run's current boundary."""
        opt, args = self.optimizer, self.args
        opt.iteration_offset = args.iteration - opt.step_calls
        started = time.perf_counter()
        position = opt.join_federation()
        self.paced_run_length()
        if position is None:
            if dist.get_rank() == 0:
                print(f"megatron-diloco: joined run {args.diloco_x_run!r} at iteration {args.iteration} "
                      "(no job ahead of this one)", flush=True)
            return
        own = args.iteration
        args.iteration = int(position["iteration"])
        args.consumed_train_samples = args.iteration * args.global_batch_size
        if scheduler is not None:
            scheduler.num_steps = 0
            scheduler.step(increment=args.consumed_train_samples)
        if dist.get_rank() == 0:
            inner = (f"its inner optimizer state from this job's checkpoint at iteration {own}" if own > 0
                     else "a fresh inner optimizer state")
            print(f"megatron-diloco: joined run {args.diloco_x_run!r} under way at iteration {args.iteration}: "
                  f"received the outer state from a live job in {time.perf_counter() - started:.2f} s; "
                  f"training with {inner}", flush=True)

    def tokens_per_step(self) -> int:
        """Tokens the inner step about to be counted trained on: this job's current global batch (with
        ``--rampup-batch-size``, as it stands) x ``--seq-length``."""
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        return int(get_current_global_batch_size()) * int(self.args.seq_length)

    def describe_launch(self, inner, separate_jobs: bool = False) -> dict:
        """What must agree with the other launches (:func:`megatron_diloco.megatron_adapter.handshake.describe_launch`):
        this launch's flags, versions and every rank's fp32 main shards (their digests, all-gathered
        over this launch's world: collective, once, every rank must call it)."""
        from megatron.core import package_info

        from megatron_diloco.megatron_adapter.handshake import describe_launch, shard_digest
        from megatron_diloco.megatron_adapter.optimizer import distributed_optimizers

        plan = self.optimizer.slots if separate_jobs and self.optimizer is not None else None
        mine = (shard_digest(_shard_layout(distributed_optimizers(inner))) if plan is None else
                [[v, shard_digest(layout)] for v, layout in zip(plan.virtual_ranks, plan.layouts)])
        shards: list = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)
        if plan is not None:  # per exchange slot, in the order of the run's virtual ranks (every job's alike)
            shards = [digest for _, digest in sorted(slot for rank in shards for slot in rank)]
        by_name = self.optimizer.by_name if separate_jobs and self.optimizer is not None else None
        return describe_launch(self.args, self.config, shards, megatron_version(package_info), separate_jobs,
                               by_name.digest() if by_name is not None else None)

    def run_length_known(self) -> None:
        """Megatron built the LR scheduler, so ``args.train_iters`` is set (under ``--train-samples`` it
        is only now): apply the auto warm-up's cap (half the run) to the schedule
        (:func:`megatron_diloco.megatron_adapter.arguments.resolve_run_length`), before the first step and before a
        checkpoint load (which may keep the checkpoint's schedule instead). Every rank resolves the
        same flags, so the replicas agree."""
        from megatron_diloco.megatron_adapter.arguments import resolve_run_length

        if self.optimizer is not None and self.config.site_pace is not None:
            self.optimizer.sync.schedule.run_steps = int(self.args.train_iters)  # the run's length, in run steps
            self.optimizer.sync.schedule.changed()
        if not resolve_run_length(self.config, self.args):
            return
        if self.optimizer is not None:
            self.optimizer.sync.schedule_changed()
        if dist.get_rank() == 0:
            print(f"megatron-diloco: --train-iters {self.args.train_iters} (from --train-samples): warm-up "
                  f"H0 {self.config.warmup_local_steps} for {self.config.warmup_iters} steps", flush=True)

    def wrap_build_pretraining_data_loader(self, build: Callable) -> Callable:
        """Replicas in separate worlds or jobs: each reads its share of the run's samples
        (:func:`~megatron_diloco.megatron_adapter.data_split.build_loader`)."""
        return data_split.build_loader(build, self.config.replicas, self.args.diloco_x_replica_index,
                                       _data_slots(self.args), getattr(self.args, "diloco_x_data_micro_batch", None))

    def wrap_get_train_valid_test_num_samples(self, get_num_samples: Callable) -> Callable:
        """Replicas in separate worlds or jobs: the datasets sized for the run's samples
        (:func:`~megatron_diloco.megatron_adapter.data_split.num_samples`)."""
        return data_split.num_samples(get_num_samples, self.config.replicas, _data_slots(self.args),
                                      getattr(self.args, "data_parallel_size", 1), self.config.site_pace)

    def after_load(self) -> None:
        """Megatron's ``load_checkpoint`` returned: the optimizer restarts the outer loop if weights
        were loaded without DiLoCoX state (:meth:`DiLoCoXOptimizer.after_checkpoint_load`: one rule
        for fp32/fp16/bf16, a plain checkpoint, ``--no-load-optim``, ``--finetune``,
        ``--pretrained-checkpoint``). Weights were loaded when ``--load`` or
        ``--pretrained-checkpoint`` holds a checkpoint (Megatron's tracker file; the same answer on
        every rank)."""
        if self.optimizer is None:
            return
        from megatron.training.checkpointing import get_checkpoint_tracker_filename

        dirs = [d for d in (self.args.load, self.args.pretrained_checkpoint) if d]
        loaded = any(os.path.isfile(get_checkpoint_tracker_filename(d)) for d in dirs)
        self.optimizer.after_checkpoint_load(weights_loaded=loaded)

    def paced_run_length(self) -> None:
        """``--diloco-x-site-pace``: this job's ``--train-iters`` as its rounds go (Megatron's loop reads it every
        iteration): the end of its current round, plus the run's rounds after it at its current pace; exactly its
        iteration at the run's last boundary once its last round began (:meth:`Pace.own_end`)."""
        opt = self.optimizer
        if opt is not None and self.config.site_pace is not None:
            self.args.train_iters = opt.iteration_offset + opt.sync.schedule.pace.own_end(opt.sync.schedule.run_steps)

    def log_round(self, m: dict) -> None:
        self.paced_run_length()
        self.rounds.append(m)
        if dist.get_rank() == 0:
            print(format_round_line(m, lossy=self.config.compression != "none"), flush=True)
            warning = None if self.warned_warmup else warmup_exposure_warning(
                m, self.config.warmup_local_steps, self.config.warmup_iters)
            if warning is not None:
                self.warned_warmup = True
                logger.warning(warning)
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        tb, wb = get_tensorboard_writer(), get_wandb_writer()
        if tb is None and wb is None:
            return
        # at Megatron's iteration, as its own scalars: the boundary runs inside train_step of iteration
        # args.curr_iteration + 1 (the optimizer's step count restarts at 0 with a new outer loop, e.g.
        # after --no-load-optim / --finetune, while Megatron's iteration continues)
        curr = getattr(self.args, "curr_iteration", None)
        iteration = curr + 1 if curr is not None else m["step"]
        scalars = {f"diloco_x/{k}": float(v) for k, v in m.items() if k not in ("round", "step")}
        if tb is not None:
            for k, v in scalars.items():
                tb.add_scalar(k, v, iteration)
        if wb is not None:
            wb.log(scalars, iteration)

    # ------------------------------------------------------------------ summary
    def record_loss(self, loss_dict: dict) -> None:
        """Keep the first and the latest loss (device tensors: no host sync in the inner loop)."""
        if loss_dict:
            value = next(iter(loss_dict.values()))
            if self.first_loss is None:
                self.first_loss = torch.as_tensor(value).detach().clone()
            self.last_loss = value

    def finish(self, iteration: int, wall_s: float) -> None:
        opt, args = self.optimizer, self.args
        if opt is None:
            return
        if iteration < args.train_iters:
            return  # interrupted (exit interval / signal): the checkpoint holds the in-flight exchange
        opt.finish()
        federation = opt.federation.summary() if opt.federation is not None else None
        identical = opt.replicas_identical()
        device = opt.view.device
        nan = float("nan")
        local = torch.tensor([
            opt.totals.bytes_sent, opt.totals.bytes_received, opt.totals.exposed_s, opt.totals.exchange_s,
            opt.totals.raw_bytes, opt.totals.payload_bytes,
            float(self.first_loss) if self.first_loss is not None else nan,
            float(self.last_loss) if self.last_loss is not None else nan,
        ], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu()
        fps = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(fps, opt.params_fingerprint())
        has_loss = ~torch.isnan(table[:, 6])
        tokens = iteration * args.global_batch_size * args.seq_length
        if dist.get_rank() == 0:
            summary: dict[str, Any] = {
                "rounds": opt.sync.rounds,
                "local_steps": "auto" if self.config.local_steps_auto else self.config.local_steps,
                **({"last_local_steps": self.config.local_steps} if self.config.local_steps_auto else {}),
                **({"warmup_local_steps": self.config.warmup_local_steps, "warmup_iters": self.config.warmup_iters,
                    "warmup_overlap_steps": self.config.warmup_overlap_steps,  # (0 but with partial)
                    "warmup_compression": self.config.warmup_compression or self.config.compression}
                   if self.config.warmup_local_steps is not None else {}),
                "replicas": self.config.replicas,
                "overlap": self.config.overlap,
                **({"eager_weight": self.config.eager_weight} if self.config.eager_weight is not None else {}),
                **({"overlap_steps": self.config.overlap_steps if self.config.overlap_steps is not None
                    else "auto", "last_overlap_steps": opt.sync.tau, "merge": self.config.merge}
                   if self.config.overlap == "partial" else {}),
                "compression": self.config.compression,
                "iterations": iteration,
                "bytes_sent_per_rank": float(table[:, 0].mean()),
                "bytes_received_per_rank": float(table[:, 1].mean()),
                "exposed_comm_s": float(table[:, 2].max()),
                "exchange_s": float(table[:, 3].max()),
                "train_wall_s": wall_s,
                "tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
                "compression_ratio": float(table[:, 4].sum() / table[:, 5].sum()) if table[:, 5].sum() else None,
                "skipped_rounds": opt.sync.skipped_rounds,
                # the site's link (--diloco-x-bandwidth-mbps, or rank 0's measured share x its sharers)
                "link_mbps": opt.sync.link_mbps,
                "first_loss": float(table[has_loss, 6].mean()) if has_loss.any() else None,
                "final_loss": float(table[has_loss, 7].mean()) if has_loss.any() else None,
                "replicas_identical": identical,
                # the final model (fp32 main params) of this rank's replica: compare it between launches
                "final_params_fingerprint": params_digest([f.tolist() for f in fps[:opt.topology.ranks_per_replica]]),
                **({"federation": federation} if federation is not None else {}),
            }
            print(format_summary(summary), flush=True)
        if self.membership is not None:
            self.membership.shutdown()


def megatron_version(package_info) -> str:
    """megatron-core's version as the launches compare it. Its ``package_info`` appends the short hash of the
    git repository that holds its files: the real Megatron commit in a Megatron-LM checkout, but the hash of
    an unrelated repository when a wheel is installed in a virtual environment that lies inside one (two
    sites would then differ by their own projects' commits): that suffix is kept only for a checkout."""
    version = package_info.__version__
    root = Path(package_info.__file__).resolve().parents[2]  # the folder that holds megatron/
    if "+" in version and not (root / ".git").exists():
        version = version.split("+", 1)[0]
    return version


def _shard_layout(dist_opts: list) -> list[tuple[tuple[int, ...], int, int]]:
    """This rank's fp32 main shards, in the order of the outer state (``optimizer._main_params``):
    per shard (the model parameter's shape, the shard's start in it, its element count)."""
    out = []
    for d in dist_opts:
        for g, group in enumerate(d.optimizer.param_groups):
            # DistributedOptimizer lists a group's fp32-param shards, then its fp16/bf16 ones
            for model_param in [*d.model_fp32_groups[g], *d.model_float16_groups[g]]:
                span = d._get_model_param_range_map(model_param)["param"]
                out.append((tuple(model_param.shape), span.start, span.size))
    return out


def make_gradient_reduction_replica_local(ddp_chunk: torch.nn.Module, replicas: int) -> None:
    """Turn Megatron's partial-distributed-optimizer gradient path into a replica-local one.

    With R optimizer instances Megatron reduce-scatters gradients inside the instance and then
    all-reduces each shard across instances every step, scaling by 1/(full DP size). DiLoCoX keeps the
    first and drops the second: bucket groups get a private DDP config copy with one instance, and
    gradients are rescaled by R so the mean is over the replica's own data-parallel ranks. With
    ``--calculate-per-token-loss`` Megatron does not scale in the reduction (factor 1) but divides by
    the token count in ``finalize_model_grads``, which DiLoCoX sums over the replica
    (:func:`megatron_diloco.megatron_adapter.replica_local.replica_local_finalize`): no rescale then.
    Idempotent per chunk.
    """
    if getattr(ddp_chunk, "_diloco_x_local_grads", False):
        return
    for group in list(ddp_chunk.bucket_groups) + list(ddp_chunk.expert_parallel_bucket_groups):
        group.ddp_config = copy.copy(group.ddp_config)
        group.ddp_config.num_distributed_optimizer_instances = 1
    per_token = getattr(getattr(ddp_chunk, "config", None), "calculate_per_token_loss", False)
    if not ddp_chunk.ddp_config.average_in_collective and not per_token:
        for buffer in list(ddp_chunk.buffers) + list(ddp_chunk.expert_parallel_buffers):
            buffer.gradient_scaling_factor *= replicas
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor *= replicas
    ddp_chunk._diloco_x_local_grads = True
