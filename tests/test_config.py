"""Flag validation: every bad value or incompatible combination names the flag; nothing is changed."""

from __future__ import annotations

import argparse
import re
import dataclasses

import pytest

from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args, validate_megatron_args
from megatron_diloco.algorithm.schedule import RoundSchedule
from megatron_diloco.algorithm.config import DiLoCoXConfig, ineffective_settings


def parse(*argv: str) -> argparse.Namespace:
    return add_diloco_x_args(argparse.ArgumentParser()).parse_args(["--diloco-x", *argv])


def megatron_args(**kw) -> argparse.Namespace:
    base = dict(data_parallel_size=4, num_distributed_optimizer_instances=1, use_distributed_optimizer=False,
                use_tp_pp_dp_mapping=False, optimizer="adam")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("argv, flag", [
    (["--diloco-x-local-steps", "0"], "--diloco-x-local-steps"),
    (["--diloco-x-local-steps", "-3"], "--diloco-x-local-steps"),
    (["--diloco-x-replicas", "0"], "--diloco-x-replicas"),
    (["--diloco-x-outer-lr", "0"], "--diloco-x-outer-lr"),
    (["--diloco-x-outer-lr", "nan"], "--diloco-x-outer-lr"),
    (["--diloco-x-outer-lr", "inf"], "--diloco-x-outer-lr"),
    (["--diloco-x-outer-momentum", "1.0"], "--diloco-x-outer-momentum"),
    (["--diloco-x-outer-momentum", "-0.1"], "--diloco-x-outer-momentum"),
    (["--diloco-x-overlap", "eager", "--diloco-x-eager-weight", "0"], "--diloco-x-eager-weight"),
    (["--diloco-x-overlap", "eager", "--diloco-x-eager-weight", "1.5"], "--diloco-x-eager-weight"),
    (["--diloco-x-overlap", "delayed", "--diloco-x-eager-weight", "1"], "--diloco-x-eager-weight"),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-iters", "25"], "--diloco-x-warmup-iters"),  # H0 auto: 10
    (["--diloco-x-local-steps", "2", "--diloco-x-warmup-iters", "20"], "--diloco-x-warmup-local-steps"),  # H0 auto: 0
    (["--diloco-x-warmup-local-steps", "0"], "--diloco-x-warmup-local-steps"),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "40", "--diloco-x-warmup-iters", "40"],
     "--diloco-x-warmup-local-steps"),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "5", "--diloco-x-warmup-iters", "22"],
     "--diloco-x-warmup-iters"),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "5", "--diloco-x-warmup-iters", "20",
      "--diloco-x-overlap-steps", "31"], "--diloco-x-overlap-steps"),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "5", "--diloco-x-warmup-iters", "20",
      "--diloco-x-warmup-overlap-steps", "6"], "--diloco-x-warmup-overlap-steps"),  # > H0
    (["--diloco-x-warmup-overlap-steps", "-1"], "--diloco-x-warmup-overlap-steps"),
    (["--diloco-x-warmup-iters", "0", "--diloco-x-warmup-overlap-steps", "1"], "--diloco-x-warmup-overlap-steps"),
    (["--diloco-x-overlap", "delayed", "--diloco-x-warmup-overlap-steps", "1"], "--diloco-x-warmup-overlap-steps"),
    (["--diloco-x-compression", "none", "--diloco-x-warmup-compression", "int2"], "--diloco-x-warmup-compression"),
    (["--diloco-x-compression", "adaptive", "--diloco-x-warmup-compression", "int2"],
     "--diloco-x-warmup-compression"),
    (["--diloco-x-warmup-iters", "0", "--diloco-x-warmup-compression", "int2"], "--diloco-x-warmup-compression"),
])
def test_bad_values_name_their_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        config_from_args(parse(*argv))


@pytest.mark.parametrize("argv", [["--diloco-x-overlap", "eventually"], ["--diloco-x-compression", "zip"],
                                  ["--diloco-x-local-steps", "ten"], ["--diloco-x-warmup-compression", "adaptive"]])
