"""DiLoCoX hyperparameters: one dataclass, validated, with errors naming the ``--diloco-x-*`` flag."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

OverlapMode = Literal["none", "delayed", "eager", "partial"]

#: Overlap modes accepted by ``--diloco-x-overlap``.
OVERLAP_MODES: tuple[str, ...] = ("none", "delayed", "eager", "partial")
#: How ``partial`` merges the outer step into the local params (``--diloco-x-merge``).
MERGE_RULES: tuple[str, ...] = ("exact", "mix")
#: Where the outer state lives (``--diloco-x-outer-state``).
OUTER_STATES: tuple[str, ...] = ("device", "host")
#: The earlier names of :data:`OUTER_STATES`, still accepted: ``gpu`` is the compute device (the CPU in
#: a CPU run), ``cpu`` host memory.
OUTER_STATE_ALIASES: dict[str, str] = {"gpu": "device", "cpu": "host"}


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """What the rest of the package needs to know about one ``--diloco-x-compression`` value (the
    codec objects themselves: :func:`megatron_diloco.algorithm.compression.get_codec`)."""

    name: str
    lossy: bool
    """Sends less than the exact pseudo-gradient: keeps an error-feedback residual (fp32, 4 B/elem)."""
    collective: Literal["all-reduce", "all-gather"]
    """How the payload crosses the outer group: an fp32 all-reduce (SUM, each rank sends and receives
    2 (R-1)/R payloads) or an all-gather of encoded payloads (R-1 payloads each way)."""
    matrix: bool = False
    """Needs the shards' matrix shapes and several dependent collectives per round (low-rank: P, then
    Q): runs on a worker thread instead of as one asynchronous collective."""


#: The one registry of ``--diloco-x-compression`` values, in the order the help lists them.
CODECS: dict[str, CodecSpec] = {spec.name: spec for spec in (
    CodecSpec("none", lossy=False, collective="all-reduce"),
    CodecSpec("int8", lossy=True, collective="all-gather"),
    CodecSpec("int4", lossy=True, collective="all-gather"),
    CodecSpec("fp8", lossy=True, collective="all-gather"),
    CodecSpec("int2", lossy=True, collective="all-gather"),
    CodecSpec("lowrank", lossy=True, collective="all-gather", matrix=True),
    CodecSpec("lowrank-int8", lossy=True, collective="all-gather", matrix=True),
    CodecSpec("adaptive", lossy=True, collective="all-gather", matrix=True),
)}
#: The blockwise codecs (one async all-gather of a quantized payload, error feedback): the values of
#: ``--diloco-x-warmup-compression``, the codecs ``--diloco-x-outer-state host`` takes besides ``none``.
BLOCKWISE: tuple[str, ...] = tuple(name for name, spec in CODECS.items() if spec.lossy and not spec.matrix)
#: ``--diloco-x-local-steps auto``: the bounds of the H it chooses. Below 30 the measured gap to
#: AllReduce does not shrink (85M GPT, 2 seeds: +1.96% at H 30, +1.79% at 100, +2.24% at 300;
#: benchmarks/RESULTS.md §2.3) while every boundary's fixed costs (the decision all-reduce, the encode
#: and outer-step passes over the shard) recur more often; above 300 it grows (+2.62% at H 500, seed 1).
#: A run starts at AUTO_H_MIN (its warm-up is resolved from it, then follows the H chosen).
AUTO_H_MIN, AUTO_H_MAX = 30, 300
#: auto H makes a round at least AUTO_H_PER_TAU x the steps its exchange overlaps (tau): how stale the
#: merged update may be, not only whether the exchange is hidden. Measured against blocking DiLoCo at the
#: same H and codecs (85M GPT, benchmarks/RESULTS.md §2.3): tau 4 of H 30 (0.13 of a round) +0.43%, of
#: H 100 +0.25%, of H 300 +0.34%; tau 4 of H 20 (0.2) +1.75% (§2.1); a round just long enough to hide
#: its exchange (tau 38-46 of H 48-58, 0.8) +1.6% over H 30. An eighth keeps tau within the measured 0.13.
AUTO_H_PER_TAU = 8
#: The auto warm-up's length: WARMUP_H_MULTIPLE x H inner steps, at most 1 / WARMUP_MAX_SHARE of the run
#: (:func:`megatron_diloco.algorithm.schedule.auto_warmup_iters`).
WARMUP_H_MULTIPLE, WARMUP_MAX_SHARE = 30, 2

#: the largest --diloco-x-site-pace: a job's round at most this many times the run's (its datasets are sized
#: for that many samples)
PACE_MAX = 16.0
#: --diloco-x-site-weights: how a round's mean weighs the jobs of a run (the first: the default)
SITE_WEIGHTS = ("tokens", "normalized")
#: k of the derived outer timeout: an exchange may take k times a round's compute (or k times the
#: longest exchange seen) before the link counts as hung (see :meth:`DiLoCoXConfig.outer_timeout_s`).
OUTER_TIMEOUT_HEADROOM: float = 4.0


def link_share_bytes_per_s(link_mbps: float, sharers: int, efficiency: float = 1.0) -> float:
    """Payload bytes/s one rank can count on from a site's slow link of ``link_mbps`` Mbit/s each way
    (``--diloco-x-bandwidth-mbps``; the planner's ``--link-mbps``) when ``sharers`` ranks send over it
    at once, each its own outer group's exchange (a replica's ranks holding a shard: they all launch
    at the same boundary): ``link_mbps x 10^6 / 8 x efficiency / sharers``. ``efficiency``: the
    payload fraction of the rate (1: the rate given is the payload's; the planner discounts TCP/IP)."""
    return link_mbps * 1e6 / 8 * efficiency / max(1, sharers)


def _check_site_pace(pace: float | None, local_steps_auto: bool) -> None:
    """``--diloco-x-site-pace``: ValueError naming the fix."""
    if pace is None:
        return
    if not (isinstance(pace, (int, float)) and 1 <= pace <= PACE_MAX):
        raise ValueError(f"--diloco-x-site-pace (the most a job's round may exceed the run's, as a multiple) must be "
                         f"a number in [1, {PACE_MAX}], got {pace!r}")
    if local_steps_auto:
        raise ValueError("--diloco-x-site-pace sizes each job's rounds from the run's fixed H: give "
                         "--diloco-x-local-steps as a number with it, not auto")


@dataclasses.dataclass
class DiLoCoXConfig:
    """Configuration of the DiLoCoX outer loop (arXiv 2506.21263).

    Symbols follow the DiLoCo / DiLoCoX papers: R replicas (clusters), H inner steps per outer round,
    outer learning rate eta and momentum mu.
    """

    # ---------------- topology ----------------
    replicas: int = 2
    """R: number of model replicas (clusters), one per Megatron distributed-optimizer instance.
    Must divide the data-parallel size; each replica owns a contiguous block of ranks."""

    # ---------------- outer loop ----------------
    local_steps: int = 500
    """H: inner optimizer ``step()`` calls per outer round (counted in calls, not successful steps).
    With :attr:`local_steps_auto` the current H (AUTO_H_MIN at the start), changed by the boundaries."""

    local_steps_auto: bool = False
    """``--diloco-x-local-steps auto``: H chosen at every boundary after the warm-up, the smallest that
    hides the exchange (:func:`megatron_diloco.algorithm.schedule.auto_local_steps`), agreed by all ranks."""

    site_pace: float | None = None
    """Separate jobs (``--diloco-x-site-pace P``): in every round of the run (the flags' rounds) a job runs the inner
    steps that fit the slowest job's round, at most P x the run's (:mod:`megatron_diloco.algorithm.pace`). None:
    every job runs the run's rounds."""

    site_weights: str = "tokens"
    """Separate jobs (``--diloco-x-site-weights``): each job's pseudo-gradient in a round's mean weighs by the tokens
    it trained on (``tokens``), or by them with each divided by its inner steps and the mean scaled by the
    token-weighted mean steps (``normalized``: :func:`megatron_diloco.algorithm.weights.normalized_weights`)."""

    warmup_local_steps: int | None = None
    """H0: the round length during the first :attr:`warmup_iters` inner steps
    (``--diloco-x-warmup-local-steps``, 1 <= H0 <= H; None: no warm-up, this dataclass's default; the
    command line's default is the auto warm-up, :func:`megatron_diloco.megatron_adapter.arguments.resolve_warmup`,
    which depends on ``--train-iters``). Short rounds early, where
    DiLoCo's gap to AllReduce forms (benchmarks/RESULTS.md §2.1), then H. With ``partial``, rounds
    shorter than H overlap at most :attr:`warmup_overlap_steps` inner steps (0 blocks): the exchange
    is exposed in the warm-up's W / H0 rounds only."""

    warmup_iters: int = 0
    """Inner steps run in rounds of H0 before the rounds of H (``--diloco-x-warmup-iters``; a
    multiple of H0; 0: no warm-up)."""

    warmup_overlap_steps: int = 0
    """``partial`` only: the most inner steps an exchange launched into a warm-up round may overlap
    (``--diloco-x-warmup-overlap-steps``, 0 <= tau_w <= H0). Such a round's tau is the smaller of this
    and the tau the rounds of H would take over H0 steps (:attr:`overlap_steps`, auto by default);
    0 (this dataclass's default) blocks. The command line's default is ``auto``, H0 // 10
    (:func:`megatron_diloco.megatron_adapter.arguments.resolve_warmup_overlap`): a few steps of a ten-step round are a
    large share of it, 1 cost +0.09% loss for 30% less exposed time, 2 +0.44%, 4 the warm-up's whole
    gain (benchmarks/RESULTS.md §2.1)."""

    warmup_compression: str | None = None
    """The codec of the exchanges launched into a warm-up round (``--diloco-x-warmup-compression``;
    None: :attr:`compression`'s, this dataclass's default; the command line's default is ``auto``,
    int2 under int4 with a warm-up, :func:`megatron_diloco.megatron_adapter.arguments.resolve_warmup_compression`). A
    blockwise codec, with a blockwise :attr:`compression`: the two share the error-feedback residual,
    so what the warm-up's coarser payload did not send goes out with the next rounds. The exchange
    launched at the warm-up's last boundary hides behind a round of H and takes :attr:`compression`.
    Measured at H0 10 under int4 (benchmarks/RESULTS.md §2.1): int2 warm-up exchanges cost no loss
    against int4 ones (-0.19%, 3 seeds) and took the warm-up's exposure from 6.9% to 2.1% of the run."""

    warmup_auto: bool = False
    """Whether the warm-up came from the command line's ``auto`` (it depends on ``--train-iters``):
    a resume then keeps the schedule its checkpoint was trained with
    (:meth:`megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer.load_state_dict`)."""

    warmup_iters_max: int = 0
    """With :attr:`local_steps_auto` and an auto warm-up: the longest the warm-up may grow to (the auto
    warm-up of H = AUTO_H_MAX for this run; a multiple of H0). The warm-up starts as the one of the
    starting H; at every warm-up boundary the ranks agree on the H the link asks for, and the warm-up
    lengthens to that H's (:meth:`megatron_diloco.algorithm.schedule.RoundSchedule.extend_warmup`), so
    a run whose link takes H to 300 warms up as a run at a fixed H 300 does. 0: the warm-up is fixed."""

    outer_lr: float = 1.0
    """eta: outer learning rate applied to the averaged pseudo-gradient. 1.0 with mu = 0 makes the
    outer step the replicas' mean (theta <- mean_r x_r): the best measured at H = 30
    (benchmarks/RESULTS.md §2; the DiLoCo papers' 0.7 / 0.9 at H = 500 diverged there)."""

    outer_momentum: float = 0.0
    """mu: outer momentum (PyTorch SGD semantics; 0, the default, allocates no momentum buffer).
    Momentum amplifies a consistent pseudo-gradient by up to eta / (1 - mu): at a few tens of inner
    Adam steps per round that acted like a larger inner learning rate (measured: mu 0.5 +7% loss,
    mu 0.9 diverged). Try it with long rounds (H in the hundreds), where it pays in the papers."""

    nesterov: bool = True
    """Use Nesterov momentum for the outer step (``--diloco-x-no-nesterov`` turns it off)."""

    # ---------------- communication ----------------
    overlap: OverlapMode = "partial"
    """``partial`` (default): the exchange launched at a boundary is applied tau inner steps later
    and merged with the local progress of those steps (Streaming DiLoCo's overlap; tau from
    :attr:`overlap_steps`, ``auto`` by default: only the staleness the link forces). ``delayed``:
    DiLoCoX's one-step-delay overlap, round t's exchange runs during round t+1 and is applied one
    round late, every replica restarting from the shared theta. ``none``: plain DiLoCo, the exchange
    blocks at every boundary. ``eager``: ``delayed`` plus each replica's own fresh pseudo-gradient
    applied at once as a look-ahead (Kale et al. 2025; see :mod:`megatron_diloco.algorithm.sync`)."""

    overlap_steps: int | None = None
    """``partial`` only: tau, the inner steps between a boundary and the application of the exchange
    it launched (0 <= tau <= H; 0 is blocking DiLoCo, H applies it at the next boundary). None
    (``--diloco-x-overlap-steps auto``): the smallest tau that hides the last exchange (its measured
    duration, or its wire bytes at ``--diloco-x-bandwidth-mbps``) behind the inner steps, re-chosen
    at every boundary and agreed by all ranks (H before any exchange was measured)."""

    merge: str = "exact"
    """``partial`` only: how the outer step meets the tau steps of local progress made while the
    exchange ran (``--diloco-x-merge``). ``exact``: x <- theta_new + (x - x_launch), the local
    progress since the launch kept whole (delay-corrected; 4 B per element for x_launch). ``mix``:
    x <- alpha x + (1 - alpha) theta_new (Streaming DiLoCo; ``--diloco-x-mix-alpha``)."""

    mix_alpha: float = 0.5
    """``partial`` with ``--diloco-x-merge mix``: weight of the local params in the merge."""

    eager_weight: float | None = None
    """``eager`` only: weight of the replica's own fresh pseudo-gradient in its look-ahead, as a
    fraction of one outer step. None: 1/R, Kale et al.'s rule (own fresh + the others' stale, over
    R). 1.0: the whole own pseudo-gradient, as if it were the replicas' mean; when the replicas'
    pseudo-gradients agree this reproduces blocking DiLoCo's parameters exactly (mu = 0) while the
    exchange still overlaps the next round (``--diloco-x-eager-weight``). Measured on the 85.5M GPT
    benchmark (benchmarks/RESULTS.md): 1.0 was worse than 1/R, the replicas' pseudo-gradients there
    being far from agreeing; keep the default unless yours agree (large per-replica batches)."""

    compression: str = "int4"
    """Pseudo-gradient codec (default ``int4``: 7.8x fewer bytes than fp32, no loss cost measured on
    the benchmark, benchmarks/RESULTS.md §2). ``none`` sends fp32 shards and averages them exactly (all-reduce);
    ``int8``/``int4``/``fp8``/``int2`` send blockwise-absmax-quantized shards (one fp32 scale per
    256 elements; int2: ternary, -1 / 0 / 1 x scale) with error feedback, all-gathered and decoded in
    replica order (fp8: CUDA only);
    ``lowrank``/``lowrank-int8``: PowerSGD-style P Q^T with a shared warm-started basis (factors
    fp32 / int8), 1-D and small tensors quantized or raw; ``adaptive``: per-tensor rank from the
    captured-energy target, capped by the byte budget."""

    rank: int = 4
    """Low-rank rank r for ``lowrank`` / ``lowrank-int8`` (``--diloco-x-rank``)."""

    energy: float = 0.9
    """``adaptive``: smallest rank whose captured energy 1 - ||M - P Q^T||^2 / ||M||^2 reaches this
    (``--diloco-x-energy``)."""

    bandwidth_mbps: float | None = None
    """The site's slow link in Mbit/s of payload each way (``--diloco-x-bandwidth-mbps``): the link one
    replica's ranks share to reach the other replicas. At a boundary every rank of the replica that
    holds a shard sends its outer group's exchange at once, so a rank counts on bandwidth / S, S =
    those ranks (:func:`link_share_bytes_per_s`; the planner's ``--link-mbps`` with ``--link-scope
    cluster``, as the same quantity). Sizes auto tau (the exchange's wire bytes at a rank's share)
    and the ``adaptive`` byte budget (a rank's share x the time of H inner steps). None: measured
    at the first boundary by every outer group at once (a rank's share directly; ``adaptive`` only)."""

    # ---------------- memory ----------------
    outer_state: str = "device"
    """Where the outer state of the rank's shard lives (``--diloco-x-outer-state``): ``device`` (theta,
    the outer momentum, the error-feedback residual, the eager anchor and the partial launch point on
    the compute device: 8-20 B per shard element there) or ``host`` (in host memory, pinned when CUDA is
    available; each boundary streams them through the device in chunks of
    ``--diloco-x-outer-chunk-mb``, the copies overlapping the compute on side CUDA streams). With
    ``host`` the device keeps the staging buffers (fixed size) and the exchange's payload: none for
    ``none`` (its fp32 all-reduce runs in host memory, over the outer group's gloo mirror in one
    world, over the gloo outer group of replicas in separate worlds), the encoded payload for the
    blockwise codecs (about 1 B int8/fp8, 0.5 B int4, plus the R payloads gathered while in flight). Same bits as
    ``device``; the boundary moves the state over the host link (PCIe) instead. The matrix codecs
    (``lowrank``, ``lowrank-int8``, ``adaptive``) need ``device``. The flag also takes the earlier names
    ``gpu`` and ``cpu`` (:data:`OUTER_STATE_ALIASES`)."""

    outer_chunk_mb: float = 16.0
    """``--diloco-x-outer-state host``: MiB of fp32 per staged chunk (``--diloco-x-outer-chunk-mb``;
    rounded down to whole 256-element blocks). The device holds three chunks per tensor a pass touches
    (at most 5): 240 MiB at the default, whatever the model size. Larger chunks mean fewer, longer
    copies (16 MiB already moves at full PCIe speed)."""

    # ---------------- fault handling ----------------
    outer_timeout_minutes: float | None = None
    """T: bound on every operation over the outer groups and on the boundary's skip decision, in
    minutes (``--diloco-x-outer-timeout-minutes``): an exchange must complete within T of its launch
    (a one-step-delayed exchange is waited for at the next boundary), the skip decision and the link
    measurement within T of their start; past it the run ends with an error naming the round and the
    group. The groups' own (backend) timeouts are set to ``1.25 T + 1 min``, a backstop behind it.

    None (default): derived at every launch as ``max(distributed_timeout_minutes, k x H x step
    time, k x longest exchange so far)`` with k = :data:`OUTER_TIMEOUT_HEADROOM` = 4 and the step
    time the mean inner-step time of the last round. Why: with overlap an exchange is sized to hide
    under one round's compute (H x step time), so 4x leaves room for a link at a quarter of the
    speed the run was planned for, while a dead link still ends the run within a few rounds' time;
    the longest exchange seen covers exchanges that do not hide (``--diloco-x-overlap none``, an
    undersized H); and never less than the timeout the user gave Megatron's own collectives. At the
    paper's scale (107B, 1 Gbit/s, ~15 min per exchange hidden under a round) that is >= 60 min,
    where Megatron's 10 min would abort. The first exchange is launched after one round, whose step
    time is then known. Give the flag when one exchange may take longer than the rule allows, e.g. a
    first blocking exchange over a very slow link (no exchange measured yet)."""

    distributed_timeout_minutes: float = 10.0
    """Megatron's ``--distributed-timeout-minutes`` (read from its arguments): the floor of the
    derived outer timeout."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending flag for any invalid value."""
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(
                f"--diloco-x-replicas must be an integer >= 1, got {self.replicas!r}; "
                "use the number of clusters (model replicas), e.g. --diloco-x-replicas 2"
            )
        if not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ValueError(
                f"--diloco-x-local-steps (H) must be an integer >= 1, got {self.local_steps!r}; "
                "H is the number of inner optimizer steps between outer synchronizations"
            )
        if self.local_steps_auto:
            if self.overlap == "none":
                raise ValueError("--diloco-x-local-steps auto chooses the smallest H whose exchange the overlap hides: "
                                 "it needs an overlapping --diloco-x-overlap (partial, the default; delayed; eager), "
                                 "not none; or give H as a number")
            if self.compression == "adaptive":
                raise ValueError("--diloco-x-local-steps auto and --diloco-x-compression adaptive both fit the exchange "
                                 "to the link (one by H, the other by the bytes): give H as a number with adaptive, "
                                 "or take another codec with auto")
            if not AUTO_H_MIN <= self.local_steps <= AUTO_H_MAX:
                raise ValueError(f"--diloco-x-local-steps auto keeps H in [{AUTO_H_MIN}, {AUTO_H_MAX}], "
                                 f"got H = {self.local_steps}")
        _check_site_pace(self.site_pace, self.local_steps_auto)
        if self.site_weights not in SITE_WEIGHTS:
            raise ValueError(f"--diloco-x-site-weights must be one of {', '.join(SITE_WEIGHTS)}, got {self.site_weights!r}")
        if self.warmup_local_steps is not None or self.warmup_iters:
            h0, w = self.warmup_local_steps, self.warmup_iters
            if not isinstance(h0, int) or not 1 <= h0 <= self.local_steps:
                raise ValueError(
                    f"--diloco-x-warmup-local-steps (H0) must be an integer in [1, H = {self.local_steps}] "
                    f"(--diloco-x-local-steps) with --diloco-x-warmup-iters, got {h0!r}"
                )
            if not isinstance(w, int) or w < 1 or w % h0:
                raise ValueError(
                    f"--diloco-x-warmup-iters must be a positive multiple of --diloco-x-warmup-local-steps "
                    f"({h0}), got {w!r}: the warm-up ends on a boundary"
                )
        if self.warmup_iters_max and not (self.local_steps_auto and self.warmup_auto and self.warmup_iters
                                          and self.warmup_iters <= self.warmup_iters_max
                                          and self.warmup_iters_max % self.warmup_local_steps == 0):
            raise ValueError(f"a warm-up that follows auto H (up to {self.warmup_iters_max} steps) needs "
                             "--diloco-x-local-steps auto, an auto --diloco-x-warmup-iters and a longest warm-up "
                             f"that is a multiple of H0 and at least the starting one ({self.warmup_iters})")
        if not (self.outer_lr > 0.0) or self.outer_lr != self.outer_lr or self.outer_lr == float("inf"):
            raise ValueError(
                f"--diloco-x-outer-lr must be a finite number > 0, got {self.outer_lr!r} "
                "(default 1.0: the replicas' mean)"
            )
        if not (0.0 <= self.outer_momentum < 1.0):
            raise ValueError(
                f"--diloco-x-outer-momentum must be in [0, 1), got {self.outer_momentum!r} "
                "(default 0; the DiLoCo papers use 0.9 with H in the hundreds)"
            )
        if self.nesterov and self.outer_momentum == 0.0:
            # Nesterov with mu=0 is plain SGD; accept it silently (the update is identical).
            pass
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(
                f"--diloco-x-overlap must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}"
            )
        if self.overlap_steps is not None:
            if self.overlap != "partial":
                raise ValueError(
                    f"--diloco-x-overlap-steps applies to --diloco-x-overlap partial only (got overlap "
                    f"{self.overlap!r}); drop the flag or use --diloco-x-overlap partial"
                )
            if not isinstance(self.overlap_steps, int) or not 0 <= self.overlap_steps <= self.local_steps:
                raise ValueError(
                    f"--diloco-x-overlap-steps must be 'auto' or an integer in [0, {self.local_steps}] (H, "
                    f"--diloco-x-local-steps), got {self.overlap_steps!r}"
                )
        if self.warmup_overlap_steps:
            if self.overlap != "partial":
                raise ValueError(
                    f"--diloco-x-warmup-overlap-steps applies to --diloco-x-overlap partial only (got overlap "
                    f"{self.overlap!r}); drop the flag or use --diloco-x-overlap partial"
                )
            h0 = self.warmup_local_steps if self.warmup_iters else None
            if not isinstance(self.warmup_overlap_steps, int) or not 0 <= self.warmup_overlap_steps <= (h0 or 0):
                raise ValueError(
                    f"--diloco-x-warmup-overlap-steps must be an integer in [0, H0 = {h0}] "
                    f"(--diloco-x-warmup-local-steps) with a warm-up (--diloco-x-warmup-iters > 0), "
                    f"got {self.warmup_overlap_steps!r}"
                )
        if self.warmup_compression is not None:
            if self.warmup_compression not in BLOCKWISE or self.compression not in BLOCKWISE:
                raise ValueError(
                    f"--diloco-x-warmup-compression must be one of {', '.join(BLOCKWISE)} with "
                    f"--diloco-x-compression one of them too (they share the error-feedback residual), got "
                    f"{self.warmup_compression!r} with --diloco-x-compression {self.compression!r}")
            if not self.warmup_iters:
                raise ValueError("--diloco-x-warmup-compression needs a warm-up (--diloco-x-warmup-iters > 0 "
                                 "and --diloco-x-warmup-local-steps); drop the flag or give the warm-up")
        if self.merge not in MERGE_RULES:
            raise ValueError(f"--diloco-x-merge must be one of {', '.join(MERGE_RULES)}, got {self.merge!r}")
        if not (0.0 <= self.mix_alpha <= 1.0):
            raise ValueError(f"--diloco-x-mix-alpha must be in [0, 1], got {self.mix_alpha!r}")
        if self.eager_weight is not None:
            if self.overlap != "eager":
                raise ValueError(
                    f"--diloco-x-eager-weight applies to --diloco-x-overlap eager only (got overlap "
                    f"{self.overlap!r}); drop the flag or use --diloco-x-overlap eager"
                )
            if not (0.0 < self.eager_weight <= 1.0):
                raise ValueError(
                    f"--diloco-x-eager-weight must be in (0, 1], got {self.eager_weight!r} "
                    "(1/R is Kale et al.'s rule, the default; 1 the full look-ahead)"
                )
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"--diloco-x-rank must be an integer >= 1, got {self.rank!r}")
        if not (0.0 < self.energy <= 1.0):
            raise ValueError(f"--diloco-x-energy must be in (0, 1], got {self.energy!r}")
        if self.bandwidth_mbps is not None and not (0.0 < self.bandwidth_mbps < float("inf")):
            raise ValueError(f"--diloco-x-bandwidth-mbps must be a finite number > 0, got {self.bandwidth_mbps!r}")
        if self.outer_timeout_minutes is not None and not (0.0 < self.outer_timeout_minutes < float("inf")):
            raise ValueError(
                f"--diloco-x-outer-timeout-minutes must be a finite number > 0, got "
                f"{self.outer_timeout_minutes!r}; give the minutes one exchange may take (at least "
                "the time of H inner steps), or drop the flag for the derived default"
            )
        if not (0.0 < self.distributed_timeout_minutes < float("inf")):
            raise ValueError(
                f"--distributed-timeout-minutes must be a finite number > 0 with --diloco-x, got "
                f"{self.distributed_timeout_minutes!r}"
            )
        if self.compression not in CODECS:
            raise ValueError(
                f"--diloco-x-compression must be one of {', '.join(CODECS)}, "
                f"got {self.compression!r}"
            )
        if self.outer_state not in OUTER_STATES:
            raise ValueError(f"--diloco-x-outer-state must be one of {', '.join(OUTER_STATES)}, "
                             f"got {self.outer_state!r}")
        if self.outer_state == "host" and CODECS[self.compression].matrix:
            raise ValueError(
                f"--diloco-x-outer-state host supports --diloco-x-compression {', '.join(['none', *BLOCKWISE])}, not "
                f"{self.compression!r} (its low-rank factors work per tensor on the whole shard); use "
                "--diloco-x-outer-state device with it")
        if not (0.0 < self.outer_chunk_mb < float("inf")):
            raise ValueError(f"--diloco-x-outer-chunk-mb must be a finite number > 0, got {self.outer_chunk_mb!r}")

    def separate_jobs_problem(self) -> str | None:
        """Why these settings cannot run as separate jobs (``--diloco-x-lighthouse``: rounds that may fail
        and be resolved later need the exact merge's launch point and a residual that can be rolled
        back), naming the flag; None when they can."""
        if self.overlap not in ("none", "partial") or (self.overlap == "partial" and self.merge != "exact"):
            merge = f" --diloco-x-merge {self.merge}" if self.overlap == "partial" else ""
            return ("--diloco-x-lighthouse runs --diloco-x-overlap partial (the default, with --diloco-x-merge "
                    f"exact) or none; got --diloco-x-overlap {self.overlap}{merge}")
        if CODECS[self.compression].matrix:
            return ("--diloco-x-lighthouse takes --diloco-x-compression none or a blockwise codec "
                    f"({', '.join(BLOCKWISE)}); got {self.compression}")
        if self.local_steps_auto:  # a joining job would need the agreed H and its anchor from the run
            return ("--diloco-x-lighthouse takes a fixed --diloco-x-local-steps (a number), not auto: the jobs of a "
                    "run that changes H at its boundaries cannot join it yet")
        return None

    @property
    def exchanges_on_host_mirror(self) -> bool:
        """Whether the exchange runs over the gloo mirror of the outer group (when there is one):
        the matrix codecs (their worker thread never talks over a group the training loop uses), and
        ``none`` with the outer state on the host (its fp32 all-reduce in host memory: no device
        buffer for it; the outer link is the slow one, NCCL's speed buys nothing there)."""
        spec = CODECS[self.compression]
        return spec.matrix or (self.outer_state == "host" and not spec.lossy)

    def outer_timeout_s(self, step_time_s: float | None = None, longest_exchange_s: float = 0.0,
                        round_steps: int | None = None) -> float:
        """T in seconds: ``--diloco-x-outer-timeout-minutes`` when given, else the derived rule of
        :attr:`outer_timeout_minutes` (``step_time_s``: mean inner-step time, None while unknown; ``longest_exchange_s``:
        the longest completed exchange, launch to completion; ``round_steps``: the job's current round, if over H)."""
        if self.outer_timeout_minutes is not None:
            return 60.0 * self.outer_timeout_minutes
        bound = 60.0 * self.distributed_timeout_minutes
        if step_time_s is not None and math.isfinite(step_time_s):
            bound = max(bound, OUTER_TIMEOUT_HEADROOM * max(self.local_steps, round_steps or 0) * step_time_s)
        return max(bound, OUTER_TIMEOUT_HEADROOM * longest_exchange_s)


