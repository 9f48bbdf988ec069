"""What keeps a planner tick short at 100k prefixes, and changes none of its decisions.

* ``Ranked`` rows, built only as far as the tick gets, plan exactly what the same candidates passed
  eagerly plan (a property test), and most of a full cluster's rows are never built;
* ``gate_row`` with ``tick_bounds`` turns a row away for the very reason ``plan`` gives;
* ``to_review``: a slice of the placed chains a tick, whole chains, every due one, all of them within
  ``review_slices`` ticks; what is not under review is left as it is;
* ``LazyHolders`` looks a depth up once, and only when read;
* ``plan_steps``, the tick a step at a time, plans what ``plan`` plans, and a placed prefix that goes
  between its steps is passed over.

Pure: no sockets, no clocks.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import drain_steps

from kvstore.placement.candidates import GATE_REASONS, RANK_CHUNK, Ranked, gate_row
from kvstore.placement.planner import PLAN_STEP, plan, plan_steps, tick_bounds
from kvstore.placement.planner_types import Candidate, LazyHolders, NodeState, PlannerConfig
from kvstore.placement.renewals import RENEW_STEP, REVIEW_STEP, renew_or_drop, renew_or_drop_steps, to_review, to_review_steps

MB = 1_000_000
GB = 1_000_000_000
NOW = 1000.0
IDS = [f"n{i}" for i in range(6)]


def chain_of(name: str, n: int = 8) -> tuple[bytes, ...]:
    return tuple(f"{name}/{i}".encode() for i in range(1, n + 1))


def cand(name: str, prob: float, need: float, page: int, holders: dict[int, frozenset[str]],
         demand: float = 0.0) -> Candidate:
    return Candidate(namespace="ns", chain=chain_of(name), depth_options=(1, 2, 4, 8), holders=holders, prob=prob,
                     need_in_s=need, page_bytes=page, demand=demand)


def least(c: Candidate) -> int:
    return min(c.depth_options) * c.page_bytes if c.page_bytes > 0 else -1


def split(cands: list[Candidate], eager_names: set[bytes], threshold: float,
          built: list[int]) -> tuple[list[Candidate], Ranked]:
    """The chains not in ``eager_names`` with a candidate at the copy threshold as ranked rows (one row a
    chain, best first), the rest eager, as ``TickPlanner.split`` does."""
    chains: dict[bytes, list[Candidate]] = {}
    for c in cands:
        chains.setdefault(c.chain[0], []).append(c)
    later = sorted((m for root, m in chains.items() if root not in eager_names and max(c.prob for c in m) >= threshold),
                   key=lambda m: -max(c.prob for c in m))
    ranked_ids = {id(c) for m in later for c in m}
    eager = [c for c in cands if id(c) not in ranked_ids]

    def build(lo: int, hi: int) -> list[Candidate]:
        built[0] += hi - lo
        return [c for m in later[lo:hi] for c in m]

    ranked = Ranked(np.array([max(c.prob for c in m) for m in later]), np.array([max(c.need_in_s for c in m) for m in later]),
                    np.array([min(least(c) for c in m) for m in later], dtype=np.int64),
                    np.array([sum(c.prob >= threshold for c in m) for m in later]), build)
    return eager, ranked


@st.composite
def ticks(draw: st.DrawFn) -> tuple[list[Candidate], list[NodeState], PlannerConfig, dict, set[bytes], float]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    ns = []
    for nid in IDS[: rng.randint(2, 6)]:
        cap = rng.choice([100, 20, 4]) * GB
        spec = rng.randrange(0, 8) * GB // 2
        ns.append(NodeState(nid, cap, min(cap, spec + rng.randrange(0, 20) * GB), min(spec, cap),
                            load=rng.choice([0.0, 1.0]), egress_bps=rng.choice([0.0, 1e9, 1e10]),
                            sending=rng.randrange(0, 3)))
    probs = [rng.choice([0.4, 0.6, 0.7, 0.7, 0.8, 0.9, 0.95]) for _ in range(rng.randint(0, 3 * RANK_CHUNK))]
    cands = [cand(f"c{i}", p, rng.choice([0.2, 2.0, 30.0, 60.0]), rng.choice([10 * MB, 100 * MB, 1 * GB, 0]),
                  {d: frozenset(rng.sample(IDS, rng.randint(0, 2))) for d in (2, 8)},
                  demand=rng.choice([0.0, 5.0, 40.0]))
             for i, p in enumerate(probs)]
    for c in rng.sample(cands, len(cands) // 4):  # a shorter prefix of the same chain, scored apart
        cands.append(replace(c, chain=c.chain[:4], depth_options=(1, 2, 4), prob=rng.choice([0.4, 0.7, 0.95]),
                             need_in_s=rng.choice([2.0, 60.0]), demand=rng.choice([0.0, 80.0])))
    spec: dict = {}
    for c in rng.sample(cands, min(len(cands), 6)):
        spec[(c.namespace, c.chain[rng.choice([1, -1])])] = {n: NOW + rng.choice([-1.0, 30.0, 100.0])
                                                            for n in rng.sample(IDS, 2)}
    cfg = PlannerConfig(threshold=0.5, spec_budget=rng.choice([0.1, 0.5]), spec_bandwidth=rng.choice([1e9, 1e10, 1e11]),
                        max_decisions=rng.choice([3, 100]), node_rate=rng.choice([0.0, 1.0]), review_slices=1)
    eager = {c.chain[0] for c in cands if rng.random() < 0.3}
    eager |= {c.chain[0] for c in cands if any((c.namespace, k) in spec for k in c.chain)}  # under review: built
    return cands, ns, cfg, spec, eager, rng.choice([1e9, 1e10])


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ticks())
def test_ranked_rows_plan_what_the_same_candidates_plan_eagerly(
        tick: tuple[list[Candidate], list[NodeState], PlannerConfig, dict, set[bytes], float]) -> None:
    cands, ns, cfg, spec, eager_names, bandwidth = tick
    whole = plan(cands, ns, bandwidth, cfg, NOW, spec)
    built = [0]
    eager, ranked = split(cands, eager_names, cfg.threshold, built)
    lazy = plan(eager, ns, bandwidth, cfg, NOW, spec, ranked=ranked)
    assert lazy.decisions == whole.decisions
    assert (lazy.renewals, lazy.drops, lazy.bytes_planned) == (whole.renewals, whole.drops, whole.bytes_planned)
    # every row is accounted for once; a row turned away early may count under an earlier reason
    assert sum(lazy.skipped.values()) == sum(whole.skipped.values())
    assert built[0] <= len(ranked)


def test_a_full_cluster_builds_few_of_its_ranked_rows() -> None:
    """Room for one copy, 10 RANK_CHUNKs of rows: the tick builds the rows up to the copy, then stops."""
    ns = [NodeState("a", 100 * GB, 100 * GB - 5 * MB), NodeState("b", 100 * GB, 100 * GB - 15 * MB)]
    cfg = PlannerConfig(threshold=0.5, spec_bandwidth=1e11)
    cands = [cand(f"c{i:03d}", 0.9 - i * 1e-4, 60.0, 10 * MB, {8: frozenset({"a"})}) for i in range(10 * RANK_CHUNK)]
    built = [0]
    eager, ranked = split(cands, set(), cfg.threshold, built)
    r = plan(eager, ns, 10 * GB, cfg, NOW, ranked=ranked)
    assert [d.targets for d in r.decisions] == [("b",)]
    assert built[0] <= 2 * RANK_CHUNK
    assert r.skipped == {"no_room": 10 * RANK_CHUNK - 1}  # the rows never built count too
    assert r == plan(cands, ns, 10 * GB, cfg, NOW)


@pytest.mark.parametrize("case", range(80))
def test_gate_turns_a_row_away_for_the_reason_plan_gives(case: int) -> None:
    rng = random.Random(case)
    ns = [NodeState(n, 10 * GB, rng.randrange(0, 11) * GB, 0, egress_bps=rng.choice([0.0, 1e8]),
                    receiving=rng.randrange(0, 3)) for n in IDS[: rng.randint(0, 3)]]
    cfg = PlannerConfig(threshold=0.0, spec_budget=rng.choice([0.0, 0.1, 1.0]),
                        spec_bandwidth=rng.choice([0.0, 1e8, 1e10, 1e10, 1e10]))
    c = cand("x", 0.9, rng.choice([0.1, 1.0, 100.0]), rng.choice([0, 10 * MB, 1 * GB]), {8: frozenset({"n0"})})
    in_flight = rng.choice([0, 0, 0, 10 * GB])
    b = tick_bounds(ns, 1e9, cfg, transfers_in_flight_bytes=in_flight)
    code = gate_row(least(c), c.need_in_s, b, cfg.safety)
    r = plan([c], ns, 1e9, cfg, NOW, transfers_in_flight_bytes=in_flight)
    if code:
        assert r.skipped == {GATE_REASONS[code]: 1}
    else:  # it may still be skipped, by the checks node by node
        assert r.decisions or set(r.skipped) <= {"no_room", "too_late", "no_source", "held_everywhere"}


# --------------------------------------------------------------------------
# review slices
# --------------------------------------------------------------------------

SLICED = PlannerConfig(ttl_s=120.0, renew_when_left=0.5, tick_s=1.0, review_slices=4)


def placed(chains: int, expires: float) -> tuple[dict, dict]:
    """Two placed prefixes (depth 4 and 8) of each of ``chains`` chains; their chain numbers."""
    spec, number = {}, {}
    for i in range(chains):
        keys = chain_of(f"p{i}")
        for d in (4, 8):
            pid = ("ns", keys[d - 1])
            spec[pid] = {"a": expires}
            number[pid] = i
    return spec, number


def test_review_covers_every_chain_within_its_slices_and_keeps_chains_whole() -> None:
    spec, number = placed(40, NOW + 110)  # none due for renewal within 4 ticks
    seen: set = set()
    for turn in range(4):
        review = to_review(spec, number, turn, SLICED, NOW)
        assert 0 < len(review) < len(spec)
        assert {number[p] for p in review} == {i for i in range(40) if i % 4 == turn}  # whole chains, one slice
        seen |= review
    assert seen == set(spec)
    assert to_review(spec, number, 0, replace(SLICED, review_slices=1), NOW) == set(spec)


def test_a_chain_due_for_renewal_is_reviewed_every_tick() -> None:
    spec, number = placed(8, NOW + 110)
    due = ("ns", chain_of("p1")[3])
    spec[due] = {"a": NOW + 63.0}  # renewed once under 60 s are left: due within the 4 ticks of a round
    for turn in range(4):
        review = to_review(spec, number, turn, SLICED, NOW)
        assert due in review and ("ns", chain_of("p1")[7]) in review  # with the rest of its chain
    gone = ("ns", chain_of("p2")[3])
    spec[gone] = {"a": NOW - 1.0}  # expired: its drop waits for no slice either
    assert gone in to_review(spec, number, 1, SLICED, NOW)


def test_replicas_not_under_review_are_left_as_they_are() -> None:
    cold = cand("c", 0.01, 60.0, 10 * MB, {8: frozenset({"a"})})
    spec = {("ns", cold.chain[-1]): {"b": NOW - 1.0}, ("ns", chain_of("d")[-1]): {"b": NOW + 5.0}}
    live = {"a": None, "b": None}
    assert renew_or_drop([cold], spec, live, SLICED, NOW, review=set()) == ([], [])
    _, drops = renew_or_drop([cold], spec, live, SLICED, NOW, review={("ns", chain_of("d")[-1])})
    assert [(d.key, d.reason) for d in drops] == [(chain_of("d")[-1], "decayed")]


def test_the_tick_in_steps_plans_what_plan_plans_and_passes_over_a_replica_gone_meanwhile() -> None:
    sized = PlannerConfig(threshold=0.5, node_rate=1.0, demand_window_s=10.0, review_slices=1)
    cands = [cand(f"c{i:03d}", 0.9 - i * 1e-3, 60.0, 10 * MB, {8: frozenset({"a"})}, demand=30.0)
             for i in range(3 * PLAN_STEP)]
    spec = {("ns", c.chain[-1]): {"b": NOW + 1.0} for c in cands[:3]}  # due for renewal
    ns = [NodeState(n, 100 * GB, 0) for n in "abcd"]
    whole = plan(cands, ns, 10 * GB, sized, NOW, spec)
    steps = plan_steps(cands, ns, 10 * GB, sized, NOW, spec)
    next(steps)
    next(steps)  # the first PLAN_STEP - 1 candidates are planned
    del spec[("ns", cands[0].chain[-1])]  # then its replica goes (evicted) while the tick is off the loop
    stepped, yields = drain_steps(steps)
    assert yields >= 1  # it did yield on the way
    assert stepped.decisions == whole.decisions
    assert [r.key for r in whole.renewals] == [c.chain[-1] for c in cands[:3]]
    assert [r.key for r in stepped.renewals] == [c.chain[-1] for c in cands[1:3]]


def test_the_review_and_the_renewals_run_in_steps_over_many_placed_prefixes() -> None:
    """Thousands of placed prefixes: the review and the renewals give the loop back every REVIEW_STEP and
    RENEW_STEP of them. The review is of the prefixes placed when it began; a placed prefix that goes
    before its renewal's turn is passed over (no KeyError, no renewal of a replica that is gone)."""
    n = 2 * REVIEW_STEP + 3
    cands = [cand(f"r{i:05d}", 0.9, 60.0, 10 * MB, {8: frozenset({"a"})}) for i in range(n)]
    spec = {("ns", c.chain[-1]): {"b": NOW + 1.0} for c in cands}  # every one due for renewal
    live = {"a": None, "b": None}
    number = {pid: int(pid[1][1:6]) for pid in spec}
    review, yields = drain_steps(to_review_steps(spec, number, 0, SLICED, NOW))
    assert yields >= 2 and review == to_review(spec, number, 0, SLICED, NOW) == set(spec)
    steps = renew_or_drop_steps(cands, spec, live, SLICED, NOW, review=review)
    next(steps)  # the first RENEW_STEP - 1 looked at
    gone = [("ns", c.chain[-1]) for c in (cands[0], cands[-1])]
    for pid in gone:
        del spec[pid]  # their replicas went meanwhile
    (renewals, drops), _ = drain_steps(steps)
    renewed = {(r.namespace, r.key) for r in renewals}
    assert gone[0] in renewed and gone[1] not in renewed and not drops  # the first had its turn already
    assert len(renewed) == n - 1 and RENEW_STEP < n


