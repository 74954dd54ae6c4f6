"""Convergence at equal tokens: validation loss vs tokens and vs bytes communicated (issue 4).

Same model, data order (per seed), global batch and token budget for every method; 2 processes
per run (allreduce: data-parallel 2; DiLoCo(X): 2 replicas x 1), one replica per side of the link.
Methods (``--methods``):

* ``allreduce``: plain Megatron data parallelism (``--no-diloco-x``).
* ``diloco``: ``--diloco-x-overlap none``, no compression (eta/mu: ``--eta-none``/``--mu-none``).
* ``dilocox``: ``--diloco-x-overlap delayed``, no compression (``--eta-delayed``/``--mu-delayed``).
* ``dilocox_compressed``: delayed (``--compressed-overlap``) + ``--diloco-x-compression adaptive``
  (``--energy``) capped by ``--diloco-x-bandwidth-mbps`` (``--bandwidth-mbps``).
* ``dilocox_eager``: ``--diloco-x-overlap eager``, no compression (``--eta-eager``/``--mu-eager``).
* ``dilocox_eager_compressed``: eager + adaptive (as ``dilocox_compressed``, eager's eta/mu).
* ``dilocox_eager_full`` / ``dilocox_eager_full_compressed``: eager with ``--diloco-x-eager-weight 1``
  (the replica's whole own pseudo-gradient as the look-ahead), fp32 / adaptive.
* ``diloco_compressed``: blocking (``none``) + adaptive (blocking's eta/mu): what the one-step delay
  costs at the compressed variant's bytes (with ~100x+ fewer bytes the exchange is short enough that
  a blocking one may expose little; see the GPU throughput benchmark).

Defaults follow RESULTS.md's outer sweep (blocking best at eta 1, mu 0; delayed at eta 0.5, mu 0);
eager at eta 1, mu 0 is untested (its slow directions contract like the blocking variant's, by
1 - eta p per round, so it should take the blocking variant's eta). With adaptive compression at
energy 0.9 a round of the 85.5M GPT sends ~6.6 MB per rank (RESULTS.md) against 256.5 MB per
*step* for allreduce (distributed optimizer): ~780x fewer bytes at H = 20, ~390x at H = 10; fp32
DiLoCo(X) sends 342 MB per round (15x at H = 20).
Validation loss comes from Megatron's own evaluation (``--eval-interval``, a multiple of H so that
every replica holds the outer parameters when evaluated) on the held-out split of the stdlib corpus
(``--split``, by documents), the same ``--eval-iters`` batches at every evaluation
(``BENCH_FIXED_EVAL``, see ``instrumented.py``), plus the evaluation Megatron runs after training
(after the last exchange is drained): ``final_val_loss``. The default split 90,9,1 leaves 61
documents (0.60M tokens with Python 3.12.1's stdlib) for validation; 8 batches of 64 x 1024 tokens
use 0.52M of them, each once. Training: 10.8M tokens, so 400 iterations are ~2.4 epochs.
Bytes are counted by ``link_model.py`` in accounting-only mode: modelled wire bytes *sent per rank*
(ring formulas; sent = received) by every collective whose group spans both replicas — for
``allreduce`` Megatron's per-step gradient reduce-scatter (fp32) and parameter all-gather (bf16),
3 bytes per parameter per step over 2 ranks; for DiLoCo(X) the pseudo-gradient exchanges; for all
methods also the few-byte cross-replica scalars (loss logging, timers, evaluation).

How to run (GPU machine; megatron-core from the wheel, ``PYTHONPATH`` set)::

    python benchmarks/convergence.py --out DIR                       # 9 methods, 1 seed, 4 GPUs: 2 runs at once
    python benchmarks/convergence.py --out DIR2 --seeds 2            # a second seed (another call)
    python benchmarks/convergence.py --out DIR --report-only --from DIR2    # merge, JSON + PNG
    python benchmarks/convergence.py --out DIR --cpu-smoke           # CPU, gloo, tiny GPT, few its

Expected wall time on 4 x H100 (85.5M GPT, 64 x 1024 tokens per step, 400 iterations, H = 20,
an evaluation every 40): ~2 min per run, two at a time: ~10 min for 9 methods. Runs done in ``DIR`` with the same flags are skipped
and none starts past ``--budget-s``: rerun the command to finish. Writes ``DIR/convergence.json``
after every run and ``DIR/convergence.png`` when matplotlib is importable (else run
``python benchmarks/plot_results.py convergence DIR/convergence.json`` where it is).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import MODEL as GPU_MODEL  # noqa: E402  (the 85.5M GPT of the GPU smoke benchmark)
from jobs import Job, done, gpu_count, load_ranks, run_jobs, summary_of  # noqa: E402

METHODS = ("allreduce", "diloco", "dilocox", "dilocox_compressed", "dilocox_eager",
           "dilocox_eager_compressed", "diloco_compressed", "dilocox_eager_full",
           "dilocox_eager_full_compressed")
CPU_MODEL = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2
""".split()
_VALID = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| lm loss value: (\S+)")


