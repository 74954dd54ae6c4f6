"""Heals between jobs without pickles, authenticated.

A job behind the run receives, per rank, the outer state of rank k of the most advanced member, once the
members have authenticated each other (:mod:`megatron_diloco.federation.membership`): the source
:meth:`SealedTransport.offer` s a snapshot, the target :meth:`SealedTransport.fetch` es it. The body is a
fixed format, never a pickle::

    envelope(kind "heal", context {quorum, step, rank}) of:
        header length (8 B, little endian) | header (JSON) | tensor bytes, in the header's order

The header is the state's tree with each tensor replaced by ``{"tensor": i}`` and a table of
``[dtype, shape]`` per tensor (dtypes from :data:`DTYPES` only). The receiver checks the envelope's tag
(:mod:`megatron_diloco.federation.auth`) before it reads anything, bounds the body's size
(``max_bytes``), then rebuilds the tensors from the raw bytes; what the state must look like (numel,
dtype, finiteness) is checked by the state's owner (:meth:`megatron_diloco.algorithm.federated.FederatedRounds.load_state_dict`).

The server (one per rank, a thread) binds the address this rank advertises, serves the one body on offer
(bound to the quorum and the source's progress) and only to a request whose own tag verifies: a process
without the run's secret gets 403 and nothing else.
"""

from __future__ import annotations

import hmac
import json
import logging
import struct
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megatron_diloco.federation.auth import AuthenticationError, RunKey, dump_json

logger = logging.getLogger(__name__)

#: the dtypes a heal may carry
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                                  "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
_NAMES = {v: k for k, v in DTYPES.items()}
AUTH_HEADER = "X-DiLoCoX-Auth"


