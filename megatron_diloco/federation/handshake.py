"""What the jobs of a run must agree on, checked whenever the members change.

Each job describes itself once (:func:`megatron_diloco.megatron_adapter.handshake.describe_launch`:
the flags that decide the exchange's bytes, the outer step, the round schedule, the data split and
the shards, the package versions; plus the run's name, ``--diloco-x-run``). At a meeting whose
members changed, each rank of each member sends, over its outer group, in two bounded all-gathers of
raw bytes (never a pickle):

1. a **hello**: JSON of its description's digest and the description, its progress, data slot, name and
   a fresh random nonce, sealed with the run's key (:mod:`megatron_diloco.federation.auth`) and bound to
   the quorum and its position in it;
2. a **verdict**: which hellos verified, sealed and bound to the digest of all hellos (the transcript,
   fresh through the nonces), so a hello replayed by a process without the secret cannot be confirmed.

A member whose hello or verdict does not verify with this run's key is refused before anything it sent
is read. The job that finds itself outnumbered by members it cannot verify (or tied with them at its
first meeting) is the one with the wrong secret: it leaves (SystemExit naming ``--diloco-x-secret-file``);
the others meet again without it. Among the verified members the reference is the most advanced (ties:
the first in the quorum's order); a member whose description differs from the reference's, or that
holds a data slot (``--diloco-x-replica-index``) a more advanced member holds, leaves the run (SystemExit
naming the flag); every other member meets again without it. Every verified rank reads the same
messages, so they all reach the same verdict.

Every round, before its commit, the members also agree that they landed the same mean
(:func:`means_agree`: its fingerprint, sealed and bound to the quorum, the round and the sender).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.link import wait_within
from megatron_diloco.federation.auth import FLAG, AuthenticationError, RunKey, dump_json
from megatron_diloco.algorithm.description import JOBS_MAY_DIFFER, MAY_DIFFER, differences

logger = logging.getLogger(__name__)

RUN = "--diloco-x-run"
#: the largest handshake message accepted (a description is a few kB, plus ~40 B per rank of the job)
MAX_MESSAGE_BYTES = 16 << 20


@dataclasses.dataclass
class Agreement:
    """The outcome of :func:`agree`, the same on every verified member."""

    ok: bool
    """Every member is verified and agrees (False: meet again without the ones that leave)."""
    source: int | None = None
    """The most advanced member (the heal's source) when some member is behind it, else None."""
    source_url: str = ""
    """Where rank k of the source offers its state (its heal server)."""
    source_progress: int = 0
    behind: tuple[int, ...] = ()
    """The members behind the source (they heal from it)."""


class HandshakeBroken(RuntimeError):
    """The meeting's group broke during the handshake (a member died or froze past the bound): meet again."""


def identity(description: dict[str, Any]) -> str:
    """A digest of ``description`` (what a healing peer's state is checked against)."""
    return hashlib.sha256(dump_json(description)).hexdigest()[:32]


def gather_bytes(group: dist.ProcessGroup, data: bytes, deadline: float) -> list[bytes]:
    """Every member's ``data`` (collective over ``group``, gloo, blocking but not past ``deadline``, a
    ``time.perf_counter()`` value): the lengths (int64), then the bytes padded to the longest (uint8,
    at most :data:`MAX_MESSAGE_BYTES`; longer messages arrive cut, and fail to verify). Raises
    :class:`HandshakeBroken` when a collective fails or the deadline passes."""
    size = dist.get_world_size(group)
    try:
        mine = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        wait_within(dist.all_gather(lengths, mine, group=group, async_op=True), deadline)
        claimed = [int(t.item()) for t in lengths]
        width = max(1, min(max(claimed), MAX_MESSAGE_BYTES))
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[:min(len(data), width)] = torch.frombuffer(bytearray(data[:width]), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
        wait_within(dist.all_gather(out, buf, group=group, async_op=True), deadline)
    except (RuntimeError, TimeoutError) as err:
        raise HandshakeBroken(f"the handshake's group broke ({err})") from err
    return [out[i][:max(0, min(claimed[i], width))].numpy().tobytes() for i in range(size)]


def _valid_hello(hello: Any) -> bool:
    """The hello's schema (a verified hello that does not follow it is refused like an unverified one)."""
    return (isinstance(hello, dict) and isinstance(hello.get("identity"), str) and
            isinstance(hello.get("description"), dict) and isinstance(hello.get("progress"), int) and
            hello["progress"] >= 0 and isinstance(hello.get("slot"), int) and
            isinstance(hello.get("name"), str) and len(hello["name"]) <= 256 and
            isinstance(hello.get("heal_url"), str) and len(hello["heal_url"]) <= 512)


def agree(group: dist.ProcessGroup, key: RunKey, quorum: int, progress: int, description: dict[str, Any],
          slot: int, name: str, heal_url: str, first_meeting: bool, timeout_s: float,
          fresh_start_heals: bool = False) -> Agreement:
    """Compare this job with every member of ``group`` (module doc; two all-gathers over it, bounded by
    ``timeout_s``). ``heal_url``: where this rank offers its state when it is the heal's source.
    ``fresh_start_heals``: when every member is at progress 0 (a run starting), the members after the reference
    heal from it all the same (sites of different layouts initialize different weights). Returns
    the :class:`Agreement` (not ok when a member is refused or differs: it leaves; meet again); raises
    SystemExit when this job is the one to leave, and :class:`HandshakeBroken` when the group breaks."""
    size = dist.get_world_size(group)
    if size <= 1:
        return Agreement(True)
    me = group.rank()
    deadline = time.perf_counter() + timeout_s
    at = lambda i: {"quorum": int(quorum), "member": i, "members": size}  # noqa: E731
    hello = {"identity": identity(description), "description": description, "progress": int(progress),
             "slot": int(slot), "name": name, "heal_url": heal_url, "nonce": secrets.token_hex(16)}
    blobs = gather_bytes(group, key.seal("hello", at(me), dump_json(hello)), deadline)
    everyone: list[dict | None] = []
    for i, blob in enumerate(blobs):
        try:
            got = key.open_json("hello", at(i), blob)
            everyone.append(got if _valid_hello(got) else None)
        except AuthenticationError:
            everyone.append(None)
    transcript = hashlib.sha256(b"".join(len(b).to_bytes(8, "little") + b for b in blobs)).hexdigest()
    seen = [h is not None for h in everyone]
    confirms = gather_bytes(group, key.seal("verdict", {**at(me), "transcript": transcript},
                                            dump_json({"verified": seen})), deadline)
    for i, blob in enumerate(confirms):
        try:
            key.open("verdict", {**at(i), "transcript": transcript}, blob)
        except AuthenticationError:
            everyone[i] = None  # a hello nobody fresh confirms: a replay, or a process without the secret
    refused = [i for i in range(size) if everyone[i] is None]
    verified = size - len(refused)
    if refused:
        if verified < len(refused) or (verified == len(refused) and first_meeting):
            raise SystemExit(
                f"megatron-diloco: error: this job ({name!r}, key id {key.key_id}) cannot verify {len(refused)} of "
                f"the {size - 1} other jobs it met: its {FLAG} or {RUN} differs from the run's. Give every job "
                "a copy of the same secret file and the same run name. It leaves the run; the others go on.")
        logger.warning("DiLoCoX: refused %d member%s of quorum %d (position%s %s): %s; meeting again without them",
                       len(refused), "s" if len(refused) > 1 else "", quorum, "s" if len(refused) > 1 else "",
                       ", ".join(map(str, refused)), f"their messages do not verify with this run's {FLAG}")
    ok_members = [i for i in range(size) if everyone[i] is not None]
    order = sorted(ok_members, key=lambda i: (-everyone[i]["progress"], i))
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
                          f"and package versions (jobs may differ in {', '.join(MAY_DIFFER + JOBS_MAY_DIFFER)})")
        elif member["slot"] in slots:
            other = everyone[slots[member['slot']]]
            leaving[i] = (f"this job ({member['name']!r}) and job {other['name']!r} both read data slot "
                          f"--diloco-x-replica-index {member['slot']}; give every job its own index in "
                          f"[0, --diloco-x-replicas)")
        else:
            slots[member["slot"]] = i
    if me in leaving:
        raise SystemExit(f"megatron-diloco: error: {leaving[me]}. It leaves the run; the others go on.")
    if leaving or refused:
        return Agreement(False)
    behind = tuple(i for i in order if everyone[i]["progress"] < ref["progress"])
    if fresh_start_heals and ref["progress"] == 0:  # (order: the most advanced first, so all are at 0)
        behind = tuple(order[1:])
    if not behind:
        return Agreement(True)
    return Agreement(True, order[0], ref["heal_url"], ref["progress"], behind)


def means_agree(group: dist.ProcessGroup, key: RunKey, quorum: int, round_: int, mean: bytes,
                timeout_s: float) -> tuple[bool, str]:
    """Whether every member of ``group`` landed the same mean for round ``round_`` (collective over
    ``group``, one bounded all-gather of raw bytes): each member sends the digest of the mean it is about to
    apply (``mean``, a few bytes), sealed with the run's key and bound to the quorum, the round and its
    position. Returns ``(True, "")``, or ``(False, why)`` when a member's digest does not verify (a process
    without the secret, a replay, corrupted bytes) or differs from this one's (a payload altered or
    corrupted on its way to some members, or a faulty member): the round is then not committed, here or
    (every member reads the same messages) anywhere. Raises :class:`HandshakeBroken` when the group breaks."""
    size = dist.get_world_size(group)
    if size <= 1:
        return True, ""
    me = group.rank()
    at = lambda i: {"quorum": int(quorum), "round": int(round_), "member": i, "members": size}  # noqa: E731
    blobs = gather_bytes(group, key.seal("mean", at(me), dump_json({"mean": mean.hex()})),
                         time.perf_counter() + timeout_s)
    unverified, differ = [], []
    for i, blob in enumerate(blobs):
        try:
            got = key.open_json("mean", at(i), blob)
        except AuthenticationError:
            unverified.append(i)
            continue
        if not isinstance(got, dict) or got.get("mean") != mean.hex():
            differ.append(i)
    if not unverified and not differ:
        return True, ""
    parts = []
    if unverified:
        parts.append(f"the digest of member{'s' if len(unverified) > 1 else ''} {', '.join(map(str, unverified))} "
                     f"does not verify with this run's {FLAG}")
    if differ:
        parts.append(f"member{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} landed another mean "
                     "than this one (a payload altered or corrupted on its way, or a faulty member)")
    return False, "; ".join(parts)
