"""The simulated replay (``kvctl replay --sim``): the kernel's physics and the cluster's mechanics without
sockets. Its calibration against the real replay on the CI smoke workload:
tests/integration/test_replay_end_to_end.py."""

from __future__ import annotations

import json
import math

import pytest

from kvstore.replay.sim_cluster import PRIMARY, ClusterParams, SimCluster, SimPool
from kvstore.replay.sim_kernel import Network, Semaphore, Sim
from kvstore.pool.room import PRIOR_READS
from kvstore.tiers.admission import ReadSinceStored, ReuseAdmission

GB = 1e9


def _cluster(nodes: int = 3, rate: float = 1 * GB, policy: str = "reactive") -> SimCluster:
    p = ClusterParams(nodes=nodes, namespace="m", page_bytes=10**8, scaled_page_bytes=4096,
                      capacity_bytes=4096 * 1000, policy=policy, speedup=1.0, heartbeat_s=0.1,
                      heartbeat_timeout_s=1.0, fetch_timeout_s=100.0, link_rate=rate, link_latency=0.0)
    c = SimCluster(Sim(), p)
    c.start()
    return c


# ---- the kernel ---------------------------------------------------------------------------

def test_one_transfer_takes_bytes_over_rate_plus_latencies() -> None:
    sim = Sim()
    net = Network(sim, 2, rate=12.5 * GB, latency=10e-6)
    ends: list[float] = []
    net.transfer(0, 1, 1 << 30).then(lambda _: ends.append(sim.now))
    sim.run()
    assert ends[0] == pytest.approx((1 << 30) / 12.5e9 + 20e-6, rel=1e-9)  # 86 ms, as the shaper's test


def test_two_pulls_from_one_holder_take_twice_one() -> None:
    sim = Sim()
    net = Network(sim, 3, rate=1 * GB)
    ends: list[float] = []
    for dst in (1, 2):
        net.transfer(0, dst, 1e9).then(lambda _: ends.append(sim.now))
    sim.run()
    assert ends == pytest.approx([2.0, 2.0])  # the holder's egress is shared fairly


def test_a_receivers_ingress_is_shared_and_a_short_flow_is_not_stuck_behind_a_long_one() -> None:
    sim = Sim()
    net = Network(sim, 3, rate=1 * GB)
    ends: dict[str, float] = {}
    net.transfer(0, 2, 3e9).then(lambda _: ends.setdefault("long", sim.now))
    net.transfer(1, 2, 1e9).then(lambda _: ends.setdefault("short", sim.now))
    sim.run()
    assert ends["short"] == pytest.approx(2.0)   # half the ingress until it is through
    assert ends["long"] == pytest.approx(4.0)    # then all of it: 1 GB by t=2, 2 GB more by t=4


def test_semaphore_is_fifo() -> None:
    sim = Sim()
    lock = Semaphore(sim, 1)
    order: list[int] = []

    def user(i: int):  # type: ignore[no-untyped-def]
        yield lock.acquire()
        order.append(i)
        yield sim.timeout(1.0)
        lock.release()

    for i in range(4):
        sim.process(user(i))
    sim.run()
    assert order == [0, 1, 2, 3] and sim.now == pytest.approx(4.0)


# ---- the cluster ----------------------------------------------------------------------------

def test_single_flight_two_readers_move_the_bytes_once() -> None:
    c = _cluster()
    keys = [bytes([i]) * 8 for i in range(10)]
    c.pools[0].store(keys, PRIMARY)
    c.sim.run(until=0.2)  # a heartbeat: the directory knows n0 holds them
    assert c.directory.holders("m", keys[0]) == {"n0"}
    ends: list[float] = []
    t0 = c.sim.now
    for _ in range(2):
        c.fetch_missing(1, keys).then(lambda _: ends.append(c.sim.now - t0))
    c.sim.run(until=t0 + 10)
    assert c.net.bytes_in[1] == 10 * 10**8          # once, not twice
    assert ends == pytest.approx([1.0, 1.0])         # the second reader waited on the first pull
    assert all(k in c.pools[1] for k in keys)


def test_none_never_pulls_and_the_directory_lags_a_heartbeat() -> None:
    c = _cluster(policy="none")
    keys = [b"a" * 8, b"b" * 8]
    c.pools[0].store(keys, PRIMARY)
    assert c.lookup(1, keys)[1] == []               # not reported yet
    c.sim.run(until=0.2)
    local, nodes, _ = c.lookup(1, keys)
    assert local == 0 and [(n.node_id, n.prefix_length) for n in nodes] == [("n0", 2)]
    c.fetch_missing(1, keys)
    c.sim.run(until=1.0)
    assert c.net.bytes_in[1] == 0 and keys[0] not in c.pools[1]


