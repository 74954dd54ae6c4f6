"""A failed round resolves exactly (``megatron_diloco.algorithm.federated``), on two gloo ranks, each one
job, with a scripted membership in place of torchft: every job present at every boundary; a job that
is behind at a meeting receives the most advanced job's state (as torchft's heal delivers it); the
commit of a round can be refused for one job (as when another rank of that job failed its exchange).

The local steps do not depend on x and every value is a dyadic rational (exact in fp32), with the
fp32 exchange, eta 1 and mu 0: then the outer step and the merges are exact, and the rule of the
module doc can be checked bit for bit against the run in which no round failed:

* a round that one job did not commit while the other did: at the next meeting the job that failed
  takes the committed theta and keeps its progress since that launch; every later value equals the
  undisturbed run's;
* a round that no job committed: theta stays; the next pseudo-gradient covers both rounds; every value
  after the next landing equals the undisturbed run's.

Each job counts its tokens (``FederatedRounds.count_tokens``): the mean is token-weighted, exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_diloco.algorithm import faults
from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.compression import get_codec
from megatron_diloco.algorithm.federated import FederatedRounds, Meeting
from megatron_diloco.algorithm.weights import normalized_weights, token_weights
from megatron_diloco.algorithm.heal import tau_of_share, tau_share
from megatron_diloco.algorithm.shard_view import ShardView
from megatron_diloco.algorithm.sync import OuterSync
from megatron_diloco.federation.auth import RunKey
from megatron_diloco.federation.handshake import means_agree
from tests.dist_utils import run_world
from tests.inner_steps import boundaries

N, H, STEPS = 64, 4, 24
KEY = RunKey(b"a test secret of the run", "test-run")


class ScriptedMembership:
    """Every job (rank of the world) present; heals the jobs behind from the most advanced one;
    ``refuse``: the (job, commit number) pairs whose commit is refused."""

    job_group = None

    def __init__(self, refuse: set[tuple[int, int]], check_means: bool = True) -> None:
        self.refuse = refuse
        #: False where one job's exchange fails and the other's completes: the real members then check on
        #: a group the failed job never uses again (the other waits for it up to the bound); here both share
        #: the world group, which cannot model that
        self.check_means = check_means
        self.fed: FederatedRounds | None = None
        self.commits = 0
        self.refused_means = 0
        self.first = True

    def meet(self, progress: int) -> Meeting:
        rank, world = dist.get_rank(), dist.get_world_size()
        everyone = [None] * world
        dist.all_gather_object(everyone, progress)
        top = max(everyone)
        src = everyone.index(top)
        if any(p < top for p in everyone):
            box = [self.fed.state_dict() if rank == src else None]
            dist.broadcast_object_list(box, src=src)
            if everyone[rank] < top:
                self.fed.load_state_dict(box[0])
        changed, self.first = self.first, False
        return Meeting(dist.group.WORLD, changed, world)

    def abandon(self) -> None:  # the world group stays (the test's jobs never lose a member)
        pass

    def commit(self, ok: bool, mean: bytes | None = None) -> bool:
        """As torchft's job-wide commit does (one rank per job here), after the members' authenticated
        check that they landed the same mean (the real one, over the world group)."""
        self.commits += 1
        if ok and mean is not None and self.check_means:
            ok, why = means_agree(dist.group.WORLD, KEY, 0, self.rounds(), mean, 30.0)
            self.refused_means += not ok
        return ok and (dist.get_rank(), self.commits) not in self.refuse


def _job(overlap: str, compression: str, refuse: set = frozenset(), steps: dict | None = None,
         check_means: bool = True, local_steps: int = H, site_weights: str = "tokens"):
    """One job's rank: ``(sync, fed, x, steps)`` over the world group, with a scripted membership; the job
    weighs by its tokens (:func:`_boundaries` counts them)."""
    cfg = DiLoCoXConfig(replicas=2, local_steps=local_steps, outer_lr=1.0, outer_momentum=0.0, overlap=overlap,
                        compression=compression, site_weights=site_weights,
                        **({"overlap_steps": 1} if overlap == "partial" else {}))
    x = torch.zeros(N)
    sync = OuterSync(ShardView([x]), cfg, dist.group.WORLD)
    steps = {"steps": 0} if steps is None else steps
    membership = ScriptedMembership(refuse, check_means)
    sync.round_rules = fed = FederatedRounds(sync, membership, lambda: dict(steps), lambda p: steps.update(p))
    membership.fed = fed
    fed.tokens_per_step = lambda: 1  # (:func:`_boundaries` sets the job's)
    return sync, fed, x, steps


def _boundaries(sync: OuterSync, x: torch.Tensor, rank: int, steps: dict, last: int, tokens: int = 1,
                first: int = 1):
    """The inner steps ``first``..``last`` (``partial``'s landings included), each on ``tokens`` tokens; yields
    each boundary's step before the caller runs it. A local step that does not depend on x, dyadic (exact in
    fp32), different per job."""
    sync.round_rules.tokens_per_step = lambda: tokens
    return boundaries(sync, steps, first, last, lambda step: x.sub_(
        torch.arange(N, dtype=torch.float32).mul_(2.0 ** -8 * (rank + 1)).add_(2.0 ** -6 * step)))


def _run(rank: int, refuse: set, overlap: str) -> list[tuple[int, list[float], list[float]]]:
    sync, fed, x, steps = _job(overlap, "none", refuse)
    seen, tokens = [], {}
    for step in _boundaries(sync, x, rank, steps, STEPS):
        sync.boundary()
        seen.append((step, sync.theta.tolist(), x.tolist()))
        tokens[step] = fed.round_tokens
    sync.drain()
    seen.append((STEPS + 1, sync.theta.tolist(), x.tolist()))
    return seen, {**fed.summary(), "refused_means": fed.membership.refused_means, "tokens": tokens}


def _worker(rank: int, world: int, overlap: str, case: str, out) -> None:
    reference, _ = _run(rank, set(), overlap)
    if case == "one_job_commits":
        refuse = {(1, 2)}  # job 1's second commit (the exchange launched at step 8) refused, job 0's granted
    elif case == "nobody_commits":
        refuse = {(0, 2), (1, 2)}  # nobody commits that round
    else:  # one element of the mean job 1 landed in that round changed: every member refuses the round
        refuse = set()
        if rank == 1:
            os.environ[faults.ENV] = "commit:corrupt:2"
    failed, summary = _run(rank, refuse, overlap)
    assert summary["failed_rounds"] == (0 if case == "one_job_commits" and rank == 0 else 1), summary
    assert summary["refused_means"] == (case == "corrupted_mean"), summary  # on both jobs, that round only
    if case == "one_job_commits" and rank == 1:
        assert summary["heals"] == 1, summary
    # the tokens the pseudo-gradient after the failed round (step 8) covers: that round's too where nobody
    # committed it, only the steps since its launch where the job took it from another job's theta
    failed_here = summary["failed_rounds"] == 1
    assert summary["tokens"][12] == (2 * H if failed_here and case != "one_job_commits" else H), summary
    ref = {step: (theta, x) for step, theta, x in reference}
    got = {step: (theta, x) for step, theta, x in failed}
    # the resolution lands at the boundary after the failed round (step 12): from there on, exact
    for step in sorted(ref):
        if step >= 12 + (H if case != "one_job_commits" else 0):
            assert got[step][0] == ref[step][0], (case, rank, step, "theta")
            assert got[step][1] == ref[step][1], (case, rank, step, "x")
    thetas = [None, None]
    dist.all_gather_object(thetas, got[STEPS + 1][0])
    assert thetas[0] == thetas[1]


@pytest.mark.parametrize("case", ["one_job_commits", "nobody_commits", "corrupted_mean"])
@pytest.mark.parametrize("overlap", ["partial", "none"])
def test_failed_round_resolves_to_the_undisturbed_run(overlap, case):
    """``corrupted_mean``: job 1 lands a mean with one element changed (as a payload altered on its way to it):
    the members' authenticated check refuses the round on both jobs, which then resolve as when nobody
    committed (the corrupted mean never reaches theta)."""
    run_world(_worker, 2, overlap, case, None)


# ---------------- lossy codecs: the residual after every failure case ----------------
def _run_lossy(rank: int, overlap: str, case: str) -> dict:
    """2 jobs, int8 with error feedback; round 2 (the boundary at step 8) fails as ``case`` says. Returns
    the residual before that launch, right after it, and right after the failure's resolution."""
    from megatron_diloco.algorithm.bounds import OuterGroupError

    refuse = {"one_job_commits": {(1, 2)}, "nobody_commits": {(0, 2), (1, 2)}}.get(case, set())
    sync, fed, x, steps = _job(overlap, "int8", refuse, check_means=case != "save_finds_it_failed")
    decide, complete, resolve = sync.decision.decide, sync.complete, fed._resolve_failed_round
    out: dict = {"saved": None}

    def failing_decide(rounds, *args, **kw):
        if case == "decision_fails" and rounds == 2:
            raise OuterGroupError("injected: the decision of round 2 failed")
        return decide(rounds, *args, **kw)

    def failing_complete(handle, *args, **kw):  # the save finds the exchange failed on job 1
        if case == "save_finds_it_failed" and rank == 1 and handle.round == 2 and not args:
            raise OuterGroupError("injected: the exchange of round 2 failed")
        return complete(handle, *args, **kw)

    def resolving(healed):
        resolve(healed)
        out["resolved"], out["healed"] = sync.residual.clone(), healed

    sync.decision.decide, sync.complete, fed._resolve_failed_round = failing_decide, failing_complete, resolving
    for step in _boundaries(sync, x, rank, steps, STEPS):
        if step == 8:
            out["before"] = sync.residual.clone()
        sync.boundary()
        if step == 8:
            out["after"] = sync.residual.clone()
            if case == "save_finds_it_failed":
                state = sync.state_dict()
                out["saved"] = (state["pending_delta"] is None, sync.committed_residual.clone())
    sync.drain()
    out["theta"] = sync.theta.clone()
    out["summary"] = fed.summary()
    return out


