"""Fused Triton kernels vs the reference, bit for bit, run on CPU by the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported, and other test modules (Megatron)
import triton. So when this module is collected without it, a single test re-runs this file in a
fresh ``python -m pytest`` subprocess with the variable set; the kernel tests run there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_kernels_under_triton_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env=env, cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]

else:
    import torch

    from megatron_diloco.algorithm.compression import reference as ref
    from megatron_diloco.algorithm.compression import triton_kernels as tk
    from megatron_diloco.algorithm.outer import OuterNesterov

    # 1-D, odd sizes, sizes that don't fill a block, several programs (4096 elements each), empty
    SIZES = [0, 1, 3, 255, 256, 257, 4096 + 513, 3 * 4096 + 7]

    def _bucket_from_tensors(shapes, seed):
        """A flat bucket concatenating tensors of the given shapes (1-D, 2-D, >2-D), as ShardView does."""
        g = torch.Generator().manual_seed(seed)
        return torch.cat([torch.randn(*s, generator=g).reshape(-1) for s in shapes])

    def _inputs(n, seed, x_dtype):
        g = torch.Generator().manual_seed(seed)
        anchor = torch.randn(n, generator=g) * 0.1
        x = (anchor - 1e-2 * torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(x_dtype)
        e = 1e-4 * torch.randn(n, generator=g)
        return anchor, x, e

    def _same_bits(a, b):
        return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))

    @pytest.mark.parametrize("fmt", ref.FORMATS)
    @pytest.mark.parametrize("n", SIZES)
    @pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
    def test_encode_bit_exact(fmt, n, x_dtype):
        anchor, x, e = _inputs(n, seed=n + 17, x_dtype=x_dtype)
        e_ref, e_tri = torch.empty_like(e), torch.empty_like(e)
        p_ref = ref.encode_reference(e, fmt, 256, anchor=anchor, x=x, residual_out=e_ref)
        p_tri = tk.encode_triton(e, fmt, 256, anchor=anchor, x=x, residual_out=e_tri)
        assert torch.equal(p_ref, p_tri)  # scales, values and padding
        assert _same_bits(e_ref, e_tri)

    @pytest.mark.parametrize("fmt", ref.FORMATS)
    @pytest.mark.parametrize("block_size", [2, 4, 32, 1024])
    def test_encode_bit_exact_multi_tensor_bucket(fmt, block_size):
        if block_size < ref.elements_per_byte(fmt):  # a block is whole bytes: 4 elements for int2
            with pytest.raises(ValueError, match="power of two >= 4 for int2"):
                ref.payload_layout(10, fmt, block_size)
            return
        shapes = [(7,), (3, 5, 7), (64, 33), (1,), (2, 3, 4, 5), (129,)]
        v = _bucket_from_tensors(shapes, seed=block_size)
        e = torch.zeros_like(v)
        e_ref, e_tri = torch.empty_like(v), torch.empty_like(v)
        p_ref = ref.encode_reference(e, fmt, block_size, pseudo_grad=v, residual_out=e_ref)
        p_tri = tk.encode_triton(e, fmt, block_size, pseudo_grad=v, residual_out=e_tri)
        assert torch.equal(p_ref, p_tri) and _same_bits(e_ref, e_tri)

    @pytest.mark.parametrize("fmt", ref.FORMATS)
    def test_encode_in_place_and_special_values(fmt):
        """Zero, subnormal, huge, signed-zero and non-finite blocks; residual updated in place."""
        v = torch.cat([torch.zeros(256), torch.full((256,), 1e-44), torch.linspace(-1, 1, 256) * 3e38,
                       torch.tensor([0.5, -0.5, 1e-30, -0.0] * 64), torch.randn(256) * 1e-39,
                       torch.randn(300)])
        v[256 * 5 + 10] = float("nan")
        v[256 * 5 + 200] = float("inf")
        e1 = torch.randn_like(v) * 1e-3
        e2 = e1.clone()
        p_ref = ref.encode_reference(e1, fmt, 256, pseudo_grad=v)
        p_tri = tk.encode_triton(e2, fmt, 256, pseudo_grad=v)
        assert torch.equal(p_ref, p_tri)  # NaN scales included: both write the canonical 0x7fc00000
        assert torch.equal(e1.isnan(), e2.isnan())
        assert _same_bits(torch.nan_to_num(e1), torch.nan_to_num(e2))
        layout = ref.payload_layout(v.numel(), fmt, 256)
        assert ref.has_nonfinite_scales(p_tri, layout)

    @pytest.mark.parametrize("fmt", ref.FORMATS)
    @pytest.mark.parametrize("n", [1, 257, 4096 + 513])
    @pytest.mark.parametrize("replicas", [1, 2, 3])
    def test_decode_bit_exact(fmt, n, replicas):
        layout = ref.payload_layout(n, fmt, 256)
        payloads = torch.stack([ref.quantize_reference(torch.randn(n) * (r + 1), fmt)[0] for r in range(replicas)])
        assert _same_bits(tk.decode_triton(payloads, layout), ref.decode_reference(payloads, layout))

    @pytest.mark.parametrize("fmt", ref.FORMATS)
    @pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True), (0.35, True)])
    def test_decode_fused_outer_step_bit_exact(fmt, momentum, nesterov):
        """The fused decode + outer step leaves theta and m exactly as OuterNesterov.step does."""
        n = 4096 + 333
        layout = ref.payload_layout(n, fmt, 256)
        theta0 = torch.randn(n)
        a = OuterNesterov(theta0.clone(), lr=0.7, momentum=momentum, nesterov=nesterov)
        b = OuterNesterov(theta0.clone(), lr=0.7, momentum=momentum, nesterov=nesterov)
        for rnd in range(3):  # several rounds so the momentum is non-trivial
            payloads = torch.stack([ref.quantize_reference(torch.randn(n) * 1e-2, fmt)[0] for _ in range(3)])
            assert tk.decode_triton(payloads, layout, outer=a) is None
            b.step(ref.decode_reference(payloads, layout))
            assert _same_bits(a.theta, b.theta), rnd
            if momentum:
                assert _same_bits(a.momentum_buffer, b.momentum_buffer), rnd

    def test_interpreted_fma_is_exact_at_fp32_midpoints():
        """The emulated FMA rounds once, also where fp64-then-fp32 rounding would err (and torch agrees)."""
        import triton
        import triton.language as tl

        @triton.jit
        def _fma_probe(a_ptr, c_ptr, out_ptr, b, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            m = o < n
            a = tl.load(a_ptr + o, mask=m)
            c = tl.load(c_ptr + o, mask=m)
            tl.store(out_ptr + o, tk._fma_f32(a, b, c, False), mask=m)

        b = 1.0 - 2.0 ** -18
        crafted_a = torch.tensor([2.0 ** -24 * (1 + 2.0 ** -18), -(2.0 ** -24) * (1 + 2.0 ** -18)])
        crafted_c = torch.tensor([1.0 + 2.0 ** -23, -(1.0 + 2.0 ** -23)])
        a = torch.cat([crafted_a, torch.randn(4000), torch.randn(4000) * 1e-30])
        c = torch.cat([crafted_c, torch.randn(4000), torch.randn(4000) * 1e-38])
        out = torch.empty_like(a)
        _fma_probe[(1,)](a, c, out, b, a.numel(), BLOCK=8192)
        expect = c.add(a, alpha=b)  # torch: one rounding (FMA)
        assert expect[0].item() == 1.0 + 2.0 ** -23  # the naive double rounding would give 1 + 2**-22
        assert _same_bits(out, expect)

    @pytest.mark.parametrize("codec_name", ["lowrank-int8", "adaptive"])
    def test_lowrank_codec_runs_the_kernels_bit_exact(codec_name, monkeypatch):
        """The low-rank codecs quantize their factors and fallback tensors (1-D, small, int8 and
        int4) with the same kernels as the blockwise codecs, and match the reference bit for bit."""
        from megatron_diloco.algorithm.compression import AdaptivePolicy, get_codec

        shapes = [(64, 48), (32,), (3, 5), (16, 4, 8), (10, 3), (128, 96), (300,)]
        layout, off = [], 0
        for s in shapes:
            layout.append((off, s))
            off += torch.Size(s).numel()

        def bucket(seed):  # matrices of rank 2 plus noise (low-ranked), the rest Gaussian
            g = torch.Generator().manual_seed(seed)
            parts = []
            for s in shapes:
                if len(s) >= 2 and torch.Size(s).numel() > 100:
                    m = s[0]
                    n = torch.Size(s).numel() // m
                    lr = torch.randn(m, 2, generator=g) @ torch.randn(2, n, generator=g)
                    parts.append((lr + 0.01 * torch.randn(m, n, generator=g)).reshape(-1))
                else:
                    parts.append(torch.randn(torch.Size(s).numel(), generator=g))
            return torch.cat(parts)

        def make():
            if codec_name == "adaptive":  # a budget 25% under the free plan: int4 next to int8 and factors
                free = AdaptivePolicy(max_rank=8, min_numel=0).choose(bucket(40), layout, 1)
                budget = 0.75 * sum(c.bytes for c in free)
                return get_codec("adaptive", layout, policy=AdaptivePolicy(max_rank=8, min_numel=0,
                                                                           budget_bytes=budget))
            codec = get_codec(codec_name, layout, rank=3)
            codec.min_numel = 0
            codec.fallback = {1: "int4"}  # the rest int8
            return codec

        def twins(t):
            return torch.stack([t, t])

        tri, rf = make(), make()
        low_tri, low_ref = getattr(tri, "lowrank", tri), getattr(rf, "lowrank", rf)
        low_tri.min_numel = low_ref.min_numel = 0
        calls = []
        encode, decode = tk.encode_triton, tk.decode_triton
        monkeypatch.setattr(tk, "encode_triton", lambda *a, **k: calls.append("enc") or encode(*a, **k))
        monkeypatch.setattr(tk, "decode_triton", lambda *a, **k: calls.append("dec") or decode(*a, **k))
        e_tri, e_ref = torch.zeros(off), torch.zeros(off)
        for rnd in range(2):
            v = bucket(40 + rnd)
            calls.clear()
            d_tri = tri.exchange(e_tri, twins, pseudo_grad=v)
            # P, Q, int8 and int4 fallback payloads, each encoded and decoded by the kernels
            assert calls.count("enc") == calls.count("dec") == 4, (rnd, calls)
            assert low_tri.lowranked() and {low_tri.fallback_of(i) for i in range(len(layout))
                                            if i not in low_tri.lowranked()} == {"int8", "int4"}
            with monkeypatch.context() as m:
                m.setattr(tk, "use_triton", lambda device: False)  # the reference path
                d_ref = rf.exchange(e_ref, twins, pseudo_grad=v)
            assert _same_bits(d_tri, d_ref) and _same_bits(e_tri, e_ref), rnd
            assert low_tri.bases.keys() == low_ref.bases.keys()
            assert all(_same_bits(low_tri.bases[i], low_ref.bases[i]) for i in low_tri.bases)

    def test_dispatch():
        assert tk.use_triton(torch.device("cpu"))  # interpreter on

    def test_kernel_rejects_bad_inputs():
        with pytest.raises(ValueError, match="x must be"):
            tk.encode_triton(torch.zeros(10), "int8", 256, anchor=torch.zeros(10), x=torch.zeros(10, dtype=torch.float16))
        with pytest.raises(ValueError, match="payloads must be"):
            tk.decode_triton(torch.zeros(2, 5, dtype=torch.uint8), ref.payload_layout(10, "int8"))
