"""Resuming and restarting the outer loop around Megatron's checkpoint loads.

:class:`RestartMixin` gives :class:`~megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer` the rules
that decide what a load means for DiLoCoX: restart the outer loop from the loaded weights when they came
without DiLoCoX state (a plain Megatron checkpoint, ``--no-load-optim``, ``--finetune``,
``--pretrained-checkpoint``), keep the checkpoint's round schedule (an auto warm-up resolved for the
run that wrote it), restore each replica's own LR-schedule position and 0-dim optimizer state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.exchange import ExchangeStats
from megatron_diloco.megatron_adapter.arguments import resolve_kept_warmup

logger = logging.getLogger(__name__)


class RestartMixin:
    """The resume and restart rules of :class:`~megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer`
    (module doc)."""

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

    def _keep_schedule(self, saved: dict | None) -> None:
        """On a resume: the round schedule the checkpoint was trained with (``saved``, None in
        checkpoints written before it was recorded) against this run's. An ``auto`` warm-up (it
        depends on ``--train-iters``, which a resume may extend) takes the checkpoint's, so that the
        boundaries stay where they were; explicit flags that differ win, with a warning (the rounds
        after this step follow them; the replicas agree, as every rank resolves the same flags). An auto
        H resumed with auto H keeps the checkpoint's H and the step its rounds began at."""
        cfg, schedule = self.diloco_config, self.sync.schedule
        if saved is None or saved == schedule.state_dict():
            return
        if schedule.load_auto(saved) and saved == schedule.state_dict():
            logger.info("DiLoCoX: auto H resumes with the checkpoint's H %d (rounds from step %s)", cfg.local_steps,
                        schedule.anchor if schedule.anchor is not None else cfg.warmup_iters)
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
                       "--diloco-x-warmup-iters)", saved, schedule.state_dict(), self.step_calls)

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

    def restart_outer_loop_from_params(self, reason: str) -> None:
        """Start a new outer loop from the current fp32 main params: theta <- x (this rank's shard),
        outer momentum 0, error-feedback residual 0, eager anchor = theta, nothing in flight, round
        and step counters 0 (the first boundary comes H ``step()`` calls from now). Logs one line (rank
        0) with ``reason``. An exchange in flight is waited for and dropped (then collective over the
        outer group: call it on every rank). Model params are left as they are (they hold x already).

        Resets :class:`OuterSync` through its attributes (``theta``, ``outer.momentum_buffer``,
        ``residual``, ``anchor``, ``pending``, ``tau``, ``rounds``, ``skipped_rounds``) and this
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
        sync.params_shared = True
        sync.rounds = 0
        sync.skipped_rounds = 0
        sync.schedule.restart()  # auto H: the rounds of H begin after the new loop's warm-up
        # partial: when the (now dropped) exchange was to land; a fresh loop's value
        sync.tau = self.diloco_config.local_steps if self.diloco_config.overlap_steps is None \
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
