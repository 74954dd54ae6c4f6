"""benchmarks/results/convergence_h.json from the warm-up-across-H runs (``run_device.sh``'s output folders:
the r*_h*.json files and logs.tgz unpacked beside them).

    PYTHONPATH=. python benchmarks/warmup_h/make_convergence_h.py RUNS
        the file from seed 1's folder (4 x H200, bbc6d91)
    PYTHONPATH=. python benchmarks/warmup_h/make_convergence_h.py --add RUNS [RUNS ...] --commit C --card CARD
        later runs merged into the file: seeds appended to the AllReduce / default rows, the default's blocking
        reference (convergence.py's ``default_blocking``) as the 'blocking' row; gaps recomputed. A run's
        ``run_resolved`` (what it resolved, from its log's summary) needs the logs beside the JSONs; the
        JSONs of the runs at 2314120 (no logs) are in benchmarks/results/convergence_h_runs/

Gaps: ``gap_vs_allreduce`` over the seeds both rows ran (convergence.paired_gap), ``gap_vs_allreduce_mean``
against the mean of every AllReduce seed, ``gap_vs_blocking`` (the default) over the seeds both ran.
"""
import argparse, copy, json, glob, statistics, sys
from megatron_diloco.summary import parse_summaries
from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args
sys.path.insert(0, "benchmarks")
import convergence

PATH = "benchmarks/results/convergence_h.json"
FIELDS = ("local_steps", "warmup_local_steps", "warmup_iters", "warmup_overlap_steps", "warmup_compression",
          "overlap", "overlap_steps", "merge", "compression", "outer_lr", "outer_momentum", "nesterov", "bandwidth_mbps")
RUN_FIELDS = ("local_steps", "warmup_local_steps", "warmup_iters", "warmup_overlap_steps", "warmup_compression",
              "overlap", "overlap_steps", "last_overlap_steps", "last_local_steps", "merge", "compression", "link_mbps")
#: convergence.py's method -> the row of each H it adds to (--add); AllReduce rows ("allreduce*") to every H
KEYS = {"allreduce": "allreduce", "default": "default", "default_blocking": "blocking",
        **{f"{m}_lr{lr}": f"{m}_lr{lr}" for m in ("allreduce", "default") for lr in ("5e-4", "2e-3")},
        "allreduce_lr2.5e-4": "allreduce_lr2.5e-4", "default_auto_h_100mbit": "auto_h_100mbit",
        "default_100mbit": "default_100mbit",
        **{f"default_mu{mu}_gain1": f"mu{mu}_gain1" for mu in ("0.5", "0.9")}}
#: the inner lrs of the sweep, by the suffix of their rows (1e-3: the common flags', the plain rows)
LRS = {"2.5e-4": "_lr2.5e-4", "5e-4": "_lr5e-4", "1e-3": "", "2e-3": "_lr2e-3"}
SEED1 = {"commit": "bbc6d91", "card": "NVIDIA H200 (a 4 x H200 host, one run per GPU)"}


def resolved(H, name):
    args, _ = add_diloco_x_args(argparse.ArgumentParser()).parse_known_args(
        ["--diloco-x-local-steps", str(H), *convergence.method_flags(name)])
    args.train_iters = 3000
    cfg = config_from_args(args)
    return {k: getattr(cfg, k) for k in FIELDS}


def as_run(D, H, name, seed=1):
    """the run's own summary (what it resolved when it ran); None without its log"""
    logs = glob.glob(f"{D}/*_h{H}/{name}_seed{seed}/replica0.log")
    if not logs:
        return None
    s = parse_summaries(open(logs[0], errors="replace").read())[-1]
    return {k: s.get(k) for k in RUN_FIELDS}


