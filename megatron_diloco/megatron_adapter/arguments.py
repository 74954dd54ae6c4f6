"""The ``--diloco-x*`` argparse group and its translation into Megatron arguments.

``add_diloco_x_args`` has the signature Megatron expects of an ``extra_args_provider``
(``parser -> parser``). ``config_from_args`` builds a validated :class:`DiLoCoXConfig`;
``validate_megatron_args`` rejects Megatron settings that cannot work with DiLoCoX and sets the ones
DiLoCoX implies (distributed optimizer, one optimizer instance per replica, contiguous replicas).
"""

from __future__ import annotations

import argparse

from megatron_diloco.compat.help import escape_unformattable_help
from megatron_diloco.algorithm.schedule import auto_warmup_iters
from megatron_diloco.algorithm.config import (AUTO_H_MAX, AUTO_H_MIN, AUTO_H_PER_TAU, WARMUP_H_MULTIPLE,
                                              WARMUP_MAX_SHARE, BLOCKWISE, CODECS, MERGE_RULES,
                                              OUTER_STATE_ALIASES, OUTER_STATES, OVERLAP_MODES, SITE_WEIGHTS,
                                              DiLoCoXConfig)


def add_diloco_x_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the DiLoCoX flags to a Megatron argument parser and return it."""
    defaults = DiLoCoXConfig.__dataclass_fields__
    group = parser.add_argument_group(title="DiLoCoX (megatron-diloco)")
    group.add_argument("--diloco-x", action="store_true", default=False,
                       help="Enable DiLoCoX: replicas train H local steps, then exchange "
                            "pseudo-gradients over the slow network and take an outer Nesterov step.")
    group.add_argument("--diloco-x-replicas", type=int, default=defaults["replicas"].default,
                       help="R: number of model replicas (clusters). Must divide the data-parallel "
                            "size; sets --num-distributed-optimizer-instances R and "
                            "--use-tp-pp-dp-mapping so each replica is a contiguous block of ranks.")
    group.add_argument("--diloco-x-local-steps", type=_local_steps, default=defaults["local_steps"].default,
                       metavar="H|auto",
                       help="H: inner optimizer steps per outer round. auto: at every boundary after the "
                            f"warm-up, {AUTO_H_PER_TAU} x the steps that hide the exchange (from the measured step "
                            "time and link), so that the exchange overlaps at most an eighth of the round, "
                            f"within [{AUTO_H_MIN}, {AUTO_H_MAX}] "
                            f"(starting at {AUTO_H_MIN}; an auto warm-up lengthens to the one of the H the link "
                            "asks for during it); needs an overlapping --diloco-x-overlap, not with "
                            "--diloco-x-compression adaptive or --diloco-x-lighthouse.")
    group.add_argument("--diloco-x-warmup-local-steps", type=_int_or_auto, default=None, metavar="H0|auto",
                       help="H0: rounds of H0 inner steps (1..H) during the first --diloco-x-warmup-iters "
                            "steps, then rounds of H; with --diloco-x-overlap partial these shorter rounds "
                            "overlap at most --diloco-x-warmup-overlap-steps. Default auto: "
                            f"H // {WARMUP_H_DIVISOR}, at most {WARMUP_H0_MAX} (the auto warm-up applies to --diloco-x-overlap partial "
                            "and none only, where it was measured; with delayed / eager auto means no warm-up).")
    group.add_argument("--diloco-x-warmup-iters", type=_int_or_auto, default=None, metavar="W|auto",
                       help="Inner steps of the warm-up (a multiple of H0); 0: no warm-up. Default auto: "
                            f"{WARMUP_H_MULTIPLE} x H, at most 1/{WARMUP_MAX_SHARE} of the run's iterations "
                            "(--train-iters, or --train-samples as Megatron converts it), rounded down to a "
                            "multiple of H0 (none when that is 0 or H < 3), with --diloco-x-overlap partial or "
                            "none only (measured there; delayed / eager: none, give the flags to have one). "
                            "Why and what it buys: docs/tuning.md, Warm-up.")
    group.add_argument("--diloco-x-warmup-overlap-steps", type=_int_or_auto, default=None, metavar="TAU_W|auto",
                       help="--diloco-x-overlap partial: the most inner steps an exchange launched into "
                            "a warm-up round may overlap (0..H0; 0 blocks); its tau is the smaller of this "
                            f"and the tau the rounds of H take. Default auto: H0 // {WARMUP_OVERLAP_DIVISOR} "
                            "(docs/tuning.md, Warm-up overlap and codec).")
    group.add_argument("--diloco-x-outer-lr", type=float, default=defaults["outer_lr"].default,
                       help="eta: outer learning rate (default 1.0: with mu 0 the outer step is the "
                            "replicas' mean).")
    group.add_argument("--diloco-x-outer-momentum", type=float,
                       default=defaults["outer_momentum"].default,
                       help="mu: outer momentum (default 0; with Adam inner steps momentum has hurt here: "
                            "docs/tuning.md, Outer lr and momentum).")
    group.add_argument("--diloco-x-no-nesterov", action="store_true", default=False,
                       help="Use heavy-ball instead of Nesterov momentum for the outer step.")
    group.add_argument("--diloco-x-overlap", choices=OVERLAP_MODES, default=defaults["overlap"].default,
                       help="partial (default): the exchange launched at a boundary is applied tau "
                            "inner steps later (--diloco-x-overlap-steps, default auto), the local "
                            "progress of those steps merged in (--diloco-x-merge); "
                            "delayed: one-step-delay overlap (round t's exchange runs during round "
                            "t+1, applied one round late); eager: delayed plus each replica's own "
                            "fresh pseudo-gradient applied at once; none: blocking exchange (plain DiLoCo).")
    group.add_argument("--diloco-x-overlap-steps", type=_int_or_auto, default=None,
                       help="partial only: tau, inner steps from a boundary to the application of its "
                            "exchange, 0..H; 'auto' (default): the fewest steps that hide the last "
                            "measured exchange, re-chosen every boundary.")
    group.add_argument("--diloco-x-merge", choices=MERGE_RULES, default=defaults["merge"].default,
                       help="partial only: exact (default): x <- theta_new + (x - x_at_launch); mix: "
                            "x <- alpha x + (1 - alpha) theta_new (Streaming DiLoCo).")
    group.add_argument("--diloco-x-mix-alpha", type=float, default=defaults["mix_alpha"].default,
                       help="partial with --diloco-x-merge mix: alpha (default 0.5).")
    group.add_argument("--diloco-x-eager-weight", type=float, default=None,
                       help="eager only: weight of the replica's own fresh pseudo-gradient in its "
                            "look-ahead, in (0, 1]; default 1/R (Kale et al.); 1: the full look-ahead.")
    group.add_argument("--diloco-x-compression", choices=list(CODECS),
                       default=defaults["compression"].default,
                       help="Pseudo-gradient codec (default int4; see the README).")
    group.add_argument("--diloco-x-warmup-compression", default=None, metavar="CODEC|auto",
                       choices=["auto", *BLOCKWISE],
                       help="The codec of the exchanges launched into a warm-up round (int8, int4, fp8, "
                            "int2; with a blockwise --diloco-x-compression, whose error-feedback residual it "
                            "shares). Default auto: int2 (ternary, 1.9x fewer bytes) under int4 with a "
                            "warm-up, else --diloco-x-compression's.")
    group.add_argument("--diloco-x-rank", type=int, default=defaults["rank"].default,
                       help="Rank of the lowrank / lowrank-int8 codecs.")
    group.add_argument("--diloco-x-energy", type=float, default=defaults["energy"].default,
                       help="adaptive: captured-energy target per tensor, in (0, 1].")
    group.add_argument("--diloco-x-bandwidth-mbps", type=float, default=None,
                       help="The site's slow link (Mbit/s of payload, each way): the one link a replica's "
                            "ranks share to reach the other replicas. Every rank of the replica that holds "
                            "a shard sends its exchange at the same time, so each counts on this / their "
                            "number (as the planner's --link-mbps with --link-scope cluster). Sizes auto "
                            "tau (--diloco-x-overlap-steps) and the adaptive codec's per-round byte cap. "
                            "Default: adaptive measures it at the first boundary (all outer groups at "
                            "once, so a rank's share directly); auto tau then uses measured exchange times.")
    group.add_argument("--diloco-x-outer-state", choices=OUTER_STATES, default=defaults["outer_state"].default,
                       type=lambda v: OUTER_STATE_ALIASES.get(v, v),  # the earlier names, as the current ones
                       help="Where the outer state (theta, outer momentum, error-feedback residual, eager "
                            "anchor) lives: device (default: the GPU) or host (host memory, pinned; streamed "
                            "through the GPU in chunks at each boundary; same results, less GPU memory). "
                            f"host supports the codecs none, {', '.join(BLOCKWISE)}. The earlier names gpu "
                            "and cpu are accepted.")
    group.add_argument("--diloco-x-outer-chunk-mb", type=float, default=defaults["outer_chunk_mb"].default,
                       help="--diloco-x-outer-state host: MiB of fp32 per staged chunk (default 16).")
    # Replicas as separate launches with a fixed membership, joined through a TCP store hosted by
    # replica 0's rank 0 (no checkpoints, no failures survived): kept, unlisted, for the benchmarks that
    # put single-GPU replicas on one GPU; users run separate jobs with --diloco-x-lighthouse.
    group.add_argument("--diloco-x-outer-store", default=None, metavar="HOST:PORT", help=argparse.SUPPRESS)
    group.add_argument("--diloco-x-replica-index", type=int, default=None,
                       help="With --diloco-x-lighthouse: this job's data slot, "
                            "0..R-1 (R = --diloco-x-replicas, the most jobs the run has): the job reads "
                            "the samples replica I of R reads in one world, through restarts and "
                            "membership changes; unique per job.")
    group.add_argument("--diloco-x-lighthouse", default=None, metavar="HOST:PORT",
                       help="Replicas as separate jobs that meet, fail, heal and rejoin: this job (its own "
                            "torchrun world, TP x PP x DP inside) is one replica of the run coordinated by "
                            "the torchft lighthouse at HOST:PORT (start it with torchft_lighthouse). Jobs "
                            "may start at any time; a job that is behind receives the run's outer state "
                            "from a live peer at the next boundary. Needs --diloco-x-run, "
                            "--diloco-x-replica-index. Default: all replicas in this one world.")
    group.add_argument("--diloco-x-run", default=None, metavar="NAME",
                       help="With --diloco-x-lighthouse: the run's name; jobs of another run (or with other "
                            "flags) are refused, naming the flag that differs.")
    group.add_argument("--diloco-x-replica-id", default=None, metavar="NAME",
                       help="With --diloco-x-lighthouse: this job's name in the run (default: "
                            "replica<--diloco-x-replica-index>); a restarted job keeps its name.")
    group.add_argument("--diloco-x-advertise-host", default=None, metavar="HOST",
                       help="With --diloco-x-lighthouse: the address the other jobs reach this job's rank 0 "
                            "at (its federation store and torchft manager; the same value on every rank of "
                            "the job; default: this host's fully qualified name). The other ranks' gloo and "
                            "heal connections use their own host names (GLOO_SOCKET_IFNAME selects the "
                            "interface).")
    group.add_argument("--diloco-x-secret-file", default=None, metavar="PATH",
                       help="With --diloco-x-lighthouse (required): a file holding the run's secret, the same "
                            "on every job (at least 16 bytes; e.g. head -c 32 /dev/urandom | base64 > "
                            "run.secret, chmod 600, copied to each site over a channel you trust). Every "
                            "handshake and heal between jobs is authenticated with it; a job without it "
                            "is refused.")
    group.add_argument("--diloco-x-meeting-timeout-minutes", type=float, default=15.0,
                       help="With --diloco-x-lighthouse: the longest one boundary's meeting may take (the "
                            "quorum, the handshake, a heal); past it the job trains the round alone and "
                            "meets again at the next boundary. Must exceed the lighthouse's "
                            "--join_timeout_ms plus a heal (default 15).")
    group.add_argument("--diloco-x-alone-timeout-minutes", type=float, default=60.0,
                       help="With --diloco-x-lighthouse: a job that meets no other job for this long (the "
                            "lighthouse unreachable, every meeting failing) stops with an error naming the "
                            "lighthouse; until then it trains alone and meets again at each boundary "
                            "(default 60).")
    group.add_argument("--diloco-x-federation-port", type=int, default=0,
                       help="With --diloco-x-lighthouse: the port of this job's federation store on its "
                            "rank 0, which the other jobs connect to (default 0: any free port).")
    group.add_argument("--diloco-x-exchange-slots", type=int, default=None, metavar="G",
                       help="With --diloco-x-lighthouse, for sites of different data-parallel size: the largest "
                            "site's data-parallel size, the same on every job of the run. A rank of a site of DP d "
                            "exchanges its shard as G / d slots, each with the ranks of the other sites that hold "
                            "the same slot. A power of two up to 128 and a multiple of this job's DP; above 40 "
                            "every job needs the same --ddp-bucket-size. Default: every job has the same DP.")
    group.add_argument("--diloco-x-exchange-chunks", type=int, default=None, metavar="G",
                       help="With --diloco-x-lighthouse, for sites of different tensor / pipeline / data parallelism "
                            "(and world size): the model's parameters, by their names in Megatron's distributed "
                            "checkpoint, cut into G chunks of equal size, the same on every job of the run; each "
                            "rank holds G / its world size of them and exchanges each with the ranks of the other "
                            "sites that hold the same chunk. Each rank gathers its chunks from the site's main "
                            "shards (all-to-all over the site's fast network) at every boundary and scatters them "
                            "back. A multiple of every job's world size. Every site needs the same padded "
                            "vocabulary (--make-vocab-size-divisible-by x TP alike). Default: every job has the "
                            "same layout.")
    group.add_argument("--diloco-x-data-slots", type=int, default=None, metavar="D",
                       help="With --diloco-x-exchange-chunks: every job reads its samples as D data-parallel ranks "
                            "would, D the largest site's data-parallel size, the same on every job (a rank of a "
                            "site of DP d reads as the first of its D / d). Default: G, which sizes each job's "
                            "datasets (and Megatron's sample index) G / DP times its own samples.")
    group.add_argument("--diloco-x-data-micro-batch", type=int, default=None, metavar="U",
                       help="With --diloco-x-lighthouse, for sites of different micro-batch: the samples are dealt "
                            "out in micro-batches of U, the same on every job, and each of this job's micro-batches "
                            "(--micro-batch-size, --eval-micro-batch-size: multiples of U) is that many of them in "
                            "a row, so that jobs of any micro-batch read disjoint samples. Default: this job's "
                            "--micro-batch-size (every job the same).")
    group.add_argument("--diloco-x-site-pace", type=float, default=None, metavar="P",
                       help="With --diloco-x-lighthouse, for sites of different speed: each job runs, in every "
                            "round of the run, the inner steps that fit the slowest job's round, from the step "
                            "times measured at each boundary: floor(L x slowest step / own step) for a run round "
                            "of L steps, at most P x L (1 <= P <= 16). Give every job the same flags, as for jobs "
                            "of equal speed (--diloco-x-local-steps, --train-iters, the LR schedule): they are the "
                            "run's rounds, which the slowest job runs; a faster job runs more steps per round, "
                            "follows the LR schedule by the run's progress and ends with the run. Each job's "
                            "iteration and data position stay its own. Default: every job runs the run's rounds.")
    group.add_argument("--diloco-x-site-weights", choices=SITE_WEIGHTS, default=SITE_WEIGHTS[0],
                       help="With --diloco-x-lighthouse, how a round's mean weighs the jobs: tokens (the default): "
                            "each job's pseudo-gradient by the tokens it trained on in the round; normalized: each "
                            "divided by its inner steps, weighed by its tokens, and the mean scaled by the jobs' "
                            "token-weighted mean steps (FedNova's normalized averaging), so that a job running more "
                            "steps per round (--diloco-x-site-pace, its own --diloco-x-local-steps) does not pull "
                            "further for its longer pseudo-gradient. The same on every job of a run.")
    group.add_argument("--diloco-x-outer-timeout-minutes", type=float, default=None,
                       help="T: an exchange over the outer groups (and the boundary's skip decision, the "
                            "link measurement) must complete within T minutes of its launch, else the run "
                            "ends with an error naming the round and the group; the groups' own timeouts "
                            "are set to 1.25 T + 1 min as a backstop. Default: derived at each launch as "
                            "max(--distributed-timeout-minutes, 4 x H (a paced job's own round, if longer) x "
                            "inner-step time of the last round, "
                            "4 x the longest exchange so far); give it when one exchange may take longer "
                            "than that (e.g. a first blocking exchange over a very slow link).")
    escape_unformattable_help(parser)  # megatron-core 0.19.2 has a help string argparse cannot print
    return parser


#: the auto warm-up (``--diloco-x-warmup-local-steps`` / ``--diloco-x-warmup-iters``): rounds of
#: min(H // WARMUP_H_DIVISOR, WARMUP_H0_MAX) for the first WARMUP_H_MULTIPLE x H inner steps, at most
#: 1 / WARMUP_MAX_SHARE of the run (schedule.auto_warmup_iters; benchmarks/RESULTS.md §2.1: H 30, H0 10,
#: 900 of 3000 steps; §2.3: H 100 and 300, H0 10 for 1500 of 3000 steps, against H // 3 for 1000 and H0
#: 10 for 900)
WARMUP_H_DIVISOR, WARMUP_H0_MAX = 3, 10


#: the auto warm-up overlap (``--diloco-x-warmup-overlap-steps``): at most H0 // WARMUP_OVERLAP_DIVISOR
#: steps, a tenth of a warm-up round (benchmarks/RESULTS.md §2.1: 1, 2, 3, 4 of H0 = 10 measured)
WARMUP_OVERLAP_DIVISOR = 10


#: the overlap modes the auto warm-up was measured with (benchmarks/RESULTS.md §2.1: partial and
#: blocking); under ``delayed`` / ``eager`` the ``auto`` warm-up rules resolve to no warm-up (never
#: measured there: rounds of H0 with a whole round of delay were seen to raise the loss)
WARMUP_AUTO_OVERLAPS: tuple[str, ...] = ("partial", "none")


#: the auto warm-up codec per --diloco-x-compression (benchmarks/RESULTS.md §2.1: measured under int4)
WARMUP_CODEC_AUTO: dict[str, str] = {"int4": "int2"}


def resolve_warmup_compression(warmup_compression: str | None, compression: str, warmup_iters: int) -> str | None:
    """The codec of the warm-up's exchanges from ``--diloco-x-warmup-compression`` (None or
    ``auto``: :data:`WARMUP_CODEC_AUTO`'s for ``compression`` when there is a warm-up, else None, the
    main codec's). An explicit codec is returned as given (:class:`DiLoCoXConfig` validates it), None
    where it is ``compression`` itself."""
    if warmup_compression not in (None, "auto"):
        return None if warmup_compression == compression else warmup_compression
    return WARMUP_CODEC_AUTO.get(compression) if warmup_iters else None


def resolve_warmup_overlap(warmup_overlap_steps: int | None, warmup_local_steps: int | None, overlap: str) -> int:
    """tau_w, the most steps an exchange launched into a warm-up round of H0 overlaps, from its flag
    (None: ``auto``, H0 // :data:`WARMUP_OVERLAP_DIVISOR` with ``partial`` and a warm-up, else 0). An
    explicit value is returned as given (:class:`DiLoCoXConfig` validates it)."""
    if warmup_overlap_steps is not None:
        return warmup_overlap_steps
    if overlap != "partial" or not isinstance(warmup_local_steps, int) or warmup_local_steps < 1:
        return 0
    return warmup_local_steps // WARMUP_OVERLAP_DIVISOR


def resolve_warmup(warmup_local_steps: int | None, warmup_iters: int | None, local_steps: int,
                   train_iters: int | None, overlap: str = "partial") -> tuple[int | None, int]:
    """(H0, W) of the warm-up from the two flags, None meaning ``auto`` (see their help); (None, 0):
    no warm-up. An explicit value is returned as given (:class:`DiLoCoXConfig` validates it). An
    ``auto`` W is a warm-up only under the overlap modes it was measured with
    (:data:`WARMUP_AUTO_OVERLAPS`); under ``delayed`` / ``eager`` it resolves to none."""
    if warmup_iters == 0 or (warmup_iters is None and overlap not in WARMUP_AUTO_OVERLAPS):
        return None, 0
    h0 = min(local_steps // WARMUP_H_DIVISOR, WARMUP_H0_MAX) if warmup_local_steps is None else warmup_local_steps
    if warmup_iters is not None:
        return h0, warmup_iters
    if not isinstance(h0, int) or h0 < 1:  # auto with H < 3, or a bad H0 (validated as given)
        return (None, 0) if warmup_local_steps is None else (h0, WARMUP_H_MULTIPLE * local_steps)
    w = auto_warmup_iters(local_steps, h0, train_iters)
    return (h0, w) if w > 0 else (None, 0)


def _local_steps(value: str) -> int | str:
    """``--diloco-x-local-steps``: an integer, or 'auto' (kept as the string)."""
    return "auto" if value == "auto" else _int_or_auto(value)


def _int_or_auto(value: str) -> int | None:
    """``--diloco-x-overlap-steps`` and the warm-up flags: 'auto' (None) or an integer."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {value!r}") from None


