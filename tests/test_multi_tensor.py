"""The package's multi-tensor gradient norm and scale (``megatron_adapter/multi_tensor.py``) against
Megatron's own fallbacks (``local_multi_tensor_l2_norm``, ``local_multi_tensor_scale``), their catalogue
entries, and where they are installed.

On CPU (the compat layer maps ``device="cuda"``) both run on the host: the norm equals the fallback's
within fp32 rounding and the scale bit for bit. On a GPU the same checks run on the device, plus the
point of the change: under ``torch.cuda.set_sync_debug_mode("error")`` the package's norm and scale make
no host synchronization, where Megatron's norm makes one per tensor (it fails there).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.core import utils
from megatron.core.optimizer import clip_grads

from megatron_diloco.compat import cpu
from megatron_diloco.megatron_adapter import multi_tensor, patches
from megatron_diloco.megatron_adapter.multi_tensor import multi_tensor_l2_norm, multi_tensor_scale

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def megatron_on_this_device():
    """Megatron's fallbacks and clipping place results with ``device="cuda"``: on CPU the compat layer's
    rewrite of CUDA placements (what every CPU run of this package has) for the test's duration, unless an
    earlier test in this process applied the compat layer for good (a second rewrite would stack)."""
    if DEVICE == "cuda" or cpu._applied:
        yield
        return
    with cpu._CudaToCpuMode():
        yield


def _grads(seed: int = 0, dtypes=(torch.float32,)) -> list[torch.Tensor]:
    """Gradient-like tensors: a GPT's shapes (embedding, matrices, norms, a bias) in ``dtypes`` in turn."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(512, 64), (192, 64), (64, 64), (64,), (256, 64), (64, 256), (64,), (1,), (3, 5, 7)]
    return [(torch.randn(s, generator=g) * 10 ** (i % 5 - 2)).to(DEVICE, dtypes[i % len(dtypes)])
            for i, s in enumerate(shapes)]


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int, device=DEVICE)


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)], ids=["fp32", "fp32+bf16"])
def test_norm_equals_megatrons_fallback_within_fp32_rounding(dtypes):
    grads = _grads(dtypes=dtypes)
    ours, none = multi_tensor_l2_norm(2048 * 32, _flag(), [grads], False)
    megatron, _ = utils.local_multi_tensor_l2_norm(2048 * 32, _flag(), [grads], False)
    exact = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in grads]))
    assert none is None and ours.shape == (1,) and ours.dtype == torch.float32 and ours.device.type == DEVICE
    torch.testing.assert_close(ours.cpu(), megatron.cpu(), rtol=2e-6, atol=0)
    torch.testing.assert_close(ours.double().cpu(), exact.reshape(1).cpu(), rtol=2e-6, atol=0)
    # several lists are one vector, as the fallback takes them
    both, _ = multi_tensor_l2_norm(0, _flag(), [grads[:4], grads[4:]], False)
    torch.testing.assert_close(both, ours, rtol=1e-6, atol=0)


def test_norm_of_no_tensors_is_zero():
    norm, _ = multi_tensor_l2_norm(0, _flag(), [[]], False)
    assert norm.tolist() == [0.0]


