"""Throughput of the fused compression kernels vs a device-to-device copy and the torch reference.

    python benchmarks/codecs/kernel_bench.py --out benchmarks/results/kernel.json            # GPU, 1B elements
    TRITON_INTERPRET=1 python benchmarks/codecs/kernel_bench.py --numel 5000 --out /tmp/k.json  # CPU smoke

Bucket: x bf16, anchor and residual fp32 (the DiLoCoX encode inputs). GB/s count the bytes each
operation must read + write (its logical traffic, the same count for the kernel and the reference):

* copy:    read 4N, write 4N (fp32 ``dst.copy_(src)``): the roofline.
* encode:  read 4N anchor + 2N x + 4N e, write P payload + 4N e_new.
* decode:  read R*P payloads, write 4N Delta.
* decode_outer (fused Nesterov): read R*P + 4N theta + 4N m, write 4N theta + 4N m.

Times are medians (``triton.testing.do_bench`` on GPU; a perf_counter loop on CPU). Before timing, the
kernel and the reference are checked bit for bit on the first ``--check-numel`` elements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_diloco.algorithm.compression import reference as ref  # noqa: E402
from megatron_diloco.algorithm.compression import triton_kernels as tk  # noqa: E402
from megatron_diloco.algorithm.outer import OuterNesterov  # noqa: E402


def _bench(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()``."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=max(100, reps * 10), return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check_bit_exact(n: int, fmt: str, block: int, replicas: int, device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    anchor = torch.randn(n, device=device, generator=g)
    x = (anchor - 1e-2 * torch.randn(n, device=device, generator=g)).to(torch.bfloat16)
    e = 1e-3 * torch.randn(n, device=device, generator=g)
    e_ref, e_tri = torch.empty_like(e), torch.empty_like(e)
    p_ref = ref.encode_reference(e, fmt, block, anchor=anchor, x=x, residual_out=e_ref)
    p_tri = tk.encode_triton(e, fmt, block, anchor=anchor, x=x, residual_out=e_tri)
    ok = torch.equal(p_ref, p_tri) and torch.equal(e_ref.view(torch.int32), e_tri.view(torch.int32))
    layout = ref.payload_layout(n, fmt, block)
    payloads = torch.stack([p_ref] * replicas)
    ok &= torch.equal(ref.decode_reference(payloads, layout).view(torch.int32),
                      tk.decode_triton(payloads, layout).view(torch.int32))
    a = OuterNesterov(anchor.clone(), 0.7, 0.9, True)
    b = OuterNesterov(anchor.clone(), 0.7, 0.9, True)
    ref.decode_reference(payloads, layout, outer=a)
    tk.decode_triton(payloads, layout, outer=b)
    return bool(ok and torch.equal(a.theta.view(torch.int32), b.theta.view(torch.int32))
                and torch.equal(a.momentum_buffer.view(torch.int32), b.momentum_buffer.view(torch.int32)))


def _torchft_kernels(bucket: torch.Tensor, device: torch.device, reps: int) -> dict:
    """torchft's fused fp8 row-wise quantize and dequantize on ``bucket`` (fp32 ``[N]``) viewed as rows
    of 256 elements (our block size: as many scales as ours) and of 8192 (torchft's favourable case).

    Bytes: quantize reads 4N, writes N + 4 per row (+ its row padding); dequantize the reverse. Note
    what it does not do that our encode does: no pseudo-gradient (anchor - x), no error feedback."""
    import importlib.util

    found = importlib.util.find_spec("torchft")  # locates the package without running its __init__
    if found is None:
        raise SystemExit("--torchft: torchft is not installed (pip install torchft)")
    path = os.path.join(found.submodule_search_locations[0], "quantization.py")
    spec = importlib.util.spec_from_file_location("torchft_quantization", path)
    q = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)
    out = {}
    n = bucket.numel()
    for cols in (256, 8192):
        rows = n // cols
        mat = bucket[: rows * cols].view(rows, cols)
        quantized = q.fused_quantize_into_fp8([mat], 1)
        qbytes = 4 * rows * cols + quantized.numel()
        t = _bench(lambda: q.fused_quantize_into_fp8([mat], 1), device, reps)
        out[f"torchft_quantize_fp8_rows{cols}"] = {"gbps": qbytes / t / 1e9, "seconds": t, "bytes": qbytes}
        back = torch.empty_like(mat)
        t = _bench(lambda: q.fused_dequantize_from_fp8([back], quantized, 1), device, reps)
        out[f"torchft_dequantize_fp8_rows{cols}"] = {"gbps": qbytes / t / 1e9, "seconds": t, "bytes": qbytes}
        print("torchft", cols, out, flush=True)
        del quantized, back
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--numel", type=int, default=1_000_000_000, help="bucket elements (default 1B)")
    parser.add_argument("--fmt", default="int8", choices=ref.FORMATS)
    parser.add_argument("--block-size", type=int, default=ref.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--replicas", type=int, default=2, help="R payloads decoded")
    parser.add_argument("--check-numel", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions on CPU")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--sweep-decode", action="store_true",
                        help="also time the decode kernel at other launch shapes (elements per program x "
                             "warps), each checked bit for bit against the default shape")
    parser.add_argument("--torchft", action="store_true",
                        help="also time torchft's fused fp8 row-wise quantize / dequantize kernels on the "
                             "same bucket (torchft must be importable; its quantization module is loaded "
                             "alone, by path)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not tk.use_triton(device):
        sys.exit("kernel_bench needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke run)")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    n, fmt, block, r = args.numel, args.fmt, args.block_size, args.replicas
    bit_exact = _check_bit_exact(min(n, args.check_numel), fmt, block, r, device)
    layout = ref.payload_layout(n, fmt, block)
    p = layout.total_bytes

    # Inputs (x bf16; anchor, residual fp32), generated in place to spare memory.
    anchor = torch.empty(n, dtype=torch.float32, device=device).normal_()
    x = anchor.to(torch.bfloat16)
    residual = torch.zeros(n, dtype=torch.float32, device=device)

    results: dict = {"card": card, "numel": n, "format": fmt, "block_size": block, "replicas": r,
                     "bit_exact": bit_exact, "torch": torch.__version__}
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    results["copy_gbps"] = 8 * n / _bench(lambda: dst.copy_(src), device, args.reps) / 1e9
    del src, dst

    kernels = {}
    enc_bytes = 10 * n + p + 4 * n
    t = _bench(lambda: tk.encode_triton(residual, fmt, block, anchor=anchor, x=x), device, args.reps)
    kernels["encode"] = {"gbps": enc_bytes / t / 1e9, "seconds": t, "bytes": enc_bytes}
    payload = tk.encode_triton(residual, fmt, block, anchor=anchor, x=x)
    payloads = torch.stack([payload] * r)  # (R, P)
    del payload
    dec_bytes = r * p + 4 * n
    delta = torch.empty(n, dtype=torch.float32, device=device)
    t = _bench(lambda: tk.decode_triton(payloads, layout, out=delta), device, args.reps)
    kernels["decode"] = {"gbps": dec_bytes / t / 1e9, "seconds": t, "bytes": dec_bytes}
    if args.sweep_decode:
        want = tk.decode_triton(payloads, layout, out=delta).clone()
        sweep = []
        for elems in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                got = torch.empty_like(delta)
                tk.decode_triton(payloads, layout, out=got, elements_per_program=elems, num_warps=warps)
                same = torch.equal(got.view(torch.int32), want.view(torch.int32))
                t = _bench(lambda: tk.decode_triton(payloads, layout, out=delta, elements_per_program=elems,
                                                    num_warps=warps), device, args.reps)
                sweep.append({"elements_per_program": elems, "num_warps": warps, "gbps": dec_bytes / t / 1e9,
                              "bit_identical_to_default": same})
                print("decode sweep", sweep[-1], flush=True)
                del got
        kernels["decode"]["sweep"] = sweep
        del want
    del delta
    outer = OuterNesterov(anchor, 0.7, 0.9, True)  # theta aliases anchor (benchmark only)
    out_bytes = r * p + 16 * n
    t = _bench(lambda: tk.decode_triton(payloads, layout, outer=outer), device, args.reps)
    kernels["decode_outer"] = {"gbps": out_bytes / t / 1e9, "seconds": t, "bytes": out_bytes}

    if not args.no_reference:
        t = _bench(lambda: ref.encode_reference(residual, fmt, block, anchor=anchor, x=x), device, args.reps)
        kernels["encode"]["reference_gbps"] = enc_bytes / t / 1e9
        t = _bench(lambda: ref.decode_reference(payloads, layout), device, args.reps)
        kernels["decode"]["reference_gbps"] = dec_bytes / t / 1e9
        t = _bench(lambda: ref.decode_reference(payloads, layout, outer=outer), device, args.reps)
        kernels["decode_outer"]["reference_gbps"] = out_bytes / t / 1e9
    if args.torchft:
        del outer, payloads
        kernels.update(_torchft_kernels(anchor, device, args.reps))
    for k in kernels.values():
        k["fraction_of_copy"] = k["gbps"] / results["copy_gbps"]
        if "reference_gbps" in k:
            k["speedup_vs_reference"] = k["gbps"] / k["reference_gbps"]
    results["kernels"] = kernels
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