def test_argparse_rejects_unknown_choices(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_warmup_schedule_rounds():
    """Rounds of H0 during the warm-up, then of H; without a warm-up every H-th step ends a round."""
    warm = config_from_args(parse("--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "5",
                                  "--diloco-x-warmup-iters", "20"))
    assert [s for s in range(1, 111) if RoundSchedule(warm).steps_since_boundary(s) == 0] == [5, 10, 15, 20, 50, 80, 110]
    assert RoundSchedule(warm).steps_since_boundary(23) == 3 and RoundSchedule(warm).steps_since_boundary(0) == 0
    assert [RoundSchedule(warm).round_steps(b) for b in (0, 5, 15, 20, 50)] == [5, 5, 5, 30, 30]  # the round after step b
    plain = config_from_args(parse("--diloco-x-local-steps", "30", "--diloco-x-warmup-iters", "0"))
    assert [s for s in range(1, 100) if RoundSchedule(plain).steps_since_boundary(s) == 0] == [30, 60, 90]
    assert RoundSchedule(plain).round_steps(0) == RoundSchedule(plain).round_steps(30) == 30
    # H0 = H: the warm-up changes nothing (the same boundaries, round lengths, codec and tau cap as none)
    same = RoundSchedule(config_from_args(parse("--diloco-x-local-steps", "4", "--diloco-x-warmup-local-steps", "4",
                                                "--diloco-x-warmup-iters", "4")))
    none = RoundSchedule(config_from_args(parse("--diloco-x-local-steps", "4", "--diloco-x-warmup-iters", "0")))
    for schedule in (same, none):
        assert [s for s in range(1, 30) if schedule.is_boundary(s)] == list(range(4, 30, 4))
        assert all(schedule.round_steps(s) == 4 and not schedule.is_warmup_round(schedule.round_steps(s))
                   and schedule.tau_cap(schedule.round_steps(s)) == 4 for s in range(0, 30, 4))
    # the run's clock in rounds (separate jobs of different H): boundaries within s steps, and its inverse
    odd = config_from_args(parse("--diloco-x-local-steps", "7", "--diloco-x-warmup-local-steps", "4",
                                 "--diloco-x-warmup-iters", "20"))
    for cfg in (warm, plain, odd):
        schedule = RoundSchedule(cfg)
        bounds = [s for s in range(1, 400) if schedule.is_boundary(s)]
        assert [schedule.boundaries_in(s) for s in range(400)] == [sum(b <= s for b in bounds) for s in range(400)]
        assert [schedule.steps_at_boundary(k) for k in range(len(bounds) + 1)] == [0, *bounds]


@pytest.mark.parametrize("argv,train_iters,want", [
    ([], None, (10, 15000)),  # H 500: rounds of at most 10 for 30 H steps
    (["--diloco-x-local-steps", "30"], 3000, (10, 900)),  # the measured default (RESULTS §2.1)
    (["--diloco-x-local-steps", "100"], 3000, (10, 1500)),  # measured at H 100 and 300 (RESULTS §2.3) ...
    (["--diloco-x-local-steps", "300"], 3000, (10, 1500)),  # ... where H // 3 for 1000 steps lost 3-5 points
    (["--diloco-x-local-steps", "31"], 3000, (10, 930)),  # H // 3 = 10: the cap
    (["--diloco-x-local-steps", "45"], 3000, (10, 1350)),  # H // 3 = 15 capped at 10
    (["--diloco-x-local-steps", "30"], 1200, (10, 600)),  # at most half the run
    (["--diloco-x-local-steps", "16"], 300, (5, 150)),  # the demo
    (["--diloco-x-local-steps", "4"], 1, (None, 0)),  # half the run is under H0: none
    (["--diloco-x-local-steps", "25"], 1000, (8, 496)),  # rounded down to a multiple of H0
    (["--diloco-x-local-steps", "2"], 3000, (None, 0)),  # H < 3: none
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-iters", "0"], 3000, (None, 0)),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-local-steps", "6"], 3000, (6, 900)),
    (["--diloco-x-local-steps", "30", "--diloco-x-warmup-iters", "60"], 90, (10, 60)),  # explicit W: as given
])
def test_auto_warmup(argv, train_iters, want):
    """The warm-up is on by default: H0 = min(H // 3, 10) for 30 H steps, at most half of
    --train-iters, rounded down to a multiple of H0; 0 turns it off; an explicit value is kept. The
    rule measured across H (benchmarks/RESULTS.md §2.3, results/convergence_h.json): a regression
    here changes the default's measured loss at H = 30, 100 or 300."""
    args = parse(*argv, *(["--diloco-x-warmup-local-steps", "auto"] if not argv else []))
    args.train_iters = train_iters
    cfg = config_from_args(args)
    assert (cfg.warmup_local_steps, cfg.warmup_iters) == want


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_auto_warmup_only_where_measured(overlap):
    """The auto warm-up (H0, W, tau_w and the int2 warm-up codec) was measured under ``partial`` and
    ``none`` only (benchmarks/RESULTS.md §2.1): under ``delayed`` / ``eager`` (rounds of H0 with a whole
    round of delay, never measured) ``auto`` resolves to no warm-up; explicit flags still give one."""
    args = parse("--diloco-x-local-steps", "30", "--diloco-x-overlap", overlap)
    args.train_iters = 3000
    cfg = config_from_args(args)
    assert (cfg.warmup_local_steps, cfg.warmup_iters, cfg.warmup_overlap_steps, cfg.warmup_compression) == (
        None, 0, 0, None)
    assert RoundSchedule(cfg).steps_since_boundary(10) == 10 and RoundSchedule(cfg).round_steps(0) == 30  # rounds of H from the start
    args = parse("--diloco-x-local-steps", "30", "--diloco-x-overlap", overlap, "--diloco-x-warmup-iters", "60")
    args.train_iters = 3000
    explicit = config_from_args(args)
    assert (explicit.warmup_local_steps, explicit.warmup_iters, explicit.warmup_compression) == (10, 60, "int2")
    for measured in ("partial", "none"):
        args = parse("--diloco-x-local-steps", "30", "--diloco-x-overlap", measured)
        args.train_iters = 3000
        assert (config_from_args(args).warmup_local_steps, config_from_args(args).warmup_iters) == (10, 900)


