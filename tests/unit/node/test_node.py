"""Pure logic of the node (``kvstore.node``): namespaces, put batches, reads,
leases and write-ahead slots over real page pools; no sockets, no event
loop, a fake clock for leases."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kvstore.config import NamespaceSpec, NodeConfig
from kvstore.errors import AlreadyExists, InvalidArgument, NotFound, PoolExhausted, ResourceExhausted
from kvstore.node import Node, PutResult
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.ops.staged import StagedNumpyPageOps
from kvstore.pool.layout import PageLayout
from kvstore.pool.movement import SOCKET
from kvstore.pool.pool import PageKind
from tests.unit.pool.test_pool import PB, page, read_bytes, snapshot

StagedNumpyOps = StagedNumpyPageOps  # numpy memory driven like a device pool (staging copies)


OPS = [NumpyPageOps, StagedNumpyOps]
OPS_IDS = ["host", "staged"]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_node(capacity: int = 64 * PB, clock: FakeClock | None = None, ops: Any = None, **overrides: Any) -> Node:
    cfg = NodeConfig(listen="127.0.0.1:0", capacity=capacity, device="cpu", prefault=False, **overrides)
    return Node(cfg, ops or NumpyPageOps(), clock=clock or FakeClock())


# ---------------------------------------------------------------------------
# PutBatch
# ---------------------------------------------------------------------------

def test_put_batch_commits_and_reports() -> None:
    node = make_node(capacity=4 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    first = node.begin_put("m")
    first.add([b"a", b"b"], [page(1), page(2)])
    assert ns.pool.exists([b"a", b"b"]) == [False, False]  # invisible before commit
    assert first.pages == 2
    assert first.commit() == PutResult(stored=2, already_present=0, evicted=0)
    ns.pool.check_invariants()
    second = node.begin_put("m")
    second.add([b"b", b"c"], [page(2), page(3)])
    second.add([b"d", b"e"], [page(4), page(5)])  # 4 slots: a is evicted for e
    assert second.commit() == PutResult(stored=3, already_present=1, evicted=1)
    ns.pool.check_invariants()
    assert ns.counters.puts == 5
    assert ns.pool.exists([b"a", b"b", b"c", b"d", b"e"]) == [False, True, True, True, True]
    _, handle = node.acquire("m", [b"c", b"e"])
    assert read_bytes(ns.pool, handle) == [page(3), page(5)]
    second.abort()  # no-op after commit
    ns.pool.check_invariants()
    assert ns.pool.used_slots == 4


def test_put_batch_speculative_kind() -> None:
    node = make_node()
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m", PageKind.SPECULATIVE)
    batch.add([b"a"], [page(0)])
    batch.commit()
    assert ns.pool.kind_of(b"a") is PageKind.SPECULATIVE and ns.pool.speculative_slots == 1


def test_put_batch_rejects_duplicate_keys_across_and_within_chunks() -> None:
    node = make_node()
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    batch.add([b"a", b"b"], [page(1), page(2)])
    used = ns.pool.used_slots
    with pytest.raises(InvalidArgument, match="duplicate key " + b"b".hex()):
        batch.add([b"c", b"b"], [page(3), page(2)])
    assert ns.pool.used_slots == used  # the bad chunk reserved nothing
    with pytest.raises(InvalidArgument, match="duplicate"):
        batch.add([b"d", b"d"], [page(4), page(4)])
    assert ns.pool.used_slots == used
    batch.abort()
    ns.pool.check_invariants()
    assert ns.pool.used_slots == 0


@pytest.mark.parametrize("bad", [PB - 1, PB + 1, 0])
def test_put_batch_rejects_wrong_page_size(bad: int) -> None:
    node = make_node()
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    with pytest.raises(InvalidArgument, match=f"page #1 has {bad} bytes.*'m' pages are {PB} bytes"):
        batch.add([b"a", b"b"], [page(1), bytes(bad)])
    assert ns.pool.used_slots == 0 and batch.pages == 0


def test_put_batch_rejects_key_page_count_mismatch_and_bad_keys() -> None:
    node = make_node()
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    with pytest.raises(InvalidArgument, match="2 keys but 1 pages"):
        batch.add([b"a", b"b"], [page(1)])
    with pytest.raises(InvalidArgument, match="keys must be 1..64 bytes"):
        batch.add([b""], [page(1)])
    with pytest.raises(InvalidArgument, match="keys must be 1..64 bytes"):
        batch.add([b"k" * 65], [page(1)])
    assert ns.pool.used_slots == 0


def test_put_batch_over_page_limit_is_resource_exhausted() -> None:
    node = make_node(max_batch_pages=3)
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    batch.add([b"a", b"b"], [page(1), page(2)])
    with pytest.raises(ResourceExhausted, match="batch of 4 pages .* limit of 3 pages"):
        batch.add([b"c", b"d"], [page(3), page(4)])
    batch.add([b"c"], [page(3)])  # exactly at the limit is fine
    assert batch.commit().stored == 3
    ns.pool.check_invariants()
    # present keys count too: the limit is on the batch, not on what is new
    again = node.begin_put("m")
    with pytest.raises(ResourceExhausted):
        again.add([b"a", b"b", b"c", b"e"], [page(0)] * 4)
    again.abort()


def test_put_batch_over_byte_limit_is_resource_exhausted() -> None:
    node = make_node(max_batch_bytes=3 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    batch.add([b"a"], [page(1)])
    with pytest.raises(ResourceExhausted, match=f"{3 * PB} bytes"):
        batch.add([b"b", b"c", b"d"], [page(2), page(3), page(4)])
    batch.abort()
    ns.pool.check_invariants()
    assert ns.pool.used_slots == 0


def test_put_batch_abort_after_partial_chunks_restores_used_slots() -> None:
    node = make_node(capacity=8 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    pre = node.begin_put("m")
    pre.add([b"x"], [page(0)])
    pre.commit()
    used = ns.pool.used_slots
    batch = node.begin_put("m")
    batch.add([b"a", b"b"], [page(1), page(2)])
    batch.add([b"x", b"c"], [page(0), page(3)])
    assert ns.pool.used_slots == used + 3
    batch.abort()
    ns.pool.check_invariants()
    assert ns.pool.used_slots == used == len(ns.pool)
    assert ns.pool.exists([b"a", b"b", b"c", b"x"]) == [False, False, False, True]
    batch.abort()  # twice is safe
    assert ns.pool.used_slots == used
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        batch.add([b"d"], [page(4)])


def test_put_batch_pool_exhausted_chunk_reserves_nothing() -> None:
    node = make_node(capacity=3 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    pre = node.begin_put("m")
    pre.add([b"p", b"q"], [page(0), page(1)])
    pre.commit()
    ns.pool.pin([b"p", b"q"])
    batch = node.begin_put("m")
    batch.add([b"a"], [page(2)])
    before = snapshot(ns.pool)
    with pytest.raises(PoolExhausted):
        batch.add([b"b"], [page(3)])
    assert snapshot(ns.pool) == before
    assert batch.commit() == PutResult(1, 0, 0)  # the rejected chunk is not part of the batch
    ns.pool.check_invariants()


@pytest.mark.parametrize("ops_cls", OPS, ids=OPS_IDS)
def test_put_batch_landing_round_trip(ops_cls: type) -> None:
    node = make_node(ops=ops_cls())
    ns = node.create_namespace("m", PageLayout(PB))
    pre = node.begin_put("m")
    pre.add([b"b"], [page(2)])
    pre.commit()
    batch = node.begin_put("m")
    landing = batch.write_in([b"a", b"b", b"c"], SOCKET)
    views = landing.targets
    assert len(views) == 3
    if ns.pool.ops.host_visible:  # present: received into the scratch page and dropped
        assert views[1].obj is ns.pool.scratch_page()
    views[0][:] = page(1)
    views[1][:] = page(9)
    views[2][:] = page(3)
    assert landing.finish() == set()
    assert batch.commit() == PutResult(2, 1, 0)
    _, handle = node.acquire("m", [b"a", b"b", b"c"])
    assert read_bytes(ns.pool, handle) == [page(1), page(2), page(3)]
    ns.pool.check_invariants()


def test_put_batch_does_not_evict_its_own_present_keys() -> None:
    node = make_node(capacity=3 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    pre = node.begin_put("m")
    pre.add([b"A", b"B", b"X"], [page(1), page(2), page(3)])  # A is the LRU page
    pre.commit()
    batch = node.begin_put("m")
    batch.add([b"A", b"C"], [page(1), page(4)])  # needs one slot; B or X could go
    result = batch.commit()
    assert result.already_present == 1
    # every key of a successful Put is present afterwards
    assert ns.pool.exists([b"A", b"C"]) == [True, True]


def test_rejected_multi_chunk_put_stores_nothing() -> None:
    """A rejected stream stores none of its pages. Evictions made to fit
    chunks received before the rejection stand (documented in the proto)."""
    node = make_node(capacity=2 * PB, max_batch_pages=2)
    ns = node.create_namespace("m", PageLayout(PB))
    pre = node.begin_put("m")
    pre.add([b"x", b"y"], [page(1), page(2)])
    pre.commit()
    batch = node.begin_put("m")
    batch.add([b"a"], [page(3)])  # evicts x to make room
    with pytest.raises(ResourceExhausted):
        batch.add([b"b", b"c"], [page(4), page(5)])  # over max_batch_pages: the Put is rejected
    batch.abort()
    ns.pool.check_invariants()
    assert ns.pool.exists([b"a", b"b", b"c"]) == [False, False, False]
    assert ns.pool.exists([b"y"]) == [True] and ns.pool.used_slots == 1


# ---------------------------------------------------------------------------
# Node: namespaces
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a", "Z", "0", "llama3-8b", "org/model@v1+lora:fp16.x", "a_b", "a" * 128])
def test_namespace_name_accepted(name: str) -> None:
    node = make_node()
    assert node.create_namespace(name, PageLayout(PB), PB).name == name


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "/a", "a b", "a,b", "é", "a" * 129, "a\tb", " a"])
def test_namespace_name_rejected(name: str) -> None:
    node = make_node()
    with pytest.raises(InvalidArgument, match="bad namespace name"):
        node.create_namespace(name, PageLayout(PB))
    assert node.namespaces == {} and node.reserved_bytes == 0


def test_namespace_name_with_trailing_newline_rejected() -> None:
    node = make_node()
    with pytest.raises(InvalidArgument):
        node.create_namespace("ns\n", PageLayout(PB))


def test_namespace_capacity_accounting() -> None:
    node = make_node(capacity=1000)
    a = node.create_namespace("a", PageLayout(100), capacity=650)
    assert a.capacity == 600 and a.pool.num_slots == 6  # rounded down to whole pages
    assert node.reserved_bytes == 600
    with pytest.raises(ResourceExhausted, match="asks for 500 bytes; 400 unreserved"):
        node.create_namespace("b", PageLayout(100), capacity=500)
    assert set(node.namespaces) == {"a"} and node.reserved_bytes == 600
    b = node.create_namespace("b", PageLayout(64))  # 0 = all that is left
    assert b.pool.num_slots == 400 // 64 and b.capacity == 384
    assert node.reserved_bytes == 984
    with pytest.raises(ResourceExhausted, match="holds no page"):
        node.create_namespace("c", PageLayout(100))  # 16 bytes left
    node.delete_namespace("a")
    assert node.reserved_bytes == 384
    assert node.create_namespace("c", PageLayout(100)).pool.num_slots == 6


def test_namespace_smaller_than_a_page_is_resource_exhausted() -> None:
    node = make_node(capacity=1000)
    with pytest.raises(ResourceExhausted, match="holds no page"):
        node.create_namespace("a", PageLayout(100), capacity=99)
    with pytest.raises(ResourceExhausted):
        node.create_namespace("a", PageLayout(2000))
    assert node.namespaces == {}


def test_namespace_exist_ok() -> None:
    node = make_node()
    layout = PageLayout(PB)
    ns = node.create_namespace("m", layout, 4 * PB)
    assert node.create_namespace("m", PageLayout(PB), exist_ok=True) is ns
    assert node.create_namespace("m", PageLayout(PB), 8 * PB, exist_ok=True) is ns  # capacity not compared
    with pytest.raises(AlreadyExists, match="'m' exists"):
        node.create_namespace("m", layout)
    with pytest.raises(AlreadyExists):
        node.create_namespace("m", PageLayout(2 * PB), exist_ok=True)
    assert node.namespaces == {"m": ns} and node.reserved_bytes == 4 * PB


def test_namespaces_from_config_are_created() -> None:
    node = make_node(capacity=100 * PB, namespace=(NamespaceSpec("a", PB, 10 * PB), NamespaceSpec("b", 2 * PB)))
    assert node.namespace("a").pool.num_slots == 10
    assert node.namespace("b").pool.num_slots == 45
    assert node.reserved_bytes == 100 * PB


def test_node_id_defaults_to_listen_address() -> None:
    assert make_node().node_id == "127.0.0.1:0"
    assert make_node(node_id="n1").node_id == "n1"


def test_unknown_namespace_is_not_found() -> None:
    node = make_node()
    node.create_namespace("m", PageLayout(PB))
    for call in (
        lambda: node.namespace("x"),
        lambda: node.begin_put("x"),
        lambda: node.acquire("x", [b"k"]),
        lambda: node.lookup("x", [b"k"]),
        lambda: node.exists("x", [b"k"]),
        lambda: node.delete("x", [b"k"]),
        lambda: node.pin("x", [b"k"], 1.0),
        lambda: node.delete_namespace("x"),
    ):
        with pytest.raises(NotFound, match="unknown namespace 'x'"):
            call()


def test_delete_namespace_refuses_while_pinned() -> None:
    node = make_node()
    node.create_namespace("m", PageLayout(PB))
    batch = node.begin_put("m")
    batch.add([b"a"], [page(0)])
    batch.commit()
    lease, _ = node.pin("m", [b"a"], 10)
    with pytest.raises(InvalidArgument, match="pinned"):
        node.delete_namespace("m")
    node.unpin("m", lease.lease_id)
    empty, _ = node.pin("m", [b"zz"], 10)  # a lease without pages does not block
    node.delete_namespace("m")
    assert "m" not in node.namespaces and empty.lease_id not in node.leases


# ---------------------------------------------------------------------------
# Node: reads and leases
# ---------------------------------------------------------------------------

def _node_with_pages(keys: list[bytes], clock: FakeClock | None = None, **overrides: Any) -> tuple[Node, Any]:
    node = make_node(clock=clock, **overrides)
    ns = node.create_namespace("m", PageLayout(PB), len(keys) * PB)
    batch = node.begin_put("m")
    batch.add(keys, [page(i) for i in range(len(keys))])
    batch.commit()
    return node, ns


def test_acquire_counts_hits_and_misses_lookup_and_exists() -> None:
    node, ns = _node_with_pages([b"k0", b"k1", b"k2"])
    _, handle = node.acquire("m", [b"k0", b"no", b"k2", b"k0"])  # duplicates allowed on reads
    assert handle.found == [True, False, True, True]
    assert (ns.counters.hits, ns.counters.misses) == (3, 1)
    ns.pool.release(handle)
    ns.pool.check_invariants()
    assert node.lookup("m", [b"k0", b"k1", b"no", b"k2"]) == 2
    assert node.exists("m", [b"k2", b"no"]) == [True, False]
    assert node.delete("m", [b"k1", b"no"]) == (1, [b"no"], [])


def test_read_batches_are_validated() -> None:
    node, _ = _node_with_pages([b"k0"], max_batch_pages=2)
    with pytest.raises(ResourceExhausted, match="batch of 3 keys"):
        node.acquire("m", [b"a", b"b", b"c"])
    with pytest.raises(InvalidArgument):
        node.lookup("m", [b""])
    with pytest.raises(InvalidArgument):
        node.exists("m", [b"x" * 65])


def test_pin_leases_count_and_release() -> None:
    node, ns = _node_with_pages([b"a", b"b"])
    one, missing = node.pin("m", [b"a", b"a", b"nope"], 10)  # a repeated key is pinned once per lease
    assert one.keys == [b"a"] and missing == [b"nope"]
    assert one.timer is None and one.namespace == "m"
    assert ns.pool._table[b"a"].pins == 1
    two, _ = node.pin("m", [b"a", b"b"], 10)
    assert one.lease_id != two.lease_id
    assert ns.pool._table[b"a"].pins == 2 and ns.pool.pinned_slots == 2
    assert node.delete("m", [b"a"]) == (0, [], [b"a"])
    assert node.unpin("m", one.lease_id) == 1
    assert ns.pool._table[b"a"].pins == 1  # the other lease still holds it
    with pytest.raises(NotFound, match="no lease"):
        node.unpin("m", one.lease_id)  # already released
    with pytest.raises(NotFound):
        node.unpin("other", two.lease_id)  # lease of another namespace
    assert node.unpin("m", two.lease_id) == 2
    assert ns.pool.pinned_slots == 0 and node.leases == {}
    ns.pool.check_invariants()


def test_leases_expire_by_the_clock() -> None:
    clock = FakeClock(500.0)
    node, ns = _node_with_pages([b"a", b"b"], clock=clock)
    short, _ = node.pin("m", [b"a"], 10)
    long, _ = node.pin("m", [b"a", b"b"], 100)
    assert short.expires_at == 510.0 and long.expires_at == 600.0
    clock.t = 509.999
    assert node.expire_leases() == 0
    clock.t = 510.0
    assert node.expire_leases() == 1
    assert short.lease_id not in node.leases and ns.pool._table[b"a"].pins == 1
    with pytest.raises(NotFound):
        node.unpin("m", short.lease_id)
    clock.t = 10_000.0
    assert node.expire_leases() == 1
    assert ns.pool.pinned_slots == 0 and node.leases == {}
    assert node.expire_leases() == 0
    ns.pool.check_invariants()
    # both pages are evictable again
    assert ns.pool.evictable() == 2
    assert node.uptime() == 10_000.0 - 500.0


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan, math.inf, -math.inf, 3600.0001])
def test_bad_ttl_is_invalid_argument(ttl: float) -> None:
    node, ns = _node_with_pages([b"a"])
    with pytest.raises(InvalidArgument, match="ttl_seconds must be in"):
        node.pin("m", [b"a"], ttl)
    assert ns.pool.pinned_slots == 0 and node.leases == {}


def test_ttl_at_the_limit_is_accepted() -> None:
    node, ns = _node_with_pages([b"a"], max_pin_ttl=60.0)
    lease, _ = node.pin("m", [b"a"], 60.0)
    assert ns.pool.pinned_slots == 1
    with pytest.raises(InvalidArgument):
        node.pin("m", [b"a"], 60.5)
    node.close()
    assert node.leases == {} and ns.pool.pinned_slots == 0
    assert lease.lease_id not in node.leases


# ---------------------------------------------------------------------------
# Write-ahead slots (the shared-memory path's one-round-trip Put)
# ---------------------------------------------------------------------------

def test_write_ahead_commits_new_keys_and_returns_the_rest() -> None:
    node = make_node(capacity=8 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    pool = ns.pool
    first = node.begin_put(ns.name)
    landing = first.write_in([b"old"])
    landing.targets[0][:] = page(9)
    landing.finish()
    first.commit()
    res = pool.reserve_free(4)
    assert res is not None and len(res.slots) == 4
    for i, slot in enumerate(res.slots[:3]):  # "written ahead" into the lent slots
        pool.buffer[slot] = np.frombuffer(page(i), dtype=np.uint8)
    batch = node.begin_put(ns.name)
    batch.write_ahead([b"x0", b"old", b"x2"], res).finish()
    result = batch.commit()
    assert (result.stored, result.already_present) == (2, 1)
    assert len(pool) == 3 and pool.used_slots == 3  # the slot of "old" and the unused one went back
    _, handle = node.acquire(ns.name, [b"x0", b"old", b"x2"])
    assert read_bytes(pool, handle) == [page(0), page(9), page(2)]
    assert all(e.checksum for e in pool._table.values())  # computed from the slots at commit
    pool.check_invariants()


def test_write_ahead_refuses_more_keys_than_slots_and_leaves_them_to_the_caller() -> None:
    node = make_node(capacity=8 * PB)
    ns = node.create_namespace("m", PageLayout(PB))
    res = ns.pool.reserve_free(2)
    assert res is not None
    batch = node.begin_put("m")
    with pytest.raises(InvalidArgument, match="3 keys for 2 write-ahead slots"):
        batch.write_ahead([b"a", b"b", b"c"], res)
    batch.abort()
    assert not res.done  # still the caller's to give back
    ns.pool.abort(res)
    assert ns.pool.used_slots == 0 and ns.pool._lent == 0
    ns.pool.check_invariants()
