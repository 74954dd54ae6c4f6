"""Every plot of the benchmark report, drawn from ``benchmarks/results/*.json`` only (no run, no GPU):

    python benchmarks/plots.py [--out benchmarks/plots] [--only gap,bytes,speedup,...]   # or: make plots

- ``gap_vs_tokens.png`` (``results/convergence.json``): the gap to AllReduce's validation loss, %, vs
  tokens, for the headline rows of RESULTS §2.1.
- ``loss_vs_bytes.png`` (``results/convergence.json``): final validation loss vs bytes sent per rank,
  with the Pareto frontier; only frontier points are labelled.
- ``speedup_vs_link.png`` (``results/wan.json``, ``results/gpu.json``): speedup over AllReduce vs the
  slow link's bandwidth; the planner's curves (``python -m megatron_diloco.plan``, run in-process
  through its command line) at 1B / 10B / 100B, and next to them the planner's curves for the
  measured configurations with the measured points on them.
- ``gap_vs_h.png`` (``results/convergence_h.json``): the default's gap to AllReduce at each H, per
  seed and mean, beside blocking DiLoCo and the warm-up rule it replaced where they were run.
- ``fault_tolerance.png`` (``results/fault_tolerance.json``): training loss of a job whose peer was
  killed and restarted, beside the undisturbed run.
- ``wan.png`` (``results/wan.json``): ``benchmarks/throughput/wan_bench.py``'s figure (tokens/s,
  speedup, utilization per emulated link).
- ``gap_vs_size.png`` (``results/convergence_scale.json``): the package default's gap to AllReduce (each at its
  best inner lr) by model size and by tokens per parameter, beside the published gaps of DiLoCo to data
  parallelism (Charles et al. 2025; Streaming DiLoCo), with each point's bytes.
- ``sites.png`` (``results/heterogeneous.json`` with ``heterogeneous_paced.json``; ``heterogeneous_gpu.json`` with
  ``heterogeneous_paced_gpu.json``: a row each): two sites of different speed, per way of running them: the fast
  site's idle share of its wall time and the run's tokens/s against the two sites' solo sum.
- ``sites_loss.png`` (``results/heterogeneous_loss*_gpu.json``): the same two sites at equal tokens, each way of
  running them (and of weighing their means): its validation loss against AllReduce's, per seed.

Each plot is stamped with the commit it was made at (``git rev-parse --short HEAD``; ``+dirty`` when
the results or this file have uncommitted changes). Needs matplotlib (``make bench-venv``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

#: RESULTS §2.1's headline rows (benchmarks/convergence.py: HEADLINE_METHODS; the default measured
#: at H = 30 as ``partial_auto_int4_hwarm900_wtau1_w2``)
DEFAULT_ROW = "partial_auto_int4_hwarm900_wtau1_w2"
GAP_ROWS = (DEFAULT_ROW, "diloco_int4_hwarm900_w2", "partial_auto_int4", "diloco_int4")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def commit_stamp() -> str:
    """The short commit, ``+dirty`` when the results or this file differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCH, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", str(RESULTS), str(Path(__file__).resolve()))
    return head + ("+dirty" if dirty else "")


def _save(fig, path, stamp: str, bottom: float = 0.0) -> None:
    """Lay out (``bottom``: room for a caption), stamp with the commit, write ``path``, close."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, bottom, 1, 0.97))
    fig.text(0.995, 0.995, f"commit {stamp}", ha="right", va="top", fontsize=7, color="0.4")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- convergence
def label(name: str, row: dict) -> str:
    """A reader's label for a convergence row (the harness names are for the harness)."""
    if row.get("overlap") == "allreduce":
        return "AllReduce" + (" (inner lr " + name.split("_lr")[1] + ")" if "_lr" in name else "")
    if name == DEFAULT_ROW:
        return "default (--diloco-x)"
    parts = ["blocking" if row["overlap"] == "none" else row["overlap"]]
    if row["overlap"] == "partial" and row.get("tau") not in (None, "auto"):
        parts[0] += f" tau {row['tau']}"
    parts.append("fp32" if row.get("codec") in (None, "none") else row["codec"])
    if row.get("local_steps") not in (None, 30):
        parts.append(f"H {row['local_steps']}")
    warm = re.search(r"hwarm(\d*)", name)
    if warm:
        w = f"warm-up {warm[1] or 300} steps"
        h0 = re.search(r"_h0_(\d+)", name)
        w += f" of H0 {h0[1]}" if h0 else ""
        w += " as int2" if name.endswith("_w2") else ""
        tau_w = re.search(r"_wtau(\d+)", name)
        w += f" tau_w {tau_w[1]}" if tau_w else ""
        parts.append(w)
    if row.get("outer_lr") not in (None, 1.0):
        parts.append(f"eta {row['outer_lr']:g}")
    return ", ".join(parts)


