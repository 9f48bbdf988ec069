"""Pure logic of the page pool (``kvstore.pool.pool``): no sockets, no event
loop. The node over these pools: tests/unit/node/test_node.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstore.errors import PoolExhausted, ResourceExhausted
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.pool.movement import SOCKET
from kvstore.pool.pool import PageKind, PagePool, ReadHandle, Reservation

PB = 16  # page bytes of the small pools here


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

def test_eviction_takes_lru_first_and_a_forecast_copy_only_when_nothing_else_is_left() -> None:
    seen: list[list[bytes]] = []
    pool = make_pool(5, on_change=lambda added, removed: removed and seen.append(removed))
    put(pool, [b"p1"], PageKind.PRIMARY)
    put(pool, [b"s1"], PageKind.SPECULATIVE)
    put(pool, [b"r1"], PageKind.REPLICA)
    put(pool, [b"s2"], PageKind.SPECULATIVE)
    put(pool, [b"p2"], PageKind.PRIMARY)
    assert pool.speculative_slots == 2 and pool.evictable() == 5 and pool.cold_slots == 3
    res = pool.reserve(1)
    assert res.evicted == [b"p1"]
    pool.check_invariants()
    res2 = pool.reserve(3)
    assert res2.evicted == [b"r1", b"p2", b"s1"]  # the copies last, oldest first
    pool.check_invariants()
    assert seen == [[b"p1"], [b"r1", b"p2", b"s1"]]
    assert pool.evictions == Counter({"speculative": 1, "lru": 3})
    assert list(pool._table) == [b"s2"] and pool.cold_slots == 0
    pool.abort(res)
    pool.abort(res2)
    pool.check_invariants()
    assert pool.used_slots == 1


def test_a_forecast_copy_dropped_sinks_through_on_evict_before_its_slot_is_freed() -> None:
    pool = make_pool(4)
    put(pool, [b"p1"], PageKind.PRIMARY)
    put(pool, [b"s1", b"s2"], PageKind.SPECULATIVE)
    sunk: list[tuple[bytes, bool]] = []
    pool.on_evict = lambda entries: sunk.extend((e.key, e.key in pool) for e in entries)
    assert pool.drop_speculative([b"s1", b"p1"]) == [b"s1"]
    assert sunk == [(b"s1", True)]  # handed down while still held: its bytes intact
    assert b"s1" not in pool and pool.spec_wasted == 1
    pool.check_invariants()


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
    assert pool.reserve(1).evicted == [b"a"]  # one eviction, so the counter is non-zero
    assert pool.evictions == Counter({"lru": 1})
    seen.clear()
    pool.pin([b"b"])
    handle = pool.acquire([b"c"])
    # free: 0, evictable: s only -> 2 cannot be had
    assert len(pool._free) == 0 and pool.evictable() == 1
    before = snapshot(pool)
    with pytest.raises(PoolExhausted, match="need 2 slots"):
        pool.reserve(2)
    assert snapshot(pool) == before
    assert seen == []
    assert b"s" in pool  # no partial eviction
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


# (moving bytes in and out: tests/unit/pool/test_movement.py)


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
