"""Two sites of different speed as separate jobs (``--diloco-x-lighthouse``): how long the fast site
waits, and the run's tokens/s against the two sites' solo tokens/s summed; writes
``benchmarks/results/heterogeneous.json`` (CPU) or the file given by ``--out`` (GPU).

    python benchmarks/federation/heterogeneous.py [--iters 160] [--balanced-batches 16,24] [--out JSON]
    python benchmarks/federation/heterogeneous.py --gpus 2 --model 85M --out JSON   # a GPU per site
    python benchmarks/federation/heterogeneous.py --runs paced --b-sleep S ...      # those runs and their references

CPU (the default): each job is one replica of the demo model (the example's defaults, PP 1), one rank on one
core (``OMP_NUM_THREADS=1``; the machine's two cores, one per job). ``--gpus N``: each job one rank on a GPU
of its own (site A GPU 0, B GPU 1); ``--model 85M``: 12 x 768, sequence 512, bf16, torch's SDPA
attention, H 30 (else the demo's model, H 16). Both: a real ``torchft_lighthouse``, the package's defaults
(partial overlap, int4, auto tau, the auto warm-up). Site B is the slow one: every one of its inner steps
sleeps as long as site A's step at its global batch takes alone (``DILOCO_TEST_STEP_SLEEP_S``, no compute:
the core or GPU stays free), so B runs at half A's speed at the same global batch.

Runs, one after the other (``--resume`` keeps those ``--out`` holds: a run longer than one device call):

* ``solo_A8``, ``solo_B8``, ``solo_A<k>``: each job alone (it meets only itself), the model's global batch
  (8 sequences for the demo: the keys name it), or for A each of ``--balanced-batches`` (CPU only): its solo
  step time and tokens/s. Also ``side_by_side`` (``side_by_side_A<k>`` for the balanced pair): A and B alone
  at the same time, each on its core or GPU. One machine holds both sites here, and a job's step is slower
  while the other computes too (the machine's share, not the run's): the two-job runs are measured against
  these; ``against_each_solo_alone`` gives them against the solos run one at a time.
* ``equal``: A and B at the same global batch, the same H (what the package runs when sites differ only in
  speed): the slowest sets the pace.
* ``balanced`` (CPU only): A at the global batch among ``--balanced-batches`` whose solo step is closest to
  B's (on this CPU a step's time grows slower than its batch), B at 8: the means weigh each by its tokens,
  and neither should wait.
* ``per_site_h``: A and B at the same global batch, A with twice B's H (its warm-up H0, ``--train-iters``
  and ``--lr-warmup-iters`` doubled: the same rounds): A runs twice the inner steps per round, and neither
  should wait.
* ``--site-weights normalized``: every two-job run with ``--diloco-x-site-weights normalized`` (the means weigh each
  job's pseudo-gradient per inner step, FedNova's normalized averaging) instead of by tokens alone.
* ``paced``: A and B with the same flags and ``--diloco-x-site-pace 4``: each job runs, in every round, the
  inner steps that fit the slowest job's round, from the step times measured at each boundary (A about twice
  B's); nothing to size by hand.
* GPUs only, for the loss at the same tokens as ``per_site_h`` (3 x iters x the global batch):
  ``equal_tokens``, A and B at the same H for 1.5 x iters each; ``allreduce``, ``--no-diloco-x`` data
  parallel over both GPUs at twice the global batch for 1.5 x iters (Megatron's AllReduce run).

Figures per two-job run, over the steady boundaries (after the first half): a job's step time = wall time
over inner steps between its boundaries; ``fast_site_idle_fraction`` = 1 - A's solo step time (at its global
batch, side by side) / its step time in the run (every wait: the meeting, the landing's commit, the exchange);
the run's tokens/s = sum over the jobs of tokens per step / step time; ``throughput_vs_solo_sum`` = that / the
same jobs' solo tokens/s summed (side by side); the final training loss (mean of the last 20 logged) of each
job, the validation loss after training (the example's own evaluation, each job on its own slot of the
validation set; the run's is their mean, the samples the AllReduce run evaluates), and the tokens each trained
on.
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
from harness.runner import VALIDATION_LINE, ExampleJob, run_jobs  # noqa: E402
from megatron_diloco.algorithm.config import SITE_WEIGHTS  # noqa: E402

ITERS = 160
JOB_FLAGS = ["--diloco-x-replicas", "2", "--pipeline-model-parallel-size", "1", "--log-interval", "1",
             "--diloco-x-outer-timeout-minutes", "1"]

#: name -> (model flags, sequence length, H, --lr-warmup-iters, global batch); "demo": the example's defaults
MODELS = {
    "demo": ([], 256, 16, 30, 8),
    "85M": (["--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-attention-heads", "12",
             "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "64", "--bf16",
             "--attention-sdpa", "--no-create-attention-mask-in-dataloader", "--lr", "1e-3", "--min-lr", "1e-4"],
            512, 30, 60, 64),
    # 302M: large enough that a TP-2 rank's pull and push take several all-to-alls (by_name.PIECE_ELEMENTS)
    "302M": (["--num-layers", "24", "--hidden-size", "1024", "--ffn-hidden-size", "4096", "--num-attention-heads",
              "16", "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "32", "--bf16",
              "--attention-sdpa", "--no-create-attention-mask-in-dataloader", "--lr", "1e-3", "--min-lr", "1e-4"],
             512, 30, 30, 32),
}
#: ``paced`` runs: --diloco-x-site-pace (a job's round at most this many times the run's)
PACE = 4
#: --gpus N: each job on GPU (its index mod N); 0: the CPU
GPUS = 0
MODEL = "demo"


def _model() -> tuple[list[str], int, int, int, int]:
    return MODELS[MODEL]


def _site_flags(gbs: int, iters: int, m: int) -> list[str]:
    """A job of m x the model's H over m x ``iters`` (its warm-up H0 and LR warm-up in proportion: the same
    rounds as a job of H); m = 0: the model's H and ``iters`` with ``--diloco-x-site-pace`` (:data:`PACE`), the job
    running the steps that fit the slowest one's rounds."""
    _, _, h, lr_warmup, _ = _model()
    if m == 0:
        return ["--global-batch-size", str(gbs), "--train-iters", str(iters), "--diloco-x-local-steps", str(h),
                "--lr-warmup-iters", str(lr_warmup), "--diloco-x-site-pace", str(PACE)]
    scaled = ["--diloco-x-warmup-local-steps", str(m * min(h // 3, 10))] if m > 1 else []
    return ["--global-batch-size", str(gbs), "--train-iters", str(m * iters), "--diloco-x-local-steps", str(m * h),
            "--lr-warmup-iters", str(m * lr_warmup), *scaled]


def _start(tmp: Path, iters: int, sites: dict[str, tuple[int, float, int]]) -> tuple[Lighthouse, dict[str, Job]]:
    """Start the jobs of ``sites`` (name -> (global batch, seconds of sleep per step, H multiple m: rounds of m H
    over m x ``iters``)) on a lighthouse of their own."""
    shutil.rmtree(tmp, ignore_errors=True)
    lh = Lighthouse(tmp / "lighthouse.txt")
    model = _model()[0]
    jobs = {}
    for n, (gbs, sleep, m) in sites.items():
        env = {"DILOCO_TEST_STEP_SLEEP_S": str(sleep)} if sleep else {}
        if GPUS:
            env["CUDA_VISIBLE_DEVICES"] = str("AB".index(n) % GPUS)
        jobs[n] = Job(tmp / n, n, "AB".index(n), lh.address, [*JOB_FLAGS, *_site_flags(gbs, iters, m)],
                      model=model, run=f"heterogeneous-{tmp.name}", nproc=1, env=env or None, torchrun=bool(GPUS))
    return lh, jobs


def _run_many(runs: list[tuple[Path, int, dict[str, tuple[int, float, int]]]]) -> list[dict[str, Job]]:
    """Start the runs (each (folder, iters, sites) as :func:`_start`, its own lighthouse) at once and wait for
    all their jobs; per run its jobs (records and logs)."""
    started = [_start(*r) for r in runs]
    try:
        for _, jobs in started:
            for job in jobs.values():
                assert job.wait(3600) == 0, job.log()[-4000:]
    finally:
        for lh, jobs in started:
            for job in jobs.values():
                job.close()
            lh.__exit__(None, None, None)
    return [jobs for _, jobs in started]


def _run(tmp: Path, iters: int, sites: dict[str, tuple[int, float, int]]) -> dict[str, Job]:
    """Run the jobs of ``sites`` (as :func:`_start`) and wait for all of them; the jobs (records and logs)."""
    return _run_many([(tmp, iters, sites)])[0]


def _val_loss(log: str) -> float | None:
    """The validation loss the example printed after training (the last one), or None."""
    found = [float(m[3]) for m in VALIDATION_LINE.finditer(log) if m[2]]
    return found[-1] if found else None


def _step_s(job: Job, iters: int) -> float:
    """Wall seconds per inner step between the job's boundaries in the second half of the run (the auto warm-up
    takes at most the first half; rank 0's records)."""
    rounds = [r for r in job.records()[0]["fed_rounds"] if r[0] > iters // 2]
    return (rounds[-1][5] - rounds[0][5]) / (rounds[-1][0] - rounds[0][0])


def _final_loss(job: Job, last: int = 20) -> float:
    values = [v["lm loss"] for _, v in job.records()[0]["losses"] if "lm loss" in v][-last:]
    return sum(values) / len(values)


def _solo_record(job: Job, iters: int, gbs: int, sleep: float) -> dict:
    step = _step_s(job, iters)
    return {"global_batch": gbs, "sleep_s": sleep, "step_s": step, "tokens_per_s": gbs * _model()[1] / step,
            "final_loss": _final_loss(job), "val_loss": _val_loss(job.log())}


def _solo(tmp: Path, iters: int, name: str, gbs: int, sleep: float) -> dict:
    return _solo_record(_run(tmp, iters, {name: (gbs, sleep, 1)})[name], iters, gbs, sleep)


def _solos_side_by_side(tmp: Path, iters: int, sites: dict[str, tuple[int, float]]) -> dict:
    """Each job of ``sites`` (name -> (global batch, sleep)) alone, all at once, each on its own GPU and
    lighthouse: the solo steps under the host's load of a two-site run (one host holds both sites here;
    apart, they would not share it)."""
    runs = _run_many([(tmp / n, iters, {n: (gbs, sleep, 1)}) for n, (gbs, sleep) in sites.items()])
    return {n: _solo_record(jobs[n], iters, *sites[n]) for n, jobs in zip(sites, runs)}


def _together(tmp: Path, iters: int, sites: dict[str, tuple[int, float, int]]) -> dict:
    """Run the two jobs of ``sites`` (as :func:`_start`) together: per job its step, tokens/s, losses, tokens and
    weight; the run's tokens/s, validation loss and identity at every shared boundary and at the end."""
    jobs = _run(tmp, iters, sites)
    seq = _model()[1]
    out: dict = {"sites": {}}
    for n, job in jobs.items():
        gbs, sleep, m = sites[n]
        rounds = job.records()[0]["fed_rounds"]
        own = job.records()[0]["final_fp"]["steps"] if m == 0 else m * iters  # (paced: the steps it ran)
        step = _step_s(job, own)
        out["sites"][n] = {"global_batch": gbs, "sleep_s": sleep, "iters": own, "step_s": step,
                           "local_steps": f"paced (at most {PACE} x {_model()[2]})" if m == 0 else m * _model()[2],
                           "tokens_per_s": gbs * seq / step, "final_loss": _final_loss(job),
                           "val_loss": _val_loss(job.log()), "tokens": gbs * seq * own,
                           "weight": rounds[-1][9] if len(rounds[-1]) > 9 else None, "members_last": rounds[-1][2]}
        if m == 0:  # each round's own steps (the paced H) and the job's weight
            out["sites"][n]["round_steps"] = [b[0] - a[0] for a, b in zip(rounds, rounds[1:])]
    out["tokens"] = sum(s["tokens"] for s in out["sites"].values())
    # each job evaluates its own slot of the validation set (as one replica of a data-parallel world would):
    # their mean covers the samples Megatron's AllReduce run evaluates
    vals = [s["val_loss"] for s in out["sites"].values()]
    out["val_loss"] = sum(vals) / len(vals) if None not in vals else None
    ends = [job.records()[0].get("final_fp", {}).get("main") for job in jobs.values()]
    out["identical_at_end"] = None not in ends and all(e == ends[0] for e in ends)
    out["tokens_per_s"] = sum(s["tokens_per_s"] for s in out["sites"].values())
    # theta after the same committed rounds, at every boundary both met at (by rounds, not steps: a job of m H
    # records m x the steps; and a job whose warm-up exchanges block has landed one round more at a boundary
    # than one whose exchanges overlap a step)
    a_fp, b_fp = ({r[4]: r[1] for r in job.records()[0]["fed_rounds"] if r[2] == 2} for job in jobs.values())
    common = set(a_fp) & set(b_fp)
    out["boundaries_together"] = len(common)
    out["identical_at_every_boundary"] = bool(common) and all(a_fp[s] == b_fp[s] for s in common)
    return out


def _figures(run: dict, solo: dict[str, dict]) -> None:
    """Set ``run``'s idle share of site A and its tokens/s against the solo sum, against ``solo`` (name -> its
    solo record)."""
    run["fast_site_idle_fraction"] = 1 - solo["A"]["step_s"] / run["sites"]["A"]["step_s"]
    run["solo_sum_tokens_per_s"] = sum(solo[n]["tokens_per_s"] for n in run["sites"])
    run["throughput_vs_solo_sum"] = run["tokens_per_s"] / run["solo_sum_tokens_per_s"]


def _allreduce(tmp: Path, iters: int, gbs: int) -> dict:
    """Megatron's data parallel run (``--no-diloco-x``) over ``GPUS`` GPUs, ``iters`` iterations of ``gbs``
    sequences, the model's flags and LR warm-up: its validation loss after training."""
    shutil.rmtree(tmp, ignore_errors=True)
    model, seq, _, lr_warmup, _ = _model()
    job = ExampleJob("allreduce", [*model, "--no-diloco-x", "--pipeline-model-parallel-size", "1", "--log-interval",
                                   "10", "--global-batch-size", str(gbs), "--train-iters", str(iters),
                                   "--lr-warmup-iters", str(lr_warmup)], nproc=GPUS, estimate_s=600)
    info = run_jobs([job], tmp, resume=False)["allreduce"]
    text = (tmp / "allreduce" / "log.txt").read_text(errors="replace")
    assert info.get("ok"), text[-4000:]
    return {"global_batch": gbs, "iters": iters, "tokens": gbs * seq * iters, "val_loss": _val_loss(text)}


def main() -> None:
    global GPUS, MODEL
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--balanced-batches", default="16,24", help="A's global batches to balance B with (CPU runs)")
    p.add_argument("--gpus", type=int, default=0, help="each job on a GPU of its own (2); 0: the CPU")
    p.add_argument("--model", choices=sorted(MODELS), default="demo")
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "heterogeneous")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "heterogeneous.json")
    p.add_argument("--resume", action="store_true", help="keep the runs --out holds and run the rest")
    p.add_argument("--runs", default="per_site_h,equal,paced,balanced",
                   help="the two-job runs to make, of per_site_h, equal, paced, balanced (CPU); the solos they are "
                        "measured against always")
    p.add_argument("--site-weights", choices=SITE_WEIGHTS, default=SITE_WEIGHTS[0],
                   help="--diloco-x-site-weights of every two-job run (the solos have one job: no weights)")
    p.add_argument("--seed", type=int, default=None, help="Megatron's --seed for every run (default: the example's)")
    p.add_argument("--loss-only", action="store_true",
                   help="the runs' losses only: no solos, so no idle or throughput figures (give --b-sleep)")
    p.add_argument("--b-sleep", type=float, default=None,
                   help="B's sleep per step in seconds (default: A's solo step, measured first)")
    a = p.parse_args()
    if a.gpus == 1:
        p.error("--gpus 1 would put both sites on one GPU: give each site its own (--gpus 2), or run on the CPU")
    GPUS, MODEL = a.gpus, a.model
    if a.site_weights != SITE_WEIGHTS[0]:
        JOB_FLAGS.extend(["--diloco-x-site-weights", a.site_weights])
    if a.seed is not None:  # (the model's flags: the two-job runs, the solos and AllReduce alike)
        MODELS[MODEL] = ([*MODELS[MODEL][0], "--seed", str(a.seed)], *MODELS[MODEL][1:])
    if a.loss_only and a.b_sleep is None:
        p.error("--loss-only runs no solo to measure B's sleep from: give --b-sleep")
    _, seq, h, _, gbs = _model()
    commit = os.environ.get("DILOCO_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    started = time.time()
    solo: dict = {}
    runs: dict = {}
    if GPUS:
        import torch

        machine = f"{GPUS} x {torch.cuda.get_device_name(0)}, one job per GPU, gloo over loopback"
    else:
        machine = "CPU, 2 cores (one per job), gloo over loopback"
    a_key, b_key = f"A{gbs}", f"B{gbs}"

    describe = (f"{MODEL} ({'the demo, ' if MODEL == 'demo' else ''}examples/pretrain_gpt_diloco.py), PP 1, one rank "
                f"per job, sequence {seq}, H {h}, global batch {gbs}"
                + ("" if a.site_weights == "tokens" else f", --diloco-x-site-weights {a.site_weights}")
                + ("" if a.seed is None else f", --seed {a.seed}"))

    def side_key(g: int) -> str:
        return "side_by_side" if g == gbs else f"side_by_side_A{g}"

    def reference(g: int) -> dict[str, dict]:
        """The solo records a two-job run with A at global batch ``g`` is measured against: both solos run side
        by side (the same load on the machine as the run: one machine holds both sites here); without them, each
        alone."""
        side = solo.get(side_key(g))
        return {n: side[n] for n in "AB"} if side else {"A": solo[f"A{g}"], "B": solo[b_key]}

    def write() -> dict:  # after every run: a failure later keeps what was measured
        for name, r in runs.items():
            if name in ("per_site_h", "equal", "balanced", "paced") and solo:
                g = r["sites"]["A"]["global_batch"]
                _figures(r, reference(g))
                if f"A{g}" in solo and b_key in solo:
                    alone = {"sites": r["sites"], "tokens_per_s": r["tokens_per_s"]}
                    _figures(alone, {"A": solo[f"A{g}"], "B": solo[b_key]})
                    r["against_each_solo_alone"] = {k: alone[k] for k in
                                                    ("fast_site_idle_fraction", "throughput_vs_solo_sum")}
        result = {"machine": machine, "commit": commit, "iters": a.iters, "model": describe,
                  "slow_site": f"B sleeps {sleep:.4f} s per step (A's solo step at global batch {gbs}"
                  f"{', measured before' if a.b_sleep else ''})" if sleep else None,
                  "solo": solo, "runs": runs, "wall_s": time.time() - started}
        result["gpu" if GPUS else "cpu"] = {
            name: {"fast_site_idle_fraction": r["fast_site_idle_fraction"],
                   "throughput_vs_solo_sum": r["throughput_vs_solo_sum"]}
            for name, r in runs.items() if "fast_site_idle_fraction" in r}
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    if a.resume and a.out.exists():  # a previous call's runs (same settings; each names its commit): go on
        before = json.loads(a.out.read_text())
        assert (before["iters"], before["model"]) == (a.iters, describe), \
            f"{a.out} holds runs of other settings: remove it or leave --resume out"
        solo, runs, started = before["solo"], before["runs"], started - before["wall_s"]

    def once(table: dict, key: str, fn, *args) -> None:
        if key not in table:
            table[key] = {**fn(*args), "commit": commit}
            write()

    chosen = a.runs.split(",")
    sleep = a.b_sleep
    if sleep is None:
        once(solo, a_key, _solo, a.work / f"solo_{a_key}", a.iters, "A", gbs, 0.0)
        sleep = solo[a_key]["step_s"]  # B: half A's speed at the same global batch
        once(solo, b_key, _solo, a.work / f"solo_{b_key}", a.iters, "B", gbs, sleep)
    if not a.loss_only:
        once(solo, side_key(gbs), _solos_side_by_side, a.work / "solo_side_by_side", a.iters,
             {"A": (gbs, 0.0), "B": (gbs, sleep)})
    for name, (ma, mb) in (("paced", (0, 0)), ("per_site_h", (2, 1)), ("equal", (1, 1))):  # (paced: the same flags)
        if name in chosen:
            once(runs, name, _together, a.work / name, a.iters, {"A": (gbs, 0.0, ma), "B": (gbs, sleep, mb)})
    if GPUS and "per_site_h" in chosen:  # the loss at per_site_h's tokens: the same H, and Megatron's AllReduce
        once(runs, "equal_tokens", _together, a.work / "equal_tokens", 3 * a.iters // 2,
             {"A": (gbs, 0.0, 1), "B": (gbs, 0.0, 1)})
        if GPUS > 1:
            once(runs, "allreduce", _allreduce, a.work / "allreduce", 3 * a.iters // 2, 2 * gbs)
    elif not GPUS and "balanced" in chosen:  # A at the global batch whose solo step is closest to B's
        for g in map(int, a.balanced_batches.split(",")):
            once(solo, f"A{g}", _solo, a.work / f"solo_A{g}", a.iters, "A", g, 0.0)
        best = min((int(k[1:]) for k in solo if k[0] == "A" and k[1:].isdigit() and k != a_key),
                   key=lambda g: abs(solo[f"A{g}"]["step_s"] - solo[b_key]["step_s"]))
        once(solo, side_key(best), _solos_side_by_side, a.work / f"solo_side_by_side_A{best}", a.iters,
             {"A": (best, 0.0), "B": (gbs, sleep)})
        once(runs, "balanced", _together, a.work / "balanced", a.iters, {"A": (best, 0.0, 1), "B": (gbs, sleep, 1)})
    result = write()
    print(json.dumps(result["gpu" if GPUS else "cpu"], indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
