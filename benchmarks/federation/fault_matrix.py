"""Every failure kind at every point of the round protocol, on this CPU machine: writes
``benchmarks/results/fault_matrix.json``.

    python benchmarks/federation/fault_matrix.py [--kinds kill,stop,stall_within,stall_past,lighthouse]
        [--points meeting,...] [--out JSON]

A cell: a real ``torchft_lighthouse`` (join timeout 10 s, heartbeat timeout 3 s) and three jobs of the TINY
test model (one rank each, 240 iterations of 0.1 s more each, H 6, int4,
``partial``, the package's defaults otherwise), one of which is given ``DILOCO_X_FAULT`` for the cell's
point (:mod:`megatron_diloco.algorithm.faults`) from round 6 on. Which job: ``C`` for most points;
``heal-target``: C, started late (it heals); ``heal-source``: A (the most advanced member, first in the
quorum's order), with C started late so that a heal happens; ``save``: C, saving every 12 iterations.

Failure kinds:

* ``kill``: kill -9 of every rank of the job at the point;
* ``stop``: SIGSTOP at the point (heartbeats stop), SIGCONT once the outer bound has passed: the job then
  finds the run ahead and catches up in place, or rejoins;
* ``stall_within``: the job's training thread sleeps 3 s at the point (heartbeats go on), well inside the
  bound: the others wait, nothing fails;
* ``stall_past``: it sleeps past the bound while heartbeating (a job stuck in its work, or whose link to the
  others is cut while the coordinator still hears it);
* ``corrupt`` (point ``commit`` only): one element of the mean the job landed is changed (as a payload altered
  on its way to it): the members' check refuses that round on every job; all three go on (the faulted job
  counts among the survivors);
* ``lighthouse`` (600 iterations): the lighthouse is killed after 20 rounds and restarted at the same
  address 20 s later, within the meeting bound (no job faulted; point ``meeting``); ``lighthouse_past``: 45 s
  later, past it (meetings fail, the jobs train rounds alone, then meet again).

``--slots``: sites of different data-parallel size (``--diloco-x-exchange-slots 2``): A and B on 2 ranks (DP 2), C
on 1 (DP 1: its one rank holds both slots, as two virtual ranks of the run), into
``results/fault_matrix_slots.json`` by default; theta compared slot by slot.

``--pace``: sites of different speed paced at run time (``--diloco-x-site-pace 4`` on every job, B twice as slow
as A and C: 0.2 s more per step), into ``results/fault_matrix_pace.json`` by default. The jobs run their own steps
of the run's rounds, so a survivor ends at the run's last boundary (its own iteration), and theta is compared by
the rounds committed.

``--chunks``: sites of different layouts exchanging by name (``--diloco-x-exchange-chunks 2``): A and B at TP 2 on 2
ranks, C at TP 1 on 1 (its one rank holds both chunks), into ``results/fault_matrix_chunks.json`` by default; theta
compared chunk by chunk, and x at the end chunk by chunk.

Per cell: ``survived`` (every job not faulted ends at --train-iters with exit 0), ``survivors_identical``
(their final fp32 main shards and theta at every boundary they share are bit-identical), ``aborted`` (a
survivor ended by a signal, SIGABRT included), ``max_wait_s`` (the longest meeting, and the longest
exchange of a survivor) against ``bound_s`` (the meeting bound; an exchange's bound is the outer bound).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.federation import Job, Lighthouse, wait_until  # noqa: E402
from megatron_diloco.algorithm.faults import POINTS  # noqa: E402

ITERS = 240
H = 6
FAULT_ROUND = 6
OUTER_BOUND_S = 15.0  # --diloco-x-outer-timeout-minutes 0.25
MEETING_BOUND_S = 30.0  # --diloco-x-meeting-timeout-minutes 0.5 (> the lighthouse's 10 s join timeout + a heal)
KINDS = ("kill", "stop", "stall_within", "stall_past", "lighthouse", "lighthouse_past", "corrupt")
#: how long the lighthouse stays down: within the meeting bound, or past it (the jobs then train rounds alone)
LIGHTHOUSE_DOWN_S = {"lighthouse": 20.0, "lighthouse_past": MEETING_BOUND_S + 15.0}
FLAGS = ["--pipeline-model-parallel-size", "1", "--global-batch-size", "4", "--diloco-x-replicas", "3",
         "--diloco-x-local-steps", str(H),
         "--diloco-x-outer-timeout-minutes", str(OUTER_BOUND_S / 60),
         "--diloco-x-meeting-timeout-minutes", str(MEETING_BOUND_S / 60)]
STEP_ENV = {"DILOCO_TEST_STEP_SLEEP_S": "0.1"}  # ~35 s of training: a late job (~20 s to start) joins
#: --slots: each job's ranks (the others' one rank each otherwise)
SLOT_RANKS = {"A": 2, "B": 2, "C": 1}
SLOTS = False
#: --pace: every job paced at run time, B slower
PACE = False
#: --chunks: sites of different layouts exchanging by name (A and B at TP 2 on 2 ranks, C at TP 1 on 1)
CHUNKS = False
CHUNK_FLAGS = {n: ["--diloco-x-exchange-chunks", "2", "--tensor-model-parallel-size", str(tp),
                   "--make-vocab-size-divisible-by", str(256 // tp)] for n, tp in (("A", 2), ("B", 2), ("C", 1))}


def _action(kind: str) -> str:
    return {"kill": "kill", "stop": "stop", "stall_within": "stall=3",
            "stall_past": f"stall={OUTER_BOUND_S + 10:g}", "corrupt": "corrupt"}[kind]


def _fed_rounds(job: Job) -> list:
    recs = job.records()
    return recs[0]["fed_rounds"] if recs else []


def _identical(jobs: list[Job]) -> bool:
    finals = [[r.get("final_fp") for r in j.records()] for j in jobs]
    if not finals or any(None in f or not f for f in finals):
        return False
    if SLOTS or CHUNKS:  # jobs of other layouts hold other main shards: theta compared slot by slot below
        if len({f["steps"] for job in finals for f in job}) != 1:
            return False
        if CHUNKS and len({str([c for f in job for c in f["chunks"]]) for job in finals}) != 1:
            return False  # (x at the end, chunk by chunk, pulled from each job's main shards)
    elif PACE and any([r["main"] for r in f] != [r["main"] for r in finals[0]] for f in finals):
        return False  # (paced jobs end at their own steps: the same parameters)
    elif not PACE and any(f != finals[0] for f in finals):
        return False
    tables = [_job_theta(j) for j in jobs]
    common = set(tables[0]).intersection(*tables[1:])
    return bool(common) and all(len({str(t[s]) for t in tables}) == 1 for s in common)


def _job_theta(job: Job) -> dict[int, list]:
    """step -> theta's fingerprint of the whole job at each boundary every rank recorded: its ranks', in rank
    order (slot by slot: a job of DP 1 and one of DP 2 list the same slots)."""
    per_rank = [{r[4 if PACE else 0]: r[1] for r in rec["fed_rounds"]} for rec in job.records()]  # (pace: by rounds)
    common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
    return {s: [x for rank in per_rank for x in rank[s]] for s in common}


def cell(tmp: Path, kind: str, point: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    late = point in ("handshake", "heal-target", "heal-source")  # C starts late: a membership change and a heal
    faulted = "A" if point == "heal-source" else ("C" if not kind.startswith("lighthouse") else None)
    env = {n: dict(STEP_ENV) for n in "ABC"}
    if PACE:
        env["B"]["DILOCO_TEST_STEP_SLEEP_S"] = "0.2"
    if faulted:  # the late job's own handshake and heal come before its first round
        at = 0 if point in ("handshake", "heal-target") else FAULT_ROUND
        env[faulted]["DILOCO_X_FAULT"] = f"{point}:{_action(kind)}:{at}"
    iters = 600 if kind.startswith("lighthouse") else ITERS  # (training outlasts the lighthouse's absence)
    extra = {n: ["--train-iters", str(iters)] for n in "ABC"}
    if point == "save":
        extra["C"] += ["--save", str(tmp / "ckptC"), "--save-interval", "12", "--no-load-rng"]
    started = time.time()
    with Lighthouse(tmp / "lighthouse.txt", join_timeout_ms=10000, heartbeat_timeout_ms=3000) as lh:
        def job(n: str, i: int) -> Job:
            slots = ["--diloco-x-exchange-slots", "2"] if SLOTS else ["--diloco-x-site-pace", "4"] if PACE else (
                CHUNK_FLAGS[n] if CHUNKS else [])
            return Job(tmp / n, n, i, lh.address, [*FLAGS, *slots, *extra[n]],
                       nproc=SLOT_RANKS[n] if SLOTS or CHUNKS else 1,
                       env=env[n], run="fault-matrix", torchrun=True)

        jobs = {"A": job("A", 0), "B": job("B", 1)}
        try:
            if late:
                wait_until(lambda: jobs["A"].rounds() >= 1, 600, "A's first round", list(jobs.values()))
            jobs["C"] = job("C", 2)
            if kind == "stop":  # SIGCONT once the bound passed
                target = jobs[faulted]
                wait_until(lambda: "[fault drill]" in target.log(), 900, "the fault", list(jobs.values()))
                time.sleep(MEETING_BOUND_S + 5)
                target.signal(signal.SIGCONT)
            if kind.startswith("lighthouse"):
                wait_until(lambda: jobs["A"].rounds() >= 20, 900, "20 rounds", list(jobs.values()))
                os.killpg(lh.proc.pid, signal.SIGKILL)
                lh.proc.wait()
                time.sleep(LIGHTHOUSE_DOWN_S[kind])
                port = lh.address.rsplit(":", 1)[1]
                lh.proc = subprocess.Popen([lh.proc.args[0], "--bind", f"127.0.0.1:{port}", *lh.proc.args[3:]],
                                           stdout=lh.log, stderr=subprocess.STDOUT, start_new_session=True)
            codes = {}
            for n, j in jobs.items():
                try:
                    codes[n] = j.proc.wait(timeout=1200)
                except subprocess.TimeoutExpired:
                    codes[n] = None
        finally:
            for j in jobs.values():
                j.close()
    survivors = [j for n, j in jobs.items() if n != faulted or kind == "corrupt"]
    finals = {n: [r.get("final_fp", {}).get("steps") for r in j.records()] for n, j in jobs.items()}
    waits = [r[6] for j in survivors for r in _fed_rounds(j) if r[6] is not None]
    exchanges = [r[7] for j in survivors for r in _fed_rounds(j) if len(r) > 7 and r[7] is not None]
    fired = faulted is None or "[fault drill]" in jobs[faulted].log()
    return {"failure": kind, "point": point, "faulted_job": faulted, "fired": fired, "iters": iters,
            "survived": all(codes[j.name] == 0 and finals[j.name] and (PACE or all(s == iters for s in finals[j.name]))
                            for j in survivors),
            "survivor_steps": {j.name: finals[j.name] for j in survivors},
            "survivors_identical": _identical(survivors),
            "aborted": any(codes[j.name] is None or codes[j.name] < 0 or codes[j.name] == 134 for j in survivors),
            "max_wait_s": round(max(waits, default=0.0), 3), "max_exchange_s": round(max(exchanges, default=0.0), 3),
            "bound_s": MEETING_BOUND_S, "outer_bound_s": OUTER_BOUND_S, "exit_codes": codes,
            "faulted_outcome": None if faulted is None else _outcome(jobs[faulted], codes[faulted]),
            "failed_rounds": {n: _summary(j).get("federation", {}).get("failed_rounds") for n, j in jobs.items()},
            "wall_s": round(time.time() - started, 1)}


def _summary(job: Job) -> dict:
    """The job's summary line, or {} (a job killed before it printed one)."""
    try:
        return job.summary()
    except AssertionError:
        return {}