def test_kept_warmup_is_revalidated():
    """A resume keeps its checkpoint's auto warm-up (H0, W) over the one this run's flags resolved
    (``RestartPolicy.keep_schedule``): tau_w and the warm-up codec follow it, so the config stays
    valid. A checkpoint trained without a warm-up (a short run) resumed by a longer one: no tau_w, no
    warm-up codec; one with a warm-up resumed by a run whose flags resolved none: the auto rules."""
    from megatron_diloco.megatron_adapter.arguments import resolve_kept_warmup

    args = parse("--diloco-x-local-steps", "30")
    args.train_iters = 3000
    cfg = config_from_args(args)
    assert (cfg.warmup_local_steps, cfg.warmup_iters, cfg.warmup_overlap_steps, cfg.warmup_compression) == (
        10, 900, 1, "int2")
    cfg.warmup_local_steps, cfg.warmup_iters = None, 0  # the checkpoint's: no warm-up
    resolve_kept_warmup(cfg, had_warmup=True)
    assert (cfg.warmup_overlap_steps, cfg.warmup_compression) == (0, None)
    args.train_iters = 19  # half of it is under H0: none
    short = config_from_args(args)
    assert (short.warmup_iters, short.warmup_overlap_steps, short.warmup_compression) == (0, 0, None)
    short.warmup_local_steps, short.warmup_iters = 10, 900  # the checkpoint's
    resolve_kept_warmup(short, had_warmup=False)
    assert (short.warmup_overlap_steps, short.warmup_compression) == (1, "int2")
    explicit = config_from_args(parse("--diloco-x-local-steps", "30", "--diloco-x-warmup-overlap-steps", "5"))
    explicit.warmup_local_steps, explicit.warmup_iters = 3, 30  # tau_w 5 > H0 3: refused, naming the flag
    with pytest.raises(ValueError, match="--diloco-x-warmup-overlap-steps"):
        resolve_kept_warmup(explicit, had_warmup=True)


def test_defaults_are_the_measured_best():
    """--diloco-x alone: partial overlap with auto tau and the exact merge, eta 1, mu 0, int4, the
    auto warm-up (benchmarks/RESULTS.md §2); the CLI and the dataclass agree but for the warm-up,
    which the CLI resolves (it depends on --train-iters) and the dataclass leaves off."""
    cfg = config_from_args(parse())
    got = (cfg.replicas, cfg.local_steps, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.overlap,
           cfg.overlap_steps, cfg.merge, cfg.compression, cfg.warmup_local_steps, cfg.warmup_overlap_steps,
           cfg.warmup_compression)
    assert got == (2, 500, 1.0, 0.0, True, "partial", None, "exact", "int4", 10, 1, "int2")  # H0 min(500 // 3, 10)
    assert cfg.warmup_auto and not config_from_args(parse("--diloco-x-warmup-iters", "330")).warmup_auto
    assert dataclasses.replace(cfg, warmup_local_steps=None, warmup_iters=0, warmup_auto=False,
                               warmup_overlap_steps=0, warmup_compression=None) == DiLoCoXConfig()


@pytest.mark.parametrize("argv, want", [
    ([], 1),  # auto: H0 10 // 10
    (["--diloco-x-warmup-overlap-steps", "3"], 3),
    (["--diloco-x-warmup-overlap-steps", "0"], 0),
    (["--diloco-x-warmup-local-steps", "9"], 0),  # auto: 9 // 10, a warm-up round of 9 blocks
    (["--diloco-x-warmup-iters", "0"], 0),  # no warm-up
    (["--diloco-x-overlap", "none"], 0),
    (["--diloco-x-overlap", "delayed"], 0),
])
def test_auto_warmup_overlap(argv, want):
    """``--diloco-x-warmup-overlap-steps auto`` (the default): H0 // 10 with partial and a warm-up,
    else 0; an explicit value as given."""
    args = parse("--diloco-x-local-steps", "30", *argv)
    args.train_iters = 3000
    assert config_from_args(args).warmup_overlap_steps == want


@pytest.mark.parametrize("argv, want", [
    ([], "int2"),  # auto: int2 under int4 with a warm-up
    (["--diloco-x-warmup-compression", "auto"], "int2"),
    (["--diloco-x-warmup-iters", "0"], None),  # no warm-up
    (["--diloco-x-compression", "int8"], None),  # auto under another codec: its own
    (["--diloco-x-compression", "none"], None),
    (["--diloco-x-compression", "adaptive"], None),
    (["--diloco-x-warmup-compression", "int4"], None),  # the main codec itself
    (["--diloco-x-warmup-compression", "int8"], "int8"),
    (["--diloco-x-compression", "int8", "--diloco-x-warmup-compression", "int2"], "int2"),
])
def test_auto_warmup_compression(argv, want):
    """``--diloco-x-warmup-compression auto`` (the default): int2 under int4 with a warm-up, else
    the main codec's (None); an explicit codec as given."""
    args = parse("--diloco-x-local-steps", "30", *argv)
    args.train_iters = 3000
    assert config_from_args(args).warmup_compression == want


def test_valid_setup_sets_the_replica_topology():
    args = megatron_args()
    validate_megatron_args(args, DiLoCoXConfig(replicas=2))
    assert args.use_distributed_optimizer and args.use_tp_pp_dp_mapping
    assert args.num_distributed_optimizer_instances == 2


def test_async_save_with_the_host_outer_state_is_refused_naming_both_flags():
    """Megatron's async writer moves host tensors' storage to shared memory in place and writes them
    later: the host-held outer state would be saved as a mix of rounds. Refused before training,
    naming both flags; the device layout keeps --async-save."""
    args = megatron_args(async_save=True)
    with pytest.raises(ValueError, match="--async-save.*--diloco-x-outer-state host"):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2, outer_state="host"))
    validate_megatron_args(args, DiLoCoXConfig(replicas=2, outer_state = "device"))
    assert args.async_save


