"""Throughput over an emulated slow network: AllReduce data parallelism vs DiLoCo vs DiLoCoX.

    make bench-wan                        # = python benchmarks/throughput/wan_bench.py (needs root)
    python benchmarks/throughput/wan_bench.py --links 100 --methods allreduce,dilocox
    python benchmarks/throughput/wan_bench.py --dry-run    # print the namespace and run commands only
    python benchmarks/throughput/wan_bench.py --plot-only  # redraw the PNG from the JSON

Each replica runs in its own network namespace behind a full-duplex link shaped with tc tbf
(``harness/netns.py``; no added latency: this kernel has no netem). The SAME Megatron model,
data and global batch (``examples/pretrain_gpt_diloco.py``, one rank per replica) is trained by

* ``allreduce``: plain Megatron data parallelism (``--no-diloco-x``, no plugin, DDP without the
  distributed optimizer: the harness recorder ``plain_ddp``): the fp32 gradients are all-reduced over the slow link every step;
* ``allreduce-distopt``: the same with Megatron's distributed optimizer (as the example runs
  ``--no-diloco-x``): reduce-scatter of the gradients + all-gather of the params every step. With
  NCCL that moves the bytes of a ring all-reduce; over gloo it moves 1.5x as much (measured: gloo's
  reduce-scatter costs a full all-reduce), so ``allreduce`` is the baseline of the speedups and
  the bound;
* ``diloco``: DiLoCoX with no delay and no compression (blocking fp32 all-reduce every H steps);
* ``dilocox``: the package's default mode, ``--diloco-x`` with no other flag: partial overlap with
  auto tau (the exchange launched at a boundary lands the fewest inner steps later that hide its
  measured duration), exact merge, eta 1, mu 0, int4 pseudo-gradients; its steady rounds of H
  (``--diloco-x-warmup-iters 0``);
* ``dilocox-warmup``: the same with the default's auto warm-up (rounds of min(H // 3, 10) for the
  first 30 H steps, at most half the run: here half; blocking at H0 < 10, their exchanges int2), the
  window from the end of its first round: what the warm-up's blocked exchanges cost a run this short;
* ``dilocox-adaptive`` (optional): as ``dilocox`` with the adaptive low-rank codec, budget = link;
* ``dilocox-auto-h`` (optional): as ``dilocox`` with ``--diloco-x-local-steps auto`` (no bandwidth flag: H
  from the exchanges the run measures), ``--auto-h-iters`` iterations, the window from the end of the
  second round of its starting H (the first boundary that knows an exchange's time chooses H there).

Definitions (per run, over a measured window that excludes process start, setup and warm-up:
from the end of iteration ``w`` to the end of the last iteration; ``w`` = 2 for allreduce, = H
(the first round, its boundary included) for DiLoCo(X), H // 3 for ``dilocox-warmup``, so the
window holds whole rounds):

* ``tokens_per_s`` = window iterations x global batch x sequence length / window wall time
  (slowest rank).
* ``compute_utilization`` = time in inner steps / window wall time (mean over ranks), where an
  inner step is Megatron's ``train_step`` minus the time blocked on the slow link: minus the
  data-parallel synchronization and every other blocking collective (gradient norm, logged loss)
  for allreduce, minus DiLoCoX's boundary work (pseudo-gradient, encode, wait, outer step, param
  publish) for DiLoCo(X). The replica-local sync of DiLoCo(X) counts as inner step, so
  ``t_step`` (below) leaves out a few ms of local work that DiLoCoX's steps include: the bound
  errs high, against DiLoCoX.
* ``t_step`` (per link) = mean inner-step time of the allreduce run at that link;
  ``t_allreduce`` = its mean step time minus ``t_step`` (the per-step synchronization, plus
  Megatron's loop overhead between steps); ``speedup_bound`` = (t_step + t_allreduce) / t_step:
  the speedup of a method whose communication is entirely hidden and free, from the same run's
  measurements. ``speedup_vs_allreduce`` = tokens_per_s / tokens_per_s of allreduce at the link.
* ``bytes_per_rank_per_token``: bytes the rank's namespace put on its shaped link in the window
  (veth ``tx_bytes``: Ethernet frames, TCP/IP headers and ACKs included) per rank per token;
  ``accounted_bytes_per_rank_per_token``: DiLoCoX's own accounting of the exchanges completed in
  the window (allreduce: ring all-reduce of the fp32 parameters, 2 (R-1)/R x 4 bytes/param).
* ``exposed_comm_per_round_s``: DiLoCo(X): time the training loop waited for an exchange, per
  round; allreduce: t_allreduce x H (the same number of steps).
* ``other_cpu_cores``: CPU time that other processes used during the window (whole machine's busy
  time from ``/proc/stat`` minus the ranks' own CPU time) / window wall time: how much the run was
  disturbed on a shared machine. With ``--repeats N`` every (link, method) runs N times (in N passes
  over the sweep); per link the runs of one pass are reported (the least disturbed pass in which
  every method succeeded), so that ratios compare runs measured side by side; all repeats stay in
  the JSON (``repeats``) and ``by_pass`` gives each pass's own speedup, bound and fraction.
* ``exchange_fits_in_H``: the exchange's launch-to-completion time <= H x inner-step time.
  Target (issue 4): DiLoCoX >= 90% of the bound and >= 90% compute utilization when it fits.

Every run is one :class:`~harness.runner.Job` of the runner: one harness process per rank
(recorder ``wan``, ``harness/recorders/network.py``), each started through ``ip netns exec`` in
its replica's namespace. Writes ``benchmarks/results/wan.json``, ``benchmarks/plots/wan.png`` (with
matplotlib), per-run logs and rank records under ``--work``; prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from harness import netns  # noqa: E402
from harness.runner import Command, Job, harness_command, load_ranks, run_job, summary_of  # noqa: E402
from megatron_diloco.megatron_adapter.arguments import resolve_warmup  # noqa: E402
from megatron_diloco.algorithm.config import AUTO_H_MIN  # noqa: E402

METHODS = ("allreduce", "allreduce-distopt", "diloco", "dilocox", "dilocox-warmup", "dilocox-adaptive", "dilocox-auto-h")
DEFAULT_METHODS = ("allreduce", "allreduce-distopt", "diloco", "dilocox", "dilocox-warmup")
#: Same model, data and global batch for every method: the example's demo GPT (4 layers, hidden
#: 192, seq 256, 1.84M parameters, byte-level, Python stdlib corpus), one rank per replica.
COMMON_ARGS = """
    --pipeline-model-parallel-size 1 --micro-batch-size 4 --global-batch-size 8
    --lr-warmup-iters 2 --eval-iters 0 --eval-interval 100000
