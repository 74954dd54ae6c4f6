"""Separate jobs on this machine for the federation tests and benchmarks: a real ``torchft_lighthouse``
process and one job per replica (CPU, gloo), each in its own process session so that a test can
kill -9, stop or continue a whole job, and always tears every process down. A job's ranks are forked
from the pre-imported process (``harness/zygote.py``: the environment, script and exit torchrun
gives them, without each rank importing torch and Megatron), or started by ``torchrun`` itself
(``torchrun=True``: the user's launcher, as the benchmarks and one test run them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import runner
from harness.launch import ENV, REPO, RUNNER, TINY, StartedJob, kill_session, signal_tree, start_job
from harness.runner import free_port, harness_args

LIGHTHOUSE = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
ROUND_LINE = re.compile(r"\[DiLoCoX\] round\s+(\d+) \|")


def run_secret(folder: Path, text: str = "the test run's shared secret, 32+ bytes") -> Path:
    """The run's secret file in ``folder`` (created once, mode 600): every job of a test shares it."""
    path = folder / "run.secret"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o600)
    return path


class Lighthouse:
    """``torchft_lighthouse`` on 127.0.0.1 (a context manager). ``join_timeout_ms`` must exceed a round
    (docs/federation.md); ``heartbeat_timeout_ms``: how long a silent job stays a member."""

    def __init__(self, log: Path, min_replicas: int = 1, join_timeout_ms: int = 60000,
                 heartbeat_timeout_ms: int = 3000) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [LIGHTHOUSE, "--bind", f"127.0.0.1:{self.port}", "--min_replicas", str(min_replicas),
             "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        kill_session(self.proc)
        self.log.close()


class Job:
    """One replica job: the harness (the demo example) on ``nproc`` ranks with ``model`` (default TINY;
    [] keeps the demo's model), ``flags`` and the federation flags, output in ``out/``, the combined
    log in ``out/log.txt``; ranks forked from the zygote, or ``torchrun --nproc-per-node nproc``."""

    def __init__(self, out: Path, name: str, index: int, lighthouse: str, flags: list[str], nproc: int = 2,
                 recorders: tuple[str, ...] = ("federation",), run: str = "test-run",
                 env: dict[str, str] | None = None, model: list[str] = TINY, secret: Path | None = None,
                 torchrun: bool = False) -> None:
        self.name, self.index, self.nproc, self.recorders = name, index, nproc, recorders
        self.torchrun = torchrun
        secret = secret or run_secret(out.parent)
        # each job its own dataset index cache, as every site has its own filesystem: two jobs building the same
        # index in one folder at once read each other's half-written files (Megatron's builder assumes one world)
        self.flags = [*model, "--data-cache-path", str(out.parent / f"{name}.dataset_cache"), *flags,
                      "--diloco-x-lighthouse", lighthouse, "--diloco-x-run", run,
                      "--diloco-x-secret-file", str(secret),
                      "--diloco-x-replica-id", name, "--diloco-x-replica-index", str(index),
                      "--diloco-x-advertise-host", "127.0.0.1"]
        self.env = {**os.environ, **ENV, **(env or {})}
        self.proc: subprocess.Popen | StartedJob | None = None
        self._log = None
        self.start(out)

    def start(self, out: Path, extra: list[str] = ()) -> None:
        """(Re)start the job, its records and log in ``out`` (``extra``: flags added)."""
        if self._log is not None:
            self._log.close()
            self._log = None
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.logfile = out / "log.txt"
        target = [*harness_args(out, self.recorders), *self.flags, *extra]
        if not self.torchrun:
            self.args = [str(RUNNER), *target]
            self.proc = start_job(RUNNER, target, self.logfile, self.nproc, self.env)
            return
        self.args = [*runner.torchrun(self.nproc), str(RUNNER), *target]
        self._log = open(self.logfile, "a")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        """The job's output so far ("" until its launcher has created the file: forked jobs start it
        asynchronously, and a poll right after the start may come first)."""
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def rounds(self) -> int:
        """Boundaries this job's rank 0 logged so far (all its starts)."""
        return len(ROUND_LINE.findall(self.log()))

    def signal(self, sig: int) -> None:
        """``sig`` to every process of the job: torchrun and its ranks (which run in sessions of their own)."""
        signal_tree(self.proc, sig)

    def kill(self) -> None:
        """kill -9 every process of the job (its torchrun and ranks)."""
        kill_session(self.proc)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job {self.name} did not end within {timeout} s:\n{self.log()[-5000:]}") from None

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("rank*.json"))]

    def summary(self) -> dict:
        found = re.findall(r"DILOCOX SUMMARY (\{.*\})", self.log())
        assert found, self.log()[-5000:]
        return json.loads(found[-1])

    def close(self) -> None:
        if self.proc is not None:
            kill_session(self.proc)
        if self._log is not None:
            self._log.close()


def wait_until(predicate, timeout: float, what: str, jobs: list[Job] = ()) -> None:
    """Poll ``predicate`` every 0.2 s until true; fail naming ``what`` (with the jobs' log tails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for job in jobs:
            if job.proc.poll() not in (None, 0):
                raise AssertionError(f"job {job.name} exited with {job.proc.returncode} while waiting for {what}:\n"
                                     f"{job.log()[-5000:]}")
        time.sleep(0.2)
    tails = "\n".join(f"--- {j.name}\n{j.log()[-3000:]}" for j in jobs)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tails}")
