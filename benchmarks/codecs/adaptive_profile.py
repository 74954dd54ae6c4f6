"""Per-round CPU cost of the ``adaptive`` codec next to ``lowrank-int8``, on the shapes of a 12-layer,
hidden-768 GPT shard (the 85.5M model of ``gpu_smoke.py``, one replica's whole stage).

    python benchmarks/codecs/adaptive_profile.py [--layers 12] [--rounds 6] [--threads 2] [--profile]
                                          [--out benchmarks/results/adaptive_profile.json]

Single process, R = 1 all-gather (``t -> t.unsqueeze(0)``). The pseudo-gradient is synthetic: every
matrix is ``G1 diag(d^i) G2 + noise`` (Gaussian factors, a per-kind geometric decay ``d`` chosen so
that energy 0.9 needs ranks ~10-60, as the adaptive codec chose on the real 85.5M run), 1-D tensors
Gaussian; the same pseudo-gradient every round (the residual and bases carry over). Timed per round:

* ``lowrank-int8 r4``: the fixed-rank codec at its default rank;
* ``lowrank-int8 @plan``: the fixed-rank codec at the ranks the adaptive policy chose at round 1
  (the cost the chosen ranks imply by themselves; the adaptive cached rounds run that plan);
* ``adaptive``: the policy (re-evaluated at rounds 1 and 1 + reevaluate_every) plus the exchange;
  ``policy_s`` is the part spent in ``AdaptivePolicy.choose``.

``--profile`` prints torch.profiler's top operators for one evaluation round and one cached round.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_diloco.algorithm.compression import AdaptivePolicy, get_codec  # noqa: E402
from megatron_diloco.algorithm.compression.lowrank import LowRankCodec  # noqa: E402

HIDDEN, FFN, VOCAB, SEQ = 768, 3072, 256, 1024
#: geometric singular-value decay per matrix kind (energy 0.9 at rank ~ ln(0.1) / (2 ln d), plus noise)
DECAY = {"qkv": 0.95, "proj": 0.9, "fc1": 0.96, "fc2": 0.965, "emb": 0.85}


#: the round timer: the calling thread's CPU time (one torch thread), else wall time
CLOCK = [time.thread_time]


def gpt_layout(layers: int) -> tuple[list[tuple[int, tuple[int, ...]]], list[str]]:
    """(offset, shape) and kind of every parameter of a local-spec GPT stage (Megatron weight shapes)."""
    shapes = [((VOCAB, HIDDEN), "emb"), ((SEQ, HIDDEN), "emb")]
    for _ in range(layers):
        shapes += [((HIDDEN,), "1d"), ((HIDDEN,), "1d"), ((3 * HIDDEN, HIDDEN), "qkv"), ((3 * HIDDEN,), "1d"),
                   ((HIDDEN, HIDDEN), "proj"), ((HIDDEN,), "1d"), ((HIDDEN,), "1d"), ((HIDDEN,), "1d"),
                   ((FFN, HIDDEN), "fc1"), ((FFN,), "1d"), ((HIDDEN, FFN), "fc2"), ((HIDDEN,), "1d")]
    shapes += [((HIDDEN,), "1d"), ((HIDDEN,), "1d")]
    layout, off = [], 0
    for shape, _ in shapes:
        layout.append((off, shape))
        off += math.prod(shape)
    return layout, [k for _, k in shapes]


def pseudo_gradient(layout, kinds, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for (_, shape), kind in zip(layout, kinds):
        if kind == "1d":
            parts.append(torch.randn(math.prod(shape), generator=g) * 1e-3)
            continue
        m, n = shape
        k = 128
        s = DECAY[kind] ** torch.arange(k, dtype=torch.float32)
        mat = (torch.randn(m, k, generator=g) * s) @ torch.randn(k, n, generator=g) / math.sqrt(n)
        mat += 0.02 * mat.norm() / math.sqrt(m * n) * torch.randn(m, n, generator=g)
        parts.append(mat.reshape(-1) * 1e-3)
    return torch.cat(parts)


def allgather(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0)


def run_rounds(codec, v: torch.Tensor, rounds: int, adaptive: bool) -> list[dict]:
    residual = torch.zeros_like(v)
    delta = torch.empty_like(v)  # the exchange buffer of OuterSync (out=)
    out = []
    policy_time = [0.0]
    if adaptive:
        orig = codec.policy.choose

        def timed(*a, **k):
            t0 = CLOCK[0]()
            try:
                return orig(*a, **k)
            finally:
                policy_time[0] += CLOCK[0]() - t0

        codec.policy.choose = timed
    for rnd in range(1, rounds + 1):
        policy_time[0] = 0.0
        w0, t0 = time.perf_counter(), CLOCK[0]()
        codec.exchange(residual, allgather, pseudo_grad=v, out=delta)
        dt, wall = CLOCK[0]() - t0, time.perf_counter() - w0
        rec = {"round": rnd, "s": dt, "wall_s": wall}
        if adaptive:
            rec["policy_s"] = policy_time[0]
            rec["evaluated"] = codec.policy.evaluated_at == rnd
            if rec["evaluated"]:
                rec["plan"] = [c.rank for c in codec.policy.plan]
        out.append(rec)
    if adaptive:
        codec.policy.choose = orig
    return out


def profile_round(codec, v, residual, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        codec.exchange(residual, allgather, pseudo_grad=v, out=torch.empty_like(v))
    print(f"\n=== {label} ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; with 1 the times are the thread's CPU time (robust to "
                        "other jobs on the machine), else wall time")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads != 1:
        CLOCK[0] = time.perf_counter  # one thread's CPU time would miss the pool's work
    layout, kinds = gpt_layout(args.layers)
    v = pseudo_gradient(layout, kinds)
    n = v.numel()
    print(f"shard: {n:,} elements, {len(layout)} tensors, {sum(k != '1d' for k in kinds)} matrices; "
          f"torch {torch.__version__}, {args.threads} threads")

    adaptive = get_codec("adaptive", layout, policy=AdaptivePolicy(energy_target=0.9))
    res_adaptive = run_rounds(adaptive, v, args.rounds, adaptive=True)
    # the plan of rounds 1..reevaluate_every (the cached rounds below run it)
    plan = {i: r for i, r in enumerate(res_adaptive[0]["plan"]) if r > 0}
    by_kind: dict[str, list[int]] = {}
    for i, r in plan.items():
        by_kind.setdefault(kinds[i], []).append(r)

    fixed4 = get_codec("lowrank-int8", layout, rank=4)
    res_r4 = run_rounds(fixed4, v, args.rounds, adaptive=False)
    at_plan = LowRankCodec(layout, rank=dict(plan), factor_format="int8", fallback={}, min_numel=4096)
    res_plan = run_rounds(at_plan, v, args.rounds, adaptive=False)

    def med(rs, pred=lambda r: True):
        xs = sorted(r["s"] for r in rs if pred(r))
        return xs[len(xs) // 2] if xs else float("nan")

    summary = {
        "lowrank-int8 r4 (median round s)": med(res_r4[1:]),
        "lowrank-int8 @plan (median round s)": med(res_plan[1:]),
        "adaptive evaluation round s (mean)": sum(r["s"] for r in res_adaptive if r["evaluated"])
        / max(1, sum(r["evaluated"] for r in res_adaptive)),
        "adaptive policy s on evaluation rounds (mean)": sum(r["policy_s"] for r in res_adaptive if r["evaluated"])
        / max(1, sum(r["evaluated"] for r in res_adaptive)),
        "adaptive cached round s (median)": med(res_adaptive, lambda r: not r["evaluated"]),
        "adaptive mean round s": sum(r["s"] for r in res_adaptive) / len(res_adaptive),
        "plan ranks by kind (min-max)": {k: [min(r), max(r)] for k, r in sorted(by_kind.items())},
        "payload bytes adaptive / r4": [adaptive.payload_bytes(), fixed4.payload_bytes()],
    }
    print(json.dumps(summary, indent=1))
    print("adaptive rounds:", json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in res_adaptive]))
    if args.profile:
        residual = torch.zeros_like(v)
        prof_codec = get_codec("adaptive", layout, policy=AdaptivePolicy(energy_target=0.9))
        profile_round(prof_codec, v, residual, "adaptive, evaluation round (cold bases)")
        profile_round(prof_codec, v, residual, "adaptive, cached round")
    if args.out:
        args.out.write_text(json.dumps({
            "machine": f"{platform.machine()} CPU, {args.threads} threads", "torch": torch.__version__,
            "layers": args.layers, "numel": n, "rounds": args.rounds, "summary": summary,
            "adaptive_rounds": res_adaptive, "lowrank_int8_r4_rounds": res_r4, "lowrank_int8_plan_rounds": res_plan,
        }, indent=1))


if __name__ == "__main__":
    main()
