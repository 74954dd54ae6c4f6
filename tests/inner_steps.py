"""The inner-step loops of the round tests that drive ``OuterSync`` without Megatron (``tests/test_federated_rounds.py``,
``tests/test_slot_exchange.py``, ``tests/test_pace.py``)."""

from __future__ import annotations

from typing import Callable, Iterator

from megatron_diloco.algorithm.schedule import RoundSchedule


def boundaries(sync, steps: dict, first: int, last: int, local_step: Callable[[int], None]) -> Iterator[int]:
    """The inner steps ``first``..``last`` of one rank: ``local_step(step)``, the job's position (``steps``) and
    its tokens counted (``sync.round_rules.count_step``), ``partial``'s merges where they fall; yields each
    boundary's step, after ``before_boundary``, before the caller runs the boundary."""
    schedule = RoundSchedule(sync.config)
    for step in range(first, last + 1):
        local_step(step)
        steps["steps"] = step
        sync.round_rules.count_step()
        since = schedule.steps_since_boundary(step)
        if since:
            if sync.merge_due(since):
                sync.merge()
            continue
        sync.before_boundary(0.01)
        yield step


def paced_boundaries(sync, steps: dict, until: int, step_s: float, local_step: Callable[[int], None]) -> Iterator[int]:
    """The inner steps of a paced job (``--diloco-x-site-pace``: its boundaries where its own rounds end) until it has
    reached ``until`` boundaries of the run: ``local_step(step)``, its position (``steps``) and tokens counted,
    ``partial``'s merges where they fall, ``step_s`` given as the step time measured; yields each boundary's step
    after running it."""
    fed, step = sync.round_rules, 0
    while fed.boundaries() < until:
        step += 1
        local_step(step)
        steps["steps"] = step
        fed.count_step()
        since = sync.schedule.steps_since_boundary(step)
        if since:
            if sync.merge_due(since):
                sync.merge()
            continue
        sync.before_boundary(step_s, steps=step)
        sync.boundary()
        yield step
