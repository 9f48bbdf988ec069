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

ucxx state and progress
-----------------------
ucxx keeps ONE ``ApplicationContext`` (UCP context + worker) per process,
created on first use and never reset here: every :class:`UcxTransport` in a
process shares it and owns only its listener and endpoints, which
:meth:`UcxTransport.close` tears down.

Progress: this module drives the worker from the asyncio event loop itself
(:class:`_LoopProgress`, one per loop, uvloop or asyncio alike): the
worker's epoll fd is a reader of the loop, so an idle daemon sleeps in the
loop's own poll, and while an operation is in flight the worker is
progressed on every loop iteration. ucxx's built-in modes were measured
and not chosen (UcxTransport pulls of one 1 MiB page between two
processes on this 2-core VM, median of 60; noisy, +-30%):

=====================  ==============  ===================  ==============
progress               back-to-back    after 50 ms idle     idle CPU
=====================  ==============  ===================  ==============
ucxx ``thread``        0.38 ms         6.1 ms               3% (polling)
ucxx ``blocking``      0.17 ms         1.0 ms               100% (a core)
this loop driver       0.20 ms         1.4 ms               0.4%
=====================  ==============  ===================  ==============

(ucxx raw send/recv showed the same: ``thread`` 0.18 ms hot / 5.7 ms after
idle; ucxx's ``blocking`` mode never re-arms the worker, so its epoll fd
stays readable and the loop spins; ``polling`` spins by design.) The
driver uses ucxx internals (``ProgressTasks``, ``init(progress_mode=
"blocking")`` for a worker without progress thread or delayed submission);
when those are missing, when ``UCXPY_PROGRESS_MODE`` is set, or when other
code created the ucxx context first, the transport leaves progress to ucxx
(its default ``thread`` mode) and still works. Several loops (threads) in
one process may each drive the worker (it is ``UCS_THREAD_MODE_MULTI``).
ucxx's Python-future notifier mode is not used: it binds the context to
the loop that created it.

Without Python futures ucxx awaits a request by polling with
``asyncio.sleep(0)``: a ``recv`` posted on an idle connection would keep the
event loop spinning at 100% CPU (measured: 2.0 s of CPU per 2 s idle with
one idle endpoint). So the wait for the NEXT message (the server waiting for
a request, the puller waiting for a reply) probes (``tag_probe``) after
each progress of the worker (loop driver), or under ucxx's thread mode on
every loop iteration while the transport moved a message in the last 5 ms,
else with sleeps backing off to 1 ms. Transfers themselves (``send``/
``recv`` of a payload) use ucxx's own wait.

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
every time under ucxx's thread mode, rarely with the loop driver). Cancellation (the caller's
deadline) aborts the endpoint, which cancels its in-flight requests before
the receive buffer can be reused.

Listening: ucxx listeners bind every interface (the API takes only a port);
``start(host, port)`` advertises ``host``.

UCX settings (:func:`configure_ucx_env`)
----------------------------------------
UCX reads most of its environment when the ucxx context is created, and a
few global options (``UCX_WARN_UNUSED_ENV_VARS``) when ``import ucxx`` loads
libucs, so :func:`configure_ucx_env` must run before ucxx is first imported:
``kvstore.transport.auto`` runs it before its import check, and
:class:`UcxTransport`'s constructor runs it too (a no-op by then). It only
fills in variables the operator has not set:

``UCX_MM_ERROR_HANDLING=y``
    ucxx creates every endpoint with error handling, and UCX by default
    drops its shared-memory transports (sysv/posix) from such endpoints, so
    two processes on one host fell back to TCP over loopback. Measured with
    ucxx-cu12 0.52 / UCX 1.21 between two processes on this 2-core VM, one
    tagged message send -> recv + 1-byte ack, 8 repeats (best / median):

    =========  ===================  =====================
    message    default (tcp/lo)     UCX_MM_ERROR_HANDLING=y (sysv)
    =========  ===================  =====================
    1 MiB      1.26 / 0.54 GB/s     9.92 / 5.77 GB/s
    16 MiB     1.64 / 0.88 GB/s     14.10 / 4.22 GB/s
    64 MiB     1.00 / 0.93 GB/s     20.08 / 7.05 GB/s
    =========  ===================  =====================

    (noisy: a shared 2-core VM.) Peer death is still detected with it (the
    SIGKILL numbers above were taken with it set). Tried and not chosen:
    ``UCX_RNDV_PIPELINE_ERROR_HANDLING=y`` (1 MiB median fell to 0.13 GB/s),
    ``UCX_TLS=posix,cma,tcp,self`` (64 MiB fell to 0.5 GB/s),
    ``UCX_CMA_MEMORY_INVALIDATE=y`` (no gain). Across hosts UCX uses RDMA or
    TCP as before; the setting only matters between processes on one host.
