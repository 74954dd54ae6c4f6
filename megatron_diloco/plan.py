"""Analytic projection of a DiLoCoX run: memory per GPU, time per step and per round, exchange and
exposed time, and speedup over data-parallel AllReduce over the same slow link.

    python -m megatron_diloco.plan --params 107e9 --pp 8 --dp 10 --replicas 2 --gpu-tflops 125 \\
        --tokens-per-step 327680 --link-mbps 1000 --local-steps 500 --codec int8
    python -m megatron_diloco.plan --preset paper [--json]

The model is arithmetic; only the blockwise codecs' byte layout is imported from the codec (which
imports torch). Units are in every name (``_s`` seconds, ``_bytes``,
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

**Memory** per GPU (bytes per parameter of the rank): inner = params (2, bf16) + main grads (4,
fp32) + distributed-optimizer fp32 main params and Adam moments (12 / dp); outer (DiLoCoX) = theta
(4) + momentum (4, if mu > 0) + exchange buffer (4) + error-feedback residual (4, lossy codecs) +
eager anchor (4, ``eager``) or partial's launch point x_L (4, ``partial``, exact merge), all / dp; plus the transient payload + gather buffer of a quantized
exchange ((1 + R) x the shard's payload). With ``--diloco-x-outer-state host`` theta, momentum, residual, anchor and (quantized codecs) the exchange buffer move to host
memory (``host_memory_gib``, per GPU), and so does ``none``'s fp32 all-reduce buffer (its all-reduce
runs on host memory over gloo); the GPU keeps the quantized exchange's payload and the fixed staging
buffers (3 slots x 5 tensors x ``outer_chunk_mb``). The
AllReduce job shards its optimizer over ``R dp``. Activations (of the first pipeline stage, the
fullest) are estimated only when the GPT shape and micro-batch are given (:func:`activation_bytes`),
otherwise they are left out and the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Any

from megatron_diloco.megatron_adapter.arguments import resolve_warmup, resolve_warmup_compression, resolve_warmup_overlap
from megatron_diloco.algorithm.config import AUTO_H_MIN, BLOCKWISE, CODECS, DiLoCoXConfig, link_share_bytes_per_s
from megatron_diloco.algorithm.schedule import RoundSchedule, auto_local_steps, auto_warmup_iters, steps_to_hide

#: Payload fraction of a TCP/IPv4 stream on Ethernet at MTU 1500 (1448 payload bytes per 1514 on the wire).
TCP_EFFICIENCY = 1448 / 1514
#: Elements per fp32 scale of the blockwise codecs (``reference.DEFAULT_BLOCK_SIZE``).
BLOCK_SIZE = 256
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


def blockwise_payload_bytes(numel: int, fmt: str, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one blockwise-quantized payload of ``numel`` elements: the codec's own layout
    (:func:`megatron_diloco.algorithm.compression.reference.payload_layout`: fp32 scales, values, padding)."""
    if fmt not in BLOCKWISE:
        raise ValueError(f"--codec: no blockwise payload for {fmt!r}")
    from megatron_diloco.algorithm.compression.reference import payload_layout  # imports torch (~2 s)

    return payload_layout(numel, fmt, block_size).total_bytes


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
class PlanConfig:
    """Inputs of the projection. Every field maps to the ``--flag`` of the same name (``_`` -> ``-``)."""

    # ---------------- model ----------------
    params: float | None = None
    """N: parameters of one model replica. None: computed from the GPT shape below."""
    layers: int | None = None
    """L: transformer layers (GPT shape; enables the attention FLOPs and the activation estimate)."""
    hidden: int | None = None
    """h: hidden size."""
    ffn_hidden: int | None = None
    """FFN hidden size (default 4 h)."""
    vocab: int | None = None
    """Padded vocabulary size (embedding and, untied, output layer)."""
    heads: int | None = None
    """a: attention heads (activation estimate)."""
    seq_length: int | None = None
    """s: sequence length in tokens."""
    swiglu: bool = False
    """Gated FFN (three FFN matrices instead of two)."""
    tied_embeddings: bool = False
    """Output layer shares the embedding (counted once)."""

    # ---------------- batch ----------------
    tokens_per_step: int = 0
    """Tokens one replica processes per inner step (its global batch x sequence length)."""
    micro_batch: int | None = None
    """b: micro-batch size (activation estimate only)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` or ``full`` (activation estimate only)."""
    dropout: bool = True
    """Dropout masks are stored (activation estimate only; ``--no-dropout`` for dropout 0)."""

    # ---------------- layout ----------------
    tp: int = 1
    """Tensor-parallel size inside a replica."""
    pp: int = 1
    """Pipeline-parallel size inside a replica."""
    dp: int = 1
    """Data-parallel size inside a replica (the distributed optimizer and the outer state shard over it)."""
    replicas: int = 2
    """R: replicas (clusters)."""
    gpus_per_node: int = 8
    """GPUs per node (``--link-scope node``)."""

    # ---------------- compute ----------------
    gpu_tflops: float | None = None
    """Achieved model TFLOP/s per GPU (pipeline bubble included). Ignored when step_time_s is given."""
    step_time_s: float | None = None
    """Measured inner-step time in seconds (overrides the FLOP model)."""
    boundary_s: float | None = None
    """Extra time of a boundary step in seconds (pseudo-gradient, outer step, re-gather). None:
    BOUNDARY_NS_PER_PARAM x shard parameters."""

    # ---------------- slow link ----------------
    link_mbps: float = 1000.0
    """Slow-link bandwidth, Mbit/s each way (full duplex)."""
    latency_ms: float = 0.0
    """One-way latency per sequential ring step, milliseconds."""
    link_scope: str = "cluster"
    """Ranks sharing one link: ``cluster`` (a replica), ``node`` (gpus_per_node) or ``gpu`` (one rank)."""
    link_efficiency: float = TCP_EFFICIENCY
    """Payload fraction of the link rate."""

    # ---------------- DiLoCoX ----------------
    local_steps: int | str = 500
    """H: inner steps per outer round, or ``auto`` (the run's rule: 8 x the steps that hide the
    modelled exchange, within the run's bounds)."""
    codec: str = "int4"
    """Pseudo-gradient codec (``--diloco-x-compression``)."""
    compression_ratio: float | None = None
    """4 N / payload bytes. None: the exact blockwise formula (none/int8/int4/fp8/int2) or the measured
    :data:`MEASURED_RATIOS` (lowrank, lowrank-int8 at ``rank``, adaptive at ``energy``)."""
    rank: int = 4
    """Low-rank rank (ratio lookup in :data:`MEASURED_RATIOS`)."""
    energy: float = 0.9
    """Adaptive energy target (ratio lookup in :data:`MEASURED_RATIOS`)."""
    overlap: str = "partial"
    """``partial`` (the package default, auto tau: the exchange lands the fewest steps later that
    hide it, at most H) / ``delayed`` / ``eager``: exchange hidden behind up to one round; ``none``:
    blocking."""
    outer_momentum: float = 0.0
    """mu: > 0 allocates the outer momentum buffer."""
    outer_state: str = "device"
    """Where the outer state lives (``--diloco-x-outer-state``): ``device`` (the GPU) or ``host`` (host memory)."""
    outer_chunk_mb: float = 16.0
    """``outer_state host``: MiB per staged chunk (``--diloco-x-outer-chunk-mb``)."""
    warmup_local_steps: int | None = None
    """H0 of the warm-up (``--diloco-x-warmup-local-steps``). None: auto, min(H // 3, 10)."""
    warmup_iters: int | None = None
    """W, inner steps of the warm-up (``--diloco-x-warmup-iters``; 0: none). None: auto, 30 H, at most
    half of ``train_iters``."""
    warmup_overlap_steps: int | None = None
    """``partial``: the most steps a warm-up round's exchange overlaps (``--diloco-x-warmup-overlap-steps``;
    0: they block). None: auto, H0 // 10."""
    warmup_codec: str | None = None
    """The codec of the exchanges launched into a warm-up round (``--diloco-x-warmup-compression``, a
    blockwise codec). None: auto, as the package resolves it (int2 under int4)."""
    train_iters: int | None = None
    """Inner steps of the whole run (caps the auto warm-up; the warm-up's one-time cost as a share)."""

    # ---------------- memory ----------------
    param_bytes: int = 2
    """Bytes per model parameter (2: bf16, 4: fp32)."""
    grad_bytes: int = 4
    """Bytes per main gradient (4: fp32 grad buffer, Megatron's default with bf16)."""
    optimizer_bytes: int = 12
    """Distributed-optimizer bytes per parameter before sharding (fp32 main params + Adam m, v)."""
    gpu_memory_gib: float | None = None
    """GPU memory in GiB, to say whether the plan fits."""

    # ---------------- AllReduce baseline ----------------
    baseline_algo: str = "hierarchical"
    """``hierarchical`` (reduce in the replica, exchange 1/dp across replicas) or ``ring`` (flat ring)."""
    baseline_bytes_per_param: float | None = None
    """Bytes per parameter a step reduces/gathers. None: grad_bytes + param_bytes (reduce-scatter of
    the main grads + all-gather of the params, Megatron's distributed optimizer)."""
    baseline_overlap: bool = False
    """Overlap the AllReduce with the backward pass (step = max(compute, comm))."""

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        _choice("outer_state", self.outer_state, ("device", "host"))
        if not self.outer_chunk_mb > 0:
            raise ValueError(f"--outer-chunk-mb must be > 0, got {self.outer_chunk_mb!r}")
        """Raise ``ValueError`` naming the ``--flag`` of any invalid value."""
        for name in ("tp", "pp", "dp", "replicas", "gpus_per_node", "local_steps", "rank"):
            v = getattr(self, name)
            if name == "local_steps" and v == "auto":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {v!r}")
        shape = (self.layers, self.hidden)
        if self.params is None and None in shape:
            raise ValueError("--params is required unless the GPT shape (--layers, --hidden) is given")
        if self.params is not None and not (self.params > 0 and math.isfinite(self.params)):
            raise ValueError(f"--params must be a finite number > 0, got {self.params!r}")
        for name in ("layers", "hidden", "ffn_hidden", "vocab", "heads", "seq_length", "micro_batch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {v!r}")
        if self.layers is not None and self.layers % self.pp:
            raise ValueError(f"--pp ({self.pp}) must divide --layers ({self.layers})")
        if self.heads is not None and self.heads % self.tp:
            raise ValueError(f"--tp ({self.tp}) must divide --heads ({self.heads})")
        if not isinstance(self.tokens_per_step, int) or self.tokens_per_step < 1:
            raise ValueError(f"--tokens-per-step must be an integer >= 1, got {self.tokens_per_step!r}")
        if self.step_time_s is None:
            if self.gpu_tflops is None or not (self.gpu_tflops > 0 and math.isfinite(self.gpu_tflops)):
                raise ValueError(f"--gpu-tflops must be a finite number > 0 (or give --step-time-s), "
                                 f"got {self.gpu_tflops!r}")
        elif not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"--step-time-s must be a finite number > 0, got {self.step_time_s!r}")
        if self.boundary_s is not None and not (self.boundary_s >= 0 and math.isfinite(self.boundary_s)):
            raise ValueError(f"--boundary-s must be a finite number >= 0, got {self.boundary_s!r}")
        if not (self.link_mbps > 0 and math.isfinite(self.link_mbps)):
            raise ValueError(f"--link-mbps must be a finite number > 0, got {self.link_mbps!r}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"--latency-ms must be a finite number >= 0, got {self.latency_ms!r}")
        if not (0 < self.link_efficiency <= 1):
            raise ValueError(f"--link-efficiency must be in (0, 1], got {self.link_efficiency!r}")
        _choice("link_scope", self.link_scope, ("cluster", "node", "gpu"))
        _choice("codec", self.codec, tuple(CODECS))
        if self.warmup_codec not in (None, "auto"):
            _choice("warmup_codec", self.warmup_codec, BLOCKWISE)
            if self.codec not in BLOCKWISE:
                raise ValueError(f"--warmup-codec needs a blockwise --codec ({', '.join(BLOCKWISE)}), "
                                 f"got {self.codec!r}")
        _choice("overlap", self.overlap, ("none", "partial", "delayed", "eager"))
        _choice("recompute", self.recompute, ("none", "selective", "full"))
        _choice("baseline_algo", self.baseline_algo, ("hierarchical", "ring"))
        if self.compression_ratio is not None and not (self.compression_ratio >= 1 and
                                                       math.isfinite(self.compression_ratio)):
            raise ValueError(f"--compression-ratio must be a finite number >= 1, got {self.compression_ratio!r}")
        if not (0 <= self.outer_momentum < 1):
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum!r}")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            if getattr(self, name) not in (0, 1, 2, 4, 8, 12, 16):
                raise ValueError(f"{_flag(name)} must be a byte count like 2, 4 or 12, got {getattr(self, name)!r}")
        if self.baseline_bytes_per_param is not None and not self.baseline_bytes_per_param > 0:
            raise ValueError(f"--baseline-bytes-per-param must be > 0, got {self.baseline_bytes_per_param!r}")
        if self.link_scope == "node" and self.gpus_per_replica % self.gpus_per_node:
            raise ValueError(f"--gpus-per-node ({self.gpus_per_node}) must divide the GPUs of a replica "
                             f"(tp x pp x dp = {self.gpus_per_replica}) with --link-scope node")

    # ---------------------------------------------------------------- derived sizes
    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_params(self) -> float:
        """N: parameters of one replica (given, or from the GPT shape)."""
        if self.params is not None:
            return float(self.params)
        h, L = self.hidden, self.layers
        ffn = self.ffn_hidden or 4 * h
        per_layer = 4 * h * h + (3 if self.swiglu else 2) * h * ffn + 2 * h  # qkv+proj, FFN, 2 norms
        emb = (self.vocab or 0) * h * (1 if self.tied_embeddings else 2)
        return float(L * per_layer + emb + h)

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N, plus 12 L h s for the attention score/value matmuls."""
        attn = 12 * self.layers * self.hidden * self.seq_length if None not in (
            self.layers, self.hidden, self.seq_length) else 0
        return 6 * self.n_params + attn


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {value!r}")


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

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = dataclasses.asdict(self.config)
        return d


def _ranks_per_site(cfg: PlanConfig) -> int:
    return {"cluster": cfg.gpus_per_replica, "node": cfg.gpus_per_node, "gpu": 1}[cfg.link_scope]


def _ratio(cfg: PlanConfig, shard: int) -> tuple[float, str]:
    if cfg.compression_ratio is not None:
        return cfg.compression_ratio, "given"
    if cfg.codec == "none":
        return 1.0, "fp32"
    if cfg.codec in BLOCKWISE:
        return 4 * shard / blockwise_payload_bytes(shard, cfg.codec), "blockwise formula"
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
    """Project ``cfg`` (see the module docstring for every formula)."""
    R = cfg.replicas
    auto_h = cfg.local_steps == "auto"
    H = AUTO_H_MIN if auto_h else cfg.local_steps  # (auto: the H the run starts at, its warm-up's)
    n = cfg.n_params
    per_gpu = n / (cfg.tp * cfg.pp)
    shard = per_gpu / cfg.dp
    shard_int = max(1, int(round(shard)))

    # ---- memory (bytes per GPU) ----
    lossy = cfg.codec != "none"
    ratio, source = _ratio(cfg, shard_int)
    payload = 4 * shard / ratio  # bytes one rank sends per round (before the R-1 factor)
    act = activation_bytes(cfg)
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

    # ---- compute ----
    if cfg.step_time_s is not None:
        t_step = cfg.step_time_s
    else:
        t_step = cfg.flops_per_token * cfg.tokens_per_step / (cfg.gpus_per_replica * cfg.gpu_tflops * 1e12)
    t_boundary = cfg.boundary_s if cfg.boundary_s is not None else BOUNDARY_NS_PER_PARAM * 1e-9 * shard

    # ---- DiLoCoX exchange over the slow link ----
    rate = cfg.link_mbps * 1e6 / 8 * cfg.link_efficiency  # payload bytes/s per link, each way
    lat = cfg.latency_ms * 1e-3
    sites = _ranks_per_site(cfg)
    spec = CODECS[cfg.codec]
    if spec.collective == "all-reduce":
        sent = 2 * (R - 1) / R * payload  # ring all-reduce
        steps = 2 * (R - 1)
    else:
        sent = (R - 1) * payload  # all-gather of payloads
        steps = (R - 1) * (2 if spec.matrix else 1)  # low-rank: P, then Q
    per_link = sites * sent

    # a rank's share of its site's link (config.link_share_bytes_per_s, as the run sizes auto tau and the
    # adaptive budget by --diloco-x-bandwidth-mbps): the site's ranks all send at once
    share = link_share_bytes_per_s(cfg.link_mbps, sites, cfg.link_efficiency)

    def link_s(sent_bytes: float, collectives: int) -> float:
        """Seconds one exchange takes on the slow link: a rank's bytes at its share, plus latency."""
        return sent_bytes / share + collectives * lat if R > 1 else 0.0

    exchange = link_s(sent, steps)
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

    # ---- AllReduce baseline: the same job as plain DP over R x dp ranks per stage ----
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

    # ---- the warm-up (one-time): rounds of H0; with partial each overlaps at most tau_w steps ----
    # (all but the warm-up's last exchange launch into a warm-up round: --warmup-codec's; the last
    # one launches into a round of H and takes ``codec``)
    warm_rounds = w // h0 if h0 else 0
    tau_w = resolve_warmup_overlap(cfg.warmup_overlap_steps, h0, cfg.overlap) if w else 0
    warm_codec = resolve_warmup_compression(cfg.warmup_codec, cfg.codec, w)
    warm_exchange = exchange
    if warm_codec is not None:  # blockwise: one all-gather of payloads
        warm_exchange = link_s((R - 1) * shard * blockwise_payload_bytes(shard_int, warm_codec) / shard_int, R - 1)
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
    warm_share = warm_exposed / (cfg.train_iters * t_step) if cfg.train_iters else None

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
        warmup_exposed_s=warm_exposed, warmup_share=warm_share,
    )


