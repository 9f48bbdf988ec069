"""Speculative replicas in the pool (pure) and the ``full`` policy end to end."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import check_pools_sound, keys_for, random_pages
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.pool.pool import PageKind, PagePool
from kvstore_client import KvClient

PB = 64


def fill(pool: PagePool, keys: list[bytes], kind: PageKind, expires_at: float = 0.0) -> None:
    res = pool.reserve(len(keys))
    for i, slot in enumerate(res.slots):
        pool.buffer[slot] = i
    pool.commit(res, keys, kind, expires_at=expires_at)


def test_speculative_pages_go_first_and_count_as_waste() -> None:
    pool = PagePool(NumpyPageOps(), 4, PB)
    fill(pool, [b"p1", b"p2"], PageKind.PRIMARY)
    fill(pool, [b"s1", b"s2"], PageKind.SPECULATIVE, expires_at=100.0)
    res = pool.reserve(2)
    assert sorted(res.evicted) == [b"s1", b"s2"]
    assert pool.spec_wasted == 2 and pool.evictions["speculative"] == 2
    pool.abort(res)
    pool.check_invariants()


def test_read_promotes_and_peer_read_does_not() -> None:
    pool = PagePool(NumpyPageOps(), 4, PB)
    fill(pool, [b"s1", b"s2"], PageKind.SPECULATIVE, expires_at=100.0)
    pool.release(pool.acquire([b"s1"], promote=False))  # a peer pulling it
    assert pool.kind_of(b"s1") is PageKind.SPECULATIVE and pool.spec_hits == 0
    pool.release(pool.acquire([b"s1"]))  # a client read: the forecast paid off
    assert pool.kind_of(b"s1") is PageKind.REPLICA and pool.spec_hits == 1
    # promoted pages are no longer expired or evicted first
    assert pool.drop_speculative(now=1e9) == [b"s2"]
    assert pool.spec_wasted == 1 and b"s1" in pool
    pool.check_invariants()


def test_expiry_renewal_and_drop() -> None:
    pool = PagePool(NumpyPageOps(), 6, PB)
    fill(pool, [b"a", b"b", b"c"], PageKind.SPECULATIVE, expires_at=10.0)
    fill(pool, [b"p"], PageKind.PRIMARY)
    assert pool.renew([b"b", b"p", b"zz"], 20.0) == 1
    lease = pool.pin([b"c"])
    assert pool.drop_speculative(now=15.0) == [b"a"]  # b renewed, c pinned, p primary
    pool.unpin(lease[0])
    assert sorted(pool.drop_speculative(now=25.0)) == [b"b", b"c"]
    assert pool.drop_speculative([b"p"]) == []  # never a primary
    assert pool.keys() == [b"p"] and pool.spec_wasted == 3
    pool.check_invariants()


def test_full_policy_copies_every_page_everywhere(make_server) -> None:  # type: ignore[no-untyped-def]
    common = dict(replication="full", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.05, capacity=16 << 20)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    c = make_server(node_id="c", peers=(a.address,), **common)
    for srv in (a, b, c):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 4096)
    pages = random_pages(6, 4096)
    with KvClient(b.address) as kb, KvClient(c.address) as kc, KvClient(a.address) as ka:
        kb.put("m", keys_for(6), pages)
        deadline = time.monotonic() + 10
        while not (all(kc.exists("m", keys_for(6))) and all(ka.exists("m", keys_for(6)))):
            assert time.monotonic() < deadline, "full replication did not reach every node"
            time.sleep(0.02)
        for kv in (ka, kc):
            got = kv.get("m", keys_for(6), local_only=True)
            assert got.found.all() and np.array_equal(got.pages, pages)
            assert kv.stats("m").namespaces[0].replica_slots == 6
    for srv in (a, b, c):
        check_pools_sound(srv)


@pytest.mark.parametrize("policy", ["none", "reactive"])
def test_reactive_and_none_place_nothing(make_server, policy: str) -> None:  # type: ignore[no-untyped-def]
    common = dict(replication=policy, transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.05, capacity=16 << 20)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 4096)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys_for(3), random_pages(3, 4096))
        deadline = time.monotonic() + 5
        while a.call(lambda: len(a.server.agent.directory)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        got = kb.get("m", keys_for(3), timeout=2)
        assert got.found.all() == (policy == "reactive")
        assert kb.stats("m").namespaces[0].replica_slots == (3 if policy == "reactive" else 0)
