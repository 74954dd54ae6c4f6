"""Bounds on the outer operations: the bound T, the groups' backstop timeouts, the error past T.

Every wait on an outer group or the decision group (the exchange, the boundary's decision, the link
measurement) must complete within T of its start (``--diloco-x-outer-timeout-minutes``, or derived:
:meth:`~megatron_diloco.algorithm.config.DiLoCoXConfig.outer_timeout_s`); past it, or on a backend
error, :class:`OuterGroupError` names the round, the operation, the group, the bound and the way out.
The groups' own (backend) timeouts are set above T (:func:`backstop_timeout_s`), so the named error
comes first.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_diloco.algorithm.config import OUTER_TIMEOUT_HEADROOM, DiLoCoXConfig

#: ``dist.set_timeout`` (recent torch), else the private form it replaced (torch >= 2.6 as setup.py allows)
_set_group_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout


class OuterGroupError(RuntimeError):
    """An operation over an outer group (or the skip-decision group) did not complete within
    ``--diloco-x-outer-timeout-minutes`` of its start, or the backend reported it failed: a peer
    replica or the slow link stopped answering. Raised on the training loop's thread, before any
    state of the round is written, so the last completed checkpoint stays the one to resume from.
    The raising rank's :class:`~megatron_diloco.algorithm.sync.OuterSync` is left mid-boundary: end
    the run, do not save it."""


def backstop_timeout_s(bound_s: float) -> float:
    """The process groups' own (backend) timeout for an outer bound ``bound_s``: ``1.25 x bound +
    60 s``. Larger than the bound, so the bounded wait raises its named error first; it fires only
    when the training loop is not waiting when the bound passes (an explicit bound shorter than a
    round's compute), then with the backend's message (NCCL: its watchdog ends the process)."""
    return 1.25 * bound_s + 60.0


class OuterBounds:
    """The groups a rank waits on across replicas, their backstop timeouts, and the errors past T.

    Args:
        config: ``--diloco-x-outer-timeout-minutes`` (or the derived rule) and the flags the errors name.
        group: the outer group; ``exchange_group``: the group the exchange runs on (the outer group,
            or its gloo mirror); ``decision_groups``: the boundary decision's; ``worker``: whether the
            exchange runs on a worker thread (named in the errors).
    """

    def __init__(self, config: DiLoCoXConfig, group: dist.ProcessGroup | None,
                 exchange_group: dist.ProcessGroup | None, decision_groups: tuple[dist.ProcessGroup, ...],
                 worker: bool) -> None:
        self.config = config
        self.group = group
        self.exchange_group = exchange_group
        self.decision_groups = decision_groups
        #: the outer groups of this rank's other exchange slots (:mod:`~megatron_diloco.algorithm.slot_exchange`)
        self.slot_groups: tuple[dist.ProcessGroup | None, ...] = ()
        self.worker = worker
        self._backstop_s: float | None = None  # the groups' own timeout as last set

    def regroup(self, group: dist.ProcessGroup | None, exchange_group: dist.ProcessGroup | None,
                decision_groups: tuple[dist.ProcessGroup, ...],
                slot_groups: tuple[dist.ProcessGroup | None, ...] = ()) -> None:
        """The groups changed (separate jobs: new members; ``slot_groups``: each exchange slot's outer
        group): the next :meth:`arm` sets theirs."""
        self.group, self.exchange_group, self.decision_groups = group, exchange_group, decision_groups
        self.slot_groups = tuple(slot_groups)
        self._backstop_s = None

    def groups(self) -> list[dist.ProcessGroup]:
        """The distinct multi-rank groups this rank waits on (outer, its gloo mirror, decision)."""
        out: list[dist.ProcessGroup] = []
        for g in (self.group, self.exchange_group, *self.decision_groups, *self.slot_groups):
            if g is not None and dist.get_world_size(g) > 1 and not any(g is h for h in out):
                out.append(g)
        return out

    def arm(self, bound_s: float) -> None:
        """Set the groups' own timeout to the backstop of ``bound_s`` (when it grew, or shrank by more
        than 10%: the derived bound follows the step time). Only operations issued afterwards get it
        (NCCL reads it when a collective is enqueued)."""
        backstop = backstop_timeout_s(bound_s)
        if self._backstop_s is not None and 0.9 * self._backstop_s <= backstop <= self._backstop_s:
            return
        for g in self.groups():
            _set_group_timeout(datetime.timedelta(seconds=backstop), g)
        self._backstop_s = backstop

    def describe(self, group: dist.ProcessGroup | None) -> str:
        """``group`` in words, with its global ranks (for the errors)."""
        if group is not None and any(group is g for g in self.decision_groups) and group is not self.group:
            return f"the skip-decision group (all {dist.get_world_size(group)} ranks)"
        ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        mirror = ((" (its gloo mirror, worker thread)" if self.worker else " (its gloo mirror)")
                  if group is self.exchange_group and group is not self.group else "")
        return f"outer group [ranks {', '.join(map(str, ranks))}]{mirror}"

    def failure(self, round_: int, what: str, group: dist.ProcessGroup | None, bound_s: float | None,
                elapsed_s: float, err: BaseException) -> OuterGroupError:
        """The error naming the round, the operation, the group, the bound and the way out."""
        given = self.config.outer_timeout_minutes
        k = f"{OUTER_TIMEOUT_HEADROOM:g}"
        flag = (f"--diloco-x-outer-timeout-minutes {given:g}" if given is not None else
                f"--diloco-x-outer-timeout-minutes, derived: max(--distributed-timeout-minutes, {k} x H x "
                f"step time, {k} x longest exchange)")
        if isinstance(err, TimeoutError):
            how = (f"did not complete within {bound_s:.0f} s ({flag}); the slow link or a peer replica "
                   "stopped answering")
        else:
            how = (f"failed after {elapsed_s:.1f} s: {type(err).__name__}: {err}; a peer replica stopped "
                   "or the link broke")
        return OuterGroupError(
            f"DiLoCoX round {round_}: {what} over "
            f"{self.describe(group)} {how}. Nothing of this round was written: the last completed "
            "checkpoint (--save) is intact; resume from it with --load once the link is back, or raise "
            "--diloco-x-outer-timeout-minutes if the exchange is only slower than that bound.")
