"""Pure logic of the page pool (``kvstore.pool.pool``) and of the node
(``kvstore.node``): no sockets, no event loop, a fake clock for leases."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstore.config import NamespaceSpec, NodeConfig
from kvstore.errors import AlreadyExists, InvalidArgument, NotFound, PoolExhausted, ResourceExhausted
from kvstore.node import Node, PutResult
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.ops.staged import StagedNumpyPageOps
from kvstore.pool.movement import SOCKET
from kvstore.pool.layout import PageLayout
from kvstore.pool.pool import PageKind, PagePool, ReadHandle, Reservation

PB = 16  # page bytes of the small pools here


StagedNumpyOps = StagedNumpyPageOps  # numpy memory driven like a device pool (staging copies)


OPS = [NumpyPageOps, StagedNumpyOps]
OPS_IDS = ["host", "staged"]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def page(i: int, page_bytes: int = PB) -> bytes:
    return bytes((i + j) % 256 for j in range(page_bytes))


def make_pool(num_slots: int = 4, ops: Any = None, **kwargs: Any) -> PagePool:
    return PagePool(ops or NumpyPageOps(), num_slots, PB, **kwargs)


def put(pool: PagePool, keys: list[bytes], kind: PageKind = PageKind.PRIMARY) -> Reservation:
    res = pool.reserve(len(keys))
    pool.check_invariants()
    assert pool.commit(res, keys, kind) == len(keys)
    pool.check_invariants()
    return res


def read_bytes(pool: PagePool, handle: ReadHandle) -> list[bytes]:
    """The bytes of held pages through the read-out API; ends the hold."""
    out = pool.read_out(handle, SOCKET)
    try:
        return [bytes(v) for v in out.payload or []]
    finally:
        out.release()


def snapshot(pool: PagePool) -> tuple[Any, ...]:
    """Everything observable about the pool's bookkeeping."""
    table = {k: (e.slot, e.kind, e.pins, e.readers, e.deleted) for k, e in pool._table.items()}
    return (table, list(pool._free), list(pool._spec), list(pool._lru), Counter(pool.evictions), pool.used_slots)


def make_node(capacity: int = 64 * PB, clock: FakeClock | None = None, ops: Any = None, **overrides: Any) -> Node:
    cfg = NodeConfig(listen="127.0.0.1:0", capacity=capacity, device="cpu", prefault=False, **overrides)
    return Node(cfg, ops or NumpyPageOps(), clock=clock or FakeClock())


# ---------------------------------------------------------------------------
# PagePool: reserve / commit / abort
# ---------------------------------------------------------------------------

def test_new_pool_is_empty_and_sound() -> None:
    pool = make_pool(5)
    assert (pool.num_slots, pool.page_bytes, pool.used_slots, len(pool), pool.evictable()) == (5, PB, 0, 0, 0)
    assert pool.buffer.shape == (5, PB)
    pool.check_invariants()


def test_pool_without_slots_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        make_pool(0)


def test_reserve_then_commit_publishes_keys() -> None:
    pool = make_pool(4)
    res = pool.reserve(2)
    pool.check_invariants()
    assert len(set(res.slots)) == 2 and res.evicted == [] and not res.done
    # reserved but not yet visible
    assert pool.used_slots == 2 and len(pool) == 0 and pool.exists([b"a", b"b"]) == [False, False]
    assert pool.commit(res, [b"a", b"b"], PageKind.REPLICA) == 2
    pool.check_invariants()
    assert res.done
    assert pool.used_slots == 2 and len(pool) == 2 and b"a" in pool and b"b" in pool
    assert pool.kind_of(b"a") is PageKind.REPLICA and pool.kind_of(b"zz") is None
    assert [pool._table[k].slot for k in (b"a", b"b")] == res.slots


def test_abort_returns_slots_and_is_idempotent() -> None:
    pool = make_pool(4)
    put(pool, [b"a"])
    res = pool.reserve(3)
    assert pool.used_slots == 4
    pool.abort(res)
    pool.check_invariants()
    assert pool.used_slots == 1 and len(pool) == 1
    pool.abort(res)  # safe twice: no slot is freed twice
    pool.check_invariants()
    assert pool.used_slots == 1
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        pool.commit(res, [b"x", b"y", b"z"])
    pool.check_invariants()


