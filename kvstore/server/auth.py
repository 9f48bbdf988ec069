"""Who may call what on a node's gRPC port: client tokens and peer proofs.

:class:`AuthInterceptor` stands inside :class:`kvstore.rpc.BoundaryInterceptor`
(``interceptors=[BoundaryInterceptor(), AuthInterceptor(tokens, secret, metrics)]``),
so a refusal is a typed error that the boundary answers with its code and a
bounded message.

Client calls (``kvstore.v1.KvStore``), when the node has a token file,
carry ``authorization: Bearer <token>``; the token's role must allow the
method's role in :data:`CLIENT_ROLES`, and its principal is set in
:data:`kvstore.security.tokens.CALLER` for the handlers (which qualify
namespace names by its tenant).

Cluster calls (``kvstore.v1.Cluster``), when the node has a cluster secret,
carry ``x-kvstore-peer: <proof>`` made by
:meth:`~kvstore.security.identity.ClusterSecret.sign` for the method name
and the request's serialized bytes; a heartbeat's sender must be the node
the proof names. ``Cluster.Status`` also takes an ``admin`` client token
(``kvctl status``). gRPC server reflection (``grpcurl list``) needs an ``admin``
token on a node with a token file. Health checks stay open.

Every refusal is counted in ``kvstore_auth_rejected_total{plane}``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

import grpc

from kvstore.errors import KvError, PermissionDenied, Unauthenticated
from kvstore.metrics import NodeMetrics
from kvstore.security.identity import METADATA_KEY, PEER, ClusterSecret
from kvstore.security.tokens import CALLER, Principal, TokenStore, bearer

CLIENT_SERVICE = "kvstore.v1.KvStore"
CLUSTER_SERVICE = "kvstore.v1.Cluster"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"

# The least role each client method needs. Writes are what change stored
# pages or reserve capacity; pins are read-side holds (bounded by
# --max-pin-ttl) within the caller's own namespaces. A method missing here
# needs admin (a new method is closed until someone decides).
CLIENT_ROLES: dict[str, str] = {
    "DescribeNamespace": "read", "ListNamespaces": "read", "Get": "read", "Lookup": "read", "Exists": "read",
    "Pin": "read", "Unpin": "read", "Stats": "read", "NodeInfo": "read",
    "CreateNamespace": "write", "DeleteNamespace": "write", "Put": "write", "Delete": "write",
}
# Cluster methods a client with an admin token may call instead of a peer.
ADMIN_CLUSTER_METHODS = frozenset({"Status"})


def _metadata(context: Any, key: str) -> str:
    for item in context.invocation_metadata() or ():
        k, v = item
        if k == key:
            return v.decode("latin-1") if isinstance(v, bytes) else v
    return ""


class _Raw:
    """A cluster request with the bytes it arrived as (the proof covers them)."""

    __slots__ = ("body", "message")

    def __init__(self, body: bytes, message: Any) -> None:
        self.body = body
        self.message = message


def _set(var: ContextVar[Any], value: Any) -> Callable[[], None]:
    token = var.set(value)

    def reset() -> None:
        with contextlib.suppress(ValueError):  # a generator closed from another context
            var.reset(token)
    return reset


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Client tokens on ``KvStore``, peer proofs on ``Cluster``; a pass-through
    when the node has neither a token file nor a cluster secret."""

    def __init__(self, tokens: TokenStore | None, secret: ClusterSecret | None,
                 metrics: NodeMetrics | None = None) -> None:
        self.tokens = tokens
        self.secret = secret
        self._metrics = metrics

    def _rejected(self, plane: str, exc: KvError) -> KvError:
        if self._metrics is not None:
            self._metrics.auth_rejected.labels(plane).inc()
        return exc

    # ---- checks ----------------------------------------------------------------------
    def client(self, method: str, context: Any, need: str) -> Principal:
        """The caller's principal, allowed ``need``; raises when not."""
        assert self.tokens is not None
        try:
            principal = self.tokens.authenticate(bearer(_metadata(context, "authorization")))
        except Unauthenticated as exc:
            raise self._rejected("client", exc) from None
        if not principal.allows(need):
            raise self._rejected("client", PermissionDenied(
                f"{method} needs a token with the {need} role; this one has {principal.role}"))
        return principal

    def peer(self, method: str, context: Any, raw: _Raw) -> str:
        """The node id the call's proof names; raises when it does not verify."""
        assert self.secret is not None
        try:
            node_id = self.secret.verify(_metadata(context, METADATA_KEY), method, raw.body)
            if method == "Heartbeat" and raw.message.sender.node_id != node_id:
                raise Unauthenticated("peer proof rejected: the heartbeat's sender is not the node that signed it")
        except Unauthenticated as exc:
            raise self._rejected("peer", exc) from None
        return node_id

    # ---- wiring ----------------------------------------------------------------------
    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if service == CLIENT_SERVICE and self.tokens is not None:
            need = CLIENT_ROLES.get(method, "admin")
            return _guarded(handler, lambda context: _set(CALLER, self.client(method, context, need)))
        if service == CLUSTER_SERVICE and self.secret is not None:
            return self._cluster(method, handler)
        if service == CLUSTER_SERVICE and self.tokens is not None and method in ADMIN_CLUSTER_METHODS:
            return _guarded(handler, lambda context: _set(CALLER, self.client(method, context, "admin")))
        if service == REFLECTION_SERVICE and self.tokens is not None:  # the API's shape is for operators
            return _guarded(handler, lambda context: _set(CALLER, self.client(method, context, "admin")))
        return handler

    def _cluster(self, method: str, handler: Any) -> Any:
        fn, parse = handler.unary_unary, handler.request_deserializer
        if fn is None:  # every Cluster method is unary; a streaming one would need its own proof scheme
            async def refuse(request: Any, context: Any) -> Any:
                raise self._rejected("peer", Unauthenticated(f"{method}: no peer proof scheme for streams"))
            return _same_shape(handler, refuse)

        async def call(raw: _Raw, context: Any) -> Any:
            if method in ADMIN_CLUSTER_METHODS and not _metadata(context, METADATA_KEY) and self.tokens is not None:
                reset = _set(CALLER, self.client(method, context, "admin"))
            elif method in ADMIN_CLUSTER_METHODS and not _metadata(context, METADATA_KEY):
                reset = _set(CALLER, None)  # no client tokens on this node: as open as KvStore.Stats
            else:
                reset = _set(PEER, self.peer(method, context, raw))
            try:
                return await fn(raw.message, context)
            finally:
                reset()

        def deserialize(body: bytes) -> _Raw:
            return _Raw(body, parse(body) if parse is not None else body)

        return grpc.unary_unary_rpc_method_handler(call, deserialize, handler.response_serializer)


def _same_shape(handler: Any, fn: Callable[..., Any]) -> Any:
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(fn, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(fn, handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(fn, handler.request_deserializer, handler.response_serializer)


def _guarded(handler: Any, check: Callable[[Any], Callable[[], None]]) -> Any:
    """``handler`` with ``check(context)`` first (it raises, or returns an undo)."""
    def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> Any:
            reset = check(context)
            try:
                return await fn(request, context)
            finally:
                reset()
        return call

    def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(fn):  # writes with context.write
            return plain(fn)

        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            reset = check(context)
            try:
                async for reply in fn(request, context):
                    yield reply
            finally:
                reset()
        return call

    parse, serialize = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(plain(handler.unary_unary), parse, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), parse, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(plain(handler.stream_unary), parse, serialize)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), parse, serialize)