def ineffective_settings(config: "DiLoCoXConfig") -> list[str]:
    """Settings of ``config`` that differ from their defaults but do nothing with the others given, one sentence
    each naming the flag and what it needs (``install`` prints them as warnings; a value equal to
    the default is not told apart from no flag)."""
    d = {f.name: f.default for f in dataclasses.fields(config)}
    out = []
    if config.merge != d["merge"] and config.overlap != "partial":
        out.append(f"--diloco-x-merge {config.merge} applies to --diloco-x-overlap partial only "
                   f"(overlap is {config.overlap})")
    if config.mix_alpha != d["mix_alpha"] and not (config.overlap == "partial" and config.merge == "mix"):
        out.append("--diloco-x-mix-alpha applies to --diloco-x-merge mix with --diloco-x-overlap partial only")
    if config.rank != d["rank"] and config.compression not in ("lowrank", "lowrank-int8"):
        out.append(f"--diloco-x-rank applies to --diloco-x-compression lowrank / lowrank-int8 only "
                   f"(compression is {config.compression}; adaptive chooses its ranks by --diloco-x-energy)")
    if config.energy != d["energy"] and config.compression != "adaptive":
        out.append(f"--diloco-x-energy applies to --diloco-x-compression adaptive only "
                   f"(compression is {config.compression})")
    if not config.nesterov and config.outer_momentum == 0.0:
        out.append("--diloco-x-no-nesterov changes nothing with --diloco-x-outer-momentum 0 (no momentum)")
    if config.outer_chunk_mb != d["outer_chunk_mb"] and config.outer_state != "host":
        out.append("--diloco-x-outer-chunk-mb applies to --diloco-x-outer-state host only")
    auto_tau = config.overlap == "partial" and (config.overlap_steps is None or bool(config.warmup_iters))
    if config.bandwidth_mbps is not None and not auto_tau and config.compression != "adaptive":
        out.append("--diloco-x-bandwidth-mbps sizes auto tau (--diloco-x-overlap partial, --diloco-x-overlap-steps "
                   "auto) and the adaptive codec's byte budget; neither is used here")
    return out


