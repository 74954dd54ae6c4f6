"""The pure-torch reference codecs (megatron_diloco.algorithm.compression.reference): the semantics."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.algorithm.compression import reference as ref
from megatron_diloco.algorithm.outer import OuterNesterov

SIZES = [0, 1, 2, 7, 255, 256, 257, 1000, 4099]


def _bucket(n: int, seed: int, x_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randn(n, generator=g)
    x = (anchor - 1e-2 * torch.randn(n, generator=g)).to(x_dtype)
    e = 1e-3 * torch.randn(n, generator=g)
    return anchor, x, e


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_invariant_exact(fmt, n, x_dtype):
    """dequant(payload) + e_new == (anchor - x) + e, bit for bit, and e_new is what was not sent."""
    anchor, x, e = _bucket(n, seed=n, x_dtype=x_dtype)
    v = (anchor - x.float()) + e
    e_new = torch.empty_like(e)
    payload = ref.encode_reference(e, fmt, 256, anchor=anchor, x=x, residual_out=e_new)
    layout = ref.payload_layout(n, fmt, 256)
    assert payload.dtype == torch.uint8 and payload.numel() == layout.total_bytes
    assert layout.total_bytes % ref.PAYLOAD_ALIGN == 0
    sent = ref.dequantize_reference(payload, layout)
    assert torch.equal(sent + e_new, v)
    # the residual is at most half a quantization step (int: scale/2; fp8: 16 * scale at the top)
    if n:
        half_step = {"int8": 0.5 / 127, "int4": 0.5 / 7, "fp8": 16.0 / 448, "int2": 0.5}[fmt]
        assert (e_new.abs() <= v.abs().max() * half_step * (1 + 1e-6)).all()


def test_error_feedback_invariant_extreme_magnitudes():
    """Tiny (subnormal), huge and zero blocks, mixed signs: the invariant still holds exactly."""
    parts = [torch.full((256,), 1e-44), torch.zeros(256), torch.linspace(-1.0, 1.0, 256) * 3e38,
             torch.tensor([0.5, -0.5, 1e-30, -0.0] * 64), torch.randn(256) * 1e-39]
    v = torch.cat(parts)
    for fmt in ref.FORMATS:
        e_new = torch.empty_like(v)
        payload = ref.encode_reference(torch.zeros_like(v), fmt, 256, pseudo_grad=v, residual_out=e_new)
        sent = ref.dequantize_reference(payload, ref.payload_layout(v.numel(), fmt, 256))
        assert torch.equal(sent + e_new, v), fmt


def test_int8_known_values_and_layout():
    """Hand-checked payload: scale = absmax/127, q = round-half-even(v/scale), nibble layout for int4."""
    v = torch.tensor([127.0, -63.5, 0.5, 1.5, 0.0], dtype=torch.float32)  # one block, scale 1
    payload, dq = ref.quantize_reference(v, "int8", 8)
    layout = ref.payload_layout(5, "int8", 8)
    scales, values = ref.split_payload(payload, layout)
    assert scales.tolist() == [1.0]
    assert values.tolist() == [127, -64, 0, 2, 0]  # half to even: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2
    # 4 B scale, zero padding to 16 (values 16-byte aligned), 5 values, zero padding to 32
    assert layout.values_offset == 16 and layout.total_bytes == 32
    assert payload[4:16].eq(0).all() and payload[16 + 5:].eq(0).all()
    v4 = torch.tensor([7.0, -7.0, 3.0], dtype=torch.float32)
    payload4, _ = ref.quantize_reference(v4, "int4", 4)
    _, values4 = ref.split_payload(payload4, ref.payload_layout(3, "int4", 4))
    assert values4.tolist() == [(7 + 8) | ((-7 + 8) << 4), (3 + 8) | (8 << 4)]  # odd tail nibble = 8
    # int2: ternary, scale = absmax / 2; code = q + 2, element 4i + j in bits [2j, 2j + 2) of byte i
    v2 = torch.tensor([4.0, -3.0, 0.8, 1.2, -1.0], dtype=torch.float32)  # one block of 8, scale 2
    payload2, dq2 = ref.quantize_reference(v2, "int2", 8)
    layout2 = ref.payload_layout(5, "int2", 8)
    scales2, values2 = ref.split_payload(payload2, layout2)
    assert scales2.tolist() == [2.0] and layout2.values_bytes == 2
    # q = 1 (2, clamped), -1 (-1.5, clamped), 0 (0.4), 1 (0.6), 0 (-0.5: half to even); the tail of the
    # second byte holds code 2 (q 0)
    assert values2.tolist() == [3 | (1 << 2) | (2 << 4) | (3 << 6), 2 | (2 << 2) | (2 << 4) | (2 << 6)]
    assert dq2.tolist() == [2.0, -2.0, 0.0, 2.0, 0.0]


def test_payload_sizes():
    n = 1 << 20
    assert ref.payload_layout(n, "int8").total_bytes == n + 4 * n // 256
    assert ref.payload_layout(n, "int4").total_bytes == n // 2 + 4 * n // 256
    assert ref.payload_layout(n, "int2").total_bytes == n // 4 + 4 * n // 256
    assert ref.payload_layout(0, "int8").total_bytes == 0
    for numel in (1, 255, 257, 1000, 3 * 256 + 1):  # values always start 16-byte aligned, < 16 B gap
        lay = ref.payload_layout(numel, "int8")
        assert lay.values_offset % 16 == 0 and 0 <= lay.values_offset - 4 * lay.num_blocks < 16
        assert lay.total_bytes % 16 == 0 and lay.total_bytes - lay.values_offset - lay.values_bytes < 16
    with pytest.raises(ValueError, match="power of two"):
        ref.payload_layout(10, "int8", 100)


def test_nonfinite_blocks_are_flagged_in_scales():
    v = torch.randn(1000)
    clean = ref.encode_reference(torch.zeros(1000), "int8", 256, pseudo_grad=v, residual_out=torch.empty(1000))
    layout = ref.payload_layout(1000, "int8", 256)
    assert not ref.has_nonfinite_scales(clean, layout)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = v.clone()
        w[700] = bad
        p = ref.encode_reference(torch.zeros(1000), "int8", 256, pseudo_grad=w, residual_out=torch.empty(1000))
        assert ref.has_nonfinite_scales(p, layout)
        assert ref.has_nonfinite_scales(torch.stack([clean, p]), layout)  # any replica's payload


def test_in_place_residual_update():
    anchor, x, e = _bucket(300, seed=1)
    e2 = e.clone()
    e_out = torch.empty_like(e)
    p1 = ref.encode_reference(e, "int8", 256, anchor=anchor, x=x, residual_out=e_out)
    p2 = ref.encode_reference(e2, "int8", 256, anchor=anchor, x=x)  # in place
    assert torch.equal(p1, p2) and torch.equal(e_out, e2)


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_decode_is_ordered_mean(fmt, replicas):
    n = 777
    layout = ref.payload_layout(n, fmt, 256)
    payloads = torch.stack([ref.quantize_reference(torch.randn(n) * (r + 1), fmt)[0] for r in range(replicas)])
    delta = ref.decode_reference(payloads, layout)
    expect = ref.dequantize_reference(payloads[0], layout)
    for r in range(1, replicas):
        expect = expect + ref.dequantize_reference(payloads[r], layout)
    assert torch.equal(delta, expect * ref.inverse_replicas(replicas))


def _cancelling_payloads(n: int, fmt: str) -> torch.Tensor:
    """Payloads of 3 replicas whose fp32 sum depends on the order: in block 0 replica 0 sends +B and
    replica 1 exactly -B (same scale, q = +-QMAX), replica 2 values of size ~1. Summed in replica
    order, (B + -B) + d_2 == d_2; any order that adds d_2 to +-B first (B = 2^30) loses it."""
    g = torch.Generator().manual_seed(11)
    vs = [torch.randn(n, generator=g) * (r + 1) for r in range(3)]
    big = float(2 ** 30)
    vs[0][:256] = big
    vs[1][:256] = -big
    return torch.stack([ref.quantize_reference(v, fmt)[0] for v in vs])


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_decode_fused_outer_step_equals_straight_line(fmt, momentum, nesterov):
    """decode_reference(..., outer=) against the spec written out by hand: d_r = dequant(payload_r),
    Delta = ((d_0 + d_1) + d_2) * fp32(1/3) in fp32 (replica order), then, in fp64,
    m <- mu m + Delta; theta <- theta - eta (Delta + mu m) (Nesterov) | theta - eta m (heavy ball)
    | theta - eta Delta (mu = 0).

    Tolerance: the implementation keeps theta and m in fp32 (every op rounds; add with alpha may be
    fused), the straight line in fp64 (from the same fp32 Delta): two steps with |theta| <= 16 and
    |m| <= 10 differ by a few fp32 ulps of 16 (ulp 1.9e-6; measured <= 1.3e-6), under 1e-5. Skipping
    the momentum, a heavy-ball / Nesterov mix-up, no outer step, or another replica order (block 0
    cancels only in replica order; a wrong one moves Delta by O(1) there) miss by >= 4 (checked)."""
    n = 1000
    layout = ref.payload_layout(n, fmt, 256)
    payloads = _cancelling_payloads(n, fmt)
    eta = 0.7
    theta0 = torch.randn(n, generator=torch.Generator().manual_seed(12))
    fused = OuterNesterov(theta0.clone(), lr=eta, momentum=momentum, nesterov=nesterov)

    d = [ref.dequantize_reference(payloads[r], layout) for r in range(3)]  # plain decode, fp32
    delta = ((d[0] + d[1]) + d[2]) * torch.tensor(1.0 / 3.0, dtype=torch.float32)  # replica order
    assert delta[:256].abs().max() < 100  # block 0 cancelled: only replica 2 is left there
    delta64 = delta.double()
    theta, m = theta0.double(), torch.zeros(n, dtype=torch.float64)
    for _ in range(2):
        ref.decode_reference(payloads, layout, outer=fused)
        if momentum:
            m = momentum * m + delta64
            upd = delta64 + momentum * m if nesterov else m
        else:
            upd = delta64
        theta = theta - eta * upd
    torch.testing.assert_close(fused.theta.double(), theta, rtol=0, atol=1e-5)
    if momentum:
        torch.testing.assert_close(fused.momentum_buffer.double(), m, rtol=0, atol=1e-5)
    else:
        assert fused.momentum_buffer is None
