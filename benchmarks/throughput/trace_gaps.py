"""Where a GPU idles inside the profiled training steps: the gaps between its kernels, and the host op that
launched the kernel each gap waited for.

Reads the Chrome trace that ``fast_path.py --profile FIRST:LAST --trace`` writes (``DIR/<run>/trace.json.gz``,
torch.profiler's export). Device work: events of category ``kernel``, ``gpu_memcpy``, ``gpu_memset``, merged
into busy intervals; idle: the time between the first and the last that no interval covers. Each gap of at least
``--min-us`` is charged to the kernel that ends it: its launch (the ``cuda_runtime`` or ``cuda_driver`` event of
the same ``correlation``) and the host ops around that launch (``cpu_op`` events containing it: the innermost, and the
outermost below the step). Host calls that wait for the device (names containing ``Synchronize``, or a
``cudaMemcpy`` other than ``Async``) are counted with their time; each one of at least ``--wait-ms`` is listed
with when it began and the host ops it ran in (where the host waited for the device: what follows it until the
next launch is host time the device idles through). ``--list``: every charged gap in time order, the same way.

    python benchmarks/throughput/trace_gaps.py DIR/85M_fast_rope_mbs256/trace.json.gz --steps 2 [--top 15] [--list]
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


def _chain(ops: list[dict], ts: float) -> list[str]:
    """The host ops (``cpu_op`` events) running at ``ts``, outermost first, the profiler's step markers left out."""
    around = [o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"] and not o["name"].startswith("ProfilerStep")]
    return [o["name"] for o in sorted(around, key=lambda o: -o["dur"])]


def gaps(events: list[dict], steps: int = 1, min_us: float = 20.0, wait_ms: float = 1.0) -> dict:
    """Busy and idle device time per step, and the gaps of at least ``min_us`` charged to host ops: ``{"busy_ms",
    "idle_ms", "window_ms", "gaps": n, "by_inner_op": {name: [count, ms]}, "by_outer_op": {...}, "syncs": {name:
    [count, ms]}, "gap_list": [[at_ms, us, [host ops]], ...], "waits": [[at_ms, ms, name, [host ops]], ...]}`` (times
    per step; ``by_*`` over gaps of at least ``min_us``; ``gap_list`` and ``waits`` (host syncs of at least
    ``wait_ms``) over the whole trace, ``at_ms`` from its first device event, host ops outermost first)."""
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
    first = device[0]["ts"]
    gap_list = []
    for length, kernel in found:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        chain = _chain(ops, launch["ts"]) if launch else []
        inner = chain[-1] if chain else "(no host op: launched outside one)"
        outer = chain[0] if chain else inner
        for table, name in ((by_inner, inner), (by_outer, outer)):
            table[name][0] += 1
            table[name][1] += length
        gap_list.append([(kernel["ts"] - length - first) / 1e3, length, chain])
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    waits = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or
                                                (e["name"].startswith("cudaMemcpy") and "Async" not in e["name"])):
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"]
            if e["dur"] >= wait_ms * 1e3:
                waits.append([(e["ts"] - first) / 1e3, e["dur"] / 1e3, e["name"], _chain(ops, e["ts"])])
    per = lambda table: {k: [v[0] / steps, v[1] / 1e3 / steps] for k, v in  # noqa: E731
                         sorted(table.items(), key=lambda kv: -kv[1][1])}
    return {"busy_ms": busy / 1e3 / steps, "idle_ms": idle / 1e3 / steps, "window_ms": (end - device[0]["ts"]) / 1e3
            / steps, "gaps": len(found) / steps, "by_inner_op": per(by_inner), "by_outer_op": per(by_outer),
            "syncs": per(syncs), "gap_list": gap_list, "waits": waits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=2, help="training steps the trace holds (fast_path.py --profile)")
    p.add_argument("--min-us", type=float, default=20.0, help="shorter gaps count as idle but are not charged")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--wait-ms", type=float, default=1.0, help="host syncs at least this long are listed")
    p.add_argument("--list", action="store_true", help="every gap of at least --min-us, in time order")
    a = p.parse_args()
    r = gaps(load(a.trace), a.steps, a.min_us, a.wait_ms)
    print(f"per step: device busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms of {r['window_ms']:.1f}; "
          f"{r['gaps']:.0f} gaps of >= {a.min_us:g} us")
    for title, key in (("gaps by the host op launching the next kernel (innermost)", "by_inner_op"),
                       ("... (outermost)", "by_outer_op"), ("host calls waiting for the device", "syncs")):
        print(f"\n{title}: count, ms per step")
        for name, (n, ms) in list(r[key].items())[:a.top]:
            print(f"  {ms:8.2f} ms {n:7.1f}  {name}")
    print(f"\nhost waits of >= {a.wait_ms:g} ms (at: ms from the first kernel)")
    for at, ms, name, chain in r["waits"]:
        print(f"  at {at:9.2f}  {ms:8.2f} ms  {name}  in {' > '.join(chain) or '(no host op)'}")
    if a.list:
        print(f"\ngaps of >= {a.min_us:g} us in time order (at: ms from the first kernel; the launching host ops)")
        for at, us, chain in r["gap_list"]:
            print(f"  at {at:9.2f}  {us:8.1f} us  {' > '.join(chain) or '(no host op)'}")


if __name__ == "__main__":
    main()
