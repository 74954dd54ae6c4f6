"""The environment corpus of the convergence benchmark: distinct documents, in content-hash order,
within the byte cap; built once and read back by Megatron's indexed dataset as byte tokens + EOD."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import stdlib_corpus  # noqa: E402


def test_environment_documents_are_distinct_ordered_and_capped():
    docs = stdlib_corpus.environment_documents(max_bytes=2 << 20, max_file_bytes=64 << 10)
    keys = [hashlib.sha1(d).hexdigest() for d in docs]
    assert len(docs) > 20
    assert keys == sorted(set(keys))  # each content once, in hash order
    assert sum(map(len, docs)) <= 2 << 20
    assert all(len(d) <= 64 << 10 and d.strip() for d in docs)
    # a larger cap extends the same sequence (the cap takes a prefix of one fixed order)
    more = stdlib_corpus.environment_documents(max_bytes=4 << 20, max_file_bytes=64 << 10)
    assert more[:len(docs)] == docs and len(more) > len(docs)


def test_environment_corpus_reads_back(tmp_path, monkeypatch):
    docs = stdlib_corpus.environment_documents(max_bytes=1 << 20)
    monkeypatch.setattr(stdlib_corpus, "environment_documents", lambda max_bytes: docs)
    prefix = stdlib_corpus.build_environment(1, tmp_path)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    first = ds[0]
    assert bytes(first[:-1].astype("uint8")) == docs[0] and first[-1] == stdlib_corpus.EOD
    assert stdlib_corpus.build_environment(1, tmp_path) == prefix  # cached
