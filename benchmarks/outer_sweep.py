"""Outer-optimizer sweep on the GPU smoke model: final loss per (overlap, eta, mu), side by side.

    python benchmarks/outer_sweep.py --out DIR [--iters 200] [--local-steps 20]

Each configuration is one run of the example (4 GPUs, 2 replicas x PP 2, bf16); the vanilla
data-parallel run of the same script is the reference. Writes ``DIR/outer_sweep.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.gpu_bench import parse_bench_args, run  # noqa: E402
from common.runner import last_summary as summary_of  # noqa: E402

CONFIGS = [  # (overlap, eta, mu)
    ("delayed", 1.0, 0.0), ("delayed", 0.7, 0.5), ("delayed", 0.5, 0.0), ("delayed", 0.5, 0.8),
    ("none", 1.0, 0.0),
]


def main() -> None:
    a, common = parse_bench_args(lambda p: p.add_argument(
        "--vanilla", action="store_true", help="also run the vanilla reference"))

    def final_and_curve(recs):
        it_losses = {}
        for r in recs:
            for it, v in r["losses"].items():
                it_losses.setdefault(int(it), []).append(v)
        mean = {it: sum(v) / len(v) for it, v in sorted(it_losses.items())}
        last = sorted(mean)[-10:]
        return sum(mean[i] for i in last) / len(last), {it: mean[it] for it in mean if it % 10 == 0}

    results = []
    if a.vanilla:
        recs, _ = run("vanilla", a.out, common + ["--no-diloco-x"], a.nproc)
        f, c = final_and_curve(recs)
        results.append({"method": "vanilla", "final_loss_last10": f, "curve": c})
    for overlap, eta, mu in CONFIGS:
        name = f"{overlap}_eta{eta}_mu{mu}"
        recs, log = run(name, a.out, common + [
            "--diloco-x-replicas", "2", "--diloco-x-local-steps", str(a.local_steps),
            "--diloco-x-overlap", overlap, "--diloco-x-outer-lr", str(eta),
            "--diloco-x-outer-momentum", str(mu)], a.nproc)
        f, c = final_and_curve(recs)
        results.append({"method": name, "overlap": overlap, "outer_lr": eta, "outer_momentum": mu,
                        "final_loss_last10": f, "curve": c,
                        "replicas_identical": summary_of(log).get("replicas_identical")})
        print(name, f, flush=True)
    (a.out / "outer_sweep.json").write_text(json.dumps({"card": recs[0].get("device"), "iters": a.iters,
                                                         "local_steps": a.local_steps, "runs": results},
                                                        indent=1))
    for r in results:
        print(f"{r['method']:28s} final(last10) {r['final_loss_last10']:.4f}")


if __name__ == "__main__":
    main()
