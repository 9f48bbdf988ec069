"""Peer transport over plain asyncio TCP, framed like the data channel.

For machines without UCX. Uses ``sock_recv_into``/``sock_sendall`` on raw
non-blocking sockets (no stream buffering); the payload of a pull is one
contiguous host buffer, received in place. Connections are pooled per peer
so concurrent pulls from one peer run side by side.

Security, both ends optional: with ``server_tls``/``client_tls`` every
connection runs TLS (:class:`~kvstore.security.tls.TlsStream`; the puller
verifies the peer's certificate against its transport endpoint's host and
presents its own node certificate), and with ``prove``/``verify`` (the
cluster secret) every connection opens with a HELLO frame carrying a fresh
proof; the server answers any other first frame with UNAUTHENTICATED, so a
raw GET without credentials reads nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

import numpy as np

import grpc

from kvstore.errors import KvError
from kvstore.framing import (
    ChannelClosed, Conn, Stalled, WireError, accept_loop, check_pull, encode_header, expect_hello, hello, listen,
    open_client, open_served, read_frame, recv_exact, refuse, reply_error, sendall, skip_hello,
)
from kvstore.transport.base import AllocFn, ServeFn, Transport, TransportError, resolve_served
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]


class TcpTransport(Transport):
    """Pulls over pooled TCP connections; serves pulls on one listener."""

    name = "tcp"
    device_buffers = False  # payloads travel through host memory
    scatter = True  # send from / receive into page views in place (no pack, no unpack)

    def __init__(self, max_idle_per_peer: int = 4, *, server_tls: Callable[[], ssl.SSLContext] | None = None,
                 client_tls: Callable[[], ssl.SSLContext] | None = None, prove: Callable[[], str] | None = None,
                 verify: Callable[[str], Any] | None = None) -> None:
        """``server_tls``/``client_tls``: the current TLS contexts (per
        connection, so new files apply to new connections); ``prove()``: a
        fresh HELLO token for each connection this node opens; ``verify(token)``
        raises Unauthenticated unless a connection's HELLO token is valid."""
        self._server_tls, self._client_tls = server_tls, client_tls
        self._prove, self._verify = prove, verify
        self._listener: socket.socket | None = None
        self._endpoint: pb.TransportEndpoint | None = None
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._busy: set[Conn] = set()
        self._served: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_idle = max_idle_per_peer

    # ---- serving ---------------------------------------------------------
    async def start(self, host: str, port: int, serve: ServeFn) -> pb.TransportEndpoint:
        if self._endpoint is not None:
            return self._endpoint
        self._listener = sock = listen(host, port)
        self._endpoint = pb.TransportEndpoint(kind="tcp", host=host, port=sock.getsockname()[1])
        self._spawn(accept_loop(sock, lambda conn: self._accepted(conn, serve)))
        return self._endpoint

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accepted(self, conn: socket.socket, serve: ServeFn) -> None:
        if len(self._served) >= self.limits.max_connections:
            if self._server_tls is not None:
                conn.close()  # no plaintext frame before the handshake
                return
            refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, "tcp transport: too many connections")
            return
        self._served.add(conn)
        self._spawn(self._serve(conn, serve))

    async def _serve(self, sock: socket.socket, serve: ServeFn) -> None:
        loop = asyncio.get_running_loop()
        conn: Conn = sock
        try:
            try:
                conn = await open_served(loop, sock, self._server_tls() if self._server_tls else None, self.limits)
                if self._verify is not None:
                    await expect_hello(loop, conn, self.limits, self._verify)
            except ChannelClosed as exc:
                log.info("tcp transport: refused a connection: %s", exc)
                return
            while True:
                try:
                    request, payload_len = await read_frame(loop, conn, self.limits)
                except ChannelClosed:
                    return
                if request.op == pb.DataHeader.HELLO and not payload_len and self._verify is None:
                    await skip_hello(loop, conn)
                    continue
                check_pull(request, payload_len)
                served = await resolve_served(serve(request))
                try:
                    views = _views(served.payload)
                    await sendall(loop, conn, encode_header(served.header, sum(v.nbytes for v in views)))
                    for view in views:
                        await sendall(loop, conn, view)
                finally:
                    served.release()
        except WireError as exc:  # a bad or stalled request: answered, then closed
            log.info("tcp transport: closing served connection: %s", exc)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, Stalled) else grpc.StatusCode.INVALID_ARGUMENT
            await reply_error(loop, conn, code, str(exc), self.limits.read_timeout)
        except (ChannelClosed, OSError) as exc:
            log.debug("tcp transport: closing served connection: %s", exc)
        finally:
            self._served.discard(sock)
            sock.close()

    # ---- pulling ---------------------------------------------------------
    async def _connect(self, addr: tuple[str, int]) -> Conn:
        """A pooled connection to ``addr``, or a new one (TLS handshake and
        HELLO done, as configured; both bounded by ``limits.read_timeout``)."""
        idle = self._idle.get(addr)
        if idle:
            return idle.pop()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            timeout = self.limits.read_timeout or 30.0
            conn = await open_client(loop, sock, self._client_tls() if self._client_tls else None, addr[0], timeout)
            if self._prove is not None:
                await hello(loop, conn, self._prove(), timeout)
        except BaseException:
            sock.close()
            raise
        return conn

    async def fetch(self, endpoint: pb.TransportEndpoint, request: pb.DataHeader,
                    alloc: AllocFn) -> tuple[pb.DataHeader, Any]:
        loop = asyncio.get_running_loop()
        addr = (endpoint.host, endpoint.port)
        sock: Conn | None = None
        try:
            sock = await self._connect(addr)
            self._busy.add(sock)
            await sendall(loop, sock, encode_header(request, 0))
            reply, payload_len = await read_frame(loop, sock)
            if reply.code == _UNAUTHENTICATED:  # the peer closes the connection after this answer
                raise WireError(f"refused: {reply.message}")
            found = sum(reply.found)
            if payload_len != found * reply.page_bytes or reply.op != pb.DataHeader.RESULT:
                raise WireError(f"reply of {payload_len} bytes for {found} pages of {reply.page_bytes}")
            payload = None
            if found:
                payload = alloc(found, reply.page_bytes, reply)
                for view in _views(payload):
                    await recv_exact(loop, sock, view)
        except (OSError, WireError, ChannelClosed, TimeoutError, KvError) as exc:  # ssl.SSLError is an OSError; KvError: HELLO refused
            self._drop(sock)
            raise TransportError(f"tcp pull from {addr[0]}:{addr[1]} failed: {exc}") from None
        except BaseException:  # cancelled mid-frame: the connection is out of step
            self._drop(sock)
            raise
        self._busy.discard(sock)
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self._max_idle:
            idle.append(sock)
        else:
            sock.close()
        return reply, payload

    def _drop(self, sock: Conn | None) -> None:
        if sock is not None:
            self._busy.discard(sock)
            sock.close()

    def forget(self, endpoint: pb.TransportEndpoint) -> None:
        for sock in self._idle.pop((endpoint.host, endpoint.port), []):
            sock.close()

    def connections(self) -> int:
        return len(self._busy) + sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conns in self._idle.values():
            for sock in conns:
                sock.close()
        self._idle.clear()
        for sock in list(self._busy) + list(self._served):
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _views(payload: Any) -> list[memoryview]:
    """Flat byte views of a payload: an array (downloaded if on a device)
    or a list of page views."""
    if payload is None:
        return []
    if isinstance(payload, list):
        return [memoryview(v).cast("B") if memoryview(v).format != "B" or memoryview(v).ndim != 1
                else memoryview(v) for v in payload]
    host = payload if isinstance(payload, np.ndarray) else payload.get()  # CuPy
    return [memoryview(np.ascontiguousarray(host)).cast("B")]
