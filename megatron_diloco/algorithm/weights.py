"""The members' weights in a round's mean, for separate jobs (``--diloco-x-lighthouse``), and the decision's
per-member slots they come from.

At every boundary each member puts, into one float64 SUM all-reduce over the outer group (over every exchange
slot's group, :func:`~megatron_diloco.algorithm.slot_exchange.all_reduce_over_slots`), a value per field in its own
slot: the tokens it trained on since the point its pseudo-gradient is taken from; with ``--diloco-x-site-weights
normalized`` the inner steps those tokens took; with ``--diloco-x-site-pace`` its inner-step time. Every member
learns every member's values, so every member computes the same weights. A peer's values are checked before use
(a finite number >= 0; ValueError fails the round on every member alike: they all see the same values).

- ``tokens`` (the default, :func:`token_weights`): ``w_r = R t_r / sum t``. A job that trained on more data (a
  larger global batch, more steps per round) counts for it; one that trained nothing weighs exactly 0.
- ``normalized`` (:func:`normalized_weights`): FedNova's normalized averaging (Wang et al., "Tackling the Objective
  Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020): each pseudo-gradient divided by
  its inner steps ``s_r``, weighed by its tokens, the mean scaled by the token-weighted mean steps:
  ``w_r = R p_r s_eff / s_r``, ``p_r = t_r / sum t``, ``s_eff = sum p s``. A job that runs twice the steps of
  another per round has a pseudo-gradient about twice as long; here it pulls by its data share, not by its length.
  With equal steps the weights are :func:`token_weights`' exactly.

Weights are fp32 values (one rounding each), in the outer group's rank order; None for the plain mean.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.slot_exchange import all_reduce_over_slots


def _checked(values: list[float], what: str) -> None:
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"a member's {what} is not a finite number >= 0: {values}")


def _fp32(values) -> tuple[float, ...]:
    return tuple(float(torch.tensor(v, dtype=torch.float32)) for v in values)


def token_weights(tokens: list[float]) -> tuple[float, ...] | None:
    """The members' weights in a round's mean from the tokens each trained on (``tokens``, in the outer
    group's rank order): ``w_r = R t_r / sum t`` rounded to fp32 (mean 1, so the exchange's
    ``(1/R) sum_r w_r delta_r`` is the token-weighted mean); None when every weight is exactly 1 (equal
    tokens: the plain mean, no extra pass) or nobody trained. A member with no tokens weighs 0. ValueError when a
    count is not a finite number >= 0 (a peer's slot: checked before use)."""
    _checked(tokens, "token count")
    total = float(sum(tokens))
    if total <= 0:
        return None
    weights = _fp32(len(tokens) * t / total for t in tokens)
    return None if all(w == 1.0 for w in weights) else weights


def normalized_weights(tokens: list[float], steps: list[float]) -> tuple[float, ...] | None:
    """``--diloco-x-site-weights normalized`` (module doc): ``w_r = R p_r s_eff / s_r`` from each member's tokens and
    inner steps (both in the outer group's rank order), fp32; :func:`token_weights` when the members with tokens all
    ran the same steps. ValueError: a value that is not a finite number >= 0, or tokens without steps."""
    _checked(tokens, "token count")
    _checked(steps, "inner-step count")
    if len(steps) != len(tokens):
        raise ValueError(f"{len(tokens)} token counts and {len(steps)} step counts")
    if any(t > 0 and s <= 0 for t, s in zip(tokens, steps)):
        raise ValueError(f"a member trained on tokens in no inner steps: tokens {tokens}, steps {steps}")
    ran = {s for t, s in zip(tokens, steps) if t > 0}
    total = float(sum(tokens))
    if len(ran) <= 1 or total <= 0:
        return token_weights(tokens)
    share = [t / total for t in tokens]
    s_eff = sum(p * s for p, s in zip(share, steps))
    return _fp32(len(tokens) * p * s_eff / s if p > 0 else 0.0 for p, s in zip(share, steps))


def member_values(group: dist.ProcessGroup, slot_groups, fields: list[float], timeout_s: float) -> list[list[float]]:
    """Every member's value of each of ``fields`` (this member's, in order): one float64 SUM all-reduce of
    ``len(fields)`` slots per member over ``group`` (and every exchange slot's group, ``slot_groups``), bounded by
    ``timeout_s``; per field the members' values in ``group``'s rank order. Every member must give the same number
    of fields (the handshake compares the flags that decide them). Raises RuntimeError / TimeoutError."""
    n, me = dist.get_world_size(group), group.rank()
    slots = torch.zeros(n * len(fields), dtype=torch.float64)
    for k, value in enumerate(fields):
        slots[k * n + me] = value
    all_reduce_over_slots(slots, dist.ReduceOp.SUM, slot_groups, timeout_s)
    values = slots.tolist()
    return [values[k * n:(k + 1) * n] for k in range(len(fields))]
