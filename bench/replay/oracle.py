"""The oracle policy's look-ahead: the benefit ceiling of replication.

The daemons run ``--replication reactive``; the harness itself places copies
from the trace's future:

1. ``lead_s`` (trace time) before request *i* arrives, the oracle routes it
   with the **same router** as the other policies, but tells the router that
   every node can hold the request's reusable prefix (the part an earlier
   request computed: :func:`bench.replay.workload.reusable_blocks`), since
   the oracle will copy it wherever it sends the request. Cache-aware routing
   then balances load among all nodes, preferring real holders on ties.
   The decision is reserved (it counts as load on that node until the request
   arrives), so a burst decided within one lead window spreads.
2. Until the request arrives, it issues ``Replicate`` (kind SPECULATIVE, with
   a TTL) of the cluster-cached part of that prefix to the chosen node, from
   the node that holds the most of it, and repeats while an earlier request
   is still producing more of it (bounded by the arrival time).
3. On arrival the request goes to the chosen node, no routing.

Everything here is pure; the driver does the calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from bench.replay.routers import NodeView


def schedule(arrivals: Sequence[float], lead_s: float) -> list[tuple[float, int]]:
    """``(decide_at, index)`` for every request, in decision order (trace seconds, >= 0)."""
    return sorted((max(0.0, t - lead_s), i) for i, t in enumerate(arrivals))


def oracle_views(views: Sequence[NodeView], want: int) -> list[NodeView]:
    """Views in which every node can hold the first ``want`` blocks (the oracle will copy them)."""
    if want <= 0:
        return [replace(v) for v in views]
    return [replace(v, hinted=max(v.hinted, want)) for v in views]


def copy_source(entries: Iterable[Any], target: str, want: int) -> tuple[str, int] | None:
    """Where to copy the request's prefix from: ``(source node, blocks)``, or None.

    ``entries`` are ``LookupResponse.nodes`` (pending ones are ignored: they do
    not hold anything yet). The source is the node holding the most of the
    first ``want`` blocks; the copy is needed only if it holds more than the
    target does.
    """
    have, best, source = 0, 0, ""
    for e in entries:
        if e.pending:
            continue
        n = min(int(e.prefix_length), want)
        if e.node_id == target:
            have = max(have, n)
        elif n > best or (n == best and source and e.node_id < source):
            best, source = n, e.node_id
    if best > have and source:
        return source, best
    return None


class Reservations:
    """Requests the oracle has routed but that have not arrived yet, per node (counted as load)."""

    def __init__(self, nodes: int) -> None:
        self.count = [0] * nodes
        self.node_of: dict[int, int] = {}

    def reserve(self, request: int, node: int) -> None:
        self.node_of[request] = node
        self.count[node] += 1

    def arrive(self, request: int) -> int | None:
        """The node reserved for ``request`` (and the reservation ends), or None."""
        node = self.node_of.pop(request, None)
        if node is not None:
            self.count[node] -= 1
        return node
