"""A rank that holds several exchange slots: its shard in segments, each exchanged over its own outer group.

Sites of different data-parallel size exchange the same vectors when each rank's shard is cut into the
*slots* a rank of the largest site holds (:mod:`megatron_diloco.megatron_adapter.exchange_slots`): a rank of a
site of DP d holds k = G / d slots, one after the other in its flat outer state (slot-major). Slot j of this
rank is exchanged with the ranks of the other sites that hold the same slot: over its own outer group. Every
per-element rule of a boundary is unchanged (theta - x, the outer step, the merges); what depends on where a
vector starts restarts at each segment, so that a segment is computed exactly as the one-slot rank of a larger
site computes its whole shard:

* the codecs' blocks (each segment is encoded as a vector of its own, :class:`SlotOutbox`);
* the fingerprints (theta's, agreed at the decision, and the mean's, compared before a commit):
  one per segment, counted from its start (:meth:`Segments.fingerprint_into`).

One segment (k = 1, the shard whole) is the ordinary rank: nothing here is used then.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.exchange import ExchangeHandle, ExchangeStats, Outbox, outer_step
from megatron_diloco.algorithm.shard_view import fingerprint

if TYPE_CHECKING:
    from megatron_diloco.algorithm.exchange import AfterStep
    from megatron_diloco.algorithm.outer import OuterNesterov
    from megatron_diloco.algorithm.outer_store import OuterStore


@dataclasses.dataclass(frozen=True)
class Segments:
    """The k slots of a rank's flat shard: slot j is ``[bounds[j], bounds[j + 1])`` (bounds ``[k + 1]``, from 0
    to N, non-decreasing). Local."""

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(hi < lo for lo, hi in zip(b, b[1:])):
            raise ValueError(f"segment bounds must rise from 0: {b}")

    @classmethod
    def whole(cls, numel: int) -> "Segments":
        return cls((0, int(numel)))

    @property
    def k(self) -> int:
        return len(self.bounds) - 1

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))

    def split(self, lo: int, hi: int) -> list[tuple[int, int, slice]]:
        """The parts of the elements ``[lo, hi)`` per segment, in order: ``(j, its start in segment j, its slice of
        a chunk holding [lo, hi))``."""
        out = []
        for j, (a, b) in enumerate(self.ranges()):
            s, e = max(lo, a), min(hi, b)
            if s < e:
                out.append((j, s - a, slice(s - lo, e - lo)))
        return out

    def fingerprint_into(self, t: torch.Tensor, lo: int, acc: torch.Tensor) -> None:
        """Add the chunk ``t`` (elements ``[lo, lo + len)`` of a flat vector) into ``acc``: int64 ``[2]`` for one
        segment (:func:`fingerprint`), else ``[k, 2]``, one fingerprint per segment counted from its start."""
        if self.k == 1:
            fingerprint([t], start=lo, acc=acc)
            return
        for j, start, part in self.split(lo, lo + t.numel()):
            fingerprint([t[part]], start=start, acc=acc[j])

    def fingerprint(self, store: "OuterStore", tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The fingerprint of flat vectors of ``store`` one after another (theta, m), streamed chunk by chunk:
        int64 ``[2]``; with k segments ``[k, 2]``, segment j's the fingerprint of the segment-j parts of the
        vectors one after another (as a rank holding that slot alone computes it). Local."""
        acc = self.accumulator(device)
        for i, t in enumerate(tensors):  # (vectors of the store: N elements each)
            for lo, _, (c,) in store.stream(t):
                if self.k == 1:
                    fingerprint([c], start=i * t.numel() + lo, acc=acc)
                    continue
                for j, start, part in self.split(lo, lo + c.numel()):
                    fingerprint([c[part]], start=i * (self.bounds[j + 1] - self.bounds[j]) + start, acc=acc[j])
        return acc

    def accumulator(self, device: torch.device) -> torch.Tensor:
        """A zero fingerprint accumulator: int64 ``[2]`` for one segment, ``[k, 2]`` for k."""
        return torch.zeros((2,) if self.k == 1 else (self.k, 2), dtype=torch.int64, device=device)