def test_scale_is_bit_identical_to_megatrons_in_place_and_into_other_tensors():
    grads, expected = _grads(1), _grads(1)
    multi_tensor_scale(0, _flag(), [grads, grads], 0.37)  # gradient clipping's call: in place
    utils.local_multi_tensor_scale(0, _flag(), [expected, expected], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    src = _grads(2)
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]  # fp32 main grads into bf16
    theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    multi_tensor_scale(0, _flag(), [src, ours], 1.0)
    utils.local_multi_tensor_scale(0, _flag(), [src, theirs], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    multi_tensor_scale(0, _flag(), [[], []], 2.0)  # nothing to scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronizations exist on a GPU only")
def test_no_host_synchronization_where_megatrons_norm_makes_one_per_tensor():
    grads = _grads(3)
    flag = _flag()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = multi_tensor_l2_norm(0, flag, [grads], False)
        multi_tensor_scale(0, flag, [grads, grads], 0.5)
        with pytest.raises(RuntimeError, match="synchroniz"):
            utils.local_multi_tensor_l2_norm(0, flag, [grads], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.item() > 0


def test_both_entries_are_catalogued_and_fit_the_installed_megatron():
    for patch, attribute in ((patches.MULTI_TENSOR_L2_NORM, "l2_norm_impl"),
                             (patches.MULTI_TENSOR_SCALE, "multi_tensor_scale_impl")):
        assert patch in patches.CATALOGUE and patches.problems(patch) == []
        assert patch.target == f"{clip_grads.__name__}.{attribute}"


def test_a_call_site_that_no_longer_passes_the_global_is_reported():
    """The check reads the caller: a site whose call does not pass the global by name is a problem."""
    wrong = patches.Patch("probe", clip_grads.__name__, "l2_norm_impl",
                          (patches.CallSite(clip_grads.__name__, "clip_grad_by_total_norm_fp32", "multi_tensor_applier",
                                            patches.ARGUMENT),), "probe", "probe", "probe")
    assert patches.problems(wrong) == [f"{wrong.called_from[0].where} no longer passes l2_norm_impl to "
                                       "multi_tensor_applier()"]
    with pytest.raises(patches.MegatronMoved, match="probe"):
        patches.verify(wrong)


def test_installed_on_cuda_over_megatrons_fallbacks_only(monkeypatch):
    """On CUDA without Apex or Transformer Engine ``install`` puts both kernels in ``clip_grads``, once;
    on CPU, or over another library's kernels, it changes nothing."""
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    args = argparse.Namespace()
    monkeypatch.setattr(cpu, "cpu_mode", lambda: True)
    assert not multi_tensor.install(args) and clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert patches.MULTI_TENSOR_L2_NORM not in patches.applying_to(args)
    monkeypatch.setattr(cpu, "cpu_mode", lambda: False)
    assert patches.MULTI_TENSOR_L2_NORM in patches.applying_to(args)
    assert multi_tensor.install(args)
    assert clip_grads.l2_norm_impl is multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale
    assert not multi_tensor.install(args)  # once
    assert patches.problems(patches.MULTI_TENSOR_L2_NORM) == []  # the check reads Megatron's source, not ours
    apex = lambda chunk_size, noop_flag, tensor_lists, per_tensor: (None, None)  # noqa: E731
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex)
    assert not multi_tensor.install(args) and clip_grads.l2_norm_impl is apex
    assert patches.MULTI_TENSOR_L2_NORM not in patches.applying_to(args)


@pytest.fixture
def process_group(tmp_path):
    """The default process group Megatron's norm all-reduces over: this process alone (gloo on CPU)."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1,
                                         init_method=f"file://{tmp_path / 'store'}")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_gradient_clipping_through_megatron_gives_the_fallbacks_result(monkeypatch, process_group):
    """Megatron's own ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on the package's
    kernels: the norm within fp32 rounding of the fallbacks', the clipped gradients bit-identical given
    the same norm."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(4)]

    def clipped(l2_norm, scale) -> tuple[float, list[torch.Tensor]]:
        monkeypatch.setattr(clip_grads, "l2_norm_impl", l2_norm)
        monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", scale)
        for p, g in zip(params, _grads(4), strict=True):
            p.grad = g
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
        return norm, [p.grad.clone() for p in params]

    megatron_norm, megatron = clipped(utils.local_multi_tensor_l2_norm, utils.local_multi_tensor_scale)
    norm, ours = clipped(multi_tensor_l2_norm, multi_tensor_scale)
    assert norm == pytest.approx(megatron_norm, rel=2e-6, abs=0) and norm > 1.0  # so it clips
    if norm == megatron_norm:
        assert all(torch.equal(a, b) for a, b in zip(ours, megatron, strict=True))
    for a, b in zip(ours, megatron, strict=True):
        torch.testing.assert_close(a, b, rtol=4e-6, atol=0)
