"""The discrete-event kernel of the simulated replay: a clock, events, processes, FIFO locks, fluid links.

Pure logic, no I/O, no wall clock: time is whatever the caller says (the
simulated replay uses trace seconds). Processes are generators that yield
:class:`Event`\\ s and resume with the event's value once it fires.

Links are the same physics as the real shaper (``kvstore/transport/shaper.py``):
each node has an egress and an ingress link, and the flows on one link share
its rate by processor sharing (n flows each progress at ``rate / n``),
computed exactly by waking at the next completion. A transfer between two
nodes is one flow on the source's egress and one on the target's ingress,
each progressing on its own link (the slower of the two sets the time, as in
``kvstore/transport/shaped.py``), plus one link latency each way.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

_EPS = 1e-9

Process = Generator["Event", Any, Any]


class Event:
    """Something that happens once; callbacks run when it fires (with its value)."""

    __slots__ = ("sim", "callbacks", "fired", "value")

    def __init__(self, sim: "Sim") -> None:
        self.sim, self.callbacks, self.fired, self.value = sim, [], False, None

    def succeed(self, value: Any = None) -> "Event":
        if self.fired:
            return self
        self.fired, self.value = True, value
        callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            self.sim.at(0.0, cb, value)
        return self

    def then(self, cb: Callable[[Any], None]) -> None:
        if self.fired:
            self.sim.at(0.0, cb, self.value)
        else:
            self.callbacks.append(cb)


class Sim:
    """The clock and the event heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` ``delay`` seconds from now (same-time calls run in order)."""
        self._seq += 1
        heapq.heappush(self._heap, (self.now + max(0.0, delay), self._seq, fn, args))

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, value: Any = None) -> Event:
        ev = Event(self)
        self.at(delay, ev.succeed, value)
        return ev

    def process(self, gen: Process) -> Event:
        """Run a generator process; the returned event fires with its return value."""
        done = Event(self)

        def step(value: Any = None) -> None:
            try:
                ev = gen.send(value)
            except StopIteration as stop:
                done.succeed(stop.value)
                return
            ev.then(step)

        self.at(0.0, step)
        return done

    def all_of(self, events: Iterable[Event]) -> Event:
        evs = list(events)
        out = Event(self)
        left = [sum(1 for e in evs if not e.fired)]
        if not left[0]:
            return out.succeed()

        def one(_: Any) -> None:
            left[0] -= 1
            if left[0] == 0:
                out.succeed()

        for e in evs:
            if not e.fired:
                e.callbacks.append(one)
        return out

    def any_of(self, events: Iterable[Event]) -> Event:
        out = Event(self)
        for e in events:
            e.then(lambda v, e=e: out.succeed(e))
        return out

    def run(self, until: float = math.inf) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


class Semaphore:
    """A FIFO counting semaphore (an engine's slots; with 1, a FIFO lock like ``asyncio.Lock``)."""

    def __init__(self, sim: Sim, value: int = 1) -> None:
        self.sim, self.free, self._waiters = sim, int(value), deque[Event]()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def acquire(self) -> Event:
        ev = self.sim.event()
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return ev.succeed()
        self._waiters.append(ev)
        return ev

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().succeed()
        else:
            self.free += 1


class _Part:
    __slots__ = ("remaining", "done")

    def __init__(self, nbytes: float, done: Event) -> None:
        self.remaining, self.done = nbytes, done


class Link:
    """One direction of one node's link, shared by processor sharing (see the module doc)."""

    def __init__(self, sim: Sim, rate: float, name: str = "") -> None:
        if rate <= 0 or not math.isfinite(rate):
            raise ValueError(f"link rate must be a positive number of bytes/s, not {rate!r}")
        self.sim, self.rate, self.name = sim, float(rate), name
        self.parts: list[_Part] = []
        self._t = 0.0
        self._version = 0
        self.bytes_total = 0.0
        self.busy_s = 0.0

    def carry(self, nbytes: float) -> Event:
        """A flow of ``nbytes`` on this link; fires once it is through."""
        done = self.sim.event()
        self.bytes_total += nbytes
        if nbytes <= 0:
            return done.succeed()
        self._update()
        self.parts.append(_Part(float(nbytes), done))
        self._reschedule()
        return done

    def _update(self) -> None:
        now = self.sim.now
        dt = now - self._t
        if self.parts and dt > 0:
            each = dt * self.rate / len(self.parts)
            for p in self.parts:
                p.remaining -= each
            self.busy_s += dt
        self._t = now

    def _reschedule(self) -> None:
        self._version += 1
        if self.parts:
            least = min(p.remaining for p in self.parts)
            self.sim.at(max(0.0, least) * len(self.parts) / self.rate, self._fire, self._version)

    def _fire(self, version: int) -> None:
        if version != self._version:
            return  # the flows changed since this wake-up was planned
        self._update()
        tol = _EPS * max(1.0, self.rate)
        done = [p for p in self.parts if p.remaining <= tol]
        self.parts = [p for p in self.parts if p.remaining > tol]
        for p in done:
            p.done.succeed()
        self._reschedule()


class Network:
    """Every node's egress and ingress link, and transfers between nodes."""

    def __init__(self, sim: Sim, nodes: int, rate: float, latency: float = 0.0) -> None:
        self.sim, self.latency = sim, float(latency)
        self.egress = [Link(sim, rate, f"n{i}-egress") for i in range(nodes)]
        self.ingress = [Link(sim, rate, f"n{i}-ingress") for i in range(nodes)]
        self.bytes_in = [0.0] * nodes

    def transfer(self, src: int, dst: int, nbytes: float) -> Event:
        """Move ``nbytes`` from ``src`` to ``dst``: a request latency, both links' flows, a reply latency."""
        done = self.sim.event()
        self.bytes_in[dst] += nbytes

        def start(_: Any = None) -> None:
            both = self.sim.all_of([self.egress[src].carry(nbytes), self.ingress[dst].carry(nbytes)])
            both.then(lambda _: self.sim.at(self.latency, done.succeed))

        self.sim.at(self.latency, start)
        return done

    def describe(self) -> dict[str, object]:
        return {"kind": "simulated", "rate_bytes_s": self.egress[0].rate if self.egress else 0.0,
                "latency_s": self.latency,
                "shaping": "fluid processor sharing per node and direction (kvstore/replay/sim_kernel.py)"}
