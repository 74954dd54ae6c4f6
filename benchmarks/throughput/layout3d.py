"""The full 3-D layout: 2 DiLoCoX replicas x TP x PP (each replica a contiguous block of GPUs), a
~1B GPT, bf16, distributed optimizer, next to vanilla Megatron at the same global batch (issue 5).

    python benchmarks/throughput/layout3d.py --out DIR --nproc 8 --tp 2 --pp 2            # the 8-GPU run (x8.json)
    python benchmarks/throughput/layout3d.py --out DIR --nproc 4 --tp 2 --pp 1 --name x4  # what 4 GPUs allow

Writes ``DIR/<name>.json`` (the shape of ``benchmarks/results/x8.json``): card, layout, replicas
bit-identical after every boundary (a fingerprint all-gather over each outer group after each
boundary, ``BENCH_CHECK_BOUNDARIES=1``) and after the final drain, loss curves of both runs, median
inner-step time with and without the plugin (boundary steps apart), peak GPU memory per rank with and
without (and the difference per parameter on the rank), and the bytes that crossed the outer groups
against what data-parallel AllReduce over the replicas would have sent in the same iterations.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
from harness.gpu_bench import boundary_step_times, loss_at, parse_bench_args, run  # noqa: E402
from harness.runner import last_summary  # noqa: E402

#: ~1.2B parameters: 24 layers x hidden 2048 (12 L h^2 = 1.21B), byte-level vocabulary.
MODEL_1B = """
    --num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32
    --bf16 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20 --log-interval 10 --eval-iters 0
    --eval-interval 100000 --distributed-backend nccl
""".split()
#: A tiny model for a CPU smoke run of this script (gloo, fp32).
MODEL_TINY = """
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2 --log-interval 1 --eval-iters 0
    --eval-interval 100000 --distributed-backend gloo
""".split()


def allreduce_bytes_per_rank_per_step(params_on_rank: int, dp: int) -> float:
    """Bytes one rank sends per step over the cross-replica data-parallel group in vanilla Megatron
    with the distributed optimizer and bf16: reduce-scatter of fp32 main grads ((dp-1)/dp x 4 B) and
    all-gather of bf16 params ((dp-1)/dp x 2 B) per parameter on the rank."""
    return (dp - 1) / dp * 6 * params_on_rank


def main() -> None:
    def flags(p):
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--pp", type=int, default=2)
        p.add_argument("--codec", default="int8")
        p.add_argument("--name", default="x8")
        p.add_argument("--small", action="store_true", help="a tiny model instead of ~1B (CPU smoke)")

    a, common = parse_bench_args(flags)
    model = MODEL_TINY if a.small else MODEL_1B
    layout = ["--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp)]
    H = a.local_steps
    dx = ["--diloco-x-replicas", "2", "--diloco-x-local-steps", str(H), "--diloco-x-warmup-iters", "0", "--diloco-x-overlap", "delayed",
          "--diloco-x-compression", a.codec, "--diloco-x-outer-lr", "0.5", "--diloco-x-outer-momentum", "0"]
    env = {"BENCH_CHECK_BOUNDARIES": "1"}
    vanilla, _ = run("vanilla", a.out, model + layout + common + ["--no-diloco-x"], a.nproc)
    dilocox, log = run("dilocox", a.out, model + layout + common + dx, a.nproc, extra_env=env)
    s = last_summary(log)
    v_inner = boundary_step_times(vanilla, H, False)
    d_inner = boundary_step_times(dilocox, H, False)
    d_bound = boundary_step_times(dilocox, H, True)
    per_rank = []
    for rv, rd in zip(sorted(vanilla, key=lambda r: r["rank"]), sorted(dilocox, key=lambda r: r["rank"])):
        entry = {"rank": rd["rank"], "params_on_rank": rd["params_on_rank"]}
        if rd.get("max_mem_bytes") is not None:
            entry.update(vanilla_peak_gb=rv["max_mem_bytes"] / 2**30, dilocox_peak_gb=rd["max_mem_bytes"] / 2**30,
                         peak_delta_bytes_per_param=(rd["max_mem_bytes"] - rv["max_mem_bytes"]) / rd["params_on_rank"])
        per_rank.append(entry)
    dp_total = 2  # vanilla: the two replicas' ranks form the data-parallel group (intra-replica DP 1)
    ar_bytes = statistics.mean(allreduce_bytes_per_rank_per_step(r["params_on_rank"], dp_total)
                               for r in dilocox) * a.iters
    boundary_ok = [ok for r in dilocox for _, ok in r.get("boundary_identical", [])]
    result = {
        "card": vanilla[0].get("device"),
        "gpus": a.nproc,
        "layout": f"2 replicas x TP {a.tp} x PP {a.pp} (each replica {a.nproc // 2} contiguous GPUs) vs vanilla "
                  f"DP 2 x TP {a.tp} x PP {a.pp}; {'fp32 (tiny CPU smoke model)' if a.small else 'bf16'}, "
                  f"distributed optimizer, codec {a.codec}, H={H}",
        # one replica's ranks hold the model once (TP/PP shards; layernorms replicated over TP)
        "params_per_replica": sum(r["params_on_rank"] for r in dilocox if r["rank"] < a.nproc // 2),
        "iterations": a.iters,
        "replicas_identical": bool(s.get("replicas_identical")) and bool(boundary_ok) and all(boundary_ok),
        "replicas_identical_after_every_boundary": {"boundaries_checked": len(boundary_ok) // max(1, a.nproc),
                                                    "all": all(boundary_ok) if boundary_ok else None},
        "step_time_ms": {"vanilla": 1e3 * statistics.median(v_inner), "dilocox": 1e3 * statistics.median(d_inner),
                         "dilocox_boundary": 1e3 * statistics.median(d_bound) if d_bound else None},
        "peak_mem_gb": {"vanilla": max(r.get("vanilla_peak_gb", 0) for r in per_rank) or None,
                        "dilocox": max(r.get("dilocox_peak_gb", 0) for r in per_rank) or None},
        "memory_per_rank": per_rank,
        "loss": {name: {"first": loss_at(recs, 1), "final": loss_at(recs, a.iters),
                        "curve": {it: loss_at(recs, it) for it in range(10, a.iters + 1, 10)}}
                 for name, recs in (("vanilla", vanilla), ("dilocox", dilocox))},
        "outer_bytes_per_rank": s.get("bytes_sent_per_rank"),
        "allreduce_bytes_per_rank_same_iterations": ar_bytes,
        "bytes_reduction_vs_allreduce": ar_bytes / s["bytes_sent_per_rank"] if s.get("bytes_sent_per_rank") else None,
        "summary": s,
    }
    (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("loss", "memory_per_rank")}, indent=2))


if __name__ == "__main__":
    main()
