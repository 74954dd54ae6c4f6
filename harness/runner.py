"""Launch benchmark jobs: the one way the benchmarks start processes.

A :class:`Job` is one run made of one or more :class:`Command` s started together (a ``torchrun``
of the harness; the ranks of the WAN benchmark, one process each inside its own network namespace;
R single-rank worlds joined only through a TCP store) and ended together. :func:`run_jobs` runs
jobs under an output folder, several at once on disjoint GPU sets, within a wall-clock budget:

* a job writes into its own folder ``OUT/<name>/``: each command's stdout + stderr (``log.txt`` for
  a single command, else ``log{i}.txt`` or the command's own ``log`` name), ``cmd.txt`` (the command
  lines and their extra environment), the records the commands write there (``rank{R}.json``: stale
  ones are removed before the start) and, when it ends, ``done.json``: ``ok``, ``returncode`` (the
  first non-zero exit status, else 0), ``returncodes``, ``timed_out``, ``wall_s``, ``rank_files``,
  ``logs`` and the job's :attr:`Job.fingerprint` (its flags);
* a job whose ``done.json`` says it succeeded with the same fingerprint is skipped (``resume``), so
  a sweep cut short by a time limit is resumed by running the same command again;
* a job not yet started is not started when the elapsed time plus its ``estimate_s`` exceeds the
  budget (reported, left for a second invocation);
* a job that runs past its timeout is ended: each command's process group (every command starts a
  session of its own) gets SIGKILL, or SIGTERM and SIGKILL ``term_grace_s`` later; when one command
  of a multi-command job fails, the others are ended the same way; an exception in the caller
  (Ctrl-C, or SIGTERM turned into one) ends every running job before it propagates.

:class:`ExampleJob` is the common case: the example under the harness
(``harness/run.py``) through ``torchrun`` on ``nproc`` processes / GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

from megatron_diloco.summary import parse_summaries

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "harness" / "run.py"
#: The recorders of a Megatron-level test run (:func:`harness_args`'s default).
TRAINING = ("training",)

#: Environment of every command: one NCCL connection per device (Megatron's recommendation with
#: overlap), NVLink multicast off (the lent machines require it), unbuffered logs, one OpenMP thread.
BASE_ENV = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass
class Command:
    """One process (with whatever it starts: one process group) of a job."""

    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment of this command (over the job's)."""
    prefix: list[str] = dataclasses.field(default_factory=list)
    """Run ``argv`` through this, e.g. ``["ip", "netns", "exec", NAME]`` (``netns.netns_exec``)."""
    log: str | None = None
    """File name of its output in the job folder (default: see the module docstring)."""
    cwd: Path = REPO

    @property
    def line(self) -> list[str]:
        return [*self.prefix, *self.argv]


@dataclasses.dataclass
class Job:
    """One run: its commands start together; it ends when all of them have ended."""

    name: str
    """Folder name under the output directory; unique within a sweep."""
    commands: list[Command]
    gpus: int = 0
    """Devices of the whole job (a ``CUDA_VISIBLE_DEVICES`` slice its commands share; 0: none chosen)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment of every command."""
    estimate_s: float = 60.0
    """Expected wall time, for the budget check before launching it."""
    timeout_s: float | None = None
    """End the job after this long; default 3 x estimate_s + 120 s."""
    term_grace_s: float | None = None
    """Ending it: None sends SIGKILL at once; else SIGTERM, and SIGKILL this many seconds later."""
    expect_records: int | None = None
    """ok = this many ``rank*.json`` records, none saying ``"completed": false`` (whatever the exit
    status of a teardown after that); None: ok = every command exited 0."""
    scratch: list[str] = dataclasses.field(default_factory=list)
    """Subfolders of the job folder removed when it ends."""
    fingerprint: dict[str, Any] | None = None
    """What makes two runs the same (skip-if-done); default: the command lines and environments."""
    watch: Callable[[str], None] | None = None
    """Called with every line of the first command's output as it appears (progress displays)."""

    def __post_init__(self) -> None:
        if self.fingerprint is None:
            self.fingerprint = {"commands": [c.line for c in self.commands],
                                "env": [{**self.env, **c.env} for c in self.commands]}

    @property
    def logs(self) -> list[str]:
        if len(self.commands) == 1:
            return [self.commands[0].log or "log.txt"]
        return [c.log or f"log{i}.txt" for i, c in enumerate(self.commands)]

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else 3 * self.estimate_s + 120


