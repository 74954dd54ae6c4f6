"""Fused rotary position embedding (RoPE) in Triton: Megatron's ``--rope-fusion`` without Transformer Engine.

Megatron-Core 0.19's ``apply_rotary_pos_emb`` (``megatron/core/models/common/embeddings/rope_utils.py``)
calls the module global ``fused_apply_rotary_pos_emb`` when ``config.apply_rope_fusion`` is set
(Megatron's default; ``--no-rope-fusion`` turns it off), no packed sequence is given and ``mscale`` is
1 (otherwise it takes its unfused path itself). That global is Transformer Engine's kernel, None
without it: ``TransformerConfig`` then refuses the flag ("apply_rope_fusion is not available"). The
unfused path, ``_apply_rotary_pos_emb_bshd``, makes six full-size elementwise passes over t (``mul``,
``neg``, ``cat``, ``mul``, ``add``, and a ``cat`` with the channels past rot_dim) per call, and more in
backward; on one H200 they took 60 of the 236 ms of the 85M GPT's step (``benchmarks/RESULTS.md`` §9).

:func:`fused_apply_rotary_pos_emb` is one Triton kernel per pass (forward, and backward as the
transposed rotation): one read and one write of t. :func:`install` puts it in that global, only
where it is None, on CUDA, with rope fusion on (``patches.FUSED_ROPE``); on a machine without CUDA it
refuses the flag before anything is built, naming the fix (``--no-rope-fusion``).

The math, per pair of channels (p, q) of the first rot_dim channels: (j, j + rot_dim / 2) for
j < rot_dim / 2, or (2j, 2j + 1) with ``interleaved`` (Megatron's ``--rotary-interleaved``)::

    out_p = t_p cos(f_p) - t_q sin(f_p)        grad_p = g_p cos(f_p) + g_q sin(f_q)
    out_q = t_q cos(f_q) + t_p sin(f_q)        grad_q = g_q cos(f_q) - g_p sin(f_p)

the channels past rot_dim passed through, as ``_apply_rotary_pos_emb_bshd`` computes it (its
``_rotate_half``), with ``cos`` / ``sin`` of the fp32 freqs in fp32. Megatron's unfused path then
rounds them to t's dtype and rounds each product and the sum; this kernel computes in fp32 (fp64 for
fp64 t) and rounds once, as Transformer Engine's kernel does: equal in fp32 within rounding, closer to
the exact result in bf16 / fp16 (``tests/test_fused_rope.py``).

Not provided: the packed-sequence (thd) kernel, ``fused_apply_rotary_pos_emb_thd`` (Megatron asserts at
the first forward with packed sequences and ``--rope-fusion``); interleaved rope fusion without
Transformer Engine is refused by Megatron's ``TransformerConfig`` itself (it asks for TE >= 2.3).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import Tensor

from megatron.core.models.common.embeddings import rope_utils

from megatron_diloco.compat import cpu
from megatron_diloco.megatron_adapter import patches

try:  # Triton is needed on GPUs only; fused_apply_rotary_pos_emb says so when it is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: elements of one half (rot_dim / 2 channels) per program: ROWS = this / BLOCK_HALF rows of [b * h]
_TILE = 2048


if triton is not None:

    @triton.jit
    def _rope_kernel(
        # pointers
        x_ptr, freqs_ptr, out_ptr,
        # sizes
        heads, rows, half, rest,
        # strides, in elements (the channel stride is 1)
        x_s, x_b, x_h, freqs_s, out_s, out_b, out_h,
        # meta-parameters
        INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    ):
        """Rotate (or, BACKWARD, rotate back) ROWS rows (b, h) of position program_id(0); the cos and
        sin of that position's freqs are computed once per program."""
        pos = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) row = b_i * heads + h_i
        row_ok = r < rows
        x_row = x_ptr + pos * x_s + (r // heads) * x_b + (r % heads) * x_h  # (ROWS,) pointers
        out_row = out_ptr + pos * out_s + (r // heads) * out_b + (r % heads) * out_h
        j = tl.arange(0, BLOCK_HALF)
        j_ok = j < half
        if INTERLEAVED:
            p, q = 2 * j, 2 * j + 1
        else:
            p, q = j, j + half
        f_p = tl.load(freqs_ptr + pos * freqs_s + p, mask=j_ok, other=0.0)  # (BLOCK_HALF,) fp32
        f_q = tl.load(freqs_ptr + pos * freqs_s + q, mask=j_ok, other=0.0)
        cos_p, sin_p = tl.cos(f_p).to(ACC)[None, :], tl.sin(f_p).to(ACC)[None, :]
        cos_q, sin_q = tl.cos(f_q).to(ACC)[None, :], tl.sin(f_q).to(ACC)[None, :]
        m = row_ok[:, None] & j_ok[None, :]
        t_p = tl.load(x_row[:, None] + p[None, :], mask=m, other=0.0).to(ACC)  # (ROWS, BLOCK_HALF)
        t_q = tl.load(x_row[:, None] + q[None, :], mask=m, other=0.0).to(ACC)
        if BACKWARD:  # the transposed rotation
            y_p = t_p * cos_p + t_q * sin_q
            y_q = t_q * cos_q - t_p * sin_p
        else:
            y_p = t_p * cos_p - t_q * sin_p
            y_q = t_q * cos_q + t_p * sin_q
        tl.store(out_row[:, None] + p[None, :], y_p.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_row[:, None] + q[None, :], y_q.to(out_ptr.dtype.element_ty), mask=m)
        if BLOCK_REST > 0:  # channels past rot_dim: copied
            k = 2 * half + tl.arange(0, BLOCK_REST)
            mk = row_ok[:, None] & (k < 2 * half + rest)[None, :]
            tl.store(out_row[:, None] + k[None, :], tl.load(x_row[:, None] + k[None, :], mask=mk), mask=mk)


def _rotate(x: Tensor, freqs: Tensor, interleaved: bool, backward: bool) -> Tensor:
    """The kernel over ``x`` [s, b, h, d] (any strides; a channel stride other than 1 is copied first)
    with ``freqs`` [s, rot_dim] fp32 contiguous; returns a new contiguous [s, b, h, d] of x's dtype."""
    if x.stride(3) != 1:
        x = x.contiguous()
    s, b, h, d = x.shape
    out = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half, rest = freqs.shape[1] // 2, d - freqs.shape[1]
    block_half = triton.next_power_of_2(half)
    rows = max(1, min(triton.next_power_of_2(b * h), _TILE // block_half))
    grid = (s, triton.cdiv(b * h, rows))
    _rope_kernel[grid](
        x, freqs, out, h, b * h, half, rest, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        INTERLEAVED=interleaved, BACKWARD=backward, ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        ROWS=rows, BLOCK_HALF=block_half, BLOCK_REST=triton.next_power_of_2(rest) if rest else 0)
    return out


class _FusedRoPE(torch.autograd.Function):
    """The rotation forward, the transposed rotation backward (no gradient for freqs)."""

    @staticmethod
    def forward(ctx, t: Tensor, freqs: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(freqs)
        ctx.interleaved = interleaved
        return _rotate(t, freqs, interleaved, backward=False)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (freqs,) = ctx.saved_tensors
        return _rotate(grad, freqs, ctx.interleaved, backward=True), None, None


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE on ``t`` in Megatron's bshd layout, as ``_apply_rotary_pos_emb_bshd(t, freqs, interleaved)``
    computes it (mscale 1), fused: the signature Megatron's ``apply_rotary_pos_emb`` calls.

    Args:
        t: [s, b, h, d], fp32 / bf16 / fp16 / fp64, on CUDA (on CPU only under ``TRITON_INTERPRET=1``);
            any strides (Megatron passes views of the fused QKV). Not modified.
        freqs: [s2, 1, 1, rot_dim] fp32, same device, s2 >= s (the first s positions are used, as
            Transformer Engine's kernel does), rot_dim even and at most d: the angles (Megatron's
            ``RotaryEmbedding`` output). It gets no gradient.
        interleaved: pairs (2j, 2j + 1) instead of (j, j + rot_dim / 2) (``--rotary-interleaved``).

    Returns:
        [s, b, h, d], t's dtype, contiguous: the first rot_dim channels rotated, the rest copied.

    Raises:
        ValueError: for shapes, dtypes or devices outside the above; RuntimeError without Triton.
    """
    if triton is None:
        raise RuntimeError("fused RoPE needs Triton (pip install triton); or run with --no-rope-fusion")
    if t.dim() != 4 or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        raise ValueError(f"fused RoPE takes t [s, b, h, d] and freqs [s, 1, 1, rot_dim], not {tuple(t.shape)} "
                         f"and {tuple(freqs.shape)}")
    rot_dim = freqs.shape[3]
    if freqs.shape[0] < t.shape[0] or rot_dim % 2 or not 0 < rot_dim <= t.shape[3]:
        raise ValueError(f"fused RoPE needs freqs for every position (got {freqs.shape[0]} for {t.shape[0]}) "
                         f"and an even rot_dim of at most d (got {rot_dim} for d {t.shape[3]})")
    if t.dtype not in _DTYPES or freqs.dtype != torch.float32:
        raise ValueError(f"fused RoPE takes t in {', '.join(str(d) for d in _DTYPES)} and fp32 freqs, not "
                         f"{t.dtype} and {freqs.dtype}")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("fused RoPE gives freqs no gradient: pass them detached")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if t.device != freqs.device or not (t.device.type == "cuda" or interpreting):
        raise ValueError(f"fused RoPE runs on one CUDA device (t on {t.device}, freqs on {freqs.device}); "
                         "on CPU only under TRITON_INTERPRET=1")
    return _FusedRoPE.apply(t, freqs[: t.shape[0], 0, 0].contiguous(), bool(interleaved))  # [s, rot_dim]


def install(args: argparse.Namespace) -> bool:
    """Give Megatron's ``--rope-fusion`` this module's kernel where Transformer Engine's is absent.

    Call after Megatron parsed and validated ``args`` (``parse_and_validate_args``: it turns
    ``apply_rope_fusion`` off without RoPE) and before the model's ``TransformerConfig`` is built (it
    refuses rope fusion while the global is None). Sets ``rope_utils.fused_apply_rotary_pos_emb``
    (``patches.FUSED_ROPE``) when ``args.apply_rope_fusion`` is set, the global is None and the process
    has CUDA. Returns whether it did; idempotent; Transformer Engine's kernel is never replaced.

    Raises:
        ValueError: rope fusion on a machine without CUDA (no kernel could serve it), naming
            ``--no-rope-fusion``; before anything is built.
    """
    if not getattr(args, "apply_rope_fusion", False) or rope_utils.fused_apply_rotary_pos_emb is not None:
        return False
    if cpu.cpu_mode():
        raise ValueError("rope fusion (Megatron's default, or --rope-fusion) has no kernel on this machine: "
                         "Transformer Engine is not installed and megatron-diloco's fused RoPE runs on CUDA "
                         "only. Add --no-rope-fusion (Megatron's unfused RoPE: the same results within rounding)")
    if triton is None:
        raise ValueError("rope fusion without Transformer Engine needs Triton (pip install triton); or add "
                         "--no-rope-fusion")
    patches.verify(patches.FUSED_ROPE)
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return True