def test_pool_evicts_lru_first_keeps_a_forecast_copy_and_a_read_promotes() -> None:
    pool = SimPool(3)
    pool.store([b"p1", b"p2"], PRIMARY)
    pool.store([b"s1"], 3, expires_at=10.0)
    pool.store([b"p3"], PRIMARY)                     # full: the least recently used plain page goes, not the copy
    assert b"s1" in pool and b"p1" not in pool and pool.spec_wasted_pages == 0
    pool.read([b"p2"])
    pool.store([b"p4"], PRIMARY)                     # then the least recently used: p3
    assert b"p3" not in pool and b"p2" in pool and b"s1" in pool
    pool.read([b"s1"])
    assert pool.spec_hits == 1 and b"s1" in pool.lru
    pool.store([b"s2"], 3, expires_at=10.0)
    pool.store([b"p5", b"p6", b"p7"], PRIMARY)       # plain pages evict each other; the copy stays
    assert b"s2" in pool.spec and pool.spec_wasted_pages == 0
    pool.store([b"s3", b"s4", b"s5"], 3, expires_at=10.0)  # nothing plain left: the oldest copy goes
    assert b"s2" not in pool and pool.spec_wasted_pages == 1


def test_a_heartbeat_reports_what_a_forecast_copy_may_push_out_and_its_price() -> None:
    c = _cluster()
    c.pools[0].store([b"a", b"b", b"c"], PRIMARY)
    c.pools[0].store([b"s"], 3, expires_at=1e9)
    c.report(0)
    info = c.membership.reported["n0"]
    assert (info.cold_bytes, info.speculative_bytes) == (3 * 4096, 4096) and info.cold_reads == PRIOR_READS
    c.pools[0].admission = ReuseAdmission(1e6, 4096)  # a learned estimate prices them instead
    c.pools[0].admission.evicted[(0, PRIMARY)] = 8
    c.report(0)
    assert c.membership.reported["n0"].cold_reads == pytest.approx(0.1)


def test_a_pool_with_a_disk_below_demotes_once_and_reads_back_up() -> None:
    """--tiers preset in the simulator: what the pool evicts goes down (written once: a page read back up
    keeps its copy below), still held and reported as below; the disk's own LRU drops pages for good;
    a speculative copy whose forecast ended sinks onto it."""
    pool = SimPool(2, disk_pages=3)
    pool.store([b"a", b"b"], PRIMARY)
    pool.store([b"c"], PRIMARY)                       # a goes down
    assert b"a" in pool and not pool.in_pool(b"a") and pool.disk_writes == 1
    assert pool.prefix([b"a", b"b", b"c"]) == 3 and pool.pool_prefix([b"b", b"c", b"a"]) == 2
    assert pool.below([b"a", b"b"]) == 1
    _, batches = pool.outbox.take_full({pool.ns: pool.snapshot()}, 0.0)
    assert list(batches[0].below) == [b"a"]           # the directory hears it is below the pool
    pool.read([b"a"])                                 # up again; b goes down
    assert pool.in_pool(b"a") and pool.disk_reads == 1 and not pool.in_pool(b"b") and pool.disk_writes == 2
    pool.store([b"d"], PRIMARY)                       # c goes down; a's copy below is still there
    pool.store([b"e"], PRIMARY)                       # a goes down again: no second write
    assert pool.disk_writes == 3 and set(pool.disk) == {b"a", b"b", b"c"}
    pool.store([b"f"], PRIMARY)                       # d down: the disk's least recently used (b) is gone
    assert b"b" not in pool and pool.disk_evictions == 1
    pool.store([b"s"], 3, expires_at=10.0)            # e goes down
    assert pool.disk_writes == 5
    pool.store([b"g"], PRIMARY)                       # f goes down: the forecast copy stays in the pool
    assert pool.in_pool(b"s") and pool.disk_writes == 6
    assert pool.drop_speculative(now=10.0) == 1       # its forecast ended: it sinks onto the disk, a replica
    assert b"s" in pool and not pool.in_pool(b"s") and pool.disk[b"s"] == 2 and pool.sunk == {b"s"}
    assert pool.spec_wasted_pages == 1 and pool.disk_writes == 7
    # --tier-admit reused: only what a Get read since it was stored goes down
    freq = SimPool(2, disk_pages=3, admission=ReadSinceStored())
    freq.store([b"a", b"b"], PRIMARY)
    freq.read([b"b"])
    freq.store([b"c", b"d"], PRIMARY)                 # a (never read) is declined, b (read) goes down
    assert b"a" not in freq and b"b" in freq.disk and (freq.disk_declined, freq.disk_writes) == (1, 1)
    freq.read([b"b"])                                 # up again, and read: down again at its next eviction
    freq.store([b"e", b"f"], PRIMARY)
    assert b"b" in freq and freq.disk_writes == 1     # (its copy below stayed: no second write)


