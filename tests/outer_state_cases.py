"""The cases of ``tests/test_outer_state.py`` (no pytest needed: on a GPU machine without it,
``run_world(compare_layouts, 2, codec, "cuda")`` from ``tests.dist_utils`` runs them directly)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.algorithm.outer_store import CHUNK_ALIGN, SLOTS, chunk_elements
from megatron_diloco.algorithm.shard_view import ShardView, fingerprint
from megatron_diloco.algorithm.sync import OuterSync

H, ROUNDS = 3, 4
#: shard tensors of odd sizes (1822 elements): 256-element chunks cut inside tensors, end in a tail of 30
SHAPES = [(3, 100), (517,), (1000,), (5,)]
CHUNK_MB = CHUNK_ALIGN * 4 / 2 ** 20  # one block per chunk: 8 chunks
OVERLAPS = [dict(overlap="none"), dict(overlap="delayed"), dict(overlap="eager"),
            dict(overlap="eager", eager_weight=1.0, outer_momentum=0.0),
            dict(overlap="partial", overlap_steps=1), dict(overlap="partial", overlap_steps=0),
            dict(overlap="partial", overlap_steps=2, merge="mix"), dict(overlap="partial", overlap_steps=H)]
PER_REPLICA = ("residual", "eager_anchor", "launch_point")


def _config(world: int, codec: str, where: str, **overlap) -> DiLoCoXConfig:
    kw = dict(replicas=world, local_steps=H, outer_lr=0.7, outer_momentum=0.9, compression=codec,
              outer_state=where, outer_chunk_mb=CHUNK_MB)
    kw.update(overlap)
    return DiLoCoXConfig(**kw)


def _trajectory(rank: int, device: str, cfg: DiLoCoXConfig, resume: DiLoCoXConfig | None = None) -> list:
    """ROUNDS rounds of H deterministic, replica-specific inner steps; returns x after every boundary
    and after the drain, then theta, m and the residual. ``resume``: after the second boundary,
    checkpoint (state_dict + the per-replica tensors) and continue in a new OuterSync built with it."""
    torch.manual_seed(0)
    total = sum(torch.Size(s).numel() for s in SHAPES)
    x0 = torch.randn(total, device=device)
    shards, at = [], 0
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        shards.append(x0[at:at + n].clone().view(shape))
        at += n
    view = ShardView(shards)
    sync = OuterSync(view, cfg, dist.group.WORLD)
    if cfg.outer_state == "host":
        assert sync.theta.device.type == "cpu" and sync.store.held(sync.theta)
        assert len(sync.store.ranges()) == -(-total // CHUNK_ALIGN) > 2  # several chunks, a tail
    out, step = [], 0
    for t in range(ROUNDS):
        for _ in range(H):
            x = torch.cat([s.view(-1) for s in shards])
            x = x - 0.05 * (torch.sin(x * (rank + 1) + step) + 0.1 * (rank - 0.5))
            torch._foreach_copy_([s.view(-1) for s in shards], list(x.split([s.numel() for s in shards])))
            step += 1
            since = step % H
            if sync.merge_due(since):
                sync.merge()
            elif since == 0:
                sync.boundary()
        out.append(torch.cat([s.view(-1) for s in shards]).cpu())
        if resume is not None and t == 1:
            state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sync.state_dict().items()}
            mine = {k: getattr(sync, k).clone() for k in PER_REPLICA if getattr(sync, k) is not None}
            sync = OuterSync(view, resume, dist.group.WORLD)
            sync.load_state_dict(state)
            for k, v in mine.items():
                getattr(sync, k).copy_(v)
    sync.drain()
    out.append(torch.cat([s.view(-1) for s in shards]).cpu())
    out += [t.cpu() for t in (sync.theta, sync.outer.momentum_buffer, sync.residual) if t is not None]
    # the replicas' check streams host-held state through the device: the fingerprint of the whole
    state = sync.outer.tensors()
    assert torch.equal(sync.fingerprint(state).cpu(), fingerprint([t.cpu() for t in state]))
    if sync.config.outer_state == "host":  # three slots x at most 5 tensors x one chunk
        assert 0 < sync.store.staging_bytes() <= SLOTS * 5 * chunk_elements(CHUNK_MB) * 4
    return out


def _same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u.view(torch.int32), v.view(torch.int32)), f"{what}: entry {i} differs"


def compare_layouts(rank: int, world: int, codec: str, device: str) -> None:
    """On each rank: every overlap mode with the outer state on the device and in host memory
    (bit for bit), mixed layouts across replicas, checkpoints moved between the layouts."""
    for overlap in OVERLAPS:
        gpu = _trajectory(rank, device, _config(world, codec, "device", **overlap))
        cpu = _trajectory(rank, device, _config(world, codec, "host", **overlap))
        _same(gpu, cpu, f"{codec} {overlap}")
    # the chunked encode puts the same bytes on the link: replicas may choose their layouts apiece
    mixed = _trajectory(rank, device, _config(world, codec, "device" if rank == 0 else "host", overlap="delayed"))
    _same(_trajectory(rank, device, _config(world, codec, "device", overlap="delayed")), mixed, f"{codec} mixed")
    # checkpoints move between the layouts: a resume into either layout continues alike
    for overlap in (dict(overlap="delayed"), dict(overlap="eager"), dict(overlap="partial", overlap_steps=2)):
        runs = {(a, b): _trajectory(rank, device, _config(world, codec, a, **overlap),
                                    resume=_config(world, codec, b, **overlap))
                for a in ("device", "host") for b in ("device", "host")}
        for key, run in runs.items():
            _same(runs[("device", "device")], run, f"{codec} {overlap} checkpoint {key}")