def test_a_dead_holder_does_not_make_a_replica_surplus() -> None:
    """The surplus rule counts the live holders nobody placed: a copy on a dead node serves nothing."""
    sized = PlannerConfig(threshold=0.5, node_rate=1.0, demand_window_s=10.0)
    c = cand("s", 0.9, 60.0, 10 * MB, {8: frozenset({"a", "dead"})}, demand=10.0)  # wants 1 node (x2 slack: 2)
    spec = {("ns", c.chain[-1]): {"b": NOW + 100.0}}
    live = {n: None for n in "abcd"}
    assert renew_or_drop([c], spec, live, sized, NOW)[1] == []  # a + b = 2 live copies: kept
    c2 = replace(c, holders={8: frozenset({"a", "c"})})  # a + c + b = 3 live copies > 2: b goes
    assert [d.reason for d in renew_or_drop([c2], spec, live, sized, NOW)[1]] == ["surplus"]


# --------------------------------------------------------------------------
# lazy holders
# --------------------------------------------------------------------------


def test_lazy_holders_look_a_depth_up_once_and_only_when_read() -> None:
    asked: list[int] = []

    def lookup(d: int) -> frozenset[str]:
        asked.append(d)
        return frozenset({f"n{d}"})

    h = LazyHolders((1, 2, 4), lookup)
    assert asked == [] and len(h) == 3 and list(h) == [1, 2, 4]
    assert h[2] == h.get(2) == frozenset({"n2"}) and asked == [2]
    assert h.get(8, ()) == () and asked == [2]
    with pytest.raises(KeyError):
        h[8]
    assert dict(h) == {1: frozenset({"n1"}), 2: frozenset({"n2"}), 4: frozenset({"n4"})} and asked == [2, 1, 4]


