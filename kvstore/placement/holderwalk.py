"""Who holds a candidate's prefix, depth by depth: the planner's walk from the deepest depth up.

Pure logic over a :class:`~kvstore.placement.planner_types.Candidate`, the live nodes, the speculative
replicas and the copies planned this tick; used by :func:`kvstore.placement.planner.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.placement.planner_types import Candidate
from kvstore.placement.renewals import Speculative
from kvstore.predict.types import PrefixId


class HolderWalk:
    """Live nodes holding the first ``d`` blocks of a candidate, asked for
    deepest ``d`` first.

    Holding a deeper prefix implies holding every shallower one (chained
    keys), so holders accumulate from the deepest known block up, and only
    as far as the planner asks; unexpired speculative replicas count as
    holders too (the directory may lag behind the copies). Copies planned
    earlier in this tick (another candidate naming the same blocks, e.g. the
    depth-4 and depth-8 prefixes of one chain) are tracked apart: they make
    a node no target, but not yet a source.
    """

    __slots__ = ("_c", "_live", "_spec", "_planned", "_now", "_known", "_acc", "_pending", "_next")

    def __init__(
        self,
        c: Candidate,
        live: Mapping[str, object],
        speculative: Speculative,
        planned: Mapping[PrefixId, set[str]],
        now: float,
    ) -> None:
        self._c, self._live, self._spec, self._planned, self._now = c, live, speculative, planned, now
        n = len(c.chain)
        self._known = frozenset(c.holders)  # the depths with holders (LazyHolders: no lookup yet)
        self._acc: set[str] = set()
        for d in self._known:
            if d > n:  # beyond the known keys
                self._acc.update(c.holders[d])
        self._pending: set[str] = set()
        self._next = n  # next depth to fold in

    def at(self, depth: int) -> tuple[set[str], set[str]]:
        """(live holders, live nodes with a copy planned this tick) of the
        first ``depth`` blocks; ``depth`` never increases between calls."""
        d = self._next
        if d >= depth:
            c, acc, spec, planned, now = self._c, self._acc, self._spec, self._planned, self._now
            ns, chain, holders, known = c.namespace, c.chain, c.holders, self._known
            while d >= depth:
                if d in known:
                    acc.update(holders[d])
                pid = (ns, chain[d - 1])
                placed = spec.get(pid)
                if placed:
                    for node, expires_at in placed.items():
                        if expires_at > now:
                            acc.add(node)
                pending = planned.get(pid)
                if pending:
                    self._pending.update(pending)
                d -= 1
            self._next = d
        held = self._acc.intersection(self._live)
        if not self._pending:
            return held, set()
        pending = self._pending.intersection(self._live)
        pending -= held
        return held, pending


__all__ = ["HolderWalk"]
