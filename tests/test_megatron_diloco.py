"""DiLoCoX inside real Megatron pretraining: PP 2 x 2 replicas on 4 gloo ranks (CPU)."""

from __future__ import annotations

import math
import re

import pytest

from tests.megatron_utils import (assert_final_params_identical, losses, run_megatron, summary,
                                  traffic_between_boundaries)

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("loss_mode", [[], ["--calculate-per-token-loss"]], ids=["mean", "per-token"])
def test_degenerate_case_equals_data_parallel(tmp_path, loss_mode):
    """H=1, inner SGD, eta=1, mu=0, no delay, no compression == vanilla DP over all replicas.

    Also pins the inner gradient scale: a replica averaging over the full DP size (instead of its own)
    would take half-size steps and diverge from the vanilla run. With per-token loss Megatron divides
    the gradient by the token count instead: it must be the replica's count (and not be rescaled)."""
    common = ["--optimizer", "sgd", "--lr", "0.05", "--train-iters", "6", "--clip-grad", "0",
              "--weight-decay", "0", *loss_mode]
    vanilla, _ = run_megatron(tmp_path, common + ["--no-diloco-x"])
    dx, log = run_megatron(tmp_path, common + ["--diloco-x-local-steps", "1", "--diloco-x-outer-lr", "1",
                                               "--diloco-x-outer-momentum", "0", "--diloco-x-overlap", "none",
                                               "--diloco-x-compression", "none"])
    lv, ld = losses(vanilla), losses(dx)
    assert sorted(ld) == [1, 3]  # the last stage of each replica (contiguous replicas)
    # vanilla reports the global mean loss; DiLoCoX reports each replica's own: compare the means.
    v_rank = sorted(lv)[0]
    for it in range(1, 7):
        v = lv[v_rank][it]
        d = (ld[1][it] + ld[3][it]) / 2
        assert math.isclose(v, d, rel_tol=2e-5), (it, v, d)
    assert summary(log)["replicas_identical"]


#: Megatron's own defaults that issue world collectives (validated rerun of every step), plus the
#: exit checks production recipes use; the tests' TINY set logs every iteration (timers' gather).
MEGATRON_DEFAULTS = ["--rerun-mode", "validate_results", "--exit-duration-in-mins", "100000",
                     "--exit-signal-handler"]


def main_thread_traffic(rec: dict) -> dict[int, list[str]]:
    """{iteration: [op, ...]} of the cross-replica ops the training loop's own thread issued."""
    out: dict[int, list[str]] = {}
    for c in rec["cross_replica"]:
        if c["thread"] == "MainThread":
            out.setdefault(c["iteration"], []).append(c["op"])
    return out


@pytest.mark.parametrize("overlap,precision", [("none", []), ("delayed", []), ("delayed", ["--bf16"]), ("partial", [])],
                         ids=["none", "delayed", "delayed-bf16", "partial"])
def test_replicas_identical_and_no_cross_replica_traffic(tmp_path, overlap, precision):
    """With Megatron's default flags, over the whole training loop (counted per process group):
    no op crosses replicas in an inner step, and every boundary issues the same few; between
    boundaries DiLoCoX's step dispatches no tensor op besides the inner optimizer's. Replicas are
    bit-identical at every boundary: the params under none / delayed, the shared outer state (theta,
    m) under partial, whose params differ by design until the end; the params at the end. bf16 matters:
    Megatron's Float16Module wrapper keeps its own ``pg_collection``, which ``train_step`` reads for
    the per-step loss all-reduce."""
    recs, log = run_megatron(tmp_path, ["--train-iters", "12", "--diloco-x-local-steps", "4",
                                        "--diloco-x-overlap", overlap, "--diloco-x-outer-momentum", "0.9",
                                        # partial: tau fixed at 1, so that its exchanges land between
                                        # boundaries on a loaded machine too (auto could choose H)
                                        *(["--diloco-x-overlap-steps", "1"] if overlap == "partial" else []),
                                        *MEGATRON_DEFAULTS, *precision])
    for rank, rec in enumerate(recs):
        assert [s for s, _ in rec["boundary_identical"]] == [4, 8, 12], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        traffic = main_thread_traffic(rec)
        # before the first step: print_datetime's one world barrier ('before the start of training')
        assert traffic.pop(0, []) == ["barrier"], rank
        assert set(traffic) == {4, 8, 12}, (rank, {it: ops for it, ops in traffic.items() if it % 4})
        assert sorted(traffic[8]) == sorted(traffic[12]), (rank, traffic)  # constant per boundary
        assert len(traffic[8]) <= 6, (rank, traffic[8])
        # the exit decision runs once per boundary, after train_step (the recorder sees it there)
        after_step = [c for c in rec["cross_replica"] if not c["in_train_step"] and c["iteration"] == 8]
        assert len(after_step) == 2, (rank, after_step)  # duration all-reduce + signal all-gather
        assert {c["iteration"] for c in rec["cross_replica"] if c["in_boundary"]} == {4, 8, 12}
        # per inner step nothing but a counter: no tensor op of DiLoCoX's outside the outer work
        steps = rec["step_ops"]  # partial: also the steps its exchanges land on, 1 after a boundary
        assert {s for s, _, outer in steps if outer} == ({4, 5, 8, 9, 12} if overlap == "partial" else {4, 8, 12}), \
            (rank, steps)
        assert all(n == 0 for _, n, outer in steps if not outer), (rank, steps)
        assert all(n > 0 for _, n, outer in steps if outer), (rank, steps)  # the counter sees outer work
    assert_final_params_identical(recs)  # partial: the params at every boundary differ by design
    s = summary(log)
    assert s["rounds"] == 3 and s["replicas_identical"] and s["replicas"] == 2
    assert s["final_loss"] < s["first_loss"]


