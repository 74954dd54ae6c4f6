#!/usr/bin/env python3
"""torch alone: a process aborts at exit ("terminate called without an active exception", SIGABRT,
exit status -6) when a daemon thread is destroying a gloo process group while the interpreter finalizes.

    python benchmarks/federation/daemon_thread_abort_repro.py [--workaround]

What it does (2 processes, CPU, gloo): rank 0 starts a collective on a standalone ``ProcessGroupGloo``
that rank 1 never joins (a stale collective, like a frozen job's exchange), hands the only references
to the group and its work to a daemon thread that drops them, and exits. The group's destructor joins
gloo's worker thread, which waits for the pending collective; torch runs that destructor with the GIL
released (``IntrusivePtrNoGilDestructor``). Rank 1 exits while rank 0 finalizes: the collective fails
(connection closed), the destructor returns, and the daemon thread re-takes the GIL. CPython < 3.14
ends a thread that takes the GIL after finalization began with ``pthread_exit``, whose forced unwind
reaches a ``noexcept`` C++ frame (the holder's destructor): ``std::terminate``. A module global whose
``__del__`` sleeps (run while modules are finalized) makes the window deterministic; in a real job the
window is the finalization of torch/Megatron's modules.

``--workaround``: an ``atexit`` handler (atexit runs before finalization starts) waits, bounded, for
the daemon thread to finish destroying the groups it holds: the process exits 0.
Prints the exit status of rank 0 (-6 without the workaround).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank1(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=TIMEOUT)
    pg = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)  # connects, never takes part in rank 0's collective
    store.wait(["exiting"])
    time.sleep(0.5)  # rank 0 is finalizing by now
    os._exit(0)  # the connection closes: rank 0's pending collective fails


class _SlowTeardown:
    def __del__(self) -> None:  # runs while the modules are finalized (finalization has begun)
        time.sleep(2.0)


def _rank0(port: int, workaround: bool) -> None:
    global _slow
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=TIMEOUT)
    pg = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
    held = [pg.allreduce([torch.ones(4)]), pg]  # the stale collective and its group
    del pg
    done = threading.Event()

    def reap() -> None:  # a daemon reaper, as one that retires groups off the training thread
        held.clear()  # the group's destructor runs here, GIL released, until the collective fails
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    if workaround:
        atexit.register(lambda: done.wait(TIMEOUT.total_seconds()))
    _slow = _SlowTeardown()
    store.set("exiting", "1")
    sys.exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workaround", action="store_true")
    ap.add_argument("--rank0", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank0 is not None:
        _rank0(args.rank0, args.workaround)
        return
    port = _free_port()
    import subprocess
    r0 = subprocess.Popen([sys.executable, __file__, "--rank0", str(port)]
                          + (["--workaround"] if args.workaround else []))
    p1 = mp.get_context("spawn").Process(target=_rank1, args=(port,))
    p1.start()
    code = r0.wait(timeout=120)
    p1.join(30)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}: rank 0 exited with {code}"
          f"{' (SIGABRT)' if code == -6 else ''}{' [workaround]' if args.workaround else ''}", flush=True)


if __name__ == "__main__":
    main()
