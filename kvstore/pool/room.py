"""Room for forecast copies: what a full pool gives up for one, what that costs, how long a copy stays.

The rules the daemon's pool (:class:`~kvstore.pool.pool.PagePool`, with the tier stack below it) and the
replay's simulated pool (:class:`~kvstore.replay.sim_cluster.SimPool`) both follow, and the placement
planner prices with. Pure: no I/O, no clock.

1. **Eviction order** (:func:`victim`). For room, a pool evicts its least recently used primary or
   replica page first, and a speculative copy (a forecast copy, not yet read) only when no other page is
   left to evict. A copy is protected until its forecast has passed: its expiry, which the planner renews
   while the forecast still scores the prefix hot, and lets pass (or ends with a ``DropSpeculative``) once
   it decays. Pinned (leased) or read pages are never evicted.
2. **Displacement** (:func:`cold_price`, :func:`copy_value`). A node reports the bytes it could give up
   for a copy (``cold_bytes``: its unheld primary and replica pages, coldest first) and their price
   (``cold_reads``: the expected reads of the coldest of them after eviction, the tier admission's reuse
   estimate of a page never read since it was stored; :data:`PRIOR_READS` on a node without a learned
   one). The planner counts those bytes as room for a copy only when the copy's expected reads, the
   forecast's probability times the requests each copy serves, exceed that price: it places nothing
   where displacing does not pay. What the copy pushes out goes down to the tier below as any eviction
   does (the tier's admission decides), or is gone on a node without one.
3. **Sinking.** A copy whose forecast ended (its expiry passed, or the planner dropped
   it as decayed or surplus) goes down to the tier below like an evicted page, read or not, and from
   there through the tiers to nothing by their own eviction; a quiet period holds fewer copies in the
   pool, and a prefix that comes back finds its copy one tier down. A copy never read before it left the
   pool counts as wasted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, TypeVar

__all__ = ["PRIOR_READS", "cold_price", "copy_value", "victim"]

V = TypeVar("V")

PRIOR_READS = 0.5
"""The expected reads of an evicted page on a node that has learned none: the tier admission's prior,
``(reused + 1) / (evicted + 2)`` before any outcome."""


def victim(spec: OrderedDict[bytes, V], lru: OrderedDict[bytes, V]) -> tuple[OrderedDict[bytes, V], str]:
    """The queue a pool evicts from next, and the reason it counts: the least recently used plain page
    first, a protected speculative copy (oldest first) only when no plain page is left (rule 1)."""
    return (lru, "lru") if lru else (spec, "speculative")


def cold_price(admission: Any) -> float:
    """The expected reads of a page a copy would push out (rule 2): the admission's learned reuse rate of
    a primary page never read since it was stored, or :data:`PRIOR_READS` without one."""
    rate = getattr(admission, "rate", None)
    return float(rate(admission.classify(0, 1))) if rate is not None else PRIOR_READS


def copy_value(prob: float, demand: float, copies: int) -> float:
    """The expected reads of one page of a forecast copy (rule 2): ``prob`` that its prefix is needed
    where it lacks, times the forecast requests (``demand``, 0: unknown, then one) each of ``copies``
    replicas serves."""
    return prob * max(1.0, demand / max(1, copies))