def test_commit_twice_is_refused_and_abort_after_commit_is_a_noop() -> None:
    pool = make_pool(4)
    res = put(pool, [b"a", b"b"])
    with pytest.raises(RuntimeError):
        pool.commit(res, [b"c", b"d"])
    pool.abort(res)  # must not free the committed slots
    pool.check_invariants()
    assert pool.used_slots == 2 and len(pool) == 2


def test_commit_with_wrong_key_count_is_refused() -> None:
    pool = make_pool(4)
    res = pool.reserve(2)
    with pytest.raises(ValueError, match="1 keys for 2 reserved slots"):
        pool.commit(res, [b"a"])
    pool.abort(res)
    pool.check_invariants()
    assert pool.used_slots == 0


def test_reserve_zero_is_an_empty_reservation() -> None:
    pool = make_pool(2)
    res = pool.reserve(0)
    assert res.slots == [] and pool.commit(res, []) == 0
    pool.check_invariants()


def test_commit_of_key_that_appeared_meanwhile_returns_the_spare_slot() -> None:
    pool = make_pool(4)
    first = pool.reserve(2)
    second = pool.reserve(1)
    assert pool.commit(second, [b"a"]) == 1
    a_slot = second.slots[0]
    pool.check_invariants()
    assert pool.used_slots == 3
    assert pool.commit(first, [b"a", b"b"]) == 1  # b"a" keeps its existing page
    pool.check_invariants()
    assert pool._table[b"a"].slot == a_slot
    assert pool._table[b"b"].slot == first.slots[1]
    assert first.slots[0] in pool._free
    assert pool.used_slots == 2 == len(pool)


def test_commit_keeps_kind_of_existing_page() -> None:
    pool = make_pool(4)
    put(pool, [b"a"], PageKind.PRIMARY)
    res = pool.reserve(1)
    assert pool.commit(res, [b"a"], PageKind.SPECULATIVE) == 0
    assert pool.kind_of(b"a") is PageKind.PRIMARY and pool.speculative_slots == 0
    pool.check_invariants()


# ---------------------------------------------------------------------------
# PagePool: eviction order and holds
# ---------------------------------------------------------------------------

def test_eviction_takes_speculative_first_oldest_first_then_lru() -> None:
    seen: list[list[bytes]] = []
    pool = make_pool(5, on_change=lambda added, removed: removed and seen.append(removed))
    put(pool, [b"p1"], PageKind.PRIMARY)
    put(pool, [b"s1"], PageKind.SPECULATIVE)
    put(pool, [b"r1"], PageKind.REPLICA)
    put(pool, [b"s2"], PageKind.SPECULATIVE)
    put(pool, [b"p2"], PageKind.PRIMARY)
    assert pool.speculative_slots == 2 and pool.evictable() == 5
    res = pool.reserve(1)
    assert res.evicted == [b"s1"]
    pool.check_invariants()
    res2 = pool.reserve(3)
    assert res2.evicted == [b"s2", b"p1", b"r1"]
    pool.check_invariants()
    assert seen == [[b"s1"], [b"s2", b"p1", b"r1"]]
    assert pool.evictions == Counter({"speculative": 2, "lru": 2})
    assert list(pool._table) == [b"p2"]
    pool.abort(res)
    pool.abort(res2)
    pool.check_invariants()
    assert pool.used_slots == 1


def test_reserve_without_eviction_does_not_call_on_evict() -> None:
    seen: list[list[bytes]] = []
    pool = make_pool(3, on_change=lambda added, removed: removed and seen.append(removed))
    put(pool, [b"a", b"b"])
    assert pool.reserve(1).evicted == [] and seen == []


def test_touch_makes_a_page_recent() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b", b"c"])
    pool.touch([b"a", b"missing"])
    pool.check_invariants()
    assert pool.reserve(1).evicted == [b"b"]
    assert pool.reserve(1).evicted == [b"c"]
    assert pool.reserve(1).evicted == [b"a"]


def test_a_read_makes_a_page_recent() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b", b"c"])
    handle = pool.acquire([b"a"])
    pool.check_invariants()
    pool.release(handle)
    pool.check_invariants()
    assert pool.reserve(2).evicted == [b"b", b"c"]
    assert b"a" in pool


