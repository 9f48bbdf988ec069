"""Watched lookups: a follower waits for a claim or a copy without polling.

A follower that waits for another node's prefill (a claim) or for a copy on
its way used to re-ask every few milliseconds, and each re-ask on a node that
does not coordinate is two RPCs, one of them to the coordinator. A burst of a
hundred followers then spends more of the cluster's CPU on asking than on
moving pages. ``LookupRequest.wait_seconds`` turns the re-ask into one call
per change: the directory holder answers once its answer differs from the
one it would have given when the call came, or when the wait is up.

What counts as a change (:func:`shape`): a node's prefix length of the keys,
or its ``pending`` / ``computing`` flag. Not the times (``ready_in_seconds``,
``expires_in_seconds``) or ``copies_ahead``, which move on their own. The
owner calls :meth:`Watches.changed` with the keys of every directory report
it applied and every claim it recorded, which wakes the watches of those keys
only, and without keys when a member went; a watch also re-draws its answer
every :data:`RECHECK_S`, which catches what changes with time alone (a claim
that expired unfulfilled).

Bounded: at most ``limit`` watches at a time per node; beyond that a watch
answers at once, as a plain lookup, and its caller polls as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from kvstore.v1 import kvstore_pb2 as pb

RECHECK_S = 0.1  # a watch re-draws its answer at least this often (claims expire with time, unannounced)
MAX_WATCHES = 4096


def shape(nodes: Sequence[pb.NodePrefix]) -> frozenset[tuple[str, int, bool, bool]]:
    """What a watch compares: who holds how much, and what is on its way."""
    return frozenset((n.node_id, n.prefix_length, n.pending, n.computing) for n in nodes)


class Watches:
    """The watched lookups of one node. :meth:`changed` wakes those whose keys it names (all of them
    without keys); each woken watch re-draws its answer and compares."""

    def __init__(self, limit: int = MAX_WATCHES) -> None:
        self.limit = limit
        self._all: set[asyncio.Event] = set()
        self._by_key: dict[tuple[str, bytes], set[asyncio.Event]] = {}

    @property
    def active(self) -> int:
        return len(self._all)

    def changed(self, namespace: str | None = None, keys: Iterable[bytes] = ()) -> None:
        """Pages of ``keys`` came, went or were claimed (``namespace`` None: anything may have
        changed, e.g. a member went): the watches of those keys re-draw their answers."""
        if namespace is None:
            woken: Iterable[asyncio.Event] = self._all
        else:
            by_key = self._by_key
            woken = {ev for k in keys for ev in by_key.get((namespace, k), ())} if by_key else ()
        for ev in woken:
            ev.set()

    async def until_changed(self, first: list[pb.NodePrefix], draw: Callable[[], list[pb.NodePrefix]],
                            wait_s: float, namespace: str = "", keys: Sequence[bytes] = ()) -> list[pb.NodePrefix]:
        """``first``, or once :func:`shape` of ``draw()`` differs from it, that answer; at most
        ``wait_s`` seconds (then the answer as it is). ``namespace``/``keys``: what the answer is
        about (:meth:`changed` of those wakes it). At the limit of watches, ``first`` at once."""
        if wait_s <= 0 or len(self._all) >= self.limit:
            return first
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        want = shape(first)
        ev = asyncio.Event()
        self._all.add(ev)
        index = [(namespace, k) for k in dict.fromkeys(keys)]
        for pid in index:
            self._by_key.setdefault(pid, set()).add(ev)
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    return draw()
                try:
                    await asyncio.wait_for(ev.wait(), min(left, RECHECK_S))
                except asyncio.TimeoutError:
                    pass
                ev.clear()
                now = draw()
                if shape(now) != want:
                    return now
        finally:
            self._all.discard(ev)
            for pid in index:
                waiting = self._by_key.get(pid)
                if waiting is not None:
                    waiting.discard(ev)
                    if not waiting:
                        del self._by_key[pid]


__all__ = ["MAX_WATCHES", "RECHECK_S", "Watches", "shape"]
