"""GPU memory and step time of one rank's DiLoCoX state: vanilla Megatron vs DiLoCoX with the outer
state on the GPU and on the host (``--diloco-x-outer-state``), per codec, on one GPU (issue 13).

    python3 benchmarks/memory/outer_state_memory.py                      # 1 GPU, ~1.2B GPT (~6 min)
    python3 benchmarks/memory/outer_state_memory.py --runs vanilla,cpu-int8 --iters 60
    python3 benchmarks/memory/outer_state_memory.py --cpu-smoke          # tiny GPT on CPU gloo (~1 min)
    python3 benchmarks/memory/outer_state_memory.py --merge A.json B.json  # passes in opposite orders -> one JSON

One replica on one rank (``--diloco-x-replicas 1`` in a world of one: no outer collective, the
per-rank memory and boundary work are those of any rank of a larger job, whose shard this is), a GPT
of 24 layers x hidden 2048 (1.2B parameters, byte-level vocabulary, mock data, sequence 1024, 2
micro-batches of 2), bf16, ``--transformer-impl local``, Megatron's distributed optimizer (Adam) in
every run; DiLoCoX at the package's defaults (partial overlap with auto tau and the exact merge: the
launch point x_L is outer state too; mu 0: no momentum buffer) but for the codec, H = ``--local-steps``.
Runs one after the other (the example under the harness with the ``timers`` and ``memory``
recorders, ``harness/recorders``), each ``--iters`` iterations:

* ``vanilla``: ``--no-diloco-x``;
* ``<outer_state>-<codec>``: ``--diloco-x-outer-state`` gpu / cpu, ``--diloco-x-compression`` codec
  (default runs: gpu-none, gpu-int8, cpu-none, cpu-int8, cpu-int4; any of none/int8/int4/fp8 with
  ``--runs``);
* a repeat: any of these with a suffix ``.N`` (``vanilla.2``: the same flags again later in the
  pass; its ``step_overhead_pct`` against ``vanilla`` is the run-to-run noise of the pass).

Figures per run (``benchmarks/results/memory.json``, or ``--result``):

* ``peak_gb``: ``torch.cuda.max_memory_allocated()`` over the run (GiB);
* ``steady_gb``: ``torch.cuda.memory_allocated()`` after the last iteration (optimizer state and
  the in-flight exchange allocated);
* ``overhead_bytes_per_param`` / ``steady_overhead_bytes_per_param``: (peak / steady - vanilla's) /
  parameters;
* ``step_ms``: median wall time of the inner steps (``train_step`` between device syncs; the first
  :data:`WARM_ROUNDS` rounds and every H-th step, the boundary steps, excluded); ``step_overhead_pct``
  vs vanilla; ``step_mean_ms`` / ``step_mean_overhead_pct``: their mean (it counts ``partial``'s
  landing step, where the exchange is applied and merged: the median hides it);
* ``plugin_us``: median over the same inner steps of the host time ``DiLoCoXOptimizer.step`` adds
  to the inner optimizer's step (the ``timers`` recorder's ``plugin_s``; the plugin enqueues no
  device work on these steps, ``tests/test_megatron_diloco.py`` counts it); ``plugin_pct``: its
  share of ``step_ms``. Resolves the inner-step overhead where whole-run medians move by percents;
* ``boundary_ms``: median wall time of the boundary steps after the warm-up rounds (the whole
  iteration: inner step + the boundary's pass and launch);
* ``outer_ms``: all the outer work of a round, wherever it falls (the boundary, and ``partial``'s
  landing tau steps later): per round after the warm-up, the wall time of its H steps from its
  boundary on minus H x ``step_ms``; the median over those rounds (vanilla's: the noise floor, ~0);
* ``outer_net_ms``: ``outer_ms`` less vanilla's of the same pass (its noise floor: slow steps);
* ``boundary_vs_gpu`` / ``outer_vs_gpu`` (``cpu-<codec>``): ``boundary_ms`` / ``outer_net_ms`` over
  ``gpu-<codec>``'s of the same pass;
* ``host_gb``: the outer state held in host memory (pinned; 0 on the GPU); ``host_rss_gb``: the
  process's resident set at the end; ``staging_gb``: the device staging buffers (cpu).

Writes the runs' folders (logs, records) under ``--out`` (default ``/tmp/outer_state_memory``; a run
done with the same flags there is not repeated) and prints a table. The JSON is rewritten after every
run (a run cut short by a time limit leaves the finished ones); a run that fails is recorded as
``{"error": ..., "log_tail": ...}`` and the next one starts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from harness.runner import ExampleJob, load_ranks, replica_worlds_job, run_job  # noqa: E402

#: ~1.2B parameters (12 L h^2 = 1.21B + byte-level embeddings), one GPU, bf16.
MODEL_1B = """
    --transformer-impl local --num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192
    --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 2 --global-batch-size 4 --bf16 --distributed-backend nccl