def _paired_final_gaps(row: dict, ref: dict) -> list[float]:
    """Per seed that both ran: final validation loss / AllReduce's - 1, in %."""
    theirs = dict(zip(ref["seeds"], ref["final_val_loss_per_seed"]))
    return [100 * (v / theirs[s] - 1) for s, v in zip(row["seeds"], row["final_val_loss_per_seed"]) if s in theirs]


def gap_band(row: dict, ref: dict) -> tuple[list[float], list[float], list[float]] | None:
    """The band over seeds of a row's gap to AllReduce (%) along tokens: per seed both ran (curves
    ``curve_per_seed``, paired by seed), at the tokens every such seed evaluated, (tokens, min, max).
    None when fewer than two seeds have curves (runs recorded before per-seed curves were kept)."""
    mine, theirs = row.get("curve_per_seed") or {}, ref.get("curve_per_seed") or {}
    seeds = [s for s in mine if s in theirs]
    if len(seeds) < 2:
        return None
    gaps = []
    for s in seeds:
        ours, base = dict(map(tuple, mine[s])), dict(map(tuple, theirs[s]))
        gaps.append({t: 100 * (v / base[t] - 1) for t, v in ours.items() if t in base})
    xs = sorted(set.intersection(*(set(g) for g in gaps)))
    return xs, [min(g[t] for g in gaps) for t in xs], [max(g[t] for g in gaps) for t in xs]


def _gap_axes(ax, xlabel: str, title: str, legend_loc: str = "best") -> None:
    """Labels, a small title, a grid and the legend of a gap-to-AllReduce plot."""
    ax.set(xlabel=xlabel, ylabel="validation loss above AllReduce (%)", title=title)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc=legend_loc)


