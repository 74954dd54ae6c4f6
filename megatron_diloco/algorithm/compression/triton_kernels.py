"""Fused Triton kernels for the blockwise codecs over a flat multi-tensor bucket.

The semantics are those of :mod:`megatron_diloco.algorithm.compression.reference` (the spec); these kernels
match it bit for bit: the same correctly rounded divisions (``div_rn``), no contraction of
multiply-adds into FMAs (``enable_fp_fusion=False``) except where torch itself uses an FMA (the
``alpha`` of ``Tensor.add_`` in the outer step), round half to even by the ``1.5 * 2**23`` trick
(which also never yields ``-0``).

* :func:`encode_triton`: one pass. Read anchor (fp32), x (bf16/fp32), e (fp32); write the payload
  (scales + values) and e_new. 4 + 2|4 + 4 bytes read, 1|0.5|0.25 + 4/block + 4 bytes written per
  element.
* :func:`decode_triton`: one pass. Read the R payloads, write Delta (fp32); or, fused with the outer
  step, read/write theta and the momentum instead of writing Delta.

Dispatch: on a CUDA device the kernels always run (no Triton there raises); on CPU they run only
under ``TRITON_INTERPRET=1`` (tests), otherwise callers use the reference (:func:`use_triton`).
Every codec goes through :func:`encode_blockwise` / :func:`decode_blockwise`, which apply that rule.
"""

from __future__ import annotations

import os

import torch

from megatron_diloco.algorithm.compression.reference import (
    FORMATS, PACKED_BITS, PACKED_OFFSET, QMAX, SCALE_LEVEL, PayloadLayout, decode_reference, elements_per_byte,
    encode_reference, inverse_replicas, payload_layout,
)

try:  # Triton is a hard requirement on GPUs only; see use_triton().
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

