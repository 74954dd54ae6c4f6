"""``--diloco-x-site-pace``: each job of a run runs the inner steps that fit the slowest job's round
(``megatron_diloco.algorithm.pace``), on the run's clock of boundaries, its LR position the run's.

Two gloo ranks, each one job, with the scripted membership of ``tests/test_federated_rounds.py``: job 0 steps
twice as fast as job 1 (their measured step times, as the optimizer gives them at a boundary). The flags give the
run's rounds (two warm-up rounds of 2 steps, then rounds of 4, 20 run steps); the decision carries the members'
step times, and job 0 runs twice the inner steps of every round after the first (nothing is measured before it).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.federated import FederatedRounds
from megatron_diloco.algorithm.pace import Pace, RunRound, own_round_steps, paced_round_steps
from megatron_diloco.algorithm.schedule import RoundSchedule
from megatron_diloco.algorithm.shard_view import ShardView
from megatron_diloco.algorithm.sync import OuterSync
from tests.dist_utils import run_world
from tests.inner_steps import paced_boundaries
from tests.test_federated_rounds import N, ScriptedMembership

H, H0, W, RUN = 4, 2, 4, 20  # rounds of the run: 2, 2, then 4 x 4


def _config(**kw) -> DiLoCoXConfig:
    return DiLoCoXConfig(replicas=2, local_steps=H, warmup_local_steps=H0, warmup_iters=W, outer_lr=1.0,
                         outer_momentum=0.0, compression="none", site_pace=4.0, **kw)


def test_a_round_fits_the_slowest_members_time():
    assert own_round_steps(30, 0.2, 0.1, 4.0) == 60  # twice as fast: twice the steps (not 59)
    assert own_round_steps(30, 0.2, 0.2, 4.0) == 30 and own_round_steps(30, 0.3, 0.2, 4.0) == 45
    assert own_round_steps(30, 1.0, 0.1, 4.0) == 120  # at most P x L
    assert own_round_steps(30, None, 0.1, 4.0) == 30 and own_round_steps(30, 0.2, 0.0, 4.0) == 30
    assert own_round_steps(30, 0.1, 0.2, 4.0) == 30  # never fewer than the run's round
    pace = Pace(RoundSchedule(_config()).run_round)
    with pytest.raises(ValueError, match="inner-step time"):
        paced_round_steps(pace, 2, [0.1, math.nan], 0.1, 4.0)
    with pytest.raises(ValueError, match="inner-step time"):
        paced_round_steps(pace, 2, [0.1, -1.0], 0.1, 4.0)


def test_the_jobs_steps_map_onto_the_runs():
    """Boundaries where the job's own rounds end, the run's clock in boundaries, the LR position in run steps, the
    warm-up rounds as the run's; a checkpoint keeps the pace; a job that ran the run's rounds goes on from them."""
    schedule = RoundSchedule(_config())
    schedule.run_steps = RUN
    schedule.changed()
    pace = schedule.pace
    assert pace.current == RunRound(0, 0, H0, True) and schedule.is_boundary(2) and not schedule.is_boundary(1)
    assert schedule.round_steps(2) == 2 and schedule.is_warmup_round(2)  # projected at pace 1
    assert pace.begin(2, 4) == 4 and pace.current == RunRound(1, 2, H0, True)  # twice the run's H0
    assert [schedule.is_boundary(s) for s in range(3, 7)] == [False, False, False, True]
    assert schedule.boundaries_reached(5) == 1 and schedule.boundaries_reached(6) == 2
    assert pace.run_position(4) == 3.0 and pace.run_position(6) == 4.0
    assert schedule.round_steps(6) == 8 and not schedule.is_warmup_round(8)  # the run's round of H, at pace 2
    assert pace.begin(6, 12) == 12 and pace.ratio == 3.0 and pace.run_position(9) == 5.0
    state = schedule.state_dict()
    resumed = RoundSchedule(_config())
    resumed.run_steps = RUN
    assert resumed.load_pace(state, 9) == schedule.rounds_state()
    assert resumed.steps_since_boundary(9) == 3 and resumed.pace.run_position(9) == 5.0
    assert schedule.run_round(5) == RunRound(5, 16, 4, False) and schedule.run_round(6).steps == 4  # (past the end)
    schedule.run_steps = 18
    assert schedule.run_round(5).steps == 2  # a shorter last round
    fixed = RoundSchedule(_config())  # a checkpoint of a job that ran the run's rounds: its steps are the run's
    fixed.run_steps = RUN
    fixed.load_pace({k: v for k, v in state.items() if k != "pace"}, 10)
    assert fixed.pace.current == RunRound(3, 8, H, False) and fixed.steps_since_boundary(10) == 2
    fixed.load_pace({}, 8)  # at a boundary: the round that ended there
    assert fixed.pace.current.boundary == 2 and fixed.boundaries_reached(8) == 3 and fixed.is_boundary(8)
    pace.rebase(4, 30)  # a heal at the run's boundary 4, the job at its own step 30: that round begins there
    assert pace.current == RunRound(4, 12, H, False) and (pace.own_start, pace.own_steps) == (30, 12)  # its pace kept
    assert schedule.boundaries_reached(30) == 4 and schedule.is_boundary(42) and pace.run_position(36) == 14.0
    plain = RoundSchedule(DiLoCoXConfig(replicas=2, local_steps=H, compression="none"))
    with pytest.raises(ValueError, match="resume it with --diloco-x-site-pace"):
        plain.load_pace(state, 9)


def _paced_worker(rank: int, world: int, overlap: str, out: dict) -> None:
    cfg = _config(overlap=overlap, **({"overlap_steps": 1} if overlap == "partial" else {}))
    x = torch.zeros(N)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    sync.schedule.run_steps = RUN
    sync.schedule.changed()
    steps = {"steps": 0}
    membership = ScriptedMembership(set())
    sync.round_rules = fed = FederatedRounds(sync, membership, lambda: dict(steps), lambda p: steps.update(p))
    membership.fed = fed
    fed.tokens_per_step = lambda: 1
    step_s = (0.05, 0.1)[rank]  # job 0 twice as fast
    local = (lambda step: x.sub_(torch.arange(N, dtype=torch.float32).mul_(2.0 ** -8 * (rank + 1))
                                 .add_(2.0 ** -6 * step)))
    seen = [(step, sync.schedule.pace.own_steps, fed.round_weight, sync.theta.clone())
            for step in paced_boundaries(sync, steps, 6, step_s, local)]
    step = steps["steps"]
    sync.drain()
    # the derived outer timeout covers the job's own round, the same wall time on both (8 x 0.05 s, 4 x 0.1 s),
    # not H x its step (0.2 s for job 0): a floor and no exchange seen leave 4 x that round
    sync.config.distributed_timeout_minutes, sync.longest_exchange_s = 0.0, 0.0
    assert sync.next_round_steps == (8, 4)[rank] and sync.timeout_s() == pytest.approx(4 * 0.4)
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, sync.theta.clone())
    assert torch.equal(thetas[0], thetas[1])
    for _, _, _, theta in seen:  # identical at every boundary
        both = [torch.empty(N), torch.empty(N)]
        dist.all_gather(both, theta)
        assert torch.equal(both[0], both[1])
    own = [s for _, s, _, _ in seen]
    assert own == ([4, 8, 8, 8, 8, 8] if rank == 0 else [2, 4, 4, 4, 4, 4]), own  # (the last: past the end)
    assert [b for b, _, _, _ in seen] == ([2, 6, 14, 22, 30, 38] if rank == 0 else [2, 4, 8, 12, 16, 20])
    weight = float(torch.tensor((4 / 3, 2 / 3)[rank], dtype=torch.float32))  # its tokens: twice the other's
    assert seen[0][2] == 1.0 and {w for _, _, w, _ in seen[1:]} == {weight}
    assert sync.schedule.pace.run_position(step) == RUN


@pytest.mark.parametrize("overlap", ["partial", "none"])
def test_a_job_twice_as_fast_runs_twice_the_steps_of_every_round(overlap):
    run_world(_paced_worker, 2, overlap, {})
