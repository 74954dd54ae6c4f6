"""Adaptive compression policy: per-tensor rank from captured energy, and a per-round byte budget.

Per matrix tensor ``M`` (``(m, n)`` view, see :mod:`lowrank`), every ``reevaluate_every`` rounds:

1. Estimate the spectrum with a randomized range finder (Halko et al. 2011) on a sketch: a seeded
   Gaussian ``Omega`` ``(n, max_rank + oversample)`` (one per matrix shape), ``Y = M (M^T (M Omega))``
   (one power iteration), ``B = orth(Y)^T M`` and ``sigma^2 = eigvalsh(B B^T)`` (fp64, on CPU).
   Cost ``O(mn(max_rank + oversample))``, the same order as one low-rank round, and no ``m x n`` SVD;
   matrices of one shape are sketched together (batched QR, one host transfer per shape).
2. Captured energy of rank r: ``E(r) = sum_{i<r} sigma_i^2 / ||M||_F^2``. This is what the best
   rank-r approximation *within the sketch* captures: at most the truncated SVD's energy, and
   more than the codec's own round achieves (one power iteration from last round's basis, on the
   replicas' mean, with int8 factors). On real pseudo-gradients the achieved per-round error is
   well above ``sqrt(1 - energy_target)``; the error feedback carries the rest into later rounds
   (see the README).
3. Rank = the smallest r <= ``max_rank`` with ``E(r) >= energy_target``. If there is none, or a
   factorization of that rank does not pay off (``r (m + n) >= m n``, or the tensor is small or 1-D),
   the tensor is quantized blockwise instead (int8), which meets any practical target.
4. The replicas agree on the ranks and on the budget (one ``agree`` collective, elementwise MAX over
   the ranks and the negated budgets), so the round's layout is the same on every rank of the outer
   group even though each replica measures its own step time.
5. Byte budget ``= bandwidth_bytes_per_s * local_steps * step_time_s`` (the exchange hides under the
   H inner steps of the next round), the smallest over the group. While the plan exceeds it, the
   largest contributor steps down:
   low-rank tensors halve their rank (down to 1), quantized tensors go int8 -> int4, and a
   quantized matrix that can be factored goes int4 -> the largest rank <= ``max_rank`` whose
   factors are smaller than its int4 payload (then halves like the others): past int4, a low-rank
   approximation that misses the energy target still beats exceeding the link. If even the
   smallest plan exceeds the budget, that plan is used and ``over_budget`` is set (log it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Sequence

import torch

from megatron_diloco.algorithm.compression import reference as ref
from megatron_diloco.algorithm.compression.lowrank import init_basis, lowrank_pays_off, matrix_shape

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorChoice:
    """How one tensor is sent this round."""

    rank: int
    """r > 0: low-rank with int8 factors; 0: quantized blockwise with ``fmt``."""
    fmt: str
    """Blockwise format of the factors (rank > 0) or of the tensor (rank 0)."""
    bytes: int
    """Payload bytes of this tensor per replica per round, laid out on its own. The exchange packs all
    factors (and all fallback tensors of one format) into one payload, which never needs more: the
    round's bytes (:meth:`LowRankCodec.payload_bytes`) are at most the plan's sum."""


def energy_curves(mats: Sequence[torch.Tensor], max_rank: int, seed: int, oversample: int = 8) -> torch.Tensor:
    """Estimated captured energy ``E(r)``, r = 1..k, of same-shape matrices: fp32 ``[b, k]`` on CPU.

    ``k = min(max_rank, m, n)``. One sketch ``Omega`` (seeded) serves the whole group; the QR runs
    batched, and the only host transfer is the ``[b, w, w]`` Grams and ``[b]`` norms at the end.
    Cost per matrix: 4 products ``(m, n) x (n|m, w)``, ``w = min(k + oversample, n)``, one ``(m, w)``
    QR and a ``(w, w)`` fp64 eigendecomposition on CPU (no ``m x n`` SVD, no fp64 copy of ``M``).

    Args:
        mats: ``b`` fp32 ``(m, n)`` matrices on one device (views are fine); not modified.
    """
    b = len(mats)
    m, n = mats[0].shape
    k = min(max_rank, m, n)
    if k <= 0:
        return torch.ones(b, 0)
    width = min(k + oversample, n)
    omega = init_basis(n, width, seed, mats[0].device)  # (n, w)
    ys = torch.stack([mat @ (mat.T @ (mat @ omega)) for mat in mats])  # (b, m, w): one power iteration
    basis = torch.linalg.qr(ys, mode="reduced").Q  # (b, m, w)
    sketches = [q.T @ mat for q, mat in zip(basis.unbind(0), mats)]  # B = basis^T M, (w, n) each
    grams = torch.stack([sk @ sk.T for sk in sketches])  # (b, w, w): sigma(B)^2 = eig(B B^T)
    totals = torch.stack([torch.linalg.vector_norm(mat) for mat in mats])  # (b,) ||M||_F, fp32
    grams, totals = grams.double().cpu(), totals.double().cpu().square()  # the one host sync
    sigma_sq = torch.linalg.eigvalsh(grams).flip(-1).clamp(min=0.0)[:, :k]  # (b, k) descending
    curve = (sigma_sq.cumsum(1) / totals.clamp(min=torch.finfo(torch.float64).tiny)[:, None]).clamp(max=1.0)
    return torch.where((totals == 0)[:, None], torch.ones_like(curve), curve).float()


def energy_curve(mat: torch.Tensor, max_rank: int, seed: int, oversample: int = 8) -> torch.Tensor:
    """Estimated captured energy ``E(r)`` for r = 1..k, fp32 ``[k]``, ``k = min(max_rank, m, n)``.

    Args:
        mat: ``M``, fp32 ``(m, n)``; not modified. See :func:`energy_curves`.
    """
    return energy_curves([mat], max_rank, seed, oversample)[0]


def _tensor_bytes(shape: Sequence[int], rank: int, fmt: str, block_size: int) -> int:
    if rank > 0:
        m, n = matrix_shape(shape)
        return sum(ref.payload_layout(k * rank, fmt, block_size).total_bytes for k in (m, n))
    return ref.payload_layout(math.prod(shape), fmt, block_size).total_bytes


@dataclasses.dataclass
class AdaptivePolicy:
    """Chooses per-tensor ranks/bits (see the module docstring). Internal state: the last plan."""

    # ---------------- tuned hyperparameters ----------------
    energy_target: float = 0.9
    """Target captured energy per tensor (``--diloco-x-energy``)."""
    max_rank: int = 64
    """Largest rank considered."""
    reevaluate_every: int = 5
    """Rounds between re-evaluations of the ranks (pseudo-gradient rank falls during training)."""
    budget_bytes: float | None = None
    """Payload bytes allowed per replica per round (:func:`byte_budget`); None: no cap."""
    min_numel: int = 4096
    """Tensors with fewer elements are quantized, never low-ranked."""
    block_size: int = ref.DEFAULT_BLOCK_SIZE
    seed: int = 4321

    def __post_init__(self) -> None:
        if not 0.0 < self.energy_target <= 1.0:
            raise ValueError(f"--diloco-x-energy must be in (0, 1], got {self.energy_target!r}")
        # ---------------- internal state ----------------
        self.plan: list[TensorChoice] | None = None
        self.evaluated_at: int | None = None
        self.over_budget = False

    def choose(self, bucket: torch.Tensor, layout: Sequence[tuple[int, tuple[int, ...]]], round_index: int,
               agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[TensorChoice]:
        """The plan for round ``round_index`` (re-evaluated every ``reevaluate_every`` rounds).

        Args:
            bucket: this replica's pseudo-gradient (+ residual), fp32 ``[N]``; read.
            layout: (offset, shape) per tensor.
            agree: elementwise MAX over the outer group of an int64 ``[T + 1]`` CPU tensor (all ranks
                must call it together, at the same rounds): the T ranks, then the negated byte
                budget, so that every replica fits the plan to the group's smallest budget (each
                replica measures its own step time). None for a single replica.
        """
        if self.plan is not None and self.evaluated_at is not None \
                and round_index - self.evaluated_at < self.reevaluate_every:
            return self.plan
        ranks = torch.zeros(len(layout), dtype=torch.int64)
        groups: dict[tuple[int, int], list[int]] = {}  # matrix shape -> tensor indices: one batched sketch
        for i, (_, shape) in enumerate(layout):
            if lowrank_pays_off(shape, 1, self.min_numel):
                groups.setdefault(matrix_shape(shape), []).append(i)
        for (m, n), idx in groups.items():
            mats = [bucket[layout[i][0]: layout[i][0] + m * n].view(m, n) for i in idx]
            hit = energy_curves(mats, self.max_rank, self.seed + idx[0]) >= self.energy_target  # (b, k)
            first = hit.to(torch.int64).argmax(dim=1) + 1  # smallest rank meeting the target
            ranks[idx] = torch.where(hit.any(dim=1), first, 0)  # target out of reach: quantize
        budget = self.budget_bytes
        if agree is not None:
            no_cap = -(1 << 62)  # no budget (and any budget beyond 2^62 bytes)
            neg = no_cap if budget is None else -min(int(budget), 1 << 62)
            packed = agree(torch.cat([ranks, torch.tensor([neg], dtype=torch.int64)]))
            ranks = packed[:-1]
            budget = None if int(packed[-1]) == no_cap else float(-int(packed[-1]))
        plan = []
        for i, (_, shape) in enumerate(layout):
            r = int(ranks[i])
            if r > 0 and lowrank_pays_off(shape, r, self.min_numel):
                plan.append(TensorChoice(r, "int8", _tensor_bytes(shape, r, "int8", self.block_size)))
            else:
                plan.append(TensorChoice(0, "int8", _tensor_bytes(shape, 0, "int8", self.block_size)))
        self.plan = self._fit(plan, layout, budget)
        self.evaluated_at = round_index
        logger.info("megatron_diloco adaptive compression: ranks %s, %d bytes/round (budget %s)",
                    [c.rank if c.rank else c.fmt for c in self.plan], sum(c.bytes for c in self.plan), budget)
        return self.plan

    def fit_budget(self, plan: list[TensorChoice], layout) -> list[TensorChoice]:
        """Step the largest contributors down until the plan fits ``budget_bytes`` (or nothing is left)."""
        return self._fit(plan, layout, self.budget_bytes)

    def _fit(self, plan: list[TensorChoice], layout, budget: float | None) -> list[TensorChoice]:
        plan = list(plan)
        self.over_budget = False
        if budget is None:
            return plan
        while sum(c.bytes for c in plan) > budget:
            best = None
            for i in sorted(range(len(plan)), key=lambda j: -plan[j].bytes):
                c, shape = plan[i], layout[i][1]
                if c.rank > 1:
                    best = (i, TensorChoice(c.rank // 2, c.fmt, _tensor_bytes(shape, c.rank // 2, c.fmt,
                                                                                self.block_size)))
                elif c.rank == 0 and c.fmt == "int8":
                    best = (i, TensorChoice(0, "int4", _tensor_bytes(shape, 0, "int4", self.block_size)))
                elif c.rank == 0 and c.fmt == "int4":
                    r = self._largest_rank_below(shape, c.bytes)
                    if r:
                        best = (i, TensorChoice(r, "int8", _tensor_bytes(shape, r, "int8", self.block_size)))
                if best is not None:
                    break
            if best is None:
                self.over_budget = True
                logger.warning("megatron_diloco adaptive compression: %d bytes/round exceed the budget of %d "
                               "even at the smallest ranks/bits", sum(c.bytes for c in plan), budget)
                break
            plan[best[0]] = best[1]
        return plan

    def _largest_rank_below(self, shape: Sequence[int], nbytes: int) -> int:
        """The largest rank <= ``max_rank`` at which ``shape`` may be factored and whose int8
        factors take fewer than ``nbytes``; 0 if none (1-D, small, or even rank 1 is larger)."""
        for r in range(self.max_rank, 0, -1):
            if lowrank_pays_off(shape, r, self.min_numel) and \
                    _tensor_bytes(shape, r, "int8", self.block_size) < nbytes:
                return r
        return 0

    def state_dict(self) -> dict:
        return {"plan": [dataclasses.astuple(c) for c in self.plan] if self.plan else None,
                "evaluated_at": self.evaluated_at}

    def load_state_dict(self, state: dict) -> None:
        self.plan = [TensorChoice(*c) for c in state["plan"]] if state["plan"] else None
        self.evaluated_at = state["evaluated_at"]


def byte_budget(bandwidth_bytes_per_s: float, local_steps: int, step_time_s: float) -> float:
    """Bytes one replica may send per round so the exchange hides under H inner steps."""
    return bandwidth_bytes_per_s * local_steps * step_time_s
