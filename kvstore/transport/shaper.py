"""Link shaping: one direction of a node's network link, shared fairly.

A :class:`Link` has a rate (bytes/s) and a one-way latency. Concurrent
transfers on it share the rate by processor sharing: with *n* flows active,
each progresses at ``rate / n``, so seven pulls served by one holder at once
take about seven times as long as one, and a small transfer is not stuck
behind a big one. This is the fluid model of a fair-queued NIC (what TCP
flows over one bottleneck converge to), computed exactly: the link keeps
each flow's delivered bytes and wakes at the next completion.

A flow may start before its size is known (:meth:`Link.open` with
``nbytes=None``): it takes its share from then on, and :meth:`Flow.resize`
sets the size once known (a puller opens its ingress flow when it sends the
request and sizes it when the reply header says how many pages come). Bytes
it was credited with before the resize count.

Pure asyncio, no I/O: :mod:`kvstore.transport.shaped` applies it to a peer
transport, tests drive it directly.
"""

from __future__ import annotations

import asyncio
import math


class Flow:
    """One transfer on a :class:`Link`; ``await flow.wait()`` until its bytes are through."""

    __slots__ = ("link", "size", "delivered", "done")

    def __init__(self, link: "Link", size: float, done: asyncio.Future[None]) -> None:
        self.link, self.size, self.delivered, self.done = link, size, 0.0, done

    @property
    def remaining(self) -> float:
        return self.size - self.delivered

    def resize(self, nbytes: float) -> None:
        """Set the flow's total size (bytes already credited count)."""
        self.link._update()
        self.size = max(0.0, float(nbytes))
        self.link._settle()

    async def wait(self) -> None:
        await asyncio.shield(self.done)

    def close(self) -> None:
        """Leave the link now (done or abandoned); safe to call twice."""
        self.link._remove(self)


class Link:
    """One direction (egress or ingress) of one node's link."""

    def __init__(self, rate: float, latency: float = 0.0, name: str = "") -> None:
        if rate <= 0 or not math.isfinite(rate):
            raise ValueError(f"link rate must be a positive number of bytes/s, not {rate!r}")
        if latency < 0:
            raise ValueError("link latency must be >= 0")
        self.rate, self.latency, self.name = float(rate), float(latency), name
        self._flows: list[Flow] = []
        self._t = 0.0                      # loop time of the last update
        self._timer: asyncio.TimerHandle | None = None
        self.bytes_total = 0.0             # bytes carried (completed or credited)
        self.busy_s = 0.0                  # seconds with at least one flow active

    # ---- public -----------------------------------------------------------
    def open(self, nbytes: float | None) -> Flow:
        """Start a flow of ``nbytes`` (None: size not known yet, takes its share until resized)."""
        loop = asyncio.get_running_loop()
        self._update()
        flow = Flow(self, math.inf if nbytes is None else max(0.0, float(nbytes)), loop.create_future())
        if not self._flows:
            self._t = loop.time()
        self._flows.append(flow)
        self._settle()
        return flow

    async def transfer(self, nbytes: float) -> None:
        """Carry ``nbytes`` (fair share among the concurrent flows); returns when through."""
        if nbytes <= 0:
            return
        flow = self.open(nbytes)
        try:
            await flow.wait()
        finally:
            flow.close()

    @property
    def active(self) -> int:
        return len(self._flows)

    # ---- processor sharing --------------------------------------------------
    def _update(self) -> None:
        """Credit every active flow with its share of the time since the last update."""
        if not self._flows:
            return
        now = asyncio.get_running_loop().time()
        dt = now - self._t
        while dt > 1e-12 and self._flows:
            n = len(self._flows)
            first = min(f.remaining for f in self._flows)
            need = first * n / self.rate  # time until the smallest flow completes at the fair share
            step = min(dt, need)
            share = step * self.rate / n
            for f in self._flows:
                f.delivered += share
            self.bytes_total += share * n
            self.busy_s += step
            dt -= step
            self._finish_done()
        self._t = now

    def _finish_done(self) -> None:
        for f in [f for f in self._flows if f.remaining <= 1e-6]:
            self._flows.remove(f)
            if not f.done.done():
                f.done.set_result(None)

    def _settle(self) -> None:
        """Complete flows that are through; arm the timer for the next completion."""
        self._finish_done()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._flows:
            return
        first = min(f.remaining for f in self._flows)
        if math.isinf(first):
            return  # only flows of unknown size: nothing completes until one is resized
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(self._t + first * len(self._flows) / self.rate, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._update()
        self._settle()

    def _remove(self, flow: Flow) -> None:
        if flow not in self._flows:
            return
        self._update()
        if flow in self._flows:
            self._flows.remove(flow)
        if not flow.done.done():
            flow.done.cancel()
        self._settle()


class LinkShaper:
    """A node's two links: ``egress`` (bytes it sends to peers) and ``ingress`` (bytes it receives)."""

    def __init__(self, rate: float, latency: float = 0.0, ingress_rate: float | None = None) -> None:
        self.egress = Link(rate, latency, "egress")
        self.ingress = Link(rate if ingress_rate is None else ingress_rate, latency, "ingress")

    def describe(self) -> dict[str, float]:
        return {"egress_bytes_s": self.egress.rate, "ingress_bytes_s": self.ingress.rate,
                "latency_s": self.egress.latency}
