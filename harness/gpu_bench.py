"""What the GPU benchmarks share: the 85.5M GPT, one example run through the runner, the common
flags, and the step-time and loss readers of the ``timers`` / ``losses`` records.

Used by ``benchmarks/throughput/gpu_smoke.py``, ``throughput/gpu_throughput.py``,
``throughput/layout3d.py`` and ``memory/adaptive_step_cost.py``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from .runner import ExampleJob, load_ranks, run_job

#: The 85.5M byte-level GPT of the GPU benchmarks (12 layers, hidden 768, seq 1024), bf16, NCCL.
MODEL = """
    --num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 64
    --bf16 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 20 --log-interval 10 --eval-iters 0
    --eval-interval 100000 --distributed-backend nccl
""".split()


def run(name: str, out: Path, args: list[str], nproc: int,
        extra_env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    """Run the example (:data:`MODEL`, then ``args``) on ``nproc`` GPUs under the benchmark recorders
    into ``out/name/`` (no time limit, never skipped); returns (rank records, log). Exits on failure."""
    info = run_job(ExampleJob(name, [*MODEL, *args], nproc, dict(extra_env or {}), timeout_s=math.inf), out)
    if not info.get("ok") or info.get("returncode"):
        raise SystemExit(f"{name} run failed ({info.get('returncode')}); log: {out / name / 'log.txt'}")
    return load_ranks(out, name), (out / name / "log.txt").read_text(errors="replace")


def boundary_step_times(recs: list[dict], local_steps: int, boundary: bool | None, warm: int = 5) -> list[float]:
    """Per-iteration step times (max over ranks: a step ends when the slowest rank ends), after
    ``warm`` iterations; only boundary steps (every H-th), only inner steps, or all (None)."""
    per_it = [max(r["iter_s"][i] for r in recs) for i in range(len(recs[0]["iter_s"]))]
    return [t for i, t in enumerate(per_it, start=1) if i > warm and
            (boundary is None or ((i % local_steps == 0) == boundary))]


def loss_at(recs: list[dict], it: int) -> float:
    """Mean over the loss-logging ranks of the loss at iteration ``it``."""
    vals = [r["losses"][str(it)] for r in recs if str(it) in r["losses"]]
    return sum(vals) / len(vals)


def parse_bench_args(extra_flags: Callable[[argparse.ArgumentParser], None] | None = None,
                     argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments the GPU benchmarks share; returns them and the flags common to every run."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    if extra_flags is not None:
        extra_flags(p)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more flags for every run (after --)")
    a = p.parse_args(argv)
    return a, ["--train-iters", str(a.iters)] + [x for x in a.extra if x != "--"]
