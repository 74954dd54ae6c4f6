"""The planner's model: :func:`plan` projects a :class:`~megatron_diloco.plan.config.PlanConfig` to a
:class:`Plan` (memory per GPU, time per step and per round, exchange and exposed time, speedup over
data-parallel AllReduce over the same slow link).

The model is arithmetic; the payload sizes of ``none`` and the blockwise codecs come from the codec
registry (:func:`megatron_diloco.algorithm.compression.codecs.payload_bytes`, the codecs' own count;
importing it imports torch), those of the low-rank and adaptive codecs from :data:`MEASURED_RATIOS`.
The round schedule's rules (auto H, auto tau, the warm-up) are the run's own
(:mod:`megatron_diloco.algorithm.schedule`). Units are in every name (``_s`` seconds, ``_bytes``,
``_gib`` = 2^30 bytes, ``_mbps`` = 10^6 bit/s).

**Layout.** R replicas (``--replicas``), each ``tp x pp x dp`` GPUs on a fast network (the measured
or modelled inner step covers all traffic inside a replica). A rank holds ``N / (tp pp)`` parameters
(equal stages; embedding imbalance ignored) and its outer shard is ``N / (tp pp dp)`` elements, exactly
like the distributed optimizer's fp32 main shard.

**Link model.** Only traffic *between replicas* crosses the slow link. The link is full duplex,
``link_mbps`` each way, carrying ``link_efficiency`` of that as payload (default 1448/1514: TCP/IP
over Ethernet at MTU 1500, measured on tc-shaped links: benchmarks/RESULTS.md), plus ``latency_ms`` per
sequential ring step. One link is shared by a *site* (``--link-scope``): ``cluster`` (one link per
replica, the default: the clusters of the paper joined by one 1 Gbps line), ``node`` (one per
``gpus_per_node`` GPUs) or ``gpu`` (one per rank: the CPU WAN emulation, one shaped veth per rank).
A site's transfer time is the bytes that its ranks send to other replicas over its link, divided by
the payload bandwidth: sites are symmetric, so every site finishes at the same time.

- **The run's ``--diloco-x-bandwidth-mbps``** is the same quantity as ``--link-mbps`` with ``--link-scope
  cluster`` (the payload rate: ``link_mbps x link_efficiency``): the link a replica's ranks share, each
  counting on its share (``config.link_share_bytes_per_s``); the plan prints the flag's value for the
  layout (``bandwidth_flag_mbps``).
- **DiLoCoX exchange** (per round): the outer group of a rank is R ranks, one per replica. ``none``
  is a ring all-reduce of the fp32 shard: each rank sends ``2 (R-1)/R x 4 x shard`` bytes; the
  quantized and low-rank codecs all-gather payloads: ``(R-1) x payload`` (the byte accounting of
  :mod:`megatron_diloco.algorithm.exchange`). Every rank of a site sends at once, so a site carries
  ``ranks_per_site`` times that.
- **AllReduce baseline** (per step): the same job as plain data parallelism over all ``R x dp``
  ranks of a stage; Megatron's distributed optimizer reduce-scatters gradients and all-gathers
  parameters (``baseline_bytes_per_param`` = grad reduce bytes + param bytes, 4 + 2 for bf16 with
  fp32 gradient reduction). ``hierarchical`` (default, the most favourable to AllReduce):
  reduce inside the replica, exchange the ``1/dp`` slice among the R replicas (each rank sends
  ``(R-1)/R x bytes/dp`` of its group), gather inside. ``ring``: one flat ring per (stage, tp rank)
  over ``n = R dp`` ranks ordered replica by replica; the edge leaving a replica carries
  ``(n-1)/n x bytes`` and a site holds ``min(ranks_per_site, tp pp)`` such edges.

**Time.** Inner step ``t = flops_per_token x tokens_per_step / (gpus_per_replica x gpu_tflops)``
(``6 N``, plus ``12 L h s`` attention when the GPT shape is given), or the measured ``step_time_s``.
Round = ``H t + boundary + exposed``; exposed = ``max(0, exchange - H t)`` with an overlap (the
exchange launched at a boundary has up to the next H steps to finish: ``delayed``/``eager`` always
H, ``partial`` with auto tau the fewest steps that hide it, ``min_h``), the whole exchange without
overlap. AllReduce step = ``t + comm`` (``max(t, comm)`` with ``baseline_overlap``).
Speedup = (AllReduce seconds per token) / (DiLoCoX seconds per token), both over R replicas' tokens.

**Memory** per GPU (bytes per parameter of the rank): inner = params (2, bf16) + main grads (4, fp32) +
distributed-optimizer fp32 main params and Adam moments (12 / dp); outer (DiLoCoX) = theta (4) +
momentum (4, if mu > 0) + exchange buffer (4) + error-feedback residual (4, lossy codecs) + eager anchor
(4, ``eager``) or partial's launch point x_L (4, ``partial``, exact merge), all / dp; plus the transient
payload + gather buffer of a quantized exchange ((1 + R) x the shard's payload). With
``--diloco-x-outer-state host`` theta, momentum, residual, anchor and (quantized codecs) the exchange
buffer move to host memory (``host_memory_gib``, per GPU), and so does ``none``'s fp32 all-reduce buffer
(its all-reduce runs on host memory over gloo); the GPU keeps the quantized exchange's payload and the
fixed staging buffers (3 slots x 5 tensors x ``outer_chunk_mb``). The AllReduce job shards its optimizer
over ``R dp``. Activations (of the first pipeline stage, the fullest) are estimated only when the GPT
shape and micro-batch are given (:func:`activation_bytes`), otherwise they are left out and the output
says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from megatron_diloco.algorithm.config import AUTO_H_MIN, BLOCKWISE, CODECS, DiLoCoXConfig, link_share_bytes_per_s
from megatron_diloco.algorithm.schedule import RoundSchedule, auto_local_steps, auto_warmup_iters, steps_to_hide
from megatron_diloco.megatron_adapter.arguments import (
    resolve_warmup, resolve_warmup_compression, resolve_warmup_overlap,
)
from megatron_diloco.plan.config import PlanConfig
from megatron_diloco.plan.sites import SitesPlan, parse_sites, plan_sites

#: Calibration: compression ratios (4 N / payload bytes) of the low-rank and adaptive codecs, measured
#: by ``benchmarks/codecs_bench.py`` on real pseudo-gradients of the 4-layer, hidden-192 demo model
#: (benchmarks/results/codecs.json, 2026-11-26; ``tests/test_plan.py`` checks they agree). Low-rank
#: ratios grow with matrix width (about ``h / (2 r)`` for a square matrix): they understate what a
#: wide model gets; give ``--compression-ratio`` for a measured one.
MEASURED_RATIOS: dict[str, float] = {
    "lowrank-r4": 34.58, "lowrank-r16": 8.851, "lowrank-int8-r4": 135.8, "lowrank-int8-r16": 34.86,
    "adaptive-e0.5": 251.3, "adaptive-e0.9": 49.34, "adaptive-e0.99": 7.769,
}
#: Boundary overhead per shard parameter: (boundary step - inner step) / shard params, measured on
#: 4 x H200 (benchmarks/results/gpu_smoke.json: 179.0 - 173.2 ms over 42.77 M params).
BOUNDARY_NS_PER_PARAM = 0.136


def payload_bytes(codec: str, numel: int) -> int:
    """Bytes of one rank's ``codec`` payload of ``numel`` elements (``none`` or a blockwise codec), as
    the codec counts them (:func:`megatron_diloco.algorithm.compression.codecs.payload_bytes`)."""
    from megatron_diloco.algorithm.compression.codecs import payload_bytes as codec_payload_bytes  # torch (~2 s)

    return codec_payload_bytes(codec, numel)


def measured_ratio(codec: str, rank: int = 4, energy: float = 0.9) -> float:
    """Compression ratio (4 N / payload) of a low-rank/adaptive codec from :data:`MEASURED_RATIOS`
    (the demo model's; see there). Raises ``ValueError`` naming ``--compression-ratio`` when the
    rank / energy was not measured."""
    key = {"lowrank": f"lowrank-r{rank}", "lowrank-int8": f"lowrank-int8-r{rank}",
           "adaptive": f"adaptive-e{energy:g}"}[codec]
    if key not in MEASURED_RATIOS:
        raise ValueError(f"--compression-ratio is required for --codec {codec}: no measured ratio for "
                         f"{key!r} (measured: {', '.join(MEASURED_RATIOS)})")
    return MEASURED_RATIOS[key]


@dataclasses.dataclass
class Plan:
    """Outputs of :func:`plan` (seconds, bytes, GiB)."""

    config: PlanConfig
    params: float
    """N: parameters of one replica."""
    params_per_gpu: float
    """N / (tp pp): parameters on one GPU."""
    shard_params: float
    """N / (tp pp dp): elements of a rank's outer shard (and distributed-optimizer shard)."""
    memory_gib: dict[str, float]
    """DiLoCoX per-GPU memory by component (GiB); ``inner``, ``outer`` and ``total`` sum them."""
    host_memory_gib: float
    """Host memory per GPU for the outer state (``outer_state host``; 0 with ``device``), GiB."""
    baseline_memory_gib: float
    """Per-GPU memory of the AllReduce job (optimizer sharded over R dp, no outer state), GiB."""
    activations_estimated: bool
    """Whether ``memory_gib["activations"]`` is an estimate (GPT shape given) or left out (0)."""
    compute_step_s: float
    """Inner step, seconds (FLOP model or measured)."""
    boundary_s: float
    """Extra time of a boundary step, seconds."""
    compression_ratio: float
    """4 x shard / payload bytes."""
    ratio_source: str
    """Where the ratio came from (formula, measured on the demo model, given)."""
    payload_bytes_per_rank: float
    """Bytes of one rank's encoded pseudo-gradient."""
    bytes_sent_per_rank_per_round: float
    """Bytes a rank sends to other replicas per round (megatron_diloco.algorithm.exchange accounting)."""
    bytes_per_link_per_round: float
    """Bytes one site's link carries (each way) per round."""
    exchange_s: float
    """Time of one round's exchange on the link, seconds."""
    exposed_s: float
    """Time per round the training waits for the exchange, seconds."""
    round_s: float
    """H x step + boundary + exposed, seconds."""
    min_hidden_local_steps: int
    """Smallest H for which the exchange hides under the next round's compute."""
    local_steps: int
    """H of the rounds after the warm-up: the config's, or what ``auto`` chooses for this exchange."""
    bandwidth_flag_mbps: float
    """``--diloco-x-bandwidth-mbps`` for this layout: the payload Mbit/s one replica's ranks share (the
    flag's meaning; each of its ranks counts on 1 / (tp pp dp) of it, as each does here), i.e.
    ``link_mbps x link_efficiency x`` the replica's links (one with ``--link-scope cluster``)."""
    allreduce_bytes_per_link_per_step: float
    """Bytes one site's link carries (each way) per AllReduce step."""
    allreduce_comm_s: float
    """Gradient/parameter synchronization time per AllReduce step, seconds."""
    allreduce_step_s: float
    """AllReduce step time, seconds."""
    dilocox_tokens_per_s: float
    """Tokens per second over all R replicas."""
    allreduce_tokens_per_s: float
    """Tokens per second of the AllReduce job (same GPUs, same tokens per step)."""
    speedup_vs_allreduce: float
    """dilocox_tokens_per_s / allreduce_tokens_per_s."""
    warmup: tuple[int | None, int]
    """(H0, W) of the warm-up as the package resolves the flags; (None, 0): none."""
    warmup_overlap_steps: int
    """tau_w as the package resolves ``--diloco-x-warmup-overlap-steps`` (``partial`` only; else 0)."""
    warmup_codec: str
    """The codec of the exchanges launched into a warm-up round, as the package resolves
    ``--diloco-x-warmup-compression`` (``codec`` without a warm-up)."""
    warmup_exchange_s: float
    """One exchange launched into a warm-up round, seconds (``exchange_s`` but with ``warmup_codec``)."""
    warmup_exposed_s: float
    """Exposed exchange time of the whole warm-up, seconds (once per run): each of ``partial``'s
    warm-up exchanges but the last (which hides under a round of H) hides behind min(tau_w, the steps
    that hide it) steps; ``none`` blocks them all; the other overlap modes hide up to one round of H0
    steps."""
    warmup_share: float | None
    """warmup_exposed_s over the run's compute (``train_iters`` x step); None without train_iters."""
    sites: SitesPlan | None = None
    """``--sites``: each site's step, idle share and weight, with equal H and with an H per site
    (:mod:`megatron_diloco.plan.sites`); None: identical replicas."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = dataclasses.asdict(self.config)
        return d


def _ranks_per_site(cfg: PlanConfig) -> int:
    return {"cluster": cfg.gpus_per_replica, "node": cfg.gpus_per_node, "gpu": 1}[cfg.link_scope]


def _ratio(cfg: PlanConfig, shard: int) -> tuple[float, str]:
    """(4 x shard / payload bytes, where that ratio comes from) for a shard of ``shard`` elements."""
    if cfg.compression_ratio is not None:
        return cfg.compression_ratio, "given"
    if cfg.codec == "none":
        return 1.0, "fp32"
    if cfg.codec in BLOCKWISE:
        return 4 * shard / payload_bytes(cfg.codec, shard), "blockwise formula"
    return measured_ratio(cfg.codec, cfg.rank, cfg.energy), "measured on the hidden-192 demo model"


def activation_bytes(cfg: PlanConfig, stage: int = 0) -> float | None:
    """Activation memory of a GPU of pipeline ``stage`` in bytes (None without the GPT shape).

    Per layer and micro-batch (Korthikanti et al. 2022, bf16): ``s b h (34 + 5 a s / h)`` without
    recomputation (``32 + 4 a s / h`` without dropout masks), ``34 s b h`` selective (attention
    recomputed), ``2 s b h`` full; divided by tp (no sequence parallelism counted). Under 1F1B stage
    ``i`` holds ``pp - i`` micro-batches in flight (at most the number of micro-batches).
    """
    if None in (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_length, cfg.micro_batch):
        return None
    s, b, h, a = cfg.seq_length, cfg.micro_batch, cfg.hidden, cfg.heads
    full_coef = (34 + 5 * a * s / h) if cfg.dropout else (32 + 4 * a * s / h)
    per_layer = {"none": full_coef, "selective": 34.0, "full": 2.0}[cfg.recompute] * s * b * h / cfg.tp
    micro_batches = max(1, cfg.tokens_per_step // (s * b * cfg.dp))
    return per_layer * (cfg.layers // cfg.pp) * min(cfg.pp - stage, micro_batches)


def plan(cfg: PlanConfig) -> Plan:
    """Project ``cfg`` (the module docstring states every formula)."""
    R = cfg.replicas
    auto_h = cfg.local_steps == "auto"
    H = AUTO_H_MIN if auto_h else cfg.local_steps  # (auto: the H the run starts at, its warm-up's)
    n = cfg.n_params
    per_gpu = n / (cfg.tp * cfg.pp)
    shard = per_gpu / cfg.dp
    shard_int = max(1, int(round(shard)))

    ratio, source = _ratio(cfg, shard_int)
    payload = 4 * shard / ratio  # bytes one rank sends per round (before the R-1 factor)
    act = activation_bytes(cfg)
    mem_gib, host, baseline_mem = _memory(cfg, per_gpu, shard, payload, act)
    t_step, t_boundary = _step_times(cfg, shard)

    # ---- DiLoCoX exchange over the slow link ----
    sites = _ranks_per_site(cfg)
    sent, collectives = _exchange_bytes(cfg, payload)
    per_link = sites * sent
    # a rank's share of its site's link (config.link_share_bytes_per_s, as the run sizes auto tau and the
    # adaptive budget by --diloco-x-bandwidth-mbps): the site's ranks all send at once
    share = link_share_bytes_per_s(cfg.link_mbps, sites, cfg.link_efficiency)
    link_s = _link_time(cfg, share)
    exchange = link_s(sent, collectives)
    # the warm-up is resolved from the H a run starts at; auto H then takes the rounds' H from the exchange,
    # and an auto warm-up lengthens to that H's (never shortens: RoundSchedule.extend_warmup)
    h0, w = resolve_warmup(cfg.warmup_local_steps, cfg.warmup_iters, H, cfg.train_iters, cfg.overlap)
    if auto_h:
        H = auto_local_steps(exchange, t_step)
        if w and cfg.warmup_iters is None:
            w = max(w, auto_warmup_iters(H, h0, cfg.train_iters))
    if cfg.overlap == "none":
        exposed = exchange
    else:
        exposed = max(0.0, exchange - H * t_step)
    round_s = H * t_step + t_boundary + exposed
    min_h = steps_to_hide(exchange, t_step)  # auto tau before its cap (the run's rule)

    ar_per_link, ar_comm, ar_step = _allreduce_baseline(cfg, per_gpu, sites, t_step)
    tau_w, warm_codec, warm_exchange, warm_exposed = _warmup(cfg, H, h0, w, exchange, t_step, link_s, shard,
                                                             shard_int)
    warm_share = warm_exposed / (cfg.train_iters * t_step) if cfg.train_iters else None

    sites_plan = None if cfg.sites is None else plan_sites(
        parse_sites(cfg.sites, R, cfg.tokens_per_step), t_step, cfg.tokens_per_step, H, t_boundary, exchange,
        cfg.overlap != "none", cfg.gpus_per_replica)
    tokens_round = H * R * cfg.tokens_per_step
    dx_tps = tokens_round / round_s
    ar_tps = R * cfg.tokens_per_step / ar_step
    return Plan(
        config=cfg, params=n, params_per_gpu=per_gpu, shard_params=shard, memory_gib=mem_gib,
        host_memory_gib=host / 2**30, baseline_memory_gib=baseline_mem, activations_estimated=act is not None,
        compute_step_s=t_step, boundary_s=t_boundary, compression_ratio=ratio, ratio_source=source,
        payload_bytes_per_rank=payload, bytes_sent_per_rank_per_round=sent if R > 1 else 0.0,
        bytes_per_link_per_round=per_link if R > 1 else 0.0, exchange_s=exchange, exposed_s=exposed,
        round_s=round_s, min_hidden_local_steps=min_h, local_steps=H,
        bandwidth_flag_mbps=share * 8 / 1e6 * cfg.gpus_per_replica, allreduce_bytes_per_link_per_step=ar_per_link,
        allreduce_comm_s=ar_comm, allreduce_step_s=ar_step, dilocox_tokens_per_s=dx_tps,
        allreduce_tokens_per_s=ar_tps, speedup_vs_allreduce=dx_tps / ar_tps,
        warmup=(h0, w), warmup_overlap_steps=tau_w, warmup_codec=warm_codec or cfg.codec,
        warmup_exchange_s=warm_exchange,
        warmup_exposed_s=warm_exposed, warmup_share=warm_share, sites=sites_plan,
    )


def _memory(cfg: PlanConfig, per_gpu: float, shard: float, payload: float,
            act: float | None) -> tuple[dict[str, float], float, float]:
    """(DiLoCoX per-GPU GiB by component with ``inner``, ``outer`` and ``total``, the outer state's host
    bytes per GPU, the AllReduce job's per-GPU GiB)."""
    R = cfg.replicas
    lossy = cfg.codec != "none"
    outer = {  # bytes of the rank's outer state (the exchange buffer is the payload with ``none``)
        "outer_theta": 4 * shard,
        "outer_momentum": 4 * shard if cfg.outer_momentum > 0 else 0.0,
        "outer_exchange_buffer": 4 * shard,
        "outer_residual": 4 * shard if lossy else 0.0,
        "outer_eager_anchor": 4 * shard if cfg.overlap == "eager" else 0.0,
        "outer_launch_point": 4 * shard if cfg.overlap == "partial" else 0.0,  # x_L (exact merge)
    }
    host = 0.0
    if cfg.outer_state == "host":  # all on the host (none's all-reduce too); fixed staging buffers on the GPU
        host = sum(outer.values())
        outer = {k: 0.0 for k in outer}
        outer["outer_staging"] = min(3 * 5 * cfg.outer_chunk_mb * 2**20, 3 * 5 * 4 * shard)  # outer_store.SLOTS
    mem = {
        "params": cfg.param_bytes * per_gpu,
        "main_grads": cfg.grad_bytes * per_gpu,
        "inner_optimizer": cfg.optimizer_bytes * shard,
        **outer,
        "exchange_transient": (1 + R) * payload if cfg.codec in BLOCKWISE else 0.0,
        "activations": act or 0.0,
    }
    mem_gib = {k: v / 2**30 for k, v in mem.items()}
    mem_gib["inner"] = sum(mem_gib[k] for k in ("params", "main_grads", "inner_optimizer"))
    mem_gib["outer"] = sum(mem_gib[k] for k in mem if k.startswith("outer_") or k == "exchange_transient")
    mem_gib["total"] = sum(mem.values()) / 2**30
    baseline_mem = (mem["params"] + mem["main_grads"] + cfg.optimizer_bytes * per_gpu / (cfg.dp * R)
                    + mem["activations"]) / 2**30
    return mem_gib, host, baseline_mem


def _step_times(cfg: PlanConfig, shard: float) -> tuple[float, float]:
    """(inner step, extra time of a boundary step), seconds."""
    if cfg.step_time_s is not None:
        t_step = cfg.step_time_s
    else:
        t_step = cfg.flops_per_token * cfg.tokens_per_step / (cfg.gpus_per_replica * cfg.gpu_tflops * 1e12)
    t_boundary = cfg.boundary_s if cfg.boundary_s is not None else BOUNDARY_NS_PER_PARAM * 1e-9 * shard
    return t_step, t_boundary


def _exchange_bytes(cfg: PlanConfig, payload: float) -> tuple[float, int]:
    """(bytes a rank sends to other replicas per round, sequential collectives) for a ``payload``-byte
    pseudo-gradient, by the codec's collective in the registry (``config.CODECS``)."""
    R = cfg.replicas
    spec = CODECS[cfg.codec]
    if spec.collective == "all-reduce":
        return 2 * (R - 1) / R * payload, 2 * (R - 1)  # ring all-reduce
    return (R - 1) * payload, (R - 1) * (2 if spec.matrix else 1)  # all-gather of payloads; low-rank: P, then Q


def _link_time(cfg: PlanConfig, share: float) -> Callable[[float, int], float]:
    """``link_s(sent_bytes, collectives)``: seconds one exchange takes on the slow link, a rank's bytes
    at its ``share`` (bytes/s) of its site's link plus the latency of each sequential collective."""
    lat = cfg.latency_ms * 1e-3

    def link_s(sent_bytes: float, collectives: int) -> float:
        return sent_bytes / share + collectives * lat if cfg.replicas > 1 else 0.0

    return link_s


def _allreduce_baseline(cfg: PlanConfig, per_gpu: float, sites: int, t_step: float) -> tuple[float, float, float]:
    """The same job as plain DP over R x dp ranks per stage: (bytes per link per step, comm seconds,
    step seconds)."""
    R = cfg.replicas
    rate = cfg.link_mbps * 1e6 / 8 * cfg.link_efficiency  # payload bytes/s per link, each way
    lat = cfg.latency_ms * 1e-3
    bpp = cfg.baseline_bytes_per_param if cfg.baseline_bytes_per_param is not None else (
        cfg.grad_bytes + cfg.param_bytes)
    group_bytes = bpp * per_gpu  # bytes one (stage, tp rank) group reduces + gathers per step
    if cfg.baseline_algo == "hierarchical":
        ar_per_link = sites * (R - 1) / R * group_bytes / cfg.dp
        ar_steps = 2 * (R - 1)
    else:
        ring_n = R * cfg.dp
        ar_per_link = min(sites, cfg.tp * cfg.pp) * (ring_n - 1) / ring_n * group_bytes
        ar_steps = 2 * (ring_n - 1)
    ar_comm = ar_per_link / rate + ar_steps * lat if R > 1 else 0.0
    ar_step = max(t_step, ar_comm) if cfg.baseline_overlap else t_step + ar_comm
    return ar_per_link, ar_comm, ar_step


def _warmup(cfg: PlanConfig, H: int, h0: int | None, w: int, exchange: float, t_step: float,
            link_s: Callable[[float, int], float], shard: float,
            shard_int: int) -> tuple[int, str | None, float, float]:
    """The warm-up (one-time): rounds of H0; with ``partial`` each overlaps at most tau_w steps. All but
    the warm-up's last exchange launch into a warm-up round (``warmup_codec``'s); the last one launches
    into a round of H and takes ``codec``. Returns (tau_w, the warm-up codec or None, one warm-up
    exchange's seconds, the whole warm-up's exposed seconds)."""
    R = cfg.replicas
    warm_rounds = w // h0 if h0 else 0
    tau_w = resolve_warmup_overlap(cfg.warmup_overlap_steps, h0, cfg.overlap) if w else 0
    warm_codec = resolve_warmup_compression(cfg.warmup_codec, cfg.codec, w)
    warm_exchange = exchange
    if warm_codec is not None:  # blockwise: one all-gather of payloads
        warm_exchange = link_s((R - 1) * shard * payload_bytes(warm_codec, shard_int) / shard_int, R - 1)
    if cfg.overlap == "none":
        warm_exposed = max(0, warm_rounds - 1) * warm_exchange + (exchange if warm_rounds else 0.0)
    elif cfg.overlap == "partial" and warm_rounds:  # the warm-up's last boundary launches into a round of H
        # tau of an exchange launched into a warm-up round, as the run chooses it (auto, capped at tau_w)
        schedule = RoundSchedule(DiLoCoXConfig(replicas=max(R, 1), local_steps=H, overlap="partial",
                                               compression=cfg.codec, warmup_local_steps=h0, warmup_iters=w,
                                               warmup_overlap_steps=tau_w))
        hidden = schedule.overlap_steps(h0, warm_exchange, t_step) * t_step
        warm_exposed = max(0, warm_rounds - 1) * max(0.0, warm_exchange - hidden)
    elif cfg.overlap == "partial":
        warm_exposed = 0.0
    else:
        warm_exposed = ((max(0, warm_rounds - 1) * max(0.0, warm_exchange - h0 * t_step)
                         + max(0.0, exchange - h0 * t_step)) if h0 and warm_rounds else 0.0)
    return tau_w, warm_codec, warm_exchange, warm_exposed
