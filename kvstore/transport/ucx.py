"""Peer transport over UCX (``ucxx``): RDMA, NVLink/CUDA IPC, shared memory
or TCP, whichever UCX finds between two nodes.

One pull is the exchange described in :mod:`kvstore.transport.base`, as
tagged UCX messages on one endpoint:

1. puller -> server: one message, a data-channel frame with no payload
   (``wire.encode_header(request, 0)``: the 20-byte prefix, then the
   ``DataHeader``), so the magic/version checks of the TCP data channel apply;
2. server -> puller: one message, the RESULT frame (prefix + header), whose
   ``payload_len`` announces the payload;
3. server -> puller, when pages were found: ONE message, the packed pages
   (``[n_found, page_bytes]`` uint8, host or CuPy device memory as is; UCX
   picks the path for device memory, so ``device_buffers = True``).

Message lengths come from ``tag_probe`` before each header ``recv``, so no
length prefix is needed; a payload that does not match the announced length
fails the pull (truncation) instead of being misread.

Progress, the wait for the next message without spinning the event loop,
and the daemon's UCX environment defaults (with their measurements) are in
:mod:`kvstore.transport.ucx_progress`; the names other code uses
(``configure_ucx_env``, ``ucx_context_created``, ``ucx_loop_progress``,
``UCX_DEFAULTS``, ``UCX_LOOPBACK``) are re-exported here.

Connections: a small pool of endpoints per peer, like the TCP backend,
rather than one endpoint behind a lock: concurrent pulls from one peer then
run side by side (UCX moves several large messages at once on separate
endpoints), one exchange per endpoint keeps tag matching trivial (no
per-exchange tags; the ``DataHeader`` has no request id), and a failed or
cancelled exchange only costs its own endpoint. Idle endpoints whose peer
went away are dropped before reuse (ucxx's endpoint error handling marks
them not alive).

Peer death: every endpoint is created with ucxx's endpoint error handling,
so a peer that closes or dies mid-transfer fails the pending request
(measured: a ``recv`` of 64 MiB from a process killed with SIGKILL raised
``UCXConnectionResetError`` after ~10 ms; a pull waiting on a peer killed
with SIGKILL failed 5-8 ms later) -> :class:`TransportError`. Connecting
to a port nobody listens on usually fails at once, but ucxx's handshake can
miss the refusal and only give up after ``connect_timeout`` (5 s; seen
every time under ucxx's thread mode, rarely with the loop driver).

Cancellation (the caller's deadline) and failure: when :meth:`UcxTransport.fetch`
returns or raises, no UCX operation still writes into the buffer ``alloc``
gave. A pull cancelled or failing during the payload receive aborts its
endpoint (UCX then cancels or fails the receive) and waits, at most
``_RETIRE_S`` (1 s), until that receive has retired before it re-raises; if
it has not by then, it logs an error (UCX may still write into the buffer).

Listening: ucxx listeners bind every interface (the API takes only a port);
``start(host, port)`` advertises ``host``.

"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc

from kvstore.framing import (
    MAX_HEADER_BYTES, PREFIX, ChannelClosed, WireError, check_pull, decode_header, decode_prefix, encode_header,
    error_frame,
)
from kvstore.transport.base import AllocFn, ServeFn, Transport, TransportError, resolve_served
from kvstore.transport.ucx_progress import (
    UCX_DEFAULTS, UCX_LOOPBACK, _Heat, _LoopProgress, _next_message, configure_ucx_env, ucx_context_created,
    ucx_loop_progress,
)
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

# Endpoint.abort() waits at most this long (ns) for UCX to close.
_ABORT_PERIOD_NS = 1_000_000_000
# A pull cancelled or failing mid-payload waits at most this long (s) for
# its aborted receive to retire before it re-raises.
_RETIRE_S = 1.0

__all__ = ["UCX_DEFAULTS", "UCX_LOOPBACK", "UcxTransport", "configure_ucx_env", "ucx_context_created",
           "ucx_loop_progress"]


class _AllocFailed(Exception):
    """The caller's ``alloc`` failed: re-raised as is, not as a peer failure."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