``UCX_WARN_UNUSED_ENV_VARS=n``
    UCX otherwise prints an "unused environment variables" warning when the
    context is created, for each ``UCX_*`` variable nothing read (here:
    ``UCX_MEMTYPE_CACHE``, which ``import ucxx`` sets but UCX 1.21 no longer
    reads).

``loopback=True`` also sets ``UCX_NET_DEVICES=lo``: tests and benchmarks
only; a daemon on a fleet must not be restricted to loopback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

from kvstore.framing import (
    MAX_HEADER_BYTES, PREFIX, ChannelClosed, WireError, decode_header, decode_prefix, encode_header,
)
from kvstore.transport.base import AllocFn, ServeFn, Transport, TransportError
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

# The daemon's UCX defaults (see the module docstring for the measurements).
UCX_DEFAULTS: dict[str, str] = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# Added by configure_ucx_env(..., loopback=True): tests and benchmarks only.
UCX_LOOPBACK: dict[str, str] = {"UCX_NET_DEVICES": "lo"}

# ucxx thread mode: waiting for the next message, probe on every loop
# iteration while the transport moved a message in the last _HOT_S, else
# back off to _POLL_MAX.
_HOT_S = 5e-3
_POLL_MIN = 100e-6
_POLL_MAX = 1e-3
# Loop driver: keep progressing on every iteration for _LINGER_S after an
# operation (a burst pays no wake-up), and at least every _TICK_S anyway.
_LINGER_S = 2e-3
_TICK_S = 10e-3
# Endpoint.abort() waits at most this long (ns) for UCX to close.
_ABORT_PERIOD_NS = 1_000_000_000


def configure_ucx_env(environ: MutableMapping[str, str], *, loopback: bool = False) -> dict[str, str]:
    """Set the daemon's UCX defaults in ``environ`` where the operator has
    not set them; returns the variables it set.

    Must run before ucxx creates its context (first listener/endpoint).
    ``loopback`` also pins UCX to the ``lo`` device (tests/benchmarks).
    """
    wanted = dict(UCX_DEFAULTS)
    if loopback:
        wanted.update(UCX_LOOPBACK)
    applied = {}
    for key, value in wanted.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    return applied


def ucx_context_created() -> bool:
    """Whether ucxx already made its process-wide context (UCX's env is then
    fixed). Does not import ucxx."""
    core = sys.modules.get("ucxx.core")
    return core is not None and getattr(core, "_ctx", None) is not None


class _LoopProgress:
    """Drives the process's ucxx worker from one asyncio event loop.

    Event-driven when idle: the worker's epoll fd is a reader of the loop;
    on an event the driver progresses the worker, wakes the waiters of
    :meth:`changed` and re-arms the worker. While anything is in flight
    (:meth:`hold`), while a listener handshake runs, or for ``_LINGER_S`` after
    activity, it progresses on every loop iteration instead (UCX needs
    progress after posting operations, and a burst of pulls then pays no
    wake-up latency). A ``_TICK_S`` timer progresses anyway, in case an
    event is missed. Several loops (threads) may each have a driver: the
    worker is thread-safe (``UCS_THREAD_MODE_MULTI``), and a driver that made
    progress wakes the waiters of the others.
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        self.held = 0
        self.hot_until = 0.0
        self.watches: list[Any] = []  # callables: True while ucxx runs its own handshakes
        self._waiters: list[asyncio.Future[None]] = []
        self._scheduled = False
        worker.init_blocking_progress_mode()
        loop.add_reader(worker.epoll_file_descriptor, self._progress)
        self._tick()

    def _tick(self) -> None:
        self.loop.call_later(_TICK_S, self._tick)
        self._progress()

    def kick(self) -> None:
        """Progress on the next loop iteration (at most one pending)."""
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._kicked)

    def _kicked(self) -> None:
        self._scheduled = False
        self._progress()

    def hold(self) -> None:
        self.held += 1
        self.kick()

    def release(self) -> None:
        self.held -= 1
        self.hot_until = self.loop.time() + _LINGER_S

    def changed(self) -> asyncio.Future[None]:
        """A future resolved after the next progress of the worker."""
        fut = self.loop.create_future()
        self._waiters.append(fut)
        return fut

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _progress(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.worker.progress()
        except Exception as exc:  # pragma: no cover - failures surface on the requests
            log.debug("ucx transport: worker progress: %s", exc)
        self.wake()
        for other in list(_DRIVERS.values()):
            if other is not self and other._waiters:
                try:
                    other.loop.call_soon_threadsafe(other.wake)
                except RuntimeError:  # its loop is closed
                    _DRIVERS.pop(other.loop, None)
        busy = self.held > 0 or self.loop.time() < self.hot_until or any(w() for w in self.watches)
        if busy or not self._arm():
            self.kick()

    def _arm(self) -> bool:
        try:
            return bool(self.worker.arm())  # False: events pending, progress again
        except Exception as exc:  # pragma: no cover - UCX refused; keep polling via the tick
            log.debug("ucx transport: worker arm failed: %s", exc)
            return True


# One driver per event loop that uses UcxTransport (loop progress mode).
_DRIVERS: dict[asyncio.AbstractEventLoop, _LoopProgress] = {}
# Marks a loop in ucxx's ProgressTasks while this module creates the context.
_PLACEHOLDER = object()


def ucx_loop_progress() -> _LoopProgress | None:
    """This loop's driver, created (with the ucxx context) on first use.

    Call it before any ucxx call on a loop. Code calling ucxx directly (a
    benchmark) brackets each operation with ``driver.hold()`` /
    ``driver.release()`` so the worker is progressed while it runs.

    None when ucxx progresses itself: the operator chose a ucxx progress
    mode (``UCXPY_PROGRESS_MODE``), the ucxx context was created by other
    code first (its default ``thread`` mode), or ucxx's internals are not
    the ones this was written against (ucxx-cu12 0.52).
    """
    loop = asyncio.get_running_loop()
    driver = _DRIVERS.get(loop)
    if driver is not None:
        return driver
    if os.environ.get("UCXPY_PROGRESS_MODE"):
        return None
    import ucxx
    import ucxx.core

    try:
        from ucxx._lib_async import application_context as appctx

        tasks = appctx.ProgressTasks
        ctx = ucxx.core._ctx
        if ctx is None:
            # ucxx starts progress for the running loop when it makes its
            # context: mark this loop as taken so it does not.
            tasks[loop] = _PLACEHOLDER
            try:
                ucxx.init(progress_mode="blocking")  # no progress thread, no delayed submission
            except BaseException:
                tasks.pop(loop, None)
                raise
            ctx = ucxx.core._ctx
        elif ctx.progress_mode != "blocking" or not any(isinstance(t, _LoopProgress) for t in tasks.values()):
            return None  # a context this module did not make: ucxx progresses it
        if tasks.get(loop, _PLACEHOLDER) is not _PLACEHOLDER:
            return None  # ucxx already progresses this loop itself
        driver = _LoopProgress(ctx.worker, loop)
        tasks[loop] = driver  # ucxx's continuous_ucx_progress() now skips this loop
    except (AttributeError, ImportError, TypeError) as exc:  # pragma: no cover - other ucxx versions
        log.warning("ucx transport: cannot drive ucxx from the event loop (%s); using ucxx's progress", exc)
        return None
    _DRIVERS[loop] = driver
    return driver


class _Heat:
    """When the transport last moved a message (ucxx thread mode)."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = 0.0

    def touch(self) -> None:
        self.until = asyncio.get_running_loop().time() + _HOT_S


