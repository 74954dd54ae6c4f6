"""The Megatron-level tests' runs and what they assert on the records: :func:`run_megatron` launches the
example under the harness (:mod:`harness.launch`: ranks forked from the pre-imported zygote) with the
tests' recorders (:mod:`harness.recorders`) and reads the rank records; the rest reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.launch import RUNNER, TINY, launch
from harness.runner import TRAINING, harness_args
from megatron_diloco.summary import parse_summaries

#: The checkpoint tests' recorders, in the order they are installed.
CHECKPOINT = ("checkpoint", "training")


#: Appended to a test's flags that name no warm-up flag: the tests of other things assume rounds of
#: H from the start (boundaries, landings, resumes); the default warm-up is covered by
#: ``test_megatron_diloco.py::test_warmup_rounds_then_h`` (auto and explicit).
NO_WARMUP = ["--diloco-x-warmup-iters", "0"]


def without_default_warmup(args: list[str]) -> list[str]:
    """``args`` plus :data:`NO_WARMUP` unless they name a ``--diloco-x-warmup-*`` flag."""
    return args if any(str(a).startswith("--diloco-x-warmup") for a in args) else [*args, *NO_WARMUP]


def run_megatron(tmp: Path, args: list[str], nproc: int = 4, expect_fail: bool = False,
                 timeout: int = 400, env: dict[str, str] | None = None,
                 recorders: tuple[str, ...] = TRAINING, warmup: bool = False) -> tuple[list[dict], str]:
    """Run the example under the harness with ``recorders``; return (per-rank records, combined
    output). ``env``: extra environment variables (e.g. the recorders' fault injections).
    ``warmup``: keep the default (auto) warm-up; else :func:`without_default_warmup`."""
    args = args if warmup else without_default_warmup(args)
    out = tmp / f"out{len(list(tmp.glob('out*')))}"
    out.mkdir(parents=True)
    code, log = launch(RUNNER, [*harness_args(out, recorders), *TINY, *args], out, nproc, timeout, env)
    if expect_fail:
        assert code != 0, "expected the run to fail:\n" + log[-4000:]
        return [], log
    assert code == 0, log[-6000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return records, log


def losses(records: list[dict]) -> dict[int, dict[int, float]]:
    """{rank: {iteration: lm loss}} for the ranks that log a loss (last pipeline stages)."""
    return {r: {it: d["lm loss"] for it, d in rec["losses"]} for r, rec in enumerate(records) if rec["losses"]}


def summary(log: str) -> dict:
    found = parse_summaries(log)
    assert len(found) == 1, f"expected one summary line, got {len(found)}"
    return found[0]


def assert_final_params_identical(records: list[dict], replicas: int = 2) -> None:
    """Every replica ended training with the same model: each rank's fp32 main shards and model
    parameters after ``DiLoCoXOptimizer.finish`` equal its outer-group peers' (rank r and r + k
    world / R: replicas are contiguous blocks of ranks)."""
    per = len(records) // replicas
    for rank, rec in enumerate(records):
        assert "final_fp" in rec, f"rank {rank} did not finish training"
        peer = records[rank % per]["final_fp"]
        assert rec["final_fp"] == peer, (rank, rec["final_fp"], peer)


def traffic_between_boundaries(rec: dict) -> list[dict]:
    """The cross-replica ops a rank's training loop issued outside the outer boundaries, once
    started: none may exist (the one world barrier Megatron's ``print_datetime`` issues before the
    first step, iteration 0, is not training traffic; ``test_megatron_diloco`` pins it)."""
    return [c for c in rec["cross_replica"] if not c["in_boundary"] and c["iteration"] > 0]
