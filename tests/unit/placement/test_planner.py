"""Placement planner: candidate selection, depth gating, targets, sources,
budgets, caps, renewals and drops, determinism, and a property test.

The planner is pure, so every test builds its inputs by hand: no sockets,
no clocks.
"""

from __future__ import annotations

from dataclasses import replace

import random
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.placement.planner import SKIP_REASONS, copy_tree, plan, renew_or_drop, select_candidates
from kvstore.placement.renewals import chain_demand
from kvstore.placement.planner_types import Candidate, Drop, NodeState, PlannerConfig, PlanResult, Renewal

MB = 1_000_000
GB = 1_000_000_000
NOW = 1000.0


def chain_of(name: str, n: int = 8) -> tuple[bytes, ...]:
    return tuple(f"{name}/{i}".encode() for i in range(1, n + 1))


def cand(
    name: str = "p",
    *,
    prob: float = 0.9,
    need: float = 60.0,
    page: int = 10 * MB,
    options: tuple[int, ...] = (1, 2, 4, 8),
    holders: dict[int, Iterable[str]] | None = None,
    ns: str = "ns",
) -> Candidate:
    """A candidate held by node ``a`` at every depth unless ``holders`` says otherwise."""
    held = {8: {"a"}} if holders is None else holders
    return Candidate(
        namespace=ns,
        chain=chain_of(name, max(options)),
        depth_options=options,
        holders={d: frozenset(v) for d, v in held.items()},
        prob=prob,
        need_in_s=need,
        page_bytes=page,
    )


def node(nid: str, cap: int = 100 * GB, used: int = 0, spec: int = 0, load: float = 0.0) -> NodeState:
    return NodeState(node_id=nid, capacity_bytes=cap, used_bytes=used, spec_bytes=spec, load=load)


def nodes(*ids: str, **kw: int) -> list[NodeState]:
    return [node(i, **kw) for i in ids]  # type: ignore[arg-type]


CFG = PlannerConfig(threshold=0.5, spec_budget=0.2, spec_bandwidth=10 * GB, tick_s=1.0, ttl_s=120.0,
                    max_targets=2, safety=1.5, max_decisions=256)


def only(result: PlanResult):  # type: ignore[no-untyped-def]
    assert len(result.decisions) == 1, result
    return result.decisions[0]


# --------------------------------------------------------------------------
# select_candidates
# --------------------------------------------------------------------------


def _reference(probs: np.ndarray, threshold: float, limit: int) -> list[int]:
    rows = [i for i, p in enumerate(probs.tolist()) if p >= threshold]
    rows.sort(key=lambda i: (-probs[i], i))
    return rows[: max(limit, 0)]


def test_select_orders_by_prob_and_applies_threshold_and_limit() -> None:
    probs = np.array([0.1, 0.9, 0.5, 0.7, 0.49, 0.95])
    assert select_candidates(probs, 0.5, 10).tolist() == [5, 1, 3, 2]  # 0.5 is inclusive
    assert select_candidates(probs, 0.5, 2).tolist() == [5, 1]
    assert select_candidates(probs, 0.0, 6).tolist() == [5, 1, 3, 2, 4, 0]


def test_select_ties_break_by_row_even_at_the_limit() -> None:
    probs = np.array([0.5, 0.9, 0.5, 0.5, 0.5])
    assert select_candidates(probs, 0.5, 3).tolist() == [1, 0, 2]
    assert select_candidates(np.full(1000, 0.7), 0.5, 4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("probs", "threshold", "limit"),
    [
        (np.array([], dtype=np.float64), 0.5, 10),     # empty
        (np.array([0.1, 0.2, 0.3]), 0.5, 10),         # all below
        (np.array([0.9, 0.8]), 0.5, 0),                # limit 0
        (np.array([0.9, 0.8]), 0.5, -3),               # negative limit
        (np.array([np.nan, np.nan]), 0.0, 5),          # NaN never qualifies
    ],
)
def test_select_empty_cases(probs: np.ndarray, threshold: float, limit: int) -> None:
    out = select_candidates(probs, threshold, limit)
    assert out.size == 0 and out.dtype == np.intp


def test_select_skips_nan_and_returns_intp() -> None:
    out = select_candidates(np.array([np.nan, 0.6, np.nan, 0.8], dtype=np.float32), 0.5, 10)
    assert out.tolist() == [3, 1] and out.dtype == np.intp


def test_select_rejects_2d() -> None:
    with pytest.raises(ValueError, match="1-D"):
        select_candidates(np.zeros((2, 2)), 0.5, 1)


def test_select_matches_reference_on_random_inputs_with_ties() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(0, 60))
        probs = rng.integers(0, 6, n) / 5.0  # few distinct values: many ties
        threshold = float(rng.choice([0.0, 0.2, 0.5, 1.0, 1.1]))
        limit = int(rng.integers(0, 70))
        assert select_candidates(probs, threshold, limit).tolist() == _reference(probs, threshold, limit)


