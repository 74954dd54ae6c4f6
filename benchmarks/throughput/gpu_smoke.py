"""GPU smoke benchmark: the example at 2 replicas x PP 2 on 4 GPUs (NCCL, bf16), with and without
``--diloco-x``, side by side in one invocation.

    python benchmarks/throughput/gpu_smoke.py --out DIR [--iters 200] [--local-steps 20]

Writes ``DIR/gpu_smoke.json`` (the shape of ``benchmarks/results/gpu_smoke.json``), the runs' folders
(``DIR/<run>/``: log, rank records) and prints a table. Figures: loss next to the vanilla run, median
inner-step time (boundary steps apart), peak GPU memory per rank and its difference per parameter,
replicas identical.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
from harness.gpu_bench import boundary_step_times, loss_at, parse_bench_args, run  # noqa: E402
from harness.runner import last_summary  # noqa: E402


def main() -> None:
    a, common = parse_bench_args()
    dx_args = ["--diloco-x-replicas", "2", "--diloco-x-local-steps", str(a.local_steps), "--diloco-x-warmup-iters", "0",
               "--diloco-x-overlap", "delayed"]
    vanilla, _ = run("vanilla", a.out, common + ["--no-diloco-x"], a.nproc)
    dilocox, log = run("dilocox", a.out, common + dx_args, a.nproc)
    blocking, log_none = run("dilocox_none", a.out, common + dx_args + ["--diloco-x-overlap", "none"], a.nproc)
    s = last_summary(log)
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
        "summary_none": last_summary(log_none),
    }
    (a.out / "gpu_smoke.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
