"""How long an exchange takes, as the training loop measures it, when a peer launches it late.

Two replicas (one rank each) run ``partial`` overlap with auto tau and the default codec (int4) on a
flat shard, inner steps of a fixed host time (``--step-s``; on a GPU each step also synchronizes the compute
stream, as Megatron's per-step grad-norm ``.item()`` does). Replica 1 launches every exchange
``--delay-s`` late (a sleep injected before its launch, after the boundary's decision all-reduce),
so replica 0's exchange completes ``delay`` after its launch. The run reports what replica 0
measured for the first exchange (``exchange_s``) and the tau every rank agreed on at the next
boundary (``auto_tau_after``): the first should follow the delay (to within one inner step: the
completion is polled once per step), the second ``ceil(exchange_s / step_s)``.

On GPUs over NCCL (``--backend nccl``, one GPU per rank) this checks the path CI cannot run: NCCL
completes a collective's future when the collective is enqueued, so timing by the future read ~0 s.

Run (2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/throughput/exchange_timing.py --backend nccl \\
        --out benchmarks/results/nccl_exchange_timing.json

Writes ``{"card", "commit", "backend", "injected_delay_s", "measured_exchange_s", "auto_tau_after",
"step_s", "local_steps", "numel"}`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the package and the benchmarks from this checkout
    sys.path.insert(0, str(REPO))

from megatron_diloco.algorithm import sync as sync_module  # noqa: E402
from megatron_diloco.algorithm.config import DiLoCoXConfig  # noqa: E402
from megatron_diloco.algorithm.shard_view import ShardView  # noqa: E402


def delayed_launch_case(rank: int, world: int, delay_s: float, step_s: float, local_steps: int,
                        numel: int, device: str = "cpu") -> dict:
    """Run two rounds and a drain on the initialized default group (``world`` replicas, one rank
    each); replica ``world - 1`` launches each exchange ``delay_s`` late. Returns, on every rank,
    what this rank measured for the first exchange and the tau agreed at the second boundary."""
    cfg = DiLoCoXConfig(replicas=world, local_steps=local_steps, overlap="partial", compression="int4")
    dev = torch.device(device)
    param = torch.linspace(-1, 1, numel, device=dev)  # (numel,) fp32: the shard x
    sync = sync_module.OuterSync(ShardView([param]), cfg, dist.group.WORLD)
    if rank == world - 1:  # the late peer: sleep between the decision all-reduce and the launch
        start = sync_module.start_exchange

        def late_start(*a, **k):
            time.sleep(delay_s)
            return start(*a, **k)

        sync_module.start_exchange = late_start
    poll = getattr(sync, "poll", lambda: None)  # (older code had no poll: its timing came from the future)
    taus = []
    steps_timed, t_round = 0, time.perf_counter()
    for _t in range(2):
        for k in range(1, local_steps + 1):
            time.sleep(step_s)  # the inner step's host time
            param.sub_(1e-3 * (rank + 1))
            if dev.type == "cuda":  # Megatron's per-step .item() (grad norm, loss scale): a sync of the
                torch.cuda.current_stream(dev).synchronize()  # compute stream, not of the collective's
            steps_timed += 1
            poll()
            if sync.merge_due(k % local_steps):
                sync.merge()
            elif k == local_steps:
                sync.before_boundary((time.perf_counter() - t_round) / steps_timed)
                sync.boundary()
                taus.append(sync.tau)
                steps_timed, t_round = 0, time.perf_counter()
    first = sync.last_completed  # round 1's exchange (tau = H then: applied at the second boundary)
    sync.drain()
    return {"exchange_s": first.exchange_s, "taus": taus, "step_s": sync.step_time_s}


def _commit() -> str:
    """``DILOCO_COMMIT`` when set (a copied tree's git metadata may be another commit's), else git's."""
    if os.environ.get("DILOCO_COMMIT"):
        return os.environ["DILOCO_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--delay-s", type=float, default=2.0, help="how late replica 1 launches (default 2.0)")
    p.add_argument("--step-s", type=float, default=0.05, help="host time of one inner step (default 0.05)")
    p.add_argument("--local-steps", type=int, default=100, help="H (default 100)")
    p.add_argument("--numel", type=int, default=1 << 24, help="shard elements per rank (default 16M)")
    p.add_argument("--out", type=Path, default=None, help="JSON to write (rank 0)")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = "cpu"
    if a.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(a.backend)
    got = delayed_launch_case(rank, world, a.delay_s, a.step_s, a.local_steps, a.numel, device)
    rows = [None] * world
    dist.all_gather_object(rows, got)
    if rank == 0:
        record = {
            "card": torch.cuda.get_device_name() if device != "cpu" else "cpu",
            "commit": _commit(),
            "backend": a.backend,
            "injected_delay_s": a.delay_s,
            "measured_exchange_s": max(r["exchange_s"] for r in rows),
            "auto_tau_after": rows[0]["taus"][1],
            "expected_tau": math.ceil(max(r["exchange_s"] for r in rows) / max(r["step_s"] for r in rows)),
            "step_s": max(r["step_s"] for r in rows),
            "local_steps": a.local_steps,
            "numel": a.numel,
            "per_rank": rows,
        }
        print(json.dumps(record), flush=True)
        if a.out is not None:
            a.out.write_text(json.dumps(record, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