def test_a_forecast_prefix_held_below_a_pool_is_promoted_on_its_holder_once_a_while() -> None:
    from kvstore.cluster.directory import Directory
    from kvstore.cluster.tickplan import PROMOTE_AGAIN_S, TickPlanner
    from kvstore.predict.types import PredictorConfig
    from kvstore.v1 import kvstore_pb2 as pb

    chain = chain_of("p")
    d = Directory()
    # n0: all 8 pages, the last 4 down a tier; n1: all in its pool; n2: the first 4, all below; n3: not live
    for node, held, below in (("n0", 8, chain[4:]), ("n1", 8, ()), ("n2", 4, chain[:4]), ("n3", 8, chain)):
        d.report(node, "i", 0, True, [pb.DirectoryBatch(namespace="ns", adds=chain[:held], below=below)])
    tp = TickPlanner(None, d, None, PredictorConfig(), PlannerConfig(threshold=0.65), lambda ns: 4096)
    pid = ("ns", chain[-1])
    tp.recurring = {pid}  # the forecaster expects it back on its own period
    rows = [(pid, chain, 4096)]
    live = frozenset({"n0", "n1", "n2"})
    want = sorted([("ns", chain[4:], "n0"), ("ns", chain[:4], "n2")])
    assert tp.promote({pid: (0.9, 10.0, "forecast")}, rows, live, NOW) == []  # due later than PROMOTE_LEAD_S
    assert sorted(tp.promote({pid: (0.9, 2.0, "forecast")}, rows, live, NOW)) == want
    assert tp.promote({pid: (0.9, 2.0, "forecast")}, rows, live, NOW + 1) == []  # asked already
    assert sorted(tp.promote({pid: (0.9, 2.0, "forecast")}, rows, live, NOW + PROMOTE_AGAIN_S)) == want
    fresh = TickPlanner(None, d, None, PredictorConfig(), PlannerConfig(threshold=0.65), lambda ns: 4096)
    fresh.recurring = {pid}
    assert fresh.promote({pid: (0.5, 2.0, "forecast")}, rows, live, NOW) == []  # under the copy threshold
    fresh.recurring = set()  # seen in one burst (a borrowed period) or chosen by the classifier: left below
    assert fresh.promote({pid: (0.9, 2.0, "forecast")}, rows, live, NOW) == []
