"""The pseudo-gradient exchange over the outer group, with byte and time accounting.

The outer group holds R ranks, one per replica, that own the same parameter shard. One entry point,
:func:`start_exchange`, launches a round's exchange for every codec of
:data:`megatron_diloco.algorithm.config.CODECS`; how the payload crosses the group follows the codec's entry
there:

* ``all-reduce`` (``none``): one asynchronous fp32 all-reduce (SUM, then a division by R that every
  rank does identically), so every replica receives the same bits;
* ``all-gather`` (blockwise ``int8``/``int4``/``fp8``/``int2``): encode with error feedback, one
  asynchronous all-gather of the payloads, every rank decodes the R payloads in replica order;
* ``matrix`` codecs (low-rank, adaptive: several dependent collectives per round) run the codec's
  own ``exchange`` on a worker thread (:class:`megatron_diloco.algorithm.worker.DaemonWorker`).

The returned :class:`ExchangeHandle` is completed with :meth:`~ExchangeHandle.wait` (the mean in the
buffer) or :meth:`~ExchangeHandle.apply` (straight into the outer step, fused with the decode where
the codec has a fused kernel).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.config import CODECS
from megatron_diloco.algorithm.link import host_copy, wait_within, wire_bytes
from megatron_diloco.algorithm.outer_store import OuterStore
from megatron_diloco.algorithm.worker import DaemonWorker, ThreadWork, worker_lane

if TYPE_CHECKING:
    from megatron_diloco.algorithm.outer import OuterNesterov


@dataclasses.dataclass
class ExchangeStats:
    """What one exchange cost this rank."""

    bytes_sent: int = 0
    """Bytes this rank put on the outer link (ring all-reduce: 2 (R-1)/R x payload)."""
    bytes_received: int = 0
    """Bytes this rank took off the outer link (same as sent for an all-reduce)."""
    raw_bytes: int = 0
    """Bytes the uncompressed fp32 pseudo-gradient shard would occupy (4 N): compression ratio =
    raw_bytes / payload_bytes."""
    payload_bytes: int = 0
    """Bytes of this rank's encoded payload (4 N without compression)."""
    input_sq: float = 0.0
    """Lossy codecs: squared norm of what was encoded (pseudo-gradient + residual), this rank's shard."""
    residual_sq: float = 0.0
    """Lossy codecs: squared norm of what was not sent (the new residual), this rank's shard."""
    exchange_s: float = 0.0
    """Wall time from launch until the collective completed (the link time, overlapped or not)."""
    exposed_s: float = 0.0
    """Wall time the training loop waited for it (the part not hidden under compute)."""


@dataclasses.dataclass
class AfterStep:
    """Work fused into the outer step's pass over the shard (one pass instead of two: with the host
    layout, theta crosses PCIe once). ``fn(lo, hi, theta, extra)`` runs after the step of each chunk
    ``[lo, hi)``: ``theta`` the new theta's chunk (on the device), ``extra`` the chunks of
    ``tensors`` (read only: staged in, never copied back)."""

    tensors: list[torch.Tensor]
    fn: Callable[[int, int, torch.Tensor, list[torch.Tensor]], None]


def step_chunks(outer: OuterNesterov, store: "OuterStore", lead: Sequence[torch.Tensor],
                step: Callable[[int, int, list[torch.Tensor], OuterNesterov], None],
                after: AfterStep | None = None) -> None:
    """The outer step's pass: chunk by chunk through ``store``, ``step(lo, hi, lead_chunks,
    outer_over_chunk)`` (``lead``: tensors the step reads first, e.g. the mean), then ``after``.
    theta and m are copied back where the store holds them; nothing else is."""
    state = outer.tensors()
    extra = after.tensors if after is not None else []
    n, k = len(lead), len(state)
    for lo, hi, staged in store.stream(*lead, *state, *extra, write=state):
        st = staged[n:n + k]
        step(lo, hi, staged[:n], outer.over(st))
        if after is not None:
            after.fn(lo, hi, st[0], staged[n + k:])


