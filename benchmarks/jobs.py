"""Run benchmark jobs (one torchrun of ``benchmarks/instrumented.py`` each), several at once on
disjoint GPU sets, with a wall-clock budget. Used by ``gpu_throughput.py`` and ``convergence.py``.

A job writes into its own folder ``DIR/<name>/``: ``rank{R}.json`` (``instrumented.py``), ``log.txt``
(stdout + stderr of all ranks) and, when it ends, ``done.json`` (return code, wall seconds). A job
whose ``done.json`` says it succeeded with the same flags is skipped on a second invocation with the
same ``--out``, so a sweep cut short by a time limit is resumed by running the same command again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled
from megatron_diloco.summary import parse_summaries  # noqa: E402
INSTRUMENTED = REPO / "benchmarks" / "instrumented.py"

#: Environment of every job: one NCCL connection per device (Megatron's recommendation with
#: overlap), NVLink multicast off (the lent machines require it), unbuffered logs.
BASE_ENV = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass
class Job:
    name: str
    """Folder name under the output directory; unique within a sweep."""
    args: list[str]
    """Flags for ``examples/pretrain_gpt_diloco.py`` (through ``instrumented.py``)."""
    nproc: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment (``BENCH_LINK_*``)."""
    estimate_s: float = 60.0
    """Expected wall time, for the budget check before launching it."""
    timeout_s: float | None = None
    """Kill the job (its process group) after this long; default 3 x estimate_s + 120 s."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no driver: CPU
        return 0


def done(out: Path, name: str) -> dict | None:
    """The ``done.json`` of a finished job, or None."""
    path = out / name / "done.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_jobs(jobs: list[Job], out: Path, parallel: int = 1, budget_s: float | None = None,
             on_done=None) -> None:
    """Run ``jobs`` under ``out``, ``parallel`` at a time (each on its own ``nproc`` GPUs when GPUs
    are present: ``CUDA_VISIBLE_DEVICES`` slices; on CPU they share the cores), skipping jobs already
    done. A job is not started when the elapsed time plus its ``estimate_s`` exceeds ``budget_s``
    (reported, left for a second invocation). ``on_done(job, info)`` runs after each job ends."""
    out.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count()
    t_start = time.perf_counter()
    def finished(j: Job) -> bool:  # done with the same flags
        info = done(out, j.name) or {}
        return bool(info.get("ok")) and info.get("args") == j.args and info.get("env") == j.env

    pending = [j for j in jobs if not finished(j)]
    skipped = len(jobs) - len(pending)
    if skipped:
        print(f"[jobs] {skipped} job(s) already done in {out}, skipped", flush=True)
    running: list[tuple[Job, subprocess.Popen, list[int], float, object]] = []
    free_slots = list(range(parallel))
    slot_of: dict[int, int] = {}
    while pending or running:
        # launch
        while pending and free_slots:
            job = pending[0]
            elapsed = time.perf_counter() - t_start
            if budget_s is not None and elapsed + job.estimate_s > budget_s:
                print(f"[jobs] budget: not starting {job.name} (elapsed {elapsed:.0f} s + estimate "
                      f"{job.estimate_s:.0f} s > {budget_s:.0f} s); rerun the same command to resume",
                      flush=True)
                pending.pop(0)
                continue
            pending.pop(0)
            slot = free_slots.pop(0)
            devices = list(range(slot * job.nproc, (slot + 1) * job.nproc)) if gpus else []
            if gpus and devices[-1] >= gpus:
                raise SystemExit(f"[jobs] {job.name} needs GPUs {devices} but {gpus} are visible: "
                                 f"lower --parallel")
            d = out / job.name
            d.mkdir(parents=True, exist_ok=True)
            for stale in d.glob("rank*.json"):
                stale.unlink()
            env = {**os.environ, **BASE_ENV, **job.env, "BENCH_OUT": str(d)}
            if devices:  # slices of the devices this process sees (honours an outer CUDA_VISIBLE_DEVICES)
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(job.nproc), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), str(INSTRUMENTED), *job.args,
                   # Megatron's dataset index cache per job: concurrent jobs would race on one
                   "--data-cache-path", str(d / "dataset_cache")]
            (d / "cmd.txt").write_text(" ".join(cmd) + "\n" + json.dumps(job.env) + "\n")
            log = open(d / "log.txt", "w")
            print(f"[jobs] start {job.name} ({job.nproc} procs{', GPUs ' + env['CUDA_VISIBLE_DEVICES'] if devices else ''})",
                  flush=True)
            # Own session: a hung job is killed with its workers, by process group id.
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            running.append((job, proc, devices, time.perf_counter(), log))
            slot_of[id(proc)] = slot
        # reap
        time.sleep(0.5)
        for item in list(running):
            job, proc, devices, t0, log = item
            limit = job.timeout_s if job.timeout_s is not None else 3 * job.estimate_s + 120
            if proc.poll() is None and time.perf_counter() - t0 > limit:
                print(f"[jobs] {job.name}: no end after {limit:.0f} s, killing it", flush=True)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            free_slots.append(slot_of.pop(id(proc)))
            wall = time.perf_counter() - t0
            shutil.rmtree(out / job.name / "dataset_cache", ignore_errors=True)
            records = load_ranks(out, job.name)
            ranks = len(records)
            # ok: every rank finished the script (its record says so), whatever the exit code of a
            # teardown after that
            complete = ranks == job.nproc and all(r.get("completed", True) for r in records)
            info = {"ok": complete, "returncode": proc.returncode,
                    "wall_s": wall, "rank_files": ranks, "args": job.args, "env": job.env}
            (out / job.name / "done.json").write_text(json.dumps(info))
            status = "ok" if info["ok"] else f"FAILED (rc {proc.returncode}, {ranks} rank files)"
            print(f"[jobs] end   {job.name}: {status} in {wall:.0f} s", flush=True)
            if not info["ok"]:
                tail = (out / job.name / "log.txt").read_text(errors="replace")[-3000:]
                print(f"[jobs] last lines of {job.name}/log.txt:\n{tail}", flush=True)
            if on_done is not None:
                on_done(job, info)


def load_ranks(out: Path, name: str) -> list[dict]:
    """The ``rank{R}.json`` records of a finished job, in rank order."""
    d = out / name
    files = sorted(d.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def summary_of(out: Path, name: str) -> dict:
    """The job's ``DILOCOX SUMMARY`` (empty without ``--diloco-x``)."""
    log = (out / name / "log.txt").read_text(errors="replace")
    found = parse_summaries(log)
    return found[-1] if found else {}
