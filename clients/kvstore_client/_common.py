"""What the sync and asyncio clients share: page buffers, results, errors,
chunking of gRPC messages and data-channel frames, and the client's
credentials (:class:`Credentials`). No I/O here."""

from __future__ import annotations

import collections
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvstore.framing import decode_header, decode_prefix, encode_header
from kvstore.hostmem import populated_empty
from kvstore.node import MESSAGE_OVERHEAD, PutResult
from kvstore.errors import KvError, ResourceExhausted, Unavailable, error_for_code
from kvstore.rpc import CHANNEL_OPTIONS
from kvstore.security.tls import client_context, grpc_channel_credentials, grpc_name_options
from kvstore.v1 import kvstore_pb2 as pb

PageData = np.ndarray | Sequence[bytes | bytearray | memoryview | np.ndarray]
DEFAULT_MAX_MESSAGE = 64 << 20
GRPC_OPTIONS = CHANNEL_OPTIONS


@dataclass(slots=True)
class GetResult:
    """Pages for the requested keys, in request order.

    ``pages[i]`` holds key ``i`` when ``found[i]``; rows of missing keys are
    left as they were (uninitialised when the client allocated ``pages``).
    A partial result is data: recompute the missing pages.
    """

    keys: list[bytes]
    found: np.ndarray
    pages: np.ndarray

    @property
    def missing(self) -> list[bytes]:
        return [k for k, hit in zip(self.keys, self.found) if not hit]

    @property
    def hits(self) -> int:
        return int(self.found.sum())

    def page(self, key: bytes) -> np.ndarray | None:
        """The page of ``key`` (a view), or None if it was missing."""
        i = self.keys.index(key)
        return self.pages[i] if self.found[i] else None


class GetAssembler:
    """Places the pages of a gRPC Get stream into ``out`` in request order
    (a key asked for twice fills both rows)."""

    def __init__(self, keys: list[bytes], out: np.ndarray) -> None:
        self.keys, self.out = keys, out
        self.found = np.zeros(len(keys), dtype=bool)
        self._rows: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            self._rows.setdefault(key, []).append(i)

    def add(self, msg: pb.GetResponse) -> None:
        for key, page in zip(msg.keys, msg.pages):
            i = next(j for j in self._rows[key] if not self.found[j])
            self.out[i] = np.frombuffer(page, dtype=np.uint8)
            self.found[i] = True

    def result(self) -> "GetResult":
        return GetResult(self.keys, self.found, self.out)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    pinned: list[bytes]
    missing: list[bytes]
    ttl: float


def page_views(pages: PageData, count: int, page_bytes: int | None = None) -> list[memoryview]:
    """One flat byte view per page, without copying; ValueError for a count
    that does not match or an empty page."""
    if isinstance(pages, np.ndarray):
        if pages.ndim == 0 or pages.shape[0] != count:
            raise ValueError(f"{count} keys but {pages.shape[0] if pages.ndim else 'no'} pages")
        if count and pages.nbytes == 0:
            raise ValueError(f"pages of 0 bytes (array of shape {pages.shape}): a page has at least one byte")
        rows = np.ascontiguousarray(pages).reshape(count, -1).view(np.uint8) if count else pages
        return [memoryview(row).cast("B") for row in rows]
    if len(pages) != count:
        raise ValueError(f"{count} keys but {len(pages)} pages")
    out = []
    for i, page in enumerate(pages):
        view = memoryview(np.ascontiguousarray(page) if isinstance(page, np.ndarray) else page)
        if view.nbytes == 0:
            raise ValueError(f"page #{i} has 0 bytes: a page has at least one byte")
        out.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return out


def check_get_batch(count: int, page_bytes: int, info: pb.NodeInfoResponse) -> None:
    """The node's batch limits, checked before a Get allocates its output."""
    if info.max_batch_pages and count > info.max_batch_pages:
        raise ResourceExhausted(f"batch of {count} keys is over the node's limit of {info.max_batch_pages}; "
                                f"split it")
    if info.max_batch_bytes and count * page_bytes > info.max_batch_bytes:
        raise ResourceExhausted(f"batch of {count} pages ({count * page_bytes} bytes) is over the node's limit "
                                f"of {info.max_batch_bytes} bytes; split it")


def as_out(out: np.ndarray | None, count: int, page_bytes: int) -> np.ndarray:
    """The array Get writes into: ``out`` checked, or a new one."""
    if out is None:
        return populated_empty(count, page_bytes)  # see kvstore.hostmem: fresh memory faults slowly
    if out.dtype != np.uint8 or out.shape != (count, page_bytes) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape ({count}, {page_bytes})")
    return out


def found_views(out: np.ndarray, found: np.ndarray) -> list[memoryview]:
    """The rows of ``out`` a Get's payload fills (the ``found`` ones, in order), one flat view per run
    of consecutive found rows: the payload is received in a few large reads, not one read per page
    (on a busy event loop each read that has to wait costs a turn of the loop)."""
    rows = np.flatnonzero(found)
    if not len(rows):
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    return [memoryview(out[rows[a]:rows[b - 1] + 1].reshape(-1)) for a, b in zip(starts.tolist(), ends.tolist())]


