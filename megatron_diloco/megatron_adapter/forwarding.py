"""What :class:`~megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer` hands on to Megatron's optimizer, by name.

Megatron's training loop holds the ``DiLoCoXOptimizer`` where it would hold the optimizer
``get_megatron_optimizer`` built (``inner``: a ``ChainedOptimizer`` of ``DistributedOptimizer``\\ s, or
one). The wrapper owns ``step``, ``state_dict``, ``load_state_dict`` and ``sharded_state_dict`` (and its
DiLoCoX methods); it forwards to ``inner`` exactly the names of :data:`FORWARDED`, one descriptor each
(:func:`forward_to_inner`); any other name raises ``AttributeError`` naming this list
(:func:`not_forwarded`). Nothing else of ``inner`` is reachable through the wrapper except ``.inner``
itself.

How the list was drawn (Megatron-Core 0.19.2): every ``optimizer.<name>`` that ``megatron/training/``
reads from the optimizer it is handed (``training.py``, ``checkpointing.py``; ``getattr`` / ``hasattr``
probes included) and ``OptimizerParamScheduler``'s ``self.optimizer.param_groups``, found by a scan of
their syntax trees (``tests/test_forwarding.py`` repeats the scan against the installed Megatron and
fails on a name that is neither here, owned by the wrapper, nor in :data:`NOT_FORWARDED`), plus the rest
of the ``MegatronOptimizer`` interface that the wrapper forwarded before (its own grad-norm and offload
methods, read by no Megatron call site of 0.19 on the outer optimizer). A run of real Megatron
through the wrapper (the tests' training recorder) reads no name outside the list.
"""

from __future__ import annotations

import abc
from typing import Any

#: The names forwarded to ``inner`` -> who reads them from the training loop's optimizer (Megatron-Core
#: 0.19; "interface": the ``MegatronOptimizer`` interface, read by no call site of the training loop).
FORWARDED: dict[str, str] = {
    # read by megatron.training
    "param_groups": "OptimizerParamScheduler.step (LR and weight decay per group); training.training_log, "
                    "checkpointing (param groups' default_config); settable",
    "is_stub_optimizer": "training.setup_model_and_optimizer / training_log, checkpointing.save / load",
    "zero_grad": "training.train_step (every iteration)",
    "get_loss_scale": "training.train_step (the loss scale to log)",
    "scale_loss": "training (the loss's backward under fp16)",
    "prepare_model_params_for_param_sync": "training.disable_forward_pre_hook / force_param_sync",
    "reload_model_params": "checkpointing.load_checkpoint (--no-load-optim, --finetune, "
                           "--pretrained-checkpoint with fp16 / bf16): the main shards take the loaded "
                           "weights; the outer loop restarts from them after the load (after_checkpoint_load)",
    "chained_optimizers": "training.train_step (--reuse-grad-buf-for-mxfp8-param-ag with --overlap-param-gather)",
    # the rest of the MegatronOptimizer interface
    "config": "interface: the OptimizerConfig",
    "state": "interface: the inner optimizers' per-parameter state",
    "get_parameters": "interface",
    "get_grads_for_grad_norm": "interface",
    "has_grad_norm_group": "interface",
    "get_grad_stats_parallel_group": "interface",
    "prepare_grads": "interface (inner.step calls its own)",
    "step_with_ready_grads": "interface (inner.step calls its own)",
    "get_grad_norm": "interface (inner.step calls its own)",
    "clip_grad_norm": "interface (inner.step calls its own)",
    "count_zeros": "interface (inner.step calls its own)",
    "offload_to_cpu": "interface",
    "restore_from_cpu": "interface",
}

#: Names Megatron's training package reads from an optimizer that the wrapper deliberately does not
#: forward -> why (they raise AttributeError, as any name outside :data:`FORWARDED`).
NOT_FORWARDED: dict[str, str] = {
    "save_parameter_state": "the legacy checkpoint format (checkpointing.save_checkpoint): refused with "
                            "--diloco-x (install: --ckpt-format torch_dist only), it would save no DiLoCoX state",
    "load_parameter_state": "the legacy checkpoint format (checkpointing.load_checkpoint), as above",
    "save_state_dict_to_file": "--use-layer-wise-distributed-optimizer with --ckpt-format torch, as above",
    "load_state_dict_from_file": "--use-layer-wise-distributed-optimizer with --ckpt-format torch, as above",
    "optimizer": "utils.print_params_min_max_norm (a debug helper the training loop does not call): the torch "
                 "optimizer inside, whose step would bypass DiLoCoX",
}

#: Forwarded names that may also be set (the setter sets them on ``inner``).
SETTABLE = frozenset({"param_groups"})


class Forwarded:
    """A data descriptor reading (and, for :data:`SETTABLE` names, writing) one attribute of the
    instance's ``inner`` optimizer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = f"``inner.{name}`` (forwarded; read by {FORWARDED[name]})"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.inner, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.name not in SETTABLE:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is Megatron's optimizer's (forwarded "
                                 f"read-only to .inner): set it on .inner")
        setattr(obj.inner, self.name, value)


def forward_to_inner(cls: type) -> type:
    """Class decorator: one :class:`Forwarded` descriptor per :data:`FORWARDED` name the class does not
    define itself; recomputes the class's abstract methods (the forwarded ones implement
    ``MegatronOptimizer``'s)."""
    for name in FORWARDED:
        if name in vars(cls):
            raise TypeError(f"{cls.__name__} defines {name!r} and forwards it: remove one")
        setattr(cls, name, Forwarded(name))
    abc.update_abstractmethods(cls)
    return cls


def not_forwarded(owner: object, name: str) -> AttributeError:
    """The error for a name neither the wrapper nor :data:`FORWARDED` has."""
    why = f" ({NOT_FORWARDED[name]})" if name in NOT_FORWARDED else ""
    return AttributeError(
        f"{type(owner).__name__} has no attribute {name!r}{why}: it forwards to Megatron's optimizer only "
        f"the names of megatron_diloco.megatron_adapter.forwarding.FORWARDED ({', '.join(FORWARDED)}); "
        "Megatron's optimizer itself is .inner")