def test_default_warmup_overlaps_a_tenth_of_its_rounds(tmp_path):
    """Megatron's and the package's defaults but H = 30 over 70 iterations: the auto warm-up is
    rounds of H0 = 10 for 30 steps (half the run, rounded down to a multiple of H0), and its auto
    overlap H0 // 10 = 1: the exchanges launched at 10 and 20 (as int2, the auto warm-up codec) land
    at 11 and 21, the one at 30 (into a round of H, as int4) at the auto tau; the run ends 10 steps
    into a round of 30, so the end of training takes a last, shorter round at 70 (int4). The shared outer state (theta, m)
    bit-identical at every boundary, the params at the end, no cross-replica op between boundaries."""
    recs, log = run_megatron(tmp_path, ["--train-iters", "70", "--diloco-x-local-steps", "30", *MEGATRON_DEFAULTS],
                             warmup=True)
    s = summary(log)
    assert (s["warmup_local_steps"], s["warmup_iters"], s["warmup_overlap_steps"]) == (10, 30, 1)
    assert (s["compression"], s["warmup_compression"]) == ("int4", "int2")  # as configured
    assert s["rounds"] == 5 and s["replicas_identical"]
    assert_final_params_identical(recs)
    from megatron_diloco.algorithm.compression.reference import payload_layout

    for rank, rec in enumerate(recs):
        # as used: the exchanges launched at 10 and 20 (into warm-up rounds) carried int2 payloads, the
        # one launched at 30 (into a round of H) int4: each rank's wire bytes, R - 1 = 1 payload of its
        # shard, reported by the round it landed in (20, 30 and 60; the one launched at 60 in the last
        # round, 70)
        n = rec["outer"]["theta_numel"]
        sent = {m["step"]: m["bytes_sent"] for m in rec["rounds"]}
        int2, int4 = payload_layout(n, "int2").total_bytes, payload_layout(n, "int4").total_bytes
        assert sent == {10: 0, 20: int2, 30: int2, 60: int4, 70: int4}, (rank, n, sent)
        assert [b for b, _ in rec["boundary_identical"]] == [10, 20, 30, 60, 70], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        outer = sorted(b for b, _, o in rec["step_ops"] if o)
        assert outer[:5] == [10, 11, 20, 21, 30] and 60 in outer, (rank, outer)  # after 30: landings at the auto tau
        assert all(n == 0 for _, n, o in rec["step_ops"] if not o), rank


def test_auto_warmup_capped_under_train_samples(tmp_path):
    """``--train-samples`` instead of ``--train-iters`` (Megatron sets the iterations only after
    ``install()``, when it builds the LR scheduler): the auto warm-up is still at most half the
    run. 96 samples of global batch 8 = 12 iterations, H 4: rounds of H0 = 1 for 6 steps, then of 4
    (uncapped it would be 30 H = 120 steps: rounds of 1 for the whole run)."""
    recs, log = run_megatron(tmp_path, ["--train-samples", "96", "--lr-warmup-iters", "0", "--lr-warmup-samples", "16",
                                        "--diloco-x-local-steps", "4", *MEGATRON_DEFAULTS], warmup=True)
    s = summary(log)
    assert (s["iterations"], s["warmup_local_steps"], s["warmup_iters"]) == (12, 1, 6)
    assert s["rounds"] == 8 and s["replicas_identical"]
    for rank, rec in enumerate(recs):
        assert [b for b, _ in rec["boundary_identical"]] == [1, 2, 3, 4, 5, 6, 10, 12], rank


def test_step_time_counts_inner_steps_only(tmp_path):
    """The round's mean step time (auto tau, the adaptive budget, the derived timeout) times the
    iterations only: an evaluation (``--eval-interval 4``, made 3 s longer) between them is not in
    it. Each round's value is at most the longest ``train_step`` of the round (its timed span lies
    inside each one), where counting the evaluation would add 3 s / H = 0.75 s per step (round 2: the
    evaluation at 4 runs between its steps)."""
    recs, _ = run_megatron(tmp_path, ["--train-iters", "8", "--diloco-x-local-steps", "4", "--eval-interval", "4",
                                      "--eval-iters", "1", *MEGATRON_DEFAULTS],
                           env={"DILOCO_TEST_EVAL_SLEEP_S": "3"})
    for rank, rec in enumerate(recs):
        # (PP 2 per replica, both stages hold a shard: each sends over the site's link at half its rate)
        assert rec["outer"]["link_sharers"] == 2, rank
        durations = dict(rec["train_step_s"])
        assert [b for b, _ in rec["step_time"]] == [4, 8], rank
        for boundary, step_time in rec["step_time"]:
            longest = max(durations[it] for it in range(boundary - 3, boundary + 1))
            assert 0 < step_time <= longest, (rank, boundary, step_time, longest)


