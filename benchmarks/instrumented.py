"""Run ``examples/pretrain_gpt_diloco.py`` and record per-iteration times, losses and memory.

One process per rank (under torchrun). Writes ``$BENCH_OUT/rank{R}.json``::

    {"iter_s": [...], "losses": {iteration: loss}, "params_on_rank": N,
     "mem_after_setup_bytes": B, "max_mem_bytes": B, "device": "..."}

Iteration times are measured around Megatron's ``train_step`` with a device synchronization on both
sides, identically with and without ``--diloco-x``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

rec: dict = {"iter_s": [], "losses": {}, "params_on_rank": 0, "mem_after_setup_bytes": None}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument() -> None:
    import megatron.training.training as training

    orig_step, orig_log, orig_setup = training.train_step, training.training_log, training.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **k):
        out = orig_setup(*a, **k)
        model = out[0]
        rec["params_on_rank"] = sum(p.numel() for chunk in model for p in chunk.parameters())
        from megatron.core import parallel_state as ps

        rec["pp_rank"] = ps.get_pipeline_model_parallel_rank()
        _sync()
        if torch.cuda.is_available():
            rec["mem_after_setup_bytes"] = torch.cuda.memory_allocated()
        return out

    def train_step(*a, **k):
        _sync()
        t0 = time.perf_counter()
        out = orig_step(*a, **k)
        _sync()
        rec["iter_s"].append(time.perf_counter() - t0)
        return out

    def training_log(loss_dict, *a, **k):
        if loss_dict:
            it = k["iteration"] if "iteration" in k else a[2]
            rec["losses"][it] = float(next(iter(loss_dict.values())))
        return orig_log(loss_dict, *a, **k)

    training.train_step, training.training_log = train_step, training_log
    training.setup_model_and_optimizer = setup_model_and_optimizer


def main() -> None:
    script = str(REPO / "examples" / "pretrain_gpt_diloco.py")
    sys.argv = [script] + sys.argv[1:]
    from megatron_diloco import compat

    compat.apply_all()
    instrument()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if dist.is_initialized() and os.environ.get("BENCH_OUT"):
            if torch.cuda.is_available():
                rec["max_mem_bytes"] = torch.cuda.max_memory_allocated()
                rec["device"] = torch.cuda.get_device_name()
            Path(os.environ["BENCH_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
