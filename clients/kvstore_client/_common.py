"""What the sync and asyncio clients share: page buffers, results, errors,
chunking of gRPC messages and data-channel frames. No I/O here."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvstore.framing import decode_header, decode_prefix, encode_header
from kvstore.hostmem import populated_empty
from kvstore.node import MESSAGE_OVERHEAD, PutResult
from kvstore.errors import KvError, ResourceExhausted, Unavailable, error_for_code
from kvstore.rpc import CHANNEL_OPTIONS
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


__all__ = ["BlockingFrames", "GetAssembler", "GetResult", "Lease", "PutResult", "decode_prefix", "page_views", "as_out", "put_messages",
           "check_get_batch",
           "translate", "put_frame", "get_frame", "parse_result"]
