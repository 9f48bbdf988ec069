"""asyncio client: ``async with AsyncKvClient(addr) as kv: await kv.put(...)``.

Same calls, results and errors as :class:`kvstore_client.KvClient`; the data
channel uses the loop's ``sock_sendall``/``sock_recv_into`` on a
non-blocking socket (no stream buffering, no extra copies), or TLS over it
(:class:`kvstore.security.tls.TlsStream`) with ``tls_ca``; a ``token`` goes
on every gRPC call and as the data channel's HELLO. With ``data_path="shm"``
on the node's host pages move through shared memory: the blocking
:class:`~kvstore_client.shm.ShmConn` (memcpy plus a unix-socket round trip)
runs in a worker thread, one call at a time per client, so ``"auto"`` keeps
to the data channel: one connection by default, on which one loop's calls
take turns; with ``data_connections=N`` they run side by side on up to N
(a Get waiting on a remote pull then does not hold up a local read or a Put).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.framing import PREFIX, Conn, WireError, decode_prefix, hello_frame, open_client, sendall
from kvstore.security.tls import TlsStream
from kvstore.errors import InvalidArgument, KvError, Unavailable
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client._common import (
    GRPC_OPTIONS, Credentials, GetAssembler, data_endpoint, GetResult, Lease, PageData, PutResult, as_out, check_get_batch, found_views, get_frame,
    page_views, parse_result, put_frame, put_messages, translate,
)
from kvstore_client.shm import ShmConn


def _with(details: grpc.aio.ClientCallDetails, metadata: tuple[tuple[str, str], ...]) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(details.method, details.timeout, list(details.metadata or ()) + list(metadata),
                                      details.credentials, details.wait_for_ready)


def bearer_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``metadata`` (the bearer token) to every call of an asyncio channel."""

    class Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(_with(details, metadata), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(_with(details, metadata), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
            return await continuation(_with(details, metadata), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
            return await continuation(_with(details, metadata), requests)

    return [Unary(), UnaryStream(), StreamUnary(), StreamStream()]


class _AsyncDataConn:
    """One non-blocking connection to a node's data channel."""

    def __init__(self, host: str, port: int, timeout: float | None, creds: Credentials = Credentials()) -> None:
        self._addr = (host, port)
        self._timeout = timeout
        self._creds = creds
        self._sock: Conn | None = None
        self._lock = asyncio.Lock()
        self._got_reply = False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _socket(self) -> Conn:
        """The connection: TLS handshake (with ``tls_ca``) and HELLO (with a token) done."""
        if self._sock is None:
            loop = asyncio.get_running_loop()
            sock = socket.socket(socket.AF_INET6 if ":" in self._addr[0] else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self._addr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock = await open_client(loop, sock, self._creds.ssl_context() if self._creds.tls else None,
                                               self._creds.server_name or self._addr[0])
                if self._creds.token:
                    await sendall(loop, self._sock, hello_frame(self._creds.token))
                    await self._result()
                    self._got_reply = False  # the answer to come is the request's
            except BaseException:
                sock.close()
                self._sock = None
                raise
        return self._sock

    async def _recv_exact(self, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        sock = self._sock
        assert sock is not None
        while view.nbytes:
            n = await (sock.recv_into(loop, view) if sock.__class__ is TlsStream else loop.sock_recv_into(sock, view))
            if n == 0:
                raise ConnectionError("node closed the data channel")
            self._got_reply = True
            view = view[n:]

    async def _result(self) -> tuple[pb.DataHeader, int]:
        prefix = bytearray(PREFIX.size)
        await self._recv_exact(memoryview(prefix))
        header_len, payload_len = decode_prefix(prefix)
        body = bytearray(header_len)
        await self._recv_exact(memoryview(body))
        return parse_result(body), payload_len

    async def _exchange(self, frame: bytes, views: Sequence[memoryview], out: np.ndarray | None):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        sock = await self._socket()
        await sendall(loop, sock, frame)
        for view in views:
            await sendall(loop, sock, view)
        header, payload_len = await self._result()
        if out is None:
            return header
        found = np.array(header.found, dtype=bool)
        page_bytes = out.shape[1]
        if len(found) != out.shape[0] or header.page_bytes != page_bytes \
                or payload_len != int(found.sum()) * page_bytes:
            raise ConnectionError("reply does not match the request (namespace changed?)")
        for view in found_views(out, found):
            await self._recv_exact(view)
        return found

    async def request(self, frame: bytes, views: Sequence[memoryview], out: np.ndarray | None = None):  # type: ignore[no-untyped-def]
        """One request and its answer; a pooled connection the node closed
        while idle (``--idle-timeout``) is replaced once, as in the blocking client."""
        async with self._lock:
            for attempt in (0, 1):
                reused = self._sock is not None
                self._got_reply = False
                try:
                    return await asyncio.wait_for(self._exchange(frame, views, out), self._timeout)
                except KvError:
                    raise
                except (OSError, ValueError, WireError, asyncio.TimeoutError) as exc:
                    self.close()
                    if attempt == 0 and reused and not self._got_reply and not isinstance(exc, TimeoutError):
                        continue
                    raise Unavailable(f"data channel to {self._addr[0]}:{self._addr[1]} failed: {exc}") from None
                except asyncio.CancelledError:
                    self.close()  # a half-done frame leaves the channel out of step
                    raise
            raise AssertionError("unreachable")


class _DataPool:
    """Up to ``size`` data-channel connections to one node, one call on each at a time: concurrent
    calls of one loop run side by side (the node serves each connection on its own), so a Get that
    waits on a remote pull does not hold up a local read or a Put behind it. Connections open on
    demand and are kept for reuse."""

    def __init__(self, host: str, port: int, timeout: float | None, creds: Credentials, size: int) -> None:
        self._args = (host, port, timeout, creds)
        self._slots = asyncio.Semaphore(max(1, size))
        self._conns: list[_AsyncDataConn] = []  # every one opened
        self._idle: list[_AsyncDataConn] = []

    async def request(self, frame: bytes, views: Sequence[memoryview], out: np.ndarray | None = None):  # type: ignore[no-untyped-def]
        """:meth:`_AsyncDataConn.request` on an idle connection (a new one while fewer than ``size``
        are open; else the next one freed)."""
        async with self._slots:
            if self._idle:
                conn = self._idle.pop()
            else:
                conn = _AsyncDataConn(*self._args)
                self._conns.append(conn)
            try:
                return await conn.request(frame, views, out)
            finally:  # a connection that failed closed its socket and reconnects on its next call
                self._idle.append(conn)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


class AsyncKvClient:
    """asyncio kvstore client for one node."""

    def __init__(self, address: str, *, data_path: str = "auto", timeout: float | None = 60.0,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, server_name: str | None = None, data_connections: int = 1) -> None:
        if data_path not in ("auto", "grpc", "tcp", "shm"):
            raise ValueError("data_path must be auto, shm, tcp or grpc")
        if data_connections < 1:
            raise ValueError("data_connections must be >= 1")
        self._data_connections = data_connections
        self.address = address
        self.timeout = timeout
        self._data_path = data_path
        self._creds = creds = Credentials(tls_ca, tls_cert, tls_key, token, server_name)
        interceptors = bearer_interceptors(creds.metadata()) if creds.token else None
        if creds.tls:
            self._channel = grpc.aio.secure_channel(address, creds.channel_credentials(),
                                                    options=creds.channel_options(), interceptors=interceptors)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS, interceptors=interceptors)
        self._stub = pb_grpc.KvStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info: pb.NodeInfoResponse | None = None
        self._page_bytes: dict[str, int] = {}
        self._data: _DataPool | None = None
        self._shm: ShmConn | None = None
        self._shm_lock = asyncio.Lock()  # a ShmConn is one socket: one call at a time
        self._data_checked = False

    async def close(self) -> None:
        if self._data is not None:
            self._data.close()
        if self._shm is not None:
            async with self._shm_lock:
                self._shm.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncKvClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    async def wait_ready(self, timeout: float = 30.0) -> str:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                             wait_for_ready=True)
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def node_info(self) -> pb.NodeInfoResponse:
        if self._info is None:
            self._info = await self._call(self._stub.NodeInfo, pb.NodeInfoRequest())
        return self._info

    async def create_namespace(self, namespace: str, page_bytes: int, *, capacity: int = 0,
                               exist_ok: bool = False) -> pb.NamespaceInfo:
        info = await self._call(self._stub.CreateNamespace, pb.CreateNamespaceRequest(
            namespace=namespace, layout=pb.PageLayout(page_bytes=page_bytes), capacity_bytes=capacity,
            exist_ok=exist_ok))
        self._page_bytes[namespace] = info.layout.page_bytes
        return info

    async def page_bytes(self, namespace: str) -> int:
        if namespace not in self._page_bytes:
            info = await self._call(self._stub.DescribeNamespace, pb.DescribeNamespaceRequest(namespace=namespace))
            self._page_bytes[namespace] = info.layout.page_bytes
        return self._page_bytes[namespace]

    async def _data_conn(self) -> _DataPool | None:
        if self._data_path == "grpc":
            return None
        if not self._data_checked:
            info = await self.node_info()
            if self._data_path == "shm":  # asked for: "auto" stays on the data channel (below)
                shm = [e for e in info.data_endpoints if e.protocol == "kvs-shm"]
                if shm and ShmConn.usable(shm[0].path):
                    self._shm = ShmConn(shm[0].path, self.timeout, self._creds.token or "")
                elif self._data_path == "shm":
                    raise Unavailable(f"node {self.address} offers no shared-memory path this process can reach")
            endpoint = data_endpoint(info, self._creds, self.address)
            if endpoint is not None:
                host = self.address.rpartition(":")[0].strip("[]") or endpoint.host
                self._data = _DataPool(host, endpoint.port, self.timeout, self._creds, self._data_connections)
            elif self._data_path == "tcp":
                raise Unavailable(f"node {self.address} offers no data channel")
            self._data_checked = True
        return self._data

    async def put(self, namespace: str, keys: Sequence[bytes], pages: PageData, *,
                  kind: int = pb.PRIMARY) -> PutResult:
        keys = list(keys)
        try:
            views = page_views(pages, len(keys))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        conn = await self._data_conn()
        if (conn is not None or self._shm is not None) and keys:
            page_bytes = views[0].nbytes
            if any(v.nbytes != page_bytes for v in views):
                raise InvalidArgument("pages of one batch must all have the same size")
            if self._shm is not None:
                async with self._shm_lock:
                    return await asyncio.to_thread(self._shm.put, namespace, keys, views, page_bytes, kind)
            assert conn is not None
            reply = (await conn.request(put_frame(namespace, keys, page_bytes, kind), views)).put
            return PutResult(reply.stored, reply.already_present, reply.evicted)
        limit = (await self.node_info()).max_message_bytes
        try:
            reply = await self._stub.Put(put_messages(namespace, keys, views, kind, limit), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return PutResult(reply.stored, reply.already_present, reply.evicted)

    async def get(self, namespace: str, keys: Sequence[bytes], *, out: np.ndarray | None = None,
                  timeout: float | None = None, local_only: bool = False) -> GetResult:
        keys = list(keys)
        page_bytes = await self.page_bytes(namespace)
        check_get_batch(len(keys), page_bytes, await self.node_info())  # before allocating the output
        out = as_out(out, len(keys), page_bytes)
        conn = await self._data_conn()
        if self._shm is not None:
            async with self._shm_lock:
                found = await asyncio.to_thread(self._shm.get, namespace, keys, out, timeout, local_only)
            return GetResult(keys, found, out)
        if conn is not None:
            found = await conn.request(get_frame(namespace, keys, timeout, local_only), (), out)
            return GetResult(keys, found, out)
        pages = GetAssembler(keys, out)
        try:
            request = pb.GetRequest(namespace=namespace, keys=keys, local_only=local_only)
            async for msg in self._stub.Get(request, timeout=timeout or self.timeout):
                pages.add(msg)
        except grpc.RpcError as exc:
            if timeout and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return pages.result()  # the caller's deadline: what arrived, the rest missing
            raise translate(exc) from None
        return pages.result()

    async def lookup(self, namespace: str, keys: Sequence[bytes], *, record: bool = False) -> int:
        return (await self.lookup_nodes(namespace, keys, record=record)).prefix_length

    async def lookup_nodes(self, namespace: str, keys: Sequence[bytes], *, record: bool = False,
                           claim_seconds: float = 0.0) -> pb.LookupResponse:
        """See ``KvClient.lookup_nodes`` (``claim_seconds``: an in-flight prefill claim)."""
        return await self._call(self._stub.Lookup, pb.LookupRequest(namespace=namespace, keys=list(keys),
                                                                    record=record, claim_seconds=claim_seconds))

    async def lookup_lease(self, namespace: str, keys: Sequence[bytes], *, ttl: float, lease_id: str = "",
                           record: bool = False, claim_seconds: float = 0.0) -> pb.LookupResponse:
        """One call that looks up and leases (see ``KvClient.lookup_lease``; ``claim_seconds``: an
        in-flight prefill claim, made on the first call of a ``lease_id`` only)."""
        return await self._call(self._stub.Lookup, pb.LookupRequest(
            namespace=namespace, keys=list(keys), record=record, lease_ttl_seconds=ttl, lease_id=lease_id,
            claim_seconds=claim_seconds))

    async def exists(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        reply = await self._call(self._stub.Exists, pb.KeysRequest(namespace=namespace, keys=list(keys)))
        return list(reply.exists)

    async def delete(self, namespace: str, keys: Sequence[bytes]) -> pb.DeleteResponse:
        return await self._call(self._stub.Delete, pb.KeysRequest(namespace=namespace, keys=list(keys)))

    async def pin(self, namespace: str, keys: Sequence[bytes], ttl: float) -> Lease:
        reply = await self._call(self._stub.Pin, pb.PinRequest(namespace=namespace, keys=list(keys),
                                                               ttl_seconds=ttl))
        return Lease(reply.lease_id, list(reply.pinned_keys), list(reply.missing_keys), reply.expires_in_seconds)

    async def unpin(self, namespace: str, lease: Lease | str) -> int:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        reply = await self._call(self._stub.Unpin, pb.UnpinRequest(namespace=namespace, lease_id=lease_id))
        return reply.released

    async def stats(self, namespace: str = "") -> pb.StatsResponse:
        return await self._call(self._stub.Stats, pb.StatsRequest(namespace=namespace))
