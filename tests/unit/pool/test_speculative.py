"""Speculative replicas in the pool (pure): kept until nothing else is left to
evict, promoted by a client read, expired, renewed and dropped. The replication policies end to end:
tests/integration/test_replication_policies.py."""

from __future__ import annotations

from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.pool.pool import PageKind, PagePool

PB = 64


def fill(pool: PagePool, keys: list[bytes], kind: PageKind, expires_at: float = 0.0) -> None:
    res = pool.reserve(len(keys))
    for i, slot in enumerate(res.slots):
        pool.buffer[slot] = i
    pool.commit(res, keys, kind, expires_at=expires_at)


def test_speculative_pages_go_last_and_count_as_waste() -> None:
    pool = PagePool(NumpyPageOps(), 4, PB)
    fill(pool, [b"p1", b"p2"], PageKind.PRIMARY)
    fill(pool, [b"s1", b"s2"], PageKind.SPECULATIVE, expires_at=100.0)
    res = pool.reserve(2)
    assert sorted(res.evicted) == [b"p1", b"p2"] and pool.spec_wasted == 0
    res2 = pool.reserve(1)
    assert res2.evicted == [b"s1"]  # nothing else left: the oldest copy
    assert pool.spec_wasted == 1 and pool.evictions["speculative"] == 1
    pool.abort(res)
    pool.abort(res2)
    pool.check_invariants()


def test_read_promotes_and_peer_read_does_not() -> None:
    pool = PagePool(NumpyPageOps(), 4, PB)
    fill(pool, [b"s1", b"s2"], PageKind.SPECULATIVE, expires_at=100.0)
    pool.release(pool.acquire([b"s1"], promote=False))  # a peer pulling it
    assert pool.kind_of(b"s1") is PageKind.SPECULATIVE and pool.spec_hits == 0
    pool.release(pool.acquire([b"s1"]))  # a client read: the forecast paid off
    assert pool.kind_of(b"s1") is PageKind.REPLICA and pool.spec_hits == 1
    # promoted pages are no longer expired
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
