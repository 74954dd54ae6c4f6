"""The harness's one registry of recorders (``harness/recorders``) and how ``--record`` names resolve
(``harness/run.py``); nothing is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import recorders
from harness.run import build, resolve

HARNESS = Path(__file__).resolve().parent.parent / "harness"


def test_every_recorder_has_one_short_name():
    assert set(recorders.RECORDERS) == {
        "training", "checkpoint", "federation", "timers", "losses", "memory", "rounds", "boundary_check",
        "fixed_eval", "plain_ddp", "megatron_multi_tensor", "profile", "link", "wan", "codec_capture", "slots",
        "by_name"}
    for name, cls in recorders.RECORDERS.items():
        assert cls.name == name and resolve(name) is cls


def test_module_names_resolve_for_recorders_kept_elsewhere():
    training = recorders.RECORDERS["training"]
    assert resolve("harness.recorders:training") is training  # the module's RECORDERS
    assert resolve("harness.recorders.training:TrainingRecorder") is training  # a recorder class by name
    for name in ("nope", "harness.recorders.base:wrap", "harness.recorders.training:nope"):
        with pytest.raises(SystemExit, match="no recorder"):
            resolve(name)


def test_two_recorders_writing_one_key_are_refused():
    with pytest.raises(SystemExit, match="both write 'losses'"):
        build(["training", "losses"], {})
    record: dict = {}
    assert [r.name for r in build(["checkpoint", "training"], record)] == ["checkpoint", "training"]
    assert record["losses"] == []


def test_no_harness_module_past_one_reading():
    for path in sorted(HARNESS.rglob("*.py")):
        assert len(path.read_text().splitlines()) <= 600, path
