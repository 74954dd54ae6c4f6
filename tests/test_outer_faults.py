"""Faults on the outer groups and whole-model decisions, on gloo (CPU).

* Bounded outer operations (``--diloco-x-outer-timeout-minutes``): a slowed peer still succeeds
  within the bound; a frozen one (a rank that never joins an exchange, the skip decision or the link
  measurement, or whose worker thread stops answering) ends the run on every other rank with an
  error naming the round and the group, within the bound, and the processes exit (a worker thread
  stuck in a collective does not keep them alive). These run each rank in its own subprocess under
  a hard timeout, so a hang fails the test instead of hanging pytest.
* One skip decision for the whole model: a NaN in one pipeline stage of one replica skips the round
  on every rank, the other stage's outer group included.
* The measured outer link (adaptive byte budget) survives a resume.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.runner import free_port
from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.shard_view import ShardView, fingerprint
from megatron_diloco.algorithm.sync import OuterSync
from tests.dist_utils import run_world

ROOT = Path(__file__).resolve().parents[1]
#: the bound of the round a peer freezes in (s); a slowed peer gets more (see _slowed_worker)
BOUND_S = 3.0
#: the bound of the healthy rounds before it (s): lenient, so that a loaded machine passes them
HEALTHY_BOUND_S = 60.0
#: a rank that raised must have exited this long after: generous for a loaded machine (a torch
#: process takes seconds to exit there), below what a worker thread stuck in a gloo collective would
#: hold it (until gloo's own timeout, the backstop: 1.25 x 3 + 60 s; a frozen one: forever)
EXIT_LAG_S = 45.0
#: slack on the bound for a loaded machine (polling, logging, Python)
BOUND_SLACK_S = 4.0


def _identical(tensors: list[torch.Tensor], group=None) -> bool:
    fp = fingerprint(tensors)
    n = dist.get_world_size(group)
    got = [torch.zeros_like(fp) for _ in range(n)]
    dist.all_gather(got, fp, group=group)
    return all(torch.equal(got[0], g) for g in got)


# ------------------------------------------------------------------ the flag and its default
def test_outer_timeout_flag_default_rule_and_validation():
    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    parser = add_diloco_x_args(argparse.ArgumentParser())
    args = parser.parse_args(["--diloco-x", "--diloco-x-outer-timeout-minutes", "30"])
    args.distributed_timeout_minutes = 10  # Megatron's flag
    cfg = config_from_args(args)
    assert cfg.outer_timeout_minutes == 30 and cfg.outer_timeout_s(5.0, 9999.0) == 1800.0  # given: fixed
    args = parser.parse_args(["--diloco-x", "--diloco-x-local-steps", "100"])
    args.distributed_timeout_minutes = 15
    cfg = config_from_args(args)
    assert cfg.outer_timeout_minutes is None and cfg.distributed_timeout_minutes == 15
    assert cfg.outer_timeout_s() == 900.0  # step time unknown: Megatron's own timeout
    assert cfg.outer_timeout_s(1.0) == 900.0  # 4 x 100 x 1 s = 400 s < the floor
    assert cfg.outer_timeout_s(3.0) == 1200.0  # 4 x H x step time
    assert cfg.outer_timeout_s(1.0, 500.0) == 2000.0  # 4 x the longest exchange seen
    assert cfg.outer_timeout_s(3.0, 0.0, 250) == 3000.0  # a paced job's round of 250 steps: 4 x 250 x step time
    assert cfg.outer_timeout_s(3.0, 0.0, 40) == 1200.0  # a round shorter than H (a warm-up round): H still
    args = parser.parse_args(["--diloco-x"])  # without Megatron's attribute: its default, 10 min
    assert config_from_args(args).outer_timeout_s() == 600.0
    # the paper's scale: a ~15 min exchange hidden under a round of H x step >= 15 min -> >= 60 min
    assert DiLoCoXConfig(compression="none", local_steps=500, distributed_timeout_minutes=10).outer_timeout_s(1.8) == 3600.0
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="--diloco-x-outer-timeout-minutes"):
            config_from_args(parser.parse_args(["--diloco-x", "--diloco-x-outer-timeout-minutes", bad]))


# ------------------------------------------------------------------ a slowed peer: within the bound
def _slowed_worker(rank: int, world: int, overlap: str, codec: str, derived: bool) -> None:
    """Rank 1 arrives ``delay`` late at every boundary and joins every exchange ``delay`` late; rank 0
    waits for it (skip decision, exchange) and must succeed. ``derived``: no flag; the bound comes
    from 4 x H x step time (8 s) while Megatron's --distributed-timeout-minutes (the floor) is 2 s,
    shorter than the exchanges: an exchange longer than the distributed timeout must pass."""
    from megatron_diloco.algorithm import sync as sync_mod
    from megatron_diloco.algorithm.bounds import backstop_timeout_s

    bound, delay, step_time = 8.0, (3.0 if derived else 1.0), 2.0
    timeouts = (dict(distributed_timeout_minutes=2.0 / 60) if derived else
                dict(outer_timeout_minutes=bound / 60))
    cfg = DiLoCoXConfig(replicas=world, local_steps=1, outer_lr=0.7, outer_momentum=0.9, overlap=overlap,
                        compression=codec, rank=2, **timeouts)
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    outer = dist.new_group(backend="gloo")
    sync = OuterSync(ShardView([w]), cfg, outer, shapes=[(32, 48)])
    if rank == 1:  # the slow link: this rank joins every exchange `delay` late
        if sync._executor is not None:
            exchange = sync.codec.exchange
            sync.codec.exchange = lambda *a, **k: (time.sleep(delay), exchange(*a, **k))[1]
        else:
            start = sync_mod.start_exchange
            sync_mod.start_exchange = lambda *a, **k: (time.sleep(delay), start(*a, **k))[1]
    for t in range(2):
        torch.manual_seed(10 * t + rank)
        w.sub_(0.01 * torch.randn(32, 48))
        if rank == 1:
            time.sleep(delay)  # and arrives late at the boundary (the skip decision waits for it)
        sync.before_boundary(step_time)  # H x step time = 2 s: the derived bound is 4 x that
        armed = sync.timeout_s()  # the bound of this boundary's waits
        assert armed == (max(bound, 4 * sync.longest_exchange_s) if derived else bound)
        report = sync.boundary()
        assert not report.skipped
        assert _identical([w, sync.theta]), t  # (not over `outer`: the worker thread may own it)
        # the groups' own timeout is the backstop behind the bound (gloo's default: 30 min)
        group_timeout = outer._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        assert group_timeout == pytest.approx(backstop_timeout_s(armed), abs=1e-2)  # (kept in ms)
    sync.drain()
    if rank == 0:  # it did wait for the slowed peer's exchanges, and succeeded
        assert delay * 0.9 <= sync.longest_exchange_s < bound, sync.longest_exchange_s
        if derived:  # longer than Megatron's distributed timeout
            assert sync.longest_exchange_s > 60 * cfg.distributed_timeout_minutes


@pytest.mark.parametrize("overlap, codec, derived", [("none", "none", False), ("delayed", "lowrank", False),
                                                     ("none", "none", True)],
                         ids=["blocking", "delayed-lowrank", "blocking-derived-bound"])
def test_slowed_peer_within_the_bound_succeeds(overlap, codec, derived):
    run_world(_slowed_worker, 2, overlap, codec, derived)


# ------------------------------------------------------------------ frozen peers: subprocesses
def _freeze(*_a, **_k):
    time.sleep(3600)  # never joins (the test kills the process)


def _scenario_stage_exchange(rank: int, world: int, event) -> None:
    """4 ranks = 2 replicas x 2 stages, blocking exchange; rank 3 (replica 1, stage 1) freezes in its
    round-2 exchange after the skip decision: rank 1 (its outer-group peer) must time out in the
    exchange, ranks 0 and 2 (the other stage) in the next round's skip decision."""
    from megatron_diloco.algorithm import sync as sync_mod

    cfg = DiLoCoXConfig(compression="none", replicas=2, local_steps=1, outer_lr=0.7, outer_momentum=0.9, overlap="none",
                        outer_timeout_minutes=HEALTHY_BOUND_S / 60)
    groups = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
    x = torch.linspace(0, 1, 64) + rank % 2
    sync = OuterSync(ShardView([x]), cfg, groups[rank % 2])
    for rnd in (1, 2, 3):
        if rnd == 2:
            sync.config.outer_timeout_minutes = BOUND_S / 60  # the bound from this round on
            if rank == 3:
                sync_mod.start_exchange = _freeze
        x.sub_(0.01 * (rank + 1))
        event(kind="boundary", round=rnd)
        sync.boundary()