def _outcome(job: Job, code: int | None) -> str:
    log = job.log()
    if code == 0:
        return "finished: caught up in place" if "caught up with run" in log else "finished"
    if "behind the run" in log:  # (before the catch-up in place: such a job left)
        return "left: behind the run"
    return f"exit {code}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--tmp", type=Path, default=Path("/tmp/fault_matrix"))
    ap.add_argument("--out", type=Path, default=None, help="default results/fault_matrix.json (--slots: "
                    "results/fault_matrix_slots.json)")
    ap.add_argument("--slots", action="store_true", help="A and B at DP 2, C at DP 1 (--diloco-x-exchange-slots 2)")
    ap.add_argument("--pace", action="store_true", help="every job --diloco-x-site-pace 4, B twice as slow")
    ap.add_argument("--chunks", action="store_true", help="A and B at TP 2 (2 ranks), C at TP 1 (1 rank), "
                    "--diloco-x-exchange-chunks 2")
    ap.add_argument("--redo", default="", help="kind:point,... cells to run again (the others already in --out are kept)")
    args = ap.parse_args()
    global SLOTS, PACE, CHUNKS
    SLOTS, PACE, CHUNKS = args.slots, args.pace, args.chunks
    name = "_slots" if SLOTS else "_pace" if PACE else "_chunks" if CHUNKS else ""
    args.out = args.out or REPO / f"benchmarks/results/fault_matrix{name}.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "commits": "per cell", "machine": "CPU, 2 cores, gloo over loopback", "iters": ITERS, "H": H,
              "jobs": "A, B: 2 ranks (DP 2), C: 1 rank (DP 1), --diloco-x-exchange-slots 2" if SLOTS else
              "one rank each, --diloco-x-site-pace 4, B 0.2 s per step more (A and C 0.1 s)" if PACE else
              "A, B: 2 ranks (TP 2), C: 1 rank (TP 1), --diloco-x-exchange-chunks 2" if CHUNKS else
              "one rank each", "cells": []}
    redo = {tuple(x.split(":")) for x in args.redo.split(",") if x}
    if args.out.exists():  # cells already measured are kept (each names its commit), but those to redo
        old = json.loads(args.out.read_text())
        result["cells"] = [{"commit": old.get("commit"), **c} for c in old["cells"] if (c["failure"], c["point"]) not in redo]
    done = {(c["failure"], c["point"]) for c in result["cells"]}
    for kind in args.kinds.split(","):
        for point in (["meeting"] if kind.startswith("lighthouse") else ["commit"] if kind == "corrupt"
                      else args.points.split(",")):
            if (kind, point) in done:
                continue
            for attempt in range(2):  # a job that could not start (a port taken between its pick and its bind)
                try:
                    got = {**cell(args.tmp / f"{kind}-{point}-{attempt}", kind, point), "commit": commit}
                    break
                except AssertionError as err:
                    print(f"cell {kind}:{point}: the harness failed ({str(err)[:200]}); "
                          f"{'again' if attempt == 0 else 'recorded as not run'}", flush=True)
                    got = {"failure": kind, "point": point, "commit": commit, "fired": False, "survived": False,
                           "survivors_identical": False, "aborted": False, "max_wait_s": 0.0, "max_exchange_s": 0.0,
                           "bound_s": MEETING_BOUND_S, "outer_bound_s": OUTER_BOUND_S, "harness_error": str(err)[:500]}
            print(json.dumps(got), flush=True)
            result["cells"].append(got)
            args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
