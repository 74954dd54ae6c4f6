"""Two sites of different data-parallel size on GPUs (``--diloco-x-exchange-slots``): site A on 2 GPUs (DP 2),
site B on 1 (DP 1), separate jobs joined by a real ``torchft_lighthouse``; whether B's one rank, which holds both
exchange slots, holds each slot's theta bit for bit as A's rank of that slot does at every boundary, the weights,
and each site's step time. Writes ``--out`` (JSON).

    python benchmarks/federation/sites_dp.py --out sites_dp_gpu.json [--iters 300] [--gpu-b 2]

The 85M GPT of ``heterogeneous.py`` (12 x 768, sequence 512, bf16, SDPA attention), 64 sequences per GPU per
step (A's global batch 128, B's 64), H 30, the package's defaults otherwise (partial overlap, int4 with its fused
kernels, auto tau, the auto warm-up). On a machine of 2 GPUs B shares GPU 1 with A's second rank (``--gpu-b 1``,
the default): the step times then include that sharing; give ``--gpu-b 2`` where a third GPU exists.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.federation.heterogeneous import JOB_FLAGS, MODELS, _val_loss  # noqa: E402
from harness.federation import Job, Lighthouse  # noqa: E402


def _boundaries(job: Job) -> list[dict[int, list]]:
    """Per rank of ``job``: step -> its ``fed_rounds`` row (theta's fingerprint per slot, members, ..., weight)."""
    return [{r[0]: r for r in rec["fed_rounds"]} for rec in job.records()]


def _step_s(rows: dict[int, list]) -> float | None:
    """Wall seconds per inner step between the boundaries of the second half of the run."""
    steps = sorted(rows)
    half = steps[len(steps) // 2:]
    if len(half) < 2:
        return None
    return (rows[half[-1]][5] - rows[half[0]][5]) / (half[-1] - half[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--gpu-b", type=int, default=1, help="site B's GPU (A has GPUs 0 and 1)")
    p.add_argument("--tmp", type=Path, default=Path("/tmp/sites_dp"))
    p.add_argument("--model", choices=sorted(MODELS), default="85M", help="demo: the example's model (a CPU check)")
    p.add_argument("--outer-state", choices=("device", "host"), default="device",
                   help="--diloco-x-outer-state of both sites (host: the outer state streamed through the GPU)")
    a = p.parse_args()
    import torch

    model, _, h, lr_warmup, gbs = MODELS[a.model]
    base = [*JOB_FLAGS, "--train-iters", str(a.iters), "--diloco-x-local-steps", str(h), "--lr-warmup-iters",
            str(lr_warmup), "--diloco-x-exchange-slots", "2", "--diloco-x-outer-state", a.outer_state]
    sites = {"A": (2, "0,1", 2 * gbs), "B": (1, str(a.gpu_b), gbs)}  # (ranks, GPUs, global batch)
    jobs = {}
    with Lighthouse(a.tmp / "lighthouse.txt") as lh:
        try:
            for i, (name, (n, gpus, batch)) in enumerate(sites.items()):
                jobs[name] = Job(a.tmp / name, name, i, lh.address, [*base, "--global-batch-size", str(batch)],
                                 model=model, run="sites-dp", nproc=n, torchrun=True,
                                 env={"CUDA_VISIBLE_DEVICES": gpus} if torch.cuda.is_available() else None)
            for job in jobs.values():
                assert job.wait(3600) == 0, job.log()[-4000:]
        finally:
            for job in jobs.values():
                job.close()
    a_ranks, (b,) = _boundaries(jobs["A"]), _boundaries(jobs["B"])
    steps = sorted(set(a_ranks[0]) & set(a_ranks[1]) & set(b))
    same = [s for s in steps if [*a_ranks[0][s][1], *a_ranks[1][s][1]] == b[s][1]]
    commit = os.environ.get("DILOCO_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    cuda = torch.cuda.is_available()
    out = {"card": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)", "gpus": torch.cuda.device_count(),
           "commit": commit, "iters": a.iters, "H": h, "model": a.model, "exchange_slots": 2,
           "outer_state": a.outer_state,
           "b_shares_a_gpu": cuda and a.gpu_b in (0, 1),
           "sites": {name: {"ranks": n, "gpus": gpus, "global_batch": batch,
                            "step_s": _step_s(_boundaries(jobs[name])[0]),
                            "weights": sorted({r[9] for r in _boundaries(jobs[name])[0].values() if r[9] is not None}),
                            "val_loss": _val_loss(jobs[name].log())}
                     for name, (n, gpus, batch) in sites.items()},
           "boundaries": len(steps), "boundaries_identical_per_slot": len(same),
           "first_differing": next(([s, a_ranks[0][s][1], a_ranks[1][s][1], b[s][1]] for s in steps if s not in same),
                                   None)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
