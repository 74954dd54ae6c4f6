"""The run's reports: the round metrics (:data:`ROUND_METRICS`, the ``[DiLoCoX] round`` line) and the
summary line: rank 0 prints ``DILOCOX SUMMARY {json}`` once at the end of training
(:func:`format_summary`, from :mod:`megatron_diloco.megatron_adapter.integration`); launchers, benchmarks and tests
read it back from a log with :func:`parse_summaries`. No torch import: usable by any launcher."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

#: what starts the summary line (possibly after a launcher's per-line prefix such as ``[rank0]:``)
PREFIX = "DILOCOX SUMMARY "


def format_summary(summary: dict[str, Any]) -> str:
    """The line rank 0 prints: :data:`PREFIX` + the summary as JSON (one line)."""
    return PREFIX + json.dumps(summary)


def parse_summaries(text: str) -> list[dict[str, Any]]:
    """Every summary in ``text`` (a log: one per run that completed with DiLoCoX on), in order."""
    return [json.loads(line.split(PREFIX, 1)[1]) for line in text.splitlines() if PREFIX in line]


def params_digest(fingerprints: Sequence[Sequence[int]]) -> str:
    """A short hex digest of a replica's parameters from its ranks' fingerprints (two int64 each,
    ``DiLoCoXOptimizer.params_fingerprint``, in rank order): equal digests mean bit-identical fp32
    main params for one TP/PP/DP layout, so two separate launches can be compared from their
    summaries."""
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for fp in fingerprints for v in fp)
    return hashlib.sha256(raw).hexdigest()[:16]


#: The round metrics (``DiLoCoXOptimizer.round_metrics``): name -> (unit, meaning, whose). Logged as
#: ``diloco_x/<name>`` TensorBoard / W&B scalars at Megatron's iteration by the rank that has the writer
#: (Megatron's last rank: the last replica's last stage), and in the ``[DiLoCoX] round`` line by rank 0.
ROUND_METRICS: dict[str, tuple[str, str, str]] = {
    "applied": ("0/1", "an outer step was applied in this round (a landing, or at the boundary)", "every rank alike"),
    "bytes_sent": ("B", "bytes this rank sent to the other replicas for the exchange applied in this round", "this rank"),
    "bytes_received": ("B", "bytes this rank received for it", "this rank"),
    "replica_bytes_sent": ("B", "the same summed over the replica's ranks: what its site sent on the slow link", "the replica"),
    "replica_bytes_received": ("B", "what its site received", "the replica"),
    "exchange_s": ("s", "launch to completion of that exchange (overlapped or not)", "this rank"),
    "exposed_s": ("s", "how long the training loop waited for it", "this rank"),
    "replica_exchange_s": ("s", "the longest exchange_s of the replica's ranks", "the replica"),
    "replica_exposed_s": ("s", "the longest exposed_s of the replica's ranks", "the replica"),
    "pseudo_grad_norm": ("", "L2 norm of the replica's pseudo-gradient (theta - x) at this boundary", "the replica"),
    "compression_error": ("", "norm of what was not sent / norm of what was encoded, that exchange (0: lossless)", "the replica"),
    "compression_ratio": ("x", "fp32 bytes / payload bytes of that exchange", "this rank"),
    "skipped": ("0/1", "the round was skipped (a NaN/Inf pseudo-gradient somewhere)", "every rank alike"),
    "overlap_steps": ("steps", "tau: inner steps the exchange launched here overlaps (partial; delayed/eager: the next round)", "every rank alike"),
    "round_steps": ("steps", "length of the round this boundary starts (H, or H0 in the warm-up)", "every rank alike"),
    "step_s": ("s", "mean inner-step time of the round that ended (auto tau, the derived timeout)", "this rank"),
    "link_mbps": ("Mbit/s", "the site's slow link as auto tau sizes exchanges by it (0: not known)", "this rank"),
    "tokens": ("tokens", "separate jobs: the tokens the replica's pseudo-gradient at this boundary covers (0 in one world)", "the replica"),
    "weight": ("", "the replica's weight in the mean launched at this boundary: R x its tokens / all members' tokens (1: equal)", "every rank alike"),
}


#: a warm-up round whose exchange kept the training waiting for more than this share of the round's
#: compute is reported (once): on a slow link the warm-up's short rounds cannot hide their exchanges
WARMUP_EXPOSED_WARN_SHARE = 0.5


def warmup_exposure_warning(m: dict, warmup_local_steps: int | None, warmup_iters: int) -> str | None:
    """The warning for round metrics ``m`` (:data:`ROUND_METRICS`) when the round was a warm-up round
    (rounds of H0 = ``warmup_local_steps`` for the first ``warmup_iters`` steps) whose exchange kept the
    replica waiting for more than :data:`WARMUP_EXPOSED_WARN_SHARE` of its compute: what the warm-up
    costs at that rate and the flags that change it. None otherwise."""
    if not warmup_iters or not warmup_local_steps or m["step"] > warmup_iters or not m["applied"]:
        return None
    compute = warmup_local_steps * m["step_s"]
    if compute <= 0 or m["replica_exposed_s"] <= WARMUP_EXPOSED_WARN_SHARE * compute:
        return None
    rounds = warmup_iters // warmup_local_steps
    return (f"DiLoCoX: the warm-up's exchanges do not hide on this link: round {m['round']} waited "
            f"{m['replica_exposed_s']:.2f} s for its exchange against {compute:.2f} s of compute ({warmup_local_steps} "
            f"steps); at that rate its {rounds} rounds wait about {rounds * m['replica_exposed_s']:.0f} s in all. "
            "A longer --diloco-x-warmup-local-steps (with its --diloco-x-warmup-overlap-steps) hides more of it; "
            "--diloco-x-warmup-iters 0 drops the warm-up (faster, with a larger loss gap: docs/tuning.md)")


def format_round_line(m: dict, lossy: bool) -> str:
    """The ``[DiLoCoX] round`` log line of round metrics ``m`` (rank 0's; bytes and times are the
    replica's: :data:`ROUND_METRICS`)."""
    head = f"[DiLoCoX] round {m['round']:4d} | step {m['step']:6d} | "
    if m["skipped"]:
        return head + "SKIPPED (non-finite pseudo-gradient; nothing sent)"
    if m["applied"]:
        body = (f"applied | sent {m['replica_bytes_sent'] / 1e6:.3f} MB | recv {m['replica_bytes_received'] / 1e6:.3f} MB"
                f" | exchange {m['replica_exchange_s']:.3f} s | exposed {m['replica_exposed_s']:.4f} s"
                + (f" | compression {m['compression_ratio']:.2f}x, rel. error {m['compression_error']:.4f}"
                   if lossy else ""))
    else:
        body = "no exchange applied in this round (the first, or its exchange lands later)"
    weight = m.get("weight", 1.0)
    return (head + body + f" | pseudo-grad norm {m['pseudo_grad_norm']:.4e}"
            + (f" | weight {weight:.4f} ({m.get('tokens', 0)} tokens)" if weight != 1.0 else "")
            + f" | next round {m['round_steps']} steps, tau {m['overlap_steps']}")
