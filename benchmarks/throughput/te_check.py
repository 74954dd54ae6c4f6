"""Transformer Engine on this GPU: import, versions, and a bf16 te.Linear / te.LayerNormLinear /
te.TransformerLayer forward + backward against float64 references (fresh random inputs)."""

from __future__ import annotations

import importlib.metadata as md
import time

import torch

t0 = time.perf_counter()
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
import transformer_engine_torch as tex  # noqa: E402

print(f"import transformer_engine.pytorch: {time.perf_counter() - t0:.1f} s")
for d in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch", "torch"):
    print(f"  {d} {md.version(d)}")
print(f"  tex: {tex.__file__}\n  cuDNN (tex) {tex.get_cudnn_version()}  GPU {torch.cuda.get_device_name()}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


torch.manual_seed(int(time.time()))
dev, bf16 = "cuda", torch.bfloat16
ok = True

# te.Linear
lin = te.Linear(1024, 3072, bias=True, params_dtype=bf16).to(dev)
x = torch.randn(2048, 1024, device=dev, dtype=bf16, requires_grad=True)
y = lin(x)
g = torch.randn_like(y)
y.backward(g)
x64, w64, b64 = x.detach().double(), lin.weight.detach().double(), lin.bias.detach().double()
y_ref = x64 @ w64.T + b64
errs = {"y": rel(y, y_ref), "dx": rel(x.grad, g.double() @ w64), "dw": rel(lin.weight.grad, g.double().T @ x64),
        "db": rel(lin.bias.grad, g.double().sum(0))}
print("te.Linear bf16 rel err:", {k: f"{v:.2e}" for k, v in errs.items()})
ok &= all(v < 1e-2 for v in errs.values()) and torch.isfinite(y).all().item()

# te.LayerNormLinear (RMSNorm)
lnl = te.LayerNormLinear(1024, 1024, bias=False, normalization="RMSNorm", params_dtype=bf16).to(dev)
x = torch.randn(2048, 1024, device=dev, dtype=bf16, requires_grad=True)
y = lnl(x)
x64 = x.detach().double()
n = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + lnl.eps) * lnl.layer_norm_weight.detach().double()
e = rel(y, n @ lnl.weight.detach().double().T)
print(f"te.LayerNormLinear RMSNorm bf16 rel err: y {e:.2e}")
ok &= e < 1e-2
y.float().pow(2).mean().backward()
ok &= all(torch.isfinite(t).all().item() for t in (x.grad, lnl.weight.grad, lnl.layer_norm_weight.grad))

# te.TransformerLayer with causal attention (which backend TE picks is printed with NVTE_DEBUG)
layer = te.TransformerLayer(768, 3072, 12, params_dtype=bf16, self_attn_mask_type="causal",
                            normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0).to(dev)
x = torch.randn(512, 8, 768, device=dev, dtype=bf16, requires_grad=True)  # [s, b, h]
for _ in range(3):
    y = layer(x)
    y.float().pow(2).mean().backward()
torch.cuda.synchronize()
fin = torch.isfinite(y).all().item() and torch.isfinite(x.grad).all().item()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
ev[0].record()
for _ in range(10):
    y = layer(x)
    y.float().pow(2).mean().backward()
ev[1].record()
torch.cuda.synchronize()
print(f"te.TransformerLayer 768/3072/12 [512 x 8] bf16 fwd+bwd: finite {fin}, {ev[0].elapsed_time(ev[1]) / 10:.2f} ms")
ok &= fin
print("TE CHECK", "OK" if ok else "FAILED")
