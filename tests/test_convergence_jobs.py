"""The jobs of the convergence benchmark (``benchmarks/convergence.py``): what each method launches.
Nothing is run. The batch rule is what makes the comparison fair: AllReduce takes all replicas'
samples per step in one world, a DiLoCo replica its own share, ``single`` one replica's alone."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks import convergence


def _a(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(micro_batch=16, accum=1, cpu_smoke=False, eval_iters=32, steps=3000,
                              eval_interval=300, local_steps=30, out=tmp_path, estimate_s=400.0, timeout_s=520.0,
                              one_world=False, call_s=None, exit_interval=None, parallel=4, jobs_per_gpu=1,
                              replicas=2)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _example_args(cmd) -> list[str]:
    return cmd.argv[cmd.argv.index("--") + 1:]


@pytest.mark.parametrize("name, launches, batch, replicas", [
    ("allreduce", 1, 32, 2), ("single", 1, 16, 2), ("partial_auto_int4", 2, 16, 2), ("diloco_int4", 2, 16, 2),
    ("allreduce", 1, 64, 4), ("default", 4, 16, 4)])
def test_each_method_launches_its_worlds_with_its_batch(tmp_path, name, launches, batch, replicas):
    """R single-rank worlds on one GPU per DiLoCo run, each at its own batch; AllReduce one world of R x the batch
    (data parallelism over R); ``--replicas 4``: four worlds, ``--diloco-x-replicas 4``."""
    a = _a(tmp_path)
    a.replicas = replicas
    job = convergence.job_for(name, 2, a, "/data/corpus")
    assert job.name == f"{name}_seed2" and job.gpus == 1 and len(job.commands) == launches
    argvs = [_example_args(c) for c in job.commands]
    for r, argv in enumerate(argvs):
        assert int(_flag(argv, "--global-batch-size")) == batch and _flag(argv, "--seed") == "2"
        assert _flag(argv, "--data-path") == "/data/corpus" and _flag(argv, "--train-iters") == "3000"
        assert job.commands[r].env["WORLD_SIZE"] == "1"
    if launches == 1:
        assert argvs[0][-1] == "--no-diloco-x" and "--diloco-x-outer-store" not in argvs[0]
    else:  # R single-rank worlds joined by one outer store, each with its replica index
        assert {_flag(a, "--diloco-x-outer-store") for a in argvs} == {_flag(argvs[0], "--diloco-x-outer-store")}
        assert [_flag(a, "--diloco-x-replica-index") for a in argvs] == [str(r) for r in range(replicas)]
        assert {_flag(a, "--diloco-x-replicas") for a in argvs} == {str(replicas)}
        m = convergence.METHODS[name]
        if not m.get("default"):  # (the default gives only --diloco-x, its H and the link)
            assert _flag(argvs[0], "--diloco-x-overlap") == m["overlap"]
            assert _flag(argvs[0], "--diloco-x-compression") == m["codec"]
            assert float(_flag(argvs[0], "--diloco-x-outer-lr")) == m["eta"]
            assert ("--diloco-x-overlap-steps" in argvs[0]) == ("tau" in m)
    # the definition is stored with the run (done.json), so later reports use what ran
    assert job.fingerprint["method"] == convergence.METHODS[name]


@pytest.mark.parametrize("name", ["allreduce", "partial_auto_int4", "diloco_int4"])
def test_one_world_runs_every_method_as_r_ranks_over_r_gpus(tmp_path, name):
    """``--one-world``: the multi-GPU user's launch, one torchrun world of R ranks, one GPU each;
    the world's global batch is all replicas' samples (AllReduce: data parallelism over R ranks;
    DiLoCo: R replicas of one rank, each its share), so the samples per step match the other mode."""
    a = _a(tmp_path)
    a.one_world = True
    ej = convergence.job_for(name, 3, a, "/data/corpus")
    assert ej.nproc == ej.gpus == convergence.REPLICAS and ej.name == f"{name}_seed3"
    assert int(_flag(ej.args, "--global-batch-size")) == 16 * convergence.REPLICAS
    assert "--diloco-x-outer-store" not in ej.args and "--diloco-x-replica-index" not in ej.args
    assert (ej.args[-1] == "--no-diloco-x") == (name == "allreduce")
    if name != "allreduce":
        assert _flag(ej.args, "--diloco-x-replicas") == str(convergence.REPLICAS)
    job = ej.job(tmp_path)
    assert len(job.commands) == 1 and "torch.distributed.run" in job.commands[0].argv
    assert _flag(job.commands[0].argv, "--nproc-per-node") == str(convergence.REPLICAS)
    assert job.fingerprint["method"] == convergence.METHODS[name]


def test_one_world_refuses_a_replica_alone(tmp_path):
    a = _a(tmp_path)
    a.one_world = True
    with pytest.raises(SystemExit, match="single"):
        convergence.job_for("single", 1, a, "/data/corpus")


def test_a_continued_run_checkpoints_and_stops_within_its_call(tmp_path):
    """``--call-s``: a run saves into and loads from ``DIR/<run>/ckpt`` (only when it stops), and its launch in
    call k stops at the call's deadline, ``STOP_S`` before the call's end: Megatron's --exit-duration-in-mins (whole
    minutes) with the program start that puts it there (``BENCH_PROGRAM_START``); it logs into
    ``DIR/<run>/call<k>/`` and exits with teardown (no fast exit: a save starts helper processes); the runner ends it
    ``END_S`` before the call's end at the latest."""
    from harness.continued import END_S, LATE_START_S, STOP_S, Call

    a = _a(tmp_path)
    a.one_world, a.call_s = True, 540.0
    call = Call(2, left_s=530.0, start=1000.0)
    assert call.run_s == 530.0 - STOP_S == 440.0 and call.budget_s == 440.0 + LATE_START_S
    assert call.exit_mins == 8 and call.program_start == 1000.0 + 440.0 - 480.0  # 8 minutes end at the deadline
    ej = convergence.job_for("default", 1, a, "/data/corpus", call)
    ckpt = str(tmp_path / "default_seed1" / "ckpt")
    assert ej.name == "default_seed1/call2" and _flag(ej.args, "--save") == _flag(ej.args, "--load") == ckpt
    assert _flag(ej.args, "--save-interval") == "3001" and "--no-load-rng" not in ej.args  # past the run: at stops
    assert _flag(ej.args, "--save-retain-interval") == "3001"  # no save is a multiple of it: only the latest kept
    assert ej.args == [*convergence.run_args("default", 1, a, "/data/corpus")[1], "--exit-duration-in-mins", "8"]
    assert ej.env == {"BENCH_PROGRAM_START": "960.000"}
    assert ej.estimate_s == 440.0 and ej.timeout_s == 530.0 - END_S
    (cmd,) = ej.job(tmp_path).commands
    assert "--fast-exit" not in cmd.argv and _flag(cmd.argv, "--out") == str(tmp_path / "default_seed1" / "call2")
    # one world of one rank (allreduce, single) checkpoints without --one-world too; on CPU, no RNG state to load
    a.one_world, a.cpu_smoke = False, True
    job = convergence.job_for("single", 1, a, "/data/corpus", Call(1, 530.0, exit_interval=4, start=1000.0))
    (cmd,) = job.commands
    argv = _example_args(cmd)
    assert _flag(argv, "--load") == str(tmp_path / "single_seed1" / "ckpt") and "--no-load-rng" in argv
    assert argv[-4:] == ["--exit-duration-in-mins", "8", "--exit-interval", "4"]
    assert job.env["BENCH_PROGRAM_START"] == "960.000"
    assert _flag(cmd.argv, "--out") == str(tmp_path / "single_seed1" / "call1" / "replica0")
    assert Call(1, left_s=STOP_S + 61).exit_mins == 2  # 61 s: the start a minute less a second before the launch
    with pytest.raises(SystemExit, match="less than a minute"):
        Call(1, left_s=STOP_S + 59)


