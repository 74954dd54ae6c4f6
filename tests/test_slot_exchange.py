"""A rank holding two exchange slots computes exactly what the two ranks of a twin of its site compute
(``megatron_diloco.algorithm.slot_exchange``), on gloo ranks with a scripted membership in place of torchft.

Two separate jobs, A and B, run the same rounds (``FederatedRounds``, token-weighted: A trains on twice B's
tokens per step). Two layouts of the same run:

* **twins**: both jobs at DP 2 (4 ranks): each rank holds one slot, slot j's outer group is rank j of both;
* **mixed**: A at DP 2, B at DP 1 (3 ranks): B's one rank holds both slots, one after the other, slot j
  exchanged over its own group with A's rank j.

Every value is a function of the element's place in the slot-major vector only, so the mixed B must equal
the twins' two B ranks side by side, bit for bit: theta and x at every boundary and at the end, for the fp32
exchange and for int4 with error feedback (whose blocks must restart at each slot: the slot of 320 elements
is not a multiple of the codec's 256-element block), under the default overlap (``partial``) and ``none``.
The jobs' theta agree across the run's outer groups (the decision compares them, slot by slot).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.decision import ReplicasDivergedError
from megatron_diloco.algorithm.federated import FederatedRounds, Meeting
from megatron_diloco.algorithm.shard_view import ShardView
from megatron_diloco.algorithm.sync import OuterSync
from megatron_diloco.federation.auth import RunKey
from megatron_diloco.federation.handshake import means_agree
from tests.dist_utils import run_world
from tests.inner_steps import boundaries, paced_boundaries

SLOT, H, STEPS = 320, 4, 17  # the last round is shorter (17 = 4 x 4 + 1)
KEY = RunKey(b"a test secret of the run", "test-run")
#: per layout: each rank's (job, slots held), in rank order
LAYOUTS = {"twins": [("B", (0,)), ("B", (1,)), ("A", (0,)), ("A", (1,))],
           "mixed": [("B", (0, 1)), ("A", (0,)), ("A", (1,))]}
TOKENS = {"A": 2, "B": 1}  # per inner step


class SlotMembership:
    """Both jobs present at every boundary (no heal: they start together); each slot's outer group as the
    layout gives it; the mean checked slot by slot over each slot's group."""

    def __init__(self, job_group, slot_groups: tuple) -> None:
        self.job_group = job_group
        self.slot_groups = slot_groups
        self.first = True

    def meet(self, progress: int) -> Meeting:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, progress)
        assert len(set(everyone)) == 1, everyone  # (this test has no heal)
        changed, self.first = self.first, False
        slots = self.slot_groups if len(self.slot_groups) > 1 else None
        return Meeting(self.slot_groups[0], changed, 2, slot_groups=slots)

    def abandon(self) -> None:
        pass

    def commit(self, ok: bool, mean: bytes | None = None) -> bool:
        if ok and mean is not None:  # one 16-byte fingerprint per slot, each checked over its slot's group
            for j, group in enumerate(self.slot_groups):
                agree, why = means_agree(group, KEY, 0, self.rounds(), mean[16 * j:16 * j + 16], 30.0)
                assert agree, why
        return ok


def _values(slots: tuple, salt: float) -> torch.Tensor:
    """A dyadic value per element, from its place in the slot-major vector of the run (slot x SLOT + i)."""
    idx = torch.cat([torch.arange(s * SLOT, (s + 1) * SLOT, dtype=torch.float32) for s in slots])
    return (idx % 97).mul_(2.0 ** -9).add_(salt)


def _boundaries(sync: OuterSync, x: torch.Tensor, slots: tuple, job: str, steps: dict, first: int,
                step_s: float = 0.0):
    """The inner steps ``first``..STEPS of ``job``, each ``step_s`` long (:func:`tests.inner_steps.boundaries`). A
    local step that does not depend on x, dyadic, per job, a function of the slot-major place of each element."""
    salt = {"A": 2.0 ** -6, "B": 3 * 2.0 ** -7}[job]

    def local_step(step: int) -> None:
        time.sleep(step_s)
        x.sub_(_values(slots, salt * step).mul_(2.0 ** -3))

    return boundaries(sync, steps, first, STEPS, local_step)