class ExchangeHandle:
    """An exchange in flight. :meth:`wait` blocks until the averaged result is in ``buffer``;
    :meth:`apply` until it entered the outer step.

    Args:
        finish: ``finish(outer, after)`` turns what the collective delivered into the replicas' mean
            (divide an all-reduce sum by R, or decode gathered payloads): into ``buffer`` when
            ``outer`` is None, else straight into ``outer.step`` (``buffer`` is then scratch),
            followed per chunk by ``after`` (:class:`AfterStep`; None: nothing). Runs once.
    """

    def __init__(self, buffer: torch.Tensor, work, stats: ExchangeStats,
                 finish: Callable[[OuterNesterov | None, AfterStep | None], None],
                 store: "OuterStore | None" = None, on_device: bool = False) -> None:
        self.buffer = buffer
        self.store = store  # where ``buffer`` and the outer state live (None: on the device, whole)
        self.stats = stats
        self._work = work
        self._finish = finish
        self._launched = time.perf_counter()
        #: when the collective completed: the midpoint between the last :meth:`poll` that saw it running
        #: and the first that saw it completed (a worker thread stamps its own)
        self._done_at: float | None = None
        self._running_at = self._launched  # the last time it was seen still running
        self._finished = False
        #: restored from a checkpoint (:meth:`completed`): no exchange ran in this process, so its
        #: (empty) stats are no measurement of the link
        self.restored = False
        #: seconds after its launch by which the exchange must have completed (None: unbounded); set
        #: by the launcher (:class:`megatron_diloco.algorithm.sync.OuterSync`: --diloco-x-outer-timeout-minutes)
        self.timeout_s: float | None = None
        #: 1-based round whose pseudo-gradient this exchange carries (set by the launcher; 0: unknown)
        self.round = 0
        if work is not None and not on_device:
            # a collective on host tensors (gloo) completes its future when it completes: the exact
            # time; one on the device (NCCL) completes it at the enqueue, so there only polls tell
            try:
                work.get_future().then(self._mark_done)
            except (RuntimeError, NotImplementedError):  # no future: the polls tell
                pass

    @classmethod
    def completed(cls, buffer: torch.Tensor, store: "OuterStore | None" = None) -> "ExchangeHandle":
        """A handle whose averaged result is already in ``buffer`` (restored from a checkpoint)."""
        handle = cls(buffer, None, ExchangeStats(), lambda outer, after: None, store)
        handle._finished = True
        handle.restored = True
        return handle

    def _mark_done(self, _future) -> None:  # the backend's completion thread
        if self._done_at is None:
            self._done_at = time.perf_counter()

    def poll(self) -> bool:
        """Whether the collective has completed; the first call that sees it completed stamps its
        completion time (:attr:`ExchangeStats.exchange_s`): the midpoint between the last call that
        saw it running and this one. Non-blocking: ``Work.is_completed()`` (NCCL: a query of the
        collective's end event, no device sync). Called twice per inner step while the exchange is in
        flight (:meth:`megatron_diloco.algorithm.sync.OuterSync.poll`: before and after the inner
        optimizer step) and throughout a wait, so an exchange is timed to within half a step, on every
        backend alike.

        A collective on host tensors (gloo) is timed by its future instead, which completes when the
        collective does (the exact time; the polls then only confirm it). Not one on the device: NCCL
        completes the future when the collective is *enqueued* (torch: it "does not wait for the entire
        operation to complete on GPU"), so a future timed every NCCL exchange as ~0 s and auto tau fell
        to 1 on GPUs."""
        if self._work is None or self._done_at is not None:
            return True
        now = time.perf_counter()
        if not self._work.is_completed():
            self._running_at = now
            return False
        self._done_at = 0.5 * (self._running_at + now)  # completed in between: off by half the gap at most
        return True

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def elapsed_s(self) -> float:
        """Seconds since the launch."""
        return time.perf_counter() - self._launched

    def _wait_collective(self) -> None:
        """Block until the collective completed (bounded by :attr:`timeout_s`); record the times.

        The host waits for the collective itself (polling its completion), never for the stream of
        the caller: the exposed time is the time the collective kept the training loop waiting, and
        the kernels queued before the wait keep running meanwhile."""
        t0 = time.perf_counter()
        if self._work is not None:
            wait_within(self._work, None if self.timeout_s is None else self._launched + self.timeout_s,
                        is_done=self.poll)
        t1 = time.perf_counter()
        self.stats.exposed_s = t1 - t0
        # no collective (one replica): it completed at its launch, not when it is waited for (auto tau,
        # sized by this duration, would otherwise keep asking for the steps it last waited)
        done = self._done_at if self._done_at is not None else self._launched
        self.stats.exchange_s = done - self._launched
        self._work = None

    def wait(self) -> torch.Tensor:
        """Block until the exchange completed; return ``buffer`` holding the replicas' mean (fp32).

        With :attr:`timeout_s` set, raises ``TimeoutError`` once ``timeout_s`` seconds have passed
        since the launch without completion (the handle stays unfinished); the backend's own error
        (e.g. a peer's closed connection) propagates as raised. Idempotent: a second call returns the
        same buffer without communicating.
        """
        if not self._finished:
            self._wait_collective()
            self._finish(None, None)
            self._finished = True
        return self.buffer

    def apply(self, outer: OuterNesterov, after: AfterStep | None = None) -> None:
        """Wait as :meth:`wait` does, then take the outer step with the mean: ``outer.step(mean)``,
        fused with the decode where the codec has a fused kernel (blockwise codecs on a GPU: one pass
        over the payloads, theta and momentum; the mean is never written, ``buffer`` is left as
        scratch), and ``after`` fused into the same pass. Bit-identical to ``outer.step(self.wait())``
        followed by ``after`` over the shard. Once per handle."""
        if self._finished:  # the mean is already in the buffer (waited for, or restored)
            outer_step(outer, self.buffer, self.store, after)
        else:
            self._wait_collective()
            self._finish(outer, after)
        self._finished = True