def test_a_get_with_a_deadline_reads_from_disk_only_what_lands_before_it() -> None:
    """The simulated node keeps the daemon's rule (kvstore.tiers.stack ``_in_time``): of a Get's pages
    below the pool, it reads those whose read, behind the reads its disk was given before, ends within
    the deadline's share; the pool's pages cost nothing."""
    p = ClusterParams(nodes=1, namespace="m", page_bytes=10**8, scaled_page_bytes=4096, capacity_bytes=4096 * 2,
                      policy="reactive", speedup=1.0, heartbeat_s=0.1, heartbeat_timeout_s=1.0,
                      fetch_timeout_s=100.0, link_rate=GB, link_latency=0.0, disk_pages=8,
                      disk_read_rate=10**9, deadline_share=0.5)  # a page read in 0.1 s
    c = SimCluster(Sim(), p)
    pool = c.pools[0]
    pool.store([b"a", b"b", b"c", b"d"], PRIMARY)     # a and b go down; c and d stay in the pool
    keys = [b"c", b"a", b"b", b"d"]
    assert c.in_time(0, keys, 0.5) == 4               # 0.25 s to spend: a and b read in 0.2 s
    assert c.in_time(0, keys, 0.3) == 2               # 0.15 s: a, not b
    c.disk_read(0, 3)                                 # others' reads given before: 0.3 s ahead
    assert c.in_time(0, keys, 0.5) == 1 and c.in_time(0, keys, 0.9) == 2 and c.in_time(0, keys, 1.1) == 4
    assert c.in_time(0, [b"c", b"d"], 0.0) == 2      # all in the pool: nothing to wait for


def test_a_copy_tree_finishes_in_log_waves() -> None:
    """The coordinator's copy tree (the planner's copy_tree edges, carried out by the simulated
    coordinator) over 1 + 7 nodes with fanout 1: 3 waves of one copy time, where a star from the
    primary would queue 7 copies on its egress."""
    from kvstore.placement.planner import copy_tree

    c = _cluster(nodes=8)
    keys = [bytes([i]) * 8 for i in range(10)]       # 1 GB: one copy takes 1 s on a 1 GB/s link
    c.pools[0].store(keys, PRIMARY)
    edges, waves = copy_tree(["n0"], [f"n{i}" for i in range(1, 8)], fanout=1)
    assert waves == 3
    ends: dict[str, float] = {}
    children: dict[str, list[str]] = {}
    for s, d in edges:
        children.setdefault(s, []).append(d)

    def serve(src: str) -> None:  # a holder sends to its children one wave at a time
        todo = list(children.get(src, []))

        def send(_: object = None) -> None:
            if todo:
                dst = todo.pop(0)

                def landed(_: object) -> None:
                    ends[dst] = c.sim.now
                    serve(dst)
                    send()
                c.pull(c.index[dst], c.index[src], keys, PRIMARY).then(landed)
        send()

    serve("n0")
    c.sim.run(until=30)
    assert len(ends) == 7
    assert max(ends.values()) == pytest.approx(3.0, rel=0.01)  # log2(8) waves, not 7 s


# ---- the CLI ------------------------------------------------------------------------------

SMOKE = ["--trace", "synth", "--synth-bursts", "2", "--synth-requests", "8", "--synth-prefix-tokens", "16384",
         "--synth-window", "0.5", "--synth-decoys", "1", "--synth-background", "0.5", "--synth-duration", "10",
         "--synth-output-tokens", "64", "--nodes", "2", "--policies", "none,predictive,oracle",
         "--routers", "cache-aware,least-load", "--speedup", "8", "--byte-scale", "16384", "--network", "shaped",
         "--capacity", "16MiB", "--heartbeat", "0.1", "--heartbeat-timeout", "24", "--planner-tick", "0.1",
         "--oracle-lead", "2", "--drain-timeout", "30", "--no-progress"]  # the real replay's smoke workload

