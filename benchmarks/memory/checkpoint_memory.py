"""Peak host memory of a DiLoCoX ``torch_dist`` checkpoint save, per rank, on CPU gloo ranks.

    python benchmarks/memory/checkpoint_memory.py [--repo PATH] [--out FILE.json] [--hidden 512 --layers 8 ...]

Runs ``examples/pretrain_gpt_diloco.py`` of ``--repo`` (default: this checkout) under its harness
(``harness/run.py``) with the tests' ``checkpoint`` and ``training`` recorders
(``harness/recorders/checkpoint.py``, ``training.py``), one runner job (``torchrun``): 4 ranks = 2 DiLoCoX replicas x pipeline-parallel 2, a GPT
of ``--layers`` x ``--hidden`` (ffn 4 x hidden), Adam, delayed overlap with outer momentum, H = 4; it
trains ``--iters`` iterations (default 5, so an exchange is in flight: the full outer state is saved)
and saves once at the end (``--exit-interval``). The runner resets each rank's RSS high-water mark
(``/proc/self/clear_refs``) right before ``save_checkpoint`` and reads ``VmHWM`` after it returns:
``peak_delta`` = peak RSS during the save - RSS before it, i.e. what the save allocated at its worst
in the training process (ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``, see ``MMAP_THRESHOLD``; without
it glibc serves the save's blocks from memory freed earlier and the RSS peak undercounts). The
checkpoint writer's worker processes (Megatron forks them to write the
files) are not included. Also reported: the rank's fp32 main-shard elements N, the model's parameter
count (a replica's N summed over its ranks), and the checkpoint's bytes on disk per parameter.

``--plain`` runs the same job as plain Megatron data parallelism (4 ranks = PP 2 x DP 2) for Megatron's
own save cost.

To compare with another version, point ``--repo`` at a worktree of it; it must have the harness and
the tests' recorders (``harness/run.py``, or before it ``benchmarks/common/harness.py`` with
``tests/recorders.py``; commits before those had ``tests/checkpoint_runner.py`` instead: measure them
with that commit's own ``benchmarks/checkpoint_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))  # run from a checkout, uninstalled
from harness.runner import Command, Job, harness_command, load_ranks, run_job, torchrun  # noqa: E402

#: The tests' recorders this measurement reads (``harness/recorders/``), in install order.
RECORDERS = ["checkpoint", "training"]
#: Where a checkout keeps the harness and how it names these recorders: this layout, then the one before
#: ``harness/`` (``benchmarks/common/harness.py`` and ``tests/recorders.py``), for ``--repo``.
LAYOUTS = ((Path("harness/run.py"), Path("harness/recorders"), RECORDERS),
           (Path("benchmarks/common/harness.py"), Path("tests/recorders.py"), [f"tests.recorders:{n}" for n in RECORDERS]))
#: glibc: blocks of at least this many bytes are mmap'd and unmapped when freed. Fixing it (glibc
#: otherwise raises it to the largest block freed so far) keeps memory freed before the save (e.g.
#: the last iteration's activations) from being silently reused by the save's allocations: the RSS
#: peak then counts what the save allocates rather than only what exceeds the allocator's free pool.
MMAP_THRESHOLD = 1 << 16


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(repo: Path, hidden: int, layers: int, iters: int, work: Path, plain: bool = False) -> dict:
    found = [(repo / h, names) for h, recorders, names in LAYOUTS if (repo / h).exists() and (repo / recorders).exists()]
    if not found:
        raise SystemExit(f"{repo} has no harness / tests' recorders (see the module docstring)")
    harness, recorders = found[0]
    out, ckpt = work / "run", work / "ckpt"
    args = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(4 * hidden),
            "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", "100000", "--lr-warmup-iters", "2",
            "--train-iters", str(iters + 10), "--exit-interval", str(iters), "--save", str(ckpt),
            "--save-interval", "100000", "--diloco-x-local-steps", "4", "--diloco-x-warmup-iters", "0", "--diloco-x-overlap", "delayed",
            "--diloco-x-outer-momentum", "0.9"] + (["--no-diloco-x"] if plain else [])
    env = {"CUDA_VISIBLE_DEVICES": "", "DILOCO_CKPT_OBJECT_SIZES": "0",
           "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    cmd = Command(harness_command(recorders, out, args, torchrun(4), harness=harness), cwd=repo)
    start = time.time()
    info = run_job(Job(out.name, [cmd], env=env, timeout_s=math.inf), work)
    if not info.get("ok"):
        raise SystemExit(f"run failed (exit {info.get('returncode')}); log: {out / 'log.txt'}")
    recs = load_ranks(work, out.name)
    numel = [rec["main_shard_numel"] for rec in recs]
    # DiLoCoX: replica 0 = ranks 0 (stage 0), 1 (stage 1); plain (PP 2 x DP 2): every rank a half stage
    params = sum(numel) // (1 if plain else 2)
    (it_dir,) = [p for p in ckpt.iterdir() if p.is_dir()]
    disk = sum(f.stat().st_size for f in it_dir.rglob("*") if f.is_file())
    ranks = []
    for r, rec in enumerate(recs):
        (save,) = rec["save_memory"]
        ranks.append({"rank": r, "main_shard_numel": numel[r], "rss_before": save["rss_before"],
                      "rss_peak": save["rss_peak"], "peak_delta": save["peak_delta"],
                      "peak_delta_bytes_per_shard_element": save["peak_delta"] / numel[r]})
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    return {"repo": str(repo), "commit": commit,
            "mode": "plain Megatron (--no-diloco-x)" if plain else "DiLoCoX",
            "model": {"layers": layers, "hidden": hidden, "parameters": params},
            "iterations": iters, "wall_s": round(time.time() - start, 1),
            "checkpoint_bytes": disk, "checkpoint_bytes_per_parameter": disk / params, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--plain", action="store_true",
                        help="plain Megatron data parallelism (--no-diloco-x): Megatron's own save, for reference")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt_mem_") as tmp:
        result = measure(args.repo.resolve(), args.hidden, args.layers, args.iters, Path(tmp), args.plain)
    result["machine"] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch_device": "cpu (gloo)",
                         "malloc_mmap_threshold": MMAP_THRESHOLD}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
