"""The planner's inputs: :class:`PlanConfig`, one field per ``--flag`` of ``python -m megatron_diloco.plan``
(the docstring under each field is that flag's ``--help``), validated as it is built.

Units are in every name (``_s`` seconds, ``_bytes``, ``_gib`` = 2^30 bytes, ``_mbps`` = 10^6 bit/s).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_diloco.algorithm.config import BLOCKWISE, CODECS
from megatron_diloco.plan.sites import parse_sites

#: Payload fraction of a TCP/IPv4 stream on Ethernet at MTU 1500 (1448 payload bytes per 1514 on the wire).
TCP_EFFICIENCY = 1448 / 1514


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
    sites: str | None = None
    """Replicas that differ (separate jobs): one entry per replica, comma-separated, SPEED, SPEED:TOKENS or
    SPEED:TOKENS:GPUS: its GPUs' inner-step rate relative to the modelled ones at the same tokens per GPU (0.5:
    half as fast), its tokens per inner step (default --tokens-per-step) and its GPUs (default TP x PP x DP; sites
    of different DP run with --diloco-x-exchange-slots). Adds each site's step, idle share and weight
    (plan/sites.py). None: identical replicas."""

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
    :data:`~megatron_diloco.plan.model.MEASURED_RATIOS` (lowrank, lowrank-int8 at ``rank``, adaptive at
    ``energy``)."""
    rank: int = 4
    """Low-rank rank (ratio lookup in :data:`~megatron_diloco.plan.model.MEASURED_RATIOS`)."""
    energy: float = 0.9
    """Adaptive energy target (ratio lookup in :data:`~megatron_diloco.plan.model.MEASURED_RATIOS`)."""
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
        """Raise ``ValueError`` naming the ``--flag`` of any invalid value."""
        _choice("outer_state", self.outer_state, ("device", "host"))
        if not self.outer_chunk_mb > 0:
            raise ValueError(f"--outer-chunk-mb must be > 0, got {self.outer_chunk_mb!r}")
        for name in ("tp", "pp", "dp", "replicas", "gpus_per_node", "local_steps", "rank"):
            v = getattr(self, name)
            if name == "local_steps" and v == "auto":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{flag_name(name)} must be an integer >= 1, got {v!r}")
        shape = (self.layers, self.hidden)
        if self.params is None and None in shape:
            raise ValueError("--params is required unless the GPT shape (--layers, --hidden) is given")
        if self.params is not None and not (self.params > 0 and math.isfinite(self.params)):
            raise ValueError(f"--params must be a finite number > 0, got {self.params!r}")
        for name in ("layers", "hidden", "ffn_hidden", "vocab", "heads", "seq_length", "micro_batch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag_name(name)} must be an integer >= 1, got {v!r}")
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
                raise ValueError(f"{flag_name(name)} must be a byte count like 2, 4 or 12, got {getattr(self, name)!r}")
        if self.baseline_bytes_per_param is not None and not self.baseline_bytes_per_param > 0:
            raise ValueError(f"--baseline-bytes-per-param must be > 0, got {self.baseline_bytes_per_param!r}")
        if self.sites is not None:
            parse_sites(self.sites, self.replicas, self.tokens_per_step)
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


def flag_name(name: str) -> str:
    """The ``--flag`` of a PlanConfig field."""
    return "--" + name.replace("_", "-")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{flag_name(name)} must be one of {', '.join(allowed)}, got {value!r}")