def test_touch_of_a_held_page_leaves_it_held() -> None:
    pool = make_pool(2)
    put(pool, [b"a", b"b"])
    pool.pin([b"a"])
    handle = pool.acquire([b"b"])
    pool.touch([b"a", b"b"])  # must not put held pages back in a queue
    pool.check_invariants()
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    pool.release(handle)
    pool.unpin([b"a"])
    pool.check_invariants()


def test_pinned_pages_are_never_evicted() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b", b"c"])
    assert pool.pin([b"a"]) == ([b"a"], [])
    assert pool.pinned_slots == 1 and pool.evictable() == 2
    res = pool.reserve(2)
    assert res.evicted == [b"b", b"c"]
    pool.commit(res, [b"d", b"e"])
    pool.check_invariants()
    # d and e are evictable, a is not
    res = pool.reserve(2)
    assert set(res.evicted) == {b"d", b"e"} and b"a" in pool
    with pytest.raises(PoolExhausted, match="1 pinned"):
        pool.reserve(1)
    pool.abort(res)
    pool.check_invariants()


def test_pages_being_read_are_never_evicted() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b", b"c"], PageKind.SPECULATIVE)
    handle = pool.acquire([b"a", b"missing", b"b"])
    assert handle.found == [True, False, True]
    assert handle.slots == [pool._table[b"a"].slot, pool._table[b"b"].slot]
    pool.check_invariants()
    res = pool.reserve(1)
    assert res.evicted == [b"c"]
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    pool.release(handle)
    pool.check_invariants()
    assert pool.reserve(2).evicted == [b"a", b"b"]  # back in the queue once released


def test_two_readers_hold_a_page_until_both_release() -> None:
    pool = make_pool(1)
    put(pool, [b"a"])
    h1, h2 = pool.acquire([b"a"]), pool.acquire([b"a"])
    assert pool._table[b"a"].readers == 2
    pool.release(h1)
    pool.release(h1)  # safe twice: counts once
    pool.check_invariants()
    assert pool._table[b"a"].readers == 1
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    pool.release(h2)
    pool.check_invariants()
    assert pool.reserve(1).evicted == [b"a"]


def test_unsatisfiable_reserve_raises_and_changes_nothing() -> None:
    seen: list[list[bytes]] = []
    pool = make_pool(5, on_change=lambda added, removed: removed and seen.append(removed))
    put(pool, [b"a", b"b", b"c"])
    put(pool, [b"s"], PageKind.SPECULATIVE)
    pool.reserve(1)  # the last free slot
    assert pool.reserve(1).evicted == [b"s"]  # one eviction, so the counter is non-zero
    assert pool.evictions == Counter({"speculative": 1})
    seen.clear()
    pool.pin([b"a"])
    handle = pool.acquire([b"b"])
    # free: 0, evictable: c only -> 2 cannot be had
    assert len(pool._free) == 0 and pool.evictable() == 1
    before = snapshot(pool)
    with pytest.raises(PoolExhausted, match="need 2 slots"):
        pool.reserve(2)
    assert snapshot(pool) == before
    assert seen == []
    assert b"c" in pool  # no partial eviction
    pool.check_invariants()
    pool.release(handle)


def test_reserve_with_everything_pinned_raises_and_changes_nothing() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b", b"c"])
    pool.pin([b"a", b"b", b"c"])
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as info:
        pool.reserve(1)
    assert isinstance(info.value, ResourceExhausted)
    assert "3 pinned" in str(info.value)
    assert snapshot(pool) == before
    pool.check_invariants()


# ---------------------------------------------------------------------------
# PagePool: delete, pins, lookups
# ---------------------------------------------------------------------------

def test_delete_frees_unheld_pages_and_reports_missing() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b"])
    assert pool.delete([b"a", b"nope"]) == (1, [b"nope"], [])
    pool.check_invariants()
    assert pool.used_slots == 1 and b"a" not in pool
    assert pool.delete([b"a"]) == (0, [b"a"], [])


def test_delete_of_a_page_being_read_frees_its_slot_only_on_release() -> None:
    pool = make_pool(2)
    put(pool, [b"a"])
    slot = pool._table[b"a"].slot
    handle = pool.acquire([b"a"])
    assert pool.delete([b"a"]) == (1, [], [])
    pool.check_invariants()
    assert b"a" not in pool and len(pool) == 0
    assert pool.used_slots == 1 and slot not in pool._free  # bytes still being read
    # the held slot is not handed out, even under pressure
    res = pool.reserve(1)
    assert res.slots != [slot]
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    # the key may be written again meanwhile, into another slot
    assert pool.commit(res, [b"a"]) == 1
    assert pool._table[b"a"].slot != slot
    pool.release(handle)
    pool.check_invariants()
    assert slot in pool._free and pool.used_slots == 1
    pool.release(handle)  # no double free
    assert pool._free.count(slot) == 1
    pool.check_invariants()


