"""Run a Megatron pretraining script in this process with recorders attached (tests, benchmarks).

The Megatron-level tests (``tests/megatron_runner.py``) and the benchmarks (``benchmarks/instrumented.py``,
``benchmarks/wan_worker.py``, ``benchmarks/codec_capture.py``) all run the unmodified
``examples/pretrain_gpt_diloco.py``, one process per rank, after wrapping a few Megatron and
megatron_diloco functions to record what they measure. What they share lives here:

* :func:`wrap`: replace ``owner.name`` by a function that receives the original as first argument;
* :func:`run_script`: run the script as ``__main__`` and write the rank's record to
  ``out_dir/rank{R}.json``; optionally (``fast_exit``) leave without interpreter teardown once the
  script completed (a finished gloo run once aborted there with "terminate called without an
  active exception"). Not for runs that start helper processes (Megatron's checkpoint writers use
  ``multiprocessing`` workers): skipped teardown leaves them orphaned, holding the launcher's pipes.

Nothing here is used by training itself.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

#: The example every harness runs.
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pretrain_gpt_diloco.py"


def wrap(owner: Any, name: str) -> Callable[[Callable], Callable]:
    """Decorator: ``owner.name`` becomes ``fn(original, *args, **kwargs)``; returns the wrapper.

    ``owner`` is a module or a class (a method wrapped on the class receives ``self`` after the
    original). Process-wide and permanent: meant for harness processes only."""

    def decorate(fn: Callable) -> Callable:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return fn(original, *args, **kwargs)

        setattr(owner, name, wrapper)
        return wrapper

    return decorate


def _rank() -> int | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None else None


def run_script(argv: list[str], record: dict | None = None, out_dir: str | os.PathLike | None = None,
               finalize: Callable[[bool], None] | None = None, fast_exit: bool = False,
               script: Path = EXAMPLE) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *argv]``.

    Afterwards (also when it raised): ``finalize(completed)`` if given, then ``record`` is written as
    JSON to ``out_dir/rank{R}.json`` (R: the global rank, or ``$RANK`` before the process group
    exists) when both are given. With ``fast_exit``, if the script completed and the record was
    written, the process exits with status 0 at once (see the module docstring); otherwise this
    returns (or re-raises the script's exception)."""
    sys.argv = [str(script), *argv]
    completed = False
    try:
        runpy.run_path(str(script), run_name="__main__")
        completed = True
    finally:
        if finalize is not None:
            finalize(completed)
        rank = _rank()
        written = bool(out_dir) and record is not None and rank is not None
        if written:
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if fast_exit and completed and written:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
