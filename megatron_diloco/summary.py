"""The run summary line: rank 0 prints ``DILOCOX SUMMARY {json}`` once at the end of training
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
