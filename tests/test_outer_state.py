"""``--diloco-x-outer-state host``: the outer state in host memory, streamed through the device in
chunks, gives the same bits as keeping it on the device, for every single-collective codec and
overlap mode, and checkpoints move between the two layouts (cases: ``tests/outer_state_cases.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.outer_store import CHUNK_ALIGN, SLOTS, OuterStore, chunk_elements
from tests.dist_utils import run_world
from tests.outer_state_cases import compare_layouts


@pytest.mark.parametrize("replicas,codec", [(2, "none"), (2, "int8"), (2, "int4"), (2, "int2"), (1, "none")])
def test_host_outer_state_is_bit_identical(replicas, codec):
    """Every overlap mode, chunks of one block cutting tensors, a tail chunk: the params after every
    boundary, theta, m and the residual equal the device layout's bit for bit (both on the CPU here:
    the chunked path against the whole-shard one). One replica: ``none``'s buffer is held on the
    host without a collective."""
    run_world(compare_layouts, replicas, codec, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("codec", ["none", "int8", "int4", "fp8", "int2"])
def test_host_outer_state_is_bit_identical_on_gpu(codec):
    """On a GPU: pinned host state, side-stream copies and the Triton kernels on staged chunks vs
    the device-resident state (two gloo ranks sharing the GPU)."""
    run_world(compare_layouts, 2, codec, "cuda")


@pytest.mark.parametrize("kwargs, flag", [
    (dict(outer_state="nvme"), "--diloco-x-outer-state"),
    (dict(outer_state="host", compression="lowrank"), "--diloco-x-outer-state"),
    (dict(outer_state="host", compression="adaptive"), "--diloco-x-outer-state"),
    (dict(outer_chunk_mb=0.0), "--diloco-x-outer-chunk-mb"),
])
def test_outer_state_flags_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DiLoCoXConfig(**kwargs)


def test_chunk_elements_fall_on_blocks():
    assert chunk_elements(16.0) == 4 << 20
    assert chunk_elements(0.001) == CHUNK_ALIGN  # never less than one block
    assert chunk_elements(1.5) % CHUNK_ALIGN == 0


def test_a_slot_part_of_the_store_is_the_store_of_its_elements():
    """``OuterStore.part`` (an exchange slot's segment): every attribute a store has, its own length and one
    segment, the held vectors and staging buffers shared with the whole store (a slice of a held vector is held);
    its chunks restart at the slot's start."""
    store = OuterStore(5 * CHUNK_ALIGN, torch.device("cpu"), on_host=True, chunk=2 * CHUNK_ALIGN,
                       segments=(0, 3 * CHUNK_ALIGN, 5 * CHUNK_ALIGN))
    theta = store.zeros()
    part = store.part(3 * CHUNK_ALIGN, 5 * CHUNK_ALIGN)
    assert set(vars(part)) == set(vars(store))
    assert (part.numel, part.segments) == (2 * CHUNK_ALIGN, (0, 2 * CHUNK_ALIGN))
    assert part.held(theta[3 * CHUNK_ALIGN:]) and part._staging is store._staging
    assert part.ranges() == [(0, 2 * CHUNK_ALIGN)]
    a = CHUNK_ALIGN
    assert store.ranges() == [(0, 2 * a), (2 * a, 3 * a), (3 * a, 5 * a)]  # restarting at the slot
    assert store.part(0, store.numel) is store


class _CopyLog(torch.overrides.TorchFunctionMode):
    """Records each ``copy_`` into or out of the host vector ``t`` as ("in" | "out", chunk)."""

    def __init__(self, t: torch.Tensor, chunk: int, log: list) -> None:
        super().__init__()
        self.base, self.end, self.chunk, self.log = t.data_ptr(), t.data_ptr() + 4 * t.numel(), chunk, log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            for kind, ptr in (("out", dst.data_ptr()), ("in", src.data_ptr())):
                if self.base <= ptr < self.end:
                    self.log.append((kind, (ptr - self.base) // 4 // self.chunk))
        return func(*args, **(kwargs or {}))


def test_stream_submits_each_copy_out_after_the_next_copy_in():
    """The host layout's submission order (what one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1,
    dispatches in): chunks k and k+1 copied in before chunk k is computed; after chunk k's compute,
    chunk k+2's copy in and then chunk k's copy out. (On the CPU the copies are synchronous, so the
    order they ran in is the order they were submitted in.) The values land where they belong."""
    chunk, n = CHUNK_ALIGN, 5
    store = OuterStore(n * chunk, torch.device("cpu"), on_host=True, chunk=chunk)
    t = store.empty()
    t.copy_(torch.arange(n * chunk, dtype=torch.float32))
    log: list = []
    with _CopyLog(t, chunk, log):
        for k, (lo, hi, (c,)) in enumerate(store.stream(t, write=[t])):
            log.append(("compute", k))
            c.mul_(2).add_(k)
    expected = [("in", 0), ("in", 1)]
    for k in range(n):
        expected.append(("compute", k))
        if k + 2 < n:
            expected.append(("in", k + 2))
        expected.append(("out", k))
    assert log == expected
    assert SLOTS == 3 and store.staging_bytes() == SLOTS * chunk * 4
    want = torch.arange(n * chunk, dtype=torch.float32) * 2 + torch.arange(n).repeat_interleave(chunk)
    assert torch.equal(t, want)