def method_args(method: str, a: argparse.Namespace) -> list[str]:
    if method == "allreduce":
        return ["--no-diloco-x", "--use-tp-pp-dp-mapping"]
    dx = ["--diloco-x", "--diloco-x-replicas", "2", "--diloco-x-local-steps", str(a.local_steps)]
    outer = lambda eta, mu: ["--diloco-x-outer-lr", str(eta), "--diloco-x-outer-momentum", str(mu)]  # noqa: E731
    if method == "diloco":
        return dx + ["--diloco-x-overlap", "none", "--diloco-x-compression", "none", *outer(a.eta_none, a.mu_none)]
    if method == "dilocox":
        return dx + ["--diloco-x-overlap", "delayed", "--diloco-x-compression", "none",
                     *outer(a.eta_delayed, a.mu_delayed)]
    full = ["--diloco-x-eager-weight", "1"] if method.startswith("dilocox_eager_full") else []
    compressed = {"dilocox_compressed": a.compressed_overlap, "dilocox_eager_compressed": "eager",
                  "diloco_compressed": "none", "dilocox_eager_full_compressed": "eager"}
    if method in compressed:
        overlap = compressed[method]
        eta, mu = {"none": (a.eta_none, a.mu_none), "delayed": (a.eta_delayed, a.mu_delayed),
                   "eager": (a.eta_eager, a.mu_eager)}[overlap]
        return dx + ["--diloco-x-overlap", overlap, "--diloco-x-compression", "adaptive",
                     "--diloco-x-energy", str(a.energy), "--diloco-x-bandwidth-mbps", str(a.bandwidth_mbps),
                     *outer(eta, mu), *full]
    if method in ("dilocox_eager", "dilocox_eager_full"):
        return dx + ["--diloco-x-overlap", "eager", "--diloco-x-compression", "none",
                     *outer(a.eta_eager, a.mu_eager), *full]
    raise SystemExit(f"unknown method {method!r}; choose among {', '.join(METHODS)}")


def run_name(method: str, seed: int) -> str:
    return f"{method}_seed{seed}"


# --- analysis -------------------------------------------------------------------------------------


def analyze_run(out: Path, name: str, tokens_per_step: int) -> dict:
    """One finished run: its validation curve with bytes, final loss and totals."""
    info = done(out, name) or {}
    log_path = out / name / "log.txt"
    if not info.get("ok"):
        tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
        return {"error": f"run failed (rc {info.get('returncode')})", "log_tail": tail}
    recs = load_ranks(out, name)
    cum = [r.get("link_cum") or [] for r in recs]

    def bytes_after(it: int) -> float:  # cumulative bytes sent per rank after iteration `it`
        return statistics.mean(c[min(it, len(c)) - 1][0] for c in cum) if all(cum) else float("nan")

    curve, final = [], None
    for m in _VALID.finditer(log_path.read_text(errors="replace")):
        it, loss = int(m[1]), float(m[3])
        if m[2]:
            final = (it, loss)
        else:
            curve.append([it * tokens_per_step, loss, bytes_after(it)])
    iters = len(recs[0]["iter_s"])
    s = summary_of(out, name)
    run = {
        "iterations": iters, "tokens": iters * tokens_per_step,
        "final_val_loss": final[1] if final else (curve[-1][1] if curve else None),
        "bytes_total": bytes_after(iters), "curve": curve,
        "train_wall_s": sum(max(r["iter_s"][i] for r in recs) for i in range(iters)),
        "link_kinds_rank0": recs[0].get("link", {}).get("kinds"),
    }
    if s:
        run.update({"diloco_bytes_sent_per_rank": s.get("bytes_sent_per_rank"), "rounds": s.get("rounds"),
                    "replicas_identical": s.get("replicas_identical"),
                    "compression_ratio": s.get("compression_ratio"), "final_train_loss": s.get("final_loss")})
    return run


