"""The peer transport interface: a pull of pages from a peer.

What a transport accepts is its :attr:`Transport.carrier` (scatter lists of
host views, device arrays): the pool's read-out and write-in
(:mod:`kvstore.pool.movement`) hand it pages in that form, so no transport
packs, stages or uploads on its own.

One exchange: the puller sends a request header (``kvstore.v1.DataHeader``,
op GET, ``local_only``), the server answers with a RESULT header (``found``,
``checksums``, ``page_bytes``) and then, as ONE message, the found pages
packed contiguously (``pack_pages`` on the server; the puller scatters them
with ``unpack_pages``). Pages may be device arrays (CuPy) so UCX can move
them with RDMA/NVLink/CUDA IPC where present.

The serving side never talks to the pool directly: the node hands a
``serve`` callback to :meth:`Transport.start` that returns a
:class:`Served` (reply header, packed payload, release callback).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import Unavailable
from kvstore.framing import Limits
from kvstore.pool.movement import Carrier
from kvstore.v1 import kvstore_pb2 as pb


class TransportError(Unavailable):
    """A peer transfer failed (peer died, reset, bad frame, timeout).

    Callers treat the pages of the failed transfer as misses.
    """


@dataclass(slots=True)
class Served:
    """What a node answers to a pull: header, packed pages, and a release.

    ``payload`` is a contiguous uint8 array ``[n_found, page_bytes]`` (host
    or device), or -- for a transport with ``scatter`` -- a list of host
    page views (the pool slots themselves: no pack copy), or None when
    nothing was found; ``release`` must be called once the payload has been
    sent (it drops read holds and returns staging).
    """

    header: pb.DataHeader
    payload: Any
    release: Callable[[], None]


# serve(request) -> Served, or an awaitable of it (a shaped link paces the
# reply: kvstore.transport.shaped); runs on the event loop thread.
ServeFn = Callable[[pb.DataHeader], "Served | Awaitable[Served]"]


async def resolve_served(result: "Served | Awaitable[Served]") -> Served:
    """What ``serve`` returned, awaited if it is awaitable."""
    return await result if inspect.isawaitable(result) else result  # type: ignore[return-value]
# alloc(n_pages, page_bytes, reply) -> where to receive the payload: a
# contiguous uint8 array [n_pages, page_bytes], or -- for a transport with
# ``scatter`` -- a list of n_pages host page views (e.g. reserved pool slots).
AllocFn = Callable[[int, int, pb.DataHeader], Any]


class Transport(abc.ABC):
    """A backend that serves pulls and pulls pages from peers."""

    name: str
    device_buffers: bool = False  # payloads may be device (CuPy) arrays
    scatter: bool = False  # payloads may be lists of host page views
    # what the serving side grants each connection (header cap, read and idle
    # timeouts, connection count); the node sets its own (set_limits)
    limits: Limits = Limits()

    def set_limits(self, limits: Limits) -> None:
        """The serving side's limits (call before :meth:`start`); a transport
        that wraps another (``inner``) passes them on."""
        self.limits = limits
        inner = getattr(self, "inner", None)
        if isinstance(inner, Transport):
            inner.set_limits(limits)

    @property
    def carrier(self) -> Carrier:
        """What this transport accepts, for the pool's read-out and write-in."""
        return Carrier(scatter=self.scatter, device=self.device_buffers)

    @abc.abstractmethod
    async def start(self, host: str, port: int, serve: ServeFn) -> pb.TransportEndpoint:
        """Listen on ``host:port`` (0 = any free port); returns the endpoint
        to advertise. A second call returns the same endpoint."""

    @abc.abstractmethod
    async def fetch(self, endpoint: pb.TransportEndpoint, request: pb.DataHeader,
                    alloc: AllocFn) -> tuple[pb.DataHeader, Any]:
        """Send ``request`` to the peer at ``endpoint``; returns its RESULT
        header and the payload received into ``alloc(n_found, page_bytes)``
        (None when nothing was found). Raises :class:`TransportError` on any
        failure and leaves no half-used connection behind. Cancelling it
        (deadline) is safe: the connection used is closed.

        Buffer rule: once ``fetch`` returns or raises (cancellation
        included), nothing writes into the buffers ``alloc`` gave any more.
        They may be reserved pool slots that the caller frees at once."""

    @abc.abstractmethod
    def forget(self, endpoint: pb.TransportEndpoint) -> None:
        """Drop cached connections to a peer (it died or restarted)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and close every connection; safe to call twice."""

    def connections(self) -> int:
        """Open outgoing connections (tests check for leaks)."""
        return 0