@pytest.mark.parametrize("kw, flag", [
    (dict(data_parallel_size=3), "--diloco-x-replicas"),
    (dict(num_distributed_optimizer_instances=4), "--num-distributed-optimizer-instances"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(use_megatron_fsdp=True), "--use-megatron-fsdp"),
    (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    (dict(data_parallel_random_init=True), "--data-parallel-random-init"),
    (dict(num_experts=8), "--num-experts"),
    (dict(check_weight_hash_across_dp_replicas_interval=10), "--check-weight-hash-across-dp-replicas-interval"),
    (dict(optimizer="muon"), "--optimizer"),
])
def test_incompatible_megatron_settings_are_refused_untouched(kw, flag):
    args = megatron_args(**kw)
    before = dict(vars(args))
    with pytest.raises(ValueError, match=flag):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2))
    assert vars(args) == before  # nothing was changed


def test_summary_line_round_trips_with_launcher_prefixes():
    """One format and one parser for the run summary (printed by integration, read by the tests and
    every benchmark launcher), also behind a launcher's per-line prefix."""
    from megatron_diloco.summary import format_summary, parse_summaries

    a, b = {"rounds": 3, "final_loss": 2.5, "replicas_identical": True}, {"rounds": 4, "link_mbps": None}
    log = f"noise\n{format_summary(a)}\n[rank0]: {format_summary(b)}\nDILOCOX SUMMARIES are not lines\n"
    assert parse_summaries(log) == [a, b]
    assert parse_summaries("no summary here") == []


def test_a_resume_keeps_an_auto_warmup_and_warns_on_changed_flags(caplog):
    """``RestartPolicy.keep_schedule``: an auto warm-up takes the checkpoint's (H0, W) when H is
    the same; explicit flags (or a changed H) keep this run's, with a warning naming the flags; an
    older checkpoint (no schedule) changes nothing."""
    import logging
    import types

    from megatron_diloco.algorithm.schedule import RoundSchedule
    from megatron_diloco.megatron_adapter.restart import RestartPolicy

    def resume(argv, train_iters, saved):
        args = parse("--diloco-x-local-steps", "30", *argv)
        args.train_iters = train_iters
        cfg = config_from_args(args)
        sync = types.SimpleNamespace(schedule_changed=lambda: None, schedule=RoundSchedule(cfg))
        RestartPolicy(sync, cfg).keep_schedule(saved, step_calls=600)
        return cfg

    saved = {"local_steps": 30, "warmup_local_steps": 10, "warmup_iters": 400}  # trained with --train-iters 1200
    assert (resume([], 3000, saved).warmup_iters, resume([], 3000, None).warmup_iters) == (400, 900)
    with caplog.at_level(logging.WARNING, logger="megatron_diloco.megatron_adapter.restart"):
        cfg = resume(["--diloco-x-warmup-iters", "900"], 3000, saved)
    assert cfg.warmup_iters == 900 and "--diloco-x-warmup-iters" in caplog.text
    changed = resume(["--diloco-x-local-steps", "20"], 3000, saved)  # H changed: the flags' auto warm-up
    assert (changed.local_steps, changed.warmup_local_steps, changed.warmup_iters) == (20, 6, 600)


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(overlap="delayed", merge="mix"), "--diloco-x-merge mix applies to --diloco-x-overlap partial"),
    (dict(mix_alpha=0.3), "--diloco-x-mix-alpha applies to --diloco-x-merge mix"),
    (dict(rank=8), "--diloco-x-rank applies to --diloco-x-compression lowrank"),
    (dict(energy=0.5, compression="int4"), "--diloco-x-energy applies to --diloco-x-compression adaptive"),
    (dict(nesterov=False), "--diloco-x-no-nesterov changes nothing"),
    (dict(outer_chunk_mb=4.0), "--diloco-x-outer-chunk-mb applies to --diloco-x-outer-state host"),
    (dict(bandwidth_mbps=1000.0, overlap="delayed"), "--diloco-x-bandwidth-mbps sizes auto tau"),
])
def test_settings_that_do_nothing_are_named(kwargs, phrase):
    """A flag set away from its default that the other flags make ineffective is named (install prints
    it as a warning); the same flag where it acts is not."""
    assert any(phrase in w for w in ineffective_settings(DiLoCoXConfig(replicas=2, **kwargs)))
    acting = {"merge": dict(overlap="partial", merge="mix"), "mix_alpha": dict(merge="mix", mix_alpha=0.3),
              "rank": dict(compression="lowrank", rank=8), "energy": dict(compression="adaptive", energy=0.5),
              "nesterov": dict(nesterov=False, outer_momentum=0.9), "outer_chunk_mb": dict(outer_state="host", outer_chunk_mb=4.0),
              "bandwidth_mbps": dict(bandwidth_mbps=1000.0)}
    field = next(k for k in acting if k in kwargs)
    assert ineffective_settings(DiLoCoXConfig(replicas=2, **acting[field])) == []


def test_an_outer_step_of_high_gain_is_warned_of_with_what_it_measured():
    """eta / (1 - mu) above 1.5 (the papers' 0.7 / 0.9: 7) gets a warning naming both flags and the measurements;
    the default and momentum at unit gain get none."""
    from megatron_diloco.algorithm.config import outer_step_warning

    said = outer_step_warning(DiLoCoXConfig(replicas=2, outer_lr=0.7, outer_momentum=0.9))
    assert said is not None and "--diloco-x-outer-lr 0.7 with --diloco-x-outer-momentum 0.9" in said
    assert "7 times over" in said and "diverged" in said
    assert outer_step_warning(DiLoCoXConfig(replicas=2, outer_lr=1.0, outer_momentum=0.5)) is not None  # gain 2
    assert outer_step_warning(DiLoCoXConfig()) is None
    assert outer_step_warning(DiLoCoXConfig(replicas=2, outer_lr=0.1, outer_momentum=0.9)) is None  # unit gain
    assert outer_step_warning(DiLoCoXConfig(replicas=2, outer_lr=1.4)) is None  # within 1.5


