"""The eager one-step-delay variant inside real Megatron pretraining: PP 2 x 2 replicas, 4 gloo ranks."""

from __future__ import annotations

import pytest

from tests.megatron_utils import (assert_final_params_identical, losses, run_megatron, summary,
                                  traffic_between_boundaries)

pytestmark = pytest.mark.megatron


def test_eager_shared_state_traffic_and_exact_resume(tmp_path):
    """``--diloco-x-overlap eager``: the shared outer state (theta, m; the params differ by design by
    each replica's look-ahead) is bit-identical after every boundary, nothing crosses replicas outside
    boundaries, the params are identical after the final drain (compared rank by rank), and
    a run saved mid-round (exchange in flight, each replica at its own look-ahead start point) and at a
    boundary resumes to the uninterrupted trajectory bit for bit on both replicas."""
    base = ["--train-iters", "12", "--diloco-x-local-steps", "4", "--diloco-x-overlap", "eager",
            "--diloco-x-compression", "int8", "--diloco-x-outer-lr", "0.7",
            "--diloco-x-outer-momentum", "0.9", "--save-interval", "1000", "--no-load-rng"]
    full, log = run_megatron(tmp_path, base)
    for rank, rec in enumerate(full):
        assert [s for s, _ in rec["boundary_identical"]] == [4, 8, 12], rank
        assert all(ok for _, ok in rec["boundary_identical"]), (rank, rec["boundary_identical"])
        assert traffic_between_boundaries(rec) == [], rank
    assert_final_params_identical(full)
    s = summary(log)
    assert s["replicas_identical"] and s["rounds"] == 3 and s["overlap"] == "eager"
    # the look-ahead makes the replicas start round 2 from different points: their losses differ
    want = losses(full)
    assert want[1][5] != want[3][5]

    ckpt = str(tmp_path / "ckpt")
    leg1, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "6"])  # mid-round 2
    leg2, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--load", ckpt, "--exit-interval", "8"])
    leg3, log3 = run_megatron(tmp_path, base + ["--load", ckpt])
    for r in range(4):
        assert leg2[r]["loaded_fp"] == leg1[r]["main_fp"][-1], r
        assert leg3[r]["loaded_fp"] == leg2[r]["main_fp"][-1], r
    got = {r: {**losses(leg1)[r], **losses(leg2)[r], **losses(leg3)[r]} for r in want}
    assert got == want  # exact float equality, every iteration, both replicas
    assert summary(log3)["replicas_identical"]
    assert summary(log3)["final_loss"] == s["final_loss"]
