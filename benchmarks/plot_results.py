"""Plot ``gpu_throughput.py``'s JSON into a PNG (needs matplotlib; the GPU machines have none: plot here).

    python benchmarks/plot_results.py throughput DIR/gpu.json [PNG]

The convergence plot is ``convergence.py``'s own (``DIR/convergence.png``, also with ``--report-only``);
the WAN plot ``wan_bench.py``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path



def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: Method names of gpu_throughput.py (where ``dilocox`` is int8).
THROUGHPUT_LABELS = {"allreduce": "AllReduce DP (DDP)", "allreduce-distopt": "AllReduce DP (dist. optimizer)",
                     "diloco": "DiLoCo (blocking, fp32)", "dilocox": "DiLoCoX (delayed, int8)",
                     "dilocox-adaptive": "DiLoCoX (delayed, adaptive)", "dilocox-fp32": "DiLoCoX (delayed, fp32)"}


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


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "throughput":
        raise SystemExit("usage: python benchmarks/plot_results.py throughput DIR/gpu.json [PNG]")
    src = Path(sys.argv[2])
    plot_throughput(src, Path(sys.argv[3]) if len(sys.argv) > 3 else src.with_suffix(".png"))
