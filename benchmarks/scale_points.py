"""Convergence points by model size and tokens per parameter (issue 39): the package default against
AllReduce, each at its best inner lr, beside the published gaps of DiLoCo to data parallelism.

A point is one regime (parameters, tokens, replicas, H) of ``benchmarks/convergence.py``: its runs of
``allreduce`` / ``allreduce_lr*`` and ``default`` / ``default_lr*`` (an lr sweep), merged into one
``convergence.json`` with ``convergence.py --report-only --from ...``. This script turns it into a point of
``results/convergence_scale.json`` (``points``, replacing a point of the same regime):

    python benchmarks/scale_points.py --add DIR/convergence.json --commit C [--card CARD] [--note TEXT]
    python benchmarks/scale_points.py --add-earlier      # RESULTS §2.3's sweep (convergence_h.json), H 30 and 100

The plot (``plots/gap_vs_size.png``) is drawn by ``benchmarks/plots.py --only size``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCALE = RESULTS / "convergence_scale.json"
sys.path.insert(0, str(HERE.parent))
from benchmarks.convergence import METHODS, MODEL, paired_gap  # noqa: E402

#: Published gaps of DiLoCo to data parallelism (final loss / DP's - 1), at about 20 tokens per parameter.
#: Charles et al., "Scaling Laws for DiLoCo" (arXiv 2503.09799), Table 4: H 30, uncompressed, inner lr and
#: batch tuned per size and M, outer Nesterov 0.9. Streaming DiLoCo (arXiv 2501.18512), Table 5: M 2,
#: overlapped, FP4 outer gradients, losses DP / H 30 / H 100 turned into gaps here.
PUBLISHED = [
    *({"source": "Charles et al. 2025 (2503.09799), Table 4", "params": p, "replicas": m, "H": 30,
       "tokens_per_param": 20, "gap": g / 100}
      for p, g2, g4 in ((35e6, 0.7, 2.0), (90e6, 0.5, 1.5), (180e6, 0.3, 1.1), (335e6, 0.1, 0.9), (550e6, 0.2, 0.7),
                        (1.3e9, 0.2, 0.5), (2.4e9, -0.1, 0.3)) for m, g in ((2, g2), (4, g4))),
    *({"source": "Streaming DiLoCo (2501.18512), Table 5, FP4", "params": p, "replicas": 2, "H": h,
       "tokens_per_param": 20, "gap": loss / dp - 1}
      for p, dp, l30, l100 in ((100e6, 3.19, 3.21, 3.22), (300e6, 2.80, 2.81, 2.83), (1e9, 2.49, 2.48, 2.50))
      for h, loss in ((30, l30), (100, l100))),
]


def lr_of(name: str) -> float:
    """The inner lr a convergence.py method trains at: its own ``--lr``, else the common flags' (MODEL)."""
    flags = METHODS[name].get("flags", [])
    return float(flags[flags.index("--lr") + 1] if "--lr" in flags else MODEL[MODEL.index("--lr") + 1])


def _sweep(methods: dict, family: str) -> dict[str, dict]:
    """``family``'s rows of a convergence.json (``allreduce``, ``allreduce_lr2e-3``, ...; ``default``, ...) that
    finished, by inner lr (``"%g"``): their per-seed losses, seeds and bytes."""
    out = {}
    for name, row in methods.items():
        if (name == family or name.startswith(f"{family}_lr")) and row.get("final_val_loss_per_seed"):
            out[f"{lr_of(name):g}"] = {"row": name, "seeds": row["seeds"],
                                      "final_val_loss_per_seed": row["final_val_loss_per_seed"],
                                      "bytes_total": row.get("bytes_total")}
    if not out:
        raise SystemExit(f"no finished {family!r} row in the runs: a point needs {family} at one lr at least")
    return out


def _best(sweep: dict[str, dict]) -> str:
    """The lr whose runs end lowest over the seeds every lr of the sweep ran (seed noise would otherwise pick
    the lr that ran the luckier seed); over each lr's own seeds where they share none."""
    common = set.intersection(*(set(r["seeds"]) for r in sweep.values()))

    def loss(r: dict) -> float:
        vals = [v for s, v in zip(r["seeds"], r["final_val_loss_per_seed"]) if not common or s in common]
        return statistics.mean(vals)
    return min(sweep, key=lambda lr: loss(sweep[lr]))