def config_from_args(args: argparse.Namespace) -> DiLoCoXConfig:
    """Build the validated config from parsed ``--diloco-x*`` arguments (raises ``ValueError``). An
    ``auto`` H starts at :data:`AUTO_H_MIN`, the H its warm-up is resolved from."""
    auto_h = args.diloco_x_local_steps == "auto"
    local_steps = AUTO_H_MIN if auto_h else args.diloco_x_local_steps
    warmup_local_steps, warmup_iters = resolve_warmup(
        getattr(args, "diloco_x_warmup_local_steps", None), getattr(args, "diloco_x_warmup_iters", None),
        local_steps, getattr(args, "train_iters", None), args.diloco_x_overlap)
    return DiLoCoXConfig(
        replicas=args.diloco_x_replicas,
        local_steps=local_steps,
        local_steps_auto=auto_h,
        warmup_local_steps=warmup_local_steps,
        warmup_iters=warmup_iters,
        warmup_auto=getattr(args, "diloco_x_warmup_iters", None) is None,
        # auto H with an auto warm-up: the warm-up may lengthen to the one of the largest H auto chooses
        warmup_iters_max=auto_warmup_iters(AUTO_H_MAX, warmup_local_steps, getattr(args, "train_iters", None))
        if auto_h and warmup_iters and getattr(args, "diloco_x_warmup_iters", None) is None else 0,
        warmup_overlap_steps=resolve_warmup_overlap(getattr(args, "diloco_x_warmup_overlap_steps", None),
                                                    warmup_local_steps, args.diloco_x_overlap),
        outer_lr=args.diloco_x_outer_lr,
        outer_momentum=args.diloco_x_outer_momentum,
        nesterov=not args.diloco_x_no_nesterov,
        overlap=args.diloco_x_overlap,
        overlap_steps=getattr(args, "diloco_x_overlap_steps", None),
        merge=getattr(args, "diloco_x_merge", "exact"),
        mix_alpha=getattr(args, "diloco_x_mix_alpha", 0.5),
        eager_weight=args.diloco_x_eager_weight,
        compression=args.diloco_x_compression,
        warmup_compression=resolve_warmup_compression(getattr(args, "diloco_x_warmup_compression", None),
                                                      args.diloco_x_compression, warmup_iters),
        rank=args.diloco_x_rank,
        energy=args.diloco_x_energy,
        bandwidth_mbps=args.diloco_x_bandwidth_mbps,
        outer_state=getattr(args, "diloco_x_outer_state", "device"),
        outer_chunk_mb=getattr(args, "diloco_x_outer_chunk_mb", 16.0),
        outer_timeout_minutes=getattr(args, "diloco_x_outer_timeout_minutes", None),
        site_pace=getattr(args, "diloco_x_site_pace", None),
        site_weights=getattr(args, "diloco_x_site_weights", "tokens"),
        # Megatron's own collective timeout: the floor of the derived outer timeout
        distributed_timeout_minutes=float(getattr(args, "distributed_timeout_minutes", None) or 10.0),
    )