def test_more_than_two_replicas_are_told_the_outer_step_was_tuned_with_two():
    """With 4 replicas the default outer step measured +7.7% against AllReduce (2 replicas: +2.3%): a run of more
    than 2 replicas is told so, naming the flags; one of 2 is not; a high gain keeps its own warning."""
    from megatron_diloco.algorithm.config import outer_step_warning

    said = outer_step_warning(DiLoCoXConfig(replicas=4))
    assert said is not None and said.startswith("4 replicas") and "--diloco-x-outer-lr" in said and "+7.7%" in said
    assert outer_step_warning(DiLoCoXConfig(replicas=3, outer_lr=0.5, outer_momentum=0.5)) is not None
    assert outer_step_warning(DiLoCoXConfig(replicas=2)) is None
    assert "diverged" in outer_step_warning(DiLoCoXConfig(replicas=4, outer_lr=0.7, outer_momentum=0.9))


def test_defaults_have_no_ineffective_settings():
    assert ineffective_settings(DiLoCoXConfig()) == []


@pytest.mark.parametrize("kw, cfg, flag", [
    (dict(diloco_x_replica_index=0), {}, "--diloco-x-run"),  # no run name: a stray job could join
    (dict(diloco_x_run="r"), {}, "--diloco-x-replica-index"),  # no data slot
    (dict(diloco_x_run="r", diloco_x_replica_index=2), {}, "--diloco-x-replica-index"),  # slot out of range
    (dict(diloco_x_run="r", diloco_x_replica_index=0), dict(overlap="delayed"), "--diloco-x-overlap"),
    (dict(diloco_x_run="r", diloco_x_replica_index=0), dict(compression="lowrank"), "--diloco-x-compression"),
    (dict(diloco_x_run="r", diloco_x_replica_index=0, rampup_batch_size=[4, 4, 100]), {}, "--rampup-batch-size"),
    (dict(diloco_x_run="r", diloco_x_replica_index=0, diloco_x_outer_store="h:1"), {}, "--diloco-x-outer-store"),
    (dict(diloco_x_run="r", diloco_x_replica_index=0), {}, "needs --diloco-x-secret-file"),  # no secret: refused
    (dict(diloco_x_run="r", diloco_x_replica_index=0, diloco_x_secret_file="/nonexistent/run.secret"), {},
     "--diloco-x-secret-file /nonexistent/run.secret: cannot read"),
])
def test_separate_jobs_flags_are_checked_before_training(kw, cfg, flag):
    """``--diloco-x-lighthouse`` without what a job of a run needs, or with what it cannot run, is
    refused naming the flag, before anything is built."""
    args = megatron_args(diloco_x_lighthouse="127.0.0.1:29510", **kw)
    with pytest.raises(ValueError, match=flag):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2, **cfg))


@pytest.mark.parametrize("slots, extra, cfg, phrase", [
    (3, {}, {}, "a power of two up to 128"),
    (256, {}, {}, "a power of two up to 128"),
    (2, {}, {}, "not a multiple of this job's data-parallel size 4"),  # (DP 4)
    (64, {}, {}, "--ddp-bucket-size"),
    (8, dict(context_parallel_size=2), {}, "--context-parallel-size"),
    (8, {}, None, "applies with --diloco-x-lighthouse only"),
])
def test_exchange_slots_are_checked_before_training(tmp_path, slots, extra, cfg, phrase):
    """``--diloco-x-exchange-slots`` (sites of different data-parallel size) that cannot cut every site's buckets
    alike is refused naming the fix; G = 8 at DP 4 with the package's defaults is accepted."""
    secret = tmp_path / "run.secret"
    secret.write_text("a test secret of the run, 32 bytes or more")
    secret.chmod(0o600)
    jobs = dict(diloco_x_lighthouse="127.0.0.1:29510", diloco_x_run="r", diloco_x_replica_index=0,
                diloco_x_secret_file=str(secret))
    args = megatron_args(**({} if cfg is None else jobs), diloco_x_exchange_slots=slots, **extra)
    with pytest.raises(ValueError, match=re.escape(phrase)):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2, **(cfg or {})))
    validate_megatron_args(megatron_args(**jobs, diloco_x_exchange_slots=8), DiLoCoXConfig(replicas=2))


