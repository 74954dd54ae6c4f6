"""Launch the example under ``tests/megatron_runner.py`` with torchrun on CPU and read the records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "megatron_runner.py"

# A model small enough for several runs per test on 2 cores; PP 2 x 2 replicas on 4 ranks.
TINY = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --log-interval 1 --eval-iters 0 --eval-interval 100000 --lr-warmup-iters 2
""".split()


def run_megatron(tmp: Path, args: list[str], nproc: int = 4, expect_fail: bool = False,
                 timeout: int = 400, env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    """Run the instrumented example; return (per-rank records, combined output). ``env``: extra
    environment variables (e.g. the runner's fault injections)."""
    out = tmp / f"out{len(list(tmp.glob('out*')))}"
    out.mkdir(parents=True)
    env = dict(os.environ, DILOCO_TEST_OUT=str(out), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(RUNNER), *TINY, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    if expect_fail:
        assert proc.returncode != 0, "expected the run to fail:\n" + log[-4000:]
        return [], log
    assert proc.returncode == 0, log[-6000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return records, log


def losses(records: list[dict]) -> dict[int, dict[int, float]]:
    """{rank: {iteration: lm loss}} for the ranks that log a loss (last pipeline stages)."""
    return {r: {it: d["lm loss"] for it, d in rec["losses"]} for r, rec in enumerate(records) if rec["losses"]}


def summary(log: str) -> dict:
    lines = [l for l in log.splitlines() if l.startswith("DILOCOX SUMMARY ")]
    assert len(lines) == 1, f"expected one summary line, got {len(lines)}"
    return json.loads(lines[0][len("DILOCOX SUMMARY "):])


def traffic_between_boundaries(rec: dict) -> list[dict]:
    """The cross-replica ops a rank's training loop issued outside the outer boundaries, once
    started: none may exist (the one world barrier Megatron's ``print_datetime`` issues before the
    first step, iteration 0, is not training traffic; ``test_megatron_diloco`` pins it)."""
    return [c for c in rec["cross_replica"] if not c["in_boundary"] and c["iteration"] > 0]