def _lossy_worker(rank: int, world: int, overlap: str, case: str) -> None:
    got = _run_lossy(rank, overlap, case)
    failed = case in ("nobody_commits", "decision_fails") or rank == 1
    assert got["summary"]["failed_rounds"] == int(failed), (case, rank, got["summary"])
    if failed:
        assert not torch.equal(got["before"], got["after"]) or case == "decision_fails"
        # healed (another job committed that round with this payload): e_new; else the residual before it
        want = got["after"] if got["healed"] else got["before"]
        assert got["healed"] == (case in ("one_job_commits", "save_finds_it_failed")), (case, rank)
        assert torch.equal(got["resolved"], want), (case, rank, (got["resolved"] - want).abs().max())
    if got["saved"] is not None and rank == 1:  # the checkpoint: no pending mean, the residual before the launch
        no_pending, residual = got["saved"]
        assert no_pending and torch.equal(residual, got["before"])
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, got["theta"])
    assert torch.equal(thetas[0], thetas[1])


@pytest.mark.parametrize("case", ["one_job_commits", "nobody_commits", "decision_fails", "save_finds_it_failed"])
@pytest.mark.parametrize("overlap", ["partial", "none"])
def test_the_residual_is_exact_after_every_failure_case(overlap, case):
    """int8 with error feedback: after a failed round's resolution the residual is bit for bit the one
    before that launch (nobody committed it, or it never launched) or the one it left (another job
    committed it, with this payload); a checkpoint written while it is unresolved holds no pending mean
    and the residual before the launch; the jobs end with the same theta."""
    run_world(_lossy_worker, 2, overlap, case)