def outer_step(outer: OuterNesterov, avg: torch.Tensor, store: "OuterStore | None" = None,
               after: AfterStep | None = None) -> None:
    """``outer.step(avg)`` (then ``after``), chunk by chunk through ``store`` when it keeps the outer
    state (or ``avg``) in host memory; ``avg`` is scratch (garbage afterwards where it is on the
    device)."""
    step_chunks(outer, store or OuterStore(avg.numel(), avg.device), [avg],
                lambda lo, hi, lead, o: o.step(lead[0]), after)


class Outbox:
    """One round's outgoing pseudo-gradient, filled chunk by chunk (:meth:`put`), then sent as one
    asynchronous collective (:meth:`launch`): how :func:`start_exchange` and
    :class:`megatron_diloco.algorithm.sync.OuterSync` (which streams its outer state through the device,
    :class:`megatron_diloco.algorithm.outer_store.OuterStore`) launch the single-collective codecs.

    Device memory: the exchange's payload only: ``none``, the fp32 ``[N]`` all-reduce buffer
    (``send``, or allocated; none when ``send`` is held in host memory by the store, all-reduced
    over gloo); blockwise codecs, the encoded ``[P]`` payload (and, with R > 1, the ``[R, P]``
    all-gather output at the launch).

    Args:
        codec: a ``none`` or blockwise codec (matrix codecs run on the worker: :func:`start_exchange`).
        numel: N, elements of the shard. device: the compute device.
        send: ``none``: the device buffer to all-reduce in place (None: allocated).
    """

    def __init__(self, codec, numel: int, device: torch.device, send: torch.Tensor | None = None) -> None:
        self.codec = codec
        self.numel = numel
        self.device = device
        self.all_reduce = CODECS[codec.name].collective == "all-reduce"
        self.payload: torch.Tensor | None = None  # blockwise: uint8 [P]
        self.send = None
        if self.all_reduce:
            self.send = send if send is not None else torch.empty(numel, dtype=torch.float32, device=device)

    def put(self, lo: int, pseudo_grad: torch.Tensor, residual: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None) -> None:
        """Add the chunk ``[lo, lo + len)`` of the pseudo-gradient (fp32, on the device): copied into
        the all-reduce buffer (nothing when it is that buffer's view), or encoded with error feedback
        into the payload (``residual``: that chunk of e, updated in place, or e_new written into
        ``residual_out``, which may be ``pseudo_grad`` itself: each element is read before it is
        written). Chunks start on blocks of the codec (:data:`megatron_diloco.algorithm.outer_store.CHUNK_ALIGN`)."""
        hi = lo + pseudo_grad.numel()
        if self.all_reduce:
            dst = self.send[lo:hi]
            if dst.numel() and dst.data_ptr() != pseudo_grad.data_ptr():
                dst.copy_(pseudo_grad)
            return
        if self.payload is None and not (lo == 0 and hi == self.numel):
            self.payload = torch.zeros(self.codec.payload_bytes(self.numel), dtype=torch.uint8,
                                       device=self.device)  # (P,)
        self.payload = self.codec.encode_into(self.payload, self.numel, lo, residual, pseudo_grad, residual_out)

    def launch(self, buffer: torch.Tensor, group: dist.ProcessGroup | None, *, store: "OuterStore | None" = None,
               timeout_s: float | None = None, weights: tuple[float, ...] | None = None) -> ExchangeHandle:
        """Start the collective over ``group`` (collective: every rank of it calls this, in the same
        order, for the same N). ``buffer``: fp32 ``[N]`` where :meth:`ExchangeHandle.wait` puts the
        replicas' mean (the all-reduce buffer itself for ``none``; may be host-held by ``store``).
        ``weights``: the members' weights (:func:`start_exchange`; None: equal)."""
        size = dist.get_world_size(group) if group is not None else 1
        if weights is not None and len(weights) != size:
            raise ValueError(f"{len(weights)} weights for an outer group of {size}")
        if self.all_reduce:
            own = weights[group.rank()] if weights is not None and size > 1 else 1.0
            handle = _start_all_reduce(self.send, buffer, group, size, store, own)
        else:
            handle = _start_all_gather(buffer, self.payload, self.codec, group, size, store, weights)
        handle.timeout_s = timeout_s
        return handle


