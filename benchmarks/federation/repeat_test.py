#!/usr/bin/env python3
"""Run one pytest test id N times, K at a time, and record every outcome (pass/fail, any abort).

    python benchmarks/federation/repeat_test.py TEST_ID --count 50 --parallel 8 --out DIR [--first 1]
        [--deadline-s 540] [--run-timeout-s 600] [--seed-corpus]

Each repetition is its own ``pytest`` process with its own ``--basetemp`` (``DIR/runs/NNN``: distinct
tmp dirs; the federation tests pick their lighthouse and torchrun ports with ``free_port()``, at random
below the kernel's ephemeral range and free when picked, so parallel runs seldom collide). Every log under a run's
basetemp (the jobs' ``log.txt``, ``lighthouse.txt``) and pytest's own output are scanned for abort
markers (``terminate called``, ``gloo::EnforceNotMet``, ``exitcode: -6``, ``SIGABRT``, ``Fatal Python
error``, ``core dumped``), passing runs too (a job expected to fail could fail by aborting). One JSON
line per run goes to ``DIR/results.jsonl`` as it ends; ``DIR/summary.json`` at the end; the logs of every
failing or aborting run are packed into ``DIR/failed_logs.tgz`` and every run's text logs (records and
corpora left out) into ``DIR/all_logs.tgz``.

``--seed-corpus``: build the demo corpus (``examples/stdlib_corpus.py``) once and give each run its own
``MEGATRON_DILOCO_DATA`` folder holding hard links to it, so that parallel runs neither build it at once
nor share Megatron's dataset-index cache (the two jobs of one run still share theirs, as in the suite).
``--deadline-s``: launch no new run past this many seconds, and interrupt runs still going at
``deadline + 45 s`` (recorded as ``unfinished``, not counted): keeps a batch inside a fixed time slot.
A run past ``--run-timeout-s`` gets SIGINT (the test's own clean-up kills its jobs), then SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKERS = {
    "terminate called": re.compile(r"terminate called"),
    "gloo::EnforceNotMet": re.compile(r"gloo::EnforceNotMet"),
    "exitcode -6": re.compile(r"exitcode\s*:\s*-6\b|exited with -6\b|returncode -6\b"),
    "SIGABRT": re.compile(r"SIGABRT|Signal 6\b"),
    "Fatal Python error": re.compile(r"Fatal Python error"),
    "core dumped": re.compile(r"core dumped"),
    "SIGSEGV": re.compile(r"SIGSEGV|exitcode\s*:\s*-11\b"),
}
EXITCODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def scan(folder: Path, pytest_out: str) -> tuple[dict, dict]:
    """Abort markers found (marker -> files) and the torchrun-reported rank exit codes per job log."""
    found: dict[str, list[str]] = {}
    codes: dict[str, dict[str, int]] = {}
    texts = [("pytest.txt", pytest_out)]
    for p in sorted(folder.rglob("*.txt")):
        texts.append((str(p.relative_to(folder)), p.read_text(errors="replace")))
    for name, text in texts:
        for marker, rx in MARKERS.items():
            if rx.search(text):
                found.setdefault(marker, []).append(name)
        if name.endswith("log.txt"):
            codes[name] = {f"rank{r}": int(c) for r, c in EXITCODE.findall(text)}
    return found, codes


def why(out: str) -> str:
    """The first assertion/error line of pytest's output (short)."""
    for line in out.splitlines():
        if line.startswith("E  "):
            return line[1:].strip()[:400]
    tail = [l for l in out.splitlines() if l.strip()]
    return (tail[-1] if tail else "no output")[:400]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test")
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--first", type=int, default=1, help="number of the first run (to split a series)")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--run-timeout-s", type=float, default=1200)
    ap.add_argument("--seed-corpus", action="store_true")
    ap.add_argument("--threads", default="2", help="OMP_NUM_THREADS of each pytest process")
    args = ap.parse_args()

    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    seed = None
    if args.seed_corpus:
        seed = out / "corpus-seed"
        built = subprocess.run([sys.executable, str(REPO / "examples" / "stdlib_corpus.py"), str(seed)],
                               cwd=REPO, capture_output=True, text=True, check=True)
        print("corpus:", built.stdout.strip().splitlines()[-1], flush=True)
    t0 = time.monotonic()
    stop = threading.Event()
    lock = threading.Lock()
    results = []

    def one(i: int) -> None:
        if args.deadline_s is not None and time.monotonic() - t0 > args.deadline_s:
            return
        if stop.is_set():
            return
        run_dir = out / "runs" / f"{i:03d}"
        env = {**os.environ, "OMP_NUM_THREADS": args.threads, "PYTHONUNBUFFERED": "1"}
        if seed is not None:
            data = out / "data" / f"{i:03d}"
            data.mkdir(parents=True, exist_ok=True)
            for f in seed.iterdir():
                if f.is_file() and f.suffix in (".bin", ".idx"):
                    os.link(f, data / f.name)
            env["MEGATRON_DILOCO_DATA"] = str(data)
        run_dir.mkdir(parents=True, exist_ok=True)  # pytest 9 does not create --basetemp's parent
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 "--basetemp", str(run_dir / "tmp"), args.test], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        limit = args.run_timeout_s
        if args.deadline_s is not None:
            limit = min(limit, args.deadline_s + 45 - (start - t0))
        unfinished = False
        try:
            text, _ = proc.communicate(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            unfinished = True
            os.killpg(proc.pid, signal.SIGINT)  # KeyboardInterrupt: the test's clean-up kills its jobs
            try:
                text, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                text, _ = proc.communicate()
        wall = time.monotonic() - start
        (run_dir / "pytest.txt").write_text(text)
        markers, codes = scan(run_dir, text)
        rec = {"run": i, "passed": proc.returncode == 0 and not unfinished, "returncode": proc.returncode,
               "unfinished": unfinished, "wall_s": round(wall, 1), "abort_markers": markers,
               "rank_exitcodes": codes, "why": None if proc.returncode == 0 else why(text)}
        with lock:
            results.append(rec)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"run {i:3d}: {'PASS' if rec['passed'] else 'FAIL'} {wall:6.1f} s"
                  f"{' ABORT ' + str(sorted(markers)) if markers else ''}"
                  f"{' unfinished' if unfinished else ''}{'' if rec['passed'] else ' | ' + str(rec['why'])}",
                  flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, range(args.first, args.first + args.count)))
    wall = time.monotonic() - t0
    results.sort(key=lambda r: r["run"])
    done = [r for r in results if not r["unfinished"]]
    summary = {"test": args.test, "first": args.first, "asked": args.count, "runs": len(done),
               "passed": sum(r["passed"] for r in done),
               "aborts": sum(bool(r["abort_markers"]) for r in results),
               "unfinished": [r["run"] for r in results if r["unfinished"]],
               "failures": [{"run": r["run"], "why": r["why"]} for r in results if not r["passed"]],
               "parallel": args.parallel, "wall_s": round(wall, 1), "nproc": os.cpu_count()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)

    def text_logs(tar: tarfile.TarFile, r: dict) -> None:
        run_dir = out / "runs" / f"{r['run']:03d}"
        for p in sorted(run_dir.rglob("*")):
            if p.is_file() and p.suffix in (".txt", ".log"):
                tar.add(p, arcname=str(p.relative_to(out / "runs")))

    bad = [r for r in results if not r["passed"] or r["abort_markers"]]
    if bad:
        with tarfile.open(out / "failed_logs.tgz", "w:gz") as tar:
            for r in bad:
                text_logs(tar, r)
    with tarfile.open(out / "all_logs.tgz", "w:gz") as tar:
        for r in results:
            text_logs(tar, r)
    shutil.rmtree(out / "data", ignore_errors=True)


if __name__ == "__main__":
    main()