class SlotOutbox:
    """A round's outgoing pseudo-gradient over k segments: one :class:`Outbox` per segment, each encoding its
    segment as a vector of its own (the codec's blocks start at the segment). Filled chunk by chunk
    (:meth:`put`, chunks that the store never lets straddle a segment's block grid: it restarts its chunks at
    every segment), launched as k collectives, one per slot's outer group (:meth:`launch`)."""

    def __init__(self, codec, segments: Segments, device: torch.device, send: torch.Tensor | None = None) -> None:
        self.codec = codec
        self.segments = segments
        self.parts = [Outbox(codec, hi - lo, device, send=send[lo:hi] if send is not None else None)
                      for lo, hi in segments.ranges()]

    def put(self, lo: int, pseudo_grad: torch.Tensor, residual: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None) -> None:
        """:meth:`Outbox.put` of the chunk at ``lo``, each segment's part into its own outbox."""
        for j, start, cut in self.segments.split(lo, lo + pseudo_grad.numel()):
            self.parts[j].put(start, pseudo_grad[cut], residual[cut] if residual is not None else None,
                              residual_out[cut] if residual_out is not None else None)

    def launch(self, buffer: torch.Tensor, groups: Sequence[dist.ProcessGroup | None], *,
               store: "OuterStore", timeout_s: float | None = None,
               weights: tuple[float, ...] | None = None) -> ExchangeHandle:
        """Launch segment j's collective over ``groups[j]`` (j in order: every rank issues its slots'
        collectives in slot order, so that ranks holding several slots never wait on each other), into
        ``buffer[segment j]``; one handle for all: complete when every one is, its mean the whole buffer.
        ``weights``: the members' (the same members, in the same order, in every slot's group)."""
        if len(groups) != self.segments.k:
            raise ValueError(f"{len(groups)} outer groups for {self.segments.k} exchange slots")
        handles = [part.launch(buffer[lo:hi], group, store=store.part(lo, hi), timeout_s=timeout_s, weights=weights)
                   for part, group, (lo, hi) in zip(self.parts, groups, self.segments.ranges())]
        stats = ExchangeStats(**{f: sum(getattr(h.stats, f) for h in handles)
                                 for f in ("bytes_sent", "bytes_received", "raw_bytes", "payload_bytes")})

        def finish(outer: "OuterNesterov | None", after: "AfterStep | None") -> None:
            for h in handles:  # each segment's mean into its part of the buffer
                h._finish(None, None)
            if outer is not None:  # then one outer step over the whole (elementwise: the same bits)
                outer_step(outer, buffer, store, after)

        handle = ExchangeHandle(buffer, _AllWorks([h._work for h in handles]), stats, finish, store)
        handle.timeout_s = timeout_s
        return handle


class _AllWorks:
    """The k collectives of one exchange as one ``Work``: completed when each is; ``wait`` waits for each (and
    re-raises the first backend error). No future: the exchange's polls time it."""

    def __init__(self, works: list) -> None:
        self.works = [w for w in works if w is not None]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def get_future(self):
        raise NotImplementedError("k collectives: timed by polls")


def check_slot_codec(codec_name: str, k: int) -> None:
    """ValueError when a rank holding ``k`` > 1 slots would run a codec whose exchange is not segment by
    segment (the matrix codecs: low-rank factors over whole parameters)."""
    from megatron_diloco.algorithm.config import CODECS

    if k > 1 and CODECS[codec_name].matrix:
        raise ValueError(f"--diloco-x-compression {codec_name}: a rank holding {k} exchange slots (sites of "
                         "different data-parallel size) exchanges them one by one, which the low-rank codecs "
                         "cannot (their factors span whole parameters); use none or a blockwise codec "
                         "(int8, int4, fp8, int2)")


def all_reduce_over_slots(t: torch.Tensor, op, groups: Sequence[dist.ProcessGroup | None],
                          timeout_s: float | None) -> None:
    """All-reduce the small host tensor ``t`` in place over every slot's outer group (in slot order), for a
    value every member holds once (the members' token counts): each group must deliver the same result, else
    ValueError (a member whose ranks disagree). One group: the plain bounded all-reduce."""
    from megatron_diloco.algorithm.link import bounded_all_reduce

    live = [g for g in groups if g is not None]
    if not live:
        return
    mine = t.clone()
    bounded_all_reduce(t, op, live[0], timeout_s)
    for g in live[1:]:
        other = mine.clone()
        bounded_all_reduce(other, op, g, timeout_s)
        if not torch.equal(other, t):
            raise ValueError(f"the outer groups of this rank's exchange slots disagree: {t.tolist()} and "
                             f"{other.tolist()}")


#: the entries of a heal's state (:meth:`~megatron_diloco.algorithm.federated.FederatedRounds.state_dict`) that
#: are vectors over the rank's shard: a rank holding k slots sends and receives them slot by slot
SHARD_ENTRIES = ("theta", "momentum_buffer", "pending")


def slot_state(state: dict, lo: int, hi: int) -> dict:
    """The part of a heal's ``state`` for the slot ``[lo, hi)``: its shard vectors sliced, the rest as is."""
    return {name: (value[lo:hi] if name in SHARD_ENTRIES and value is not None else value)
            for name, value in state.items()}


#: what every slot's part of a heal must agree on with slot 0's (they come from one member at one boundary); the
#: timings and the measured link may differ between the source's ranks
AGREED_META = ("identity", "position", "rounds", "skipped_rounds", "committed", "tau", "round_steps", "in_boundary")


def joined_state(parts: list[dict]) -> dict:
    """A heal's state from its slots' parts (in slot order): the shard vectors concatenated, the rest slot 0's.
    ValueError (the heal is not taken) when a vector is present in some parts only, or when a part's metadata
    places it at another point of the run than slot 0's (:data:`AGREED_META`)."""
    first = parts[0].get("meta") if isinstance(parts[0].get("meta"), dict) else {}
    for j, part in enumerate(parts[1:], 1):
        meta = part.get("meta") if isinstance(part.get("meta"), dict) else {}
        differ = [name for name in AGREED_META if meta.get(name) != first.get(name)]
        if differ:
            raise ValueError(f"the heal's exchange slot {j} came from another point of the run than slot 0 "
                             f"({', '.join(differ)} differ); not taken")
    out = dict(parts[0])
    for name in SHARD_ENTRIES:
        values = [p.get(name) for p in parts]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise ValueError(f"the heal's {name!r} came for some exchange slots only")
        out[name] = torch.cat(values)
    return out
