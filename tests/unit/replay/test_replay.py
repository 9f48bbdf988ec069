"""The trace-replay benchmark (kvstore/replay): pure unit tests of the cost
model, routers, oracle look-ahead, workloads and aggregates (no sockets). The
end-to-end runs with real kvstored processes:
tests/integration/test_replay_end_to_end.py."""

from __future__ import annotations

from collections import Counter

import json
from types import SimpleNamespace

import numpy as np
import pytest


from kvstore.replay.costmodel import CostModel
from kvstore.replay.engine import bad_pages, make_pages, page_words
from kvstore.replay.metrics import RequestRecord, aggregate, check, cluster_summary, metric_sum
from kvstore.replay.oracle import RULES, Sim, percentile, plan, simulate
from kvstore.replay.routers import CacheAware, Eta, LeastLoad, NodeView, RoundRobin, make_router, views_from_lookup
from kvstore.replay.workload import (
    SynthSpec, cut_window, reusable_blocks, synth_requests, write_mooncake,
)
from kvstore.workloads.traces import Request, load_mooncake

MiB = 1 << 20


# ---- cost model ----------------------------------------------------------------

def test_page_bytes_from_model_shape() -> None:
    c8 = CostModel.preset("llama3-8b", byte_scale=1024)
    assert c8.model.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert c8.page_bytes == 64 * MiB  # 512-token Mooncake block
    assert c8.scaled_page_bytes == 64 * 1024
    c70 = CostModel.preset("llama3-70b", byte_scale=4096)
    assert c70.page_bytes == 80 * 8 * 128 * 2 * 2 * 512 == 160 * MiB
    assert c70.gpus == 4
    with pytest.raises(ValueError):
        CostModel.preset("llama3-8b", byte_scale=1 << 15)  # 2 KiB pages: below the 4 KiB floor
    with pytest.raises(ValueError):
        CostModel.preset("nope")


