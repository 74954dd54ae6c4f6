"""SDPA core attention (``megatron_adapter/sdpa_attention.py``) against Megatron-Core's local
``DotProductAttention``: same outputs and gradients within fp32 and bf16 rounding, masks, grouped
queries, dropout, the GPT layer spec, and the refusals.

Megatron needs the process-wide CPU shim (``compat.cpu``), so the comparisons run in one
subprocess: this file run as a script (``python tests/test_sdpa_attention.py``) prints one JSON
record per case; the tests read them. On a machine with CUDA the same script compares on the GPU,
where SDPA takes its flash / memory-efficient kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: (name, sq, b, np, ng, hn): ng < np is grouped-query attention, ng = 1 multi-query.
SHAPES = [("mha", 64, 2, 4, 4, 16), ("gqa", 96, 3, 8, 2, 32), ("mqa_odd", 33, 1, 4, 1, 8)]
#: relative error ||a - b|| / ||b|| allowed between the two modules
FP32_TOL, BF16_TOL = 1e-5, 2e-2


# --- the worker (a subprocess: Megatron patched for CPU) -------------------------------------------


def _setup():
    sys.path.insert(0, str(REPO))
    from megatron_diloco import compat

    compat.apply_all()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from harness.runner import free_port

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return torch, torch.device("cuda" if cuda else "cpu")


def _config(np_, ng, hn, dtype=None, **kw):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=np_ * hn, num_attention_heads=np_, num_query_groups=ng, kv_channels=hn,
                  attention_dropout=0.0, hidden_dropout=0.0, bf16=dtype == torch.bfloat16,
                  params_dtype=dtype or torch.float32, masked_softmax_fusion=False)
    return TransformerConfig(**{**fields, **kw})


def _pair(config, mask_type, layer_number=1, **kw):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_diloco.megatron_adapter.sdpa_attention import SDPADotProductAttention

    args = dict(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self", **kw)
    return DotProductAttention(**args), SDPADotProductAttention(**args)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _compare(torch, device, local, sdpa, sq, b, np_, ng, hn, dtype, mask=None, mask_type=None, ref=None):
    """Outputs and q / k / v gradients of both modules on the same random inputs and output grad,
    each against ``ref`` (the local module of an fp32 config; default ``local``) on fp32 inputs."""
    g = torch.Generator().manual_seed(sq * 1000 + np_ * 10 + ng)
    q, k, v = (torch.randn(s, b, h, hn, generator=g) for s, h in ((sq, np_), (sq, ng), (sq, ng)))
    grad = torch.randn(sq, b, np_ * hn, generator=g)
    outs = {}
    for name, module, dt in (("local", local, dtype), ("sdpa", sdpa, dtype), ("ref", ref or local, torch.float32)):
        leaves = [t.to(device, dt, copy=True).requires_grad_() for t in (q, k, v)]
        out = module(*leaves, None if mask is None else mask.to(device), attn_mask_type=mask_type)
        out.backward(grad.to(device, dt))
        outs[name] = [out.detach().float().cpu(), *(t.grad.float().cpu() for t in leaves)]
        assert torch.isfinite(outs[name][0]).all()
    keys = ("out", "dq", "dk", "dv")
    return {"shape": list(outs["sdpa"][0].shape), "expected_shape": [sq, b, np_ * hn],
            **{f"rel_{k}": _rel(s, l) for k, s, l in zip(keys, outs["sdpa"], outs["local"])},
            **{f"err_sdpa_{k}": _rel(s, r) for k, s, r in zip(keys, outs["sdpa"], outs["ref"])},
            **{f"err_local_{k}": _rel(l, r) for k, l, r in zip(keys, outs["local"], outs["ref"])}}


def _dropout_case(torch, device, np_=4, ng=2, hn=16, sq=32, b=2, p=0.3, draws=300):
    """Dropout: eval mode equals the local module; training mode drops (differs from eval) and its
    mean over many draws tends to the undropped output (inverted dropout is unbiased)."""
    from megatron.core.transformer.enums import AttnMaskType

    local, sdpa = _pair(_config(np_, ng, hn, attention_dropout=p), AttnMaskType.causal)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(sq, b, h, hn, generator=g).to(device) for h in (np_, ng, ng))
    local.eval(), sdpa.eval()
    exact_local, exact = local(q, k, v, None), sdpa(q, k, v, None)
    sdpa.train()
    first = sdpa(q, k, v, None)
    mean = sum(sdpa(q, k, v, None) for _ in range(draws)) / draws
    return {"rel_eval": _rel(exact, exact_local), "rel_one_draw": _rel(first, exact),
            "rel_mean_of_draws": _rel(mean, exact), "draws": draws, "p": p}


def _gpt_case(torch, device, dtype):
    """Two GPTs from the local and the SDPA layer spec with the same parameters (the first's copied
    into the second: on a GPU Megatron initializes from its RNG tracker, which the first build
    advanced): same state-dict keys, logits and parameter gradients."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_diloco.megatron_adapter.sdpa_attention import SDPADotProductAttention, get_gpt_layer_sdpa_spec

    config = _config(4, 2, 16, dtype, normalization="RMSNorm", add_bias_linear=False)
    models, results = [], []
    for spec in (get_gpt_layer_local_spec, get_gpt_layer_sdpa_spec):
        torch.manual_seed(0)
        model = GPTModel(config=config, transformer_layer_spec=spec(normalization="RMSNorm"), vocab_size=64,
                         max_sequence_length=48, position_embedding_type="rope").to(device, dtype)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model)
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 64, (2, 48), generator=g).to(device)
        position_ids = torch.arange(48, device=device).expand(2, -1)
        causal = torch.triu(torch.ones(48, 48, dtype=torch.bool, device=device), 1).expand(2, 1, 48, 48)
        loss = model(tokens, position_ids, causal, labels=tokens).float().mean()  # the data loader's mask
        loss.backward()
        logits = model(tokens, position_ids, causal).detach().float().cpu()
        grads = torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()])
        results.append((logits, grads))
    cores = [type(m.decoder.layers[0].self_attention.core_attention).__name__ for m in models]
    return {"core_attention": cores, "same_state_dict_keys": models[0].state_dict().keys() == models[1].state_dict().keys(),
            "sdpa_class": SDPADotProductAttention.__name__,
            "rel_logits": _rel(results[1][0], results[0][0]), "rel_grads": _rel(results[1][1], results[0][1])}


