"""gRPC plumbing shared by the node, its peers and the clients: channel and
server options, and the one translation of a failed call into a
:class:`~kvstore.errors.KvError`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvstore.errors import InvalidArgument, KvError, bounded, error_for_code

log = logging.getLogger(__name__)

# Channels accept messages as large as any node may send (the node's own
# --max-message-bytes bounds what it sends and accepts).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of a node's gRPC server: its message limit, no port sharing."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def from_rpc_error(exc: grpc.RpcError, what: str) -> KvError:
    """A failed call as a typed error: its status code and a bounded message."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else ""
    return error_for_code(code.value[0] if code is not None else 2, f"{what}: {(details or str(code))[:200]}")


class _Undecodable:
    """A request body that did not parse (the handler answers INVALID_ARGUMENT)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _undecodable(method: str, bad: _Undecodable) -> InvalidArgument:
    return InvalidArgument(f"{method.rsplit('/', 1)[-1]}: the request body ({bad.nbytes} bytes) is not a valid "
                           f"protobuf message of its type")


class BoundaryInterceptor(grpc.aio.ServerInterceptor):
    """The last line at a node's gRPC boundary, for every service.

    An undecodable request body (protobuf parse error) becomes
    INVALID_ARGUMENT instead of grpc's own UNKNOWN/INTERNAL; a
    :class:`KvError` its status with a message of bounded length; any other
    exception (a bug: the handlers check their input first) is logged once
    per method and kind, and answered INTERNAL with a fixed text, never a
    stack trace or an exception's name."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = handler.request_deserializer

        def deserialize(body: bytes) -> Any:
            try:
                return parse(body) if parse is not None else body
            except Exception:
                return _Undecodable(len(body))

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), deserialize, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._unary_stream(method, handler.unary_stream), deserialize, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._stream_unary(method, handler.stream_unary), deserialize, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._stream_stream(method, handler.stream_stream), deserialize, handler.response_serializer)

    async def _fail(self, method: str, exc: BaseException, context: Any) -> None:
        """Answer ``exc`` on ``context`` (always raises)."""
        if isinstance(exc, KvError):
            await context.abort(exc.code, bounded(str(exc)))
        key = (method, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.error("%s: unexpected error, answered INTERNAL", method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the node)")

    @contextlib.asynccontextmanager
    async def _guard(self, method: str, context: Any) -> AsyncIterator[None]:
        """Around every handler: an abort or a cancellation passes through;
        any other exception becomes the bounded answer of :meth:`_fail`."""
        try:
            yield
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await self._fail(method, exc, context)

    @staticmethod
    async def _checked(method: str, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                raise _undecodable(method, request)
            yield request

    def _unary(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> Any:
            async with self._guard(method, context):
                if isinstance(request, _Undecodable):
                    raise _undecodable(method, request)
                return await fn(request, context)
        return call

    def _unary_stream(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(fn):  # writes with context.write (e.g. Health.Watch)
            return self._unary(method, fn)

        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            async with self._guard(method, context):
                if isinstance(request, _Undecodable):
                    raise _undecodable(method, request)
                async for reply in fn(request, context):
                    yield reply
        return call

    def _stream_unary(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def call(requests: AsyncIterator[Any], context: Any) -> Any:
            async with self._guard(method, context):
                return await fn(self._checked(method, requests), context)
        return call

    def _stream_stream(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(fn):
            return self._stream_unary(method, fn)

        async def call(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async with self._guard(method, context):
                async for reply in fn(self._checked(method, requests), context):
                    yield reply
        return call