""".split()
#: The CPU smoke: a tiny GPT over gloo, fp32.
MODEL_TINY = """
    --transformer-impl local --num-layers 2 --hidden-size 64 --ffn-hidden-size 256
    --num-attention-heads 2 --seq-length 64 --max-position-embeddings 64
    --micro-batch-size 2 --global-batch-size 4 --distributed-backend gloo
""".split()
COMMON = """
    --pipeline-model-parallel-size 1 --mock-data --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
    --log-interval 10 --eval-iters 0 --eval-interval 100000
""".split()
DEFAULT_RUNS = "vanilla,gpu-int8,cpu-int8,gpu-none,cpu-none,cpu-int4"
CODECS = ("none", "int8", "int4", "fp8")


def base_run(name: str) -> str:
    """``name`` without a repeat suffix: ``vanilla.2`` is a second ``vanilla`` run in the same pass,
    whose difference to the first is the pass's run-to-run noise on the same work."""
    return name.partition(".")[0]


def run_flags(name: str, local_steps: int, replicas: int = 1) -> list[str]:
    """The example flags of run ``name`` (``vanilla`` or ``<gpu|cpu>-<codec>``, optionally with a
    repeat suffix ``.N``: :func:`base_run`)."""
    name = base_run(name)
    if name == "vanilla":
        return ["--no-diloco-x"]
    where, _, codec = name.partition("-")
    if where not in ("gpu", "cpu") or codec not in CODECS:
        raise SystemExit(f"--runs: unknown run {name!r} (vanilla or <gpu|cpu>-<{'|'.join(CODECS)}>, "
                         "optionally with a repeat suffix .N)")
    return ["--diloco-x-replicas", str(replicas), "--diloco-x-local-steps", str(local_steps),
            "--diloco-x-warmup-iters", "0", "--diloco-x-outer-state", where,
            "--diloco-x-compression", codec]  # the rest at the package's defaults


#: Rounds left out of every time figure: the first boundary compiles the encode (Triton's JIT; its
#: disk cache makes that cost depend on which run went first in a call: 1100 vs 350 ms for the
#: same gpu-int4 boundary on an H100), the second the decode and the landing (the first round's
#: exchange, whose tau nothing measured yet, lands at the second boundary).
WARM_ROUNDS = 2


def steady_times(iter_s: list[float], local_steps: int) -> tuple[list[float], list[float], list[list[float]]]:
    """Per-iteration wall times ``iter_s`` (seconds, iteration i at index i - 1) after the
    :data:`WARM_ROUNDS` warm-up rounds: (inner steps, boundary steps, each complete round: the
    ``local_steps`` steps from its boundary on, where its outer work falls)."""
    H, n = local_steps, len(iter_s)
    start = WARM_ROUNDS * H  # the last warm-up boundary
    inner = [t for i, t in enumerate(iter_s, start=1) if i > start and i % H]
    bounds = list(range(start + H, n + 1, H))
    rounds = [iter_s[b - 1:b - 1 + H] for b in bounds if b - 1 + H <= n]
    return inner, [iter_s[b - 1] for b in bounds], rounds


def figures(recs: list[dict], local_steps: int) -> dict:
    """The run's figures from its one rank's record (see the module docstring); with several
    replicas (``--replicas``), replica 0's, and ``peak_gb_per_replica``."""
    r = recs[0]
    if len(recs) > 1:
        return {**figures([r], local_steps), "peak_gb_per_replica": [
            x["max_mem_bytes"] / 2 ** 30 if x.get("max_mem_bytes") is not None else None for x in recs]}
    gib = 2 ** 30
    inner, bound, rounds = steady_times(r["iter_s"], local_steps)
    step = statistics.median(inner) if inner else None
    plugin = steady_times(r["plugin_s"], local_steps)[0] if r.get("plugin_s") else []
    outer = [sum(w) - local_steps * step for w in rounds] if step is not None else []
    steady = r["mem_after_step_bytes"][-1] if r.get("mem_after_step_bytes") else None
    return {
        "params": r["params_on_rank"],
        "peak_gb": r["max_mem_bytes"] / gib if r.get("max_mem_bytes") is not None else None,
        "steady_gb": steady / gib if steady is not None else None,
        "setup_gb": r["mem_after_setup_bytes"] / gib if r.get("mem_after_setup_bytes") is not None else None,
        "step_ms": 1e3 * step if step is not None else None,
        "step_mean_ms": 1e3 * statistics.mean(inner) if inner else None,
        "plugin_us": 1e6 * statistics.median(plugin) if plugin else None,
        "plugin_pct": 100 * statistics.median(plugin) / step if plugin and step else None,
        "boundary_ms": 1e3 * statistics.median(bound) if bound else None,
        "outer_ms": 1e3 * statistics.median(outer) if outer else None,
        "steady_rounds": len(rounds),
        "host_gb": (r.get("outer_host_bytes") or 0) / gib,
        "staging_gb": (r.get("outer_staging_bytes") or 0) / gib,
        "host_rss_gb": r["host_rss_bytes"] / gib if r.get("host_rss_bytes") else None,
        "steps": len(r["iter_s"]),
        "card": r.get("device"),
    }