""".split()
ALLREDUCE_WARMUP = 2


def method_args(method: str, local_steps: int, link_mbps: float) -> list[str]:
    """The example's flags that select ``method`` (on top of its demo defaults: 2 replicas, the
    package's DiLoCoX defaults; every DiLoCo(X) method but ``dilocox-warmup`` without the default
    warm-up, so that it measures the steady rounds of H); ``allreduce`` also runs as plain DDP
    (:func:`method_recorders`)."""
    if method == "allreduce":
        return ["--no-diloco-x"]
    if method == "allreduce-distopt":
        return ["--no-diloco-x"]
    h = ["--diloco-x-local-steps", str(local_steps)]
    dx = h + ["--diloco-x-warmup-iters", "0"]
    if method == "diloco":
        return dx + ["--diloco-x-overlap", "none", "--diloco-x-compression", "none"]
    if method == "dilocox":
        return dx  # the defaults, steady rounds
    if method == "dilocox-warmup":
        return h  # the defaults, the auto warm-up included
    if method == "dilocox-auto-h":
        return ["--diloco-x-local-steps", "auto", "--diloco-x-warmup-iters", "0"]
    if method == "dilocox-adaptive":
        return dx + ["--diloco-x-compression", "adaptive",
                     "--diloco-x-bandwidth-mbps", f"{link_mbps:g}"]
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def method_recorders(method: str) -> list[str]:
    """The harness recorders of a run of ``method``: ``wan``, and ``plain_ddp`` for ``allreduce``."""
    return ["wan", "plain_ddp"] if method == "allreduce" else ["wan"]


def iterations_for(method: str, link_mbps: float, local_steps: int, rounds: int,
                   allreduce_steps: dict[float, int], auto_h_iters: int = 250) -> tuple[int, int]:
    """(train iterations, warm-up iterations excluded from the window) of one run."""
    if method == "dilocox-auto-h":  # two rounds of the starting H: the second boundary chooses H
        return auto_h_iters, 2 * AUTO_H_MIN
    if method.startswith("allreduce"):
        nearest = min(allreduce_steps, key=lambda link: abs(link - link_mbps))  # the given link or the closest
        return ALLREDUCE_WARMUP + allreduce_steps[nearest], ALLREDUCE_WARMUP
    if rounds < 2:
        raise ValueError("--rounds must be >= 2 (the first round is warm-up)")
    iters = rounds * local_steps
    if method == "dilocox-warmup":  # the window from the end of the first (warm-up) round on
        h0, _ = resolve_warmup(None, None, local_steps, iters)
        return iters, h0 or local_steps
    return iters, local_steps


# --------------------------------------------------------------------------- metrics (pure)


def window_metrics(ranks: list[dict], warmup: int, sync_crosses_link: bool) -> dict:
    """Throughput, utilization and communication of one run over its window.

    Args:
        ranks: one record per rank as written by the harness recorder ``wan`` (``iters``: per iteration
            ``t0``, ``t1``, ``dp_sync_s``, ``boundary_s``, ``round_end``, ``exposed_s``, ``exchange_s``,
            ``bytes_sent``, ``tx_bytes``; ``tokens_per_iter``), in rank order.
        warmup: iterations before the window (the window starts at the end of iteration ``warmup``).
        sync_crosses_link: whether Megatron's data-parallel sync goes over the slow link
            (allreduce) or stays inside the replica (DiLoCo(X)).

    One rank per replica: a rank's namespace counters are its own traffic.
    """
    tokens_per_iter = ranks[0]["tokens_per_iter"]
    n = len(ranks[0]["iters"]) - warmup
    if n < 1:
        raise ValueError(f"no iteration after the {warmup} warm-up iterations")
    walls, computes, blocked, boundary, exposed, exchange, accounted, tx = [], [], [], [], [], [], [], []
    own_cpu = 0.0
    rounds = 0
    for rec in ranks:
        it = rec["iters"]
        win = it[warmup:]
        wall = it[-1]["t1"] - it[warmup - 1]["t1"] if warmup > 0 else it[-1]["t1"] - it[0]["t0"]
        sync = sum(i["dp_sync_s"] for i in win)
        bnd = sum(i["boundary_s"] for i in win)
        step_sum = sum(i["t1"] - i["t0"] for i in win)
        walls.append(wall)
        blocked.append(sync if sync_crosses_link else bnd)
        computes.append(step_sum - (sync if sync_crosses_link else bnd))
        boundary.append(bnd)
        exposed.append(sum(i["exposed_s"] for i in win))
        exchange.append(sum(i["exchange_s"] for i in win))
        accounted.append(sum(i["bytes_sent"] for i in win))
        # rounds ended in the window (records without ``round_end``: iterations with boundary work)
        rounds = sum(i.get("round_end", 1 if i["boundary_s"] > 0 else 0) for i in win)
        if warmup:
            own_cpu += it[-1].get("proc_cpu_s", 0.0) - it[warmup - 1].get("proc_cpu_s", 0.0)
        start_tx = it[warmup - 1]["tx_bytes"] if warmup > 0 else None
        if start_tx is not None and it[-1]["tx_bytes"] is not None:
            tx.append(it[-1]["tx_bytes"] - start_tx)
    wall = max(walls)
    tokens = n * tokens_per_iter
    # CPU that other processes (and the kernel's softirq work) used during rank 0's window, in cores
    it0 = ranks[0]["iters"]
    other = None
    if warmup and it0[-1].get("host_busy_s") is not None and it0[warmup - 1].get("host_busy_s") is not None:
        other = (it0[-1]["host_busy_s"] - it0[warmup - 1]["host_busy_s"] - own_cpu) / walls[0]
    compute = statistics.fmean(computes)
    out = {
        "window_iterations": n,
        "window_s": wall,
        "tokens_per_s": tokens / wall,
        "compute_utilization": compute / wall,
        "step_s": wall / n,
        "inner_step_s": compute / n,
        "blocked_per_step_s": statistics.fmean(blocked) / n,
        "rounds_in_window": rounds,
        "bytes_per_rank_per_token": statistics.fmean(tx) / tokens if tx else None,
        "wire_bytes_per_rank": statistics.fmean(tx) if tx else None,
        "other_cpu_cores": other,
    }
    if rounds:
        out.update({
            "exposed_comm_per_round_s": max(exposed) / rounds,
            "exchange_per_round_s": max(exchange) / rounds,
            "boundary_per_round_s": max(boundary) / rounds,
            "accounted_bytes_per_rank_per_token": statistics.fmean(accounted) / tokens,
        })
    return out


def speedup_bound(t_step: float, t_allreduce: float) -> float:
    """(t_step + t_allreduce) / t_step: the most a method that hides all communication can gain."""
    if t_step <= 0:
        raise ValueError("t_step must be positive")
    return (t_step + t_allreduce) / t_step


def ring_allreduce_bytes_per_token(params: int, replicas: int, tokens_per_iter: int) -> float:
    """Bytes a rank sends per token in a ring all-reduce of its fp32 parameters every step."""
    return 2 * (replicas - 1) / replicas * 4 * params / tokens_per_iter


_REPEAT_KEYS = ("pass", "tokens_per_s", "compute_utilization", "inner_step_s", "step_s", "other_cpu_cores",
                "error")


def select_pass(repeats: dict[tuple[float, str], list[dict]]) -> list[dict]:
    """Per link, the runs of ONE pass, so that speedups and bounds compare runs measured side by
    side (one pass over a link's methods takes minutes; the machine's speed drifts between passes
    by several percent). The pass chosen is, among those where every method at the link succeeded
    (else those with the most successes), the least disturbed: smallest largest ``other_cpu_cores``
    of its runs. Every returned run keeps a short record of all its repeats under ``repeats``.

    Args:
        repeats: ``(link_mbps, method) -> [run of pass 1, run of pass 2, ...]``."""
    out = []
    for link in dict.fromkeys(link for link, _ in repeats):
        methods = [m for (lk, m) in repeats if lk == link]
        passes = sorted({r["pass"] for m in methods for r in repeats[(link, m)]})

        def runs_of(p: int) -> list[dict]:
            return [next((r for r in repeats[(link, m)] if r["pass"] == p), {"error": "missing"})
                    for m in methods]

        def rank(p: int) -> tuple[int, float]:
            ok = [r for r in runs_of(p) if r.get("tokens_per_s")]
            worst = max((r["other_cpu_cores"] if r.get("other_cpu_cores") is not None else float("inf")
                         for r in ok), default=float("inf"))
            return (-len(ok), worst)

        chosen = min(passes, key=rank)
        for m in methods:
            run = dict(next((r for r in repeats[(link, m)] if r["pass"] == chosen), repeats[(link, m)][0]))
            run["repeats"] = [{k: r[k] for k in _REPEAT_KEYS if k in r} for r in repeats[(link, m)]]
            out.append(run)
    return out


def fractions_by_pass(runs: list[dict]) -> None:
    """Add ``by_pass`` to every non-allreduce run, in place: per pass, its speedup over that same
    pass's allreduce run at the link, that allreduce's bound (step / inner step) and the fraction of
    it, from the ``repeats`` records (so a reader sees the spread between passes)."""
    for link in {r["link_mbps"] for r in runs}:
        ar = next((r for r in runs if r["link_mbps"] == link and r["method"] == "allreduce"), None)
        if ar is None:
            continue
        ar_by_pass = {x["pass"]: x for x in ar.get("repeats", []) if x.get("tokens_per_s")}
        for r in runs:
            if r["link_mbps"] != link or r["method"].startswith("allreduce"):
                continue
            rows = []
            for x in r.get("repeats", []):
                a = ar_by_pass.get(x.get("pass"))
                if a is None or not x.get("tokens_per_s"):
                    continue
                speedup, bound = x["tokens_per_s"] / a["tokens_per_s"], a["step_s"] / a["inner_step_s"]
                rows.append({"pass": x["pass"], "speedup_vs_allreduce": speedup, "speedup_bound": bound,
                             "fraction_of_bound": speedup / bound})
            r["by_pass"] = rows


def compare_to_allreduce(runs: list[dict], local_steps: int, target: float = 0.9) -> None:
    """Add ``speedup_vs_allreduce``, ``speedup_bound``, ``fraction_of_bound``, the allreduce run's
    ``t_step_s`` / ``t_allreduce_s``, and the target check to every run, in place, per link."""
    for link in sorted({r["link_mbps"] for r in runs}):
        at_link = [r for r in runs if r["link_mbps"] == link]
        ar = next((r for r in at_link if r["method"] == "allreduce" and r.get("tokens_per_s")), None)
        if ar is None:
            continue
        t_step = ar["inner_step_s"]
        t_allreduce = ar["step_s"] - t_step
        bound = speedup_bound(t_step, t_allreduce)
        for r in at_link:
            if not r.get("tokens_per_s"):
                continue
            if r["method"].startswith("allreduce"):  # H steps' worth of per-step synchronization
                r["exposed_comm_per_round_s"] = (r["step_s"] - r["inner_step_s"]) * local_steps
            r["t_step_s"], r["t_allreduce_s"] = t_step, t_allreduce
            r["speedup_vs_allreduce"] = r["tokens_per_s"] / ar["tokens_per_s"]
            r["speedup_bound"] = bound
            r["fraction_of_bound"] = r["speedup_vs_allreduce"] / bound
            if r["method"].startswith("dilocox") and "exchange_per_round_s" in r:
                r["exchange_fits_in_H"] = r["exchange_per_round_s"] <= local_steps * r["inner_step_s"]
                r["target_met"] = (r["fraction_of_bound"] >= target and r["compute_utilization"] >= target)


def markdown_table(runs: list[dict]) -> str:
    def f(v, fmt, suffix=""):
        return "—" if v is None else format(v, fmt) + suffix

    lines = ["| link | method | tokens/s | compute util. | bytes/rank/token (wire) | (accounted) | "
             "exposed comm / round, s | exchange / round, s | speedup vs AllReduce | bound | of bound | "
             "other CPU load, cores |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r.get("tokens_per_s"):
            lines.append(f"| {r['link_mbps']:g} Mbit | {r['method']} | failed: {r.get('error', '?')} |"
                         + " |" * 9)
            continue
        lines.append(
            f"| {r['link_mbps']:g} Mbit | {r['method']} | {r['tokens_per_s']:,.0f} | "
            f"{r['compute_utilization']:.1%} | {f(r.get('bytes_per_rank_per_token'), ',.1f')} | "
            f"{f(r.get('accounted_bytes_per_rank_per_token'), ',.1f')} | "
            f"{f(r.get('exposed_comm_per_round_s'), '.3f')} | {f(r.get('exchange_per_round_s'), '.3f')} | "
            f"{f(r.get('speedup_vs_allreduce'), '.2f', 'x')} | {f(r.get('speedup_bound'), '.2f', 'x')} | "
            f"{f(r.get('fraction_of_bound'), '.1%')} | {f(r.get('other_cpu_cores'), '.2f')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


class Progress:
    """Turns rank 0's ``WANBENCH step i/N`` lines into at most one progress line every
    ``interval`` seconds (and the last one) with the mean step time and an ETA."""

    PATTERN = re.compile(r"WANBENCH step (\d+)/(\d+) ([\d.]+) s elapsed ([\d.]+) s")

    def __init__(self, label: str, interval: float = 2.0, out=sys.stdout) -> None:
        self.label, self.interval, self.out = label, interval, out
        self._last: float | None = None

    def feed(self, line: str) -> None:
        m = self.PATTERN.search(line)
        if not m:
            return
        i, n, elapsed = int(m[1]), int(m[2]), float(m[4])
        now = time.monotonic()
        if i < n and self._last is not None and now - self._last < self.interval:
            return
        self._last = now
        per_step = elapsed / i  # elapsed: start of iteration 1 to the end of iteration i
        eta = per_step * (n - i)
        bar = "#" * int(20 * i / n)
        print(f"  {self.label} [{bar:<20}] step {i:>4}/{n}  {per_step:6.3f} s/step  ETA {eta:5.0f} s",
              file=self.out, flush=True)


def rank_job(topo: netns.WanTopology, name: str, run_dir: Path, argv: list[str], record: list[str],
             port: int, timeout: float, label: str) -> Job:
    """The run as a runner job: one harness process per replica (rank r inside replica r's namespace,
    so the world size is the number of replicas), ``rank{r}.log`` each, rank 0's progress shown."""
    world = topo.replicas
    commands = [Command(harness_command(record, run_dir, argv), prefix=netns.netns_exec(topo.namespace(rank), []),
                        env={"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                             "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": topo.address(0), "MASTER_PORT": str(port),
                             "GLOO_SOCKET_IFNAME": topo.iface, "WAN_IFACE": topo.iface},
                        log=f"rank{rank}.log")
                for rank in range(world)]
    return Job(name, commands, timeout_s=timeout, term_grace_s=10.0, watch=Progress(label).feed)