#: A validation line Megatron prints (``evaluate_and_print_results``): iteration, " on validation set" for the
#: evaluation after training (absent for those during it), the loss
#: The one-GPU fast path without Transformer Engine (benchmarks/RESULTS.md §9): SDPA core attention, no
#: attention mask built by the data loader, two loader workers, Megatron's fused RoPE (served by the
#: package's Triton kernel). The flags a benchmark appends to its model's to train on it.
FAST_PATH = ["--attention-sdpa", "--no-create-attention-mask-in-dataloader", "--num-workers", "2", "--rope-fusion"]
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| lm loss value: (\S+)")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server that binds it some time after this returns (a torchrun
    master, a store, a lighthouse) and that other processes find by its port. Taken below the kernel's
    ephemeral range (``ip_local_port_range``), from which every outgoing connection and every bind to port 0
    take theirs, so that none can take it meanwhile (seen: a torchft lighthouse failing, and a torchrun
    rendezvous among jobs starting at once, with "address already in use"). Falls back to the kernel's
    choice when 64 tries below that range are all taken."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no driver: CPU
        return 0


def harness_args(out: Path, recorders: tuple[str, ...] | list[str] = TRAINING, fast_exit: bool = False) -> list[str]:
    """The harness's own flags, up to the ``--`` before the example's: these recorders, records to ``out``."""
    return ["--record", ",".join(recorders), "--out", str(out), *(["--fast-exit"] if fast_exit else []), "--"]


def harness_command(record: list[str], out: Path, args: list[str], launcher: list[str] | None = None,
                    fast_exit: bool = False, harness: Path = HARNESS) -> list[str]:
    """The command line of the harness: ``launcher`` (default: this Python) + ``harness`` with these
    recorders writing to ``out``, then the example's ``args``."""
    return [*(launcher or [sys.executable]), str(harness), *harness_args(out, record, fast_exit), *args]


def torchrun(nproc: int) -> list[str]:
    """``torchrun`` on this node with ``nproc`` processes and a free rendezvous port (the launcher
    of :func:`harness_command`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


@dataclasses.dataclass
class ExampleJob:
    """The example under the harness, ``torchrun`` on ``nproc`` processes (and GPUs when present)."""

    name: str
    args: list[str]
    """Flags for ``examples/pretrain_gpt_diloco.py``."""
    nproc: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment; also the recorders' configuration (``BENCH_LINK_*``, ``BENCH_FIXED_EVAL``,
    ``BENCH_CHECK_BOUNDARIES``: see :func:`bench_recorders`)."""
    estimate_s: float = 60.0
    timeout_s: float | None = None
    record: list[str] | None = None
    """Harness recorders; None: :func:`bench_recorders` of ``env``."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Stored with the fingerprint in ``done.json`` (e.g. the definition a sweep launched it with)."""

    @property
    def gpus(self) -> int:
        return self.nproc

    @property
    def fingerprint(self) -> dict[str, Any]:
        return ({"args": self.args, "env": self.env} | ({"record": self.record} if self.record is not None else {})
                | self.meta)

    def job(self, out: Path) -> Job:
        """The job, with a free port for its rendezvous (call it when starting the job)."""
        d = out / self.name
        # Megatron's dataset index cache per job: concurrent jobs would race on one
        args = [*self.args, "--data-cache-path", str(d / "dataset_cache")]
        record = self.record if self.record is not None else bench_recorders(self.env)
        # a fast exit, but not for a run that saves: it would orphan the checkpoint writer's helper processes
        argv = harness_command(record, d, args, torchrun(self.nproc), fast_exit="--save" not in self.args)
        return Job(self.name, [Command(argv)], gpus=self.nproc, env=self.env, estimate_s=self.estimate_s,
                   timeout_s=self.timeout_s, expect_records=self.nproc, scratch=["dataset_cache"],
                   fingerprint=self.fingerprint)


