"""One rank of ``benchmarks/wan_bench.py``: runs ``examples/pretrain_gpt_diloco.py`` and times it.

Started by the harness inside a replica's network namespace (``ip netns exec``) with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set (no torchrun: one process per
rank, no agent). Arguments are the example's, plus ``--wan-plain-ddp``: drop the example's
``--use-distributed-optimizer`` (plain DDP, gradients all-reduced). Writes ``$WAN_OUT/rank{R}.json``::

    {"iters": [{"t0", "t1", "dp_sync_s", "boundary_s", "exposed_s", "exchange_s",
                "bytes_sent", "tx_bytes", "rx_bytes"}, ...],
     "params_on_rank": N, "train_iters": N, "tokens_per_iter": N, "drain_s": F, ...}

Per iteration (one Megatron ``train_step``; ``perf_counter`` seconds):

* ``dp_sync_s``: time blocked in data-parallel communication outside DiLoCoX's boundary: Megatron's
  gradient / parameter synchronization (the bucket groups' ``start/finish_grad_sync`` and
  ``start/finish_param_sync``) and every blocking ``torch.distributed`` collective (the gradient
  norm and the logged loss are reduced over the data-parallel group); outermost calls only.
  Without DiLoCoX this is the per-step AllReduce over the slow link (``--wan-plain-ddp``: a fp32
  all-reduce of the gradients; with Megatron's distributed optimizer a reduce-scatter of the
  gradients + an all-gather of the params); with DiLoCoX it stays inside the replica (at one
  rank per replica: local copies only).
* ``boundary_s``: time in DiLoCoX's round-boundary work (``OuterSync.boundary``, publishing the new
  params, the round's metrics): pseudo-gradient, encode, the wait for an exchange, outer step.
* ``exposed_s`` / ``exchange_s`` / ``bytes_sent``: the exchange completed at this boundary (its
  wait, its launch-to-completion time, its accounted bytes), from DiLoCoX's own ``RoundReport``.
* ``proc_cpu_s`` / ``host_busy_s``: this process's CPU time (all its threads) and the whole
  machine's busy CPU time (``/proc/stat``: user + nice + system + irq + softirq + steal) at the
  end of the iteration; the harness turns them into the CPU load of other processes in the window.
* ``tx_bytes`` / ``rx_bytes``: the counters of ``$WAN_IFACE`` (the shaped veth; ``ip netns exec``
  mounts the namespace's own sysfs) at the end of the iteration: bytes on the wire, Ethernet
  frames, TCP/IP headers and ACKs included. ``None`` when the interface is absent.

Rank 0 prints ``WANBENCH step i/N ...`` after each iteration (the harness turns it into progress).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

from instrumented import plain_ddp  # noqa: E402  (drops --use-distributed-optimizer: plain DDP)

from megatron_diloco.harness import run_script  # noqa: E402

rec: dict = {"iters": [], "params_on_rank": 0, "train_iters": None, "tokens_per_iter": None,
             "drain_s": None}
_acc = {"dp_sync_s": 0.0, "boundary_s": 0.0, "exposed_s": 0.0, "exchange_s": 0.0, "bytes_sent": 0}
_depth = {"dp": 0, "boundary": 0}
#: Blocking collectives Megatron calls through ``torch.distributed.<name>`` at call time.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_gather_object", "reduce", "gather", "scatter")


def _read_counter(name: str) -> int | None:
    iface = os.environ.get("WAN_IFACE")
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/{name}").read_text())
    except OSError:
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _host_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all cores summed)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _timed_dp(fn):
    """Adds the wall time of the outermost call to ``_acc['dp_sync_s']`` (the sync methods call each
    other: ``finish_grad_sync`` starts the sync itself when it was not started)."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        if _depth["boundary"] or k.get("async_op"):  # boundary: timed as a whole; async: not blocking
            return fn(*a, **k)
        _depth["dp"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _depth["dp"] -= 1
            if _depth["dp"] == 0:
                _acc["dp_sync_s"] += time.perf_counter() - t0
    return wrapper


def _timed_boundary(fn, record_report: bool = False):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        _depth["boundary"] += 1
        t0 = time.perf_counter()
        try:
            out = fn(*a, **k)
        finally:
            _depth["boundary"] -= 1
        if _depth["boundary"] == 0:
            _acc["boundary_s"] += time.perf_counter() - t0
        done = getattr(out, "completed", None) if record_report else None
        if done is not None:
            _acc["exposed_s"] += done.exposed_s
            _acc["exchange_s"] += done.exchange_s
            _acc["bytes_sent"] += done.bytes_sent
        return out
    return wrapper


def instrument() -> None:
    import megatron.training.training as training
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    import megatron_diloco.optimizer as dx_opt
    import megatron_diloco.sync as dx_sync

    for name in _COLLECTIVES:
        setattr(dist, name, _timed_dp(getattr(dist, name)))
    group_cls = pgb._ParamAndGradBucketGroup
    for name in ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"):
        setattr(group_cls, name, _timed_dp(getattr(group_cls, name)))
    dx_sync.OuterSync.boundary = _timed_boundary(dx_sync.OuterSync.boundary, record_report=True)
    for name in ("_publish_params", "round_metrics"):
        setattr(dx_opt.DiLoCoXOptimizer, name, _timed_boundary(getattr(dx_opt.DiLoCoXOptimizer, name)))
    orig_finish = dx_opt.DiLoCoXOptimizer.finish

    def finish(self):  # the final drain, outside the measured window
        t0 = time.perf_counter()
        orig_finish(self)
        rec["drain_s"] = time.perf_counter() - t0

    dx_opt.DiLoCoXOptimizer.finish = finish

    orig_step, orig_setup = training.train_step, training.setup_model_and_optimizer
    rank = int(os.environ.get("RANK", "0"))

    def setup_model_and_optimizer(*a, **k):
        out = orig_setup(*a, **k)
        from megatron.training import get_args

        args = get_args()
        rec["params_on_rank"] = sum(p.numel() for chunk in out[0] for p in chunk.parameters())
        rec["train_iters"] = args.train_iters
        rec["tokens_per_iter"] = args.global_batch_size * args.seq_length
        return out

    def train_step(*a, **k):
        for key in _acc:
            _acc[key] = 0
        t0 = time.perf_counter()
        out = orig_step(*a, **k)
        t1 = time.perf_counter()
        rec["iters"].append({"t0": t0, "t1": t1, **_acc, "tx_bytes": _read_counter("tx_bytes"),
                             "rx_bytes": _read_counter("rx_bytes"), "proc_cpu_s": time.process_time(),
                             "host_busy_s": _host_busy_s()})
        if rank == 0:
            i, n = len(rec["iters"]), rec["train_iters"]
            print(f"WANBENCH step {i}/{n} {t1 - t0:.3f} s elapsed {t1 - rec['iters'][0]['t0']:.1f} s",
                  flush=True)
        return out

    training.train_step = train_step
    training.setup_model_and_optimizer = setup_model_and_optimizer


def main() -> None:
    argv = sys.argv[1:]
    from megatron_diloco import compat

    compat.apply_all()
    instrument()
    if "--wan-plain-ddp" in argv:
        plain_ddp()
    rec["counters_at_start"] = {"tx_bytes": _read_counter("tx_bytes"), "rx_bytes": _read_counter("rx_bytes")}

    def finalize(completed: bool) -> None:
        rec["counters_at_end"] = {"tx_bytes": _read_counter("tx_bytes"), "rx_bytes": _read_counter("rx_bytes")}

    run_script([x for x in argv if x != "--wan-plain-ddp"], rec, os.environ.get("WAN_OUT"), finalize)


if __name__ == "__main__":
    main()
