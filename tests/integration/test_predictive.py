"""End to end: a 3-node cluster under ``--replication predictive`` fed a
fan-out burst places speculative replicas on the other nodes before the
bulk of the burst arrives there, and tells routers where they are."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest

from tests.conftest import TESTS_DIR, check_pools_sound, random_pages, wait_until
from kvstore_client import KvClient, chain_keys

PAGE = 64 << 10


@pytest.fixture
def cluster(make_server):  # type: ignore[no-untyped-def]
    # node_rate 0.01 req/s: three requests already ask for more nodes than there are (at the default 2 req/s
    # one node serves them, and the planner copies nothing: test_planner covers that sizing)
    common = dict(replication="predictive", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.1, spec_ttl=30.0, capacity=32 << 20, node_rate=0.01)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    c = make_server(node_id="c", peers=(a.address,), **common)
    for srv in (a, b, c):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    wait_until(lambda: all(s.call(lambda s=s: len(s.server.agent.membership.live_ids())) == 3 for s in (a, b, c)),
               10, "membership")
    yield a, b, c
    for srv in (a, b, c):
        check_pools_sound(srv)


def test_fanout_burst_is_replicated_before_it_lands(cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    a, b, c = cluster
    caplog.set_level(logging.INFO, logger="kvstore.decisions")
    prompt = np.arange(8 * 16)  # an 8-block shared prefix (16-token blocks)
    keys = chain_keys(prompt, 16)
    pages = random_pages(8, PAGE)
    decoy = chain_keys(np.arange(8 * 16) + 10_000, 16)
    with KvClient(a.address) as ka, KvClient(b.address) as kb, KvClient(c.address) as kc:
        ka.put("m", keys, pages)
        ka.put("m", decoy, random_pages(8, PAGE, seed=1))
        ka.lookup_nodes("m", decoy)  # the decoy is looked up, never recorded as requests
        # the head of the burst lands on a, the node that holds the prefix
        for _ in range(3):
            assert ka.lookup("m", keys, record=True) == 8
        # before the rest arrives on b and c, the coordinator has copied it there
        took = wait_until(lambda: kb.lookup("m", keys) == 8 and kc.lookup("m", keys) == 8, 10,
                          "speculative replicas on b and c")
        assert took < 3.0
        assert b.call(lambda: b.node.namespace("m").pool.speculative_slots) == 8
        # routers see where the prefix lives and for how long
        def hints() -> dict:  # type: ignore[type-arg]
            return {n.node_id: n for n in ka.lookup_nodes("m", keys).nodes}

        wait_until(lambda: {k: v.prefix_length for k, v in hints().items()} == {"a": 8, "b": 8, "c": 8}, 5,
                   "placement hints")
        assert hints()["b"].expires_in_seconds > 0 and hints()["c"].expires_in_seconds > 0
        assert hints()["a"].expires_in_seconds == 0  # a holds the primary copy
        # the bulk of the burst on b and c: local hits, no remote fetch on the critical path
        for kv in (kb, kc):
            got = kv.get("m", keys)
            assert got.found.all() and np.array_equal(got.pages, pages)
            ns = kv.stats("m").namespaces[0]
            assert ns.remote_hits == 0 and ns.speculative_hits == 8
        # the decoy was never placed anywhere
        assert not kb.exists("m", decoy)[0] and not kc.exists("m", decoy)[0]
    assert any("replicate" in r.message and "-> " in r.message for r in caplog.records)


def test_spec_budget_zero_places_nothing(make_server) -> None:  # type: ignore[no-untyped-def]
    common = dict(replication="predictive", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.05, spec_budget=0.0, capacity=16 << 20)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    keys = chain_keys(np.arange(4 * 16), 16)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys, random_pages(4, PAGE))
        for _ in range(4):
            assert ka.lookup("m", keys, record=True) == 4
        ticks = a.call(lambda: len(a.server.coordinator.tick_seconds))
        wait_until(lambda: a.call(lambda: len(a.server.coordinator.tick_seconds)) >= ticks + 5, 10,
                   "planner ticks")
        assert kb.lookup("m", keys) == 0
        skipped = a.call(lambda: a.server.metrics.decisions.labels("skip_no_room")._value.get())
        assert skipped > 0


def test_daemon_loads_a_trained_model_and_exposes_predictor_metrics(tmp_path, daemon) -> None:  # type: ignore[no-untyped-def]
    import urllib.request
    from kvstore.cli.kvctl import main as kvctl

    model = tmp_path / "model.json"
    sample = TESTS_DIR / "data" / "mooncake_sample.jsonl"
    assert kvctl(["train", "--trace", str(sample), "--out", str(model), "--threads", "1", "--horizon", "60",
                  "--sample-every", "10", "--max-rows", "300", "--train-from", "0"]) == 0
    d = daemon("--node-id", "a", "--replication", "predictive", "--predictor-model", str(model),
               "--predictor-horizon", "60",
               "--metrics-port", "0", "--planner-tick", "0.1", "--transport", "tcp")
    with KvClient(d.address) as kv:
        kv.create_namespace("m", PAGE)
        keys = chain_keys(np.arange(32), 16)
        kv.put("m", keys, random_pages(2, PAGE))
        for _ in range(3):
            kv.lookup("m", keys, record=True)
    url = f"http://127.0.0.1:{d.fields['metrics_port']}/metrics"
    deadline = time.monotonic() + 10
    text = ""
    while 'kvstore_predictor_source{source="lightgbm"} 1.0' not in text:
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.1)
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert "kvstore_planner_tick_seconds_count" in text

    def slices_seen() -> float:  # ticks that recorded their longest stretch on the loop
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        found = re.search(r"^kvstore_planner_tick_slice_seconds_count (\S+)$", body, re.M)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: slices_seen() >= 2, 10, "planner ticks on the loop", state=slices_seen)


@pytest.mark.parametrize("chunks", [1, 4])
def test_demand_sized_fanout_is_copied_as_a_tree(make_server, chunks) -> None:  # type: ignore[no-untyped-def]
    """With --node-rate the forecast demand asks for every node; the copies go
    as a tree (landed targets serve later ones), not five out of a; with
    --copy-chunks 4 as a relayed chain (each target forwards each quarter as
    it lands; --copy-part-min is lowered so that this small copy relays).

    The planner's first tick sees the whole demand (it sits out the
    lookups): 5 targets as a tree, so some of the pages are sent by a node
    other than the primary, and every page is copied once. The node rate is
    low enough (0.01 req/s) that even a slow machine's rate estimate of the
    12 lookups asks for all five nodes at once (at 0.05 a CI run's first
    tick asked for four, and the fifth came from the primary later), not three
    now and two a tick later."""
    common = dict(replication="predictive", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.1, spec_ttl=30.0, capacity=32 << 20, node_rate=0.01, copy_chunks=chunks,
                  copy_part_min=1e-9)
    a = make_server(node_id="a", **common)
    others = [make_server(node_id=n, peers=(a.address,), **common) for n in "bcdef"]
    servers = [a, *others]
    for srv in servers:
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    wait_until(lambda: all(s.call(lambda s=s: len(s.server.agent.membership.live_ids())) == 6 for s in servers),
               10, "membership")
    keys = chain_keys(np.arange(8 * 16), 16)
    coordinator = a.server.coordinator
    with KvClient(a.address) as ka:
        ka.put("m", keys, random_pages(8, PAGE))
        # the planner sits out the burst's arrival (as under a long tick), so its first tick sees the
        # whole demand: on a slow machine the lookups would otherwise straddle ticks
        a.call(lambda: setattr(coordinator.core, "policy", "reactive"))
        for _ in range(12):
            assert ka.lookup("m", keys, record=True) == 8
        a.call(lambda: setattr(coordinator.core, "policy", "predictive"))

        def spread() -> int:
            return sum(1 for s in others if s.call(lambda s=s: s.node.namespace("m").pool.speculative_slots) == 8)

        wait_until(lambda: spread() == 5, 15, "speculative replicas on all five other nodes", state=spread)

    def sent_now() -> dict[str, int]:
        return a.call(lambda: dict(a.server.coordinator.core.pages_from))

    # a target holds its pages a moment before the coordinator has the Replicate's reply and counts them
    wait_until(lambda: sum(sent_now().values()) >= 5 * 8, 5, "the coordinator to count the copies", state=sent_now)
    sent = sent_now()
    assert sum(sent.values()) == 5 * 8, sent
    assert sent.get("a", 0) < 5 * 8, f"every page went out of the primary: {sent}"
    # the copies were measured, and no copy is still counted on a link once the copies of later ticks
    # (which find the pages there and move none) have had their replies. Which end a copy measures is
    # its more contended one (tests/unit/placement/test_links.py): a sender whose target was busier (a later tick's
    # copy to it still in flight) has no egress sample, so only "some end of the copies" is certain
    def links_now():  # type: ignore[no-untyped-def]
        return a.call(lambda: (coordinator.core.links.stats(), dict(coordinator.core.links.sending),
                               dict(coordinator.core.links.receiving)))

    wait_until(lambda: not any(links_now()[1].values()), 5, "the copies in flight to end", state=links_now)
    rates, sending, receiving = links_now()
    assert rates and set(rates) <= set("abcdef") and not sending and not receiving, (rates, sending, receiving)
    assert sum(sent_now().values()) == 5 * 8, f"a later copy moved pages again: {sent_now()}"
    assert all(r["egress_bps"] > 0 and r["ingress_bps"] > 0 for r in rates.values())
    if chunks > 1:
        assert sent.get("a") == 8, f"relayed: the primary heads one chain and sends one copy: {sent}"
    for srv in servers:
        check_pools_sound(srv)
