"""A run's description (what every replica's launch or job must share, one JSON-able dict of label ->
value; labels name the flags) and its comparison: which labels differ, as phrases naming both values.
Built by :func:`megatron_diloco.megatron_adapter.handshake.describe_launch`; compared by the launches'
join (:mod:`megatron_diloco.megatron_adapter.handshake`) and the jobs' handshake
(:mod:`megatron_diloco.federation.handshake`). Standard library only."""

from __future__ import annotations

import json
from typing import Any

#: What launches may set apiece (named in the refusal): the same bits or agreed at run time.
MAY_DIFFER = ("--diloco-x-outer-state", "--diloco-x-outer-chunk-mb", "--diloco-x-bandwidth-mbps",
              "--diloco-x-outer-timeout-minutes", "--distributed-timeout-minutes", "data paths",
              "precision (--bf16 / --fp16)", "logging")
#: What separate jobs may also set apiece (their means weigh each job by its tokens), given --train-iters.
JOBS_MAY_DIFFER = ("--global-batch-size (with --train-iters)",
                   "--diloco-x-local-steps, --diloco-x-warmup-local-steps, --diloco-x-warmup-iters, the overlap "
                   "steps, --train-iters, --lr-decay-iters and --lr-warmup-iters (with --train-iters, in proportion: "
                   "the same rounds and LR schedule over them)")

SHARDS = "fp32 main shards"
"""The description's key for the per-rank shards: a list (by rank) of ``[numel, digest]``."""
#: what decides the shards, named when they differ
SHARD_FLAGS = ("--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size, the "
               "data-parallel size, the model-shape flags, --ddp-bucket-size")


_MISSING = object()


def _value(v: Any) -> str:
    """A described value as the refusal prints it (as the flag is written where it is one)."""
    if v is _MISSING:
        return "(not used)"
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "on" if v else "off"
    return v if isinstance(v, str) else json.dumps(v)


def differences(mine: dict[str, Any], theirs: dict[str, Any], other: int) -> list[str]:
    """Where the description ``theirs`` (replica ``other``'s) differs from ``mine``, one phrase per
    label: ``'<label> is <mine> here, <theirs> in replica <other>'`` (the shards per rank)."""
    out = []
    for label in [*mine, *(k for k in theirs if k not in mine)]:
        a, b = mine.get(label, _MISSING), theirs.get(label, _MISSING)
        if a == b:
            continue
        if label == SHARDS and isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{SHARDS}: {len(a)} ranks here, {len(b)} in replica {other} ({SHARD_FLAGS})")
                continue
            for rank, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    size = (f"{x[0]} elements here, {y[0]} in replica {other}" if x[0] != y[0] else
                            f"{x[0]} elements on both, cut differently")
                    out.append(f"{SHARDS} of rank {rank}: {size} ({SHARD_FLAGS})")
                    break  # the first rank says enough
            continue
        out.append(f"{label} is {_value(a)} here, {_value(b)} in replica {other}")
    return out
