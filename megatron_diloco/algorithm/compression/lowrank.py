"""PowerSGD-style low-rank codec for the matrix-shaped tensors of a flat bucket, with error feedback.

A tensor of shape ``(m, *rest)`` is viewed as the matrix ``M`` of shape ``(m, n)``, ``n = prod(rest)``,
and sent as ``M ~ P Q^T`` (``P`` ``(m, r)``, ``Q`` ``(n, r)``). One round, on every rank of the outer
group (the math of Vogels et al. 2019, with the basis shared across the group)::

    1. v = pseudo_grad + e                      (in e's buffer; per tensor, M = v viewed as a matrix)
    2. P = M Q                                  Q: last round's averaged basis (warm start), identical
                                                on every rank; initialised from a shared seed
    3. P <- mean_r P_r                          collective #1 (all-gather, fixed-order sum)
    4. P <- orth(P)                             (QR, batched per shape; identical inputs -> outputs)
    5. Q = M^T P
    6. Q <- mean_r Q_r                          collective #2
    7. Delta = P Q^T = P P^T mean_r(M_r)        identical on every rank
    8. e_new = v - P Q_own^T                    error feedback (per replica): Q_own is the Q this
                                                replica sent, so e_new = (I - P P^T) v, bounded; the
                                                replicas' mean of e_new is still mean(v) - Delta

Tensors that are 1-D or small (``rank * (m + n) >= m * n``, or fewer than ``min_numel`` elements) are
never low-ranked: they go through the blockwise quantizer (``fallback="int8"``) or raw fp32
(``fallback="none"``), so they never cost more than raw. With ``factor_format="int8"`` the factors are
quantized (blockwise absmax, :mod:`reference`) before the all-gather and everyone averages the same
dequantized factors: nothing is quantized twice. Quantization and decoding go through the dispatch of
the blockwise codecs (:func:`triton_kernels.encode_blockwise`): the fused Triton kernels on CUDA
(Triton required there), the bit-identical reference on CPU.

Collectives are a parameter: ``allgather(t: Tensor[k]) -> Tensor[R, k]`` (row r = replica r's
``t``); it must be called by every rank of the outer group in the same order (two calls per round
when any tensor is low-ranked, P then Q, plus one per fallback format present, in sorted order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from megatron_diloco.algorithm.compression import reference as ref
from megatron_diloco.algorithm.compression import triton_kernels as tk

AllGather = Callable[[torch.Tensor], torch.Tensor]
#: A tensor of the bucket: (offset in the flat bucket, shape).
Layout = Sequence[tuple[int, tuple[int, ...]]]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(m, n)`` for a tensor viewed as a matrix (first dim x the rest); ``None`` for 0-D/1-D."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def lowrank_pays_off(shape: Sequence[int], rank: int, min_numel: int) -> bool:
    """Whether a rank-``rank`` factorization of ``shape`` is strictly smaller than the tensor itself."""
    mn = matrix_shape(shape)
    if mn is None or rank < 1:
        return False
    m, n = mn
    return m * n >= min_numel and rank * (m + n) < m * n


def init_basis(n: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """The shared initial basis ``Q``: fp32 ``(n, rank)``, identical on every rank and device.

    Drawn on CPU by a generator of its own seeded with ``seed`` (the numbers of ``torch.randn`` after
    ``torch.manual_seed(seed)``), so no global RNG is touched: the matrix codecs call this on their
    worker thread while the training loop draws (``torch.manual_seed`` would also reseed every CUDA
    device's default generator, the one dropout uses, and ``fork_rng`` restores the CPU one under
    the training thread's feet).
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, rank, dtype=torch.float32, generator=gen)  # (n, r)
    return q.to(device)


def _mean_in_order(rows: torch.Tensor) -> torch.Tensor:
    """``(rows[0] + ... + rows[R-1]) * fp32(1/R)``: the same bits on every rank."""
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        acc += rows[i]
    return acc.mul_(ref.inverse_replicas(rows.shape[0]))


def _exchange_mean(flat: torch.Tensor, allgather: AllGather, fmt: str | None,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mean over the group, what this rank did not send)`` of the fp32 ``[k]`` ``flat``.

    ``fmt`` None: sends fp32, everything is sent (``None`` is returned for the second item). Else
    the blockwise format, quantized once by :func:`triton_kernels.encode_blockwise` (the fused
    Triton kernel on CUDA, the reference on CPU: the same bits) and decoded likewise; the second
    item is ``flat - dequant(own payload)``, fp32 ``[k]`` (exact: ``dequant + it == flat``).
    """
    flat = flat.contiguous()
    if fmt is None:
        return _mean_in_order(allgather(flat)), None
    err = torch.zeros_like(flat)  # (k,) fp32: e = 0 in, flat - dequant(payload) out
    payload = tk.encode_blockwise(err, fmt, block_size, pseudo_grad=flat, residual_out=err)  # (P,) uint8
    mean = tk.decode_blockwise(allgather(payload), ref.payload_layout(flat.numel(), fmt, block_size))
    return mean, err


def _orthonormalize(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``Q`` of the reduced QR of every ``(m, r)`` matrix, one batched QR per distinct shape.

    (On CPU a batched QR is the loop of single ones: the same bits; on a GPU it saves a solver
    launch, and its workspace queries, per tensor.)"""
    out: list[torch.Tensor | None] = [None] * len(ps)
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, p in enumerate(ps):
        groups.setdefault(tuple(p.shape), []).append(j)
    for idx in groups.values():
        q = torch.linalg.qr(torch.stack([ps[j] for j in idx]), mode="reduced").Q  # (b, m, r)
        for j, qj in zip(idx, q.unbind(0)):
            out[j] = qj
    return out


