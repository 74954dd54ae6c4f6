"""The boundary's one decision all-reduce: skip the round, agree on tau, compare theta across replicas.

Before anything of a round is sent, every rank of the model (all replicas, stages and shards) takes
the same :class:`Decision` from one MAX all-reduce over the decision group(s) of a float64 vector
``[skip, tau, H, fp[W], gid[W]]`` (W: the ranks of the decision groups):

* ``skip``: 1 when this rank's pseudo-gradient shard holds a NaN/Inf (or its fp32 norm overflows):
  a NaN in one stage skips the round of all stages;
* ``tau``: this rank's overlap steps (``partial``); the largest wins, so that the slowest rank's
  exchange is hidden;
* ``H``: this rank's proposed round length (``--diloco-x-local-steps auto``; 0: none); the largest wins,
  and tau is capped by it, so the exchange lands within the round;
* ``fp[slot]``, ``gid[slot]``: this rank's theta fingerprint folded to 52 bits and the id of its outer
  group (-1 in every other rank's slot, so the MAX delivers every rank's to every rank): when the
  members of some outer group disagree, every rank raises :class:`ReplicasDivergedError` alike.

Cost per boundary: 16 B per rank of the world plus 24 B (16 KB at 1024 ranks: latency-bound, one
collective); the fingerprint is two int64 sums over the rank's theta shard, taken by the caller inside
a pass that streams theta anyway; one 16-byte device-to-host copy. Nothing is compared with one replica.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.bounds import OuterBounds
from megatron_diloco.algorithm.link import bounded_all_reduce

#: theta's fingerprint in the decision all-reduce: the two int64 sums (a0, a1) of
#: :func:`megatron_diloco.algorithm.shard_view.fingerprint` folded to (MIX a0 + a1) mod P in [0, 2^52), exact in
#: float64 (P prime). One flipped bit changes a0 by d = +-2^j (j < 32) and a1 by d w (position weight
#: 1 <= w <= 1000003), so the fold by d (MIX + w) mod P, never 0 since 0 < MIX + w < P: it is always
#: seen (but where the 64-bit sums wrap around, a 2^-52 chance)
_FP_PRIME, _FP_MIX = 2**52 - 47, 2**32 + 15


class ReplicasDivergedError(RuntimeError):
    """The outer parameters theta, which every replica must hold bit for bit, differ between replicas
    at a boundary (:meth:`BoundaryDecision.decide` compares their fingerprints). Raised on every rank of
    every replica before anything of the round is launched."""


def _fingerprint_value(fp: torch.Tensor) -> float:
    """``fp`` (int64 ``[2]``, :func:`megatron_diloco.algorithm.shard_view.fingerprint`) as one float64 in
    [0, 2^52), exactly representable; a host sync (16 bytes)."""
    a0, a1 = (v % 2**64 for v in fp.tolist())
    return float((a0 * _FP_MIX + a1) % _FP_PRIME)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank agreed at a boundary."""

    skip: bool
    """Some rank's pseudo-gradient holds a NaN/Inf: the round is skipped on every rank."""
    tau: int
    """The overlap steps of the exchange about to launch: the largest any rank asked for (at most
    :attr:`local_steps` when that is set)."""
    local_steps: int = 0
    """``--diloco-x-local-steps auto``: H of the round this boundary starts, the largest any rank
    proposed; 0: H stays (fixed H, a warm-up round, nothing measured yet)."""
    weights: tuple[float, ...] | None = None
    """Each outer-group member's weight in the mean (its rank order; mean 1), as the round's rules set it
    (separate jobs: the tokens each trained on, :meth:`FederatedRounds.agree`); None: equal weights."""


