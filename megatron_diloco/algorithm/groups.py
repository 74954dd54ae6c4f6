"""torch.distributed's group tables for groups built outside its world: entering one (a gloo group of
separate launches, or a torchft quorum's), and retiring one off the training thread. torch only."""

from __future__ import annotations

import atexit
import sys
import threading
import time

import torch.distributed as dist


def register_group(group: dist.ProcessGroup, name: str, labels: list[int], store=None) -> dist.ProcessGroup:
    """Enter a gloo ``group`` built outside ``torch.distributed``'s world (:func:`_gloo_group`, or a
    torchft quorum's) into its group tables, so that ``dist.*`` collectives, ``dist.get_world_size``,
    ``dist.get_process_group_ranks`` and ``dist.set_timeout`` accept it. Its "ranks" are ``labels``
    (only errors print them)."""
    group._set_group_name(name)
    tables = dist.distributed_c10d._world
    tables.pg_map[group] = ("gloo", store)
    tables.pg_names[group] = name
    tables.pg_group_ranks[group] = {label: i for i, label in enumerate(labels)}
    return group


def unregister_group(group: dist.ProcessGroup | None) -> None:
    """Drop ``group`` from torch's group tables (a superseded quorum's)."""
    if group is None:
        return
    tables = dist.distributed_c10d._world
    for table in (tables.pg_map, tables.pg_names, tables.pg_group_ranks):
        table.pop(group, None)


_held: list[dist.ProcessGroup] = []  # retired groups some other object may still hold
_lock = threading.Lock()
_reaper: threading.Thread | None = None
_destroying = threading.Event()  # set while the reaper runs destructors (the GIL released, in C++)
_closing = False  # the interpreter is exiting: the reaper destroys nothing more


def retire_group(group: dist.ProcessGroup | None) -> None:
    """Drop ``group`` from torch's tables and release it on a daemon thread: a gloo group's destructor joins
    its threads, which wait for the operations still queued on it (a collective that timed out is never
    cancelled; a peer that froze mid-transfer) up to its timeout, which must not stall training (it releases
    the GIL while it waits: measured, 3.9 s for a 4 s timeout on the thread that dropped it, other threads
    running). The thread holds its reference until it is the last one, so the destructor runs there
    whoever else held the group.

    At exit the process waits for a destructor in progress there (:func:`_wait_at_exit`): a daemon thread
    that takes the GIL back after the interpreter began finalizing is ended by CPython < 3.14 with a forced
    unwind through that destructor, and the process aborts (SIGABRT, "terminate called without an active
    exception"; ``benchmarks/federation/daemon_thread_abort_repro.py`` shows it with torch alone)."""
    global _reaper
    if group is None:
        return
    unregister_group(group)
    with _lock:
        if any(g is group for g in _held):
            return
        _held.append(group)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="diloco_x_group_reaper", daemon=True)
            _reaper.start()
            atexit.register(_wait_at_exit)


def _reap() -> None:
    """Every 50 ms, destroy (here) the retired groups nobody else holds any more."""
    while True:
        time.sleep(0.05)
        with _lock:
            if _closing:
                return
            free = [i for i in range(len(_held)) if sys.getrefcount(_held[i]) <= 2]  # the list's and the argument
            items = [_held.pop(i) for i in reversed(free)]
            if items:
                _destroying.set()
        del items  # the destructors run here, outside the lock
        _destroying.clear()


def _wait_at_exit() -> None:
    """(atexit, before the interpreter finalizes) Stop the reaper, and wait for a destructor it is running:
    it returns once the operations queued on its group end, at the latest at the group's timeout. Groups
    still held are destroyed by the exiting thread itself."""
    global _closing
    with _lock:
        _closing = True
    if _destroying.is_set():
        print("megatron-diloco: waiting for a retired outer group to close (at most its timeout) before exiting",
              file=sys.stderr, flush=True)
        while _destroying.is_set():
            time.sleep(0.05)
    with _lock:
        items = list(_held)
        _held.clear()
    del items