def _within_pass(runs: dict[str, dict]) -> dict[str, dict]:
    """Each run's figures relative to the other runs of its pass (side by side in one call), in place:
    bytes per parameter, step overheads and ``outer_net_ms`` (``outer_ms`` less vanilla's: the same
    sum where there is no outer work, the slow steps' share, ~H x (mean - median) of an inner step)
    against ``vanilla``; for ``cpu-<codec>``, ``boundary_vs_gpu`` and ``outer_vs_gpu`` (of
    ``outer_net_ms``) against ``gpu-<codec>`` (issue 13's boundary target: <= 2x). Returns the runs
    that did not fail."""
    ok = {n: f for n, f in runs.items() if "error" not in f}
    base = ok.get("vanilla")
    if base is not None and base.get("outer_ms") is not None:
        for name, f in ok.items():
            if name != "vanilla" and f.get("outer_ms") is not None:
                f["outer_net_ms"] = f["outer_ms"] - base["outer_ms"]
    for name, f in ok.items():
        gpu = ok.get("gpu-" + base_run(name).partition("-")[2]) if name.startswith("cpu-") else None
        for key, ratio in (("boundary_ms", "boundary_vs_gpu"), ("outer_net_ms", "outer_vs_gpu")):
            if gpu is not None and f.get(key) and gpu.get(key):
                f[ratio] = f[key] / gpu[key]
        if name == "vanilla" or base is None:
            continue
        for key, per_param in (("peak_gb", "overhead_bytes_per_param"), ("steady_gb", "steady_overhead_bytes_per_param")):
            if f.get(key) is not None and base.get(key) is not None:
                f[per_param] = (f[key] - base[key]) * 2 ** 30 / f["params"]
        for key in ("step_ms", "step_mean_ms"):
            if f.get(key) and base.get(key):
                f[key.replace("_ms", "_overhead_pct")] = 100 * (f[key] / base[key] - 1)
    return ok


def _result(runs: dict[str, dict], a: argparse.Namespace, model: list[str]) -> dict:
    """The JSON of the runs so far, with the differences to the vanilla run."""
    ok = _within_pass(runs)
    card = next((f.get("card") for f in ok.values() if f.get("card")), None)
    return {"card": card or "cpu", "params": next((f["params"] for f in ok.values()), None), "commit": _commit(),
            "iters": a.iters, "local_steps": a.local_steps, "replicas": a.replicas, "model": " ".join(model),
            "runs": runs}


#: the figures that vary from pass to pass (the memory figures are the same bytes every pass), and
#: those taken within a pass (:func:`_within_pass`): merge() averages both over the passes
TIMES = ("step_ms", "step_mean_ms", "plugin_us", "plugin_pct", "boundary_ms", "outer_ms")
RATIOS = ("step_overhead_pct", "step_mean_overhead_pct", "outer_net_ms", "boundary_vs_gpu", "outer_vs_gpu")


