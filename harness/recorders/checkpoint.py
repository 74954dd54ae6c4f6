"""The checkpoint tests' recorder (``harness/run.py --record checkpoint,training``).

``checkpoint`` (the checkpoint tests and ``benchmarks/memory/checkpoint_memory.py``;
:class:`CheckpointRecorder`) writes, per rank:

* ``scaler``: after every training iteration (global iteration number, also after a resume),
  ``[iteration, update_successful, scale, growth_tracker, hysteresis_tracker]`` of this rank's
  grad scaler (fp16 runs only; DiLoCoX and plain runs alike);
* ``adam_step``: after every iteration, the torch-Adam ``step`` count of this rank's first main shard;
* ``save_memory``: one entry per ``save_checkpoint`` call: ``rss_before`` (bytes, VmRSS before),
  ``rss_peak`` (VmHWM during the call, after resetting the high-water mark through
  ``/proc/self/clear_refs``), ``peak_delta`` = peak - before, and ``torch_peak_delta`` (the CUDA
  allocator's peak over the call when on GPU, else None). Linux only (None elsewhere);
* ``main_shard_numel``: the rank's fp32 main-shard elements (DiLoCoX and plain runs);
* ``model_fp``: after every iteration, ``[iteration, fingerprint]`` of all the rank's model
  parameters (:func:`megatron_diloco.algorithm.shard_view.fingerprint`); ``loaded_model_fp``: the same right
  after ``load_checkpoint`` returned; ``opt_fp`` / ``loaded_opt_fp``: the same for the shard-sized
  optimizer state (Adam moments) of the rank's main shards;
* ``save_entries``: per save, what DiLoCoX adds to the sharded state dict: the number of
  ShardedTensors, their bytes, how many of them alias a live tensor (main shard, optimizer state,
  outer state: not a copy), the pickled size of each ShardedObject (skipped with
  ``DILOCO_CKPT_OBJECT_SIZES=0``: serializing them allocates), and the rank's shard numel;
* ``restart``: the reason string of each ``DiLoCoXOptimizer.restart_outer_loop_from_params`` call;
* ``timings_saved``: per save (``OuterCheckpoint.replica_meta``), ``[step_calls, timings]`` of the
  rank's ``OuterSync`` (``[step time, [last exchange bytes, seconds] or None, longest exchange]``:
  what auto tau is sized from);
  ``timings_loaded``: the same right after a checkpoint was loaded.

Environment: ``DILOCO_TEST_RESTART_AFTER_STEP=N`` calls ``restart_outer_loop_from_params`` on every
rank right after the N-th ``step()`` (once): a new outer loop started mid-run.

Nothing here changes training.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from .base import Recorder, fingerprint_ints, proc_status_bytes, wrap


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0: ``5`` to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class CheckpointRecorder(Recorder):
    """Grad scaler, Adam steps, save memory, fingerprints around saves and loads (module docstring)."""

    name = "checkpoint"
    keys = ("scaler", "adam_step", "save_memory", "main_shard_numel", "model_fp", "loaded_model_fp",
            "opt_fp", "loaded_opt_fp", "save_entries", "restart", "timings_saved", "timings_loaded")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        self.iteration = 0  # train_step calls in this process (as the training recorder counts them)

    def install(self) -> None:
        import torch
        from megatron.training import checkpointing, training

        from megatron_diloco.megatron_adapter.checkpoint import OuterCheckpoint
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer, distributed_optimizers

        record = self.record

        def opt_fp(opt) -> list[int]:
            """Bitwise fingerprint of the shard-sized optimizer state (e.g. Adam moments) of all main shards."""
            ts = [v for d in distributed_optimizers(getattr(opt, "inner", opt)) for g in d.optimizer.param_groups
                  for p in g["params"] for _, v in sorted(d.optimizer.state.get(p, {}).items())
                  if isinstance(v, torch.Tensor) and v.shape == p.shape]
            return fingerprint_ints(ts) if ts else []

        def model_fp(model) -> list[int]:
            """Bitwise fingerprint of every parameter of this rank's model chunks (its pipeline stage)."""
            return fingerprint_ints(p for chunk in model for p in chunk.parameters())

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            self.iteration += 1
            out = orig(*a, **k)
            opt = a[3] if len(a) > 3 else k["optimizer"]
            opt = getattr(opt, "inner", opt)  # DiLoCoXOptimizer -> Megatron's optimizer
            d = distributed_optimizers(opt)[0]
            record.setdefault("main_shard_numel", sum(p.numel() for d_ in distributed_optimizers(opt)
                                                      for g in d_.optimizer.param_groups for p in g["params"]))
            # the global iteration this step completes (also after a resume)
            iteration = k["iteration"] + 1 if k.get("iteration") is not None else self.iteration
            if d.grad_scaler is not None:
                sd = d.grad_scaler.state_dict()
                record.setdefault("scaler", []).append([
                    iteration, not bool(out[1]), float(sd["scale"].item()),
                    int(sd.get("growth_tracker", -1)), int(sd.get("hysteresis_tracker", -1))])
            first = next((p for g in d.optimizer.param_groups for p in g["params"]), None)
            st = d.optimizer.state.get(first, {}) if first is not None else {}
            if "step" in st:
                record.setdefault("adam_step", []).append([iteration, float(st["step"])])
            record.setdefault("model_fp", []).append([iteration, model_fp(a[2] if len(a) > 2 else k["model"])])
            record.setdefault("opt_fp", []).append([iteration, opt_fp(a[3] if len(a) > 3 else k["optimizer"])])
            return out

        def load_checkpoint(orig, model, *a, **k):
            out = orig(model, *a, **k)
            record["loaded_model_fp"] = model_fp(model)
            optimizer = a[0] if a else k.get("optimizer")
            if optimizer is not None:
                record["loaded_opt_fp"] = opt_fp(optimizer)
            return out

        for module in (checkpointing, training):
            wrap(module, "load_checkpoint")(load_checkpoint)

        def save_checkpoint(orig, *a, **k):
            on_gpu = torch.cuda.is_available()
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                cuda_before = torch.cuda.memory_allocated()
            before = proc_status_bytes("VmRSS")
            reset = _reset_peak_rss()
            out = orig(*a, **k)
            peak = proc_status_bytes("VmHWM") if reset else None
            entry = {"iteration": self.iteration, "rss_before": before, "rss_peak": peak,
                     "peak_delta": (peak - before) if peak is not None and before is not None else None,
                     "torch_peak_delta": None}
            if on_gpu:
                torch.cuda.synchronize()
                entry["torch_peak_delta"] = torch.cuda.max_memory_allocated() - cuda_before
            record.setdefault("save_memory", []).append(entry)
            return out

        # training.py imported save_checkpoint by name: wrap both references
        for module in (checkpointing, training):
            wrap(module, "save_checkpoint")(save_checkpoint)

        @wrap(DiLoCoXOptimizer, "sharded_state_dict")
        def sharded_state_dict(orig, opt, model_sd, is_loading=False, **k):
            sd = orig(opt, model_sd, is_loading, **k)
            if not is_loading:
                from megatron.core.dist_checkpointing.dict_utils import nested_values
                from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

                live = {t.data_ptr() for d in opt.dist_opts for g in d.optimizer.param_groups for p in g["params"]
                        for t in [p, *[v for v in d.optimizer.state.get(p, {}).values()
                                       if isinstance(v, torch.Tensor)]]}
                live |= {t.data_ptr() for t in (opt.sync.theta, opt.sync.outer.momentum_buffer, opt.sync.exchange_buffer,
                                               opt.sync.residual, opt.sync.eager_anchor) if t is not None}
                ours = [v for key, v in sd.items() if str(key).startswith("diloco_x")]
                tensors = [v for v in nested_values(ours) if isinstance(v, ShardedTensor)]
                objects = [v for v in nested_values(ours) if isinstance(v, ShardedObject)]
                sizes = []  # serializing allocates: off for memory measurements (DILOCO_CKPT_OBJECT_SIZES=0)
                for obj in objects if os.environ.get("DILOCO_CKPT_OBJECT_SIZES", "1") == "1" else ():
                    buf = io.BytesIO()
                    torch.save(obj.data, buf)
                    sizes.append(buf.tell())
                record.setdefault("save_entries", []).append({
                    "tensors": len(tensors),
                    "tensor_bytes": sum(t.data.numel() * t.data.element_size() for t in tensors),
                    "aliased": sum(t.data.data_ptr() in live for t in tensors),
                    "object_bytes": sizes,
                    "shard_numel": opt.view.numel,
                })
            return sd

        @wrap(DiLoCoXOptimizer, "restart_outer_loop_from_params")
        def restart(orig, opt, reason, *a, **k):
            record.setdefault("restart", []).append(str(reason))
            return orig(opt, reason, *a, **k)

        def timings(opt) -> list:
            sync, last = opt.sync, opt.sync.last_completed
            return [sync.step_time_s, None if last is None else [last.bytes_sent, last.exchange_s],
                    sync.longest_exchange_s]

        @wrap(OuterCheckpoint, "replica_meta")  # called when a checkpoint is written
        def replica_meta(orig, codec, counters):
            record.setdefault("timings_saved", []).append([counters.step_calls, timings(codec)])
            return orig(codec, counters)

        @wrap(DiLoCoXOptimizer, "load_state_dict")
        def load_state_dict(orig, opt, state_dict):
            orig(opt, state_dict)
            record["timings_loaded"] = [opt.step_calls, timings(opt)]

        restart_after = int(os.environ.get("DILOCO_TEST_RESTART_AFTER_STEP", "0"))
        if restart_after:
            done = []

            @wrap(DiLoCoXOptimizer, "step")
            def step(orig, opt):
                out = orig(opt)
                if opt.step_calls == restart_after and not done:
                    done.append(True)
                    opt.restart_outer_loop_from_params(f"test: restart after step {restart_after}")
                return out