def point(conv: dict, *, resolved_flags: dict | None, commit: str, card: str, note: str | None = None) -> dict:
    """One point from a merged convergence.json (``regime`` + ``methods``): each family at its best lr, the
    default's gap to AllReduce's best over their shared seeds, bytes per rank, and every lr that ran."""
    reg = conv["regime"]
    out = {"params": reg["params"], "tokens": reg["tokens"], "tokens_per_param": reg["tokens"] / reg["params"],
           "replicas": reg["replicas"], "H": reg["local_steps"], "card": card, "commit": commit,
           "regime": {k: reg.get(k) for k in ("tokens_per_step", "corpus", "epochs", "fast_path", "launch")}}
    for family in ("allreduce", "default"):
        sweep = _sweep(conv["methods"], family)
        lr = _best(sweep)
        out[family] = {"lr": float(lr), "final_val_loss_per_seed": sweep[lr]["final_val_loss_per_seed"],
                       "seeds": sweep[lr]["seeds"], "bytes_total": sweep[lr]["bytes_total"],
                       "lr_sweep": {k: {"seeds": v["seeds"], "final_val_loss_per_seed": v["final_val_loss_per_seed"]}
                                    for k, v in sorted(sweep.items(), key=lambda kv: float(kv[0]))},
                       "best_lr_bracketed": min(sweep, key=float) != lr != max(sweep, key=float)}
    out["default"]["resolved_flags"] = resolved_flags
    mean = lambda r: {**r, "final_val_loss": statistics.mean(r["final_val_loss_per_seed"])}  # noqa: E731
    out["gap_best_lrs"], out["gap_seeds"] = paired_gap(mean(out["default"]), mean(out["allreduce"]))
    out["fewer_bytes"] = out["allreduce"]["bytes_total"] / out["default"]["bytes_total"]
    if note:
        out["note"] = note
    return out


def resolved_from_log(log: Path) -> dict:
    """The DiLoCoX settings a run resolved (the example's ``DiLoCoX on: DiLoCoXConfig(...)`` line): name -> value."""
    import ast
    import re

    m = re.search(r"DiLoCoX on: DiLoCoXConfig\((.*?)\); ", log.read_text(errors="replace"))
    if m is None:
        raise SystemExit(f"{log}: no 'DiLoCoX on: DiLoCoXConfig(...)' line (not a DiLoCoX run's log?)")
    return {k: ast.literal_eval(v) for k, v in re.findall(r"(\w+)=('[^']*'|[^,]+)", m[1])}


def earlier_points(conv_h: dict) -> list[dict]:
    """RESULTS §2.3's inner-lr sweep (convergence_h.json, 3000 steps of 16,384 tokens) as points at H 30 and 100."""
    reg, out = conv_h["regime"], []
    for h, sweep in conv_h["lr_sweep"].items():
        rows = conv_h["runs"][h]
        methods = {}
        for family in ("allreduce", "default"):
            for lr, r in sweep[family]["per_lr"].items():
                name = family if float(lr) == 1e-3 else f"{family}_lr{lr}"
                methods[name] = {**r, "bytes_total": rows[name]["bytes_total"]}
        conv = {"regime": {**reg, "local_steps": int(h)}, "methods": methods}
        out.append(point(conv, resolved_flags=rows["default"].get("resolved_flags"),
                         commit=reg["commit"].split(" ")[0], card="NVIDIA H200",
                         note="RESULTS §2.3 (convergence_h.json): the local layers (--transformer-impl local), "
                              "micro-batch 16 per replica, 100 MB corpus"))
    return out


def merge(scale: dict, new: list[dict]) -> dict:
    """``scale`` with ``new`` points in place of those of the same regime (params, tokens, replicas, H)."""
    key = lambda p: (p["params"], p["tokens"], p["replicas"], p["H"])  # noqa: E731
    keep = [p for p in scale.get("points", []) if key(p) not in {key(n) for n in new}]
    scale["points"] = sorted([*keep, *new], key=lambda p: (p["params"], p["tokens"], p["replicas"], p["H"]))
    scale["published"] = PUBLISHED
    return scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--add", type=Path, help="a merged convergence.json of one regime")
    p.add_argument("--log", type=Path, help="a default run's replica log (its resolved DiLoCoX settings)")
    p.add_argument("--commit")
    p.add_argument("--card", default="NVIDIA H200")
    p.add_argument("--note")
    p.add_argument("--add-earlier", action="store_true", help="RESULTS §2.3's sweep (results/convergence_h.json)")
    a = p.parse_args()
    new = []
    if a.add:
        if not a.commit:
            p.error("--add: give --commit (the commit the runs trained at)")
        new.append(point(json.loads(a.add.read_text()), resolved_flags=resolved_from_log(a.log) if a.log else None,
                         commit=a.commit, card=a.card, note=a.note))
    if a.add_earlier:
        new += earlier_points(json.loads((RESULTS / "convergence_h.json").read_text()))
    scale = merge(json.loads(SCALE.read_text()) if SCALE.exists() else {}, new)
    SCALE.write_text(json.dumps(scale, indent=1) + "\n")
    for pt in scale["points"]:
        print(f"{pt['params'] / 1e6:.1f}M, {pt['tokens_per_param']:.2f} tokens/param, M {pt['replicas']}, H {pt['H']}: "
              f"AllReduce {pt['allreduce']['lr']:g} default {pt['default']['lr']:g}, gap {100 * pt['gap_best_lrs']:+.2f}% "
              f"(seeds {pt['gap_seeds']}), {pt['fewer_bytes']:.0f}x fewer bytes")


if __name__ == "__main__":
    main()
