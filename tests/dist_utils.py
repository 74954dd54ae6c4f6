"""Run a function on N gloo ranks in fresh processes, propagating failures.

The processes come from one fork server per test session (``multiprocessing``'s ``forkserver``),
started once with torch and the package imported: each rank is a fresh, single-threaded fork of it
(no CUDA, no process group yet) instead of a spawned interpreter that imports torch again (~2 s of
CPU per rank on 2 cores).
"""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from harness.runner import free_port


def _entry(rank: int, world: int, port: int, fn, args, errq) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: imported once by the fork server (the modules every rank function needs)
PRELOAD = ["torch", "torch.distributed", "megatron_diloco.algorithm.sync", "megatron_diloco.algorithm.compression",
           "tests.dist_utils"]


def run_world(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any rank fails."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    errq = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            errors.append((-1, "timeout"))
    if errors or any(p.exitcode != 0 for p in procs):
        raise AssertionError("distributed test failed:\n" + "\n".join(f"[rank {r}] {e}" for r, e in errors))
