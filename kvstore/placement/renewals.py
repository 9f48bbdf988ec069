"""Keeping, renewing and dropping the speculative replicas already placed.

Pure logic, called by :func:`kvstore.placement.planner.plan` every tick with
the same candidates: a replica lives while its prefix is forecast hot (with
hysteresis), is renewed before its TTL runs out, and goes when it expired,
when its prefix's score decayed, or when the forecast demand asks for fewer
copies than are placed (the replica set shrinks in quiet periods).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, KeysView, Mapping, Sequence
from dataclasses import dataclass

from kvstore.loops.slices import Steps, in_one_go
from kvstore.placement.planner_types import Candidate, Drop, PlannerConfig, Renewal, usable_depths
from kvstore.predict.types import PrefixId

Speculative = Mapping[PrefixId, Mapping[str, float]]
"""``speculative[(namespace, key of the deepest block)] = {node_id: expires_at}``."""

RENEW_STEP = 256
"""Placed prefixes :func:`renew_or_drop_steps` looks at between two yields."""
REVIEW_STEP = 1024
"""Placed prefixes :func:`to_review_steps` sorts between two yields."""


def chain_demand(candidates: Sequence[Candidate]) -> dict[str, dict[bytes, float]]:
    """Forecast demand per prefix key at the candidates' depth options (``[namespace][key]``): the
    largest of every candidate covering the key. A request for a longer prefix reads every shorter one,
    and the forecaster scores only the keys it tracks, so a shorter prefix takes its longer prefixes'
    demand instead of counting as unknown (0). The planner sizes a copy (``_wanted``) and a placed set
    (the surplus rule) by it."""
    return Coverage.of(candidates, {}).demand


@dataclass(slots=True)
class Coverage:
    """What the candidates say of the prefix keys, from one pass over them (:meth:`of`, then
    :meth:`add` for candidates built later).

    * ``demand[ns][key]``: :func:`chain_demand`;
    * ``hot[ns][key]``: for a placed key, the best score of any candidate whose chain holds it (a
      deeper hot prefix keeps its shallower replicas hot too), whatever the candidates' order;
    * ``sized[ns][key]``: for a placed key with a demand, the first candidate holding it at one of
      its depth options, and that depth: the holders the surplus rule counts (read only for a set
      that could be too large)."""

    demand: dict[str, dict[bytes, float]]
    hot: dict[str, dict[bytes, float]]
    sized: dict[str, dict[bytes, tuple[Candidate, int]]]
    placed: dict[str, set[bytes]]      # the placed keys, by namespace

    @classmethod
    def of(cls, candidates: Sequence[Candidate], placed_ids: Iterable[PrefixId]) -> Coverage:
        """The coverage of ``candidates``, with scores and sizes kept for the keys of ``placed_ids`` (the
        placed prefixes whose replicas are reviewed: a ``Speculative``'s keys, or ``to_review``'s)."""
        placed: dict[str, set[bytes]] = {}
        for ns, key in placed_ids:
            placed.setdefault(ns, set()).add(key)
        out = cls({}, {ns: {} for ns in placed}, {ns: {} for ns in placed}, placed)
        out.add(candidates)
        return out

    def add(self, candidates: Sequence[Candidate]) -> None:
        """Fold more candidates in (in the order given)."""
        demand, hot, sized, placed = self.demand, self.hot, self.sized, self.placed
        for c in candidates:
            ns, chain, want = c.namespace, c.chain, c.demand
            depths = usable_depths(c.depth_options, len(chain))
            if want > 0:
                mine = demand.get(ns)
                if mine is None:
                    mine = demand[ns] = {}
                for d in depths:
                    key = chain[d - 1]
                    if mine.get(key, 0.0) < want:
                        mine[key] = want
            keys = placed.get(ns)
            if not keys:
                continue
            common = keys.intersection(chain)
            if not common:
                continue
            best, prob = hot[ns], c.prob
            for key in common:
                if best.get(key, -1.0) < prob:
                    best[key] = prob
            sizes = sized[ns]
            for d in depths:
                key = chain[d - 1]
                if key in common and key not in sizes:
                    sizes[key] = (c, d)


def renew_or_drop_steps(
    candidates: Sequence[Candidate],
    speculative: Speculative,
    live: Mapping[str, object],
    cfg: PlannerConfig,
    now: float,
    coverage: Coverage | None = None,
    review: Collection[PrefixId] | None = None,
) -> Steps[tuple[list[Renewal], list[Drop]]]:
    """Renew hot speculative replicas, drop expired and decayed ones.

    * ``expires_at <= now`` -> drop ``expired`` (the node may already have
      evicted it; a still-hot prefix is simply copied again if it fits);
    * best score of the prefix ``< cfg.keep_threshold`` (or the prefix is not
      among ``candidates``) -> drop ``decayed``;
    * more than :data:`SURPLUS_SLACK` times the replicas the prefix's
      forecast demand asks for (with ``cfg.node_rate``; the demand is the
      :func:`chain_demand` of ``candidates``), counting the live holders
      nobody placed -> drop ``surplus``, the soonest to expire first: fewer
      copies in quiet periods;
    * otherwise, once less than ``cfg.renew_when_left * cfg.ttl_s`` is left,
      renew to ``now + cfg.ttl_s`` (not every tick: fewer control messages).

    ``coverage``: :meth:`Coverage.of` ``(candidates, review)`` (``speculative``
    when ``review`` is None) when the caller has it already. ``review``: the
    placed prefixes to look at this tick (:func:`to_review`; ``None``: all),
    in their order; the others are left as they are, so their candidates need
    not be passed. Replicas on nodes not in ``live`` are left to expire (no
    renewal, no drop: a node that comes back drops its own expired replicas).

    A step at a time (``kvstore.loops.slices``): it yields every :data:`RENEW_STEP` placed prefixes;
    :func:`renew_or_drop` runs it in one go. Between steps ``speculative`` may change: a placed prefix
    is read as it is at its turn, and one gone by then is passed over.
    """
    if coverage is None:
        coverage = Coverage.of(candidates, speculative if review is None else review)
    hot, sized, demand = coverage.hot, coverage.sized, coverage.demand
    pids = list(speculative) if review is None else review
    per_node = cfg.node_rate * cfg.demand_window_s
    n_live = len(live)
    keep = cfg.keep_threshold
    renew_at = cfg.renew_when_left * cfg.ttl_s
    renewals: list[Renewal] = []
    drops: list[Drop] = []
    no_scores: dict[bytes, float] = {}
    no_sizes: dict[bytes, tuple[Candidate, int]] = {}
    i = 0
    for pid in pids:
        placed = speculative.get(pid)  # as it is at its turn (a loop, not a generator: mypyc runs those eagerly)
        if placed is None:
            continue
        i += 1
        if i % RENEW_STEP == 0:
            yield
        if not placed:
            continue  # its last replica went between two steps
        ns, key = pid
        score = hot.get(ns, no_scores).get(key, -1.0)
        surplus: Collection[str] = ()
        if per_node > 0 and score >= keep:  # (a decayed set goes whole)
            size = sized.get(ns, no_sizes).get(key)
            asked = demand.get(ns, no_scores).get(key, 0.0) if size is not None else 0.0
            if asked > 0:
                want = max(1, math.ceil(SURPLUS_SLACK * asked / per_node))
                if want < n_live:  # else the live replicas and holders together never exceed it
                    c, depth = size  # type: ignore[misc]
                    surplus = _surplus(placed, want, c.holders.get(depth, ()), live, now)
        if score >= keep and not surplus and min(placed.values()) - now >= renew_at > 0:
            continue  # hot, wanted, and none due for renewal: the common case, one check for the set
        for node, expires_at in placed.items():
            if node not in live:
                continue
            if expires_at <= now:
                drops.append(Drop(ns, key, node, "expired"))
            elif score < keep:
                drops.append(Drop(ns, key, node, "decayed"))
            elif node in surplus:
                drops.append(Drop(ns, key, node, "surplus"))
            elif expires_at - now < renew_at:
                renewals.append(Renewal(ns, key, node, now + cfg.ttl_s))
    return renewals, drops


renew_or_drop = in_one_go(renew_or_drop_steps)
"""Renew hot speculative replicas, drop expired and decayed ones, in one go (:func:`renew_or_drop_steps`)."""


def to_review_steps(speculative: Speculative, chain_of: Mapping[PrefixId, int], turn: int, cfg: PlannerConfig,
                    now: float) -> Steps[KeysView[PrefixId]]:
    """The placed prefixes a tick reviews when a review covers only part of them (``cfg.review_slices``
    > 1): the chains in slice ``turn % review_slices``, and every chain with a replica due for renewal
    or expiry before that slice comes round again. So a renewal is never late, and a tick's cost does
    not grow with every replica placed; a decayed or surplus replica waits at most ``review_slices``
    ticks for its drop.

    A chain is the placed prefixes sharing a first block; ``chain_of[pid]`` names it with a stable
    non-negative integer (e.g. the first 8 bytes of block 1's key; two chains sharing one merely
    share their turn): a mapping, read once per placed prefix a tick (a dict with ``__missing__`` can
    work a number out on first read, as the coordinator's ``tickplan._ChainNumbers`` does). They are
    reviewed together, because a deeper prefix's score keeps its shallower replicas hot, so the caller
    passes the candidates of every prefix reviewed.

    A set, in ``speculative``'s order (the order of the tick's renewals and drops), of the placed
    prefixes as they were at the first step: it yields every :data:`REVIEW_STEP` of them
    (``kvstore.loops.slices``); :func:`to_review` runs it in one go."""
    items = list(speculative.items())
    slices = max(1, cfg.review_slices)
    if slices == 1:
        return dict.fromkeys([pid for pid, _ in items]).keys()
    due_by = now + cfg.renew_when_left * cfg.ttl_s + slices * cfg.tick_s
    turn %= slices
    chains: list[int] = []
    chosen: set[int] = set()
    for lo in range(0, len(items), REVIEW_STEP):
        for pid, placed in items[lo:lo + REVIEW_STEP]:
            chain = chain_of[pid]
            chains.append(chain)
            if chain in chosen:
                continue
            if chain % slices == turn:
                chosen.add(chain)
                continue
            for expires_at in placed.values():  # due: a replica expires before the slice comes round
                if expires_at < due_by:
                    chosen.add(chain)
                    break
        yield
    return dict.fromkeys([pid for (pid, _), chain in zip(items, chains) if chain in chosen]).keys()


to_review = in_one_go(to_review_steps)
"""The placed prefixes a tick reviews, in one go (:func:`to_review_steps`)."""


SURPLUS_SLACK = 2.0
"""Hysteresis of the replica-set size: a set shrinks only once it is more
than this many times what the demand asks for (as a replica outlives a
score that fell below ``threshold`` until it falls below ``keep_threshold``).
Without it a demand that wobbles around a step drops a copy one tick and
copies it again the next: each round trip costs a whole copy on the link,
while keeping the replica costs only speculative memory, which primaries
evict first anyway."""


def _surplus(placed: Mapping[str, float], want: int, holders: Collection[str], live: Mapping[str, object],
             now: float) -> set[str]:
    """Speculative replicas beyond what the forecast demand asks for (``want`` nodes, ``holders``
    holding it now): the set shrinks as the demand decays (the ones closest to expiry go first).
    Only live holders count: a dead node's copy serves nothing."""
    others = sum(1 for n in holders if n in live and n not in placed)  # primaries and replicas nobody placed
    keep = max(0, want - others)
    mine = [n for n, exp in placed.items() if n in live and exp > now]
    if len(mine) <= keep:
        return set()
    mine.sort(key=lambda n: (placed[n], n))
    return set(mine[: len(mine) - keep])


__all__ = ["RENEW_STEP", "REVIEW_STEP", "Coverage", "Speculative", "chain_demand", "renew_or_drop", "renew_or_drop_steps",
           "to_review", "to_review_steps"]