def replica_worlds_job(name: str, out: Path, args: list[str], replicas: int, record: list[str], *,
                       diloco: bool = True, env: dict[str, str] | None = None, estimate_s: float = 60.0,
                       timeout_s: float | None = None, fingerprint: dict | None = None) -> Job:
    """R launches of the example under the harness, each a world of one rank (one per replica), all
    on the job's one GPU: replica r writes ``OUT/name/replica{r}/rank0.json`` and logs to
    ``replica{r}.log``. ``diloco``: they are joined only through ``--diloco-x-outer-store`` (a free
    port on this host) with ``--diloco-x-replica-index r`` appended to ``args`` (NCCL refuses two
    ranks of one world on one GPU); else the R launches are independent (``args`` has
    ``--no-diloco-x``: R vanilla trainings sharing the GPU the same way). The fingerprint is the
    flags, not the ports (or ``fingerprint``, stored in ``done.json``)."""
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    store = ["--diloco-x-outer-store", f"127.0.0.1:{free_port()}"] if diloco else []
    commands = [Command(harness_command(record, out / name / f"replica{r}",
                                        [*args, *store, *(["--diloco-x-replica-index", str(r)] if diloco else [])]),
                        env={**world, "MASTER_PORT": str(free_port())}, log=f"replica{r}.log")
                for r in range(replicas)]
    return Job(name, commands, gpus=1, env={"OMP_NUM_THREADS": "1", **(env or {})}, estimate_s=estimate_s,
               timeout_s=timeout_s, fingerprint=fingerprint or {"args": args, "replicas": replicas,
                                                                "diloco": diloco, "record": record, "env": env or {}})


def bench_recorders(env: dict[str, str]) -> list[str]:
    """The recorders of a benchmark run configured by ``env``: ``timers``, ``losses``, ``rounds``;
    ``boundary_check`` with ``BENCH_CHECK_BOUNDARIES=1``; ``fixed_eval`` with ``BENCH_FIXED_EVAL=1``;
    ``link`` with ``BENCH_LINK_MBPS`` (the link last: it rebinds what Megatron's modules imported)."""
    return ["timers", "losses", "rounds"] \
        + (["boundary_check"] if env.get("BENCH_CHECK_BOUNDARIES") == "1" else []) \
        + (["fixed_eval"] if env.get("BENCH_FIXED_EVAL") == "1" else []) \
        + (["link"] if env.get("BENCH_LINK_MBPS") else [])


