"""``ShardLayout``: where each rank's flat shard sits in the world, asked once and kept.

One all-gather of ``(replica index, rank in replica, shard numel)`` (3 int64 per rank, over the default
world group) answers both questions the adapter has about the other ranks' shards:

* how many ranks of this rank's replica hold a shard, i.e. share the site's slow link at a boundary
  (:meth:`ShardLayout.link_sharers`, asked by :class:`~megatron_diloco.megatron_adapter.optimizer.DiLoCoXOptimizer`
  at construction);
* where this rank's flat shard vector starts in its replica's concatenation (ranks ordered by rank in
  replica) and that concatenation's length T, the same on every replica (:meth:`ShardLayout.checkpoint_span`,
  asked by :class:`~megatron_diloco.megatron_adapter.checkpoint.OuterCheckpoint` at save and load).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardLayout:
    """The world's shard table, for one rank.

    Args:
        replica_index: this rank's replica (0..R-1).
        rank_in_replica: this rank's position inside its replica.
        numel: elements of this rank's flat fp32 main-shard vector (``ShardView.numel``; 0 on a rank
            without main shards).
        device: where the all-gathered int64 rows live (the shard's device: the default group's
            backend must reach it).
    """

    def __init__(self, replica_index: int, rank_in_replica: int, numel: int, device: torch.device) -> None:
        self.replica_index, self.rank_in_replica = replica_index, rank_in_replica
        self.numel, self.device = numel, device
        self._table: list[tuple[int, int, int]] | None = None
        self._span: tuple[int, int] | None = None

    def table(self) -> list[tuple[int, int, int]]:
        """``(replica index, rank in replica, shard numel)`` of every rank of the world, in world rank
        order. The first call all-gathers 3 int64 per rank over the default (world) group, so it must
        be made on every rank (the optimizer's construction, checkpoint save / load are); cached."""
        if self._table is None:
            mine = torch.tensor([self.replica_index, self.rank_in_replica, self.numel], dtype=torch.int64,
                                device=self.device)
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            self._table = [tuple(int(x) for x in row.tolist()) for row in rows]
        return self._table

    def link_sharers(self) -> int:
        """S: the ranks of this rank's replica that hold a shard, i.e. whose outer groups' exchanges
        cross the site's slow link at the same time (each counts on 1 / S of
        ``--diloco-x-bandwidth-mbps``). 1 without torch.distributed; else collective over the world
        on the first call (:meth:`table`)."""
        if not dist.is_initialized():
            return 1
        return sum(1 for r, _, n in self.table() if r == self.replica_index and n > 0)

    def checkpoint_span(self) -> tuple[int, int]:
        """``(offset, T)``: where this rank's flat shard vector starts in its replica's concatenation
        (ranks ordered by rank in replica) and that concatenation's length T. Raises when the
        replicas' T differ (DiLoCoX needs one TP/PP/DP layout for every replica). Collective over the
        world on the first call (:meth:`table`); cached."""
        if self._span is None:
            table = self.table()
            totals: dict[int, int] = {}
            for replica, _, n in table:
                totals[replica] = totals.get(replica, 0) + n
            if len(set(totals.values())) != 1:
                raise RuntimeError(f"replicas hold different numbers of main-shard elements {totals}: "
                                   "DiLoCoX needs one TP/PP/DP layout for every replica")
            offset = sum(n for replica, k, n in table
                         if replica == self.replica_index and k < self.rank_in_replica)
            self._span = (offset, totals[self.replica_index])
        return self._span
