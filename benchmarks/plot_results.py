"""Plot benchmark JSON files into PNGs (needs matplotlib; the GPU machines have none: plot here).

    python benchmarks/plot_results.py                                   # results/gpu_smoke.json (+ sweep)
    python benchmarks/plot_results.py convergence DIR/convergence.json [PNG]
    python benchmarks/plot_results.py throughput DIR/gpu.json [PNG]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: Method names of convergence.py and of gpu_throughput.py (where ``dilocox`` is int8).
CONVERGENCE_LABELS = {"allreduce": "AllReduce DP (every step)", "diloco": "DiLoCo (blocking, fp32)",
                      "dilocox": "DiLoCoX (delayed, fp32)", "dilocox_compressed": "DiLoCoX (delayed, adaptive)",
                      "dilocox_eager": "DiLoCoX (eager, fp32)",
                      "dilocox_eager_compressed": "DiLoCoX (eager, adaptive)",
                      "diloco_compressed": "DiLoCo (blocking, adaptive)",
                      "diloco_compressed_energy0.99": "DiLoCo (blocking, adaptive E=0.99)",
                      "dilocox_eager_compressed_energy0.99": "DiLoCoX (eager, adaptive E=0.99)",
                      "dilocox_eager_full": "DiLoCoX (eager w=1, fp32)",
                      "dilocox_eager_full_compressed": "DiLoCoX (eager w=1, adaptive)"}
THROUGHPUT_LABELS = {"allreduce": "AllReduce DP (DDP)", "allreduce-distopt": "AllReduce DP (dist. optimizer)",
                     "diloco": "DiLoCo (blocking, fp32)", "dilocox": "DiLoCoX (delayed, int8)",
                     "dilocox-adaptive": "DiLoCoX (delayed, adaptive)", "dilocox-fp32": "DiLoCoX (delayed, fp32)"}


def plot_convergence(json_path: Path, png_path: Path) -> None:
    """Validation loss vs tokens and vs bytes sent per rank (log x), one line per method."""
    plt = _plt()
    data = json.loads(Path(json_path).read_text())
    setup = data.get("setup", {})
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (method, r) in enumerate(data["methods"].items()):
        if "error" in r or not r.get("curve"):
            continue
        label = CONVERGENCE_LABELS.get(method, method)
        tokens = [p[0] / 1e6 for p in r["curve"]]
        loss = [p[1] for p in r["curve"]]
        nbytes = [max(p[2], 1.0) for p in r["curve"]]
        style = dict(lw=1.8, color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20],
                     ls="--" if "compressed" in method else "-")
        (line,) = ax_t.plot(tokens, loss, label=label, **style)
        ax_b.plot(nbytes, loss, label=label, **style)
        if r.get("final_val_loss") is not None:  # after training (delayed: after the final drain)
            ax_t.plot([r["tokens"] / 1e6], [r["final_val_loss"]], "o", color=line.get_color(), ms=4)
            ax_b.plot([max(r["bytes_total"], 1.0)], [r["final_val_loss"]], "o", color=line.get_color(), ms=4)
    ax_t.set_xlabel("tokens (M)")
    ax_b.set_xlabel("bytes sent per rank across the link (log)")
    ax_b.set_xscale("log")
    for ax in (ax_t, ax_b):
        ax.set_ylabel("validation loss (nats / byte)")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"{data.get('model')}, H={setup.get('local_steps')}, {data.get('card')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def plot_throughput(json_path: Path, png_path: Path) -> None:
    """Tokens/s per method, grouped by link bandwidth (and GPU count)."""
    plt = _plt()
    data = json.loads(Path(json_path).read_text())
    groups = sorted({(r["gpus"], r["link_mbps"]) for r in data["runs"]}, key=lambda g: (g[0], -g[1]))
    methods = list(dict.fromkeys(r["method"] for r in data["runs"]))
    fig, ax = plt.subplots(figsize=(4.5 + 1.6 * len(groups), 4.5))
    width = 0.8 / max(1, len(methods))
    for k, m in enumerate(methods):
        xs, ys = [], []
        for g_i, (gpus, link) in enumerate(groups):
            for r in data["runs"]:
                if (r["gpus"], r["link_mbps"], r["method"]) == (gpus, link, m):
                    xs.append(g_i + (k - (len(methods) - 1) / 2) * width)
                    ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=THROUGHPUT_LABELS.get(m, m))
    ax.set_xticks(range(len(groups)), [f"{g} GPUs, {l:g} Mbit/s" for g, l in groups])
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"{data.get('model')}; {data.get('card')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def gpu_smoke() -> None:
    plt = _plt()
    smoke = json.loads((HERE / "results" / "gpu_smoke.json").read_text())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"vanilla": "vanilla Megatron DP (AllReduce every step)",
              "dilocox": "DiLoCoX delayed, eta 0.7 mu 0.9", "dilocox_none": "DiLoCo (no delay), eta 0.7 mu 0.9"}
    for name, run in smoke["loss"].items():
        its = sorted(int(k) for k in run["curve"])
        ax.plot(its, [run["curve"][str(i)] for i in its], label=labels.get(name, name), lw=2)
    ax.set_xlabel("iteration (global batch 64 x 1024 tokens)")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(f"GPU smoke: 85M byte-level GPT, 2 replicas x PP 2, H={smoke['local_steps']}, {smoke['card']} x4")
    ax.set_ylim(1.2, 4.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "gpu_smoke_loss.png", dpi=110)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] in ("convergence", "throughput"):
        src = Path(sys.argv[2])
        dst = Path(sys.argv[3]) if len(sys.argv) > 3 else src.with_suffix(".png")
        (plot_convergence if sys.argv[1] == "convergence" else plot_throughput)(src, dst)
    else:
        gpu_smoke()
