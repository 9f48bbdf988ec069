"""Candidate selection: the few hundred rows of the predictor's score vector worth planning.

Vectorised and pure (numpy only): the coordinator calls :func:`select_candidates` every tick over the
scores of 100k+ prefixes and builds :class:`~kvstore.placement.planner_types.Candidate` objects only for
the rows it returns (rule 1 of :mod:`kvstore.placement.planner`), less those :func:`gate_row` turns away.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.placement.planner_types import Candidate


def select_candidates(probs: np.ndarray, threshold: float, limit: int) -> np.ndarray:
    """Row indices of the ``limit`` highest scores ``>= threshold``, best first.

    This is what keeps a tick cheap with 100k active prefixes: one
    vectorised pass and an ``argpartition`` instead of a Python object per
    prefix; only the rows returned become :class:`Candidate` objects.

    Deterministic under ties: equal scores are ordered by row index, and at
    the ``limit`` boundary the lowest indices win. NaN scores never qualify.
    Returns an ``intp`` array (empty when nothing qualifies or ``limit <= 0``).
    """
    probs = np.asarray(probs)
    if probs.ndim != 1:
        raise ValueError(f"probs must be 1-D, got shape {probs.shape}")
    if limit <= 0 or probs.size == 0:
        return np.empty(0, dtype=np.intp)
    idx = np.flatnonzero(probs >= threshold)  # NaN >= x is False
    vals = probs[idx]
    if idx.size > limit:
        # kth largest value; everything above it is in, ties at it fill up by index.
        kth = vals[np.argpartition(vals, idx.size - limit)[idx.size - limit]]
        above = vals > kth
        n_tied = limit - int(np.count_nonzero(above))
        tied = np.flatnonzero(vals == kth)[:n_tied]  # idx is ascending, so lowest rows
        keep = np.flatnonzero(above)
        keep = np.concatenate((keep, tied))
        idx, vals = idx[keep], vals[keep]
    order = np.lexsort((idx, -vals))  # prob descending, then row ascending
    return idx[order].astype(np.intp, copy=False)


GATE_REASONS = ("", "too_late", "no_room", "bandwidth", "no_target", "unknown_size")
"""What :func:`gate_row` returns, by index: ``""`` (a copy may start) or the reason
:func:`~kvstore.placement.planner.plan` would give for skipping it."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What any further copy of a tick can get at best (``planner.tick_bounds``, ``_Tick.limits``)."""

    rate: float   # bytes/s of the fastest copy any source could send any target
    room: int     # most speculative bytes any one node can take
    budget: int   # copy bytes the tick may spend
    nodes: int    # live nodes


def gate_row(least: float, need_in_s: float, b: Bounds, safety: float) -> int:
    """The index in :data:`GATE_REASONS` of why no copy of a row can start this tick, 0 when one may.

    ``least``: its shallowest usable copy in bytes (the smallest depth option within its chain, times its
    page bytes; 0 when no depth is usable, -1 when the page size is unknown). The planner's cheap checks
    (rules 3 and 6 of :mod:`kvstore.placement.planner`), in its order. Room, rate and budget only shrink as
    a tick books copies, so a row turned away here is turned away by :func:`plan` wherever it comes in
    the order: the caller need not build its candidate unless another candidate reads its demand or
    score (a prefix of the same chain). Scalar on purpose: a tick gates a few rows at a time, where a
    numpy call costs more than the rule."""
    if b.budget <= 0:  # plan() checks its budget before anything else
        return 3
    if b.nodes == 0:
        return 4
    if least < 0:
        return 5
    if least == 0 or b.rate <= 0 or least / b.rate * safety > need_in_s:
        return 1
    if least > b.room:
        return 2
    if least > b.budget:
        return 3
    return 0


