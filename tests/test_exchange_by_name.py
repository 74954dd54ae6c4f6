"""The exchange by name on real Megatron models (``megatron_diloco.megatron_adapter.by_name``): the same model built at
TP 1 / PP 1 / DP 2, TP 2, PP 2, TP 2 x PP 2 and PP 2 with two virtual stages per rank, and with ``--swiglu`` at DP 2
and TP 2 (gloo ranks, the distributed optimizer, bf16), the recorder ``by_name`` at the first step. At every layout a pull must bring every canonical element from its main shard (set to its index,
computed densely from Megatron's sharded state dict) into the staging of the rank that holds its chunk, and a push
must write every copy back; and every layout must name the same tensors with the same global shapes."""

from __future__ import annotations

import pytest

from tests.megatron_utils import run_megatron

pytestmark = pytest.mark.megatron

#: name -> (TP, PP, ranks, flags); ``swiglu*``: the fused gate and up projection (Megatron saves it through a
#: factory, as two blocks of one global tensor)
LAYOUTS = {"dp2": (1, 1, 2, []), "tp2": (2, 1, 2, []), "pp2": (1, 2, 2, []), "tp2pp2": (2, 2, 4, []),
           "swiglu_dp2": (1, 1, 2, ["--swiglu"]), "swiglu_tp2": (2, 1, 2, ["--swiglu"]),
           "vpp2": (1, 2, 2, ["--num-layers-per-virtual-pipeline-stage", "1"])}


def test_a_checkpoint_loaded_at_any_layout_gives_the_same_chunks(tmp_path):
    """What "the same parameter" means across layouts is Megatron's own: a checkpoint saved at TP 1 / DP 2 (its
    distributed format) and loaded at DP 2, TP 2, PP 2, TP 2 x PP 2 and PP 2 with two virtual stages per rank (the
    weights only) gives, pulled, the same values chunk by chunk, bit for bit."""
    ckpt = tmp_path / "ckpt"
    _layout(tmp_path, 1, 1, 2, ["--save", str(ckpt), "--save-interval", "3", "--train-iters", "3"])
    loaded = {name: _layout(tmp_path, tp, pp, nproc, [*extra, "--load", str(ckpt), "--no-load-optim", "--no-load-rng"])
              for name, (tp, pp, nproc, extra) in LAYOUTS.items() if not name.startswith("swiglu")}
    values = {name: [v for rec in ranks for v in rec["values"]] for name, ranks in loaded.items()}
    assert all(len(v) == 8 for v in values.values()), values
    assert all(v == values["dp2"] for v in values.values()), values


def _layout(tmp_path, tp: int, pp: int, nproc: int, extra: list[str], chunks: int = 8,
            piece: int | None = None) -> list[dict]:
    recs, _ = run_megatron(tmp_path, ["--tensor-model-parallel-size", str(tp),
                                      "--pipeline-model-parallel-size", str(pp),
                                      "--train-iters", "4", "--no-diloco-x", "--bf16", *extra,
                                      # the embedding's rows padded alike: a multiple of 256 at every TP
                                      "--make-vocab-size-divisible-by", str(256 // tp)],
                           nproc=nproc, recorders=("by_name",),
                           env={"DILOCO_TEST_CHUNKS": str(chunks),
                                **({"DILOCO_TEST_PIECE": str(piece)} if piece else {})})
    return [r["by_name"] for r in recs]


def test_every_layout_pulls_and_pushes_the_same_canonical_vector(tmp_path):
    # (TP 2 x PP 2 in all-to-alls of 997 elements per peer: streams cut mid-row, in many rounds)
    got = {name: _layout(tmp_path, *shape, piece=997 if name == "tp2pp2" else None) for name, shape in LAYOUTS.items()}
    for name, ranks in got.items():
        first = got["swiglu_dp2" if name.startswith("swiglu") else "dp2"][0]
        for rank, rec in enumerate(ranks):
            assert rec["pulled"] and rec["pushed"], (name, rank)
            assert rec["digest"] == first["digest"] and rec["numel"] == first["numel"], (name, rank)
        # the ranks' staging ranges tile the canonical vector, chunks of 8 split evenly over the world
        n, w = first["numel"], len(ranks)
        assert [tuple(r["range"]) for r in ranks] == [(i * n // w, (i + 1) * n // w) for i in range(w)]
        assert all(len(r["chunks"]) == 8 // len(ranks) for r in ranks), name
    assert got["tp2"][0]["segments"] > got["dp2"][0]["segments"]  # (row-parallel blocks: strided rows, cut)


@pytest.mark.parametrize("local, shape, offset", [((4, 6), (4, 12), (0, 6)), ((1, 5, 3), (3, 10, 3), (2, 5, 0)),
                                                  ((8,), (16,), (8,)), ((2, 3, 4), (2, 3, 4), (0, 0, 0))])
def test_segments_and_cuts_map_every_element_to_its_global_index(local, shape, offset):
    """Segments of every element range of a block, cut at every index, against the dense row-major index."""
    import math

    import torch

    from megatron_diloco.megatron_adapter.by_name import _split, block_rows, segments_of

    dense = torch.zeros(local, dtype=torch.int64)
    for axis, (n, off) in enumerate(zip(local, offset)):
        dense += ((torch.arange(n) + off) * math.prod(shape[axis + 1:])).view(*[n if a == axis else 1
                                                                                for a in range(len(local))])
    dense = dense.view(-1).tolist()
    base, row_len, stride = block_rows(local, shape, offset)
    n = len(dense)
    for start in range(n):
        for end in range(start + 1, n + 1):
            for cut in (None, *range(math.prod(shape))):
                segs = segments_of(0, start, end - start, 100 + base, row_len, stride, True)
                if cut is not None:
                    segs = [p for s in segs for p in _split(s, 100 + cut)]
                got = {}
                for s in segs:
                    assert s.rows == 1 or s.stride >= s.cols
                    if cut is not None:  # a piece lies on one side of the cut
                        last = s.canon + (s.rows - 1) * s.stride + s.cols
                        assert last <= 100 + cut or s.canon >= 100 + cut, (s, cut)
                    for i in range(s.rows):
                        for j in range(s.cols):
                            got[s.lo + i * s.cols + j] = s.canon + i * s.stride + j - 100
                assert got == {k: dense[start + k] for k in range(end - start)}, (start, end, cut)


def test_a_stream_range_is_every_element_once_in_order():
    """``_stream_range``: any range of a stream of 2-D (strided) views, as views, gives exactly its elements in
    order: what a pull or push cut into all-to-alls of a few elements moves."""
    import torch

    from megatron_diloco.megatron_adapter.by_name import _stream_range

    base = torch.arange(200.0)
    views = [base[:12].view(3, 4), base.as_strided((4, 5), (9, 1), 20), base[100:101].view(1, 1),
             base.as_strided((2, 7), (10, 1), 150)]
    stream = torch.cat([v.reshape(-1) for v in views])
    for lo in range(len(stream) + 1):
        for hi in range(lo, len(stream) + 1):
            got = [v.reshape(-1) for v in _stream_range(views, lo, hi)]
            assert torch.equal(torch.cat(got) if got else torch.zeros(0), stream[lo:hi]), (lo, hi)