def _refusals(torch):
    """Each unsupported setting raises ValueError naming its flag."""
    import argparse

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_diloco.megatron_adapter import sdpa_attention as sa

    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)

    catch("window", lambda: _pair(_config(4, 4, 8, window_size=(16, 0)), AttnMaskType.causal))
    catch("softmax_type", lambda: _pair(_config(4, 4, 8, softmax_type="off-by-one"), AttnMaskType.causal))
    catch("mla_spec", lambda: sa.get_gpt_layer_sdpa_spec(multi_latent_attention=True))
    _, sdpa = _pair(_config(4, 4, 8), AttnMaskType.causal)
    x = torch.zeros(8, 1, 4, 8)
    catch("packed", lambda: sdpa(x, x, x, None, packed_seq_params=PackedSeqParams()))
    catch("bias", lambda: sdpa(x, x, x, None, attention_bias=torch.zeros(1)))
    base = dict(transformer_impl="local", context_parallel_size=1, reset_attention_mask=False, window_size=None,
                softmax_type="vanilla", multi_latent_attention=False)
    catch("args_ok", lambda: sa.check_args(argparse.Namespace(**base), flag="--attention-sdpa"))
    for key, change in (("args_te", {"transformer_impl": "transformer_engine"}), ("args_cp", {"context_parallel_size": 2}),
                        ("args_reset_mask", {"reset_attention_mask": True})):
        catch(key, lambda change=change: sa.check_args(argparse.Namespace(**{**base, **change}), flag="--attention-sdpa"))
    return out


