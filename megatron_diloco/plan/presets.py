"""The planner's presets (``python -m megatron_diloco.plan --preset NAME``): PlanConfig values, and what
each assumes beyond its source."""

from __future__ import annotations

from typing import Any

#: A800 dense bf16 peak, TFLOP/s.
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
