"""The ``codec_capture`` recorder (``harness/run.py --record codec_capture``): real pseudo-gradients
saved to files for ``benchmarks/codecs/codecs_bench.py`` (:class:`CodecCaptureRecorder`; configured by
``CODEC_CAPTURE_*``, :class:`CodecCaptureConfig`, as ``benchmarks/codecs/codec_capture.py`` sets them)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from .base import Recorder, wrap


@dataclasses.dataclass(frozen=True)
class CodecCaptureConfig:
    """What the ``codec_capture`` recorder saves (set by ``benchmarks/codecs/codec_capture.py``)."""

    out: Path
    rounds: frozenset[int]
    """1-based outer rounds to capture."""
    replica0_only: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> CodecCaptureConfig:
        """From ``CODEC_CAPTURE_OUT`` (required), ``CODEC_CAPTURE_ROUNDS`` (comma-separated),
        ``CODEC_CAPTURE_REPLICA0_ONLY`` (``1``)."""
        if not env.get("CODEC_CAPTURE_OUT"):
            raise SystemExit("harness: the codec_capture recorder needs CODEC_CAPTURE_OUT")
        return cls(Path(env["CODEC_CAPTURE_OUT"]),
                   frozenset(int(r) for r in env.get("CODEC_CAPTURE_ROUNDS", "").split(",") if r),
                   env.get("CODEC_CAPTURE_REPLICA0_ONLY") == "1")


def _named_params(opt) -> dict:
    """{name: param} of every model chunk the DiLoCoX optimizer's inner optimizers update."""
    out = {}
    seen = set()
    for d in opt.dist_opts:
        for ci, chunk in enumerate(d.model_chunks):
            for name, p in chunk.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = name.removeprefix("module.")
                out[name if len(d.model_chunks) == 1 else f"chunk{ci}.{name}"] = p
    return out


def _snapshot(opt) -> dict:
    import torch

    return {n: p.detach().to(torch.float32, copy=True).cpu() for n, p in _named_params(opt).items()}


class CodecCaptureRecorder(Recorder):
    """For every outer round k in the config, the per-parameter pseudo-gradient of each rank

        delta = (params at the start of round k) - (params at the end of round k)

    with full parameter shapes (the model's ``named_parameters`` on the rank):

    * round start: right before the first inner ``step()`` of the round, i.e. right after the
      previous boundary's ``DiLoCoXOptimizer.step`` returned (x == theta; round 1: the initial params);
    * round end: right before ``OuterSync.boundary`` runs at the end of the round.

    Saved as ``OUT/round{k}_replica{r}_stage{s}.pt`` = ``{"delta": {name: fp32 tensor}, "meta":
    {...}}`` (``meta``: round, iterations, rank, replica, stage, the boundary's own shard
    pseudo-gradient norm as a cross-check). No record keys."""

    name = "codec_capture"

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        self.config = CodecCaptureConfig.from_env()

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer
        from megatron_diloco.algorithm.sync import OuterSync

        cfg = self.config
        owner: dict[int, DiLoCoXOptimizer] = {}  # id(OuterSync) -> its optimizer
        starts: dict[int, dict] = {}  # round -> snapshot at the round start

        def saving(opt) -> bool:
            return not cfg.replica0_only or opt.topology.replica_index == 0

        @wrap(DiLoCoXOptimizer, "step")
        def step(orig, opt):
            owner[id(opt.sync)] = opt
            H = opt.diloco_config.local_steps
            if opt.step_calls % H == 0:  # first inner step of round k: params = round start
                k = opt.step_calls // H + 1
                if k in cfg.rounds and saving(opt):
                    starts[k] = _snapshot(opt)
            return orig(opt)

        @wrap(OuterSync, "boundary")
        def boundary(orig, sync):
            opt = owner.get(id(sync))
            k = sync.rounds + 1  # the boundary about to run ends round k
            delta = None
            if opt is not None and k in starts:
                end = _snapshot(opt)
                delta = {n: starts[k][n] - end[n] for n in end}  # start - end, fp32, full shapes
                del starts[k]
            t0 = time.perf_counter()
            report = orig(sync)
            if delta is not None:
                from megatron.core import parallel_state as ps

                sq = sum(float(v.double().square().sum()) for v in delta.values())
                H = opt.diloco_config.local_steps
                meta = {
                    "round": k,
                    "iterations": [(k - 1) * H + 1, k * H],
                    "rank": dist.get_rank(),
                    "replica": opt.topology.replica_index,
                    "stage": ps.get_pipeline_model_parallel_rank(),
                    "pp_size": ps.get_pipeline_model_parallel_world_size(),
                    "numel": sum(v.numel() for v in delta.values()),
                    "delta_norm": sq ** 0.5,
                    # the boundary's own ||theta - x|| over this rank's fp32 main shard (cross-check)
                    "boundary_shard_norm": float(report.pseudo_grad_sq) ** 0.5,
                    "boundary_s": time.perf_counter() - t0,
                }
                name = f"round{k}_replica{meta['replica']}_stage{meta['stage']}.pt"
                torch.save({"delta": delta, "meta": meta}, cfg.out / name)
                print(f"[codec_capture] rank {meta['rank']}: saved {name}: {len(delta)} tensors, "
                      f"{meta['numel']} elements, ||delta|| {meta['delta_norm']:.6g} "
                      f"(boundary shard norm {meta['boundary_shard_norm']:.6g})", flush=True)
            return report