def build(D):
    runs = {}
    for f in ["r1_h300.json", "r2_h100.json", "r1_h100.json", "r2_h30.json"]:
        d = json.load(open(f"{D}/{f}"))
        H = d["regime"]["local_steps"]
        for name, r in d["methods"].items():
            if r.get("final_val_loss_per_seed"):
                runs[(H, name)] = (r, d)
    ar, regime_src = runs[(100, "allreduce")]
    AR = ar["final_val_loss"]; AR_BYTES = ar["bytes_total"]

    def row(H, name, extra=None):
        r, _ = runs[(H, name)]
        out = {"method": name, "final_val_loss_per_seed": r["final_val_loss_per_seed"], "seeds": r["seeds"],
               "final_val_loss_per_replica": r["final_val_loss_per_replica"],
               "gap_vs_allreduce": r["final_val_loss"] / AR - 1}
        if name != "allreduce":
            out.update(bytes_total=r["bytes_total"], fewer_bytes_than_allreduce=AR_BYTES / r["bytes_total"],
                       rounds=r["rounds"], replicas_identical=r["replicas_identical"], run_resolved=as_run(D, H, name))
        else:
            out.update(bytes_total=AR_BYTES, note="one world, 2 x 16 x 512 per step: H does not apply; the same run at every H")
        out["curve"] = r["curve"]
        out.update(extra or {})
        return out

    arow = row(100, "allreduce")
    out = {
      "regime": {**regime_src["regime"], "steps": 3000, "eval_iters": 32, "micro_batch_per_replica": 16,
                 "card": "NVIDIA H200 (a 4 x H200 host, one run per GPU, both replicas of a run on its GPU)",
                 "commit": "bbc6d91 (main 6fd7a45 + convergence.py's default_w900 / default_w1500 methods); package rule under test unchanged from 6fd7a45",
                 "command": "benchmarks/warmup_h/run_device.sh: convergence.py --micro-batch 16 --corpus-mb 100 --eval-iters 32 --jobs-per-gpu 1 --seeds 1 --local-steps H --methods ...",
                 "corpus_note": "built on the GPU image of 2026-11-28 (7045 documents, 104.9M tokens) where RESULTS \u00a72.1 had 7041 documents, 104.8M tokens: another validation split, so absolute losses are not comparable to \u00a72.1 / convergence.json (AllReduce 0.6896 here, 0.7656 there) and its AllReduce numbers were not reused; every gap below is against this file's AllReduce run",
                 "link_mbps_modelled": 1000, "seeds_note": "one seed (1) per row: device budget"},
      "rule": {"package_default": "H0 = min(H // 3, 10) for min(30 H, train-iters / 2) steps, rounded down to a multiple of H0 (arguments.resolve_warmup, 32e680f); tau_w = H0 // 10, int2 warm-up exchanges under int4",
               "previous": "H0 = H // 3 for min(30 H, train-iters / 3) steps (6fd7a45)",
               "default_resolved_flags_checked_by": "tests/test_convergence_jobs.py::test_convergence_h_default_is_the_package_rule"},
      "runs": {},
    }
    for H, default_name, extra in ((30, "default", {}), (100, "default_w1500", {"previous_default": "default"}),
                                   (300, "default_w1500", {"previous_default": "default", "h0_10_w900": "default_w900"})):
        entry = {"allreduce": arow}
        entry["default"] = row(H, default_name)
        entry["default"]["resolved_flags"] = resolved(H, "default")  # the package default on this branch at this H
        for key, name in extra.items():
            entry[key] = row(H, name)
            entry[key]["resolved_flags"] = entry[key]["run_resolved"]
        out["runs"][str(H)] = entry
    out["runs"]["30"]["default"]["note"] = "the package default at H 30 is the same under both rules (H0 10 for 900 steps)"
    out["earlier_corpus"] = {"note": "the earlier table: 2 x H200, commit 03ac5c0, the corpus of convergence.json (7041 documents); not comparable in absolute loss with the runs above",
                             "100": {"allreduce": [0.7656, 0.7563], "previous_default (H0 33 for 990 steps, tau_w 3)": [0.8054, 0.7995],
                                     "h0_10_w900 (tau_w 1)": [0.7862], "gap_previous_default": [0.0520, 0.0572], "gap_h0_10_w900": [0.0269]}}
    out["not_measured"] = ["blocking DiLoCo at each H with the new warm-up (the issue's 'blocking' row)", "second seeds",
                           "H0 10 for 900 steps at H 100 in this corpus (the run failed to start: port taken, EADDRINUSE)",
                           "H0 10 for 1500 steps at H 30 (the rule keeps 900 there: 30 H < T / 2)", "H = 500 (the CLI default)"]
    return out