def start_exchange(buffer: torch.Tensor, residual: torch.Tensor | None, codec, group: dist.ProcessGroup | None,
                   *, worker: "DaemonWorker | None" = None, timeout_s: float | None = None,
                   outbox: Outbox | None = None, store: "OuterStore | None" = None,
                   weights: tuple[float, ...] | None = None) -> ExchangeHandle:
    """Launch one round's exchange of ``buffer`` with ``codec`` over ``group`` (the outer group).

    Args:
        buffer: fp32 ``[N]`` pseudo-gradient shard; holds the replicas' mean once
            :meth:`ExchangeHandle.wait` returns (or feeds the outer step: :meth:`ExchangeHandle.apply`).
            Nothing else may touch it until then.
        residual: fp32 ``[N]`` error-feedback residual of this replica (lossy codecs), updated in place
            by the encode (``e <- v - dequant(payload)``); ``None`` for ``none``.
        codec: the object :func:`megatron_diloco.algorithm.compression.get_codec` built; its registry entry
            (:data:`megatron_diloco.algorithm.config.CODECS`) decides the collective (see the module doc).
        group: the outer group (R ranks, one per replica); collective over it: every rank of the
            group calls this, in the same order, with a buffer of the same size. ``None`` or a group of
            one rank: no communication (one replica). For a matrix codec on GPU tensors it must be a
            **gloo** group (the host mirror of the outer group, made by ``megatron_diloco.install()``).
        worker: the :class:`DaemonWorker` that runs matrix codecs' exchanges (required for them;
            one thread, exchanges in order); unused by the others.
        timeout_s: the exchange must complete within it from now (None: unbounded); bounds
            :meth:`ExchangeHandle.wait` and, for matrix codecs, the worker's own collectives.
        outbox: single-collective codecs: the round's :class:`Outbox`, already filled chunk by chunk
            (the pseudo-gradient is then not read from ``buffer``, which only receives the mean);
            None: ``buffer`` (on the device) is put whole.
        store: where ``buffer`` and the outer state live (:class:`OuterStore`; None: on the device).
        weights: per member of ``group`` (in its rank order), fp32 values w_r with mean 1 (separate jobs
            weigh each replica by the tokens it trained on: w_r = R t_r / sum t); the result is then
            ``(1/R) sum_r w_r delta_r``. ``none`` scales this rank's own ``buffer`` by its weight before the
            all-reduce (in place); the blockwise codecs scale the gathered payloads' block scales
            (:meth:`BlockwiseCodec.weigh`). None: equal weights (the plain mean, no extra pass). Not with
            the matrix codecs.

    No payload is ever re-quantized: each replica's payload is gathered as encoded and every rank
    decodes the R payloads in replica order, so all ranks compute the same bits.
    """
    spec = CODECS[codec.name]
    size = dist.get_world_size(group) if group is not None else 1
    if spec.matrix:
        if worker is None:
            raise ValueError(f"--diloco-x-compression {codec.name}: its exchange runs on a worker thread; "
                             "pass worker=DaemonWorker()")
        if weights is not None:
            raise ValueError(f"--diloco-x-compression {codec.name}: weighted exchanges take none or a blockwise "
                             "codec")
        handle = _start_on_worker(buffer, residual, codec, group, size, worker, timeout_s)
    else:
        if outbox is None:
            outbox = Outbox(codec, buffer.numel(), buffer.device, send=buffer)
            outbox.put(0, buffer, residual)
        return outbox.launch(buffer, group, store=store, timeout_s=timeout_s, weights=weights)
    handle.timeout_s = timeout_s
    return handle