def worker() -> None:
    torch, device = _setup()
    from megatron.core.transformer.enums import AttnMaskType

    records = []

    def emit(name, **rec):
        records.append({"case": name, **rec})
        print(json.dumps(records[-1]), flush=True)

    for dtype_name in ("fp32", "bf16"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]

        def compare(name, shape, mask_type=AttnMaskType.causal, **kw):
            sq, b, np_, ng, hn = shape
            local, sdpa = _pair(_config(np_, ng, hn, dtype), mask_type)
            ref, _ = _pair(_config(np_, ng, hn), mask_type)
            emit(f"{name}_{dtype_name}", dtype=dtype_name,
                 **_compare(torch, device, local, sdpa, *shape, dtype, ref=ref, **kw))

        for name, *shape in SHAPES:
            compare(f"causal_{name}", shape)
        # the data loader's causal mask given (the local module reads it, SDPA its own causal mask)
        shape = sq, b, np_, ng, hn = 64, 2, 4, 2, 16
        compare("causal_given_mask", shape, mask=torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1).expand(b, 1, sq, sq))
        # key padding (every row keeps at least its first 40 keys)
        pad = torch.zeros(b, 1, 1, sq, dtype=torch.bool)
        pad[0, ..., 40:], pad[1, ..., 50:] = True, True
        compare("padding", shape, mask_type=AttnMaskType.padding, mask=pad)
    # softmax scale given, and query-key layer scaling (layer 3: the local module's /3 then x3)
    sq, b, np_, ng, hn = 48, 2, 4, 4, 16
    local, sdpa = _pair(_config(np_, ng, hn), AttnMaskType.causal, softmax_scale=0.05)
    emit("softmax_scale_fp32", dtype="fp32", **_compare(torch, device, local, sdpa, sq, b, np_, ng, hn, torch.float32))
    local, sdpa = _pair(_config(np_, ng, hn, apply_query_key_layer_scaling=True), AttnMaskType.causal, layer_number=3)
    emit("layer_scaling_fp32", dtype="fp32", **_compare(torch, device, local, sdpa, sq, b, np_, ng, hn, torch.float32))
    emit("dropout", **_dropout_case(torch, device))
    emit("gpt_fp32", **_gpt_case(torch, device, torch.float32))
    emit("gpt_bf16", **_gpt_case(torch, device, torch.bfloat16))
    emit("refusals", **_refusals(torch))
    print("device", device, torch.cuda.get_device_name() if device.type == "cuda" else "cpu", flush=True)


# --- the tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in recs}


def _cases(records, prefix):
    found = {k: v for k, v in records.items() if k.startswith(prefix)}
    assert found, prefix
    return found


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_outputs_and_gradients_equal_the_local_module(records, dtype):
    """Causal (mask generated or given), key padding; MHA, GQA, MQA; odd length: output, dq, dk, dv."""
    tol = FP32_TOL if dtype == "fp32" else BF16_TOL
    cases = {k: v for k, v in records.items() if v.get("dtype") == dtype}
    assert len(cases) == len(SHAPES) + 2 + (2 if dtype == "fp32" else 0)
    for name, r in cases.items():
        assert r["shape"] == r["expected_shape"], name
        for key in ("out", "dq", "dk", "dv"):
            assert r[f"rel_{key}"] < tol, (name, key, r)
            if dtype == "bf16":  # SDPA in bf16 is no further from the fp32 result than the local module
                assert r[f"err_sdpa_{key}"] < 2 * r[f"err_local_{key}"] + 1e-3, (name, key, r)


def test_scale_and_layer_scaling(records):
    for name in ("softmax_scale_fp32", "layer_scaling_fp32"):
        assert records[name]["rel_out"] < FP32_TOL and records[name]["rel_dq"] < FP32_TOL, records[name]


def test_dropout_is_off_in_eval_and_unbiased_in_training(records):
    r = records["dropout"]
    assert r["rel_eval"] < FP32_TOL
    assert r["rel_one_draw"] > 0.1  # a draw with p = 0.3 drops
    assert r["rel_mean_of_draws"] < 0.1  # ~ sqrt(p / (1 - p) / draws) of one draw's spread


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt_from_the_sdpa_spec_equals_the_local_spec(records, dtype):
    r = records[f"gpt_{dtype}"]
    assert r["core_attention"] == ["DotProductAttention", r["sdpa_class"]]
    assert r["same_state_dict_keys"]
    logits_tol, grads_tol = (FP32_TOL, 1e-4) if dtype == "fp32" else (BF16_TOL, 5e-2)
    assert r["rel_logits"] < logits_tol and r["rel_grads"] < grads_tol, r


def test_unsupported_settings_are_refused_naming_the_flag(records):
    r = records["refusals"]
    assert r["args_ok"] is None
    expected = {"window": "--window-size", "softmax_type": "--softmax-type", "mla_spec": "--multi-latent-attention",
                "packed": "packed", "bias": "bias", "args_te": "--transformer-impl transformer_engine",
                "args_cp": "--context-parallel-size 2", "args_reset_mask": "--reset-attention-mask"}
    for key, text in expected.items():
        assert r[key] is not None and text in r[key], (key, r[key])
    assert all("--attention-sdpa" in r[k] for k in ("args_te", "args_cp", "args_reset_mask"))


if __name__ == "__main__":
    worker()
