"""What the matrix codecs' worker thread costs the inner steps it overlaps (issue 13): the inner-step
time of 2 replicas sharing one GPU with ``--diloco-x-compression adaptive`` vs ``int4`` vs no
DiLoCoX, in one invocation.

    python3 benchmarks/memory/adaptive_step_cost.py                  # 1 GPU, 85.5M GPT (~4 min)
    python3 benchmarks/memory/adaptive_step_cost.py --runs vanilla,adaptive,lowrank-int8 --iters 300
    python3 benchmarks/memory/adaptive_step_cost.py --cpu-smoke      # tiny GPT on CPU gloo (~1.5 min)

Each run is 2 launches of the example under the harness, each a world of one rank on the same GPU
(``harness.runner.replica_worlds_job``): joined through ``--diloco-x-outer-store`` for the
DiLoCoX runs (the outer group is gloo, so ``adaptive`` runs its exchange on the worker thread with
host copies, as a multi-GPU job does on the gloo mirror), independent for ``vanilla``
(``--no-diloco-x``: the same two processes sharing the GPU, without the plugin). The 85.5M GPT of the
GPU benchmarks (12 layers x 768, sequence 1024) at 1 micro-batch of 4 per step, bf16, mock data;
DiLoCoX at the package's defaults (partial overlap, auto tau, eta 1, mu 0) with H =
``--local-steps`` and ``--diloco-x-bandwidth-mbps 1000`` (the link the adaptive byte budget and the
auto tau are sized for; the exchange itself crosses localhost). ``--overlap delayed`` lets every
exchange run under the whole next round instead.

Figures per run (``benchmarks/results/adaptive_step_cost.json``, or ``--result``), over both
replicas' inner steps (every iteration after the first 5 but the boundaries, the H-th; ``partial``'s
landing step is an inner step here):

* ``step_ms``: median inner step, timed as every benchmark here times it (the harness ``timers``:
  a device synchronization on both sides, so work queued on the worker's stream counts);
* ``step_stream_ms``: median inner step until the training stream drained (``iter_stream_s``): what
  the training loop itself loses (GIL, copies, SM and memory-bandwidth contention), without waiting
  for the worker's own kernels;
* ``step_mean_ms`` / ``step_stream_mean_ms``: the means (throughput: a cost confined to the few
  steps a short exchange overlaps moves the mean, not the median);
* ``by_position_ms``: median step time at each position 1..H-1 after a boundary (where the worker's
  cost lands: the exchange starts at the boundary);
* ``*_overhead_pct``: vs ``vanilla``'s; ``boundary_ms``: median boundary step;
* ``exchange_ms``: median launch-to-completion time of the exchanges (the ``rounds`` recorder;
  the window during which the worker is busy), ``steps``: inner steps measured.

Writes the runs' folders under ``--out`` (default ``/tmp/adaptive_step_cost``; a run done with the
same flags there is not repeated) and prints a table; the JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from benchmarks.memory.outer_state_memory import COMMON, MODEL_TINY, _commit  # noqa: E402
from harness.gpu_bench import MODEL as GPU_MODEL  # noqa: E402
from harness.runner import replica_worlds_job, run_jobs  # noqa: E402

#: The 85.5M GPT of the GPU benchmarks at one micro-batch of 4 x 1024 tokens per step (two
#: processes share the GPU: ~2 x its step time alone), local transformer implementation.
MODEL = [*GPU_MODEL, "--micro-batch-size", "4", "--global-batch-size", "4", "--transformer-impl", "local"]
DEFAULT_RUNS = "vanilla,int4,adaptive"
REPLICAS = 2
WARM = 5  # iterations left out of every figure (compilation, allocator warm-up)


def run_args(name: str, a: argparse.Namespace, model: list[str]) -> tuple[list[str], bool]:
    """The example flags of run ``name`` (``vanilla`` or a ``--diloco-x-compression`` codec), and
    whether it is DiLoCoX."""
    base = [*model, *COMMON, "--train-iters", str(a.iters)]
    if name == "vanilla":
        return [*base, "--no-diloco-x"], False
    return [*base, "--diloco-x", "--diloco-x-replicas", str(REPLICAS), "--diloco-x-local-steps", str(a.local_steps), "--diloco-x-warmup-iters", "0",
            "--diloco-x-overlap", a.overlap, "--diloco-x-compression", name,
            "--diloco-x-bandwidth-mbps", "1000"], True


def _inner(times: list[float], local_steps: int) -> list[tuple[int, float]]:
    """(position after the last boundary, time) of the inner steps (1-based iterations > WARM, not
    a multiple of H)."""
    return [(i % local_steps, t) for i, t in enumerate(times, start=1) if i > WARM and i % local_steps]


def figures(recs: list[dict], local_steps: int) -> dict:
    """The run's figures from its replicas' records (see the module docstring)."""
    inner = [p for r in recs for p in _inner(r["iter_s"], local_steps)]
    stream = [p for r in recs for p in _inner(r.get("iter_stream_s") or [], local_steps)]
    bound = [t for r in recs for i, t in enumerate(r["iter_s"], start=1) if i > WARM and i % local_steps == 0]
    exchanges = [m["exchange_s"] for r in recs for m in r.get("rounds", []) if m.get("exchange_s")]
    ms = lambda xs, f=statistics.median: 1e3 * f(xs) if xs else None  # noqa: E731
    return {
        "params": recs[0]["params_on_rank"],
        "step_ms": ms([t for _, t in inner]),
        "step_stream_ms": ms([t for _, t in stream]),
        "step_mean_ms": ms([t for _, t in inner], statistics.fmean),
        "step_stream_mean_ms": ms([t for _, t in stream], statistics.fmean),
        "by_position_ms": {k: ms([t for p, t in inner if p == k]) for k in range(1, local_steps)},
        "boundary_ms": ms(bound),
        "exchange_ms": ms(exchanges),
        "steps": len(inner),
        "card": recs[0].get("device"),
    }


def _with_overheads(runs: dict[str, dict]) -> None:
    base = runs.get("vanilla")
    if not base or "error" in base:
        return
    for name, f in runs.items():
        if name == "vanilla" or "error" in f:
            continue
        for key in ("step_ms", "step_stream_ms", "step_mean_ms", "step_stream_mean_ms"):
            if f.get(key) and base.get(key):
                f[key.replace("_ms", "_overhead_pct")] = 100 * (f[key] / base[key] - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/adaptive_step_cost"), help="the runs' folders")
    p.add_argument("--result", type=Path, default=None,
                   help="JSON to write (default benchmarks/results/adaptive_step_cost.json; --cpu-smoke: "
                        "OUT/adaptive_step_cost.json)")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"vanilla and codecs, comma-separated (default {DEFAULT_RUNS})")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--local-steps", type=int, default=10, help="H")
    p.add_argument("--overlap", default="partial", choices=("partial", "delayed"))
    p.add_argument("--max-connections", type=int, default=None,
                   help="CUDA_DEVICE_MAX_CONNECTIONS of the runs (default: the runner's 1, Megatron's "
                        "recommendation; with 1 every stream shares one hardware queue, so the worker's "
                        "kernels and copies interleave with the training stream's)")
    p.add_argument("--budget-s", type=float, default=420, help="start no run that would end after this")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny GPT on CPU gloo (checks the script end to end)")
    a = p.parse_args(argv)
    if a.cpu_smoke and a.iters == 200:
        a.iters, a.local_steps = 14, 4
    result_path = a.result or (a.out / "adaptive_step_cost.json" if a.cpu_smoke
                               else REPO / "benchmarks/results/adaptive_step_cost.json")
    model = MODEL_TINY if a.cpu_smoke else MODEL
    names = [n for n in a.runs.split(",") if n]
    runs: dict[str, dict] = {}

    def on_done(job, info: dict) -> None:
        recs = [json.loads(f.read_text()) for f in sorted((a.out / job.name).glob("replica*/rank0.json"))]
        if info.get("ok") and len(recs) == REPLICAS:
            runs[job.name] = figures(recs, a.local_steps)
        else:
            logs = [a.out / job.name / f"replica{r}.log" for r in range(REPLICAS)]
            runs[job.name] = {"error": f"exit status {info.get('returncode')}, timed out {info.get('timed_out')}",
                              "log_tail": "".join(x.read_text(errors="replace")[-1500:] for x in logs if x.exists())}
        _with_overheads(runs)
        print(f"[adaptive_step_cost] {job.name}: {json.dumps(runs[job.name])[:1500]}", flush=True)
        card = next((f.get("card") for f in runs.values() if f.get("card")), None)
        result = {"card": card or "cpu", "commit": _commit(), "params": next(
                      (f["params"] for f in runs.values() if "params" in f), None),
                  "iters": a.iters, "local_steps": a.local_steps, "overlap": a.overlap, "replicas": REPLICAS,
                  "cuda_device_max_connections": a.max_connections or 1,
                  "model": " ".join(model), "runs": runs}
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(result, indent=1) + "\n")

    jobs = []
    for name in names:
        args, diloco = run_args(name, a, model)
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": str(a.max_connections)} if a.max_connections else None
        jobs.append(replica_worlds_job(name, a.out, args, REPLICAS, ["timers", "rounds"], diloco=diloco, env=env,
                                       estimate_s=90, timeout_s=300))
    run_jobs(jobs, a.out, budget_s=a.budget_s, resume=True, on_done=on_done)
    for job in jobs:  # skipped as done with the same flags: figures from its records
        if job.name not in runs and (a.out / job.name / "done.json").exists():
            on_done(job, json.loads((a.out / job.name / "done.json").read_text()))
    cols = ("step_ms", "step_overhead_pct", "step_stream_ms", "step_stream_overhead_pct", "step_mean_ms",
            "step_mean_overhead_pct", "boundary_ms", "exchange_ms")
    card = next((f.get("card") for f in runs.values() if f.get("card")), None) or "cpu"
    print(f"\n{card}, H {a.local_steps}, {a.overlap}, commit {_commit()}; written {result_path}")
    print(f"{'run':<14}" + "".join(f"{c:>26}" for c in cols))
    for name, f in runs.items():
        print(f"{name:<14}" + "".join(f"{f.get(c):>26.4g}" if isinstance(f.get(c), (int, float)) else f"{'-':>26}"
                                      for c in cols))
    return 0 if runs and all("error" not in f for f in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
