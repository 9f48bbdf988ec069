"""The client API against a real node, over every pool memory, event loop and
client data path (see the ``node`` fixture)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages
from kvstore_client import InvalidArgument, KvClient, NotFound, chain_keys

MiB = 1 << 20


@pytest.fixture
def kv(node):  # type: ignore[no-untyped-def]
    srv, path = node
    with KvClient(srv.address, data_path=path, **srv.client_auth) as client:
        assert client.wait_ready() == "SERVING"
        yield client


def test_round_trip_1000_random_1mib_pages(make_server) -> None:  # type: ignore[no-untyped-def]
    """The issue's bar: 1,000 random 1 MiB pages byte-for-byte, both paths."""
    srv = make_server(capacity=1100 * MiB)
    for path in ("tcp", "grpc"):
        with KvClient(srv.address, data_path=path) as kv:
            ns = f"rt-{path}"
            kv.create_namespace(ns, MiB, capacity=1000 * MiB // 2 + MiB)
            for batch in range(0, 500, 50):  # 500 pages per path = 1,000 in all
                pages = random_pages(50, MiB, seed=batch)
                keys = keys_for(50, f"{path}{batch}".encode())
                assert kv.put(ns, keys, pages).stored == 50
                got = kv.get(ns, keys)
                assert got.found.all()
                assert np.array_equal(got.pages, pages)
            kv.delete_namespace(ns)
    check_pools_sound(srv)


def test_put_get_lookup_exists_delete(kv) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("m", 4096)
    tokens = np.arange(16 * 10)
    keys = chain_keys(tokens, 16)
    pages = random_pages(10, 4096)
    assert kv.put("m", keys[:6], pages[:6]).stored == 6
    # a repeated put of present keys stores nothing new (keys name content)
    again = kv.put("m", keys[:7], pages[:7])
    assert (again.stored, again.already_present) == (1, 6)
    assert kv.lookup("m", keys) == 7
    assert kv.lookup("m", [b"absent"] + keys) == 0
    got = kv.get("m", keys)
    assert got.found.tolist() == [True] * 7 + [False] * 3
    assert got.missing == keys[7:]
    assert np.array_equal(got.pages[:7], pages[:7])
    assert kv.exists("m", [keys[0], b"nope"]) == [True, False]
    deleted = kv.delete("m", [keys[6], b"nope"])
    assert deleted.deleted == 1 and list(deleted.not_found) == [b"nope"]
    assert kv.lookup("m", keys) == 6


def test_get_into_caller_buffer_and_duplicates(kv) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("m", 1000)  # not a multiple of 16: the byte paths
    pages = random_pages(3, 1000)
    keys = keys_for(3)
    kv.put("m", keys, pages)
    out = np.full((4, 1000), 7, dtype=np.uint8)
    got = kv.get("m", [keys[2], b"zz", keys[2], keys[0]], out=out)
    assert got.pages is out
    assert got.found.tolist() == [True, False, True, True]
    assert np.array_equal(out[0], pages[2]) and np.array_equal(out[2], pages[2])
    assert np.array_equal(out[3], pages[0])
    assert (out[1] == 7).all()  # a missing row is left alone
    with pytest.raises(ValueError):
        kv.get("m", keys, out=np.empty((3, 999), dtype=np.uint8))


def test_pages_from_list_of_bytes(kv) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("m", 256)
    pages = [bytes([i]) * 256 for i in range(5)]
    kv.put("m", keys_for(5), pages)
    got = kv.get("m", keys_for(5))
    assert [bytes(row) for row in got.pages] == pages


def test_pin_unpin_and_lease_expiry(kv) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("m", 1024)
    kv.put("m", keys_for(3), random_pages(3, 1024))
    lease = kv.pin("m", keys_for(4), ttl=30)
    assert lease.pinned == keys_for(3) and lease.missing == keys_for(4)[3:]
    stats = kv.stats("m").namespaces[0]
    assert stats.pinned_slots == 3 and stats.active_leases == 1
    # pinned pages survive delete
    assert list(kv.delete("m", keys_for(1)).pinned) == keys_for(1)
    assert kv.unpin("m", lease) == 3
    with pytest.raises(NotFound):
        kv.unpin("m", lease)
    short = kv.pin("m", keys_for(2), ttl=0.2)
    assert kv.stats("m").namespaces[0].pinned_slots == 2
    deadline = time.monotonic() + 5
    while kv.stats("m").namespaces[0].pinned_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv.stats("m").namespaces[0].pinned_slots == 0
    with pytest.raises(NotFound):
        kv.unpin("m", short)


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, 1e9])
def test_bad_ttl_is_invalid_argument(kv, ttl: float) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("m", 1024)
    kv.put("m", keys_for(1), random_pages(1, 1024))
    with pytest.raises(InvalidArgument, match="ttl"):
        kv.pin("m", keys_for(1), ttl=ttl)
    assert kv.stats("m").namespaces[0].pinned_slots == 0


def test_lru_eviction_spares_pinned_and_recent(kv) -> None:  # type: ignore[no-untyped-def]
    kv.create_namespace("small", 1024, capacity=4 * 1024)
    keys = keys_for(6)
    kv.put("small", keys[:4], random_pages(4, 1024))
    kv.pin("small", keys[:1], ttl=60)
    kv.get("small", keys[1:2])  # key 1 is now recent
    res = kv.put("small", keys[4:6], random_pages(2, 1024, seed=1))
    assert res.evicted == 2
    assert kv.exists("small", keys) == [True, True, False, False, True, True]
    stats = kv.stats("small").namespaces[0]
    assert stats.evictions["lru"] == 2 and stats.used_slots == 4


def test_stats_and_namespaces(kv) -> None:  # type: ignore[no-untyped-def]
    info = kv.create_namespace("m", 2048, capacity=1 << 20, block_tokens=16, num_layers=1, kv_heads=2,
                               head_dim=16, dtype=1)
    assert info.num_slots == 512 and info.layout.block_tokens == 16
    assert kv.create_namespace("m", 2048, capacity=1 << 20, block_tokens=16, num_layers=1, kv_heads=2,
                               head_dim=16, dtype=1, exist_ok=True).num_slots == 512
    kv.put("m", keys_for(2), random_pages(2, 2048))
    kv.get("m", keys_for(3))
    stats = kv.stats()
    (ns,) = [s for s in stats.namespaces if s.namespace == "m"]
    assert (ns.hits, ns.misses, ns.puts, ns.used_bytes) == (2, 1, 2, 4096)
    assert stats.device in ("cpu", "cpu-staged") and stats.uptime_seconds > 0
    assert [n.namespace for n in kv.list_namespaces()] == ["m"]
    kv.delete_namespace("m")
    with pytest.raises(NotFound):
        kv.describe_namespace("m")
