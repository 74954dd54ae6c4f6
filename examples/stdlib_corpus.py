"""A real-text corpus that every machine has offline: the Python standard library sources.

Byte-level tokens for Megatron's ``NullTokenizer``: token = byte value (0..255), every document
(one ``.py`` file) ends with the end-of-document token ``EOD = 256``, so the vocabulary has
``VOCAB_SIZE = 257`` entries (``--tokenizer-type NullTokenizer --vocab-size 257``; 0.19's
NullTokenizer defaults ``eod_id`` to ``vocab_size - 1``). Written with Megatron's
``IndexedDatasetBuilder`` as ``<prefix>.bin`` / ``<prefix>.idx`` for ``GPTDataset``.

Files: every ``*.py`` under the running interpreter's stdlib directory, except ``site-packages``
and the test suites (``test``/``tests``/``idle_test`` folders: ~20 MB of fixtures). They are read
in sorted order, then written in a fixed pseudo-random order (keyed by path hash) so that the
contiguous document ranges that ``--split`` carves into train/valid/test are each a fair sample
of the library rather than its alphabetical tail.

Cache: ``$MEGATRON_DILOCO_DATA`` or ``<repo>/.cache/corpus/``. Built once: concurrent callers
(all ranks of a torchrun job) serialize on a file lock; the builder writes temporary files and
renames them, ``.idx`` last, so a reader never sees a partial corpus.

A larger corpus (:func:`build_environment`, for the convergence benchmark): every ``*.py``, ``*.rst``
and ``*.md`` file of the running interpreter's environment (stdlib and installed packages, test
suites included), deduplicated by content, in content-hash order, up to a byte cap; nothing
downloaded. Its size and content depend on what is installed: the benchmark records both.

CLI: ``python examples/stdlib_corpus.py [DIR]`` builds the stdlib corpus and prints its path prefix;
``--environment MAX_MB`` the environment corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np

VOCAB_SIZE = 257  # 256 byte values + EOD
EOD = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_REPO = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Where corpora are cached: ``$MEGATRON_DILOCO_DATA`` or ``<repo>/.cache/corpus``."""
    return Path(os.environ.get("MEGATRON_DILOCO_DATA") or _REPO / ".cache" / "corpus")


def source_files(stdlib: Path | None = None) -> list[Path]:
    """The stdlib ``*.py`` files in the corpus, sorted by relative path."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.rglob("*.py")
             if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _document_order(files: list[Path], stdlib: Path) -> list[Path]:
    # Deterministic shuffle: independent of filesystem order and of PYTHONHASHSEED.
    key = lambda p: hashlib.sha1(p.relative_to(stdlib).as_posix().encode()).hexdigest()
    return sorted(files, key=key)


def build(out_dir: Path | None = None) -> str:
    """Build the corpus if it is not cached yet and return its path prefix (no extension).

    Safe to call from every rank at once: one builds, the others wait on the lock and reuse it.
    """
    out_dir = Path(out_dir or cache_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / f"pystdlib-{platform.python_version()}-bytes"
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (bin_path.exists() and idx_path.exists()):
            _write(prefix)
    return str(prefix)


def environment_documents(max_bytes: int, max_file_bytes: int = 1 << 20) -> list[bytes]:
    """The environment corpus's documents: the text of every ``*.py`` / ``*.rst`` / ``*.md`` file
    (at most ``max_file_bytes``, not empty) under the stdlib and the site-packages folders, each
    distinct content once, ordered by its SHA-1, the first ones up to ``max_bytes`` in total."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")})
    seen: dict[str, bytes] = {}
    for root in roots:
        for suffix in ("*.py", "*.rst", "*.md"):
            for path in root.rglob(suffix):
                try:
                    if not path.is_file() or path.stat().st_size > max_file_bytes:
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue
                if data.strip():
                    seen.setdefault(hashlib.sha1(data).hexdigest(), data)
    docs, total = [], 0
    for key in sorted(seen):
        if total + len(seen[key]) > max_bytes:
            break
        docs.append(seen[key])
        total += len(seen[key])
    return docs


def build_environment(max_mb: int, out_dir: Path | None = None) -> str:
    """Build (once, as :func:`build`) the environment corpus capped at ``max_mb`` MB; its prefix."""
    out_dir = Path(out_dir or cache_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / f"pyenv-{platform.python_version()}-{max_mb}mb-bytes"
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
            _write(prefix, environment_documents(max_mb << 20))
    return str(prefix)


def _write(prefix: Path, documents: list[bytes] | None = None) -> None:
    """Write ``documents`` (default: the stdlib files in their fixed order) as byte tokens + EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if documents is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        documents = (path.read_bytes() for path in _document_order(source_files(stdlib), stdlib))
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    n_docs = n_tokens = 0
    for data in documents:
        if not data.strip():
            continue  # empty __init__.py files carry no text
        tokens = np.empty(len(data) + 1, dtype=np.uint16)  # (bytes + 1,) uint16
        tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
        tokens[-1] = EOD
        builder.add_document(tokens, [tokens.size])
        n_docs += 1
        n_tokens += tokens.size
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")  # last: its presence marks a complete corpus
    print(f"stdlib_corpus: wrote {n_docs} documents, {n_tokens / 1e6:.1f}M tokens to {prefix}.bin",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--environment":
        print(build_environment(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))
    else:
        print(build(sys.argv[1] if len(sys.argv) > 1 else None))