def _scenario_worker_frozen(rank: int, world: int, event) -> None:
    """2 replicas, delayed low-rank exchange on the worker thread over a gloo mirror: rank 1's worker
    stops answering in round 2's exchange (it never returns); at round 3 both ranks must time out
    waiting for it and exit, although rank 1's worker is still busy (rank 0's waits in a gloo
    all-gather until the same deadline)."""
    from megatron_diloco.megatron_adapter.topology import host_mirror_of_outer_groups

    cfg = DiLoCoXConfig(replicas=2, local_steps=1, overlap="delayed", compression="lowrank", rank=2,
                        outer_timeout_minutes=HEALTHY_BOUND_S / 60)
    mirror = host_mirror_of_outer_groups(2)
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    sync = OuterSync(ShardView([w]), cfg, dist.group.WORLD, shapes=[(32, 48)], gloo_group=mirror)
    if rank == 1:  # the worker's second exchange (round 2's) freezes. Counted, not swapped in at round
        real, calls = sync.codec.exchange, []  # 2: round 1's delayed exchange may not have started by then

        def exchange(*a, **k):
            calls.append(1)
            return _freeze() if len(calls) == 2 else real(*a, **k)

        sync.codec.exchange = exchange
    for rnd in (1, 2, 3):
        if rnd == 2:
            sync.config.outer_timeout_minutes = BOUND_S / 60
        w.sub_(0.01 * (rank + 1))
        event(kind="boundary", round=rnd)
        sync.boundary()