# ---------------- a job that joins by a heal sends a zero row ----------------
def _joiner_worker(rank: int, world: int) -> None:
    """Both jobs train round 1 together (int8, ``none``); job 1 then restarts from its checkpoint of step H
    with the stale error-feedback residual a checkpoint holds, and joins while job 0 runs its boundary at 2H:
    it takes job 0's state and runs that boundary contributing nothing. Its row must be exactly zero: its
    residual after the launch is all zeros (a stale residual would have left e - D(C(e))), and both jobs
    hold the same theta after the landing."""

    sync, fed, x, steps = _job("none", "int8")
    for _ in _boundaries(sync, x, rank, steps, 2 * H if rank == 0 else H):
        sync.boundary()
    if rank == 1:  # restarted from its checkpoint at step H: a stale residual, then joins the run
        sync, fed, x, steps = _job("none", "int8", steps={"steps": H})
        sync.residual.copy_(torch.linspace(-0.3, 0.3, N))
        assert fed.join() is not None and steps["steps"] == 2 * H
        assert torch.count_nonzero(sync.residual) == 0, sync.residual
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, sync.theta.clone())
    assert torch.equal(thetas[0], thetas[1])


def test_a_job_that_joins_by_a_heal_sends_a_zero_row():
    run_world(_joiner_worker, 2)