def resolve_run_length(config: DiLoCoXConfig, args: argparse.Namespace) -> bool:
    """Re-resolve the ``auto`` warm-up against the run's iterations once Megatron knows them and
    return whether it changed. Under ``--train-samples`` Megatron sets ``args.train_iters`` (from the
    samples and the global batch, its batch-size schedule included: ``update_train_iters``) only
    when it builds the LR scheduler, after :func:`config_from_args` resolved the warm-up without it:
    the cap (half the run) is applied here. ``config`` is updated in place (H0, W, tau_w, the
    warm-up codec; validated), so every holder of it sees the same schedule."""
    if not config.warmup_auto:
        return False
    fresh = config_from_args(args)
    fields = ("warmup_local_steps", "warmup_iters", "warmup_overlap_steps", "warmup_compression", "warmup_iters_max")
    if all(getattr(fresh, f) == getattr(config, f) for f in fields):
        return False
    for f in fields:
        setattr(config, f, getattr(fresh, f))
    config.validate()
    return True


def resolve_kept_warmup(config: DiLoCoXConfig, had_warmup: bool) -> None:
    """A resume kept its checkpoint's auto warm-up (H0, W) over the one this run's flags resolved
    (``RestartPolicy.keep_schedule``): make tau_w and the warm-up codec go with it, then validate.
    No warm-up kept: tau_w 0, no warm-up codec. A warm-up kept where this run's flags resolved none
    (so tau_w and the codec were resolved without one; an explicit value would have been refused):
    the ``auto`` rules for it. Otherwise this run's values stay (validated against the kept H0).
    Raises ``ValueError`` naming the flag when they do not fit."""
    if not config.warmup_iters:
        config.warmup_local_steps = None
        config.warmup_overlap_steps, config.warmup_compression = 0, None
    elif not had_warmup:
        config.warmup_overlap_steps = resolve_warmup_overlap(None, config.warmup_local_steps, config.overlap)
        config.warmup_compression = resolve_warmup_compression(None, config.compression, config.warmup_iters)
    config.validate()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_megatron_args(args: argparse.Namespace, config: DiLoCoXConfig) -> None:
    """Check Megatron's (already validated) arguments against DiLoCoX and set what it implies.

    Sets ``use_distributed_optimizer=True``, ``num_distributed_optimizer_instances=R`` and
    ``use_tp_pp_dp_mapping=True``. Raises ``ValueError`` naming the flag and the fix otherwise.
    Must run before ``pretrain_cfg_container_from_args`` / ``pretrain`` (they read these fields).
    """
    R = config.replicas
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        raise ValueError("megatron-diloco: call install(args) after Megatron's argument validation "
                         "(args.data_parallel_size is not set yet)")
    store = getattr(args, "diloco_x_outer_store", None) is not None
    federated = getattr(args, "diloco_x_lighthouse", None) is not None
    separate = store or federated
    how = "--diloco-x-lighthouse" if federated else "--diloco-x-outer-store"
    index = getattr(args, "diloco_x_replica_index", None)
    if store and federated:
        raise ValueError("--diloco-x-lighthouse and --diloco-x-outer-store are two ways of joining separate "
                         "jobs; give one (--diloco-x-lighthouse: jobs that may fail and rejoin)")
    if separate and (index is None or not 0 <= index < R):
        raise ValueError(f"{how} needs --diloco-x-replica-index in [0, {R}) "
                         f"(--diloco-x-replicas {R}), got {index!r}: give each job its own index")
    if not separate and index is not None:
        raise ValueError("--diloco-x-replica-index applies to separate jobs only (--diloco-x-lighthouse); "
                         "drop it when all replicas run in one world")
    for flag in ("run", "replica_id", "advertise_host", "secret_file"):  # (the timeouts have defaults)
        if not federated and getattr(args, f"diloco_x_{flag}", None) is not None:
            raise ValueError(f"--diloco-x-{flag.replace('_', '-')} applies with --diloco-x-lighthouse only")
    if federated:
        if not getattr(args, "diloco_x_run", None):
            raise ValueError("--diloco-x-lighthouse needs --diloco-x-run NAME (the same on every job of the "
                             "run): a job of another run cannot join it by accident")
        if (why := config.separate_jobs_problem()) is not None:
            raise ValueError(why)
        if getattr(args, "rampup_batch_size", None):
            raise ValueError("--diloco-x-lighthouse cannot be used with --rampup-batch-size (a job that joins "
                             "takes its data position from the run's iteration)")
        if not getattr(args, "diloco_x_secret_file", None):
            raise ValueError("--diloco-x-lighthouse needs --diloco-x-secret-file PATH: the jobs of a run "
                             "authenticate each other with a shared secret (make one with head -c 32 "
                             "/dev/urandom | base64 > run.secret; chmod 600; copy it to every site)")
        from megatron_diloco.federation.auth import RunKey

        RunKey.from_file(args.diloco_x_secret_file, args.diloco_x_run)  # refused here, before training
        for flag in ("meeting", "alone"):
            if getattr(args, f"diloco_x_{flag}_timeout_minutes", 1.0) <= 0:
                raise ValueError(f"--diloco-x-{flag}-timeout-minutes must be > 0")
    _validate_exchange_slots(args, config, dp, federated)
    _validate_exchange_chunks(args, federated)
    _validate_data_micro_batch(args, separate)
    if config.site_weights != "tokens" and not federated:
        raise ValueError("--diloco-x-site-weights applies with --diloco-x-lighthouse only (separate jobs; the "
                         "replicas of one world run the same steps on the same batch: every weight is 1)")
    if config.site_pace is not None:
        if not federated:
            raise ValueError("--diloco-x-site-pace applies with --diloco-x-lighthouse only (separate jobs, one "
                             "per site; the replicas of one world step together)")
        if getattr(args, "train_iters", None) is None:
            raise ValueError("--diloco-x-site-pace needs the run's length in iterations (--train-iters, the run's "
                             "rounds as the slowest job runs them), not --train-samples")
    if store and (args.save or args.load):
        raise ValueError("--save / --load cannot be used with --diloco-x-outer-store yet (the DiLoCoX "
                         "checkpoint layout spans the replicas of one world); run the replicas in one "
                         "world (drop --diloco-x-outer-store) to checkpoint")
    if separate:  # Megatron sees one replica: its own data parallelism, one optimizer instance
        R = 1
    if dp % R != 0:
        raise ValueError(
            f"--diloco-x-replicas {R} does not divide the data-parallel size {dp} "
            f"(world size / (TP x PP x CP)); choose R among the divisors of {dp}, or change the world size"
        )
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if instances not in (1, R):
        raise ValueError(
            f"--num-distributed-optimizer-instances {instances} conflicts with --diloco-x-replicas {R}; "
            "drop --num-distributed-optimizer-instances (DiLoCoX sets it to R)"
        )
    incompatible = {
        "use_torch_fsdp2": "DiLoCoX shards its outer state like the distributed optimizer; use "
                           "--use-distributed-optimizer instead of FSDP",
        "use_megatron_fsdp": "DiLoCoX shards its outer state like the distributed optimizer; use "
                             "--use-distributed-optimizer instead of Megatron FSDP",
        "use_layer_wise_distributed_optimizer": "DiLoCoX needs the distributed optimizer's fp32 shards",
        "check_weight_hash_across_dp_replicas_interval": "replicas differ between outer boundaries by "
                                                         "design; DiLoCoX checks its own replicas",
        "num_experts": "MoE expert parameters use separate expert-data-parallel groups that DiLoCoX "
                       "does not handle yet",
        "use_precision_aware_optimizer": "it keeps the fp32 master weights inside Transformer Engine's "
                                         "FusedAdam, where the outer step cannot read or write them; drop "
                                         "the flag (DiLoCoX works on the distributed optimizer's fp32 shards)",
        "data_parallel_random_init": "every data-parallel rank would start from different weights, while "
                                     "the replicas of an outer loop must start from the same ones; drop "
                                     "the flag",
    }
    for name, why in incompatible.items():
        if getattr(args, name, None):
            raise ValueError(f"{_flag(name)} cannot be used with --diloco-x: {why}")
    if getattr(args, "reduce_scatter_with_fp32_accumulation", False) and R > 1:
        raise ValueError("--reduce-scatter-with-fp32-accumulation cannot be used with --diloco-x "
                         "(Megatron does not support it with several optimizer instances)")
    if getattr(args, "fp8_param_gather", False):
        raise ValueError("--fp8-param-gather cannot be used with --diloco-x yet: the outer step needs "
                         "high-precision model parameters to copy the outer parameters into")
    if config.outer_state == "host" and getattr(args, "async_save", False):
        raise ValueError("--async-save cannot be used with --diloco-x-outer-state host: Megatron's async writer "
                         "takes host tensors as they are, uncloned, and moves their storage to shared memory "
                         "while training goes on, so it would write a mix of rounds of the outer state held in "
                         "host memory and break its staging; use --diloco-x-outer-state device with --async-save, "
                         "or drop --async-save")
    if getattr(args, "optimizer", "adam") not in ("adam", "sgd"):
        raise ValueError(f"--optimizer {args.optimizer} cannot be used with --diloco-x; use adam or sgd "
                         "(the inner optimizer must be Megatron's distributed optimizer)")

    for flag, codec in (("--diloco-x-compression", config.compression),
                        ("--diloco-x-warmup-compression", config.warmup_compression)):
        if codec == "fp8":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"{flag} fp8 runs on CUDA GPUs only (sm89+); use {flag} int8 on this machine")

    args.use_distributed_optimizer = True
    args.num_distributed_optimizer_instances = R
    args.use_tp_pp_dp_mapping = True