@dataclass(frozen=True, slots=True)
class Ranked:
    """Candidates built only as far as a tick gets (``plan(..., ranked=)``): most of a busy tick's
    candidates are turned away once the cluster's room or the byte budget is spent, so there is no
    need to build them.

    A row is a chain: the candidates sharing its first block, built together (they read each other's
    scores and demands). Rows in nonincreasing ``prob`` order, the best of the chain's; for the gate,
    its smallest ``least_bytes`` and its longest ``need_in_s`` (so a row turned away has every
    candidate turned away), and ``count``, its candidates at the copy threshold. ``build(lo, hi)``
    returns the candidates of rows ``lo`` to ``hi - 1``. A row shares no chain with another row or
    with the eagerly passed candidates, and is not under review: only its copies are at stake."""

    prob: np.ndarray
    need_in_s: np.ndarray
    least_bytes: np.ndarray            # as gate_row() takes it
    count: np.ndarray
    build: Callable[[int, int], Sequence[Candidate]]

    def __len__(self) -> int:
        return len(self.prob)


RANK_CHUNK = 32
"""Rows of :class:`Ranked` built at once."""


def unfold(ranked: Ranked, built_already: Sequence[Candidate], threshold: float, state: Callable[[], Bounds | str],
           safety: float, skip: Callable[[str, int], None], built: Callable[[Sequence[Candidate]], None],
           order: Callable[[Candidate], tuple]) -> Iterator[Candidate]:  # type: ignore[type-arg]
    """``built_already`` (in ``order`` already) and the candidates of ``ranked``'s rows at ``prob >=
    threshold``, in ``order``; the rows are built a chunk at a time, only once the next row could hold
    the next candidate in that order (ties: ``built_already`` first). Before each chunk ``state()``
    gives either a reason for every row left (``"cap"``, ``"bandwidth"``) or the tick's bounds now;
    rows :func:`gate_row` turns away are counted with ``skip`` (``count`` each) and never built (the
    bounds only shrink, so they would be turned away at their turn too), and ``built`` sees each chunk
    before any of it is yielded."""
    n = int(np.searchsorted(-ranked.prob, -threshold, side="right"))  # rows with prob >= threshold
    probs, least, need_in, counts = [a[:n].tolist() for a in (ranked.prob, ranked.least_bytes, ranked.need_in_s,
                                                               ranked.count)]
    early = built_already  # in order already: read from the front, not heaped
    early_keys = [order(c) for c in early]
    i = 0
    ready: list[tuple[tuple, int, Candidate]] = []  # type: ignore[type-arg]  # built from rows: a heap
    lo = seq = 0
    while True:
        best = -early_keys[i][0] if i < len(early) else -1.0  # the best ready candidate's prob
        if ready and -ready[0][0][0] > best:
            best = -ready[0][0][0]
        # a candidate not built yet has prob <= probs[lo]: build until the best ready one beats that
        while lo < n and best <= probs[lo]:
            now = state()
            if isinstance(now, str):
                skip(now, sum(counts[lo:n]))
                n = lo
                break
            hi = min(n, lo + RANK_CHUNK)
            keep: list[int] = []
            for row in range(lo, hi):
                code = gate_row(least[row], need_in[row], now, safety)
                if code:
                    skip(GATE_REASONS[code], counts[row])
                else:
                    keep.append(row)
            if keep:
                chunk: list[Candidate] = []
                for a, b in _runs(keep):
                    chunk.extend(ranked.build(a, b))
                built(chunk)
                for c in chunk:
                    heapq.heappush(ready, (order(c), seq, c))
                    seq += 1
                if ready and -ready[0][0][0] > best:
                    best = -ready[0][0][0]
            lo = hi
        if i < len(early) and (not ready or early_keys[i] <= ready[0][0]):
            yield early[i]
            i += 1
        elif ready:
            yield heapq.heappop(ready)[2]
        else:
            return


def _runs(rows: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive rows (at least one)."""
    start = prev = rows[0]
    for r in rows[1:]:
        if r != prev + 1:
            yield start, prev + 1
            start = r
        prev = r
    yield start, prev + 1


__all__ = ["GATE_REASONS", "RANK_CHUNK", "Bounds", "Ranked", "gate_row", "select_candidates", "unfold"]
