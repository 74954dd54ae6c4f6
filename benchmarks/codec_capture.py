"""Capture real DiLoCoX pseudo-gradients from ``examples/pretrain_gpt_diloco.py`` (for ``codecs_bench.py``).

    python benchmarks/codec_capture.py [--out .cache/pseudograds] [--rounds 1,4] [--nproc 4] \\
        -- --train-iters 64 --diloco-x-local-steps 16 --diloco-x-overlap none

Launches the example under ``torchrun`` (CPU/gloo, ``OMP_NUM_THREADS=1``) with instrumentation that,
for every outer round k in ``--rounds``, records on each rank the per-parameter pseudo-gradient

    delta = (params at the start of round k) - (params at the end of round k)

with full parameter shapes (the model's ``named_parameters`` on the rank; with PP 2 and one rank per
replica stage each rank holds its stage's full parameters):

* round start: right before the first inner ``step()`` of the round, i.e. right after the previous
  boundary's ``DiLoCoXOptimizer.step`` returned (x == theta; for round 1 the initial params);
* round end: right before ``OuterSync.boundary`` runs at the end of the round.

Writes ``OUT/round{k}_replica{r}_stage{s}.pt`` = ``{"delta": {name: fp32 tensor}, "meta": {...}}``
(``meta``: round, iterations, rank, replica, stage, the boundary's own shard pseudo-gradient norm as a
cross-check), ``OUT/meta.json`` and the run's log ``OUT/run.log``. Replica 0 always saves; the other
replicas too unless ``--replica0-only``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from megatron_diloco.summary import PREFIX as SUMMARY_PREFIX, parse_summaries  # noqa: E402
WORKER_ENV = "CODEC_CAPTURE_WORKER"


# --------------------------------------------------------------------------- worker (one per rank)
def _named_params(opt) -> dict:
    """{name: param} of every model chunk the DiLoCoX optimizer's inner optimizers update."""
    out = {}
    seen = set()
    for d in opt.dist_opts:
        for ci, chunk in enumerate(d.model_chunks):
            for name, p in chunk.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = name.removeprefix("module.")
                out[name if len(d.model_chunks) == 1 else f"chunk{ci}.{name}"] = p
    return out


def _snapshot(opt) -> dict:
    import torch

    return {n: p.detach().to(torch.float32, copy=True).cpu() for n, p in _named_params(opt).items()}


def instrument(out: Path, rounds: set[int], replica0_only: bool) -> None:
    import torch
    import torch.distributed as dist
    from megatron_diloco.optimizer import DiLoCoXOptimizer
    from megatron_diloco.sync import OuterSync

    owner: dict[int, DiLoCoXOptimizer] = {}  # id(OuterSync) -> its optimizer
    starts: dict[int, dict] = {}  # round -> snapshot at the round start
    orig_step, orig_boundary = DiLoCoXOptimizer.step, OuterSync.boundary

    def saving(opt) -> bool:
        return not replica0_only or opt.topology.replica_index == 0

    def step(self):
        owner[id(self.sync)] = self
        H = self.diloco_config.local_steps
        if self.step_calls % H == 0:  # first inner step of round k: params = round start
            k = self.step_calls // H + 1
            if k in rounds and saving(self):
                starts[k] = _snapshot(self)
        return orig_step(self)

    def boundary(self):
        opt = owner.get(id(self))
        k = self.rounds + 1  # the boundary about to run ends round k
        delta = None
        if opt is not None and k in starts:
            end = _snapshot(opt)
            delta = {n: starts[k][n] - end[n] for n in end}  # start - end, fp32, full shapes
            del starts[k]
        t0 = time.perf_counter()
        report = orig_boundary(self)
        if delta is not None:
            from megatron.core import parallel_state as ps

            sq = sum(float(v.double().square().sum()) for v in delta.values())
            meta = {
                "round": k,
                "iterations": [(k - 1) * opt.diloco_config.local_steps + 1, k * opt.diloco_config.local_steps],
                "rank": dist.get_rank(),
                "replica": opt.topology.replica_index,
                "stage": ps.get_pipeline_model_parallel_rank(),
                "pp_size": ps.get_pipeline_model_parallel_world_size(),
                "numel": sum(v.numel() for v in delta.values()),
                "delta_norm": sq ** 0.5,
                # the boundary's own ||theta - x|| over this rank's fp32 main shard (cross-check)
                "boundary_shard_norm": float(report.pseudo_grad_sq) ** 0.5,
                "boundary_s": time.perf_counter() - t0,
            }
            name = f"round{k}_replica{meta['replica']}_stage{meta['stage']}.pt"
            torch.save({"delta": delta, "meta": meta}, out / name)
            print(f"[codec_capture] rank {meta['rank']}: saved {name}: {len(delta)} tensors, "
                  f"{meta['numel']} elements, ||delta|| {meta['delta_norm']:.6g} "
                  f"(boundary shard norm {meta['boundary_shard_norm']:.6g})", flush=True)
        return report

    DiLoCoXOptimizer.step = step
    OuterSync.boundary = boundary


def worker() -> None:
    out = Path(os.environ["CODEC_CAPTURE_OUT"])
    rounds = {int(r) for r in os.environ["CODEC_CAPTURE_ROUNDS"].split(",") if r}
    replica0_only = os.environ.get("CODEC_CAPTURE_REPLICA0_ONLY") == "1"
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "examples"))
    from megatron_diloco import compat
    from megatron_diloco.harness import run_script

    compat.apply_all()
    instrument(out, rounds, replica0_only)
    run_script(sys.argv[1:])  # the captures are written by the instrumentation, no rank record


# --------------------------------------------------------------------------- launcher
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / ".cache" / "pseudograds")
    p.add_argument("--rounds", default="1,4", help="comma-separated 1-based outer rounds to capture")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--replica0-only", action="store_true")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="flags for the example (after --)")
    a = p.parse_args()
    extra = [x for x in a.extra if x != "--"] or \
        "--train-iters 64 --diloco-x-local-steps 16 --diloco-x-overlap none".split()
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("round*_replica*_stage*.pt"):
        old.unlink()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               **{WORKER_ENV: "1", "CODEC_CAPTURE_OUT": str(a.out.resolve()), "CODEC_CAPTURE_ROUNDS": a.rounds,
                  "CODEC_CAPTURE_REPLICA0_ONLY": "1" if a.replica0_only else "0"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(Path(__file__).resolve()), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    (a.out / "run.log").write_text(proc.stdout)
    for line in proc.stdout.splitlines():
        if line.startswith("[codec_capture]") or SUMMARY_PREFIX in line or "[DiLoCoX] round" in line:
            print(line)
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        raise SystemExit(f"capture run failed ({proc.returncode}); log: {a.out / 'run.log'}")
    files = sorted(f.name for f in a.out.glob("round*_replica*_stage*.pt"))
    summary = parse_summaries(proc.stdout)
    meta = {"command": " ".join(["python", "benchmarks/codec_capture.py", "--rounds", a.rounds, "--",
                                 *extra]),
            "example_flags": extra, "rounds": [int(r) for r in a.rounds.split(",")], "nproc": a.nproc,
            "files": files, "wall_s": round(wall, 1),
            "summary": summary[-1] if summary else None}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"[codec_capture] {len(files)} files in {a.out} ({wall:.0f} s)")


if __name__ == "__main__":
    if os.environ.get(WORKER_ENV) == "1" and "LOCAL_RANK" in os.environ:
        worker()
    else:
        main()