@pytest.mark.parametrize("chunks, extra, cfg, phrase", [
    (6, {}, {}, "not a multiple of this job's world size 4"),
    (8, dict(diloco_x_exchange_slots=4), {}, "and --diloco-x-exchange-slots: give one"),
    (8, dict(context_parallel_size=2), {}, "--context-parallel-size"),
    (8, {}, dict(compression="lowrank"), "takes --diloco-x-compression none or a blockwise codec"),
    (8, dict(diloco_x_data_slots=6), {}, "--diloco-x-data-slots 6 is not a multiple of this job's data-parallel size 4"),
    (None, dict(diloco_x_data_slots=4), {}, "--diloco-x-data-slots applies with --diloco-x-exchange-chunks only"),
    (8, {}, None, "applies with --diloco-x-lighthouse only"),
])
def test_exchange_chunks_are_checked_before_training(tmp_path, chunks, extra, cfg, phrase):
    """``--diloco-x-exchange-chunks`` (sites of different layout) that a site cannot hold, or with what it cannot
    run, is refused naming the fix; G = 8 on a world of 4 with the package's defaults is accepted."""
    secret = tmp_path / "run.secret"
    secret.write_text("a test secret of the run, 32 bytes or more")
    secret.chmod(0o600)
    jobs = dict(diloco_x_lighthouse="127.0.0.1:29510", diloco_x_run="r", diloco_x_replica_index=0,
                diloco_x_secret_file=str(secret), world_size=4)
    args = megatron_args(**({} if cfg is None else jobs), diloco_x_exchange_chunks=chunks, **extra)
    with pytest.raises(ValueError, match=re.escape(phrase)):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2, **(cfg or {})))
    validate_megatron_args(megatron_args(**jobs, diloco_x_exchange_chunks=8), DiLoCoXConfig(replicas=2))
    validate_megatron_args(megatron_args(**jobs, diloco_x_exchange_chunks=8, diloco_x_data_slots=4),
                           DiLoCoXConfig(replicas=2))


@pytest.mark.parametrize("unit, extra, jobs, phrase", [
    (3, {}, True, "--diloco-x-data-micro-batch 3 does not divide --micro-batch-size 4"),
    (0, {}, True, "--diloco-x-data-micro-batch 0 does not divide --micro-batch-size 4"),
    (2, dict(eval_micro_batch_size=3), True, "does not divide --eval-micro-batch-size 3"),
    (2, dict(dataloader_type="cyclic"), True, "needs Megatron's default sampler (--dataloader-type single"),
    (2, {}, False, "applies to separate jobs only (--diloco-x-lighthouse)"),
])
def test_data_micro_batch_is_checked_before_training(tmp_path, unit, extra, jobs, phrase):
    """``--diloco-x-data-micro-batch`` U (sites of different micro-batch) that does not divide a loader's
    micro-batch, with another sampler, or in one world, is refused naming the fix; U 2 under micro-batch 4 (and
    an evaluation micro-batch of 2) is accepted."""
    secret = tmp_path / "run.secret"
    secret.write_text("a test secret of the run, 32 bytes or more")
    secret.chmod(0o600)
    fed = dict(diloco_x_lighthouse="127.0.0.1:29510", diloco_x_run="r", diloco_x_replica_index=0,
               diloco_x_secret_file=str(secret))
    args = megatron_args(**(fed if jobs else {}), micro_batch_size=4, diloco_x_data_micro_batch=unit, **extra)
    with pytest.raises(ValueError, match=re.escape(phrase)):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2))
    validate_megatron_args(megatron_args(**fed, micro_batch_size=4, eval_micro_batch_size=2,
                                         diloco_x_data_micro_batch=2), DiLoCoXConfig(replicas=2))


def test_separate_jobs_flags_apply_with_the_lighthouse_only():
    args = megatron_args(diloco_x_run="r")
    with pytest.raises(ValueError, match="--diloco-x-run applies with --diloco-x-lighthouse only"):
        validate_megatron_args(args, DiLoCoXConfig(replicas=2))


# ------------------------------------------------------------------ --diloco-x-local-steps auto
def test_auto_local_steps_starts_at_the_lower_bound_with_its_warmup():
    """``auto`` starts at H 30, the H its warm-up is resolved from (H0 10 for 900 steps at 3000), and
    the flag still takes a number; anything else is refused by the parser, naming the choices."""
    from megatron_diloco.algorithm.config import AUTO_H_MIN

    args = parse("--diloco-x-local-steps", "auto")
    args.train_iters = 3000
    cfg = config_from_args(args)
    assert (cfg.local_steps, cfg.local_steps_auto, cfg.warmup_local_steps, cfg.warmup_iters) == (AUTO_H_MIN, True, 10, 900)
    fixed = config_from_args(parse("--diloco-x-local-steps", "30"))
    assert (fixed.local_steps, fixed.local_steps_auto) == (30, False)
    with pytest.raises(SystemExit):
        parse("--diloco-x-local-steps", "fast")


@pytest.mark.parametrize("argv, phrase", [
    (["--diloco-x-overlap", "none"], "it needs an overlapping --diloco-x-overlap"),
    (["--diloco-x-compression", "adaptive"], "--diloco-x-local-steps auto and --diloco-x-compression adaptive"),
])
def test_auto_local_steps_refused_where_it_cannot_hold(argv, phrase):
    with pytest.raises(ValueError, match=phrase):
        config_from_args(parse("--diloco-x-local-steps", "auto", *argv))
    config_from_args(parse("--diloco-x-local-steps", "30", *argv))  # a number: accepted


def test_auto_local_steps_is_refused_for_separate_jobs():
    """A joining job would need the run's agreed H and where its rounds began: refused before training."""
    problem = config_from_args(parse("--diloco-x-local-steps", "auto")).separate_jobs_problem()
    assert problem is not None and "--diloco-x-local-steps" in problem and "auto" in problem
    assert config_from_args(parse("--diloco-x-local-steps", "30")).separate_jobs_problem() is None


def test_auto_local_steps_proposal_bounds():
    """A rank's proposal: 8 x the steps that hide the exchange (tau at most an eighth of the round),
    within [30, 300]; none while the step time or the exchange is unknown."""
    from megatron_diloco.algorithm.schedule import auto_local_steps

    assert auto_local_steps(None, 0.1) == auto_local_steps(5.0, None) == 0
    assert auto_local_steps(0.3, 0.1) == 30  # 3 steps hide it, x 8 = 24: the lower bound
    assert auto_local_steps(1.0, 0.1) == 80  # 10 steps, x 8
    assert auto_local_steps(1.05, 0.1) == 88  # 10.5 steps: 11 hide it, x 8
    assert auto_local_steps(1e4, 0.1) == 300  # the upper bound


