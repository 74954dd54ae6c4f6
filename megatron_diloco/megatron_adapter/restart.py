"""Resuming and restarting the outer loop around Megatron's checkpoint loads.

The rules that decide what a load means for DiLoCoX, each on explicit inputs (the optimizer holds them
and calls them; nothing here reads the optimizer):

* :class:`RestartPolicy` (on the rank's :class:`~megatron_diloco.algorithm.sync.OuterSync` and the run's
  :class:`~megatron_diloco.algorithm.config.DiLoCoXConfig`): restart the outer loop from the loaded
  weights when they came without DiLoCoX state (a plain Megatron checkpoint, ``--no-load-optim``,
  ``--finetune``, ``--pretrained-checkpoint``; :meth:`RestartPolicy.after_checkpoint_load` names the
  reason, :meth:`RestartPolicy.restart_sync` resets the outer state), and keep the checkpoint's round
  schedule (an auto warm-up resolved for the run that wrote it; :meth:`RestartPolicy.keep_schedule`);
* :class:`LRSchedulePosition`: each replica's own position in Megatron's LR schedule, restored right
  after Megatron restored replica 0's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.sync import OuterSync
from megatron_diloco.megatron_adapter.arguments import resolve_kept_warmup

logger = logging.getLogger(__name__)


class RestartPolicy:
    """The resume and restart rules over one rank's outer state (module doc).

    Args:
        sync: the rank's outer state (theta, momentum, residual, anchors, the exchange in flight, the
            round schedule).
        config: the run's DiLoCoX configuration (:meth:`keep_schedule` may take the checkpoint's
            auto warm-up into it).
    """

    def __init__(self, sync: OuterSync, config: DiLoCoXConfig) -> None:
        self.sync, self.config = sync, config
        # what the last load restored, for after_checkpoint_load: DiLoCoX state, or (the restart
        # reason) a checkpoint without it
        self._loaded_diloco_state = False
        self._loaded_without_diloco_state: str | None = None

    def loaded(self, without_diloco_state: str | None) -> None:
        """A load restored the optimizer's state: with DiLoCoX state (``None``) or without it (the
        reason the outer loop restarts from the loaded weights, :meth:`after_checkpoint_load`)."""
        if without_diloco_state is None:
            self._loaded_diloco_state = True
        else:
            self._loaded_without_diloco_state = without_diloco_state

    def after_checkpoint_load(self, weights_loaded: bool) -> str | None:
        """Why the outer loop restarts after Megatron's ``load_checkpoint`` returned, or None: when
        the load restored weights but no DiLoCoX state. That is a checkpoint written without
        ``--diloco-x`` (its inner optimizer state loaded as Megatron loads it; noted by
        :meth:`loaded`), or weights loaded without any optimizer state (``--no-load-optim``,
        ``--finetune``, ``--pretrained-checkpoint``: ``weights_loaded`` True and nothing noted). A load
        that restored DiLoCoX state gives None. Forgets what was noted. ``weights_loaded`` must be the
        same on every rank (the answer decides a collective restart)."""
        plain, self._loaded_without_diloco_state = self._loaded_without_diloco_state, None
        restored, self._loaded_diloco_state = self._loaded_diloco_state, False
        if plain is not None:
            return plain
        if weights_loaded and not restored:
            return "model weights loaded without optimizer state"
        return None

    def restart_sync(self) -> None:
        """A new outer loop from the current fp32 main params, on :class:`OuterSync`: theta <- x (this
        rank's shard), outer momentum 0, error-feedback residual 0, eager anchor = theta, nothing in
        flight, round counters 0, the round schedule's auto H restarted, tau a fresh loop's. An exchange
        in flight is waited for and dropped (then collective over the outer group: call it on every
        rank). Codec state (low-rank warm-start bases, adaptive plan) and the measurements of the link
        and the step time are kept. Model params are left as they are (they hold x already)."""
        sync, config = self.sync, self.config
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
        sync.tau = config.local_steps if config.overlap_steps is None else config.overlap_steps

    def keep_schedule(self, saved: dict | None, step_calls: int) -> None:
        """On a resume: the round schedule the checkpoint was trained with (``saved``, None in
        checkpoints written before it was recorded) against this run's. An ``auto`` warm-up (it
        depends on ``--train-iters``, which a resume may extend) takes the checkpoint's, so that the
        boundaries stay where they were; explicit flags that differ win, with a warning (the rounds
        after ``step_calls``, the resumed step, follow them; the replicas agree, as every rank resolves
        the same flags). An auto H resumed with auto H keeps the checkpoint's H and the step its rounds
        began at."""
        cfg, schedule = self.config, self.sync.schedule
        saved = schedule.load_pace(saved or {}, step_calls) or None  # (--diloco-x-site-pace: the job's own rounds)
        if saved is None or saved == schedule.rounds_state():
            return
        if schedule.load_auto(saved) and saved == schedule.rounds_state():
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
                       "--diloco-x-warmup-iters)", saved, schedule.rounds_state(), step_calls)


class LRSchedulePosition:
    """This replica's own position in Megatron's LR schedule (``OptimizerParamScheduler.num_steps``).

    Megatron's ``train_step`` advances the scheduler only after a successful step, and with fp16 each
    replica skips the steps its own loss-scale overflows hit, so the replicas' schedules (``num_steps``,
    hence LR and weight decay) drift apart; Megatron's checkpoint keeps one schedule (replica 0's). The
    per-replica checkpoint state records :attr:`steps`, and :meth:`attach` wraps the scheduler
    instance's ``load_state_dict`` so that, right after Megatron restored replica 0's schedule, the
    position :meth:`restore_after_scheduler_load` was given is set and the LR / weight decay of every
    param group re-applied."""

    def __init__(self) -> None:
        self.scheduler: Any = None
        self._steps_to_restore: int | None = None

    def attach(self, scheduler: Any) -> None:
        """Follow ``scheduler`` (Megatron's ``OptimizerParamScheduler`` built for this optimizer;
        idempotent). Needs to be called before the checkpoint is loaded (``megatron_diloco.install``
        wires it where Megatron builds the scheduler)."""
        self.scheduler = scheduler
        original = scheduler.load_state_dict
        if getattr(original, "_diloco_x", False):
            return

        def load_state_dict(state_dict: dict) -> None:
            original(state_dict)
            self._restore()

        load_state_dict._diloco_x = True
        scheduler.load_state_dict = load_state_dict

    def follow(self, position: Callable[[], float]) -> None:
        """``--diloco-x-site-pace``: the schedule's position is ``position()`` (in the scheduler's units: run steps x
        the global batch), whatever increment Megatron steps it by (a job's own steps are not the run's); set at
        every step, load and resume. Call after :meth:`attach`."""
        scheduler = self.scheduler
        original = scheduler.step
        if getattr(original, "_diloco_x_follows", False):
            return

        def step(increment: int) -> None:
            scheduler.num_steps = position()
            original(increment=0)

        step._diloco_x_follows = True
        scheduler.step = step

    @property
    def steps(self) -> int | None:
        """The scheduler's ``num_steps`` (what a checkpoint records), None without a scheduler."""
        return self.scheduler.num_steps if self.scheduler is not None else None

    def restore_after_scheduler_load(self, steps: int | None) -> None:
        """Set ``steps`` (a checkpoint's, None: keep Megatron's) once Megatron's scheduler load has run."""
        self._steps_to_restore = steps

    def _restore(self) -> None:
        steps, self._steps_to_restore = self._steps_to_restore, None
        scheduler = self.scheduler
        if steps is None or scheduler is None or steps == scheduler.num_steps:
            return
        scheduler.num_steps = steps
        scheduler.step(increment=0)  # sets lr and weight decay of every param group for ``steps``
