"""Analytic projection of a DiLoCoX run: memory per GPU, time per step and per round, exchange and
exposed time, and speedup over data-parallel AllReduce over the same slow link.

    python -m megatron_diloco.plan --params 107e9 --pp 8 --dp 10 --replicas 2 --gpu-tflops 125 \\
        --tokens-per-step 327680 --link-mbps 1000 --local-steps 500 --codec int8
    python -m megatron_diloco.plan --preset paper [--json]

Modules, one concept each:

* :mod:`.config`: :class:`PlanConfig`, the inputs (one ``--flag`` per field) and their validation.
* :mod:`.model`: :func:`plan` and its :class:`Plan`: the model (its docstring states every formula).
* :mod:`.presets`: the paper's setting and what it assumes.
* :mod:`.report`: the table, the training flags a plan implies, the outer state on the GPU or the host.
* :mod:`.cli`: the command line, a pretraining command line after ``--`` included, and :func:`main`.
"""

from megatron_diloco.plan.cli import build_parser, config_from_args, from_training_command, main
from megatron_diloco.plan.config import TCP_EFFICIENCY, PlanConfig
from megatron_diloco.plan.model import (
    BOUNDARY_NS_PER_PARAM, MEASURED_RATIOS, Plan, activation_bytes, measured_ratio, payload_bytes, plan,
)
from megatron_diloco.plan.presets import A800_BF16_PEAK_TFLOPS, PAPER_ASSUMPTIONS, PAPER_PRESET, PRESETS
from megatron_diloco.plan.report import format_outer_state_options, format_table, outer_state_options, training_flags

__all__ = [
    "A800_BF16_PEAK_TFLOPS", "BOUNDARY_NS_PER_PARAM", "MEASURED_RATIOS", "PAPER_ASSUMPTIONS", "PAPER_PRESET",
    "PRESETS", "TCP_EFFICIENCY", "Plan", "PlanConfig", "activation_bytes", "build_parser", "config_from_args",
    "format_outer_state_options", "format_table", "from_training_command", "main", "measured_ratio",
    "outer_state_options", "payload_bytes", "plan", "training_flags",
]