# --------------------------------------------------------------------------
# depth gating
# --------------------------------------------------------------------------

# page 100 MB at 1 GB/s: depth d takes d * 0.1 s, x1.5 safety.
GATE = dict(page=100 * MB)


def test_deepest_depth_when_it_fits() -> None:
    d = only(plan([cand(need=1.25, **GATE)], nodes("a", "b"), 1 * GB, CFG, NOW))  # 0.8 s * 1.5 = 1.2 s
    assert d.depth == 8 and d.keys == chain_of("p")[:8] and d.bytes == 800 * MB
    assert d.transfer_s == pytest.approx(0.8) and d.need_in_s == 1.25
    # The bound is inclusive: 8 * 2**20 B at 2**24 B/s = 0.5 s, x2 = exactly 1.0 s.
    exact = PlannerConfig(safety=2.0)
    assert only(plan([cand(need=1.0, page=2**20)], nodes("a", "b"), 2**24, exact, NOW)).depth == 8


def test_shallower_depth_when_only_it_fits() -> None:
    d = only(plan([cand(need=1.0, **GATE)], nodes("a", "b"), 1 * GB, CFG, NOW))  # depth 4: 0.6 s fits, 8: 1.2 s not
    assert d.depth == 4 and d.keys == chain_of("p")[:4] and d.bytes == 400 * MB


def test_skip_when_no_depth_fits_in_time() -> None:
    r = plan([cand(need=0.1, **GATE)], nodes("a", "b"), 1 * GB, CFG, NOW)  # depth 1: 0.15 s > 0.1 s
    assert r.decisions == [] and r.skipped == {"too_late": 1} and r.bytes_planned == 0


def test_zero_bandwidth_is_too_late_and_zero_page_size_is_unknown() -> None:
    assert plan([cand()], nodes("a", "b"), 0.0, CFG, NOW).skipped == {"too_late": 1}
    assert plan([cand(page=0)], nodes("a", "b"), 1 * GB, CFG, NOW).skipped == {"unknown_size": 1}


def test_depth_options_beyond_the_chain_are_ignored() -> None:
    c = cand()
    c.chain = c.chain[:4]  # keys known only up to depth 4
    assert only(plan([c], nodes("a", "b"), 1 * GB, CFG, NOW)).depth == 4


# --------------------------------------------------------------------------
# sources and targets
# --------------------------------------------------------------------------


def test_source_must_hold_the_depth_else_shallower() -> None:
    # Only depth 4 has a live holder: depth 8 is skipped for want of a source.
    d = only(plan([cand(holders={4: {"a"}})], nodes("a", "b"), 1 * GB, CFG, NOW))
    assert d.depth == 4 and d.source == "a" and d.targets == ("b",)
    assert "depth 8 no_source" in d.reason
    # A dead holder is no source.
    r = plan([cand(holders={8: {"zz"}})], nodes("a", "b"), 1 * GB, CFG, NOW)
    assert r.decisions == [] and r.skipped == {"no_source": 1}


def test_source_prefers_least_load_then_id_and_holds_the_chosen_depth() -> None:
    ns = [node("a", load=5.0), node("b", load=1.0), node("c", load=1.0), node("d")]
    d = only(plan([cand(holders={8: {"a", "c", "b"}})], ns, 1 * GB, CFG, NOW))
    assert d.source == "b" and d.targets == ("d",)
    # b holds only depth 4; depth 8 fits in time, so the source is a (the only depth-8 holder).
    ns = [node("a", load=5.0), node("b"), node("c")]
    d = only(plan([cand(holders={8: {"a"}, 4: {"b"}})], ns, 1 * GB, CFG, NOW))
    assert d.depth == 8 and d.source == "a" and d.targets == ("b", "c")  # b lacks depth 8: a target


def test_targets_exclude_holders_and_pick_most_headroom() -> None:
    ns = [node("a"), node("b", used=50 * GB), node("c", used=10 * GB), node("d", used=20 * GB), node("e")]
    d = only(plan([cand(holders={8: {"a", "e"}})], ns, 1 * GB, CFG, NOW))
    assert d.targets == ("c", "d")
    assert "p=0.90" in d.explain() and "transfer" in d.explain() and d.reason in d.explain()


def test_target_ties_break_on_fewer_spec_bytes_then_id() -> None:
    ns = [node("a"), node("z", used=5 * GB, spec=0), node("y", used=5 * GB, spec=3 * GB), node("x", used=5 * GB)]
    assert only(plan([cand()], ns, 1 * GB, CFG, NOW)).targets == ("x", "z")


def test_holders_of_a_deeper_prefix_are_holders_of_the_shallower() -> None:
    # depth 8 does not fit in time; b holds depth 8, so it holds depth 4 too.
    d = only(plan([cand(need=1.0, holders={8: {"b"}, 4: {"a"}}, **GATE)], nodes("a", "b", "c"), 1 * GB, CFG, NOW))
    assert d.depth == 4 and d.targets == ("c",) and d.source in {"a", "b"}


