"""What a job accepts from a peer's heal, and where it stands after one: the checks before anything is taken
(:func:`check_heal`), this job's own position at the peer's boundary (:func:`own_position`), its progress moved
onto the peer's theta (:func:`rebase_x`), and tau as a share of a round, so that jobs of different H land together
(:func:`tau_share`, as the boundary's decision carries it). Local, no communication; used by
:class:`~megatron_diloco.algorithm.federated.FederatedRounds`."""

from __future__ import annotations

from typing import Any

import torch

#: the scale of tau as a share of a round in the decision (an integer below 2^53: exact in its float64 slot)
TAU_SHARE_SCALE = 1 << 20


def tau_share(tau: int, round_steps: int) -> int:
    """tau as a share of a round of ``round_steps`` inner steps, in units of 1 / :data:`TAU_SHARE_SCALE`
    rounded up: what a member proposes in the decision, so that jobs of different H agree on a share of
    the round (the same wall time when their rounds take the same time), not on a number of steps."""
    return -(-tau * TAU_SHARE_SCALE // round_steps) if round_steps > 0 else 0


def tau_of_share(share: int, round_steps: int, cap: int) -> int:
    """This job's tau for the agreed ``share`` (:func:`tau_share`, the largest proposed) of its round of
    ``round_steps``: rounded down, at least 1 when the share is not 0, at most ``cap``. A job of the
    same ``round_steps`` as the proposer gets the proposed tau back exactly (``round_steps`` below
    :data:`TAU_SHARE_SCALE`)."""
    if share <= 0:
        return 0
    return min(cap, max(1, share * round_steps // TAU_SHARE_SCALE))


class ForeignStateError(ValueError):
    """A peer offered state of another run or configuration (its identity differs): not taken."""


def check_heal(sync, identity: str | None, state: Any) -> None:
    """Refuse (ValueError; :class:`ForeignStateError` for another run or configuration) a heal that is not
    this rank's outer state (``sync``'s :class:`~megatron_diloco.algorithm.sync.OuterSync`; ``identity``: this
    job's run and configuration): its identity, theta / momentum / pending as fp32 vectors of this shard's
    length and finite (the momentum present exactly when this run keeps one), the counters and the position
    as non-negative integers. Local."""
    if not isinstance(state, dict) or not isinstance(state.get("meta"), dict):
        raise ValueError("a peer job sent a heal without its metadata")
    meta = state["meta"]
    if meta.get("identity") != identity:
        raise ForeignStateError("a member of another run, or with other flags, was ahead; its state was not "
                                "taken (the handshake names the difference)")
    n = sync.theta.numel()

    def vector(name: str, value: Any, required: bool) -> None:
        if value is None:
            if required:
                raise ValueError(f"a peer job sent a heal without {name}")
            return
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.numel() != n:
            what = (f"{value.dtype} x {value.numel()}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise ValueError(f"a peer job sent {name} as {what} for this rank's float32 x {n}: every job must "
                             "use the same TP/PP/DP layout and model")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"a peer job sent a non-finite {name}; not taken")

    vector("theta", state.get("theta"), True)
    vector("the outer momentum", state.get("momentum_buffer"), sync.outer.momentum_buffer is not None)
    if sync.outer.momentum_buffer is None and state.get("momentum_buffer") is not None:
        raise ValueError("a peer job sent an outer momentum this run does not keep (--diloco-x-outer-momentum)")
    vector("the pending exchange", state.get("pending"), False)
    for name in ("rounds", "skipped_rounds", "tau", "committed", "round_steps"):
        if not isinstance(meta.get(name), int) or isinstance(meta[name], bool) or meta[name] < 0:
            raise ValueError(f"a peer job sent a heal whose {name} is {meta.get(name)!r}")
    if meta["round_steps"] < 1:  # (tau may exceed it: before an exchange completes tau is H, also in a warm-up)
        raise ValueError(f"a peer job sent a heal whose round is {meta['round_steps']} steps")
    position = meta.get("position")
    if (not isinstance(position, dict) or not isinstance(position.get("steps"), int) or
            not isinstance(position.get("boundaries"), int) or
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in position.values())):
        raise ValueError(f"a peer job sent a heal whose position is {position!r}")
    if not isinstance(meta.get("timings"), dict):
        raise ValueError("a peer job sent a heal without its timings")


def landing_tau(share: int, schedule, steps: int) -> int:
    """tau of a pending exchange a job takes in a heal at its start: the peer's ``share`` of its round
    (:func:`tau_share`) as this job's steps of the round that starts after
    ``steps`` inner steps, capped as in every round's decision (jobs of other H land after the same share)."""
    own_round = schedule.round_steps(steps)
    return tau_of_share(share, own_round, schedule.tau_cap(own_round))


def own_position(schedule, healed: dict, own: dict) -> dict:
    """This job's position at a peer's healed position (``healed``: the peer's position with its
    ``"boundaries"``; ``schedule``: this job's :class:`~megatron_diloco.algorithm.schedule.RoundSchedule`): the
    inner steps at that boundary on this job's own schedule, and Megatron's iteration offset by as many (the
    peer's offset kept: with the same H, exactly the peer's position). With ``--diloco-x-site-pace`` the job's
    own position ``own`` as it stands (its steps are never the run's), its pace moved to the boundary."""
    if schedule.pace is not None:
        schedule.pace.rebase(int(healed["boundaries"]), int(own["steps"]))
        return {**healed, **own}
    steps = schedule.steps_at_boundary(int(healed["boundaries"]))
    own = {k: v for k, v in healed.items() if k != "boundaries"}
    own["steps"] = steps
    if "iteration" in healed:
        own["iteration"] = int(healed["iteration"]) - int(healed["steps"]) + steps
    return own


@torch.no_grad()
def rebase_x(sync, add: torch.Tensor | None = None, sub: torch.Tensor | None = None) -> None:
    """x <- x - ``sub`` + ``add`` on ``sync``'s shards in place (flat fp32 vectors of its store, theta's length;
    either may be None), chunk by chunk of the store: a job's progress since ``sub`` moved onto ``add`` (a
    healed theta). Local."""
    for lo, hi, (a, s) in sync.store.stream(add, sub):
        xs = sync.view.pieces(lo, hi)
        if not xs:
            continue
        if s is not None:
            torch._foreach_sub_(xs, sync.view.split_like(s, xs))
        if a is not None:
            torch._foreach_add_(xs, sync.view.split_like(a, xs))


def enter_at_theta(sync) -> None:
    """x <- theta on ``sync``'s shards (a joiner, a job caught up): no error feedback (of another theta), nothing
    in flight. Local."""
    sync.x_from(sync.theta)
    if sync.residual is not None:
        sync.residual.zero_()
    sync.params_shared = True
    sync.pending = None
