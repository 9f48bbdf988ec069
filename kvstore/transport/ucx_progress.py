"""UCX (``ucxx``) plumbing under :mod:`kvstore.transport.ucx`: the daemon's
UCX environment defaults (:func:`configure_ucx_env`), the event-loop driver
that progresses the process's ucxx worker (:func:`ucx_loop_progress`), and
the wait for a tagged message that does not spin the loop
(:func:`_next_message`). It imports ucxx only when a driver is first made.

ucxx state and progress
-----------------------
ucxx keeps ONE ``ApplicationContext`` (UCP context + worker) per process,
created on first use and never reset here: every
:class:`~kvstore.transport.ucx.UcxTransport` in a process shares it and owns
only its listener and endpoints, which
:meth:`~kvstore.transport.ucx.UcxTransport.close` tears down.

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

UCX settings (:func:`configure_ucx_env`)
----------------------------------------
UCX reads most of its environment when the ucxx context is created, and a
few global options (``UCX_WARN_UNUSED_ENV_VARS``) when ``import ucxx`` loads
libucs, so :func:`configure_ucx_env` must run before ucxx is first imported:
``kvstore.transport.auto`` runs it before its import check, and
:class:`~kvstore.transport.ucx.UcxTransport`'s constructor runs it too (a
no-op by then). It only fills in variables the operator has not set:

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

from kvstore.framing import ChannelClosed

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