async def _next_message(ep: Any, heat: _Heat, driver: _LoopProgress | None) -> int:
    """Wait until a tagged message for ``ep`` is queued; returns its length.

    Probes (``tag_probe``) instead of posting a receive, which ucxx would
    await by spinning the event loop however long the connection stays
    idle. With the loop driver it probes after each progress of the worker;
    under ucxx's thread mode it probes on every loop iteration while the
    transport is hot, else with sleeps backing off to 1 ms. Raises
    :class:`ChannelClosed` when the endpoint is closed or its peer died.
    """
    loop = asyncio.get_running_loop()
    delay = 0.0
    while True:
        closed = ep.closed  # read first: a message sent before a close still counts
        length = _probe(ep)
        if length is not None:
            return length
        if closed:
            raise ChannelClosed("ucx endpoint closed")
        if driver is not None:
            await driver.changed()
        elif loop.time() < heat.until:
            delay = 0.0
            await asyncio.sleep(0)
        else:
            delay = min(max(delay * 2, _POLL_MIN), _POLL_MAX)
            await asyncio.sleep(delay)


def _probe(ep: Any) -> int | None:
    """Length of the next queued message for ``ep``, or None."""
    if ep._ctx is None:  # aborted here: nothing can be received any more
        return None
    info = ep.tag_probe()
    return int(info.length) if info.matched else None


class _AllocFailed(Exception):
    """The caller's ``alloc`` failed: re-raised as is, not as a peer failure."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


async def _recv_frame(ep: Any, transport: "UcxTransport") -> tuple[pb.DataHeader, int]:
    """Receive one header message: (header, announced payload length)."""
    length = await _next_message(ep, transport._heat, transport._driver)
    if length < PREFIX.size or length > PREFIX.size + MAX_HEADER_BYTES:
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
        if self._closed or self._serve_fn is None:
            _abort(ep)
            return
        self._served.add(ep)
        task = asyncio.get_running_loop().create_task(self._serve(ep, self._serve_fn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, ep: Any, serve: ServeFn) -> None:
        try:
            while True:
                try:
                    request, payload_len = await _recv_frame(ep, self)
                except ChannelClosed:
                    return
                if request.op != pb.DataHeader.GET or payload_len:
                    raise WireError(f"peer sent op {request.op} with {payload_len} payload bytes")
                served = serve(request)
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
        except Exception as exc:  # WireError, ChannelClosed, any UCX error
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
                await self._run(ep.recv(payload))
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
