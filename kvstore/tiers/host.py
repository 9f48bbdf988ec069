"""Pages of one size in host memory, and the bookkeeping both page tiers share.

:class:`PageIndex` is the part of a tier that is not its bytes: which slot holds which
(namespace, key), the free slots, the least recently used order (whole tier and per namespace), the
namespaces' shares, the holds (pins), the readers in flight and the puts in flight. It takes no lock:
its owner calls it under its own. Its rules:

* a slot is in exactly one of four states: free, holding a page (in the index), reserved for a put in
  flight (the put's page is not visible yet), or retiring (its page left the index; the slot returns
  to the free list once its owner has released it). Only free slots are handed out, so no write ever
  lands in a slot that a reader or another writer is using;
* a page with a hold or a read in flight is never chosen for eviction; a page removed or dropped while
  being read keeps its slot until the last reader is done (:meth:`PageIndex.release_reader`);
* with a share set (:meth:`PageIndex.set_share`), a put of that namespace at or over it evicts that
  namespace's own least recently used pages (as many as it takes to come back under it: pages found
  at open above a share are evicted by the namespace's next put, and passed to its spill); a put that
  finds no free slot evicts the tier's least recently used page. A put that finds nothing it may
  evict is not stored (the tier counts it in ``stats.drops``).

:class:`HostPages` is the host-memory tier over one preallocated buffer of ``capacity_bytes //
page_bytes`` slots, from ``allocate`` (pinned host memory on a GPU node) or ``numpy.empty``. Its copies
run outside its lock: a put copies into a slot reserved for it, a get copies out of a slot its read
keeps from reuse; a copy of a large page is split across threads (:func:`~kvstore.hostmem.copy_into`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.hostmem import as_bytes, copy_into
from kvstore.tiers.base import PageId, Spill, Stored, TierStats

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Entry:
    """One page in a tier's index. ``record`` is what the disk tier needs to find and check it again."""

    page: PageId
    slot: int
    kind: int
    checksum: int
    record: Any = None
    readers: int = 0   # reads in flight
    holds: int = 0     # pins: never evicted while > 0
    gone: bool = False  # left the index while read: the last reader releases its slot

    def stored(self) -> Stored:
        return Stored(self.page, self.kind, self.checksum)


@dataclass(slots=True)
class Reservation:
    """A slot taken for a put, and the pages evicted for it (out of the index, slots not free yet)."""

    page: PageId
    slot: int
    victims: list[Entry]


