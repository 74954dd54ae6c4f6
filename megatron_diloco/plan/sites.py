"""Sites that differ: what a round costs each site of a run of separate jobs whose speed or global batch
differ (``--sites``): with equal H, with a global batch in proportion to speed, and with an H per site.

Inputs: the run's plan (its inner step t at ``--tokens-per-step`` k on the replica's g = TP x PP x DP GPUs,
modelled or measured, the boundary b, the exchange e) and per site m a speed s_m (its GPUs' inner-step rate
relative to the planned ones at the same tokens per GPU: another GPU generation, or a cluster that is shared
and slows down), its tokens per step k_m (its own ``--global-batch-size`` x ``--seq-length``) and its GPUs g_m
(sites of different data-parallel size: ``--diloco-x-exchange-slots``). Site m's inner step is
``t_m = t (k_m / k) (g / g_m) / s_m``; alone it would train ``k_m / t_m`` tokens/s (its *solo* rate; their sum
is the run's ceiling). The exchange is the planned one on every site: a site sends the whole model's
pseudo-gradient over its link whatever its GPUs (a site of fewer GPUs, more bytes per rank).

**Equal H (the same flags everywhere).** Every job runs H inner steps per round and the boundary's
meeting waits for the slowest, so the slowest sets the pace::

    round = H t_max + b + exposed,   exposed = max(0, e - H t_max)  (overlapped; e with overlap none)
    idle_m = round - (H t_m + b)     tokens/s = H sum_m k_m / round
    weight_m = R k_m / sum_m k_m     (the token-weighted mean: docs/federation.md)

**Global batch in proportion to speed** (runs today: jobs may differ in ``--global-batch-size``): every job
runs H steps, a faster site on a larger batch, ``k'_m = k_m t_max / t_m`` tokens per step, so that its step
takes the slowest's (a site's step time taken as proportional to its tokens); the round as above,
``idle_m = 0``, ``tokens/s = H sum_m k'_m / round``, ``weight_m = R k'_m / sum k'``. A real global batch is
a whole number of micro-batches x DP: round k'_m to one (``balanced_tokens_per_step`` is the ideal).

**H per site** (jobs may differ in ``--diloco-x-local-steps`` when their rounds agree; Async Local-SGD's
DyLU, arXiv 2401.09135, sizes H by speed the same way): each site runs the steps that fit the slowest site's
round, ``H_m = floor(H t_max / t_m)``; the round and exposed time as above,
``idle_m = round - (H_m t_m + b)``, ``tokens/s = sum_m H_m k_m / round``, ``weight_m = R H_m k_m / sum``.

Per policy: the run's tokens/s, its ratio to the solo sum, and the largest idle share of a site's wall
time (the fast site's). Pure arithmetic, no torch.
"""

from __future__ import annotations

import dataclasses
import math


#: GiB a rank of a site exchanging by name holds in transfer buffers while it pulls or pushes (send and receive,
#: fp32, ``megatron_adapter.by_name.PIECE_ELEMENTS`` each)
BY_NAME_TRANSFER_GIB = 2 * 4 * (1 << 26) / 2**30


@dataclasses.dataclass(frozen=True)
class Site:
    """One site as ``--sites`` gives it."""

    speed: float
    """Inner-step rate relative to the modelled (or measured) step at the same tokens per step."""
    tokens_per_step: int
    """Tokens of one inner step of this site (its global batch x sequence length)."""
    gpus: int | None = None
    """GPUs of this site (None: the planned replica's)."""


def parse_sites(text: str, replicas: int, tokens_per_step: int) -> list[Site]:
    """``--sites`` as a list: comma-separated ``SPEED``, ``SPEED:TOKENS`` or ``SPEED:TOKENS:GPUS`` per replica
    (TOKENS defaults to ``tokens_per_step``, GPUS to the planned replica's). ``ValueError`` naming ``--sites`` for
    a malformed entry, a speed that is not a finite number > 0, tokens or GPUs below 1, or a count other than
    ``replicas``."""
    sites = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        speed, tokens, gpus = (parts + ["", ""])[:3]
        try:
            if len(parts) > 3:
                raise ValueError
            site = Site(float(speed), int(tokens) if tokens else tokens_per_step, int(gpus) if gpus else None)
        except ValueError:
            raise ValueError(f"--sites: {entry.strip()!r} is not SPEED, SPEED:TOKENS or SPEED:TOKENS:GPUS (e.g. 1,0.5 "
                             "or 1:65536,0.5:32768 or 1:65536:16,1:32768:8)") from None
        if (not (site.speed > 0 and math.isfinite(site.speed)) or site.tokens_per_step < 1
                or (site.gpus is not None and site.gpus < 1)):
            raise ValueError(f"--sites: {entry.strip()!r} needs a speed > 0, tokens >= 1 and GPUs >= 1")
        sites.append(site)
    if len(sites) != replicas:
        raise ValueError(f"--sites lists {len(sites)} sites for --replicas {replicas}: give one entry per replica")
    return sites


