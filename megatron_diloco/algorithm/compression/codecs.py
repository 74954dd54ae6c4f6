"""Codec objects behind ``--diloco-x-compression``: one interface over the blockwise, low-rank and
adaptive codecs, with byte accounting.

Every codec has ``exchange(residual, allgather, *, anchor, x | pseudo_grad, out, ...) -> Delta``:
encode with error feedback, all-gather the payloads over the outer group, decode in replica order
(so every rank gets the same bits), and ``payload_bytes()`` (bytes one replica sends per round; for
``none`` and the blockwise codecs :func:`payload_bytes` of the name, which the planner asks too).
The blockwise codecs (``int8``, ``int4``, ``fp8``) also expose the two halves, ``encode`` and
``decode(..., outer=)``, which :func:`megatron_diloco.algorithm.exchange.start_exchange` runs around one
asynchronous all-gather (the decode fused with the outer step). Training sends ``none`` as an fp32
all-reduce (:data:`megatron_diloco.algorithm.config.CODECS`); :class:`RawCodec`'s own ``exchange`` is the
all-gather form of the same mean, for the codec-level tests and benchmarks.
"""

from __future__ import annotations

import torch

from megatron_diloco.algorithm.compression import reference as ref
from megatron_diloco.algorithm.config import CODECS
from megatron_diloco.algorithm.compression import triton_kernels as tk
from megatron_diloco.algorithm.compression.lowrank import AllGather, Layout, LowRankCodec
from megatron_diloco.algorithm.compression.policy import AdaptivePolicy


