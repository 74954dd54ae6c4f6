"""Pure-torch reference codecs: the specification every fused kernel must match bit for bit.

Everything operates on a *flat bucket*: a 1-D fp32 tensor ``[N]`` that concatenates many parameter
(shard) tensors in a fixed order (the layout of :class:`megatron_diloco.algorithm.shard_view.ShardView`). Blocks
of ``block_size`` consecutive elements are quantized with one fp32 scale each; blocks run over the
flat bucket and may straddle tensor boundaries (at most one block per boundary; error feedback
carries what that costs into the next round).

Blockwise absmax quantization of a block ``b`` of ``v`` (formats in :data:`FORMATS`)::

    scale_b = absmax(v_b) / SCALE_LEVEL           (fp32, correctly rounded division)
    q_i     = clamp(v_i / scale_b, -QMAX, QMAX)   (correctly rounded division)
              -> round half to even, never -0   (int8: QMAX 127, int4: QMAX 7, int2: QMAX 1)
              -> cast to float8_e4m3fn, RNE, never -0   (fp8: QMAX 448)
    dequant = float(q_i) * scale_b                (one fp32 rounding)

SCALE_LEVEL is QMAX, but for int2 (ternary), whose scale is absmax / 2: the level +-1 sits at half
the block's absmax and the values under a quarter of it send 0 (for Gaussian-like blocks of 256 a
third of the squared error of scale = absmax, which sends 0 below half the absmax). The clamped
values (|v| in (1.5, 2] x scale) keep Sterbenz's lemma below: dequant = scale is within a factor 2.

A block of zeros has ``scale 0`` and ``q 0``. A block holding a NaN or Inf gets ``scale NaN`` and
``q 0``, so :func:`has_nonfinite` finds it from the scales alone.

Error feedback (encode), with ``v = (anchor - x) + e`` or ``v = pseudo_grad + e``::

    payload = Q(v) ;  e_new = v - dequant(payload)

``dequant(payload) + e_new == v`` holds exactly in fp32: ``q`` is ``v / scale`` rounded to the
nearest level, so ``dequant`` is within a factor of 2 of ``v`` (or 0) and Sterbenz's lemma makes the
subtraction exact.

Decode: ``Delta = (d_0 + d_1 + ... + d_{R-1}) * fp32(1/R)`` with ``d_r = dequant(payload_r)``,
summed left to right in fp32, then optionally the outer step of
:class:`megatron_diloco.algorithm.outer.OuterNesterov` with the very same torch operations.

Payload byte layout (one ``uint8`` tensor per bucket, see :func:`payload_layout`)::

    [0, 4*B)          B = ceil(N / block_size) fp32 scales, native (little-endian) byte order
    [4*B, O)          zero padding to O = 4*B rounded up to a multiple of 16 (< 16 bytes): the
                      values start 16-byte aligned, so kernels load them with vector instructions
    [O, O + V)        values: int8 / fp8 e4m3fn: V = N bytes, one per element;
                      int4: V = ceil(N / 2) bytes, element 2i in the low nibble and 2i+1 in the
                      high nibble of byte i, nibble = q + 8 (offset binary; 8 encodes 0);
                      an odd N leaves the last high nibble 8
                      int2 (ternary, q in {-1, 0, 1}): V = ceil(N / 4) bytes, element 4i + j in
                      bits [2j, 2j + 2) of byte i, code = q + 2 (2 encodes 0; 0 is never written);
                      a tail short of 4 elements leaves its codes 2
    [O + V, P)        zero padding to P = a multiple of 16 bytes (aligned rows when R payloads
                      are gathered into one ``[R, P]`` tensor)
"""

from __future__ import annotations

import dataclasses

import torch

