"""The shape of a copy tree, pure: which node sends to which, in how many waves or relayed parts, and how
many single-copy times its last target waits. The planner shapes its demand-sized decisions with it,
the claims their waiter trees, and the coordinator carries both out (``CoordinatorCore.copy_tree``)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def copy_tree(sources: Sequence[str], targets: Sequence[str], fanout: int,
              chunks: int = 1) -> tuple[list[tuple[str, str]], int]:
    """Edges ``(from, to)`` of a copy tree, in wave order, and its number of waves.

    Store and forward (``chunks`` 1): wave 1, each source sends to ``fanout``
    targets; from then on every node that holds the pages (sources and
    landed targets) sends to ``fanout`` more. So k targets take about
    ``log_(1+fanout)(k / sources + 1)`` waves instead of ``k / fanout`` sends
    out of one node's egress.

    Relayed (``chunks`` > 1): each source heads one chain of the targets and
    every target forwards each of the ``chunks`` parts of the copy as soon as
    that part landed (the coordinator core's ``copy_tree`` runs both shapes), so
    the last of L targets behind a source holds it after about
    ``1 + (L - 1) / chunks`` copy times (:func:`copy_times`); ``waves`` is that
    rounded up."""
    if chunks > 1 and sources and targets:
        chains: list[list[str]] = [[s] for s in sources]
        for i, target in enumerate(targets):
            chains[i % len(chains)].append(target)
        longest = max(len(c) for c in chains) - 1
        hops = [(c[hop], c[hop + 1]) for hop in range(longest) for c in chains if hop + 1 < len(c)]
        return hops, math.ceil(copy_times(len(sources), len(targets), fanout, chunks) - 1e-9)
    servers, fanout = list(sources), max(1, fanout)
    edges: list[tuple[str, str]] = []
    waves = done = 0
    while done < len(targets):  # a wave: each server in turn sends to the next fanout targets
        waves += 1
        start = done
        for server in servers:
            if done >= len(targets):
                break
            edges.extend((server, target) for target in targets[done:done + fanout])
            done = min(done + fanout, len(targets))
        servers.extend(targets[start:done])
    return edges, max(waves, 1)


def arrival_waves(edges: Sequence[tuple[str, str]], fanout: int) -> dict[str, int]:
    """The wave in which each target of a store-and-forward tree (:func:`copy_tree`'s ``edges``, in wave
    order) holds the copy: a sender sends ``fanout`` at a time, its next ``fanout`` once those landed,
    from the wave after its own copy landed (its sources' wave 0). A target of the first wave is due
    after one wave, not after the whole tree."""
    fanout = max(1, fanout)
    wave: dict[str, int] = {}
    sent: dict[str, int] = {}
    for src, dst in edges:
        k = sent.get(src, 0)
        sent[src] = k + 1
        wave[dst] = wave.get(src, 0) + 1 + k // fanout
    return wave


def copy_times(sources: int, targets: int, fanout: int, chunks: int = 1) -> float:
    """Single-copy times until the last of ``targets`` holds a prefix that ``sources`` nodes hold, copied
    as :func:`copy_tree` shapes it: waves x fanout store and forward (each wave's copies share their
    sender's egress), ``1 + (L - 1) / chunks`` relayed along chains of L targets."""
    if targets <= 0:
        return 0.0
    sources = max(1, sources)
    if chunks > 1:
        return 1.0 + (math.ceil(targets / sources) - 1) / chunks
    return float(copy_tree([str(i) for i in range(sources)], [""] * targets, fanout)[1] * max(1, fanout))


def relay_parts(copy_s: float, chunks: int, min_part_s: float) -> int:
    """Parts to relay a copy of ``copy_s`` seconds in (at most ``chunks``; 1 = store and forward): each part
    costs a Replicate round trip per hop, so a copy is cut only into parts that take ``min_part_s`` or more
    (on a link fast next to the copy, relaying would buy less than its round trips cost)."""
    if chunks <= 1 or not copy_s > 0:
        return 1
    return max(1, min(chunks, int(copy_s // min_part_s)))


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the parts a relayed copy of ``n`` keys goes in: ``chunks`` near-equal ones, in
    order (fewer when ``n`` is smaller, one part when ``chunks`` <= 1)."""
    parts = max(1, min(chunks, n))
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
