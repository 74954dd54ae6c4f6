"""The benchmarks' recorders (``harness/run.py --record NAME,...``).

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
* ``link``: the slow link between replicas (``link_model.py``), configured by :class:`LinkConfig`
  (``BENCH_LINK_*``); ``link`` (the model's totals per op kind) and ``link_cum``: per iteration,
  cumulative ``[wire bytes sent, modelled link s, waited s]`` of this rank;
* ``wan``: per-iteration timing of the CPU WAN benchmark (:class:`WanRecorder`);
* ``codec_capture``: real pseudo-gradients saved to files (:class:`CodecCaptureRecorder`).
* ``profile``: a window of steps under ``torch.profiler``: the top ops and kernels by device time
  (:class:`ProfileRecorder`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

from .base import Recorder, proc_status_bytes, wrap


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _params_on_rank(model) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())


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

            rec["params_on_rank"] = _params_on_rank(out[0])
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

        @wrap(training, "training_log")
        def training_log(orig, loss_dict, *a, **k):
            if loss_dict:
                it = k["iteration"] if "iteration" in k else a[2]
                self.record["losses"][it] = float(next(iter(loss_dict.values())))
            return orig(loss_dict, *a, **k)


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


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    """The slow link of the ``link`` recorder (``link_model.install``)."""

    mbps: float
    """Bandwidth in Mbit/s; ``inf``: count cross-replica bytes without slowing anything."""
    latency_ms: float = 5.0
    replicas: int = 2
    """R: contiguous blocks of world/R ranks."""
    share: str = "rank"
    """``rank``: a link per rank; ``replica``: one per replica shared by its ranks."""

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> LinkConfig:
        """From ``BENCH_LINK_MBPS`` (required), ``BENCH_LINK_LATENCY_MS`` (5), ``BENCH_LINK_REPLICAS``
        (2), ``BENCH_LINK_SHARE`` (``rank``)."""
        if not env.get("BENCH_LINK_MBPS"):
            raise SystemExit("harness: the link recorder needs BENCH_LINK_MBPS (Mbit/s, or inf)")
        return cls(float(env["BENCH_LINK_MBPS"]), float(env.get("BENCH_LINK_LATENCY_MS", "5")),
                   int(env.get("BENCH_LINK_REPLICAS", "2")), env.get("BENCH_LINK_SHARE", "rank"))


class LinkRecorder(Recorder):
    """Every collective whose group spans replicas goes through the modelled slow link."""

    name = "link"
    keys = ("link", "link_cum")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        self.config = LinkConfig.from_env()
        self.link = None

    def install(self) -> None:
        import megatron.training.training as training

        from megatron_diloco.megatron_adapter import integration  # noqa: F401  (imported before the install rebinds)

        from harness import link_model

        c = self.config
        self.link = link_model.install(c.mbps, c.latency_ms, c.replicas, c.share)
        self.record["link_cum"] = []

        @wrap(training, "setup_model_and_optimizer")
        def setup_model_and_optimizer(orig, *a, **k):
            out = orig(*a, **k)
            self.link.rebind()  # modules imported since install() bound the original collectives
            return out

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            out = orig(*a, **k)
            self.record["link_cum"].append(list(self.link.counters()))
            return out

    def finalize(self, completed: bool) -> None:
        self.record["link"] = self.link.stats()


# --------------------------------------------------------------------------- the CPU WAN benchmark

#: Blocking collectives Megatron calls through ``torch.distributed.<name>`` at call time.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_gather_object", "reduce", "gather", "scatter")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _host_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all cores summed)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


class WanRecorder(Recorder):
    """One rank of ``benchmarks/throughput/wan_bench.py``: per-iteration timing and link counters.

    Writes ``{"iters": [{"t0", "t1", "dp_sync_s", "boundary_s", "exposed_s", "exchange_s",
    "bytes_sent", "tx_bytes", "rx_bytes", "proc_cpu_s", "host_busy_s"}, ...], "params_on_rank",
    "train_iters", "tokens_per_iter", "drain_s", "counters_at_start", "counters_at_end"}``.
    Per iteration (one Megatron ``train_step``; ``perf_counter`` seconds):

    * ``dp_sync_s``: time blocked in data-parallel communication outside DiLoCoX's boundary:
      Megatron's gradient / parameter synchronization (the bucket groups' ``start/finish_grad_sync``
      and ``start/finish_param_sync``) and every blocking ``torch.distributed`` collective (the
      gradient norm and the logged loss are reduced over the data-parallel group); outermost calls
      only. Without DiLoCoX this is the per-step AllReduce over the slow link; with DiLoCoX it stays
      inside the replica (at one rank per replica: local copies only).
    * ``boundary_s``: time in DiLoCoX's round-boundary work (``OuterSync.boundary``, ``partial``'s
      landing ``OuterSync.merge``, publishing the new params, the round's metrics): pseudo-gradient,
      encode, the wait for an exchange, outer step, merge.
    * ``round_end``: 1 where an outer round ended (``OuterSync.boundary`` ran), else 0: ``partial``'s
      landings are boundary work but no round of their own.
    * ``exposed_s`` / ``exchange_s`` / ``bytes_sent``: the exchange completed in this iteration (its
      wait, its launch-to-completion time, its accounted bytes), from DiLoCoX's ``RoundReport`` or
      the stats ``OuterSync.merge`` returns.
    * ``proc_cpu_s`` / ``host_busy_s``: this process's CPU time and the whole machine's busy CPU time
      (``/proc/stat``) at the end of the iteration (the CPU load of other processes in the window).
    * ``tx_bytes`` / ``rx_bytes``: the counters of ``$WAN_IFACE`` (the shaped veth; ``ip netns exec``
      mounts the namespace's own sysfs) at the end of the iteration: bytes on the wire, Ethernet
      frames, TCP/IP headers and ACKs included. ``None`` when the interface is absent.

    Rank 0 prints ``WANBENCH step i/N ...`` after each iteration (the launcher's progress line)."""

    name = "wan"
    keys = ("iters", "params_on_rank", "train_iters", "tokens_per_iter", "drain_s", "counters_at_start",
            "counters_at_end")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        self.iface = os.environ.get("WAN_IFACE")
        self.rank = int(os.environ.get("RANK", "0"))
        self.acc = {"dp_sync_s": 0.0, "boundary_s": 0.0, "exposed_s": 0.0, "exchange_s": 0.0, "bytes_sent": 0,
                    "round_end": 0}
        self.depth = {"dp": 0, "boundary": 0}
        record.update(iters=[], params_on_rank=0, train_iters=None, tokens_per_iter=None, drain_s=None)

    def counter(self, name: str) -> int | None:
        if not self.iface:
            return None
        try:
            return int(Path(f"/sys/class/net/{self.iface}/statistics/{name}").read_text())
        except OSError:
            return None

    def counters(self) -> dict[str, int | None]:
        return {"tx_bytes": self.counter("tx_bytes"), "rx_bytes": self.counter("rx_bytes")}

    def timed_dp(self, fn):
        """Adds the wall time of the outermost call to ``dp_sync_s`` (the sync methods call each
        other: ``finish_grad_sync`` starts the sync itself when it was not started)."""
        acc, depth = self.acc, self.depth

        @functools.wraps(fn)
        def wrapper(*a, **k):
            if depth["boundary"] or k.get("async_op"):  # boundary: timed as a whole; async: not blocking
                return fn(*a, **k)
            depth["dp"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth["dp"] -= 1
                if depth["dp"] == 0:
                    acc["dp_sync_s"] += time.perf_counter() - t0
        return wrapper

    def timed_boundary(self, fn, record_report: bool = False):
        from megatron_diloco.algorithm.exchange import ExchangeStats

        acc, depth = self.acc, self.depth

        @functools.wraps(fn)
        def wrapper(*a, **k):
            depth["boundary"] += 1
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                depth["boundary"] -= 1
            if depth["boundary"] == 0:
                acc["boundary_s"] += time.perf_counter() - t0
            # the exchange completed here: a boundary's report, or (partial) the stats its landing
            # tau steps later returns; outermost call only (a boundary may land a pending one itself)
            done = None
            if record_report and depth["boundary"] == 0:
                done = out if isinstance(out, ExchangeStats) else getattr(out, "completed", None)
                if not isinstance(out, ExchangeStats):  # OuterSync.boundary: a round ended here
                    acc["round_end"] += 1
            if done is not None:
                acc["exposed_s"] += done.exposed_s
                acc["exchange_s"] += done.exchange_s
                acc["bytes_sent"] += done.bytes_sent
            return out
        return wrapper

    def install(self) -> None:
        import megatron.training.training as training
        import torch.distributed as dist
        from megatron.core.distributed import param_and_grad_buffer as pgb

        import megatron_diloco.megatron_adapter.optimizer as dx_opt
        import megatron_diloco.algorithm.sync as dx_sync

        rec, acc = self.record, self.acc
        for name in _COLLECTIVES:
            setattr(dist, name, self.timed_dp(getattr(dist, name)))
        group_cls = pgb._ParamAndGradBucketGroup
        for name in ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"):
            setattr(group_cls, name, self.timed_dp(getattr(group_cls, name)))
        for name in ("boundary", "merge"):  # merge: partial's landing, tau steps after the boundary
            setattr(dx_sync.OuterSync, name, self.timed_boundary(getattr(dx_sync.OuterSync, name), record_report=True))
        for name in ("_publish_params", "round_metrics"):
            setattr(dx_opt.DiLoCoXOptimizer, name, self.timed_boundary(getattr(dx_opt.DiLoCoXOptimizer, name)))

        @wrap(dx_opt.DiLoCoXOptimizer, "finish")
        def finish(orig, opt):  # the final drain, outside the measured window
            t0 = time.perf_counter()
            orig(opt)
            rec["drain_s"] = time.perf_counter() - t0

        @wrap(training, "setup_model_and_optimizer")
        def setup_model_and_optimizer(orig, *a, **k):
            out = orig(*a, **k)
            from megatron.training import get_args

            args = get_args()
            rec["params_on_rank"] = _params_on_rank(out[0])
            rec["train_iters"] = args.train_iters
            rec["tokens_per_iter"] = args.global_batch_size * args.seq_length
            return out

        @wrap(training, "train_step")
        def train_step(orig, *a, **k):
            for key in acc:
                acc[key] = 0
            t0 = time.perf_counter()
            out = orig(*a, **k)
            t1 = time.perf_counter()
            rec["iters"].append({"t0": t0, "t1": t1, **acc, "tx_bytes": self.counter("tx_bytes"),
                                 "rx_bytes": self.counter("rx_bytes"), "proc_cpu_s": time.process_time(),
                                 "host_busy_s": _host_busy_s()})
            if self.rank == 0:
                i, n = len(rec["iters"]), rec["train_iters"]
                print(f"WANBENCH step {i}/{n} {t1 - t0:.3f} s elapsed {t1 - rec['iters'][0]['t0']:.1f} s",
                      flush=True)
            return out

        rec["counters_at_start"] = self.counters()

    def finalize(self, completed: bool) -> None:
        self.record["counters_at_end"] = self.counters()


# --------------------------------------------------------------------------- codec capture

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


class ProfileRecorder(Recorder):
    """``profile``: ``train_step`` calls FIRST..LAST (1-based, ``BENCH_PROFILE_STEPS=FIRST:LAST``,
    default 12:13) under ``torch.profiler`` (CPU and CUDA): ``profile_steps``, ``profile_table`` (the
    ops and kernels by self device time, ``key_averages().table``, 40 rows) and
    ``profile_device_ms_per_step`` (the kernels' device time per step, the table's "Self CUDA time
    total" over the steps; on CPU the ops' CPU time)."""

    name = "profile"
    keys = ("profile_steps", "profile_table", "profile_device_ms_per_step")

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
            return out
