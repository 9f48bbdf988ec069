"""In-flight prefill claims: who is computing a prefix right now, and when it will be ready.

Pure logic, no I/O; the coordinator's agent keeps one :class:`Claims` beside
its :class:`~kvstore.cluster.directory.Directory`, and the simulated replay
keeps another.

The problem it answers: a burst of requests that share a *new* context (an
agent fan-out, a shared document) arrives while the first request is still in
its prefill. Nothing is cached anywhere yet, so without claims every node
that gets a follower recomputes the same context -- k prefills of the same
tokens, on engines that are the bottleneck. With claims:

1. the engine that misses and is about to prefill says so
   (``Lookup(claim_seconds=its expected prefill)``), and the coordinator
   records ``(namespace, key) -> (node, ready at)`` for every key of the chain
   that nobody else has claimed (first come, first served: the directory's
   answers are serial on the coordinator's loop, so two claimants of one key
   cannot both win);
2. a follower's Lookup, on any node, sees the claimant as
   ``NodePrefix(pending=true, computing=true, ready_in_seconds=...)`` and
   its connector waits for it when ``ready_in + the copy < its own prefill``
   (``kvstore_client.claims``: the engines decide), then Gets, which pulls;
3. the claimant's Put reaches the directory (its node reports at once while
   it holds claims), which resolves the claim: from then on the node is an
   ordinary holder.

A claim is soft state: it expires at ``ready at + grace`` whether or not the
Put came (the claimant died, or its request was cancelled), so a follower
never waits on a claim longer than the claimant said plus the grace, and a
coordinator's restart loses nothing but the chance to share that prefill.

Who waited on a claim is kept with it (``waiters``): the nodes that will pull
the prefix once it lands, for the coordinator to copy to as a tree instead
of k pulls on the claimant's egress. A node that was shown the claim
(``asked``) waits only if its engine decided waiting beats computing; it
shows that by looking again (a lookup that records no request: the
follower's re-look). One that computes instead never re-looks, gets no copy
of a prefix it is computing itself, and does not count as a copy ahead of
the real waiters.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.placement.copytree import copy_times, copy_tree
from kvstore.placement.planner_types import Decision

DEFAULT_MAX_KEYS = 200_000      # claimed keys kept at once (a claim that does not fit is not recorded)
DEFAULT_GRACE_S = 2.0           # a claim lives this long past its ready time before it is dropped
SPREAD_AT_WAITERS = 2           # this many nodes waiting on one claim: copy it to every live node


@dataclass(slots=True)
class Claim:
    """One claimant's in-flight prefill of a chain."""

    node: str
    namespace: str
    ready_at: float                 # when the claimant expects to Put (its clock: the coordinator's monotonic)
    expires_at: float               # dropped after this, Put or not
    keys: list[bytes] = field(default_factory=list)   # the keys this claim won, in chain order
    chain: list[bytes] = field(default_factory=list)  # the claimant's chain up to its last won key
    needed: int = 0                                   # the longest prefix of it a waiter asked for
    asked: set[str] = field(default_factory=set)      # nodes whose requests' lookups were answered with it
    waiters: set[str] = field(default_factory=set)    # those of them that looked again: they wait for it
    seconds: float = 0.0                              # what the claimant said its queue and prefill take


@dataclass(slots=True, frozen=True)
class Seen:
    """What a lookup learns of one claimant: it computes ``length`` leading keys of the chain."""

    node: str
    length: int
    ready_in: float
    copies_ahead: int = 0  # copy times before the asker's copy ends, less one (see Claims.tree_fanout)


