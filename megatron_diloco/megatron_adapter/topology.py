"""Where a rank sits in the DiLoCoX layout: its replica, its outer group, its intra-replica groups.

With ``--num-distributed-optimizer-instances R --use-tp-pp-dp-mapping`` Megatron makes each replica
a contiguous block of ``world / R`` ranks and builds the inter-instance group: the R ranks that own
the same shard (same TP rank, PP stage, CP rank and intra-DP index). That group is the outer group.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from megatron_diloco.algorithm.groups import register_group


@dataclasses.dataclass(frozen=True)
class Topology:
    """A rank's place in the replica layout. Holds process groups; never checkpointed."""

    replicas: int
    """R."""
    replica_index: int
    """Which replica (cluster) this rank belongs to, 0..R-1."""
    ranks_per_replica: int
    """world size / R."""
    rank_in_replica: int
    """This rank's position inside its replica (0..ranks_per_replica-1); the outer-group peers of a
    rank share it."""
    outer_group: dist.ProcessGroup | None
    """The R ranks (one per replica) owning the same shard; None when R == 1."""
    replica_groups: tuple[dist.ProcessGroup, ...]
    """Groups that together span this rank's replica (intra-replica DP, model parallel); used to
    reduce per-replica statistics without touching the slow link."""
    outer_gloo_group: dist.ProcessGroup | None = None
    """A gloo group over the outer group's ranks (CPU tensors), for exchanges that run off the main
    thread on a GPU (low-rank / adaptive): see :func:`host_mirror_of_outer_groups`. None otherwise."""
    decision_group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None
    """A gloo group over every rank of the world (all replicas, all stages and shards): carries the
    one MAX all-reduce per boundary that decides, for the whole model, whether the round is skipped
    (a NaN/Inf pseudo-gradient anywhere), agrees on tau and compares theta's fingerprints across
    replicas (:class:`megatron_diloco.algorithm.decision.BoundaryDecision`); see :func:`decision_group_of_world`. With replicas
    in separate worlds (:func:`from_outer_store`): the replica's world group, then the outer group
    (a MAX over both reaches every rank of every replica)."""
    separate_worlds: bool = False
    """True when each replica is its own torch.distributed world (its own launcher), joined only by
    the outer groups (:func:`from_outer_store`)."""
    exchange_slots: int | None = None
    """Separate jobs of different data-parallel size (``--diloco-x-exchange-slots`` G): each rank exchanges its
    shard as G / DP slots (:mod:`~megatron_diloco.megatron_adapter.exchange_slots`); None: as one."""
    exchange_chunks: int | None = None
    """Separate jobs of different parallel layout (``--diloco-x-exchange-chunks`` G): the model's parameters by
    name, cut into G chunks, G / world of them on each rank (:mod:`~megatron_diloco.megatron_adapter.by_name`)."""


def host_mirror_of_outer_groups(replicas: int) -> dist.ProcessGroup | None:
    """Create a gloo group for every outer group (collective over the world: every rank must call
    this, once, at the same point) and return this rank's. Its timeout is set by
    :class:`megatron_diloco.algorithm.sync.OuterSync` (``--diloco-x-outer-timeout-minutes``).

    Why: an exchange run on a worker thread that issued NCCL collectives would enqueue kernels that
    wait for the peer replicas on the same GPU as the training loop's own NCCL kernels (intra-replica
    reductions, Megatron's timer and evaluation collectives), in an order that differs between
    ranks; with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue, as Megatron recommends) that
    deadlocks, and it was seen to on 2 x H200. Gloo collectives on host copies never enqueue a kernel
    that waits for another rank, so the worker cannot block the GPU.
    """
    world = dist.get_world_size()
    per = world // replicas
    mine = None
    for i in range(per):  # the same groups in the same order on every rank
        ranks = [i + k * per for k in range(replicas)]
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    return mine


def decision_group_of_world() -> dist.ProcessGroup:
    """A gloo group over every rank of the world, for the boundary's skip decision (collective over
    the world: every rank must call this, once, at the same point).

    Why a group of its own: the decision must be one for the whole model (a NaN in one pipeline
    stage's or shard's pseudo-gradient skips the round on every rank, else stages of one model would
    diverge), so it crosses replicas and stages; on gloo it reads a host float (no device sync, no
    NCCL communicator, no kernel queued behind the training loop's), and it has its own timeout
    (``--diloco-x-outer-timeout-minutes``, set by :class:`megatron_diloco.algorithm.sync.OuterSync`) instead
    of Megatron's default group's."""
    return dist.new_group(backend="gloo")


def _replica_groups() -> tuple[dist.ProcessGroup, ...]:
    """The multi-rank groups spanning this rank's replica: its own data parallelism (x CP; with R
    optimizer instances in one world, the intra-instance part) and model parallelism."""
    from megatron.core import parallel_state as ps

    intra_dp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    return tuple(g for g in (intra_dp, ps.get_model_parallel_group()) if dist.get_world_size(g) > 1)


