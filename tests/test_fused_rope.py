"""The fused RoPE kernel (``megatron_adapter/fused_rope.py``) against Megatron's unfused
``_apply_rotary_pos_emb_bshd``, forward and backward, and its installation behind ``--rope-fusion``.

On CPU the kernel runs in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton is
imported, so one test re-runs this file in a fresh ``python -m pytest`` with the variable set (as
``test_compression_triton.py`` does); the kernel tests run there, on small shapes. On a GPU the same
checks run on the compiled kernel at the 85M GPT's shape [512, 256, 12, 64], with the speed of forward +
backward against Megatron's unfused RoPE (``pytest -s`` prints it).

What "the same" means: in fp32, equal to Megatron's result within fp32 rounding; in bf16 / fp16,
within one rounding of the exact result (Megatron's math on the inputs in fp32), which Megatron's own
low-precision path is not (it rounds cos, sin, each product and the sum to t's dtype); on the GPU
also no farther from it than Megatron's. The interpreter truncates fp32 to bf16 where the GPU rounds
to nearest, so there the bound is one unit in the last place rather than a half.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_diloco.compat import cpu
from megatron_diloco.megatron_adapter import fused_rope, patches
from megatron_diloco.megatron_adapter.fused_rope import fused_apply_rotary_pos_emb

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parent.parent


def _megatron_freqs(s: int, rot_dim: int, interleaved: bool = False, device: str = "cpu") -> torch.Tensor:
    """The angles Megatron's ``RotaryEmbedding`` gives attention: [s, 1, 1, rot_dim] fp32, position
    times 10000^(-2i / rot_dim), each frequency twice (the halves, or neighbours when interleaved)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _unfused(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def _run(fn, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, g: torch.Tensor):
    """(output, gradient of <output, g> for t) of ``fn`` on a leaf with t's strides."""
    x = t.detach().requires_grad_()
    y = fn(x, freqs, interleaved)
    (dx,) = torch.autograd.grad(y, x, g)
    return y.detach(), dx


def _check(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, g: torch.Tensor) -> None:
    """The fused kernel against Megatron's unfused RoPE, forward and backward (module docstring)."""
    out, grad = _run(fused_apply_rotary_pos_emb, t, freqs, interleaved, g)
    ref, ref_grad = _run(_unfused, t, freqs, interleaved, g)
    assert out.dtype == grad.dtype == t.dtype and out.shape == grad.shape == t.shape and out.is_contiguous()
    if t.dtype in (torch.float32, torch.float64):  # (cos and sin are fp32 in both: fp32's tolerance)
        torch.testing.assert_close(out, ref, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1.3e-6, atol=1e-5)
        return
    exact, exact_grad = _run(_unfused, t.float(), freqs, interleaved, g.float())
    eps = torch.finfo(t.dtype).eps
    rtol = eps if INTERPRETED and t.dtype == torch.bfloat16 else eps / 2 + 1e-6
    torch.testing.assert_close(out.float(), exact, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(grad.float(), exact_grad, rtol=rtol, atol=1e-6)
    if not INTERPRETED:  # round to nearest: never farther from the exact result than Megatron's
        assert (out.float() - exact).abs().max() <= (ref.float() - exact).abs().max()
        assert (grad.float() - exact_grad).abs().max() <= (ref_grad.float() - exact_grad).abs().max()


if not INTERPRETED:

    def test_kernel_under_triton_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]

    def test_the_patch_is_catalogued_for_rope_fusion_on_cuda_without_te(monkeypatch):
        assert patches.FUSED_ROPE in patches.CATALOGUE and patches.problems(patches.FUSED_ROPE) == []
        assert patches.FUSED_ROPE.target == f"{rope_utils.__name__}.fused_apply_rotary_pos_emb"
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)

        def applies(on: bool) -> bool:
            return patches.FUSED_ROPE in patches.applying_to(argparse.Namespace(apply_rope_fusion=on))

        monkeypatch.setattr(cpu, "cpu_mode", lambda: False)
        assert applies(True) and not applies(False)
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda t, freqs, interleaved=False: t)
        assert not applies(True)  # Transformer Engine's
        monkeypatch.setattr(cpu, "cpu_mode", lambda: True)
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
        assert not applies(True)

    def test_install_fills_megatrons_global_only_without_te_on_cuda(monkeypatch):
        """With rope fusion on CUDA and no Transformer Engine, ``install`` gives Megatron the kernel (its
        config then accepts the flag); otherwise it changes nothing, and never replaces TE's kernel."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
        monkeypatch.setattr(cpu, "cpu_mode", lambda: False)
        config = dict(num_layers=1, hidden_size=64, num_attention_heads=2, apply_rope_fusion=True)
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            TransformerConfig(**config)
        assert not fused_rope.install(argparse.Namespace(apply_rope_fusion=False))
        assert rope_utils.fused_apply_rotary_pos_emb is None
        assert fused_rope.install(argparse.Namespace(apply_rope_fusion=True))
        assert rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb
        assert TransformerConfig(**config).apply_rope_fusion
        assert not fused_rope.install(argparse.Namespace(apply_rope_fusion=True))  # once
        te = lambda t, freqs, transpose_output_memory=False, interleaved=False: t  # noqa: E731
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te)
        assert not fused_rope.install(argparse.Namespace(apply_rope_fusion=True))
        assert rope_utils.fused_apply_rotary_pos_emb is te

    def test_rope_fusion_is_refused_without_cuda_naming_the_fix(monkeypatch):
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
        monkeypatch.setattr(cpu, "cpu_mode", lambda: True)
        with pytest.raises(ValueError, match="runs on CUDA only. Add --no-rope-fusion"):
            fused_rope.install(argparse.Namespace(apply_rope_fusion=True))
        assert rope_utils.fused_apply_rotary_pos_emb is None
        assert not fused_rope.install(argparse.Namespace(apply_rope_fusion=False))

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
    def test_the_example_refuses_rope_fusion_on_cpu_before_training(tmp_path):
        """``--rope-fusion`` after the demo's ``--no-rope-fusion`` turns fusion on; on CPU the example stops
        with the fix named, before Megatron builds anything (one rank, forked from the tests' pre-imported
        process)."""
        from harness.launch import launch

        code, output = launch(ROOT / "examples" / "pretrain_gpt_diloco.py",
                              ["--no-diloco-x", "--mock-data", "--pipeline-model-parallel-size", "1", "--rope-fusion"],
                              tmp_path, nproc=1, timeout=120)
        assert code != 0 and "Add --no-rope-fusion" in output, output[-3000:]
        assert "building GPT" not in output and "apply_rope_fusion is not available" not in output

    @pytest.mark.parametrize("t_shape, freqs_shape, dtype, says", [
        ((8, 2, 16), (8, 1, 1, 16), torch.float32, r"t \[s, b, h, d\]"),
        ((8, 2, 3, 16), (8, 2, 1, 16), torch.float32, r"freqs \[s, 1, 1, rot_dim\]"),
        ((8, 2, 3, 16), (8, 1, 1, 7), torch.float32, "even rot_dim"),
        ((8, 2, 3, 16), (8, 1, 1, 32), torch.float32, "at most d"),
        ((8, 2, 3, 16), (4, 1, 1, 16), torch.float32, "every position"),
        ((8, 2, 3, 16), (8, 1, 1, 16), torch.int32, "fp32 freqs"),
    ])
    def test_bad_shapes_and_dtypes_are_refused(t_shape, freqs_shape, dtype, says):
        with pytest.raises(ValueError, match=says):
            fused_apply_rotary_pos_emb(torch.zeros(t_shape, dtype=dtype), torch.zeros(freqs_shape))

    def test_bf16_freqs_learned_freqs_and_cpu_tensors_are_refused():
        with pytest.raises(ValueError, match="fp32 freqs"):
            fused_apply_rotary_pos_emb(torch.zeros(8, 2, 3, 16), torch.zeros(8, 1, 1, 16, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="no gradient"):
            fused_apply_rotary_pos_emb(torch.zeros(8, 2, 3, 16), torch.zeros(8, 1, 1, 16, requires_grad=True))
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):  # CPU tensors without the interpreter
            fused_apply_rotary_pos_emb(torch.zeros(8, 2, 3, 16), torch.zeros(8, 1, 1, 16))

    # --- on a GPU: the compiled kernel ------------------------------------------------------------
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    SHAPE_85M = (512, 256, 12, 64)  # s, b, heads, head dim of the 85M GPT at micro-batch 256

    def _qkv_view(shape, dtype, generator_seed=0):
        """The key of a fused QKV [s, b, h, 3d] (a strided view, as Megatron passes it), and a gradient."""
        s, b, h, d = shape
        g = torch.Generator(device="cuda").manual_seed(generator_seed)
        qkv = torch.randn(s, b, h, 3 * d, device="cuda", dtype=dtype, generator=g)
        return qkv[..., d:2 * d], torch.randn(s, b, h, d, device="cuda", dtype=dtype, generator=g)

    @cuda
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_cuda_matches_megatron_at_the_85m_shape(dtype, interleaved):
        t, g = _qkv_view(SHAPE_85M, dtype)
        _check(t, _megatron_freqs(SHAPE_85M[0], SHAPE_85M[3], interleaved, "cuda"), interleaved, g)

    @cuda
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_cuda_partial_rotary_dim(dtype):
        t, g = _qkv_view((128, 8, 12, 64), dtype)
        _check(t, _megatron_freqs(128, 32, device="cuda"), False, g)  # --rotary-percent 0.5

    @cuda
    def test_cuda_speed_of_forward_and_backward_at_the_85m_shape():
        """Forward + backward of one call (Megatron makes two per layer: query and key), bf16."""
        t, g = _qkv_view(SHAPE_85M, torch.bfloat16)
        t = t.detach().requires_grad_()
        freqs = _megatron_freqs(SHAPE_85M[0], SHAPE_85M[3], device="cuda")

        def ms(fn, n=20):
            for _ in range(3):
                torch.autograd.grad(fn(t, freqs, False), t, g)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                torch.autograd.grad(fn(t, freqs, False), t, g)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / n

        fused, unfused = ms(fused_apply_rotary_pos_emb), ms(_unfused)
        moved = 4 * t.numel() * t.element_size()  # read t, write out; read the gradient, write t's
        print(f"\nRoPE {list(SHAPE_85M)} bf16, a view of the fused QKV, forward + backward on "
              f"{torch.cuda.get_device_name()}: fused {fused:.3f} ms ({moved / fused / 1e6:.0f} GB/s), "
              f"Megatron's unfused {unfused:.3f} ms ({unfused / fused:.1f}x)")
        assert fused < unfused

else:
    SHAPE = (8, 2, 3, 16)  # s, b, heads, head dim

    def _inputs(dtype, rot_dim, seed=0):
        """The key view of a fused QKV, a gradient, and angles that differ within each pair (every
        channel its own, up to 3 s radians: the transposed rotation is checked in general)."""
        s, b, h, d = SHAPE
        gen = torch.Generator().manual_seed(seed)
        qkv = torch.randn(s, b, h, 3 * d, generator=gen).to(dtype)
        freqs = 3 * s * torch.rand(s, 1, 1, rot_dim, generator=gen)
        return qkv[..., d:2 * d], freqs, torch.randn(SHAPE, generator=gen).to(dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
    def test_matches_megatron_forward_and_backward(dtype, interleaved, rot_dim):
        t, freqs, g = _inputs(dtype, rot_dim)
        _check(t, freqs, interleaved, g)

    @pytest.mark.parametrize("layout", ["batch_first", "channel_strided", "contiguous"])
    def test_any_strides_of_input_and_gradient(layout):
        s, b, h, d = SHAPE
        t, freqs, _ = _inputs(torch.float32, 16, seed=1)
        t = {"batch_first": t.transpose(0, 1).contiguous().transpose(0, 1),  # [s, b] strides swapped
             "channel_strided": t.transpose(2, 3).contiguous().transpose(2, 3),  # channel stride h
             "contiguous": t.contiguous()}[layout]
        g = torch.randn(b, s, h, d).transpose(0, 1)  # a strided gradient
        _check(t, freqs, False, g)

    def test_longer_freqs_use_the_first_positions():
        t, _, g = _inputs(torch.float32, 16)
        freqs = _megatron_freqs(3 * SHAPE[0], 16)
        out, grad = _run(fused_apply_rotary_pos_emb, t, freqs, False, g)
        ref, ref_grad = _run(_unfused, t, freqs[: SHAPE[0]], False, g)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad, ref_grad)

    def test_megatron_calls_it_for_rope_fusion(monkeypatch):
        """Installed, the kernel is what Megatron's ``apply_rotary_pos_emb`` runs under rope fusion, with
        the angles ``RotaryEmbedding`` makes, and gives its unfused result."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
        monkeypatch.setattr(cpu, "cpu_mode", lambda: False)
        assert fused_rope.install(argparse.Namespace(apply_rope_fusion=True))
        calls = []
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb",
                            lambda *a, **k: calls.append(k) or fused_apply_rotary_pos_emb(*a, **k))
        t, _, _ = _inputs(torch.float32, 16)
        freqs = _megatron_freqs(SHAPE[0], 16)
        configs = [TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, apply_rope_fusion=on)
                   for on in (True, False)]
        fused, unfused = (rope_utils.apply_rotary_pos_emb(t, freqs, config=c, cp_group=object())  # (packed only)
                          for c in configs)
        assert calls == [{"interleaved": False}]
        torch.testing.assert_close(fused, unfused)