@dataclasses.dataclass
class LowRankCodec:
    """Low-rank (+ optional factor quantization) codec over a flat bucket with a tensor layout.

    Tuning: start at rank 4 and double it while the relative error reported by
    :meth:`exchange` stays high; error feedback makes low ranks converge (slower) anyway.
    """

    layout: Layout
    """(offset, shape) of each tensor in the flat bucket, in bucket order."""
    rank: int | dict[int, int] = 4
    """r: rank for every matrix tensor, or per tensor index (the adaptive policy sets these)."""
    factor_format: str | None = None
    """None: fp32 factors. ``"int8"``: blockwise int8 factors (``lowrank-int8``)."""
    fallback: str | dict[int, str] = "int8"
    """Codec of the tensors that are not low-ranked: ``"int8"``/``"int4"``/``"fp8"`` or ``"none"`` (fp32);
    or per tensor index (missing indices: ``"int8"``)."""
    min_numel: int = 4096
    """Tensors with fewer elements are never low-ranked."""
    block_size: int = ref.DEFAULT_BLOCK_SIZE
    """Elements per scale for quantized factors and the fallback."""
    seed: int = 1234
    """Seed of the shared initial bases (the same on every rank)."""

    def __post_init__(self) -> None:
        # ---- internal state (checkpointed by state_dict) ----
        self.bases: dict[int, torch.Tensor] = {}  # tensor index -> Q (n, r) fp32, identical on all ranks

    lossy = True

    @property
    def name(self) -> str:
        return "lowrank" if self.factor_format is None else f"lowrank-{self.factor_format}"

    def fallback_of(self, index: int) -> str:
        return self.fallback.get(index, "int8") if isinstance(self.fallback, dict) else self.fallback

    def rank_of(self, index: int) -> int:
        return self.rank.get(index, 0) if isinstance(self.rank, dict) else self.rank

    def lowranked(self) -> list[int]:
        """Indices of the tensors sent as factors (the others go through the fallback)."""
        return [i for i, (_, shape) in enumerate(self.layout)
                if lowrank_pays_off(shape, self.rank_of(i), self.min_numel)]

    def payload_bytes(self) -> int:
        """Bytes one replica puts into the round's all-gathers (all-gather counts once): all P
        factors as one payload, all Q factors as another, and one payload per fallback format,
        exactly as :meth:`exchange_v` sends them (quantized payloads with their scale headers and
        16-byte alignment padding)."""
        low = set(self.lowranked())
        p_numel = q_numel = 0
        rest: dict[str, int] = {}
        for i, (_, shape) in enumerate(self.layout):
            if i in low:
                m, n = matrix_shape(shape)
                p_numel += m * self.rank_of(i)
                q_numel += n * self.rank_of(i)
            else:
                fmt = self.fallback_of(i)
                rest[fmt] = rest.get(fmt, 0) + math.prod(shape)
        total = self._factor_bytes(p_numel) + self._factor_bytes(q_numel) if low else 0
        return total + sum(self._fallback_bytes(fmt, k) for fmt, k in rest.items())

    def _factor_bytes(self, numel: int) -> int:
        if self.factor_format is None:
            return 4 * numel
        return ref.payload_layout(numel, self.factor_format, self.block_size).total_bytes

    def _fallback_bytes(self, fmt: str, numel: int) -> int:
        if fmt == "none":
            return 4 * numel
        return ref.payload_layout(numel, fmt, self.block_size).total_bytes if numel else 0

    def _basis(self, index: int, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """Q for tensor ``index``: the warm start, cut or extended (shared seeds) to ``rank`` columns."""
        q = self.bases.get(index)
        if q is not None and q.device != device:  # restored from a checkpoint loaded on the CPU
            q = q.to(device)
        if q is None or q.shape[0] != n:
            q = init_basis(n, rank, self.seed + 7919 * index, device)
        elif q.shape[1] > rank:
            q = q[:, :rank].contiguous()
        elif q.shape[1] < rank:  # new columns from their own shared seed
            extra = init_basis(n, rank - q.shape[1], self.seed + 7919 * index + 104729 * rank, device)
            q = torch.cat([q, extra], dim=1)
        return q

    @torch.no_grad()
    def exchange(self, residual: torch.Tensor, allgather: AllGather, *, pseudo_grad: torch.Tensor | None = None,
                 anchor: torch.Tensor | None = None, x: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """One round: encode, exchange (via ``allgather``), decode; the residual is updated in place.

        Args:
            residual: e, fp32 ``[N]`` (the flat bucket); holds v = pseudo_grad + e during the round
                (no second ``[N]`` buffer) and e_new after it.
            allgather: the collective (see the module docstring); every rank calls this with the
                same layout, ranks and call order.
            pseudo_grad / anchor, x: the pseudo-gradient, as in :func:`reference.error_feedback_input`.
                ``pseudo_grad`` is read before ``out`` is written: it may be ``out`` itself.
            out: fp32 ``[N]`` for Delta, allocated when None.

        Returns:
            Delta, fp32 ``[N]``: the group's mean pseudo-gradient as decoded; identical on every rank.
        """
        v = ref.error_feedback_input_(residual, anchor, x, pseudo_grad)  # (N,) fp32, v in residual
        return self.exchange_v(v, residual, allgather, out)

    @torch.no_grad()
    def exchange_v(self, v: torch.Tensor, residual: torch.Tensor, allgather: AllGather,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`exchange` from ``v = pseudo_grad + e`` (fp32 ``[N]``); e_new goes to ``residual``.

        ``v`` may be ``residual`` itself (each tensor's part of v is read before its e_new is written)."""
        avg = torch.empty_like(v) if out is None else out
        low = self.lowranked()
        low_set = set(low)
        rest = [i for i in range(len(self.layout)) if i not in low_set]

        if low:
            mats = []
            for i in low:
                off, shape = self.layout[i]
                m, n = matrix_shape(shape)
                mats.append(v[off: off + m * n].view(m, n))  # (m, n) view of v
            # 2-3. P = M Q, averaged over the group in one collective
            ps = [mat @ self._basis(i, mat.shape[1], self.rank_of(i), v.device) for i, mat in zip(low, mats)]
            p_all, _ = _exchange_mean(torch.cat([p.reshape(-1) for p in ps]), allgather,
                                      self.factor_format, self.block_size)
            # 4-5. orthogonalize, Q = M^T P
            p_views, start = [], 0
            for p in ps:
                m, r = p.shape
                p_views.append(p_all[start: start + m * r].view(m, r))  # (m, r) group mean
                start += m * r
            ps = _orthonormalize(p_views)
            qs = [mat.T @ p for mat, p in zip(mats, ps)]  # (n, r) each
            # 6. Q averaged over the group in one collective
            q_flat = torch.cat([q.reshape(-1) for q in qs])  # (sum n r,) this rank's Q
            q_all, q_err = _exchange_mean(q_flat, allgather, self.factor_format, self.block_size)
            q_sent = q_flat if q_err is None else q_flat.sub_(q_err)  # exactly the dequantized payload
            start = 0
            for i, mat, p in zip(low, mats, ps):
                m, n = mat.shape
                r = p.shape[1]
                q = q_all[start: start + n * r].view(n, r)  # (n, r) group mean
                q_own = q_sent[start: start + n * r].view(n, r)  # (n, r) what this rank sent
                start += n * r
                self.bases[i] = q.clone()  # warm start of the next round
                off = self.layout[i][0]
                torch.mm(p, q.T, out=avg[off: off + m * n].view(m, n))  # 7. P Q^T
                e = residual[off: off + m * n].view(m, n)  # (m, n); mat itself when v is the residual
                if e.data_ptr() != mat.data_ptr():
                    e.copy_(mat)
                e.addmm_(p, q_own.T, alpha=-1.0)  # 8. e_new = v - P Q_own^T (no (m, n) temporary)

        for fmt in sorted({self.fallback_of(i) for i in rest}):  # one collective per format, fixed order
            spans = [(self.layout[i][0], math.prod(self.layout[i][1])) for i in rest if self.fallback_of(i) == fmt]
            sub = torch.cat([v[o: o + k] for o, k in spans])  # (k,) fp32 copy of the fallback tensors
            mean, err = _exchange_mean(sub, allgather, None if fmt == "none" else fmt, self.block_size)
            sizes = [k for _, k in spans]
            torch._foreach_copy_([avg[o: o + k] for o, k in spans], list(mean.split(sizes)))
            if err is None:  # raw fp32: everything sent
                for o, k in spans:
                    residual[o: o + k].zero_()
            else:  # exact: dequant + e_new == v
                torch._foreach_copy_([residual[o: o + k] for o, k in spans], list(err.split(sizes)))
        return avg

    # ---------------- checkpointing ----------------
    def state_dict(self) -> dict:
        """The shared bases (identical on every replica); residuals are checkpointed by their owner."""
        return {"bases": {i: q for i, q in self.bases.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.bases = {int(i): q.clone() for i, q in state["bases"].items()}
