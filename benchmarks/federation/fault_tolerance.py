"""Separate jobs under failures (``--diloco-x-lighthouse``), on this CPU machine: the demo model (the
example's defaults: ~1M-parameter GPT, PP 2, 16 x 256 tokens per step over the 2 replicas, H 16),
each replica its own job of 2 ranks (PP 2), a real ``torchft_lighthouse``; writes
``benchmarks/results/fault_tolerance.json``.

    python benchmarks/federation/fault_tolerance.py [--iters 300] [--fail-every-s 45] [--out JSON]

Runs, one after the other (4 ranks at a time, as ``make demo``):

* ``undisturbed``: two jobs, the whole run. Its loss curve; the meeting (torchft quorum) per boundary
  against the exchange (medians over the boundaries after the first two, rank 0 of job A; the meeting
  includes the wait for the other job to reach the boundary: an upper bound).
* ``kill_restart``: job B killed (kill -9) a third into the run and restarted at once from nothing.
  ``recover_s``: from the kill to the survivor's next applied outer step; ``heal_s`` / ``heal_bytes``:
  the restarted job's transfer of the outer state from a live job (per rank: seconds, and the bytes
  of the tensors in it); ``identical_after_rejoin``: theta bit-identical on every rank at every
  boundary after the rejoin, and the same final model; the survivor's final loss beside the
  undisturbed run's (same seed and data).
* ``kill_restart_from_checkpoint``: the same, B restarted from its own last checkpoint (``--save-interval``
  16): its Adam state is its own, against the fresh one above.
* ``frozen``: job B stopped (SIGSTOP) a third in for 20 s, then continued: it is behind and catches up in
  place (``caught_up``: it ends with A, exit 0); ``recover_s`` as above.
* ``exchange_in_flight``: job B dies right after a boundary's decision, before sending its payload:
  the survivor's exchange of that round fails (no job commits it).
* ``goodput``: a failure every ``--fail-every-s`` seconds. Federated: job B killed and restarted from
  its own last checkpoint each time (A goes on). One world: both replicas in one torchrun world
  (4 ranks), killed whole and restarted from the last checkpoint each time (``--save-interval`` 16 in
  both); a one-world run that saves nothing in 3 attempts in a row is stopped (it would never end) and
  credited with its last checkpoint.
  goodput = replica-steps that end up in the final model x the undisturbed step time / (replicas x
  wall time to the end); in the federated run, a replica-step of B counts when the round it belongs to
  was committed with B present (A's records), every step of A counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.federation import Job, Lighthouse, wait_until  # noqa: E402
from harness.launch import kill_session  # noqa: E402
from harness.launch import ENV, RUNNER  # noqa: E402
from harness.runner import harness_args  # noqa: E402

ITERS = 160
#: the goodput runs' checkpoint interval (iterations), the same for both
SAVE_INTERVAL = 16
#: each job is one of the demo's two replicas: its share of the demo's 16 sequences per step
JOB_FLAGS = ["--global-batch-size", "8", "--diloco-x-replicas", "2", "--log-interval", "1",
             "--diloco-x-outer-timeout-minutes", "0.5"]


#: --gpus N: each job one rank (PP 1) on GPU (its index mod N): N 1 puts both jobs on one GPU (separate
#: processes, each its own world); 0: two CPU ranks (PP 2) per job
GPUS = 0


def _jobs(tmp: Path, lh: Lighthouse, iters: int, extra: dict[str, list[str]] | None = None,
          env: dict[str, dict] | None = None) -> dict[str, Job]:
    extra, env = extra or {}, env or {}
    layout = ["--pipeline-model-parallel-size", "1"] if GPUS else []
    return {n: Job(tmp / n, n, i, lh.address, [*JOB_FLAGS, *layout, "--train-iters", str(iters), *extra.get(n, [])],
                   model=[], run="fault-tolerance", nproc=1 if GPUS else 2, torchrun=True,
                   env={**({"CUDA_VISIBLE_DEVICES": str(i % GPUS)} if GPUS else {}), **(env.get(n) or {})})
            for i, n in enumerate("AB")}


def _close(jobs) -> None:
    for job in jobs:
        job.close()


def _fed_rounds(job: Job, rank: int = 0) -> list:
    return job.records()[rank]["fed_rounds"]


def _losses(job: Job) -> list[tuple[int, float]]:
    rec = job.records()[-1]  # the last pipeline stage holds the loss
    return [(it, v["lm loss"]) for it, v in rec["losses"] if "lm loss" in v]


def _final_loss(job: Job, last: int = 20) -> float:
    values = [v for _, v in _losses(job)][-last:]
    return sum(values) / len(values)


def _recover_s(survivor: Job, failed_at: float) -> float:
    """From ``failed_at`` to the survivor's first boundary after it whose exchange committed (its
    committed-round count grew)."""
    rounds = _fed_rounds(survivor)
    before = max((r[4] for r in rounds if r[5] <= failed_at), default=0)
    after = [r[5] for r in rounds if r[5] > failed_at and r[4] > before]
    return after[0] - failed_at if after else float("nan")


def _identical(a: Job, b: Job) -> bool:
    ta = {r[0]: r[1] for r in _fed_rounds(a)}  # rank 0's theta; the final check covers every rank
    tb = {r[0]: r[1] for r in _fed_rounds(b)}
    common = set(ta) & set(tb)
    same_rounds = bool(common) and all(ta[s] == tb[s] for s in common)
    same_final = [r["final_fp"] for r in a.records()] == [r["final_fp"] for r in b.records()]
    return same_rounds and same_final


def undisturbed(tmp: Path, iters: int) -> dict:
    with Lighthouse(tmp / "lighthouse.txt") as lh:
        jobs = _jobs(tmp, lh, iters)
        started = time.time()
        try:
            codes = {n: j.wait(1800) for n, j in jobs.items()}
        finally:
            _close(jobs.values())
    wall = time.time() - started
    a = jobs["A"]
    summary = a.summary()
    rounds = summary["rounds"]
    fed = summary["federation"]
    steady = [r for r in _fed_rounds(a) if len(r) > 7][2:]  # past the first meetings (the jobs' start)
    return {"codes": codes, "wall_s": wall, "final_loss": _final_loss(a), "losses": _losses(a),
            "step_s": summary["train_wall_s"] / iters,
            "quorum_ms_per_boundary": 1e3 * statistics.median(r[6] for r in steady),
            "exchange_ms_per_boundary": 1e3 * statistics.median(r[7] for r in steady if r[7] is not None),
            "meetings": fed["meetings"],
            "rounds": rounds, "identical": _identical(jobs["A"], jobs["B"])}


def kill_restart(tmp: Path, iters: int, from_checkpoint: bool = False) -> dict:
    ckpt = tmp / "ckptB"
    extra = {"B": ["--save", str(ckpt), "--save-interval", "16", "--no-load-rng"]} if from_checkpoint else None
    with Lighthouse(tmp / "lighthouse.txt") as lh:
        jobs = _jobs(tmp, lh, iters, extra=extra)
        a, b = jobs["A"], jobs["B"]
        try:
            wait_until(lambda: a.rounds() >= iters // 16 // 3 and (not from_checkpoint or (
                ckpt / "latest_checkpointed_iteration.txt").exists()), 900, "a third of the run", [a, b])
            time.sleep(0.5)
            b.kill()
            killed = time.time()
            b.start(tmp / "B-restarted", extra=["--load", str(ckpt)] if from_checkpoint else [])
            codes = {n: j.wait(1800) for n, j in jobs.items()}
        finally:
            _close(jobs.values())
    heals = [h for rec in b.records() for h in rec.get("heals", [])]
    return {"codes": codes, "survived": codes["A"] == 0, "identical_after_rejoin": _identical(a, b),
            "recover_s": _recover_s(a, killed), "heal_s": max(h["s"] for h in heals) if heals else None,
            "heal_bytes": sum(h["tensor_bytes"] for h in heals) if heals else None,
            "final_loss": _final_loss(a), "losses": _losses(a)}


def frozen(tmp: Path, iters: int) -> dict:
    with Lighthouse(tmp / "lighthouse.txt", heartbeat_timeout_ms=3000) as lh:
        jobs = _jobs(tmp, lh, iters)
        a, b = jobs["A"], jobs["B"]
        try:
            wait_until(lambda: a.rounds() >= iters // 16 // 3, 900, "a third of the run", [a, b])
            b.signal(signal.SIGSTOP)
            stopped = time.time()
            time.sleep(20)
            b.signal(signal.SIGCONT)
            codes = {n: j.wait(1800) for n, j in jobs.items()}
        finally:
            _close(jobs.values())
    return {"codes": codes, "survived": codes["A"] == 0,
            "caught_up": codes["B"] == 0 and "caught up with run" in b.log(),
            "identical_after_rejoin": None, "recover_s": _recover_s(a, stopped), "heal_s": None, "heal_bytes": None}


def exchange_in_flight(tmp: Path, iters: int) -> dict:
    round_ = iters // 16 // 3
    with Lighthouse(tmp / "lighthouse.txt") as lh:
        jobs = _jobs(tmp, lh, iters, env={"B": {"DILOCO_X_FAULT": f"decision:kill:{round_}"}})
        a = jobs["A"]
        try:
            codes = {n: j.wait(1800) for n, j in jobs.items()}
        finally:
            _close(jobs.values())
    # B died at A's boundary of round `round_` (its last with 2 members)
    two = [r for r in _fed_rounds(a) if r[2] == 2]
    died = two[-1][5] if two else float("nan")
    fed = a.summary()["federation"]
    return {"codes": codes, "survived": codes["A"] == 0, "identical_after_rejoin": None,
            "failed_rounds": fed["failed_rounds"], "recover_s": _recover_s(a, died), "heal_s": None,
            "heal_bytes": None}


def goodput_federated(tmp: Path, iters: int, every_s: float, step_s: float) -> dict:
    ckpt = tmp / "ckptB"
    flags = {"B": ["--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL), "--no-load-rng"]}
    with Lighthouse(tmp / "lighthouse.txt") as lh:
        jobs = _jobs(tmp, lh, iters, extra=flags)
        a, b = jobs["A"], jobs["B"]
        started = time.time()
        failures = 0
        try:
            while a.proc.poll() is None:
                time.sleep(0.5)
                if time.time() - started >= every_s * (failures + 1) and b.proc.poll() is None:
                    b.kill()
                    failures += 1
                    load = ["--load", str(ckpt)] if (ckpt / "latest_checkpointed_iteration.txt").exists() else []
                    b.start(tmp / f"B{failures}", extra=load)
            codes = {n: j.wait(1800) for n, j in jobs.items()}
        finally:
            _close(jobs.values())
    wall = time.time() - started
    rounds = _fed_rounds(a)
    useful_b = 0
    for i, r in enumerate(rounds):
        prev = rounds[i - 1][0] if i else 0
        nxt_committed = rounds[i + 1][4] if i + 1 < len(rounds) else r[4] + 1
        if r[2] == 2 and nxt_committed > r[4]:
            useful_b += r[0] - prev
    useful = iters + useful_b
    return {"codes": codes, "failures": failures, "wall_s": wall, "useful_replica_steps": useful,
            "goodput": useful * step_s / (2 * wall)}


def goodput_one_world(tmp: Path, iters: int, every_s: float, step_s: float) -> dict:
    ckpt = tmp / "ckpt"
    started = time.time()
    failures = 0
    attempt = 0
    stuck = 0  # attempts in a row that saved nothing: the run would never end at this failure rate
    while stuck < 3:
        out = tmp / f"attempt{attempt}"
        out.mkdir(parents=True)
        load = ["--load", str(ckpt)] if (ckpt / "latest_checkpointed_iteration.txt").exists() else []
        saved = _saved(ckpt)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone", str(RUNNER),
               *harness_args(out, ("federation",)), "--train-iters", str(iters), "--log-interval", "1",
               "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL), "--no-load-rng", *load]
        with open(out / "log.txt", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, **ENV), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            deadline = started + every_s * (failures + 1)
            while proc.poll() is None and time.time() < deadline:
                time.sleep(0.5)
            if proc.poll() is None:
                kill_session(proc)
                failures += 1
                attempt += 1
                stuck = stuck + 1 if _saved(ckpt) == saved else 0
                continue
        if proc.returncode != 0:
            raise RuntimeError(f"one-world attempt {attempt} failed: {(out / 'log.txt').read_text()[-3000:]}")
        break
    wall = time.time() - started
    if stuck >= 3:  # no checkpoint in 3 attempts: it would never finish; the work kept is the last save
        done = _saved(ckpt)
        return {"failures": failures, "wall_s": wall, "finished": False, "useful_replica_steps": 2 * done,
                "goodput": 2 * done * step_s / (2 * wall)}
    return {"failures": failures, "wall_s": wall, "finished": True, "useful_replica_steps": 2 * iters,
            "goodput": 2 * iters * step_s / (2 * wall)}


def _saved(ckpt: Path) -> int:
    """The iteration of the last complete checkpoint in ``ckpt`` (0: none)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text()) if tracker.exists() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--fail-every-s", type=float, default=60.0)
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "fault_tolerance")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fault_tolerance.json")
    p.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    p.add_argument("--gpus", type=int, default=0, help="2: each job on its own GPU (one rank each); 1: both jobs on one GPU")
    a = p.parse_args()
    global GPUS
    GPUS = a.gpus
    shutil.rmtree(a.work, ignore_errors=True)
    only = set(filter(None, a.only.split(",")))
    result: dict = json.loads(a.out.read_text()) if a.out.exists() and only else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    commit = os.environ.get("DILOCO_COMMIT", commit)
    machine = "CPU, 2 cores, gloo over loopback (every job on this machine)"
    if a.gpus:
        import torch

        machine = (f"{a.gpus} x {torch.cuda.get_device_name(0)}, "
                   f"{'one job per GPU' if a.gpus > 1 else 'both jobs on one GPU'}, gloo over loopback")
    for earlier in result.get("scenarios", {}).values():  # (--only: what ran before keeps its commit)
        earlier.setdefault("commit", result.get("commit"))
    result.update({"machine": machine, "commit": result.get("commit", commit) if only else commit, "iters": a.iters,
                   "model": "the demo (examples/pretrain_gpt_diloco.py defaults), each job one replica, "
                            + ("one rank (PP 1) on a GPU" if a.gpus else "PP 2")})
    scenarios = result.setdefault("scenarios", {})

    def want(name):
        return not only or name in only

    if want("undisturbed"):
        base = undisturbed(a.work / "undisturbed", a.iters)
        result["undisturbed"] = base
        result["quorum_ms_per_boundary"] = base["quorum_ms_per_boundary"]
        result["exchange_ms_per_boundary"] = base["exchange_ms_per_boundary"]
        print("undisturbed", {k: v for k, v in base.items() if k != "losses"}, flush=True)
    base = result["undisturbed"]
    scenario_fns = (("kill_restart", kill_restart), ("frozen", frozen), ("exchange_in_flight", exchange_in_flight),
                    ("kill_restart_from_checkpoint", lambda tmp, iters: kill_restart(tmp, iters, True)))
    for name, fn in scenario_fns:
        if want(name):
            scenarios[name] = {**fn(a.work / name, a.iters), "commit": commit}  # (--only: others keep theirs)
            print(name, {k: v for k, v in scenarios[name].items() if k != "losses"}, flush=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")  # (a later failure keeps what ran)
    if "kill_restart" in scenarios:
        result["final_loss"] = {"undisturbed": base["final_loss"], "one_failure": scenarios["kill_restart"]["final_loss"]}
        if "kill_restart_from_checkpoint" in scenarios:
            result["final_loss"]["one_failure_restarted_from_checkpoint"] = (
                scenarios["kill_restart_from_checkpoint"]["final_loss"])
    if want("goodput"):
        fed = goodput_federated(a.work / "goodput_fed", a.iters, a.fail_every_s, base["step_s"])
        one = goodput_one_world(a.work / "goodput_one", a.iters, a.fail_every_s, base["step_s"])
        result["goodput"] = {"federated": fed["goodput"], "one_world": one["goodput"], "failure_every_s": a.fail_every_s,
                             "federated_run": fed, "one_world_run": one}
        print("goodput", result["goodput"], flush=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