def _site(rank: int, world: int, layout: str, overlap: str, compression: str, diverge: bool, out: dict,
          outer_state: str = "device") -> None:
    ranks = LAYOUTS[layout]
    job, slots = ranks[rank]
    # every rank builds every group, in the same order: each slot's outer group, then each job's world
    slot_of = {}
    for s in (0, 1):
        members = [r for r, (_, held) in enumerate(ranks) if s in held]
        slot_of[s] = dist.new_group(members)
    jobs = {}
    for name in ("A", "B"):
        members = [r for r, (j, _) in enumerate(ranks) if j == name]
        jobs[name] = dist.new_group(members) if len(members) > 1 else None
    cfg = DiLoCoXConfig(replicas=2, local_steps=H, outer_lr=1.0, outer_momentum=0.0, overlap=overlap,
                        compression=compression, outer_state=outer_state, outer_chunk_mb=2.0 ** -12,  # 256 elements
                        **({"overlap_steps": 1} if overlap == "partial" else {}))
    x = _values(slots, 1.0)
    bounds = tuple(SLOT * j for j in range(len(slots) + 1))
    sync = OuterSync(ShardView([x]), cfg, slot_of[slots[0]], segments=bounds)
    steps = {"steps": 0}
    membership = SlotMembership(jobs[job], tuple(slot_of[s] for s in slots))
    sync.round_rules = fed = FederatedRounds(sync, membership, lambda: dict(steps), lambda p: steps.update(p))
    membership.rounds = lambda: sync.rounds
    fed.tokens_per_step = lambda: TOKENS[job]
    seen, weights = {}, {}
    for step in _boundaries(sync, x, slots, job, steps, 1):
        if diverge and step == 2 * H and job == "B":  # one element of slot 1's theta, on B alone
            where = bounds[-1] - 7
            sync.theta[where] += 2.0 ** -12
        sync.boundary()
        seen[step] = (sync.theta.clone(), x.clone())
        weights[step] = fed.round_weight
    sync.drain()
    seen["end"] = (sync.theta.clone(), x.clone())
    out_path = out["dir"] / f"{layout}_{rank}.pt"
    torch.save({"job": job, "slots": slots, "seen": seen, "weights": weights,
                "summary": fed.summary()}, out_path)


def _diverging(rank: int, world: int, out: dict) -> None:
    with pytest.raises(ReplicasDivergedError) as err:  # on every rank of both jobs
        _site(rank, world, "mixed", "partial", "int4", True, out)
    assert "differ" in str(err.value)


@pytest.mark.parametrize("overlap,compression,outer_state", [
    ("partial", "int4", "device"), ("none", "none", "device"),
    ("partial", "int4", "host"),  # host chunks of 256 elements, restarting at each slot of 320
])
def test_a_rank_holding_two_slots_equals_its_twin_site(tmp_path, overlap, compression, outer_state):
    out = {"dir": tmp_path}
    run_world(_site, 4, "twins", overlap, compression, False, out, outer_state)
    run_world(_site, 3, "mixed", overlap, compression, False, out, outer_state)
    twins = [torch.load(tmp_path / f"twins_{r}.pt") for r in range(4)]
    mixed = [torch.load(tmp_path / f"mixed_{r}.pt") for r in range(3)]
    b = mixed[0]
    assert b["slots"] == (0, 1) and b["summary"]["failed_rounds"] == 0
    for when in twins[0]["seen"]:
        for what in (0, 1):  # theta, x
            whole = b["seen"][when][what]
            assert torch.equal(whole, torch.cat([twins[0]["seen"][when][what], twins[1]["seen"][when][what]])), \
                (when, what)
            for j in (0, 1):  # A's ranks: the same in both layouts
                assert torch.equal(mixed[1 + j]["seen"][when][what], twins[2 + j]["seen"][when][what]), (when, j)
        for j in (0, 1):  # B's slot j and A's rank j hold the same theta (the run's, per slot)
            assert torch.equal(b["seen"][when][0][j * SLOT:(j + 1) * SLOT], mixed[1 + j]["seen"][when][0]), when
    # token weights: A 2 tokens per step to B's 1, every member counted at every boundary
    assert set(b["weights"].values()) == {float(torch.tensor(2 / 3, dtype=torch.float32))}, b["weights"]
    assert set(mixed[1]["weights"].values()) == {float(torch.tensor(4 / 3, dtype=torch.float32))}
    # the run moved: theta is not its start
    assert not torch.equal(b["seen"]["end"][0], _values((0, 1), 1.0))


