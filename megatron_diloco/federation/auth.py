"""The run's secret: who may take part in a run of separate jobs, and what they sent.

Every job of a run reads the same secret from a file (``--diloco-x-secret-file``; make one with
``head -c 32 /dev/urandom | base64 > run.secret`` and copy it to every site over a channel you trust).
The run's key is HMAC-SHA256(secret, run name): the same secret gives each run its own key. Every message
that one job accepts from another is an *envelope*::

    MAGIC (8 B) | tag (32 B) | body

where ``tag = HMAC-SHA256(key, kind | context | body)``: ``kind`` names the message (a handshake
hello, a verdict, a heal request, a heal body), ``context`` binds it to where it is valid (the quorum, the
sender's position in it, the step of a heal). A receiver computes the tag it expects from its own key and
the context it is in, and compares it (constant time) *before* it looks at the body: bytes from a process
without the secret, or replayed from another quorum, step or sender, are refused without being parsed.
Bodies are JSON or raw tensor bytes, never pickles.

What this does not give: confidentiality (everything crosses in clear) and the coordinator's availability
(anyone who reaches the lighthouse can stall meetings). ``docs/federation.md`` has the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

MAGIC = b"DLCXv1\x00\x00"
TAG_BYTES = 32
#: the shortest secret accepted (after surrounding whitespace is stripped)
MIN_SECRET_BYTES = 16
FLAG = "--diloco-x-secret-file"


class AuthenticationError(ValueError):
    """A message whose tag does not verify with this run's key (another secret, another run, a replay
    from another quorum or step, or corrupted bytes): refused before its body was read."""


def _canonical(kind: str, context: dict[str, Any]) -> bytes:
    return json.dumps([kind, context], sort_keys=True, separators=(",", ":")).encode() + b"\n"


class RunKey:
    """The key of one run (module doc): tags and verifies envelopes.

    Args:
        secret: the shared secret (at least :data:`MIN_SECRET_BYTES` bytes).
        run: the run's name (``--diloco-x-run``).
    """

    def __init__(self, secret: bytes, run: str) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"{FLAG}: the secret has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                             "(e.g. head -c 32 /dev/urandom | base64 > run.secret)")
        self.run = run
        self._key = hmac.new(secret, b"megatron-diloco run key\n" + run.encode(), hashlib.sha256).digest()
        #: a short public name of the key (logs: two jobs whose key ids differ hold different secrets)
        self.key_id = hmac.new(self._key, b"key id", hashlib.sha256).hexdigest()[:12]

    @classmethod
    def from_file(cls, path: str | os.PathLike, run: str) -> "RunKey":
        """Read the secret from ``path`` (surrounding whitespace stripped). Raises ValueError naming
        :data:`FLAG` when the file is missing, empty, too short or readable by other users."""
        p = Path(path)
        try:
            st = p.stat()
            secret = p.read_bytes().strip()
        except OSError as err:
            raise ValueError(f"{FLAG} {path}: cannot read the run's secret ({err.strerror}); every job of the "
                             "run needs a copy of the same file") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{FLAG} {path}: the secret is readable by other users of this host "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        return cls(secret, run)

    def tag(self, kind: str, context: dict[str, Any], body: bytes | memoryview) -> bytes:
        """HMAC-SHA256 over ``kind``, ``context`` and ``body`` (32 bytes)."""
        mac = hmac.new(self._key, _canonical(kind, context), hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def seal(self, kind: str, context: dict[str, Any], body: bytes) -> bytes:
        """The envelope of ``body`` (module doc)."""
        return MAGIC + self.tag(kind, context, body) + body

    def open(self, kind: str, context: dict[str, Any], envelope: bytes | memoryview) -> memoryview:
        """The body of ``envelope`` once its tag verifies for ``kind`` and ``context``; raises
        :class:`AuthenticationError` otherwise (the body is not looked at)."""
        view = memoryview(envelope)
        head = len(MAGIC) + TAG_BYTES
        if len(view) < head or bytes(view[:len(MAGIC)]) != MAGIC:
            raise AuthenticationError(f"not a {kind} message of this package")
        body = view[head:]
        if not hmac.compare_digest(bytes(view[len(MAGIC):head]), self.tag(kind, context, body)):
            raise AuthenticationError(f"the {kind} message does not verify with this run's key (another "
                                      f"{FLAG}, another --diloco-x-run, or a replay)")
        return body

    def open_json(self, kind: str, context: dict[str, Any], envelope: bytes | memoryview) -> Any:
        """:meth:`open`, then the body parsed as JSON (never a pickle); ValueError when it is not JSON."""
        body = self.open(kind, context, envelope)
        try:
            return json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise AuthenticationError(f"the {kind} message verified but is not JSON ({err})") from None


def dump_json(obj: Any) -> bytes:
    """``obj`` as canonical JSON bytes (sorted keys; NaN and infinities refused)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