# ---------------- token-weighted means ----------------
def test_token_weights():
    """w_r = R t_r / sum t in fp32; None (the plain mean) when all are 1 or nobody trained; 0 for no tokens."""
    assert token_weights([8192.0, 8192.0]) is None and token_weights([5.0]) is None
    assert token_weights([0.0, 0.0]) is None
    assert token_weights([3.0, 1.0]) == (1.5, 0.5)
    assert token_weights([7.0, 0.0]) == (2.0, 0.0)
    w = token_weights([2.0, 1.0, 1.0])
    assert w == (1.5, 0.75, 0.75)
    for bad in ([float("nan"), 1.0], [-1.0, 2.0], [float("inf"), 1.0]):  # a peer's slot, checked before use
        with pytest.raises(ValueError, match="finite number >= 0"):
            token_weights(bad)
    w = token_weights([1.0, 2.0])  # 2/3, 4/3: rounded to fp32
    assert w == (float(torch.tensor(2 / 3, dtype=torch.float32)), float(torch.tensor(4 / 3, dtype=torch.float32)))


def test_normalized_weights():
    """FedNova's normalized averaging: w_r = R p_r s_eff / s_r; token weights when the members with tokens ran the
    same steps (a member without tokens weighs 0 whatever its steps); refused: bad values, tokens in no steps."""
    assert normalized_weights([4.0, 4.0], [1.0, 2.0]) == (1.5, 0.75)  # p = 1/2 each, s_eff 1.5
    assert normalized_weights([2.0, 1.0], [2.0, 1.0]) == (float(torch.tensor(10 / 9, dtype=torch.float32)),) * 2
    assert normalized_weights([3.0, 1.0], [5.0, 5.0]) == token_weights([3.0, 1.0]) == (1.5, 0.5)
    assert normalized_weights([3.0, 0.0], [2.0, 0.0]) == (2.0, 0.0)  # one member with tokens: its own mean
    assert normalized_weights([8.0, 8.0, 0.0], [4.0, 2.0, 0.0]) == (1.125, 2.25, 0.0)  # a joiner weighs 0
    assert normalized_weights([0.0, 0.0], [0.0, 0.0]) is None and normalized_weights([6.0, 6.0], [3.0, 3.0]) is None
    for tokens, steps, match in (([1.0, 1.0], [float("nan"), 1.0], "finite"), ([1.0, 1.0], [-1.0, 1.0], "finite"),
                                 ([1.0, 1.0], [0.0, 1.0], "no inner steps"), ([1.0], [1.0, 1.0], "step counts")):
        with pytest.raises(ValueError, match=match):
            normalized_weights(tokens, steps)


def test_weighed_payloads_decode_to_the_weighted_mean():
    """int8: weighing the gathered payloads (their block scales) and decoding gives (1/R) sum_r w_r D(p_r),
    D(p_r) each payload decoded alone, to fp32 rounding; weights of 1 leave the bits unchanged."""
    torch.manual_seed(0)
    codec, n = get_codec("int8"), 1000
    rows = [codec.encode(torch.zeros(n), pseudo_grad=torch.randn(n) * (r + 1)) for r in range(3)]
    alone = [codec.decode(p.unsqueeze(0), n) for p in rows]
    weights = (1.5, 0.0, 1.5)
    gathered = torch.stack(rows)
    plain = codec.decode(gathered.clone(), n)
    codec.weigh(gathered, n, weights)
    want = sum(w * d.double() for w, d in zip(weights, alone)) / 3
    got = codec.decode(gathered, n).double()
    assert (got - want).abs().max() <= 4 * 2.0 ** -23 * want.abs().max()  # a few fp32 roundings of the sum
    assert not torch.allclose(got, plain.double(), rtol=1e-3)
    ones = torch.stack(rows)
    codec.weigh(ones, n, (1.0, 1.0, 1.0))
    assert torch.equal(codec.decode(ones, n), plain)