def test_slots_whose_theta_differ_are_found_at_the_decision(tmp_path):
    """B's theta changed in one element of its second slot: the decision, comparing theta slot by slot across
    the run's outer groups, raises on every rank of both jobs before anything of the round is launched."""
    run_world(_diverging, 3, {"dir": tmp_path})


# ---------------- the same run over torchft: k virtual ranks per rank ----------------
def _torchft_site(rank: int, world: int, job: str, lighthouse: str, delay_s: float, out: dict,
                  step_s: float = 0.0) -> None:
    """One job of the mixed layout (A: 2 ranks, one slot each; B: 1 rank, both slots) meeting through a real
    lighthouse (``TorchftMembership`` with ``segments``), the rounds and values of :func:`_site`. ``delay_s``:
    the job starts that much later (it joins the run under way: a heal, slot by slot); ``step_s``: each inner
    step takes that long."""
    from megatron_diloco.federation import handshake
    from megatron_diloco.federation.membership import TorchftMembership

    time.sleep(delay_s)
    slots = (0, 1) if job == "B" else (rank,)
    cfg = DiLoCoXConfig(replicas=2, local_steps=H, outer_lr=1.0, outer_momentum=0.0, overlap="partial",
                        compression="int4", overlap_steps=1)
    x = _values(slots, 1.0)
    bounds = tuple(SLOT * j for j in range(len(slots) + 1))
    sync = OuterSync(ShardView([x]), cfg, None, segments=bounds)
    steps = {"steps": 0}
    fed = sync.round_rules = FederatedRounds(sync, None, lambda: dict(steps), lambda p: steps.update(p),
                                             catch_up=None)
    description = {"test": "slots", handshake.RUN: "test-run"}
    fed.identity = handshake.identity(description)
    fed.membership = membership = TorchftMembership(
        lighthouse, f"job{job}", "127.0.0.1", 0, key=KEY, timeout_s=30.0, meeting_timeout_s=30.0,
        alone_timeout_s=120.0, min_replicas=1, job_group=dist.group.WORLD if world > 1 else None,
        state_dict=fed.state_dict, load_state_dict=fed.load_state_dict, heal_bytes=fed.heal_bytes,
        segments=bounds)
    membership.handshake = lambda group, progress, quorum, heal_url, first: handshake.agree(
        group, KEY, quorum, progress, description, 0 if job == "A" else 1, f"job{job}", heal_url, first, 30.0)
    membership.rounds = lambda: sync.rounds
    fed.tokens_per_step = lambda: TOKENS[job]
    joined = fed.join()
    weights = {}
    for step in _boundaries(sync, x, slots, job, steps, int(joined["steps"]) + 1 if joined else 1, step_s):
        sync.boundary()
        weights[step] = fed.round_weight
    sync.drain()
    fed.finish()
    membership.shutdown()
    torch.save({"slots": slots, "theta": sync.theta.clone(), "x": x.clone(), "weights": weights,
                "joined": joined, "summary": fed.summary()}, out["dir"] / f"torchft_{job}_{rank}.pt")


