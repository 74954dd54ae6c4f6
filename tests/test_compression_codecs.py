"""The codec registry behind --diloco-x-compression: dispatch, errors, NaN/Inf handling."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.algorithm.compression import (
    BlockwiseCodec, get_codec, has_nonfinite, has_nonfinite_scales, payload_layout,
)
from megatron_diloco.algorithm.compression import reference as ref
from megatron_diloco.algorithm.compression import triton_kernels as tk
from megatron_diloco.algorithm.config import CODECS


def _twins(t):
    return torch.stack([t, t])


def test_registry_names_and_payload_bytes():
    layout = [(0, (64, 64)), (4096, (64,))]
    for name, spec in CODECS.items():
        codec = get_codec(name, layout)
        assert codec.name == name and callable(codec.exchange)
        assert codec.lossy == spec.lossy, name
        if spec.matrix:  # the matrix codecs need the layout; the others do not
            with pytest.raises(ValueError, match="layout"):
                get_codec(name)
        else:
            assert get_codec(name).name == name
    n = 1 << 16
    assert get_codec("none").payload_bytes(n) == 4 * n
    assert get_codec("int8").payload_bytes(n) == n + 4 * n // 256  # ratio ~3.94 vs fp32
    assert get_codec("int4").payload_bytes(n) == n // 2 + 4 * n // 256
    with pytest.raises(ValueError, match="--diloco-x-compression"):
        get_codec("zstd")
    with pytest.raises(ValueError, match="layout"):
        get_codec("lowrank")


def test_fp8_is_gpu_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    codec = get_codec("fp8")
    with pytest.raises(RuntimeError, match="--diloco-x-compression fp8"):
        codec.encode(torch.zeros(10), pseudo_grad=torch.ones(10))


def test_cuda_without_triton_is_an_error(monkeypatch):
    monkeypatch.setattr(tk, "triton", None)
    with pytest.raises(RuntimeError, match="needs Triton"):
        tk.use_triton(torch.device("cuda"))


def test_cpu_runs_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tk.use_triton(torch.device("cpu"))
    anchor, x, e = torch.randn(999), torch.randn(999).to(torch.bfloat16), torch.randn(999) * 1e-3
    e1, e2 = e.clone(), e.clone()
    codec = BlockwiseCodec("int4", 64)
    payload = codec.encode(e1, anchor=anchor, x=x)
    assert torch.equal(payload, ref.encode_reference(e2, "int4", 64, anchor=anchor, x=x))
    assert torch.equal(e1, e2)


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_exchange_with_identical_replicas(name):
    """Two identical replicas: Delta is what one replica sent; sent + residual == v exactly."""
    v = torch.randn(1000)
    residual = torch.zeros(1000)
    delta = get_codec(name).exchange(residual, _twins, pseudo_grad=v)
    assert torch.equal(delta + residual, v)
    if name == "none":
        assert torch.equal(delta, v)


def test_nonfinite_round_is_skipped_without_touching_state():
    """Encode into a second residual buffer, detect from the scales, drop the round: e is intact."""
    codec = get_codec("int8")
    anchor = torch.randn(2000)
    x = anchor - 1e-2 * torch.randn(2000)
    x[1234] = float("nan")
    residual = torch.randn(2000) * 1e-3
    saved = residual.clone()
    scratch = torch.empty_like(residual)
    assert has_nonfinite(anchor - x)
    payload = codec.encode(residual, anchor=anchor, x=x, residual_out=scratch)
    layout = payload_layout(2000, "int8")
    skip = has_nonfinite_scales(payload, layout)  # the exchange all-reduces this flag (MAX) first
    assert skip
    assert torch.equal(residual, saved)  # nothing to roll back
    assert not has_nonfinite(torch.randn(10)) and not has_nonfinite(torch.zeros(0))
