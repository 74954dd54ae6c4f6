"""Capture real DiLoCoX pseudo-gradients from ``examples/pretrain_gpt_diloco.py`` (for ``codecs_bench.py``).

    python benchmarks/codecs/codec_capture.py [--out .cache/pseudograds] [--rounds 1,4] [--nproc 4] \\
        -- --train-iters 64 --diloco-x-local-steps 16 --diloco-x-warmup-iters 0 --diloco-x-overlap none

One runner job: the example under the harness with the recorder ``codec_capture``
(``harness/recorders/codec_capture.py``, where what a capture holds is described) under ``torchrun``
(CPU/gloo, ``OMP_NUM_THREADS=1``), which for every outer round k in ``--rounds`` saves on each rank the
per-parameter pseudo-gradient (params at the start of round k) - (params at the end of round k) with
full parameter shapes (with PP 2 and one rank per replica stage each rank holds its stage's full
parameters).

Writes ``OUT/round{k}_replica{r}_stage{s}.pt``, ``OUT/meta.json`` and the run's log ``OUT/run/log.txt``.
Replica 0 always saves; the other replicas too unless ``--replica0-only``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from harness.runner import Command, Job, harness_command, run_job, summary_of, torchrun  # noqa: E402
from megatron_diloco.summary import PREFIX as SUMMARY_PREFIX  # noqa: E402


def show(line: str) -> None:
    """Echo the run's capture, round and summary lines."""
    if line.startswith("[codec_capture]") or SUMMARY_PREFIX in line or "[DiLoCoX] round" in line:
        print(line, end="", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / ".cache" / "pseudograds")
    p.add_argument("--rounds", default="1,4", help="comma-separated 1-based outer rounds to capture")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--replica0-only", action="store_true")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="flags for the example (after --)")
    a = p.parse_args()
    extra = [x for x in a.extra if x != "--"] or \
        "--train-iters 64 --diloco-x-local-steps 16 --diloco-x-warmup-iters 0 --diloco-x-overlap none".split()
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("round*_replica*_stage*.pt"):
        old.unlink()
    env = {"CODEC_CAPTURE_OUT": str(a.out.resolve()), "CODEC_CAPTURE_ROUNDS": a.rounds,
           "CODEC_CAPTURE_REPLICA0_ONLY": "1" if a.replica0_only else "0"}
    cmd = Command(harness_command(["codec_capture"], a.out / "run", extra, torchrun(a.nproc)))
    info = run_job(Job("run", [cmd], env=env, timeout_s=math.inf, watch=show), a.out)
    wall = info["wall_s"]
    if not info["ok"]:
        raise SystemExit(f"capture run failed ({info['returncode']}); log: {a.out / 'run' / 'log.txt'}")
    files = sorted(f.name for f in a.out.glob("round*_replica*_stage*.pt"))
    summary = summary_of(a.out, "run")
    meta = {"command": " ".join(["python", "benchmarks/codecs/codec_capture.py", "--rounds", a.rounds, "--",
                                 *extra]),
            "example_flags": extra, "rounds": [int(r) for r in a.rounds.split(",")], "nproc": a.nproc,
            "files": files, "wall_s": round(wall, 1),
            "summary": summary or None}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"[codec_capture] {len(files)} files in {a.out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
