"""The worker thread of the matrix codecs' exchanges: :class:`DaemonWorker` (one daemon thread, jobs in
order), its per-device :class:`WorkerLane` (own CUDA stream) and :class:`ThreadWork` (a ``dist.Work``-like
view of a job). The exchange run on it is :func:`megatron_diloco.algorithm.exchange.start_exchange`'s.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import time
import weakref

import torch


class ThreadWork:
    """A ``dist.Work``-like view of an exchange running on a worker thread.

    ``done``: on a GPU, the event the worker recorded on its stream after its last kernel (None on
    the CPU). :meth:`wait` makes the caller's current stream wait for it, as an NCCL ``Work.wait()``
    does: device-side ordering, no host sync (the worker synchronized the event itself before
    completing the future, so the wait costs nothing on the device either).
    """

    def __init__(self, future: concurrent.futures.Future, done: "torch.cuda.Event | None" = None,
                 device: torch.device | None = None) -> None:
        self._future = future
        self._done = done
        self._device = device

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()  # re-raises the worker's exception, if any
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)

    def get_future(self):
        raise NotImplementedError  # completion time is recorded by the worker itself


def _run_jobs(jobs: "queue.SimpleQueue") -> None:
    """The loop of a :class:`DaemonWorker` thread (holds the queue only, not the worker)."""
    while (job := jobs.get()) is not None:
        future, fn = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the future
            future.set_exception(err)


#: the live :class:`DaemonWorker` threads and their job queues, stopped at interpreter exit
_LIVE_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # {Thread: SimpleQueue}
#: how long interpreter exit waits for the workers to stop (s, all together)
EXIT_JOIN_S = 2.0


@atexit.register
def stop_workers_at_exit() -> None:
    """At interpreter exit (atexit runs before finalization starts), stop every idle worker the way
    ``ThreadPoolExecutor`` does, so that none is left for the finalizing interpreter (seen on a GPU:
    processes whose idle daemon worker had run CUDA work ended with SIGABRT, "terminate called
    without an active exception", after a successful run). A worker still busy after
    :data:`EXIT_JOIN_S` (stuck: the run is failing) is left behind, a daemon, and does not hold the
    process. Idempotent: :func:`megatron_diloco.megatron_adapter.integration.destroy_process_groups_at_exit` calls it
    before it destroys the groups the workers talk over."""
    workers = list(_LIVE_WORKERS.items())
    for _, jobs in workers:
        jobs.put(None)
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread, _ in workers:
        thread.join(max(0.0, deadline - time.monotonic()))


class DaemonWorker:
    """One **daemon** thread running submitted callables in order: the ``submit`` of
    ``ThreadPoolExecutor(max_workers=1)``, without waiting for a stuck job at interpreter exit.

    Why: the executor's threads are joined at interpreter exit, so a worker stuck in a collective
    whose peer stopped answering kept a failed run alive until the backend's own timeout (gloo: 30
    min by default). At exit an idle worker is stopped and joined (as the executor does); a busy one
    is waited for :data:`EXIT_JOIN_S` at most, then left (a daemon thread does not hold the process).
    The thread also stops once the worker is garbage-collected (or :meth:`shutdown`).
    """

    def __init__(self, name: str = "diloco_x") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_run_jobs, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()
        _LIVE_WORKERS[self._thread] = self._jobs
        # stop the thread when the worker is dropped; at exit stop_workers_at_exit does it (waking it
        # any later would make it take the GIL during finalization: pthread_exit before Python 3.14)
        weakref.finalize(self, self._jobs.put, None).atexit = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)``; its result (or exception) arrives in the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, (lambda: fn(*args, **kwargs)) if args or kwargs else fn))
        return future

    def shutdown(self) -> None:
        """Stop the thread after the jobs already queued (does not wait for it)."""
        self._jobs.put(None)


class WorkerLane:
    """What a :class:`DaemonWorker` keeps per CUDA device across rounds, so that its exchanges stay
    off the training loop's stream and out of its allocations:

    * ``stream``: the one CUDA stream its kernels go to. One per worker, reused every round: the
      caching allocator keeps freed blocks per stream, so a fresh pool stream each round would
      strand the worker's buffers of earlier rounds (up to 32 pool streams' worth) instead of
      reusing them.
    * ``ready``: an event on ``stream``; :meth:`sync` is the worker thread's only wait for its GPU
      work (never a device-wide sync: the training stream is not waited for).

    Its all-gathers stage through page-locked host memory as the single-collective exchanges do
    (:func:`host_copy`: PyTorch's caching host allocator, whose blocks are reused across rounds
    once the copies recorded on them have run): asynchronous DMA on ``stream``, no pageable bounce
    through the driver, no host allocation per round.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = torch.cuda.Event()

    def sync(self, event: "torch.cuda.Event | None" = None) -> None:
        """Block this (the worker) thread until everything enqueued on :attr:`stream` so far ran
        (recorded in ``event``, default :attr:`ready`)."""
        event = self.ready if event is None else event
        event.record(self.stream)
        event.synchronize()


#: executor -> {device: its :class:`WorkerLane`}
_WORKER_LANES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def worker_lane(executor, device: torch.device) -> WorkerLane:
    """The :class:`WorkerLane` of ``executor`` on ``device`` (made on first use)."""
    lanes = _WORKER_LANES.setdefault(executor, {})
    if device not in lanes:
        lanes[device] = WorkerLane(device)
    return lanes[device]