def test_copies_planned_this_tick_are_not_planned_twice() -> None:
    # The depth-8 and the depth-4 prefixes of one chain, scored as two candidates.
    deep = cand("p", prob=0.9)
    shallow = cand("p", prob=0.8, options=(1, 2, 4))
    r = plan([shallow, deep], nodes("a", "b", "c"), 1 * GB, PlannerConfig(max_targets=1), NOW)
    assert [(d.depth, d.targets) for d in r.decisions] == [(8, ("b",)), (4, ("c",))]
    # ... and a planned target is no source yet: with only a and b, depth 4 is covered.
    r = plan([shallow, deep], nodes("a", "b"), 1 * GB, PlannerConfig(max_targets=1), NOW)
    assert [(d.depth, d.targets) for d in r.decisions] == [(8, ("b",))]
    assert r.skipped == {"held_everywhere": 1}


def test_copies_in_flight_are_neither_targets_nor_sources() -> None:
    c = cand(holders={})
    spec = {("ns", c.chain[7]): {"a": NOW + 50}}
    pending = {("ns", c.chain[7]): {"b"}}
    d = only(plan([c], nodes("a", "b", "c"), 1 * GB, CFG, NOW, spec, pending=pending))
    assert d.source == "a" and d.targets == ("c",)
    # A copy of depth 8 in flight to c covers depth 4 too; nothing left to do.
    r = plan([c], nodes("a", "c"), 1 * GB, CFG, NOW, spec, pending={("ns", c.chain[7]): ["c"]})
    assert r.decisions == [] and r.skipped == {"held_everywhere": 1}
    # Only a copy in flight, no holder: no source.
    r = plan([c], nodes("a", "b"), 1 * GB, CFG, NOW, pending=pending)
    assert r.skipped == {"no_source": 1}


def test_full_cluster_is_no_room_before_any_holder_lookup() -> None:
    full = [node("a", used=100 * GB), node("b", used=100 * GB)]
    assert plan([cand(holders={8: {"a", "b"}})], full, 1 * GB, CFG, NOW).skipped == {"no_room": 1}


def test_held_everywhere() -> None:
    r = plan([cand(holders={8: {"a", "b"}})], nodes("a", "b"), 1 * GB, CFG, NOW)
    assert r.decisions == [] and r.skipped == {"held_everywhere": 1}


def test_no_live_node_is_no_target() -> None:
    assert plan([cand()], [], 1 * GB, CFG, NOW).skipped == {"no_target": 1}


def test_live_speculative_replica_is_a_holder_expired_one_is_not() -> None:
    c = cand()
    spec = {("ns", c.chain[7]): {"b": NOW + 50}}
    d = only(plan([c], nodes("a", "b", "c"), 1 * GB, CFG, NOW, spec))
    assert d.targets == ("c",)  # b already holds it speculatively: renew, don't re-copy
    spec = {("ns", c.chain[7]): {"b": NOW - 1}}
    r = plan([c], nodes("a", "b", "c"), 1 * GB, CFG, NOW, spec)
    assert only(r).targets == ("b", "c")
    assert r.drops == [Drop("ns", c.chain[7], "b", "expired")]


def test_speculative_replica_can_be_the_source() -> None:
    c = cand(holders={})
    d = only(plan([c], nodes("a", "b"), 1 * GB, CFG, NOW, {("ns", c.chain[7]): {"b": NOW + 50}}))
    assert d.source == "b" and d.targets == ("a",)


# --------------------------------------------------------------------------
# room and budgets
# --------------------------------------------------------------------------


def test_spec_budget_forces_a_shallower_depth_then_no_room() -> None:
    # spec limit 20 GB; 16 GB already speculative; depth 8 = 8 GB no, depth 4 = 4 GB fits.
    ns = [node("a"), node("b", used=16 * GB, spec=16 * GB)]
    d = only(plan([cand(page=1 * GB)], ns, 100 * GB, CFG, NOW))
    assert d.depth == 4 and "depth 8 no_room" in d.reason
    ns = [node("a"), node("b", used=20 * GB, spec=20 * GB)]
    assert plan([cand(page=1 * GB)], ns, 100 * GB, CFG, NOW).skipped == {"no_room": 1}


def test_free_space_is_required_not_only_the_spec_share() -> None:
    ns = [node("a"), node("b", used=100 * GB - 10 * MB, spec=0)]  # spec share empty, no free space
    r = plan([cand(page=10 * MB)], ns, 1 * GB, CFG, NOW)
    d = only(r)
    assert d.depth == 1  # 10 MB is exactly the free space left
    ns = [node("a"), node("b", used=100 * GB - 1, spec=0)]
    assert plan([cand(page=10 * MB)], ns, 1 * GB, CFG, NOW).skipped == {"no_room": 1}