async def _recv_frame(ep: Any, transport: "UcxTransport",
                      max_header: int = MAX_HEADER_BYTES) -> tuple[pb.DataHeader, int]:
    """Receive one header message: (header, announced payload length)."""
    length = await _next_message(ep, transport._heat, transport._driver)
    if length < PREFIX.size or length > PREFIX.size + max_header:
        raise WireError(f"header message of {length} bytes")
    frame = bytearray(length)
    await transport._run(ep.recv(frame))
    header_len, payload_len = decode_prefix(memoryview(frame)[:PREFIX.size])
    if header_len != length - PREFIX.size:
        raise WireError(f"prefix says {header_len} header bytes, message holds {length - PREFIX.size}")
    return decode_header(memoryview(frame)[PREFIX.size:]), payload_len


def _alloc(alloc: AllocFn, n_pages: int, page_bytes: int, nbytes: int, reply: pb.DataHeader) -> Any:
    try:
        payload = alloc(n_pages, page_bytes, reply)
        if int(payload.nbytes) != nbytes:
            raise ValueError(f"alloc gave {payload.nbytes} bytes for a {nbytes}-byte payload")
    except Exception as exc:
        raise _AllocFailed(exc) from exc
    return payload


def _abort(ep: Any) -> None:
    """Close an endpoint now; UCX cancels or fails its in-flight requests."""
    try:
        ep.abort(period=_ABORT_PERIOD_NS)
    except Exception as exc:  # already closed / UCX error: nothing left to free
        log.debug("ucx transport: abort: %s", exc)