def from_parallel_state(replicas: int, host_mirror: bool = False) -> Topology:
    """Read the topology from Megatron's ``parallel_state`` (after ``initialize_model_parallel``).
    Collective over the world (creates the skip-decision group, :func:`decision_group_of_world`).

    ``host_mirror``: also create the gloo mirrors of the outer groups (collective over the world)."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % replicas:
        raise ValueError(f"--diloco-x-replicas {replicas} does not divide the world size {world}")
    per = world // replicas
    outer = None
    if replicas > 1:
        outer = ps.get_inter_distributed_optimizer_instance_group()
        members = dist.get_process_group_ranks(outer)
        expected = [rank % per + i * per for i in range(replicas)]
        if sorted(members) != expected:
            raise RuntimeError(
                f"outer group of rank {rank} is {members}, expected {expected}: Megatron was not "
                "initialized with --use-tp-pp-dp-mapping and --num-distributed-optimizer-instances R "
                "(call megatron_diloco.install(args) before pretrain)"
            )
    host = host_mirror_of_outer_groups(replicas) if host_mirror and replicas > 1 else None
    decision = decision_group_of_world()
    return Topology(replicas, rank // per, per, rank % per, outer, _replica_groups(), host, decision)


def _gloo_group(store, rank: int, size: int, timeout: datetime.timedelta, name: str,
                labels: list[int]) -> dist.ProcessGroup:
    """A gloo process group over ``store`` outside the default world (as ``new_group`` builds one,
    for CPU and, as host copies, CUDA tensors), entered into torch's group tables so that
    ``dist.get_backend``, ``dist.get_process_group_ranks`` and ``dist.set_timeout`` accept it. Its
    "ranks" are ``labels`` (the replicas' joint numbering; only errors print them)."""
    import torch

    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    kind = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), kind, backend)
    return register_group(group, name, labels, store)


def from_outer_store(replicas: int, replica_index: int, address: str, timeout_minutes: float,
                     description: dict | None = None, worker_group: bool = False) -> Topology:
    """The topology when each replica is its own torch.distributed world (its own ``torchrun``, e.g.
    one job per cluster, or several single-GPU replicas sharing one GPU), joined only through a
    TCP store at ``address`` (``HOST:PORT``; hosted by replica 0's rank 0, which must be reachable
    from every rank of every replica). Call on every rank of every replica, after Megatron's groups
    exist; every replica must use the same TP/PP/DP layout.

    Outer group k: a gloo group over rank k of every replica (CPU tensors; GPU shards travel as host
    copies, :func:`megatron_diloco.algorithm.exchange.start_exchange`); its position = ``replica_index``.
    The skip decision reduces over the replica's world (gloo) and then the outer group. Ranks in
    errors are numbered ``replica_index x world + rank``.

    ``description``: what must agree across the launches (:func:`megatron_diloco.megatron_adapter.handshake.describe_launch`,
    the same on every rank of this launch): compared with every other launch's through the store
    before any group is built (:func:`megatron_diloco.megatron_adapter.handshake.join_launches`); a difference raises
    ``ValueError`` naming the flag and both values, on every rank of every launch.

    ``worker_group``: also a second gloo group over the same ranks (its own store prefix) for the
    matrix codecs' worker thread (``outer_gloo_group``), so that it never talks on the group the
    training loop's thread uses (the skip decision, the link measurement, the checks); else
    ``outer_gloo_group`` is the outer group itself (already gloo: host-memory exchanges run on it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--diloco-x-outer-store must be HOST:PORT, got {address!r}")
    if not 0 <= replica_index < replicas:
        raise ValueError(f"--diloco-x-replica-index must be in [0, {replicas}) (--diloco-x-replicas), "
                         f"got {replica_index}")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = dist.TCPStore(host, int(port), replicas * world, is_master=(replica_index == 0 and rank == 0),
                          timeout=timeout, wait_for_workers=False)
    if description is not None:
        from megatron_diloco.megatron_adapter.handshake import join_launches

        join_launches(store, replica_index, replicas, rank, description, address, timeout.total_seconds())
    outer = None
    if replicas > 1:
        outer = _gloo_group(dist.PrefixStore(f"diloco_x/outer/{rank}", store), replica_index, replicas,
                            timeout, f"diloco_x_outer_{rank}", [r * world + rank for r in range(replicas)])
    host = outer
    if worker_group and replicas > 1:
        host = _gloo_group(dist.PrefixStore(f"diloco_x/outer_worker/{rank}", store), replica_index, replicas,
                           timeout, f"diloco_x_outer_worker_{rank}", [r * world + rank for r in range(replicas)])
    replica_world = decision_group_of_world() if world > 1 else None
    decision = tuple(g for g in (replica_world, outer) if g is not None)
    return Topology(replicas, replica_index, world, rank, outer, _replica_groups(), host, decision,
                    separate_worlds=True)


def from_federation(exchange_slots: int | None = None, exchange_chunks: int | None = None) -> Topology:
    """The topology of a job that is one replica of a run of separate jobs (``--diloco-x-lighthouse``):
    to Megatron and the checkpoint, a world of one replica; its outer group is the members present
    at each boundary, set by the meeting (:mod:`megatron_diloco.federation.membership`). The skip
    decision reduces over this job's world (gloo), then that outer group. Collective over the job's
    world (creates the gloo group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    job = decision_group_of_world() if world > 1 else None
    return Topology(1, 0, world, rank, None, _replica_groups(), None, tuple(g for g in (job,) if g is not None),
                    separate_worlds=True, exchange_slots=exchange_slots, exchange_chunks=exchange_chunks)
