"""Two sites of different speed as separate jobs (``--diloco-x-lighthouse``), on this CPU machine: how long
the fast site waits, and the run's tokens/s against the two sites' solo tokens/s summed; writes
``benchmarks/results/heterogeneous.json``.

    python benchmarks/federation/heterogeneous.py [--iters 160] [--balanced-batches 16,24] [--out JSON]

Each job is one replica of the demo model (the example's defaults, PP 1), one rank on one core
(``OMP_NUM_THREADS=1``; the machine's two cores, one per job), a real ``torchft_lighthouse``, the package's
defaults (partial overlap, int4, auto tau, the auto warm-up). Site B is the slow one: every one of its inner
steps sleeps as long as site A's step at its global batch takes alone (``DILOCO_TEST_STEP_SLEEP_S``, no
compute: the core stays free), so B runs at half A's speed at the same global batch.

Runs, one after the other:

* ``solo_A8``, ``solo_B8``, ``solo_A<k>``: each job alone (it meets only itself), global batch 8, or for A each
  of ``--balanced-batches`` (x the demo's sequence length in tokens per step): its solo step time and tokens/s.
* ``equal``: A and B at global batch 8 each, the same H (what the package runs when sites differ only in
  speed): the slowest sets the pace.
* ``balanced``: A at the global batch among ``--balanced-batches`` whose solo step is closest to B's (on this
  CPU a step's time grows slower than its batch), B at 8: the means weigh each by its tokens, and neither
  should wait.
* ``per_site_h``: A and B at global batch 8, A with twice B's H (32 to the demo's 16; its auto warm-up
  doubles with it, its ``--train-iters`` and ``--lr-warmup-iters`` doubled: the same rounds): A runs twice
  the inner steps per round, and neither should wait.

Figures per two-job run, over the steady boundaries (after the first two): a job's step time = wall time over
inner steps between its boundaries; ``fast_site_idle_fraction`` = 1 - A's solo step time (at its global batch)
/ its step time in the run (every wait: the meeting, the landing's commit, the exchange); the run's tokens/s =
sum over the jobs of tokens per step / step time; ``throughput_vs_solo_sum`` = that / the same jobs' solo
tokens/s summed; the final loss (mean of the last 20 logged) of each job and the tokens each trained on.
The runs train different token counts (A trains twice as many in ``balanced`` and ``per_site_h``): their
losses are not at equal tokens.
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

from harness.federation import Job, Lighthouse  # noqa: E402

ITERS = 160
SEQ = 256  # the demo's --seq-length
JOB_FLAGS = ["--diloco-x-replicas", "2", "--pipeline-model-parallel-size", "1", "--log-interval", "1",
             "--diloco-x-outer-timeout-minutes", "1"]


H, LR_WARMUP = 16, 30  # the demo's --diloco-x-local-steps and --lr-warmup-iters


def _run(tmp: Path, iters: int, sites: dict[str, tuple[int, float, int]]) -> dict[str, Job]:
    """Start the jobs of ``sites`` (name -> (global batch, seconds of sleep per step, H multiple m: rounds of m H
    over m x ``iters``)) on one lighthouse and wait for all of them; the jobs (their records and logs)."""
    shutil.rmtree(tmp, ignore_errors=True)
    with Lighthouse(tmp / "lighthouse.txt") as lh:
        jobs = {n: Job(tmp / n, n, "AB".index(n), lh.address,
                       [*JOB_FLAGS, "--global-batch-size", str(gbs), "--train-iters", str(m * iters),
                        "--diloco-x-local-steps", str(m * H), "--lr-warmup-iters", str(m * LR_WARMUP)],
                       model=[], run=f"heterogeneous-{tmp.name}", nproc=1,
                       env={"DILOCO_TEST_STEP_SLEEP_S": str(sleep)} if sleep else None)
                for n, (gbs, sleep, m) in sites.items()}
        try:
            for job in jobs.values():
                assert job.wait(3600) == 0, job.log()[-4000:]
        finally:
            for job in jobs.values():
                job.close()
    return jobs


def _step_s(job: Job, iters: int) -> float:
    """Wall seconds per inner step between the job's boundaries in the second half of the run (the auto warm-up
    takes at most the first half; rank 0's records)."""
    rounds = [r for r in job.records()[0]["fed_rounds"] if r[0] > iters // 2]
    return (rounds[-1][5] - rounds[0][5]) / (rounds[-1][0] - rounds[0][0])


def _final_loss(job: Job, last: int = 20) -> float:
    values = [v["lm loss"] for _, v in job.records()[0]["losses"] if "lm loss" in v][-last:]
    return sum(values) / len(values)


def _solo(tmp: Path, iters: int, name: str, gbs: int, sleep: float) -> dict:
    job = _run(tmp, iters, {name: (gbs, sleep, 1)})[name]
    step = _step_s(job, iters)
    return {"global_batch": gbs, "sleep_s": sleep, "step_s": step, "tokens_per_s": gbs * SEQ / step,
            "final_loss": _final_loss(job)}


def _together(tmp: Path, iters: int, sites: dict[str, tuple[int, float, int]], solo: dict[str, dict]) -> dict:
    jobs = _run(tmp, iters, sites)
    out: dict = {"sites": {}}
    for n, job in jobs.items():
        gbs, sleep, m = sites[n]
        rounds = job.records()[0]["fed_rounds"]
        step = _step_s(job, m * iters)
        out["sites"][n] = {"global_batch": gbs, "sleep_s": sleep, "local_steps": m * H, "iters": m * iters,
                           "step_s": step, "tokens_per_s": gbs * SEQ / step, "final_loss": _final_loss(job),
                           "tokens": gbs * SEQ * m * iters, "weight": rounds[-1][9] if len(rounds[-1]) > 9 else None,
                           "members_last": rounds[-1][2]}
    a = out["sites"]["A"]
    out["fast_site_idle_fraction"] = 1 - solo["A"]["step_s"] / a["step_s"]
    out["tokens_per_s"] = sum(s["tokens_per_s"] for s in out["sites"].values())
    out["solo_sum_tokens_per_s"] = sum(solo[n]["tokens_per_s"] for n in sites)
    out["throughput_vs_solo_sum"] = out["tokens_per_s"] / out["solo_sum_tokens_per_s"]
    # theta after the same committed rounds, at every boundary both met at (by rounds, not steps: a job of m H
    # records m x the steps; and a job whose warm-up exchanges block has landed one round more at a boundary
    # than one whose exchanges overlap a step)
    a_fp, b_fp = ({r[4]: r[1] for r in job.records()[0]["fed_rounds"] if r[2] == 2} for job in jobs.values())
    common = set(a_fp) & set(b_fp)
    out["boundaries_together"] = len(common)
    out["identical_at_every_boundary"] = bool(common) and all(a_fp[s] == b_fp[s] for s in common)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--balanced-batches", default="16,24", help="A's global batches to balance B with (solo runs)")
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "heterogeneous")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "heterogeneous.json")
    a = p.parse_args()
    commit = os.environ.get("DILOCO_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    started = time.time()
    solo: dict = {}
    runs: dict = {}

    def write() -> dict:  # after every run: a failure later keeps what was measured
        result = {"machine": "CPU, 2 cores (one per job), gloo over loopback", "commit": commit, "iters": a.iters,
                  "model": "the demo (examples/pretrain_gpt_diloco.py defaults), PP 1, one rank per job",
                  "slow_site": f"B sleeps {solo['A8']['step_s']:.4f} s per step (A's solo step at global batch 8)"
                  if "A8" in solo else None,
                  "solo": solo, "runs": runs, "wall_s": time.time() - started,
                  "cpu": {name: {"fast_site_idle_fraction": r["fast_site_idle_fraction"],
                                 "throughput_vs_solo_sum": r["throughput_vs_solo_sum"]} for name, r in runs.items()}}
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    solo["A8"] = _solo(a.work / "solo_A8", a.iters, "A", 8, 0.0)
    sleep = solo["A8"]["step_s"]  # B: half A's speed at the same global batch
    solo["B8"] = _solo(a.work / "solo_B8", a.iters, "B", 8, sleep)
    write()
    runs["per_site_h"] = _together(a.work / "per_site_h", a.iters, {"A": (8, 0.0, 2), "B": (8, sleep, 1)},
                                   {"A": solo["A8"], "B": solo["B8"]})
    write()
    runs["equal"] = _together(a.work / "equal", a.iters, {"A": (8, 0.0, 1), "B": (8, sleep, 1)},
                              {"A": solo["A8"], "B": solo["B8"]})
    write()
    for gbs in map(int, a.balanced_batches.split(",")):
        solo[f"A{gbs}"] = _solo(a.work / f"solo_A{gbs}", a.iters, "A", gbs, 0.0)
    best = min((int(k[1:]) for k in solo if k.startswith("A") and k != "A8"),
               key=lambda g: abs(solo[f"A{g}"]["step_s"] - solo["B8"]["step_s"]))
    runs["balanced"] = _together(a.work / "balanced", a.iters, {"A": (best, 0.0, 1), "B": (8, sleep, 1)},
                                 {"A": solo[f"A{best}"], "B": solo["B8"]})
    result = write()
    print(json.dumps(result["cpu"], indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