def test_a_full_node_makes_room_for_a_copy_worth_more_than_what_it_pushes_out() -> None:
    # b is full of cold pages; their price is their expected reads after eviction
    full = NodeState(node_id="b", capacity_bytes=100 * GB, used_bytes=100 * GB, cold_bytes=60 * GB, cold_reads=0.5)
    d = only(plan([cand(prob=0.9, page=1 * GB)], [node("a", used=100 * GB), full], 100 * GB, CFG, NOW))
    assert d.targets == ("b",) and d.depth == 8  # 0.9 expected reads a page against 0.5
    # a copy worth less than what it would push out is not placed
    assert plan([cand(prob=0.45, page=1 * GB)], [node("a", used=100 * GB), full], 100 * GB,
                replace(CFG, threshold=0.4), NOW).skipped == {"no_room": 1}
    pricey = replace(full, cold_reads=0.95)
    assert plan([cand(prob=0.9, page=1 * GB)], [node("a", used=100 * GB), pricey], 100 * GB, CFG,
                NOW).skipped == {"no_room": 1}
    # the speculative share still caps what it takes (20 GB of 100), and free space goes first
    r = plan([cand(f"p{i}", prob=0.9, page=1 * GB) for i in range(6)],
             [node("a", used=100 * GB), full, node("c", used=90 * GB)], 1000 * GB, replace(CFG, max_targets=1), NOW)
    on = {t: sum(x.bytes for x in r.decisions if t in x.targets) for t in "bc"}
    assert on["b"] <= 20 * GB and r.decisions[0].targets == ("c",)
    # no cold pages: no room
    bare = replace(full, cold_bytes=0)
    assert plan([cand(prob=0.9, page=1 * GB)], [node("a", used=100 * GB), bare], 100 * GB, CFG,
                NOW).skipped == {"no_room": 1}


def test_spec_budget_never_exceeded_within_one_tick() -> None:
    ns = [node("a"), node("b", spec=5 * GB, used=5 * GB), node("c", cap=50 * GB), node("d", cap=10 * GB, used=9_900 * MB)]
    cands = [cand(f"p{i}", prob=0.99 - i / 1000, page=200 * MB) for i in range(200)]
    cfg = PlannerConfig(spec_bandwidth=1e15, max_decisions=1000)
    r = plan(cands, ns, 100 * GB, cfg, NOW)
    assert r.decisions and r.skipped.get("no_room", 0) > 0
    landed: dict[str, int] = {}
    for d in r.decisions:
        for t in d.targets:
            landed[t] = landed.get(t, 0) + d.depth * 200 * MB
    for n in ns:
        got = landed.get(n.node_id, 0)
        assert n.spec_bytes + got <= cfg.spec_budget * n.capacity_bytes
        assert n.used_bytes + got <= n.capacity_bytes
    assert landed["b"] > 0 and landed["c"] > 0 and "d" not in landed  # d: 100 MB free < one 200 MB page


def test_bandwidth_budget_holds_and_charges_transfers_in_flight() -> None:
    cfg = PlannerConfig(spec_bandwidth=2 * GB, tick_s=1.0, max_targets=2)
    cands = [cand(f"p{i}", prob=0.9 - i / 100, page=100 * MB) for i in range(10)]
    r = plan(cands, nodes("a", "b", "c"), 10 * GB, cfg, NOW)
    assert r.bytes_budget == 2 * GB
    assert r.bytes_planned == sum(d.bytes for d in r.decisions) <= 2 * GB
    assert r.bytes_planned == 2 * GB  # 800 MB x 2 targets, then 400 MB x 1 target (fewer targets fit)
    assert [(d.depth, len(d.targets)) for d in r.decisions] == [(8, 2), (4, 1)]
    assert r.skipped == {"bandwidth": 8}
    r = plan(cands, nodes("a", "b", "c"), 10 * GB, cfg, NOW, transfers_in_flight_bytes=1_700 * MB)
    assert r.bytes_budget == 300 * MB and r.bytes_planned <= 300 * MB
    assert [(d.depth, len(d.targets)) for d in r.decisions] == [(2, 1), (1, 1)]  # 200 MB, then 100 MB
    assert r.skipped == {"bandwidth": 8}
    r = plan(cands, nodes("a", "b", "c"), 10 * GB, cfg, NOW, transfers_in_flight_bytes=5 * GB)
    assert r.bytes_budget == 0 and r.decisions == [] and r.skipped == {"bandwidth": 10}


def test_max_targets_and_max_decisions() -> None:
    cfg = PlannerConfig(max_targets=3, max_decisions=2)
    cands = [cand(f"p{i}", prob=0.9 - i / 100) for i in range(5)]
    r = plan(cands, nodes("a", "b", "c", "d", "e"), 10 * GB, cfg, NOW)
    assert [len(d.targets) for d in r.decisions] == [3, 3]
    assert [d.keys[0] for d in r.decisions] == [chain_of("p0")[0], chain_of("p1")[0]]  # highest prob first
    assert r.skipped == {"cap": 3}
    assert all(len(d.targets) == 1 for d in plan(cands, nodes("a", "b", "c"), 10 * GB,
                                                 PlannerConfig(max_targets=1), NOW).decisions)