class PageIndex:
    """Slots, LRU order, shares, holds and in-flight reads and puts of one tier (module doc). Not
    thread-safe on its own: every call is made under the owner's lock."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.entries: dict[PageId, Entry] = {}
        self.lru: OrderedDict[PageId, Entry] = OrderedDict()  # least recently used first
        self.by_namespace: dict[str, OrderedDict[PageId, Entry]] = {}
        self.shares: dict[str, int] = {}
        self.pending: set[PageId] = set()
        self.pending_by_namespace: Counter[str] = Counter()
        self.free: list[int] = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Entry) -> None:
        """Publish ``entry`` as the most recently used page (its slot is no longer free)."""
        self.entries[entry.page] = entry
        self.lru[entry.page] = entry
        self.by_namespace.setdefault(entry.page[0], OrderedDict())[entry.page] = entry

    def touch(self, entry: Entry) -> None:
        self.lru.move_to_end(entry.page)
        self.by_namespace[entry.page[0]].move_to_end(entry.page)

    def detach(self, entry: Entry) -> None:
        """Take ``entry`` out of the index; its slot is the caller's to release (or the last reader's)."""
        del self.entries[entry.page]
        del self.lru[entry.page]
        own = self.by_namespace[entry.page[0]]
        del own[entry.page]
        if not own:
            del self.by_namespace[entry.page[0]]
        entry.gone = True

    def evictable(self, order: OrderedDict[PageId, Entry] | None, n: int) -> list[Entry]:
        """Up to ``n`` pages of ``order`` that may be evicted, least recently used first."""
        found: list[Entry] = []
        if order is None or n <= 0:
            return found
        for entry in order.values():
            if entry.holds == 0 and entry.readers == 0:
                found.append(entry)
                if len(found) == n:
                    break
        return found

    def reserve(self, page: PageId) -> Reservation | None:
        """A slot for a put of ``page``, evicting what the share and the capacity call for; None when
        nothing may be evicted (the put is dropped). The page is in flight until :meth:`commit` or
        :meth:`abort`."""
        namespace = page[0]
        victims: list[Entry] = []
        share = self.shares.get(namespace)
        if share is not None:
            if share <= 0:
                return None
            over = len(self.by_namespace.get(namespace, ())) + self.pending_by_namespace[namespace] - share + 1
            if over > 0:
                victims = self.evictable(self.by_namespace.get(namespace), over)
                if len(victims) < over:
                    return None
        if not victims and not self.free:
            victims = self.evictable(self.lru, 1)
            if not victims:
                return None
        for entry in victims:
            self.detach(entry)
        slot = victims[0].slot if victims else self.free.pop()
        self.pending.add(page)
        self.pending_by_namespace[namespace] += 1
        return Reservation(page, slot, victims)

    def settle(self, page: PageId) -> None:
        """``page``'s put is no longer in flight (then :meth:`add` it, or free its slot)."""
        self.pending.discard(page)
        self.pending_by_namespace[page[0]] -= 1
        if self.pending_by_namespace[page[0]] <= 0:
            del self.pending_by_namespace[page[0]]

    def release_reader(self, entry: Entry) -> bool:
        """A read of ``entry`` is done; True when its page left the index meanwhile and this was the last
        reader (the caller now releases the slot)."""
        entry.readers -= 1
        return entry.gone and entry.readers == 0

    def set_share(self, namespace: str, max_pages: int) -> None:
        self.shares[namespace] = max(0, int(max_pages))

    def in_order(self) -> list[Stored]:
        return [entry.stored() for entry in self.lru.values()]


class IndexedTier:
    """What both page tiers answer from their :class:`PageIndex` alone, under their lock: membership, the
    pages in order, shares and holds. A subclass sets ``_lock`` and ``_index``."""

    _lock: threading.Lock
    _index: PageIndex

    def __contains__(self, page: object) -> bool:
        return page in self._index.entries

    def __len__(self) -> int:
        return len(self._index)

    def pages(self) -> list[Stored]:
        """Every page held, least recently used first."""
        with self._lock:
            return self._index.in_order()

    def set_share(self, namespace: str, max_pages: int) -> None:
        """At most ``max_pages`` of ``namespace``; pages over it (found at open, or a share made smaller)
        are evicted by the namespace's next put, each passed to that put's spill."""
        with self._lock:
            self._index.set_share(namespace, max_pages)

    def hold(self, page: PageId) -> bool:
        with self._lock:
            entry = self._index.entries.get(page)
            if entry is None:
                return False
            entry.holds += 1
            return True

    def unhold(self, page: PageId) -> None:
        with self._lock:
            entry = self._index.entries.get(page)
            if entry is not None and entry.holds > 0:
                entry.holds -= 1


