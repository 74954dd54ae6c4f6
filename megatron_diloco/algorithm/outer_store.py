"""Where the outer state lives (``--diloco-x-outer-state``), and how a boundary reaches it.

The outer state of :class:`megatron_diloco.algorithm.sync.OuterSync` (theta, the outer momentum, the
error-feedback residual, the eager anchor, the partial launch point) is flat fp32 ``[N]`` vectors
over the rank's shard. :class:`OuterStore` allocates them and runs every pass of a boundary over
them with :meth:`OuterStore.stream`:

* ``gpu`` (default): the vectors live on the device; ``stream`` yields **one** chunk, ``[0, N)``,
  holding the tensors themselves (no copy). The boundary's arithmetic is then exactly the
  whole-shard arithmetic.
* ``cpu``: the vectors live in host memory (pinned when CUDA is available); ``stream`` yields
  fixed-size chunks ``[lo, hi)`` (``--diloco-x-outer-chunk-mb``), each tensor staged in a device
  buffer: read tensors copied in (host to device), written ones copied back after the chunk's
  compute. Three staging slots rotate and the copies run on two side CUDA streams (in and out),
  so chunk k+1 arrives and chunk k-1 leaves while chunk k is computed. The work is *submitted* in
  the order a single hardware queue needs (``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron sets,
  dispatches every stream's work in submission order, and a wait at the head stalls what follows):
  after chunk k's compute come chunk k+2's copy in, then chunk k's copy out (which waits for the
  compute), then chunk k+1's compute; so a copy out never holds back the next compute or the next
  copy in. On a machine without CUDA the same chunking runs with synchronous copies (the tests
  exercise it).

All arithmetic runs on the compute device in both layouts, on the same elements with the same
operations, so the results are bit-identical (every operation of a boundary is elementwise, or
blockwise over blocks of 256 that chunk boundaries never split; the chunk size is a multiple of
:data:`CHUNK_ALIGN`). Tensors not allocated by the store (the model's shards, the exchange's device
buffers) are used in place, as views ``[lo, hi)``.

Device memory of the ``cpu`` layout: 3 slots x (tensors in the widest pass, at most 5) x chunk
bytes, whatever the model size (16 MiB chunks: at most 240 MiB).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Sequence

import torch

#: chunk boundaries fall on multiples of this many elements: the blockwise codecs' block (256
#: elements per scale, compression.reference.DEFAULT_BLOCK_SIZE; int4 packs pairs within a block)
CHUNK_ALIGN = 256
#: staging slots per tensor: chunk k is computed while k + 1 is copied in and k - 1 copied out
SLOTS = 3


def pinned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``[numel]`` host tensor of ``dtype`` (default fp32), page-locked when CUDA is available (so
    that the staging copies are asynchronous DMA). Pinned by ``cudaHostRegister`` of an ordinary
    allocation, exactly its size (``pin_memory=True`` goes through PyTorch's caching host allocator,
    which rounds a block up to the next power of two: up to 2x the host memory for a multi-GB shard);
    unregistered when the tensor is collected."""
    t = torch.empty(numel, dtype=dtype)
    if numel and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def chunk_elements(chunk_mb: float) -> int:
    """Elements per chunk for ``--diloco-x-outer-chunk-mb``: fp32 elements in ``chunk_mb`` MiB,
    rounded down to a multiple of :data:`CHUNK_ALIGN` (at least one block)."""
    n = int(chunk_mb * (1 << 20)) // 4
    return max(CHUNK_ALIGN, n // CHUNK_ALIGN * CHUNK_ALIGN)


class OuterStore:
    """Allocates the outer-state vectors of one rank's shard and streams them through the device.

    Args:
        numel: N, elements of the rank's flat shard.
        device: the compute device (the shards' device).
        on_host: ``--diloco-x-outer-state host``: keep the vectors in host memory.
        chunk: elements per chunk when ``on_host`` (:func:`chunk_elements`).
    """

    def __init__(self, numel: int, device: torch.device, on_host: bool = False, chunk: int = 1 << 22,
                 segments: Sequence[int] | None = None) -> None:
        if chunk <= 0 or chunk % CHUNK_ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {CHUNK_ALIGN} elements, got {chunk}")
        self.numel = numel
        self.device = torch.device(device)
        self.on_host = on_host
        self.chunk = chunk
        #: the bounds of the shard's exchange slots (``[k + 1]``; None: one): host chunks restart at each, so
        #: that a chunk never splits a block of a segment's codec
        self.segments = tuple(segments) if segments is not None else (0, numel)
        self._held: set[int] = set()  # storage data_ptr of the host-held vectors (their slices are held too)
        self._staging: dict[tuple[int, int], torch.Tensor] = {}  # (slot, position) -> (chunk,) fp32
        self._cuda = self.device.type == "cuda"
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if (
            on_host and self._cuda) else None  # (host to device, device to host)

    # ---------------- allocation ----------------
    def empty(self, held: bool = True) -> torch.Tensor:
        """A new fp32 ``[N]`` vector: in host memory when the store is ``on_host`` and ``held``
        (pinned where CUDA is available), else on the device."""
        if self.on_host and held:
            t = pinned_empty(self.numel)
            self._held.add(t.untyped_storage().data_ptr())
            return t
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    def zeros(self, held: bool = True) -> torch.Tensor:
        return self.empty(held).zero_()

    def held(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` is one of this store's host-held vectors (staged by :meth:`stream`)."""
        return t is not None and self.on_host and t.untyped_storage().data_ptr() in self._held

    def host_bytes(self) -> int:
        """Bytes of the host-held vectors."""
        return 4 * self.numel * len(self._held)

    def staging_bytes(self) -> int:
        """Device bytes of the staging buffers allocated so far."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    # ---------------- streaming ----------------
    def _buffer(self, slot: int, position: int, n: int) -> torch.Tensor:
        buf = self._staging.get((slot, position))
        if buf is None or buf.numel() < n:
            buf = self._staging[(slot, position)] = torch.empty(
                min(self.chunk, self.numel), dtype=torch.float32, device=self.device)
        return buf[:n]

    def ranges(self) -> list[tuple[int, int]]:
        """The chunks ``[lo, hi)`` :meth:`stream` visits, in order."""
        if not self.on_host or self.numel == 0:
            return [(0, self.numel)]
        return [(lo, min(lo + self.chunk, b)) for a, b in zip(self.segments, self.segments[1:])
                for lo in range(a, b, self.chunk)]

    def part(self, lo: int, hi: int) -> "OuterStore":
        """The store of the elements ``[lo, hi)`` (an exchange slot's segment): the same layout, its slices
        of this store's host-held vectors held, its staging buffers shared with this store (one pass at a
        time). Local."""
        if (lo, hi) == (0, self.numel):
            return self
        part = OuterStore.__new__(OuterStore)
        part.numel, part.segments = hi - lo, (0, hi - lo)
        part.device, part.on_host, part.chunk, part._cuda = self.device, self.on_host, self.chunk, self._cuda
        # shared with this store: which vectors are held (a slice of one is too), the staging buffers, the streams
        part._held, part._staging, part._streams = self._held, self._staging, self._streams
        return part

    def stream(self, *tensors: torch.Tensor | None, write: Sequence[torch.Tensor | None] = (),
               scratch: Sequence[torch.Tensor | None] = ()) -> Iterator[tuple[int, int, list]]:
        """Visit the shard chunk by chunk: yields ``(lo, hi, staged)``, ``staged[i]`` the device
        tensor ``(hi - lo,)`` standing for ``tensors[i][lo:hi]`` (None for a None entry).

        Every tensor the body uses is listed in ``tensors``. Those also in ``write`` are copied back
        into the host after the body of the chunk ran; those in ``scratch`` are not copied in (a
        device work area; in both ``write`` and ``scratch``: write-only, the body must fill it); the
        rest are read only. Tensors the store does not hold (device tensors) are passed as views,
        read and written in place. Local: no communication. The host copies are complete when the
        iteration ends (one host sync per pass on CUDA)."""
        ranges = self.ranges()
        if len(ranges) == 1 and ranges[0] == (0, self.numel) and not any(self.held(t) for t in tensors):
            yield 0, self.numel, list(tensors)  # everything on the device: the tensors themselves
            return
        is_write = [any(t is w for w in write) for t in tensors]
        is_scratch = [any(t is s for s in scratch) for t in tensors]
        held = [self.held(t) for t in tensors]
        cuda = self._cuda and self._streams is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        h2d, d2h = self._streams if cuda else (None, None)
        freed: list = [None] * SLOTS  # per slot: event after the last use of its buffers (compute + copy out)

        def stage_in(k: int) -> tuple[list, object]:
            lo, hi = ranges[k]
            slot = k % SLOTS
            staged = []
            ctx = torch.cuda.stream(h2d) if cuda else contextlib.nullcontext()
            with ctx:
                if cuda and freed[slot] is not None:
                    h2d.wait_event(freed[slot])
                for i, t in enumerate(tensors):
                    if t is None:
                        staged.append(None)
                    elif not held[i]:
                        staged.append(t[lo:hi])
                    else:
                        buf = self._buffer(slot, i, hi - lo)
                        if not is_scratch[i]:
                            buf.copy_(t[lo:hi], non_blocking=True)
                        staged.append(buf)
            ready = None
            if cuda:
                ready = torch.cuda.Event()
                ready.record(h2d)
            return staged, ready

        def stage_out(k: int, staged: list, done) -> None:
            lo, hi = ranges[k]
            ctx = torch.cuda.stream(d2h) if cuda else contextlib.nullcontext()
            with ctx:
                if cuda:
                    d2h.wait_event(done)
                for i, t in enumerate(tensors):
                    if held[i] and is_write[i]:
                        t[lo:hi].copy_(staged[i], non_blocking=True)
            if cuda:
                freed[k % SLOTS] = torch.cuda.Event()
                freed[k % SLOTS].record(d2h)

        pending = {k: stage_in(k) for k in range(min(SLOTS - 1, len(ranges)))}
        for k, (lo, hi) in enumerate(ranges):
            staged, ready = pending.pop(k)
            if cuda:
                compute.wait_event(ready)
            yield lo, hi, staged
            done = None
            if cuda:
                done = torch.cuda.Event()
                done.record(compute)
            if k + SLOTS - 1 < len(ranges):  # the slot of chunk k - 1, whose copy out was submitted before
                pending[k + SLOTS - 1] = stage_in(k + SLOTS - 1)
            stage_out(k, staged, done)
        if cuda:
            d2h.synchronize()  # the host vectors hold the results before anyone reads them
            compute.wait_stream(d2h)
            compute.wait_stream(h2d)