# -------------------------------------------------------------------- presets
A800_BF16_PEAK_TFLOPS = 312.0
#: The paper's setting (arXiv 2506.21263): 107B, 160 A800 in 20 nodes x 8, PP 8, 1 Gbps. What the
#: paper does not state here is assumed (see :data:`PAPER_ASSUMPTIONS`).
PAPER_PRESET: dict[str, Any] = dict(
    params=107e9, tp=1, pp=8, dp=10, replicas=2, gpus_per_node=8,
    gpu_tflops=0.4 * A800_BF16_PEAK_TFLOPS, tokens_per_step=160 * 2048,
    link_mbps=1000.0, latency_ms=0.0, link_scope="cluster", local_steps=500, codec="int8",
    overlap="delayed", outer_momentum=0.9, gpu_memory_gib=80.0,
)
PAPER_ASSUMPTIONS: tuple[str, ...] = (
    "2 clusters of 10 nodes (PP 8 x DP 10 each), as in the paper's Fig. 1 (2 clusters, PP 8 x DP 2) scaled to 160 GPUs",
    "A800 bf16 dense peak 312 TFLOP/s at 40% model FLOPs utilization (124.8 TFLOP/s achieved)",
    "160 sequences x 2048 tokens per replica step (327,680 tokens; 16 micro-batches of 1 per DP rank)",
    "one 1 Gbit/s full-duplex line between the clusters, 95.6% TCP payload efficiency, no latency term",
    "H = 500 (DiLoCo default), int8 pseudo-gradients (the paper's adaptive low-rank + quantization sends fewer bytes)",
    "AllReduce baseline: hierarchical reduce-scatter fp32 grads + all-gather bf16 params (6 B/param), no overlap",
)