def test_warmup_rounds_then_h(tmp_path):
    """``--diloco-x-warmup-local-steps 2 --diloco-x-warmup-iters 4`` with H = 4 over 12 iterations:
    boundaries at 2, 4, 8 and 12 (partial, tau fixed at 1 so that runs land alike), the shared outer
    state (theta, m) bit-identical at each and the params at the end, no cross-replica op between them, the round count 4; the warm-up's round
    (2..4) blocks (no landing at 3), the rounds of H land one step late (5, 9); a checkpoint saved
    inside the warm-up (iteration 3) resumes on the same schedule, bit for bit. (With H0 = H the
    warm-up changes nothing: the schedule's test, tests/test_config.py::test_warmup_schedule_rounds.) With
    ``--diloco-x-warmup-overlap-steps 1`` the warm-up's round lands one step late too (3), and a
    checkpoint saved with that exchange in flight (an int2 payload: the auto warm-up codec) resumes
    bit for bit; ``--diloco-x-warmup-compression int4`` sends it as int4. With no warm-up flag, the
    auto warm-up: rounds of H // 3 = 1 for half the run (6 steps), blocking, then of H; resumed
    with a longer --train-iters, it keeps the checkpoint's warm-up."""
    base = ["--train-iters", "12", "--diloco-x-local-steps", "4", "--diloco-x-overlap-steps", "1",
            "--save-interval", "1000", "--no-load-rng", *MEGATRON_DEFAULTS]
    warm = base + ["--diloco-x-warmup-local-steps", "2", "--diloco-x-warmup-iters", "4"]
    recs, log = run_megatron(tmp_path, warm)
    for rank, rec in enumerate(recs):
        assert [s for s, _ in rec["boundary_identical"]] == [2, 4, 8, 12], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        traffic = main_thread_traffic(rec)
        traffic.pop(0, None)
        assert set(traffic) == {2, 4, 8, 12}, (rank, traffic)
        assert {s for s, _, outer in rec["step_ops"] if outer} == {2, 4, 5, 8, 9, 12}, rank  # + landings
        assert all(n == 0 for _, n, outer in rec["step_ops"] if not outer), rank
    assert_final_params_identical(recs)
    s = summary(log)
    assert s["rounds"] == 4 and s["replicas_identical"]
    assert (s["local_steps"], s["warmup_local_steps"], s["warmup_iters"], s["warmup_overlap_steps"]) == (4, 2, 4, 0)
    # --diloco-x-warmup-overlap-steps 1: the warm-up's round overlaps one step (lands at 3)
    capped, capped_log = run_megatron(tmp_path, warm + ["--diloco-x-warmup-overlap-steps", "1"])
    assert summary(capped_log)["warmup_overlap_steps"] == 1
    for rank, rec in enumerate(capped):
        assert [s for s, _ in rec["boundary_identical"]] == [2, 4, 8, 12], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        assert {s for s, _, outer in rec["step_ops"] if outer} == {2, 3, 4, 5, 8, 9, 12}, rank
        assert all(n == 0 for _, n, outer in rec["step_ops"] if not outer), rank
    assert losses(capped) != losses(recs)
    # saved at iteration 2, the warm-up boundary whose exchange is in flight (it lands at 3): the
    # resume completes it at the same step, bit for bit
    capped_ckpt = str(tmp_path / "capped_ckpt")
    cap = warm + ["--diloco-x-warmup-overlap-steps", "1"]
    leg1, _ = run_megatron(tmp_path, cap + ["--save", capped_ckpt, "--exit-interval", "2"])
    leg2, _ = run_megatron(tmp_path, cap + ["--load", capped_ckpt])
    assert {r: {**losses(leg1)[r], **losses(leg2)[r]} for r in losses(capped)} == losses(capped)
    # the warm-up codec (--diloco-x-warmup-compression auto: int2 under int4): the exchange launched
    # into the warm-up round (at 2) went as int2 above, those of the rounds of H as int4; with int4
    # for the warm-up too, the same schedule, more bytes, other losses
    int4_run, log = run_megatron(tmp_path, cap + ["--diloco-x-warmup-compression", "int4"])
    for rank, rec in enumerate(int4_run):
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        assert {s for s, _, outer in rec["step_ops"] if outer} == {2, 3, 4, 5, 8, 9, 12}, rank
    s2, s4 = summary(capped_log), summary(log)
    assert s2["warmup_compression"] == "int2" and s4["warmup_compression"] == "int4" and s4["rounds"] == 4
    assert s2["bytes_sent_per_rank"] < s4["bytes_sent_per_rank"] and losses(int4_run) != losses(capped)
    ckpt = str(tmp_path / "ckpt")
    leg1, _ = run_megatron(tmp_path, warm + ["--save", ckpt, "--exit-interval", "3"])
    leg2, _ = run_megatron(tmp_path, warm + ["--load", ckpt])
    want = losses(recs)
    assert {r: {**losses(leg1)[r], **losses(leg2)[r]} for r in want} == want
    # no warm-up flag at all: the auto warm-up, H // 3 = 1 for half the 12 iterations (6); the
    # rounds of H from 6 land one step late (7, 11); the last one is shorter (10..12), its boundary
    # taken by the end of training, after the last step
    auto, log = run_megatron(tmp_path, base, warmup=True)
    for rank, rec in enumerate(auto):
        assert [s for s, _ in rec["boundary_identical"]] == [1, 2, 3, 4, 5, 6, 10, 12], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        assert {s for s, _, outer in rec["step_ops"] if outer} == {1, 2, 3, 4, 5, 6, 7, 10, 11}, rank
    assert (summary(log)["warmup_local_steps"], summary(log)["warmup_iters"]) == (1, 6)
    # a resume that extends --train-iters keeps the auto warm-up it was trained with (6 steps), not
    # the longer one its own --train-iters would give (24 / 2 = 12: boundaries 4, 5, ..., 12, 16, ...)
    auto_ckpt = str(tmp_path / "auto_ckpt")
    run_megatron(tmp_path, base + ["--save", auto_ckpt, "--exit-interval", "3"], warmup=True)
    longer = list(base)
    longer[longer.index("--train-iters") + 1] = "24"
    resumed, log = run_megatron(tmp_path, longer + ["--load", auto_ckpt, "--use-checkpoint-opt_param-scheduler"],
                                warmup=True)
    for rank, rec in enumerate(resumed):
        assert [s for s, _ in rec["boundary_identical"]] == [4, 5, 6, 10, 14, 18, 22, 24], rank
    assert "keeps the checkpoint's schedule" in log
    assert (summary(log)["warmup_local_steps"], summary(log)["warmup_iters"]) == (1, 6)


