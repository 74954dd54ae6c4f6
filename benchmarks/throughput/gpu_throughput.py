"""Throughput of AllReduce data parallelism, DiLoCo and DiLoCoX across a modelled slow link (issue 4).

Every run is the example (``examples/pretrain_gpt_diloco.py`` under the harness recorders) with the
same model, data and global batch, 2 replicas (contiguous halves of the GPUs), NCCL between the
GPUs, and ``harness/link_model.py`` slowing every collective whose group spans both replicas to
``latency + wire bytes / bandwidth`` (ring formulas; see that module). Compute runs at GPU speed,
so the ratios reflect real step times.

How to run (GPU machine; megatron-core installed from the wheel, ``PYTHONPATH`` set)::

    python benchmarks/throughput/gpu_throughput.py --out DIR --nproc 4 --links 1000,100      # 4 GPUs: 2 x PP 2
    python benchmarks/throughput/gpu_throughput.py --out DIR --nproc 2 --links 1000,100 --parallel 2   # 2 x 1 GPU, two at a time
    python benchmarks/throughput/gpu_throughput.py --out DIR --cpu-smoke                      # CPU, gloo, tiny GPT

Expected wall time (85.5M GPT, 64 x 1024 tokens per step, ~0.2 s per step, H = 20; start-up of
Megatron ~25-40 s per run, not yet measured on the GPU machines): ``--nproc 4``, 3 methods x 2 links:
~2.2 min of training + 6 start-ups, ~5 min; ``--nproc 2 --parallel 2`` on 4 GPUs: ~3.6 min of
training + start-ups, two at a time, ~3.5 min (+1 min with ``dilocox-adaptive``). The slowest runs
are allreduce and blocking DiLoCo at 100 Mbit/s (all-reduces of 171 MB per rank at 4 GPUs, 342 MB at
2: 14 s / 27 s each); ``--allreduce-iters`` and ``--rounds-blocking`` bound them.
Runs already done in ``DIR`` with the same flags are skipped, and no run starts past ``--budget-s``,
so a sweep cut short is finished by repeating the command. ``DIR/gpu.json`` is rewritten after
every run.

Methods (``--methods``):

* ``allreduce``: plain Megatron DDP (``--no-diloco-x``, the example's ``--use-distributed-optimizer``
  dropped, as in the CPU WAN benchmark ``wan_bench.py``, recorder ``plain_ddp``): the fp32 gradients all-reduced across the
  link every step, with ``--overlap-grad-reduce`` (``--no-allreduce-overlap`` drops it) and
  ``--use-tp-pp-dp-mapping`` so that each replica is a complete model (only data parallelism
  crosses). The baseline of ``speedup_vs_allreduce`` and ``speedup_bound``.
* ``allreduce-distopt``: the example's ``--no-diloco-x`` as is: distributed optimizer, fp32 gradients
  reduce-scattered and bf16 parameters all-gathered every step (3/4 of the bytes of ``allreduce``
  with bf16), with ``--overlap-grad-reduce --overlap-param-gather``; when run, every run also gets
  ``speedup_vs_allreduce_distopt``.
* ``diloco``: ``--diloco-x-overlap none --diloco-x-compression none`` (blocking fp32 all-reduce
  every H steps), eta 1, mu 0 (best blocking setting of the outer sweep in RESULTS.md).
* ``dilocox``: ``--diloco-x-overlap delayed --diloco-x-compression int8``, eta 0.5, mu 0.
* ``dilocox-adaptive``: delayed + ``adaptive`` with ``--diloco-x-bandwidth-mbps`` = the link.
* ``dilocox-fp32``: delayed, no compression.

Measurement window: allreduce, iterations after ``--allreduce-skip``; DiLoCo methods, rounds 2..N
(each with its boundary; round 1 and the final drain excluded). Per run in ``gpu.json``:

* ``tokens_per_s``: global tokens / wall time of the window (per-iteration max over ranks).
* ``compute_step_s`` (t_step): median inner (non-boundary) step of the DiLoCo runs at that GPU count
  (no byte crosses the link there); ``compute_utilization`` = t_step x steps / window time.
* ``bytes_per_rank_per_token``: modelled wire bytes sent per rank (mean over ranks) / global tokens.
* ``exposed_s_per_round``: DiLoCo: time the boundary waited for an exchange (max over ranks, mean
  over rounds); allreduce: (mean step - t_step), a round being one step. ``overhead_s_per_round``:
  (window time - t_step x steps) / rounds, for every method.
* ``speedup_vs_allreduce``: tokens/s over allreduce's at the same GPUs and link.
* ``speedup_bound``: (t_step + t_allreduce) / t_step, t_allreduce = modelled link seconds per step of
  the allreduce run: the speedup of a method that hid all communication over an allreduce that hid none.
  ``speedup_ceiling``: measured allreduce step / t_step, the same with allreduce's real exposure (it
  can exceed the bound: with pipeline stages the stages' transfers and waits add up on the critical
  path; with overlap it can fall below it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
from harness.gpu_bench import MODEL as GPU_MODEL  # noqa: E402  (the 85.5M GPT)
from harness.runner import (  # noqa: E402
    ExampleJob, bench_recorders, done, load_ranks, run_jobs, summary_of)

CPU_MODEL = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --log-interval 4 --eval-iters 0 --eval-interval 100000
""".split()
METHODS = ("allreduce", "allreduce-distopt", "diloco", "dilocox", "dilocox-adaptive", "dilocox-fp32")
#: Methods run as plain DDP (the harness recorder ``plain_ddp``: no distributed optimizer).
PLAIN_DDP = ("allreduce",)
BLOCKING = ("diloco",)