def test_bytes_planned_this_tick_move_later_targets() -> None:
    # Two equal nodes: the first copy lowers b's headroom, so the second goes to c.
    cfg = PlannerConfig(max_targets=1)
    r = plan([cand("p", prob=0.9), cand("q", prob=0.8)], nodes("a", "b", "c"), 10 * GB, cfg, NOW)
    assert [d.targets for d in r.decisions] == [("b",), ("c",)]


def test_below_threshold_candidates_are_not_copied_nor_counted() -> None:
    r = plan([cand(prob=0.4)], nodes("a", "b"), 1 * GB, CFG, NOW)
    assert r.decisions == [] and r.skipped == {}


# --------------------------------------------------------------------------
# renewals and drops
# --------------------------------------------------------------------------


def test_renewals_and_drops() -> None:
    hot, warm, cold = cand("hot", prob=0.9), cand("warm", prob=0.3), cand("cold", prob=0.1)
    gone = chain_of("gone")
    spec = {
        ("ns", hot.chain[7]): {"b": NOW + 10, "c": NOW + 100, "dead": NOW + 1},  # b renewed (< 60 s left), c not yet
        ("ns", hot.chain[3]): {"c": NOW + 5},            # shallower replica kept hot by the deeper candidate
        ("ns", warm.chain[7]): {"b": NOW + 20},          # 0.3 >= keep 0.25: renewed, never copied anew
        ("ns", cold.chain[7]): {"b": NOW + 100},         # decayed
        ("ns", gone[7]): {"c": NOW + 100},               # no longer a candidate: decayed
        ("other", hot.chain[7]): {"b": NOW + 100},       # other namespace: not hot
        ("ns", hot.chain[1]): {"b": NOW},                # expired (expiry == now)
    }
    r = plan([hot, warm, cold], nodes("a", "b", "c"), 1 * GB, CFG, NOW, spec)
    assert r.renewals == [
        Renewal("ns", hot.chain[7], "b", NOW + 120),
        Renewal("ns", hot.chain[3], "c", NOW + 120),
        Renewal("ns", warm.chain[7], "b", NOW + 120),
    ]
    assert r.drops == [
        Drop("ns", cold.chain[7], "b", "decayed"),
        Drop("ns", gone[7], "c", "decayed"),
        Drop("other", hot.chain[7], "b", "decayed"),
        Drop("ns", hot.chain[1], "b", "expired"),
    ]
    assert r.decisions == [] and r.skipped == {"held_everywhere": 1}  # hot: a primary, b and c speculative


def test_renew_every_tick_and_custom_hysteresis() -> None:
    c = cand(prob=0.6)
    spec = {("ns", c.chain[7]): {"b": NOW + 119}}
    cfg = PlannerConfig(renew_when_left=1.0, drop_below=0.7)
    r = plan([c], nodes("a", "b"), 1 * GB, cfg, NOW, spec)
    assert r.drops == [Drop("ns", c.chain[7], "b", "decayed")] and r.renewals == []
    r = plan([c], nodes("a", "b"), 1 * GB, PlannerConfig(renew_when_left=1.0), NOW, spec)
    assert r.renewals == [Renewal("ns", c.chain[7], "b", NOW + 120.0)] and r.drops == []
    assert PlannerConfig(threshold=0.8).keep_threshold == pytest.approx(0.4)


def test_renew_or_drop_takes_the_best_score_whatever_the_order() -> None:
    cold_deep, hot_shallow = cand("p", prob=0.1), cand("p", prob=0.9, options=(1, 2, 4))
    spec = {("ns", hot_shallow.chain[3]): {"b": NOW + 1}}
    for order in ([cold_deep, hot_shallow], [hot_shallow, cold_deep]):
        renewals, drops = renew_or_drop(order, spec, {"a", "b"}, CFG, NOW)
        assert renewals == [Renewal("ns", hot_shallow.chain[3], "b", NOW + 120)] and drops == []


# --------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------


def test_deterministic_whatever_the_input_order() -> None:
    rng = random.Random(3)
    ns = [node(f"n{i}", used=rng.randrange(0, 50) * GB, load=rng.choice([0.0, 1.0])) for i in range(6)]
    cands = [
        cand(f"p{i}", prob=rng.choice([0.5, 0.7, 0.9]), need=rng.choice([0.5, 2.0, 30.0]), page=100 * MB,
             holders={d: {f"n{rng.randrange(6)}"} for d in (2, 8)})
        for i in range(40)
    ]
    cfg = PlannerConfig(spec_bandwidth=5 * GB, max_targets=2)
    first = plan(cands, ns, 1 * GB, cfg, NOW)
    for _ in range(3):
        rng.shuffle(cands)
        rng.shuffle(ns)
        assert plan(cands, ns, 1 * GB, cfg, NOW) == first
    assert first.decisions and set(first.skipped) <= set(SKIP_REASONS)