#: Format ids of the kernels. The packed formats (int4: 2 elements per byte, int2: 4) share one path:
#: contiguous ``[ROWS, BLOCK]`` tiles (vectorized loads and stores of the fp32 data), viewed as
#: ``[ROWS, BLOCK / EPB, EPB]`` to pack or unpack a byte's EPB codes
_FMT_ID = {"int8": 0, "int4": 1, "fp8": 2, "int2": 3}
#: Outer-step modes of the decode kernel.
_MODE_DELTA, _MODE_SGD, _MODE_HEAVY_BALL, _MODE_NESTEROV = 0, 1, 2, 3


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Whether the codecs must run the Triton kernels for tensors on ``device``.

    True on CUDA (raises if Triton is missing: never a silent fallback there) and on CPU under
    ``TRITON_INTERPRET=1``; False on CPU otherwise (the reference runs).
    """
    if device.type == "cuda":
        if triton is None:
            raise RuntimeError(
                "megatron_diloco compression on a CUDA device needs Triton (pip install triton); "
                "it does not fall back to the slow torch reference"
            )
        return True
    return triton is not None and interpreting()


if triton is not None:

    @triton.jit
    def _fma_f32(a, b, c, NATIVE: tl.constexpr):
        """fp32 ``a * b + c`` rounded once (torch's ``add_(t, alpha=)`` on CPU and CUDA).

        NATIVE uses the hardware FMA; the interpreter's ``tl.fma`` rounds twice, so there it is
        emulated exactly: the product is exact in fp64, the fp64 sum's error is found by TwoSum, and
        the one case where rounding fp64 -> fp32 twice errs (the fp64 sum lands exactly on an fp32
        midpoint) is corrected toward the sign of the error.
        """
        if NATIVE:
            return tl.fma(a, b, c)
        else:
            b = b + tl.zeros_like(a)  # scalar b (a kernel argument) as an fp32 tensor
            p = a.to(tl.float64) * b.to(tl.float64)  # exact: 24 + 24 bits <= 53
            c64 = c.to(tl.float64)
            s = p + c64
            t = s - p
            err = (p - (s - t)) + (c64 - t)  # TwoSum: p + c64 == s + err exactly
            r = s.to(tl.float32)  # RNE
            diff = s - r.to(tl.float64)  # exact
            rb = r.to(tl.int32, bitcast=True)
            mag = rb & 0x7FFFFFFF
            pos = (rb >= 0) & (mag != 0)
            neg = (rb < 0) & (mag != 0)
            up = tl.where(neg, rb - 1, tl.where(mag == 0, 1, rb + 1))  # next fp32 toward +inf
            down = tl.where(pos, rb - 1, tl.where(mag == 0, -2147483647, rb + 1))  # toward -inf
            other = tl.where(diff > 0, up, down).to(tl.float32, bitcast=True)
            midpoint = (diff != 0) & ((other.to(tl.float64) - s) == diff)
            wrong = midpoint & (((err > 0) & (diff > 0)) | ((err < 0) & (diff < 0)))
            return tl.where(wrong, other, r)

    @triton.jit
    def _load_v(anchor_ptr, x_ptr, e_ptr, offs, mask, HAS_X: tl.constexpr):
        """v = (anchor - float(x)) + e, or anchor + e (anchor holding the pseudo-gradient); 0 outside."""
        a = tl.load(anchor_ptr + offs, mask=mask, other=0.0)
        e = tl.load(e_ptr + offs, mask=mask, other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = (a - x) + e
        else:
            v = a + e
        return v

    @triton.jit
    def _block_stats(v):
        """Per row: (absmax, any NaN/Inf) of a ``[ROWS, K]`` tile."""
        av = tl.abs(v)
        bad = ((v != v) | (av == float("inf"))).to(tl.int32)
        return tl.max(av, axis=1), tl.max(bad, axis=1)

    @triton.jit
    def _quantize(v, scale, use, FMT: tl.constexpr, QMAX: tl.constexpr):
        """Levels of ``v`` ``[ROWS, K]`` for row scales ``[ROWS, 1]``: ``(q, dequant)`` in fp32."""
        y = tl.math.div_rn(v, tl.where(use, scale, 1.0))
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        y = tl.where(use, y, 0.0)
        if FMT == 2:
            # RNE onto the e4m3 grid in fp32 arithmetic (not the cast: the interpreter's fp32 -> fp8
            # cast does not round to nearest even). 3 mantissa bits: the grid step of a value in
            # [2^k, 2^(k+1)) is 2^(k-3), and 2^-9 in the subnormal range below 2^-6.
            k = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            step = ((k - 3 + 127) << 23).to(tl.float32, bitcast=True)
            inv_step = ((127 - (k - 3)) << 23).to(tl.float32, bitcast=True)
            q = ((y * inv_step + 12582912.0) - 12582912.0) * step  # exact power-of-two scalings
        else:
            q = (y + 12582912.0) - 12582912.0  # round half to even for |y| < 2**22; never -0
        return q, q * scale

    @triton.jit
    def _encode_kernel(
        # pointers
        anchor_ptr, x_ptr, e_ptr, e_out_ptr, scales_ptr, values_ptr,
        # sizes
        n, num_blocks,
        # meta-parameters
        HAS_X: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr, SCALE_LEVEL: tl.constexpr,
        EPB: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):
        """Encode blocks ``[pid*ROWS, pid*ROWS + ROWS)`` of the bucket (one scale per row of the tile)."""
        pid_rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) block ids
        rows = pid_rows
        offs = pid_rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK), contiguous rows
        mask = offs < n
        v = _load_v(anchor_ptr, x_ptr, e_ptr, offs, mask, HAS_X)
        absmax, bad = _block_stats(v)
        scale = tl.where(bad > 0, float("nan"), tl.math.div_rn(absmax, SCALE_LEVEL))  # (ROWS,)
        tl.store(scales_ptr + rows, scale, mask=rows < num_blocks)
        scale2 = scale[:, None]  # (ROWS, 1)
        use = scale2 > 0  # False for 0 and NaN
        q, d = _quantize(v, scale2, use, FMT, QMAX)
        tl.store(e_out_ptr + offs, v - d, mask=mask)
        if EPB > 1:  # packed (int4, int2): element EPB i + j in bits [j BITS, (j + 1) BITS) of byte i
            NB: tl.constexpr = BLOCK // EPB
            codes = tl.reshape(q.to(tl.int32) + OFFSET, [ROWS, NB, EPB])  # (ROWS, NB, EPB), order kept
            shifts = (tl.arange(0, EPB) * BITS)[None, None, :]
            packed = tl.sum(codes << shifts, axis=2)  # disjoint bits: the sum is the OR  (ROWS, NB)
            byte = pid_rows[:, None] * NB + tl.arange(0, NB)[None, :]  # (ROWS, NB) byte index
            tl.store(values_ptr + byte, packed.to(tl.uint8), mask=byte * EPB < n)
        elif FMT == 2:
            tl.store(values_ptr + offs, q.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(values_ptr + offs, q.to(tl.int8), mask=mask)

    @triton.jit
    def _dequant(scales_ptr, values_ptr, r, row_floats, row_bytes, values_offset, rows, cols_idx, mask,
                 FMT: tl.constexpr):
        """Replica r's dequantized tile (int8, fp8): ``float(q) * scale``; ``cols_idx`` indexes values.

        ``row_bytes`` and ``values_offset`` are multiples of 16 (the payload layout), and ``cols_idx``
        runs contiguously along each row, so the byte loads vectorize (16 B per instruction)."""
        r64 = rows * 0 + r  # (ROWS,) int64: r * row_bytes overflows int32 for R >= 3 at 1B elements
        s = tl.load(scales_ptr + r64 * row_floats + rows)[:, None]  # (ROWS, 1); rows clamped by the caller
        base = tl.multiple_of(r * row_bytes + values_offset, 16)
        raw = tl.load(values_ptr + base + cols_idx, mask=mask)  # masked lanes: never stored
        return raw.to(tl.float32) * s

    @triton.jit
    def _dequant_packed(scales_ptr, values_ptr, r, row_floats, row_bytes, values_offset, rows, byte, mask,
                        EPB: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr):
        """Replica r's dequantized tile of a packed format (int4, int2) as ``[ROWS, NB, EPB]``: byte
        ``byte`` (``[ROWS, NB]``, contiguous along each row: vectorized loads) holds its EPB
        elements' codes in bits ``[j BITS, (j + 1) BITS)``; ``float(code - OFFSET) * scale``."""
        r64 = rows * 0 + r
        s = tl.load(scales_ptr + r64 * row_floats + rows)[:, None, None]  # (ROWS, 1, 1)
        base = tl.multiple_of(r * row_bytes + values_offset, 16)
        raw = tl.load(values_ptr + base + byte, mask=mask).to(tl.int32) & 0xFF  # (ROWS, NB)
        shifts = (tl.arange(0, EPB) * BITS)[None, None, :]
        codes = (raw[:, :, None] >> shifts) & ((1 << BITS) - 1)  # (ROWS, NB, EPB)
        return (codes - OFFSET).to(tl.float32) * s

    @triton.jit
    def _finish(acc, offs, mask, out_ptr, theta_ptr, m_ptr, inv_r, neg_lr, mu,
                MODE: tl.constexpr, NATIVE_FMA: tl.constexpr):
        """Delta = acc * fp32(1/R); then store it, or apply the outer step (OuterNesterov.step)."""
        avg = acc * inv_r
        if MODE == 0:
            tl.store(out_ptr + offs, avg, mask=mask)
        else:
            theta = tl.load(theta_ptr + offs, mask=mask, other=0.0)
            if MODE == 1:  # theta.add_(avg, alpha=-lr)
                theta = _fma_f32(avg, neg_lr, theta, NATIVE_FMA)
            else:
                m = tl.load(m_ptr + offs, mask=mask, other=0.0)
                m = m * mu + avg  # m.mul_(mu).add_(avg): two roundings (no fusion)
                tl.store(m_ptr + offs, m, mask=mask)
                if MODE == 2:  # theta.add_(m, alpha=-lr)
                    theta = _fma_f32(m, neg_lr, theta, NATIVE_FMA)
                else:  # avg.add_(m, alpha=mu); theta.add_(avg, alpha=-lr)
                    theta = _fma_f32(_fma_f32(m, mu, avg, NATIVE_FMA), neg_lr, theta, NATIVE_FMA)
            tl.store(theta_ptr + offs, theta, mask=mask)

    @triton.jit
    def _decode_kernel(
        # pointers
        scales_ptr, values_ptr, out_ptr, theta_ptr, m_ptr,
        # sizes and strides
        n, num_blocks, row_floats, row_bytes, values_offset,
        # scalars (fp32)
        inv_r, neg_lr, mu,
        # meta-parameters
        NUM_REPLICAS: tl.constexpr, FMT: tl.constexpr, EPB: tl.constexpr, BITS: tl.constexpr,
        OFFSET: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
        NATIVE_FMA: tl.constexpr,
    ):
        """Dequantize + sum (replica order 0..R-1) + average (+ outer step) for ROWS blocks."""
        row_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        rows = tl.minimum(row_ids, num_blocks - 1)  # clamp: tail rows reload the last scale, masked below
        offs = row_ids[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
        mask = offs < n
        if EPB > 1:  # packed: accumulate as [ROWS, NB, EPB], back to [ROWS, BLOCK] once (order kept)
            NB: tl.constexpr = BLOCK // EPB
            byte = row_ids[:, None] * NB + tl.arange(0, NB)[None, :]  # (ROWS, NB)
            bmask = byte * EPB < n
            acc3 = _dequant_packed(scales_ptr, values_ptr, 0, row_floats, row_bytes, values_offset, rows, byte,
                                   bmask, EPB, BITS, OFFSET)
            for r in tl.static_range(1, NUM_REPLICAS):
                acc3 += _dequant_packed(scales_ptr, values_ptr, r, row_floats, row_bytes, values_offset, rows,
                                        byte, bmask, EPB, BITS, OFFSET)
            acc = tl.reshape(acc3, [ROWS, BLOCK])
        else:
            acc = _dequant(scales_ptr, values_ptr, 0, row_floats, row_bytes, values_offset, rows, offs, mask, FMT)
            for r in tl.static_range(1, NUM_REPLICAS):
                acc += _dequant(scales_ptr, values_ptr, r, row_floats, row_bytes, values_offset, rows, offs, mask,
                                FMT)
        _finish(acc, offs, mask, out_ptr, theta_ptr, m_ptr, inv_r, neg_lr, mu, MODE, NATIVE_FMA)


#: Elements per program and warps per program of the decode kernel (tuned on an H100, see
#: benchmarks/kernel_bench.py --sweep-decode).
DECODE_ELEMENTS_PER_PROGRAM = 4096
DECODE_NUM_WARPS = 4


def _rows_per_program(block_size: int, elements: int = 4096) -> int:
    """Blocks per program: ~``elements`` elements per program (a power of two)."""
    return max(1, elements // block_size)


def _packing(fmt: str) -> dict[str, int]:
    """The kernels' packing meta-parameters: elements per byte, bits per code, code offset (q + OFFSET);
    1 / 8 / 0 for the byte formats."""
    epb = elements_per_byte(fmt)
    return {"EPB": epb, "BITS": PACKED_BITS.get(fmt, 8), "OFFSET": PACKED_OFFSET.get(fmt, 0)}


def _require_kernels(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError("the fused compression kernels need Triton (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"Triton kernels need a CUDA device or TRITON_INTERPRET=1, got {device}")


def _flat(t: torch.Tensor, name: str, n: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if t.dim() != 1 or t.numel() != n or t.dtype not in dtypes or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous 1-D [{n}] tensor of {dtypes} on {device}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")


def encode_triton(residual: torch.Tensor, fmt: str, block_size: int, *,
                  anchor: torch.Tensor | None = None, x: torch.Tensor | None = None,
                  pseudo_grad: torch.Tensor | None = None,
                  residual_out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused error-feedback encode; same contract as :func:`reference.encode_reference`.

    Args:
        residual: e, fp32 ``[N]``, contiguous; read (and overwritten when ``residual_out`` is None).
        anchor: theta fp32 ``[N]`` and x bf16/fp32 ``[N]``; or ``pseudo_grad`` fp32 ``[N]``.
        residual_out: fp32 ``[N]`` for e_new (may be ``residual`` itself).

    Returns:
        payload, uint8 ``[P]`` on the bucket's device.
    """
    # read 4N (anchor) + 2|4N (x) + 4N (e); write P (~N or N/2, + 4N/block) + 4N (e_new)
    device = residual.device
    _require_kernels(device)
    n = residual.numel()
    layout = payload_layout(n, fmt, block_size)
    _flat(residual, "residual", n, (torch.float32,), device)
    out = residual if residual_out is None else residual_out
    _flat(out, "residual_out", n, (torch.float32,), device)
    if pseudo_grad is not None:
        if anchor is not None or x is not None:
            raise ValueError("pass either pseudo_grad or (anchor, x), not both")
        _flat(pseudo_grad, "pseudo_grad", n, (torch.float32,), device)
        a, xx, has_x = pseudo_grad, pseudo_grad, False
    else:
        if anchor is None or x is None:
            raise ValueError("pass pseudo_grad or both anchor and x")
        _flat(anchor, "anchor", n, (torch.float32,), device)
        _flat(x, "x", n, (torch.float32, torch.bfloat16), device)
        a, xx, has_x = anchor, x, True
    payload = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)  # (P,)
    payload[4 * layout.num_blocks: layout.values_offset].zero_()  # the paddings (< 16 B each); the
    payload[layout.values_offset + layout.values_bytes:].zero_()  # kernel writes the rest
    if n == 0:
        return payload
    scales = payload[: 4 * layout.num_blocks].view(torch.float32)  # (num_blocks,)
    raw = payload[layout.values_offset: layout.values_offset + layout.values_bytes]
    values = {"int8": raw.view(torch.int8), "fp8": raw.view(torch.float8_e4m3fn)}.get(fmt, raw)
    rows = _rows_per_program(block_size)
    grid = (triton.cdiv(layout.num_blocks, rows),)
    _encode_kernel[grid](
        a, xx, residual, out, scales, values,
        n, layout.num_blocks,
        HAS_X=has_x, FMT=_FMT_ID[fmt], QMAX=QMAX[fmt], SCALE_LEVEL=SCALE_LEVEL[fmt], **_packing(fmt),
        BLOCK=block_size, ROWS=rows, enable_fp_fusion=False,
    )
    return payload


def decode_triton(payloads: torch.Tensor, layout: PayloadLayout, out: torch.Tensor | None = None,
                  outer=None, *, elements_per_program: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor | None:
    """Fused decode; same contract as :func:`reference.decode_reference`.

    Args:
        payloads: uint8 ``[R, P]`` contiguous, row r = replica r's payload.
        out: fp32 ``[N]`` for Delta (allocated when None); unused (not written) with ``outer``.
        outer: :class:`~megatron_diloco.algorithm.outer.OuterNesterov` whose theta (and momentum) are updated
            in place in the same pass.
        elements_per_program, num_warps: launch shape (defaults: the module's tuned values); the
            result does not depend on them.

    Returns:
        Delta fp32 ``[N]``, or ``None`` when fused with ``outer`` (Delta is never materialized).
    """
    # read R*P; write 4N (Delta)  |  fused: read R*P + 4N theta (+4N m), write 4N theta (+4N m)
    device = payloads.device
    _require_kernels(device)
    if payloads.dim() != 2 or payloads.dtype != torch.uint8 or payloads.shape[1] != layout.total_bytes \
            or not payloads.is_contiguous() or payloads.shape[0] < 1:
        raise ValueError(f"payloads must be contiguous uint8 [R>=1, {layout.total_bytes}], "
                         f"got {payloads.dtype} {tuple(payloads.shape)}")
    n, r = layout.numel, payloads.shape[0]
    theta = m = None
    lr = mu = 0.0
    if outer is None:
        mode = _MODE_DELTA
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=device)  # (N,)
        _flat(out, "out", n, (torch.float32,), device)
    else:
        theta, m, lr, mu = outer.theta, outer.momentum_buffer, outer.lr, outer.momentum
        _flat(theta, "outer.theta", n, (torch.float32,), device)
        if m is None:
            mode = _MODE_SGD
        else:
            _flat(m, "outer.momentum_buffer", n, (torch.float32,), device)
            mode = _MODE_NESTEROV if outer.nesterov else _MODE_HEAVY_BALL
    if n == 0:
        return None if outer is not None else out
    scales = payloads.view(torch.float32)  # (R, P/4); P is a multiple of 16
    values = {"int8": payloads.view(torch.int8), "fp8": payloads.view(torch.float8_e4m3fn)}.get(
        layout.fmt, payloads)
    dummy = scales  # unused pointer slots (never dereferenced for the given MODE)
    rows = _rows_per_program(layout.block_size, elements_per_program or DECODE_ELEMENTS_PER_PROGRAM)
    grid = (triton.cdiv(layout.num_blocks, rows),)
    _decode_kernel[grid](
        scales, values, out if out is not None else dummy,
        theta if theta is not None else dummy, m if m is not None else dummy,
        n, layout.num_blocks, layout.total_bytes // 4, layout.total_bytes, layout.values_offset,
        inverse_replicas(r), float(torch.tensor(-lr, dtype=torch.float32)),
        float(torch.tensor(mu, dtype=torch.float32)),
        NUM_REPLICAS=r, FMT=_FMT_ID[layout.fmt], **_packing(layout.fmt), BLOCK=layout.block_size, ROWS=rows, MODE=mode,
        NATIVE_FMA=not interpreting(), num_warps=num_warps or DECODE_NUM_WARPS,
        enable_fp_fusion=False,
    )
    return None if outer is not None else out


def encode_blockwise(residual: torch.Tensor, fmt: str, block_size: int, **pseudo_grad) -> torch.Tensor:
    """Error-feedback encode of a flat bucket on its device: :func:`encode_triton` where
    :func:`use_triton` says so (always on CUDA), else :func:`reference.encode_reference`; the same
    contract and bits either way. ``pseudo_grad``: ``anchor=, x=`` or ``pseudo_grad=``, and
    optionally ``residual_out=``."""
    fn = encode_triton if use_triton(residual.device) else encode_reference
    return fn(residual, fmt, block_size, **pseudo_grad)


def decode_blockwise(payloads: torch.Tensor, layout: PayloadLayout, out: torch.Tensor | None = None,
                     outer=None) -> torch.Tensor | None:
    """Ordered mean of the ``[R, P]`` payloads (+ ``outer.step``), dispatched as :func:`encode_blockwise`.

    Returns Delta fp32 ``[N]``; with ``outer`` the Triton kernel returns ``None`` (Delta is never
    materialized) while the reference returns scratch: callers with ``outer`` must not use it."""
    if use_triton(payloads.device):
        return decode_triton(payloads, layout, out=out, outer=outer)
    return decode_reference(payloads, layout, out=out, outer=outer)


__all__ = ["FORMATS", "decode_blockwise", "decode_triton", "encode_blockwise", "encode_triton", "interpreting",
           "use_triton"]