def _modular_boundaries(h0: int, w: int, h: int, steps: int) -> list[int]:
    """The fixed-H schedule as plain arithmetic: rounds of H0 up to W, then of H."""
    return [s for s in range(1, steps + 1) if (s % h0 == 0 if w and s <= w else (s - w) % h == 0)]


@pytest.mark.parametrize("h, h0, w", [(30, None, 0), (30, 10, 900), (7, 2, 6), (25, 8, 496), (1, None, 0)])
def test_fixed_local_steps_schedule_is_the_modular_one(h, h0, w):
    """A fixed H keeps the boundaries of plain modular arithmetic (the anchor stays at the warm-up's
    end); a restart changes nothing there."""
    cfg = DiLoCoXConfig(local_steps=h, warmup_local_steps=h0, warmup_iters=w)
    schedule = RoundSchedule(cfg)
    want = _modular_boundaries(h0 or 1, w, h, 2000)
    assert [s for s in range(1, 2001) if schedule.is_boundary(s)] == want
    schedule.restart()
    assert [s for s in range(1, 2001) if schedule.is_boundary(s)] == want
    with pytest.raises(RuntimeError, match="auto only"):
        schedule.begin_rounds(want[-1], 50)


def test_auto_local_steps_rounds_start_where_agreed_and_resume_there():
    """auto H: rounds of H0 10 up to 900, then of 30 (the start); H agreed at a boundary starts its
    rounds there (900: 120, then 1260: 45); a checkpoint's schedule restores H and that anchor (a
    resume with a fixed H does not take them); an H agreed off a boundary or inside the warm-up is a
    bug and raises."""
    cfg = DiLoCoXConfig(local_steps=30, local_steps_auto=True, warmup_local_steps=10, warmup_iters=900)
    schedule = RoundSchedule(cfg)
    with pytest.raises(RuntimeError, match="not at a boundary after the warm-up"):
        schedule.begin_rounds(890, 120)
    with pytest.raises(RuntimeError, match="not at a boundary"):
        schedule.begin_rounds(905, 120)
    schedule.begin_rounds(900, 0)  # no proposal: H stays
    assert schedule.round_steps(900) == 30 and schedule.anchor is None
    schedule.begin_rounds(900, 120)
    assert [s for s in range(880, 1400) if schedule.is_boundary(s)] == [880, 890, 900, 1020, 1140, 1260, 1380]
    schedule.begin_rounds(1260, 45)
    bounds = [s for s in range(1260, 1500) if schedule.is_boundary(s)]  # (asked from the last change on)
    assert bounds == [1260, 1305, 1350, 1395, 1440, 1485] and schedule.round_steps(1305) == 45
    saved = schedule.state_dict()
    assert saved == {"local_steps": 45, "warmup_local_steps": 10, "warmup_iters": 900,
                     "local_steps_auto": True, "anchor": 1260}
    resumed = RoundSchedule(dataclasses.replace(cfg, local_steps=30))
    assert resumed.load_auto(saved) and resumed.state_dict() == saved
    assert [s for s in range(1260, 1500) if resumed.is_boundary(s)] == bounds
    fixed = RoundSchedule(DiLoCoXConfig(local_steps=30, warmup_local_steps=10, warmup_iters=900))
    assert not fixed.load_auto(saved) and fixed.config.local_steps == 30 and fixed.anchor is None
    schedule.restart()  # a new outer loop: its warm-up again, then rounds of the last H
    assert [s for s in range(880, 1000) if schedule.is_boundary(s)] == [880, 890, 900, 945, 990]


def test_an_auto_warmup_lengthens_to_the_h_auto_chooses():
    """auto H with an auto warm-up: the warm-up starts as the one of H 30 (900 steps of 3000) and may
    grow to the one of H 300 (1500, half the run); an H agreed inside it lengthens it to that H's
    (30 x H, capped, a multiple of H0), never shortens it, and is refused outside it. A given warm-up,
    or a fixed H, does not follow H; the checkpoint's lengthened warm-up comes back on a resume."""
    auto = config_from_args(parse("--diloco-x-local-steps", "auto"))
    assert (auto.warmup_local_steps, auto.warmup_iters, auto.warmup_iters_max) == (10, 900, 9000)  # run length unknown
    args = parse("--diloco-x-local-steps", "auto")
    args.train_iters = 3000
    cfg = config_from_args(args)
    assert (cfg.warmup_iters, cfg.warmup_iters_max) == (900, 1500)
    args = parse("--diloco-x-local-steps", "auto", "--diloco-x-warmup-iters", "600")
    args.train_iters = 3000
    assert config_from_args(args).warmup_iters_max == 0  # a given warm-up stays as given
    args = parse("--diloco-x-local-steps", "100")
    args.train_iters = 3000
    assert config_from_args(args).warmup_iters_max == 0
    with pytest.raises(ValueError, match="needs --diloco-x-local-steps auto"):
        DiLoCoXConfig(local_steps=30, warmup_local_steps=10, warmup_iters=900, warmup_auto=True,
                      warmup_iters_max=1500).validate()
    with pytest.raises(ValueError, match="multiple of H0"):
        dataclasses.replace(cfg, warmup_iters_max=1505).validate()

    schedule = RoundSchedule(cfg)
    assert schedule.warmup_follows_h(890) and not schedule.warmup_follows_h(900)
    schedule.extend_warmup(20, 40)  # H 40 agreed after 20 steps: its warm-up, 1200 steps
    assert cfg.warmup_iters == 1200 and schedule.round_steps(890) == 10 and schedule.is_boundary(1190)
    schedule.extend_warmup(30, 35)  # a shorter H later: the warm-up does not shorten
    assert cfg.warmup_iters == 1200
    saved = schedule.state_dict()
    schedule.extend_warmup(40, 300)  # 9000 capped at half the run
    assert cfg.warmup_iters == 1500 and not schedule.warmup_follows_h(40)
    with pytest.raises(RuntimeError, match="lengthens with auto H inside an auto warm-up only"):
        schedule.extend_warmup(50, 300)
    cfg.validate()
    assert [s for s in range(1480, 1600) if schedule.is_boundary(s)] == [1480, 1490, 1500, 1530, 1560, 1590]
    resumed = RoundSchedule(dataclasses.replace(cfg, warmup_iters=900))
    assert resumed.load_auto(saved) and resumed.config.warmup_iters == 1200 and resumed.state_dict() == saved
    fixed = RoundSchedule(DiLoCoXConfig(local_steps=30, local_steps_auto=True, warmup_local_steps=10,
                                        warmup_iters=900, warmup_auto=True))
    assert not fixed.warmup_follows_h(10)  # no longest warm-up given: the warm-up is fixed