def merge(passes: list[dict], commit: str | None = None) -> dict:
    """One JSON from several passes of the same runs (``--merge``; e.g. two calls in opposite orders,
    so that no run always goes first). Per run: the memory figures of the first pass (a differing
    ``peak_gb`` is recorded as ``peak_gb_per_pass``); each time figure, and each figure taken within
    a pass (step overheads against that pass's vanilla, ``boundary_vs_gpu``; recomputed from the
    pass's times), the mean over the passes, with ``<figure>_per_pass``."""
    if not passes:
        raise SystemExit("--merge: no passes given")
    passes = [dict(p, runs={n: {k: v for k, v in f.items() if k not in RATIOS} for n, f in p["runs"].items()})
              for p in passes]  # the within-pass figures recomputed from each pass's own times
    for p in passes:
        _within_pass(p["runs"])
    names = list(dict.fromkeys(n for p in passes for n in p["runs"]))
    runs: dict[str, dict] = {}
    for name in names:
        ok = [p for p in passes if name in p["runs"] and "error" not in p["runs"][name]]
        if not ok:
            runs[name] = passes[0]["runs"].get(name) or next(p["runs"][name] for p in passes if name in p["runs"])
            continue
        f = dict(ok[0]["runs"][name])
        peaks = [p["runs"][name]["peak_gb"] for p in ok]
        if len(set(peaks)) > 1:
            f["peak_gb_per_pass"] = peaks
        for key in (*TIMES, *RATIOS):
            vals = [p["runs"][name][key] for p in ok if p["runs"][name].get(key) is not None]
            if vals:
                f[key], f[f"{key}_per_pass"] = statistics.mean(vals), vals
        f["passes"] = len(ok)
        runs[name] = f
    first = passes[0]
    return {"card": first.get("card"), "params": first.get("params"),
            "commit": commit or first.get("commit"), "iters": first.get("iters"),
            "local_steps": first.get("local_steps"), "model": first.get("model"), "passes": len(passes),
            "runs": runs}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/outer_state_memory"), help="the runs' folders")
    p.add_argument("--result", type=Path, default=None,
                   help="JSON to write (default benchmarks/results/memory.json; --cpu-smoke: OUT/memory.json)")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated (default {DEFAULT_RUNS})")
    p.add_argument("--iters", type=int, default=80, help="per run (>= 50 inner steps after the warm-up rounds)")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny GPT on CPU gloo (checks the script end to end)")
    p.add_argument("--replicas", type=int, default=1,
                   help="R > 1: R replicas as separate launches sharing the GPU, joined over gloo "
                        "(--diloco-x-outer-store, as separate clusters are); memory per replica process")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="PASS_JSON",
                   help="write one JSON (--result) from these passes' JSONs instead of running (see merge())")
    p.add_argument("--commit", default=None,
                   help="the commit to record (default: git HEAD; for a copy of the tree without its history)")
    a = p.parse_args(argv)
    if a.merge:
        result = merge([json.loads(f.read_text()) for f in a.merge], a.commit)
        result_path = a.result or REPO / "benchmarks/results/memory.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(result, indent=1) + "\n")
        _print_table(result, result_path)
        return 0
    if a.cpu_smoke and a.iters == 80:
        a.iters, a.local_steps = 20, 4
    result_path = a.result or (a.out / "memory.json" if a.cpu_smoke else REPO / "benchmarks/results/memory.json")
    model = MODEL_TINY if a.cpu_smoke else MODEL_1B
    names = [n for n in a.runs.split(",") if n]
    for name in names:
        run_flags(name, a.local_steps, a.replicas)  # validate before the first run
    runs: dict[str, dict] = {}
    result: dict = {}
    for name in names:
        args = [*model, *COMMON, "--train-iters", str(a.iters), *run_flags(name, a.local_steps, a.replicas)]
        if a.replicas > 1:
            job = replica_worlds_job(name, a.out, args, a.replicas, ["timers", "memory"], diloco=base_run(name) != "vanilla",
                                     estimate_s=90 * a.replicas, timeout_s=420 * a.replicas)
        else:
            job = ExampleJob(name, args, nproc=1, record=["timers", "memory"], estimate_s=90, timeout_s=420)
        info = run_job(job, a.out, resume=True)
        recs = ([json.loads(f.read_text()) for f in sorted((a.out / name).glob("replica*/rank0.json"))]
                if a.replicas > 1 else load_ranks(a.out, name))
        if info.get("ok") and recs:
            runs[name] = figures(recs, a.local_steps)
        else:
            logs = [a.out / name / f for f in (["log.txt"] if a.replicas == 1 else
                                               [f"replica{r}.log" for r in range(a.replicas)])]
            tail = "".join(x.read_text(errors="replace")[-3000:] for x in logs if x.exists())
            runs[name] = {"error": f"exit status {info.get('returncode')}, timed out {info.get('timed_out')}",
                          "log_tail": tail}
        print(f"[outer_state_memory] {name}: {json.dumps(runs[name])[:2000]}", flush=True)
        result = _result(runs, a, model)
        if a.commit:
            result["commit"] = a.commit
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(result, indent=1) + "\n")
    _print_table(result, result_path)
    return 0


def _print_table(result: dict, result_path: Path) -> None:
    params = result.get("params") or 0
    cols = ("peak_gb", "steady_gb", "overhead_bytes_per_param", "step_ms", "step_overhead_pct", "step_mean_ms",
            "plugin_us", "boundary_ms", "outer_net_ms", "host_gb")
    print(f"\n{result.get('card')}, {params / 1e9:.3f} B params, commit {result.get('commit')}; written {result_path}")
    print(f"{'run':<10}" + "".join(f"{c:>26}" for c in cols))
    for name, f in result.get("runs", {}).items():
        print(f"{name:<10}" + "".join(f"{f.get(c):>26.4g}" if isinstance(f.get(c), (int, float)) else f"{'-':>26}"
                                      for c in cols))


if __name__ == "__main__":
    sys.exit(main())
