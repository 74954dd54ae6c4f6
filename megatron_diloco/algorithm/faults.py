"""Fault drills for separate jobs: freeze or kill this job at a named point of the round protocol.

``DILOCO_X_FAULT=<point>:<action>:<round>`` (set for one job) makes every rank of that job act when it
reaches ``<point>`` in outer round ``<round>`` or the first round after it where the point is reached
(``decision``, ``exchange``, ``commit``: with another job present), once. Every rank of a job runs the
same protocol, so they all act at the same point.

Points (in the order a boundary reaches them, :mod:`megatron_diloco.algorithm.federated`):

=============== ===========================================================================
``meeting``     a boundary's meeting is about to start (before the coordinator is asked)
``handshake``   the members changed; the handshake is about to start
``heal-source`` this job is the source of a heal, its state on offer
``heal-target`` this job is behind, about to fetch its heal
``decision``    every member decided; the exchange is about to be launched
``exchange``    the exchange is in flight, before this job waits for it
``commit``      the exchange completed here, before the job-wide commit (and the members' check
                that they landed the same mean)
``save``        a checkpoint of this job is being written
=============== ===========================================================================

Actions: ``kill`` (SIGKILL, the job's ranks; torchrun then ends), ``stop`` (SIGSTOP: the job freezes,
heartbeats included, until someone sends SIGCONT), ``stall=<seconds>`` (the training thread sleeps;
heartbeats go on: a job stuck in its work, or whose link to the other jobs is cut while the coordinator
still hears it), ``corrupt`` (``commit`` only: one element of the mean this job landed is changed, as a
payload altered on its way to this job would: the members' check refuses the round everywhere).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV = "DILOCO_X_FAULT"
POINTS = ("meeting", "handshake", "heal-source", "heal-target", "decision", "exchange", "commit", "save")
ACTIONS = ("kill", "stop", "stall", "corrupt")

_fired = False


def parse(spec: str) -> tuple[str, str, float, int]:
    """``(point, action, stall seconds, round)`` of a :data:`ENV` value; ValueError naming it otherwise."""
    try:
        point, action, round_ = spec.split(":")
        action, _, seconds = action.partition("=")
        parsed = (point, action, float(seconds or 0), int(round_))
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected <point>:<action>:<round>, e.g. decision:kill:14") from None
    if point not in POINTS or action not in ACTIONS or (action == "stall") != (parsed[2] > 0):
        raise ValueError(f"{ENV}={spec!r}: point one of {', '.join(POINTS)}; action kill, stop, stall=<seconds> "
                         "or corrupt")
    if action == "corrupt" and point != "commit":
        raise ValueError(f"{ENV}={spec!r}: corrupt acts at the commit only (commit:corrupt:<round>)")
    return parsed


def point(name: str, round_: int, target: "torch.Tensor | None" = None, company: bool = True) -> None:
    """Act as :data:`ENV` says if this is its point and round (module doc); otherwise nothing. ``target``: the
    tensor ``corrupt`` changes (the mean at the commit; None: a round whose exchange failed, nothing to
    change: the drill waits for the next round). ``company``: False where this job is alone in the round
    (its decision, exchange and commit involve nobody else: the drill waits for a round with company)."""
    global _fired
    spec = os.environ.get(ENV)
    if _fired or not spec:
        return
    where, action, seconds, at_round = parse(spec)
    if where != name or round_ < at_round or not company or (action == "corrupt" and target is None):
        return
    _fired = True
    print(f"[fault drill] {action} at {name}, round {round_}", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "corrupt":
        flat = target.view(-1)
        if flat.numel():
            flat[:1].add_(1.0)
    else:
        time.sleep(seconds)
