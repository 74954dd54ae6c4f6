"""DiLoCoX checkpoints inside real Megatron pretraining (torch_dist, CPU gloo ranks).

* the per-replica and outer state are ShardedTensors over the live buffers (no clone, no pickle);
* fp16: each replica's grad scaler and step counts follow its own overflow history, and resume
  restores them (bit-identical losses on every replica);
* a plain Megatron checkpoint (``--no-diloco-x``) loads into a DiLoCoX run (the outer loop restarts
  from its weights), and a DiLoCoX checkpoint loads into a plain run (which resumes from replica 0).

The runs go through the harness with the tests' ``checkpoint`` and ``training`` recorders
(``harness/recorders/checkpoint.py``: grad-scaler, model-fingerprint and save records on top of the training ones).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.megatron_utils import CHECKPOINT, losses, run_megatron, summary

pytestmark = pytest.mark.megatron


def run_ckpt(tmp: Path, args: list[str], nproc: int = 4, timeout: int = 600) -> tuple[list[dict], str]:
    """Run the example under the harness with the checkpoint and training recorders on ``nproc``
    ranks; return (per-rank records, output)."""
    return run_megatron(tmp, args, nproc, timeout=timeout, recorders=CHECKPOINT)


def _metadata(ckpt_dir: Path) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {k: (tuple(v.global_shape), str(v.dtype)) if isinstance(v, ShardedTensor) else "object"
            for k, v in load_sharded_metadata(str(ckpt_dir)).items()}


def test_checkpoint_state_is_sharded_tensors_over_live_buffers(tmp_path):
    """Mid-round save (exchange in flight) with int8 error feedback, eager look-ahead and outer
    momentum: every per-replica and outer tensor is a ShardedTensor that aliases the live buffer
    (nothing cloned or pickled), keyed as documented in ``DiLoCoXOptimizer``'s checkpoint section:
    outer state (T,) once, per-replica state (R, T) one row per replica; the ShardedObjects hold only
    small metadata."""
    ckpt = tmp_path / "ckpt"
    recs, _ = run_ckpt(tmp_path, ["--train-iters", "8", "--diloco-x-local-steps", "4", "--diloco-x-overlap",
                                  "eager", "--diloco-x-compression", "int8", "--diloco-x-outer-momentum", "0.9",
                                  "--save", str(ckpt), "--save-interval", "1000", "--exit-interval", "6"])
    total = sum(recs[r]["outer"]["main_shard_numel"] for r in (0, 1))  # replica 0's ranks (PP 2)
    assert total == sum(recs[r]["outer"]["main_shard_numel"] for r in (2, 3))
    for rank, rec in enumerate(recs):
        (entry,) = rec["save_entries"]
        n = entry["shard_numel"]
        # theta, momentum, pending; per main shard: param, exp_avg, exp_avg_sq; residual, anchor
        assert entry["tensors"] == entry["aliased"] > 6, (rank, entry)
        assert entry["tensor_bytes"] == 4 * n * 8, (rank, entry)  # 3 outer + 5 per-replica fp32 vectors
        assert max(entry["object_bytes"]) < 20_000 < 4 * n, (rank, entry)  # metadata only
    meta = _metadata(ckpt / "iter_0000006")
    for name in ("theta", "momentum_buffer", "pending_delta"):
        assert meta[f"diloco_x.outer.{name}"] == ((total,), "torch.float32"), name
    for kind in ("param", "opt.exp_avg", "opt.exp_avg_sq", "residual", "anchor"):
        assert meta[f"diloco_x.replica.{kind}"] == ((2, total), "torch.float32"), kind
    objects = sorted(k for k, v in meta.items() if k.startswith("diloco_x") and v == "object")
    assert objects == [f"diloco_x.{name}.meta/shard_{i}_2" for name in ("outer", "replica0", "replica1")
                       for i in (0, 1)]
    assert all(rec["save_memory"][0]["peak_delta"] is not None for rec in recs)


FP16 = ["--pipeline-model-parallel-size", "1", "--fp16", "--initial-loss-scale", "262144",
        "--loss-scale-window", "2", "--hysteresis", "1", "--lr", "0.01", "--train-iters", "16",
        "--diloco-x-local-steps", "4", "--diloco-x-outer-momentum", "0.9", "--save-interval", "1000",
        "--no-load-rng"]


@pytest.mark.parametrize("schedule", [
    pytest.param(["--lr-decay-style", "constant", "--lr-warmup-iters", "0"], id="constant-lr"),
    # Megatron advances the LR schedule on successful fp16 steps only: per replica, checkpointed
    # through DiLoCoXOptimizer.attach_lr_scheduler (install() hands it the scheduler; restart.LRSchedulePosition)
    pytest.param([], id="warmup-linear-decay"),
])
def test_fp16_grad_scaler_and_steps_resume_per_replica(tmp_path, schedule):
    """fp16 with dynamic loss scaling, 2 replicas x intra-replica DP 2 (PP 1, 4 ranks): each replica's
    grad scaler (scale, growth tracker), Adam step count and - with a step-dependent LR - LR-schedule
    position follow its own overflow history; a run saved mid-round at iteration 6, where the
    replicas' scalers differ, resumes bit-identically on every rank (losses, scaler states, step
    counts) - Megatron's own checkpoint keeps one scaler and one schedule (replica 0's)."""
    args = FP16 + schedule
    full, log = run_ckpt(tmp_path, args)
    scaler = {r: {it: s for it, *s in full[r]["scaler"]} for r in range(4)}
    assert scaler[0] == scaler[1] and scaler[2] == scaler[3]  # one scaler state per replica
    assert scaler[0][6] != scaler[2][6], "test premise: the replicas' scalers differ at the save"
    steps = {r: dict(full[r]["adam_step"]) for r in range(4)}
    assert steps[0][6] != steps[2][6], "test premise: the replicas skipped different numbers of steps"
    ckpt = str(tmp_path / "ckpt")
    leg1, _ = run_ckpt(tmp_path, args + ["--save", ckpt, "--exit-interval", "6"])
    leg2, log2 = run_ckpt(tmp_path, args + ["--load", ckpt])
    want = losses(full)
    assert sorted(want) == [0, 1, 2, 3]
    got = {r: {**losses(leg1)[r], **losses(leg2)[r]} for r in want}
    assert sorted(losses(leg2)[0]) == list(range(7, 17))
    for r in range(4):
        assert [s for s in full[r]["scaler"] if s[0] > 6] == leg2[r]["scaler"], r
        assert [s for s in full[r]["adam_step"] if s[0] > 6] == leg2[r]["adam_step"], r
    assert got == want  # exact float equality, every iteration, every rank of both replicas
    assert summary(log2)["final_loss"] == summary(log)["final_loss"]
    # Megatron's training loop, save and load read nothing from the optimizer outside forwarding.FORWARDED
    assert [rec["refused_attrs"] for rec in full + leg1 + leg2] == [[]] * 12


def test_plain_megatron_checkpoint_starts_the_outer_loop(tmp_path):
    """``--load`` of a checkpoint written by a plain Megatron run (``--no-diloco-x``, same ranks and
    layout): Megatron's inner optimizer state is loaded by every replica (resharded from full DP to
    one instance per replica) and the outer loop starts from the loaded weights.

    Checks: the restart is logged; the replicas' first losses (same weights, each replica's half of the
    batch) average to the plain run's own loss at that iteration, i.e. model *and* optimizer state
    were loaded; after the first boundary (x <- theta) the loss stays at the trained level instead of
    falling back to the random init's (the plain run's own first iterations: a fresh init)."""
    common = ["--train-iters", "40", "--lr", "3e-3", "--no-load-rng"]
    ckpt = str(tmp_path / "ckpt")
    plain, _ = run_ckpt(tmp_path, common + ["--no-diloco-x", "--save", ckpt, "--save-interval", "30"])
    # the plain run also saved at its end (40): --ckpt-step picks iteration 30
    dx, log = run_ckpt(tmp_path, common + ["--load", ckpt, "--ckpt-step", "30", "--diloco-x-local-steps", "4",
                                           "--diloco-x-outer-momentum", "0.9"])
    assert "outer loop restarted from the current params" in log and "holds no DiLoCoX state" in log
    assert all(len(rec["restart"]) == 1 for rec in dx)
    lp, ld = losses(plain), losses(dx)
    p = lp[sorted(lp)[0]]  # plain: the global mean loss (every last-stage rank logs the same)
    assert sorted(ld) == [1, 3] and sorted(ld[1]) == list(range(31, 41))
    assert math.isclose((ld[1][31] + ld[3][31]) / 2, p[31], rel_tol=1e-4), (ld[1][31], ld[3][31], p[31])
    # after the first boundary (34; rounds restart at the load): a theta left at the random init would
    # put the replicas back there (x <- theta), ~2.5 nats above the trained level; per-iteration losses
    # of half a batch are noisy (+-0.5), so compare means over 35-40 with the plain run's
    init = p[1]
    after = [it for it in range(35, 41)]
    trained = sum(p[it] for it in after) / len(after)
    dx_mean = sum(ld[r][it] for r in (1, 3) for it in after) / (2 * len(after))
    assert init - trained > 1.5, (init, trained)  # the plain run learned something unmistakable
    assert abs(dx_mean - trained) < 0.1 * (init - trained), (dx_mean, trained, init)
    # boundaries counted from the load (4, 8); the run ends 2 steps into a round: a last one at 10
    assert [s for s, _ in dx[0]["boundary_identical"]] == [4, 8, 10]
    assert all(ok for rec in dx for _, ok in rec["boundary_identical"])
    assert summary(log)["replicas_identical"] and summary(log)["rounds"] == 3


def test_diloco_checkpoint_loads_into_plain_megatron(tmp_path):
    """A DiLoCoX checkpoint saved mid-round (replicas differ; an exchange in flight) loads into a
    plain Megatron run (``--no-diloco-x``), which resumes from replica 0's local state: its model
    parameters right after the load are bit-identical to replica 0's at the save (not replica 1's,
    not a per-shard mix), and it trains on from the checkpointed loss level, not the init's."""
    common = ["--train-iters", "24", "--lr", "3e-3", "--no-load-rng"]
    ckpt = str(tmp_path / "ckpt")
    # saves at 20 (mid-round 3, the exchange launched at 16 in flight) and at the end (24)
    dx, _ = run_ckpt(tmp_path, common + ["--diloco-x-local-steps", "8", "--diloco-x-outer-momentum", "0.9",
                                         "--save", ckpt, "--save-interval", "20"])
    fp = {r: dict((it, tuple(f)) for it, f in rec["model_fp"]) for r, rec in enumerate(dx)}
    assert fp[0][20] != fp[2][20] and fp[1][20] != fp[3][20], "test premise: replicas differ mid-round"
    plain, log = run_ckpt(tmp_path, common + ["--no-diloco-x", "--load", ckpt, "--ckpt-step", "20"])
    lp, ld = losses(plain), losses(dx)
    assert sorted(ld) == [1, 3]  # DiLoCoX (tp-pp-dp mapping): replica 0 = ranks 0 (stage 0), 1 (stage 1)
    for rank in range(4):  # plain (Megatron's default order): the last stage's ranks log the loss
        stage = 1 if rank in lp else 0
        assert tuple(plain[rank]["loaded_model_fp"]) == fp[stage][20], rank  # replica 0's rank of that stage
    p = lp[sorted(lp)[0]]
    assert sorted(p) == [21, 22, 23, 24]
    # level: the plain run's losses 21-24 against the DiLoCoX run's own continuation (both replicas),
    # far from the init's (noisy per-iteration losses: compare means)
    init = (ld[1][1] + ld[3][1]) / 2
    dx_mean = sum(ld[r][it] for r in (1, 3) for it in range(21, 25)) / 8
    plain_mean = sum(p[it] for it in range(21, 25)) / 4
    assert init - dx_mean > 1.0, (init, dx_mean)
    assert abs(plain_mean - dx_mean) < 0.2 * (init - dx_mean), (plain_mean, dx_mean, init)
    assert "outer loop restarted" not in log