#: Quantized formats of the blockwise codecs.
FORMATS: tuple[str, ...] = ("int8", "int4", "fp8", "int2")
#: Largest quantized magnitude per format (the scale maps absmax to it).
QMAX: dict[str, float] = {"int8": 127.0, "int4": 7.0, "fp8": 448.0, "int2": 1.0}
#: The level a block's absmax maps to (scale = absmax / SCALE_LEVEL): QMAX, but 2 for int2.
SCALE_LEVEL: dict[str, float] = {**QMAX, "int2": 2.0}
#: The packed formats: bits per element (several elements per byte, low bits first) and the code
#: offset (code = q + offset, offset binary).
PACKED_BITS: dict[str, int] = {"int4": 4, "int2": 2}
PACKED_OFFSET: dict[str, int] = {"int4": 8, "int2": 2}
#: Default elements per scale.
DEFAULT_BLOCK_SIZE = 256
#: Payload rows are padded to a multiple of this many bytes.
PAYLOAD_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class PayloadLayout:
    """Byte layout of one encoded bucket (see the module docstring)."""

    numel: int
    """N: elements of the bucket."""
    fmt: str
    """One of :data:`FORMATS`."""
    block_size: int
    """Elements per fp32 scale."""
    num_blocks: int
    """ceil(N / block_size): number of fp32 scales in the header."""
    values_offset: int
    """Byte offset of the values (= 4 * num_blocks rounded up to a multiple of 16)."""
    values_bytes: int
    """N for int8/fp8, ceil(N / 2) for int4, ceil(N / 4) for int2."""
    total_bytes: int
    """P: the padded payload size, a multiple of :data:`PAYLOAD_ALIGN`."""


def elements_per_byte(fmt: str) -> int:
    """Elements one value byte holds: 2 for int4, 4 for int2, else 1."""
    return 8 // PACKED_BITS[fmt] if fmt in PACKED_BITS else 1


def check_block_size(block_size: int, fmt: str | None = None) -> None:
    """A block is a power of two and, for a packed ``fmt``, whole bytes (4 elements for int2)."""
    least = max(2, elements_per_byte(fmt) if fmt is not None else 2)
    if block_size < least or block_size & (block_size - 1):
        raise ValueError(f"compression block size must be a power of two >= {least}"
                         f"{f' for {fmt}' if fmt is not None else ''}, got {block_size}")


