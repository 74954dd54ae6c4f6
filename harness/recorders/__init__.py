"""The recorders of ``harness/run.py --record NAME,...``: one registry, :data:`RECORDERS`, by short name.

* the tests' (``training.py``): ``training``, ``checkpoint``, ``federation``;
* the benchmarks' (``steps.py``): ``timers``, ``losses``, ``memory``, ``rounds``, ``boundary_check``,
  ``fixed_eval``, ``plain_ddp``, ``link``, ``wan``, ``codec_capture``, ``profile``.

Each module's docstring says what its recorders write into the rank's record. A recorder kept elsewhere
is named ``package.module:Name`` (:func:`harness.run.resolve`).
"""

from __future__ import annotations

from .base import Recorder
from .steps import (BoundaryCheckRecorder, CodecCaptureRecorder, FixedEvalRecorder, LinkRecorder, LossesRecorder,
                    MemoryRecorder, PlainDDPRecorder, ProfileRecorder, RoundsRecorder, TimersRecorder, WanRecorder)
from .training import CheckpointRecorder, FederationRecorder, TrainingRecorder

#: Every recorder of this repository by its ``name`` (a bare ``--record`` name).
RECORDERS: dict[str, type[Recorder]] = {r.name: r for r in (
    TrainingRecorder, CheckpointRecorder, FederationRecorder,
    TimersRecorder, LossesRecorder, MemoryRecorder, RoundsRecorder, BoundaryCheckRecorder, FixedEvalRecorder,
    PlainDDPRecorder, LinkRecorder, WanRecorder, CodecCaptureRecorder, ProfileRecorder)}