def _start_all_reduce(send: torch.Tensor, buffer: torch.Tensor, group, size: int,
                      store: "OuterStore | None", weight: float = 1.0) -> ExchangeHandle:
    """fp32 all-reduce (SUM) of ``send`` in place, asynchronous; the mean is the sum / R, into
    ``buffer`` (:meth:`ExchangeHandle.wait`) or straight into the outer step, chunk by chunk through
    ``store``. ``send`` is on the device, or (a gloo group) may be held in host memory by ``store``:
    the collective then runs on it in place and the finish streams it through the device. ``weight``:
    this rank's (fp32), ``send`` scaled by it first (one pass; none when it is 1)."""
    if weight != 1.0:
        send.mul_(weight)
    payload = send.numel() * send.element_size()
    wire = wire_bytes("all-reduce", payload, size)
    stats = ExchangeStats(bytes_sent=wire, bytes_received=wire, raw_bytes=payload, payload_bytes=payload)
    staged = host_copy(send, group)  # GPU tensor over a gloo group: its host copy crosses
    work = dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group, async_op=True) if size > 1 else None
    store = store or OuterStore(send.numel(), send.device)

    def finish(outer: OuterNesterov | None, after: AfterStep | None) -> None:
        if staged is not send:
            send.copy_(staged, non_blocking=True)  # enqueued (page-locked source): no stall
        if outer is None:
            if buffer is send:  # the mean in place (on the device, or streamed through it when held)
                for _, _, (s,) in store.stream(send, write=[send]):
                    if size > 1:
                        s.div_(size)
                return
            for _, _, (s, b) in store.stream(send, buffer, write=[buffer], scratch=[buffer]):
                if size > 1:
                    s.div_(size)
                b.copy_(s)
            return

        def step(lo: int, hi: int, lead: list[torch.Tensor], o: OuterNesterov) -> None:
            if size > 1:
                lead[0].div_(size)
            o.step(lead[0])

        step_chunks(outer, store, [send], step, after)

    return ExchangeHandle(buffer, work, stats, finish, store, on_device=staged.is_cuda)


