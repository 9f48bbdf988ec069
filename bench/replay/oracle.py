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


def plan(requests: Sequence[Any], reusable: Sequence[int], nodes: int, concurrency: int, cost: Any) -> list[int]:
    """The oracle's routes, from the whole future: per request, the node with the lowest modelled TTFT.

    A list-scheduling simulation of the engines with the cost model: each node
    has ``concurrency`` slots and one prefill unit. For request *i* (arrival
    order) and each node, the prefill can start once a slot and the unit are
    free; its reusable prefix is cached there if the node computed it, or if
    it can be copied there over the link from where it was computed by then
    (``cost.link_s``); otherwise the prefix is recomputed. The node with the
    lowest start + prefill (ties: fewest requests planned so far) wins, and
    the simulation books it. Stale views and prefixes still in prefill are
    what the router-based oracle got wrong; this one knows when each prefix
    is ready.
    """
    import heapq

    slots = [[0.0] * concurrency for _ in range(nodes)]  # heaps of slot free times
    unit = [0.0] * nodes                                   # prefill unit free time
    ready: dict[int, dict[int, float]] = {}                # block id -> node -> time computed there
    count = [0] * nodes
    out = []
    for req, want in zip(requests, reusable):
        t, ids = req.t, req.hash_ids
        best: tuple[float, int, int, float] | None = None
        for n in range(nodes):
            start = max(t, slots[n][0], unit[n])
            cached = 0
            if want:
                where = ready.get(ids[want - 1], {})
                if where:
                    at = where.get(n, min(where.values()) + cost.link_s(want))
                    cached = want if at <= start else 0
            end = start + cost.prefill_s(cost.uncached_tokens(req.input_length, cached))
            if best is None or (end, count[n]) < (best[0], count[best[1]]):
                best = (end, n, cached, start)
        assert best is not None
        end, n, _, _ = best
        unit[n] = end
        heapq.heapreplace(slots[n], end + cost.decode_s(req.input_length, req.output_length))
        for h in ids:
            ready.setdefault(h, {}).setdefault(n, end)
        count[n] += 1
        out.append(n)
    return out