def plot_gap(conv: dict, path: Path, stamp: str) -> None:
    """Gap to AllReduce (%) vs tokens: the curve of each row's first seed (the only curve the JSON
    keeps), and at the end every seed's final gap (after the drain) with the mean."""
    plt = _plt()
    methods = conv["methods"]
    ref = methods["allreduce"]
    ref_curve = dict(map(tuple, ref["curve"]))
    end = conv["regime"]["tokens"] / 1e6
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for k, name in enumerate(n for n in GAP_ROWS if n in methods):
        row = methods[name]
        color = f"C{k}"
        xs = [t for t, _ in row["curve"] if t in ref_curve]
        ys = [100 * (dict(map(tuple, row["curve"]))[t] / ref_curve[t] - 1) for t in xs]
        ax.plot([x / 1e6 for x in xs], ys, color=color, lw=2.2 if name == DEFAULT_ROW else 1.3,
                label=f"{label(name, row)}: final {100 * row['gap_vs_allreduce']:+.2f}% ({len(row['seeds'])} seeds)")
        band = gap_band(row, ref)
        if band is not None:
            ax.fill_between([x / 1e6 for x in band[0]], band[1], band[2], color=color, alpha=0.15, lw=0)
        finals = _paired_final_gaps(row, ref)
        x_end = end * (1.03 + 0.025 * k)
        ax.scatter([x_end] * len(finals), finals, color=color, s=14, zorder=3)
        ax.errorbar([x_end], [100 * row["gap_vs_allreduce"]], yerr=[[100 * row["gap_vs_allreduce"] - min(finals)],
                    [max(finals) - 100 * row["gap_vs_allreduce"]]], color=color, marker="_", ms=10, capsize=0, lw=1)
    ax.axhline(0, color="black", lw=0.8)
    ax.axvline(end, color="0.7", lw=0.8, ls=":")
    ax.text(end * 1.005, ax.get_ylim()[0], " final, per seed", va="bottom", fontsize=7, color="0.35")
    r = conv["regime"]
    _gap_axes(ax, "tokens (M)", f"Gap to AllReduce, {r['params'] / 1e6:.1f}M GPT, {r['replicas']} replicas, "
              f"H = {r['local_steps']}, {r['tokens'] / 1e6:.1f}M tokens ({conv.get('card', '')})", "upper right")
    fig.text(0.01, 0.005, "Lines: mid-run evaluations of each row's first seed vs AllReduce's; shade: min..max over "
             "seeds where per-seed curves were recorded. Overlapped rows read high there\n(an evaluation at a boundary sees unmerged "
             "parameters). Right: final evaluation after the drain, each seed paired with AllReduce's; bar = min..max, "
             "tick = mean.", fontsize=6.5, color="0.3", va="bottom")
    _save(fig, path, stamp, bottom=0.06)


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points no other point beats on both bytes and loss (fewer-or-equal bytes and lower loss),
    by increasing bytes."""
    front, best = [], math.inf
    for b, loss, name in sorted(points, key=lambda p: (p[0], p[1])):
        if loss < best:
            front.append((b, loss, name))
            best = loss
    return front


def plot_bytes(conv: dict, path: Path, stamp: str) -> None:
    """Final validation loss vs bytes sent per rank; the Pareto frontier drawn and labelled."""
    plt = _plt()
    methods = conv["methods"]
    # rows at the recipe's inner lr (the lr sweep's rows answer another question)
    rows = {n: r for n, r in methods.items() if r.get("final_val_loss") and r.get("bytes_total") and "_lr" not in n}
    pts = [(r["bytes_total"] / 1e9, r["final_val_loss"], n) for n, r in rows.items()]
    front = pareto(pts)
    on_front = {n for _, _, n in front}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.scatter([b for b, _, n in pts if n not in on_front], [l for _, l, n in pts if n not in on_front],
               color="0.65", s=16, label="other measured rows", zorder=2)
    fx, fy = [b for b, _, _ in front], [l for _, l, _ in front]
    ax.step(fx, fy, where="post", color="C3", lw=1.2, zorder=1, label="Pareto frontier")
    ax.scatter(fx, fy, color="C3", s=28, zorder=3)
    if DEFAULT_ROW in rows and DEFAULT_ROW not in on_front:
        r = rows[DEFAULT_ROW]
        ax.scatter([r["bytes_total"] / 1e9], [r["final_val_loss"]], marker="*", s=140, color="C0", zorder=4,
                   label=f"default (--diloco-x): {r['final_val_loss']:.4f}, {r['bytes_total'] / 1e9:.2f} GB")
    # labels of the frontier only, stacked in a column right of the cluster (in loss order, so the
    # connectors do not cross); the last point (most bytes) is labelled on its left
    lo, hi = min(l for _, l, _ in pts), max(l for _, l, _ in pts)
    cluster = front[:-1]
    slots = [hi - (hi - lo) * (0.05 + 0.6 * i / max(1, len(cluster) - 1)) for i in range(len(cluster))]
    x_text = 12.0  # GB: right of the DiLoCo rows (4-8 GB), left of AllReduce
    for (b, loss, n), y in zip(sorted(cluster, key=lambda p: -p[1]), slots):
        ax.annotate(f"{label(n, rows[n])}: {loss:.4f}, {b:.3g} GB", (b, loss), xytext=(x_text, y), fontsize=7,
                    va="center", arrowprops=dict(arrowstyle="-", color="0.5", lw=0.6, relpos=(0, 0.5)))
    b, loss, n = front[-1]
    ax.annotate(f"{label(n, rows[n])}\n{loss:.4f}, {b:.3g} GB", (b, loss), xytext=(-8, 0), textcoords="offset points",
                fontsize=7, ha="right", va="center")
    ax.set_xscale("log")
    ax.set_ylim(lo - 0.35 * (hi - lo), hi + 0.05 * (hi - lo))
    r = conv["regime"]
    ax.set(xlabel="bytes sent per rank over the run (GB, log)", ylabel="final validation loss",
           title=f"Final loss vs bytes, {r['params'] / 1e6:.1f}M GPT, {r['replicas']} replicas, "
                 f"{r['tokens'] / 1e6:.1f}M tokens; means over each row's seeds (1-3)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="lower left")
    _save(fig, path, stamp)


# --------------------------------------------------------------------------- speedup vs link
def plan_json(flags: list[str]) -> dict:
    """``python -m megatron_diloco.plan <flags> --json``: the command line's own entry point, called
    in-process (torch, which the codec's byte layout needs, is imported once for every call)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = importlib.import_module("megatron_diloco.plan").main([*flags, "--json"])
    if code:
        raise RuntimeError(f"python -m megatron_diloco.plan {' '.join(flags)}: exit {code}")
    return json.loads(out.getvalue())


#: The planner's projections at three sizes (its FLOP model; the speedup depends on the model size
#: only through the layout's tokens per GPU per step, H and the codec, so the layouts are stated)
SIZES = (
    ("1B: 8 GPUs / replica (DP 8), 0.5M tokens / step", ["--params", "1e9", "--dp", "8", "--tokens-per-step", "524288"]),
    ("10B: 32 GPUs / replica (TP 4 x DP 8), 1M tokens / step",
     ["--params", "10e9", "--tp", "4", "--dp", "8", "--tokens-per-step", "1048576"]),
    ("100B: 128 GPUs / replica (TP 8 x PP 8 x DP 2), 2M tokens / step",
     ["--params", "100e9", "--tp", "8", "--pp", "8", "--dp", "2", "--tokens-per-step", "2097152"]),
)
SIZES_COMMON = ["--replicas", "2", "--gpu-tflops", "400", "--local-steps", "100", "--codec", "int4",
                "--overlap", "partial", "--link-scope", "cluster"]


def _links(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def measured_setups() -> list[dict]:
    """The measured configurations of wan.json / gpu.json as planner flags, with their points
    (bandwidth, measured speedup over AllReduce); the inputs as benchmarks/planning/plan_validate.py
    takes them (the run's layout, its measured inner step; CPU: its measured boundary work)."""
    out = []
    wan = json.loads((RESULTS / "wan.json").read_text())
    cfg, model = wan["config"], wan["model"]
    for method, codec, overlap, text in (("dilocox", "int4", "partial", "default (partial, int4)"),
                                         ("diloco", "none", "none", "DiLoCo (blocking, fp32)")):
        runs = [r for r in wan["runs"] if r["method"] == method and r.get("speedup_vs_allreduce")]
        if not runs:
            continue
        step = statistics.median(r["inner_step_s"] for r in runs)
        boundary = statistics.median(max(0.0, r["boundary_per_round_s"] - r["exposed_comm_per_round_s"]) for r in runs)
        out.append(dict(
            label=f"CPU, emulated WAN, {model['params'] / 1e6:.2f}M GPT, H {cfg['local_steps']}: {text}",
            flags=["--params", str(model["params"]), "--replicas", str(cfg["replicas"]),
                   "--tokens-per-step", str(model["tokens_per_iter"] // cfg["replicas"]),
                   "--step-time-s", f"{step:.6g}", "--boundary-s", f"{boundary:.6g}", "--param-bytes", "4",
                   "--local-steps", str(cfg["local_steps"]), "--codec", codec, "--overlap", overlap,
                   "--outer-momentum", "0", "--link-scope", "cluster"],
            points=[(r["link_mbps"], r["speedup_vs_allreduce"]) for r in runs]))
    gpu = json.loads((RESULTS / "gpu.json").read_text())
    for gpus in (2, 4):
        runs = [r for r in gpu["runs"] if r["method"] == "dilocox" and r["gpus"] == gpus]
        if not runs:
            continue
        pp = gpus // 2
        params = {1: 85_248_768, 2: 85_543_680}[pp]  # per rank of the 85.5M GPT by PP size (plan_validate)
        out.append(dict(
            label=f"{gpus} x H100, link model, 85.5M GPT, H {runs[0]['local_steps']}: delayed + int8",
            flags=["--params", str(params), "--pp", str(pp), "--replicas", "2",
                   "--tokens-per-step", str(runs[0]["tokens_per_step"] // 2),
                   "--step-time-s", f"{statistics.median(r['compute_step_s'] for r in runs):.6g}",
                   "--latency-ms", str(runs[0].get("latency_ms") or 0), "--link-scope", "gpu", "--link-efficiency", "1",
                   "--local-steps", str(runs[0]["local_steps"]), "--codec", "int8", "--overlap", "delayed",
                   "--outer-momentum", "0", "--baseline-algo", "ring", "--baseline-bytes-per-param", "8",
                   "--baseline-overlap"],
            points=[(r["link_mbps"], r["speedup_vs_allreduce"]) for r in runs]))
    return out


def plot_speedup(path: Path, stamp: str) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    links = _links(10, 100_000, 25)
    for k, (text, flags) in enumerate(SIZES):
        ys = [plan_json([*flags, *SIZES_COMMON, "--link-mbps", f"{l:g}"])["speedup_vs_allreduce"] for l in links]
        ax1.plot(links, ys, color=f"C{k}", lw=1.8, label=text)
    ax1.set(xscale="log", yscale="log", xlabel="slow link between the 2 clusters (Mbit/s, each way)",
            ylabel="speedup over AllReduce (tokens/s)",
            title="Planner: 2 replicas, 400 TFLOP/s per GPU, H = 100, int4, partial overlap")
    ax1.title.set_fontsize(9)
    ax1.axhline(1, color="black", lw=0.8)
    ax1.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=7.5)
    links2 = _links(5, 20_000, 25)
    for k, setup in enumerate(measured_setups()):
        color = f"C{k + 3}"
        ys = [plan_json([*setup["flags"], "--link-mbps", f"{l:g}"])["speedup_vs_allreduce"] for l in links2]
        ax2.plot(links2, ys, color=color, lw=1.2, ls="--")
        xs, ms = zip(*setup["points"])
        ax2.scatter(xs, ms, color=color, s=30, zorder=3, label=setup["label"])
    ax2.set(xscale="log", yscale="log", xlabel="link (Mbit/s, each way)", ylabel="speedup over AllReduce (tokens/s)",
            title="Measured (points) and the planner for the same configuration (dashed)")
    ax2.title.set_fontsize(9)
    ax2.axhline(1, color="black", lw=0.8)
    ax2.grid(alpha=0.3, which="both")
    ax2.set_ylim(0.8, 1000)  # room for the legend above the data
    ax2.legend(fontsize=7, loc="upper right")
    fig.text(0.01, 0.005, "Left: the planner's model (python -m megatron_diloco.plan), which leaves out activations, "
             "stragglers, and here latency (0 ms). Under its FLOP model the speedup depends on the model size only through the "
             "tokens per GPU per step, H and the codec.\nRight: benchmarks/results/wan.json (2 CPU cores, tc-shaped "
             "veth, one link per replica) and gpu.json (in-process link model, one link per GPU; delayed + int8 is "
             "an earlier configuration, not today's default);\ndashed: the planner given each run's measured inner "
             "step (benchmarks/RESULTS.md 3.1-3.3).", fontsize=6.5, color="0.3", va="bottom")
    _save(fig, path, stamp, bottom=0.08)


# --------------------------------------------------------------------------- separate jobs under failures
def _smooth(points: list, window: int) -> tuple[list[float], list[float]]:
    """Moving mean of ``(iteration, loss)`` points over ``window`` iterations (the per-step training loss
    of a small batch is noisy)."""
    its, vals = [p[0] for p in points], [p[1] for p in points]
    out = [sum(vals[max(0, i - window + 1):i + 1]) / len(vals[max(0, i - window + 1):i + 1]) for i in range(len(vals))]
    return its, out


def plot_faults(ft: dict, gpu: dict | None, path: Path, stamp: str) -> None:
    """The loss of job A in a run where job B was killed and restarted against the undisturbed run of the
    same seed (CPU and, when measured, 2 GPUs)."""
    plt = _plt()
    panels = [("CPU, 2 cores", ft)] + ([(gpu["machine"].split(",")[0], gpu)] if gpu else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (title, res) in zip(axes, panels):
        window = max(5, res["iters"] // 40)
        ax.plot(*_smooth(res["undisturbed"]["losses"], window), label="undisturbed", color="0.2")
        sc = res["scenarios"]
        ax.plot(*_smooth(sc["kill_restart"]["losses"], window), label="job B killed, restarted fresh", color="C3")
        if "kill_restart_from_checkpoint" in sc:
            ax.plot(*_smooth(sc["kill_restart_from_checkpoint"]["losses"], window),
                    label="job B killed, restarted from its checkpoint", color="C0")
        ax.set_title(f"{title}: {res['iters']} iterations, job A's training loss")
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"loss (mean of {window} iterations)")
        ax.legend(fontsize=8)
    _save(fig, path, stamp)


#: convergence_h.json's rows, in drawing order, with their legend labels
H_ROWS = {"default": "--diloco-x alone (the package default)", "blocking": "blocking DiLoCo, same codec and warm-up",
          "previous_default": "the warm-up rule before (H0 = H // 3)",
          "best_lrs": "the default at its best inner lr vs AllReduce at its own"}


def gap_vs_h_points(conv_h: dict) -> dict[str, list[tuple[int, list[float]]]]:
    """Per row of ``convergence_h.json``: [(H, [gap % per seed vs the mean of AllReduce's seeds])]; and
    ``best_lrs`` where the lr sweep ran: the default's best-lr row against AllReduce's best-lr row."""
    out: dict[str, list[tuple[int, list[float]]]] = {}
    sweep = conv_h.get("lr_sweep", {})
    for h, rows in sorted(conv_h["runs"].items(), key=lambda kv: int(kv[0])):
        ref = rows.get("allreduce", {}).get("final_val_loss_per_seed")
        if not ref:
            continue
        base = statistics.mean(ref)
        for name in H_ROWS:
            if name == "best_lrs":
                if h not in sweep:
                    continue
                row, ar = rows[sweep[h]["default"]["best_row"]], rows[sweep[h]["allreduce"]["best_row"]]
                best = statistics.mean(ar["final_val_loss_per_seed"])
                out.setdefault(name, []).append((int(h), [100 * (v / best - 1) for v in row["final_val_loss_per_seed"]]))
                continue
            vals = (rows.get(name) or {}).get("final_val_loss_per_seed")
            if vals:
                out.setdefault(name, []).append((int(h), [100 * (v / base - 1) for v in vals]))
    return out


def plot_gap_vs_h(conv_h: dict, path: Path, stamp: str) -> None:
    """Gap to AllReduce (%) vs H: each seed a dot, the mean a line, per row of convergence_h.json."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, (name, pts) in enumerate(gap_vs_h_points(conv_h).items()):
        hs = [h for h, _ in pts]
        for h, gaps in pts:
            ax.scatter([h] * len(gaps), gaps, color=f"C{k}", s=16, zorder=3)
        seeds = sorted({len(g) for _, g in pts})
        ax.plot(hs, [statistics.mean(g) for _, g in pts], color=f"C{k}", marker="_", ms=12,
                label=f"{H_ROWS[name]}: {'-'.join(map(str, (seeds[0], seeds[-1]) if len(seeds) > 1 else seeds))} "
                      f"seed{'s' if seeds[-1] > 1 else ''}, line = mean")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    hs = sorted(int(h) for h in conv_h["runs"])
    ax.set_xticks(hs, [str(h) for h in hs])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    r = conv_h["regime"]
    _gap_axes(ax, "H (inner steps per round)", f"Gap to AllReduce vs H: {r['params'] / 1e6:.1f}M GPT, "
              f"{r['replicas']} replicas, {r['steps']} steps ({r.get('card', '').split(' (')[0]});\n"
              "dots: each seed's final loss against the mean of AllReduce's seeds")
    _save(fig, path, stamp)


# --------------------------------------------------------------------------- gap by size
def plot_gap_vs_size(scale: dict, path: Path, stamp: str) -> None:
    """Left: gap to data parallelism (%) vs parameters, the published points (20 tokens per parameter) and ours
    (labelled with tokens per parameter and bytes). Right: our gap vs tokens per parameter, per H."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    pub = scale.get("published", [])
    series: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for q in pub:
        series.setdefault((q["source"], q["replicas"], q["H"]), []).append((q["params"], 100 * q["gap"]))
    for k, ((source, m, h), pts) in enumerate(sorted(series.items())):
        pts.sort()
        left.plot([x for x, _ in pts], [y for _, y in pts], color=f"C{k + 2}", marker="o", ms=4, lw=1, alpha=0.7,
                  label=f"{source.split(' (')[0]}: M {m}, H {h}")
    ours = scale.get("points", [])
    kinds = sorted({(q["params"], q["replicas"]) for q in ours})  # one colour per size and M
    colour = {k: c for k, c in zip(kinds, ["black", "C3", "C0", "C1", "C4", "C5"])}
    for q in ours:
        marker, c = "*" if q["H"] == 30 else "D", colour[(q["params"], q["replicas"])]
        for ax, x in ((left, q["params"]), (right, q["tokens_per_param"])):
            ax.scatter([x], [100 * q["gap_best_lrs"]], marker=marker, s=90 if marker == "*" else 40, color=c, zorder=4)
        near = [o for o in ours if o is not q and o["tokens"] == q["tokens"] and o["params"] == q["params"]
                and abs(o["gap_best_lrs"] - q["gap_best_lrs"]) < 0.002]  # (labels apart: the higher one above)
        dy = -3 if not near else 3 if q["gap_best_lrs"] >= near[0]["gap_best_lrs"] else -9
        right.annotate(f"H {q['H']}: {100 * q['gap_best_lrs']:+.2f}%, {q['fewer_bytes']:.0f}x", color=c,
                       xy=(q["tokens_per_param"], 100 * q["gap_best_lrs"]), xytext=(7, dy), textcoords="offset points",
                       fontsize=7)
    for (params, m), c in colour.items():
        left.scatter([], [], marker="s", color=c, label=f"ours: {params / 1e6:.0f}M, M {m} (the package default, int4)")
    left.scatter([], [], marker="*", color="0.3", label="ours at H 30 (star), H 100 (diamond); best lrs")
    left.axhline(0, color="black", lw=0.8)
    left.set_xscale("log")
    _gap_axes(left, "parameters", "Gap to data parallelism by size\n(published: ~20 tokens per parameter)",
              legend_loc="upper right")
    for q in pub:  # the published 90-100M, M 2 gaps at 20 tokens per parameter, as reference lines
        if q["replicas"] == 2 and q["params"] <= 100e6 and q["params"] >= 90e6:
            right.axhline(100 * q["gap"], color="0.6", lw=0.8, ls=":")
    right.set_xscale("log")
    right.set_xlim(0.3, 30)
    right.axvline(20, color="0.6", lw=0.8)
    right.text(20, right.get_ylim()[1], " 20", fontsize=7, va="top", color="0.4")
    right.set(xlabel="tokens per parameter", ylabel="validation loss above AllReduce (%)",
              title="Ours by tokens per parameter: gap, times fewer bytes\n(dotted: the published 90-100M, M 2 gaps, at 20)")
    right.title.set_fontsize(9)
    right.grid(alpha=0.3)
    right.set_ylim(bottom=0)
    cards = sorted({q["card"] for q in ours})
    fig.suptitle(f"DiLoCo's gap to data parallelism ({', '.join(cards)})", fontsize=9)
    fig.tight_layout()
    _save(fig, path, stamp)


# --------------------------------------------------------------------------- sites that differ
#: heterogeneous.json's runs, in the order and words of the plot
SITE_RUNS = (("equal", "the same flags\n(equal H, batch)"), ("balanced", "fast site: larger\nglobal batch"),
             ("per_site_h", "fast site: twice\nthe H"), ("paced", "both: --diloco-x-\nsite-pace 4"))


def plot_sites(hets: list[dict], path: Path, stamp: str) -> None:
    """Per machine (one row each: heterogeneous.json, heterogeneous_gpu.json) and way of running two sites of
    different speed: the fast site's idle share and the run's tokens/s against the solo sum (%), with the targets
    (5%, 95%) drawn."""
    plt = _plt()
    fig, axes = plt.subplots(len(hets), 2, figsize=(9, 3.3 * len(hets)), squeeze=False)
    for row, het in zip(axes, hets):
        runs = [(words, het["runs"][name]) for name, words in SITE_RUNS if name in het.get("runs", {})]
        for ax, key, title, target in ((row[0], "fast_site_idle_fraction", "fast site idle (% of its wall time)", 5),
                                       (row[1], "throughput_vs_solo_sum", "run's tokens/s (% of the solo sum)", 95)):
            values = [100 * r[key] for _, r in runs]
            colors = {"equal": "0.6", "balanced": "tab:blue", "per_site_h": "tab:green", "paced": "tab:purple"}
            bars = ax.bar(range(len(runs)), values,
                          color=[colors[n] for n, _ in SITE_RUNS if n in het.get("runs", {})])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target}%")
            ax.set_xticks(range(len(runs)), [w for w, _ in runs], fontsize=8)
            ax.set_title(f"{het.get('machine', '').split(',')[0]}: {title}", fontsize=9)
            ax.set_ylim(0, 105)
            ax.legend(fontsize=7.5, loc="upper right" if target < 50 else "lower right")
    commits = ", ".join(f"{h.get('machine', '').split(',')[0]} {h.get('commit')}"
                        + (f" (paced: {h['runs']['paced'].get('commit')})" if "paced" in h.get("runs", {}) else "")
                        for h in hets)
    fig.suptitle(f"Two sites, one half as fast (commits: {commits})", fontsize=9)
    fig.tight_layout()
    _save(fig, path, stamp)


#: the loss runs of heterogeneous.py (``results/heterogeneous_loss*_gpu.json``), in the order and words of the plot;
#: runs whose mean does not depend on the weights (one job's steps, or none) are keyed without them
LOSS_RUNS = (("equal_tokens", None, "the same H\n(equal steps)"), ("per_site_h", "tokens", "fast site: H 60\ntokens"),
             ("per_site_h", "normalized", "fast site: H 60\nnormalized"), ("paced", "tokens", "paced (P 4)\ntokens"),
             ("paced", "normalized", "paced (P 4)\nnormalized"))


def site_losses(files: list[dict]) -> dict:
    """{(run, weights or None): {seed: validation loss}} and AllReduce's {seed: loss} under ("allreduce", None),
    from heterogeneous.py's loss files (seed and weights read from each file's ``model``)."""
    out: dict = {}
    for het in files:
        seed = int(m[1]) if (m := re.search(r"--seed (\d+)", het["model"])) else 1234  # (the example's default)
        weights = "normalized" if "--diloco-x-site-weights normalized" in het["model"] else "tokens"
        for name, run in het["runs"].items():
            key = (name, weights if name in ("per_site_h", "paced") else None)
            if run.get("val_loss") is not None:
                out.setdefault(key, {})[seed] = run["val_loss"]
    return out


def plot_site_losses(losses: dict, path: Path, stamp: str, card: str) -> None:
    """Each way of running two sites of different speed: its validation loss's gap to AllReduce at the same tokens
    (%), per seed (points) and their mean (bar)."""
    plt = _plt()
    ar = losses[("allreduce", None)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = {"equal_tokens": "0.6", "per_site_h": "tab:green", "paced": "tab:purple"}
    rows = [(run, words, losses[(run, w)]) for run, w, words in LOSS_RUNS if (run, w) in losses]
    for i, (run, _, by_seed) in enumerate(rows):
        gaps = [100 * (v / ar[seed] - 1) for seed, v in sorted(by_seed.items()) if seed in ar]
        bar = ax.bar(i, statistics.mean(gaps), color=colors[run], alpha=0.8)
        ax.bar_label(bar, fmt="%+.1f%%", fontsize=8)
        ax.scatter([i] * len(gaps), gaps, color="k", s=12, zorder=3)
    ax.set_xticks(range(len(rows)), [words for _, words, _ in rows], fontsize=8)
    ax.set_ylabel("validation loss vs AllReduce (%)")
    ax.margins(y=0.15)
    seeds = sorted({s for _, _, v in rows for s in v})
    ax.set_title(f"Two sites, one half as fast, at the same tokens ({card}; seeds {', '.join(map(str, seeds))}: "
                 "points, mean: bar)", fontsize=9)
    fig.tight_layout()
    _save(fig, path, stamp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=BENCH / "plots", help="folder for the PNGs (default benchmarks/plots)")
    p.add_argument("--only", default="gap,bytes,speedup,h,faults,wan,sites,size",
                   help="comma-separated subset of gap, bytes, speedup, h, faults, wan, sites, size (default: all)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = commit_stamp()
    only = set(a.only.split(","))
    conv = json.loads((RESULTS / "convergence.json").read_text())
    made = []
    if "gap" in only:
        plot_gap(conv, a.out / "gap_vs_tokens.png", stamp)
        made.append("gap_vs_tokens.png")
    if "bytes" in only:
        plot_bytes(conv, a.out / "loss_vs_bytes.png", stamp)
        made.append("loss_vs_bytes.png")
    if "speedup" in only:
        plot_speedup(a.out / "speedup_vs_link.png", stamp)
        made.append("speedup_vs_link.png")
    if "faults" in only and (RESULTS / "fault_tolerance.json").exists():
        ft = json.loads((RESULTS / "fault_tolerance.json").read_text())
        plot_faults(ft, ft.get("gpu"), a.out / "fault_tolerance.png", stamp)
        made.append("fault_tolerance.png")
    if "h" in only and (RESULTS / "convergence_h.json").exists():
        plot_gap_vs_h(json.loads((RESULTS / "convergence_h.json").read_text()), a.out / "gap_vs_h.png", stamp)
        made.append("gap_vs_h.png")
    if "wan" in only and (RESULTS / "wan.json").exists():
        sys.path.insert(0, str(BENCH.parent))
        from benchmarks.throughput import wan_bench

        wan_bench.plot(json.loads((RESULTS / "wan.json").read_text()), a.out / "wan.png", stamp)
        made.append("wan.png")
    if "sites" in only and (RESULTS / "heterogeneous.json").exists():
        hets = [json.loads((RESULTS / f).read_text()) for f in ("heterogeneous.json", "heterogeneous_gpu.json")
                if (RESULTS / f).exists()]
        for het, paced in zip(hets, ("heterogeneous_paced.json", "heterogeneous_paced_gpu.json")):  # (later runs)
            if (RESULTS / paced).exists():
                het["runs"]["paced"] = json.loads((RESULTS / paced).read_text())["runs"]["paced"]
        plot_sites(hets, a.out / "sites.png", stamp)
        made.append("sites.png")
        loss_files = [json.loads(f.read_text()) for f in sorted(RESULTS.glob("heterogeneous_loss*_gpu.json"))]
        if loss_files:
            card = loss_files[0]["machine"].split(",")[0]
            plot_site_losses(site_losses(loss_files), a.out / "sites_loss.png", stamp, card)
            made.append("sites_loss.png")
    if "size" in only and (RESULTS / "convergence_scale.json").exists():
        scale = json.loads((RESULTS / "convergence_scale.json").read_text())
        if scale.get("points"):
            plot_gap_vs_size(scale, a.out / "gap_vs_size.png", stamp)
            made.append("gap_vs_size.png")
    print(f"plots ({stamp}): " + ", ".join(str(a.out / m) for m in made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