def _start_all_gather(buffer: torch.Tensor, payload: torch.Tensor, codec, group, size: int,
                      store: "OuterStore | None", weights: tuple[float, ...] | None = None) -> ExchangeHandle:
    """Asynchronous all-gather of the encoded ``payload`` (uint8 ``[P]``, device); the finish weighs the
    R payloads (``weights``, :meth:`BlockwiseCodec.weigh`; None: equal) and decodes them in replica order,
    into ``buffer`` or fused with the outer step, chunk by chunk through ``store``."""
    numel = buffer.numel()
    wire = wire_bytes("all-gather", payload.numel(), size)
    stats = ExchangeStats(bytes_sent=wire, bytes_received=wire, raw_bytes=4 * numel,
                          payload_bytes=payload.numel())
    work = None
    if size > 1:
        gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=payload.device)  # (R*P,)
        staged_in, staged_out = host_copy(payload, group), host_copy(gathered, group, copy=False)
        work = dist.all_gather_into_tensor(staged_out, staged_in, group=group, async_op=True)
    else:  # one replica: its own payload is the gathered one
        gathered = staged_out = payload
    store = store or OuterStore(numel, buffer.device)

    def finish(outer: OuterNesterov | None, after: AfterStep | None) -> None:
        if staged_out is not gathered:
            gathered.copy_(staged_out, non_blocking=True)  # enqueued (page-locked source): no stall
        rows = gathered.view(size, -1)
        if weights is not None:
            codec.weigh(rows, numel, weights)
        if outer is None:
            for lo, hi, (b,) in store.stream(buffer, write=[buffer], scratch=[buffer]):
                codec.decode_range(rows, numel, lo, hi, out=b)
            return
        step_chunks(outer, store, [], lambda lo, hi, lead, o: codec.decode_range(rows, numel, lo, hi, outer=o),
                    after)

    return ExchangeHandle(buffer, work, stats, finish, store, on_device=staged_out.is_cuda)