def payload_layout(numel: int, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> PayloadLayout:
    """The byte layout of the payload of a bucket of ``numel`` elements."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; expected one of {', '.join(FORMATS)}")
    check_block_size(block_size, fmt)
    num_blocks = -(-numel // block_size)
    values_bytes = -(-numel // elements_per_byte(fmt))
    values_offset = -(-4 * num_blocks // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    used = values_offset + values_bytes
    total = -(-used // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    return PayloadLayout(numel, fmt, block_size, num_blocks, values_offset, values_bytes, total)


def split_payload(payload: torch.Tensor, layout: PayloadLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(scales fp32 [num_blocks], values [values_bytes])`` of a ``uint8 [P]`` payload.

    ``values`` is int8 for int8, uint8 (packed codes) for int4 / int2, float8_e4m3fn for fp8.
    """
    if payload.dtype != torch.uint8 or payload.shape != (layout.total_bytes,):
        raise ValueError(f"payload must be uint8 [{layout.total_bytes}], got {payload.dtype} {tuple(payload.shape)}")
    scales = payload[: 4 * layout.num_blocks].view(torch.float32)
    raw = payload[layout.values_offset: layout.values_offset + layout.values_bytes]
    values = {"int8": lambda: raw.view(torch.int8), "fp8": lambda: raw.view(torch.float8_e4m3fn)}.get(
        layout.fmt, lambda: raw)()
    return scales, values


def error_feedback_input(residual: torch.Tensor, anchor: torch.Tensor | None = None,
                         x: torch.Tensor | None = None,
                         pseudo_grad: torch.Tensor | None = None) -> torch.Tensor:
    """``v = (anchor - float(x)) + e``, or ``v = pseudo_grad + e``: fp32 ``[N]``, a new tensor
    (``residual`` is not modified; :func:`error_feedback_input_` is the in-place form, same bits).

    Args:
        residual: e, fp32 ``[N]``. anchor: theta, fp32 ``[N]``. x: local params, bf16 or fp32 ``[N]``.
        pseudo_grad: fp32 ``[N]``, instead of ``anchor`` and ``x``.
    """
    return error_feedback_input_(residual.clone(), anchor, x, pseudo_grad)


def error_feedback_input_(residual: torch.Tensor, anchor: torch.Tensor | None = None,
                          x: torch.Tensor | None = None,
                          pseudo_grad: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`error_feedback_input` written into ``residual`` (fp32 ``[N]``, modified in place and
    returned), without a second ``[N]`` buffer. (fp32 addition commutes: the same bits either way.)"""
    # read 4N (e) + 4N (pseudo_grad) | 4N (anchor) + 2-4N (x), write 4N (v, in place)
    if pseudo_grad is not None:
        if anchor is not None or x is not None:
            raise ValueError("pass either pseudo_grad or (anchor, x), not both")
        return residual.add_(pseudo_grad.float())
    if anchor is None or x is None:
        raise ValueError("pass pseudo_grad or both anchor and x")
    return residual.add_(anchor - x.float())


def quantize_reference(v: torch.Tensor, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of the fp32 ``[N]`` bucket ``v`` (any device; not modified).

    Returns ``(payload uint8 [P], dequant fp32 [N])``; see the module docstring for the math.
    """
    # read 4N, write N (int8/fp8) or N/2 (int4) or N/4 (int2) + 4N/block_size (scales) + 4N (dequant)
    if v.dtype != torch.float32 or v.dim() != 1:
        raise ValueError(f"quantize_reference needs a flat fp32 bucket, got {v.dtype} {tuple(v.shape)}")
    layout = payload_layout(v.numel(), fmt, block_size)
    n, nb, bs = layout.numel, layout.num_blocks, block_size
    qmax = QMAX[fmt]
    payload = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=v.device)  # (P,)
    scales, values = split_payload(payload, layout)
    vb = torch.zeros(nb * bs, dtype=torch.float32, device=v.device)  # (nb*bs,) zero-padded tail
    vb[:n] = v
    vb = vb.view(nb, bs)  # (nb, bs)
    absmax = vb.abs().amax(dim=1) if nb else vb.new_zeros(0)  # (nb,)
    bad = ~torch.isfinite(vb).all(dim=1)  # (nb,)
    # tensor / tensor: torch on CUDA turns a division by a Python scalar into a reciprocal multiply
    scale = torch.where(bad, torch.full_like(absmax, float("nan")),
                        absmax / torch.full_like(absmax, SCALE_LEVEL[fmt]))
    use = (scale > 0).unsqueeze(1)  # (nb, 1); False for 0 and NaN
    y = (vb / torch.where(use, scale.unsqueeze(1), torch.ones_like(vb[:, :1]))).clamp(-qmax, qmax)
    y = torch.where(use, y, torch.zeros_like(y))  # (nb, bs)
    scales.copy_(scale)
    if fmt == "fp8":
        qf = y.to(torch.float8_e4m3fn).float() + 0.0  # (nb, bs) RNE; "+ 0.0": never -0
        values.copy_(qf.view(-1)[:n].to(torch.float8_e4m3fn))
    else:
        qf = torch.round(y) + 0.0  # half to even, |y| <= QMAX; "+ 0.0" turns -0 into +0
        if fmt == "int8":
            values.copy_(qf.view(-1)[:n].to(torch.int8))
        else:  # packed: code = q + offset, element g*i + j in bits [j*bits, (j+1)*bits) of byte i;
            # a block is whole bytes (check_block_size), so a byte never straddles two scales
            bits, g = PACKED_BITS[fmt], elements_per_byte(fmt)
            codes = (qf.view(-1).to(torch.int16) + PACKED_OFFSET[fmt]).view(-1, g)  # (nb*bs/g, g)
            packed = codes[:, 0].clone()
            for j in range(1, g):
                packed |= codes[:, j] << (j * bits)
            values.copy_(packed.to(torch.uint8)[: layout.values_bytes])
    dequant = (qf * scale.unsqueeze(1)).view(-1)[:n]  # (N,)
    return payload, dequant


def dequantize_reference(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """fp32 ``[N]`` dequantized values of one payload (``float(q) * scale`` per element)."""
    # read N (or N/2, N/4) + 4N/block_size, write 4N
    scales, values = split_payload(payload, layout)
    n, bs = layout.numel, layout.block_size
    if layout.fmt in PACKED_BITS:
        bits = PACKED_BITS[layout.fmt]
        b = values.to(torch.int16)
        fields = [(b >> (j * bits)) & ((1 << bits) - 1) for j in range(elements_per_byte(layout.fmt))]
        q = (torch.stack(fields, dim=1).view(-1)[:n] - PACKED_OFFSET[layout.fmt]).float()  # (N,)
    else:
        q = values.float()  # (N,)
    block_scale = scales.repeat_interleave(bs)[:n] if n else scales.new_zeros(0)  # (N,)
    return q * block_scale


def encode_reference(residual: torch.Tensor, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE, *,
                     anchor: torch.Tensor | None = None, x: torch.Tensor | None = None,
                     pseudo_grad: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None) -> torch.Tensor:
    """Error-feedback encode of one flat bucket: ``payload = Q(v)``, ``e_new = v - dequant(payload)``.

    Args:
        residual: e, fp32 ``[N]``; read.
        fmt, block_size: the quantized format and elements per scale.
        anchor, x, pseudo_grad: the pseudo-gradient, as in :func:`error_feedback_input`.
        residual_out: fp32 ``[N]`` receiving e_new; defaults to ``residual`` (updated in place). Pass a
            second buffer to be able to drop the round (non-finite values) and keep e intact.

    Returns:
        the payload, uint8 ``[P]`` (:func:`payload_layout`), on the bucket's device.
    """
    # read 4N (e) + 4N (anchor) + 2-4N (x); write P + 4N (e_new)  [this reference makes ~6 more passes]
    v = error_feedback_input(residual, anchor, x, pseudo_grad)  # (N,) fp32
    payload, dequant = quantize_reference(v, fmt, block_size)
    out = residual if residual_out is None else residual_out
    torch.sub(v, dequant, out=out)
    return payload


def decode_reference(payloads: torch.Tensor, layout: PayloadLayout, out: torch.Tensor | None = None,
                     outer=None) -> torch.Tensor:
    """Mean of the R replicas' dequantized payloads, optionally followed by the outer step.

    Args:
        payloads: uint8 ``[R, P]``, row r = replica r's payload (the all-gather order: the same on
            every rank, so every rank computes the same bits).
        layout: the payloads' layout.
        out: fp32 ``[N]`` receiving Delta; allocated when None. With ``outer`` it is scratch.
        outer: an :class:`~megatron_diloco.algorithm.outer.OuterNesterov` (or ``None``): when given, its
            ``step(Delta)`` runs (theta and momentum updated in place).

    Returns:
        ``out``: Delta = (d_0 + ... + d_{R-1}) * fp32(1/R), fp32 ``[N]`` (garbage after ``outer.step``).
    """
    # read R*P, write 4N  (+ read 8N, write 8N for the outer step)
    if payloads.dim() != 2:
        raise ValueError(f"payloads must be [R, P], got {tuple(payloads.shape)}")
    r = payloads.shape[0]
    acc = dequantize_reference(payloads[0], layout)
    for i in range(1, r):
        acc = acc + dequantize_reference(payloads[i], layout)
    avg = acc.mul_(inverse_replicas(r))
    if out is not None:
        out.copy_(avg)
        avg = out
    if outer is not None:
        outer.step(avg)
    return avg


def inverse_replicas(r: int) -> float:
    """fp32(1/R) as a Python float (exactly representable in fp32): the decode's averaging factor."""
    return float(torch.tensor(1.0 / r, dtype=torch.float32))


def has_nonfinite_scales(payloads: torch.Tensor, layout: PayloadLayout) -> bool:
    """Whether any payload in ``payloads`` (uint8 ``[P]`` or ``[R, P]``) encodes a NaN/Inf block.

    Reads only the scale headers (4 bytes per block); one host sync.
    """
    rows = payloads.view(-1, layout.total_bytes)
    scales = rows[:, : 4 * layout.num_blocks].contiguous().view(torch.float32)
    return bool(scales.numel()) and not bool(torch.isfinite(scales).all())