@dataclasses.dataclass
class Policy:
    """The run under one rule for the round's steps (module doc)."""

    local_steps: list[int]
    """Inner steps per round, per site."""
    round_s: float
    """Wall time of a round, seconds."""
    idle_fraction: list[float]
    """Per site: the share of its wall time it waits at the boundary for the others."""
    weights: list[float]
    """Per site: its weight in the round's mean (R x its tokens / all sites' tokens)."""
    tokens_per_s: float
    """The run's tokens per second over all sites."""
    throughput_vs_solo_sum: float
    """tokens_per_s / the sum of the sites' solo rates."""
    fast_site_idle_fraction: float
    """The largest idle fraction of any site."""


@dataclasses.dataclass
class SitesPlan:
    """Per site and per policy (module doc): both sets of figures for one run."""

    step_s: list[float]
    """Per site: its inner step t_m, seconds."""
    solo_tokens_per_s: list[float]
    """Per site: k_m / t_m."""
    equal_h: Policy
    """Every site H steps per round at its own tokens per step (the same flags everywhere)."""
    balanced_tokens_per_step: list[float]
    """Per site: the tokens per step k'_m that make its step as long as the slowest's."""
    balanced_batch: Policy
    """Every site H steps per round at :attr:`balanced_tokens_per_step` (runs today)."""
    per_site_h: Policy
    """H_m = floor(H t_max / t_m) (each job its own ``--diloco-x-local-steps``)."""
    shard_ratio: list[float] = dataclasses.field(default_factory=list)
    """Per site: its ranks' shard over the planned replica's, g / g_m (what is sharded over DP, the inner
    optimizer's and the outer state, scales by it: a site of half the GPUs holds two exchange slots per rank)."""


def plan_sites(sites: list[Site], step_s: float, tokens_per_step: int, local_steps: int, boundary_s: float,
               exchange_s: float, overlapped: bool, gpus: int = 1) -> SitesPlan:
    """The module doc's figures. ``step_s``: the inner step at ``tokens_per_step`` tokens on ``gpus`` GPUs (the
    planned replica's); ``local_steps``: H; ``boundary_s``, ``exchange_s``: the plan's; ``overlapped``: the
    exchange may hide under the next round (every overlap rule but ``none``)."""
    steps = [step_s * (s.tokens_per_step / tokens_per_step) * (gpus / (s.gpus or gpus)) / s.speed for s in sites]
    solo = [s.tokens_per_step / t for s, t in zip(sites, steps)]
    slowest = max(steps)
    exposed = max(0.0, exchange_s - local_steps * slowest) if overlapped else exchange_s
    round_s = local_steps * slowest + boundary_s + exposed

    def policy(hs: list[int], per_step: list[float], times: list[float]) -> Policy:
        tokens = [h * k for h, k in zip(hs, per_step)]
        idle = [(round_s - (h * t + boundary_s)) / round_s for h, t in zip(hs, times)]
        rate = sum(tokens) / round_s
        return Policy(hs, round_s, idle, [len(sites) * k / sum(tokens) for k in tokens], rate, rate / sum(solo),
                      max(idle))

    # floor, allowing for the rounding of the ratio (a site exactly twice as fast runs exactly 2 H)
    per_site = [max(1, math.floor(local_steps * slowest / t * (1 + 1e-12))) for t in steps]
    own = [float(s.tokens_per_step) for s in sites]
    balanced = [k * slowest / t for k, t in zip(own, steps)]
    equal = [local_steps] * len(sites)
    return SitesPlan(steps, solo, policy(equal, own, steps), balanced, policy(equal, balanced, [slowest] * len(sites)),
                     policy(per_site, own, steps), [gpus / (s.gpus or gpus) for s in sites])
