"""Keeping, renewing and dropping the speculative replicas already placed.

Pure logic, called by :func:`kvstore.predict.planner.plan` every tick with
the same candidates: a replica lives while its prefix is forecast hot (with
hysteresis), is renewed before its TTL runs out, and goes when it expired,
when its prefix's score decayed, or when the forecast demand asks for fewer
copies than are placed (the replica set shrinks in quiet periods).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvstore.predict.planner_types import Candidate, Drop, PlannerConfig, Renewal
from kvstore.predict.types import PrefixId

Speculative = Mapping[PrefixId, Mapping[str, float]]
"""``speculative[(namespace, key of the deepest block)] = {node_id: expires_at}``."""


def chain_demand(candidates: Sequence[Candidate]) -> dict[str, dict[bytes, float]]:
    """Forecast demand per prefix key at the candidates' depth options (``[namespace][key]``): the
    largest of every candidate covering the key. A request for a longer prefix reads every shorter one,
    and the forecaster scores only the keys it tracks, so a shorter prefix takes its longer prefixes'
    demand instead of counting as unknown (0). The planner sizes a copy (``_wanted``) and a placed set
    (the surplus rule) by it."""
    out: dict[str, dict[bytes, float]] = {}
    for c in candidates:
        want = c.demand
        if want > 0:
            mine = out.setdefault(c.namespace, {})
            chain, n = c.chain, len(c.chain)
            for d in c.depth_options:
                if d <= n and mine.get(chain[d - 1], 0.0) < want:
                    mine[chain[d - 1]] = want
    return out


def _placed_keys(speculative: Speculative) -> dict[str, set[bytes]]:
    """The keys of the placed prefixes, by namespace."""
    out: dict[str, set[bytes]] = {}
    for ns, key in speculative:
        out.setdefault(ns, set()).add(key)
    return out


def renew_or_drop(
    candidates: Sequence[Candidate],
    speculative: Speculative,
    live: Mapping[str, object],
    cfg: PlannerConfig,
    now: float,
    demand: Mapping[str, Mapping[bytes, float]] | None = None,
) -> tuple[list[Renewal], list[Drop]]:
    """Renew hot speculative replicas, drop expired and decayed ones.

    * ``expires_at <= now`` -> drop ``expired`` (the node may already have
      evicted it; a still-hot prefix is simply copied again if it fits);
    * best score of the prefix ``< cfg.keep_threshold`` (or the prefix is not
      among ``candidates``) -> drop ``decayed``;
    * more than :data:`SURPLUS_SLACK` times the replicas the prefix's
      forecast demand asks for (with ``cfg.node_rate`` and ``demand``, the
      :func:`chain_demand` of ``candidates`` unless given) -> drop
      ``surplus``, the soonest to expire first: fewer copies in quiet periods;
    * otherwise, once less than ``cfg.renew_when_left * cfg.ttl_s`` is left,
      renew to ``now + cfg.ttl_s`` (not every tick: fewer control messages).

    Replicas on nodes not in ``live`` are left to expire (no renewal, no drop:
    a node that comes back drops its own expired replicas).
    """
    if cfg.node_rate > 0 and demand is None:
        demand = chain_demand(candidates)
    hot, sized = _covered(candidates, _placed_keys(speculative), cfg, demand if cfg.node_rate > 0 else None)
    keep = cfg.keep_threshold
    renew_at = cfg.renew_when_left * cfg.ttl_s
    renewals: list[Renewal] = []
    drops: list[Drop] = []
    no_scores: dict[bytes, float] = {}
    no_sizes: dict[bytes, Sized] = {}
    for (ns, key), placed in speculative.items():
        score = hot.get(ns, no_scores).get(key, -1.0)
        size = sized.get(ns, no_sizes).get(key)
        surplus = _surplus(placed, size, live, now) if size is not None and len(placed) > size[0] - len(size[1]) \
            else ()
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


SURPLUS_SLACK = 2.0
"""Hysteresis of the replica-set size: a set shrinks only once it is more
than this many times what the demand asks for (as a replica outlives a
score that fell below ``threshold`` until it falls below ``keep_threshold``).
Without it a demand that wobbles around a step drops a copy one tick and
copies it again the next: each round trip costs a whole copy on the link,
while keeping the replica costs only speculative memory, which primaries
evict first anyway."""

Sized = tuple[int, frozenset[str]]
"""(nodes that may keep a placed prefix, nodes that hold it)."""


def _covered(candidates: Sequence[Candidate], placed: Mapping[str, set[bytes]], cfg: PlannerConfig,
             demand: Mapping[str, Mapping[bytes, float]] | None,
             ) -> tuple[dict[str, dict[bytes, float]], dict[str, dict[bytes, Sized]]]:
    """For the placed prefix keys, in one pass over the candidates (one set intersection each):

    * the best score of any candidate covering the key (a deeper hot prefix keeps its shallower
      replicas hot too), whatever the candidates' order;
    * with a demand forecast (``demand``: per key, the largest of the candidates covering it), the
      size of its set: ``SURPLUS_SLACK`` times the nodes the demand asks for, and who holds it."""
    hot: dict[str, dict[bytes, float]] = {ns: {} for ns in placed}
    sized: dict[str, dict[bytes, Sized]] = {ns: {} for ns in placed}
    per_node = cfg.node_rate * cfg.demand_window_s
    for c in candidates:
        keys = placed.get(c.namespace)
        if not keys:
            continue
        common = keys.intersection(c.chain)
        if not common:
            continue
        best, prob = hot[c.namespace], c.prob
        for key in common:
            if best.get(key, -1.0) < prob:
                best[key] = prob
        wants = demand.get(c.namespace) if demand else None
        if wants:
            sizes, chain = sized[c.namespace], c.chain
            for d in c.depth_options:
                if d <= len(chain) and (key := chain[d - 1]) in common and key not in sizes:
                    want = wants.get(key, 0.0)
                    if want > 0:
                        sizes[key] = (max(1, math.ceil(SURPLUS_SLACK * want / per_node)),
                                      frozenset(c.holders.get(d, ())))
    return hot, sized


def _surplus(placed: Mapping[str, float], size: Sized, live: Mapping[str, object], now: float) -> set[str]:
    """Speculative replicas beyond what the forecast demand asks for: the
    set shrinks as the demand decays (the ones closest to expiry go first)."""
    want, holders = size
    others = sum(1 for n in holders if n not in placed)  # primaries and replicas nobody placed
    keep = max(0, want - others)
    if len(placed) <= keep:
        return set()
    mine = sorted((n for n, exp in placed.items() if n in live and exp > now), key=lambda n: (placed[n], n))
    return set(mine[: max(0, len(mine) - keep)])


__all__ = ["Speculative", "chain_demand", "renew_or_drop"]
