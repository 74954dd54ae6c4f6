"""The slow link between replicas, as the benchmarks measure it (``harness/run.py --record NAME,...``):

* ``link``: the slow link between replicas (``harness/link_model.py``), configured by :class:`LinkConfig`
  (``BENCH_LINK_*``); ``link`` (the model's totals per op kind) and ``link_cum``: per iteration,
  cumulative ``[wire bytes sent, modelled link s, waited s]`` of this rank;
* ``wan``: per-iteration timing of the CPU WAN benchmark (:class:`WanRecorder`);
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

from .base import Recorder, params_on_rank, wrap


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
            rec["params_on_rank"] = params_on_rank(out[0])
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
