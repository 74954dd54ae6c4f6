"""What authenticating a heal costs on the CPU: the sealed body of a shard's outer state (theta and the
outer momentum, fp32) built by the source and opened by the target, against a plain copy of the same bytes,
measured side by side in one process. Writes ``benchmarks/results/seal.json``.

    python benchmarks/federation/seal_bench.py [--elements 100e6] [--repeats 3]

Per size: ``encode_s`` (tensors to the body: the host copy and the JSON header), ``seal_s`` (HMAC-SHA256 over
it), ``open_s`` (the tag checked), ``decode_s`` (tensors rebuilt from the raw bytes), ``copy_s`` (one
``bytes`` copy of the same size: the floor any transport pays), best of ``--repeats``. A handshake message is a
few kB (negligible beside its two all-gathers); a heal happens once per job joining or falling behind.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_diloco.federation.auth import RunKey  # noqa: E402
from megatron_diloco.federation.transport import decode_state, encode_state  # noqa: E402


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def measure(numel: int, repeats: int) -> dict:
    key = RunKey(b"a benchmark's secret, 32 bytes..", "bench")
    state = {"theta": torch.randn(numel), "momentum_buffer": torch.randn(numel),
             "meta": {"rounds": 12, "position": {"steps": 360, "iteration": 360}}}
    ctx = {"quorum": 3, "step": 360 << 32, "rank": 0}
    encode_s, body = best(lambda: encode_state(state), repeats)
    seal_s, sealed = best(lambda: key.seal("heal", ctx, body), repeats)
    open_s, opened = best(lambda: key.open("heal", ctx, sealed), repeats)
    decode_s, got = best(lambda: decode_state(opened), repeats)
    copy_s, _ = best(lambda: bytes(bytearray(sealed)), repeats)
    assert torch.equal(got["theta"], state["theta"]) and torch.equal(got["momentum_buffer"], state["momentum_buffer"])
    gb = len(sealed) / 1e9
    return {"elements": numel, "body_bytes": len(sealed), "encode_s": encode_s, "seal_s": seal_s, "open_s": open_s,
            "decode_s": decode_s, "copy_s": copy_s,
            "seal_gb_per_s": gb / seal_s, "open_gb_per_s": gb / open_s, "copy_gb_per_s": gb / copy_s,
            "sealed_heal_vs_copy": (encode_s + seal_s + open_s + decode_s) / copy_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/seal.json")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    rows = [measure(int(n), args.repeats) for n in args.elements]
    for r in rows:
        print(json.dumps(r))
    args.out.write_text(json.dumps({"commit": commit, "machine": f"{platform.processor() or platform.machine()}, "
                                    f"{torch.get_num_threads()} threads", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