class Claims:
    """The coordinator's table of in-flight prefills (see the module doc)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, grace_s: float = DEFAULT_GRACE_S,
                 tree_fanout: int = 0) -> None:
        # tree_fanout: 0 = every waiter pulls from the claimant (one egress shared by all: copies_ahead is
        # the other waiters); > 0 = the coordinator copies to the waiters as a tree of this fanout, relayed
        # in tree_parts(namespace, keys) parts when > 1 (copies_ahead + 1 = copytree.copy_times, rounded up)
        self.max_keys, self.grace_s, self.tree_fanout = max_keys, grace_s, tree_fanout
        self.tree_parts: Callable[[str, int], int] = lambda namespace, n: 1
        self._by_key: dict[tuple[str, bytes], Claim] = {}
        self._expiry: list[tuple[float, int, Claim]] = []   # heap: claims by expiry, for an O(log n) prune
        self._seq = itertools.count()
        self.refused = 0   # claims not recorded because the table was full

    def __len__(self) -> int:
        return len(self._by_key)

    def claim(self, namespace: str, keys: Sequence[bytes], node: str, seconds: float, now: float,
              start: int = 0) -> Claim | None:
        """``node`` will compute ``keys[start:]`` and store the whole chain within ``seconds``; record the
        keys nobody else claims. ``start`` is how much of the chain the cluster already holds (those
        keys are not claimed: they can be read now). Returns the claim, or None when it won no key or
        the table is full."""
        self.prune(now)
        if seconds <= 0 or start >= len(keys):
            return None
        won = [k for k in dict.fromkeys(keys[start:]) if self._live((namespace, k), now) is None]
        if not won:
            return None
        if len(self._by_key) + len(won) > self.max_keys:
            self.refused += 1
            return None
        taken = set(won)
        last = max(i for i, k in enumerate(keys) if k in taken)
        c = Claim(node=node, namespace=namespace, ready_at=now + seconds,
                  expires_at=now + seconds + self.grace_s, keys=won, chain=list(keys[:last + 1]), seconds=seconds)
        for k in won:
            self._by_key[(namespace, k)] = c
        heapq.heappush(self._expiry, (c.expires_at, next(self._seq), c))
        return c

    def _live(self, slot: tuple[str, bytes], now: float) -> Claim | None:
        c = self._by_key.get(slot)
        if c is not None and c.expires_at <= now:
            return None
        return c

    def seen(self, namespace: str, keys: Sequence[bytes], now: float, held: dict[str, int] | None = None,
             asker: str = "", record: bool = True) -> list[Seen]:
        """Per claimant of a key of ``keys``: how many leading keys of the chain it will hold once its Put
        lands -- the prefix the cluster holds already (``held``: the directory's prefix length per node;
        the claimant reads that part before it computes), then its own run of claimed keys. The asker (a
        node id) is noted as shown each claim (``record``: a request's first lookup), and among its waiters
        when it looks again (not ``record``) having been shown it."""
        base = max(held.values(), default=0) if held else 0
        out: list[Seen] = []
        i = base
        while i < len(keys):
            c = self._live((namespace, keys[i]), now)
            if c is None:
                break
            j = i
            while j < len(keys) and self._live((namespace, keys[j]), now) is c:
                j += 1
            if asker and asker != c.node:
                c.needed = max(c.needed, j)
                if record:
                    c.asked.add(asker)
                elif asker in c.asked:
                    c.waiters.add(asker)
            # every node shown it may wait (its re-look, which tells, comes later): the estimate errs
            # towards contention, and so towards computing
            others = len(c.asked - {asker})
            if self.tree_fanout <= 0:
                ahead = others  # every waiter pulls from the claimant at once: its egress shared by all
            else:               # the tree's copy times, this asker's copy among them
                parts = self.tree_parts(namespace, j)
                ahead = math.ceil(copy_times(1, others + 1, self.tree_fanout, parts) - 1e-9) - 1
            out.append(Seen(node=c.node, length=j, ready_in=max(0.0, c.ready_at - now), copies_ahead=ahead))
            i = j  # a deeper run claimed by another node needs this one's keys first: it waits for both
        return out

    def resolve(self, node: str, namespace: str, added: Iterable[bytes]) -> list[Claim]:
        """``node`` reported ``added`` keys stored: its claims on them are done. Returns the claims that
        ended (every key landed), for the caller to act on their waiters."""
        ended: dict[int, Claim] = {}
        for k in added:
            c = self._by_key.get((namespace, k))
            if c is not None and c.node == node:
                del self._by_key[(namespace, k)]
                ended[id(c)] = c
        return [c for c in ended.values() if not any(self._by_key.get((namespace, k)) is c for k in c.keys)]

    def drop_node(self, node: str) -> int:
        """``node`` left the cluster: its claims will never land."""
        gone = [slot for slot, c in self._by_key.items() if c.node == node]
        for slot in gone:
            del self._by_key[slot]
        return len(gone)

    def prune(self, now: float) -> int:
        """Drop the claims past their expiry (:meth:`claim` calls it; the cost is per expired claim)."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, _, c = heapq.heappop(self._expiry)
            mine = [k for k in c.keys if self._by_key.get((c.namespace, k)) is c]
            for k in mine:
                del self._by_key[(c.namespace, k)]
            dropped += len(mine)
        return dropped


DEFAULT_PULL_HORIZON_S = 30.0  # a pull the directory never saw land stops counting after this


class Pulls:
    """The reactive pulls the coordinator expects in flight, per prefix (pure; beside :class:`Claims`).

    A recorded lookup (an engine about to serve a request) from a node that lacks a prefix another node
    holds announces a pull of it. The pull counts as in flight until the directory shows the asker
    holding the prefix (its pull, or its own prefill, landed), or ``horizon_s`` passed. A later asker of
    the same prefix is told, on each holder's entry, how many of those pulls share that holder
    (``copies_ahead``), so its engine prices its own pull with that contention
    (``kvstore_client.claims.worth_reading``). An asker whose engine computes instead keeps counting
    until its Put lands: the estimate errs towards contention, and so towards computing."""

    def __init__(self, horizon_s: float = DEFAULT_PULL_HORIZON_S, max_prefixes: int = 10_000) -> None:
        self.horizon_s, self.max_prefixes = horizon_s, max_prefixes
        self._ends: dict[tuple[str, bytes], dict[str, float]] = {}
        self._full_until = 0.0  # a full table's earliest expiry: no prune can free a slot before it

    def __len__(self) -> int:
        return len(self._ends)

    def ahead(self, namespace: str, key: bytes, now: float, asker: str = "",
              holding: Callable[[str], bool] = lambda node: False) -> int:
        """Pulls of the prefix ending in ``key`` in flight now: announced, not past the horizon, and by a
        node that does not hold it yet (``holding``); the asker's own aside."""
        ends = self._ends.get((namespace, key))
        if not ends:
            return 0
        for node in [n for n, end in ends.items() if end <= now or holding(n)]:
            del ends[node]
        if not ends:
            del self._ends[(namespace, key)]
        return sum(1 for node in ends if node != asker)

    def note(self, namespace: str, key: bytes, asker: str, now: float) -> None:
        """``asker`` pulls the prefix ending in ``key`` from now on."""
        slot = (namespace, key)
        if slot not in self._ends and len(self._ends) >= self.max_prefixes:
            if now < self._full_until:
                return  # full, and nothing in it can have expired since the last prune looked
            self.prune(now)
            if len(self._ends) >= self.max_prefixes:
                self._full_until = min(min(ends.values()) for ends in self._ends.values())
                return
        self._ends.setdefault(slot, {})[asker] = now + self.horizon_s

    def prune(self, now: float) -> None:
        for slot in [s for s, ends in self._ends.items() if all(end <= now for end in ends.values())]:
            del self._ends[slot]


def waiter_tree(claim: Claim, alive: Callable[[str], bool], fanout: int, ttl_s: float, page_bytes: int,
                others: Sequence[str] = (), spread_at: int = SPREAD_AT_WAITERS,
                parts: int = 1, bytes_per_s: float = 0.0, holders: Sequence[str] = ()) -> Decision | None:
    """The copy tree that brings a landed claim's shared prefix to the nodes that waited for it (the
    claimant first, then every landed copy serves more), instead of every waiter pulling from the
    claimant at once (nodes shown the claim that did not wait compute it themselves and get nothing).
    ``holders``: the other nodes the directory shows holding that prefix already (in a
    burst, followers that computed it themselves): they send too, and are no target. When at least
    ``spread_at`` nodes waited, a burst is on and a router that spreads load will send its next
    followers anywhere: the tree then goes on to ``others`` (the live nodes), after the waiters -- where
    a copy can pay: one copy of the shared prefix at ``bytes_per_s`` (the measured link rate; 0: not
    known) takes less than the claimant's own prefill of it took (its claim's seconds), else a follower
    there computes it sooner than the copy lands and the copies only load the links. Relayed in
    ``parts`` parts when > 1. None when nobody else waited, or when the tree would land its last copy no
    sooner than its targets all pulling from the senders at once (a few targets copied store and
    forward, :func:`~kvstore.placement.copytree.copy_times`): its waves and their round trips through
    the coordinator would only add to the pulls' time."""
    senders = [claim.node, *sorted(n for n in set(holders) if n != claim.node and alive(n))]
    waiters = sorted(n for n in claim.waiters if n not in senders and alive(n))
    chain = claim.chain[:claim.needed]  # what the waiters share (the claimant's own suffix is its alone)
    if not waiters or not chain:
        return None
    copy_s = len(chain) * page_bytes / bytes_per_s if bytes_per_s > 0 else 0.0
    spread = len(waiters) >= spread_at and (copy_s < claim.seconds or not claim.seconds)
    extra = [n for n in others if n not in senders and n not in claim.asked and alive(n)] if spread else []
    targets = tuple(waiters + sorted(extra))
    if copy_times(len(senders), len(targets), fanout, parts) >= math.ceil(len(targets) / len(senders)):
        return None  # the tree's last copy lands no sooner than every target pulling at once: they pull
    edges, waves = copy_tree(senders, list(targets), fanout, parts)
    return Decision(namespace=claim.namespace, keys=tuple(chain), depth=len(chain), source=claim.node,
                    targets=targets, prob=1.0, ttl_s=ttl_s, reason="claim-waiters",
                    bytes=len(chain) * page_bytes * len(targets), tree=tuple(edges), waves=waves, parts=parts)