def launch(topo: netns.WanTopology, run_dir: Path, argv: list[str], record: list[str], port: int,
           timeout: float, label: str) -> tuple[list[dict], dict | None]:
    """Run the example once (:func:`rank_job`, in ``run_dir``); returns the ranks' records and the
    DiLoCoX summary (None without the plugin). Raises RuntimeError when a rank failed or it timed out."""
    info = run_job(rank_job(topo, run_dir.name, run_dir, argv, record, port, timeout, label), run_dir.parent)
    if not info["ok"]:
        bad = next((r for r, c in enumerate(info["returncodes"]) if c != 0), 0)
        tail = (run_dir / f"rank{bad}.log").read_text(errors="replace")[-3000:]
        why = f"no end after {timeout:.0f} s" if info["timed_out"] else f"exited {info['returncodes'][bad]}"
        raise RuntimeError(f"rank {bad} {why}:\n{tail}")
    return load_ranks(run_dir.parent, run_dir.name), (summary_of(run_dir.parent, run_dir.name) or None)


def code_state() -> dict:
    """The commit the runs used and the tracked files that differed from it (the runs import the
    working tree)."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return out.stdout.rstrip("\n") if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "modified": [line[3:] for line in status.splitlines()] if status else []}


def machine_description() -> dict:
    model = ""
    try:
        model = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {"cpus": os.cpu_count(), "cpu_model": model, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": None, "backend": "gloo"}


def plot(result: dict, path: Path, stamp: str | None = None) -> bool:
    """Tokens/s, speedup vs AllReduce (with the bound) and compute utilization per link and method;
    stamped with the commit the runs used (and ``stamp``, the commit it is drawn at, when given)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-wan: matplotlib not installed: no plot (pip install matplotlib; then "
              "python benchmarks/throughput/wan_bench.py --plot-only)")
        return False
    runs = [r for r in result["runs"] if r.get("tokens_per_s")]
    links = sorted({r["link_mbps"] for r in runs}, reverse=True)
    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
    width = 0.8 / max(len(methods), 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    keys = ("tokens_per_s", "speedup_vs_allreduce", "compute_utilization")
    for k, m in enumerate(methods):
        get = {r["link_mbps"]: r for r in runs if r["method"] == m}
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(links))]
        for ax, key in zip(axes, keys):
            vals = [get[l].get(key) if l in get else None for l in links]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=m, color=f"C{k}")
            if key != "tokens_per_s":
                ax.bar_label(bars, [("" if v is None else f"{v:.2f}" if key == keys[1] else f"{v:.0%}")
                                    for v in vals], fontsize=6, padding=1)
    for i, l in enumerate(links):
        b = next((r["speedup_bound"] for r in runs if r["link_mbps"] == l and r.get("speedup_bound")), None)
        if b is not None:
            axes[1].hlines(b, i - 0.45, i + 0.45, colors="k", linestyles="--",
                           label="bound (t_step + t_allreduce) / t_step" if i == 0 else None)
            axes[1].hlines(0.9 * b, i - 0.45, i + 0.45, colors="grey", linestyles=":",
                           label="90% of the bound" if i == 0 else None)
    axes[2].axhline(0.9, color="grey", ls=":")
    titles = ("tokens/s (log scale)", "speedup over AllReduce (log scale)", "compute utilization")
    for ax, title in zip(axes, titles):
        ax.set_xticks(range(len(links)), [f"{l:g} Mbit/s" for l in links])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_ylim(0, 1.1)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    m = result.get("machine", {})
    fig.suptitle(f"Emulated WAN (tc tbf, no added latency): {result['config']['replicas']} replicas x 1 rank, "
                 f"{result['model']['params'] / 1e6:.2f}M-param GPT, {result['model']['tokens_per_iter']} "
                 f"tokens/step, H={result['config']['local_steps']}; {m.get('cpus')} CPU cores, gloo "
                 f"({result.get('date', '')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    ran = ((result.get("code") or {}).get("commit") or "unknown")[:7]
    fig.text(0.995, 0.995, f"runs at commit {ran}" + (f", drawn at {stamp}" if stamp else ""), ha="right", va="top",
             fontsize=7, color="0.4")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="1000,100,10", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {', '.join(METHODS)}")
    p.add_argument("--local-steps", type=int, default=16, help="H of the DiLoCo(X) runs")
    p.add_argument("--rounds", type=int, default=5, help="DiLoCo(X) rounds per run (the first is warm-up)")
    p.add_argument("--allreduce-steps", default="1000:32,100:16,10:8",
                   help="measured allreduce steps per link (LINK:STEPS,...), after 2 warm-up steps")
    p.add_argument("--auto-h-iters", type=int, default=250, help="iterations of a dilocox-auto-h run")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the sweep; per (link, method) the least disturbed repeat is kept")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "wan.json")
    p.add_argument("--plot", type=Path, default=BENCH / "plots" / "wan.png")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "wan", help="logs and rank records")
    p.add_argument("--dry-run", action="store_true", help="print the commands, change nothing")
    p.add_argument("--plot-only", action="store_true", help="redraw --plot from --out")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more example flags for every run (after --)")
    a = p.parse_args()
    a.links = [float(x) for x in a.links.split(",")]
    a.methods = [m.strip() for m in a.methods.split(",")]
    for m in a.methods:
        method_args(m, 1, 1.0)  # validates
    if "diloco" in a.methods or any(m.startswith("dilocox") for m in a.methods):
        if "allreduce" not in a.methods:
            print("bench-wan: note: without allreduce no speedup or bound is computed")
    a.methods.sort(key=METHODS.index)  # allreduce first: its run defines the link's bound
    a.allreduce_steps = {float(k): int(v) for k, v in (x.split(":") for x in a.allreduce_steps.split(","))}
    a.extra = [x for x in a.extra if x != "--"]
    return a