def test_resume_keeps_each_replicas_timings(tmp_path):
    """Auto tau is agreed by MAX over every rank's own timings (step time, last exchange, longest
    exchange); a resume must give each rank its own again, not replica 0's on every replica. Save at
    6 (the default partial overlap, auto tau: an exchange in flight, completed by the save) and resume:
    every rank loads exactly the timings it saved."""
    ckpt = str(tmp_path / "ckpt")
    base = ["--train-iters", "8", "--diloco-x-local-steps", "4", "--save-interval", "1000", "--no-load-rng"]
    leg1, _ = run_megatron(tmp_path, base + ["--save", ckpt, "--exit-interval", "6"], recorders=CHECKPOINT)
    leg2, _ = run_megatron(tmp_path, base + ["--load", ckpt], recorders=CHECKPOINT)
    saved = [rec["timings_saved"][-1] for rec in leg1]
    assert all(step == 6 for step, _ in saved), saved
    assert saved[0][1] != saved[2][1], saved  # the replicas' own measurements differ (rank 0 vs rank 2)
    for rank, rec in enumerate(leg2):
        assert rec["timings_loaded"] == saved[rank], (rank, rec["timings_loaded"], saved[rank])


def test_restart_mid_run_starts_a_fresh_outer_loop(tmp_path):
    """``restart_outer_loop_from_params`` after step 8 of 16 (delayed, H 4: the exchange launched at 8
    is waited for and dropped): a fresh outer loop, its first boundary checks the start weights again
    and launches without applying, its counters (rounds, bytes) are the new loop's only: the same
    bytes as an 8-step run's."""
    base = ["--diloco-x-local-steps", "4", "--diloco-x-overlap", "delayed"]
    recs, log = run_megatron(tmp_path, ["--train-iters", "16", *base], recorders=CHECKPOINT,
                             env={"DILOCO_TEST_RESTART_AFTER_STEP": "8"})
    assert all(rec["restart"] == ["test: restart after step 8"] for rec in recs)
    rounds = re.findall(r"\[DiLoCoX\] round +(\d+) \| step +(\d+) \| (\w+)", log)
    assert [(int(r), int(s), a) for r, s, a in rounds] == [(1, 4, "no"), (2, 8, "applied"),
                                                           (1, 4, "no"), (2, 8, "applied")], rounds  # no: none applied
    _, fresh = run_megatron(tmp_path, ["--train-iters", "8", *base])
    s, want = summary(log), summary(fresh)
    assert s["rounds"] == 2 and s["replicas_identical"]
    assert s["bytes_sent_per_rank"] == want["bytes_sent_per_rank"] > 0