def test_a_job_of_another_data_parallel_size_joins_the_run_under_way(tmp_path):
    """Through a real lighthouse (``TorchftMembership`` with ``segments``: B's one rank is two virtual ranks of the
    run, two Managers, outer groups and heal servers). A starts 3 s after B (rounds of about 1 s) and joins the run
    under way: each of A's ranks takes its slot's outer state from B's one rank, which offers each slot's part from
    its own heal server. Both then train to the end together: each slot's theta and x the same on B and on A.
    (B joining A's run: tests/test_federation.py, with Megatron.)"""
    late = "A"
    import threading

    from harness.federation import Lighthouse

    out = {"dir": tmp_path}
    with Lighthouse(tmp_path / "lighthouse.log", min_replicas=1, join_timeout_ms=3000) as lh:
        errors = []

        def job(name: str, nproc: int) -> None:
            try:
                run_world(_torchft_site, nproc, name, lh.address, 3.0 if name == late else 0.0, out, 0.25)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append((name, err))

        threads = [threading.Thread(target=job, args=(name, n)) for name, n in (("A", 2), ("B", 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    b = torch.load(tmp_path / "torchft_B_0.pt")
    a = [torch.load(tmp_path / f"torchft_A_{r}.pt") for r in (0, 1)]
    joiner = b if late == "B" else a[0]
    assert joiner["joined"] is not None and joiner["summary"]["heals"] == 1, joiner["summary"]
    assert int(joiner["joined"]["steps"]) >= H, joiner["joined"]  # it entered the run under way
    assert b["summary"]["members"] == 2 and a[0]["summary"]["members"] == 2
    for j in (0, 1):
        assert torch.equal(a[j]["theta"], b["theta"][j * SLOT:(j + 1) * SLOT]), j
        assert torch.equal(a[j]["x"], b["x"][j * SLOT:(j + 1) * SLOT]), j  # (the run's end: x = theta)


def _part(theta: list[float], **meta) -> dict:
    base = {"identity": "run", "position": {"steps": 12, "boundaries": 2}, "rounds": 2, "skipped_rounds": 0,
            "committed": 2, "tau": 1, "round_steps": 6, "in_boundary": True,
            "timings": {"step_time_s": 0.1}, "link_bytes_per_s": None}
    return {"theta": torch.tensor(theta), "momentum_buffer": None, "pending": None, "codec": None,
            "meta": {**base, **meta}}


def test_a_heal_is_joined_from_slots_of_one_point_of_the_run_only():
    """The slots' parts of a heal come from one member at one boundary: joined in slot order, where the source's
    ranks may differ in their timings only; a part placed elsewhere in the run (another boundary, round, tau,
    identity) is refused, naming what differs, and nothing is joined (the membership fails that heal)."""
    from megatron_diloco.algorithm.slot_exchange import joined_state

    joined = joined_state([_part([1.0, 2.0]), _part([3.0], timings={"step_time_s": 0.2})])
    assert torch.equal(joined["theta"], torch.tensor([1.0, 2.0, 3.0]))
    assert joined["momentum_buffer"] is None and joined["meta"]["timings"] == {"step_time_s": 0.1}
    for meta in ({"position": {"steps": 18, "boundaries": 3}}, {"rounds": 3}, {"tau": 2}, {"identity": "other"},
                 {"committed": 1}):
        with pytest.raises(ValueError, match=f"slot 1 came from another point.*{next(iter(meta))}"):
            joined_state([_part([1.0]), _part([2.0], **meta)])
    with pytest.raises(ValueError, match="momentum_buffer"):
        joined_state([_part([1.0]), {**_part([2.0]), "momentum_buffer": torch.zeros(1)}])


# ---------------- paced jobs of different data-parallel size ----------------
def _paced_site(rank: int, world: int, out: dict) -> None:
    """The mixed layout with ``--diloco-x-site-pace 4``: A (DP 2) reports half B's step time, its ranks 0.05 s and
    0.04 s (the job's time is its slowest rank's: a rank that took its own would run another round length than its
    twin and hang the job); B, one rank holding both slots, 0.1 s. The run's rounds: two warm-up rounds of 2, then
    4; 20 run steps. Six boundaries of the run, the loop of ``tests/test_pace.py``."""
    ranks = LAYOUTS["mixed"]
    job, slots = ranks[rank]
    slot_of = {s: dist.new_group([r for r, (_, held) in enumerate(ranks) if s in held]) for s in (0, 1)}
    jobs = {name: dist.new_group([r for r, (j, _) in enumerate(ranks) if j == name]) for name in ("A", "B")}
    cfg = DiLoCoXConfig(replicas=2, local_steps=H, warmup_local_steps=2, warmup_iters=4, outer_lr=1.0,
                        outer_momentum=0.0, compression="int4", overlap_steps=1, site_pace=4.0)
    x = _values(slots, 1.0)
    bounds = tuple(SLOT * j for j in range(len(slots) + 1))
    sync = OuterSync(ShardView([x]), cfg, slot_of[slots[0]], segments=bounds)
    sync.schedule.run_steps = 20
    sync.schedule.changed()
    steps = {"steps": 0}
    membership = SlotMembership(jobs[job] if job == "A" else None, tuple(slot_of[s] for s in slots))
    sync.round_rules = fed = FederatedRounds(sync, membership, lambda: dict(steps), lambda p: steps.update(p))
    membership.rounds = lambda: sync.rounds
    fed.tokens_per_step = lambda: TOKENS[job]
    step_s = {0: 0.1, 1: 0.05, 2: 0.04}[rank]
    salt = {"A": 2.0 ** -6, "B": 3 * 2.0 ** -7}[job]
    seen = [(step, sync.schedule.pace.own_steps, fed.round_weight, sync.theta.clone())
            for step in paced_boundaries(sync, steps, 6, step_s,
                                         lambda step: x.sub_(_values(slots, salt * step).mul_(2.0 ** -3)))]
    sync.drain()
    torch.save({"job": job, "seen": seen, "theta": sync.theta.clone(), "failed": fed.summary()["failed_rounds"],
                "at_end": sync.schedule.pace.run_position(steps["steps"])}, out["dir"] / f"paced_{rank}.pt")


def test_paced_jobs_of_different_data_parallel_size(tmp_path):
    """With ``--diloco-x-site-pace`` and exchange slots together: A's two ranks run the same rounds, twice B's
    inner steps (its job-wide step time, not each rank's), the slots' theta agree at every boundary of the run and
    at the end, and the means weigh the jobs by their tokens (A: twice the steps at twice the tokens per step)."""
    run_world(_paced_site, 3, {"dir": tmp_path})
    b, a0, a1 = (torch.load(tmp_path / f"paced_{r}.pt") for r in range(3))
    for r in (b, a0, a1):
        assert r["failed"] == 0 and r["at_end"] == 20
    assert [s[1] for s in b["seen"]] == [2, 4, 4, 4, 4, 4]  # each boundary: the round it starts (the last: past
    assert [s[1] for s in a0["seen"]] == [s[1] for s in a1["seen"]] == [4, 8, 8, 8, 8, 8]  # the run's end)
    assert [s[0] for s in a0["seen"]] == [2, 6, 14, 22, 30, 38] and [s[0] for s in b["seen"]] == [2, 4, 8, 12, 16, 20]
    for k in range(6):  # B's slot j is A's rank j, at every boundary of the run
        for j, a in enumerate((a0, a1)):
            assert torch.equal(b["seen"][k][3][j * SLOT:(j + 1) * SLOT], a["seen"][k][3]), (k, j)
    for j, a in enumerate((a0, a1)):
        assert torch.equal(b["theta"][j * SLOT:(j + 1) * SLOT], a["theta"]), j
    assert not torch.equal(b["theta"], _values((0, 1), 1.0))
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    assert [s[2] for s in b["seen"]] == [f32(2 / 3)] + [f32(0.4)] * 5  # tokens 1:2 in the first round, then 1:4
    assert [s[2] for s in a0["seen"]] == [s[2] for s in a1["seen"]] == [f32(4 / 3)] + [f32(1.6)] * 5
