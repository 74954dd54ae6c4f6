"""Replicas as separate launches (``--diloco-x-outer-store``): each replica its own torch.distributed
world, joined only by the outer groups, trains exactly as the same replicas in one world do. This is
how several replicas share one GPU (NCCL refuses two ranks of one world on one GPU) in the
convergence benchmark, so the benchmark's numbers are the Megatron path's numbers."""

from __future__ import annotations

import json
import re

import pytest

from harness.launch import RUNNER, TINY, launch, run_jobs
from harness.runner import free_port, harness_args
from tests.megatron_utils import losses, summary

pytestmark = pytest.mark.megatron


def _records(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _dataset_sizes(log: str) -> list[int]:
    """Megatron's ' > datasets target sizes' (train, validation, test) printed by a world's rank 0."""
    return [int(n) for n in re.findall(r"^\s*(?:\[rank\d+\]:)?\s*(?:train|validation|test):\s+(\d+)\s*$",
                                       log, flags=re.M)]


# (--diloco-x-outer-store serves the benchmarks only: the default codec and the worker thread's group;
# the other overlap rules and codecs are the same code in one world)
@pytest.mark.parametrize("flags", [
    # the default codec with a warm-up of shorter rounds (boundaries 2, 4, 8)
    ["--diloco-x-overlap", "partial", "--diloco-x-overlap-steps", "1", "--diloco-x-compression", "int4",
     "--diloco-x-warmup-local-steps", "2", "--diloco-x-warmup-iters", "4"],
    # the matrix codecs' worker thread: on a gloo group of its own, not the one the training loop uses
    ["--diloco-x-overlap", "partial", "--diloco-x-overlap-steps", "1", "--diloco-x-compression", "lowrank"],
], ids=["partial-int4-warmup", "partial-lowrank"])
def test_separate_worlds_train_as_one_world(tmp_path, flags):
    """2 replicas x 1 rank: one launch of 2 ranks vs two launches of 1 rank joined through a TCP
    store. Same losses at every iteration on both replicas, bit for bit, and the same final main
    params (fingerprints): the data split, the exchange and the outer step are the same."""
    base = [*TINY, "--pipeline-model-parallel-size", "1", "--train-iters", "8", "--diloco-x-local-steps", "4", "--diloco-x-outer-lr", "0.7",
            "--diloco-x-outer-momentum", "0.9", *flags]
    one = tmp_path / "one"
    one.mkdir()
    code, log = launch(RUNNER, [*harness_args(one), *base], one, nproc=2)
    assert code == 0, log[-4000:]
    sizes = _dataset_sizes(log)
    want = losses(_records(one))
    assert set(want) == {0, 1} and want[0] != want[1]  # two replicas on different data

    store = f"127.0.0.1:{free_port()}"

    outs = [tmp_path / f"replica{r}" for r in range(2)]
    # --global-batch-size is per launch: each replica's share of the one world's 8
    results = list(zip(outs, run_jobs([([*harness_args(out), *base, "--global-batch-size", "4",
                                         "--diloco-x-outer-store", store, "--diloco-x-replica-index", str(r)], out, 1)
                                       for r, out in enumerate(outs)])))
    got = {}
    for r, (out, (code, log)) in enumerate(results):
        assert code == 0, log[-4000:]
        assert summary(log)["replicas_identical"] is True, summary(log)  # this launch's rank 0's summary
        # datasets sized for the R replicas' samples, as the one world sizes them (each launch reads
        # every R-th share: sized for one launch, they ran out at half the run)
        assert len(sizes) == 3 and _dataset_sizes(log) == sizes, (sizes, _dataset_sizes(log))
        got[r] = losses(_records(out))[0]
        if "lowrank" in flags:  # the worker's exchanges run on a second gloo group over the same ranks
            assert _records(out)[0]["outer"]["exchange_on_mirror"], r
    assert got == want
    one_fp = [rec["main_fp"][-1] for rec in _records(one)]
    sep_fp = [_records(out)[0]["main_fp"][-1] for out, _ in results]
    assert one_fp == sep_fp


@pytest.mark.parametrize("flag, values", [
    ("--train-iters", ["8", "12"]),  # a Megatron flag: the rounds and the end differ (DiLoCoX flags: test_handshake.py)
], ids=["train-iters"])
def test_launches_that_disagree_are_refused_before_training(tmp_path, flag, values):
    """Two launches joined through one store with one flag apart: both stop before their first
    iteration, each naming the flag, its own value and the other replica's (the join handshake,
    megatron_diloco.megatron_adapter.handshake; before it, nothing compared the launches' flags)."""
    base = [*TINY, "--pipeline-model-parallel-size", "1", "--diloco-x-local-steps", "4",
            "--global-batch-size", "4", *(["--train-iters", "8"] if flag != "--train-iters" else [])]
    store = f"127.0.0.1:{free_port()}"

    results = run_jobs([([*harness_args(tmp_path / f"replica{r}"), *base, flag, values[r], "--diloco-x-outer-store",
                          store, "--diloco-x-replica-index", str(r)], tmp_path / f"replica{r}", 1) for r in range(2)],
                       timeout=300)
    for r, (code, log) in enumerate(results):
        assert code != 0, log[-4000:]
        assert "megatron-diloco: error: the launches joined through --diloco-x-outer-store" in log, log[-4000:]
        assert f"{flag} is {values[r]} here, {values[1 - r]} in replica {1 - r}" in log, log[-4000:]
        assert not re.search(r"iteration\s+1/", log), "a launch trained before refusing"


def test_outer_store_flags_are_checked(tmp_path):
    code, log = launch(RUNNER, [*harness_args(tmp_path), *TINY, "--pipeline-model-parallel-size", "1",
                                "--train-iters", "4", "--diloco-x-outer-store", "127.0.0.1:1"], tmp_path, nproc=1)
    assert code != 0 and "--diloco-x-outer-store needs --diloco-x-replica-index" in log, log[-3000:]