def _fake_megatron(launched: list[str], per_call: dict[str, int], train_iters: int, eval_interval: int):
    """A stand-in for ``run_jobs`` that trains nothing: each launched run goes on from its checkpoint's
    iteration (``--load``) by ``per_call[method]`` iterations, logs Megatron's evaluations and, at
    ``train_iters``, the one after training, and saves where it stopped."""
    def run_jobs(jobs, out, **_):
        for ej in jobs:
            launched.append(ej.name)
            tracker = Path(_flag(ej.args, "--load")) / "latest_checkpointed_iteration.txt"
            start = int(tracker.read_text()) if tracker.exists() else 0
            end = min(train_iters, start + per_call[ej.name.split("_seed")[0]])
            lines = [f" validation loss at iteration {it} | lm loss value: {1 / it} |"
                     for it in range(start + 1, end + 1) if it % eval_interval == 0]
            if end == train_iters:
                lines.append(f" validation loss at iteration {end} on validation set | lm loss value: 0.5 |")
            (out / ej.name).mkdir(parents=True)
            (out / ej.name / "log.txt").write_text("\n".join(lines) + "\n")
            (out / ej.name / "done.json").write_text(json.dumps({"ok": True, **ej.fingerprint}))
            for it in [*range((start // eval_interval + 1) * eval_interval, end + 1, eval_interval), end]:
                (tracker.parent / f"iter_{it:07d}").mkdir(parents=True, exist_ok=True)  # Megatron keeps every save
            tracker.write_text(str(end))
            (tracker.parent / f"iter_{end + 1:07d}").mkdir()  # a save that did not complete
    return run_jobs


def test_the_next_call_continues_only_unfinished_runs_and_the_report_reads_every_call(tmp_path, monkeypatch):
    """Three calls of the same command into one DIR, runs faked (:func:`_fake_megatron`): AllReduce
    finishes in call 2 and is not launched again; the default goes on from its checkpoint each call. The
    manifest follows (saved iteration, finished, the calls per run); the analysis reads each call's log in
    order, so the curve is whole; a run's flags may not change between calls."""
    from harness.continued import last_done

    a = _a(tmp_path)
    a.one_world, a.call_s, a.steps = True, 1e4, 900
    launched: list[str] = []
    monkeypatch.setattr(convergence, "run_jobs", _fake_megatron(launched, {"allreduce": 600, "default": 400}, 900, 300))
    runs = [("allreduce", 1), ("default", 1)]
    states = []
    for _ in range(3):
        convergence.continue_runs(runs, a, "/data/corpus")
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        states.append({r: (st["saved_iteration"], st["finished"]) for r, st in manifest["runs"].items()})
        for run, st in manifest["runs"].items():  # only the latest checkpoint is kept
            assert sorted(p.name for p in (tmp_path / run / "ckpt").glob("iter_*")) == [
                f"iter_{st['saved_iteration']:07d}"]
    assert launched == ["allreduce_seed1/call1", "default_seed1/call1", "allreduce_seed1/call2", "default_seed1/call2",
                        "default_seed1/call3"]
    assert states == [{"allreduce_seed1": (600, False), "default_seed1": (400, False)},
                      {"allreduce_seed1": (900, True), "default_seed1": (800, False)},
                      {"allreduce_seed1": (900, True), "default_seed1": (900, True)}]
    both = ["allreduce_seed1", "default_seed1"]
    assert [c["unfinished"] for c in manifest["calls"]] == [both, both, ["default_seed1"]]
    assert [manifest["runs"][r]["calls"] for r in both] == [[1, 2], [1, 2, 3]]
    assert manifest["runs"]["default_seed1"]["train_iters"] == 900
    assert "--exit-duration-in-mins" not in manifest["runs"]["default_seed1"]["flags"]  # a call's, not the run's
    got = convergence.analyze(tmp_path / "default_seed1", 100)
    assert got["curve"] == [[30000, 1 / 300], [60000, 1 / 600], [90000, 1 / 900]] and got["final_val_loss"] == 0.5
    assert last_done(tmp_path / "default_seed1")["method"] == convergence.METHODS["default"]  # the report's definition
    a.steps = 1200  # a longer run into the same DIR: refused, nothing launched
    with pytest.raises(SystemExit, match="--train-iters"):
        convergence.continue_runs(runs, a, "/data/corpus")
    assert len(launched) == 5


def test_a_failed_launch_is_reported_then_the_exit_status_says_so(tmp_path, monkeypatch):
    """A run that fails in a call (seen: a checkpoint save on a full disk): the report is still written, and the
    script exits non-zero naming it, so that whoever drives the calls does not read the call as a success."""
    fake = _fake_megatron([], {"default": 4}, 8, 4)

    def run_jobs(jobs, out, **kw):
        fake(jobs, out, **kw)
        return {ej.name: {"ok": False, "returncode": 1} for ej in jobs}

    monkeypatch.setattr(convergence, "run_jobs", run_jobs)
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--out", str(tmp_path), "--cpu-smoke", "--one-world",
                                      "--methods", "default", "--call-s", "1e4", "--card", "cpu"])
    with pytest.raises(SystemExit, match="failed: default_seed1/call1"):
        convergence.main()
    assert (tmp_path / "convergence.json").exists()


def test_at_a_calls_start_and_end_only_the_latest_checkpoint_is_kept(tmp_path):
    """:func:`harness.continued.prune_checkpoints` (nothing running): a save that did not complete (past the
    tracker) and one kept from before go; the tracker's stays; a run that saved nothing is left alone."""
    from harness.continued import prune_checkpoints

    ckpt = tmp_path / "run" / "ckpt"
    assert prune_checkpoints(tmp_path / "run") == []
    for it in (500, 1000, 1500):
        (ckpt / f"iter_{it:07d}").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1000")
    assert prune_checkpoints(tmp_path / "run") == [500, 1500]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0001000"]


@pytest.mark.megatron
def test_megatron_stops_at_the_calls_deadline_saves_only_there_and_keeps_only_the_latest(tmp_path):
    """The continued runs' flags and deadline on real Megatron (CPU, gloo, the example with DiLoCoX in one world,
    an evaluation every iteration). Call 1: ``--exit-duration-in-mins 1`` with the call's program start
    (``BENCH_PROGRAM_START``, read by ``harness/run.py``) putting the deadline 5 s after the launch: Megatron stops at
    the first iteration past it, saved there, long before its own minute (counted from each rank's imports: more
    than 60 s). Call 2 (``--exit-interval``, as a split by steps) loads that save, saves only at its own stop, not at
    its evaluations (a save at every evaluation cost a 302M run about 80 of each call's 420 s), and Megatron deletes
    call 1's save once its own is complete (``--save-retain-interval``; without it a 302M run's saves filled a
    machine's disk)."""
    import time

    from harness.continued import checkpoint_flags
    from tests.megatron_utils import run_megatron

    flags = [*checkpoint_flags(tmp_path / "run", 100000, load_rng=False), "--train-iters", "100000",
             "--eval-interval", "1", "--eval-iters", "1", "--exit-duration-in-mins", "1"]
    ckpt = tmp_path / "run" / "ckpt"
    saves = lambda log: [int(i) for i in re.findall(r"saving checkpoint at iteration +(\d+)", log)]  # noqa: E731
    kept = lambda: (int((ckpt / "latest_checkpointed_iteration.txt").read_text()), sorted(ckpt.glob("iter_*")))  # noqa: E731
    began = time.time()
    _, log = run_megatron(tmp_path / "call1", flags, env={"BENCH_PROGRAM_START": f"{began + 5 - 60:.3f}"})
    took = time.time() - began
    assert "exiting program after" in log and len(saves(log)) == 1, log[-3000:]
    assert took < 55, f"stopped after {took:.0f} s: Megatron's own minute, not the call's deadline"
    (n,) = saves(log)
    assert kept() == (n, [ckpt / f"iter_{n:07d}"])
    _, log = run_megatron(tmp_path / "call2", [*flags, "--exit-interval", str(n + 2)])
    assert saves(log) == [n + 2] and log.count("validation loss at iteration") == 2  # evaluated at n + 1, n + 2
    assert kept() == (n + 2, [ckpt / f"iter_{n + 2:07d}"])


def test_separate_worlds_are_refused_a_continued_run_before_anything_starts(tmp_path, monkeypatch):
    """R single-rank worlds joined by ``--diloco-x-outer-store`` cannot save (the package refuses
    --save / --load there): ``--call-s`` without ``--one-world`` stops before any launch or manifest."""
    a = _a(tmp_path)
    a.call_s = 1e4
    launched: list[str] = []
    monkeypatch.setattr(convergence, "run_jobs", _fake_megatron(launched, {}, 900, 300))
    with pytest.raises(SystemExit, match="--one-world"):
        convergence.continue_runs([("allreduce", 1), ("default", 1)], a, "/data/corpus")
    assert launched == [] and not (tmp_path / "manifest.json").exists()


def test_gaps_are_over_the_seeds_both_rows_ran():
    """A method run with seeds 1-3 against AllReduce with seeds 1-2: the gap is over seeds 1-2 (a
    seed's data order and initialisation are every method's), not the mean of 3 over the mean of 2."""
    row = {"seeds": [1, 2, 3], "final_val_loss_per_seed": [1.1, 1.2, 2.0], "final_val_loss": 1.4333}
    ref = {"seeds": [1, 2], "final_val_loss_per_seed": [1.0, 1.0], "final_val_loss": 1.0}
    gap, seeds = convergence.paired_gap(row, ref)
    assert seeds == [1, 2] and gap == pytest.approx(0.15)
    gap, seeds = convergence.paired_gap({**row, "seeds": [4, 5, 6]}, ref)  # none shared: unpaired
    assert seeds == [] and gap == pytest.approx(0.4333)


def test_each_row_is_judged_against_blocking_at_its_codec_and_uncompressed_at_its_rule():
    defs = {n: convergence.METHODS[n] for n in ("allreduce", "diloco", "diloco_int4", "partial_auto_int4",
                                                "partial_auto_int4_eta1.2", "partial_tau5", "partial_mix_tau5",
                                                "partial_auto_int8_h60")}
    blocking, uncompressed = convergence.REFERENCES["blocking"], convergence.REFERENCES["uncompressed"]
    assert convergence.counterpart("partial_auto_int4", defs, **blocking) == "diloco_int4"
    assert convergence.counterpart("partial_auto_int4_eta1.2", defs, **blocking) == "diloco_int4"
    assert convergence.counterpart("partial_tau5", defs, **blocking) == "diloco"
    assert convergence.counterpart("partial_mix_tau5", defs, **blocking) == "diloco"
    assert convergence.counterpart("diloco_int4", defs, **uncompressed) == "diloco"
    assert convergence.counterpart("partial_auto_int4", defs, **uncompressed) is None  # partial_auto not run
    assert convergence.counterpart("partial_auto_int8_h60", defs, **blocking) is None  # no blocking at H = 60
    assert convergence.counterpart("diloco", defs, **blocking) is None  # itself
    assert convergence.counterpart("allreduce", defs, **blocking) is None


def _log(iters_losses: list[tuple[int, float]], final: float) -> str:
    lines = [f" validation loss at iteration {it} | lm loss value: {v} | lm loss PPL: 2.0 |" for it, v in iters_losses]
    return "\n".join(lines + [f" validation loss at iteration 3000 on validation set | lm loss value: {final} |", ""])


def test_analysis_reads_separate_worlds_and_one_world_logs(tmp_path):
    """R separate worlds: each replica's log, averaged; one world (``--one-world``): its ``log.txt``,
    where Megatron already averaged the replicas' halves."""
    sep = tmp_path / "sep" / "diloco_seed1"
    sep.mkdir(parents=True)
    (sep / "replica0.log").write_text(_log([(300, 1.0), (600, 0.8)], 0.7))
    (sep / "replica1.log").write_text(_log([(300, 1.2), (600, 0.9)], 0.9))
    got = convergence.analyze(sep, 100)
    assert got["final_val_loss"] == pytest.approx(0.8) and got["final_val_loss_per_log"] == [0.7, 0.9]
    assert got["curve"] == [[30000, pytest.approx(1.1)], [60000, pytest.approx(0.85)]]
    one = tmp_path / "one" / "diloco_seed1"
    one.mkdir(parents=True)
    (one / "log.txt").write_text(_log([(300, 1.1)], 0.8))
    got = convergence.analyze(one, 100)
    assert got["final_val_loss"] == pytest.approx(0.8) and got["curve"] == [[30000, 1.1]]


@pytest.mark.parametrize("name, lr", [("allreduce_lr2e-3", "2e-3"), ("diloco_int4_lr5e-4", "5e-4")])
def test_a_methods_megatron_flags_override_the_common_ones(tmp_path, name, lr):
    job = convergence.job_for(name, 1, _a(tmp_path), "/data/corpus")
    argv = _example_args(job.commands[0])
    lrs = [i for i, f in enumerate(argv) if f == "--lr"]
    assert len(lrs) == 2 and argv[lrs[-1] + 1] == lr  # argparse: the last one wins
    assert ("--diloco-x" in argv) == name.startswith("diloco")


def test_h20_rows_are_judged_against_blocking_at_h20():
    defs = {n: convergence.METHODS[n] for n in ("diloco_int4", "diloco_int4_h20", "partial_auto_int4",
                                                "partial_auto_int4_h20")}
    blocking = convergence.REFERENCES["blocking"]
    assert convergence.counterpart("partial_auto_int4_h20", defs, **blocking) == "diloco_int4_h20"
    assert convergence.counterpart("partial_auto_int4", defs, **blocking) == "diloco_int4"


def test_int2_warmup_rows_are_judged_against_blocking_with_the_same_warmup_codec():
    names = ("diloco_int4_hwarm900", "diloco_int4_hwarm900_w2", "partial_auto_int4_hwarm900_wtau1",
             "partial_auto_int4_hwarm900_wtau1_w2")
    defs = {n: convergence.METHODS[n] for n in names}
    blocking = convergence.REFERENCES["blocking"]
    assert convergence.counterpart(names[3], defs, **blocking) == names[1]
    assert convergence.counterpart(names[2], defs, **blocking) == names[0]
    flags = convergence.method_flags(names[3])
    assert flags[flags.index("--diloco-x-warmup-compression") + 1] == "int2"
    old = convergence.method_flags(names[2])  # measured before the auto int2 warm-up: pinned to int4
    assert old[old.index("--diloco-x-warmup-compression") + 1] == "int4"


@pytest.mark.parametrize("name, mbps", [("default_auto_h", None), ("default_auto_h_100mbit", "100")])
def test_auto_h_methods_run_the_package_default_with_auto_h(tmp_path, name, mbps):
    """The auto-H rows: the harness's H is overridden by ``auto`` (the last flag wins), and the modelled
    link the run sizes H by is the common 1 Gbit or the row's own."""
    import argparse

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    argv = _example_args(convergence.job_for(name, 1, _a(tmp_path), "/data/corpus").commands[0])
    args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(argv)
    cfg = config_from_args(args)
    assert cfg.local_steps_auto and cfg.local_steps == 30
    assert cfg.bandwidth_mbps == float(mbps or convergence.LINK_MBPS)


def test_every_method_is_a_valid_package_config():
    """Each method's ``--diloco-x*`` flags, at the harness's H, pass the package's own validation
    (a warm-up longer than H, or a tau beyond the shortest round, would fail the run at start)."""
    import argparse

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    for name, m in convergence.METHODS.items():
        if not convergence.communicates(m) or m.get("default"):  # (the default: the next test)
            continue
        argv = ["--diloco-x-local-steps", str(convergence.H), *convergence.method_flags(name)]
        args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(argv)
        cfg = config_from_args(args)
        assert cfg.overlap == m["overlap"] and cfg.compression == m["codec"], name
        assert cfg.warmup_compression == m.get("wc"), name


@pytest.mark.parametrize("local_steps", [30, 100, 300])
def test_the_default_method_is_the_package_default(local_steps):
    """The report's default method (``--default-method``) runs what ``--diloco-x`` alone runs at the
    harness's H (any: 30, 100, 300) and step count, but for the modelled link
    (``--diloco-x-bandwidth-mbps``, which auto tau is sized by in the harness). At H = 30 over 3000
    steps that is the row measured as the default before (its explicit warm-up equals the auto one
    there)."""
    import argparse
    import dataclasses

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    def config(argv: list[str]):
        args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(
            ["--diloco-x-local-steps", str(local_steps), *argv])
        args.train_iters = 3000  # convergence.py --steps default
        return config_from_args(args)

    got = config(convergence.method_flags(convergence.DEFAULT_METHOD))
    want = config(["--diloco-x", "--diloco-x-replicas", str(convergence.REPLICAS)])
    assert got.bandwidth_mbps == convergence.LINK_MBPS and dataclasses.replace(got, bandwidth_mbps=None) == want
    if local_steps == convergence.H:
        (old,) = convergence.MEASURED_AS_DEFAULT
        measured = config(convergence.method_flags(old))
        assert dataclasses.replace(measured, warmup_auto=True) == got


@pytest.mark.parametrize("local_steps", [30, 100, 300])
def test_default_blocking_is_the_default_without_its_overlap(local_steps):
    """``default_blocking``, the default's blocking reference (``results/convergence_h.json``'s
    'blocking' rows): the package default at the same H, codecs and auto warm-up, but for
    ``--diloco-x-overlap none`` (and so tau_w 0: the warm-up's rounds block too)."""
    import dataclasses

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    def config(name: str):
        args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(
            ["--diloco-x-local-steps", str(local_steps), *convergence.method_flags(name)])
        args.train_iters = 3000
        return config_from_args(args)

    default, blocking = config(convergence.DEFAULT_METHOD), config("default_blocking")
    assert blocking.overlap == "none" and blocking.warmup_overlap_steps == 0
    assert dataclasses.replace(blocking, overlap=default.overlap, warmup_overlap_steps=default.warmup_overlap_steps) \
        == default


def test_convergence_h_default_is_the_package_rule():
    """``results/convergence_h.json`` (the warm-up rule measured across H): at every H it
    reports, the harness's default method (``--diloco-x`` alone) resolves today to the warm-up, overlap
    and codecs the row measured as the default ran with (its own summary). A change of the auto warm-up
    rule that would no longer run what was measured at H = 30, 100 or 300 fails here."""
    import json

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args

    result = json.loads((Path(convergence.__file__).parent / "results" / "convergence_h.json").read_text())
    assert {"30", "100", "300"} <= set(result["runs"])
    for h, rows in result["runs"].items():
        ran = rows["default"]["run_resolved"]
        args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(
            ["--diloco-x-local-steps", h, *convergence.method_flags(convergence.DEFAULT_METHOD)])
        args.train_iters = result["regime"]["steps"]
        cfg = config_from_args(args)
        got = {"local_steps": cfg.local_steps, "warmup_local_steps": cfg.warmup_local_steps,
               "warmup_iters": cfg.warmup_iters, "warmup_overlap_steps": cfg.warmup_overlap_steps,
               "warmup_compression": cfg.warmup_compression, "overlap": cfg.overlap, "merge": cfg.merge,
               "compression": cfg.compression, "link_mbps": cfg.bandwidth_mbps}
        assert got == {k: ran[k] for k in got}, h
        assert rows["default"]["resolved_flags"]["warmup_iters"] == cfg.warmup_iters, h
        if "blocking" in rows:  # the default's blocking reference ran the default's warm-up and codecs
            ran_b = rows["blocking"]["run_resolved"]
            want = {**got, "overlap": "none", "warmup_overlap_steps": 0, "merge": None}  # (merge: partial's)
            assert want == {k: ran_b[k] for k in got}, h
        # the rule beats the one it replaced at every H where both ran
        if "previous_default" in rows:
            assert rows["default"]["gap_vs_allreduce"] < rows["previous_default"]["gap_vs_allreduce"], h


def test_the_gap_plot_bands_over_the_seeds_both_rows_ran():
    """The band is min..max over seeds of each seed's gap to AllReduce's run of the same seed, at the
    tokens every paired seed evaluated; none without two paired seeds."""
    from benchmarks.plots import gap_band

    ref = {"curve_per_seed": {"1": [[10, 1.0], [20, 0.5]], "2": [[10, 2.0], [20, 0.5]], "3": [[10, 1.0]]}}
    row = {"curve_per_seed": {"1": [[10, 1.1], [20, 0.55]], "2": [[10, 2.4], [20, 0.51], [30, 0.4]],
                              "4": [[10, 9.0]]}}
    xs, lo, hi = gap_band(row, ref)
    assert xs == [10, 20]
    assert lo == pytest.approx([10.0, 2.0]) and hi == pytest.approx([20.0, 10.0])
    assert gap_band({"curve_per_seed": {"1": [[10, 1.1]]}}, ref) is None
    assert gap_band({"curve": [[10, 1.1]]}, ref) is None


def test_gap_vs_h_points_pair_each_method_at_its_best_lr():
    """The gap-vs-H plot's best-lr points: the default's best-lr row against the mean of AllReduce's
    best-lr row (not of its 1e-3 row), only at the H the sweep ran."""
    from benchmarks.plots import gap_vs_h_points

    ar = {"final_val_loss_per_seed": [1.0, 1.2]}
    ar_low = {"final_val_loss_per_seed": [0.9, 1.1]}
    dflt = {"final_val_loss_per_seed": [1.05, 1.1]}
    conv_h = {"runs": {"30": {"allreduce": ar, "allreduce_lr5e-4": ar_low, "default": dflt},
                       "300": {"allreduce": ar, "default": dflt}},
              "lr_sweep": {"30": {"allreduce": {"best_row": "allreduce_lr5e-4"}, "default": {"best_row": "default"}}}}
    pts = gap_vs_h_points(conv_h)
    assert [h for h, _ in pts["default"]] == [30, 300]
    assert pts["default"][0][1] == pytest.approx([100 * (1.05 / 1.1 - 1), 0.0])
    assert [h for h, _ in pts["best_lrs"]] == [30]
    assert pts["best_lrs"][0][1] == pytest.approx([100 * (1.05 / 1.0 - 1), 10.0])


def test_fast_path_runs_every_method_on_the_measured_fast_flags(tmp_path):
    """--fast-path appends the flags RESULTS §9 measured (fast_path.py's ``fast_rope``) to every method's run, and
    a method's own flags still come last."""
    sys.path.insert(0, str(Path(convergence.__file__).parent / "throughput"))
    import fast_path

    assert fast_path.PATHS["fast_rope"] == [*fast_path.PATHS["fast_workers"], "--rope-fusion"]
    a = _a(tmp_path)
    plain = convergence.run_args("allreduce_lr2e-3", 1, a, "/data/corpus")[1]
    a.fast_path = True
    fast = convergence.run_args("allreduce_lr2e-3", 1, a, "/data/corpus")[1]
    assert [f for f in fast if f.startswith("--") and f not in plain] == [
        "--attention-sdpa", "--no-create-attention-mask-in-dataloader", "--num-workers", "--rope-fusion"]
    assert fast[-2:] == ["--min-lr", "2e-4"] and _flag(fast, "--num-workers") == "2"


def test_a_scale_point_takes_each_family_at_its_best_lr_over_shared_seeds(tmp_path):
    """convergence_scale.json's points: AllReduce and the default each at the lr that ends lowest over the
    seeds every lr ran (not the lr that ran a luckier extra seed), the gap paired over shared seeds."""
    from benchmarks import scale_points

    row = lambda seeds, losses, b=1.0: {"seeds": seeds, "final_val_loss_per_seed": losses, "bytes_total": b}  # noqa: E731
    conv = {"regime": {"params": 100, "tokens": 200, "replicas": 2, "local_steps": 30},
            "methods": {"allreduce": row([1, 2], [1.00, 1.20], 600.0),    # lr 1e-3: seed 1 1.00
                        "allreduce_lr5e-4": row([1], [0.99], 600.0),       # lr 5e-4: seed 1 0.99 -> best
                        "allreduce_lr2e-3": row([1], [1.10], 600.0), "allreduce_lr2.5e-4": row([1], [1.02], 600.0),
                        "default": row([1, 2], [1.05, 1.25], 4.0), "default_lr2e-3": row([1], [1.2], 4.0),
                        "diloco_int4": row([1], [0.5])}}                   # another family: not a point's
    pt = scale_points.point(conv, resolved_flags={"compression": "int4"}, commit="c", card="card")
    assert pt["allreduce"]["lr"] == 5e-4 and pt["allreduce"]["best_lr_bracketed"]
    assert pt["default"]["lr"] == 1e-3 and not pt["default"]["best_lr_bracketed"]
    assert pt["gap_best_lrs"] == pytest.approx(1.05 / 0.99 - 1) and pt["gap_seeds"] == [1]
    assert pt["fewer_bytes"] == 150 and pt["tokens_per_param"] == 2
    assert list(pt["allreduce"]["lr_sweep"]) == ["0.00025", "0.0005", "0.001", "0.002"]
    log = tmp_path / "replica0.log"
    log.write_text("x\nmegatron-diloco: DiLoCoX on: DiLoCoXConfig(replicas=2, warmup_compression='int2', "
                   "overlap_steps=None, outer_lr=1.0, nesterov=True); set --use-distributed-optimizer\n")
    assert scale_points.resolved_from_log(log) == {"replicas": 2, "warmup_compression": "int2", "overlap_steps": None,
                                                   "outer_lr": 1.0, "nesterov": True}


def test_the_earlier_sweep_as_points_gives_results_2_3s_gaps():
    """RESULTS §2.3's best-lr gaps (+2.79% at H 30, +2.63% at H 100) come out of convergence_h.json's sweep."""
    from benchmarks import scale_points

    conv_h = json.loads((scale_points.RESULTS / "convergence_h.json").read_text())
    pts = {p["H"]: p for p in scale_points.earlier_points(conv_h)}
    assert round(100 * pts[30]["gap_best_lrs"], 2) == 2.79 and round(100 * pts[100]["gap_best_lrs"], 2) == 2.63
    assert pts[30]["allreduce"]["lr"] == 5e-4 and pts[30]["default"]["lr"] == 1e-3


def test_the_model_flag_picks_the_shape_and_keeps_the_rest(tmp_path):
    """``--model 302M``: 24 layers of 1024 (16 heads, ffn 4096), every other flag as the 85M run's."""
    a = _a(tmp_path)
    small = convergence.run_args("allreduce", 1, a, "/data/corpus")[1]
    a.model = "302M"
    big = convergence.run_args("allreduce", 1, a, "/data/corpus")[1]
    shape = {f: _flag(big, f) for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads")}
    assert shape == {"--num-layers": "24", "--hidden-size": "1024", "--ffn-hidden-size": "4096",
                     "--num-attention-heads": "16"}
    assert _flag(small, "--num-layers") == "12" and _flag(small, "--hidden-size") == "768"
    rest = lambda argv: [x for i, x in enumerate(argv) if x not in shape and (i == 0 or argv[i - 1] not in shape)]  # noqa: E731
    assert rest(big) == rest(small)