def test_replay_refuses_a_non_positive_setting_before_starting_anything(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvstore.replay.cli import replay_main

    for flag in ("--data-connections", "--concurrency", "--repeats"):
        assert replay_main([*SMOKE, "--sim", flag, "0", "--no-plots", "--out", str(tmp_path / flag)]) == 2
        assert "must be positive" in capsys.readouterr().err
        assert not (tmp_path / flag).exists()


def test_sim_cli_writes_the_same_results_marked_simulated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.replay.cli import replay_main

    out = tmp_path / "sim"
    assert replay_main([*SMOKE, "--sim", "--no-plots", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["simulated"] is True
    (w,) = results["workloads"].values()
    assert set(w["runs"]) == {"none|cache-aware@32", "none|least-load", "predictive|cache-aware@32",
                              "predictive|least-load", "oracle|plan"}
    assert all(v == [] for v in w["problems"].values()), w["problems"]
    for runs in w["runs"].values():
        s = runs[0]
        assert s["simulated"] is True and s["completed"] == s["requests"] == w["workload"]["requests"]
        assert s["local_blocks"] + s["remote_blocks"] + s["miss_blocks"] + s["engine_cached_blocks"] == s["blocks"]
        assert all(math.isfinite(float(s[k])) for k in ("ttft_p50_s", "ttft_p99_s", "spec_bytes", "link_bytes"))
    assert w["oracle_bound"] and all(v["at_or_below"] for v in w["oracle_bound"].values())
    report = (out / "report.md").read_text()
    assert report.startswith("# Trace replay -- SIMULATED") and "not measured" in report


def test_every_run_keeps_its_request_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One file per policy, router and seed: the first router and seed under the plain name."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "rows"
    args = [*SMOKE, "--sim", "--policies", "none", "--routers", "least-load,round-robin", "--repeats", "2"]
    assert replay_main([*args, "--no-plots", "--no-progress", "--out", str(out)]) == 0
    names = sorted(p.name for p in (out / "requests").iterdir())
    wl = names[0].split("-none")[0]
    assert names == sorted(f"{wl}-none{tag}{again}.jsonl" for tag in ("", "-round-robin") for again in ("", "-s1"))
    rows = [json.loads(line) for line in (out / "requests" / f"{wl}-none-round-robin-s1.jsonl").read_text().splitlines()]
    assert rows and all(r["done"] for r in rows)


def test_claims_share_one_prefill_where_waiting_beats_computing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A burst of 128 requests a window on a new 64k-token context, 8 nodes, 70B over 400 Gb/s, simulated:
    with +claims, a follower that arrives late in another node's prefill of the context waits for it and
    its copy (sooner than computing it), so the cluster prefills less than without claims, and every
    wait ends with the prefix landed. Early followers compute (waiting would be slower), and followers
    queued behind their own engine's prefill of it are served by its prefix cache, not by a wait."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "claims"
    args = ["--sim", "--trace", "synth", "--synth-prefix-tokens", "65536", "--synth-requests", "128",
            "--synth-window", "10", "--nodes", "8", "--preset", "llama3-70b-tp8", "--link", "rdma-400g",
            "--policies", "reactive,reactive+claims,predictive+claims", "--routers", "least-load", "--no-plots",
            "--out", str(out)]
    assert replay_main(args) == 0
    (w,) = json.loads((out / "results.json").read_text())["workloads"].values()
    runs = {k: v[0] for k, v in w["runs"].items()}
    plain, claims, tree = (runs[f"{p}|least-load"] for p in ("reactive", "reactive+claims", "predictive+claims"))
    for s in (plain, claims, tree):
        assert s["completed"] == s["requests"] and s["engine_cached_blocks"] > 0
    assert claims["prefill_gpu_s"] < 0.97 * plain["prefill_gpu_s"]
    assert tree["prefill_gpu_s"] < 0.97 * plain["prefill_gpu_s"]
    for policy in ("reactive+claims", "predictive+claims"):
        lines = (out / "requests" / f"synth-fanout-{policy}.jsonl").read_text().splitlines()
        waited = [r for r in map(json.loads, lines) if r["claim_wait"]]
        assert waited and all(r["wait_end"] == "came" for r in waited)
        assert len(waited) < len(lines) // 10  # most followers compute or queue behind their engine's own


def test_claim_margin_auto_and_the_copy_on_its_way() -> None:
    from kvstore.replay import claiming
    from kvstore.replay.costmodel import CostModel
    from kvstore.v1 import kvstore_pb2 as pb

    assert claiming.margin_for("auto") == 1.0 and claiming.margin_for("3") == 3.0
    with pytest.raises(ValueError):
        claiming.margin_for("0")
    cost = CostModel.preset("llama3-70b-tp8")
    tree_copy = pb.NodePrefix(node_id="me", prefix_length=10, pending=True)
    wait = claiming.incoming([tree_copy], "me", 2, cost)
    assert wait is not None and wait.length == 10
    assert wait.budget_s == pytest.approx(cost.prefill_s(8 * cost.block_tokens))
    assert claiming.incoming([pb.NodePrefix(node_id="me", prefix_length=10, pending=True, computing=True)],
                             "me", 2, cost) is None   # a claim of this node's is not a copy on its way
    own = cost.prefill_s(8 * cost.block_tokens)          # trace s; the daemons' ready_in is real s x speedup
    due = pb.NodePrefix(node_id="me", prefix_length=10, pending=True, ready_in_seconds=own / 8)
    assert claiming.incoming([due], "me", 2, cost, speedup=4) is not None
    assert claiming.incoming([due], "me", 2, cost, speedup=8) is None   # lands just as computing would end
    assert not claiming.landed([tree_copy, pb.NodePrefix(node_id="x", prefix_length=10)], "me", 2, 10)
    assert claiming.landed([pb.NodePrefix(node_id="x", prefix_length=10)], "me", 2, 10)
    assert not claiming.landed([pb.NodePrefix(node_id="x", prefix_length=10)], "me", 2, 10, claimant="me")


def test_replica_seconds_integrate_the_slot_samples() -> None:
    from kvstore.replay.metrics import replica_gib_s

    tl = {"stats_t": [0.0, 2.0, 4.0], "spec_slots": [[0, 0], [2, 0], [2, 2]], "replica_slots": [[1, 1], [1, 1], [0, 0]],
          "sunk_slots": [[0, 0], [0, 0], [1, 0]]}
    held = replica_gib_s(tl, 1 << 30)   # 1 GiB pages
    assert held["speculative"] == pytest.approx((0 + 2) / 2 * 2 + (2 + 4) / 2 * 2)   # 8 GiB-s
    assert held["replica"] == pytest.approx(2 * 2 + (2 + 0) / 2 * 2)                 # 6 GiB-s
    assert held["sunk"] == pytest.approx((0 + 1) / 2 * 2)                             # 1 GiB-s below the pool
    assert replica_gib_s({}, 1 << 30) == {"speculative": 0.0, "replica": 0.0, "sunk": 0.0}


def test_a_node_joining_a_ramp_is_warmed_from_the_forecast_before_routers_use_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--join, simulated: the ninth node joins at 60 s; the coordinator copies it the ramp's hot prefix
    before routers send it requests, so its first requests load instead of pulling (its TTFT p99 over the
    first minute is lower than a cold join's); with --join-warm 0 it serves at once, cold."""
    from kvstore.replay.cli import replay_main

    args = ["--sim", "--trace", "ramp", "--nodes", "9", "--join", "n8@60", "--preset", "llama3-70b-tp8",
            "--link", "eth-100g", "--capacity", "preset", "--configs", "predictive|least-load", "--no-plots",
            "--no-progress"]
    runs = {}
    for name, extra in (("warm", []), ("cold", ["--kvstored-arg=--join-warm=0"])):
        assert replay_main([*args, *extra, "--out", str(tmp_path / name)]) == 0
        (w,) = json.loads((tmp_path / name / "results.json").read_text())["workloads"].values()
        runs[name] = w["runs"]["predictive|least-load"][0]
        rows = [json.loads(line) for line in (tmp_path / name / "requests").glob("*.jsonl").__next__().read_text()
                .splitlines()]
        assert all(r["t"] >= 60 for r in rows if r["node"] == "n8") and any(r["node"] == "n8" for r in rows)
    warm, cold = runs["warm"], runs["cold"]
    assert warm["planner_decisions"]["warm"] > 0 and cold["planner_decisions"]["warm"] == 0
    (jw,), (jc,) = warm["joins"], cold["joins"]
    assert jw["first_request_after_s"] > jc["first_request_after_s"]  # routers waited for the warm mark
    assert jw["joined"]["ttft_p99_s"] < jc["joined"]["ttft_p99_s"]
    assert jw["joined"]["hit_ratio"] >= 0.8 * jw["serving"]["hit_ratio"]
    report = (tmp_path / "warm" / "report.md").read_text()
    assert "After the join" in report and f"| predictive | least-load | n8@60 | {jw['first_request_after_s']:.2f} |" in report