def aggregate(per_seed: dict[int, dict]) -> dict:
    """Mean over seeds (final loss, bytes, curve point by point); per-seed figures kept."""
    ok = {s: r for s, r in per_seed.items() if "error" not in r}
    if not ok:
        return {"error": "; ".join(r["error"] for r in per_seed.values()), "seeds": per_seed}
    runs = list(ok.values())
    n_points = min(len(r["curve"]) for r in runs)
    curve = [[runs[0]["curve"][i][0], statistics.mean(r["curve"][i][1] for r in runs),
              statistics.mean(r["curve"][i][2] for r in runs)] for i in range(n_points)]
    finals = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
    out = {"final_val_loss": statistics.mean(finals) if finals else None,
           "final_val_loss_seeds": {s: r["final_val_loss"] for s, r in ok.items()},
           "bytes_total": statistics.mean(r["bytes_total"] for r in runs),
           "tokens": runs[0]["tokens"], "curve": curve,
           "seeds": {s: {k: v for k, v in r.items() if k != "curve"} for s, r in ok.items()}}
    if len(finals) > 1:
        out["final_val_loss_std"] = statistics.stdev(finals)
    failed = {s: r for s, r in per_seed.items() if "error" in r}
    if failed:
        out["failed_seeds"] = failed
    return out


def report(dirs: list[Path], a: argparse.Namespace) -> dict:
    """convergence.json from every run found in ``dirs`` (later dirs add seeds / methods)."""
    per_method: dict[str, dict[int, dict]] = {}
    for d in dirs:
        for done_file in sorted(d.glob("*_seed*/done.json")):
            name = done_file.parent.name
            method, seed = name.rsplit("_seed", 1)
            per_method.setdefault(method, {})[int(seed)] = analyze_run(d, name, a.tokens_per_step)
    methods = {m: aggregate(per_method[m]) for m in METHODS if m in per_method}
    base = methods.get("allreduce", {})
    for m, r in methods.items():
        if "error" in r or not base.get("final_val_loss") or r.get("final_val_loss") is None:
            continue
        r["loss_gap_vs_allreduce"] = r["final_val_loss"] / base["final_val_loss"] - 1
        r["bytes_ratio_vs_allreduce"] = base["bytes_total"] / r["bytes_total"] if r["bytes_total"] else None
        r["meets_target"] = (m != "allreduce" and r["loss_gap_vs_allreduce"] <= 0.02
                             and (r["bytes_ratio_vs_allreduce"] or 0) >= 100)
    card = None
    for d in dirs:
        for rank0 in d.glob("*_seed*/rank0.json"):
            card = json.loads(rank0.read_text()).get("device") or "cpu (gloo)"
            break
    return {"card": f"{card} x 2 per run" if card else None, "model": a.model_desc,
            "setup": {"iterations": a.iters, "local_steps": a.local_steps, "eval_interval": a.eval_interval,
                      "tokens_per_step": a.tokens_per_step, "split": a.split,
                      "validation": f"the same {a.eval_iters} batches of the held-out split at every evaluation",
                      "outer": {"none": [a.eta_none, a.mu_none], "delayed": [a.eta_delayed, a.mu_delayed],
                                "eager": [a.eta_eager, a.mu_eager]},
                      "compressed": {"energy": a.energy, "bandwidth_mbps": a.bandwidth_mbps,
                                     "overlap": a.compressed_overlap},
                      "bytes": "modelled ring wire bytes sent per rank on cross-replica groups (link_model.py)",
                      "target": "final val loss within 2% of allreduce with >= 100x fewer bytes"},
            "methods": methods}


def print_table(result: dict) -> None:
    print(f"\ncard: {result['card']}   model: {result['model']}")
    head = f"{'method':20} {'final val loss':>14} {'gap vs AR':>10} {'bytes/rank':>12} {'fewer bytes':>12} {'target':>7}"
    print(head)
    print("-" * len(head))
    for m, r in result["methods"].items():
        if "error" in r:
            print(f"{m:20} FAILED: {r['error']}")
            continue
        gap, ratio = r.get("loss_gap_vs_allreduce"), r.get("bytes_ratio_vs_allreduce")
        print(f"{m:20} {r['final_val_loss']:14.4f} {(f'{100 * gap:+.2f}%' if gap is not None else '-'):>10} "
              f"{r['bytes_total']:12.3e} {(f'{ratio:.1f}x' if ratio else '-'):>12} "
              f"{('yes' if r.get('meets_target') else 'no') if m != 'allreduce' else '':>7}")


