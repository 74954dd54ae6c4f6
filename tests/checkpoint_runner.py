"""``tests/megatron_runner.py`` plus the records the checkpoint tests and benchmark need (one process per rank).

On top of everything ``megatron_runner`` records, per rank into ``$DILOCO_TEST_OUT/rank{R}.json``:

* ``scaler``: after every training iteration (global iteration number, also after a resume),
  ``[iteration, update_successful, scale, growth_tracker,
  hysteresis_tracker]`` of this rank's grad scaler (fp16 runs only; DiLoCoX and plain runs alike);
* ``adam_step``: after every iteration, the torch-Adam ``step`` count of this rank's first main shard;
* ``save_memory``: one entry per ``save_checkpoint`` call: ``rss_before`` (bytes, VmRSS before),
  ``rss_peak`` (VmHWM during the call, after resetting the high-water mark through
  ``/proc/self/clear_refs``), ``peak_delta`` = peak - before, and ``torch_peak_delta`` (the CUDA
  allocator's peak over the call when on GPU, else None). Linux only (None elsewhere);
* ``main_shard_numel``: the rank's fp32 main-shard elements (DiLoCoX and plain runs);
* ``model_fp``: after every iteration, ``[iteration, fingerprint]`` of all the rank's model parameters
  (:func:`megatron_diloco.shard_view.fingerprint`); ``loaded_model_fp``: the same right after
  ``load_checkpoint`` returned; ``opt_fp`` / ``loaded_opt_fp``: the same for the shard-sized optimizer
  state (Adam moments) of the rank's main shards;
* ``save_entries``: per save, what DiLoCoX adds to the sharded state dict: the number of
  ShardedTensors, their bytes, how many of them alias a live tensor (main shard, optimizer state,
  outer state: not a copy), the pickled size of each ShardedObject (skipped with
  ``DILOCO_CKPT_OBJECT_SIZES=0``: serializing them allocates), and the rank's shard numel;
* ``restart``: the reason string of each ``DiLoCoXOptimizer.restart_outer_loop_from_params`` call.

Nothing here changes training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_diloco.harness import wrap  # noqa: E402
from tests import megatron_runner as base  # noqa: E402

record = base.record


def _status_bytes(field: str) -> int | None:
    """``field`` (e.g. ``VmRSS``, ``VmHWM``) of /proc/self/status in bytes; None when unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0: ``5`` to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def instrument_checkpointing() -> None:
    import torch
    from megatron.training import checkpointing, training

    from megatron_diloco.optimizer import DiLoCoXOptimizer, distributed_optimizers
    from megatron_diloco.shard_view import fingerprint

    def opt_fp(opt) -> list[int]:
        """Bitwise fingerprint of the shard-sized optimizer state (e.g. Adam moments) of all main shards."""
        ts = [v for d in distributed_optimizers(getattr(opt, "inner", opt)) for g in d.optimizer.param_groups
              for p in g["params"] for _, v in sorted(d.optimizer.state.get(p, {}).items())
              if isinstance(v, torch.Tensor) and v.shape == p.shape]
        return [int(x) for x in fingerprint(ts)] if ts else []

    def model_fp(model) -> list[int]:
        """Bitwise fingerprint of every parameter of this rank's model chunks (its pipeline stage)."""
        return [int(x) for x in fingerprint([p for chunk in model for p in chunk.parameters()])]

    @wrap(training, "train_step")  # wrapped again by megatron_runner (iteration count) and install()
    def train_step(orig, *a, **k):
        out = orig(*a, **k)
        opt = a[3] if len(a) > 3 else k["optimizer"]
        opt = getattr(opt, "inner", opt)  # DiLoCoXOptimizer -> Megatron's optimizer
        d = distributed_optimizers(opt)[0]
        record.setdefault("main_shard_numel", sum(p.numel() for d_ in distributed_optimizers(opt)
                                                  for g in d_.optimizer.param_groups for p in g["params"]))
        # the global iteration this step completes (also after a resume)
        iteration = k["iteration"] + 1 if k.get("iteration") is not None else base.ctx["iteration"]
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
        before = _status_bytes("VmRSS")
        reset = _reset_peak_rss()
        out = orig(*a, **k)
        peak = _status_bytes("VmHWM") if reset else None
        entry = {"iteration": base.ctx["iteration"], "rss_before": before, "rss_peak": peak,
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
    def sharded_state_dict(orig, self, model_sd, is_loading=False, **k):
        sd = orig(self, model_sd, is_loading, **k)
        if not is_loading:
            import io

            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

            live = {t.data_ptr() for d in self.dist_opts for g in d.optimizer.param_groups for p in g["params"]
                    for t in [p, *[v for v in d.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]]}
            live |= {t.data_ptr() for t in (self.sync.theta, self.sync.outer.momentum_buffer, self.sync.delta,
                                           self.sync.residual, self.sync.eager_anchor) if t is not None}
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
                "shard_numel": self.view.numel,
            })
        return sd

    if hasattr(DiLoCoXOptimizer, "restart_outer_loop_from_params"):
        @wrap(DiLoCoXOptimizer, "restart_outer_loop_from_params")
        def restart(orig, self, reason, *a, **k):
            record.setdefault("restart", []).append(str(reason))
            return orig(self, reason, *a, **k)


def main() -> None:
    from megatron_diloco.compat import cpu as cpu_compat

    if cpu_compat.cpu_mode():
        cpu_compat.apply()
    instrument_checkpointing()
    base.main()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