def test_auto_local_steps_follows_the_link_and_resumes_exactly(tmp_path):
    """``--diloco-x-local-steps auto`` on Megatron (partial, int4; no warm-up): the first round has
    H 30; at its boundary every rank, with a link that takes far longer than any round
    (``--diloco-x-bandwidth-mbps 0.001``), proposes the upper bound, 300, so the next boundary is the
    run's end (70, a shorter last round) instead of 60, with the replicas bit-identical there and the
    summary reporting ``auto`` and the H it ended with. A checkpoint saved mid-round (45, the
    exchange in flight) resumes with the checkpoint's H and its anchor: the same losses, bit for bit.
    Without the bandwidth flag (H from measured exchanges, over loopback) every proposal is 30: the
    losses of a fixed H 30, bit for bit."""
    base = ["--train-iters", "70", "--diloco-x-local-steps", "auto", "--diloco-x-compression", "int4",
            "--diloco-x-bandwidth-mbps", "0.001", "--save-interval", "1000", "--no-load-rng", *MEGATRON_DEFAULTS]
    full, log = run_megatron(tmp_path, base)
    for rank, rec in enumerate(full):
        assert [s for s, _ in rec["boundary_identical"]] == [30, 70], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
    assert_final_params_identical(full)
    s = summary(log)
    assert (s["local_steps"], s["last_local_steps"], s["rounds"]) == ("auto", 300, 2) and s["replicas_identical"]
    ckpt = str(tmp_path / "ckpt")
    leg1, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "45"])
    leg2, log2 = run_megatron(tmp_path, base + ["--load", ckpt])
    assert "auto H resumes with the checkpoint's H 300" in log2
    want = losses(full)
    assert {r: {**losses(leg1)[r], **losses(leg2)[r]} for r in want} == want
    assert summary(log2)["last_local_steps"] == 300
    # as a user runs it, no bandwidth flag: H from the measured exchanges, which loopback finishes within a
    # few steps, so every proposal is the lower bound and auto trains as a fixed H 30, bit for bit (tau fixed
    # at 3 on both, so that measured step times do not enter)
    fast = ["--train-iters", "40", "--diloco-x-compression", "int4", "--diloco-x-overlap-steps", "3",
            "--no-load-rng", *MEGATRON_DEFAULTS]
    auto, log = run_megatron(tmp_path, fast + ["--diloco-x-local-steps", "auto"])
    fixed, _ = run_megatron(tmp_path, fast + ["--diloco-x-local-steps", "30"])
    assert [s for s, _ in auto[0]["boundary_identical"]] == [30, 40] and summary(log)["last_local_steps"] == 30
    assert losses(auto) == losses(fixed)


# (a blockwise residual with delayed / eager: test_host_outer_state_trains_alike_and_checkpoints_across_layouts)
@pytest.mark.parametrize("codec,overlap", [("none", "delayed"), ("lowrank-int8", "delayed"),
                                           ("adaptive", "delayed"), ("int4", "partial")],
                         ids=["none", "lowrank-int8", "adaptive", "partial-int4"])
