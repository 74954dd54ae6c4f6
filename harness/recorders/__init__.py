"""The recorders of ``harness/run.py --record NAME,...``: one registry, :data:`RECORDERS`, by short name.

By concern (each module's docstring says what its recorders write into the rank's record):

* ``training.py``: ``training`` (the Megatron-level tests: losses, boundary checks, cross-replica
  traffic, shard fingerprints, ...);
* ``checkpoint.py``: ``checkpoint`` (saves, loads, grad scaler, save memory);
* ``federation.py``: ``federation`` (separate jobs: rounds, heals, final fingerprints);
* ``steps.py``: ``timers``, ``losses``, ``memory``, ``rounds``, ``boundary_check``, ``fixed_eval``,
  ``plain_ddp``, ``megatron_multi_tensor``, ``profile`` (the benchmarks' step times, losses and memory);
* ``network.py``: ``link`` (the in-process slow link), ``wan`` (the CPU WAN benchmark);
* ``codec_capture.py``: ``codec_capture`` (real pseudo-gradients saved to files);
* ``by_name.py``: ``by_name`` (the exchange by name's pull and push against canonical indices);
* ``slots.py``: ``slots`` (each rank's exchange slots: their parameter pieces and values);
* ``base.py``: :class:`~harness.recorders.base.Recorder`, ``wrap`` and the readings several share.

A recorder kept elsewhere is named ``package.module:Name`` (:func:`harness.run.resolve`).
"""

from __future__ import annotations

from .base import Recorder
from .by_name import ByNameRecorder
from .checkpoint import CheckpointRecorder
from .codec_capture import CodecCaptureRecorder
from .federation import FederationRecorder
from .network import LinkRecorder, WanRecorder
from .slots import SlotsRecorder
from .steps import (BoundaryCheckRecorder, FixedEvalRecorder, LossesRecorder, MegatronMultiTensorRecorder,
                    MemoryRecorder, PlainDDPRecorder, ProfileRecorder, RoundsRecorder, TimersRecorder)
from .training import TrainingRecorder

#: Every recorder of this repository by its ``name`` (a bare ``--record`` name).
RECORDERS: dict[str, type[Recorder]] = {r.name: r for r in (
    TrainingRecorder, CheckpointRecorder, FederationRecorder,
    TimersRecorder, LossesRecorder, MemoryRecorder, RoundsRecorder, BoundaryCheckRecorder, FixedEvalRecorder,
    PlainDDPRecorder, MegatronMultiTensorRecorder, ProfileRecorder, LinkRecorder, WanRecorder, CodecCaptureRecorder,
    SlotsRecorder, ByNameRecorder)}
