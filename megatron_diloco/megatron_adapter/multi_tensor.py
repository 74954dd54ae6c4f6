"""Megatron's gradient-norm and gradient-scaling kernels without Apex or Transformer Engine, with no
host synchronization.

Megatron-Core 0.19's ``megatron/core/optimizer/clip_grads.py`` takes its multi-tensor kernels from
Transformer Engine, else Apex (``amp_C``), else its own fallbacks in ``megatron/core/utils.py``, in the
module globals ``l2_norm_impl`` and ``multi_tensor_scale_impl``. ``get_grad_norm_fp32`` passes the first
to ``multi_tensor_applier`` and ``clip_grad_by_total_norm_fp32`` the second. The fallbacks cost the GPU
idle time at every optimizer step:

* ``local_multi_tensor_l2_norm`` takes ``torch.norm`` of each gradient and builds ``torch.tensor`` of the
  list: one read-back to the host per tensor (76 for the 85M GPT of ``benchmarks/RESULTS.md`` §9), each a
  device synchronization with one small kernel between them;
* ``local_multi_tensor_scale`` launches two kernels per tensor (``src * scale`` and ``copy_``).

:func:`multi_tensor_l2_norm` computes the same norm on the device with torch's multi-tensor
``_foreach_norm`` (the kernel behind ``torch.nn.utils.clip_grad_norm_``), no read-back;
:func:`multi_tensor_scale` scales with ``_foreach_mul_`` (in place, as clipping calls it) or
``_foreach_mul`` and ``_foreach_copy_``. :func:`install` puts them in those two globals where the
fallbacks are in place, on CUDA (``patches.MULTI_TENSOR_L2_NORM``, ``patches.MULTI_TENSOR_SCALE``);
Apex's and Transformer Engine's kernels are never replaced, and a CPU run (the host is the device)
keeps Megatron's.

Results: the scaled gradients are bit-identical to the fallback's (one fp32 product per element either
way). The norm is the same 2-norm of the per-tensor 2-norms, rounded in another order on a GPU
(``_foreach_norm``'s reduction against ``torch.norm``'s, and the last 2-norm on the device rather than
on the host): equal within fp32 rounding, as Apex's and Transformer Engine's kernels are
(``tests/test_multi_tensor.py``).
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from megatron_diloco.compat import cpu
from megatron_diloco.megatron_adapter import patches


def multi_tensor_l2_norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], per_tensor: bool,
                         *args) -> tuple[Tensor, None]:
    """Drop-in for Megatron's ``local_multi_tensor_l2_norm`` (``multi_tensor_applier``'s op): the 2-norm of
    every tensor of every list in ``tensor_lists`` taken as one vector.

    Returns ``(norm, None)``: ``norm`` a float32 tensor of shape [1] on ``noop_flag``'s device (the
    fallback's result, and Apex's without ``per_tensor``), computed there with no host read-back.
    ``chunk_size`` and ``per_tensor`` are ignored, as the fallback ignores them.
    """
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:  # _foreach_norm takes one device and dtype per call
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    norms = [n.to(device=noop_flag.device, dtype=torch.float32)
             for group in by_kind.values() for n in torch._foreach_norm(group)]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                       scale: float) -> None:
    """Drop-in for Megatron's ``local_multi_tensor_scale``: ``dst = src * scale`` for each pair of
    ``tensor_lists = [src, dst]`` (same shapes; ``dst`` may be ``src`` itself, as gradient clipping
    passes it). In place with ``_foreach_mul_`` when every ``dst`` is its ``src``; else the products
    are copied into ``dst`` (cast to its dtype). Bit-identical to the fallback."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
        return
    products = torch._foreach_mul(src, scale)
    for group in _by_dtype(dst, products):
        torch._foreach_copy_(*group)


def _by_dtype(dst: list[Tensor], src: list[Tensor]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """(dst, src) sublists grouped by the pair of dtypes and devices (``_foreach_copy_`` per group)."""
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        key = (d.device, d.dtype, s.device, s.dtype)
        groups.setdefault(key, ([], []))
        groups[key][0].append(d)
        groups[key][1].append(s)
    return list(groups.values())


def install(args: argparse.Namespace | None = None) -> bool:
    """Replace Megatron's host-synchronizing fallbacks in ``clip_grads`` with :func:`multi_tensor_l2_norm`
    and :func:`multi_tensor_scale`, where they are in place (neither Transformer Engine nor Apex
    installed) and the process has CUDA. Returns whether it did; idempotent. ``args`` is not read (the
    entries apply whatever the flags); call before the first optimizer step."""
    if cpu.cpu_mode() or not patches.local_multi_tensor_fallbacks(args):
        return False
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is multi_tensor_l2_norm:
        return False
    patches.verify(patches.MULTI_TENSOR_L2_NORM)  # both fit, or neither is replaced
    patches.verify(patches.MULTI_TENSOR_SCALE)
    clip_grads.l2_norm_impl = multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = multi_tensor_scale
    return True