class BoundaryDecision:
    """The boundary's decision all-reduce of one rank (module doc).

    Args:
        group: the outer group (one rank per replica, same shard): whose members must hold the same theta.
        decision_groups: reduced over in order (the world; or, with replicas in separate worlds, the
            replica's world then the outer group, the first varying fastest in the ranks' numbering).
            Every boundary is collective over them.
        device: where the vector goes when a decision group is not gloo.
        bounds: bounds each all-reduce (:class:`OuterGroupError` past T, naming the group).
    """

    def __init__(self, group: dist.ProcessGroup | None, decision_groups: tuple[dist.ProcessGroup, ...],
                 device: torch.device, bounds: OuterBounds) -> None:
        self.group = group
        self.decision_groups = decision_groups
        self.slot_groups: tuple[dist.ProcessGroup | None, ...] = (group,)
        #: separate jobs: (each exchange slot's virtual rank v, their number V in every job) where the caller
        #: numbers them (sites of different layouts); None: ``job rank x k + j`` of ``job size x k``
        self.virtual: tuple[tuple[int, ...], int] | None = None
        self.device = device
        self.bounds = bounds
        #: ([(this rank's slot, its outer group's id) per exchange slot], slots W) among the decision groups'
        #: ranks; None: nothing to compare
        self._agreement = self._agreement_slot()

    def regroup(self, group: dist.ProcessGroup | None, decision_groups: tuple[dist.ProcessGroup, ...],
                slot_groups: tuple[dist.ProcessGroup | None, ...] | None = None) -> None:
        """The groups changed (separate jobs: new members; ``slot_groups``: each exchange slot's outer group
        where this rank holds several, :mod:`~megatron_diloco.algorithm.slot_exchange`). Local."""
        self.group, self.decision_groups = group, decision_groups
        self.slot_groups = tuple(slot_groups) if slot_groups is not None else (group,)
        self._agreement = self._agreement_slot()

    def _agreement_slot(self) -> tuple[list[tuple[int, int]], int] | None:
        """This rank's places in the theta agreement: ([(its slot among the decision groups' ranks, the id of
        its outer group)] per exchange slot it holds, their number W), or None where there is nothing to
        compare (one replica, no decision group).

        Separate jobs (the outer groups are decision groups): the rank's exchange slot j is virtual rank
        ``v = job rank x k + j`` of ``V = job size x k`` (the same V in every job: sites of different
        data-parallel size hold k slots each where a site of the largest holds one), its slot ``v + V x
        member`` and its outer group's id v. One world: the slot numbers ranks as the outer group lists them
        (:func:`dist.get_process_group_ranks`, the global rank) and the group's id is its lowest member.
        Local."""
        if self.group is None or dist.get_world_size(self.group) <= 1 or not self.decision_groups:
            return None
        if any(g is self.group for g in self.decision_groups):  # separate jobs
            k = len(self.slot_groups)
            if self.virtual is not None:
                vs, V = self.virtual
            else:
                job_rank, job_size = 0, 1
                for g in self.decision_groups:  # the job's world (mixed radix, the first varying fastest)
                    if not any(g is s for s in self.slot_groups):
                        job_rank += g.rank() * job_size
                        job_size *= g.size()
                vs, V = tuple(job_rank * k + j for j in range(k)), job_size * k
            return [(vs[j] + V * g.rank(), vs[j]) for j, g in enumerate(self.slot_groups)], V * self.group.size()
        slot, slots = 0, 1
        for g in self.decision_groups:  # mixed radix: the first group varies fastest
            slot += g.rank() * slots
            slots *= g.size()
        members = dist.get_process_group_ranks(self.group)
        if slot not in members or max(members) >= slots:
            return None  # groups numbered otherwise than topology.py's (not compared)
        return [(slot, min(members))], slots

    def theta_accumulator(self) -> torch.Tensor | None:
        """A zero fingerprint accumulator (int64 ``[2]``; ``[k, 2]`` for k exchange slots; on ``device``) when
        theta is compared at the boundaries, else None (the caller fingerprints theta into it in a pass that
        reads theta)."""
        if self._agreement is None:
            return None
        k = len(self.slot_groups)
        return torch.zeros((2,) if k == 1 else (k, 2), dtype=torch.int64, device=self.device)

    def decide(self, round_: int, pseudo_grad_sq: float, tau: int, theta_fp: torch.Tensor | None,
               timeout_s: Callable[[], float], local_steps: int = 0) -> Decision:
        """The round's :class:`Decision` (blocking; collective over the decision groups, each bounded by
        ``timeout_s()``).

        ``pseudo_grad_sq``: this rank's squared norm of its pseudo-gradient shard (already on the host):
        non-finite when the shard holds a NaN/Inf or its fp32 norm overflows (entries near 1e19: a
        diverged round, skipped as well). ``tau``: this rank's overlap steps; ``local_steps``: its
        proposed H (auto H; 0: none). ``theta_fp``: the
        fingerprint (int64 ``[2]``) of this rank's theta as it stands at the decision (None: not known
        this boundary, then not compared). Raises :class:`ReplicasDivergedError` on every rank when
        replicas' theta differ."""
        groups = [g for g in self.decision_groups if dist.get_world_size(g) > 1]
        groups += [g for g in self.slot_groups[1:] if g is not None and dist.get_world_size(g) > 1]
        on_host = all(dist.get_backend(g) == "gloo" for g in groups)
        slots = self._agreement[1] if self._agreement is not None else 0
        vec = torch.full((3 + 2 * slots,), -1.0, dtype=torch.float64)  # [skip, tau, H, fp[W], gid[W]]
        vec[0], vec[1], vec[2] = 0.0 if math.isfinite(pseudo_grad_sq) else 1.0, float(tau), float(local_steps)
        if self._agreement is not None:
            fps = theta_fp.view(-1, 2) if theta_fp is not None else None
            for j, (slot, gid) in enumerate(self._agreement[0]):
                vec[3 + slot] = _fingerprint_value(fps[j]) if fps is not None else -1.0
                vec[3 + slots + slot] = float(gid)
        if not on_host:
            vec = vec.to(self.device)
        for group in groups:
            bound = timeout_s()
            started = time.perf_counter()
            try:
                bounded_all_reduce(vec, dist.ReduceOp.MAX, group, bound)
            except (RuntimeError, TimeoutError) as err:
                raise self.bounds.failure(round_, "the skip decision (non-finite check)", group, bound,
                                          time.perf_counter() - started, err) from err
        values = vec.tolist()
        if self._agreement is not None:
            self._check_theta_agrees(round_, values[3:3 + slots], values[3 + slots:])
        h = max(0, int(values[2]))
        return Decision(skip=bool(values[0]), tau=min(int(values[1]), h) if h else int(values[1]), local_steps=h)

    @staticmethod
    def _check_theta_agrees(round_: int, fps: list[float], gids: list[float]) -> None:
        """Raise :class:`ReplicasDivergedError` when the members of some outer group hold different
        theta fingerprints (``fps``, ``gids``: per slot, as the decision delivered them; -1: not
        known). Replica r of a group is its r-th member. The same lists on every rank: all raise."""
        members: dict[int, list[tuple[int, float]]] = {}
        for slot, (fp, gid) in enumerate(zip(fps, gids)):
            if gid >= 0:
                members.setdefault(int(gid), []).append((slot, fp))
        odd: set[int] = set()
        where: list[str] = []  # the disagreeing outer groups, by their ranks
        for group in members.values():
            known = [fp for _, fp in group if fp >= 0]
            if len(set(known)) <= 1:
                continue
            common = max(known, key=lambda v: (known.count(v), -known.index(v)))  # ties: lowest replica
            odd.update(r for r, (_, fp) in enumerate(group) if fp >= 0 and fp != common)
            where.append("[ranks " + ", ".join(str(slot) for slot, _ in group) + "]")
        if not odd:
            return
        listed = ", ".join(map(str, sorted(odd)))
        raise ReplicasDivergedError(
            f"DiLoCoX round {round_}: the outer parameters theta differ across replicas at this "
            f"boundary: replica{'s' if len(odd) > 1 else ''} {listed} differ{'' if len(odd) > 1 else 's'} from "
            f"the others in {len(where)} of {len(members)} outer groups ({', '.join(where[:4])}"
            f"{', ...' if len(where) > 4 else ''}); theta must be bit-identical "
            "on every replica. Likely causes: a payload corrupted on the outer link, a decode or outer step "
            "that is not bit-reproducible across the replicas' devices (other GPU generations, library or "
            "package versions), or memory corruption. Nothing of this round was launched; resume from the "
            "last checkpoint with --load (it holds one theta for every replica) on hardware and software "
            "that agree.")
