"""Two sites of different parallel layouts as separate jobs (``--diloco-x-exchange-chunks``): whether they stay
bit-identical, and what the exchange by name costs each site per boundary; writes the JSON given by ``--out``.

    python benchmarks/federation/layouts.py --out /tmp/layouts.json                 # CPU: the demo model, gloo
    python benchmarks/federation/layouts.py --gpus 2 --model 85M --out JSON         # 2 GPUs, NCCL inside each site

Site A: one rank at TP 1 (GPU 0); site B: two ranks at TP 2 (GPUs 0 and 1: on a machine of 2 GPUs its rank 0
shares GPU 0 with A, as separate jobs may). Both start together, so at the first meeting one takes the other's
outer state (their layouts initialize different weights); a real ``torchft_lighthouse``; the package's defaults
(partial overlap, int4, auto tau, the auto warm-up); G = 2 chunks (A's rank holds both, each of B's ranks one);
the padded vocabulary alike (``--make-vocab-size-divisible-by`` 256 at TP 1, 128 at TP 2).

Figures: theta chunk by chunk at every boundary both recorded, and x at the end (pulled from the main shards),
equal or not; the heals; per site, the pull (main shards -> chunks) and push (chunks -> main shards) per
boundary in ms (device-synchronized, mean over its ranks and calls) against its round's wall time; the
validation loss each job prints after training, and the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.federation.heterogeneous import MODELS, _val_loss  # noqa: E402
from harness.federation import Job, Lighthouse  # noqa: E402

CHUNKS = 2


def _sites(gpus: int) -> dict[str, tuple[int, list[str], str]]:
    """name -> (ranks, flags, CUDA_VISIBLE_DEVICES)."""
    return {"A": (1, ["--tensor-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256"], "0"),
            "B": (2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128"],
                  ",".join(str(i % max(gpus, 1)) for i in range(2)))}


def _chunks(job: Job) -> dict[int, list]:
    """step -> theta's fingerprint chunk by chunk (the job's ranks in order), where every rank recorded it."""
    at = [{r[0]: r[1] for r in rec["fed_rounds"]} for rec in job.records()]
    return {s: [x for fps in at for x in fps[s]] for s in set(at[0]).intersection(*at[1:])}


def run(work: Path, model: str, iters: int, gpus: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    flags, seq, h, lr_warmup, gbs = MODELS[model]
    common = ["--diloco-x-replicas", "2", "--pipeline-model-parallel-size", "1", "--log-interval", "10",
              "--diloco-x-outer-timeout-minutes", "1", "--global-batch-size", str(gbs), "--train-iters", str(iters),
              "--diloco-x-local-steps", str(h), "--lr-warmup-iters", str(lr_warmup),
              "--diloco-x-exchange-chunks", str(CHUNKS)]
    started = time.time()
    with Lighthouse(work / "lighthouse.txt", min_replicas=2) as lh:
        jobs = {}
        for i, (name, (ranks, own, devices)) in enumerate(_sites(gpus).items()):
            # (Megatron's tensor parallelism on GPUs needs one connection per device: its own check)
            env = {"CUDA_VISIBLE_DEVICES": devices, "CUDA_DEVICE_MAX_CONNECTIONS": "1"} if gpus else {
                "OMP_NUM_THREADS": "1"}
            jobs[name] = Job(work / name, name, i, lh.address, [*common, *own], nproc=ranks, model=flags,
                             run="layouts", env=env, torchrun=bool(gpus))
        try:  # a job that fails ends the run at once (the other would wait for it at its first meeting)
            while any(job.proc.poll() is None for job in jobs.values()):
                failed = [job for job in jobs.values() if job.proc.poll() not in (None, 0)]
                assert not failed, f"job {failed[0].name} failed:\n{failed[0].log()[-4000:]}"
                time.sleep(1)
            for job in jobs.values():
                assert job.wait(60) == 0, job.log()[-4000:]
        finally:
            for job in jobs.values():
                job.close()
    out: dict = {"model": model, "iters": iters, "chunks": CHUNKS, "wall_s": time.time() - started, "sites": {}}
    for name, job in jobs.items():
        recs = job.records()
        rounds = recs[0]["fed_rounds"]
        steady = [r for r in rounds if r[0] > iters // 2]
        round_s = (steady[-1][5] - steady[0][5]) / max(len(steady) - 1, 1)
        per_call = {k: sum(r["by_name_s"][k][1] / r["by_name_s"][k][0] for r in recs) / len(recs) * 1e3
                    for k in ("pull", "push")}
        out["sites"][name] = {
            "ranks": job.nproc, "flags": _sites(gpus)[name][1], "heals": job.summary()["federation"]["heals"],
            "boundaries": len(rounds), "pull_ms": per_call["pull"], "push_ms": per_call["push"],
            "pulls_per_rank": recs[0]["by_name_s"]["pull"][0], "round_s": round_s,
            "step_s": round_s / h, "val_loss": _val_loss(job.log()),
            "final_loss": [v["lm loss"] for rec in recs for _, v in rec["losses"] if "lm loss" in v][-1]}
    ta, tb = _chunks(jobs["A"]), _chunks(jobs["B"])
    shared = sorted(set(ta) & set(tb))
    out["boundaries_together"] = len(shared)
    out["identical_at_every_boundary"] = bool(shared) and all(ta[s] == tb[s] for s in shared)
    ends = [[c for r in job.records() for c in r["final_fp"]["chunks"]] for job in jobs.values()]
    out["identical_at_end"] = ends[0] == ends[1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="2: site A on GPU 0, site B on GPUs 0 and 1; 0: the CPU")
    p.add_argument("--model", choices=sorted(MODELS), default="demo")
    p.add_argument("--iters", type=int, default=None, help="default: 10 x H")
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "layouts")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.gpus not in (0, 2):
        p.error("--gpus: 2 (site A on GPU 0, site B on GPUs 0 and 1) or 0 (the CPU)")
    result = run(a.work, a.model, a.iters or 10 * MODELS[a.model][2], a.gpus)
    if a.gpus:
        import torch

        result["card"] = torch.cuda.get_device_name(0)
    else:
        result["card"] = "cpu (gloo)"
    result["commit"] = os.environ.get("DILOCO_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
