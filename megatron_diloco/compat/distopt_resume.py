"""Fixes that let Megatron-Core 0.19's distributed optimizer resume from a checkpoint.

Both are Megatron bugs, not CPU ones: they hit any machine without Transformer Engine and Apex
(CPU machines, and GPU machines that lack both) and any fp32 run. ``apply()`` is idempotent and
patches ``DistributedOptimizer`` only; behaviour while training is unchanged.

1. **No Adam state before the first step.** Without TE/Apex Megatron falls back to
   ``torch.optim.Adam``/``AdamW``, which allocates its state lazily at the first step. Loading a
   ``torch_dist`` checkpoint builds its template with ``DistributedOptimizer.state_dict()``, which
   reads every state's ``step`` (``distrib_optimizer.py:838-839``, ``assert len(steps) == 1``) and
   fails. Fix: allocate the state Adam would allocate at its first step (``step = 0``, zero
   moments) just before; the checkpoint then overwrites it (and if it did not, Adam's first step
   would start from exactly these values).
2. **fp32 main parameters are views of the model's leaf parameters** (``distrib_optimizer.py:467``),
   so restoring them in place (``_set_main_param_and_optimizer_states``, ``distrib_optimizer.py:1225``,
   ``dst.copy_(src)``) raises "a view of a leaf Variable that requires grad is being used in an
   in-place operation". Fix: run that restore under ``torch.no_grad()`` (it is not part of any graph).
3. **One shared ``step`` tensor after loading (torch Adam).** ``load_state_dict`` gives every
   parameter's state the same ``step`` tensor (``distrib_optimizer.py:1029-1031``) and
   ``torch.optim.Optimizer.load_state_dict`` keeps it shared, so each optimizer step increments
   it once per parameter: the resumed run uses wrong bias corrections from its first step on.
   Fix: give every parameter its own copy after loading.
4. **The per-parameter ``step`` is restored from the load template.** With (1) the template's
   per-parameter state has ``step = 0``, and ``_set_main_param_and_optimizer_states`` copies every
   state key back, overwriting the correct step just set from the checkpoint's param groups
   (``distrib_optimizer.py:1024-1031``). Fix: hide ``step`` from that copy. With all four, a resumed run
   matches an uninterrupted one exactly (``tests/test_example_smoke.py``).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

_applied = False


def apply() -> None:
    """Patch ``DistributedOptimizer`` for resuming (idempotent; no effect on training steps)."""
    global _applied
    if _applied:
        return
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        original_state_dict = cls.state_dict

        @functools.wraps(original_state_dict)
        def state_dict(self):
            _allocate_adam_state(self.optimizer)
            return original_state_dict(self)

        cls.state_dict = state_dict

        original_load_state_dict = cls.load_state_dict

        @functools.wraps(original_load_state_dict)
        def load_state_dict(self, state_dict):
            original_load_state_dict(self, state_dict)
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

        cls.load_state_dict = load_state_dict

    original_set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(original_set_states)
    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            tensors = {**tensors, "step": None}  # non-tensor values are skipped there
        return original_set_states(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    _applied = True


def _allocate_adam_state(optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            # What torch.optim.Adam._init_group allocates at the first (non-capturable) step.
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                optimizer.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
    logger.debug("allocated torch Adam state (step 0) as a checkpoint-load template")