def test_checkpoint_resume_is_exact(tmp_path, codec, overlap):
    """Save mid-round (exchange in flight) and at a boundary, resume: the loss trajectory of the
    uninterrupted run, bit for bit, on every replica (with a lossy codec: error-feedback residuals
    too; low-rank: the shared warm-start bases; adaptive: its plan and when it was evaluated, which
    a resumed run must reuse rather than re-evaluate at its first boundary; partial, the default
    overlap: the launch point x_L and when the pending exchange lands).

    16 iterations, H = 4: the codec state saved at iterations 6 and 8 feeds the exchange launched at
    boundary 8, which the delay applies at boundary 12, so it shows in the losses of 13-16. partial
    with tau 3 (a fixed tau: auto follows measured times) lands its exchanges at 7, 11, 15: both
    saves (6, 8) hold one in flight."""
    base = ["--train-iters", "16", "--diloco-x-local-steps", "4", "--diloco-x-overlap", overlap,
            "--diloco-x-compression", codec,
            *(["--diloco-x-overlap-steps", "3"] if overlap == "partial" else []),
            "--diloco-x-outer-lr", "0.7", "--diloco-x-outer-momentum", "0.9",  # momentum state too
            "--save-interval", "1000", "--no-load-rng"]
    if codec == "adaptive":  # a fixed, non-binding byte budget: the plan must not depend on timing
        base += ["--diloco-x-bandwidth-mbps", "1e6"]
    full, log = run_megatron(tmp_path, base)
    ckpt = str(tmp_path / "ckpt")
    leg1, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "6"])  # mid-round 2
    leg2, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--load", ckpt, "--exit-interval", "8"])  # boundary
    leg3, log3 = run_megatron(tmp_path, base + ["--load", ckpt])
    # Every rank restores exactly the fp32 shards it saved (replicas differ mid-round).
    for r in range(4):
        assert leg2[r]["loaded_fp"] == leg1[r]["main_fp"][-1], r
        assert leg3[r]["loaded_fp"] == leg2[r]["main_fp"][-1], r
    want = losses(full)
    got = {r: {**losses(leg1)[r], **losses(leg2)[r], **losses(leg3)[r]} for r in want}
    assert sorted(losses(leg1)[1]) == list(range(1, 7))
    assert sorted(losses(leg2)[1]) == [7, 8]
    assert sorted(losses(leg3)[1]) == list(range(9, 17))
    assert got == want  # exact float equality, every iteration, both replicas
    assert summary(log3)["replicas_identical"] and summary(log3)["rounds"] == 4
    assert summary(log3)["final_loss"] == summary(log)["final_loss"]
    if overlap == "partial":  # each round reports the exchange that landed in it (tau steps after its launch)
        rounds = re.findall(r"\[DiLoCoX\] round +(\d+) \| step +\d+ \| (\w+)(?: \| sent ([\d.]+) MB)?", log)
        assert [(int(r), a) for r, a, _ in rounds] == [(1, "no"), (2, "applied"), (3, "applied"),
                                                        (4, "applied")], rounds  # no: none applied in round 1
        assert all(float(mb) > 0 for _, _, mb in rounds[1:]), rounds
    if codec == "int8":  # 1 byte + 4/256 bytes of scale per element, padded: 3.9x fewer bytes than fp32
        assert 3.8 < summary(log3)["compression_ratio"] < 4.0
    if codec in ("lowrank-int8", "adaptive"):  # matrices sent as factors: well above int8's ratio
        assert summary(log3)["compression_ratio"] > 4.5
    if codec == "adaptive":  # the plan's INFO line reaches the user at Megatron's default log level
        assert "adaptive compression: ranks" in log


def test_host_outer_state_trains_alike_and_checkpoints_across_layouts(tmp_path):
    """``--diloco-x-outer-state host`` (chunks of 2560 elements: several per rank's shard) trains to the
    same losses as the device layout, bit for bit, and a checkpoint saved mid-round (exchange in
    flight; eager anchor, int8 residual, momentum) with either layout resumes in the other exactly."""
    base = ["--train-iters", "12", "--diloco-x-local-steps", "4", "--diloco-x-overlap", "eager",
            "--diloco-x-compression", "int8", "--diloco-x-outer-momentum", "0.9", "--save-interval", "1000",
            "--no-load-rng", "--diloco-x-outer-chunk-mb", "0.01"]
    gpu, log = run_megatron(tmp_path, base + ["--diloco-x-outer-state", "device"])
    cpu, log_cpu = run_megatron(tmp_path, base + ["--diloco-x-outer-state", "host"])
    assert "outer_state='host', outer_chunk_mb=0.01" in log_cpu  # the config install() printed
    want = losses(gpu)
    assert losses(cpu) == want and sorted(want[1]) == list(range(1, 13))
    assert summary(log_cpu)["replicas_identical"] and summary(log_cpu)["final_loss"] == summary(log)["final_loss"]
    for saved, resumed in (("device", "host"), ("host", "device")):
        ckpt = str(tmp_path / f"ckpt-{saved}")
        run_megatron(tmp_path, base + ["--diloco-x-outer-state", saved, "--save", ckpt, "--exit-interval", "6"])
        leg2, log2 = run_megatron(tmp_path, base + ["--diloco-x-outer-state", resumed, "--load", ckpt])
        got = losses(leg2)
        assert sorted(got[1]) == list(range(7, 13)), (saved, resumed)
        for r in want:
            assert {it: want[r][it] for it in got[r]} == got[r], (saved, resumed, r)
        assert summary(log2)["replicas_identical"], (saved, resumed)