# --------------------------------------------------------------------------
# property: whatever the inputs, decisions are safe
# --------------------------------------------------------------------------

NODE_IDS = [f"n{i}" for i in range(6)]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Candidate], list[NodeState], float, PlannerConfig, int]:
    live_ids = draw(st.lists(st.sampled_from(NODE_IDS), unique=True, min_size=2, max_size=6))
    ns = []
    for nid in live_ids:
        cap = draw(st.sampled_from([100, 20, 2, 0])) * GB
        spec = draw(st.integers(0, 10)) * GB // 2
        used = min(cap, spec + draw(st.integers(0, 20)) * GB)
        ns.append(node(nid, cap=cap, used=used, spec=min(spec, used), load=draw(st.sampled_from([0.0, 1.0, 2.0]))))
    cands = []
    for i in range(draw(st.integers(0, 12))):
        options = tuple(sorted(draw(st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1))))
        holders = {d: frozenset(draw(st.sets(st.sampled_from(NODE_IDS + ["gone"]), min_size=1, max_size=2))) for d in options}
        cands.append(cand(f"c{i}", prob=draw(st.floats(0, 1)), need=draw(st.floats(0, 60).map(lambda x: 60 - x)),
                          page=draw(st.sampled_from([100 * MB, 10 * MB, 300 * MB, 1 * GB, 0])), options=options,
                          holders=holders))
    cfg = PlannerConfig(
        threshold=draw(st.sampled_from([0.3, 0.0, 0.5, 0.9])), spec_budget=draw(st.sampled_from([0.5, 0.1, 1.0, 0.0])),
        spec_bandwidth=draw(st.sampled_from([1e10, 1e9, 1e11, 1e8, 0.0])), max_targets=draw(st.integers(1, 3)),
        max_decisions=draw(st.sampled_from([100, 3, 1, 0])), safety=draw(st.sampled_from([1.0, 1.5, 3.0])),
    )
    bandwidth = draw(st.sampled_from([1e10, 1e9, 1e11, 1e8, 0.0]))
    in_flight = draw(st.sampled_from([0, 500 * MB, 5 * GB]))
    return cands, ns, bandwidth, cfg, in_flight


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_decisions_are_safe(
    scenario: tuple[list[Candidate], list[NodeState], float, PlannerConfig, int],
) -> None:
    cands, ns, bandwidth, cfg, in_flight = scenario
    r = plan(cands, ns, bandwidth, cfg, NOW, transfers_in_flight_bytes=in_flight)
    by_id = {n.node_id: n for n in ns}
    by_chain = {c.chain: c for c in cands}
    landed: dict[str, int] = {}
    budget = max(0, int(cfg.spec_bandwidth * cfg.tick_s) - in_flight)
    assert r.bytes_planned == sum(d.bytes for d in r.decisions) <= budget == r.bytes_budget
    assert len(r.decisions) <= cfg.max_decisions
    for d in r.decisions:
        c = next(c for chain, c in by_chain.items() if chain[: d.depth] == d.keys)
        holding = set().union(*(c.holders.get(x, frozenset()) for x in c.depth_options if x >= d.depth))
        assert c.prob >= cfg.threshold
        assert d.depth in c.depth_options
        assert d.source in by_id and d.source in holding                     # live source holding the depth
        assert 1 <= len(d.targets) <= cfg.max_targets and len(set(d.targets)) == len(d.targets)
        assert all(t in by_id and t not in holding for t in d.targets)        # live non-holders
        assert d.bytes == d.depth * c.page_bytes * len(d.targets)
        assert d.transfer_s >= d.depth * c.page_bytes / bandwidth * (1 - 1e-9)  # no faster than an idle link
        assert d.transfer_s * cfg.safety <= c.need_in_s                      # lands in time
        for t in d.targets:
            landed[t] = landed.get(t, 0) + d.depth * c.page_bytes
    for nid, got in landed.items():
        n = by_id[nid]
        assert n.spec_bytes + got <= cfg.spec_budget * n.capacity_bytes
        assert n.used_bytes + got <= n.capacity_bytes
    n_eligible = sum(c.prob >= cfg.threshold for c in cands)
    assert len(r.decisions) + sum(r.skipped.values()) == n_eligible
    assert set(r.skipped) <= set(SKIP_REASONS)


# --------------------------------------------------------------------------
# replica sets sized from forecast demand, copied as trees
# --------------------------------------------------------------------------

EIGHT = ("a", "b", "c", "d", "e", "f", "g", "h")
SIZED = replace(CFG, node_rate=1.0, demand_window_s=10.0, fanout=2)


def test_copy_tree_waves_and_fanout() -> None:
    edges, waves = copy_tree(["a"], list("bcdefgh"), fanout=2)
    assert waves == 2 and [t for _, t in edges] == list("bcdefgh")
    assert edges[:2] == [("a", "b"), ("a", "c")]  # wave 1: only the holder has the pages
    senders = [s for s, _ in edges[2:]]
    assert set(senders) <= {"a", "b", "c"} and max(senders.count(s) for s in senders) <= 2
    star, one = copy_tree(["a", "b"], ["c"], fanout=2)
    assert star == [("a", "c")] and one == 1


