"""An in-process model of a slow link between replicas, for machines without ``tc`` (the GPU hosts).

:func:`install` wraps the ``torch.distributed`` collectives. A collective on a process group whose
ranks span more than one replica (a *cross-replica* group) runs for real, then completes no earlier
than its modelled finish time; collectives inside one replica are untouched. Replica of global rank
``g`` = ``g // (world / replicas)``: contiguous blocks, as with ``--use-tp-pp-dp-mapping`` (which
``--diloco-x-replicas`` sets; give it to the ``--no-diloco-x`` baseline too).

The model (per rank; n = group size, B = bytes of the tensor named below)::

    op                                    wire bytes sent per rank   latency hops
    all_reduce(B)                         2 (n-1)/n B                2 (n-1)
    reduce_scatter_tensor(in = B)         (n-1)/n B                  n-1
    all_gather_into_tensor(in = B / n)    (n-1)/n B  = (n-1) in      n-1
    all_gather(list, in)                  (n-1) in                   n-1
    broadcast(B)                          B                          n-1   (pipelined chain)
    (``_reduce_scatter_base`` / ``_all_gather_base`` as their public forms; a coalesced batch of
    ``torch.distributed._coalescing_manager``, as Megatron's DDP buckets issue, is one transfer of the
    sum of its ops' bytes with the latency hops of one op)

    duration = hops x latency + wire bytes / bandwidth
    start    = max(launch time, when this rank's link finished its previous transfer)   (FIFO)
    finish   = start + duration

These are the ring formulas (bytes sent = bytes received), exact for groups with one rank per
replica (every hop of the ring on the slow link: the outer groups of DiLoCoX, and the data-parallel
group of the ``--no-diloco-x`` baseline when each replica is a complete model); for groups with
several ranks per replica every hop is charged at the slow rate (pessimistic). Each rank has its own
full-duplex link of ``bandwidth`` (as in the CPU benchmark: one shaped veth per rank);
``share="replica"`` divides the bandwidth by the ranks per replica instead (one uplink per cluster,
all ranks of a replica sending equal amounts at once). Ranks of one collective are assumed to
launch it at about the same time (the real collective still makes none finish before the last
arrived); point-to-point ops, ``barrier``, ``all_to_all`` and ``reduce_scatter`` (list form) are not
modelled (none crosses replicas in the layouts used here).

Completion:

* synchronous ops (``async_op=False``): the real op, a device synchronization (on CUDA the op is
  only enqueued), then a sleep until ``finish``;
* asynchronous ops: a :class:`LinkWork` whose ``wait()`` waits for the real work, synchronizes the
  device, then sleeps until ``finish`` — so whatever runs between launch and ``wait()`` overlaps the
  modelled transfer, and ``wait()`` from a worker thread blocks only that thread.
* On CUDA the device is synchronized *before* launching, so that ``start`` is when the inputs are
  ready, not when the host (which may run ahead of the GPU) issued the op. Only cross-replica ops pay
  for this.

``bandwidth_mbps=None`` (``inf``) only accounts bytes: no synchronization, no sleeping.

Use::

    from harness.link_model import install
    link = install(bandwidth_mbps=1000, latency_ms=5, replicas=2)   # before or after importing Megatron
    ...
    link.stats()   # per-rank: wire bytes, modelled seconds, waited seconds, per op kind

The harness recorder ``link`` (``harness/recorders/network.py``) installs it from ``BENCH_LINK_*``
environment variables;
``BENCH_LINK_TRACE=1`` also counts the cross-replica ops per call site (``stats()["sites"]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

#: ``torch.distributed`` attributes wrapped: name -> (kind, name of the argument whose bytes count).
WRAPPED: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "_all_gather_base": ("all_gather", "input_tensor"),
    "all_gather": ("all_gather", "tensor"),
    "broadcast": ("broadcast", "tensor"),
}


def ring_cost(kind: str, nbytes: int, n: int) -> tuple[int, int]:
    """``(wire bytes sent per rank, latency hops)`` of one collective over ``n`` ranks.

    ``nbytes``: the all-reduced / broadcast tensor, the reduce-scatter *input*, or the all-gather
    *input* (one rank's piece).
    """
    if n <= 1:
        return 0, 0
    if kind == "all_reduce":
        return 2 * (n - 1) * nbytes // n, 2 * (n - 1)
    if kind == "reduce_scatter":
        return (n - 1) * nbytes // n, n - 1
    if kind == "all_gather":
        return (n - 1) * nbytes, n - 1
    if kind == "broadcast":
        return nbytes, n - 1
    raise ValueError(f"unknown collective kind {kind!r}")


def crosses_replicas(ranks: list[int], ranks_per_replica: int) -> bool:
    """Whether global ``ranks`` lie in more than one replica (contiguous blocks of ranks)."""
    return len({r // ranks_per_replica for r in ranks}) > 1


class Clock:
    """The link's time: ``now()`` (seconds, monotonic), ``sleep(seconds)`` and ``call_later(delay, fn)``
    (``fn`` run on another thread after ``delay``). This one is the wall clock; the tests give
    :class:`ManualClock` where they check elapsed times."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        timer = threading.Timer(delay, fn)
        timer.daemon = True
        timer.start()


class ManualClock(Clock):
    """A clock that only moves when someone sleeps on it: ``sleep(s)`` returns at once, ``s`` later.
    The link's timing is then exact and reproducible on a loaded machine, for callers that use this
    clock for their own waits too, from one thread (two threads sleeping on it would share one time)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._due: list[tuple[float, Callable[[], None]]] = []

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += max(0.0, seconds)
            due = [fn for at, fn in self._due if at <= self._now]
            self._due = [(at, fn) for at, fn in self._due if at > self._now]
        for fn in due:
            fn()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        if delay <= 0:
            fn()
            return
        with self._lock:
            self._due.append((self._now + delay, fn))


@dataclasses.dataclass
class KindStats:
    ops: int = 0
    bytes: int = 0
    modelled_s: float = 0.0


class LinkWork:
    """An asynchronous cross-replica collective: ``wait()`` returns no earlier than the modelled
    finish. Other ``dist.Work`` methods are forwarded to the real work."""

    def __init__(self, work, finish: float, link: "LinkModel", device: torch.device | None) -> None:
        self._work = work
        self._finish = finish
        self._link = link
        self._device = device
        self._done = False
        self._future = None

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - dist.Work signature
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._link._complete(self._finish, self._device)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or ((self._work is None or self._work.is_completed())
                              and self._link.clock.now() >= self._finish)

    def get_future(self) -> torch.futures.Future:
        """A future completed at the modelled finish time (by a timer thread), holding the real
        work's result if it has one."""
        if self._future is None:
            fut = torch.futures.Future()
            self._future = fut

            def fire() -> None:
                if not fut.done():
                    fut.set_result(None)

            self._link.clock.call_later(max(0.0, self._finish - self._link.clock.now()), fire)
        return self._future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class LinkModel:
    """The per-process link state and the wrappers (see the module docstring).

    Args:
        bandwidth_mbps: link rate in Mbit/s (10^6 bit/s); ``None`` or ``inf``: account bytes only.
        latency_ms: one-way latency per ring hop.
        replicas: R; the world is split into R contiguous blocks of ranks.
        share: ``"rank"`` (a link per rank) or ``"replica"`` (one per replica, split evenly).
        clock: the link's time (:class:`Clock`, the wall clock, by default).
    """

    def __init__(self, bandwidth_mbps: float | None, latency_ms: float = 5.0, replicas: int = 2,
                 share: str = "rank", clock: Clock | None = None) -> None:
        if share not in ("rank", "replica"):
            raise ValueError(f"share must be 'rank' or 'replica', got {share!r}")
        if bandwidth_mbps is not None and math.isinf(bandwidth_mbps):
            bandwidth_mbps = None
        if bandwidth_mbps is not None and not bandwidth_mbps > 0:
            raise ValueError(f"bandwidth must be > 0 Mbit/s, got {bandwidth_mbps}")
        self.bandwidth_mbps = bandwidth_mbps
        self.latency_s = latency_ms / 1e3
        self.replicas = replicas
        self.share = share
        self.clock = clock or Clock()
        self._lock = threading.Lock()
        self._link_free = 0.0  # the clock's time at which this rank's link finishes its queue
        self._groups: dict[Any, tuple[int, bool]] = {}  # group -> (size, crosses replicas)
        self._coalescing: dict[Any, list] = {}  # group -> [(kind, wire, hops, device)] pending
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self.kinds: dict[str, KindStats] = {}
        self.bytes_sent = 0
        self.modelled_s = 0.0
        self.waited_s = 0.0
        self.cross_ops = 0
        self.local_ops = 0
        self.untracked_coalesced_ops = 0
        # call site ("file:line in function" of the first frame outside torch and this module)
        # -> [ops, wire bytes] of the cross-replica ops issued there; filled when ``trace`` is on
        self.trace = os.environ.get("BENCH_LINK_TRACE") == "1"
        self.sites: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ topology
    def _ranks_per_replica(self) -> int:
        world = dist.get_world_size()
        if world % self.replicas:
            raise ValueError(f"link model: {self.replicas} replicas do not divide the world size {world}")
        return world // self.replicas

    def _bytes_per_s(self) -> float | None:
        if self.bandwidth_mbps is None:
            return None
        rate = self.bandwidth_mbps * 1e6 / 8
        return rate / self._ranks_per_replica() if self.share == "replica" else rate

    def group_info(self, group) -> tuple[int, bool]:
        """``(size, crosses replicas)`` of ``group`` (``None``: the default group); cached."""
        key = group if group is not None else dist.distributed_c10d._get_default_group()
        info = self._groups.get(key)
        if info is None:
            ranks = dist.get_process_group_ranks(key)
            info = (len(ranks), crosses_replicas(ranks, self._ranks_per_replica()))
            self._groups[key] = info
        return info

    # ------------------------------------------------------------------ time
    def _reserve(self, transfers: list[tuple[str, int, int]]) -> float:
        """Queue one transfer of ``transfers`` (``(kind, wire bytes, hops)``: one op, or a coalesced
        batch sent as one: bytes summed, hops of one op) on this rank's link now; returns its
        modelled finish time."""
        rate = self._bytes_per_s()
        hops = max(h for _, _, h in transfers)
        duration = hops * self.latency_s + sum(w for _, w, _ in transfers) / rate
        with self._lock:
            start = max(self.clock.now(), self._link_free)
            finish = start + duration
            self._link_free = finish
            self.modelled_s += duration
            total = sum(w for _, w, _ in transfers) or 1
            for kind, wire, _ in transfers:  # the batch's time split by bytes
                self.kinds[kind].modelled_s += duration * (wire / total if len(transfers) > 1 else 1.0)
        return finish

    def _complete(self, finish: float, device: torch.device | None) -> None:
        """Block until the real op is done on the device and the modelled finish has passed."""
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        remaining = finish - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)
            with self._lock:
                self.waited_s += remaining

    def _account(self, kind: str, wire: int) -> None:
        site = _call_site() if self.trace else None
        with self._lock:
            s = self.kinds.setdefault(kind, KindStats())
            s.ops += 1
            s.bytes += wire
            self.bytes_sent += wire
            self.cross_ops += 1
            if site is not None:
                entry = self.sites.setdefault(f"{kind} @ {site}", [0, 0])
                entry[0] += 1
                entry[1] += wire

    # ------------------------------------------------------------------ wrappers
    def _wrap(self, name: str, kind: str, tensor_arg: str, original: Callable) -> Callable:
        sig = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            if not dist.is_initialized():
                return original(*args, **kwargs)
            n, crosses = self.group_info(group)
            if not crosses:
                self.local_ops += 1
                return original(*args, **kwargs)
            tensor = bound.arguments[tensor_arg]
            wire, hops = ring_cost(kind, tensor.numel() * tensor.element_size(), n)
            self._account(kind, wire)
            if self._bytes_per_s() is None:  # accounting only
                return original(*args, **kwargs)
            key = group if group is not None else dist.distributed_c10d._get_default_group()
            if key in self._coalescing:  # one transfer at the end of the coalesced batch
                self._coalescing[key].append((kind, wire, hops, tensor.device))
                return original(*args, **kwargs)
            if key in getattr(dist.distributed_c10d._world, "pg_coalesce_state", {}):
                self.untracked_coalesced_ops += 1  # someone else's coalescing manager: bytes only
                return original(*args, **kwargs)
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()  # start = inputs ready
            finish = self._reserve([(kind, wire, hops)])
            work = original(*args, **kwargs)
            if bound.arguments.get("async_op", False):
                return LinkWork(work, finish, self, tensor.device)
            self._complete(finish, tensor.device)
            return work

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__wrapped__ = original
        wrapper._link_model = self
        return wrapper

    def _wrap_coalescing_manager(self, original: Callable) -> Callable:
        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            crosses = dist.is_initialized() and self.group_info(group)[1]
            if not crosses or self._bytes_per_s() is None:
                with original(group, device, async_ops) as cm:
                    yield cm
                return
            key = group if group is not None else dist.distributed_c10d._get_default_group()
            self._coalescing[key] = []
            finish, on = None, None
            try:
                with original(group, device, async_ops) as cm:
                    yield cm
                    # The batch is recorded; the original launches it on exit: start the clock.
                    pending = self._coalescing.pop(key)
                    if pending:
                        on = pending[0][3]
                        if on.type == "cuda":
                            torch.cuda.current_stream(on).synchronize()  # start = inputs ready
                        finish = self._reserve([p[:3] for p in pending])
            finally:
                self._coalescing.pop(key, None)
            if finish is None:
                return
            if async_ops and cm.works:
                cm.works[-1] = LinkWork(cm.works[-1], finish, self, on)
            elif not async_ops:
                self._complete(finish, on)

        coalescing_manager.__wrapped__ = original
        coalescing_manager._link_model = self
        return coalescing_manager

    # ------------------------------------------------------------------ install
    def install(self) -> "LinkModel":
        """Wrap the collectives in ``torch.distributed`` and rebind every imported module's
        reference to an original (``from torch.distributed import X``; Megatron binds
        ``dist_reduce_scatter_func`` at import). Call :meth:`rebind` after importing more modules."""
        for name, (kind, arg) in WRAPPED.items():
            original = getattr(dist, name)
            original = getattr(original, "__wrapped__", original) if hasattr(original, "_link_model") else original
            self._originals[name] = original
            self._wrappers[name] = self._wrap(name, kind, arg, original)
            setattr(dist, name, self._wrappers[name])
        cm = dist._coalescing_manager
        cm = cm.__wrapped__ if hasattr(cm, "_link_model") else cm
        self._originals["_coalescing_manager"] = cm
        self._wrappers["_coalescing_manager"] = self._wrap_coalescing_manager(cm)
        dist._coalescing_manager = self._wrappers["_coalescing_manager"]
        self.rebind()
        return self

    def rebind(self) -> int:
        """Point module attributes that hold an original collective at its wrapper (modules under
        ``torch`` are left alone: c10d compares its own globals internally). Returns the count."""
        return _replace_in_modules({id(f): self._wrappers[n] for n, f in self._originals.items()})

    def uninstall(self) -> None:
        """Restore the originals in ``torch.distributed`` and in every module rebound to them."""
        for name, original in self._originals.items():
            setattr(dist, name, original)
        _replace_in_modules({id(w): self._originals[n] for n, w in self._wrappers.items()})

    # ------------------------------------------------------------------ report
    def counters(self) -> tuple[int, float, float]:
        """``(wire bytes sent, modelled link seconds, seconds slept waiting)`` so far, this rank."""
        return self.bytes_sent, self.modelled_s, self.waited_s

    def stats(self) -> dict:
        """This rank's totals and per-kind figures, and the model's parameters (JSON-ready)."""
        return {
            "bandwidth_mbps": self.bandwidth_mbps, "latency_ms": self.latency_s * 1e3,
            "replicas": self.replicas, "share": self.share,
            "bytes_sent": self.bytes_sent, "modelled_s": self.modelled_s, "waited_s": self.waited_s,
            "cross_ops": self.cross_ops, "local_ops": self.local_ops,
            "untracked_coalesced_ops": self.untracked_coalesced_ops,
            "kinds": {k: dataclasses.asdict(v) for k, v in self.kinds.items()},
            **({"sites": {k: {"ops": o, "bytes": b} for k, (o, b) in self.sites.items()}}
               if self.trace else {}),
        }


def _call_site() -> str:
    """``file:line in function`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and f"{os.sep}torch{os.sep}" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _replace_in_modules(by_id: dict[int, Callable]) -> int:
    """In every imported module outside ``torch``, replace attributes whose value has an id in
    ``by_id`` by the mapped function. Returns how many were replaced."""
    count = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name == "torch" or mod_name.startswith("torch."):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            if id(value) in by_id and callable(value):
                setattr(mod, attr, by_id[id(value)])
                count += 1
    return count


_INSTALLED: LinkModel | None = None


def install(bandwidth_mbps: float | None, latency_ms: float = 5.0, replicas: int = 2,
            share: str = "rank", clock: Clock | None = None) -> LinkModel:
    """Install one process-wide :class:`LinkModel` (replacing a previous one) and return it."""
    global _INSTALLED
    if _INSTALLED is not None:
        _INSTALLED.uninstall()
    _INSTALLED = LinkModel(bandwidth_mbps, latency_ms, replicas, share, clock).install()
    return _INSTALLED


def installed() -> LinkModel | None:
    """The process-wide link model, if one is installed."""
    return _INSTALLED
