"""What every recorder stands on: :class:`Recorder`, :func:`wrap`, and the readings several of them take
(the loss Megatron logs, host memory, parameter counts, shard fingerprints)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, ClassVar


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


class Recorder:
    """One named measurement: wraps functions in :meth:`install`, adds its keys to the record.

    Subclasses set :attr:`name` and :attr:`keys` (every record key they may write) and override
    :meth:`install` and, if they need the end of the run, :meth:`finalize`. One instance per
    process; ``record`` is the rank's record dict shared by all recorders of the run."""

    name: ClassVar[str] = ""
    keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def install(self) -> None:
        """Wrap what this recorder measures (Megatron is importable; the example has not run)."""

    def finalize(self, completed: bool) -> None:
        """After the script ended (``completed``: it returned normally), before the record is written."""


def on_losses(training, record_loss: Callable[[int, dict], None]) -> None:
    """``record_loss(iteration, loss_dict)`` for every iteration Megatron's ``training_log`` gets a
    non-empty loss dict (the ranks that log a loss: the last pipeline stage)."""

    @wrap(training, "training_log")
    def training_log(orig, loss_dict, *a, **k):
        if loss_dict:
            record_loss(k["iteration"] if "iteration" in k else a[2], loss_dict)
        return orig(loss_dict, *a, **k)


def record_losses(training, losses: list) -> None:
    """``losses``: every logged iteration's losses at full precision, ``[iteration, {loss name: value}]``."""
    on_losses(training, lambda iteration, loss_dict: losses.append(
        [iteration, {key: float(v) for key, v in loss_dict.items()}]))


def proc_status_bytes(field: str) -> int | None:
    """``field`` of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; None where it is unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def params_on_rank(model) -> int:
    """Parameters of this rank's model chunks (its pipeline stage)."""
    return sum(p.numel() for chunk in model for p in chunk.parameters())


def fingerprint_ints(tensors) -> list[int]:
    """Bitwise fingerprint of ``tensors`` (:func:`megatron_diloco.algorithm.shard_view.fingerprint`)
    as JSON integers."""
    from megatron_diloco.algorithm.shard_view import fingerprint

    return [int(x) for x in fingerprint(list(tensors))]
