"""Node side of the data channel: PUT/GET frames on raw non-blocking sockets.

Uses ``loop.sock_recv_into``/``loop.sock_sendall`` rather than asyncio
streams: measured on this kind of machine, streams' ``readexactly`` moves
~0.5 GB/s while ``sock_recv_into`` into a preallocated buffer moves ~3.5 GB/s.

Bytes move through the pool's movement API only: a PUT reserves slots chunk
by chunk, each once its first byte has arrived (``PutBatch.write_in``), and
the chunks grow from one page (doubling up to ~4 MiB) so the slots reserved
ahead of the bytes that arrived are never more than those bytes plus one
page: a header alone reserves nothing, a stalled sender holds one page. The
bytes land in the slots (host pool) or in staging that the unpack kernel
scatters (device pool). The whole PUT must arrive within
``--transfer-timeout``, and no gap between bytes may exceed
``--read-timeout``, or it aborts and frees its slots. A GET sends
``PagePool.read_out``'s views.

Limits (:func:`kvstore.framing.server_limits`): at most ``--max-connections``
connections (one more gets an error frame and is closed), headers capped
before they are read, idle connections closed after ``--idle-timeout``.
Every malformed or stalled frame is answered with an error frame, then the
connection is closed; the node keeps serving.

Security: with a TLS context (``tls``, the node's certificate, reloaded by
:class:`~kvstore.security.tls.ReloadingContext`) every connection starts
with a TLS handshake and then runs over a
:class:`~kvstore.security.tls.TlsStream`: the same frame code, decrypting
into the slots. With ``authenticate`` (the node's token store), its first
frame must be a HELLO whose token it accepts; the principal it returns is
the connection's caller, asked for again at every request (a token rotated
out of the file ends the connection): a PUT needs its ``write`` role, a GET
``read``, and names are the tenant's
(:func:`~kvstore.security.tokens.namespace_for`), as on gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.cluster.replicator import Replicator
from kvstore.errors import InvalidArgument, KvError, ResourceExhausted, shown
from kvstore.framing import (
    ChannelClosed, Conn, Stalled, WireError, accept_loop, drain, encode_header, expect_hello, listen, open_served,
    read_frame, recv_exact, refuse, reply_error, send_views, sendall, server_limits, skip_hello,
)
from kvstore.hostmem import populated_empty
from kvstore.metrics import NodeMetrics
from kvstore.node import Namespace, Node, PutBatch, page_kind
from kvstore.pool.movement import SOCKET
from kvstore.pool.pool import PageKind
from kvstore.security.tokens import Principal, namespace_for
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.tracing import TRACER, SpanKind, context_from

log = logging.getLogger(__name__)
_DRAIN_CHUNK = 1 << 20
_CHUNK_BYTES = 4 << 20  # a PUT reserves slots for about this many bytes at a time


class DataServer:
    """Accepts data-channel connections and serves frames in order."""

    def __init__(self, node: Node, metrics: NodeMetrics, reader: Replicator, host: str, port: int, *,
                 tls: Callable[[], ssl.SSLContext] | None = None,
                 authenticate: Callable[[str], Any] | None = None) -> None:
        self._node = node
        self._tls = tls  # the current server context, per accepted connection (reloads)
        self._authenticate = authenticate
        self._reader = reader
        self._metrics = metrics
        self._host, self._port = host, port
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[socket.socket] = set()
        self._scratch = bytearray(_DRAIN_CHUNK)
        self._limits = server_limits(node.config)

    @property
    def port(self) -> int:
        assert self._sock is not None, "not started"
        return self._sock.getsockname()[1]

    async def start(self) -> None:
        if self._sock is not None:
            return
        self._sock = listen(self._host, self._port)
        self._spawn(accept_loop(self._sock, self._accepted))

    async def stop(self) -> None:
        """Stop accepting, close connections, wait for handlers."""
        if self._sock is None:
            return
        self._sock.close()
        for conn in list(self._conns):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock = None

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accepted(self, conn: socket.socket) -> None:
        if len(self._conns) >= self._limits.max_connections:
            self._metrics.ops.labels("connect", "RESOURCE_EXHAUSTED").inc()
            if self._tls is not None:  # no plaintext frame before the handshake
                conn.close()
                return
            refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"data channel: {len(self._conns)} connections open, the limit (--max-connections)")
            return
        self._conns.add(conn)
        self._spawn(self._serve(conn))

    async def _open(self, loop: asyncio.AbstractEventLoop,
                    sock: socket.socket) -> tuple[Conn, Callable[[], Any]] | None:
        """TLS handshake and HELLO, as configured: (connection, a function that
        gives the caller's principal now), or None when the caller failed either
        (answered, where it can be). The principal is asked for again at every
        request, so a token rotated out of the file stops an open connection too."""
        try:
            conn = await open_served(loop, sock, self._tls() if self._tls else None, self._limits)
            if self._authenticate is None:
                return conn, lambda: None
            authenticate, hello = self._authenticate, [""]

            def first(token: str) -> Any:
                hello[0] = token
                return authenticate(token)

            await expect_hello(loop, conn, self._limits, first)
        except ChannelClosed as exc:
            self._metrics.ops.labels("connect", "UNAUTHENTICATED").inc()
            log.info("data channel: refused a connection: %s", exc)
            return None
        return conn, lambda: authenticate(hello[0])

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn: Conn = sock
        try:
            opened = await self._open(loop, sock)
            if opened is None:
                return
            conn, caller = opened
            while True:
                try:
                    header, payload_len = await read_frame(loop, conn, self._limits)
                except ChannelClosed:
                    return  # clean end or idle between frames (or mid-frame: nothing was reserved yet)
                if header.op in (pb.DataHeader.PUT, pb.DataHeader.GET):
                    try:
                        principal = caller()
                    except KvError as exc:  # its token was rotated out: answered, then closed
                        self._metrics.ops.labels("connect", "UNAUTHENTICATED").inc()
                        await self._reply_error(loop, conn, exc.code, str(exc))
                        return
                if header.op == pb.DataHeader.PUT:
                    await self._put(loop, conn, header, payload_len, principal)
                elif header.op == pb.DataHeader.GET and payload_len == 0:
                    await self._get(loop, conn, header, principal)
                elif header.op == pb.DataHeader.HELLO and payload_len == 0 and self._authenticate is None:
                    await skip_hello(loop, conn)
                else:
                    raise WireError(f"unexpected op {header.op} with {payload_len} payload bytes")
        except Stalled as exc:
            log.info("data channel: closing a stalled connection: %s", exc)
            await self._reply_error(loop, conn, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except WireError as exc:
            log.info("data channel: closing connection: %s", exc)
            await self._reply_error(loop, conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (ChannelClosed, ConnectionError):
            pass
        except Exception:  # a bug, not the peer's input: logged, answered, closed; the node keeps serving
            log.exception("data channel: unexpected error; closing the connection")
            await self._reply_error(loop, conn, grpc.StatusCode.INTERNAL, "internal error (logged by the node)")
        finally:
            self._conns.discard(sock)
            sock.close()

    async def _put(self, loop: asyncio.AbstractEventLoop, conn: Conn, header: pb.DataHeader, payload_len: int,
                   principal: Principal | None = None) -> None:
        """One PUT frame; ``principal``: the caller HELLO authenticated (None without tokens)."""
        start = time.perf_counter()
        keys = list(header.keys)
        try:
            if payload_len != len(keys) * header.page_bytes:
                raise WireError(f"payload of {payload_len} bytes for {len(keys)} pages of {header.page_bytes}")
            if payload_len > self._node.config.max_batch_bytes:
                raise ResourceExhausted(f"batch of {payload_len} bytes is over the limit of "
                                        f"{self._node.config.max_batch_bytes}; split it")
            kind = page_kind(header.kind, PageKind.PRIMARY)
            name = namespace_for(principal, header.namespace, "write")  # the tenant's, with tokens
            ns = self._node.namespace(name)
            if header.page_bytes != ns.layout.page_bytes:
                raise InvalidArgument(f"pages of {header.page_bytes} bytes; namespace {shown(ns.name)} pages are "
                                      f"{ns.layout.page_bytes} bytes")
            batch = self._node.begin_put(name, kind)
        except KvError as exc:
            await self._drain(loop, conn, payload_len)
            await self._refuse(loop, conn, exc)
            return
        try:
            async with asyncio.timeout(batch.time_left()):
                refused = await self._receive(loop, conn, batch, keys, header.page_bytes)
            if refused is not None:
                await self._refuse(loop, conn, refused)
                return
            result = batch.commit()
        except TimeoutError:
            self._metrics.ops.labels("put", "DEADLINE_EXCEEDED").inc()
            await self._reply_error(loop, conn, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the PUT's {payload_len} bytes did not arrive within "
                                    f"{self._node.config.transfer_timeout:g} s; its slots were freed")
            raise ChannelClosed("put deadline") from None  # mid-frame: the connection is out of step
        finally:
            batch.abort()  # no-op after commit; frees slots if the peer vanished or was too slow
        self._metrics.ops.labels("put", "OK").inc()
        self._metrics.bytes.labels("put", "data").inc(payload_len)
        self._metrics.latency.labels("put", "data").observe(time.perf_counter() - start)
        reply = pb.DataHeader(op=pb.DataHeader.RESULT, put=pb.PutResponse(
            stored=result.stored, already_present=result.already_present, evicted=result.evicted))
        await sendall(loop, conn, encode_header(reply, 0))

    async def _receive(self, loop: asyncio.AbstractEventLoop, conn: Conn, batch: PutBatch,
                       keys: list[bytes], page_bytes: int) -> KvError | None:
        """Receive a PUT's pages chunk by chunk; each chunk's slots are
        reserved only once its first byte is here, and chunks grow from one
        page, doubling, so what is reserved ahead never exceeds what arrived
        plus one page. A refusal (no room, bad keys) drains the rest of the
        frame and is returned, not raised."""
        most = max(1, _CHUNK_BYTES // page_bytes)
        stall = self._limits.read_timeout
        first = memoryview(bytearray(1))
        i, size = 0, 1
        while i < len(keys):
            chunk = keys[i:i + size]
            await recv_exact(loop, conn, first, stall)  # the chunk's bytes are arriving: now reserve
            try:
                landing = batch.write_in(chunk, SOCKET)
            except KvError as exc:
                await self._drain(loop, conn, (len(keys) - i) * page_bytes - 1)
                return exc
            try:
                targets = landing.targets
                targets[0][0:1] = first
                await recv_exact(loop, conn, targets[0][1:], stall)
                for view in targets[1:]:
                    await recv_exact(loop, conn, view, stall)
                landing.finish()
            finally:
                landing.abandon()  # no-op once finished
            i, size = i + len(chunk), min(most, size * 2)
        return None

    async def _get(self, loop: asyncio.AbstractEventLoop, conn: Conn, header: pb.DataHeader,
                   principal: Principal | None = None) -> None:
        with TRACER.start_as_current_span("kvstore.get", context=context_from(header.traceparent),
                                          kind=SpanKind.SERVER, attributes={"kvstore.path": "data"}):
            await self._serve_get(loop, conn, header, principal)

    async def _serve_get(self, loop: asyncio.AbstractEventLoop, conn: Conn, header: pb.DataHeader,
                         principal: Principal | None) -> None:
        start = time.perf_counter()
        # leave part of the caller's deadline to send what we have
        share = self._node.config.deadline_share
        timeout = share * header.deadline_ms / 1000 if header.deadline_ms else None
        try:
            ns, handle, fetched = await self._reader.read(namespace_for(principal, header.namespace, "read"),
                                                          list(header.keys), timeout, header.local_only)
        except KvError as exc:
            await self._refuse(loop, conn, exc, op="get")
            return
        page_bytes = ns.layout.page_bytes
        keys = list(header.keys)
        try:
            left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - start))
            tiered = await self._from_tiers(ns, [k for k, hit in zip(keys, handle.found) if not hit], left)
            found = [hit or k in tiered for k, hit in zip(keys, handle.found)]
            out = ns.pool.read_out(handle, SOCKET)
            try:
                pooled = iter(out.payload or [])
                views = [next(pooled) if hit else tiered[k] for k, hit in zip(keys, handle.found) if hit or k in tiered]
                reply = pb.DataHeader(op=pb.DataHeader.RESULT, found=found, page_bytes=page_bytes)
                await send_views(loop, conn, reply, views)
            finally:
                out.release()
        finally:
            self._reader.end_read(ns, handle, fetched)
        hits = sum(found)
        self._metrics.count_get("data", hits, len(found) - hits, page_bytes, time.perf_counter() - start)

    async def _from_tiers(self, ns: Namespace, missing: list[bytes], timeout: float | None) -> dict[bytes, memoryview]:
        """The pages of ``missing`` (a Get's keys, repeats included, that its pool did not have) its tiers hold,
        read straight from there (``NamespaceTiers.serve_into``) into one buffer of those pages: the reply's
        header says which keys it answers before the first page is sent, so they are all read first."""
        below = ns.below
        if below is None or not missing:
            return {}
        wanted = below.unpromoted(missing, timeout)
        if not wanted:
            return {}
        rows = populated_empty(len(wanted), ns.layout.page_bytes)
        ok = await below.serve_into(wanted, rows, timeout)
        got = {key: memoryview(rows[i]) for i, key in enumerate(wanted) if ok[i]}
        n = sum(1 for k in missing if k in got)
        ns.counters.hits += n
        ns.counters.misses -= n
        return got

    async def _drain(self, loop: asyncio.AbstractEventLoop, conn: Conn, nbytes: int) -> None:
        """Read and drop ``nbytes`` so the connection stays in step."""
        if nbytes > self._node.config.max_batch_bytes + _DRAIN_CHUNK:
            raise WireError(f"refusing to drain {nbytes} bytes")
        await drain(loop, conn, nbytes, memoryview(self._scratch), self._limits.read_timeout)

    async def _refuse(self, loop: asyncio.AbstractEventLoop, conn: Conn, exc: KvError,
                      op: str = "put") -> None:
        self._metrics.ops.labels(op, exc.code.name).inc()
        await self._reply_error(loop, conn, exc.code, str(exc))

    async def _reply_error(self, loop: asyncio.AbstractEventLoop, conn: Conn,
                           code: grpc.StatusCode, message: str) -> None:
        await reply_error(loop, conn, code, message, self._limits.read_timeout)

