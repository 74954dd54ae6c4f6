"""Where a rank sits in the DiLoCoX layout: its replica, its outer group, its intra-replica groups.

With ``--num-distributed-optimizer-instances R --use-tp-pp-dp-mapping`` Megatron makes each replica
a contiguous block of ``world / R`` ranks and builds the inter-instance group: the R ranks that own
the same shard (same TP rank, PP stage, CP rank and intra-DP index). That group is the outer group.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


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


def from_parallel_state(replicas: int) -> Topology:
    """Read the topology from Megatron's ``parallel_state`` (after ``initialize_model_parallel``)."""
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
    intra_dp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    groups = tuple(g for g in (intra_dp, ps.get_model_parallel_group()) if dist.get_world_size(g) > 1)
    return Topology(replicas, rank // per, per, rank % per, outer, groups)