def payload_bytes(name: str, numel: int, block_size: int = ref.DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one replica's payload of ``numel`` elements under ``--diloco-x-compression name``:
    ``4 numel`` (``none``, the fp32 values) or the blockwise layout's padded size
    (:func:`reference.payload_layout`: scales, values, padding). The codecs' own ``payload_bytes`` and
    the planner (``python -m megatron_diloco.plan``) both count with it. Pure arithmetic. The matrix
    codecs' payloads depend on the tensors' shapes and ranks: ``ValueError`` (ask the codec object)."""
    if name == "none":
        return 4 * numel
    if name in ref.FORMATS:
        return ref.payload_layout(numel, name, block_size).total_bytes
    raise ValueError(f"--diloco-x-compression {name}: the payload size depends on the tensors' shapes; "
                     f"only none and {', '.join(ref.FORMATS)} have one per element count")


def has_nonfinite(bucket: torch.Tensor) -> bool:
    """Whether the fp32 ``[N]`` bucket holds a NaN or Inf (one read pass; one host sync)."""
    return bucket.numel() > 0 and not bool(torch.isfinite(bucket).all())


class RawCodec:
    """``none``: the fp32 pseudo-gradient itself (lossless, no residual)."""

    name = "none"
    lossy = False

    def payload_bytes(self, numel: int) -> int:
        return payload_bytes(self.name, numel)

    def encode(self, residual: torch.Tensor | None = None, *, anchor=None, x=None, pseudo_grad=None,
               residual_out=None) -> torch.Tensor:
        """The payload: the pseudo-gradient's fp32 bytes, uint8 ``[4N]`` (the residual stays 0)."""
        v = pseudo_grad.float().clone() if pseudo_grad is not None else anchor - x.float()  # (N,)
        return v.view(torch.uint8)

    def decode(self, payloads: torch.Tensor, numel: int, out=None, outer=None) -> torch.Tensor:
        """Ordered mean of the ``[R, 4N]`` payloads (fp32 ``[N]``), then ``outer.step`` if given."""
        rows = payloads.view(torch.float32)  # (R, N)
        acc = rows[0].clone()
        for i in range(1, rows.shape[0]):
            acc += rows[i]
        avg = acc.mul_(ref.inverse_replicas(rows.shape[0]))
        if out is not None:
            avg = out.copy_(avg)
        if outer is not None:
            outer.step(avg)
        return avg

    def exchange(self, residual, allgather: AllGather, *, out=None, outer=None, **pg) -> torch.Tensor:
        payload = self.encode(residual, **pg)
        return self.decode(allgather(payload), payload.numel() // 4, out=out, outer=outer)


class BlockwiseCodec:
    """``int8`` / ``int4`` / ``fp8`` / ``int2``: blockwise absmax quantization with error feedback.

    Runs the fused Triton kernels on CUDA (Triton required there) and under ``TRITON_INTERPRET=1``,
    the reference otherwise. ``fp8`` needs a CUDA GPU with float8 support (sm89+).
    """

    lossy = True

    def __init__(self, fmt: str, block_size: int = ref.DEFAULT_BLOCK_SIZE) -> None:
        ref.check_block_size(block_size, fmt)
        self.name = fmt
        self.fmt = fmt
        self.block_size = block_size

    def layout(self, numel: int) -> ref.PayloadLayout:
        return ref.payload_layout(numel, self.fmt, self.block_size)

    def payload_bytes(self, numel: int) -> int:
        return payload_bytes(self.fmt, numel, self.block_size)

    def _check_device(self, device: torch.device) -> None:
        if self.fmt != "fp8":
            return
        if device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 9):
                raise RuntimeError("--diloco-x-compression fp8 needs an sm89+ GPU (H100/H200/L40/4090); "
                                   "use --diloco-x-compression int8")
        elif not tk.interpreting():
            raise RuntimeError(f"--diloco-x-compression fp8 runs on CUDA GPUs only (got a {device.type} "
                               "bucket); use --diloco-x-compression int8 on CPU")

    def encode(self, residual: torch.Tensor, *, anchor=None, x=None, pseudo_grad=None,
               residual_out=None) -> torch.Tensor:
        """Error-feedback encode (see :func:`reference.encode_reference`); returns uint8 ``[P]``."""
        self._check_device(residual.device)
        return tk.encode_blockwise(residual, self.fmt, self.block_size, anchor=anchor, x=x,
                                   pseudo_grad=pseudo_grad, residual_out=residual_out)

    def decode(self, payloads: torch.Tensor, numel: int, out=None, outer=None) -> torch.Tensor | None:
        """Ordered mean of the ``[R, P]`` payloads, optionally fused with ``outer.step``."""
        return tk.decode_blockwise(payloads, self.layout(numel), out=out, outer=outer)

    def exchange(self, residual, allgather: AllGather, *, out=None, outer=None, **pg):
        payload = self.encode(residual, **pg)
        return self.decode(allgather(payload), residual.numel(), out=out, outer=outer)

    # ---- one chunk [lo, hi) of a bucket of ``numel`` elements (megatron_diloco.algorithm.outer_store) ----
    def _chunk_bytes(self, numel: int, lo: int, hi: int) -> tuple[ref.PayloadLayout, ref.PayloadLayout,
                                                                    slice, slice, slice, slice]:
        """(full layout, chunk layout, then the byte ranges of the chunk's scales and values in the
        full payload and in the chunk's own payload). ``lo`` must start a block."""
        if lo % self.block_size or not 0 <= lo < hi <= numel or (hi < numel and hi % self.block_size):
            raise ValueError(f"chunk [{lo}, {hi}) of {numel} elements does not fall on {self.block_size}-element "
                             "blocks")
        full, part = self.layout(numel), self.layout(hi - lo)
        b0 = lo // self.block_size
        g = ref.elements_per_byte(self.fmt)
        v0, v1 = lo // g, -(-hi // g)
        return (full, part, slice(4 * b0, 4 * (b0 + part.num_blocks)), slice(0, 4 * part.num_blocks),
                slice(full.values_offset + v0, full.values_offset + v1),
                slice(part.values_offset, part.values_offset + part.values_bytes))

    def encode_into(self, payload: torch.Tensor | None, numel: int, lo: int, residual: torch.Tensor,
                    pseudo_grad: torch.Tensor, residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode the chunk ``[lo, lo + len)`` of a bucket of ``numel`` elements (``residual``,
        ``pseudo_grad``: fp32, that chunk; e_new into ``residual_out``, default the residual itself,
        in place) into the bucket's payload:
        the same bytes :meth:`encode` of the whole bucket writes there (blocks never straddle a
        chunk). ``payload``: uint8 ``[P]`` of the whole bucket, zero-initialized (None for a chunk
        that is the whole bucket: the encoded payload is returned as it is). Returns the payload."""
        part = self.encode(residual, pseudo_grad=pseudo_grad,
                           residual_out=residual if residual_out is None else residual_out)  # (P_chunk,)
        if lo == 0 and residual.numel() == numel:
            return part
        _, _, s_full, s_part, v_full, v_part = self._chunk_bytes(numel, lo, lo + residual.numel())
        payload[s_full].copy_(part[s_part])
        payload[v_full].copy_(part[v_part])
        return payload

    def weigh(self, payloads: torch.Tensor, numel: int, weights: "tuple[float, ...]") -> None:
        """Weigh the gathered ``[R, P]`` payloads of a bucket of ``numel`` elements in place: row r's fp32
        block scales times ``weights[r]`` (fp32, one rounding per scale), so that the ordered mean
        :meth:`decode` takes of them is ``(1/R) sum_r weights[r] dequant_r``. Local; the same bits on every
        rank given the same rows and weights."""
        blocks = self.layout(numel).num_blocks
        for r, w in enumerate(weights):
            if w != 1.0:
                payloads[r, :4 * blocks].view(torch.float32).mul_(w)

    def decode_range(self, payloads: torch.Tensor, numel: int, lo: int, hi: int, out=None, outer=None):
        """:meth:`decode` of the chunk ``[lo, hi)`` of the ``[R, P]`` payloads of a bucket of ``numel``
        elements: ``out`` / ``outer`` over that chunk only. Bit-identical to the chunk's part of the
        whole decode (the same blocks, the same ordered sum)."""
        if lo == 0 and hi == numel:
            return self.decode(payloads, numel, out=out, outer=outer)
        _, part, s_full, s_part, v_full, v_part = self._chunk_bytes(numel, lo, hi)
        rows = torch.zeros(payloads.shape[0], part.total_bytes, dtype=torch.uint8,
                           device=payloads.device)  # (R, P_chunk)
        rows[:, s_part].copy_(payloads[:, s_full])
        rows[:, v_part].copy_(payloads[:, v_full])
        return self.decode(rows, hi - lo, out=out, outer=outer)


class AdaptiveCodec:
    """``adaptive``: :class:`AdaptivePolicy` picks ranks/bits, :class:`LowRankCodec` sends them."""

    name = "adaptive"
    lossy = True

    def __init__(self, layout: Layout, policy: AdaptivePolicy | None = None, seed: int = 1234) -> None:
        self.policy = policy or AdaptivePolicy()
        self.lowrank = LowRankCodec(layout, rank={}, factor_format="int8", fallback={},
                                    min_numel=self.policy.min_numel, block_size=self.policy.block_size, seed=seed)
        self.rounds = 0

    def payload_bytes(self, numel: int | None = None) -> int:
        return self.lowrank.payload_bytes()

    @torch.no_grad()
    def exchange(self, residual, allgather: AllGather, *, agree=None, out=None, **pg) -> torch.Tensor:
        """One round; ``agree`` is the policy's MAX collective (see :meth:`AdaptivePolicy.choose`)."""
        self.rounds += 1
        v = ref.error_feedback_input_(residual, **pg)  # (N,) fp32: v = pseudo_grad + e, in the residual
        plan = self.policy.choose(v, self.lowrank.layout, self.rounds, agree)
        self.lowrank.rank = {i: c.rank for i, c in enumerate(plan) if c.rank > 0}
        self.lowrank.fallback = {i: c.fmt for i, c in enumerate(plan) if c.rank == 0}
        return self.lowrank.exchange_v(v, residual, allgather, out)

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "policy": self.policy.state_dict(), "lowrank": self.lowrank.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rounds = int(state["rounds"])
        self.policy.load_state_dict(state["policy"])
        self.lowrank.load_state_dict(state["lowrank"])


def get_codec(name: str, layout: Layout | None = None, *, rank: int = 4, block_size: int = ref.DEFAULT_BLOCK_SIZE,
              policy: AdaptivePolicy | None = None):
    """The codec for ``--diloco-x-compression name``.

    Args:
        layout: (offset, shape) of the bucket's tensors; required by the low-rank codecs.
        rank: ``--diloco-x-rank`` for ``lowrank``/``lowrank-int8``. policy: for ``adaptive``.
    """
    spec = CODECS.get(name)
    if spec is None:
        raise ValueError(f"--diloco-x-compression must be one of {', '.join(CODECS)}, got {name!r}")
    if name == "none":
        return RawCodec()
    if name in ref.FORMATS:
        return BlockwiseCodec(name, block_size)
    if spec.matrix:
        if layout is None:
            raise ValueError(f"--diloco-x-compression {name} needs the bucket's tensor layout")
        if name == "adaptive":
            return AdaptiveCodec(layout, policy)
        quant = "int8" if name == "lowrank-int8" else None
        return LowRankCodec(layout, rank=rank, factor_format=quant, fallback="int8" if quant else "none",
                            block_size=block_size)
    raise AssertionError(f"codec {name!r} is registered in config.CODECS but get_codec cannot build it")