def _validate_exchange_slots(args: argparse.Namespace, config: DiLoCoXConfig, dp: int, federated: bool) -> None:
    """``--diloco-x-exchange-slots`` G (sites of different data-parallel size): ValueError naming the fix."""
    from megatron_diloco.algorithm.slot_exchange import check_slot_codec

    slots = getattr(args, "diloco_x_exchange_slots", None)
    if slots is None:
        return
    flag = f"--diloco-x-exchange-slots {slots}"
    if not federated:
        raise ValueError(f"{flag} applies with --diloco-x-lighthouse only (replicas of one world share their size)")
    if slots < 1 or slots > 128 or slots & (slots - 1):
        raise ValueError(f"{flag}: give a power of two up to 128 (Megatron pads every bucket to a multiple of 128 "
                         "elements, so that such a count of slots cuts the buckets of every site alike)")
    if slots % dp:
        raise ValueError(f"{flag} is not a multiple of this job's data-parallel size {dp}: give every job the "
                         "largest site's data-parallel size")
    if getattr(args, "context_parallel_size", 1) != 1:
        raise ValueError(f"{flag} cannot be used with --context-parallel-size > 1 yet (the distributed optimizer "
                         "then shards over data x context parallel ranks)")
    if slots > 40 and getattr(args, "ddp_bucket_size", None) is None:
        raise ValueError(f"{flag}: above 40 data-parallel ranks Megatron sizes its buckets by the DP size "
                         "(max(40M, 1M x DP) elements), which differs between sites; give every job the same "
                         "--ddp-bucket-size")
    for codec in (config.compression, config.warmup_compression):
        if codec is not None:
            check_slot_codec(codec, slots // dp)


def _validate_exchange_chunks(args: argparse.Namespace, federated: bool) -> None:
    """``--diloco-x-exchange-chunks`` G (sites of different parallel layout): ValueError naming the fix (separate
    jobs take no low-rank codec, whose factors the chunks would cut: refused with the lighthouse)."""
    chunks = getattr(args, "diloco_x_exchange_chunks", None)
    if chunks is None:
        if getattr(args, "diloco_x_data_slots", None) is not None:
            raise ValueError("--diloco-x-data-slots applies with --diloco-x-exchange-chunks only (with "
                             "--diloco-x-exchange-slots G every job reads as G data-parallel ranks)")
        return
    flag = f"--diloco-x-exchange-chunks {chunks}"
    if not federated:
        raise ValueError(f"{flag} applies with --diloco-x-lighthouse only (replicas of one world share their layout)")
    if getattr(args, "diloco_x_exchange_slots", None) is not None:
        raise ValueError(f"{flag} and --diloco-x-exchange-slots: give one (the chunks cover sites of different "
                         "data-parallel size too)")
    world = int(getattr(args, "world_size", 1))
    if chunks < 1 or chunks % world:
        raise ValueError(f"{flag} is not a multiple of this job's world size {world}: give every job of the run the "
                         "same count, a multiple of every site's world size (e.g. the largest, when each divides it)")
    if getattr(args, "context_parallel_size", 1) != 1:
        raise ValueError(f"{flag} cannot be used with --context-parallel-size > 1 yet")
    data = getattr(args, "diloco_x_data_slots", None)
    dp = int(getattr(args, "data_parallel_size", 1))
    if data is not None and (data < 1 or data % dp):
        raise ValueError(f"--diloco-x-data-slots {data} is not a multiple of this job's data-parallel size {dp}: give "
                         "every job the largest site's data-parallel size")


def _validate_data_micro_batch(args: argparse.Namespace, separate: bool) -> None:
    """``--diloco-x-data-micro-batch`` U (sites of different micro-batch): ValueError naming the fix."""
    unit = getattr(args, "diloco_x_data_micro_batch", None)
    if unit is None:
        return
    flag = f"--diloco-x-data-micro-batch {unit}"
    if not separate:
        raise ValueError(f"{flag} applies to separate jobs only (--diloco-x-lighthouse): the replicas of one world "
                         "read one micro-batch")
    batches = {"--micro-batch-size": args.micro_batch_size,
               "--eval-micro-batch-size": getattr(args, "eval_micro_batch_size", None)}
    for name, m in batches.items():
        if m is not None and (unit < 1 or m % unit):
            raise ValueError(f"{flag} does not divide {name} {m}: give every job of the run the same U, a divisor of "
                             "each job's micro-batch (e.g. the smallest site's)")
    if getattr(args, "dataloader_type", "single") != "single" or getattr(args, "hybrid_context_parallel", False):
        raise ValueError(f"{flag} needs Megatron's default sampler (--dataloader-type single, no "
                         "--hybrid-context-parallel): the others cut the samples by the micro-batch in other ways")
