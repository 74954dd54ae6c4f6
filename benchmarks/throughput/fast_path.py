"""Tokens/s of one GPU: the local spec's attention (today's path) against SDPA core attention (the
fast path), side by side in one invocation.

Every run is the example (``examples/pretrain_gpt_diloco.py --no-diloco-x``) under the harness's
``timers`` recorder on one GPU, bf16, ``--transformer-impl local``, mock data, sequence 512, global
batch = micro-batch (no accumulation), the example's demo settings otherwise (RMSNorm, RoPE, no
biases, distributed optimizer, torch AdamW, ``--num-workers 0``). Paths (``--runs`` entries
``model:path:micro_batch``):

* ``local``: today's path, Megatron's ``DotProductAttention`` (baddbmm, fp32 softmax, bmm);
* ``sdpa``: ``--attention-sdpa`` alone (only the attention kernel changes);
* ``fast``: ``--attention-sdpa --no-create-attention-mask-in-dataloader``: the data loader stops
  building the [b, 1, s, s] mask nobody reads (built and collated on the training thread with
  ``--num-workers 0``);
* ``fast_workers``: ``fast`` with ``--num-workers 2`` (Megatron's default: batches prepared by two
  loader processes while the GPU computes);
* ``fast_rope``: ``fast_workers`` with ``--rope-fusion``: Megatron's fused RoPE, served without
  Transformer Engine by the package's Triton kernel (``megatron_adapter/fused_rope.py``) instead of the
  unfused ``mul`` / ``cat`` / ``neg`` kernels;
* ``fast_sync_norm``: ``fast_rope`` with Megatron's own gradient-norm and clipping fallbacks (recorder
  ``megatron_multi_tensor``): a host read-back per gradient's norm, as before the package's multi-tensor
  kernels (``megatron_adapter/multi_tensor.py``), which every other path here runs on;
* ``te``: Transformer Engine's layers (``--transformer-impl transformer_engine``, where it is installed) with
  ``fast_rope``'s loader settings and TE's own fused RoPE.

The fast path of a model is its best run among the SDPA paths (every path but ``local`` and ``te``: the
fast path is the one without Transformer Engine).

Models: ``85M`` (12 x 768, 12 heads), ``302M`` (24 x 1024, 16 heads), ``cpu`` (2 x 64, for
``--cpu-smoke``). Figures per run, over iterations ``--skip`` + 1 .. ``--iters``:

* ``step_ms``: median of the recorder's ``iter_s`` (each ``train_step`` between two device
  synchronizations); ``tokens_per_s`` = micro-batch x 512 / step;
* ``mfu``: 6 N tokens/s / ``--peak-tflops`` (N: parameters on the rank, embeddings included; the
  issue's convention); ``mfu_with_attention``: (6 N + 6 L s h) tokens/s / peak, adding causal
  attention's score and value products (2 s h multiply-adds per token per layer, x3 for backward);
* ``max_mem_gb``: ``torch.cuda.max_memory_allocated``.

    python benchmarks/throughput/fast_path.py --out DIR [--runs 85M:local:16,...] [--iters 30]
        [--results benchmarks/results/convergence_scale.json --commit SHA]
    python benchmarks/throughput/fast_path.py --out DIR --runs 85M:fast:256 --profile 12:13   # where the time goes
    python benchmarks/throughput/fast_path.py --out DIR --cpu-smoke

Writes ``DIR/fast_path.json`` (every run, and per model the best of each path) and, with
``--results``, that file's ``card``, ``commit`` and ``fast_path`` (other keys kept). A run that fails
(e.g. out of memory) is listed with ``ok: false``; runs done with the same flags are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
from harness.runner import FAST_PATH, ExampleJob, done, load_ranks, run_jobs  # noqa: E402

SEQ = 512
#: layers, hidden, heads (ffn 4 x hidden)
MODELS = {"85M": (12, 768, 12), "302M": (24, 1024, 16), "cpu": (2, 64, 2)}
_FAST = ["--attention-sdpa", "--no-create-attention-mask-in-dataloader"]
_WORKERS = [*_FAST, "--num-workers", "2"]
PATHS = {"local": [], "sdpa": ["--attention-sdpa"], "fast": _FAST, "fast_workers": _WORKERS,
         "fast_rope": FAST_PATH,  # _WORKERS + --rope-fusion
         "fast_sync_norm": FAST_PATH,  # with Megatron's grad-norm fallback (RECORDERS)
         # Transformer Engine's layers (where it is installed), with the fast path's loader and its fused RoPE
         "te": ["--transformer-impl", "transformer_engine", "--no-create-attention-mask-in-dataloader",
                "--num-workers", "2", "--rope-fusion"]}
#: recorders a path adds to the runs' own
RECORDERS = {"fast_sync_norm": ["megatron_multi_tensor"]}
#: priority order: the budget drops the last ones first
DEFAULT_RUNS = ("85M:local:16,85M:local:64,85M:fast:128,302M:local:32,302M:fast:64,302M:fast:128,"
                "85M:sdpa:64,302M:sdpa:32,85M:fast:256,85M:fast_workers:256,302M:fast_workers:128,"
                "85M:fast_rope:256,302M:fast_rope:128,85M:fast:64,302M:fast:32")


DEFINITIONS = {
    "common": "examples/pretrain_gpt_diloco.py --no-diloco-x --bf16 --transformer-impl local --mock-data, seq 512, "
              "global batch = micro-batch, 1 GPU, the example's demo settings otherwise",
    "tokens_per_s": "micro-batch x seq / median train_step time (device-synchronized) after the first iterations",
    "mfu": "6 N tokens/s / peak (N: parameters on the rank, embeddings included)",
    "mfu_with_attention": "(6 N + 6 L s h) tokens/s / peak (causal attention products added)",
    "paths": {k: " ".join([*v, *(f"(recorder {r})" for r in RECORDERS.get(k, []))]) or "(today's path)"
              for k, v in PATHS.items()},
}


def run_args(model: str, path: str, mbs: int, a: argparse.Namespace) -> list[str]:
    layers, hidden, heads = MODELS[model]
    seq = 64 if a.cpu_smoke else SEQ
    args = ["--no-diloco-x", "--transformer-impl", "local", "--mock-data",
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(4 * hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--pipeline-model-parallel-size", "1", "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs),
            "--train-iters", str(a.iters), "--lr-warmup-iters", "5", "--lr-decay-iters", "1000",
            "--log-interval", str(a.iters), "--eval-iters", "0", "--eval-interval", "100000"]
    if not a.cpu_smoke:
        args += ["--bf16", "--distributed-backend", "nccl"]
    return args + PATHS[path]


def analyze(name: str, model: str, path: str, mbs: int, a: argparse.Namespace) -> dict:
    layers, hidden, _ = MODELS[model]
    seq = 64 if a.cpu_smoke else SEQ
    run = {"name": name, "model": model, "path": path, "micro_batch": mbs, "flags": PATHS[path]}
    info = done(a.out, name) or {}
    recs = load_ranks(a.out, name) if info.get("ok") else []
    if not recs or len(recs[0]["iter_s"]) < a.iters:
        log = a.out / name / "log.txt"
        tail = log.read_text(errors="replace")[-400:] if log.exists() else ""
        return {**run, "ok": False, "why": "out of memory" if "out of memory" in tail.lower() else tail}
    r = recs[0]
    first, last = (int(x) for x in a.profile.split(":")) if a.profile else (0, -1)
    steps = [t for i, t in enumerate(r["iter_s"], start=1) if i > a.skip and not first <= i <= last]
    step = statistics.median(steps)
    tokens_per_s = mbs * seq / step
    n = r["params_on_rank"]
    flops = 6 * n + 6 * layers * seq * hidden
    return {**run, "ok": True, "params": n, "step_ms": 1e3 * step, "tokens_per_s": tokens_per_s,
            "mfu": 6 * n * tokens_per_s / (a.peak_tflops * 1e12),
            "mfu_with_attention": flops * tokens_per_s / (a.peak_tflops * 1e12),
            "step_ms_spread": [1e3 * min(steps), 1e3 * max(steps)],
            **({"profile_device_ms_per_step": r.get("profile_device_ms_per_step")} if a.profile else {}),
            "max_mem_gb": (r.get("max_mem_bytes") or 0) / 2**30, "device": r.get("device")}


def summarize(runs: list[dict]) -> dict:
    """Per model: each path's runs by micro-batch and its best; the fast path against today's."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        ok = [r for r in runs if r["model"] == model and r["ok"]]
        best = {p: max((r for r in ok if r["path"] == p), key=lambda r: r["tokens_per_s"], default=None) for p in PATHS}
        local = best["local"]
        fast = max((best[p] for p in PATHS if p not in ("local", "te") and best[p]), key=lambda r: r["tokens_per_s"],
                   default=None)
        entry = {"params": ok[0]["params"] if ok else None,
                 **{f"tokens_per_s_{p}_by_micro_batch": {str(r["micro_batch"]): round(r["tokens_per_s"])
                                                         for r in ok if r["path"] == p} for p in PATHS}}
        if local:
            entry.update(tokens_per_s_local=local["tokens_per_s"], micro_batch_local=local["micro_batch"],
                         mfu_local=local["mfu"])
        if fast:
            entry.update(tokens_per_s_fast=fast["tokens_per_s"], micro_batch_fast=fast["micro_batch"],
                         flags_fast=fast["flags"], mfu_fast=fast["mfu"],
                         mfu_fast_with_attention=fast["mfu_with_attention"], max_mem_gb_fast=fast["max_mem_gb"])
        if best["te"]:
            entry.update(tokens_per_s_te=best["te"]["tokens_per_s"], micro_batch_te=best["te"]["micro_batch"],
                         mfu_te=best["te"]["mfu"])
        if local and fast:
            entry["speedup_fast_vs_best_local"] = fast["tokens_per_s"] / local["tokens_per_s"]
            smallest = min((r for r in ok if r["path"] == "local"), key=lambda r: r["micro_batch"])
            entry["speedup_fast_vs_local_at_micro_batch"] = {
                str(smallest["micro_batch"]): fast["tokens_per_s"] / smallest["tokens_per_s"]}
        out[model] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", default=DEFAULT_RUNS, help="model:path:micro_batch, comma-separated, in order")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--skip", type=int, default=10, help="first iterations not measured")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the card's bf16 dense rate (MFU's denominator)")
    p.add_argument("--budget-s", type=float, default=540, help="start no run past this (seconds)")
    p.add_argument("--results", type=Path, help="also write card / commit / fast_path into this JSON")
    p.add_argument("--commit", help="the commit measured (stored with --results)")
    p.add_argument("--profile", metavar="FIRST:LAST", help="profile these steps of every run (recorder "
                   "``profile``: its table printed and kept in the run's record); timings then exclude them")
    p.add_argument("--trace", action="store_true", help="with --profile: also each run's timeline, "
                   "DIR/<run>/trace.json.gz (a Chrome trace; benchmarks/throughput/trace_gaps.py reads where the "
                   "device idles)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, 2 runs")
    a = p.parse_args()
    if a.cpu_smoke:
        a.runs, a.iters, a.skip = "cpu:local:2,cpu:fast_workers:4", 4, 1
    plan = [(f"{m}_{path}_mbs{mbs}", m, path, int(mbs)) for m, path, mbs in (r.split(":") for r in a.runs.split(","))]
    if a.trace and not a.profile:
        p.error("--trace: only with --profile (the steps it records)")
    env, record = ({"BENCH_PROFILE_STEPS": a.profile}, ["timers", "profile"]) if a.profile else ({}, ["timers"])
    trace = lambda name: {"BENCH_PROFILE_TRACE": str(a.out / name / "trace.json.gz")} if a.trace else {}  # noqa: E731
    jobs = [ExampleJob(name, run_args(m, path, mbs, a), 1, env={**env, **trace(name)},
                       record=record + RECORDERS.get(path, []), timeout_s=150,
                       estimate_s=40 if a.cpu_smoke else 45) for name, m, path, mbs in plan]
    run_jobs(jobs, a.out, budget_s=a.budget_s)
    runs = [analyze(name, m, path, mbs, a) for name, m, path, mbs in plan]
    card = next((r["device"] for r in runs if r.get("device")), None) or "cpu"
    result = {"card": card, "commit": a.commit, "seq_length": 64 if a.cpu_smoke else SEQ,
              "peak_tflops": a.peak_tflops, "definitions": DEFINITIONS, "summary": summarize(runs), "runs": runs}
    (a.out / "fast_path.json").write_text(json.dumps(result, indent=1))
    if a.results:
        old = json.loads(a.results.read_text()) if a.results.exists() else {"points": []}
        old.update(card=card, commit=a.commit, fast_path=result["summary"],
                   fast_path_setup={k: result[k] for k in ("seq_length", "peak_tflops", "definitions")},
                   fast_path_runs=runs)
        a.results.write_text(json.dumps(old, indent=1) + "\n")
    print(f"\ncard: {card}")
    print(f"{'run':24} {'step ms':>8} {'tokens/s':>10} {'MFU':>6} {'MFU+attn':>8} {'mem GB':>7}")
    for r in runs:
        if r["ok"]:
            print(f"{r['name']:24} {r['step_ms']:8.1f} {r['tokens_per_s']:10.0f} {r['mfu']:6.1%} "
                  f"{r['mfu_with_attention']:8.1%} {r['max_mem_gb']:7.1f}")
        else:
            print(f"{r['name']:24} failed: {r['why'][-160:]!r}")
    print(json.dumps(result["summary"], indent=1))
    for name, *_ in plan if a.profile else ():
        for r in (load_ranks(a.out, name) if (done(a.out, name) or {}).get("ok") else []):
            print(f"\n--- {name}: steps {a.profile}, device ms per step "
                  f"{r.get('profile_device_ms_per_step', 0):.1f}\n{r.get('profile_table', '')}")


if __name__ == "__main__":
    main()
