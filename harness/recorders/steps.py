"""The benchmarks' recorders of a training run's steps (``harness/run.py --record NAME,...``); the slow
link and the WAN benchmark's: ``network.py``; ``codec_capture``: ``codec_capture.py``.

Each writes its keys into the rank's record ``rank{R}.json``; what they hold:

* ``timers``: ``iter_s`` (each Megatron ``train_step``, timed with a device synchronization on both
  sides, identically with and without ``--diloco-x``), ``iter_stream_s`` (CUDA only: the same step
  until the training thread's current stream drained, just before the closing device
  synchronization: without the work of other streams, e.g. a DiLoCoX worker thread's),
  ``plugin_s`` (with ``--diloco-x``: per ``DiLoCoXOptimizer.step`` call, its host wall time less
  the wrapped inner optimizer's ``step``: what the plugin itself adds to the step, boundary work
  included on the steps that carry it; no device synchronization, so GPU work it enqueues is not
  in it), ``params_on_rank``, ``pp_rank``, ``tp_rank``,
  ``rank``, ``mem_after_setup_bytes`` / ``max_mem_bytes`` / ``device`` (CUDA only) and ``completed``
  (the script returned normally);
* ``losses``: ``{iteration: loss}`` of the logging ranks;
* ``memory``: ``mem_after_step_bytes`` (``torch.cuda.memory_allocated()`` after each ``train_step``,
  CUDA only: the steady footprint once the optimizer state exists), ``host_rss_bytes`` /
  ``host_hwm_bytes`` (this process's resident set at the end / its high-water mark, from
  ``/proc/self/status``), ``outer_host_bytes`` / ``outer_staging_bytes`` (with ``--diloco-x``: the
  outer state kept in host memory and the device staging buffers,
  ``megatron_diloco.algorithm.outer_store.OuterStore``);
* ``rounds``: with ``--diloco-x``, this rank's per-boundary metrics (bytes, exchange and exposed
  seconds, ...), as logged in the ``[DiLoCoX] round`` lines;
* ``boundary_check``: ``boundary_identical``: after every DiLoCoX boundary, ``[step, replicas
  bit-identical]`` (a fingerprint all-gather inside ``step()``: for checks, not timings);
* ``fixed_eval``: every evaluation (Megatron's periodic one and the one after training) sees the same
  batches: the first ``--eval-iters`` batches of each evaluation data stream, cached on first use and
  replayed (by default each evaluation takes the stream's next batches);
* ``plain_ddp``: the example's argument parsing ignores ``--use-distributed-optimizer`` (its demo
  defaults add it): plain Megatron DDP, gradients all-reduced;
* ``megatron_multi_tensor``: gradient clipping keeps Megatron's multi-tensor fallbacks (one host read-back
  per gradient's norm) instead of the package's kernels, where neither Apex nor Transformer Engine is there;
* ``profile``: a window of steps under ``torch.profiler``: the top ops and kernels by device time
  (:class:`ProfileRecorder`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .base import Recorder, on_losses, params_on_rank, proc_status_bytes, wrap


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimersRecorder(Recorder):
    """Step times, parameters and device memory of the rank (see the module docstring)."""

    name = "timers"
    keys = ("iter_s", "iter_stream_s", "plugin_s", "params_on_rank", "pp_rank", "tp_rank", "rank",
            "mem_after_setup_bytes", "max_mem_bytes", "device", "completed")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record.update(iter_s=[], iter_stream_s=[], plugin_s=[], params_on_rank=0, mem_after_setup_bytes=None,
                      completed=False)

    def install(self) -> None:
        import megatron.training.training as training
        import torch
        import torch.distributed as dist

        rec = self.record

        @wrap(training, "setup_model_and_optimizer")
        def setup_model_and_optimizer(orig, *a, **k):
            out = orig(*a, **k)
            from megatron.core import parallel_state as ps

            rec["params_on_rank"] = params_on_rank(out[0])
            rec["pp_rank"] = ps.get_pipeline_model_parallel_rank()
            rec["tp_rank"] = ps.get_tensor_model_parallel_rank()
            rec["rank"] = dist.get_rank()
            _sync()
            if torch.cuda.is_available():
                rec["mem_after_setup_bytes"] = torch.cuda.memory_allocated()
            return out

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            _sync()
            t0 = time.perf_counter()
            out = orig(*a, **k)
            if torch.cuda.is_available():  # (ends no later than the device sync: iter_s unchanged)
                torch.cuda.current_stream().synchronize()
                rec["iter_stream_s"].append(time.perf_counter() - t0)
            _sync()
            rec["iter_s"].append(time.perf_counter() - t0)
            return out

        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        inner_s = [0.0]  # the last inner step's wall time

        @wrap(DiLoCoXOptimizer, "step")
        def step(orig, opt):
            if "step" not in vars(opt.inner):  # time the wrapped optimizer's step (once per instance)
                real = opt.inner.step

                def timed(*a, **k):
                    t = time.perf_counter()
                    try:
                        return real(*a, **k)
                    finally:
                        inner_s[0] = time.perf_counter() - t

                opt.inner.step = timed
            t0 = time.perf_counter()
            out = orig(opt)
            rec["plugin_s"].append(time.perf_counter() - t0 - inner_s[0])
            return out

    def finalize(self, completed: bool) -> None:
        import torch
        import torch.distributed as dist

        self.record["completed"] = completed
        if dist.is_initialized() and torch.cuda.is_available():
            self.record["max_mem_bytes"] = torch.cuda.max_memory_allocated()
            self.record["device"] = torch.cuda.get_device_name()


class LossesRecorder(Recorder):
    """``losses``: ``{iteration: loss}`` (the first entry of Megatron's loss dict)."""

    name = "losses"
    keys = ("losses",)

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record["losses"] = {}

    def install(self) -> None:
        import megatron.training.training as training

        def record_loss(iteration: int, loss_dict: dict) -> None:
            self.record["losses"][iteration] = float(next(iter(loss_dict.values())))

        on_losses(training, record_loss)


class MemoryRecorder(Recorder):
    """Steady device memory per step, host memory, and where DiLoCoX keeps its outer state."""

    name = "memory"
    keys = ("mem_after_step_bytes", "host_rss_bytes", "host_hwm_bytes", "outer_host_bytes", "outer_staging_bytes")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record.update(mem_after_step_bytes=[], host_rss_bytes=None, host_hwm_bytes=None,
                      outer_host_bytes=None, outer_staging_bytes=None)

    def install(self) -> None:
        import megatron.training.training as training
        import torch

        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        rec = self.record

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            out = orig(*a, **k)
            if torch.cuda.is_available():
                rec["mem_after_step_bytes"].append(torch.cuda.memory_allocated())
            return out

        @wrap(DiLoCoXOptimizer, "finish")
        def finish(orig, opt):
            orig(opt)
            store = opt.sync.store
            rec["outer_host_bytes"] = store.host_bytes()
            rec["outer_staging_bytes"] = store.staging_bytes()

    def finalize(self, completed: bool) -> None:
        self.record["host_rss_bytes"] = proc_status_bytes("VmRSS")
        self.record["host_hwm_bytes"] = proc_status_bytes("VmHWM")


class RoundsRecorder(Recorder):
    """``rounds``: the metrics of every ``[DiLoCoX] round`` line of this rank."""

    name = "rounds"
    keys = ("rounds",)

    def install(self) -> None:
        from megatron_diloco.megatron_adapter import integration

        @wrap(integration._Installation, "log_round")
        def log_round(orig, inst, m):
            self.record.setdefault("rounds", []).append(
                {k: (v if isinstance(v, (bool, int, float)) else float(v)) for k, v in m.items()})
            return orig(inst, m)


class BoundaryCheckRecorder(Recorder):
    """``boundary_identical``: replicas bit-identical after every boundary (fingerprint all-gather)."""

    name = "boundary_check"
    keys = ("boundary_identical",)

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record["boundary_identical"] = []

    def install(self) -> None:
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        @wrap(DiLoCoXOptimizer, "step")
        def step(orig, opt):
            out = orig(opt)
            if opt.sync.schedule.steps_since_boundary(opt.step_calls) == 0:  # H, or H0 in a warm-up
                self.record["boundary_identical"].append([opt.step_calls, opt.replicas_identical()])
            return out


class FixedEvalRecorder(Recorder):
    """Every ``evaluate`` call replays the same batches of its data iterator (no record keys)."""

    name = "fixed_eval"

    def install(self) -> None:
        import megatron.training.training as training

        seen: dict[int, tuple[list, object]] = {}  # id(iterator) -> (batches so far, iterator kept alive)

        @wrap(training, "evaluate")
        def evaluate(orig, forward_step_func, data_iterator, *a, **k):
            if data_iterator is None or isinstance(data_iterator, list):  # no data on this stage / VPP
                return orig(forward_step_func, data_iterator, *a, **k)
            batches, _ = seen.setdefault(id(data_iterator), ([], data_iterator))

            def replay():
                yield from list(batches)
                while True:  # only on the first evaluation (or a longer one)
                    try:
                        batch = next(data_iterator)  # (Megatron's RerunDataIterator has no __iter__)
                    except StopIteration:
                        return
                    batches.append(batch)
                    yield batch

            return orig(forward_step_func, replay(), *a, **k)


class PlainDDPRecorder(Recorder):
    """Drops ``--use-distributed-optimizer`` from the example's flags: plain DDP (no record keys)."""

    name = "plain_ddp"

    def install(self) -> None:
        import megatron.training.arguments as arguments

        @wrap(arguments, "parse_and_validate_args")
        def parse_and_validate_args(orig, *a, **k):
            sys.argv = [x for x in sys.argv if x != "--use-distributed-optimizer"]
            return orig(*a, **k)


class MegatronMultiTensorRecorder(Recorder):
    """Keeps Megatron's own multi-tensor fallbacks in gradient clipping (the package's device-side norm
    and scale, ``megatron_adapter.multi_tensor.install``, not installed): the before of that change
    (no record keys)."""

    name = "megatron_multi_tensor"

    def install(self) -> None:
        from megatron_diloco.megatron_adapter import multi_tensor

        @wrap(multi_tensor, "install")
        def install(orig, *a, **k):
            return False


class ProfileRecorder(Recorder):
    """``profile``: ``train_step`` calls FIRST..LAST (1-based, ``BENCH_PROFILE_STEPS=FIRST:LAST``,
    default 12:13) under ``torch.profiler`` (CPU and CUDA): ``profile_steps``, ``profile_table`` (the
    ops and kernels by self device time, ``key_averages().table``, 40 rows) and
    ``profile_device_ms_per_step`` (the kernels' device time per step, the table's "Self CUDA time
    total" over the steps; on CPU the ops' CPU time). With ``BENCH_PROFILE_TRACE=PATH`` (rank 0) also the
    timeline, as a Chrome trace (gzipped when PATH ends in ``.gz``): ``profile_trace``, its path."""

    name = "profile"
    keys = ("profile_steps", "profile_table", "profile_device_ms_per_step", "profile_trace")

    def install(self) -> None:
        import megatron.training.training as training
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        first, last = (int(x) for x in os.environ.get("BENCH_PROFILE_STEPS", "12:13").split(":"))
        rec, calls, prof = self.record, [0], []
        rec["profile_steps"] = [first, last]

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            calls[0] += 1
            if calls[0] == first:
                _sync()
                prof.append(profile(activities=[ProfilerActivity.CPU]
                                    + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])))
                prof[0].__enter__()
            out = orig(*a, **k)
            if calls[0] == last and prof:
                _sync()
                prof[0].__exit__(None, None, None)
                events = prof[0].key_averages()
                cuda = torch.cuda.is_available()
                key = "self_device_time_total" if cuda else "self_cpu_time_total"
                rec["profile_table"] = events.table(sort_by=key, row_limit=40, max_name_column_width=70)
                # kernels only: an op's own row repeats its kernels' time (as the table's total counts)
                counted = [e for e in events if e.device_type == DeviceType.CUDA] if cuda else events
                rec["profile_device_ms_per_step"] = sum(getattr(e, key) for e in counted) / 1e3 / (last - first + 1)
                trace = os.environ.get("BENCH_PROFILE_TRACE")
                if trace and os.environ.get("RANK", "0") == "0":
                    prof[0].export_chrome_trace(trace)
                    rec["profile_trace"] = trace
            return out