def add(out, folders, commit, card, training_note="the training path unchanged: the commits between touch separate jobs",
        keys=None, notes=None):
    """Merge later runs (one row per method and seed; a seed a row already has must match) into ``out``.
    ``keys``: method -> row for these runs, over :data:`KEYS` (a method whose meaning changed between
    commits gets a row of its own); ``notes``: row -> its note."""
    keys = {**KEYS, **(keys or {})}
    for H, rows in out["runs"].items():  # seed 1's provenance
        for row in rows.values():
            row.setdefault("per_seed", {str(s): {**SEED1, "method": row["method"], "last_overlap_steps":
                                                 (row.get("run_resolved") or {}).get("last_overlap_steps")}
                                        for s in row["seeds"]})
    for D in folders:
        for f in sorted(glob.glob(f"{D}/r*_h*.json")):
            d = json.load(open(f))
            H = d["regime"]["local_steps"]
            for name, r in d["methods"].items():
                key = keys.get(name)
                if key is None or not r.get("final_val_loss_per_seed"):
                    continue
                for s, loss, per_replica in zip(r["seeds"], r["final_val_loss_per_seed"], r["final_val_loss_per_replica"]):
                    ran = as_run(D, H, name, s) if not key.startswith("allreduce") else None
                    if str(H) not in out["runs"]:  # a new H: AllReduce's rows are the same runs at every H
                        out["runs"][str(H)] = {k: copy.deepcopy(v) for k, v in next(iter(out["runs"].values())).items()
                                               if k.startswith("allreduce")}
                    for h in (out["runs"] if key.startswith("allreduce") else [str(H)]):
                        row = out["runs"][h].get(key)
                        if row is None:  # a row this H has not had (the blocking reference, auto H, ...)
                            row = out["runs"][h][key] = {
                                "method": name, "final_val_loss_per_seed": [], "seeds": [], "final_val_loss_per_replica": [],
                                "bytes_total": r["bytes_total"], "rounds": r.get("rounds"),
                                "replicas_identical": r.get("replicas_identical"), "run_resolved": ran,
                                "resolved_flags": resolved(H, name) if ran is not None else None,
                                "curve": r["curve"], "per_seed": {}}
                        if s in row["seeds"]:
                            assert abs(row["final_val_loss_per_seed"][row["seeds"].index(s)] - loss) < 1e-9, (h, key, s)
                            continue
                        row["seeds"].append(s)
                        row["final_val_loss_per_seed"].append(loss)
                        row["final_val_loss_per_replica"].append(per_replica)
                        info = {"commit": commit, "card": card}
                        if not key.startswith("allreduce"):
                            info.update(bytes_total=r["bytes_total"], rounds=r["rounds"],
                                        replicas_identical=r["replicas_identical"], method=name,
                                        last_overlap_steps=ran["last_overlap_steps"] if ran else r.get("last_overlap_steps"))
                        row["per_seed"][str(s)] = info
    for H, rows in out["runs"].items():
        ar = rows["allreduce"]
        ar_mean = statistics.mean(ar["final_val_loss_per_seed"])
        ar_seed = dict(zip(ar["seeds"], ar["final_val_loss_per_seed"]))
        for key, row in rows.items():
            finals = row["final_val_loss_per_seed"]
            row["final_val_loss"] = statistics.mean(finals)
            if len(finals) > 1:
                row["seed_spread"] = max(finals) - min(finals)
            if key == "allreduce":
                row["gap_vs_allreduce"] = 0.0
                continue
            row["gap_vs_allreduce"], row["gap_vs_allreduce_seeds"] = convergence.paired_gap(row, ar)
            row["gap_vs_allreduce_mean"] = row["final_val_loss"] / ar_mean - 1
            row["gap_vs_allreduce_per_seed"] = {str(s): v / ar_seed[s] - 1 for s, v in zip(row["seeds"], finals) if s in ar_seed}
            row["fewer_bytes_than_allreduce"] = ar["bytes_total"] / row["bytes_total"]
        for row in rows.values():
            methods = {i.get("method", row["method"]) for i in row["per_seed"].values()}
            if len(methods) > 1:
                row["methods_note"] = ("the seeds ran as " + ", ".join(f"{i['method']} (seed {s})" for s, i in row["per_seed"].items())
                                       + ": the same resolved flags at this H (run_resolved: seed 1's summary; per_seed: "
                                       "auto tau's last value, which follows the measured step time)")
        if "blocking" in rows:
            b, dflt = rows["blocking"], rows["default"]
            dflt["gap_vs_blocking"], dflt["gap_vs_blocking_seeds"] = convergence.paired_gap(dflt, b)
            b["note"] = ("the package default with --diloco-x-overlap none (convergence.py default_blocking): the same H, "
                         "codecs and auto warm-up, its rounds blocking (tau_w 0)")
    for H, rows in out["runs"].items():
        for key, note in (notes or {}).items():
            if key in rows:
                rows[key]["note"] = note
    lr_sweep(out)
    regime = out["regime"]
    regime["seeds"] = sorted({s for rows in out["runs"].values() for row in rows.values() for s in row["seeds"]})
    later = {"commit": commit, "card": card}
    if later not in regime.setdefault("later_runs", []):
        regime["later_runs"].append(later)
        regime["corpus_note"] = regime["corpus_note"].rstrip(".") + (
            f". The runs at {commit} rebuilt it and checked the same count (7045 documents, 104.9M tokens) before training.")
        regime["card"] += f" for seed 1; {card} for the runs at {commit.split()[0]}"
        regime["commit"] += f"; later runs: {commit} ({training_note})"
        regime["command"] = regime["command"].replace("--seeds 1 ", "--seeds S ")
    regime["seeds_note"] = "seeds per row (each row's per_seed: commit, card): " + "; ".join(
        f"H {H} {key} {row['seeds']}" for H, rows in out["runs"].items() for key, row in rows.items())
    out["not_measured"] = [
        *[f"a second seed of H {H} {key}" for H, rows in out["runs"].items() for key, row in rows.items()
          if len(row["seeds"]) < 2 and key != "allreduce"],
        *[f"blocking DiLoCo (default_blocking) at H {H}" for H, rows in out["runs"].items() if "blocking" not in rows],
        *[n for n in out["not_measured"] if not n.startswith(("blocking DiLoCo at each H", "second seeds",
                                                              "a second seed", "blocking DiLoCo (default_blocking)"))
           and not (n.startswith("H = 500") and "500" in out["runs"])]]
    return out