def main() -> None:
    a = parse_args()
    if a.plot_only:
        plot(json.loads(a.out.read_text()), a.plot)
        return
    topo = netns.WanTopology(replicas=a.replicas)
    plan = []
    for link in a.links:
        for m in a.methods:
            iters, warmup = iterations_for(m, link, a.local_steps, a.rounds, a.allreduce_steps, a.auto_h_iters)
            argv = COMMON_ARGS + ["--train-iters", str(iters), "--log-interval", str(iters)] \
                + method_args(m, a.local_steps, link) + a.extra
            plan.append((link, m, iters, warmup, argv))
    if a.dry_run:
        for cmd in netns.setup_commands(topo) + netns.shape_commands(topo, a.links[0]):
            print(" ".join(cmd))
        for link, m, iters, warmup, argv in plan:
            print(f"# {link:g} Mbit {m}: {iters} iterations ({warmup} warm-up); rank 0 (rank r: namespace r):")
            job = rank_job(topo, "run", a.work / "run", argv, method_recorders(m), 29500, a.timeout, "")
            print(" ".join(job.commands[0].line))
        for cmd in netns.teardown_commands(topo):
            print(" ".join(cmd))
        return

    netns.check_requirements()
    # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the namespaces are always torn down.
    signal.signal(signal.SIGTERM, _interrupt)
    subprocess.run([sys.executable, str(REPO / "examples" / "stdlib_corpus.py")], check=True,
                   cwd=REPO, stdout=subprocess.DEVNULL)  # build the corpus once, outside the timing
    result = {"date": datetime.date.today().isoformat(), "machine": machine_description(), "code": code_state(),
              "config": {"local_steps": a.local_steps, "rounds": a.rounds, "replicas": a.replicas,
                         "ranks_per_replica": 1,
                         "allreduce_steps": {f"{k:g}": v for k, v in a.allreduce_steps.items()},
                         "common_args": COMMON_ARGS + a.extra, "latency": "none (no netem in this kernel)",
                         "tbf": "rate R, burst 256kb (>= 1 Gbit) / 64kb, latency 5ms, both veth ends"},
              "model": {}, "links": [], "runs": []}
    started = time.monotonic()
    repeats: dict[tuple[float, str], list[dict]] = {}
    total, k, shaped = a.repeats * len(plan), 0, None
    with netns.emulated_wan(topo):
        for rep, (link, m, iters, warmup, argv) in ((r, p) for r in range(a.repeats) for p in plan):
            if shaped != link:
                netns.shape(topo, link)
                shaped = link
                goodput = netns.measure_goodput(topo, int(min(64 << 20, link * 1e6 / 8 * 1.5)))
                result["links"].append({"link_mbps": link, "tcp_goodput_mbps": goodput, "pass": rep + 1})
                print(f"bench-wan: link {link:g} Mbit/s shaped; TCP goodput {goodput:.1f} Mbit/s")
            k += 1
            label = f"{link:g} Mbit {m}"
            print(f"run {k}/{total}: {label}, {iters} iterations ({warmup} warm-up)"
                  + (f", pass {rep + 1}/{a.repeats}" if a.repeats > 1 else "")
                  + f", {time.monotonic() - started:.0f} s into the sweep", flush=True)
            run = {"link_mbps": link, "method": m, "iterations": iters, "warmup_iterations": warmup,
                   "pass": rep + 1, "load_avg_before": os.getloadavg()[0]}
            try:
                ranks, summary = launch(topo, a.work / f"{link:g}mbit_{m}_pass{rep + 1}", argv,
                                        method_recorders(m), 29500 + k, a.timeout, label)
                run.update(window_metrics(ranks, warmup, sync_crosses_link=m.startswith("allreduce")))
                params = ranks[0]["params_on_rank"]
                result["model"] = {"params": params, "tokens_per_iter": ranks[0]["tokens_per_iter"]}
                if m.startswith("allreduce"):  # what a ring all-reduce moves (NCCL; gloo's DDP)
                    run["accounted_bytes_per_rank_per_token"] = ring_allreduce_bytes_per_token(
                        params, a.replicas, ranks[0]["tokens_per_iter"])
                else:
                    run["drain_s"] = max(r["drain_s"] or 0.0 for r in ranks)
                if summary:
                    run["summary"] = summary
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as err:
                run["error"] = str(err).splitlines()[0]
                print(f"bench-wan: run failed: {err}", file=sys.stderr)
            run["load_avg_after"] = os.getloadavg()[0]
            if run.get("other_cpu_cores") is not None:
                print(f"bench-wan: {label}: {run['tokens_per_s']:,.0f} tokens/s, other processes used "
                      f"{run['other_cpu_cores']:.2f} CPU cores meanwhile")
            repeats.setdefault((link, m), []).append(run)
    result["runs"] = select_pass(repeats)
    compare_to_allreduce(result["runs"], a.local_steps)
    fractions_by_pass(result["runs"])
    result["sweep_s"] = time.monotonic() - started
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(markdown_table(result["runs"]))
    print(f"bench-wan: wrote {a.out}" + (f" and {a.plot}" if plot(result, a.plot) else "")
          + f" ({result['sweep_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