def test_host_outer_state_all_reduces_none_on_the_host(tmp_path):
    """``none`` with ``--diloco-x-outer-state host`` in one world of 2 replicas: the all-reduce buffer
    is held in host memory with the outer state (no device payload) and the collective runs on it in
    place, over the outer group's gloo mirror (on GPUs the outer group is NCCL; the mirror is what
    lets the buffer leave the device there); the default overlap (partial, tau fixed at 2 so that
    both runs land alike) trains to the device layout's losses bit for bit."""
    base = ["--train-iters", "8", "--diloco-x-local-steps", "4", "--diloco-x-compression", "none",
            "--diloco-x-overlap-steps", "2", "--diloco-x-outer-chunk-mb", "0.01"]
    # the names before device / host, still accepted: gpu = device, cpu = host
    gpu, _ = run_megatron(tmp_path, base + ["--diloco-x-outer-state", "gpu"])
    cpu, log = run_megatron(tmp_path, base + ["--diloco-x-outer-state", "cpu"])
    assert "outer_state='host'" in log
    assert [r["outer"]["delta_held"] for r in gpu] == [False] * 4
    assert [r["outer"]["delta_held"] for r in cpu] == [True] * 4
    assert [r["outer"]["exchange_on_mirror"] for r in gpu] == [False] * 4
    assert [r["outer"]["exchange_on_mirror"] for r in cpu] == [True] * 4
    assert losses(cpu) == losses(gpu) and summary(log)["rounds"] == 2


def test_outer_state_is_sharded_like_the_distributed_optimizer(tmp_path):
    """PP 1, 2 replicas x intra-replica DP 2 on 4 ranks: each rank's outer state (theta, momentum) is
    fp32 and covers exactly its inner optimizer's main shard, half of the model. The run gives
    ``--load`` of an empty directory with ``--no-load-optim`` (a first start of an auto-resuming job):
    nothing was loaded, so the outer loop does not restart."""
    empty = tmp_path / "no-checkpoint-yet"
    empty.mkdir()
    recs, log = run_megatron(tmp_path, ["--pipeline-model-parallel-size", "1", "--train-iters", "4",
                                        "--diloco-x-local-steps", "2", "--diloco-x-outer-momentum", "0.9",
                                        "--load", str(empty), "--no-load-optim"])
    assert "outer loop restarted" not in log
    total = recs[0]["outer"]["model_params_on_rank"]
    for rank, rec in enumerate(recs):
        o = rec["outer"]
        assert o["theta_dtype"] == "torch.float32"
        assert o["theta_numel"] == o["momentum_numel"] == o["main_shard_numel"], (rank, o)
        assert o["model_params_on_rank"] == total
        assert all(ok for _, ok in rec["boundary_identical"]), rank
        assert traffic_between_boundaries(rec) == [], rank
    # ranks {0,1} form replica 0, {2,3} replica 1; inside a replica the shards partition the model
    for replica in ((0, 1), (2, 3)):
        assert sum(recs[r]["outer"]["theta_numel"] for r in replica) == total
    assert recs[0]["outer"]["theta_numel"] == recs[2]["outer"]["theta_numel"]  # outer-group peers
    assert summary(log)["replicas_identical"]


def test_three_d_layout_tp2_pp2_two_replicas(tmp_path):
    """The layout of issue 5 on 8 gloo ranks: 2 replicas x TP 2 x PP 2, int8 exchange. Replicas are
    contiguous blocks of 4 ranks, bit-identical after every boundary, nothing crosses them between
    boundaries, and each rank's outer state covers exactly its own distributed-optimizer shard."""
    recs, log = run_megatron(tmp_path, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                        "--train-iters", "8", "--diloco-x-local-steps", "4",
                                        "--diloco-x-compression", "int8", "--diloco-x-outer-momentum", "0.9"],
                             nproc=8, timeout=600)
    for rank, rec in enumerate(recs):
        assert rec["boundary_identical"] == [[4, True], [8, True]], (rank, rec["boundary_identical"])
        assert traffic_between_boundaries(rec) == [], rank
        o = rec["outer"]
        assert o["theta_numel"] == o["main_shard_numel"] == o["momentum_numel"] > 0, (rank, o)
    # replica 1 (ranks 4-7) mirrors replica 0 (ranks 0-3) rank for rank (same shard sizes)
    for r in range(4):
        assert recs[r]["outer"] == recs[r + 4]["outer"], r
    assert sorted(losses(recs)) == [2, 3, 6, 7]  # the last pipeline stage of each replica (both TP ranks)
    s = summary(log)
    assert s["replicas_identical"] and s["rounds"] == 2 and s["compression"] == "int8"