class UcxTransport(Transport):
    """Pulls over pooled ucxx endpoints; serves pulls on one ucxx listener.

    Buffer lifetime: UCX writes into (or reads from) a buffer until its
    request completes, and neither closing an endpoint nor cancelling the
    awaiting coroutine stops a transfer that is already under way (a
    matched tag receive is not cancellable). Freeing the buffer early is a
    use-after-free (seen: heap corruption and a segfault when a pull was
    cancelled mid-handshake). So every ucxx operation here runs as a task
    this transport owns (:meth:`_run`): cancelling the caller leaves that
    task, and with it the buffer it references, alive until UCX retires the
    request (after an abort, with an error); :meth:`close` waits for them.
    The payload receive goes further, since its buffer is the caller's
    (``alloc``): :meth:`fetch` does not return or raise before that receive
    has retired (bounded by ``_RETIRE_S``; an error is logged past it).
    """

    name = "ucx"
    device_buffers = True  # payloads may be CuPy device arrays

    def __init__(self, max_idle_per_peer: int = 4, connect_timeout: float = 5.0) -> None:
        applied = configure_ucx_env(os.environ)
        import ucxx  # noqa: F401  (fail early, with ImportError, when missing)

        if applied and ucx_context_created():
            log.warning("ucx transport: UCX context already created; %s not applied", applied)
        self._listener: Any = None
        self._endpoint: pb.TransportEndpoint | None = None
        self._serve_fn: ServeFn | None = None
        self._idle: dict[tuple[str, int], list[Any]] = {}
        self._busy: set[Any] = set()
        self._served: set[Any] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # served-connection handlers
        self._ops: set[asyncio.Task[Any]] = set()  # ucxx operations in flight
        self._max_idle = max_idle_per_peer
        self._connect_timeout = connect_timeout
        self._closed = False
        self._heat = _Heat()
        self._driver: _LoopProgress | None = None
        self._watch: Any = None

    # ---- ucxx operations -------------------------------------------------
    def _progress(self) -> None:
        """Make sure the worker is progressed on this loop (before any ucxx call)."""
        if self._driver is None or self._driver.loop is not asyncio.get_running_loop():
            self._driver = ucx_loop_progress()

    def _own(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._ops.add(task)
        driver = self._driver
        if driver is not None:
            driver.hold()  # progress every iteration until UCX retires it
        task.add_done_callback(lambda done: self._retire(done, driver))
        return task

    def _retire(self, task: asyncio.Task[Any], driver: _LoopProgress | None) -> None:
        self._ops.discard(task)
        if driver is not None:
            driver.release()
        if not task.cancelled():
            task.exception()  # seen by the awaiting caller, if it still waits

    async def _run(self, coro: Any) -> Any:
        """Await one ucxx send/recv; cancelling the caller does not cancel it."""
        self._heat.touch()
        try:
            return await asyncio.shield(self._own(coro))
        finally:
            self._heat.touch()

    # ---- serving ---------------------------------------------------------
    async def start(self, host: str, port: int, serve: ServeFn) -> pb.TransportEndpoint:
        if self._endpoint is not None:
            return self._endpoint
        if self._closed:
            raise TransportError("ucx transport is closed")
        import ucxx

        self._serve_fn = serve
        try:
            self._progress()
            self._listener = listener = ucxx.create_listener(self._on_connect, port)
        except Exception as exc:
            raise TransportError(f"ucx listener on port {port} failed: {exc}") from None
        if self._driver is not None:
            # ucxx runs each accepted endpoint's handshake in its own task.
            self._watch = lambda: listener.active_clients > 0
            self._driver.watches.append(self._watch)
        self._endpoint = pb.TransportEndpoint(kind="ucx", host=host, port=self._listener.port)
        return self._endpoint

    def _on_connect(self, ep: Any) -> None:
        """ucxx listener callback, on the loop that created the listener."""
        if self._closed or self._serve_fn is None or len(self._served) >= self.limits.max_connections:
            _abort(ep)  # closed, or over --max-connections
            return
        self._served.add(ep)
        task = asyncio.get_running_loop().create_task(self._serve(ep, self._serve_fn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, ep: Any, serve: ServeFn) -> None:
        try:
            while True:
                try:
                    # a pull request is one message: idle until it is queued
                    async with asyncio.timeout(self.limits.idle_timeout):
                        request, payload_len = await _recv_frame(ep, self, self.limits.max_header)
                except (ChannelClosed, TimeoutError):
                    return
                check_pull(request, payload_len)
                served = await resolve_served(serve(request))
                sending: asyncio.Task[Any] | None = None
                try:
                    payload = served.payload
                    nbytes = 0 if payload is None else int(payload.nbytes)
                    await self._run(ep.send(encode_header(served.header, nbytes)))
                    if nbytes:
                        sending = self._own(ep.send(payload))
                        await asyncio.shield(sending)
                        self._heat.touch()
                finally:
                    if sending is not None and not sending.done():
                        # Cancelled mid-send: UCX may still read the payload.
                        release = served.release
                        sending.add_done_callback(lambda _task: release())
                    else:
                        served.release()
        except asyncio.CancelledError:
            raise
        except WireError as exc:  # a bad request: answered (bounded wait), then closed
            log.info("ucx transport: closing served endpoint: %s", exc)
            try:
                await asyncio.wait_for(self._run(ep.send(error_frame(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))),
                                       self.limits.read_timeout)
            except Exception as send_exc:  # the peer is gone or does not read
                log.debug("ucx transport: error reply not sent: %s", send_exc)
        except Exception as exc:  # ChannelClosed, any UCX error
            log.debug("ucx transport: closing served endpoint: %s", exc)
        finally:
            self._served.discard(ep)
            _abort(ep)

    # ---- pulling ---------------------------------------------------------
    async def _connect(self, addr: tuple[str, int]) -> Any:
        idle = self._idle.get(addr)
        while idle:
            ep = idle.pop()
            if not ep.closed:
                return ep
            _abort(ep)  # the peer went away while it sat idle
        import ucxx

        self._progress()
        connecting = self._own(ucxx.create_endpoint(addr[0], addr[1], connect_timeout=self._connect_timeout))
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            # ucxx's handshake buffers live in that task: let it finish, then
            # close what it made.
            connecting.add_done_callback(
                lambda task: None if task.cancelled() or task.exception() else _abort(task.result()))
            raise

    async def fetch(self, endpoint: pb.TransportEndpoint, request: pb.DataHeader,
                    alloc: AllocFn) -> tuple[pb.DataHeader, Any]:
        if self._closed:
            raise TransportError("ucx transport is closed")
        addr = (endpoint.host, endpoint.port)
        ep: Any = None
        try:
            self._progress()
            ep = await self._connect(addr)
            self._busy.add(ep)
            if self._closed:  # closed while connecting
                raise ChannelClosed("transport closed")
            await self._run(ep.send(encode_header(request, 0)))
            reply, payload_len = await _recv_frame(ep, self)
            found = sum(reply.found)
            if payload_len != found * reply.page_bytes or reply.op != pb.DataHeader.RESULT:
                raise WireError(f"reply of {payload_len} bytes for {found} pages of {reply.page_bytes}")
            payload = None
            if found:
                payload = _alloc(alloc, found, reply.page_bytes, payload_len, reply)
                await self._recv_payload(ep, payload)
        except asyncio.CancelledError:  # mid-exchange: the endpoint is out of step
            self._drop(ep)
            raise
        except _AllocFailed as exc:  # not the peer's fault: the caller's error as is
            self._drop(ep)
            raise exc.exc from None
        except Exception as exc:  # WireError, ChannelClosed, timeouts, any UCX error
            self._drop(ep)
            raise TransportError(f"ucx pull from {addr[0]}:{addr[1]} failed: "
                                 f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            self._drop(ep)
            raise
        self._busy.discard(ep)
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self._max_idle and not self._closed and not ep.closed:
            idle.append(ep)
        else:
            _abort(ep)
        return reply, payload

    async def _recv_payload(self, ep: Any, payload: Any) -> None:
        """Receive the payload into the caller's buffer. Cancelled or failing
        while UCX may still write into it: abort the endpoint, then wait
        (bounded) until the receive has retired, and only then re-raise."""
        receiving = self._own(ep.recv(payload))
        self._heat.touch()
        try:
            await asyncio.shield(receiving)
        except BaseException:
            if not receiving.done():
                self._drop(ep)  # UCX cancels or fails the receive
                await self._until_retired(receiving)
            raise
        finally:
            self._heat.touch()

    async def _until_retired(self, task: asyncio.Task[Any]) -> None:
        """Wait at most ``_RETIRE_S`` for ``task`` (a UCX operation) to end.

        A further cancellation of the caller does not cut the wait short (the
        buffer must outlive the operation); it is re-raised after it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _RETIRE_S
        cancelled = False
        while not task.done() and loop.time() < deadline:
            try:
                await asyncio.wait({task}, timeout=deadline - loop.time())
            except asyncio.CancelledError:
                cancelled = True
        if not task.done():
            log.error("ucx transport: an aborted payload receive did not retire within %.1f s; "
                      "UCX may still write into the caller's buffer", _RETIRE_S)
        if cancelled:
            raise asyncio.CancelledError

    def _drop(self, ep: Any) -> None:
        if ep is not None:
            self._busy.discard(ep)
            _abort(ep)

    def forget(self, endpoint: pb.TransportEndpoint) -> None:
        for ep in self._idle.pop((endpoint.host, endpoint.port), []):
            _abort(ep)

    def connections(self) -> int:
        return len(self._busy) + sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        self._closed = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for eps in self._idle.values():
            for ep in eps:
                _abort(ep)
        self._idle.clear()
        for ep in list(self._busy) + list(self._served):
            _abort(ep)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The aborts fail every request in flight; wait until UCX retired them
        # (their buffers stay referenced until then), and until the listener's
        # handshakes in progress ended (ucxx runs them in its own tasks).
        limit = asyncio.get_running_loop().time() + self._connect_timeout + 1.0
        if self._ops:
            await asyncio.wait(set(self._ops), timeout=self._connect_timeout + 1.0)
        while listener is not None and listener.active_clients and asyncio.get_running_loop().time() < limit:
            await asyncio.sleep(0.005)
        if self._watch is not None and self._driver is not None and self._watch in self._driver.watches:
            self._driver.watches.remove(self._watch)
        self._watch = None
        if self._ops:
            log.warning("ucx transport: %d UCX operations still in flight at close", len(self._ops))
