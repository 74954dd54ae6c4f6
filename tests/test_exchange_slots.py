"""Exchange slots on real Megatron buffers (``megatron_diloco.megatron_adapter.exchange_slots``): the same model
built at data-parallel sizes 1, 2 and 4 (gloo ranks, the distributed optimizer, overlapped grad reduce with
buckets of 20,000 elements, so that a rank's shards fall in several; bf16), cut into 4 slots. Slot s must be the same
vector at every DP: the same parameter elements in the same order, and the same values at the start (the same
seed); together the slots cover every parameter element once; at DP 4 a rank's one slot is its whole main shard
(what Megatron's optimizer owns)."""

from __future__ import annotations

import pytest

from tests.megatron_utils import run_megatron

pytestmark = pytest.mark.megatron

SLOTS = 4


def _slots(tmp_path, dp: int, extra: list[str]) -> tuple[dict[int, tuple[list, list]], dict[str, int]]:
    recs, _ = run_megatron(tmp_path, ["--pipeline-model-parallel-size", "1", "--train-iters", "4", "--no-diloco-x",
                                      "--ddp-bucket-size", "20000", "--overlap-grad-reduce", *extra],
                           nproc=dp, recorders=("slots",), env={"DILOCO_TEST_SLOTS": str(SLOTS)}, warmup=True)
    out = {}
    for rank, rec in enumerate(recs):
        got = rec["slots"]
        assert got["dp"] == [rank, dp] and got["buckets"] >= 3, got  # (several buckets: each is cut)
        k = SLOTS // dp
        assert len(got["pieces"]) == len(got["fingerprints"]) == k
        if k == 1:  # at DP = slots, a rank's one slot is its whole main shard, as Megatron's optimizer owns it
            assert sum(hi - lo for _, lo, hi in got["pieces"][0]) == got["main_numel"], rank
        for j in range(k):
            out[rank * k + j] = (got["pieces"][j], got["fingerprints"][j])
    return out, recs[0]["slots"]["numel"]


def test_a_slot_is_the_same_vector_at_every_data_parallel_size(tmp_path):
    runs = {dp: _slots(tmp_path, dp, ["--bf16"]) for dp in (1, 2, 4)}  # (bf16: the fp32 main shards of bf16 params)
    by_dp, numel = {dp: r[0] for dp, r in runs.items()}, runs[1][1]
    for dp in (2, 4):
        for s in range(SLOTS):
            assert by_dp[dp][s][0] == by_dp[1][s][0], (dp, s)  # the same elements, in the same order
            assert by_dp[dp][s][1] == by_dp[1][s][1], (dp, s)  # the same values
    covered: dict[str, list[tuple[int, int]]] = {}
    for s in range(SLOTS):
        assert by_dp[1][s][0], s  # (every slot holds something: the buckets are cut, not the buffer)
        for name, lo, hi in by_dp[1][s][0]:
            covered.setdefault(name, []).append((lo, hi))
    assert set(covered) == set(numel)
    for name, spans in covered.items():  # each parameter's elements once
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == numel[name], (name, spans, numel[name])
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)
