"""What the jobs of a run must agree on, checked whenever the members change.

Each job describes itself once (:func:`megatron_diloco.megatron_adapter.handshake.describe_launch`:
the flags that decide the exchange's bytes, the outer step, the round schedule, the data split and
the shards, the package versions; plus the run's name, ``--diloco-x-run``). At a meeting whose
members changed, the members' descriptions, progress, data slots and names are all-gathered over
each outer group (a few kB, once per change). The reference is the most advanced member (ties: the
first in the quorum's order). A member whose description differs from the reference's, or that holds
a data slot (``--diloco-x-replica-index``) a more advanced member holds, leaves the run (SystemExit
naming the flag); every other member meets again without it. Every rank of every member reads the
same gathered list, so all reach the same verdict.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from megatron_diloco.megatron_adapter.handshake import MAY_DIFFER, differences

RUN = "--diloco-x-run"


def identity(description: dict[str, Any]) -> str:
    """A digest of ``description`` (what a healing peer's state is checked against)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def agree(group: dist.ProcessGroup, progress: int, description: dict[str, Any], slot: int, name: str) -> bool:
    """Compare this job with every member of ``group`` (module doc; collective over it). Returns True
    when every member agrees; False when another member differs (it leaves; meet again); raises
    SystemExit when this job is the one that differs."""
    size = dist.get_world_size(group)
    if size <= 1:
        return True
    mine = {"identity": identity(description), "description": description, "progress": int(progress),
            "slot": int(slot), "name": name}
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    order = sorted(range(size), key=lambda i: (-everyone[i]["progress"], i))
    ref = everyone[order[0]]
    leaving: dict[int, str] = {}
    slots: dict[int, int] = {}
    for i in order:
        member = everyone[i]
        if member["identity"] != ref["identity"]:
            found = differences(member["description"], ref["description"], 0)
            listed = "; ".join(p.replace("in replica 0", f"in job {ref['name']!r}") for p in found)
            leaving[i] = (f"this job ({member['name']!r}) differs from the run's job {ref['name']!r}: {listed}. "
                          "Every job of a run must train with the same values of these; give it the same flags "
                          f"and package versions (jobs may differ in {', '.join(MAY_DIFFER)})")
        elif member["slot"] in slots:
            other = everyone[slots[member['slot']]]
            leaving[i] = (f"this job ({member['name']!r}) and job {other['name']!r} both read data slot "
                          f"--diloco-x-replica-index {member['slot']}; give every job its own index in "
                          f"[0, --diloco-x-replicas)")
        else:
            slots[member["slot"]] = i
    me = group.rank()
    if me in leaving:
        raise SystemExit(f"megatron-diloco: error: {leaving[me]}. It leaves the run; the others go on.")
    return not leaving