def _weighted_worker(rank: int, world: int, overlap: str, paced: bool, site_weights: str = "tokens") -> None:
    """Job 0 trains on 3 tokens per step, job 1 on 1: every landing moves theta by exactly
    (1/2)(1.5 delta_0 + 0.5 delta_1) (dyadic values, fp32 exchange, eta 1, mu 0). ``paced``: job 1 runs rounds
    of 2H inner steps (a site twice as fast), job 0 of H, over the same rounds, on 6 and 1 tokens per step (24
    and 8 a round): the same weights; both land after the same share of their round (tau 1 of H, 2 of 2H).
    ``normalized`` (paced, ``--diloco-x-site-weights normalized``): 2 and 1 tokens per step (2H each a round:
    token weights would be 1 and 1); shares p = 1/2, mean steps 1.5 H: w = 2 p 1.5 H / steps = 1.5 and 0.75."""
    h = 2 * H if paced and rank == 1 else H
    sync, fed, x, steps = _job(overlap, "none", local_steps=h, site_weights=site_weights)
    normalized = site_weights == "normalized"
    tokens = (2 if normalized else 6 if paced else 3) if rank == 0 else 1
    w = (1.5, 0.75) if normalized else (1.5, 0.5)
    expected, taus = None, []
    for _ in _boundaries(sync, x, rank, steps, STEPS * h // H, tokens=tokens):
        if expected is not None:
            assert torch.equal(sync.theta, expected), (sync.theta - expected).abs().max()
        deltas = [torch.empty(N), torch.empty(N)]
        dist.all_gather(deltas, sync.theta - x)
        expected = sync.theta - (w[0] * deltas[0] + w[1] * deltas[1]) / 2
        sync.boundary()
        taus.append(sync.tau)
        assert fed.round_weight == w[rank] and fed.round_tokens == h * tokens
    sync.drain()
    assert torch.equal(sync.theta, expected)
    if paced:
        assert taus == [h // H] * (STEPS // H), taus


@pytest.mark.parametrize("overlap, paced, site_weights", [("partial", False, "tokens"), ("none", False, "tokens"),
                                                           ("partial", True, "tokens"), ("partial", True, "normalized")],
                         ids=["partial", "none", "partial-jobs-of-different-H", "normalized-jobs-of-different-H"])
def test_the_mean_weighs_jobs_by_their_tokens(overlap, paced, site_weights):
    run_world(_weighted_worker, 2, overlap, paced, site_weights)


# ---------------- jobs of different H: the rounds are the clock ----------------
def test_tau_travels_as_a_share_of_the_round():
    """A job of the proposer's H gets its tau back exactly; a job of twice the H twice the steps; never 0 for a
    share that is not, never above the cap."""
    for h in (1, 3, 4, 30, 500, 4096):
        for tau in range(h + 1):
            assert tau_of_share(tau_share(tau, h), h, h) == tau
    assert tau_of_share(tau_share(1, 4), 8, 8) == 2 and tau_of_share(tau_share(3, 30), 60, 60) == 6
    assert tau_of_share(tau_share(1, 20), 5, 5) == 1 and tau_of_share(tau_share(4, 4), 8, 2) == 2
    assert tau_share(0, 4) == 0 and tau_of_share(0, 8, 8) == 0


def _paced_joiner_worker(rank: int, world: int) -> None:
    """Job 1 (rounds of 2H) restarts from its checkpoint after its first round (step 2H) and joins while job 0
    (rounds of H) runs its second boundary (step 2H too): it is one round behind, heals, and goes on at its
    own step of that boundary (4H), not job 0's; both are identical after the third round."""
    h = H if rank == 0 else 2 * H
    sync, fed, x, steps = _job("none", "none", local_steps=h)
    for _ in _boundaries(sync, x, rank, steps, 3 * H if rank == 0 else 2 * H):
        sync.boundary()
    if rank == 1:
        sync, fed, x, steps = _job("none", "none", steps={"steps": 2 * H}, local_steps=h)
        assert fed.join() is not None and steps["steps"] == 4 * H and fed.boundaries() == 2
        for _ in _boundaries(sync, x, rank, steps, 6 * H, first=4 * H + 1):
            sync.boundary()
    sync.drain()
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, sync.theta.clone())
    assert torch.equal(thetas[0], thetas[1]) and fed.committed == 3


def test_a_job_of_another_h_joins_at_its_own_step():
    run_world(_paced_joiner_worker, 2)


def _pending_heal_worker(rank: int, world: int) -> None:
    """Job 0 (rounds of H, partial, tau 1) and job 1 (rounds of 2H: tau 2, the same share) launch their first
    exchange; job 0 saves it, pending, and both restart: job 0 from that checkpoint, job 1 with none. Job 1 is
    healed at its start from job 0, pending exchange included: it lands it after the same share of its own round
    (2 steps, not job 0's 1), and both end identical after the next round."""
    h = H if rank == 0 else 2 * H
    sync, fed, x, steps = _job("partial", "none", local_steps=h)
    for _ in _boundaries(sync, x, rank, steps, h):
        sync.boundary()
    assert sync.tau == (1 if rank == 0 else 2)  # the agreed share, in each job's steps
    saved = sync.state_dict() if rank == 0 else None
    sync.drain()
    sync, fed, x, steps = _job("partial", "none", steps={"steps": h if rank == 0 else 0}, local_steps=h)
    if rank == 0:
        assert saved["pending_delta"] is not None
        sync.load_state_dict(saved)
        x.copy_(sync.theta)
    healed = fed.join()
    assert (healed is None) == (rank == 0) and steps["steps"] == h
    assert sync.pending is not None and sync.tau == (1 if rank == 0 else 2), (rank, sync.tau)
    for _ in _boundaries(sync, x, rank, steps, 2 * h, first=h + 1):
        sync.boundary()
    sync.drain()
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, sync.theta.clone())
    assert torch.equal(thetas[0], thetas[1])