def encode_state(state: Any) -> bytes:
    """``state`` (dicts with str keys, lists, str, int, float, bool, None, tensors) as the body format of
    the module doc (tensors copied to the host; the result owns its bytes)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.dtype not in _NAMES:
                raise TypeError(f"a heal cannot carry {x.dtype} tensors")
            tensors.append(x.detach().to("cpu").contiguous())
            return {"tensor": len(tensors) - 1}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError("a heal's dict keys must be str")
            return {"dict": {k: walk(v) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return {"list": [walk(v) for v in x]}
        if x is None or isinstance(x, (str, int, float, bool)):
            return {"value": x}
        raise TypeError(f"a heal cannot carry {type(x).__name__}")

    tree = walk(state)
    header = dump_json({"tree": tree, "tensors": [[_NAMES[t.dtype], list(t.shape)] for t in tensors]})
    parts = [struct.pack("<Q", len(header)), header]
    parts += [t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"" for t in tensors]
    return b"".join(parts)


def decode_state(body: memoryview | bytes) -> Any:
    """The inverse of :func:`encode_state` on an authenticated body; ValueError on any malformed part."""
    view = memoryview(body)
    if len(view) < 8:
        raise ValueError("a heal body too short for its header")
    (n,) = struct.unpack("<Q", view[:8])
    if n > len(view) - 8:
        raise ValueError("a heal header longer than the body")
    try:
        header = json.loads(bytes(view[8:8 + n]).decode("utf-8"))
        specs = header["tensors"]
        tree = header["tree"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"a heal header that is not the expected JSON ({err})") from None
    tensors: list[torch.Tensor] = []
    offset = 8 + n
    for spec in specs:
        if (not isinstance(spec, list) or len(spec) != 2 or spec[0] not in DTYPES or not isinstance(spec[1], list)
                or not all(isinstance(d, int) and d >= 0 for d in spec[1])):
            raise ValueError(f"a heal tensor spec {spec!r} is not [dtype, shape]")
        dtype = DTYPES[spec[0]]
        numel = 1
        for d in spec[1]:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset + nbytes > len(view):
            raise ValueError("a heal body shorter than its tensors")
        raw = bytearray(view[offset:offset + nbytes])
        t = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        tensors.append(t.reshape(spec[1]))
        offset += nbytes
    if offset != len(view):
        raise ValueError("a heal body longer than its tensors")

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError("a heal tree node is not one of tensor / dict / list / value")
        (kind, v), = node.items()
        if kind == "tensor" and isinstance(v, int) and 0 <= v < len(tensors):
            return tensors[v]
        if kind == "dict" and isinstance(v, dict):
            return {k: build(x) for k, x in v.items()}
        if kind == "list" and isinstance(v, list):
            return [build(x) for x in v]
        if kind == "value" and (v is None or isinstance(v, (str, int, float, bool))):
            return v
        raise ValueError(f"a heal tree node of kind {kind!r} is malformed")

    return build(tree)


class SealedTransport:
    """Heals over HTTP with sealed bodies (module doc). One per rank: a server (a daemon thread) that offers
    this rank's state while a heal is under way, and a client that fetches a peer's. Also given to
    torchft's ``Manager`` as its checkpoint transport (torchft 0.2.0 only asks it for :meth:`metadata`;
    the heal runs after the members authenticated each other, :mod:`megatron_diloco.federation.membership`).

    Args:
        key: the run's key.
        host: the address this rank's server binds and advertises.
        rank: this rank's index in its job (the heal is rank k to rank k).
        timeout: bound on a request.
    """

    def __init__(self, key: RunKey, host: str, rank: int, timeout: timedelta) -> None:
        self.key, self.rank, self.timeout = key, rank, timeout
        self._lock = threading.Lock()
        self._offer: tuple[dict, bytes] | None = None  # (context, envelope) of the heal on offer
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                transport._serve(self)

            def log_message(self, *args) -> None:  # quiet: refusals are logged as warnings
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="diloco_x_heal_server",
                                        daemon=True)
        self._thread.start()
        bound = self._server.server_address[0]
        self._url = f"http://{'[' + bound + ']' if ':' in bound else bound}:{self._server.server_address[1]}"

    def _context(self, quorum: int, step: int) -> dict:
        return {"quorum": int(quorum), "step": int(step), "rank": self.rank}

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        try:
            with self._lock:
                offer = self._offer
            tag = bytes.fromhex(req.headers.get(AUTH_HEADER, ""))
            if offer is None:
                req.send_error(404, "no heal on offer")
                return
            context, body = offer
            if req.path != f"/heal/{context['quorum']}/{context['step']}" or not hmac.compare_digest(
                    tag, self.key.tag("heal request", context, b"")):
                raise AuthenticationError("the heal request does not verify with this run's key for the heal on offer")
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            req.wfile.write(body)
        except (ValueError, AuthenticationError) as err:
            logger.warning("DiLoCoX: refused a heal request from %s: %s", req.client_address[0], err)
            req.send_error(403, "refused")
        except (BrokenPipeError, ConnectionResetError):
            pass

    @property
    def url(self) -> str:
        """Where this rank's server is reached (sent to the other members in the handshake)."""
        return self._url

    # torchft's CheckpointTransport: it asks for the address at every quorum and closes the (empty) window
    # at every commit; it never sends or receives (allow_heal=False)
    def metadata(self) -> str:
        return self._url

    def disallow_checkpoint(self) -> None:
        pass

    def send_checkpoint(self, *args, **kwargs) -> None:
        raise RuntimeError("megatron-diloco heals after the handshake, not inside torchft's quorum")

    recv_checkpoint = send_checkpoint

    def offer(self, quorum: int, step: int, state: Any) -> None:
        """Offer ``state`` (a snapshot is taken now: training may go on) to sealed requests for ``quorum``
        and ``step`` until :meth:`withdraw`."""
        context = self._context(quorum, step)
        envelope = self.key.seal("heal", context, encode_state(state))
        with self._lock:
            self._offer = (context, envelope)

    def withdraw(self) -> None:
        with self._lock:
            self._offer = None

    def fetch(self, url: str, quorum: int, step: int, max_bytes: int) -> Any:
        """The state rank k of the member at ``url`` offers for ``quorum`` and ``step``: requested with a
        sealed request, at most ``max_bytes`` read, its tag checked before it is decoded (no pickle).
        Raises :class:`AuthenticationError` (or an ``OSError`` from the connection) otherwise."""
        if not isinstance(url, str) or not url.startswith("http://"):
            raise AuthenticationError(f"a heal source advertised {url!r}, not an http:// address")
        context = self._context(quorum, step)
        tag = self.key.tag("heal request", context, b"")
        request = urllib.request.Request(f"{url}/heal/{int(quorum)}/{int(step)}", headers={AUTH_HEADER: tag.hex()})
        with urllib.request.urlopen(request, timeout=self.timeout.total_seconds()) as resp:
            length = int(resp.headers.get("Content-Length", "-1"))
            if not 0 < length <= max_bytes:
                raise AuthenticationError(f"a heal body of {length} bytes announced; this rank accepts at most "
                                          f"{max_bytes}")
            data = resp.read(length + 1)
        if len(data) != length:
            raise AuthenticationError(f"a heal body of {len(data)} bytes for the {length} announced")
        return decode_state(self.key.open("heal", context, data))

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
