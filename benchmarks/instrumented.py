"""Run ``examples/pretrain_gpt_diloco.py`` and record per-iteration times, losses and memory.

One process per rank (under torchrun). Writes ``$BENCH_OUT/rank{R}.json``::

    {"iter_s": [...], "losses": {iteration: loss}, "params_on_rank": N,
     "mem_after_setup_bytes": B, "max_mem_bytes": B, "device": "..."}

Iteration times are measured around Megatron's ``train_step`` with a device synchronization on both
sides, identically with and without ``--diloco-x``.

Slow link between replicas (``benchmarks/link_model.py``), when ``BENCH_LINK_MBPS`` is set (a number
in Mbit/s, or ``inf`` to count cross-replica bytes without slowing anything):
``BENCH_LINK_LATENCY_MS`` (default 5), ``BENCH_LINK_REPLICAS`` (R, default 2: contiguous blocks of
world/R ranks), ``BENCH_LINK_SHARE`` (``rank``: a link per rank, default; ``replica``: one per
replica). The rank file then also holds ``"link"`` (the model's totals per op kind) and
``"link_cum"``: per iteration, cumulative ``[wire bytes sent, modelled link s, waited s]`` of this rank.
With ``--diloco-x`` it holds ``"rounds"``: this rank's per-boundary metrics (bytes, exchange and
exposed seconds, ...), as logged in the ``[DiLoCoX] round`` lines.
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
_link = None  # the installed link model, if any


def install_link_model() -> None:
    """Install the slow-link model from ``BENCH_LINK_*`` (no-op when ``BENCH_LINK_MBPS`` is unset)."""
    global _link
    mbps = os.environ.get("BENCH_LINK_MBPS")
    if not mbps:
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    import link_model

    _link = link_model.install(float(mbps), float(os.environ.get("BENCH_LINK_LATENCY_MS", "5")),
                               int(os.environ.get("BENCH_LINK_REPLICAS", "2")),
                               os.environ.get("BENCH_LINK_SHARE", "rank"))
    rec["link_cum"] = []


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
        if _link is not None:
            _link.rebind()  # modules imported since install() bound the original collectives
        rec["tp_rank"] = ps.get_tensor_model_parallel_rank()
        rec["rank"] = dist.get_rank()
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
        if _link is not None:
            rec["link_cum"].append(list(_link.counters()))
        return out

    def training_log(loss_dict, *a, **k):
        if loss_dict:
            it = k["iteration"] if "iteration" in k else a[2]
            rec["losses"][it] = float(next(iter(loss_dict.values())))
        return orig_log(loss_dict, *a, **k)

    training.train_step, training.training_log = train_step, training_log
    training.setup_model_and_optimizer = setup_model_and_optimizer

    from megatron_diloco import integration

    orig_log_round = integration._Installation.log_round

    def log_round(self, m):
        rec.setdefault("rounds", []).append({k: (v if isinstance(v, (bool, int, float)) else float(v))
                                             for k, v in m.items()})
        return orig_log_round(self, m)

    integration._Installation.log_round = log_round

    if os.environ.get("BENCH_CHECK_BOUNDARIES") == "1":
        # after every DiLoCoX boundary: are the replicas bit-identical? (a fingerprint all-gather;
        # outside the timed train_step only in the sense that it runs inside step(): use for checks)
        from megatron_diloco.optimizer import DiLoCoXOptimizer

        orig_opt_step = DiLoCoXOptimizer.step
        rec["boundary_identical"] = []

        def step(self):
            out = orig_opt_step(self)
            if self.step_calls % self.diloco_config.local_steps == 0:
                rec["boundary_identical"].append([self.step_calls, self.replicas_identical()])
            return out

        DiLoCoXOptimizer.step = step


def main() -> None:
    script = str(REPO / "examples" / "pretrain_gpt_diloco.py")
    sys.argv = [script] + sys.argv[1:]
    from megatron_diloco import compat

    compat.apply_all()
    instrument()
    install_link_model()  # after Megatron's modules are imported (it rebinds their references)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if dist.is_initialized() and os.environ.get("BENCH_OUT"):
            if torch.cuda.is_available():
                rec["max_mem_bytes"] = torch.cuda.max_memory_allocated()
                rec["device"] = torch.cuda.get_device_name()
            if _link is not None:
                rec["link"] = _link.stats()
            Path(os.environ["BENCH_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
