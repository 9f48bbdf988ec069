"""A node that joins a running cluster is warmed from the forecast before routers send it traffic.

Pure logic over an explicit clock; the coordinator core (:mod:`kvstore.cluster.coordinator_core`) runs it
in the daemon and in the simulated replay. Rules:

1. **Who joins.** A live member the coordinator first sees once it has watched the membership for a
   heartbeat timeout (``settle_s``: the members it sees before are the cluster as it started, or as it
   found it on taking the role), or one that left and came back (a replaced node). With ``join_warm_s``
   0 nobody is warmed: a node serves as soon as it is a member.
2. **What it gets** (:func:`warm_copies`). Every prefix for which the rate forecaster expects at least
   one request a live node within the predictor's horizon (``expected`` over ``horizon_s``, the joiner
   counted: what it expects hot, spread over the nodes a router spreads it over), most requests first,
   one a chain, at the deepest depth a live node holds, from the holder with the fewest warm copies
   leaving it this tick, as speculative copies (an unread one sinks when its forecast ends), until the
   joiner's speculative share of its capacity is spent.
3. **When it serves.** A joiner is ``joining`` (``ClusterStatusResponse.joining``: routers leave it out)
   until each of its copies has landed or failed, or ``join_warm_s`` after it was first seen, whichever
   comes first; one with nothing to copy serves at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from kvstore.predict.types import PrefixId

__all__ = ["WarmCopy", "Warming", "warm_copies"]

WarmCopy = tuple[str, tuple[bytes, ...], str, str]
"""(namespace, keys, source, joiner)."""


@dataclass(slots=True)
class _Joiner:
    seen_at: float
    copies: int = 0         # its warm copies not yet ended
    planned: bool = False   # its copies were planned (or it had nothing to get)


class Warming:
    """The joiners of a cluster and their warm mark (the module doc)."""

    def __init__(self, bound_s: float, settle_s: float = 0.0) -> None:
        self.bound_s, self.settle_s = bound_s, settle_s
        self._since: float | None = None  # when it first saw the membership
        self._known: set[str] = set()
        self._joiners: dict[str, _Joiner] = {}
        self.joined = 0  # nodes warmed (or warming) since the start

    def see(self, live: Collection[str], now: float) -> list[str]:
        """The live members now; returns the joiners whose copies are still to be planned (rule 1)."""
        if self._since is None:
            self._since = now
        if not self.settled(now):
            self._known.update(live)
            return []
        if self.bound_s > 0:
            for node in live:
                if node not in self._known:
                    self._joiners[node] = _Joiner(now)
                    self.joined += 1
        self._known = set(live)
        for node in [n for n in self._joiners if n not in self._known]:
            del self._joiners[node]  # gone again before it was warm
        return [n for n, j in self._joiners.items() if not j.planned]

    def settled(self, now: float) -> bool:
        """Whether a member first seen now counts as joining (rule 1)."""
        return self._since is not None and now - self._since > self.settle_s

    def planned(self, node: str, copies: int) -> None:
        """``node``'s warm copies were started (``copies`` of them; 0: nothing to get, it serves now)."""
        joiner = self._joiners.get(node)
        if joiner is not None:
            joiner.planned, joiner.copies = True, joiner.copies + copies

    def ended(self, node: str) -> None:
        """One of ``node``'s warm copies landed or failed."""
        joiner = self._joiners.get(node)
        if joiner is not None:
            joiner.copies -= 1

    def joining(self, now: float) -> list[str]:
        """The members routers leave out now (rule 3)."""
        for node, j in list(self._joiners.items()):
            if (j.planned and j.copies <= 0) or now - j.seen_at >= self.bound_s:
                del self._joiners[node]
        return sorted(self._joiners)


def warm_copies(rows: Sequence[tuple[PrefixId, tuple[bytes, ...], int]], expected: Mapping[PrefixId, float],
                holders: Callable[[str, tuple[bytes, ...]], Mapping[str, int]],
                joiners: Sequence[str], room: Mapping[str, int]) -> list[WarmCopy]:
    """The copies that warm ``joiners`` (rule 2): ``rows`` are the hot prefixes (pid, chain, page bytes) with
    their ``expected`` requests; ``holders(namespace, chain)`` the live nodes holding a prefix of it, with
    its length; ``room`` each joiner's bytes for them."""
    groups: dict[tuple[str, bytes], list] = {}  # a chain (its first block) -> [most requests, longest chain, page]
    for pid, chain, page in rows:
        p = expected.get(pid, 0.0)
        if not chain:
            continue
        group = groups.get((pid[0], chain[0]))
        if group is None:
            groups[(pid[0], chain[0])] = [p, chain, page]
        else:
            group[0] = max(group[0], p)
            if len(chain) > len(group[1]):
                group[1] = chain
    out: list[WarmCopy] = []
    left = dict(room)
    sends: Counter[str] = Counter()
    for (namespace, _), (_, chain, page) in sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0])):
        sources = {n: length for n, length in holders(namespace, chain).items() if n not in joiners}
        if not sources:
            continue
        depth = max(sources.values())
        deepest = [n for n, length in sources.items() if length == depth]
        for joiner in joiners:
            if depth * page > left.get(joiner, 0):
                continue
            source = min(deepest, key=lambda n: (sends[n], n))
            sends[source] += 1
            left[joiner] -= depth * page
            out.append((namespace, chain[:depth], source, joiner))
    return out
