"""Capacity at an SLO: load as an axis (``--rate-scale``, ``--burstiness``), the bisection, the baselines a
user would run instead (engine-only under least-load and a KV router, Mooncake's scheduler), the bound,
and ``kvctl replay --search capacity`` on the simulator end to end."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from kvstore.replay import capacity
from kvstore.replay.cli import replay_main
from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import RequestRecord, meets_slo
from kvstore.replay.routers import KvRouter, Mooncake, NodeView, make_router
from kvstore.replay.workload import Workload, shape_requests
from kvstore.workloads.traces import Request, arrival_gap, scale_rate

COST = CostModel.preset("llama3-70b-tp8", 40960)


# ---- load as an axis -------------------------------------------------------------------------

def test_rate_scale_brings_the_same_requests_closer_together() -> None:
    reqs = [Request(1.0, 512, 8, (1,)), Request(3.0, 1024, 8, (1, 2)), Request(10.0, 512, 4, (3,))]
    fast = scale_rate(reqs, 4.0)
    assert [r.t for r in fast] == [0.25, 0.75, 2.5]
    assert [(r.input_length, r.output_length, r.hash_ids) for r in fast] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in reqs]
    wl = Workload("w", reqs, {"kind": "test"})
    assert wl.at_rate(1.0) is wl
    assert wl.at_rate(0.5).duration_s == 20.0 and wl.at_rate(0.5).source["rate_scale"] == 0.5
    with pytest.raises(ValueError, match="rate scale must be > 0"):
        scale_rate(reqs, 0.0)


def test_burstiness_keeps_the_mean_rate_and_sets_the_spread_of_the_gaps() -> None:
    for b in (0.25, 1.0, 4.0):
        rng = random.Random(1)
        gaps = [arrival_gap(rng, 2.0, b) for _ in range(20000)]
        mean = statistics.fmean(gaps)
        cv2 = statistics.pvariance(gaps) / mean ** 2  # gamma of shape b: squared coefficient of variation 1/b
        assert mean == pytest.approx(0.5, rel=0.05)
        assert cv2 == pytest.approx(1 / b, rel=0.1)
    # Poisson (1.0) draws exactly the stream it drew before burstiness existed: seeded workloads are unchanged
    assert arrival_gap(random.Random(3), 2.0) == random.Random(3).expovariate(2.0)
    assert shape_requests("ramp", 0) == shape_requests("ramp", 0, burstiness=1.0)
    assert shape_requests("ramp", 0) != shape_requests("ramp", 0, burstiness=0.3)


def test_the_tool_agent_shape_matches_mooncakes_tool_and_agent_trace() -> None:
    from kvstore.replay.workload import reusable_blocks

    reqs = shape_requests("tool-agent", 0)
    tokens = sum(r.input_length for r in reqs)
    assert 7000 < tokens / len(reqs) < 10000          # 8,596 in Mooncake's table
    assert {r.output_length for r in reqs} == {182}
    assert 0.5 < sum(reusable_blocks(reqs)) * 512 / tokens < 0.65  # 59 % cacheable


def test_the_slo_is_the_larger_of_a_fixed_ttft_and_a_factor_of_the_cold_prefill() -> None:
    short = RequestRecord(0, 0.0, queue_s=0.5, prefill_s=0.001, cold_prefill_s=0.001)
    long = RequestRecord(1, 0.0, queue_s=3.0, prefill_s=2.0, cold_prefill_s=2.0)
    assert meets_slo(short, 2.0, 1.0) and not meets_slo(short, 2.0, 0.0)  # a short prompt's round trips
    assert not meets_slo(long, 2.0, 1.0)  # 5 s against max(1, 4)
    long.queue_s = 1.9
    assert meets_slo(long, 2.0, 1.0)


# ---- the search ---------------------------------------------------------------------------------

def _knee_at(x0: float):  # type: ignore[no-untyped-def]
    calls: list[float] = []

    def run(x: float) -> dict[str, float]:
        calls.append(x)
        return {"slo_attainment": 0.95 if x <= x0 else 0.5, "ttft_p50_s": x, "ttft_p99_s": 2 * x,
                "completed": 10, "requests": 10}
    return run, calls


@pytest.mark.parametrize("x0", [0.3, 1.0, 3.3, 17.0])
def test_bisection_finds_the_knee_to_its_resolution(x0: float) -> None:
    run, calls = _knee_at(x0)
    cap = capacity.search(run, 0.9, 0.05, base_rps=2.0)
    assert x0 / 1.05 <= cap.rate_scale <= x0
    assert cap.knee is not None and cap.knee.attainment == 0.95 and cap.knee.requests_per_s == 2.0 * cap.rate_scale
    assert len(calls) <= 12 and len(cap.probes) == len(calls)
    assert any(p.rate_scale > x0 for p in cap.probes)  # the bracket's upper end was seen failing


def test_a_configuration_that_never_meets_the_slo_has_no_capacity_and_one_that_always_does_is_capped() -> None:
    never = capacity.search(lambda x: {"slo_attainment": 0.1, "ttft_p50_s": 9, "ttft_p99_s": 9, "completed": 1,
                                       "requests": 1}, 0.9, 0.05, 1.0)
    assert never.knee is None and never.rate_scale == 0.0 and never.probes[-1].rate_scale == capacity.LOWEST
    always = capacity.search(lambda x: {"slo_attainment": 1.0, "ttft_p50_s": 0, "ttft_p99_s": 0, "completed": 1,
                                        "requests": 1}, 0.9, 0.05, 1.0)
    assert always.capped and always.rate_scale == capacity.HIGHEST


def _cap(x: float) -> dict[str, object]:
    return {"rate_scale": x, "requests_per_s": x, "attainment": 0.9, "ttft_p50": 0.1, "ttft_p99": 1.0,
            "capped": False}


def test_summary_reads_every_capacity_against_engine_only_the_best_baseline_and_the_bound() -> None:
    per = {"engine-only|least-load": [_cap(1.0), _cap(1.2)], "engine-only|kv-router": [_cap(2.0), _cap(2.0)],
           "none|cache-aware@32": [_cap(3.0), _cap(2.0)], "predictive|cache-aware@32": [_cap(4.0), _cap(3.0)],
           "oracle|plan": [_cap(5.0), _cap(5.0)], "bound|plan": [_cap(6.0), _cap(5.0)]}
    s = capacity.summarize(per)
    assert s["reference"] == "engine-only|kv-router"      # engine-only's best router is the 1.0x
    assert s["best_baseline"] == "none|cache-aware@32"    # the best that does not predict
    assert s["best"] == "predictive|cache-aware@32"       # neither the oracle nor the bound
    assert s["bound"] == "bound|plan"
    p = s["configs"]["predictive|cache-aware@32"]
    assert p["vs_engine_only"] == {"median": 1.75, "min": 1.5, "max": 2.0, "n": 2}
    assert p["vs_best_baseline"]["median"] == pytest.approx((4 / 3 + 1.5) / 2)
    assert capacity.over_bound(s) == []
    per["reactive|mooncake"] = [_cap(6.5), _cap(1.0)]
    assert capacity.over_bound(capacity.summarize(per)) == ["reactive|mooncake"]
    assert capacity.knees(s) == {"best_baseline": 2.5, "best": 3.5}


# ---- the routers a user would pick instead --------------------------------------------------------

def _prefill(blocks: int, cached: int) -> float:
    return COST.prefill_s(COST.uncached_tokens(blocks * COST.block_tokens, cached))


def test_the_kv_router_follows_the_engines_own_caches_until_their_queues_outweigh_them() -> None:
    r = make_router("kv-router", prefill_s=_prefill)
    assert isinstance(r, KvRouter) and r.needs_engine_cache and not r.needs_prefix
    views = [NodeView("a", engine=0), NodeView("b", engine=30), NodeView("c", engine=10)]
    assert r.choose(views, 32) == (1, "kv-router")
    views[1].work_s = 5.0  # computing 30 blocks elsewhere is cheaper than 5 s of queue
    assert r.choose(views, 32)[0] == 2


def test_mooncakes_scheduler_pulls_only_where_the_pull_beats_computing() -> None:
    r = make_router("mooncake", prefill_s=_prefill, pull_s=COST.link_s)
    assert isinstance(r, Mooncake) and r.needs_prefix and r.needs_engine_cache
    views = [NodeView("a", prefix=32, work_s=10.0), NodeView("b", work_s=0.0), NodeView("c", engine=8, work_s=0.5)]
    est = r.estimate(views, 33)
    pull_all = COST.link_s(32) + _prefill(33, 32)
    assert est[1] == pytest.approx(min(_prefill(33, 0), pull_all))
    assert est[2] == pytest.approx(0.5 + min(_prefill(33, 8), COST.link_s(24) + _prefill(33, 32)))
    assert r.choose(views, 33)[0] == 1
    no_pull = Mooncake(_prefill, None)  # a policy that does not pull: each node computes what it lacks
    assert no_pull.estimate(views, 33)[1] == pytest.approx(_prefill(33, 0))


# ---- the bound's clock: a block is at hand once its first computation could have ended ----------------

def test_a_block_is_ready_once_the_first_request_that_has_it_could_have_computed_it() -> None:
    from kvstore.replay.workload import reusable_blocks, reuse_ready

    reqs = [Request(t=0.0, input_length=4 * 512, output_length=1, hash_ids=[1, 2, 3, 4]),
            Request(t=0.5, input_length=3 * 512, output_length=1, hash_ids=[1, 2, 9]),    # a follower of the first
            Request(t=9.0, input_length=5 * 512, output_length=1, hash_ids=[1, 2, 9, 7, 8])]
    ready = reuse_ready(reqs, reusable_blocks(reqs), lambda blocks: 1.0 * blocks)
    assert ready[0] == ()
    assert ready[1] == (1.0, 2.0)            # the first's blocks 1 and 2, one second a block from its arrival
    # block 9 could exist at 1.5 (the second's arrival plus one block), but the prefix through it at 2.0
    assert ready[2] == (1.0, 2.0, 2.0)


def test_the_bound_waits_for_a_prefix_only_where_that_ends_before_computing_it() -> None:
    from kvstore.replay.serve import bound_reuse

    cost = CostModel.preset("llama3-70b-tp8")
    per_block = cost.prefill_s(cost.block_tokens)
    rec = RequestRecord(idx=1, t=0.0, blocks=33, input_tokens=33 * cost.block_tokens, reusable=32)
    rec.ready = tuple(5.0 * per_block for _ in range(32))    # the leader's prefill ends in 5 blocks' time
    n, wait = bound_reuse(rec, 32, cost, 0.0)                 # waiting 5 beats computing 32
    assert n == 32 and wait == pytest.approx(5.0 * per_block)
    n, wait = bound_reuse(rec, 32, cost, 10.0 * per_block)    # already there: no wait
    assert n == 32 and wait == 0.0
    rec.ready = tuple((40.0 if i >= 2 else 0.0) * per_block for i in range(32))  # the rest comes too late
    n, wait = bound_reuse(rec, 32, cost, 0.0)
    assert n == 2 and wait == 0.0
    rec.ready = ()                                            # no clock: every reusable block, at once
    assert bound_reuse(rec, 32, cost, 0.0) == (32, 0.0)


# ---- the simulator, end to end --------------------------------------------------------------------

def _replay(tmp_path: Path, *args: str) -> dict:  # type: ignore[type-arg]
    assert replay_main(["--sim", "--nodes", "2", "--preset", "llama3-70b-tp8", "--link", "eth-100g",
                        "--capacity", "preset", "--no-plots", "--no-progress", "--out", str(tmp_path), *args]) == 0
    return json.loads((tmp_path / "results.json").read_text())


def test_engine_only_asks_the_store_nothing_and_the_bound_serves_every_reusable_block(tmp_path: Path) -> None:
    res = _replay(tmp_path, "--trace", "tool-agent", "--policies", "engine-only,none,bound", "--routers",
                  "kv-router", "--rate-scale", "0.25")
    w = res["workloads"]["tool-agent"]
    eng, bound = w["runs"]["engine-only|kv-router"][0], w["runs"]["bound|plan"][0]
    assert eng["local_blocks"] == eng["remote_blocks"] == 0 and eng["engine_cached_blocks"] > 0
    assert eng["kv_fetch_p99_s"] == 0.0 and eng["route_p99_s"] == 0.0
    assert bound["miss_blocks"] == bound["blocks"] - round(bound["reusable_ratio"] * bound["blocks"])
    for s in (eng, bound):
        assert s["completed"] == s["requests"]
    # at a quarter of the load nothing queues: the bound is the floor
    assert bound["ttft_p50_s"] == pytest.approx(bound["ttft_floor_p50_s"], rel=0.01)
    assert w["workload"]["rate_scale"] == 0.25 and w["workload"]["duration_s"] > 2000


def test_capacity_search_end_to_end_no_configuration_exceeds_the_bound(tmp_path: Path) -> None:
    res = _replay(tmp_path, "--search", "capacity", "--trace", "agent-fanout", "--policies",
                  "engine-only,none,reactive,predictive,oracle,bound", "--routers", "least-load,cache-aware,mooncake",
                  "--search-resolution", "0.1", "--jobs", "2")
    w = res["workloads"]["agent-fanout"]
    cap = w["capacity"]
    assert cap["reference"].startswith("engine-only|") and cap["bound"] == "bound|plan"
    assert capacity.over_bound(cap, 0.1) == [] and not any(w["problems"].values())
    for label, c in cap["configs"].items():
        assert 0 < c["rate_scale"]["median"] < capacity.HIGHEST, label
        seed = cap["per_seed"][label][0]
        assert seed["attainment"] >= 0.9 and seed["probes"]
    report = (tmp_path / "report.md").read_text()
    assert "| configuration | capacity (rate scale) |" in report and "(bound)" in report