def _scenario_checkpoint(rank: int, world: int, event, out_dir: Path) -> None:
    """2 replicas, delayed int8: a checkpoint after round 1; rank 1 freezes in round 2's exchange;
    rank 0's checkpoint after round 2 (which completes the exchange in flight) must raise before
    writing anything, leaving round 1's checkpoint the last one."""
    from megatron_diloco.algorithm import sync as sync_mod

    cfg = DiLoCoXConfig(replicas=2, local_steps=1, overlap="delayed", compression="int8",
                        outer_timeout_minutes=HEALTHY_BOUND_S / 60)
    x = torch.linspace(0, 1, 1000)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    for rnd in (1, 2):
        if rnd == 2:
            sync.config.outer_timeout_minutes = BOUND_S / 60
            if rank == 1:
                sync_mod.start_exchange = _freeze
        x.sub_(0.01 * (rank + 1))
        event(kind="boundary", round=rnd)
        sync.boundary()
        event(kind="save", round=rnd)
        state = sync.state_dict()
        if rank == 0:
            torch.save(state, out_dir / f"ckpt_round{rnd}.pt")


def _scenario_measurement(rank: int, world: int, event) -> None:
    """2 replicas, adaptive without --diloco-x-bandwidth-mbps: rank 1 never reaches the first
    boundary, so rank 0's link measurement (before it) must time out."""
    cfg = DiLoCoXConfig(replicas=2, local_steps=1, overlap="delayed", compression="adaptive",
                        outer_timeout_minutes=BOUND_S / 60)
    w = torch.randn(32, 48)
    sync = OuterSync(ShardView([w]), cfg, dist.group.WORLD, shapes=[(32, 48)])
    if rank == 1:
        _freeze()
    event(kind="boundary", round=1)
    sync.before_boundary(0.01)
    sync.boundary()


