"""A pre-imported parent that forks the ranks of the Megatron-level tests (instead of torchrun).

Importing torch and Megatron-Core costs each rank ~8 s of CPU (Megatron pulls in torch._inductor);
with 4 ranks per run on 2 cores that is ~16 s per run, most of a short test run. This process
imports them once, then forks a fresh child per rank for each run, exactly as torchrun would start
it: its own environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ...),
``sys.argv``, a script run as ``__main__``, and a normal interpreter exit (non-daemon threads
joined, ``atexit`` run). Like torchrun, the first rank that fails gets the others terminated
(SIGTERM, then SIGKILL after ``TERM_GRACE_S``).

Protocol (one run at a time): the parent writes one JSON line on stdin,
``{"script", "args", "nproc", "env", "logs", "timeout"}`` (``logs``: one file per rank that receives
its stdout and stderr); the zygote answers one JSON line on stdout, ``{"returncodes": [...],
"timed_out": bool}``. Only the imports happen here: nothing of Megatron is configured or built
before the fork (the CPU shim is idempotent and applied again by each script).

Concurrent jobs (the separate-jobs tests: several replica jobs at once, each killed, frozen or
restarted on its own): a request with ``"job": true`` (and one combined ``"log"``, a ``"result"``
path) is answered at once with ``{"pid": P}``: P is a supervisor forked for the job (twice, so
that it is nobody's zombie), in a session of its own, doing torchrun's part: it forks the ranks
(all writing to the one log), stops the others when one fails, and writes the ranks' exit statuses
to ``result`` as it ends (a job killed as a whole leaves no result).

Used by :mod:`harness.launch` (``launch`` and ``start_job``); never by training.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TERM_GRACE_S = 30.0
_ANSWER_FD = -1
_MANAGER = None  # the checkpoint writer's results manager (_start_results_manager)
_STOP = False  # set in a job's supervisor by SIGTERM: stop its ranks as torchrun would
#: variables the preloaded imports added to the environment (the CPU shim's setdefault of
#: CUDA_DEVICE_MAX_CONNECTIONS): given to each child the same way, unless the run sets them
_PRELOAD_ENV: dict[str, str] = {}


def _start_results_manager() -> None:
    """Start the multiprocessing manager that Megatron's checkpoint writer wants, once, here.

    A ``torch_dist`` save creates a queue for its writers' results on a ``multiprocessing`` manager
    of its own, started with ``spawn`` at the first save of each process
    (``dist_checkpointing.strategies.filesystem_async.get_write_results_queue``). From a rank forked
    here, that start made every first save of the tests' tiny model take ~10 s (0.25 s without it),
    most of a short run that saves. Started once here instead, each rank gets a queue of its own on
    it (:func:`_child`), which Megatron's cache then returns: the same writer, the same files."""
    global _MANAGER
    import multiprocessing
    from multiprocessing.managers import SyncManager

    _MANAGER = SyncManager(ctx=multiprocessing.get_context("spawn"))
    _MANAGER.start(_end_with_the_zygote)