def test_delete_of_a_pinned_page_is_refused() -> None:
    pool = make_pool(3)
    put(pool, [b"a", b"b"])
    pool.pin([b"a"])
    assert pool.delete([b"a", b"b", b"c"]) == (1, [b"c"], [b"a"])
    pool.check_invariants()
    assert b"a" in pool and pool.pinned_slots == 1


def test_pins_count_per_lease() -> None:
    pool = make_pool(2)
    put(pool, [b"a", b"b"])
    assert pool.pin([b"a", b"x"]) == ([b"a"], [b"x"])
    assert pool.pin([b"a"]) == ([b"a"], [])
    assert pool._table[b"a"].pins == 2 and pool.pinned_slots == 1
    pool.check_invariants()
    assert pool.unpin([b"a", b"x"]) == 1
    pool.check_invariants()
    assert pool.pinned_slots == 1 and pool.evictable() == 1  # one lease still holds it
    assert pool.delete([b"a"])[2] == [b"a"]
    assert pool.unpin([b"a"]) == 1
    pool.check_invariants()
    assert pool.pinned_slots == 0 and pool.evictable() == 2
    assert pool.unpin([b"a"]) == 0  # no pin left to drop
    pool.check_invariants()


def test_pin_and_read_together_hold_until_both_end() -> None:
    pool = make_pool(2)
    put(pool, [b"a", b"b"])
    pool.pin([b"a"])
    handle = pool.acquire([b"a"])
    pool.unpin([b"a"])
    pool.check_invariants()
    assert pool.evictable() == 1  # still read
    pool.pin([b"a"])
    pool.release(handle)
    pool.check_invariants()
    assert pool.evictable() == 1  # still pinned
    pool.unpin([b"a"])
    pool.check_invariants()
    assert pool.evictable() == 2


def test_prefix_length_and_exists() -> None:
    pool = make_pool(4)
    put(pool, [b"k0", b"k1", b"k3"])
    assert pool.prefix_length([b"k0", b"k1", b"k2", b"k3"]) == 2
    assert pool.prefix_length([b"k0", b"k1"]) == 2
    assert pool.prefix_length([b"k2", b"k0"]) == 0
    assert pool.prefix_length([]) == 0
    assert pool.exists([b"k3", b"k2", b"k0"]) == [True, False, True]


# (moving bytes in and out: tests/test_movement.py)


# ---------------------------------------------------------------------------
# PagePool: random operation sequences (hypothesis)
# ---------------------------------------------------------------------------

KEYS = [bytes([ord("a") + i]) for i in range(9)]
SLOTS = 6


class PoolMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/acquire/release/pin/unpin/delete/touch on a
    6-slot pool, checked against a small model of pins and reads."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[bytes] = []
        self.pool = PagePool(NumpyPageOps(), SLOTS, PB, on_change=lambda added, removed: self.evicted.extend(removed))
        self.reservations: list[Reservation] = []
        self.handles: list[tuple[ReadHandle, list[bytes]]] = []
        self.pins: Counter[bytes] = Counter()  # model: pins per key

    # -- helpers --
    def _read_count(self, key: bytes) -> int:
        return sum(
            1 for h, _ in self.handles for e in h.entries if e.key == key and not e.deleted
        )

    def _held(self, key: bytes) -> bool:
        return self.pins[key] > 0 or self._read_count(key) > 0

    # -- rules --
    @rule(n=st.integers(0, 4))
    def reserve(self, n: int) -> None:
        before = snapshot(self.pool)
        room = len(self.pool._free) + self.pool.evictable()
        held_before = {k for k in self.pool._table if self._held(k)}
        self.evicted.clear()
        try:
            res = self.pool.reserve(n)
        except PoolExhausted:
            assert n > room
            assert snapshot(self.pool) == before
            return
        assert n <= room
        assert len(res.slots) == n == len(set(res.slots))
        assert res.evicted == self.evicted
        assert not set(res.evicted) & held_before, "a held page was evicted"
        self.reservations.append(res)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        res = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(res.slots), max_size=len(res.slots)))
        kind = data.draw(st.sampled_from(list(PageKind)))
        expected_new = len({k for k in keys if k not in self.pool})
        assert self.pool.commit(res, keys, kind) == expected_new
        assert all(k in self.pool for k in keys)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        res = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        free = len(self.pool._free)
        self.pool.abort(res)
        self.pool.abort(res)
        assert len(self.pool._free) == free + len(res.slots)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def acquire(self, keys: list[bytes]) -> None:
        handle = self.pool.acquire(keys)
        assert handle.found == [k in self.pool for k in keys]
        self.handles.append((handle, [e.key for e in handle.entries]))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        handle, _ = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.pool.release(handle)
        self.pool.release(handle)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
    def pin(self, keys: list[bytes]) -> None:
        pinned, missing = self.pool.pin(keys)
        assert pinned == [k for k in keys if k in self.pool]
        assert missing == [k for k in keys if k not in self.pool]
        self.pins.update(pinned)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
    def unpin(self, keys: list[bytes]) -> None:
        expected = sum(1 for k in keys if self.pins[k] > 0)
        assert self.pool.unpin(keys) == expected
        for k in keys:
            if self.pins[k] > 0:
                self.pins[k] -= 1

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
    def delete(self, keys: list[bytes]) -> None:
        present = [k for k in keys if k in self.pool]
        deleted, not_found, pinned = self.pool.delete(keys)
        assert pinned == [k for k in present if self.pins[k] > 0]
        assert not_found == [k for k in keys if k not in present]
        assert deleted == len(present) - len(pinned)
        assert all(k in self.pool for k in pinned)
        assert not any(k in self.pool for k in present if k not in pinned)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def touch(self, keys: list[bytes]) -> None:
        self.pool.touch(keys)

    # -- invariants --
    @invariant()
    def sound(self) -> None:
        pool = self.pool
        pool.check_invariants()
        reserved = [s for r in self.reservations for s in r.slots]
        held_deleted = {id(e): e.slot for h, _ in self.handles for e in h.entries if e.deleted}
        live = [e.slot for e in pool._table.values()]
        # every slot is in exactly one place: free, live, reserved or a deleted page still read
        everything = list(pool._free) + live + reserved + list(held_deleted.values())
        assert sorted(everything) == list(range(SLOTS))
        assert pool.used_slots == len(pool) + len(reserved) + len(held_deleted)
        if not held_deleted:
            assert pool.used_slots == len(pool) + len(reserved)

    @invariant()
    def held_pages_are_kept(self) -> None:
        for key, n in self.pins.items():
            if n:
                assert key in self.pool, f"pinned {key!r} lost"
                assert self.pool._table[key].pins == n
        for handle, keys in self.handles:
            for entry, key in zip(handle.entries, keys):
                assert entry.key == key
                if not entry.deleted:
                    assert self.pool._table.get(key) is entry, f"read {key!r} lost"
        for key, entry in self.pool._table.items():
            assert entry.readers == self._read_count(key)

    def teardown(self) -> None:
        for res in self.reservations:
            self.pool.abort(res)
        for handle, _ in self.handles:
            self.pool.release(handle)
        self.pool.unpin([k for k, n in self.pins.items() for _ in range(n)])
        self.pool.check_invariants()
        assert self.pool.used_slots == len(self.pool)
        assert self.pool.pinned_slots == 0 and self.pool.evictable() == len(self.pool)


def test_pool_random_operation_sequences_keep_invariants() -> None:
    run_state_machine_as_test(
        PoolMachine,
        settings=settings(max_examples=100, stateful_step_count=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


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

def test_reserve_free_lends_free_slots_only_and_never_evicts() -> None:
    pool = make_pool(4)
    put(pool, [b"a", b"b", b"c"])
    lent = pool.reserve_free(3)
    assert lent is not None and len(lent.slots) == 1 and lent.ahead  # one free slot; nothing evicted
    assert len(pool) == 3 and pool.used_slots == 3  # lent slots are not "used"
    assert pool.reserve_free(1) is None  # none free now
    pool.check_invariants()
    pool.abort(lent)
    assert pool.used_slots == 3 and pool.reserve(1).evicted == []  # the slot came back free
    pool.check_invariants()


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