PRESETS: dict[str, dict[str, Any]] = {"paper": PAPER_PRESET}


# -------------------------------------------------------------------- output
def _fmt_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def _h(c: PlanConfig, p: Plan) -> str:
    """H as the report states it: the number, or ``auto -> N`` (what the run would choose)."""
    return f"auto -> {p.local_steps}" if c.local_steps == "auto" else str(p.local_steps)


def _fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 1:
        return f"{s:.4g} s"
    return f"{s * 1e3:.3g} ms"


def format_table(p: Plan) -> str:
    """A readable two-column table of the projection."""
    c = p.config
    m = p.memory_gib
    fits = "" if c.gpu_memory_gib is None else (
        f"  ({'fits' if m['total'] <= c.gpu_memory_gib else 'does NOT fit'} {c.gpu_memory_gib:g} GiB)")
    rows = [
        ("model", f"{p.params / 1e9:.4g} B params; {p.params_per_gpu / 1e9:.4g} B per GPU; "
                  f"outer shard {p.shard_params / 1e6:.4g} M per rank"),
        ("layout", f"{c.replicas} replicas x (TP {c.tp} x PP {c.pp} x DP {c.dp}) = "
                   f"{c.replicas * c.gpus_per_replica} GPUs; link {c.link_mbps:g} Mbit/s per {c.link_scope}"),
        ("memory / GPU, DiLoCoX", f"{m['total']:.2f} GiB = inner {m['inner']:.2f} (params {m['params']:.2f}, "
                                  f"grads {m['main_grads']:.2f}, optimizer {m['inner_optimizer']:.2f}) + outer "
                                  f"{m['outer']:.2f} + activations "
                                  + (f"{m['activations']:.2f}" if p.activations_estimated else "not estimated")
                                  + fits + f"; outer state on the {c.outer_state}"
                                  + (f" ({p.host_memory_gib:.2f} GiB host memory per GPU)"
                                     if c.outer_state == "host" else "")),
        ("memory / GPU, AllReduce job", f"{p.baseline_memory_gib:.2f} GiB"),
        ("inner step", _fmt_s(p.compute_step_s) + ("  (measured)" if c.step_time_s is not None else
                                                   f"  ({p.config.gpu_tflops:g} TFLOP/s per GPU)")),
        ("codec", f"{c.codec}, {p.compression_ratio:.4g}x vs fp32 ({p.ratio_source})"),
        ("exchange / round", f"{_fmt_bytes(p.bytes_sent_per_rank_per_round)} per rank, "
                             f"{_fmt_bytes(p.bytes_per_link_per_round)} per link -> {_fmt_s(p.exchange_s)}"),
        ("exposed / round", f"{_fmt_s(p.exposed_s)} ({c.overlap}; H = {_h(c, p)}, "
                            f"hidden from H = {p.min_hidden_local_steps}; run with --diloco-x-bandwidth-mbps "
                            f"{p.bandwidth_flag_mbps:.4g})"),
        ("round", f"{_fmt_s(p.round_s)} = {p.local_steps} x {_fmt_s(p.compute_step_s)} + boundary "
                  f"{_fmt_s(p.boundary_s)} + exposed"),
        ("warm-up (once)", "none" if not p.warmup[1] else
         f"{p.warmup[1]} steps in rounds of {p.warmup[0]}"
         + (f", tau_w {p.warmup_overlap_steps}" if c.overlap == "partial" else "")
         + (f", {p.warmup_codec} exchanges of {_fmt_s(p.warmup_exchange_s)}" if p.warmup_codec != c.codec else "")
         + f": {_fmt_s(p.warmup_exposed_s)} exposed in all"
         + (f" ({100 * p.warmup_share:.2g}% of the {c.train_iters}-step run's compute)" if p.warmup_share is not None
            else " (give --train-iters for its share of the run)")),
        ("AllReduce step", f"{_fmt_s(p.allreduce_step_s)} = compute + {_fmt_s(p.allreduce_comm_s)} comm "
                           f"({_fmt_bytes(p.allreduce_bytes_per_link_per_step)} per link, {c.baseline_algo})"),
        ("tokens/s", f"DiLoCoX {p.dilocox_tokens_per_s:,.0f}; AllReduce {p.allreduce_tokens_per_s:,.1f}"),
        ("speedup vs AllReduce", f"{p.speedup_vs_allreduce:.1f}x"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


# -------------------------------------------------------------------- CLI
def _field_docs() -> dict[str, str]:
    """The docstring under each PlanConfig field (first sentence), for ``--help``."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(PlanConfig)).body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            text = " ".join(str(b.value.value).split())
            text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`", r"\1", text).replace("``", "")  # no Sphinx markup
            docs[a.target.id] = text.replace("%", "%%")
    return docs


def build_parser() -> argparse.ArgumentParser:
    docs = _field_docs()
    p = argparse.ArgumentParser(prog="python -m megatron_diloco.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset (flags given override it)")
    p.add_argument("--json", action="store_true", help="print the projection as JSON")
    p.add_argument("training", nargs=argparse.REMAINDER, metavar="-- TRAINING FLAGS",
                   help="your pretraining command line after `--`: Megatron's model, batch and parallelism flags "
                        "and the --diloco-x* flags set the corresponding values (this tool's own flags, given "
                        "before `--`, override them); what it cannot know (--dp, --gpu-tflops or --step-time-s, "
                        "--link-mbps without --diloco-x-bandwidth-mbps) comes from this tool's flags")
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    for f in dataclasses.fields(PlanConfig):
        flag = _flag(f.name)
        doc = docs.get(f.name, "")
        default = defaults[f.name]
        doc = f"{doc} (default: {'not set' if default is None else default})" if doc else doc
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc or None)
        else:
            conv = {"int": int, "int | None": int, "float | None": float, "float": float}.get(f.type, str)
            if f.name == "params":
                conv = lambda v: float(v)  # noqa: E731 (accepts 107e9)
            if f.name == "local_steps":
                conv = lambda v: v if v == "auto" else int(v)  # noqa: E731
            if f.name == "tokens_per_step":
                conv = lambda v: int(float(v))  # noqa: E731
            p.add_argument(flag, type=conv, default=None, help=doc or None)
    return p


def from_training_command(argv: list[str]) -> dict[str, Any]:
    """PlanConfig values from a pretraining command line: Megatron's own flags (parsed by Megatron's
    parser: the same names and defaults as your run) and the ``--diloco-x*`` flags (the package's
    parser). Only what the command line determines; flags Megatron does not know are ignored.
    Imports Megatron (a few seconds)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_diloco import add_diloco_x_args

    parser = add_diloco_x_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    a, _ = parser.parse_known_args([x for x in argv if x != "--"])
    auto = lambda v: None if v == "auto" else v  # noqa: E731 (the package's auto rules run in plan())
    values: dict[str, Any] = {
        "layers": a.num_layers, "hidden": a.hidden_size, "ffn_hidden": a.ffn_hidden_size,
        "heads": a.num_attention_heads, "seq_length": a.seq_length, "vocab": a.vocab_size,
        "micro_batch": a.micro_batch_size, "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
        "train_iters": a.train_iters, "swiglu": bool(a.swiglu), "tied_embeddings": not a.untie_embeddings_and_output_weights,
        "recompute": a.recompute_granularity or "none", "param_bytes": 2 if (a.bf16 or a.fp16) else 4,
        "replicas": a.diloco_x_replicas, "local_steps": a.diloco_x_local_steps, "codec": a.diloco_x_compression,
        "overlap": a.diloco_x_overlap, "outer_momentum": a.diloco_x_outer_momentum,
        "outer_state": a.diloco_x_outer_state, "outer_chunk_mb": a.diloco_x_outer_chunk_mb,
        "rank": a.diloco_x_rank, "energy": a.diloco_x_energy,
        "warmup_local_steps": auto(a.diloco_x_warmup_local_steps), "warmup_iters": auto(a.diloco_x_warmup_iters),
        "warmup_overlap_steps": auto(a.diloco_x_warmup_overlap_steps),
        "warmup_codec": auto(a.diloco_x_warmup_compression),
    }
    if a.global_batch_size and a.seq_length:  # the replica's: --global-batch-size is the sum over replicas
        values["tokens_per_step"] = a.global_batch_size // a.diloco_x_replicas * a.seq_length
    if a.diloco_x_bandwidth_mbps is not None:  # the site's link, shared by the replica's ranks
        values.update(link_mbps=a.diloco_x_bandwidth_mbps, link_scope="cluster")
    return {k: v for k, v in values.items() if v is not None}


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """The PlanConfig of parsed CLI arguments: preset values, then the training command line's
    (after ``--``), overridden by this tool's flags given."""
    values = dict(PRESETS[args.preset]) if args.preset else {}
    if getattr(args, "training", None):
        values.update(from_training_command(args.training))
    for f in dataclasses.fields(PlanConfig):
        v = getattr(args, f.name)
        if v is not None:
            values[f.name] = v
    return PlanConfig(**values)


def training_flags(cfg: PlanConfig, p: "Plan") -> str:
    """The ``--diloco-x*`` flags of the run this plan projects (the auto rules left to the run)."""
    flags = ["--diloco-x", f"--diloco-x-replicas {cfg.replicas}", f"--diloco-x-local-steps {cfg.local_steps}",
             f"--diloco-x-compression {cfg.codec}", f"--diloco-x-overlap {cfg.overlap}",
             f"--diloco-x-bandwidth-mbps {p.bandwidth_flag_mbps:g}"]
    if cfg.outer_momentum:
        flags.append(f"--diloco-x-outer-momentum {cfg.outer_momentum:g}")
    if cfg.outer_state != "device":
        flags.append(f"--diloco-x-outer-state {cfg.outer_state}")
    for name, flag in (("warmup_local_steps", "--diloco-x-warmup-local-steps"),
                       ("warmup_iters", "--diloco-x-warmup-iters"),
                       ("warmup_overlap_steps", "--diloco-x-warmup-overlap-steps"),
                       ("warmup_codec", "--diloco-x-warmup-compression")):
        if getattr(cfg, name) is not None:
            flags.append(f"{flag} {getattr(cfg, name)}")
    return " ".join(flags)


def outer_state_options(cfg: PlanConfig) -> list[dict[str, Any]]:
    """Per-GPU memory of ``cfg`` with the outer state on the GPU and on the host, and whether each fits
    ``gpu_memory_gib`` (None when it is not given): ``[{"outer_state", "gpu_gib", "host_gib", "fits"}]``."""
    out = []
    for where in ("device", "host"):
        p = plan(dataclasses.replace(cfg, outer_state=where))
        total = p.memory_gib["total"]
        out.append({"outer_state": where, "gpu_gib": total, "host_gib": p.host_memory_gib,
                    "host_gib_per_node": p.host_memory_gib * cfg.gpus_per_node,
                    "fits": None if cfg.gpu_memory_gib is None else total <= cfg.gpu_memory_gib})
    return out


def format_outer_state_options(cfg: PlanConfig, options: list[dict[str, Any]]) -> str:
    """The options of :func:`outer_state_options` as lines, ending with which layout fits."""
    lines = []
    for o in options:
        counted = "" if plan(cfg).activations_estimated else " (activations not counted: give --layers, --heads, ...)"
        fit = ("" if o["fits"] is None else
               f"  {'fits' if o['fits'] else 'does NOT fit'} {cfg.gpu_memory_gib:g} GiB{counted}")
        host = (f" + {o['host_gib']:.2f} GiB host ({o['host_gib_per_node']:.0f} GiB per {cfg.gpus_per_node}-GPU node)"
                if o["outer_state"] == "host" else "")
        lines.append(f"  --diloco-x-outer-state {o['outer_state']}: {o['gpu_gib']:.2f} GiB GPU{host}{fit}")
    if cfg.gpu_memory_gib is not None:
        fitting = [o["outer_state"] for o in options if o["fits"]]
        lines.append("  -> fits: " + (", ".join(f"outer state on the {w}" for w in fitting) if fitting else
                                       "neither layout (the inner state alone is "
                                       f"{plan(cfg).memory_gib['inner']:.2f} GiB; activations not counted)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        p = plan(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = outer_state_options(cfg)
    if args.json:
        out = p.to_dict()
        out["outer_state_options"] = options
        out["training_flags"] = training_flags(cfg, p)
        if args.preset == "paper":
            out["assumptions"] = list(PAPER_ASSUMPTIONS)
        print(json.dumps(out, indent=1))
    else:
        print(format_table(p))
        print("\ntraining flags this plan implies:\n  " + training_flags(cfg, p))
        print("\nwhere the outer state lives (memory per GPU):")
        print(format_outer_state_options(cfg, options))
        if args.preset == "paper":
            bf16 = dataclasses.replace(cfg, grad_bytes=2)
            print("with bf16 main gradients (--grad-bytes 2; Megatron --grad-reduce-in-bf16):")
            print(format_outer_state_options(bf16, outer_state_options(bf16)))
            print("\nassumptions (not stated in the material available here):")
            print("\n".join(f"  - {a}" for a in PAPER_ASSUMPTIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