def _end_with_the_zygote() -> None:
    """In the manager's process: die with the zygote (which the test session may SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _prewarm() -> None:
    """Fill, once here, caches that every rank would otherwise fill on its own at start (~0.5 s of CPU
    per rank, 4 ranks a run): Megatron's argument parser reads the source of its config classes at
    every parse (``argument_utils._get_field_docstrings``: ``inspect.getsource``, here memoized: the
    sources do not change during a test session), and the package's check of Megatron's call sites
    parses the callers' source (``patches._syntax``, cached per function). The values are the same a
    rank would compute."""
    import functools
    import inspect

    from megatron.training import arguments

    from megatron_diloco.megatron_adapter import patches

    inspect.getsource = functools.cache(inspect.getsource)
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        arguments.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    for entry in patches.CATALOGUE:
        patches.problems(entry)


def _preload() -> None:
    here = Path(__file__).resolve().parent  # (run as a script: the repository root instead of this folder)
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "examples"))
    from megatron_diloco import compat

    compat.apply_all()  # the example's own first step, in its order (before Megatron imports)
    import importlib

    for name in ("megatron.core.models.gpt.gpt_layer_specs", "megatron.training.training",
                 "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.datasets.gpt_dataset",
                 "megatron_diloco.megatron_adapter.integration", "stdlib_corpus", "harness.run",
                 "harness.recorders"):  # what the example, the harness and its recorders import
        importlib.import_module(name)


def _child(script: str, args: list[str], env: dict[str, str], log: str, append: bool = False) -> None:
    """In the forked child: become the rank, run ``script``, exit like an interpreter would."""
    os.setpgid(0, 0)  # its own process group: a kill reaches the rank's helper processes too
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(devnull)
    if _ANSWER_FD >= 0:
        os.close(_ANSWER_FD)
    sys.stdout = sys.__stdout__
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    for key, value in _PRELOAD_ENV.items():
        os.environ.setdefault(key, value)
    sys.argv = [script, *args]
    if _MANAGER is not None:  # this rank's own queue on the zygote's manager (_start_results_manager)
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._results_queue = _MANAGER.Queue()
    # Megatron takes the job's start time at import (``--exit-duration-in-mins`` counts from it and
    # the start-up log reports it): the import happened in the zygote, so set it as a fresh process
    # would have, now.
    training = sys.modules["megatron.training.training"]
    for name in ("_TRAIN_START_TIME", "_LEGACY_TRAIN_START_TIME"):
        if hasattr(training, name):
            setattr(training, name, time.time())
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    # What interpreter shutdown does, in its order: join non-daemon threads, run atexit.
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(req: dict) -> dict:
    nproc = req["nproc"]
    pids = {}
    for rank in range(nproc):
        env = dict(req["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]))
        pid = os.fork()
        if pid == 0:
            _child(req["script"], req["args"], env, req["logs"][rank], req.get("append", False))
        pids[pid] = rank
    codes: list[int | None] = [None] * nproc
    deadline = time.monotonic() + req["timeout"]
    timed_out, stopping_since = False, None

    def signal_all(sig: int) -> None:
        for pid, rank in pids.items():
            if codes[rank] is None:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass

    while any(c is None for c in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if stopping_since is None and _STOP:  # the job's supervisor was told to stop (SIGTERM)
                stopping_since = now
                signal_all(signal.SIGTERM)
            elif stopping_since is None and now > deadline:
                timed_out, stopping_since = True, now
                signal_all(signal.SIGTERM)
            elif stopping_since is not None and now - stopping_since > TERM_GRACE_S:
                signal_all(signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and stopping_since is None:  # torchrun: one failed, stop the rest
            stopping_since = time.monotonic()
            signal_all(signal.SIGTERM)
    return {"returncodes": codes, "timed_out": timed_out}


def _start_job(req: dict) -> int:
    """Fork the supervisor of one job (see the module doc); return its pid without waiting for it."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # exits at once: the supervisor is reparented, never the zygote's zombie
        os.close(read)
        supervisor = os.fork()
        if supervisor == 0:
            os.close(write)
            _supervise(req)
        os.write(write, str(supervisor).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    pid = int(os.read(read, 64).decode())
    os.close(read)
    return pid


def _supervise(req: dict) -> None:
    """A job's supervisor (torchrun's part): run its ranks, record their statuses, exit."""
    global _ANSWER_FD, _STOP
    os.setsid()
    os.close(_ANSWER_FD)
    _ANSWER_FD = -1
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, source in ((0, devnull), (1, fd), (2, fd)):
        os.dup2(source, target)
    os.close(fd)
    os.close(devnull)

    def stop(*_) -> None:
        global _STOP
        _STOP = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 1
    try:
        answer = _run({**req, "logs": [req["log"]] * req["nproc"], "append": True})
        result = Path(req["result"])
        result.with_suffix(".tmp").write_text(json.dumps(answer))
        result.with_suffix(".tmp").replace(result)
        code = 0 if all(c == 0 for c in answer["returncodes"]) else 1
    finally:
        os._exit(code)


def main() -> None:
    global _ANSWER_FD
    _ANSWER_FD = os.dup(1)  # the answer channel; fd 1 becomes stderr (imports may print or log)
    os.dup2(2, 1)
    answer = os.fdopen(_ANSWER_FD, "w")
    before = dict(os.environ)
    _start_results_manager()
    _preload()
    _prewarm()
    _PRELOAD_ENV.update({k: v for k, v in os.environ.items() if k not in before})
    print("zygote ready", file=answer, flush=True)
    for line in sys.stdin:
        if line.strip():
            req = json.loads(line)
            reply = {"pid": _start_job(req)} if req.get("job") else _run(req)
            print(json.dumps(reply), file=answer, flush=True)


if __name__ == "__main__":
    main()
