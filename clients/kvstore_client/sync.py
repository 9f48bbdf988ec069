"""Blocking client: ``with KvClient("127.0.0.1:7400") as kv: kv.put(...)``.

Control calls go over gRPC. Put/Get bytes go through shared memory when the
client runs on the node's host and the node offers it (``data_path="auto"`` or
``"shm"``), else over the node's data channel when it advertises one, else
over gRPC streams; all give the same results and errors.

Security: with ``tls_ca`` the gRPC channel and the data channel speak TLS
(the node's certificate verified against ``tls_ca`` and for the host
dialled, or ``server_name``); ``tls_cert``/``tls_key`` add a client
certificate (mTLS). ``token`` goes as ``authorization: Bearer`` on every
gRPC call and as the data channel's HELLO.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.framing import PREFIX, WireError, decode_prefix, hello_frame
from kvstore.errors import InvalidArgument, KvError, Unavailable
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client.shm import ShmConn
from kvstore_client._common import (
    BlockingFrames, Credentials, blocking_channel, data_endpoint, GetAssembler, GetResult, Lease, PageData, PutResult, as_out, check_get_batch, found_views, get_frame,
    page_views, parse_result, put_frame, put_messages, translate,
)

T = TypeVar("T")


class _DataConn(BlockingFrames):
    """One blocking connection to a node's data channel (reconnects lazily)."""

    _what = "data channel"

    def __init__(self, host: str, port: int, timeout: float | None, creds: Credentials = Credentials()) -> None:
        self._addr = (host, port)
        self._timeout = timeout
        self._creds = creds
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._got_reply = False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        """The connection: TLS handshake (with ``tls_ca``) and HELLO (with a
        token) done; a HELLO refusal is raised as its typed error."""
        if self._sock is None:
            sock = socket.create_connection(self._addr, timeout=self._timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._creds.tls:
                    sock = self._creds.ssl_context().wrap_socket(
                        sock, server_hostname=self._creds.server_name or self._addr[0])
                self._sock = sock
                if self._creds.token:
                    sock.sendall(hello_frame(self._creds.token))
                    self._result()
                    self._got_reply = False  # the answer to come is the request's
            except BaseException:
                sock.close()
                self._sock = None
                raise
        return self._sock

    def _result(self) -> tuple[pb.DataHeader, int]:
        prefix = bytearray(PREFIX.size)
        self._recv_exact(memoryview(prefix))
        header_len, payload_len = decode_prefix(prefix)
        body = bytearray(header_len)
        self._recv_exact(memoryview(body))
        return parse_result(body), payload_len

    def _exchange(self, send: "Callable[[socket.socket], None]", receive: "Callable[[], T]") -> T:
        """One request and its answer. A pooled connection the node closed
        while it sat idle (``--idle-timeout``) fails before any answer byte:
        that request is sent once more on a fresh connection (a Put or Get
        may repeat: keys name content)."""
        with self._lock:
            for attempt in (0, 1):
                reused = self._sock is not None
                self._got_reply = False
                try:
                    send(self._socket())
                    return receive()
                except KvError:
                    raise
                except (OSError, ValueError, WireError) as exc:
                    self.close()
                    if attempt == 0 and reused and not self._got_reply and not isinstance(exc, TimeoutError):
                        continue
                    raise Unavailable(f"data channel to {self._addr[0]}:{self._addr[1]} failed: {exc}") from None
            raise AssertionError("unreachable")

    def put(self, frame: bytes, views: Sequence[memoryview], whole: memoryview | None) -> pb.DataHeader:
        def send(sock: socket.socket) -> None:
            sock.sendall(frame)
            if whole is not None:
                sock.sendall(whole)
            else:
                for view in views:
                    sock.sendall(view)

        return self._exchange(send, lambda: self._result()[0])

    def get(self, frame: bytes, out: np.ndarray) -> np.ndarray:
        def receive() -> np.ndarray:
            header, payload_len = self._result()
            found = np.array(header.found, dtype=bool)
            page_bytes = out.shape[1]
            if len(found) != out.shape[0] or header.page_bytes != page_bytes \
                    or payload_len != int(found.sum()) * page_bytes:
                self.close()
                raise Unavailable("data channel: reply does not match the request (namespace changed?)")
            for view in found_views(out, found):
                self._recv_exact(view)
            return found

        return self._exchange(lambda sock: sock.sendall(frame), receive)


def _lease_request(namespace: str, keys: Sequence[bytes], ttl: float, lease_id: str,
                   record: bool, claim_seconds: float = 0.0) -> pb.LookupRequest:
    return pb.LookupRequest(namespace=namespace, keys=list(keys), record=record, lease_ttl_seconds=ttl,
                            lease_id=lease_id, claim_seconds=claim_seconds)


class LookupFuture:
    """A leasing Lookup in flight (:meth:`KvClient.lookup_lease_future`)."""

    def __init__(self, call: grpc.Future) -> None:
        self._call = call

    def done(self) -> bool:
        return self._call.done()

    def result(self, timeout: float | None = None) -> pb.LookupResponse:
        """The reply; a failed call raises its typed :class:`KvError`."""
        try:
            return self._call.result(timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable("lookup still in flight") from None
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def cancel(self) -> bool:
        return self._call.cancel()


class KvClient:
    """Blocking kvstore client for one node."""

    def __init__(self, address: str, *, data_path: str = "auto", timeout: float | None = 60.0,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, server_name: str | None = None) -> None:
        if data_path not in ("auto", "grpc", "tcp", "shm"):
            raise ValueError("data_path must be auto, shm, tcp or grpc")
        self.address = address
        self.timeout = timeout
        self._data_path = data_path
        self._creds = Credentials(tls_ca, tls_cert, tls_key, token, server_name)
        self._channel = blocking_channel(address, self._creds)
        self._stub = pb_grpc.KvStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info: pb.NodeInfoResponse | None = None
        self._page_bytes: dict[str, int] = {}
        self._data: _DataConn | None = None
        self._data_checked = False
        self._shm: ShmConn | None = None

    # ---- lifecycle -------------------------------------------------------
    def close(self) -> None:
        if self._data is not None:
            self._data.close()
        if self._shm is not None:
            self._shm.close()
        self._channel.close()

    def __enter__(self) -> "KvClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method, request, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except grpc.RpcError as exc:
            raise translate(exc) from None

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Block until the node answers its health check; returns the status."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                       wait_for_ready=True)
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def health(self, service: str = "") -> str:
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def node_info(self) -> pb.NodeInfoResponse:
        if self._info is None:
            self._info = self._call(self._stub.NodeInfo, pb.NodeInfoRequest())
        return self._info

    # ---- namespaces --------------------------------------------------------
    def create_namespace(self, namespace: str, page_bytes: int, *, capacity: int = 0, exist_ok: bool = False,
                         block_tokens: int = 0, num_layers: int = 0, kv_heads: int = 0, head_dim: int = 0,
                         dtype: int = 0) -> pb.NamespaceInfo:
        layout = pb.PageLayout(page_bytes=page_bytes, block_tokens=block_tokens, num_layers=num_layers,
                               kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        info = self._call(self._stub.CreateNamespace, pb.CreateNamespaceRequest(
            namespace=namespace, layout=layout, capacity_bytes=capacity, exist_ok=exist_ok))
        self._page_bytes[namespace] = info.layout.page_bytes
        return info

    def describe_namespace(self, namespace: str) -> pb.NamespaceInfo:
        info = self._call(self._stub.DescribeNamespace, pb.DescribeNamespaceRequest(namespace=namespace))
        self._page_bytes[namespace] = info.layout.page_bytes
        return info

    def list_namespaces(self) -> list[pb.NamespaceInfo]:
        return list(self._call(self._stub.ListNamespaces, pb.ListNamespacesRequest()).namespaces)

    def delete_namespace(self, namespace: str) -> None:
        self._call(self._stub.DeleteNamespace, pb.DeleteNamespaceRequest(namespace=namespace))
        self._page_bytes.pop(namespace, None)

    def page_bytes(self, namespace: str) -> int:
        if namespace not in self._page_bytes:
            self.describe_namespace(namespace)
        return self._page_bytes[namespace]

    # ---- pages -------------------------------------------------------------
    def _data_conn(self) -> _DataConn | None:
        if self._data_path == "grpc":
            return None
        if not self._data_checked:
            if self._data_path in ("auto", "shm"):
                shm = [e for e in self.node_info().data_endpoints if e.protocol == "kvs-shm"]
                if shm and ShmConn.usable(shm[0].path):
                    self._shm = ShmConn(shm[0].path, self.timeout, self._creds.token or "")
                elif self._data_path == "shm":
                    raise Unavailable(f"node {self.address} offers no shared-memory path this process can reach")
            endpoint = data_endpoint(self.node_info(), self._creds, self.address)
            if endpoint is not None:
                host = self.address.rpartition(":")[0].strip("[]") or endpoint.host
                self._data = _DataConn(host, endpoint.port, self.timeout, self._creds)
            elif self._data_path == "tcp":
                raise Unavailable(f"node {self.address} offers no data channel")
            self._data_checked = True
        return self._data

    def put(self, namespace: str, keys: Sequence[bytes], pages: PageData, *, kind: int = pb.PRIMARY) -> PutResult:
        """Store pages (one batch: all stored, or none and an error)."""
        keys = list(keys)
        try:
            views = page_views(pages, len(keys))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        conn = self._data_conn()
        if (conn is not None or self._shm is not None) and keys:
            page_bytes = views[0].nbytes
            if any(v.nbytes != page_bytes for v in views):
                raise InvalidArgument("pages of one batch must all have the same size")
            if self._shm is not None:
                return self._shm.put(namespace, keys, views, page_bytes, kind)
            whole = None
            if isinstance(pages, np.ndarray) and pages.flags.c_contiguous:
                whole = memoryview(pages).cast("B")
            reply = conn.put(put_frame(namespace, keys, page_bytes, kind), views, whole).put
            return PutResult(reply.stored, reply.already_present, reply.evicted)
        limit = self.node_info().max_message_bytes
        try:
            reply = self._stub.Put(put_messages(namespace, keys, views, kind, limit), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise translate(exc) from None
        return PutResult(reply.stored, reply.already_present, reply.evicted)

    def get(self, namespace: str, keys: Sequence[bytes], *, out: np.ndarray | None = None,
            timeout: float | None = None, local_only: bool = False) -> GetResult:
        """Fetch pages; missing keys are reported in the result, not raised.

        Pages this node lacks are pulled from peers that hold them (unless
        ``local_only``). With ``timeout``, the node stops waiting for peers
        in time to answer with what it has, so the caller can recompute the
        rest instead of waiting.
        """
        keys = list(keys)
        page_bytes = self.page_bytes(namespace)
        check_get_batch(len(keys), page_bytes, self.node_info())  # before allocating the output
        out = as_out(out, len(keys), page_bytes)
        conn = self._data_conn()
        if self._shm is not None:
            return GetResult(keys, self._shm.get(namespace, keys, out, timeout, local_only), out)
        if conn is not None:
            found = conn.get(get_frame(namespace, keys, timeout, local_only), out)
            return GetResult(keys, found, out)
        pages = GetAssembler(keys, out)
        try:
            request = pb.GetRequest(namespace=namespace, keys=keys, local_only=local_only)
            for msg in self._stub.Get(request, timeout=timeout or self.timeout):
                pages.add(msg)
        except grpc.RpcError as exc:
            if timeout and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return pages.result()  # the caller's deadline: what arrived, the rest missing
            raise translate(exc) from None
        return pages.result()

    def lookup(self, namespace: str, keys: Sequence[bytes], *, record: bool = False) -> int:
        """Length of the longest prefix of the key chain cached on this node.

        ``record=True`` marks the lookup as a request served by this node
        (the engine's call at request start): the coordinator's burst
        predictor learns from these."""
        return self.lookup_nodes(namespace, keys, record=record).prefix_length

    def lookup_nodes(self, namespace: str, keys: Sequence[bytes], *, record: bool = False,
                     claim_seconds: float = 0.0) -> pb.LookupResponse:
        """The local prefix length and, per live node, its prefix length with
        placement hints (``pending``: a speculative copy is on its way;
        ``expires_in_seconds``: a speculative replica's remaining life;
        ``computing``: another request is prefilling it, ready in about
        ``ready_in_seconds``). ``claim_seconds > 0`` says this caller will
        compute what the cluster lacks and Put it within that time (an
        in-flight prefill claim other callers see as ``computing``)."""
        return self._call(self._stub.Lookup, pb.LookupRequest(namespace=namespace, keys=list(keys), record=record,
                                                              claim_seconds=claim_seconds))

    def lookup_lease(self, namespace: str, keys: Sequence[bytes], *, ttl: float, lease_id: str = "",
                     record: bool = False, timeout: float | None = None,
                     claim_seconds: float = 0.0) -> pb.LookupResponse:
        """One call that looks up and leases: :meth:`lookup_nodes`, plus a pin
        of this node's answer for ``ttl`` seconds (``reply.lease_id``,
        ``reply.leased_length``). A repeat with the same ``lease_id`` neither
        pins nor records nor claims again. ``claim_seconds``: an in-flight
        prefill claim, as in :meth:`lookup_nodes`."""
        return self._call(self._stub.Lookup, _lease_request(namespace, keys, ttl, lease_id, record, claim_seconds),
                          timeout=timeout or self.timeout)

    def lookup_lease_future(self, namespace: str, keys: Sequence[bytes], *, ttl: float, lease_id: str = "",
                            record: bool = False, timeout: float | None = None,
                            claim_seconds: float = 0.0) -> "LookupFuture":
        """:meth:`lookup_lease` without blocking: poll ``done()``, then ``result()``.
        With ``ttl=0`` and no ``lease_id`` it is a plain :meth:`lookup_nodes`
        (nothing pinned) that does not block."""
        call = self._stub.Lookup.future(_lease_request(namespace, keys, ttl, lease_id, record, claim_seconds),
                                        timeout=timeout or self.timeout)
        return LookupFuture(call)

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call(self._stub.Exists, pb.KeysRequest(namespace=namespace, keys=list(keys))).exists)

    def delete(self, namespace: str, keys: Sequence[bytes]) -> pb.DeleteResponse:
        return self._call(self._stub.Delete, pb.KeysRequest(namespace=namespace, keys=list(keys)))

    def pin(self, namespace: str, keys: Sequence[bytes], ttl: float) -> Lease:
        reply = self._call(self._stub.Pin, pb.PinRequest(namespace=namespace, keys=list(keys), ttl_seconds=ttl))
        return Lease(reply.lease_id, list(reply.pinned_keys), list(reply.missing_keys), reply.expires_in_seconds)

    def unpin(self, namespace: str, lease: Lease | str) -> int:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        return self._call(self._stub.Unpin, pb.UnpinRequest(namespace=namespace, lease_id=lease_id)).released

    def stats(self, namespace: str = "") -> pb.StatsResponse:
        return self._call(self._stub.Stats, pb.StatsRequest(namespace=namespace))
