"""The page pool: one contiguous buffer cut into fixed slots.

Bookkeeping (free list, page table, pins, readers, eviction order) is plain
Python and runs on the event loop thread; bytes live in one array that is
CuPy device memory or numpy host memory, reached through a
:class:`~kvstore.ops.base.PageOps`.

Eviction order (:mod:`kvstore.pool.room`): the least recently used
primary/replica page first, a speculative copy (oldest first) only when no
other page is left: a forecast copy is kept until its forecast has passed.
A page that is pinned (a lease holds it) or being read (a transfer holds it)
is never evicted; it leaves the eviction queues while held and returns to the
recent end when released. A speculative copy whose forecast ended
(:meth:`PagePool.drop_speculative`) sinks: ``on_evict`` hands it to the tier
below as it does an evicted page.

Writes are two-phase: :meth:`PagePool.reserve` takes slots (evicting only
after checking that enough can be freed), the caller fills them, then
:meth:`PagePool.commit` publishes the keys or :meth:`PagePool.abort` returns
the slots. A key is never visible before its bytes are complete.
"""

from __future__ import annotations

import enum
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import PoolExhausted
from kvstore.hostmem import populated_empty, shared_empty
from kvstore.ops.base import PageOps
from kvstore.pool.movement import Carrier, Outgoing, StagingBuffers, contiguous_run, read_out
from kvstore.pool.room import victim

__all__ = ["Entry", "PageKind", "PagePool", "ReadHandle", "Reservation", "contiguous_run"]


class PageKind(enum.IntEnum):
    """Mirrors ``kvstore.v1.PageKind``."""

    PRIMARY = 1
    REPLICA = 2
    SPECULATIVE = 3


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    slot: int
    kind: PageKind
    checksum: int = 0  # xxh3_64 of the bytes, computed when stored (0 = none)
    expires_at: float = 0.0  # SPECULATIVE only: dropped unread after this (0 = never)
    pins: int = 0  # leases holding the page
    readers: int = 0  # in-flight reads holding the page
    reads: int = 0  # client reads (acquire with promote) since it was stored: --tier-admit reused
    deleted: bool = False  # deleted while held; slot freed on last release


@dataclass(slots=True)
class Reservation:
    """Slots taken for a write, not yet visible under any key."""

    slots: list[int]
    evicted: list[bytes] = field(default_factory=list)
    done: bool = False
    ahead: bool = False  # free slots lent ahead of a Put (reserve_free): not counted as used


@dataclass(slots=True)
class ReadHandle:
    """Pages held against eviction while their bytes are read."""

    entries: list[Entry]
    found: list[bool]
    released: bool = False

    @property
    def slots(self) -> list[int]:
        return [e.slot for e in self.entries]