def test_a_job_healed_at_its_start_lands_the_pending_exchange_at_its_own_share_of_the_round():
    run_world(_pending_heal_worker, 2)


# ---------------- a job late by one round contributes it one round stale ----------------
class _LateMembership(ScriptedMembership):
    """Job 0 meets alone at its meetings in ``alone`` (job 1 is late: it has not reached its boundary);
    otherwise both meet as :class:`ScriptedMembership` does."""

    def __init__(self, alone: set[int]) -> None:
        super().__init__(set())
        self.alone, self.meetings = alone, 0

    def meet(self, progress: int) -> Meeting:
        self.meetings += 1
        if dist.get_rank() == 0 and self.meetings in self.alone:
            return Meeting(None, True, 1)
        return super().meet(progress)


def _late_worker(rank: int, world: int, overlap: str, late: int, codec: str) -> None:
    """Both jobs train 2 rounds together; job 0 then meets without job 1 at its next ``late`` boundaries (job 1
    is stuck before its third): job 1's third meeting is job 0's (3 + late)-th, where job 1 is healed while it
    trains and catches up in place (the integration's iteration skip stands in as moving its steps). Late by one
    round, its last round goes into that boundary's mean one round stale: x1 <- theta_run + (x1 - theta_held),
    its tokens kept; the mean is exactly the token-weighted mean of job 0's x and that. Late by two, it enters as
    a joiner (x1 <- theta_run, weight 0). Both end with the same theta. int8: the error feedback is kept late by one
    round (the residual its last launch left, not zero) and zeroed late by two (that of another theta)."""
    sync, fed, x, steps = _job(overlap, codec)
    fed.membership = membership = _LateMembership(set(range(3, 3 + late)))
    membership.fed, membership.rounds = fed, lambda: sync.rounds
    fed.catch_up = lambda target: steps.update(steps=target)
    caught_up, residual = fed._caught_up, {}

    def catching_up(healed, before):
        residual["before"] = None if sync.residual is None else sync.residual.clone()
        caught_up(healed, before)
        residual["after"] = None if sync.residual is None else sync.residual.clone()

    fed._caught_up = catching_up
    last = H * (3 + late) if rank == 0 else 3 * H
    for step in _boundaries(sync, x, rank, steps, last):
        if step < last:
            sync.boundary()
    before = [torch.empty(2, N), torch.empty(2, N)]  # per job: x, theta before the common boundary
    dist.all_gather(before, torch.stack([x, sync.theta]))
    sync.boundary()
    assert steps["steps"] == H * (3 + late), steps  # job 1 moved to the run's boundary
    sync.drain()
    (x0, theta_run), (x1, theta_held) = before
    stale = theta_run + (x1 - theta_held) if late == 1 else theta_run
    w0, w1 = (1.0, 1.0) if late == 1 else (2.0, 0.0)
    expected = theta_run - ((theta_run - x0) * w0 + (theta_run - stale) * w1) * 0.5
    if codec == "none":
        assert torch.equal(sync.theta, expected), (rank, (sync.theta - expected).abs().max())
    else:  # the residual as it enters the boundary's launch
        assert rank == 0 or (torch.count_nonzero(residual["before"]) > 0 and torch.equal(
            residual["after"], residual["before"] if late == 1 else torch.zeros(N))), residual
    if rank == 1:
        assert fed.stats["stale_rounds"] == (late == 1) and fed.stats["caught_up_rounds"] == late, fed.stats
        assert (fed.round_tokens, fed.round_weight) == ((H, 1.0) if late == 1 else (0, 0.0))
    thetas = [torch.empty(N), torch.empty(N)]
    dist.all_gather(thetas, sync.theta.clone())
    assert torch.equal(thetas[0], thetas[1])


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("late", [1, 2])
@pytest.mark.parametrize("overlap", ["partial", "none"])
def test_a_job_late_by_one_round_contributes_it_one_round_stale(overlap, late, codec):
    run_world(_late_worker, 2, overlap, late, codec)
