"""Plot the committed benchmark JSON files into PNGs beside RESULTS.md (needs matplotlib).

    python benchmarks/plot_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def gpu_smoke() -> None:
    smoke = json.loads((HERE / "results" / "gpu_smoke.json").read_text())
    sweep_path = HERE / "results" / "outer_sweep.json"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"vanilla": "vanilla Megatron DP (AllReduce every step)",
              "dilocox": "DiLoCoX delayed, eta 0.7 mu 0.9", "dilocox_none": "DiLoCo (no delay), eta 0.7 mu 0.9"}
    for name, run in smoke["loss"].items():
        its = sorted(int(k) for k in run["curve"])
        ax.plot(its, [run["curve"][str(i)] for i in its], label=labels.get(name, name), lw=2)
    if sweep_path.exists():
        for run in json.loads(sweep_path.read_text())["runs"]:
            its = sorted(int(k) for k in run["curve"])
            ax.plot(its, [run["curve"][str(i)] for i in its], ls="--", lw=1,
                    label=f"{run['overlap']}, eta {run['outer_lr']} mu {run['outer_momentum']}")
    ax.set_xlabel("iteration (global batch 64 x 1024 tokens)")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(f"GPU smoke: 85M byte-level GPT, 2 replicas x PP 2, H={smoke['local_steps']}, {smoke['card']} x4")
    ax.set_ylim(1.2, 4.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "gpu_smoke_loss.png", dpi=110)


if __name__ == "__main__":
    gpu_smoke()
