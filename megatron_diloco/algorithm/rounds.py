"""The seam between the boundary protocols and who takes part in a round: :class:`RoundRules`.

The boundary protocols (:mod:`~megatron_diloco.algorithm.protocols`, over the state
:class:`~megatron_diloco.algorithm.sync.OuterSync` owns) run a round on one rank's shard: the
pseudo-gradient, the launch pass, the exchange, the outer step. How a round is agreed, landed, saved and
finished depends on who the replicas are, and is :attr:`OuterSync.round_rules`:

* :class:`OneWorldRounds` (the default): replicas in one world (or separate launches that share one
  decision group): the boundary's decision all-reduce agrees every round, and every exchange launched
  lands.
* :class:`~megatron_diloco.algorithm.federated.FederatedRounds`: separate jobs that meet, fail, heal
  and rejoin: a round goes ahead only when every member decided, and lands only when it is committed;
  a round that failed is resolved at the next meeting from its :class:`RoundOutcome`.

The protocols call the hooks at fixed points, on every rank, in this order (``none`` / ``partial``;
``delayed`` / ``eager``, one world only, call ``meet``, ``decide``, ``launch`` and ``land`` alike):

1. :meth:`~RoundRules.meet`: after ``partial``'s pending exchange landed, before the pseudo-gradient
   (not on the boundary a job joins at);
2. :meth:`~RoundRules.before_pseudo_gradient` (``none``): x and the residual are about to change;
3. :meth:`~RoundRules.decide`: the boundary's :class:`~megatron_diloco.algorithm.decision.Decision`, or
   None (the round does not go ahead on this job; nothing is launched);
4. :meth:`~RoundRules.launch`: the round's exchange launches now (a decision to go ahead, not a skip);
   ``rotate``: the launch pass left the new residual in the exchange buffer, and the rules place the old one
   (:meth:`OuterSync.rotate_residual`);
5. :meth:`~RoundRules.land`: complete an exchange into the outer step, or not (at the boundary with
   ``none``, tau steps later with ``partial``, at the drain);

and, outside a boundary, :meth:`~RoundRules.before_save` (a checkpoint is written),
:meth:`~RoundRules.committed_residual` (the residual it holds) and :meth:`~RoundRules.finish` (after the
drain). The rules use only :class:`OuterSync`'s public methods and attributes; the protocols call only
these hooks (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from megatron_diloco.algorithm.decision import Decision
from megatron_diloco.algorithm.exchange import AfterStep, ExchangeHandle


@dataclasses.dataclass
class RoundOutcome:
    """One round on this rank as the boundary protocols left it, through the hooks of :class:`RoundRules`
    (:meth:`~RoundRules.decide` opens it, :meth:`~RoundRules.launch` and :meth:`~RoundRules.land` fill it):
    what a failed round is resolved from (:class:`~megatron_diloco.algorithm.federated.FederatedRounds`)."""

    round: int = 0
    """1-based index of the boundary (0: no round yet)."""
    launched: bool = False
    """The round's exchange was launched (with a lossy codec the residual moved on)."""
    residual_before: torch.Tensor | None = None
    """The error-feedback residual from before the launch where it is kept, (N,) fp32 with the outer state;
    None: nothing launched, no residual (lossless codec), or not kept (one world)."""
    x_before: torch.Tensor | None = None
    """The point this replica's progress since the round is counted from, (N,) fp32 with the outer state:
    x_L (``partial``, exact merge) or x before the pseudo-gradient (``none``); None: not kept."""
    committed: bool | None = None
    """None: not landed (yet); True: applied; False: failed on this job (theta and m untouched)."""
    tokens: int = 0
    """Tokens the launched pseudo-gradient covers (separate jobs: what a round nobody committed gives back)."""


class RoundRules(Protocol):
    """How a boundary's round is agreed, landed, saved and finished (module doc). Every hook runs on every
    rank in the same order; those that communicate are collective over the groups the implementation
    names."""

    def meet(self) -> None:
        """Before the pseudo-gradient: who takes part in this round (may regroup :class:`OuterSync`)."""

    def before_pseudo_gradient(self) -> None:
        """``none``: x and the residual are about to change (keep what a failed round restores)."""

    def decide(self, sq: float, tau: int, theta_fp: torch.Tensor | None, local_steps: int = 0) -> Decision | None:
        """The boundary's decision (:meth:`BoundaryDecision.decide`: ``sq`` this rank's squared norm of its
        pseudo-gradient, ``tau`` its overlap steps, ``theta_fp`` theta's fingerprint, int64 ``[2]`` or None,
        ``local_steps`` its proposed H); None: the round does not go ahead on this job."""

    def launch(self, rotate: bool) -> None:
        """The round's exchange launches now. ``rotate``: the launch pass wrote the new residual into the
        exchange buffer; the rules make it the residual (:meth:`OuterSync.rotate_residual`)."""

    def land(self, handle: ExchangeHandle, after: AfterStep | None = None) -> bool:
        """Complete ``handle`` into the outer step (``after`` fused into its pass), or not: whether the step
        was applied."""

    def before_save(self) -> bool:
        """A checkpoint is about to be written: complete the exchange in flight (not applied); returns
        whether the checkpoint holds it as pending."""

    def committed_residual(self) -> torch.Tensor | None:
        """The error-feedback residual a checkpoint holds (None: a lossless codec)."""

    def finish(self) -> None:
        """The end of training, after the drain applied what was in flight."""


class OneWorldRounds:
    """:class:`RoundRules` of replicas that all take part in every round (module doc): no meeting, the
    decision all-reduce over the decision groups agrees, every exchange lands.

    Args:
        sync: the rank's :class:`~megatron_diloco.algorithm.sync.OuterSync`.
    """

    def __init__(self, sync) -> None:
        self.sync = sync

    def meet(self) -> None:
        pass

    def before_pseudo_gradient(self) -> None:
        pass

    def decide(self, sq: float, tau: int, theta_fp: torch.Tensor | None, local_steps: int = 0) -> Decision:
        """:meth:`BoundaryDecision.decide` (collective over the decision groups, bounded; never None)."""
        sync = self.sync
        return sync.decision.decide(sync.rounds, sq, tau, theta_fp, sync.timeout_s, local_steps)

    def launch(self, rotate: bool) -> None:
        if rotate:  # e <- e_new; e_old's storage is the exchange buffer (scratch until the mean comes back)
            self.sync.rotate_residual()

    def land(self, handle: ExchangeHandle, after: AfterStep | None = None) -> bool:
        """Complete ``handle`` into the outer step (collective wait over the outer group, bounded); True."""
        sync = self.sync
        sync.complete(handle, sync.outer, after)
        return True

    def before_save(self) -> bool:
        """Complete the exchange in flight into the exchange buffer (bounded: a hung link raises before anything
        is written); whether there was one."""
        sync = self.sync
        if sync.pending is None:
            return False
        sync.complete(sync.pending)
        return True

    def committed_residual(self) -> torch.Tensor | None:
        return self.sync.residual

    def finish(self) -> None:
        pass