def _child(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a fault scenario (run as ``python -c``): prints JSON events on stdout; an
    OuterGroupError is reported, then raised (the process exits with it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def event(**kw) -> None:
        print(json.dumps({"rank": rank, "t": time.time(), **kw}), flush=True)

    fn = {"stage_exchange": _scenario_stage_exchange, "worker_frozen": _scenario_worker_frozen,
          "measurement": _scenario_measurement}.get(scenario)
    try:
        if scenario == "checkpoint":
            _scenario_checkpoint(rank, world, event, Path(out_dir))
        else:
            fn(rank, world, event)
    except RuntimeError as err:  # the OuterGroupError (or whatever else went wrong: reported too)
        event(kind="raised", error=type(err).__name__, msg=str(err))
        raise
    event(kind="finished")


def _run_scenario(tmp_path: Path, scenario: str, world: int, frozen: set[int],
                  hard_timeout_s: float = 150.0) -> dict[int, dict]:
    """Start the ranks; wait until every rank not in ``frozen`` exited (at most ``hard_timeout_s``);
    kill what is left. Returns per rank: exit code (None: was still running), when it exited, its
    events and stderr."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {}
    for r in range(world):
        code = (f"from tests.test_outer_faults import _child; "
                f"_child({scenario!r}, {r}, {world}, {port}, {str(tmp_path)!r})")
        procs[r] = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                    stdout=open(tmp_path / f"rank{r}.out", "w"),
                                    stderr=open(tmp_path / f"rank{r}.err", "w"))
    exited: dict[int, float] = {}
    deadline = time.time() + hard_timeout_s
    try:
        while time.time() < deadline and not all(r in exited for r in procs if r not in frozen):
            for r, p in procs.items():
                if r not in exited and p.poll() is not None:
                    exited[r] = time.time()
            time.sleep(0.05)
    finally:
        for r, p in procs.items():
            if p.poll() is None:
                p.kill()
            p.wait()
    out = {}
    for r, p in procs.items():
        lines = (tmp_path / f"rank{r}.out").read_text().splitlines()
        out[r] = {"code": p.returncode if r in exited else None, "exited_at": exited.get(r),
                  "events": [json.loads(s) for s in lines if s.startswith("{")],
                  "stderr": (tmp_path / f"rank{r}.err").read_text()}
    return out


def _raised(res: dict, rank: int) -> dict:
    """The rank's 'raised' event, after checking it exited with it, promptly."""
    r = res[rank]
    assert r["code"] is not None, f"rank {rank} did not exit (hang):\n{r['stderr'][-3000:]}"
    raised = [e for e in r["events"] if e["kind"] == "raised"]
    assert raised, f"rank {rank} exited {r['code']} without the error:\n{r['stderr'][-3000:]}"
    assert raised[0]["error"] == "OuterGroupError", raised[0]
    assert r["code"] != 0 and "OuterGroupError" in r["stderr"]
    lag = r["exited_at"] - raised[0]["t"]
    assert lag < EXIT_LAG_S, f"rank {rank} took {lag:.1f} s to exit after raising"
    return raised[0]


def _since(res: dict, rank: int, kind: str, rnd: int, ev: dict) -> float:
    """Seconds from the rank's event ``kind`` of round ``rnd`` to ``ev``."""
    start = next(e for e in res[rank]["events"] if e["kind"] == kind and e["round"] == rnd)
    return ev["t"] - start["t"]


def test_frozen_stage_peer_ends_the_run_naming_round_and_group(tmp_path):
    res = _run_scenario(tmp_path, "stage_exchange", 4, frozen={3})
    assert res[3]["code"] is None  # still frozen: the others did not wait for it
    err = _raised(res, 1)
    assert err["msg"].startswith("DiLoCoX round 2: the exchange over outer group [ranks 1, 3] did not "
                                 "complete within 3 s (--diloco-x-outer-timeout-minutes 0.05)"), err["msg"]
    assert "the last completed checkpoint (--save) is intact" in err["msg"]
    assert BOUND_S - 0.5 < _since(res, 1, "boundary", 2, err) < BOUND_S + BOUND_SLACK_S
    for rank in (0, 2):  # the other stage finished round 2, then could not agree on round 3
        err = _raised(res, rank)
        assert err["msg"].startswith("DiLoCoX round 3: the skip decision (non-finite check) over the "
                                     "skip-decision group (all 4 ranks)"), err["msg"]
        assert _since(res, rank, "boundary", 3, err) < BOUND_S + BOUND_SLACK_S


def test_frozen_worker_thread_ends_the_run_and_does_not_block_exit(tmp_path):
    res = _run_scenario(tmp_path, "worker_frozen", 2, frozen=set())
    for rank in (0, 1):
        err = _raised(res, rank)  # exits although its worker thread never returns
        assert err["msg"].startswith(
            "DiLoCoX round 3: the exchange of round 2 over outer group [ranks 0, 1] (its gloo mirror, "
            "worker thread) did not complete within 3 s"), err["msg"]
        # bound from the launch (round 2's boundary); round 3's boundary follows at once here
        assert BOUND_S - 0.5 < _since(res, rank, "boundary", 2, err) < BOUND_S + BOUND_SLACK_S


def test_hung_exchange_at_checkpoint_raises_before_writing(tmp_path):
    res = _run_scenario(tmp_path, "checkpoint", 2, frozen={1})
    err = _raised(res, 0)
    assert err["msg"].startswith("DiLoCoX round 2: the exchange over outer group [ranks 0, 1] did not "
                                 "complete within 3 s"), err["msg"]
    assert _since(res, 0, "boundary", 2, err) < BOUND_S + BOUND_SLACK_S
    assert not (tmp_path / "ckpt_round2.pt").exists()
    last = torch.load(tmp_path / "ckpt_round1.pt")  # the last completed checkpoint: intact, loadable
    assert last["rounds"] == 1 and last["pending_delta"] is not None


def test_frozen_peer_at_link_measurement_ends_the_run(tmp_path):
    res = _run_scenario(tmp_path, "measurement", 2, frozen={1})
    err = _raised(res, 0)
    assert err["msg"].startswith("DiLoCoX round 1: the link measurement over outer group [ranks 0, 1] did "
                                 "not complete within 3 s"), err["msg"]
    assert _since(res, 0, "boundary", 1, err) < BOUND_S + BOUND_SLACK_S


# ------------------------------------------------------------------ one skip decision for the model
def _one_stage_nan_worker(rank: int, world: int, overlap: str, codec: str, explicit: bool) -> None:
    # 2 replicas {0, 1}, {2, 3} x 2 stages: outer groups {0, 2} (stage 0) and {1, 3} (stage 1)
    groups = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
    outer = groups[rank % 2]
    kwargs = {}
    if explicit:  # as install() wires it: the topology's gloo group over the world
        from megatron_diloco.megatron_adapter.topology import decision_group_of_world

        kwargs["decision_group"] = decision_group_of_world()
    cfg = DiLoCoXConfig(replicas=2, local_steps=1, outer_lr=0.5, outer_momentum=0.9, overlap=overlap,
                        compression=codec)
    x = torch.linspace(0, 1, 300) + rank % 2
    sync = OuterSync(ShardView([x]), cfg, outer, **kwargs)
    x.sub_(0.1 * (rank + 1))
    assert not sync.boundary().skipped  # a normal round
    theta, m = sync.theta.clone(), sync.outer.momentum_buffer.clone()
    e = sync.residual.clone() if sync.residual is not None else None
    x.sub_(0.1 * (rank + 1))
    if rank == 3:
        x[7] = float("nan")  # one stage (1) of one replica (1) only
    report = sync.boundary()
    assert report.skipped, f"rank {rank} (stage {rank % 2}) applied a round that stage 1 skipped"
    assert report.launched.bytes_sent == 0 and sync.pending is None
    if overlap == "none":  # nothing applied: outer state untouched
        assert torch.equal(sync.theta, theta) and torch.equal(sync.outer.momentum_buffer, m)
    if e is not None:
        assert torch.equal(sync.residual, e)
    assert torch.equal(x, sync.theta) and torch.isfinite(x).all()
    assert _identical([x, sync.theta], outer)
    x.sub_(0.1 * (rank + 1))
    report = sync.boundary()
    assert not report.skipped
    if overlap != "none":  # nothing of the skipped round is in flight, on any stage
        assert not report.applied
    sync.drain()
    assert sync.skipped_rounds == 1 and _identical([x, sync.theta], outer)


@pytest.mark.parametrize("overlap, codec, explicit", [("none", "none", False), ("delayed", "int8", True)])
def test_nan_in_one_stage_skips_the_round_on_every_rank(overlap, codec, explicit):
    run_world(_one_stage_nan_worker, 4, overlap, codec, explicit)


# ------------------------------------------------------------------ the measured link across a resume
def _link_resume_worker(rank: int, world: int, old_checkpoint: bool) -> None:
    cfg = DiLoCoXConfig(replicas=world, local_steps=2, overlap="delayed", compression="adaptive",
                        energy=0.5)
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    sync = OuterSync(ShardView([w]), cfg, dist.new_group(backend="gloo"), shapes=[(32, 48)])
    for _ in range(2):
        w.sub_(0.01 * (rank + 1))
        sync.before_boundary(0.5)
        sync.boundary()
    measured = sync.link_bytes_per_s
    assert measured is not None and 0 < measured < float("inf")
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sync.state_dict().items()}
    assert state["pending_delta"] is not None  # an exchange restored as pending: the hard case
    if old_checkpoint:  # written before the field existed
        state.pop("link_measured", None)
        state.pop("link_bytes_per_s", None)
    else:
        assert state["link_measured"] and state["link_bytes_per_s"] == measured
    w2 = w.clone()
    resumed = OuterSync(ShardView([w2]), cfg, dist.new_group(backend="gloo"), shapes=[(32, 48)])
    resumed.load_state_dict(state)
    resumed.residual.copy_(sync.residual)  # per-replica state, restored by DiLoCoXOptimizer
    resumed.before_boundary(0.5)
    budget = resumed.codec.policy.budget_bytes
    if old_checkpoint:  # measured again at the first boundary (its restored exchange is complete)
        assert resumed.link_bytes_per_s is not None and 0 < resumed.link_bytes_per_s < float("inf")
        assert budget == resumed.link_bytes_per_s * 2 * 0.5
        resumed.boundary()
        resumed.drain()
        return
    # the uninterrupted run's budget, exactly, without measuring again
    assert resumed.link_bytes_per_s == measured
    sync.before_boundary(0.5)
    assert budget == sync.codec.policy.budget_bytes == measured * 2 * 0.5
    for s, v in ((sync, w), (resumed, w2)):
        v.sub_(0.01 * (rank + 1))
        s.boundary()
        s.drain()
    assert torch.equal(w, w2)


@pytest.mark.parametrize("old_checkpoint", [False, True], ids=["saved", "old-checkpoint"])
def test_measured_link_survives_resume(old_checkpoint):
    run_world(_link_resume_worker, 2, old_checkpoint)