class PagePool:
    """Slots of ``page_bytes`` in one buffer, with a key -> slot table."""

    def __init__(self, ops: PageOps, num_slots: int, page_bytes: int,
                 on_change: Callable[[list[Entry], list[bytes]], None] | None = None,
                 prefault: bool = False, shared: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"a pool needs at least one slot (capacity < page_bytes={page_bytes})")
        self.ops = ops
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        self.shm_fd = -1  # a memfd holding the buffer (shared): clients on this host map it
        if shared and ops.host_visible:
            self.buffer, self.shm_fd = shared_empty(num_slots, page_bytes)
        elif prefault and ops.host_visible:
            # Map every page now: first-touch faults on fresh anonymous memory
            # otherwise land on the put path (measured: 4 MiB put p99 8 ms
            # without, 1.3 ms with; see kvstore.hostmem).
            self.buffer = populated_empty(num_slots, page_bytes)
        else:
            self.buffer = ops.empty_pool(num_slots, page_bytes)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lent = 0  # slots of live ahead reservations (reserve_free)
        self._table: dict[bytes, Entry] = {}
        # Eviction queues hold only pages that are neither pinned nor read.
        self._spec: OrderedDict[bytes, Entry] = OrderedDict()
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()
        self._held = 0  # entries out of the queues (pinned or read)
        self.evictions: Counter[str] = Counter()
        # Kept in step with the table, so stats and heartbeats need no scan.
        self._kinds: Counter[PageKind] = Counter()
        self._pinned = 0
        self.spec_hits = 0  # reads that found a speculative replica (promoting it)
        self.spec_wasted = 0  # speculative replicas evicted or expired unread (sunk to a tier or gone)
        # on_change(added entries, removed keys): the directory outbox listens
        # here; a renewed or promoted speculative page is reported as added again.
        self._on_change = on_change
        # on_evict(entries): pages evicted for room, or speculative copies whose forecast ended, called while
        # their slots still hold their bytes (the tier stack copies them down here); before on_change reports
        # them removed.
        self.on_evict: Callable[[list[Entry]], None] | None = None
        self.staging = StagingBuffers()  # packed transfers in and out (movement.py)
        self._scratch: np.ndarray | None = None

    def close(self) -> None:
        """Give back the shared-memory file (its pages go once no client maps them)."""
        if self.shm_fd >= 0:
            os.close(self.shm_fd)
            self.shm_fd = -1

    # ---- queries -------------------------------------------------------
    @property
    def used_slots(self) -> int:
        """Slots holding pages or reserved for a Put under way; free slots
        lent ahead of a Put (:meth:`reserve_free`) are not counted."""
        return self.num_slots - len(self._free) - self._lent

    @property
    def free_slots(self) -> int:
        """Slots holding nothing and reserved by no one."""
        return len(self._free)

    def held(self, key: bytes) -> bool:
        """Whether ``key``'s page is pinned or being read (never evicted then)."""
        entry = self._table.get(key)
        return entry is not None and bool(entry.pins or entry.readers)

    @property
    def speculative_slots(self) -> int:
        return self._kinds[PageKind.SPECULATIVE]

    @property
    def pinned_slots(self) -> int:
        return self._pinned

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: bytes) -> bool:
        return key in self._table

    def exists(self, keys: Iterable[bytes]) -> list[bool]:
        return [k in self._table for k in keys]

    def prefix_length(self, chain: Sequence[bytes]) -> int:
        """Length of the longest leading run of ``chain`` held here."""
        n = 0
        for key in chain:
            if key not in self._table:
                break
            n += 1
        return n

    def evictable(self) -> int:
        return len(self._spec) + len(self._lru)

    @property
    def cold_slots(self) -> int:
        """Slots a forecast copy may take from this pool once its free ones are gone: its unheld primary
        and replica pages (``kvstore.pool.room``, rule 2)."""
        return len(self._lru)

    def entry(self, key: bytes) -> Entry | None:
        return self._table.get(key)

    def keys(self) -> list[bytes]:
        return list(self._table)

    @property
    def replica_slots(self) -> int:
        return self._kinds[PageKind.REPLICA]

    def kind_of(self, key: bytes) -> PageKind | None:
        entry = self._table.get(key)
        return entry.kind if entry else None

    # ---- writes --------------------------------------------------------
    def reserve(self, n: int) -> Reservation:
        """Take ``n`` slots, evicting if needed; all or nothing."""
        if n > len(self._free) + self.evictable():
            raise PoolExhausted(
                f"need {n} slots but only {len(self._free)} free and {self.evictable()} evictable "
                f"of {self.num_slots} ({self.pinned_slots} pinned)"
            )
        gone: list[Entry] = []
        while len(self._free) < n:
            gone.append(self._evict_one())
        if gone and self.on_evict is not None:
            self.on_evict(gone)  # their slots are free but not yet rewritten: the bytes are still there
        evicted = [e.key for e in gone]
        # Sorted: a batch often gets one contiguous run, which transfers can
        # fill in place (see contiguous_run).
        slots = sorted(self._free.pop() for _ in range(n))
        if evicted and self._on_change:
            self._on_change([], evicted)
        return Reservation(slots, evicted)

    def reserve_free(self, n: int) -> Reservation | None:
        """Up to ``n`` slots from the free list, never evicting: slots held
        before any Put asked for room (the shared-memory path's write-ahead
        slots) must not cost a stored page. None when no slot is free."""
        k = min(n, len(self._free))
        if k <= 0:
            return None
        self._lent += k
        return Reservation(sorted(self._free.pop() for _ in range(k)), ahead=True)

    def commit(self, res: Reservation, keys: Sequence[bytes], kind: PageKind | Sequence[PageKind] = PageKind.PRIMARY,
               checksums: Sequence[int] | None = None, expires_at: float = 0.0) -> int:
        """Publish ``keys[i]`` at ``res.slots[i]`` (of ``kind``, or ``kind[i]``); returns how many were new.

        A key that appeared meanwhile keeps its existing page; the spare slot
        goes back to the free list.
        """
        if res.done:
            raise RuntimeError("reservation already committed or aborted")
        if len(keys) != len(res.slots):
            raise ValueError(f"{len(keys)} keys for {len(res.slots)} reserved slots")
        res.done = True
        if res.ahead:
            self._lent -= len(res.slots)
        added = []
        one = kind if isinstance(kind, PageKind) else None
        for i, (key, slot) in enumerate(zip(keys, res.slots)):
            if key in self._table:
                self._free.append(slot)
                continue
            k = one or kind[i]  # type: ignore[index]
            entry = Entry(key, slot, k, checksums[i] if checksums is not None else 0,
                          expires_at if k is PageKind.SPECULATIVE else 0.0)
            self._table[key] = entry
            self._queue_of(entry)[key] = entry
            self._kinds[k] += 1
            added.append(entry)
        if added and self._on_change:
            self._on_change(added, [])
        return len(added)

    def unreserve(self, res: Reservation, slots: Sequence[int]) -> None:
        """Give back some of a reservation's slots before it is committed."""
        if res.done:
            raise RuntimeError("reservation already committed or aborted")
        gone = set(slots)
        before = len(res.slots)
        res.slots = [s for s in res.slots if s not in gone]
        if res.ahead:
            self._lent -= before - len(res.slots)
        self._free.extend(gone)

    def abort(self, res: Reservation) -> None:
        """Return reserved slots unused (safe to call twice)."""
        if not res.done:
            res.done = True
            if res.ahead:
                self._lent -= len(res.slots)
            self._free.extend(res.slots)

    def delete(self, keys: Iterable[bytes]) -> tuple[int, list[bytes], list[bytes]]:
        """Remove unpinned pages: (deleted, not_found, pinned)."""
        deleted, not_found, pinned = 0, [], []
        for key in keys:
            entry = self._table.get(key)
            if entry is None:
                not_found.append(key)
            elif entry.pins:
                pinned.append(key)
            else:
                self._remove(entry)
                deleted += 1
        if deleted and self._on_change:
            gone = [k for k in keys if k not in self._table and k not in not_found]
            self._on_change([], gone)
        return deleted, not_found, pinned

    # ---- reads ---------------------------------------------------------
    def acquire(self, keys: Sequence[bytes], promote: bool = True) -> ReadHandle:
        """Hold the found pages against eviction until :meth:`release`.

        A client read (``promote``) of a speculative replica makes it a
        plain REPLICA: the forecast paid off, so it is no longer evicted
        first nor expired."""
        entries, found, promoted = [], [], []
        for key in keys:
            entry = self._table.get(key)
            found.append(entry is not None)
            if entry is None:
                continue
            if entry.readers == 0 and entry.pins == 0:
                self._dequeue(entry)
            if promote and entry.kind is PageKind.SPECULATIVE:
                entry.kind, entry.expires_at = PageKind.REPLICA, 0.0
                self._kinds[PageKind.SPECULATIVE] -= 1
                self._kinds[PageKind.REPLICA] += 1
                self.spec_hits += 1
                promoted.append(entry)
            entry.readers += 1
            if promote:
                entry.reads += 1
            entries.append(entry)
        if promoted and self._on_change:
            self._on_change(promoted, [])
        return ReadHandle(entries, found)

    def release(self, handle: ReadHandle) -> None:
        """End a read (safe to call twice); frees pages deleted meanwhile."""
        if handle.released:
            return
        handle.released = True
        for entry in handle.entries:
            entry.readers -= 1
            self._maybe_requeue(entry)

    # ---- pins ----------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Pin the pages present: (pinned, missing)."""
        pinned, missing = [], []
        for key in keys:
            entry = self._table.get(key)
            if entry is None:
                missing.append(key)
                continue
            if entry.readers == 0 and entry.pins == 0:
                self._dequeue(entry)
            if entry.pins == 0:
                self._pinned += 1
            entry.pins += 1
            pinned.append(key)
        return pinned, missing

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Drop one pin from each key that still holds one."""
        released = 0
        for key in keys:
            entry = self._table.get(key)
            if entry is None or entry.pins == 0:
                continue
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned -= 1
            released += 1
            self._maybe_requeue(entry)
        return released

    # ---- bytes (see kvstore.pool.movement) --------------------------
    def read_out(self, handle: ReadHandle, carrier: Carrier) -> Outgoing:
        """The held pages of ``handle`` in the form ``carrier`` takes; the
        returned ``release`` ends the hold (or returns the staging)."""
        return read_out(self, handle.slots, carrier, lambda: self.release(handle))

    def scratch_page(self) -> np.ndarray:
        """One host page whose bytes are never read: where bytes of a page
        the pool already holds are received and dropped."""
        if self._scratch is None:
            self._scratch = np.empty(self.page_bytes, dtype=np.uint8)
        return self._scratch

    # ---- internals -----------------------------------------------------
    def _queue_of(self, entry: Entry) -> OrderedDict[bytes, Entry]:
        return self._spec if entry.kind is PageKind.SPECULATIVE else self._lru

    def _dequeue(self, entry: Entry) -> None:
        del self._queue_of(entry)[entry.key]

    def _maybe_requeue(self, entry: Entry) -> None:
        if entry.readers or entry.pins:
            return
        if entry.deleted:
            self._free.append(entry.slot)
        else:
            self._queue_of(entry)[entry.key] = entry

    def _remove(self, entry: Entry) -> None:
        del self._table[entry.key]
        self._kinds[entry.kind] -= 1
        if entry.readers:
            entry.deleted = True  # the last reader frees the slot
            return
        self._dequeue(entry)
        self._free.append(entry.slot)

    def _evict_one(self) -> Entry:
        queue, reason = victim(self._spec, self._lru)
        key, entry = queue.popitem(last=False)
        del self._table[key]
        self._kinds[entry.kind] -= 1
        self._free.append(entry.slot)
        self.evictions[reason] += 1
        if entry.kind is PageKind.SPECULATIVE:
            self.spec_wasted += 1
        return entry

    def renew(self, keys: Iterable[bytes], expires_at: float) -> int:
        """Push back the expiry of speculative replicas among ``keys``."""
        renewed = []
        for key in keys:
            entry = self._table.get(key)
            if entry is not None and entry.kind is PageKind.SPECULATIVE:
                entry.expires_at = max(entry.expires_at, expires_at)
                renewed.append(entry)
        if renewed and self._on_change:
            self._on_change(renewed, [])
        return len(renewed)

    def drop_speculative(self, keys: Iterable[bytes] | None = None, now: float | None = None) -> list[bytes]:
        """Remove unread, unheld speculative replicas: those in ``keys``, or
        (with ``now``) those whose expiry has passed. Counted as wasted; they
        sink (``on_evict``: the tier below takes them as it takes an evicted page)."""
        pool = self._spec if keys is None else {k: self._table[k] for k in keys if k in self._table}
        entries = [e for e in pool.values()
                   if e.kind is PageKind.SPECULATIVE and not e.pins and not e.readers
                   and (now is None or 0 < e.expires_at <= now)]
        if entries and self.on_evict is not None:
            self.on_evict(entries)  # before their slots are freed: the bytes are still there
        for entry in entries:
            self._remove(entry)
        gone = [e.key for e in entries]
        self.spec_wasted += len(gone)
        if gone and self._on_change:
            self._on_change([], gone)
        return gone

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark pages as just used (moves them to the recent end)."""
        for key in keys:
            entry = self._table.get(key)
            if entry is not None and not entry.readers and not entry.pins:
                self._queue_of(entry).move_to_end(key)

    def check_invariants(self) -> None:
        """Every slot is free, held by one entry, or reserved (tests)."""
        for kind in PageKind:
            assert self._kinds[kind] == sum(1 for e in self._table.values() if e.kind is kind), f"{kind} count"
        assert self._pinned == sum(1 for e in self._table.values() if e.pins), "pinned count"
        live = [e.slot for e in self._table.values()]
        assert len(set(live)) == len(live), "two keys share a slot"
        assert not set(live) & set(self._free), "a live slot is on the free list"
        assert len(set(self._free)) == len(self._free), "free list repeats a slot"
        assert 0 <= self._lent <= self.num_slots - len(self._free), "lent-ahead count"
        queued = set(self._spec) | set(self._lru)
        for key, entry in self._table.items():
            held = bool(entry.pins or entry.readers)
            assert (key in queued) != held, f"queue state wrong for {key.hex()}"
