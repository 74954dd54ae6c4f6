"""Exchange by name: sites of different tensor / pipeline / data parallelism exchange the same vectors.

Megatron's distributed checkpoint names every model tensor by a key and a global shape that do not depend on the
parallel layout (``sharded_state_dict``: a :class:`ShardedTensor` per parameter, with the local tensor's offset in
the global one; stacked layers carry the layer as a prepended axis). The **canonical vector** is every trained
parameter's global tensor, flattened row-major, concatenated in key order: N elements, the same at any TP / PP /
DP. It is cut into G **chunks** (chunk c is ``[c N // G, (c + 1) N // G)``); rank r of a site of W ranks (its whole
world, any layout, W dividing G) holds the chunks ``r k .. r k + k - 1`` (k = G / W), one contiguous canonical
range, in a **staging** buffer (fp32, on the main shards' device). The outer state lives over the staging buffer,
so chunk c is the same vector on its holder at every site.

- :meth:`ByName.pull`: staging <- the fp32 main shards. Every canonical element comes from the one rank that owns
  it (its main shard holds it and Megatron marks its copy as the main replica: tensor-parallel replicated norms and
  a tied output layer have other copies). One ``all_to_all_single`` over the site's world group.
- :meth:`ByName.push`: main shards <- staging, to every rank whose main shard holds the element (every copy).

A main shard is a contiguous range of its parameter's local (tensor-parallel) block, or of the blocks Megatron's
checkpoint cuts it into (a factory: ``--swiglu``'s fused gate and up projection is two blocks of one global tensor,
:func:`param_parts`); in the global tensor a block is rows of equal length at a fixed stride, so a shard is at most
three **segments** per block (a partial row, full rows, a partial row), cut again where a rank's staging range ends.
A segment is one strided copy on each side.

Collectives: :class:`ByName` construction (an all-gather of the site's key tables and segments, objects within the
job: nothing crosses to another job), :meth:`pull` and :meth:`push` (``all_to_all_single``, tensors), all over
the site's world group. Memory: the staging buffer (about a main shard's size) and, during a pull or push, a send
and a receive buffer of at most :data:`PIECE_ELEMENTS` fp32 elements (a larger shard moves in several all-to-alls).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_diloco.megatron_adapter.exchange_slots import ExchangePlan


#: the elements one pull or push moves from a rank in one all-to-all, over all its peers (64 Mi: 256 MB send and
#: receive buffers); more takes several all-to-alls
PIECE_ELEMENTS = 1 << 26


@dataclasses.dataclass(frozen=True)
class Segment:
    """``rows x cols`` elements of a main shard, contiguous in it from element ``lo``, at canonical index
    ``canon + i stride + j`` (row i, column j). ``owned``: this copy is the one a pull reads."""

    main: int
    lo: int
    canon: int
    rows: int
    cols: int
    stride: int
    owned: bool

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def wire(self) -> tuple[int, int, int, int, int]:
        """What the staging side needs: (canon, rows, cols, stride, owned)."""
        return self.canon, self.rows, self.cols, self.stride, int(self.owned)


def _row_pieces(rows: int, cols: int, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """Elements ``[a, b)`` of a row-major ``rows x cols`` block as at most three pieces ``(row, nrows, c0, c1)``:
    a partial row, whole rows, a partial row."""
    if a >= b:
        return []
    (r0, c0), (r1, c1) = divmod(a, cols), divmod(b, cols)
    if r0 == r1:
        return [(r0, 1, c0, c1)]
    out = []
    if c0:
        out.append((r0, 1, c0, cols))
        r0 += 1
    if r1 > r0:
        out.append((r0, r1 - r0, 0, cols))
    if c1:
        out.append((r1, 1, 0, c1))
    return out


def _split(seg: Segment, at: int) -> list[Segment]:
    """``seg`` cut at canonical index ``at`` (pieces before it, then from it), each a segment."""
    row, col = divmod(at - seg.canon, seg.stride)
    cut = row * seg.cols + min(col, seg.cols)  # elements of seg before ``at`` (a cut between rows: whole rows)
    if not 0 < cut < seg.numel:
        return [seg]
    return [dataclasses.replace(seg, lo=seg.lo + r * seg.cols + c0, canon=seg.canon + r * seg.stride + c0, rows=n,
                                cols=c1 - c0, stride=seg.stride if n > 1 else c1 - c0)
            for a, b in ((0, cut), (cut, seg.numel)) for r, n, c0, c1 in _row_pieces(seg.rows, seg.cols, a, b)]


def segments_of(main: int, start: int, length: int, canon0: int, row_len: int, stride: int,
                owned: bool, shard_lo: int = 0) -> list[Segment]:
    """The segments of a main shard ``main`` holding elements ``[start, start + length)`` of a local block whose
    flat element i sits at canonical ``canon0 + (i // row_len) stride + i % row_len``, the first of them at element
    ``shard_lo`` of the shard."""
    out, i, end = [], start, start + length
    while i < end:
        r, c = divmod(i, row_len)
        if c or end - i < row_len:  # a partial row
            n = min(row_len - c, end - i)
            out.append(Segment(main, shard_lo + i - start, canon0 + r * stride + c, 1, n, n, owned))
        else:  # whole rows
            n = (end - i) // row_len
            out.append(Segment(main, shard_lo + i - start, canon0 + r * stride, n, row_len,
                               stride if n > 1 else row_len, owned))
            n *= row_len
        i += n
    return out


def block_rows(local_shape: tuple[int, ...], global_shape: tuple[int, ...],
               global_offset: tuple[int, ...]) -> tuple[int, int, int]:
    """A local block ``local_shape`` at ``global_offset`` in a row-major ``global_shape`` tensor (all of the same
    rank) as rows: ``(base, row_len, stride)``, flat local element i at global ``base + (i // row_len) stride +
    i % row_len``. ValueError if the block is cut along more than one axis of more than one element."""
    cut = [a for a, (l, g) in enumerate(zip(local_shape, global_shape)) if l != g]
    inner_cut = [a for a in cut if local_shape[a] > 1]
    if len(inner_cut) > 1:
        raise ValueError(f"exchange by name: a local block {local_shape} of {global_shape} is cut along more than "
                         "one axis")
    k = max(cut, default=-1)  # rows below axis k are whole: a row spans axes k..
    inner = math.prod(global_shape[k + 1:])
    row_len = local_shape[k] * inner if k >= 0 else math.prod(global_shape)
    stride = global_shape[k] * inner if k >= 0 else row_len
    strides = [math.prod(global_shape[a + 1:]) for a in range(len(global_shape))]
    base = sum(o * s for o, s in zip(global_offset, strides))
    if inner_cut and inner_cut[0] < k:
        raise ValueError(f"exchange by name: a local block {local_shape} of {global_shape} is cut along an outer axis")
    return base, row_len, stride


def _sharded_tensors(sd, out: list) -> list:
    """Every ShardedTensor (or factory) of a nested sharded state dict, in order."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sd, dict):
        for v in sd.values():
            _sharded_tensors(v, out)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            _sharded_tensors(v, out)
    elif isinstance(sd, (ShardedTensor, ShardedTensorFactory)):
        out.append(sd)
    return out


def _main_replica(replica_id) -> bool:
    """Whether Megatron's ``replica_id`` marks the main copy of a tensor across TP / PP (its last entry, the
    data-parallel one, is left out: the distributed optimizer's shards split the data-parallel copies)."""
    ids = tuple(replica_id) if isinstance(replica_id, (tuple, list)) else (replica_id,)
    return all(int(i) == 0 for i in ids[:-1]) if len(ids) > 1 else True


def model_chunks(dist_opts: list) -> list:
    """The model chunks of Megatron's distributed optimizers ``dist_opts``, each once, in order."""
    seen, out = set(), []
    for d in dist_opts:
        for chunk in d.model_chunks:
            if id(chunk) not in seen:
                seen.add(id(chunk))
                out.append(chunk)
    return out


@dataclasses.dataclass(frozen=True)
class Part:
    """Elements ``[start, start + numel)`` of a parameter's local tensor (flattened): one tensor of Megatron's
    sharded state dict, the block ``local`` at ``offset`` of the global tensor ``key`` of shape ``shape`` (as many
    axes as ``shape``: prepended ones included); ``owned``: this copy is the main one."""

    start: int
    numel: int
    key: str
    shape: tuple[int, ...]
    local: tuple[int, ...]
    offset: tuple[int, ...]
    owned: bool


def _part(st, start: int) -> Part:
    key = st.key
    while key.startswith("module."):  # (a precision wrapper's prefix: the same tensor in an fp32 model)
        key = key[len("module."):]
    local = (1,) * st.prepend_axis_num + tuple(st.local_shape)
    return Part(start, math.prod(local), key, tuple(st.global_shape), local, tuple(st.global_offset),
                _main_replica(st.replica_id))


def param_parts(model_chunks: list) -> dict[int, list[Part]]:
    """Each parameter of ``model_chunks`` that Megatron's sharded state dict names: ``id(param)`` -> its
    :class:`Part` s, in order, covering it. One, or for a parameter saved through a factory (``--swiglu``'s fused
    gate and up projections: two blocks of one global tensor) one per tensor the factory builds, each a contiguous
    view of the parameter. ValueError for a factory whose tensors are not (a layout this cannot reshard)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    params = {id(p): p for chunk in model_chunks for p in chunk.parameters()}
    by_ptr = {(p.data_ptr(), p.numel()): p for p in params.values() if p.numel()}
    out: dict[int, list[Part]] = {}
    for chunk in model_chunks:
        for st in _sharded_tensors(chunk.sharded_state_dict(), []):
            data = st.data
            p = by_ptr.get((data.data_ptr(), data.numel())) if isinstance(data, torch.Tensor) and data.numel() else None
            if p is None or st.flattened_range is not None:
                continue
            if not isinstance(st, ShardedTensorFactory):
                out[id(p)] = [_part(st, 0)]
                continue
            parts = []
            for sub in _sharded_tensors(st.build(), []):
                t = sub.data
                at, rest = divmod(t.data_ptr() - p.data_ptr(), p.element_size())
                if isinstance(sub, ShardedTensorFactory) or not t.is_contiguous() or rest or sub.flattened_range:
                    raise ValueError(f"exchange by name: parameter {st.key!r} is saved through a factory whose "
                                     "tensors are not contiguous pieces of it; sites of different layout cannot "
                                     "exchange it by name")
                parts.append(_part(sub, at))
            parts.sort(key=lambda q: q.start)
            if [q.start for q in parts] != [0, *(q.start + q.numel for q in parts[:-1])] or \
                    parts[-1].start + parts[-1].numel != p.numel():
                raise ValueError(f"exchange by name: the tensors Megatron saves parameter {st.key!r} as do not "
                                 "cover it once")
            out[id(p)] = parts
    return out


class ByName:
    """One rank's part of the exchange by name (module doc): its staging buffer and the plans of :meth:`pull` and
    :meth:`push`.

    Args:
        model_chunks: the job's model chunks on this rank (Megatron's, as the distributed optimizers hold them).
        ranges: :func:`~megatron_diloco.megatron_adapter.exchange_slots.main_ranges` of this rank.
        shards: its fp32 main shards in the same order (ShardView order).
        chunks: G, the run's number of chunks: a multiple of the site's world size.
        group: the site's world group (every rank of the job); None: the default group.
    """

    def __init__(self, model_chunks: list, ranges: list, shards: list[torch.Tensor], chunks: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if chunks < self.world or chunks % self.world:
            raise ValueError(f"exchange by name: {chunks} chunks are not a multiple of this site's world size "
                             f"{self.world} (every job of the run gives the same count, a multiple of each site's)")
        self.shards = shards
        self.device = shards[0].device if shards else torch.device("cpu")
        names = param_parts(model_chunks)
        mine = []  # (main shard, its range, a part of its parameter)
        for i, r in enumerate(ranges):
            if id(r.param) not in names:
                raise ValueError("exchange by name: a trained parameter of shape "
                                 f"{tuple(r.param.shape)} has no name in Megatron's sharded state dict")
            mine += [(i, r, part) for part in names[id(r.param)]]
        tables: list = [None] * self.world
        dist.all_gather_object(tables, sorted({(q.key, q.shape) for _, _, q in mine}), group=group)
        shapes: dict[str, tuple[int, ...]] = {}
        for key, shape in (entry for table in tables for entry in table):
            if shapes.setdefault(key, tuple(shape)) != tuple(shape):
                raise ValueError(f"exchange by name: {key!r} has global shapes {shapes[key]} and {tuple(shape)}")
        #: (key, global shape) in canonical order: what the sites' handshake compares
        self.table = tuple(sorted(shapes.items()))
        offsets, n = {}, 0
        for key, shape in self.table:
            offsets[key], n = n, n + math.prod(shape)
        self.numel_total, self.chunks = n, chunks
        per = chunks // self.world
        #: canonical ``[lo, hi)`` of each rank's staging (rank r: chunks r k .. r k + k - 1)
        self.rank_ranges = [(r * per * n // chunks, (r + 1) * per * n // chunks) for r in range(self.world)]
        self.lo, self.hi = self.rank_ranges[self.rank]
        self._starts = [lo for lo, _ in self.rank_ranges]
        #: the chunks of this rank, each ``[lo, hi)`` in canonical indices
        self.chunk_ranges = [(c * n // chunks, (c + 1) * n // chunks)
                             for c in range(self.rank * per, (self.rank + 1) * per)]
        self.staging = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=self.device)
        segs = []
        for i, r, q in mine:  # the part's elements in the shard: [a, b) of the parameter
            a, b = max(r.param_start, q.start), min(r.param_start + r.end - r.start, q.start + q.numel)
            if a < b:
                base, row_len, stride = block_rows(q.local, q.shape, q.offset)
                segs += segments_of(i, a - q.start, b - a, offsets[q.key] + base, row_len, stride, q.owned,
                                    a - r.param_start)
        for cut, _ in self.rank_ranges[1:]:
            segs = [piece for s in segs for piece in _split(s, cut)]
        #: this rank's segments by the rank whose staging holds them
        self.out: list[list[Segment]] = [[] for _ in range(self.world)]
        for s in segs:
            self.out[self._holder(s.canon)].append(s)
        wires: list = [None] * self.world
        dist.all_gather_object(wires, [[s.wire() for s in to] for to in self.out], group=group)
        #: per source rank, the (canon, rows, cols, stride, owned) of its segments this rank's staging holds
        self.inc = [[tuple(w) for w in wires[src][self.rank]] for src in range(self.world)]
        #: elements a pull or push moves per peer in one all-to-all (its buffers: world x this x 4 B at most)
        self.piece = max(1, PIECE_ELEMENTS // self.world)
        streams = [[sum(w[1] * w[2] for w in to if w[4] or not owned_only) for src in wires for to in src]
                   for owned_only in (True, False)]
        #: the longest stream between two ranks of a pull and of a push (every rank runs as many all-to-alls)
        self._longest = tuple(max(lens, default=0) for lens in streams)
        # the views each transfer reads and writes, per peer, built once (the shards and the staging stay put)
        local = [[self._local(s).view(s.rows, s.cols) for s in to] for to in self.out]
        staged = [[self._staged(*w[:4]) for w in src] for src in self.inc]
        self._pull_views = ([[v for v, s in zip(views, to) if s.owned] for views, to in zip(local, self.out)],
                            [[v for v, w in zip(views, src) if w[4]] for views, src in zip(staged, self.inc)])
        self._push_views = (staged, local)
        owned_total = sum(w[1] * w[2] for src in wires for to in src for w in to if w[4])
        got = sum(w[1] * w[2] for src in self.inc for w in src if w[4])
        if owned_total != n or got != self.hi - self.lo:
            raise ValueError(f"exchange by name: the site's main copies cover {owned_total} of {n} canonical elements "
                             f"(this rank's staging {got} of {self.hi - self.lo}): a parameter is held twice or not "
                             "at all as Megatron marks its copies")

    def plan(self) -> "ExchangePlan":
        """This rank's part in the run as exchange slots (one per chunk): the staging's chunk views, the chunks'
        indices as the run's virtual ranks (G of them, the same on every site) and, per chunk, its canonical range
        (the handshake compares them with the key table, :meth:`digest`)."""
        from megatron_diloco.megatron_adapter.exchange_slots import ExchangePlan

        per = self.chunks // self.world
        bounds = [0]
        for a, b in self.chunk_ranges:
            bounds.append(bounds[-1] + b - a)
        return ExchangePlan(self.chunk_views(), tuple(bounds), tuple(range(self.rank * per, (self.rank + 1) * per)),
                            self.chunks, [[((self.numel_total,), a, b - a)] for a, b in self.chunk_ranges])

    def _holder(self, canon: int) -> int:
        """The rank whose staging holds canonical element ``canon``."""
        return bisect.bisect_right(self._starts, canon) - 1

    def digest(self) -> str:
        """The key table and G, as the handshake compares them: equal on every site of a run that can exchange by
        name (its elements and tensors, read by a user, and a sha256 of the whole)."""
        h = hashlib.sha256(json.dumps([self.chunks, [[k, list(s)] for k, s in self.table]]).encode()).hexdigest()
        return f"{self.numel_total} elements in {len(self.table)} tensors (sha256 {h[:16]})"

    def chunk_views(self) -> list[torch.Tensor]:
        """Views of :attr:`staging`, one per chunk of this rank, in order."""
        return [self.staging[a - self.lo:b - self.lo] for a, b in self.chunk_ranges]

    def _staged(self, canon: int, rows: int, cols: int, stride: int) -> torch.Tensor:
        return self.staging.as_strided((rows, cols), (stride, 1), self.staging.storage_offset() + canon - self.lo)

    def _local(self, s: Segment) -> torch.Tensor:
        return self.shards[s.main].detach().view(-1)[s.lo:s.lo + s.numel]

    def pull(self) -> None:
        """staging <- the main shards (each canonical element from its owner). Collective over the site's group."""
        self._transfer(*self._pull_views, self._longest[0])

    def push(self) -> None:
        """main shards <- staging (every copy of each element). Collective over the site's group."""
        self._transfer(*self._push_views, self._longest[1])

    def _transfer(self, send: list[list[torch.Tensor]], recv: list[list[torch.Tensor]], longest: int) -> None:
        """Move each peer's stream (``send[p]``: the 2-D views whose elements, row-major, in order, go to peer p;
        ``recv[p]``: where those of peer p land) in all-to-alls of at most :attr:`piece` elements per peer each, as
        many as the site's ``longest`` stream needs (the same on every rank): the buffers stay bounded."""
        lengths = [[sum(v.numel() for v in views) for views in side] for side in (send, recv)]
        for r in range(-(-longest // self.piece)):
            a = r * self.piece
            spans = [[(min(a, n), min(a + self.piece, n)) for n in side] for side in lengths]
            out = [v for views, (lo, hi) in zip(send, spans[0]) for v in _stream_range(views, lo, hi)]
            buf = torch.cat([v.reshape(-1) for v in out]) if out else torch.zeros(0, device=self.device)
            got = torch.empty(sum(hi - lo for lo, hi in spans[1]), dtype=torch.float32, device=self.device)
            if self.world == 1:
                got.copy_(buf)
            else:
                dist.all_to_all_single(got, buf, [hi - lo for lo, hi in spans[1]], [hi - lo for lo, hi in spans[0]],
                                       group=self.group)
            pos = 0
            for views, (lo, hi) in zip(recv, spans[1]):
                for v in _stream_range(views, lo, hi):
                    v.copy_(got[pos:pos + v.numel()].view_as(v))
                    pos += v.numel()


def _stream_range(views: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Views of elements ``[lo, hi)`` of the stream that is ``views`` (2-D, each read row-major) one after the
    other: per view it cuts, at most a partial row, whole rows and a partial row."""
    out, start = [], 0
    for v in views:
        rows, cols = v.shape
        a, b = max(lo, start) - start, min(hi, start + rows * cols) - start
        start += rows * cols
        out += [v[r:r + n, c0:c1] for r, n, c0, c1 in _row_pieces(rows, cols, a, b)]
    return out
