"""Keeping, renewing and dropping the speculative replicas already placed.

Pure logic, called by :func:`kvstore.predict.planner.plan` every tick with
the same candidates: a replica lives while its prefix is forecast hot (with
hysteresis), is renewed before its TTL runs out, and goes when it expired,
when its prefix's score decayed, or when the forecast demand asks for fewer
copies than are placed (the replica set shrinks in quiet periods).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from kvstore.predict.planner_types import Candidate, Drop, PlannerConfig, Renewal
from kvstore.predict.types import PrefixId

Speculative = Mapping[PrefixId, Mapping[str, float]]
"""``speculative[(namespace, key of the deepest block)] = {node_id: expires_at}``."""


def chain_demand(demand: dict[tuple[str, bytes], float],
                  chain: Callable[[tuple[str, bytes]], Sequence[bytes]]) -> dict[tuple[str, bytes], float]:
    """Each prefix's forecast demand, at least that of every longer prefix of its chain: a request for
    the longer one reads the shorter too. The forecaster scores the keys it tracks, so a shorter prefix
    it has no number for (0) takes its longer prefixes' instead of counting as unknown."""
    out = dict(demand)
    for deep, want in demand.items():
        if want > 0:
            for key in chain(deep)[:-1]:
                pid = (deep[0], key)
                if pid in out and out[pid] < want:
                    out[pid] = want
    return out


def _hot_scores(candidates: Sequence[Candidate]) -> dict[PrefixId, float]:
    """Best score of every prefix key any candidate covers (a deeper hot
    prefix keeps its shallower replicas hot too).

    Candidates go in ascending prob order so the best score overwrites the
    others in one comprehension (cheap: ``plan`` passes them already sorted
    the other way, which timsort reverses in linear time).
    """
    ascending = sorted(candidates, key=_prob)
    return {(c.namespace, key): c.prob for c in ascending for key in c.chain}


def _prob(c: Candidate) -> float:
    return c.prob


def renew_or_drop(
    candidates: Sequence[Candidate],
    speculative: Speculative,
    live: Mapping[str, object],
    cfg: PlannerConfig,
    now: float,
) -> tuple[list[Renewal], list[Drop]]:
    """Renew hot speculative replicas, drop expired and decayed ones.

    * ``expires_at <= now`` -> drop ``expired`` (the node may already have
      evicted it; a still-hot prefix is simply copied again if it fits);
    * best score of the prefix ``< cfg.keep_threshold`` (or the prefix is not
      among ``candidates``) -> drop ``decayed``;
    * more than :data:`SURPLUS_SLACK` times the replicas the prefix's
      forecast demand asks for (with ``cfg.node_rate`` and the largest
      ``demand`` of the candidates covering it) -> drop ``surplus``, the
      soonest to expire first: fewer copies in quiet periods;
    * otherwise, once less than ``cfg.renew_when_left * cfg.ttl_s`` is left,
      renew to ``now + cfg.ttl_s`` (not every tick: fewer control messages).

    Replicas on nodes not in ``live`` are left to expire (no renewal, no drop:
    a node that comes back drops its own expired replicas).
    """
    hot = _hot_scores(candidates)
    keep = cfg.keep_threshold
    renew_at = cfg.renew_when_left * cfg.ttl_s
    renewals: list[Renewal] = []
    drops: list[Drop] = []
    sized = _sized_sets(candidates, cfg)
    for (ns, key), placed in speculative.items():
        score = hot.get((ns, key), -1.0)
        surplus = _surplus((ns, key), placed, sized, live, now)
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


SURPLUS_SLACK = 2.0
"""Hysteresis of the replica-set size: a set shrinks only once it is more
than this many times what the demand asks for (as a replica outlives a
score that fell below ``threshold`` until it falls below ``keep_threshold``).
Without it a demand that wobbles around a step drops a copy one tick and
copies it again the next: each round trip costs a whole copy on the link,
while keeping the replica costs only speculative memory, which primaries
evict first anyway."""


def _sized_sets(candidates: Sequence[Candidate], cfg: PlannerConfig) -> dict[PrefixId, tuple[int, frozenset[str]]]:
    """Per prefix key with a demand forecast: (nodes that may keep it, nodes that do).

    A key is covered by the candidate of its own prefix and by those of every
    longer prefix of its chain; each request of a longer prefix is also one
    of the shorter, so the key keeps the largest set any of them asks for
    (the planner copied it for one of them)."""
    if cfg.node_rate <= 0:
        return {}
    out: dict[PrefixId, tuple[int, frozenset[str]]] = {}
    per_node = cfg.node_rate * cfg.demand_window_s
    for c in candidates:
        if c.demand > 0:
            keep = max(1, math.ceil(SURPLUS_SLACK * c.demand / per_node))
            for d in c.depth_options:
                if d <= len(c.chain):
                    pid = (c.namespace, c.chain[d - 1])
                    if pid not in out or out[pid][0] < keep:
                        out[pid] = (keep, frozenset(c.holders.get(d, ())))
    return out


def _surplus(pid: PrefixId, placed: Mapping[str, float], sized: Mapping[PrefixId, tuple[int, frozenset[str]]],
             live: Mapping[str, object], now: float) -> set[str]:
    """Speculative replicas beyond what the forecast demand asks for: the
    set shrinks as the demand decays (the ones closest to expiry go first)."""
    if pid not in sized:
        return set()
    want, holders = sized[pid]
    mine = sorted((n for n, exp in placed.items() if n in live and exp > now), key=lambda n: (placed[n], n))
    others = len(holders - set(placed))  # primaries and replicas nobody placed
    keep = max(0, want - others)
    return set(mine[: max(0, len(mine) - keep)])


__all__ = ["Speculative", "chain_demand", "renew_or_drop"]
