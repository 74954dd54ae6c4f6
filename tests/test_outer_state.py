"""``--diloco-x-outer-state cpu``: the outer state in host memory, streamed through the device in
chunks, gives the same bits as keeping it on the device, for every single-collective codec and
overlap mode, and checkpoints move between the two layouts (cases: ``tests/outer_state_cases.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.config import DiLoCoXConfig
from megatron_diloco.outer_store import CHUNK_ALIGN, chunk_elements
from tests.dist_utils import run_world
from tests.outer_state_cases import compare_layouts


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_host_outer_state_is_bit_identical(codec):
    """Every overlap mode, chunks of one block cutting tensors, a tail chunk: the params after every
    boundary, theta, m and the residual equal the device layout's bit for bit (both on the CPU here:
    the chunked path against the whole-shard one)."""
    run_world(compare_layouts, 2, codec, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("codec", ["none", "int8", "int4", "fp8"])
def test_host_outer_state_is_bit_identical_on_gpu(codec):
    """On a GPU: pinned host state, side-stream copies and the Triton kernels on staged chunks vs
    the device-resident state (two gloo ranks sharing the GPU)."""
    run_world(compare_layouts, 2, codec, "cuda")


@pytest.mark.parametrize("kwargs, flag", [
    (dict(outer_state="host"), "--diloco-x-outer-state"),
    (dict(outer_state="cpu", compression="lowrank"), "--diloco-x-outer-state"),
    (dict(outer_state="cpu", compression="adaptive"), "--diloco-x-outer-state"),
    (dict(outer_chunk_mb=0.0), "--diloco-x-outer-chunk-mb"),
])
def test_outer_state_flags_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DiLoCoXConfig(**kwargs)


def test_chunk_elements_fall_on_blocks():
    assert chunk_elements(16.0) == 4 << 20
    assert chunk_elements(0.001) == CHUNK_ALIGN  # never less than one block
    assert chunk_elements(1.5) % CHUNK_ALIGN == 0
