"""GPU smoke benchmark: the example at 2 replicas x PP 2 on 4 GPUs (NCCL, bf16), with and without
``--diloco-x``, side by side in one invocation.

    python benchmarks/gpu_smoke.py --out DIR [--iters 200] [--local-steps 20]

Writes ``DIR/gpu_smoke.json`` (the shape of ``benchmarks/results/gpu_smoke.json``), the two runs'
logs, and prints a table. Figures: loss next to the vanilla run, median inner-step time (boundary
steps apart), peak GPU memory per rank and its difference per parameter, replicas identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from megatron_diloco.summary import parse_summaries  # noqa: E402

MODEL = """
    --num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 64
    --bf16 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 20 --log-interval 10 --eval-iters 0
    --eval-interval 100000 --distributed-backend nccl
""".split()


def run(name: str, out: Path, args: list[str], nproc: int,
        extra_env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, BENCH_OUT=str(d), PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "benchmarks" / "instrumented.py"), *MODEL, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        print(log[-5000:])
        raise SystemExit(f"{name} run failed ({proc.returncode})")
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(nproc)], log


def summary_of(log: str) -> dict:
    found = parse_summaries(log)
    return found[-1] if found else {}


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


def parse_bench_args(extra_flags=None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments the GPU benchmarks share; returns them and the flags common to every run."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    if extra_flags is not None:
        extra_flags(p)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more flags for every run (after --)")
    a = p.parse_args()
    return a, ["--train-iters", str(a.iters)] + [x for x in a.extra if x != "--"]


def main() -> None:
    a, common = parse_bench_args()
    dx_args = ["--diloco-x-replicas", "2", "--diloco-x-local-steps", str(a.local_steps),
               "--diloco-x-overlap", "delayed"]
    vanilla, _ = run("vanilla", a.out, common + ["--no-diloco-x"], a.nproc)
    dilocox, log = run("dilocox", a.out, common + dx_args, a.nproc)
    blocking, log_none = run("dilocox_none", a.out, common + dx_args + ["--diloco-x-overlap", "none"], a.nproc)
    s = summary_of(log)
    H = a.local_steps

    def step_times(recs, boundary: bool | None):
        return boundary_step_times(recs, H, boundary)

    v_inner, d_inner = step_times(vanilla, False), step_times(dilocox, False)
    d_bound = step_times(dilocox, True)
    mem = []
    # Compare ranks of the same pipeline stage (the two runs order ranks differently).
    by_stage = {r["pp_rank"]: r for r in vanilla}
    for rd in dilocox:
        rv = by_stage[rd["pp_rank"]]
        if rv.get("max_mem_bytes") is None:  # CPU dry run: no device memory figures
            continue
        mem.append({"pp_rank": rd["pp_rank"], "params_on_rank": rd["params_on_rank"],
                    "vanilla_max_gb": rv["max_mem_bytes"] / 2**30, "dilocox_max_gb": rd["max_mem_bytes"] / 2**30,
                    "setup_delta_bytes_per_param": (rd["mem_after_setup_bytes"] - rv["mem_after_setup_bytes"])
                    / rd["params_on_rank"],
                    "peak_delta_bytes_per_param": (rd["max_mem_bytes"] - rv["max_mem_bytes"]) / rd["params_on_rank"]})
    result = {
        "card": vanilla[0].get("device"),
        "gpus": a.nproc,
        "layout": "2 replicas x PP 2 (DiLoCoX) vs DP 2 x PP 2 (vanilla), bf16, distributed optimizer",
        "iterations": a.iters, "local_steps": H,
        "replicas_identical": s.get("replicas_identical"),
        "loss": {name: {"first": loss_at(recs, 1), "final": loss_at(recs, a.iters),
                        "curve": {it: loss_at(recs, it) for it in range(10, a.iters + 1, 10)}}
                 for name, recs in (("vanilla", vanilla), ("dilocox", dilocox), ("dilocox_none", blocking))},
        "step_time_ms": {
            "vanilla_median": 1e3 * statistics.median(v_inner),
            "dilocox_inner_median": 1e3 * statistics.median(d_inner),
            "dilocox_boundary_median": 1e3 * statistics.median(d_bound) if d_bound else None,
            "vanilla_mean_all": 1e3 * statistics.mean(step_times(vanilla, None)),
            "dilocox_mean_all": 1e3 * statistics.mean(step_times(dilocox, None)),
            "dilocox_none_inner_median": 1e3 * statistics.median(step_times(blocking, False)),
            "dilocox_none_boundary_median": 1e3 * statistics.median(step_times(blocking, True)),
        },
        "memory_per_rank": mem,
        "summary": s,
        "summary_none": summary_of(log_none),
    }
    (a.out / "gpu_smoke.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