def test_interleaved_pipeline_resumes_exactly(tmp_path):
    """Megatron's interleaved pipeline schedule (``--num-layers-per-virtual-pipeline-stage``, as
    production recipes run PP) at the defaults and Megatron's default checkpoint format: 2 replicas x
    PP 2 x 2 model chunks per stage. Each rank's outer state covers both chunks' shard, the replicas'
    shared outer state (theta, m) is bit-identical after every boundary and their params at the end,
    nothing crosses them between boundaries, and a torch_dist
    resume mid-round reproduces the uninterrupted run bit for bit. The auto warm-up stays on (H0 = 1 for
    the first 6 steps, then rounds of 4, the last one shorter)."""
    base = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--train-iters", "12", "--diloco-x-local-steps", "4", "--save-interval", "1000", "--no-load-rng"]
    full, log = run_megatron(tmp_path, base, warmup=True)
    for rank, rec in enumerate(full):
        assert rec["boundary_identical"] == [[s, True] for s in (1, 2, 3, 4, 5, 6, 10, 12)], (rank, rec["boundary_identical"])
        assert traffic_between_boundaries(rec) == [], rank
        o = rec["outer"]
        # one DP rank per replica stage: the shard is every parameter of the rank's two chunks
        assert o["model_chunks"] == 2, (rank, o)
        assert o["theta_numel"] == o["main_shard_numel"] == o["model_params_on_rank"] > 0, (rank, o)
    assert full[0]["outer"] == full[2]["outer"] and full[1]["outer"] == full[3]["outer"]
    assert_final_params_identical(full)
    s = summary(log)
    assert s["replicas_identical"] and s["rounds"] == 8 and s["final_loss"] < s["first_loss"]
    ckpt = str(tmp_path / "ckpt")
    run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "8"], warmup=True)  # mid-round (6..10)
    leg2, log2 = run_megatron(tmp_path, base + ["--save", ckpt, "--load", ckpt], warmup=True)
    want, got = losses(full), losses(leg2)
    assert sorted(got) == [1, 3]  # the last pipeline stage of each replica
    for r in want:
        assert {it: want[r][it] for it in got[r]} == got[r] and sorted(got[r]) == list(range(9, 13)), r
    assert summary(log2)["final_loss"] == s["final_loss"] and summary(log2)["replicas_identical"]


@pytest.mark.parametrize("precision,how", [([], ["--no-load-optim"]), (["--bf16"], ["--finetune"])],
                         ids=["fp32-no-load-optim", "bf16-finetune"])
def test_starts_from_loaded_weights(tmp_path, precision, how):
    """Continued pretraining: a plain Megatron checkpoint loaded without its optimizer state. The
    outer loop must start from the loaded weights: after the first boundaries the loss stays at the
    loaded model's, not back at the random init's (old code: theta kept the init, x <- theta)."""
    ckpt = str(tmp_path / "plain")
    plain, _ = run_megatron(tmp_path, ["--no-diloco-x", "--train-iters", "30", "--save", ckpt,
                                       "--save-interval", "30", "--lr", "3e-3", *precision])
    trained = losses(plain)
    rank = sorted(trained)[0]
    init_loss, loaded_loss = trained[rank][1], trained[rank][30]
    assert init_loss - loaded_loss > 1.0  # the gap the test relies on
    iters = ["--train-iters", "38"] if "--no-load-optim" in how else ["--train-iters", "8"]
    dx, log = run_megatron(tmp_path, ["--load", ckpt, *how, "--no-load-rng", *iters, "--lr", "3e-4",
                                      "--diloco-x-local-steps", "4", "--diloco-x-overlap", "delayed",
                                      *precision])
    assert "outer loop restarted" in log
    assert [rec["refused_attrs"] for rec in dx] == [[]] * 4  # (reload_model_params: forwarded)
    # (the message is printed by the fix: on the old code the test fails on it or on the losses)
    for r, by_iter in losses(dx).items():
        its = sorted(by_iter)
        assert len(its) == 8, (r, its)
        after = [by_iter[it] for it in its[4:]]  # after the first boundary (per-batch noise ~0.5)
        assert sum(after) / len(after) < (init_loss + loaded_loss) / 2, (r, by_iter, loaded_loss, init_loss)
    assert summary(log)["replicas_identical"]


@pytest.mark.parametrize("overlap", ["delayed", "partial"])
def test_boundary_gathers_the_params_once(tmp_path, overlap):
    """Intra-replica DP 2, no --overlap-param-gather: a step that ends with outer work (a boundary,
    partial's landing) all-gathers the params once, as an inner step does. The inner step's own
    gather is deferred (the outer work changes the params it would gather)."""
    flags = ["--pipeline-model-parallel-size", "1", "--train-iters", "8", "--diloco-x-local-steps", "4",
             "--diloco-x-overlap", overlap, *(["--diloco-x-overlap-steps", "2"] if overlap == "partial" else [])]
    recs, log = run_megatron(tmp_path, flags)
    for rank, rec in enumerate(recs):
        gathers = {int(it): n for it, n in rec["replica_gathers"].items() if int(it) > 0}
        assert sorted(gathers) == list(range(1, 9)), (rank, gathers)
        assert len(set(gathers.values())) == 1, (rank, gathers)  # boundary / landing steps included
        assert [s for s, _ in rec["boundary_identical"]] == [4, 8] and all(ok for _, ok in rec["boundary_identical"])
    assert summary(log)["replicas_identical"]


