"""Runs longer than one device call: Megatron runs that save, stop in time and go on in the next call.

A lent GPU machine runs one command for at most 10 minutes and keeps its files for the next call
only while it stays held (30 s idle, 30 minutes in all). A run longer than one command is carried
over several calls of the same command into the same folder ``DIR``:

* every run saves into ``DIR/<run>/ckpt`` when it stops (its call's exit, the end of training) and loads
  from it (:func:`checkpoint_flags`); on ``--load`` Megatron resumes from the latest checkpoint there by
  itself (none yet: from iteration 0);
* each call stops its runs at one deadline, :data:`STOP_S` before the call's end (:class:`Call`), through
  Megatron's ``--exit-duration-in-mins``. Megatron 0.19 checks it after every iteration
  (``training.checkpoint_and_decide_exit``: past it, it saves a checkpoint, when ``--save`` is set and that
  iteration was not just saved, then exits with status 0; with DiLoCoX at the next outer boundary) and, without
  DiLoCoX, after every evaluation batch (``training.evaluate``: past it, the evaluation is dropped unprinted and
  the save and exit follow at that iteration; the resumed run does not repeat it, so that point is missing from
  the curve; with DiLoCoX the evaluation finishes). An evaluation after training is made by the next call. Its limit is whole minutes from the program's start; the harness gives
  Megatron, through its own ``training.set_startup_timestamps``, the start that puts that limit on the
  deadline (``BENCH_PROGRAM_START``, read by ``harness/run.py``), so the stop is to the iteration, not to the
  minute, and counts from the call rather than from each rank's imports (about 28 s after its launch at 302M).
  A run that has not ended :data:`END_S` before the call's end is killed (its steps of this call are lost,
  not its checkpoint); a run that cannot start at once (no free GPUs) waits for the next call;
* a run keeps only its latest checkpoint: Megatron deletes the one before each save as the save completes
  (``--save-retain-interval``, :func:`checkpoint_flags`), and a save that did not complete is deleted at the next
  start or end of a call (:func:`prune_checkpoints`);
* each call's logs and records go to ``DIR/<run>/call<k>/`` (:meth:`Call.job_name`), kept, so that a
  report reads every call's logs of a run in order (:func:`call_dirs`);
* ``DIR/manifest.json`` (:class:`Manifest`): the calls made into ``DIR`` and, per run, its flags,
  ``train_iters``, the last iteration saved (Megatron's ``latest_checkpointed_iteration.txt``), whether
  it finished and the calls that launched it; read from the disk at the start and at the end of every
  call. A call launches only the runs not finished; a run's flags may not change between calls.

What cannot be seen from the device: a machine given back between two calls (idle past its window, or
its 30 minutes up) takes ``DIR`` with it. The next call finds no manifest, counts itself call 1 and
starts every run from iteration 0, as a first call does: its output says ``call 1``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import time
from pathlib import Path
from typing import Callable

from harness.runner import done

#: Seconds a call keeps after its runs' deadline: the steps to the next outer boundary, where DiLoCoX takes the
#: exit (up to H: 16 s at 302M and H 100), the checkpoint save (a process's first: 26-37 s for one world of 2
#: DiLoCoX replicas at 302M on H200s, later ones 13-17 s), the teardown (about 10 s) and :data:`END_S`.
STOP_S = 90.0
#: Seconds a call keeps after its last run was ended: the manifest and the report.
END_S = 15.0
#: Seconds after the launch within which a run of the call may still start (its deadline is the call's).
LATE_START_S = 10.0


@dataclasses.dataclass(frozen=True)
class Call:
    """One call into a folder of continued runs: which one, and when its runs stop."""

    index: int
    """1 for the first call into the folder (no manifest yet), then 2, 3, ..."""
    left_s: float
    """Seconds the call has left when its runs are launched."""
    exit_interval: int | None = None
    """Megatron's ``--exit-interval`` for this call's runs as well: they also stop (and save) at the first
    multiple of it, a split by iterations rather than by time (checks; not in the run's flags)."""
    start: float = dataclasses.field(default_factory=time.time)
    """When the call launches its runs (``time.time()``): its deadline counts from here."""

    def __post_init__(self) -> None:
        if self.run_s < 60:
            raise SystemExit(f"--call-s: {self.left_s:.0f} s left at the launch, less {STOP_S:.0f} s to stop, leave "
                             "less than a minute to train")

    @property
    def run_s(self) -> float:
        """Seconds from the launch to the runs' deadline (the runner's estimate for a run)."""
        return self.left_s - STOP_S

    @property
    def exit_mins(self) -> int:
        """Megatron's ``--exit-duration-in-mins`` of this call's runs: the whole minutes at or past the deadline."""
        return math.ceil(self.run_s / 60)

    @property
    def program_start(self) -> float:
        """The program start (``time.time()``) given to Megatron: ``exit_mins`` before the deadline."""
        return self.start + self.run_s - 60 * self.exit_mins

    @property
    def timeout_s(self) -> float:
        """After this long a run of this call is killed (the runner's timeout: a run that did not stop)."""
        return self.run_s + STOP_S - END_S

    @property
    def budget_s(self) -> float:
        """The runner's budget: a run (estimated at :attr:`run_s`) starts only within :data:`LATE_START_S` of the
        launch; one that cannot (no free GPUs) waits for the next call."""
        return self.run_s + LATE_START_S

    def flags(self) -> list[str]:
        """The example's flags of this call's launches (after the run's own)."""
        return ["--exit-duration-in-mins", str(self.exit_mins),
                *(["--exit-interval", str(self.exit_interval)] if self.exit_interval else [])]

    def env(self) -> dict[str, str]:
        """The environment of this call's launches: the program start that puts Megatron's limit on the deadline."""
        return {"BENCH_PROGRAM_START": f"{self.program_start:.3f}"}

    def job_name(self, run: str) -> str:
        """The runner's job of ``run`` in this call: its folder ``DIR/<run>/call<k>``."""
        return f"{run}/call{self.index}"


def checkpoint_flags(run_dir: Path, train_iters: int, load_rng: bool = True) -> list[str]:
    """The example's flags that make a run continue across calls: ``--save`` / ``--load`` of
    ``run_dir/ckpt``, and ``--save-interval`` = ``--save-retain-interval`` past ``train_iters``.

    So a run saves only when it stops: at its call's exit (``--exit-duration-in-mins``, ``--exit-interval``)
    and at the end of training (Megatron saves there unless that iteration is a multiple of the interval).
    A save at every evaluation cost a 302M run about 80 of each call's 420 s of training (four saves of about
    20 GB); it only helps a run killed before its exit save, which the call's ``STOP_S`` is there to prevent.
    Megatron deletes the checkpoint before each save once the save completes (its previous iteration is no
    multiple of the retain interval): a continued run loads only its latest, and each save of one world of 2
    DiLoCoX replicas holds both replicas' weights, inner optimizer and outer state (kept, they filled a lent
    machine's disk). ``load_rng`` False: ``--no-load-rng`` (the CPU shim's RNG tracker has no state to
    restore)."""
    ckpt, past = str(run_dir / "ckpt"), str(train_iters + 1)
    return ["--save", ckpt, "--load", ckpt, "--save-interval", past, "--save-retain-interval", past,
            *([] if load_rng else ["--no-load-rng"])]


def saved_iteration(run_dir: Path) -> int | None:
    """The iteration of the run's latest checkpoint (``ckpt/latest_checkpointed_iteration.txt``), or None."""
    tracker = run_dir / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def prune_checkpoints(run_dir: Path) -> list[int]:
    """Delete a run's checkpoints other than its latest (``ckpt/iter_NNNNNNN`` but the iteration of
    ``latest_checkpointed_iteration.txt``, which Megatron writes once a save is complete): a save that did not
    complete, or one kept from before ``--save-retain-interval``. Only while none of the run's ranks writes (at
    the start and end of a call). Returns the iterations deleted."""
    latest = saved_iteration(run_dir)
    if latest is None:
        return []
    gone = []
    for d in (run_dir / "ckpt").glob("iter_*"):
        if d.name[5:].isdigit() and int(d.name[5:]) != latest:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(int(d.name[5:]))
    return sorted(gone)


def call_dirs(run_dir: Path) -> list[Path]:
    """The folders of a run's calls in call order (``call1``, ``call2``, ...); a run not continued
    across calls: the run's folder itself."""
    calls = [p for p in run_dir.glob("call*") if p.is_dir() and p.name[4:].isdigit()]
    return sorted(calls, key=lambda p: int(p.name[4:])) or [run_dir]


def last_done(run_dir: Path) -> dict | None:
    """The ``done.json`` of a run's last launch: its last call's (:func:`call_dirs`), or the run's own."""
    last = call_dirs(run_dir)[-1]
    return done(last.parent, last.name)


class Manifest:
    """``DIR/manifest.json``: ``calls`` (per call: its index, seconds left and to the deadline, exit interval, the
    runs not finished at its start) and ``runs`` (per run: ``flags``, one shell line, ``train_iters``,
    ``saved_iteration``, ``finished``, ``calls``: those that took it up)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / "manifest.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"calls": [], "runs": {}}

    def next_call(self, left_s: float, exit_interval: int | None = None) -> Call:
        """The call about to run, with ``left_s`` seconds left (refused when shorter than a minute's run)."""
        return Call(len(self.data["calls"]) + 1, left_s, exit_interval)

    def begin(self, call: Call, runs: dict[str, tuple[list[str], int]],
              finished: Callable[[Path], bool]) -> list[str]:
        """Record ``call`` with ``runs`` (``{run: (flags, train_iters)}``, the runs asked for); returns the
        ones to launch: those not ``finished(DIR/<run>)``. Refuses a run whose flags differ from the
        ones it was started with."""
        for run, (flags, train_iters) in runs.items():
            line = shlex.join(flags)
            known = self.data["runs"].setdefault(run, {"flags": line, "train_iters": train_iters, "calls": []})
            if known["flags"] != line:
                was = shlex.split(known["flags"])
                i = next((i for i, (x, y) in enumerate(zip(was, flags)) if x != y), min(len(was), len(flags)))
                window = lambda f: shlex.join(f[max(i - 1, 0):i + 2])  # noqa: E731 - around the first difference
                raise SystemExit(f"{run}: its flags differ from those it was started with ({self.path}): "
                                 f"'{window(was)}' then, '{window(flags)}' now; continue it with the same "
                                 "command, or use another --out")
        todo = [run for run, state in self.refresh(finished).items() if run in runs and not state["finished"]]
        for run in todo:
            self.data["runs"][run]["calls"].append(call.index)
        self.data["calls"].append({"call": call.index, "left_s": round(call.left_s, 1), "run_s": round(call.run_s, 1),
                                   "exit_interval": call.exit_interval, "unfinished": todo,
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.write()
        how = "no manifest: every run from iteration 0" if call.index == 1 else "runs continued from their checkpoints"
        print(f"[continued] call {call.index} into {self.out} ({how}): {len(todo)} of {len(runs)} run(s) not "
              f"finished, launched to stop {call.run_s:.0f} s from now", flush=True)
        return todo

    def refresh(self, finished: Callable[[Path], bool]) -> dict[str, dict]:
        """Every run's last saved iteration and whether it finished, from the disk (at the start and the
        end of a call), written; returns the runs."""
        for run, state in self.data["runs"].items():
            prune_checkpoints(self.out / run)
            state.update(saved_iteration=saved_iteration(self.out / run), finished=finished(self.out / run))
        self.write()
        return self.data["runs"]

    def end(self, finished: Callable[[Path], bool]) -> None:
        """At the end of a call: :meth:`refresh`, and where each run stands."""
        where = {run: "finished" if st["finished"] else f"saved at {st['saved_iteration']}"
                 for run, st in self.refresh(finished).items()}
        print("[continued] " + ", ".join(f"{run}: {w}" for run, w in where.items()), flush=True)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))