def put_messages(namespace: str, keys: Sequence[bytes], views: Sequence[memoryview], kind: int,
                 max_message: int) -> Iterator[pb.PutRequest]:
    """Cut a batch into Put stream messages under ``max_message`` bytes."""
    limit = max(1, max_message - MESSAGE_OVERHEAD)
    start, size = 0, 0
    for i, view in enumerate(views):
        if i > start and size + view.nbytes > limit:
            yield pb.PutRequest(namespace=namespace, keys=keys[start:i],
                                pages=[bytes(v) for v in views[start:i]], kind=kind)
            start, size = i, 0
        size += view.nbytes
    if start < len(keys) or not keys:
        yield pb.PutRequest(namespace=namespace, keys=keys[start:], pages=[bytes(v) for v in views[start:]],
                            kind=kind)


def translate(exc: grpc.RpcError) -> KvError:
    """A gRPC failure as the matching typed error."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        err: KvError = Unavailable(f"{code.name}: {details}")
        err.code = code
        return err
    return error_for_code(code.value[0], details or code.name)


# ---- credentials -------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    """What a client shows a node: TLS (``tls_ca``: the CA that signed the
    node's certificate; ``tls_cert``/``tls_key``: a client certificate, for
    nodes with ``--tls-client-auth``), the name to verify the node's
    certificate for (``server_name``, default: the host of the address
    dialled) and a bearer ``token`` (sent on every gRPC call and as the
    data channel's HELLO)."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    server_name: str | None = None
    _ssl: list[ssl.SSLContext] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("a client certificate (tls_cert) needs tls_ca: the CA of the node's certificate")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def channel_options(self) -> list[tuple[str, object]]:
        return list(GRPC_OPTIONS) + (grpc_name_options(self.server_name) if self.tls else [])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc_channel_credentials(self.tls_ca or "", self.tls_cert or "", self.tls_key or "")

    def ssl_context(self) -> ssl.SSLContext:
        """The data channel's client context (built once)."""
        if not self._ssl:
            self._ssl.append(client_context(self.tls_ca or "", self.tls_cert or "", self.tls_key or ""))
        return self._ssl[0]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a blocking channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        return _Details(d.method, d.timeout, list(d.metadata or ()) + list(self._metadata), d.credentials,
                        d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)


def blocking_channel(address: str, creds: Credentials) -> grpc.Channel:
    """A blocking channel to ``address``: TLS when ``creds.tls``, the token on every call."""
    if creds.tls:
        channel = grpc.secure_channel(address, creds.channel_credentials(), options=creds.channel_options())
    else:
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.intercept_channel(channel, BearerInterceptor(creds.metadata())) if creds.token else channel


def data_endpoint(info: pb.NodeInfoResponse, creds: Credentials, address: str) -> pb.DataEndpoint | None:
    """The data channel to dial, or None. A TLS client dials it with TLS (a
    node with a certificate speaks TLS on every port); a plaintext client is
    told when the node says its data channel is TLS."""
    endpoints = [e for e in info.data_endpoints if e.protocol == "kvs-tcp"]
    if not endpoints:
        return None
    if endpoints[0].tls and not creds.tls:
        raise Unavailable(f"node {address} speaks TLS on its data channel: pass tls_ca (the CA of its certificate)")
    return endpoints[0]


# ---- data channel frames --------------------------------------------------

class BlockingFrames:
    """A blocking socket of frames (the data channel, the shared-memory
    socket): exact reads that note whether any answer byte arrived, so a
    request on a connection the node closed while idle can be sent again."""

    _sock: "socket.socket | None" = None
    _got_reply: bool = False
    _what: str = "connection"

    def _recv_exact(self, view: memoryview) -> None:
        assert self._sock is not None
        while view.nbytes:
            n = self._sock.recv_into(view)
            if n == 0:
                raise ConnectionError(f"node closed the {self._what}")
            self._got_reply = True
            view = view[n:]


def put_frame(namespace: str, keys: Sequence[bytes], page_bytes: int, kind: int) -> bytes:
    header = pb.DataHeader(op=pb.DataHeader.PUT, namespace=namespace, keys=keys, page_bytes=page_bytes, kind=kind)
    return encode_header(header, len(keys) * page_bytes)


def get_frame(namespace: str, keys: Sequence[bytes], timeout: float | None = None, local_only: bool = False) -> bytes:
    deadline_ms = max(1, int(timeout * 1000)) if timeout else 0
    return encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace=namespace, keys=keys,
                                       deadline_ms=deadline_ms, local_only=local_only), 0)


def parse_result(header_bytes: bytes | bytearray) -> pb.DataHeader:
    header = decode_header(header_bytes)
    if header.op != pb.DataHeader.RESULT:
        raise Unavailable(f"data channel: expected RESULT, got op {header.op}")
    if header.code:
        raise error_for_code(header.code, header.message)
    return header


__all__ = ["BearerInterceptor", "Credentials", "blocking_channel", "data_endpoint", "BlockingFrames", "GetAssembler", "GetResult", "Lease", "PutResult", "decode_prefix", "page_views", "as_out", "put_messages",
           "check_get_batch",
           "translate", "put_frame", "get_frame", "parse_result"]
