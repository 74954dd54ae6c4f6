"""Run the example with named recorders attached, one process per rank: the one entry point of the
tests and benchmarks that measure inside a training run.

    python harness/run.py --record timers,losses --out DIR -- <example flags>
    torchrun --nproc-per-node 4 harness/run.py --record wan,plain_ddp --out DIR -- ...
    python -m harness.run --record training --out DIR -- ...

The unmodified ``examples/pretrain_gpt_diloco.py`` (or ``--script``) runs as ``__main__`` in this
process after each recorder has wrapped the Megatron / megatron_diloco functions it measures
(:func:`~harness.recorders.base.wrap`). All recorders of a run write into one dict, the rank's
*record*, saved as JSON to ``OUT/rank{R}.json`` when the script ends (also when it raised; R: the
global rank, or ``$RANK`` before the process group exists).

Recorders (:class:`~harness.recorders.base.Recorder` subclasses) are named in ``--record``,
comma-separated, installed in that order: a bare name is looked up in the registry
(``harness.recorders.RECORDERS``: ``training``, ``checkpoint``, ``federation``, ``timers``,
``wan``, ...); ``package.module:name`` looks ``name`` up in that module's ``RECORDERS``, else takes
the module's attribute ``name`` (a recorder class kept outside this repository). Each recorder
declares the record keys it writes; two recorders that declare the same key cannot be combined
(e.g. ``training``'s ``losses`` list and ``losses``'s dict).

``--record`` and ``--out`` default to ``$DILOCO_HARNESS_RECORD`` and ``$DILOCO_HARNESS_OUT``, for
launchers that can only pass the example's flags (without ``--`` every argument is the example's).
``--fast-exit``: once the script completed and the record was written, exit at once without
interpreter teardown (a finished gloo run once aborted there with "terminate called without an
active exception"); not for runs that start helper processes (Megatron's checkpoint writers use
``multiprocessing`` workers), which skipped teardown would leave orphaned. ``--hang-dump-s N``
(default ``$BENCH_HANG_DUMP_S``): every N s, all threads' stacks to stderr (diagnosing hangs).

Nothing here is used by training itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if __name__ == "__main__":  # run as a script: the repository root, not this folder, on the path
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != HERE]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))

from harness.recorders.base import Recorder  # noqa: E402

#: The example every recorder is written for.
EXAMPLE = REPO / "examples" / "pretrain_gpt_diloco.py"
#: Where bare recorder names are looked up (its ``RECORDERS``).
CATALOGUE = "harness.recorders"
RECORD_ENV, OUT_ENV = "DILOCO_HARNESS_RECORD", "DILOCO_HARNESS_OUT"


@dataclasses.dataclass
class HarnessConfig:
    """What one harness process runs and records."""

    record: list[str]
    """Recorder names, installed in this order (see the module docstring)."""
    out: Path | None
    """Folder of the ``rank{R}.json`` records; None: no record written."""
    argv: list[str]
    """The example's flags."""
    script: Path = EXAMPLE
    fast_exit: bool = False
    hang_dump_s: int | None = None


def parse_args(argv: list[str]) -> HarnessConfig:
    """``[harness flags] -- <example flags>``; without ``--`` all of ``argv`` is the example's."""
    if "--" in argv:
        cut = argv.index("--")
        own, example = argv[:cut], argv[cut + 1:]
    elif argv[:1] in (["-h"], ["--help"]):  # the harness's help (the example's: ``-- --help``)
        own, example = argv, []
    else:
        own, example = [], argv
    p = argparse.ArgumentParser(prog="harness", description=__doc__.split("\n\n")[0])
    p.add_argument("--record", default=os.environ.get(RECORD_ENV, ""),
                   help=f"recorders, comma-separated (default ${RECORD_ENV})")
    p.add_argument("--out", type=Path, default=os.environ.get(OUT_ENV) or None,
                   help=f"folder of the rank records (default ${OUT_ENV})")
    p.add_argument("--script", type=Path, default=EXAMPLE, help="the training script (default: the example)")
    p.add_argument("--fast-exit", action="store_true", help="exit without teardown once the record is written")
    p.add_argument("--hang-dump-s", type=int, default=int(os.environ.get("BENCH_HANG_DUMP_S") or 0) or None)
    a = p.parse_args(own)
    return HarnessConfig(record=[n for n in a.record.split(",") if n], out=a.out, argv=example,
                         script=a.script, fast_exit=a.fast_exit, hang_dump_s=a.hang_dump_s)


def resolve(name: str) -> type[Recorder]:
    """The recorder class of a ``--record`` name: ``name`` (the registry), or ``package.module:name``
    (that module's ``RECORDERS[name]``, else its attribute ``name``)."""
    module, _, short = name.rpartition(":")
    where = importlib.import_module(module or CATALOGUE)
    found = getattr(where, "RECORDERS", {})
    if short in found:
        return found[short]
    cls = getattr(where, short, None) if module else None
    if isinstance(cls, type) and issubclass(cls, Recorder):
        return cls
    raise SystemExit(f"harness: no recorder {short!r} in {module or CATALOGUE} "
                     f"(has: {', '.join(sorted(found)) or 'none'})")


def build(names: list[str], record: dict[str, Any]) -> list[Recorder]:
    """Instantiate the named recorders on one shared record; refuses two that write the same key."""
    classes = [resolve(n) for n in names]
    owner: dict[str, str] = {}
    for cls in classes:
        for key in cls.keys:
            if key in owner and owner[key] != cls.name:
                raise SystemExit(f"harness: recorders {owner[key]!r} and {cls.name!r} both write {key!r}")
            owner[key] = cls.name
    return [cls(record) for cls in classes]


def _rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None else None


def run_script(argv: list[str], record: dict | None = None, out_dir: str | os.PathLike | None = None,
               finalize: Callable[[bool], None] | None = None, fast_exit: bool = False,
               script: Path = EXAMPLE) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *argv]``.

    Afterwards (also when it raised): ``finalize(completed)`` if given, then ``record`` is written as
    JSON to ``out_dir/rank{R}.json`` when both are given. With ``fast_exit``, if the script completed
    and the record was written, the process exits with status 0 at once (see the module docstring);
    otherwise this returns (or re-raises the script's exception)."""
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
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if fast_exit and completed and written:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``), install the recorders, run the script."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.enable()  # a rank that crashes in native code (gloo, torch, torchft) prints every thread's stack
    for path in (cfg.script.resolve().parent, REPO):  # the example's neighbours; tests / benchmarks
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if cfg.hang_dump_s:
        faulthandler.dump_traceback_later(cfg.hang_dump_s, repeat=True)
    from megatron_diloco import compat

    compat.apply_all()  # what the example does first (idempotent): Megatron importable on any device
    if os.environ.get("BENCH_PROGRAM_START"):  # continued runs: --exit-duration-in-mins counts from here
        from megatron.training import training  # (harness/continued.py: the call's deadline, to the iteration)

        training.set_startup_timestamps(program_start=float(os.environ["BENCH_PROGRAM_START"]))
    record: dict[str, Any] = {}
    recorders = build(cfg.record, record)
    for r in recorders:
        r.install()

    def finalize(completed: bool) -> None:
        for r in recorders:
            r.finalize(completed)

    run_script(cfg.argv, record if cfg.record else None, cfg.out, finalize, cfg.fast_exit, cfg.script)


if __name__ == "__main__":
    main()