def test_tensorboard_scalars_at_megatrons_iteration(tmp_path):
    """``diloco_x/*`` TensorBoard scalars are written at Megatron's iteration, as its own scalars are,
    also when a run starts a new outer loop from a checkpoint's weights (``--no-load-optim``: the
    optimizer's step count restarts at 0, Megatron's iteration continues from 8). Read back from the
    event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_diloco.summary import ROUND_METRICS

    def scalar_steps(folder) -> dict[str, list[int]]:
        events = EventAccumulator(str(folder))
        events.Reload()
        return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    ckpt, first, second = tmp_path / "ckpt", tmp_path / "tb1", tmp_path / "tb2"
    base = ["--diloco-x-local-steps", "4", "--save-interval", "1000", "--no-load-rng"]
    run_megatron(tmp_path, base + ["--train-iters", "8", "--save", str(ckpt), "--tensorboard-dir", str(first)])
    _, log = run_megatron(tmp_path, base + ["--train-iters", "16", "--load", str(ckpt), "--no-load-optim",
                                            "--tensorboard-dir", str(second)])
    assert "outer loop restarted" in log
    for folder, boundaries, iterations in ((first, [4, 8], range(1, 9)), (second, [12, 16], range(9, 17))):
        steps = scalar_steps(folder)
        assert steps["lm loss"] == list(iterations), steps["lm loss"]  # Megatron's own
        ours = {tag: s for tag, s in steps.items() if tag.startswith("diloco_x/")}
        assert ours and all(s == boundaries for s in ours.values()), ours
        assert set(ours) == {f"diloco_x/{name}" for name in ROUND_METRICS}, sorted(ours)  # as documented


def test_a_checkpoint_in_the_first_format_is_refused_with_the_way_out(monkeypatch):
    """The first DiLoCoX checkpoint format (pickled ShardedObjects ``diloco_x.outer/...``; its plain
    state-dict twin without ``tensors``) is not read: the error says so and names ``--no-load-optim``,
    before any state is touched."""
    import megatron.core.dist_checkpointing.serialization as serialization
    from megatron_diloco.megatron_adapter import checkpoint

    monkeypatch.setattr(checkpoint, "_checkpoint_dir_being_loaded", lambda: "/ckpt/iter_0000012")
    monkeypatch.setattr(serialization, "load_sharded_metadata",
                        lambda path: {"decoder.weight": object(), "diloco_x.outer/shard_0_2": object()})
    with pytest.raises(RuntimeError, match=r"checkpoint /ckpt/iter_0000012 .*first checkpoint format.*--no-load-optim"):
        checkpoint._read_checkpoint_contents(None)

    class Inner:
        loaded = False

        def load_state_dict(self, sd):
            self.loaded = True

    inner = Inner()
    codec = checkpoint.OuterCheckpoint.__new__(checkpoint.OuterCheckpoint)  # refused before it reads its inputs
    with pytest.raises(RuntimeError, match="first checkpoint format.*--no-load-optim"):
        codec.load_state_dict({"inner": {}, "diloco_x": {"sync": {}}, "diloco_x_replica": {"0.param": None}}, inner)
    assert not inner.loaded