def test_a_resume_keeps_an_auto_local_steps_run_where_it_was(caplog):
    """``RestartPolicy.keep_schedule`` with auto H on both sides: the checkpoint's H and anchor,
    logged; with a fixed H now: the flags' H, with the warning that names them."""
    import logging
    import types

    from megatron_diloco.megatron_adapter.restart import RestartPolicy

    def resume(*argv):
        args = parse(*argv)
        args.train_iters = 3000
        cfg = config_from_args(args)
        sync = types.SimpleNamespace(schedule_changed=lambda: None, schedule=RoundSchedule(cfg))
        RestartPolicy(sync, cfg).keep_schedule(saved, step_calls=1300)
        return sync.schedule

    saved = {"local_steps": 120, "warmup_local_steps": 10, "warmup_iters": 900, "local_steps_auto": True, "anchor": 1020}
    with caplog.at_level(logging.INFO, logger="megatron_diloco.megatron_adapter.restart"):
        auto = resume("--diloco-x-local-steps", "auto")
    assert (auto.config.local_steps, auto.anchor) == (120, 1020) and "auto H resumes with the checkpoint's H 120" in caplog.text
    with caplog.at_level(logging.WARNING, logger="megatron_diloco.megatron_adapter.restart"):
        fixed = resume("--diloco-x-local-steps", "30")
    assert (fixed.config.local_steps, fixed.anchor) == (30, None) and "--diloco-x-local-steps" in caplog.text


@pytest.mark.parametrize("pace, extra, cfg, phrase", [
    (0.5, {}, {}, "--diloco-x-site-pace (the most a job's round may exceed the run's"),
    (32.0, {}, {}, "must be a number in [1, 16.0]"),
    (2.0, {}, dict(local_steps_auto=True, local_steps=32, overlap_steps=None), "not auto"),
    (2.0, dict(train_iters=None, train_samples=1000), {}, "--train-iters"),
    (2.0, {}, None, "applies with --diloco-x-lighthouse only"),
])
def test_site_pace_is_checked_before_training(tmp_path, pace, extra, cfg, phrase):
    """``--diloco-x-site-pace`` out of range, with auto H, without the run's length in iterations or without
    separate jobs is refused naming the fix; 4 with the package's defaults is accepted."""
    secret = tmp_path / "run.secret"
    secret.write_text("a test secret of the run, 32 bytes or more")
    secret.chmod(0o600)
    jobs = dict(diloco_x_lighthouse="127.0.0.1:29510", diloco_x_run="r", diloco_x_replica_index=0,
                diloco_x_secret_file=str(secret), train_iters=100)
    with pytest.raises(ValueError, match=re.escape(phrase)):
        config = DiLoCoXConfig(replicas=2, site_pace=pace, **(cfg or {}))
        validate_megatron_args(megatron_args(**{**({} if cfg is None else jobs), **extra}), config)
    validate_megatron_args(megatron_args(**jobs), DiLoCoXConfig(replicas=2, site_pace=4.0))


def test_site_weights_are_checked_before_training():
    """``--diloco-x-site-weights``: a value outside its choices is refused by the config (argparse's choices for the
    flag), ``normalized`` in one world naming --diloco-x-lighthouse; with separate jobs it is accepted."""
    with pytest.raises(ValueError, match="--diloco-x-site-weights must be one of tokens, normalized"):
        DiLoCoXConfig(replicas=2, site_weights="steps")
    with pytest.raises(ValueError, match="--diloco-x-site-weights applies with --diloco-x-lighthouse only"):
        validate_megatron_args(megatron_args(), DiLoCoXConfig(replicas=2, site_weights="normalized"))
    parser = add_diloco_x_args(argparse.ArgumentParser())
    assert parser.parse_args(["--diloco-x"]).diloco_x_site_weights == "tokens"
    with pytest.raises(SystemExit):
        parser.parse_args(["--diloco-x", "--diloco-x-site-weights", "steps"])