#: the outer step's long-run gain eta / (1 - mu) above which :func:`outer_step_warning` speaks
OUTER_GAIN_WARN = 1.5


def outer_step_warning(config: "DiLoCoXConfig") -> str | None:
    """A warning when the outer step applies a repeating pseudo-gradient more than :data:`OUTER_GAIN_WARN` times
    over (gain eta / (1 - mu), Nesterov or not), with what such steps measured; else, with more than 2 replicas,
    that the outer step was tuned with 2 and what 4 measured; None otherwise."""
    gain = config.outer_lr / (1.0 - config.outer_momentum)
    if gain > OUTER_GAIN_WARN:
        return (f"--diloco-x-outer-lr {config.outer_lr:g} with --diloco-x-outer-momentum {config.outer_momentum:g} "
                f"applies a repeating pseudo-gradient {gain:.3g} times over. Measured here (85M GPT, 2 replicas; "
                "benchmarks/RESULTS.md sections 2.2 and 2.4): gain 2 (eta 1, mu 0.5) +7.7% above eta 1 / mu 0, and "
                "the papers' eta 0.7 / mu 0.9 (gain 7) diverged at 0.58 and at 1.85 tokens per parameter. The "
                "default, eta 1 / mu 0, was the best measured")
    if config.replicas > 2:
        return (f"{config.replicas} replicas: the outer step (--diloco-x-outer-lr, --diloco-x-outer-momentum) was "
                "tuned with 2. With 4, the default eta 1 / mu 0 ended +7.7% above AllReduce where 2 replicas ended "
                "+2.3% (85M GPT, 1.85 tokens per parameter; benchmarks/RESULTS.md section 2.4, docs/tuning.md); "
                "compare a short run against AllReduce before a long one")
    return None
