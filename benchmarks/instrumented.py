"""Run ``examples/pretrain_gpt_diloco.py`` and record per-iteration times, losses and memory.

One process per rank (under torchrun). Writes ``$BENCH_OUT/rank{R}.json``::

    {"iter_s": [...], "losses": {iteration: loss}, "params_on_rank": N,
     "mem_after_setup_bytes": B, "max_mem_bytes": B, "device": "...", "completed": true}

(``completed``: the script returned normally; the process then exits without interpreter teardown.)

Iteration times are measured around Megatron's ``train_step`` with a device synchronization on both
sides, identically with and without ``--diloco-x``.

Slow link between replicas (``benchmarks/link_model.py``), when ``BENCH_LINK_MBPS`` is set (a number
in Mbit/s, or ``inf`` to count cross-replica bytes without slowing anything):
``BENCH_LINK_LATENCY_MS`` (default 5), ``BENCH_LINK_REPLICAS`` (R, default 2: contiguous blocks of
world/R ranks), ``BENCH_LINK_SHARE`` (``rank``: a link per rank, default; ``replica``: one per
replica). The rank file then also holds ``"link"`` (the model's totals per op kind) and
``"link_cum"``: per iteration, cumulative ``[wire bytes sent, modelled link s, waited s]`` of this rank.
``BENCH_FIXED_EVAL=1``: every evaluation (Megatron's periodic one and the one after training) sees
the same batches: the first ``--eval-iters`` batches of each evaluation data stream, cached on first
use and replayed (by default each evaluation takes the stream's next batches).
``--bench-plain-ddp`` (consumed here) drops the example's ``--use-distributed-optimizer``: plain
Megatron DDP, gradients all-reduced (as ``wan_worker.py`` does for the CPU WAN benchmark).
With ``--diloco-x`` it holds ``"rounds"``: this rank's per-boundary metrics (bytes, exchange and
exposed seconds, ...), as logged in the ``[DiLoCoX] round`` lines.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from megatron_diloco.harness import run_script, wrap  # noqa: E402

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

    from megatron_diloco import integration

    @wrap(training, "setup_model_and_optimizer")
    def setup_model_and_optimizer(orig, *a, **k):
        out = orig(*a, **k)
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

    @wrap(training, "train_step")
    def train_step(orig, *a, **k):
        _sync()
        t0 = time.perf_counter()
        out = orig(*a, **k)
        _sync()
        rec["iter_s"].append(time.perf_counter() - t0)
        if _link is not None:
            rec["link_cum"].append(list(_link.counters()))
        return out

    @wrap(training, "training_log")
    def training_log(orig, loss_dict, *a, **k):
        if loss_dict:
            it = k["iteration"] if "iteration" in k else a[2]
            rec["losses"][it] = float(next(iter(loss_dict.values())))
        return orig(loss_dict, *a, **k)

    @wrap(integration._Installation, "log_round")
    def log_round(orig, self, m):
        rec.setdefault("rounds", []).append({k: (v if isinstance(v, (bool, int, float)) else float(v))
                                             for k, v in m.items()})
        return orig(self, m)

    if os.environ.get("BENCH_CHECK_BOUNDARIES") == "1":
        # after every DiLoCoX boundary: are the replicas bit-identical? (a fingerprint all-gather;
        # outside the timed train_step only in the sense that it runs inside step(): use for checks)
        from megatron_diloco.optimizer import DiLoCoXOptimizer

        rec["boundary_identical"] = []

        @wrap(DiLoCoXOptimizer, "step")
        def step(orig, self):
            out = orig(self)
            if self.step_calls % self.diloco_config.local_steps == 0:
                rec["boundary_identical"].append([self.step_calls, self.replicas_identical()])
            return out


def fixed_evaluation() -> None:
    """Make every ``evaluate`` call replay the same batches of its data iterator (see above)."""
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


def plain_ddp() -> None:
    """Make the example's argument parsing ignore ``--use-distributed-optimizer`` (its demo
    defaults add it): Megatron's DDP then all-reduces the gradients."""
    import megatron.training.arguments as arguments

    @wrap(arguments, "parse_and_validate_args")
    def parse_and_validate_args(orig, *a, **k):
        sys.argv = [x for x in sys.argv if x != "--use-distributed-optimizer"]
        return orig(*a, **k)


def main() -> None:
    if os.environ.get("BENCH_HANG_DUMP_S"):  # diagnose hangs: every N s, all threads' stacks to stderr
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["BENCH_HANG_DUMP_S"]), repeat=True)
    argv = sys.argv[1:]
    from megatron_diloco import compat

    compat.apply_all()
    instrument()
    if "--bench-plain-ddp" in argv:
        plain_ddp()
    if os.environ.get("BENCH_FIXED_EVAL") == "1":
        fixed_evaluation()
    install_link_model()  # after Megatron's modules are imported (it rebinds their references)
    rec["completed"] = False

    def finalize(completed: bool) -> None:
        rec["completed"] = completed
        if dist.is_initialized() and torch.cuda.is_available():
            rec["max_mem_bytes"] = torch.cuda.max_memory_allocated()
            rec["device"] = torch.cuda.get_device_name()
        if _link is not None:
            rec["link"] = _link.stats()

    run_script([x for x in argv if x != "--bench-plain-ddp"], rec, os.environ.get("BENCH_OUT"), finalize,
               fast_exit=True)  # (no checkpointing in the benchmarks: no helper processes to orphan)


if __name__ == "__main__":
    main()
