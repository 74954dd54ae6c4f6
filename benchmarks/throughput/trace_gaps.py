"""Where a GPU idles inside the profiled training steps: the gaps between its kernels, and the host op that
launched the kernel each gap waited for.

Reads the Chrome trace that ``fast_path.py --profile FIRST:LAST --trace`` writes (``DIR/<run>/trace.json.gz``,
torch.profiler's export). Device work: events of category ``kernel``, ``gpu_memcpy``, ``gpu_memset``, merged
into busy intervals; idle: the time between the first and the last that no interval covers. Each gap of at least
``--min-us`` is charged to the kernel that ends it: its launch (the ``cuda_runtime`` or ``cuda_driver`` event of
the same ``correlation``) and the host ops around that launch (``cpu_op`` events containing it: the innermost, and the
outermost below the step). Host calls that wait for the device (names containing ``Synchronize``, or a
``cudaMemcpy`` other than ``Async``) are counted with their time.

    python benchmarks/throughput/trace_gaps.py DIR/85M_fast_rope_mbs256/trace.json.gz --steps 2 [--top 15]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    """The trace's complete events (``ph == "X"``), from a ``.json`` or ``.json.gz`` file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def gaps(events: list[dict], steps: int = 1, min_us: float = 20.0) -> dict:
    """Busy and idle device time per step, and the gaps of at least ``min_us`` charged to host ops: ``{"busy_ms",
    "idle_ms", "window_ms", "gaps": n, "by_inner_op": {name: [count, ms]}, "by_outer_op": {...}, "syncs": {name:
    [count, ms]}}`` (times per step; ``by_*`` over gaps of at least ``min_us``)."""
    events = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    device = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    if not device:
        raise SystemExit("no device events (kernel / gpu_memcpy / gpu_memset) in the trace: a CPU-only profile?")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    busy, idle, found = 0.0, 0.0, []
    start, end = device[0]["ts"], device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        if e["ts"] > end:  # a gap before e
            busy += end - start
            idle += e["ts"] - end
            if e["ts"] - end >= min_us:
                found.append((e["ts"] - end, e))
            start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    busy += end - start
    by_inner: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_outer: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for length, kernel in found:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        around = [o for o in ops if launch and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
                  and not o["name"].startswith("ProfilerStep")]
        inner = min(around, key=lambda o: o["dur"])["name"] if around else "(no host op: launched outside one)"
        outer = max(around, key=lambda o: o["dur"])["name"] if around else inner
        for table, name in ((by_inner, inner), (by_outer, outer)):
            table[name][0] += 1
            table[name][1] += length
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or
                                                (e["name"].startswith("cudaMemcpy") and "Async" not in e["name"])):
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"]
    per = lambda table: {k: [v[0] / steps, v[1] / 1e3 / steps] for k, v in  # noqa: E731
                         sorted(table.items(), key=lambda kv: -kv[1][1])}
    return {"busy_ms": busy / 1e3 / steps, "idle_ms": idle / 1e3 / steps, "window_ms": (end - device[0]["ts"]) / 1e3
            / steps, "gaps": len(found) / steps, "by_inner_op": per(by_inner), "by_outer_op": per(by_outer),
            "syncs": per(syncs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=2, help="training steps the trace holds (fast_path.py --profile)")
    p.add_argument("--min-us", type=float, default=20.0, help="shorter gaps count as idle but are not charged")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    r = gaps(load(a.trace), a.steps, a.min_us)
    print(f"per step: device busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms of {r['window_ms']:.1f}; "
          f"{r['gaps']:.0f} gaps of >= {a.min_us:g} us")
    for title, key in (("gaps by the host op launching the next kernel (innermost)", "by_inner_op"),
                       ("... (outermost)", "by_outer_op"), ("host calls waiting for the device", "syncs")):
        print(f"\n{title}: count, ms per step")
        for name, (n, ms) in list(r[key].items())[:a.top]:
            print(f"  {ms:8.2f} ms {n:7.1f}  {name}")


if __name__ == "__main__":
    main()