OVERLAP_FLAGS = {
    # intra-replica DP 2 (PP 1, 2 replicas on 4 ranks): the param all-gather is real
    "grad-param-dp2": (4, ["--pipeline-model-parallel-size", "1", "--overlap-grad-reduce",
                           "--overlap-param-gather", "--bf16"]),
    # interleaved pipeline (PP 2 x virtual 2) x DP 2 per replica on 8 ranks: the first model chunk's
    # all-gather is dispatched inside the optimizer step, before the outer step writes the params.
    # Megatron 0.19 refuses this flag with distributed checkpointing (its arguments.py), and DiLoCoX
    # checkpoints only in torch_dist: no resume leg here.
    "optimizer-step-vpp2-dp2": (8, ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--overlap-grad-reduce", "--overlap-param-gather",
                                    "--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch",
                                    "--global-batch-size", "16",  # 2 micro-batches per PP rank
                                    "--bf16"]),
}


@pytest.mark.parametrize("nproc,flags", list(OVERLAP_FLAGS.values()), ids=list(OVERLAP_FLAGS))
def test_production_overlap_flags(tmp_path, nproc, flags):
    """Megatron's overlapped gradient reduce-scatter and parameter all-gather: replicas bit-identical
    after every boundary, the final model params identical (the end-of-training drain gathers them
    although Megatron's forward hooks are off then), and a resume mid-round reproduces the
    uninterrupted run exactly."""
    base = ["--train-iters", "12", "--diloco-x-local-steps", "4", "--diloco-x-overlap", "delayed",
            "--diloco-x-outer-momentum", "0.9", "--save-interval", "1000", "--no-load-rng", *flags]
    full, log = run_megatron(tmp_path, base, nproc=nproc, timeout=900)
    for rank, rec in enumerate(full):
        assert rec["boundary_identical"] == [[4, True], [8, True], [12, True]], (rank, rec["boundary_identical"])
        assert rec["refused_attrs"] == [], rank  # nothing read outside forwarding.FORWARDED
    assert summary(log)["replicas_identical"]
    if "--overlap-param-gather-with-optimizer-step" in flags:
        return
    ckpt = str(tmp_path / "ckpt")
    run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "6"], nproc=nproc, timeout=900)
    leg2, log2 = run_megatron(tmp_path, base + ["--save", ckpt, "--load", ckpt], nproc=nproc, timeout=900)
    want = losses(full)
    got = losses(leg2)
    for r in want:
        assert {it: want[r][it] for it in got[r]} == got[r], r  # iterations 7-12, bit for bit
    assert summary(log2)["final_loss"] == summary(log)["final_loss"] and summary(log2)["replicas_identical"]


def test_replicas_starting_from_different_weights_are_stopped(tmp_path):
    """A replica whose start weights differ (another checkpoint, another seed) is caught at the first
    boundary, before anything is exchanged, with an error naming the cause."""
    _, log = run_megatron(tmp_path, ["--train-iters", "4", "--diloco-x-local-steps", "2"],
                          env={"DILOCO_TEST_PERTURB_REPLICA": "1"}, expect_fail=True)
    assert "did not start from the same weights" in log
    assert "[DiLoCoX] round" not in log


def test_forked_ranks_run_as_torchrun_ranks(tmp_path):
    """The test launcher (ranks forked from harness/zygote.py) is faithful to torchrun: the same job
    started by torchrun itself gives the same records, bit for bit (losses, main-shard fingerprints
    after every step, boundary checks, cross-replica traffic)."""
    import json

    from harness.launch import RUNNER, TINY, torchrun
    from harness.runner import harness_args

    args = ["--train-iters", "6", "--diloco-x-local-steps", "2", "--diloco-x-compression", "int8"]
    forked, _ = run_megatron(tmp_path, args)
    out = tmp_path / "torchrun"
    out.mkdir()
    code, log = torchrun([RUNNER, *harness_args(out), *TINY, *args])
    assert code == 0, log[-6000:]
    started = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for key in ("losses", "main_fp", "boundary_identical", "cross_replica"):
        assert [rec.get(key) for rec in forked] == [rec.get(key) for rec in started], key
    assert losses(forked)[1]  # the comparison covered a logged loss


@pytest.mark.parametrize("overlap", ["partial", "none"])
def test_run_ending_mid_round_ends_with_one_model(tmp_path, overlap):
    """Megatron's and the package's defaults (partial: auto tau, the auto warm-up) with H = 4 over 10
    iterations: the run ends after the last boundary's exchange has landed, mid-round. The end of
    training takes one more, shorter round (a boundary at 10) and applies it, so every replica ends
    with the same model: the fp32 main params and the model params, compared rank by rank across
    replicas (not the outer state), and the summary says so, counts the last round, and carries the
    final parameters' fingerprint (the digest of replica 0's ranks' shards)."""
    from megatron_diloco.summary import params_digest
    from tests.megatron_utils import assert_final_params_identical

    recs, log = run_megatron(tmp_path, ["--train-iters", "10", "--diloco-x-local-steps", "4",
                                        "--diloco-x-overlap", overlap, *MEGATRON_DEFAULTS], warmup=True)
    assert_final_params_identical(recs)
    s = summary(log)
    for rank, rec in enumerate(recs):
        steps = [b for b, _ in rec["boundary_identical"]]
        assert steps[-1] == 10 and steps[-2] < 10 and len(steps) == s["rounds"], (rank, steps)
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
    assert s["replicas_identical"] and s["iterations"] == 10
    assert s["final_params_fingerprint"] == params_digest([r["final_fp"]["main"] for r in recs[:2]])
    assert s["final_loss"] < s["first_loss"]