class HostPages(IndexedTier):
    """A bounded store of ``page_bytes`` pages in one host buffer (module doc); safe from several threads.

    ``allocate(nbytes)`` returns the buffer (anything exposing a writable buffer of ``nbytes`` bytes:
    pinned host memory on a GPU node); ``numpy.empty`` by default. ``name`` names the tier in logs."""

    def __init__(self, name: str, page_bytes: int, capacity_bytes: int,
                 allocate: Callable[[int], Any] | None = None) -> None:
        if page_bytes <= 0:
            raise ValueError("page_bytes must be > 0")
        self.name = name
        self.page_bytes = int(page_bytes)
        slots = max(0, int(capacity_bytes) // self.page_bytes)
        self.stats = TierStats(capacity_pages=slots)
        self._lock = threading.Lock()
        self._index = PageIndex(slots)
        self._closed = False
        nbytes = slots * self.page_bytes
        self._memory = (allocate or (lambda n: np.empty(n, dtype=np.uint8)))(nbytes)
        view = memoryview(self._memory).cast("B") if nbytes else memoryview(bytearray(0))
        if view.nbytes < nbytes:
            raise ValueError(f"allocate({nbytes}) returned {view.nbytes} bytes")
        self._bytes = np.frombuffer(view, dtype=np.uint8)[:nbytes] if nbytes else np.empty(0, dtype=np.uint8)

    @property
    def slots(self) -> int:
        return self._index.slots

    def _slot_bytes(self, slot: int) -> np.ndarray:
        return self._bytes[slot * self.page_bytes:(slot + 1) * self.page_bytes]

    # ---- PageTier ---------------------------------------------------------------------
    def put(self, namespace: str, key: bytes, payload: bytes | memoryview, kind: int = 1, checksum: int = 0,
            spill: Spill | None = None) -> list[PageId]:
        """Store one page of exactly ``page_bytes``; returns the pages evicted for room, each passed to
        ``spill`` with its bytes first (the view is valid during the call only). A page held or in
        flight already is only touched; a put with nothing to evict is dropped (``stats.drops``)."""
        data = as_bytes(payload)
        if data.nbytes != self.page_bytes:
            raise ValueError(f"a {data.nbytes} B page in a tier of {self.page_bytes} B pages")
        page = (namespace, bytes(key))
        with self._lock:
            held = self._index.entries.get(page)
            if held is not None:
                self._index.touch(held)
                return []
            if page in self._index.pending:
                return []
            taken = None if self._closed else self._index.reserve(page)
            if taken is None:
                self.stats.drops += 1
                return []
            self.stats.evictions += len(taken.victims)
        try:
            for victim in taken.victims:
                if spill is not None:
                    spill(victim.page, victim.kind, victim.checksum, memoryview(self._slot_bytes(victim.slot)))
            copy_into(self._slot_bytes(taken.slot), data)
        except BaseException:
            with self._lock:
                self._index.settle(page)
                self._index.free.extend({taken.slot, *(v.slot for v in taken.victims)})
            raise
        with self._lock:
            self._index.settle(page)
            self._index.free.extend(v.slot for v in taken.victims[1:])  # the first one's slot holds the page
            self._index.add(Entry(page, taken.slot, int(kind), int(checksum)))
            self.stats.writes += 1
            self.stats.bytes_written += self.page_bytes
            self.stats.pages = len(self._index)
        return [victim.page for victim in taken.victims]

    def get_into(self, namespace: str, key: bytes, out: memoryview) -> Stored | None:
        """Copy the page into ``out[:page_bytes]``; None if not held. A hit marks it recently used."""
        page = (namespace, bytes(key))
        with self._lock:
            entry = self._index.entries.get(page)
            if entry is None:
                self.stats.misses += 1
                return None
            entry.readers += 1
        try:
            copy_into(as_bytes(out)[:self.page_bytes], self._slot_bytes(entry.slot))
        finally:
            with self._lock:
                if self._index.release_reader(entry):
                    self._index.free.append(entry.slot)
                elif not entry.gone:
                    self._index.touch(entry)
                self.stats.hits += 1
        return entry.stored()

    def remove(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            entry = self._index.entries.get((namespace, bytes(key)))
            if entry is None:
                return False
            self._index.detach(entry)
            if entry.readers == 0:
                self._index.free.append(entry.slot)
            self.stats.pages = len(self._index)
            return True

    def close(self) -> None:
        """Stop storing (later puts are dropped); the buffer is released with the tier."""
        with self._lock:
            self._closed = True