def test_each_target_of_a_tree_is_due_after_its_own_wave() -> None:
    """A first-wave target is not told it waits for the whole tree (its engine would compute instead)."""
    from kvstore.placement.copytree import arrival_waves

    edges, waves = copy_tree(["a"], list("bcdefgh"), fanout=2)
    due = arrival_waves(edges, 2)
    assert due["b"] == due["c"] == 1 and max(due.values()) == waves == 2
    assert sorted(due) == list("bcdefgh")
    # one at a time: a sends to b (wave 1); then a and b send to c and d (wave 2); then four more
    one, waves1 = copy_tree(["a"], list("bcdefgh"), fanout=1)
    assert arrival_waves(one, 1) == {"b": 1, "c": 2, "d": 2, "e": 3, "f": 3, "g": 3, "h": 3} and waves1 == 3


def test_a_relayed_copy_tree_is_chains_and_lands_in_about_one_copy_time() -> None:
    """With the copy in parts each target forwards as they land, the tree is one chain per source (every
    node sends once: no egress shared), and L targets take 1 + (L - 1) / parts copy times."""
    from kvstore.placement.planner import chunk_bounds, copy_times, relay_parts

    edges, waves = copy_tree(["a"], list("bcdefgh"), fanout=2, chunks=8)
    assert edges == list(zip("abcdefg", "bcdefgh")) and waves == 2
    assert copy_times(1, 7, 2, chunks=8) == pytest.approx(1.75)
    two, waves2 = copy_tree(["a", "b"], list("cdefg"), fanout=1, chunks=4)
    assert sorted(two) == sorted([("a", "c"), ("c", "e"), ("e", "g"), ("b", "d"), ("d", "f")]) and waves2 == 2
    assert two[:2] == [("a", "c"), ("b", "d")]  # in hop order, as store and forward lists its waves
    assert copy_times(2, 5, 1, chunks=4) == pytest.approx(1.5)
    # store and forward: waves x fanout copy times (each wave's copies share their sender's egress)
    assert copy_times(1, 7, 2) == copy_tree(["a"], list("bcdefgh"), 2)[1] * 2 == 4.0
    assert copy_times(1, 0, 2, chunks=8) == 0.0
    # a copy is cut only into parts that take min_part_s or more: none on a link fast next to it
    assert relay_parts(1.0, 8, 0.02) == 8 and relay_parts(0.05, 8, 0.02) == 2
    assert relay_parts(0.01, 8, 0.02) == relay_parts(1.0, 1, 0.02) == relay_parts(0.0, 8, 0.02) == 1
    for n, parts in ((10, 4), (3, 8), (5, 1), (99, 8)):
        bounds = chunk_bounds(n, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == min(n, parts)
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:]))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_demand_sizes_the_set_and_the_tree_spreads_the_holder_egress() -> None:
    c = replace(cand(need=60.0), demand=80.0)  # 80 requests in 10 s at 1 req/s per node: 8 nodes
    d = only(plan([c], nodes(*EIGHT), 10 * GB, SIZED, NOW))
    assert sorted(d.targets) == list("bcdefgh") and d.waves == 2
    assert len(d.tree) == 7 and sum(1 for s, _ in d.tree if s == "a") <= 2 * d.waves
    assert "wants 7 more" in d.reason
    legacy = only(plan([cand(need=60.0)], nodes(*EIGHT), 10 * GB, CFG, NOW))
    assert len(legacy.targets) == 2 and legacy.tree == ()  # without a demand forecast: as before



def test_copies_in_flight_count_toward_the_demand_sized_set() -> None:
    """Four nodes' worth of demand, one holder and two copies still on the wire: one more copy, not
    three (the set would overshoot the demand by the copies in flight)."""
    c = replace(cand(need=60.0), demand=40.0)
    pending = {("ns", c.chain[7]): ["b", "c"]}
    d = only(plan([c], nodes(*EIGHT), 10 * GB, SIZED, NOW, pending=pending))
    assert d.targets == ("d",) and "wants 1 more" in d.reason

def test_a_shorter_prefix_takes_the_demand_of_its_longer_prefixes() -> None:
    """The forecaster counts only the keys it tracks: a depth-2 prefix it has no number for (0) is read by
    every request of the depth-4 and depth-8 prefixes, so it is sized by their demand, not left unknown."""
    deep = replace(cand(options=(1, 2, 4, 8)), demand=3.0)
    mid = replace(deep, chain=deep.chain[:4], depth_options=(1, 2, 4), demand=9.0)
    short = replace(deep, chain=deep.chain[:2], depth_options=(1, 2), demand=0.0)
    key = lambda d: deep.chain[d - 1]  # noqa: E731
    assert chain_demand([short, deep, mid]) == {"ns": {key(1): 9.0, key(2): 9.0, key(4): 9.0, key(8): 3.0}}
    # sized by it: the depth-4 prefix (scored below the copy threshold here) asks for 90 requests in
    # 10 s, at 1 req/s a node every node, so the depth-2 copy goes to all seven others, as a tree
    mid = replace(mid, demand=90.0, prob=0.4)
    d = only(plan([short, mid], nodes(*EIGHT), 10 * GB, SIZED, NOW))
    assert d.depth == 2 and len(d.targets) == 7 and d.tree
    assert len(only(plan([short], nodes(*EIGHT), 10 * GB, SIZED, NOW)).targets) == 2  # alone: unknown demand