def _start_on_worker(buffer: torch.Tensor, residual: torch.Tensor, codec, group, size: int,
                     executor: "DaemonWorker", timeout_s: float | None) -> ExchangeHandle:
    """Run a matrix codec's exchange (low-rank, adaptive) on ``executor``'s one worker thread.

    The low-rank exchange needs two dependent all-gathers (P, then Q, with compute in between), so
    it cannot be one asynchronous collective; the worker runs ``codec.exchange`` while the training
    loop computes (gloo and NCCL release the GIL). Only the worker touches ``buffer``, ``residual``
    and the group until the handle completes. The worker also measures what the codec left in the
    residual (``stats.residual_sq``), so that completing the handle needs no host sync of the
    training stream.

    On a GPU (the worker's :class:`WorkerLane`): the worker thread's current device is the
    buffer's (never device 0 by default, which would give it a CUDA context there); every kernel
    and copy of the exchange goes to the worker's own stream, which starts after the work the
    training stream has queued so far (an event: ``wait_stream``); the worker waits for its stream
    only (events), never for the device; before it completes the handle, its stream is drained (also
    when the exchange raised), so the training loop may reuse ``buffer`` and ``residual`` at once,
    and :meth:`ThreadWork.wait` orders the caller's stream after the worker's event.

    GPU tensors travel as host copies over ``group``, which must be gloo (the host mirror of
    :func:`megatron_diloco.megatron_adapter.topology.host_mirror_of_outer_groups`): the worker copies each payload
    into page-locked host memory (:func:`host_copy`: asynchronous DMA on its stream, then a wait on it),
    all-gathers it there and copies the result back asynchronously, so it never enqueues a GPU
    kernel that waits for another rank (a worker-thread NCCL collective can deadlock against the
    training loop's own NCCL kernels; seen on 2 x H200).

    ``timeout_s`` bounds the worker itself too: its collectives are issued asynchronously and polled
    from Python (:func:`wait_within`) up to the same deadline, so a worker whose peer stopped
    answering gives up (``TimeoutError`` in the handle) instead of blocking inside the backend, where
    a wake-up during interpreter exit (a peer's closed connection) could abort the process (Python
    < 3.14 ends such threads with pthread_exit).
    """
    via_host = buffer.is_cuda  # GPU tensors travel as host copies over the gloo group
    if via_host and size > 1 and dist.get_backend(group) != "gloo":
        raise ValueError(f"--diloco-x-compression {codec.name}: tensors on a GPU need a gloo group (the host mirror of "
                         "the outer group that megatron_diloco.install() creates), got backend "
                         f"{dist.get_backend(group)!r}")
    stats = ExchangeStats(raw_bytes=4 * buffer.numel())

    def finish(outer: OuterNesterov | None, after: AfterStep | None) -> None:  # the worker decoded into the buffer
        if outer is not None:
            outer_step(outer, buffer, None, after)

    handle = ExchangeHandle(buffer, None, stats, finish)
    deadline = None if timeout_s is None else handle._launched + timeout_s
    lane = worker_lane(executor, buffer.device) if buffer.is_cuda else None

    def allgather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if size == 1:
            return t.unsqueeze(0)
        if lane is None:  # host tensors: gathered where they are
            out = torch.empty(size * t.numel(), dtype=t.dtype)  # (R*k,)
            wait_within(dist.all_gather_into_tensor(out, t, group=group, async_op=True), deadline)
            return out.view(size, -1)
        out = torch.empty(size, t.numel(), dtype=t.dtype, device=t.device)  # (R, k)
        send = host_copy(t, group)  # (k,) pinned; the copy waited for on this thread's (the worker's) stream
        recv = host_copy(out, group, copy=False)  # (R, k) pinned
        wait_within(dist.all_gather_into_tensor(recv.view(-1), send, group=group, async_op=True), deadline)
        out.copy_(recv, non_blocking=True)  # enqueued on the worker stream; recv's block is kept until it ran
        return out

    def agree(t: torch.Tensor) -> torch.Tensor:  # the policy's small CPU tensors, over the gloo group
        if size > 1:
            wait_within(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), deadline)
        return t

    done = None
    if lane is not None:
        lane.stream.wait_stream(torch.cuda.current_stream(buffer.device))  # inputs ready
        done = torch.cuda.Event()  # this exchange's last work on the worker stream

    def exchange() -> None:
        kwargs = {"agree": agree} if hasattr(codec, "policy") else {}
        codec.exchange(residual, allgather, pseudo_grad=buffer, out=buffer, **kwargs)
        if residual is not None:  # what was not sent, measured here (a sync of this stream only)
            stats.residual_sq = float(torch.dot(residual, residual))

    def run() -> None:
        with torch.no_grad():
            if lane is None:
                exchange()
            else:
                torch.cuda.set_device(lane.device)  # this thread's device (idempotent)
                try:
                    with torch.cuda.stream(lane.stream):
                        exchange()
                finally:  # drained (also after a failure) before buffer and residual are the
                    lane.sync(done)  # training loop's again
        payload = codec.payload_bytes()
        stats.payload_bytes = payload
        stats.bytes_sent = stats.bytes_received = (size - 1) * payload
        handle._done_at = time.perf_counter()

    handle._work = ThreadWork(executor.submit(run), done, buffer.device)
    return handle
