"""The join handshake of replicas launched separately (``--diloco-x-outer-store``): before the outer
groups exist, every launch publishes what must agree across replicas and refuses to train when
another launch's differs, naming the flag and both values.

Why: launches joined only through a TCP store never saw each other's flags. Payloads of the same size
(int8 and fp8) decoded each other's bytes silently; a different outer lr, momentum, H, warm-up or
``--train-iters`` drifted or hung at the end; a different layout surfaced as "did not start from the
same weights" a whole round later.

What must agree (:func:`describe_launch`, one JSON object per launch): the resolved DiLoCoX config
(:data:`MUST_AGREE_DILOCO`, the codec-specific fields only where their codec / mode uses them), the
Megatron flags of :data:`MUST_AGREE_MEGATRON` (layout, run length, batch per launch, data split and
start weights, the inner optimizer and its LR schedule, the model's shape), every rank's fp32 main
shard (element count and a digest of how the parameters are cut), and the megatron-core and
megatron-diloco versions (the latter with a digest of the package source: launches running other
code decode and step differently). What may differ per launch (:data:`MAY_DIFFER`): where the outer
state lives and its chunking, timeouts, the given link bandwidth (the adaptive plan and auto tau are
agreed by the boundary's collectives), data paths, precision, logging. Separate jobs
(``--diloco-x-lighthouse``) may also differ in their global batch (:data:`PER_JOB_MEGATRON`: each job is
weighed by the tokens it trains on) and in their round lengths (:data:`PER_JOB_DILOCO`: H, H0, W, with
``--train-iters`` and the LR schedule's iterations) when the run's length is given in iterations; their
rounds must agree (:func:`describe_rounds`).

How (:func:`join_launches`, once, before the outer groups are built): rank 0 of each launch writes its
description under ``diloco_x/join/<replica index>`` in the store; every rank of every launch reads
the R descriptions in replica order and compares them with its own launch's. All ranks of all launches
read the same R descriptions, so they all reach the same verdict: a mismatch is refused by every
rank of every launch (no launch is left waiting in a group another one never joins). The store's host
(replica 0's rank 0) waits, bounded, until every rank has read before it exits, so the others read
their error rather than a closed connection. Cost: one store write per launch and R reads per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_diloco.algorithm.config import CODECS, DiLoCoXConfig
from megatron_diloco.algorithm.description import MAY_DIFFER, SHARD_FLAGS, SHARDS, differences  # noqa: F401

#: bumped when the description's layout changes (compared first: launches of other formats refuse)
HANDSHAKE_FORMAT = 1

#: The resolved ``DiLoCoXConfig`` values every launch must share, by flag: how to read the value
#: from the config (as the flag states it) and, for values that matter only under some settings,
#: the test of those settings (a value is described only where it is used; launches that use it
#: differently already differ in the settings the test reads).
MUST_AGREE_DILOCO: tuple[tuple[str, Callable[[DiLoCoXConfig], Any], Callable[[DiLoCoXConfig], bool] | None], ...] = (
    ("--diloco-x-replicas", lambda c: c.replicas, None),
    # first: with it the flags below are the run's rounds (compared), without it each job's (their rounds compared)
    ("--diloco-x-site-pace", lambda c: c.site_pace, None),
    ("--diloco-x-site-weights", lambda c: c.site_weights, None),  # (the decision's slots depend on it)
    ("--diloco-x-compression", lambda c: c.compression, None),
    ("--diloco-x-local-steps", lambda c: "auto" if c.local_steps_auto else c.local_steps, None),
    ("--diloco-x-warmup-local-steps", lambda c: c.warmup_local_steps, None),
    ("--diloco-x-warmup-iters", lambda c: c.warmup_iters, None),
    ("--diloco-x-warmup-overlap-steps", lambda c: c.warmup_overlap_steps,
     lambda c: c.warmup_iters > 0 and c.overlap == "partial"),
    ("--diloco-x-warmup-compression", lambda c: c.warmup_compression or c.compression, lambda c: c.warmup_iters > 0),
    ("--diloco-x-outer-lr", lambda c: c.outer_lr, None),
    ("--diloco-x-outer-momentum", lambda c: c.outer_momentum, None),
    ("--diloco-x-no-nesterov", lambda c: not c.nesterov, None),
    ("--diloco-x-overlap", lambda c: c.overlap, None),
    ("--diloco-x-overlap-steps", lambda c: "auto" if c.overlap_steps is None else c.overlap_steps,
     lambda c: c.overlap == "partial"),
    ("--diloco-x-merge", lambda c: c.merge, lambda c: c.overlap == "partial"),
    ("--diloco-x-mix-alpha", lambda c: c.mix_alpha, lambda c: c.overlap == "partial" and c.merge == "mix"),
    ("--diloco-x-eager-weight", lambda c: "1/R" if c.eager_weight is None else c.eager_weight,
     lambda c: c.overlap == "eager"),
    ("--diloco-x-rank", lambda c: c.rank, lambda c: CODECS[c.compression].matrix and c.compression != "adaptive"),
    ("--diloco-x-energy", lambda c: c.energy, lambda c: c.compression == "adaptive"),
)

#: Megatron arguments that every launch must share, by flag (or description) and attribute.
MUST_AGREE_MEGATRON: tuple[tuple[str, str], ...] = (
    # layout: each launch is one replica of the same TP x PP x CP x DP block
    ("world size (torchrun --nnodes x --nproc-per-node)", "world_size"),
    ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
    ("virtual pipeline size (--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank)",
     "virtual_pipeline_model_parallel_size"),
    ("--context-parallel-size", "context_parallel_size"),
    ("data-parallel size (world size / (TP x PP x CP))", "data_parallel_size"),
    # run length: the number of boundaries, the end
    ("--train-samples", "train_samples"),
    # the batch per launch and the data split (each launch reads its share of one world's samples)
    ("--rampup-batch-size", "rampup_batch_size"),
    ("--seq-length", "seq_length"),
    ("--seed", "seed"),
    # the inner optimizer and its LR schedule
    ("--optimizer", "optimizer"),
    ("--lr", "lr"),
    ("--min-lr", "min_lr"),
    ("--lr-decay-style", "lr_decay_style"),
    ("--lr-warmup-fraction", "lr_warmup_fraction"),
    ("--lr-warmup-init", "lr_warmup_init"),
    ("--weight-decay", "weight_decay"),
    ("--clip-grad", "clip_grad"),
    ("--adam-beta1", "adam_beta1"),
    ("--adam-beta2", "adam_beta2"),
    ("--adam-eps", "adam_eps"),
    ("--sgd-momentum", "sgd_momentum"),
    # the model's shape
    ("--num-layers", "num_layers"),
    ("--hidden-size", "hidden_size"),
    ("--ffn-hidden-size", "ffn_hidden_size"),
    ("--num-attention-heads", "num_attention_heads"),
    ("--num-query-groups", "num_query_groups"),
    ("--kv-channels", "kv_channels"),
    ("--max-position-embeddings", "max_position_embeddings"),
    ("padded vocabulary size (tokenizer, --make-vocab-size-divisible-by)", "padded_vocab_size"),
)

#: the micro-batch the samples are dealt in (``data_split``): a job's own, unless the sites' differ
DATA_MICRO_BATCH = "--micro-batch-size (or, where the sites' differ, --diloco-x-data-micro-batch)"
#: what ``--diloco-x-exchange-slots`` lets jobs differ in (their shards are then compared slot by slot)
SLOTS_REPLACE = ("world_size", "data_parallel_size")
#: the parameters' names and global shapes (the exchange by name), as a refusal names them
BY_NAME = ("parameters by name (Megatron's checkpoint keys and global shapes; sites of different TP need the same "
           "padded vocabulary: --make-vocab-size-divisible-by x TP alike)")
#: what ``--diloco-x-exchange-chunks`` lets jobs differ in (they compare the parameters' names and global shapes)
CHUNKS_REPLACE = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "data_parallel_size")

#: Megatron arguments separate jobs may set apiece (the mean weighs each job by its tokens, each reads its
#: data slot at its own rate, each counts its own inner steps and LR schedule); launches of one run, and
#: jobs of a run given in samples (--train-samples: its iterations would differ), must agree on them.
PER_JOB_MEGATRON: tuple[tuple[str, str], ...] = (
    ("--global-batch-size", "global_batch_size"),
    ("--train-iters", "train_iters"),
    ("--lr-decay-iters", "lr_decay_iters"),
    ("--lr-warmup-iters", "lr_warmup_iters"),
)
#: DiLoCoX flags separate jobs may set apiece, given --train-iters: the round lengths and overlaps in inner steps
#: (a faster site runs more steps per round; tau is agreed as a share of the round); the rounds themselves must
#: agree (:func:`describe_rounds`).
PER_JOB_DILOCO = ("--diloco-x-local-steps", "--diloco-x-warmup-local-steps", "--diloco-x-warmup-iters",
                  "--diloco-x-warmup-overlap-steps", "--diloco-x-overlap-steps")


def describe_rounds(args: argparse.Namespace, config: DiLoCoXConfig) -> dict[str, Any]:
    """What jobs of different round lengths (:data:`PER_JOB_DILOCO`) must still share: the rounds of the
    warm-up and of the run (boundaries in ``--train-iters`` on this job's schedule, and whether a shorter
    last round ends it) and the LR schedule as shares of the run (exact fractions), so that every job's
    boundaries, warm-up codec and learning rate fall at the same rounds."""
    from fractions import Fraction

    from megatron_diloco.algorithm.schedule import RoundSchedule

    schedule, iters = RoundSchedule(config), int(args.train_iters)
    last = " and a shorter last one" if schedule.run_steps_since_boundary(iters) else ""
    out = {"rounds of the run (--train-iters over --diloco-x-local-steps, after the warm-up)":
           f"{schedule.boundaries_in(iters)}{last}",
           "warm-up rounds (--diloco-x-warmup-iters / --diloco-x-warmup-local-steps)":
           schedule.boundaries_in(config.warmup_iters)}
    for flag, attr in (("--lr-decay-iters", "lr_decay_iters"), ("--lr-warmup-iters", "lr_warmup_iters")):
        value = getattr(args, attr, None)
        out[f"{flag} / --train-iters"] = None if value is None else str(Fraction(int(value), iters))
    return out

#: the longest the store's host waits, on a refusal, for every rank to have read (they read at once)
READ_WAIT_S = 60.0

def package_source_digest() -> str:
    """sha256 (hex, first 16 digits) over megatron_diloco's Python source files, in path order: two
    launches with the same digest run the same package code."""
    root = Path(__file__).resolve().parents[1]  # the whole package, not this subpackage
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def shard_digest(layout: Sequence[tuple[Sequence[int], int, int]]) -> list:
    """``[numel, digest]`` of one rank's fp32 main shards from ``layout``: per shard, in the order of
    the outer state, (the model parameter's shape, the shard's start in it, its element count)."""
    text = json.dumps([[list(shape), start, size] for shape, start, size in layout])
    return [sum(size for _, _, size in layout), hashlib.sha256(text.encode()).hexdigest()[:16]]


def describe_launch(args: argparse.Namespace, config: DiLoCoXConfig, shards: list[list],
                    megatron_version: str, separate_jobs: bool = False, by_name: str | None = None) -> dict[str, Any]:
    """What must agree across launches, as a JSON-serializable dict (label -> value; the labels name
    the flags). ``shards``: per rank of this launch, :func:`shard_digest` of its fp32 main shards;
    ``megatron_version``: megatron-core's; ``separate_jobs``: jobs of a run (``--diloco-x-lighthouse``),
    which may differ in :data:`PER_JOB_MEGATRON` unless the run is given in samples; ``by_name``: with
    ``--diloco-x-exchange-chunks``, the digest of the parameters' names and global shapes
    (:meth:`~megatron_diloco.megatron_adapter.by_name.ByName.digest`). Identical on every rank of a launch."""
    from megatron_diloco.version import __version__

    out: dict[str, Any] = {"handshake format": HANDSHAKE_FORMAT,
                           "megatron-diloco": f"{__version__} (source {package_source_digest()})",
                           "megatron-core": megatron_version}
    per_job = separate_jobs and getattr(args, "train_samples", None) is None
    paced = config.site_pace is not None  # the jobs share the run's rounds in run steps; only the batch may differ
    for flag, read, used in MUST_AGREE_DILOCO:
        if (used is None or used(config)) and not (per_job and not paced and flag in PER_JOB_DILOCO):
            out[flag] = read(config)
    if per_job and not paced:
        out.update(describe_rounds(args, config))
    slots = getattr(args, "diloco_x_exchange_slots", None) if separate_jobs else None
    chunks = getattr(args, "diloco_x_exchange_chunks", None) if separate_jobs else None
    # jobs of a run in iterations may differ in the global batch and (not paced) in their iterations
    shared = PER_JOB_MEGATRON if not per_job else PER_JOB_MEGATRON[1:] if paced else ()
    for flag, attr in MUST_AGREE_MEGATRON + shared:
        if (slots and attr in SLOTS_REPLACE) or (chunks and attr in CHUNKS_REPLACE):  # they agree on the slots
            continue                                                                  # or chunks instead
        value = getattr(args, attr, None)
        out[flag] = list(value) if isinstance(value, tuple) else value
    out[DATA_MICRO_BATCH] = getattr(args, "diloco_x_data_micro_batch", None) or getattr(args, "micro_batch_size", None)
    if slots:
        out["--diloco-x-exchange-slots"] = slots
    if chunks:
        out["--diloco-x-exchange-chunks"] = chunks
        out["--diloco-x-data-slots"] = getattr(args, "diloco_x_data_slots", None) or chunks  # (the data split's)
        out[BY_NAME] = by_name
    out[SHARDS] = shards
    return json.loads(json.dumps(out))  # the form the other launches read back


def refusal(address: str, replica_index: int, replicas: int, found: dict[int, list[str]]) -> str:
    """The error of a launch whose description differs from replicas' ``found`` (replica -> phrases)."""
    listed = "; ".join(p for r in sorted(found) for p in found[r])
    return (f"the launches joined through --diloco-x-outer-store {address} disagree (this launch is "
            f"--diloco-x-replica-index {replica_index} of --diloco-x-replicas {replicas}): {listed}. Every "
            "launch must train with the same values of these (they decide the exchange's bytes, the outer "
            "step, the round schedule, the data split and the shards); give every launch the same flags "
            f"and package versions (launches may differ in {', '.join(MAY_DIFFER)}). Nothing was trained.")


