"""A peer transport whose transfers take the time of a stated link.

:class:`ShapedTransport` wraps any :class:`Transport` with a node's
:class:`~kvstore.transport.shaper.LinkShaper`:

* **serving** (the holder's egress): once ``serve`` has built the reply, the
  payload's bytes go through the egress link (fair among every pull this
  node serves at once), then one link latency passes, then the inner
  transport sends header and payload at full speed. The pages stay held for
  reading meanwhile, as they would while a NIC sends them.
* **pulling** (the puller's ingress): one link latency for the request, and
  an ingress flow opened when the request goes out, sized when the reply
  header says how many pages come (so it overlaps the holder's egress; the
  slower of the two sets the time), awaited before ``fetch`` returns.

Only peer transfers go through here: an engine's calls to its own node
(gRPC, the data channel) are local and never shaped. The rates are real
bytes per second on this machine; a benchmark that replays scaled pages at a
speedup passes ``link x speedup / byte_scale``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.transport.base import AllocFn, Served, ServeFn, Transport, resolve_served
from kvstore.transport.shaper import LinkShaper
from kvstore.v1 import kvstore_pb2 as pb


class ShapedTransport(Transport):
    """``inner`` with every transfer paced by ``shaper`` (egress when serving, ingress when pulling)."""

    def __init__(self, inner: Transport, shaper: LinkShaper) -> None:
        self.inner, self.shaper = inner, shaper
        self.name = inner.name
        self.device_buffers = inner.device_buffers
        self.scatter = inner.scatter
        self._page_bytes: dict[str, int] = {}  # namespace -> page size, learnt from replies

    async def start(self, host: str, port: int, serve: ServeFn) -> pb.TransportEndpoint:
        egress = self.shaper.egress

        async def shaped_serve(request: pb.DataHeader) -> Served:
            served = await resolve_served(serve(request))
            try:
                await egress.transfer(sum(served.header.found) * served.header.page_bytes)
                if egress.latency:
                    await asyncio.sleep(egress.latency)
            except BaseException:
                served.release()
                raise
            return served

        return await self.inner.start(host, port, shaped_serve)

    async def fetch(self, endpoint: pb.TransportEndpoint, request: pb.DataHeader,
                    alloc: AllocFn) -> tuple[pb.DataHeader, Any]:
        ingress = self.shaper.ingress
        known = self._page_bytes.get(request.namespace)
        flow = ingress.open(len(request.keys) * known if known else None)  # an upper bound until the reply
        sized = False

        def sized_alloc(n: int, page_bytes: int, reply: pb.DataHeader) -> Any:
            nonlocal sized
            flow.resize(n * page_bytes)
            sized = True
            self._page_bytes[request.namespace] = page_bytes
            return alloc(n, page_bytes, reply)

        try:
            if ingress.latency:
                await asyncio.sleep(ingress.latency)
            reply, payload = await self.inner.fetch(endpoint, request, sized_alloc)
            if not sized:
                flow.resize(0)
            await flow.wait()
            return reply, payload
        finally:
            flow.close()

    def forget(self, endpoint: pb.TransportEndpoint) -> None:
        self.inner.forget(endpoint)

    async def close(self) -> None:
        await self.inner.close()

    def connections(self) -> int:
        return self.inner.connections()


def shape(transport: Transport, rate: float, latency: float = 0.0) -> Transport:
    """``transport`` shaped to ``rate`` bytes/s each way and ``latency`` s one way; unchanged if both are 0."""
    if rate <= 0 and latency <= 0:
        return transport
    return ShapedTransport(transport, LinkShaper(rate if rate > 0 else 1e18, latency))