def test_a_tree_is_trimmed_to_the_waves_that_land_in_time() -> None:
    page, bw = 10 * MB, 1 * GB  # 8 pages: 0.08 s a copy alone, 0.16 s two sharing the holder's egress
    c = replace(cand(need=0.25, page=page, options=(8,)), demand=80.0)  # a wave x1.5 safety: 0.24 s
    d = only(plan([c], nodes(*EIGHT), bw, SIZED, NOW))
    assert len(d.targets) == 2 and d.waves == 1  # one wave fits: the holder's fan-out only
    assert d.transfer_s == pytest.approx(0.16)
    c = replace(c, need_in_s=0.13)  # only a copy alone lands in time (0.12 s)
    d = only(plan([c], nodes(*EIGHT), bw, SIZED, NOW))
    assert len(d.targets) == 1 and d.transfer_s == pytest.approx(0.08)


def test_a_slow_ingress_is_no_target_when_its_copy_would_land_late() -> None:
    """The planner's rates are per node and direction: a target behind a slow link is passed over for
    one whose copy lands in time, and a source's copies in flight slow the next one out of it."""
    page = 10 * MB  # 8 pages = 80 MB
    c = cand(need=0.2, page=page, options=(8,), holders={8: {"a"}})
    ns = nodes(*EIGHT)
    for n in ns:
        n.ingress_bps = 1e8 if n.node_id != "h" else 1e10  # 0.8 s into every node but h (8 ms)
    d = only(plan([c], ns, 1e10, PlannerConfig(threshold=0.5), NOW))
    assert d.targets == ("h",) and d.transfer_s == pytest.approx(0.008)
    ns[0].sending = 99  # "a" already sends 99 copies: the 100th gets 1e8 B/s, 0.8 s
    r = plan([c], ns, 1e10, PlannerConfig(threshold=0.5), NOW)
    assert not r.decisions and r.skipped == {"too_late": 1}


def test_no_copy_when_the_set_already_serves_the_demand() -> None:
    c = replace(cand(holders={8: {"a", "b"}}), demand=15.0)  # wants 2 nodes, 2 hold it
    r = plan([c], nodes(*EIGHT), 10 * GB, SIZED, NOW)
    assert not r.decisions and r.skipped == {"enough_copies": 1}


def test_the_set_shrinks_when_the_demand_decays() -> None:
    c = replace(cand(holders={8: {"a", "b", "c", "d"}}), demand=10.0)  # now wants 1 node: keeps 2
    pid = (c.namespace, c.chain[-1])
    spec = {pid: {"b": NOW + 10, "c": NOW + 50, "d": NOW + 90}}
    renewals, drops = renew_or_drop([c], spec, {n: None for n in EIGHT}, SIZED, NOW)
    assert sorted((dr.node, dr.reason) for dr in drops) == [("b", "surplus"), ("c", "surplus")]
    assert not any(r.node in ("b", "c") for r in renewals)


def test_a_set_within_twice_the_demand_is_kept() -> None:
    """A demand that dips from 4 nodes' worth to 2's keeps the 4 copies (no drop-and-copy-again churn)."""
    c = replace(cand(holders={8: {"a", "b", "c", "d"}}), demand=20.0)  # wants 2 nodes, 4 hold it
    spec = {(c.namespace, c.chain[-1]): {"b": NOW + 10, "c": NOW + 50, "d": NOW + 90}}
    _, drops = renew_or_drop([c], spec, {n: None for n in EIGHT}, SIZED, NOW)
    assert drops == []


def test_a_shared_key_keeps_the_set_its_busiest_prefix_asks_for() -> None:
    """The depth-4 key of a chain is also part of every depth-8 request: the larger demand sizes it."""
    deep = replace(cand(holders={4: {"a", "b", "c"}, 8: {"a"}}, options=(4, 8)), demand=30.0)  # keeps 6
    short = replace(deep, chain=deep.chain[:4], depth_options=(4,), demand=2.0)                # keeps 1
    pid = (deep.namespace, deep.chain[3])
    spec = {pid: {"b": NOW + 50, "c": NOW + 90}}
    for order in ([deep, short], [short, deep]):
        _, drops = renew_or_drop(order, spec, {n: None for n in EIGHT}, SIZED, NOW)
        assert drops == [], order