def write_outputs(result: dict, out: Path) -> None:
    (out / "convergence.json").write_text(json.dumps(result, indent=1))
    try:
        from plot_results import plot_convergence

        plot_convergence(out / "convergence.json", out / "convergence.png")
    except ImportError as err:  # no matplotlib on the GPU machines
        print(f"[convergence] no PNG ({err}); plot elsewhere: python benchmarks/plot_results.py "
              f"convergence {out / 'convergence.json'}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="1234", help="comma-separated; each changes init and data order")
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--local-steps", type=int, default=20, help="H")
    p.add_argument("--eval-interval", type=int, default=40, help="a multiple of H")
    p.add_argument("--eval-iters", type=int, default=8,
                   help="validation batches (of the global batch size) per evaluation: the same "
                        "batches at every evaluation, the first ones of the held-out split")
    p.add_argument("--split", default="90,9,1", help="train,valid,test proportions of the corpus (by documents)")
    p.add_argument("--eta-none", type=float, default=1.0)
    p.add_argument("--mu-none", type=float, default=0.0)
    p.add_argument("--eta-delayed", type=float, default=0.5)
    p.add_argument("--mu-delayed", type=float, default=0.0)
    p.add_argument("--eta-eager", type=float, default=1.0)
    p.add_argument("--mu-eager", type=float, default=0.0)
    p.add_argument("--energy", type=float, default=0.9, help="dilocox_compressed: --diloco-x-energy")
    p.add_argument("--compressed-overlap", choices=("delayed", "eager"), default="delayed",
                   help="dilocox_compressed's --diloco-x-overlap (outer eta/mu of that mode)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0,
                   help="dilocox_compressed: --diloco-x-bandwidth-mbps (byte cap per round)")
    p.add_argument("--parallel", type=int, default=None, help="runs at once (default: GPUs / 2, CPU 1)")
    p.add_argument("--budget-s", type=float, default=570, help="start no run past this (seconds)")
    p.add_argument("--step-s", type=float, default=0.2, help="estimate: step time")
    p.add_argument("--startup-s", type=float, default=30, help="estimate: start-up per run")
    p.add_argument("--report-only", action="store_true", help="only rebuild JSON/PNG from finished runs")
    p.add_argument("--from", dest="more", type=Path, action="append", default=[],
                   help="with --report-only: more output folders to merge (other seeds / methods)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny GPT, 2 processes, few its")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more flags for every run (after --)")
    a = p.parse_args()
    a.extra = [x for x in a.extra if x != "--"]
    if a.cpu_smoke:
        a.iters, a.local_steps, a.eval_interval = min(a.iters, 24), min(a.local_steps, 4), min(a.eval_interval, 8)
        a.eval_iters = min(a.eval_iters, 2)
        a.split = "98,1,1" if a.split == p.get_default("split") else a.split
        a.step_s, a.startup_s = 0.1, 15
        model = CPU_MODEL
    else:
        model = GPU_MODEL
    if a.eval_interval % a.local_steps:
        print(f"[convergence] warning: --eval-interval {a.eval_interval} is not a multiple of H = "
              f"{a.local_steps}: DiLoCo replicas are evaluated mid-round", flush=True)
    a.common = [*model, "--pipeline-model-parallel-size", "1", "--train-iters", str(a.iters),
                "--eval-interval", str(a.eval_interval), "--eval-iters", str(a.eval_iters), "--split", a.split,
                "--log-interval", str(a.local_steps), *a.extra]
    gbs = [model[i + 1] for i, x in enumerate(model[:-1]) if x == "--global-batch-size"][-1]
    seq = [model[i + 1] for i, x in enumerate(model[:-1]) if x == "--seq-length"][-1]
    a.tokens_per_step = int(gbs) * int(seq)
    a.model_desc = ("tiny GPT (2 x 64)" if a.cpu_smoke else "85.5M GPT (12 x 768), bf16") + \
        f", {gbs} x {seq} tokens/step, stdlib corpus (byte-level)"
    if a.parallel is None:
        a.parallel = max(1, min(2, gpu_count() // 2))
    return a


def main() -> None:
    a = parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        seeds = [int(s) for s in a.seeds.split(",")]
        methods = a.methods.split(",")
        evals = a.iters // a.eval_interval + 1
        jobs = [Job(run_name(m, seed), [*a.common, "--seed", str(seed), *method_args(m, a)], 2,
                    {"BENCH_LINK_MBPS": "inf", "BENCH_LINK_REPLICAS": "2", "BENCH_FIXED_EVAL": "1"},
                    a.startup_s + a.iters * a.step_s + evals * 2 * a.step_s)
                for seed in seeds for m in methods]
        print(f"[convergence] {len(jobs)} runs, ~{sum(j.estimate_s for j in jobs) / a.parallel / 60:.1f} "
              f"min at {a.parallel} at a time", flush=True)
        run_jobs(jobs, a.out, parallel=a.parallel, budget_s=a.budget_s,
                 on_done=lambda *_: (a.out / "convergence.json").write_text(
                     json.dumps(report([a.out], a), indent=1)))
        for job in jobs:
            info = done(a.out, job.name) or {}
            if not info.get("ok") and job.name.startswith("dilocox_eager"):
                print(f"[convergence] {job.name} did not run to completion: is --diloco-x-overlap eager "
                      "implemented in this checkout? (see its log.txt)", flush=True)
    result = report([a.out, *a.more], a)
    write_outputs(result, a.out)
    print_table(result)


if __name__ == "__main__":
    main()