def join_launches(store, replica_index: int, replicas: int, rank: int, description: dict[str, Any],
                  address: str, timeout_s: float) -> None:
    """Publish this launch's ``description`` (rank 0 writes it) and compare it with every replica's
    through ``store`` (a ``torch.distributed`` store shared by all launches; blocking reads, bounded
    by the store's timeout). Call on every rank of every launch, before the outer groups are built.

    Raises ``ValueError`` (:func:`refusal`) on any difference, on every rank of every launch. Reads
    stop at a replica whose ``--diloco-x-replicas`` differs (a launch expecting more replicas than
    exist would wait for them). On a refusal the store's host (``replica_index`` 0, ``rank`` 0) first
    waits, at most ``timeout_s`` and :data:`READ_WAIT_S`, until every rank of every launch has read."""
    if rank == 0:
        store.set(f"diloco_x/join/{replica_index}", json.dumps(description))
    found: dict[int, list[str]] = {}
    worlds = 0  # ranks of the launches read (the host waits for as many reads on a refusal)
    for r in range(replicas):
        theirs = json.loads(store.get(f"diloco_x/join/{r}"))
        worlds += int(theirs.get(MUST_AGREE_MEGATRON[0][0]) or 1)
        if r != replica_index:
            diff = differences(description, theirs, r)
            if diff:
                found[r] = diff
        if theirs.get("--diloco-x-replicas") != replicas:
            break
    store.add("diloco_x/join/read", 1)
    if not found:
        return
    if replica_index == 0 and rank == 0:  # keep the store up until every rank read its error
        deadline = time.monotonic() + min(timeout_s, READ_WAIT_S)
        while store.add("diloco_x/join/read", 0) < worlds and time.monotonic() < deadline:
            time.sleep(0.05)
    raise ValueError(refusal(address, replica_index, replicas, found))
