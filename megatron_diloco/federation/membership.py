"""Who is present at a boundary, on torchft 0.2.0 (pinned: the calls into it are all here).

One torchft ``Manager`` per rank of a job (``rank`` = the rank in the job, ``world_size`` = the job's
world, ``replica_id`` = the job's ``--diloco-x-replica-id``): rank 0 runs the job's manager server,
which heartbeats the lighthouse (``--diloco-x-lighthouse``) every 100 ms and asks it for a quorum once
every rank of the job reached the boundary. The quorum's members are the jobs that asked and still
heartbeat. Each rank's reconfigurable gloo group then spans rank k of every member: exactly this
rank's outer group (the jobs sorted by replica id). A job whose progress is below the most advanced
member's receives, per rank from rank k of an up-to-date job, the state the algorithm gives
(:meth:`megatron_diloco.algorithm.federated.FederatedRounds.state_dict`), over HTTP.

Ports: the lighthouse's; on rank 0 of each job the federation store (``--diloco-x-federation-port``,
0: any free one) and the manager server (``TORCHFT_MANAGER_PORT``, default any); on every rank a gloo
port per outer group and an HTTP port for heals (any free ones). Everything is sent in clear and
unauthenticated; the heal unpickles what a peer sends: run the jobs inside one VPN.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from typing import Callable

import torch.distributed as dist

from megatron_diloco.algorithm.federated import ForeignStateError, Meeting
from megatron_diloco.megatron_adapter.topology import register_group

logger = logging.getLogger(__name__)

#: the name under which torch's group tables list a federation group (one per quorum)
GROUP_NAME = "diloco_x_federation_{quorum}_{rank}"


def unregister_group(group: dist.ProcessGroup | None) -> None:
    """Drop ``group`` from torch's group tables (a superseded quorum's)."""
    if group is None:
        return
    tables = dist.distributed_c10d._world
    for table in (tables.pg_map, tables.pg_names, tables.pg_group_ranks):
        table.pop(group, None)


class TorchftMembership:
    """A :class:`megatron_diloco.algorithm.federated.Membership` on torchft (module doc). Construct on
    every rank of the job, at the same point (collective over the job's world: rank 0 starts the
    federation store and shares its port).

    Args:
        lighthouse: ``HOST:PORT`` of ``torchft_lighthouse``.
        replica_id: this job's name (``--diloco-x-replica-id``), unique in the run.
        advertise_host: the address other jobs reach this job's rank 0 at (its federation store and
            manager); None: rank 0's fully qualified name, shared with the job's ranks.
        store_port: the federation store's port (0: any free one).
        timeout_s: bound on a collective or a heal (``--diloco-x-outer-timeout-minutes``).
        quorum_timeout_s: how long a meeting may wait for the run's other jobs (they reach the
            boundary at different times; a job waiting for its first peer waits this long).
        min_replicas: meet only when at least this many jobs are present.
        job_group: this job's world (gloo; None with one rank).
        state_dict / load_state_dict: what a behind job receives, and how it takes it.
    """

    def __init__(self, lighthouse: str, replica_id: str, advertise_host: str | None, store_port: int,
                 timeout_s: float, quorum_timeout_s: float, min_replicas: int,
                 job_group: dist.ProcessGroup | None, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None]) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager server logs every quorum at info
        for name in ("torchft", "torchft_commits", "torchft_quorums", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from torchft import Manager, ProcessGroupGloo

        self.job_group = job_group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.replica_id = replica_id
        self._store = None
        where = [advertise_host, store_port]
        if self.rank == 0:  # the federation store: torchft's manager keys and the outer groups' rendezvous
            self._store = dist.TCPStore("0.0.0.0", store_port, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            where = [advertise_host or default_advertise_host(), self._store.port]
        if self.world > 1:  # rank 0's address and port, as every rank of the job must use them
            dist.broadcast_object_list(where, src=0, group=job_group)
        advertise_host, port = where
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s),
            connect_timeout=datetime.timedelta(seconds=max(60.0, timeout_s)),
            rank=self.rank, world_size=self.world, store_addr=advertise_host, store_port=int(port),
            lighthouse_addr=_lighthouse_url(lighthouse), replica_id=replica_id, hostname=advertise_host,
            init_sync=False)
        self._quorum_id: int | None = None
        self.group: dist.ProcessGroup | None = None
        #: ``handshake(group, progress) -> bool``: whether every member agrees (False: meet again);
        #: raises SystemExit on the member that differs (:func:`megatron_diloco.federation.handshake.agree`)
        self.handshake: Callable[[dist.ProcessGroup, int], bool] | None = None

    def meet(self, progress: int) -> Meeting:
        """The quorum at this boundary (module doc; blocking, collective over this job's ranks). When
        the members changed, they compare what must agree (:mod:`megatron_diloco.federation.handshake`):
        a job that differs from the run leaves with the differing flag named, the others meet again
        without it."""
        started = time.perf_counter()
        changed = False
        while True:
            self.manager.load_state_dict({"step": int(progress), "batches_committed": 0})
            foreign = False
            try:
                self.manager.start_quorum()
            except ForeignStateError as err:  # a member of another run, or configured otherwise, is ahead
                logger.warning("DiLoCoX: %s", err)
                foreign = True
            err = self.manager.errored()
            if err is not None and not foreign:
                raise RuntimeError(f"megatron-diloco: the meeting with the other jobs failed: {err}") from err
            quorum = self.manager._quorum_id  # torchft 0.2.0 has no public getter
            if quorum == self._quorum_id and not foreign:
                break
            changed = True
            unregister_group(self.group)
            parent = self.pg.parent
            labels = [i * self.world + self.rank for i in range(parent.size())]
            self.group = register_group(parent, GROUP_NAME.format(quorum=quorum, rank=self.rank), labels)
            self._quorum_id = quorum
            if self.handshake is None or self.handshake(self.group, progress):
                logger.warning("DiLoCoX: %d job%s present (quorum %d); this job is member %d",
                               parent.size(), "s" if parent.size() > 1 else "", quorum, parent.rank())
                break
            self.commit(False)  # a member that differs leaves; meet again without it
            self._quorum_id = None
        return Meeting(self.group, changed, self.group.size(), time.perf_counter() - started)

    def commit(self, ok: bool) -> bool:
        """Job-wide AND of ``ok`` (torchft's ``should_commit``)."""
        if not ok:
            self.manager.report_error(RuntimeError("the exchange failed on this rank"))
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        """Leave the run (end of training): stop heartbeating."""
        try:
            self.manager.shutdown(wait=False)
        except Exception as err:  # leaving must not fail the run that just ended
            logger.warning("DiLoCoX: leaving the run: %s", err)
        unregister_group(self.group)
        self.group = None


def _lighthouse_url(address: str) -> str:
    """``HOST:PORT`` (or an ``http://`` URL) as torchft's manager expects it."""
    return address if "://" in address else f"http://{address}"


def default_advertise_host() -> str:
    """This host's name as other sites would resolve it (``--diloco-x-advertise-host``'s default)."""
    return socket.getfqdn()
