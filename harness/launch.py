"""Launch the example under the harness (``harness/run.py``) on CPU gloo ranks, as the tests and the
federation benchmarks do.

Ranks are forked from one pre-imported process per session (``harness/zygote.py``) instead of being
started by torchrun: the same environment, script and exit, without paying the torch + Megatron
import per rank (most of a short run on 2 cores). :func:`torchrun` launches through torchrun itself
(the tests of launching, and the reference runs).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from harness import runner
from harness.runner import free_port

REPO = Path(__file__).resolve().parent.parent
#: The harness entry point every Megatron-level test runs (ranks forked by the zygote, or torchrun).
RUNNER = REPO / "harness" / "run.py"
ZYGOTE = REPO / "harness" / "zygote.py"
#: The environment of every rank launched here (CPU, one OpenMP thread, unbuffered output).
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
_zygote: subprocess.Popen | None = None

# A model small enough for several runs per test on 2 cores; PP 2 x 2 replicas on 4 ranks.
TINY = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --log-interval 1 --eval-iters 0 --eval-interval 100000 --lr-warmup-iters 2
""".split()


def _get_zygote() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, str(ZYGOTE)], cwd=REPO, env=dict(os.environ, **ENV),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        atexit.register(_zygote.kill)
        ready = _zygote.stdout.readline()
        assert ready.strip() == "zygote ready", f"the rank launcher did not start: {ready!r}"
    return _zygote


def launch(script: Path, args: list[str], out: Path, nproc: int = 4, timeout: float = 400,
           env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``script args`` on ``nproc`` gloo ranks (as torchrun would, on one node); wait for all.

    Returns (exit status, combined output): the status is 0 when every rank exited 0, else the
    first non-zero one (a rank that failed gets the others terminated). Each rank's output is kept in
    ``out/rank{R}.log``; the combined output is the ranks' logs in rank order. ``env``: extra
    environment variables. Raises ``TimeoutError`` past ``timeout`` seconds (the ranks are killed)."""
    logs = [str(out / f"rank{r}.log") for r in range(nproc)]
    request = {"script": str(script), "args": [str(a) for a in args], "nproc": nproc, "port": free_port(),
               "env": dict(os.environ, **ENV, **(env or {})), "logs": logs, "timeout": timeout}
    zygote = _get_zygote()
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    ready, _, _ = select.select([zygote.stdout], [], [], timeout + 90)  # past the zygote's own kill
    assert ready, "the rank launcher stopped answering"
    answer = json.loads(zygote.stdout.readline())
    log = "".join(Path(p).read_text(errors="replace") if Path(p).exists() else "" for p in logs)
    if answer["timed_out"]:
        raise TimeoutError(f"{script.name} ran past {timeout} s:\n{log[-6000:]}")
    code = next((c for c in answer["returncodes"] if c != 0), 0)
    return code, log


class StartedJob:
    """A job started by :func:`start_job` (its supervisor is the zygote's, not this process's child):
    what the tests use of a ``subprocess.Popen``. ``returncode``: 0 when every rank exited 0, else the
    first non-zero status; ``-9`` for a job killed as a whole (its supervisor left no result)."""

    def __init__(self, pid: int, result: Path, args: list[str]) -> None:
        self.pid, self.result, self.args = pid, result, args
        self.returncode: int | None = None

    def _read(self) -> int:
        answer = json.loads(self.result.read_text())
        return next((c for c in answer["returncodes"] if c != 0), 0)

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.result.exists():
                self.returncode = self._read()
            else:
                try:
                    alive = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    alive = False
                if not alive:  # (it may have written its result just before it went)
                    self.returncode = self._read() if self.result.exists() else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.1)
        return self.returncode


def start_job(script: Path, args: list[str], log: Path, nproc: int, env: dict[str, str],
              timeout: float = 1800) -> StartedJob:
    """Start ``script args`` on ``nproc`` gloo ranks as one job (as ``torchrun --nproc-per-node nproc``
    on one node would, the ranks forked from the pre-imported zygote) and return at once; the ranks'
    output goes to ``log`` (appended). ``env``: the ranks' whole environment. Several jobs may run at
    once; the job's ranks are killed past ``timeout`` seconds."""
    result = log.parent / f".job-{free_port()}-{time.monotonic_ns()}.json"
    request = {"job": True, "script": str(script), "args": [str(a) for a in args], "nproc": nproc,
               "port": free_port(), "env": env, "log": str(log), "result": str(result), "timeout": timeout}
    zygote = _get_zygote()
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    ready, _, _ = select.select([zygote.stdout], [], [], 60)
    assert ready, "the rank launcher stopped answering"
    return StartedJob(json.loads(zygote.stdout.readline())["pid"], result, [str(script), *map(str, args)])


def run_jobs(jobs: list[tuple[list[str], Path, int]], env: dict[str, str] | None = None,
             timeout: float = 400) -> list[tuple[int, str]]:
    """Run several launches of the harness at once, each ``(args, out, nproc)`` (its flags, its folder,
    its ranks), as separate ``torchrun`` s would; wait for all. Returns (exit status, output) per launch,
    in order; kills them all and fails past ``timeout`` seconds."""
    started = []
    for args, out, nproc in jobs:
        out.mkdir(parents=True, exist_ok=True)
        log = out / "log.txt"
        started.append((start_job(RUNNER, args, log, nproc, dict(os.environ, **ENV, **(env or {})), timeout), log))
    deadline = time.monotonic() + timeout + 60
    try:
        codes = [job.wait(max(1.0, deadline - time.monotonic())) for job, _ in started]
    except subprocess.TimeoutExpired:
        raise AssertionError("launches ran past their timeout:\n" +
                             "\n".join(log.read_text(errors="replace")[-3000:] for _, log in started)) from None
    finally:
        for job, _ in started:
            if job.poll() is None:
                kill_session(job)
    return [(code, log.read_text(errors="replace")) for code, (_, log) in zip(codes, started)]


def signal_tree(proc: subprocess.Popen | StartedJob, sig: int) -> None:
    """``sig`` to ``proc``, its process group and every descendant (torchrun starts its ranks in new
    sessions: a signal to torchrun's group alone leaves them running)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_session(proc: subprocess.Popen | StartedJob) -> None:
    """kill -9 ``proc`` and all its descendants, and reap it."""
    signal_tree(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def torchrun(target: list[str], nproc: int = 4, env: dict[str, str] | None = None, cwd: Path = REPO,
             timeout: float = 400) -> tuple[int, str]:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc <target>`` on CPU gloo ranks
    (``target``: a script and its flags, or ``-m module ...``); returns (exit status, combined output).
    For the tests of launching itself and of separate launches; the Megatron-level tests use
    :func:`launch`. Records: a ``target`` of
    ``[RUNNER, *harness.runner.harness_args(out), ...]``."""
    cmd = [*runner.torchrun(nproc), *map(str, target)]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, **ENV, **(env or {})), capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


