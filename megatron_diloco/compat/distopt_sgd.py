"""SGD under Megatron-Core 0.19's distributed optimizer (which ``--diloco-x`` always uses).

``DistributedOptimizer.__init__`` (``distrib_optimizer.py:689-695``) accepts Adam, or any optimizer
that comes with an ``init_state_fn`` (its checkpoint code needs the state to exist before the first
step); ``get_megatron_optimizer`` passes ``init_state_fn=None`` for SGD (``optimizer/__init__.py:617-624``),
so plain Megatron with ``--optimizer sgd --use-distributed-optimizer`` stops with an assertion.
``apply()`` supplies the missing function for torch's SGD: the momentum buffer torch would create at
the first step, allocated as zeros (none without momentum). With dampening 0 (Megatron's SGD) torch's
first step then computes ``buf = 0 * mu + g = g``, the value it would have cloned: the trajectory is
unchanged. Idempotent; only ``DistributedOptimizer.__init__`` is wrapped.
"""

from __future__ import annotations

import functools

import torch

_applied = False


def init_sgd_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Allocate SGD's per-parameter state as its first step would: ``momentum_buffer`` zeros (same
    shape, dtype and device as the fp32 main shard) for groups with momentum > 0; nothing else."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0.0) <= 0.0:
            continue
        if group.get("dampening", 0.0) != 0.0:
            raise ValueError("SGD with dampening cannot be pre-initialized exactly; Megatron uses dampening 0")
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def apply() -> None:
    """Give torch SGD an ``init_state_fn`` inside Megatron's ``DistributedOptimizer``."""
    global _applied
    if _applied:
        return
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer.DistributedOptimizer.__init__

    @functools.wraps(original)
    def __init__(self, optimizer, config, grad_scaler, init_state_fn, *a, **k):
        if init_state_fn is None and isinstance(optimizer, torch.optim.SGD):
            init_state_fn = init_sgd_state
        original(self, optimizer, config, grad_scaler, init_state_fn, *a, **k)

    distrib_optimizer.DistributedOptimizer.__init__ = __init__
    _applied = True
