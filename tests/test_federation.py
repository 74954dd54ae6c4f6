"""Replicas as separate jobs that meet through a real ``torchft_lighthouse`` (``--diloco-x-lighthouse``):
every job its own launch of 2 ranks (DP 2) on this machine (forked from the tests' pre-imported process,
or ``torchrun`` as a user launches it), Megatron's defaults and the package's
(the default overlap, codec and warm-up, auto tau), every process killed at the end.

What is checked: a job killed mid-run (kill -9), frozen (SIGSTOP) or lost with an exchange in flight
leaves the others training with the mean over the jobs present, bit-identical to each other at every
boundary; a job restarted from nothing, or started late, joins the run at a boundary from a live peer and
is bit-identical to it from then on, ending at the same iteration; a job whose flags differ is refused
naming the flag; jobs resume from their own checkpoints."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from harness.federation import Job, Lighthouse, run_secret, wait_until

pytestmark = pytest.mark.megatron

#: per step 0.1 s more (no compute): time to kill, stop and restart jobs mid-run on two cores
ENV = {"DILOCO_TEST_STEP_SLEEP_S": "0.1"}
BASE = ["--diloco-x-local-steps", "6", "--global-batch-size", "4", "--diloco-x-outer-timeout-minutes", "0.25"]


def _slow(tmp_path, sleep_s: float = 0.1) -> dict[str, str]:
    """Per step ``sleep_s`` more (no compute) until :func:`_hurry` (time to kill, stop and restart jobs mid-run
    on two cores; once the test has done so, the rest of the run trains at full speed)."""
    return {"DILOCO_TEST_STEP_SLEEP_S": str(sleep_s), "DILOCO_TEST_STEP_SLEEP_UNTIL": str(tmp_path / "hurry")}


def _hurry(tmp_path) -> None:
    """The steps of every job of the test at full speed from now on (:func:`_slow`)."""
    (tmp_path / "hurry").touch()


def _rounds(job: Job, per: int = 1) -> dict[int, list]:
    """step -> [theta's fingerprint, members] of every boundary the job's ranks recorded (``per``: the job's steps
    per step of the run's clock; a job of twice the H records twice the steps). The fingerprint: every rank's, in
    rank order, each slot by slot (with --diloco-x-exchange-slots a job of DP 1 and one of DP 2 list the same
    slots); None where a rank did not record the boundary."""
    recs = job.records()
    assert len(recs) == job.nproc, job.log()[-3000:]
    out: dict[int, list] = {}
    for rank, rec in enumerate(recs):
        for step, fp, members, *_ in rec["fed_rounds"]:
            out.setdefault(step // per, [[None] * len(recs), members])[0][rank] = fp
    return {s: [None if None in fps else [x for fp in fps for x in fp], m] for s, (fps, m) in out.items()}


def _assert_identical_at_every_boundary(jobs: list[Job], per: tuple[int, ...] | None = None) -> None:
    """theta on every rank equal across the jobs at every boundary they both recorded (after the
    meeting: a job that failed the last round has taken the committed theta by then)."""
    tables = [_rounds(j, p) for j, p in zip(jobs, per or (1,) * len(jobs))]
    common = set(tables[0]).intersection(*tables[1:])
    assert common, "no boundary in common"
    for step in sorted(common):
        fps = [t[step][0] for t in tables]
        assert all(f == fps[0] for f in fps), (step, [j.name for j in jobs], fps)


def _final(job: Job) -> tuple:
    recs = job.records()
    return tuple((r["final_fp"]["steps"], tuple(r["final_fp"]["main"])) for r in recs)


@contextlib.contextmanager
def _closing(jobs: list[Job]):
    """Kill every job if the block raises (a test that fails midway leaves no process behind)."""
    try:
        yield
    except BaseException:
        for job in jobs:
            job.close()
        raise


def _end(jobs: list[Job], failing: tuple[Job, ...] = ()) -> None:
    """Wait for ``failing`` to exit with an error and every other job to finish; always kill them all."""
    try:
        for job in failing:
            assert job.wait(300) != 0, job.log()[-3000:]
        for job in jobs:
            if job not in failing:
                assert job.wait(400) == 0, job.log()[-5000:]
    finally:
        for job in jobs:
            job.close()


def _losses_fall(job: Job) -> None:
    values = [v["lm loss"] for rec in job.records() for _, v in rec["losses"] if "lm loss" in v]
    assert values and all(math.isfinite(v) for v in values), values
    assert sum(values[-5:]) / 5 < sum(values[:5]) / 5, values


def test_killed_job_others_go_on_then_it_rejoins(tmp_path):
    """3 jobs, A and B on 2 ranks (DP 2), C on 1 (DP 1; ``--diloco-x-exchange-slots 2`` on all: C's one rank holds
    both slots); kill -9 C mid-run: A and B go on with the mean over the two of them, identical at every boundary,
    loss falling, no NaN; restart C from nothing: it joins the run at a boundary, takes theta, m and the position
    from a peer slot by slot, is identical to them from then on (slot by slot), and all three end at the same
    iteration.

    Steps 0.2 s longer until C has rejoined (~20 steps to the kill, C back ~35-45 in 120: ~75 steps, ~20 s on two
    busy cores, for a restart that takes ~2-6 s), then at full speed."""
    flags = [*BASE, "--diloco-x-replicas", "3", "--train-iters", "120", "--diloco-x-exchange-slots", "2",
             "--pipeline-model-parallel-size", "1"]
    with Lighthouse(tmp_path / "lighthouse.txt") as lh:
        jobs = [Job(tmp_path / n, n, i, lh.address, flags, env=_slow(tmp_path, 0.2), nproc=1 if n == "C" else 2)
                for i, n in enumerate("ABC")]
        a, b, c = jobs
        with _closing(jobs):
            wait_until(lambda: all(j.rounds() >= 8 for j in jobs), 240, "8 rounds on every job", jobs)
            time.sleep(0.4)  # mid-round
            c.kill()
            seen = a.rounds()
            wait_until(lambda: a.rounds() >= seen + 2, 120, "2 rounds of the survivors", [a, b])
            c.start(tmp_path / "C-restarted")
            wait_until(lambda: "joined run 'test-run' under way at iteration" in c.log(), 240, "C's rejoin", jobs)
            _hurry(tmp_path)
        _end(jobs)
    assert "joined run 'test-run' under way at iteration" in c.log(), c.log()[-3000:]
    _assert_identical_at_every_boundary([a, b])
    _assert_identical_at_every_boundary([a, c])
    members = [m for _, (_, m) in sorted(_rounds(a).items())]
    assert 2 in members and members[-1] == 3, members  # the survivors' rounds, then the rejoin
    assert _final(a) == _final(b) and _final(a)[0][0] == _final(c)[0][0] == 120  # (C's main shards: other DP)
    for job in (a, b):
        _losses_fall(job)
    fed = a.summary()["federation"]
    assert fed["membership_changes"] >= 2 and fed["members"] == 3, fed
    assert c.summary()["federation"]["heals"] == 1


def test_frozen_job_is_left_behind_then_catches_up_in_place(tmp_path):
    """One of 2 jobs freezes (SIGSTOP, heartbeats too) with its exchange of round 8 in flight: the other's
    exchange fails at the bound and it goes on alone; SIGCONT: the frozen job's stale collective fails, it
    finds it is behind the run at its next meeting, takes the run's state and goes on from the run's boundary,
    Megatron skipping the iterations between, without touching the other (which never aborts: no collective
    is issued again on the group that broke). Both end at the same iteration with the same model.

    Steps 0.2 s longer until B has caught up (B stops at ~16, A blocks at its landing up to the 15 s bound, then
    goes on alone; B resumes at ~30 in 70: ~40 steps, ~12 s on two busy cores, to catch up at its next meeting),
    then at full speed."""
    flags = [*BASE, "--train-iters", "70"]
    slow = _slow(tmp_path, 0.2)
    with Lighthouse(tmp_path / "lighthouse.txt", heartbeat_timeout_ms=2000) as lh:
        a = Job(tmp_path / "A", "A", 0, lh.address, flags, env=slow)
        b = Job(tmp_path / "B", "B", 1, lh.address, flags, env={**slow, "DILOCO_X_FAULT": "exchange:stop:8"})
        jobs = [a, b]
        with _closing(jobs):
            wait_until(lambda: "[fault drill] stop at exchange" in b.log(), 240, "B's freeze", jobs)
            seen = a.rounds()
            wait_until(lambda: a.rounds() >= seen + 4, 120, "4 rounds of the other job", [a])
            b.signal(signal.SIGCONT)
            wait_until(lambda: "caught up with run 'test-run'" in b.log(), 240, "B's catch-up", jobs)
            _hurry(tmp_path)
        _end(jobs)
    assert "round(s) behind the run (stopped, cut off or late)" in b.log(), b.log()[-4000:]
    skipped = b.log().split("caught up with run 'test-run': iterations ")[1].split(" are skipped")[0]
    first, last = (int(v) for v in skipped.split(" to "))
    assert last >= first > 16, skipped
    for job in jobs:  # no abort (the retired group's destructor)
        assert "terminate called" not in job.log() and "SIGABRT" not in job.log(), job.log()[-4000:]
    members = [m for _, (_, m) in sorted(_rounds(a).items())]
    assert members.count(1) >= 4 and members[-1] == 2, members  # alone while B was frozen, then together again
    assert a.summary()["federation"]["failed_rounds"] >= 1
    assert b.summary()["federation"]["caught_up_rounds"] >= 4, b.summary()["federation"]
    assert b.summary()["federation"]["stale_rounds"] == 0  # (its last round failed: dropped)
    _assert_identical_at_every_boundary([a, b])
    assert _final(a) == _final(b) and _final(a)[0][0] == 70
    _losses_fall(a)


def test_a_job_late_by_less_than_a_round_contributes_it_one_round_stale(tmp_path):
    """3 jobs, rounds of 10 steps (no warm-up: not what this is about); B is stuck before its meeting of round 3
    past the lighthouse's join timeout, by less than a
    round: A and C meet without it and train the next round; B meets them at their next boundary, one
    boundary behind. It takes the run's state and its late round goes into that boundary's mean one round
    stale (its tokens, a weight of about 1, not 0), Megatron skipping the round it waited; all three identical
    at every boundary and at the end, at the same iteration."""
    flags = [*BASE, "--diloco-x-replicas", "3", "--diloco-x-local-steps", "10", "--diloco-x-warmup-iters", "0",
             "--train-iters", "50"]
    join_s = 4.0  # > a round (2.4-2.8 s here: 10 steps of at least 0.1 s, 3 jobs on two cores)
    late = {**ENV, "DILOCO_X_FAULT": f"meeting:stall={join_s + 1.0:g}:3"}  # 1 s past the join timeout
    with Lighthouse(tmp_path / "lighthouse.txt", join_timeout_ms=int(join_s * 1000)) as lh:
        jobs = [Job(tmp_path / n, n, i, lh.address, flags, env=late if n == "B" else ENV) for i, n in enumerate("ABC")]
        a, b, c = jobs
        with _closing(jobs):
            pass
        _end(jobs)
    assert "[fault drill] stall" in b.log(), b.log()[-3000:]
    assert "1 round(s) behind the run" in b.log() and "one round stale" in b.log(), b.log()[-4000:]
    fed = b.summary()["federation"]
    assert fed["stale_rounds"] == 1 and fed["caught_up_rounds"] == 1, fed
    members = {s: m for s, (_, m) in _rounds(a).items()}
    alone = [s for s, m in members.items() if m == 2 and s > 10]  # A and C without B (10: a job may start late)
    assert len(alone) == 1, members
    back = min(s for s in members if s > alone[0])  # B's late round in the mean: tokens of a round, weight ~1
    assert members[back] == 3, members
    tokens, weight = _weights(b)[back]
    assert tokens == _weights(a)[back][0] > 0 and 0.5 < weight < 1.5, (_weights(a), _weights(b))
    _assert_identical_at_every_boundary([a, b, c])
    assert _final(a) == _final(b) == _final(c) and _final(a)[0][0] == 50


@pytest.mark.parametrize("flags", [[], ["--diloco-x-overlap", "none", "--diloco-x-compression", "none"]],
                         ids=["partial-int4", "none-fp32"])
def test_job_lost_with_an_exchange_in_flight(tmp_path, flags):
    """One of 2 jobs dies right after a boundary's decision (round 14 or the first after it with both jobs
    present), before it sends its payload, so the other's
    exchange of that round is in flight when it goes: that round fails (nobody commits it: theta and m
    unchanged, the residual as before the launch, the local progress kept) and the survivor goes on alone,
    the next pseudo-gradient covering both rounds, with theta as the two jobs held it before."""
    flags = [*BASE, *flags, "--train-iters", "90"]
    with Lighthouse(tmp_path / "lighthouse.txt") as lh:
        # (A at 0.1 s per step until B is gone: it cannot finish the run before B, started after it, has met it)
        a = Job(tmp_path / "A", "A", 0, lh.address, flags, env=_slow(tmp_path))
        b = Job(tmp_path / "B", "B", 1, lh.address, flags, env={"DILOCO_X_FAULT": "decision:kill:14"})
        with _closing([a, b]):
            wait_until(lambda: b.proc.poll() is not None, 300, "B's end", [a])
            _hurry(tmp_path)
        _end([a, b], failing=(b,))
    assert "[fault drill] kill at decision, round" in b.log(), b.log()[-3000:]
    rounds = _rounds(a)
    died_at = max(step for step, (_, members) in rounds.items() if members == 2)
    assert max(rounds) == 90 and rounds[max(rounds)][1] == 1 and died_at < 90
    fed = a.summary()["federation"]
    assert fed["failed_rounds"] >= 1 and fed["members"] == 1, fed
    _losses_fall(a)


def test_late_job_joins_and_a_mismatched_one_is_refused(tmp_path):
    """A job started while the run is under way joins at the next boundary (its heal sealed with the
    run's secret) and ends with the others; a job with another outer learning rate is refused naming the
    flag, one with another secret naming --diloco-x-secret-file (launched by ``torchrun``, as a user
    launches a job: its refusal ends torchrun with an error), one with another number of ranks before
    any group is built over ranks it lacks, and the run goes on.

    The late job B is a faster site: rounds of twice A's H (12 inner steps to A's 6; its --train-iters and
    --lr-warmup-iters doubled, its auto warm-up doubles with H), the same rounds. It joins at its own
    iteration of the run's boundary (twice A's), weighs by its tokens (4/3 to A's 2/3), and the two are
    identical at every boundary and at the end, B after twice A's iterations."""
    flags = [*BASE, "--train-iters", "80"]
    fast = [*BASE, "--train-iters", "160", "--diloco-x-local-steps", "12", "--lr-warmup-iters", "4"]
    with Lighthouse(tmp_path / "lighthouse.txt") as lh:  # A at 0.8 s per step until B has joined and X, Y and Z
        # are refused: they start (~10-45 s on two busy cores, torchrun's Y the last) while A still has ~78 steps
        # (~70 s) to go (its first round: 2 steps); then A and B train the rest at full speed
        a = Job(tmp_path / "A", "A", 0, lh.address, flags, env=_slow(tmp_path, 0.8))
        jobs = [a]
        with _closing(jobs):
            wait_until(lambda: a.rounds() >= 1, 240, "the first job's first round", jobs)
            jobs.append(Job(tmp_path / "B", "B", 1, lh.address, fast, env=_slow(tmp_path)))
            jobs.append(Job(tmp_path / "X", "X", 1, lh.address, [*flags, "--diloco-x-outer-lr", "0.5"], env=ENV))
            jobs.append(Job(tmp_path / "Y", "Y", 1, lh.address, flags, env=ENV, torchrun=True,
                            secret=run_secret(tmp_path / "elsewhere", "a secret that is not the run's")))
            jobs.append(Job(tmp_path / "Z", "Z", 1, lh.address, [*flags, "--pipeline-model-parallel-size", "1"],
                            env=ENV, nproc=1))  # one rank (the others: 2, PP 2)
            b, x, y, z = jobs[1:]
            wait_until(lambda: ("joined run 'test-run' under way at iteration" in b.log()
                                and all(j.proc.poll() is not None for j in (x, y, z))), 300,
                       "B's join and the others' refusals", [a, b])
            _hurry(tmp_path)
        _end(jobs, failing=(x, y, z))
    assert "the jobs of this run have 2 ranks each, this one has 1" in z.log(), z.log()[-3000:]
    assert "--diloco-x-outer-lr is 0.5 here, 1.0 in job" in x.log(), x.log()[-3000:]
    assert "this job ('Y'" in y.log() and "--diloco-x-secret-file" in y.log(), y.log()[-3000:]
    assert b.summary()["federation"]["heals"] == 1
    joined = int(b.log().split("joined run 'test-run' under way at iteration ")[1].split(":")[0])
    assert joined % 4 == 0 and joined // 2 in _rounds(a), (joined, b.log()[-3000:])  # (B's warm-up rounds: 4)
    _assert_identical_at_every_boundary([a, b], per=(1, 2))
    assert [m for _, m in _final(a)] == [m for _, m in _final(b)]
    assert {n for n, _ in _final(a)} == {80} and {n for n, _ in _final(b)} == {160}
    shared = {step // 2: w for step, w in _weights(b).items() if step > joined}
    a_w = _weights(a)
    assert shared and all(tokens == 2 * a_w[step][0] and a_w[step][1] == float(np.float32(2 / 3)) and
                          weight == float(np.float32(4 / 3)) for step, (tokens, weight) in shared.items()), (a_w, shared)


def _weights(job: Job) -> dict[int, tuple[int, float]]:
    """step -> (tokens, weight) of the job in the mean launched at each boundary (rank 0's record)."""
    return {r[0]: (r[8], r[9]) for r in job.records()[0]["fed_rounds"]}


def test_jobs_resume_from_their_own_checkpoints(tmp_path):
    """Each job saves its own checkpoint (no shared filesystem), and each has its own global batch (A 4, B 8:
    two micro-batches per step). The run stopped at iteration 24 and restarted: job A resumes from its own
    latest checkpoint, job B from an older one of its own (iteration 12: it lost its last), started once A
    trains. B is behind: it takes the outer state and the position from A at A's next boundary (its inner
    optimizer state from its own checkpoint), and the two train on identical from there to the end. Every
    mean weighs the jobs by their tokens (B twice A's), and B by 0 at the boundary it joins."""
    base = [*BASE, "--train-iters", "84", "--no-load-rng"]
    own = {"A": [], "B": ["--global-batch-size", "8"]}
    ckpt = {n: tmp_path / f"ckpt{n}" for n in "AB"}
    with Lighthouse(tmp_path / "lighthouse.txt") as lh:
        jobs = [Job(tmp_path / f"{n}1", n, i, lh.address, [*base, *own[n], "--save", str(ckpt[n]),
                                                           "--save-interval", "12", "--exit-interval", "24"])
                for i, n in enumerate("AB")]
        _end(jobs)
        assert (ckpt["B"] / "iter_0000012").is_dir(), sorted(p.name for p in ckpt["B"].iterdir())
        (ckpt["B"] / "latest_checkpointed_iteration.txt").write_text("12")
        # A (the most advanced) first: a job that is behind and meets nobody at its start trains alone, and
        # catches up in place when the others arrive, its rounds alone dropped (docs/federation.md)
        slow = _slow(tmp_path, 0.5)  # (0.5 s per step until B has joined: A is still training when B is up)
        a = Job(tmp_path / "A2", "A", 0, lh.address, [*base, *own["A"], "--load", str(ckpt["A"])], env=slow)
        jobs = [a]
        with _closing(jobs):
            wait_until(lambda: "joined run 'test-run' at iteration 24" in a.log(), 240, "A's start", jobs)
            b = Job(tmp_path / "B2", "B", 1, lh.address, [*base, *own["B"], "--load", str(ckpt["B"])],
                    env=slow)
            jobs.append(b)
            wait_until(lambda: "joined run 'test-run' under way at iteration" in b.log(), 240, "B's join", jobs)
            _hurry(tmp_path)
        _end(jobs)
    assert "joined run 'test-run' at iteration 24 (no job ahead of this one)" in a.log(), a.log()[-3000:]
    assert ("joined run 'test-run' under way at iteration" in b.log()
            and "inner optimizer state from this job's checkpoint at iteration 12" in b.log()), b.log()[-3000:]
    _assert_identical_at_every_boundary([a, b])
    assert min(_rounds(a)) > 24  # the second run's boundaries only
    assert _final(a) == _final(b) and _final(a)[0][0] == 84
    assert a.summary()["federation"]["heals"] == 0 and b.summary()["federation"]["heals"] == 1
    wa, wb = _weights(a), _weights(b)
    joined = max(s for s in wa if s < min(wb))  # the boundary B joins at (not in its records), contributing 0
    assert wa[joined][1] == 2.0 and all(wa[s][1] == 1.0 for s in wa if s < joined), (wa, wb)  # A alone before
    two_thirds = 0.6666666865348816  # fp32(2/3): 2 x 4 / (4 + 8)
    together = [s for s in wb if s in wa]  # the boundaries both recorded
    assert together and all(wa[s][1] == two_thirds and wb[s][1] == 2 * two_thirds and
                            wb[s][0] == 2 * wa[s][0] > 0 for s in together), (wa, wb)


def test_sites_of_different_data_parallel_size(tmp_path):
    """Job A on 2 ranks (DP 2, global batch 4), job B on 1 rank (DP 1, global batch 2), PP 1, both with
    ``--diloco-x-exchange-slots 2``, the package's defaults otherwise (partial overlap, int4, the auto
    warm-up). B's one rank holds both slots and meets the run as two ranks of it (two torchft Managers, two
    outer groups): at every boundary B's slot j holds theta bit for bit as A's rank j does; every mean weighs A
    by 4/3 and B by 2/3 (their tokens); both end at iteration 36."""
    base = [*BASE, "--train-iters", "36", "--diloco-x-exchange-slots", "2", "--pipeline-model-parallel-size", "1"]
    with Lighthouse(tmp_path / "lighthouse.txt", min_replicas=2) as lh:  # (both from iteration 0, whichever is up first)
        jobs = [Job(tmp_path / "A", "A", 0, lh.address, base),
                Job(tmp_path / "B", "B", 1, lh.address, [*base, "--global-batch-size", "2"], nproc=1)]
        _end(jobs)
    a, b = [j.records() for j in jobs]
    assert len(a) == 2 and len(b) == 1
    at = [{r[0]: r for r in rec["fed_rounds"]} for rec in (*a, *b)]
    steps = sorted(set(at[0]) & set(at[1]) & set(at[2]))
    assert steps and max(steps) == 36, steps
    for step in steps:
        slots_b = at[2][step][1]  # B's theta, slot by slot: [slot 0's 2 ints, slot 1's 2 ints]
        assert [*at[0][step][1], *at[1][step][1]] == slots_b, (step, at[0][step][1], at[1][step][1], slots_b)
    two_thirds = 0.6666666865348816  # fp32(2/3): 2 x 2 / (4 + 2)
    for step in steps[:-1]:
        assert (at[0][step][9], at[2][step][9]) == (2 * two_thirds, two_thirds), (step, at[0][step], at[2][step])
    assert b[0]["final_fp"]["steps"] == a[0]["final_fp"]["steps"] == 36
    _losses_fall(jobs[1])


def test_sites_of_different_micro_batch(tmp_path):
    """Job A at micro-batch 4 and job B at micro-batch 2 (two per step), the same global batch 4, both with
    ``--diloco-x-data-micro-batch 2`` (the samples dealt in 2s: disjoint, ``test_megatron_patches.py``): the
    handshake takes them, Megatron's own loaders read through the package's sampler, and the two are identical at
    every boundary and at the end, at weights 1 / 1."""
    base = [*BASE, "--train-iters", "24", "--diloco-x-data-micro-batch", "2"]
    with Lighthouse(tmp_path / "lighthouse.txt", min_replicas=2) as lh:
        jobs = [Job(tmp_path / n, n, i, lh.address, [*base, "--micro-batch-size", str(m)])
                for i, (n, m) in enumerate((("A", 4), ("B", 2)))]
        _end(jobs)
    a, b = jobs
    for job, m in ((a, 4), (b, 2)):
        assert (f"this job's micro-batches of {m} read {m // 2} of the run's micro-batches of 2 each "
                "(--diloco-x-data-micro-batch 2)") in job.log(), job.log()[-3000:]
    _assert_identical_at_every_boundary([a, b])
    assert _final(a) == _final(b) and _final(a)[0][0] == 24
    wa = _weights(a)
    assert wa and all(w[1] == 1.0 for w in wa.values()), wa
    _losses_fall(b)


def _saved_with_b_behind(tmp_path, base: list[str], own: dict[str, tuple[list[str], int]]) -> dict[str, Path]:
    """Jobs A and B (``own``: name -> (flags, ranks)) train together from iteration 0, each saving its own
    checkpoints every 12 iterations, and stop at 24; B's latest is then set back to 12 (a site resuming behind the
    run). Their checkpoint folders by name."""
    ckpt = {n: tmp_path / f"ckpt{n}" for n in "AB"}
    with Lighthouse(tmp_path / "lighthouse1.txt", min_replicas=2) as lh:  # (both from iteration 0: B saves at 12)
        jobs = [Job(tmp_path / f"{n}1", n, i, lh.address, [*base, *own[n][0], "--save", str(ckpt[n]),
                                                           "--save-interval", "12", "--exit-interval", "24"],
                    nproc=own[n][1]) for i, n in enumerate("AB")]
        _end(jobs)
    assert (ckpt["B"] / "iter_0000012").is_dir(), sorted(p.name for p in ckpt["B"].iterdir())
    (ckpt["B"] / "latest_checkpointed_iteration.txt").write_text("12")
    return ckpt


def test_sites_of_different_data_parallel_size_resume_and_join(tmp_path):
    """The jobs of the test above (A at DP 2, B at DP 1, ``--diloco-x-exchange-slots 2``) save their own
    checkpoints, the outer state slot by slot; the run stops at iteration 24. A resumes from its latest; B from an
    older one of its own (iteration 12), once A trains: B is behind and takes each slot's outer state from the
    rank of A that holds it (its one rank fetches from both), then the two train on identical, slot by slot, to
    the end."""
    base = [*BASE, "--train-iters", "48", "--no-load-rng", "--diloco-x-exchange-slots", "2",
            "--pipeline-model-parallel-size", "1"]
    own = {"A": ([], 2), "B": (["--global-batch-size", "2"], 1)}
    ckpt = _saved_with_b_behind(tmp_path, base, own)
    # (0.8 s per step until B has joined: A's 24 steps left, ~20 s, outlast B's start on two busy cores)
    slow = _slow(tmp_path, 0.8)
    with Lighthouse(tmp_path / "lighthouse2.txt") as lh:
        a = Job(tmp_path / "A2", "A", 0, lh.address, [*base, *own["A"][0], "--load", str(ckpt["A"])], env=slow)
        jobs = [a]
        with _closing(jobs):
            wait_until(lambda: "joined run 'test-run' at iteration 24" in a.log(), 240, "A's start", jobs)
            b = Job(tmp_path / "B2", "B", 1, lh.address, [*base, *own["B"][0], "--load", str(ckpt["B"])], env=slow,
                    nproc=1)
            jobs.append(b)
            wait_until(lambda: "joined run 'test-run' under way at iteration" in b.log(), 240, "B's join", jobs)
            _hurry(tmp_path)
        _end(jobs)
    assert ("joined run 'test-run' under way at iteration" in b.log()
            and "inner optimizer state from this job's checkpoint at iteration 12" in b.log()), b.log()[-3000:]
    assert b.summary()["federation"]["heals"] == 1 and len(b.records()[0]["heals"]) == 2  # one fetch per slot
    at = [{r[0]: r[1] for r in rec["fed_rounds"]} for rec in (*a.records(), *b.records())]
    steps = sorted(set(at[0]) & set(at[2]))
    assert steps and min(steps) > 24 and max(steps) == 48, steps
    assert all([*at[0][s], *at[1][s]] == at[2][s] for s in steps), [(s, at[0][s], at[1][s], at[2][s]) for s in steps]


def test_sites_of_different_speed_each_run_the_steps_that_fit(tmp_path):
    """``--diloco-x-site-pace 4`` on both jobs, the same flags otherwise (the run's rounds: 18 warm-up rounds of 2,
    then 6 of 6, 72 run steps), job B slowed by 0.3 s per step (no compute). B, the slowest, starts alone and runs
    the run's steps; A starts while B trains, joins under way from nothing (at its own iteration 0, the LR schedule
    at the run's position) and runs the steps that fit B's round in every round after its first (more, at most
    4x). The two are identical at every boundary they share, A weighing more than B by its tokens; B ends at
    iteration 72, A at its own count, both at the run's last boundary and the LR schedule's end."""
    flags = [*BASE, "--train-iters", "72", "--diloco-x-site-pace", "4", "--log-interval", "1"]
    with Lighthouse(tmp_path / "lighthouse.txt") as lh:
        b = Job(tmp_path / "B", "B", 1, lh.address, flags, env={"DILOCO_TEST_STEP_SLEEP_S": "0.3"})
        jobs = [b]
        with _closing(jobs):
            wait_until(lambda: b.rounds() >= 2, 240, "B's first rounds", jobs)
            jobs.insert(0, Job(tmp_path / "A", "A", 0, lh.address, flags))
        _end(jobs)
    a = jobs[0]
    rounds = [[r[0][1] + r[1][1] for r in zip(*(rec["fed_rounds"] for rec in j.records()))] for j in jobs]
    assert len(rounds[1]) == 24 and 3 <= len(rounds[0]) < 22, [len(r) for r in rounds]  # A joined under way
    assert rounds[0] == rounds[1][-len(rounds[0]):]  # theta at every boundary both ran
    assert "joined run 'test-run' under way at iteration 0" in a.log(), a.log()[-3000:]
    steps_a, steps_b = ([r[0] for r in j.records()[0]["fed_rounds"]] for j in jobs)
    paced = [n - m for m, n in zip(steps_a, steps_a[1:])]
    own = [n - m for m, n in zip(steps_b, steps_b[1:])][-len(paced):]
    assert steps_b[-1] == 72 and all(p > 1.5 * o for p, o in zip(paced, own)), (steps_a, steps_b)
    assert {n for n, _ in _final(a)} == {steps_a[-1]} and {n for n, _ in _final(b)} == {72}
    wa, wb = _weights(a), _weights(b)
    later = list(zip(sorted(wa), sorted(wb)[-len(wa):]))[1:]  # (A's first round after its join: nothing measured)
    assert all(wa[s][1] > 1.0 > wb[t][1] and wa[s][0] > wb[t][0] for s, t in later), (wa, wb)

    def last_lr(job: Job) -> str:
        return job.log().rsplit("learning rate: ", 1)[1].split()[0]

    assert last_lr(a) == last_lr(b), (last_lr(a), last_lr(b))
    _losses_fall(b)


def test_sites_of_different_speed_resume_from_their_own_checkpoints(tmp_path):
    """The paced jobs of the test above, both from the start, each saving its own checkpoints every 12 of its own
    iterations, are killed together (kill -9) mid-run and restarted from their latest checkpoints, which stand at
    different boundaries of the run: the job behind takes the run's outer state from the other and keeps its own
    iteration and pace (the rounds it missed are not trained on its own steps: B, the slowest, then ends below the
    run's 72); both end at the run's last boundary, identical there, with the LR schedule's end."""
    flags = [*BASE, "--train-iters", "72", "--diloco-x-site-pace", "4", "--log-interval", "1", "--no-load-rng",
             "--save-interval", "12"]
    ckpt = {n: tmp_path / f"ckpt{n}" for n in "AB"}
    env = {"A": {}, "B": {"DILOCO_TEST_STEP_SLEEP_S": "0.3"}}
    with Lighthouse(tmp_path / "lighthouse.txt", min_replicas=2) as lh:
        jobs = [Job(tmp_path / f"{n}1", n, i, lh.address, [*flags, "--save", str(ckpt[n])], env=env[n])
                for i, n in enumerate("AB")]
        with _closing(jobs):
            wait_until(lambda: jobs[1].rounds() >= 20, 240, "20 rounds", jobs)
        for job in jobs:
            job.close()
        saved = {n: int((ckpt[n] / "latest_checkpointed_iteration.txt").read_text()) for n in "AB"}
        jobs = [Job(tmp_path / f"{n}2", n, i, lh.address, [*flags, "--save", str(ckpt[n]), "--load", str(ckpt[n])],
                    env=env[n]) for i, n in enumerate("AB")]
        _end(jobs)
    a, b = jobs
    assert saved["B"] >= 36 and saved["A"] > saved["B"], saved
    heals = [j.summary()["federation"]["heals"] for j in jobs]
    assert sum(heals) == 1, heals  # the job whose checkpoint stands at an earlier boundary
    ends = [_final(j)[0][0] for j in jobs]  # own iterations: B runs the run's 72 steps, less a round a heal drops
    assert _final(a)[0][1] == _final(b)[0][1] and a.summary()["rounds"] == b.summary()["rounds"]  # the last boundary
    assert (ends[1] == 72 if heals[1] == 0 else ends[1] < 72) and ends[0] > 72, (ends, heals)
    assert a.log().rsplit("learning rate: ", 1)[1].split()[0] == b.log().rsplit("learning rate: ", 1)[1].split()[0]


def _chunks(job: Job) -> dict[int, list]:
    """step -> theta's fingerprint chunk by chunk (every rank's chunks in rank order: the run's chunks in order),
    at every boundary all the job's ranks recorded (``--diloco-x-exchange-chunks``)."""
    recs = job.records()
    at = [{r[0]: r[1] for r in rec["fed_rounds"]} for rec in recs]
    return {s: [x for fps in at for x in fps[s]] for s in set(at[0]).intersection(*at[1:])}


#: sites of other layouts: (ranks, flags) of job A, whether B starts with it; job B is on 2 ranks at TP 2, PP 1
LAYOUTS = {"tp1_one_rank": (1, ["--pipeline-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256"], False),
           "pp2_together": (2, ["--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"], True)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sites_of_different_layouts_exchange_by_name(tmp_path, layout):
    """Job B on 2 ranks (TP 2, PP 1); job A on 1 rank (TP 1: A's rank holds both chunks, B's ranks one each) or on
    2 ranks at PP 2 (each stage's rank holds a chunk of parameters spread over both of B's ranks);
    ``--diloco-x-exchange-chunks 2`` on both, the package's defaults otherwise (partial overlap, int4, the auto
    warm-up), the padded vocabulary alike (--make-vocab-size-divisible-by 256 at TP 1, 128 at TP 2). Their initial
    weights differ (Megatron initializes each layout's shards from its own RNG streams): B starts once A trains and
    joins by taking A's outer state, or (``together``) both start at once and, at the run's first meeting, one
    takes the other's. From then on theta is bit-identical chunk by chunk at every boundary they share, each mean
    weighs them 1 / 1 (the same tokens), and both end with the same x at iteration 40: each chunk pulled from the
    main shards as they ended."""
    nproc, flags, together = LAYOUTS[layout]
    base = [*BASE, "--train-iters", "40", "--diloco-x-exchange-chunks", "2"]
    b_flags = [*base, "--make-vocab-size-divisible-by", "128", "--tensor-model-parallel-size", "2",
               "--pipeline-model-parallel-size", "1"]
    with Lighthouse(tmp_path / "lighthouse.txt", min_replicas=2 if together else 1) as lh:
        a = Job(tmp_path / "A", "A", 0, lh.address, [*base, *flags], nproc=nproc,
                env=ENV if together else _slow(tmp_path, 0.4))
        jobs = [a]
        with _closing(jobs):
            if together:
                jobs.append(Job(tmp_path / "B", "B", 1, lh.address, b_flags, env=ENV))
            else:
                wait_until(lambda: a.rounds() >= 1, 240, "the first job's first round", jobs)
                jobs.append(Job(tmp_path / "B", "B", 1, lh.address, b_flags, env=_slow(tmp_path)))
                wait_until(lambda: "joined run 'test-run' under way at iteration" in jobs[1].log(), 300, "B's join",
                           jobs)
                _hurry(tmp_path)
        _end(jobs)
    b = jobs[1]
    healed = [j for j in jobs if j.summary()["federation"]["heals"]]
    assert [j.summary()["federation"]["heals"] for j in healed] == [1] and (together or healed == [b]), healed
    joined = int(healed[0].log().split("joined run 'test-run' under way at iteration ")[1].split(":")[0])
    assert joined == 0 if together else joined > 0, joined
    ta, tb = _chunks(a), _chunks(b)
    shared = sorted(s for s in set(ta) & set(tb) if s >= joined)
    assert shared and max(shared) == 40, (joined, sorted(ta), sorted(tb))
    for step in shared:
        assert ta[step] == tb[step], (step, ta[step], tb[step])
    members = {r[0]: r[2] for r in a.records()[0]["fed_rounds"]}
    assert all(members[s] == 2 for s in shared[:-1]), members
    weights = {r[0]: r[9] for r in a.records()[0]["fed_rounds"]}
    assert all(weights[s] == 1.0 for s in shared[1:-1]), weights
    ends = [[r["final_fp"] for r in job.records()] for job in (a, b)]
    assert {e["steps"] for job in ends for e in job} == {40}
    chunks = [[c for e in job for c in e["chunks"]] for job in ends]  # (each job's ranks in order: chunks 0, 1)
    assert len(chunks[0]) == 2 and chunks[0] == chunks[1], ends
    _losses_fall(b)


def test_sites_of_different_layouts_resume_and_join(tmp_path):
    """Job A on 1 rank (TP 1) and job B on 2 ranks (TP 2), ``--diloco-x-exchange-chunks 2``, start together (one
    takes the other's outer state at the first meeting), save their own checkpoints (the outer state chunk by
    chunk) and stop at iteration 24. A resumes from its latest, B from an older one of its own (iteration 12), once
    A trains: B is behind and takes each chunk's outer state from A's one rank (each of B's ranks fetches its
    chunk); from then on theta is bit-identical chunk by chunk at every boundary, and x at the end."""
    base = [*BASE, "--train-iters", "48", "--no-load-rng", "--diloco-x-exchange-chunks", "2",
            "--pipeline-model-parallel-size", "1"]
    own = {"A": (["--make-vocab-size-divisible-by", "256"], 1),
           "B": (["--make-vocab-size-divisible-by", "128", "--tensor-model-parallel-size", "2"], 2)}
    ckpt = _saved_with_b_behind(tmp_path, base, own)
    slow = _slow(tmp_path, 0.8)
    with Lighthouse(tmp_path / "lighthouse2.txt") as lh:
        a = Job(tmp_path / "A2", "A", 0, lh.address, [*base, *own["A"][0], "--load", str(ckpt["A"])], env=slow,
                nproc=1)
        jobs = [a]
        with _closing(jobs):
            wait_until(lambda: "joined run 'test-run' at iteration 24" in a.log(), 240, "A's start", jobs)
            b = Job(tmp_path / "B2", "B", 1, lh.address, [*base, *own["B"][0], "--load", str(ckpt["B"])], env=slow)
            jobs.append(b)
            wait_until(lambda: "joined run 'test-run' under way at iteration" in b.log(), 240, "B's join", jobs)
            _hurry(tmp_path)
        _end(jobs)
    assert "inner optimizer state from this job's checkpoint at iteration 12" in b.log(), b.log()[-3000:]
    assert b.summary()["federation"]["heals"] == 1 and [len(r["heals"]) for r in b.records()] == [1, 1]
    ta, tb = _chunks(a), _chunks(b)
    steps = sorted(set(ta) & set(tb))
    assert steps and min(steps) > 24 and max(steps) == 48, steps
    assert all(ta[s] == tb[s] for s in steps), [(s, ta[s], tb[s]) for s in steps]
    chunks = [[c for r in job.records() for c in r["final_fp"]["chunks"]] for job in (a, b)]
    assert len(chunks[0]) == 2 and chunks[0] == chunks[1], chunks