def done(out: Path, name: str) -> dict | None:
    """The ``done.json`` of a finished job, or None."""
    path = out / name / "done.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_ranks(out: Path, name: str) -> list[dict]:
    """The ``rank{R}.json`` records of a finished job, in rank order; a file a rank left unwritten or cut short
    (it died while writing) is left out, named on stdout, so that the job reads as failed, not the harness."""
    files = sorted((out / name).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    records = []
    for p in files:
        try:
            records.append(json.loads(p.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            print(f"[runner] {p}: not a whole record ({p.stat().st_size} bytes), left out", flush=True)
    return records


def last_summary(text: str) -> dict:
    """The last ``DILOCOX SUMMARY`` in ``text`` (empty without ``--diloco-x``)."""
    found = parse_summaries(text)
    return found[-1] if found else {}


def summary_of(out: Path, name: str) -> dict:
    """The job's ``DILOCOX SUMMARY`` (empty without ``--diloco-x``), from all its logs."""
    logs = (done(out, name) or {}).get("logs", ["log.txt"])
    return last_summary("".join((out / name / log).read_text(errors="replace") for log in logs
                                if (out / name / log).exists()))


@dataclasses.dataclass
class _Running:
    job: Job
    procs: list[subprocess.Popen]
    files: list[IO]
    devices: list[int]
    t0: float
    watched: IO | None
    ending_since: float | None = None
    timed_out: bool = False


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:  # only the processes started here, by their process group
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _end(r: _Running, now: float) -> None:
    """Step the ending of a job: SIGKILL, or SIGTERM then SIGKILL after its grace."""
    if r.job.term_grace_s is None:
        _signal(r.procs, signal.SIGKILL)
    elif r.ending_since is None:
        r.ending_since = now
        _signal(r.procs, signal.SIGTERM)
    elif now - r.ending_since > r.job.term_grace_s:
        _signal(r.procs, signal.SIGKILL)
    if r.ending_since is None:
        r.ending_since = now


def _start(job: Job, d: Path, devices: list[int], gpus: int) -> _Running:
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob("rank*.json"):
        stale.unlink()
    env = {**os.environ, **BASE_ENV, **job.env}
    if devices:  # slices of the devices this process sees (honours an outer CUDA_VISIBLE_DEVICES)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
    (d / "cmd.txt").write_text("".join(" ".join(c.line) + "\n" + json.dumps({**job.env, **c.env}) + "\n"
                                       for c in job.commands))
    where = f", GPUs {env['CUDA_VISIBLE_DEVICES']}" if devices else ""
    print(f"[runner] start {job.name} ({len(job.commands)} command(s){where})", flush=True)
    procs, files = [], []
    for cmd, log in zip(job.commands, job.logs):
        f = open(d / log, "w")
        files.append(f)
        # Own session: a hung job is ended with its workers, by process group id.
        procs.append(subprocess.Popen(cmd.line, cwd=cmd.cwd, env={**env, **cmd.env}, stdout=f,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    watched = open(d / job.logs[0], errors="replace") if job.watch is not None else None
    return _Running(job, procs, files, devices, time.perf_counter(), watched)


def _feed(r: _Running) -> None:
    """Pass the complete new lines of the watched log to the job's ``watch``."""
    if r.watched is None:
        return
    while True:
        pos = r.watched.tell()
        line = r.watched.readline()
        if not line.endswith("\n"):
            r.watched.seek(pos)
            return
        r.job.watch(line)


def _finish(r: _Running, d: Path) -> dict:
    for f in r.files:
        f.close()
    if r.watched is not None:
        _feed(r)
        r.watched.close()
    wall = time.perf_counter() - r.t0
    for sub in r.job.scratch:
        shutil.rmtree(d / sub, ignore_errors=True)
    codes = [p.returncode for p in r.procs]
    records = load_ranks(d.parent, d.name)
    if r.job.expect_records is not None:
        ok = len(records) == r.job.expect_records and all(x.get("completed", True) for x in records)
    else:
        ok = all(c == 0 for c in codes) and not r.timed_out
    info = {"ok": ok, "returncode": next((c for c in codes if c != 0), 0), "returncodes": codes,
            "timed_out": r.timed_out, "wall_s": wall, "rank_files": len(records), "logs": r.job.logs,
            **r.job.fingerprint}
    (d / "done.json").write_text(json.dumps(info))
    status = "ok" if ok else f"FAILED (rc {info['returncode']}, {len(records)} rank files)"
    print(f"[runner] end   {r.job.name}: {status} in {wall:.0f} s", flush=True)
    if not ok:
        failed = next((i for i, c in enumerate(codes) if c != 0), 0)
        tail = (d / r.job.logs[failed]).read_text(errors="replace")[-3000:]
        print(f"[runner] last lines of {r.job.name}/{r.job.logs[failed]}:\n{tail}", flush=True)
    return info


def run_jobs(jobs: list[Job | ExampleJob], out: Path, parallel: int = 1, budget_s: float | None = None,
             on_done: Callable[[Job, dict], None] | None = None, resume: bool = True,
             poll_s: float = 0.5, jobs_per_gpu: int = 1) -> dict[str, dict]:
    """Run ``jobs`` under ``out``, ``parallel`` at a time, each on its own ``gpus`` devices when GPUs
    are present (on CPU they share the cores); returns ``{name: done info}`` of the jobs that ran.
    ``jobs_per_gpu``: how many jobs may share one device (each device has that many slots; a job
    takes one slot on each of ``gpus`` distinct devices, the least loaded first). ``resume``: skip
    jobs already done with the same fingerprint. ``budget_s``: start no job that would end past it
    (by its estimate). ``on_done(job, info)`` runs after each job ends."""
    out.mkdir(parents=True, exist_ok=True)
    pending = list(jobs)
    gpus = gpu_count()
    for job in pending:
        if gpus and job.gpus > gpus:
            raise SystemExit(f"[runner] {job.name} needs {job.gpus} GPUs but {gpus} are visible")
    if resume:
        def finished(j: Job | ExampleJob) -> bool:  # done with the same flags
            info = done(out, j.name) or {}
            return bool(info.get("ok")) and all(info.get(k) == v for k, v in j.fingerprint.items())

        skipped = [j for j in pending if finished(j)]
        pending = [j for j in pending if j not in skipped]
        if skipped:
            print(f"[runner] {len(skipped)} job(s) already done in {out}, skipped", flush=True)
    free = [d for d in range(gpus) for _ in range(jobs_per_gpu)]  # one entry per free slot
    running: list[_Running] = []
    results: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending[0]
                elapsed = time.perf_counter() - t_start
                if budget_s is not None and elapsed + job.estimate_s > budget_s:
                    print(f"[runner] budget: not starting {job.name} (elapsed {elapsed:.0f} s + estimate "
                          f"{job.estimate_s:.0f} s > {budget_s:.0f} s); rerun the same command to resume",
                          flush=True)
                    pending.pop(0)
                    continue
                need = job.gpus if gpus else 0
                by_load = sorted(set(free), key=lambda d: (-free.count(d), d))  # most free slots first
                if need > len(by_load):
                    break  # wait for a running job's devices
                pending.pop(0)
                devices = sorted(by_load[:need])
                for d in devices:
                    free.remove(d)
                job = job.job(out) if isinstance(job, ExampleJob) else job
                running.append(_start(job, out / job.name, devices, gpus))
            time.sleep(poll_s)
            now = time.perf_counter()
            for r in list(running):
                _feed(r)
                if any(p.poll() is None for p in r.procs):
                    failed = any(p.returncode not in (None, 0) for p in r.procs)
                    late = now - r.t0 > r.job.limit_s
                    if late and not r.timed_out:
                        print(f"[runner] {r.job.name}: no end after {r.job.limit_s:.0f} s, ending it", flush=True)
                        r.timed_out = True
                    if late or failed or r.ending_since is not None:
                        _end(r, now)
                    continue
                running.remove(r)
                free = sorted(free + r.devices)
                results[r.job.name] = info = _finish(r, out / r.job.name)
                if on_done is not None:
                    on_done(r.job, info)
    finally:
        for r in running:  # an exception (Ctrl-C, SIGTERM made one): end what was started here
            r.job.term_grace_s = r.job.term_grace_s or 10.0
            while any(p.poll() is None for p in r.procs):
                _end(r, time.perf_counter())
                time.sleep(0.1)
            for f in r.files:
                f.close()
    return results


def run_job(job: Job | ExampleJob, out: Path, resume: bool = False) -> dict:
    """Run one job now (no budget); returns its done info (also when it was skipped as done)."""
    name = job.name
    return run_jobs([job], out, resume=resume).get(name) or done(out, name) or {}