def test_auto_byte_scale_stores_4_kib_pages_and_auto_capacity_keeps_a_modelled_tebibyte(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--byte-scale auto picks the smallest stored page the cost model allows (4 KiB) for every preset, and
    --capacity auto gives each node 1 TiB of modelled bytes whatever the scale; the run records both."""
    from kvstore.replay.cli import replay_main
    from kvstore.replay.costmodel import MIN_PAGE_BYTES, MODELLED_CAPACITY, PRESETS, auto_byte_scale

    for name in PRESETS:
        page = CostModel.preset(name).page_bytes
        scale = auto_byte_scale(page)
        assert CostModel.preset(name, byte_scale=scale).scaled_page_bytes == MIN_PAGE_BYTES, name
    assert auto_byte_scale(160 * MiB) == 40960 and auto_byte_scale(64 * MiB) == 16384
    assert auto_byte_scale(4096 + 8) == 1  # no whole scale below: the page as it is
    out = tmp_path / "auto"
    assert replay_main(["--trace", "agent-fanout", "--nodes", "2", "--preset", "llama3-70b-tp8", "--policies",
                        "none", "--sim", "--no-plots", "--no-progress", "--out", str(out)]) == 0
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["byte_scale"] == 40960 and int(config["capacity"]) * 40960 == MODELLED_CAPACITY - MODELLED_CAPACITY % 40960


def test_preset_capacities_and_tiers_reach_the_daemons_and_the_simulator_alike() -> None:
    """--capacity preset is the host memory a DGX H100 gives KV (half its 2 TB, per GPU of the preset), and
    --tiers preset a disk tier of its NVMe (one 3.84 TB drive a GPU) paced at the drives' rated rates: all
    scaled by --byte-scale, the rates on the daemons' clock (x --speedup); the simulator reads the same
    daemon arguments back into pages and trace-second rates."""
    from kvstore.replay.cli import replay_parser
    from kvstore.replay.config import ReplayConfig, cluster_and_router
    from kvstore.replay.sim_coord import node_config

    cfg = ReplayConfig.from_args(replay_parser().parse_args(
        ["--preset", "llama3-70b-tp8", "--capacity", "preset", "--tier-policies", "single-tier,tiers-lru,tiers-freq",
         "--speedup", "4"]))
    cost = cfg.cost()
    assert cost.host_kv_bytes == 1e12 and cost.nvme_bytes == 30.72e12
    assert cost.nvme_read_bytes_s == pytest.approx(51.2e9) and cost.nvme_write_bytes_s == pytest.approx(30.4e9)
    assert cost.disk_write_budget_bytes_s == pytest.approx(30.72e12 / 86400)  # one drive write a day
    assert int(cfg.capacity) == int(1e12) // 40960
    assert cfg.policy_list() == [p + t for p in ("none", "reactive", "full", "predictive") for t in
                                 ("", "+tiers-lru", "+tiers-freq")] + ["oracle"]
    spec, _ = cluster_and_router(cfg, "reactive+tiers-lru", ("cache-aware", "cache-aware", 32.0), cost)
    daemon = node_config(spec.args("n0"))
    (disk,) = daemon.tier
    assert disk.kind == "disk" and disk.capacity == int(30.72e12) // 40960
    assert daemon.tier_read_rate == pytest.approx(51.2e9 * 4 / 40960) and daemon.tier_admit == "all"
    freq, _ = cluster_and_router(cfg, "reactive+claims+tiers-freq", ("cache-aware", "cache-aware", 32.0), cost)
    assert node_config(freq.args("n0")).tier_admit == "reused"
    # a disk page read takes its modelled time: 160 MiB at 51.2 GB/s, well under its prefill
    assert cost.disk_load_s(1) == pytest.approx(160 * MiB / 51.2e9) and cost.disk_load_s(1) < cost.prefill_s(512) / 5
    none = ReplayConfig.from_args(replay_parser().parse_args(["--preset", "llama3-70b-tp8"]))
    assert not node_config(cluster_and_router(none, "reactive", ("cache-aware", "cache-aware", 32.0),
                                              none.cost())[0].args("n0")).tier
    with pytest.raises(ValueError, match="--capacity"):
        ReplayConfig.from_args(replay_parser().parse_args(["--capacity", "lots"]))
    for bad in (["--tier-policies", "tiers-magic"], ["--policies", "oracle+tiers-lru"],
                ["--policies", "reactive+tiers-lru+tiers-freq"]):
        with pytest.raises(ValueError):
            ReplayConfig.from_args(replay_parser().parse_args(bad))


def test_prefill_decode_link_arithmetic() -> None:
    c = CostModel.preset("llama3-8b")
    # 2 x params x tokens / (FLOP/s x MFU)
    assert c.prefill_s(1000) == pytest.approx(2 * 8.03e9 * 1000 / (989e12 * 0.5))
    assert c.prefill_s(0) == 0.0
    # decode: (weights + KV of the mid-point context) / HBM per token
    per_token = (8.03e9 * 2 + 128 * 1024 * (1000 + 50)) / 3.35e12
    assert c.decode_s(1000, 100) == pytest.approx(100 * per_token)
    assert c.decode_s(1000, 0) == 0.0
    # link: unscaled bytes / 50 GB/s
    assert c.link_s(3) == pytest.approx(3 * 64 * MiB / 50e9)
    assert CostModel.preset("llama3-8b", link_gbs=100).link_s(1) == pytest.approx(64 * MiB / 100e9)
    # tensor parallelism divides compute and bandwidth time
    c70, c70x8 = CostModel.preset("llama3-70b"), CostModel.preset("llama3-70b-tp8")
    assert c70.prefill_s(512) == pytest.approx(2 * c70x8.prefill_s(512))
    # uncached tokens: whole cached blocks come off; at least one token is computed
    assert c.uncached_tokens(1300, 2) == 1300 - 1024
    assert c.uncached_tokens(1024, 2) == 1


# ---- routers -------------------------------------------------------------------

def _views(loads, prefixes, hinted=None):  # type: ignore[no-untyped-def]
    hinted = hinted or [0] * len(loads)
    return [NodeView(f"n{i}", load, p, h) for i, (load, p, h) in enumerate(zip(loads, prefixes, hinted))]


def test_round_robin_and_least_load() -> None:
    rr = RoundRobin()
    assert [rr.choose(_views([0, 0, 0], [0, 0, 0]), 4)[0] for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoad()
    assert ll.choose(_views([3, 1, 2], [0, 0, 0]), 4)[0] == 1
    # ties rotate so equal nodes share work
    assert {ll.choose(_views([0, 0, 0], [0, 0, 0]), 4)[0] for _ in range(3)} == {0, 1, 2}


def _eta(pulls: bool = True) -> Eta:
    # 1 s per uncached block of prefill, 0.1 s per block pulled
    return Eta(lambda blocks, cached: float(blocks - cached), (lambda n: 0.1 * n) if pulls else None)


def test_eta_weighs_queued_work_not_request_counts() -> None:
    # node 0 holds the prefix but has 5 s of recomputes queued; node 1 has more requests, all cheap
    views = [NodeView("a", load=2, prefix=10, work_s=5.0), NodeView("b", load=6, work_s=0.5), NodeView("c", load=6)]
    i, reason = _eta().choose(views, 10)
    assert (i, reason) == (2, "eta")  # pull 10 blocks (1 s) beats 5 s of queued work; c is idle
    assert CacheAware(abs_threshold=2).choose(views, 10)[0] == 0  # by request count the holder looks best
    # without pulls (policy none) a non-holder recomputes all 10 blocks: the holder's queue is cheaper
    assert _eta(pulls=False).choose(views, 10)[0] == 0


def test_eta_credits_hints_skips_dead_stores_and_ties_on_load() -> None:
    views = [NodeView("a", load=1, hinted=8), NodeView("b", load=0), NodeView("c", load=0, prefix=8, down=True)]
    assert _eta().choose(views, 8)[0] == 0  # the pending copy counts as held; c's store is down
    even = [NodeView("a", load=3), NodeView("b", load=1), NodeView("c", load=2)]
    assert _eta().choose(even, 4)[0] == 1  # nothing held, no work: the least-loaded
    with pytest.raises(ValueError, match="prefill_s"):
        make_router("eta")
    views = views_from_lookup(["a", "b"], [0, 0], [], work=[1.5, 0.0])
    assert [v.work_s for v in views] == [1.5, 0.0]


def test_routers_skip_a_node_whose_store_is_down() -> None:
    def down(views, *idx):  # type: ignore[no-untyped-def]
        for i in idx:
            views[i].down = True
        return views

    assert LeastLoad().choose(down(_views([3, 0, 2], [0, 0, 0]), 1), 4)[0] == 2
    rr = RoundRobin()
    assert {rr.choose(down(_views([0, 0, 0], [0, 0, 0]), 0), 4)[0] for _ in range(4)} == {1, 2}
    ca = CacheAware(abs_threshold=32)
    assert ca.choose(down(_views([0, 5, 9], [8, 4, 0]), 0), 10) == (1, "affinity")   # next-longest prefix
    assert ca.choose(down(_views([0, 20, 40], [0, 0, 8]), 0), 10)[1] == "affinity"    # a dead idle node is no imbalance
    assert LeastLoad().choose(down(_views([3, 1], [0, 0]), 0, 1), 4)[0] == 1           # all down: as if none were


def test_cache_aware_prefix_affinity_until_imbalanced() -> None:
    r = CacheAware(abs_threshold=32, rel_threshold=1.5)
    # the node with the longest prefix wins even when busier (balanced cluster)
    assert r.choose(_views([10, 0, 0], [8, 2, 0]), 10) == (0, "affinity")
    # max - min = 40 > 32 and 40 > 1.5 x 0: imbalanced -> least load
    assert r.choose(_views([40, 0, 5], [8, 0, 0]), 10) == (1, "imbalance")
    # difference above abs but max not above rel x min: still affinity
    assert r.choose(_views([100, 70, 80], [8, 0, 0]), 10)[1] == "affinity"
    # difference below abs: affinity
    assert r.choose(_views([30, 0, 0], [8, 0, 0]), 10)[1] == "affinity"
    # no node holds anything: least load
    assert r.choose(_views([2, 1, 3], [0, 0, 0]), 10) == (1, "no-match")
    # equal prefixes: the less loaded holder
    assert r.choose(_views([5, 2, 0], [8, 8, 0]), 10) == (1, "affinity")
    # thresholds are configurable
    assert CacheAware(abs_threshold=4, rel_threshold=1.5).choose(_views([6, 1, 1], [8, 0, 0]), 10)[1] == "imbalance"
    # match threshold: a short match goes to least load
    assert CacheAware(match_threshold=0.5).choose(_views([3, 0, 1], [1, 0, 0]), 10) == (1, "no-match")


def test_cache_aware_uses_placement_hints_to_spread_a_burst() -> None:
    # n0 computed the prefix; n1 and n2 have a pending / live speculative copy of (most of) it
    views = _views([6, 0, 1, 0], [17, 1, 17, 1], [0, 16, 17, 0])
    assert CacheAware().choose(views, 19) == (1, "affinity-hint")        # 16/17 >= hint_cover: credited
    assert CacheAware(use_hints=False).choose(views, 19) == (2, "affinity")  # live replica is real; pending is not
    assert CacheAware(hint_cover=0.99).choose(views, 19)[0] == 2         # 16/17 not enough: real holders only
    # from the Lookup answer: pending -> hinted only; a live speculative replica -> held and hinted
    entries = [SimpleNamespace(node_id="n0", prefix_length=17, pending=False, expires_in_seconds=0.0),
               SimpleNamespace(node_id="n1", prefix_length=16, pending=True, expires_in_seconds=60.0),
               SimpleNamespace(node_id="n2", prefix_length=17, pending=False, expires_in_seconds=42.0),
               SimpleNamespace(node_id="zz", prefix_length=3, pending=False, expires_in_seconds=0.0)]
    v = views_from_lookup(["n0", "n1", "n2", "n3"], [6, 0, 1, 0], entries)
    assert [(x.prefix, x.hinted) for x in v] == [(17, 0), (0, 16), (17, 17), (0, 0)]
    assert CacheAware().choose(v, 19) == (1, "affinity-hint")
    # an in-flight prefill claim is no holding: its followers are not piled onto the claimant
    claim = [SimpleNamespace(node_id="n3", prefix_length=17, pending=True, computing=True, expires_in_seconds=0.0)]
    v = views_from_lookup(["n0", "n1", "n2", "n3"], [6, 0, 1, 0], claim)
    assert [(x.prefix, x.hinted) for x in v] == [(0, 0)] * 4
    assert CacheAware().choose(v, 19)[1] == "no-match"


def test_cache_aware_follows_a_hint_only_where_its_pull_beats_the_holders_queue() -> None:
    # 0.1 s per block pulled; n0 holds 16 blocks, n1 has a copy of 8 of them in flight, n2 holds nothing
    ca = CacheAware(pull_s=lambda n: 0.1 * n)

    def views(holder_work: float) -> list[NodeView]:
        return [NodeView("n0", load=1, prefix=16, work_s=holder_work), NodeView("n1", load=0, hinted=8),
                NodeView("n2", load=0)]

    # the copy in flight counts as not held: 16 blocks pulled (1.6 s) do not end before 0.5 s of queue
    assert ca.choose(views(0.5), 16) == (0, "affinity")
    # behind 2 s of the holder's queued prefill the pull pays: the burst spreads to the hinted node
    assert ca.choose(views(2.0), 16) == (1, "affinity-hint")
    # without a link estimate the hint is credited as before (the copy covers half the prefix)
    assert CacheAware().choose(views(0.5), 16) == (1, "affinity-hint")
    # a live speculative replica is a real holding: nothing to pull, ties on load
    live = [NodeView("n0", load=1, prefix=16, work_s=0.5), NodeView("n1", load=0, prefix=16, hinted=16)]
    assert ca.choose(live, 16) == (1, "affinity-hint")


def test_cache_aware_follows_a_hint_where_a_burst_queues_on_the_holder_beyond_its_prefill() -> None:
    # the ramp's moment: n0 holds the 32-block prefix and carries requests waiting for a slot or decoding
    # (its queued prefill is one short suffix); n1 has a live copy of 16 blocks and nothing to do
    ca = CacheAware(pull_s=lambda n: 0.0134 * n)  # 16 blocks pulled: 0.21 s, more than the holder's prefill

    def views(holder_load: float, hinted_load: float = 0, hinted_work: float = 0.0, holder_slots_s: float = 0.0,
              hinted_slots_s: float = 0.0) -> list[NodeView]:
        return [NodeView("n0", load=holder_load, prefix=32, work_s=0.037, queued_s=holder_slots_s),
                NodeView("n1", load=hinted_load, prefix=16, hinted=16, work_s=hinted_work, queued_s=hinted_slots_s)]

    # one request on the holder, no queue: the pull would only delay this one
    assert ca.choose(views(1), 34) == (0, "affinity")
    # two on the holder, more than 1.5 x what the idle node would carry with this one: the hint is followed
    assert ca.choose(views(2), 34) == (1, "affinity-hint")
    assert ca.choose(views(10), 34) == (1, "affinity-hint")
    # the hinted node's own load counts with this request: 3 against 1 + 1 is not enough, 4 is
    assert ca.choose(views(3, hinted_load=1), 34) == (0, "affinity")
    assert ca.choose(views(4, hinted_load=1), 34) == (1, "affinity-hint")
    # a hinted node with more queued than the holder is no way round the holder's queue
    assert ca.choose(views(10, hinted_work=0.5), 34) == (0, "affinity")
    assert ca.choose(views(10, hinted_slots_s=0.5), 34) == (0, "affinity")
    # a holder whose newcomer waits for a slot longer than the pull: followed whatever the loads
    assert ca.choose(views(5, hinted_load=3, holder_slots_s=0.3), 34) == (1, "affinity-hint")
    assert ca.choose(views(5, hinted_load=3, holder_slots_s=0.1), 34) == (0, "affinity")
    # under the imbalance thresholds the least-loaded node wins anyway
    assert CacheAware(abs_threshold=2).choose(views(10) + [NodeView("n2")], 34)[1] == "imbalance"


# ---- oracle --------------------------------------------------------------------

def _burst(prefix_blocks: int, followers: int, gap: float) -> list[Request]:
    prefix = tuple(range(1, prefix_blocks + 1))
    return [Request(0.0, (prefix_blocks + 1) * 512, 16, prefix + (1000,))] + \
        [Request(0.05 + gap * i, (prefix_blocks + 1) * 512, 16, prefix + (2000 + i,)) for i in range(followers)]


def test_oracle_plan_is_never_worse_than_its_candidates() -> None:
    cost = CostModel.preset("llama3-8b")
    reqs = _burst(32, 11, 0.02)  # followers arrive while the 16k-token prefix (0.53 s) is in prefill
    reusable = reusable_blocks(reqs)
    p = plan(reqs, reusable, nodes=4, concurrency=8, cost=cost)
    assert set(p.candidates) == set(RULES)
    assert p.p99 <= min(c["p99_s"] for c in p.candidates.values()) + 1e-4
    # the baseline-like candidate that recomputes (none under least-load) is far worse: every node recomputes
    none = simulate("least-load-recompute", reqs, reusable, 4, 8, cost)
    assert p.p99 < 0.6 * none.p99
    # followers wait for the prefix or get it copied; nobody recomputes it
    assert all(s.depth == 32 for s in p.steps[1:])
    assert p.steps[0].depth == 0 and p.steps[0].ttft == pytest.approx(cost.prefill_s(33 * 512))
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0


def test_oracle_copies_queue_on_the_links() -> None:
    cost = CostModel.preset("llama3-70b-tp8")  # 160 MiB pages: a 64-block copy takes 0.21 s at 50 GB/s
    sim = Sim(nodes=3, concurrency=8, cost=cost)
    reqs = _burst(64, 2, 0.0)
    sim.book(reqs[0], sim.options(reqs[0], 0, 0)[0])
    ready = reqs[0].t + sim.options(reqs[1], 64, 0)[-1].kv_at  # the prefix is on n0 when its prefill ends
    first = [o for o in sim.options(reqs[1], 64, 1) if o.source >= 0][0]
    assert first.source == 0 and first.copy_from == 0 and first.copy_at == pytest.approx(ready)
    sim.book(reqs[1], first)
    second = [o for o in sim.options(reqs[2], 64, 2) if o.source >= 0][0]
    assert second.copy_at == pytest.approx(first.copy_at + cost.link_s(64))  # behind the first copy out of n0
    # a node that got the copy does not copy again
    assert all(o.source < 0 for o in sim.options(reqs[2], 64, 1))


# ---- workloads -------------------------------------------------------------------

def test_synth_generator_and_trace_synth_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.replay.cli import trace_main

    spec = SynthSpec(bursts=3, requests=5, prefix_tokens=1500, window_s=4, decoys=2, background=0.0,
                     duration_s=30, suffix_tokens=600, output_tokens=77, seed=1)
    reqs = synth_requests(spec)
    assert spec.prefix_blocks == 3 and spec.suffix_blocks == 2
    assert len(reqs) == 3 * 5 + 2 * 2
    assert all(r.output_length == 77 and r.input_length == len(r.hash_ids) * 512 for r in reqs)
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    # each burst's requests share block 0 + 3 prefix blocks, then 2 blocks of their own
    by_prefix: dict[tuple[int, ...], int] = {}
    for r in reqs:
        assert len(r.hash_ids) == 1 + 3 + 2
        by_prefix[r.hash_ids[:4]] = by_prefix.get(r.hash_ids[:4], 0) + 1
    assert sorted(by_prefix.values()) == [2, 2, 5, 5, 5]
    out = tmp_path / "synth.jsonl"
    assert trace_main(["synth", "--bursts", "3", "--requests", "5", "--prefix-tokens", "1500", "--window", "4",
                       "--decoys", "2", "--background", "0", "--duration", "30", "--suffix-tokens", "600",
                       "--output-tokens", "77", "--seed", "1", "--out", str(out)]) == 0
    loaded = load_mooncake(out)  # the Mooncake format, read by the project's loader
    assert [r.hash_ids for r in loaded] == [r.hash_ids for r in reqs]
    assert [r.t for r in loaded] == pytest.approx([r.t for r in reqs], abs=1e-3)
    write_mooncake(reqs[:2], tmp_path / "two.jsonl")
    assert len(load_mooncake(tmp_path / "two.jsonl")) == 2


def test_window_and_reusable_blocks() -> None:
    reqs = [Request(1.0, 1024, 5, (1, 2)), Request(2.0, 1536, 5, (1, 2, 3)), Request(3.0, 1024, 5, (1, 9)),
            Request(9.0, 512, 5, (4,))]
    assert reusable_blocks(reqs) == [0, 2, 1, 0]
    win = cut_window(reqs, start_s=1.5, duration_s=2.0)
    assert [r.t for r in win] == [0.5, 1.5] and [r.hash_ids for r in win] == [(1, 2, 3), (1, 9)]
    assert len(cut_window(reqs, max_requests=3)) == 3


# ---- pages and aggregates ---------------------------------------------------------

def test_page_content_is_checkable() -> None:
    words = page_words(np.array([5, 6, 7], dtype=np.uint64))
    pages = make_pages(words, 4096)
    assert pages.shape == (3, 4096) and pages.dtype == np.uint8
    assert bad_pages(pages, words) == 0
    pages[1, 100] ^= 1
    assert bad_pages(pages, words) == 1
    assert bad_pages(pages[:0], words[:0]) == 0


def test_aggregate_counts_and_ratios() -> None:
    recs = [RequestRecord(idx=0, t=0.0, blocks=4, local=2, remote=1, miss=1, queue_s=0.5, fetch_s=0.01,
                          prefill_s=0.2, link_s=0.003, done=True, node="n0", route_reason="affinity"),
            RequestRecord(idx=1, t=1.0, blocks=6, local=0, remote=0, miss=6, prefill_s=0.4, done=True, node="n1"),
            RequestRecord(idx=2, t=2.0, blocks=3, error="Unavailable: x")]
    s = aggregate(recs, {"spec_bytes": 10})
    assert (s["requests"], s["completed"], s["errors"], s["unfinished"]) == (3, 2, 1, 0)
    assert s["blocks"] == 10 and (s["local_blocks"], s["remote_blocks"], s["miss_blocks"]) == (2, 1, 7)
    assert s["local_hit_ratio"] == 0.2 and s["remote_hit_ratio"] == 0.1 and s["miss_ratio"] == 0.7
    assert s["ttft_mean_s"] == pytest.approx((0.5 + 0.01 + 0.2 + 0.4) / 2)
    assert s["spec_bytes"] == 10 and s["requests_per_node"] == {"n0": 1, "n1": 1}
    assert check(s) == ["1 errors, 0 unfinished"]
    text = ('kvstore_replication_bytes_total{kind="speculative"} 4096.0\n'
            'kvstore_replication_bytes_total{kind="replica"} 8192.0\n# HELP x\n')
    assert metric_sum(text, "kvstore_replication_bytes_total", {"kind": "replica"}) == 8192
    ns = SimpleNamespace(speculative_wasted_bytes=4096, speculative_slots=2, speculative_hits=3, remote_hits=1,
                         evictions={"lru": 1}, used_bytes=0)
    c = cluster_summary("predictive", [SimpleNamespace(namespaces=[ns])], text, 4096, 1024)
    assert c["spec_bytes"] == 4096 and c["spec_wasted_bytes"] == 4096 + 2 * 4096
    assert c["spec_bytes_unscaled"] == 4096 * 1024
    full = cluster_summary("full", [SimpleNamespace(namespaces=[ns])], text, 4096, 1024, placed_used_pages=1)
    assert full["spec_bytes"] == 8192 and full["spec_wasted_bytes"] == 4096


def test_repeat_bursts_count_as_found_only_where_every_serving_node_had_the_prefix_in_its_pool() -> None:
    from kvstore.replay.metrics import bursts_in_pool

    def burst(t0: float, head: int, got: list[tuple[str, int, int]]) -> list[RequestRecord]:
        # (node, local, disk) per request; 8 reusable blocks each (the first burst's own were computed)
        return [RequestRecord(idx=0, t=t0 + i, node=n, blocks=9, reusable=8, local=loc, disk=d, head=head, done=True)
                for i, (n, loc, d) in enumerate(got)]

    hot = [("n0", 8, 0), ("n1", 8, 0), ("n0", 8, 0), ("n1", 8, 0)]
    recs = burst(0, 7, [("n0", 0, 0)] * 4)                            # the first burst: not counted
    recs += burst(600, 7, hot)                                          # found on both nodes
    recs += burst(1200, 7, [("n0", 8, 0), ("n1", 8, 8)] + hot[2:])     # n1's first read it from disk
    recs += burst(1800, 7, [("n0", 8, 0), ("n1", 0, 0)] + hot[2:])     # n1's first pulled or computed it
    recs += burst(2400, 7, hot[:3])                                     # 3 requests: not a burst
    recs += [RequestRecord(idx=0, t=5.0 * i, node="n0", blocks=4, head=100 + i, done=True) for i in range(9)]
    assert bursts_in_pool(recs) == {"bursts_repeat": 3, "bursts_in_pool": 1}
    # n1's second request found it, but a node's first read of the burst is what is judged
    assert bursts_in_pool(recs, gap_s=10_000) == {"bursts_repeat": 0, "bursts_in_pool": 0}  # one long burst


# ---- sweeps, best baseline, the oracle's plan -------------------------------------------

def test_router_configs_best_baseline_and_verdicts() -> None:
    from kvstore.replay.sweep import compare, router_configs, verdict

    assert [c[0] for c in router_configs(["least-load", "cache-aware"], [8, 32])] == \
        ["least-load", "cache-aware@8", "cache-aware@32"]

    def runs(*p99s: float) -> list[dict[str, float]]:
        return [{"ttft_p50_s": x / 2, "ttft_p95_s": x, "ttft_p99_s": x, "ttft_mean_s": x / 2} for x in p99s]

    c = compare({"none|least-load": runs(3, 3.2), "reactive|least-load": runs(1.0, 1.1),
                 "reactive|cache-aware@32": runs(8, 8.5), "predictive|cache-aware@32": runs(0.9, 1.2),
                 "oracle|plan": runs(0.5, 0.6)})
    assert c["best_baseline"]["config"] == "reactive|least-load"  # not the weak cache-aware@32
    r = c["vs_best"]["predictive|cache-aware@32"]["ttft_p99_s"]
    assert r["min"] == pytest.approx(0.9) and r["max"] == pytest.approx(12 / 11) and r["verdict"] == "within spread"
    assert c["vs_best"]["oracle|plan"]["ttft_p99_s"]["verdict"] == "lower"
    assert all(v["at_or_below"] for v in c["oracle_bound"].values())
    assert verdict({"n": 1, "min": 0.5, "max": 0.5, "median": 0.5}) == "one seed"


def test_oracle_plan_spreads_a_burst_once_its_prefix_is_copyable() -> None:
    from kvstore.replay.oracle import plan

    cost = CostModel.preset("llama3-8b")
    prefix = tuple(range(1, 33))  # 16k tokens: 0.53 s of prefill, 27 ms to copy at 50 GB/s
    reqs = [Request(0.0, 33 * 512, 16, prefix + (100,))] + \
        [Request(1.0 + 0.01 * i, 33 * 512, 16, prefix + (200 + i,)) for i in range(8)]
    routes = [s.node for s in plan(reqs, reusable_blocks(reqs), nodes=4, concurrency=1, cost=cost).steps]
    assert len(set(routes[1:])) == 4  # the followers use every node: the prefix is copied, not queued for


def test_workload_shapes() -> None:
    from kvstore.replay.workload import shape_requests

    fan = shape_requests("agent-fanout", seed=1, bursts=2, duration_s=30.0, background=0.0)
    assert 64 <= len(fan) <= 256 and all(16384 // 512 <= len(r.hash_ids) - 1 <= 65536 // 512 for r in fan)
    rec = shape_requests("recurring", seed=0, prefixes=1, duration_s=400.0, background=0.0)
    starts = sorted({round(r.t // 30) for r in rec})
    assert len(starts) >= 3 and len({r.hash_ids[0] for r in rec}) == 1
    ramp = shape_requests("ramp", seed=0, duration_s=120.0, background=0.0)
    first, last = sum(r.t < 40 for r in ramp), sum(r.t >= 80 for r in ramp)
    assert last > 2 * first
    assert shape_requests("agent-fanout", seed=3) == shape_requests("agent-fanout", seed=3)
    # recurring with quiet periods: bursts quiet_s apart over a heavy unique background
    quiet = shape_requests("recurring", seed=0, prefixes=1, quiet_s=300.0)
    (prefix, _), = Counter(r.hash_ids[0] for r in quiet).most_common(1)
    shared = [r.t for r in quiet if r.hash_ids[0] == prefix]
    gaps = [b - a for a, b in zip(shared, shared[1:]) if b - a > 60.0]
    assert len(gaps) >= 3 and all(300.0 - 5.0 - 4.0 <= g <= 1.2 * 300.0 + 5.0 + 4.0 for g in gaps)
    background = [r for r in quiet if r.t < 300.0 and r.hash_ids[0] != prefix]
    assert sum(len(r.hash_ids) for r in background) > 300 * 32  # quiet, but not idle: other prompts fill pools
    # tenants: Zipf popularity over many system prompts, and a rate that rises and falls with the period
    ten = shape_requests("tenants", seed=0, count=200, duration_s=1200.0, rate=4.0)
    by_prompt = Counter(r.hash_ids[0] for r in ten)
    top = by_prompt.most_common()
    assert len(by_prompt) > 50 and top[0][1] > 5 * top[len(top) // 2][1]
    peak = sum(1 for r in ten if (r.t % 600.0) < 300.0)  # the sine's positive half-periods
    assert peak > 2 * (len(ten) - peak)
    assert ten == shape_requests("tenants", seed=0, count=200, duration_s=1200.0, rate=4.0)


# ---- failover -------------------------------------------------------------------------

def test_kill_specs_window_and_the_oracle_knows() -> None:
    from kvstore.replay.config import parse_kills
    from kvstore.replay.metrics import after_kill

    assert parse_kills(["n3@20", "1@5.5"], nodes=4) == [(3, 20.0), (1, 5.5)]
    for bad in ("n4@1", "n1", "x@1", "n1@-2"):
        with pytest.raises(ValueError):
            parse_kills([bad], nodes=4)
    assert parse_kills(["n3@60"], nodes=4, flag="--join") == [(3, 60.0)]
    for bad_joins in (["n0@5"], ["n2@5", "n2@9"]):  # n0 starts the cluster; a node joins once
        with pytest.raises(ValueError, match="--join"):
            parse_kills(bad_joins, nodes=4, flag="--join")
    recs = [RequestRecord(idx=i, t=t, blocks=2, miss=2, queue_s=q, done=True, node=n, kv_error=e)
            for i, (t, q, n, e) in enumerate([(1.0, 9.0, "n0", ""), (5.0, 1.0, "n1", "Unavailable"),
                                              (20.0, 2.0, "n0", ""), (40.0, 9.0, "n0", "")])]
    f = after_kill(recs, "n1", 4.0)
    assert (f["requests"], f["kv_errors"], f["on_killed_node"]) == (2, 1, 1)
    assert f["ttft_p50_s"] == pytest.approx(1.5) and f["miss_ratio"] == 1.0
    # the oracle knows the kill: nothing is copied from or to the dead node, and it recomputes there
    cost = CostModel.preset("llama3-8b")
    reqs = _burst(32, 3, 0.02)
    p = plan(reqs, reusable_blocks(reqs), nodes=2, concurrency=8, cost=cost, down={1: 0.0})
    assert all(s.source != 1 for s in p.steps)
    assert all(s.depth == 0 for s in p.steps if s.node == 1)


def test_post_kill_ratios_pair_seeds_against_the_best_post_kill_baseline() -> None:
    from kvstore.replay.report import failover_ratio_lines

    def runs(*p99: float) -> list[dict]:  # type: ignore[type-arg]
        return [{"failover": [{"ttft_p99_s": v}]} for v in p99]

    w = {"runs": {"reactive+claims|least-load": runs(8.0, 10.0, 4.0),
                  "reactive+claims|eta": runs(9.0, 9.0, 9.0),     # median 9 > 8: not the best
                  "predictive+claims|eta": runs(2.0, 5.0, 1.0),
                  "oracle|plan": runs(1.0, 1.0, 1.0)}}
    text = failover_ratio_lines(w)
    assert "best post-kill baseline: `reactive+claims|least-load`" in text
    assert "`predictive+claims|eta` / best post-kill baseline, p99 per seed: 0.25x (0.25-0.50)" in text
    assert "`oracle|plan` / best post-kill baseline, p99 per seed: 0.12x (0.10-0.25)" in text
    assert "need a none or reactive" in failover_ratio_lines({"runs": {"oracle|plan": runs(1.0)}})