def lr_sweep(out):
    """``out["lr_sweep"]``: per H, AllReduce's and the default's final loss at each inner lr of :data:`LRS`
    (per seed), each one's best lr (lowest seed-1 loss: every lr ran seed 1), and the default's gap to
    AllReduce at the common lr 1e-3 and at each one's best lr (paired over the seeds both rows ran)."""
    sweep = {}
    for H, rows in out["runs"].items():
        entry = {}
        for m in ("allreduce", "default"):
            by_lr = {lr: rows[m + suffix] for lr, suffix in LRS.items() if m + suffix in rows}
            if len(by_lr) < 2:
                break
            seed1 = {lr: dict(zip(r["seeds"], r["final_val_loss_per_seed"])).get(1) for lr, r in by_lr.items()}
            best = min((lr for lr in seed1 if seed1[lr] is not None), key=seed1.get)
            entry[m] = {"per_lr": {lr: {"seeds": r["seeds"], "final_val_loss_per_seed": r["final_val_loss_per_seed"]}
                                   for lr, r in by_lr.items()}, "best_lr": best, "best_row": m + LRS[best]}
        else:
            ar, dflt = rows[entry["allreduce"]["best_row"]], rows[entry["default"]["best_row"]]
            entry["gap_equal_lr_1e-3"], entry["gap_equal_lr_seeds"] = convergence.paired_gap(rows["default"], rows["allreduce"])
            entry["gap_best_lrs"], entry["gap_best_lrs_seeds"] = convergence.paired_gap(dflt, ar)
            sweep[H] = entry
    out["lr_sweep"] = sweep


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*")
    p.add_argument("--add", nargs="+", default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--card", default=None)
    p.add_argument("--training-note", default="the training path unchanged: the commits between touch separate jobs",
                   help="how the training code at --commit relates to seed 1's (recorded in regime.commit)")
    p.add_argument("--key", action="append", default=[], metavar="METHOD=ROW",
                   help="merge this call's runs of METHOD into ROW (a method whose meaning changed between commits)")
    p.add_argument("--note", action="append", default=[], metavar="ROW=TEXT", help="the row's note")
    a = p.parse_args()
    if a.add:
        out = add(json.load(open(PATH)), a.add, a.commit, a.card, a.training_note,
                  dict(k.split("=", 1) for k in a.key), dict(n.split("=", 1) for n in a.note))
    else:
        (D,) = a.runs
        out = build(D)
    json.dump(out, open(PATH, "w"), indent=1)
    for H, e in out["runs"].items():
        for k, v in e.items():
            print(H, k, v["method"], v["final_val_loss_per_seed"], f'{100 * v["gap_vs_allreduce"]:+.2f}%',
                  f'mean {100 * v.get("gap_vs_allreduce_mean", v["gap_vs_allreduce"]):+.2f}%',
                  f'vs blocking {100 * v["gap_vs_blocking"]:+.2f}%' if "gap_vs_blocking" in v else "",
                  f'{v.get("fewer_bytes_than_allreduce", 1):.0f}x', v.get("rounds"),
                  (v.get("resolved_flags") or {}).get("warmup_local_steps"), (v.get("resolved_flags") or {}).get("warmup_iters"))
