"""Burst predictor: features, labels, traces and the cluster simulator (deterministic, small)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.predict.features import FEATURE_NAMES, FeatureStore, feature_names, momentum_prob, need_in_s
from kvstore.predict.labels import EventLog, future_counts, labels_for, make_labels
from kvstore.training.trace import Simulator, simulate
from kvstore.workloads.traces import Request, hash_key, key_hash, load_azure, load_mooncake, synth_fanout
from kvstore.predict.types import Access, Outcome, PredictorConfig
from tests.conftest import TESTS_DIR

SAMPLE = TESTS_DIR / "data" / "mooncake_sample.jsonl"
CFG = PredictorConfig(depths=(1, 2), windows_s=(10.0, 60.0, 300.0), momentum_window_s=60.0, momentum_min=2,
                      fanout_window_s=60.0)
K0, K1, K2 = b"k0", b"k1", b"k2"


def acc(t: float, node: str, keys: tuple[bytes, ...], outcome: Outcome = Outcome.MISS, total: int = 2,
        local: int = -1) -> Access:
    return Access(t=t, namespace="ns", node=node, keys=keys, outcome=outcome, block_tokens=512, page_bytes=100,
                  total_blocks=total, local_blocks=local)


def hand_store() -> tuple[FeatureStore, dict[bytes, set[str]]]:
    """Three requests; a directory stub that learns each node right before observe."""
    held: dict[bytes, set[str]] = {}
    fs = FeatureStore(CFG, lambda ns, key: len(held.get(key, ())))
    for a in (acc(0.0, "a", (K0, K1), Outcome.MISS, 2, 0), acc(10.0, "b", (K0, K1), Outcome.REMOTE, 3, 1),
              acc(10.0, "a", (K0, K2), Outcome.LOCAL, 2, 2)):
        for k in a.keys:
            held.setdefault(k, set()).add(a.node)
        fs.observe(a)
    return fs, held


def rows_by_key(fs: FeatureStore, now: float) -> dict[bytes, dict[str, float]]:
    ids, depths, X = fs.snapshot(now)
    assert X.dtype == np.float32 and X.shape == (len(ids), len(fs.names))
    return {key: dict(zip(fs.names, X[i].tolist())) for i, (_, key) in enumerate(ids)}


def test_feature_names_default_and_windows() -> None:
    assert FEATURE_NAMES == feature_names(PredictorConfig())
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    names = feature_names(replace(CFG, windows_s=(5.0, 30.0)))
    assert "cnt_5s" in names and "rate_30s" in names and "cnt_10s" not in names


def test_hand_stream_exact_features() -> None:
    fs, _ = hand_store()
    r = rows_by_key(fs, 20.0)
    e1, e2 = math.exp(-1.0), math.exp(-2.0)
    k0, k1, k2 = r[K0], r[K1], r[K2]
    # the shared block: seen at 0, 10, 10 on nodes a, b, a
    assert k0["depth"] == 1 and k0["count"] == 3 and k0["seen_60s"] == 3
    assert k0["cnt_10s"] == pytest.approx(e2 + 2 * e1, rel=1e-6)
    assert k0["cnt_60s"] == pytest.approx(math.exp(-20 / 60) + 2 * math.exp(-10 / 60), rel=1e-6)
    assert k0["age_s"] == 20 and k0["since_last_s"] == 10 and k0["since_prev_s"] == 10
    assert k0["gap_mean_s"] == 5 and k0["gap_std_s"] == pytest.approx(5) and k0["gap_nz_mean_s"] == 10
    assert k0["last_gap_s"] == 0 and k0["overdue"] == 1
    assert k0["fanout"] == 2 and k0["nodes_ever"] == 2 and k0["holders"] == 2 and k0["lacking_nodes"] == 0
    assert k0["last_outcome"] == Outcome.LOCAL and k0["last_lacked"] == 0
    assert math.isnan(k0["parent_count"]) and k0["children_active"] == 2
    assert k0["momentum"] == pytest.approx(3 + 0.5 * math.exp(-10 / 60), rel=1e-6)
    # depth 2, first chain: seen at 0 (a) and 10 (b, which held 1 block: lacked it)
    assert k1["depth"] == 2 and k1["count"] == 2 and k1["since_prev_s"] == 20
    assert k1["gap_mean_s"] == 10 and k1["gap_std_s"] == 0 and k1["last_gap_s"] == 10
    assert k1["prefix_tokens"] == 1024 and k1["prefix_bytes"] == 200
    assert k1["req_blocks"] == 3 and k1["depth_frac"] == pytest.approx(2 / 3)
    assert k1["last_outcome"] == Outcome.REMOTE and k1["last_lacked"] == 1 and k1["holders"] == 2
    assert k1["parent_count"] == 3 and k1["share_of_parent"] == pytest.approx(2 / 3)
    # depth 2, second chain: seen once
    assert k2["count"] == 1 and math.isnan(k2["since_prev_s"]) and math.isnan(k2["gap_mean_s"])
    assert k2["fanout"] == 1 and k2["holders"] == 1 and k2["lacking_nodes"] == 1 and k2["last_lacked"] == 0
    # cluster-wide
    assert k0["rate_10s"] == pytest.approx((e2 + 2 * e1) / 10, rel=1e-5)
    assert k0["rate_trend"] == pytest.approx(k0["rate_10s"] / k0["rate_300s"], rel=1e-5)
    assert k0["active_keys_depth"] == 1 and k1["active_keys_depth"] == 2 and k0["active_keys"] == 3
    assert fs.chain(("ns", K1)) == (K0, K1) and fs.chain(("ns", K0)) == (K0,) and fs.chain(("ns", b"?")) == ()


def test_fanout_window_rolls_over() -> None:
    fs, _ = hand_store()
    fs.observe(acc(130.0, "c", (K0, K1)))           # epoch 2: epochs 0 and 1 are forgotten
    r = rows_by_key(fs, 130.0)
    assert r[K1]["fanout"] == 1 and r[K1]["nodes_ever"] == 3
    assert rows_by_key(fs, 185.0)[K1]["fanout"] == 1  # epoch 3: epoch 2 is the previous one
    assert rows_by_key(fs, 245.0)[K1]["fanout"] == 0  # epoch 4


def test_active_filter_momentum_and_need_in() -> None:
    fs, _ = hand_store()
    ids, _, X = fs.snapshot(65.0, active_within_s=60.0)
    assert sorted(k for _, k in ids) == [K0, K1, K2]
    assert fs.snapshot(75.0, active_within_s=60.0)[0] == []
    ids, depths, score = fs.momentum_scores(20.0)
    s = dict(zip([k for _, k in ids], score.tolist()))
    assert s[K1] == pytest.approx(2 + 0.5 * math.exp(-10 / 60))
    p = momentum_prob(np.array([0.0, 1.49, 1.5, 2.0, 10.0]), 2)
    assert (p[:3] < 0.5).all() and (p[3:] >= 0.5).all() and np.all(np.diff(p) > 0)
    ids, _, X = fs.snapshot(20.0)
    need = dict(zip([k for _, k in ids], need_in_s(X, CFG, fs.names).tolist()))
    assert need[K2] == CFG.horizon_s                 # one sighting: no gap known
    assert need[K0] == pytest.approx(2.5)            # overdue by 0 s: a quarter of the 10 s mean gap


def sample_accesses() -> list[Access]:
    return simulate(load_mooncake(SAMPLE, limit=400), nodes=3, router="random", depths=(1, 2, 4, 8))


def assert_same_features(a: FeatureStore, b: FeatureStore, now: float) -> None:
    ia, da, Xa = a.snapshot(now)
    ib, db, Xb = b.snapshot(now)
    assert ia == ib and np.array_equal(da, db)
    np.testing.assert_allclose(Xa, Xb, rtol=1e-5, equal_nan=True)


def test_batched_fold_equals_one_by_one() -> None:
    accesses = sample_accesses()
    a, b = FeatureStore(PredictorConfig()), FeatureStore(PredictorConfig())
    for x in accesses:
        a.observe(x)
        b.observe(x)
        b.snapshot(x.t)                              # forces a fold per request
    assert_same_features(a, b, accesses[-1].t + 1.0)


def test_folding_in_batches_is_folding_at_once() -> None:
    """The coordinator folds the queued requests 512 at a time before a snapshot, the loop given back
    between batches: the features are those of one fold."""
    accesses = sample_accesses()
    a, b = FeatureStore(PredictorConfig()), FeatureStore(PredictorConfig())
    for x in accesses:
        a.observe(x)
        b.observe(x)
    assert [b.fold(37) for _ in range(4)] == [len(accesses) - 37 * i for i in range(1, 5)]
    while b.fold(37):
        pass
    assert_same_features(a, b, accesses[-1].t + 1.0)


def test_rows_taken_are_copies_the_store_moving_on_leaves_alone() -> None:
    """The coordinator computes a snapshot's X in a worker thread while the loop folds more requests into
    the store: X comes from what ``take`` copied, as it was then, not from the rows as they are now."""
    accesses = sample_accesses()
    fs = FeatureStore(replace(PredictorConfig(), max_prefixes=300))  # the rest evicts and reuses rows
    half = len(accesses) // 2
    for x in accesses[:half]:
        fs.observe(x)
    now = accesses[half - 1].t + 1.0
    ids, depths, X = fs.snapshot(now)
    taken = fs.take(now)
    for x in accesses[half:]:
        fs.observe(x)
    assert len(fs) <= 300 + 300 // 32 and fs.dropped_full > 0  # folded in: rows changed, some reused
    assert taken.ids() == ids and np.array_equal(taken.depth, depths)
    np.testing.assert_array_equal(taken.features(), X)


def test_memory_is_bounded() -> None:
    cfg = PredictorConfig(depths=(1,), max_prefixes=500, idle_drop_s=100.0)
    fs = FeatureStore(cfg)
    for i in range(5000):
        fs.observe(acc(i * 0.01, "a", (i.to_bytes(8, "little"),)))
        if i % 700 == 0:
            assert len(fs) <= 500
    assert len(fs) <= 500 and fs.dropped_full >= 4500
    ids, _, _ = fs.snapshot(50.0)
    keys = {int.from_bytes(k, "little") for _, k in ids}
    assert 4999 in keys and 0 not in keys            # the stalest went first
    assert fs.nbytes < 2_000_000
    assert fs.snapshot(200.0)[0] == [] and len(fs) == 0 and fs.dropped_idle > 0  # idle rows dropped


def test_labels_hand_computed() -> None:
    cfg = PredictorConfig(depths=(1,), horizon_s=10.0, min_future=1)
    p = (b"p",)
    stream = [acc(0.0, "a", p, local=0), acc(5.0, "a", p, local=1), acc(10.0, "b", p, local=0),
              acc(10.5, "c", p, local=0), acc(11.0, "c", (b"q",), outcome=Outcome.LOCAL)]
    ids = [("ns", b"p"), ("ns", b"p"), ("ns", b"p"), ("ns", b"zz"), ("ns", b"q")]
    t0 = np.array([0.0, 10.0, 10.5, 0.0, 0.0])
    y_reuse, y_remote = labels_for(stream, t0, ids, cfg)
    assert y_reuse.tolist() == [1, 1, 0, 0, 0] and y_remote.tolist() == [1, 1, 0, 0, 0]
    # (0, 10]: the request at 5 was local, the one at 10 lacked it: 2 requests, 1 lacking
    y_reuse, y_remote = labels_for(stream, t0, ids, replace(cfg, min_future=2))
    assert y_reuse.tolist() == [1, 0, 0, 0, 0] and y_remote.tolist() == [0, 0, 0, 0, 0]
    # without local_blocks the outcome decides; q was LOCAL, so it never lacked
    y_reuse, y_remote = labels_for(stream, np.array([10.5]), [("ns", b"q")], cfg)
    assert y_reuse.tolist() == [1] and y_remote.tolist() == [0]
    log = EventLog((1,)).extend(stream)
    cnt, lacked = future_counts(np.array([0.0]), log.uids([("ns", b"p")]), *log.arrays(), 10.0)
    assert cnt.tolist() == [2] and lacked.tolist() == [1]


def test_event_log_prune_keeps_labels() -> None:
    cfg = PredictorConfig(depths=(1,), horizon_s=10.0)
    log = EventLog((1,))
    for i in range(20):
        log.append(acc(float(i), "a", (bytes([i % 3]),), local=0))
    pending = log.uids([("ns", bytes([1])), ("ns", b"new")], create=True)
    before = make_labels(np.array([12.0, 12.0]), pending, log, cfg)
    remap = log.prune(12.0, pending)
    after = make_labels(np.array([12.0, 12.0]), remap[pending], log, cfg)
    assert [x.tolist() for x in before] == [x.tolist() for x in after] == [[1, 0], [1, 0]]
    assert len(log) == 8 and (remap >= 0).sum() == 4


def test_simulator_holders_lru_and_outcomes() -> None:
    assert hash_key(258) == b"\x02\x01" + b"\x00" * 6 and key_hash(hash_key(123456789)) == 123456789
    sim = Simulator(nodes=1, router="round_robin", capacity_blocks=3, depths=(1, 2, 4))
    a = sim.step(Request(0.0, 1536, 10, (0, 1, 2)))
    assert a.outcome == Outcome.MISS and a.local_blocks == 0 and a.keys == (hash_key(0), hash_key(1), hash_key(2))
    sim.step(Request(1.0, 1024, 10, (0, 3)))      # over capacity: evicts the deep end of the first chain
    assert sim.local_blocks(0, (0, 1, 2)) == 2
    assert sim.holders_count("mooncake", hash_key(2)) == 0 and sim.holders_count("mooncake", hash_key(0)) == 1
    assert sim.holders_count("other", hash_key(0)) == 0
    two = Simulator(nodes=2, router="round_robin", depths=(1, 2))
    got = [two.step(Request(float(t), 1024, 1, (0, 1))) for t in range(3)]
    assert [(x.node, x.outcome, x.local_blocks) for x in got] == [
        ("n0", Outcome.MISS, 0), ("n1", Outcome.REMOTE, 0), ("n0", Outcome.LOCAL, 2)]
    assert got[0].total_blocks == 2 and got[0].page_bytes > 0 and got[0].block_tokens == 512
    ca = simulate([Request(float(t), 1024, 1, (0, 1 + t % 2)) for t in range(40)], nodes=4, router="cache_aware")
    assert {x.node for x in ca} == {"n0", "n1", "n2", "n3"}  # balance keeps every node in use
    with pytest.raises(ValueError):
        Simulator(router="nope")


def test_trace_loaders(tmp_path: Path) -> None:
    reqs = load_mooncake(SAMPLE, limit=50)
    assert len(reqs) == 50 and reqs[0].t == 0.0 and reqs[0].hash_ids[0] == 0
    assert all(b.t >= a.t for a, b in zip(reqs, reqs[1:]))
    csv = tmp_path / "az.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
                   "2023-11-16 18:17:04.0319600,300,8\n2023-11-16 18:17:05.0000000,1100,27\n")
    az = load_azure(csv, pool=10)
    assert [round(r.t, 3) for r in az] == [0.0, 0.052, 1.02]
    assert [len(r.hash_ids) for r in az] == [10, 1, 3] and all(r.hash_ids[0] == 0 for r in az)
    s1, s2 = synth_fanout(bursts=3, reqs_per_burst=5, decoys=2, background_rate=0.1, duration_s=100, seed=1), \
        synth_fanout(bursts=3, reqs_per_burst=5, decoys=2, background_rate=0.1, duration_s=100, seed=1)
    assert s1 == s2 and all(b.t >= a.t for a, b in zip(s1, s1[1:]))
    counts = sorted(Counter(r.hash_ids[:2] for r in s1).values())
    assert counts[-5:] == [2, 2, 5, 5, 5] and set(counts[:-5]) <= {1}  # bursts, decoys, background
