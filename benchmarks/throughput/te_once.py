"""Transformer Engine once: the example with DiLoCoX on, ``--transformer-impl transformer_engine`` (Megatron's
TE layer spec) beside ``--transformer-impl local``, bf16, one GPU, mock data, 85M (12 x 768, 12 heads),
sequence 512, micro-batch = global batch = ``--mbs``.

Runs (``--runs``, in order; names):

* ``te_dx``: TE layers, DiLoCoX with one replica in one world (``--diloco-x-replicas 1``);
* ``local_dx``: the same with the local spec;
* ``te_dx_r2``: TE layers, two replicas as two single-rank worlds on the one GPU joined through
  ``--diloco-x-outer-store`` (the exchange with TE parameters; they share the GPU, so no speed figure);
* ``te_nodx``: TE layers, ``--no-diloco-x`` (Megatron alone);

DiLoCoX at the package's defaults with the demo's ``--diloco-x-local-steps 16``. Prints per run: ok, losses at
a few iterations, median step ms (harness ``timers``: device-synchronized ``train_step``, iterations past
``--skip``), tokens/s, plugin ms per step; writes ``OUT/te_once.json``.

    python benchmarks/throughput/te_once.py --out DIR [--runs te_dx,local_dx,te_dx_r2] [--iters 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.runner import HARNESS, Command, Job, done, free_port, harness_args, run_jobs, torchrun  # noqa: E402

WRAPPER = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt_diloco.py"
RECORD = ["timers", "losses", "rounds"]


def model_args(a: argparse.Namespace, impl: str) -> list[str]:
    return ["--transformer-impl", impl, "--mock-data", "--bf16", "--distributed-backend", "nccl",
            "--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-attention-heads", "12",
            "--seq-length", "512", "--max-position-embeddings", "512", "--pipeline-model-parallel-size", "1",
            "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.mbs), "--train-iters", str(a.iters),
            "--lr-warmup-iters", "5", "--lr-decay-iters", "1000", "--log-interval", "5",
            "--eval-iters", "0", "--eval-interval", "100000"]


def jobs(a: argparse.Namespace) -> list[Job]:
    out = []
    for name in a.runs.split(","):
        impl = "local" if name.startswith("local") else "transformer_engine"
        args = model_args(a, impl)
        if name.endswith("_r2"):
            world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1"}
            store = ["--diloco-x-replicas", "2", "--diloco-x-outer-store", f"127.0.0.1:{free_port()}"]
            cmds = [Command([sys.executable, str(HARNESS), "--script", str(WRAPPER),
                             *harness_args(a.out / name / f"replica{r}", RECORD, fast_exit=True), *args, *store,
                             "--diloco-x-replica-index", str(r),
                             "--data-cache-path", str(a.out / name / f"cache{r}")],
                            env={**world, "MASTER_PORT": str(free_port())}, log=f"replica{r}.log")
                    for r in range(2)]
        else:
            args += ["--no-diloco-x"] if name.endswith("nodx") else ["--diloco-x-replicas", "1"]
            cmds = [Command([*torchrun(1), str(HARNESS), "--script", str(WRAPPER),
                             *harness_args(a.out / name, RECORD, fast_exit=True), *args,
                             "--data-cache-path", str(a.out / name / "cache")])]
        out.append(Job(name, cmds, gpus=1, env={"OMP_NUM_THREADS": "1"}, estimate_s=60, timeout_s=a.timeout_s,
                       fingerprint={"args": args, "name": name}))
    return out


def analyze(a: argparse.Namespace, job: Job) -> dict:
    d = a.out / job.name
    info = done(a.out, job.name) or {}
    recs = sorted(d.rglob("rank*.json"))
    run = {"name": job.name, "ok": bool(info.get("ok")), "wall_s": info.get("wall_s"),
           "returncodes": info.get("returncodes")}
    if not recs:
        return run
    r = json.loads(recs[0].read_text())
    steps = r.get("iter_s", [])[a.skip:]
    if steps:
        step = statistics.median(steps)
        run.update(step_ms=1e3 * step, tokens_per_s=a.mbs * 512 / step,
                   step_ms_spread=[1e3 * min(steps), 1e3 * max(steps)])
    plugin = r.get("plugin_s") or []
    if plugin:
        run["plugin_ms_median"] = 1e3 * statistics.median(plugin)
    run.update(iters_done=len(r.get("iter_s", [])), losses=r.get("losses"), params=r.get("params_on_rank"),
               max_mem_gb=(r.get("max_mem_bytes") or 0) / 2**30, device=r.get("device"),
               completed=r.get("completed"), rounds=(r.get("rounds") or [])[:4])
    if len(recs) > 1:
        run["losses_replica1"] = json.loads(recs[1].read_text()).get("losses")
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", default="te_dx,local_dx,te_dx_r2")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--mbs", type=int, default=128)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--timeout-s", type=float, default=200)
    p.add_argument("--commit", default=None)
    a = p.parse_args()
    js = jobs(a)
    run_jobs(js, a.out, budget_s=a.budget_s, resume=False)
    runs = [analyze(a, j) for j in js]
    (a.out / "te_once.json").write_text(json.dumps({"commit": a.commit, "mbs": a.mbs, "seq": 512,
                                                    "iters": a.iters, "skip": a.skip, "runs": runs}, indent=1))
    print(f"\n{'run':10} {'ok':>3} {'step ms':>8} {'tokens/s':>9} {'plugin ms':>9} {'mem GB':>6}  losses")
    for r in runs:
        ls = r.get("losses") or {}
        few = {k: round(v, 3) for k, v in ls.items() if int(k) in (5, 10, 20, 40) or int(k) == a.iters}
        print(f"{r['name']:10} {str(r['ok'])[0]:>3} {r.get('step_ms', float('nan')):8.1f} "
              f"{r.get('tokens_per_s', float('nan')):9.0f} {r.get('plugin_ms_median', float('nan')):9.2f} "
              f"{r.get('max_mem_gb', float('nan')):6.1f}  {few}")


if __name__ == "__main__":
    main()