def flag_value(args: list[str], flag: str) -> str:
    """The last value given to ``flag`` in ``args``."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag][-1]


def method_args(method: str, link_mbps: float, a: argparse.Namespace) -> list[str]:
    if method == "allreduce":  # plain DDP (PLAIN_DDP): the fp32 gradients all-reduced every step
        overlap = ["--overlap-grad-reduce"] if a.allreduce_overlap else []
        return ["--no-diloco-x", "--use-tp-pp-dp-mapping", *overlap]
    if method == "allreduce-distopt":  # the example's default: distributed optimizer
        overlap = ["--overlap-grad-reduce", "--overlap-param-gather"] if a.allreduce_overlap else []
        return ["--no-diloco-x", "--use-tp-pp-dp-mapping", *overlap]
    dx = ["--diloco-x", "--diloco-x-replicas", "2", "--diloco-x-local-steps", str(a.local_steps), "--diloco-x-warmup-iters", "0"]
    if method == "diloco":
        return dx + ["--diloco-x-overlap", "none", "--diloco-x-compression", "none",
                     "--diloco-x-outer-lr", str(a.eta_none), "--diloco-x-outer-momentum", str(a.mu_none)]
    delayed = dx + ["--diloco-x-overlap", "delayed", "--diloco-x-outer-lr", str(a.eta_delayed),
                    "--diloco-x-outer-momentum", str(a.mu_delayed)]
    if method == "dilocox":
        return delayed + ["--diloco-x-compression", "int8"]
    if method == "dilocox-adaptive":  # the flag is the replica's link: with a modelled link per rank,
        # the replica's ranks together have nproc / 2 of them (each rank then counts on one)
        site = link_mbps * (a.nproc // 2 if a.link_share == "rank" else 1)
        return delayed + ["--diloco-x-compression", "adaptive", "--diloco-x-energy", str(a.energy),
                          "--diloco-x-bandwidth-mbps", f"{site:g}"]
    if method == "dilocox-fp32":
        return delayed + ["--diloco-x-compression", "none"]
    raise SystemExit(f"unknown method {method!r}; choose among {', '.join(METHODS)}")


def iterations(method: str, link_mbps: float, a: argparse.Namespace) -> int:
    if method.startswith("allreduce"):
        table = dict(item.split(":") for item in a.allreduce_iters.split(","))
        for link, iters in sorted(((float(k), int(v)) for k, v in table.items()), reverse=True):
            if link_mbps >= link:
                return iters
        return min(int(v) for v in table.values())
    return a.local_steps * (a.rounds_blocking if method in BLOCKING else a.rounds)


def estimate_s(method: str, link_mbps: float, iters: int, a: argparse.Namespace) -> float:
    """Rough wall time of a run (for the budget), from --step-s and --params-m."""
    rate = link_mbps * 1e6 / 8
    p_rank = a.params_m * 1e6 * 2 / a.nproc  # parameters per rank (PP splits the model)
    link = {"allreduce": 4 * p_rank * iters,  # ring all-reduce of fp32 grads over 2
            "allreduce-distopt": 3 * p_rank * iters,  # fp32 grads reduce-scattered + bf16 params gathered
            "diloco": 4 * p_rank * iters / a.local_steps}.get(method, 0.0) / rate
    return a.startup_s + iters * a.step_s + link


def name_of(nproc: int, link: float, method: str) -> str:
    return f"g{nproc}_l{link:g}_{method}"


# --- analysis -------------------------------------------------------------------------------------


def _window(method: str, iters: int, a) -> range:
    """1-based iterations measured."""
    if method.startswith("allreduce"):
        return range(a.allreduce_skip + 1, iters + 1)
    return range(a.local_steps + 1, iters + 1)


def analyze_run(name: str, method: str, link: float, iters: int, a) -> dict | None:
    info = done(a.out, name)
    if not (info and info.get("ok")):
        return None
    recs = load_ranks(a.out, name)
    per_it = [max(r["iter_s"][i] for r in recs) for i in range(len(recs[0]["iter_s"]))]
    window = [i for i in _window(method, iters, a) if i <= len(per_it)]
    t_window = sum(per_it[i - 1] for i in window)
    tokens = len(window) * a.tokens_per_step
    lo, hi = window[0] - 1, window[-1]  # cumulative counters: after iteration lo .. after hi

    def delta(r, k):
        cum = r.get("link_cum") or []
        return (cum[hi - 1][k] - (cum[lo - 1][k] if lo > 0 else 0.0)) if cum else 0.0

    bytes_rank = statistics.mean(delta(r, 0) for r in recs)
    link_s = max(delta(r, 1) for r in recs)
    H = a.local_steps
    run = {"gpus": a.nproc, "link_mbps": link, "method": method, "latency_ms": a.latency_ms,
           "iterations": iters, "window": [window[0], window[-1]], "tokens_per_step": a.tokens_per_step,
           "tokens_per_s": tokens / t_window, "step_s_mean": t_window / len(window),
           "bytes_per_rank_per_token": bytes_rank / tokens, "link_s_per_step": link_s / len(window),
           "wall_s": info.get("wall_s")}
    if method.startswith("allreduce"):
        run["rounds_in_window"] = len(window)
        run["bytes_per_rank_per_round"] = bytes_rank / len(window)
    else:
        inner = [per_it[i - 1] for i in window if i % H != 0]
        run["inner_step_s_median"] = statistics.median(inner) if inner else None
        rounds = [rd for rd in range(2, iters // H + 1)]
        run["rounds_in_window"] = len(rounds)
        run["local_steps"] = H
        run["bytes_per_rank_per_round"] = bytes_rank / max(1, len(rounds))
        by_round: dict[int, float] = {}
        for r in recs:
            for m in r.get("rounds", []):
                if m["round"] in rounds:
                    by_round[m["round"]] = max(by_round.get(m["round"], 0.0), m["exposed_s"])
        run["exposed_s_per_round"] = statistics.mean(by_round.values()) if by_round else None
        s = summary_of(a.out, name)
        run.update({k: s.get(k) for k in ("replicas_identical", "compression_ratio", "final_loss",
                                          "exposed_comm_s")})
    return run


def analyze(plan: list[tuple[str, str, float, int]], a) -> dict:
    runs = [r for r in (analyze_run(n, m, l, it, a) for n, m, l, it in plan) if r is not None]
    inner = [r["inner_step_s_median"] for r in runs if r.get("inner_step_s_median")]
    t_step = statistics.median(inner) if inner else None
    if t_step is None:  # no DiLoCo run: allreduce's step less its modelled link time
        ar = [r for r in runs if r["method"].startswith("allreduce")]
        t_step = statistics.median(r["step_s_mean"] - r["link_s_per_step"] for r in ar) if ar else None
    base = {r["link_mbps"]: r for r in runs if r["method"] == "allreduce"}
    distopt = {r["link_mbps"]: r for r in runs if r["method"] == "allreduce-distopt"}
    for r in runs:
        r["compute_step_s"] = t_step
        r["compute_utilization"] = t_step / r["step_s_mean"] if t_step else None
        r["overhead_s_per_round"] = ((r["step_s_mean"] - t_step) * (r["window"][1] - r["window"][0] + 1)
                                     / max(1, r["rounds_in_window"])) if t_step else None
        if r["method"].startswith("allreduce"):
            r["exposed_s_per_round"] = r["step_s_mean"] - t_step if t_step else None
        if r["link_mbps"] in distopt:
            r["speedup_vs_allreduce_distopt"] = r["tokens_per_s"] / distopt[r["link_mbps"]]["tokens_per_s"]
        b = base.get(r["link_mbps"])
        r["speedup_vs_allreduce"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["speedup_bound"] = (t_step + b["link_s_per_step"]) / t_step if b and t_step else None
        r["speedup_ceiling"] = b["step_s_mean"] / t_step if b and t_step else None
    card = None
    for n, *_ in plan:
        if (done(a.out, n) or {}).get("ok"):
            card = load_ranks(a.out, n)[0].get("device") or "cpu (gloo)"
            break
    return {"card": f"{card} x {a.nproc}" if card else None, "model": a.model_desc,
            "link_model": {"latency_ms": a.latency_ms, "share": a.link_share,
                           "formula": "hops x latency + ring wire bytes / bandwidth, FIFO per rank"},
            "runs": runs}


def print_table(result: dict) -> None:
    print(f"\ncard: {result['card']}   model: {result['model']}")
    head = (f"{'gpus':>4} {'link':>6} {'method':17} {'tokens/s':>10} {'util':>6} {'B/rank/tok':>11} "
            f"{'exposed/rnd s':>13} {'speedup':>8} {'bound':>7} {'ceiling':>8}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for r in sorted(result["runs"], key=lambda r: (-r["link_mbps"], METHODS.index(r["method"]))):
        print(f"{r['gpus']:>4} {r['link_mbps']:>6g} {r['method']:17} {fmt(r['tokens_per_s'], '10.0f')} "
              f"{fmt(r['compute_utilization'], '6.2f')} {fmt(r['bytes_per_rank_per_token'], '11.2f')} "
              f"{fmt(r.get('exposed_s_per_round'), '13.3f')} {fmt(r['speedup_vs_allreduce'], '8.2f')} "
              f"{fmt(r['speedup_bound'], '7.1f')} {fmt(r.get('speedup_ceiling'), '8.1f')}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nproc", type=int, default=None,
                   help="GPUs per run, 2 replicas of nproc/2 (default 4; 2 with --cpu-smoke)")
    p.add_argument("--links", default="1000,100", help="link bandwidths, Mbit/s, comma-separated")
    p.add_argument("--methods", default="allreduce,diloco,dilocox")
    p.add_argument("--latency-ms", type=float, default=5.0, help="one-way latency per ring hop")
    p.add_argument("--link-share", choices=("rank", "replica"), default="rank",
                   help="rank: a link per rank; replica: one per replica shared by its ranks")
    p.add_argument("--intra", choices=("pp", "dp"), default="pp",
                   help="layout inside a replica of several GPUs: pipeline or data parallel")
    p.add_argument("--local-steps", type=int, default=20, help="H")
    p.add_argument("--rounds", type=int, default=3, help="rounds per overlapped DiLoCo(X) run")
    p.add_argument("--rounds-blocking", type=int, default=2, help="rounds per blocking DiLoCo run")
    p.add_argument("--allreduce-iters", default="1000:8,100:3,0:3",
                   help="iterations of the allreduce runs per link (Mbit/s:iters, the largest "
                        "link <= the run's applies)")
    p.add_argument("--allreduce-skip", type=int, default=1, help="allreduce warm-up iterations not measured")
    p.add_argument("--no-allreduce-overlap", dest="allreduce_overlap", action="store_false")
    p.add_argument("--eta-none", type=float, default=1.0)
    p.add_argument("--mu-none", type=float, default=0.0)
    p.add_argument("--eta-delayed", type=float, default=0.5)
    p.add_argument("--mu-delayed", type=float, default=0.0)
    p.add_argument("--energy", type=float, default=0.9, help="dilocox_adaptive's --diloco-x-energy")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (disjoint GPU sets)")
    p.add_argument("--budget-s", type=float, default=570, help="start no run past this (seconds)")
    p.add_argument("--startup-s", type=float, default=30, help="estimate: start-up per run")
    p.add_argument("--step-s", type=float, default=0.2, help="estimate: compute step time")
    p.add_argument("--params-m", type=float, default=85.5, help="estimate: model parameters (M)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny GPT, 2 processes")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more flags for every run (after --)")
    a = p.parse_args()
    a.extra = [x for x in a.extra if x != "--"]
    if a.cpu_smoke:
        a.nproc = a.nproc or 2
        if a.links == p.get_default("links"):
            a.links = "20,2"
        a.local_steps, a.rounds, a.rounds_blocking = min(a.local_steps, 4), a.rounds, a.rounds_blocking
        a.allreduce_iters = "0:4"
        a.startup_s, a.step_s, a.params_m = 15, 0.1, 0.12
        model = CPU_MODEL
    else:
        model = [*GPU_MODEL, "--log-interval", "20"]  # argparse keeps the last value
    a.nproc = a.nproc or 4
    pp = a.nproc // 2 if a.intra == "pp" else 1
    # One LR schedule for every run length (warm-up must end before the decay horizon).
    schedule = ["--lr-warmup-iters", "5", "--lr-decay-iters", "1000"]
    a.common = [*model, *schedule, "--pipeline-model-parallel-size", str(pp), *a.extra]
    a.tokens_per_step = int(flag_value(a.common, "--global-batch-size")) * int(flag_value(a.common, "--seq-length"))
    a.model_desc = ("tiny GPT (2 x 64), 8 x 64 tokens/step" if a.cpu_smoke else
                    "85.5M GPT (12 x 768), 64 x 1024 tokens/step, bf16") + \
        f", 2 replicas x {'PP' if a.intra == 'pp' else 'DP'} {a.nproc // 2}"
    return a


def main() -> None:
    a = parse_args()
    links = [float(x) for x in a.links.split(",")]
    methods = a.methods.split(",")
    plan, jobs = [], []
    for link in links:
        for method in methods:
            iters = iterations(method, link, a)
            name = name_of(a.nproc, link, method)
            args = [*a.common, *method_args(method, link, a), "--train-iters", str(iters)]
            env = {"BENCH_LINK_MBPS": str(link), "BENCH_LINK_LATENCY_MS": str(a.latency_ms),
                   "BENCH_LINK_REPLICAS": "2", "BENCH_LINK_SHARE": a.link_share}
            plan.append((name, method, link, iters))
            record = bench_recorders(env) + (["plain_ddp"] if method in PLAIN_DDP else [])
            jobs.append(ExampleJob(name, args, a.nproc, env, estimate_s(method, link, iters, a), record=record))
    total = sum(j.estimate_s for j in jobs) / a.parallel
    print(f"[gpu_throughput] {len(jobs)} runs, estimated {total / 60:.1f} min", flush=True)

    def write(*_):
        result = analyze(plan, a)
        (a.out / "gpu.json").write_text(json.dumps(result, indent=1))

    run_jobs(jobs, a.out, parallel=a.parallel, budget_s=a.budget_s, on_done=write)
    write()
    result = json.loads((a.out / "gpu.json").read_text())
    print_table(result)
    missing = [n for n, *_ in plan if not (done(a.out, n) or {}).get("ok")]
    if missing:
        print(f"\n[gpu_throughput] not done: {', '.join(missing)} (rerun the same command to resume)")


if __name__ == "__main__":
    main()
