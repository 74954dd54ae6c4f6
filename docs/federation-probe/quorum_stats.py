"""Per-boundary quorum cost from worker logs: steady rounds (quorum id unchanged, no heal) vs. rounds
that reconfigured the process group (new quorum id)."""
import json, statistics, sys
for path in sys.argv[1:]:
    last, steady, reconf = {}, [], []
    for line in open(path):
        d = json.loads(line)
        if d["ev"] != "round":
            continue
        key = (d["replica"], d["rank"], d["pid"])
        (steady if last.get(key) == d["quorum_id"] and not d["healed_from"] and d["commit"] else reconf).append(d["quorum_ms"])
        last[key] = d["quorum_id"]
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))] if v else None
    print(f"{path}: steady n={len(steady)} median={statistics.median(steady):.2f} ms p90={q(steady, .9):.2f} ms; "
          f"first/changed n={len(reconf)} values={sorted(round(x) for x in reconf)}")
