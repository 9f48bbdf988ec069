"""Pages of one size on local disk: one slab file (:mod:`kvstore.tiers.slab`) and its index.

:class:`DiskPages` is the disk tier (a :class:`~kvstore.tiers.base.PageTier`). Its bookkeeping is a
:class:`~kvstore.tiers.host.PageIndex` (slots, least recently used order, shares, holds, reads and puts
in flight, the same rules as the host tier); the generation counter (one clock for record generations
and last-used ticks) is its own. What holds:

* **put** reserves a slot under the lock (a free one, or the slot of the page it evicts: the least
  recently used of its namespace over a share, else of the tier), then outside the lock reads each
  victim for ``spill`` (only when a spill is given) and writes the record (header and payload in one
  ``pwritev``, then its table entry); the page becomes visible when the write is done. A page already
  held, or being put by another thread, is only touched. A key names its content.
* **get_into** marks the page's slot as read (so it is neither evicted nor reused meanwhile), reads
  header and payload in one ``preadv`` outside the lock, straight into ``out`` where the I/O mode allows
  (see :meth:`~kvstore.tiers.slab.Slab.read_into`), and checks that the header names this page and
  generation and that the payload matches its checksum. A record that fails is dropped, counted in
  ``stats.corrupt`` and its slot erased; so is one whose read fails with an I/O error (logged): the tier
  keeps serving the others. No get ever returns bytes of another page or of a torn write.
* **restart**: the index comes back from the slab's table (:meth:`~kvstore.tiers.slab.Slab.records`),
  least recently used first as it was before the stop, each page with its kind and checksum. Where a
  key has two records (a crash between a write and the erase of an older record), the newer generation
  wins and the other is erased. Entries are checked lazily, by the check every read makes. A restarted
  node serves what it held. Pages over a namespace's share (shares are set after the open) are evicted
  by that namespace's next put, each passed to its spill.
* **failures**: a write that fails (``EIO``, ``ENOSPC`` on a filesystem that did not honour the
  preallocation) or a slab file whose directory was removed under the node (``st_nlink == 0``; the
  open descriptor keeps working, so nothing else would notice) puts the pages in the *degraded* state:
  every later put is dropped and counted, with one log line, and gets keep serving what the file
  still holds. An open that fails (no space for the preallocation, an unusable directory) starts it
  degraded and empty. Nothing here raises an I/O error to its caller.

Safe to call from several threads at once: the lock covers only the bookkeeping (and the table entry a
hit rewrites, a small write to the page cache); reads and writes of pages run in parallel. Buffers
passed to ``spill`` are valid during the call only. :meth:`DiskPages.close` waits for the I/O in flight.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kvstore.tiers.base import PageId, Spill, Stored, TierStats
from kvstore.tiers.host import Entry, IndexedTier, PageIndex
from kvstore.tiers.slab import MAX_NAME, Record, Slab, _flat

log = logging.getLogger(__name__)


class DiskPages(IndexedTier):
    """A bounded store of ``page_bytes`` pages in the slab ``directory``/``slab-<name>.kv`` (module doc)."""

    def __init__(self, directory: str | Path, name: str, page_bytes: int, capacity_bytes: int,
                 io: str = "auto") -> None:
        self.page_bytes = int(page_bytes)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._io_in_flight = 0
        self._closed = False
        self._index = PageIndex(0)
        self._clock = 0
        self.slab: Slab | None = None
        try:
            self.slab = Slab(directory, name, page_bytes, capacity_bytes, io=io)
        except OSError as exc:
            self._degrade(f"cannot open the slab in {directory}: {exc.strerror or exc}")
            return
        self._index = PageIndex(self.slab.slots)
        self.stats.capacity_pages = self.slab.slots
        self._rebuild()

    @property
    def slots(self) -> int:
        return self.slab.slots if self.slab is not None else 0

    @property
    def io(self) -> str:
        return self.slab.io if self.slab is not None else ""

    # ---- recovery ---------------------------------------------------------------------
    def _rebuild(self) -> None:
        assert self.slab is not None
        newest: dict[PageId, Record] = {}
        stale: list[int] = []
        try:
            for record in self.slab.records():
                page = (record.namespace, record.key)
                self._clock = max(self._clock, record.generation, record.used)
                if record.length != self.page_bytes:
                    stale.append(record.slot)  # not a page of this tier's size: not ours to serve
                    continue
                held = newest.get(page)
                if held is None or record.generation > held.generation:
                    if held is not None:
                        stale.append(held.slot)
                    newest[page] = record
                else:
                    stale.append(record.slot)
            for slot in stale:
                self.slab.erase(slot)
        except OSError as exc:
            self._degrade(f"reading {self.slab.path} back failed: {exc.strerror or exc}")
            return
        index = self._index
        taken = bytearray(self.slab.slots)
        for record in sorted(newest.values(), key=lambda r: (r.used, r.generation)):  # least recently used first
            index.add(Entry((record.namespace, record.key), record.slot, record.kind, record.checksum, record))
            taken[record.slot] = 1
        index.free = [s for s in range(self.slab.slots - 1, -1, -1) if not taken[s]]
        self.stats.recovered = self.stats.pages = len(index)
        if newest or stale:
            log.info("disk tier %s: %d pages back, %d stale records erased", self.slab.path, len(newest), len(stale))

    # ---- PageTier ---------------------------------------------------------------------
    def put(self, namespace: str, key: bytes, payload: bytes | memoryview, kind: int = 1, checksum: int = 0,
            spill: Spill | None = None) -> list[PageId]:
        """Store one page of exactly ``page_bytes``; returns the pages evicted for room, each passed to
        ``spill`` with its bytes first (a victim whose record fails its check is listed, counted corrupt
        and not spilled). A page held or in flight already is only touched. A degraded tier, or one with
        nothing it may evict, drops the page (``stats.drops``)."""
        data = _flat(payload)
        if data.nbytes != self.page_bytes:
            raise ValueError(f"a {data.nbytes} B page in a tier of {self.page_bytes} B pages")
        key = bytes(key)
        if len(namespace.encode()) > MAX_NAME or len(key) > MAX_NAME:
            raise ValueError(f"namespace and key are at most {MAX_NAME} bytes")
        page = (namespace, key)
        with self._lock:
            held = self._index.entries.get(page)
            if held is not None:
                self._touch(held)
                return []
            if page in self._index.pending:
                return []
            if self.slab is None or self._closed or self.stats.degraded or not self._still_linked():
                self.stats.drops += 1
                return []
            taken = self._index.reserve(page)
            if taken is None:
                self.stats.drops += 1
                return []
            self.stats.evictions += len(taken.victims)
            self._clock += 1
            generation = self._clock
            self._io_in_flight += 1
        slab = self.slab
        stored: Entry | None = None
        try:
            try:
                for victim in taken.victims:
                    if spill is not None:
                        self._spill(victim, spill)
            finally:
                for victim in taken.victims[1:]:  # the first victim's slot takes the page
                    self._retire(victim.slot, in_flight=False)
            try:
                record = slab.write(taken.slot, namespace, key, data, generation, int(kind), int(checksum))
                stored = Entry(page, taken.slot, record.kind, record.checksum, record)
            except OSError as exc:
                self._degrade(f"writing {slab.path} failed: {exc.strerror or exc}")
        finally:
            with self._lock:
                self._index.settle(page)
                if stored is None:
                    self._index.free.append(taken.slot)
                    self.stats.drops += 1
                else:
                    self._index.add(stored)
                    self.stats.writes += 1
                    self.stats.bytes_written += slab.stride
                self.stats.pages = len(self._index)
                self._done_io()
        return [victim.page for victim in taken.victims]

    def get_into(self, namespace: str, key: bytes, out: memoryview) -> Stored | None:
        """Copy the page's bytes into ``out[:page_bytes]``; None if not held, or its record failed its check
        or its read (then dropped and counted corrupt; ``out`` may hold any bytes). A hit marks the page
        recently used. ``out`` 4 KiB aligned with ``page_bytes`` a multiple of 4 KiB is read into without
        a copy under ``O_DIRECT``."""
        dest = _flat(out)
        if dest.nbytes < self.page_bytes:
            raise ValueError(f"out holds {dest.nbytes} B, a page is {self.page_bytes} B")
        page = (namespace, bytes(key))
        with self._lock:
            entry = self._index.entries.get(page)
            if entry is None or self.slab is None or self._closed:
                self.stats.misses += 1
                return None
            entry.readers += 1
            self._io_in_flight += 1
        got: Record | None = None
        failed: OSError | None = None
        try:
            got = self.slab.read_into(entry.slot, dest[:self.page_bytes], expect=entry.record)
        except OSError as exc:
            failed = exc
        finally:
            with self._lock:
                last = self._index.release_reader(entry)
                if got is not None:
                    if not entry.gone:
                        self._touch(entry)
                    self.stats.hits += 1
                else:
                    self.stats.misses += 1
                    if not entry.gone:  # still this page's record: it is bad
                        self._index.detach(entry)
                        self.stats.corrupt += 1
                        self.stats.pages = len(self._index)
                        last = entry.readers == 0
                self._done_io()
        if failed is not None:
            log.warning("disk tier %s: reading slot %d failed (%s); the page is dropped", self.slab.path,
                        entry.slot, failed.strerror or failed)
        if last:
            self._retire(entry.slot)
        return entry.stored() if got is not None else None

    def remove(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            entry = self._index.entries.get((namespace, bytes(key)))
            if entry is None:
                return False
            self._index.detach(entry)
            self.stats.pages = len(self._index)
            now = entry.readers == 0  # else the last reader erases it
        if now:
            self._retire(entry.slot)
        return True

    def close(self) -> None:
        """Stop (later puts are dropped, gets miss), wait for the I/O in flight, close the files."""
        with self._lock:
            self._closed = True
            while self._io_in_flight:
                self._idle.wait()
            if self.slab is not None:
                self.slab.close()

    # ---- helpers ----------------------------------------------------------------------
    def _spill(self, victim: Entry, spill: Spill) -> None:
        """Read ``victim`` back and hand it to ``spill`` (outside the lock: its slot is reserved)."""
        assert self.slab is not None
        try:
            got = self.slab.read(victim.slot)
        except OSError as exc:
            log.warning("disk tier %s: reading slot %d to spill it failed (%s); dropped", self.slab.path,
                        victim.slot, exc.strerror or exc)
            got = None
        record: Record = victim.record
        if got is None or (got[0].namespace, got[0].key, got[0].generation) != (record.namespace, record.key,
                                                                                record.generation):
            with self._lock:
                self.stats.corrupt += 1
            return
        spill(victim.page, victim.kind, victim.checksum, got[1])

    def _retire(self, slot: int, in_flight: bool = True) -> None:
        """Erase ``slot`` (out of the index, used by no one) and free it; a failed erase keeps the slot out
        of use (its old record may come back at a restart, where the check of every read covers it)."""
        assert self.slab is not None
        if in_flight:
            with self._lock:
                if self._closed:
                    return
                self._io_in_flight += 1
        try:
            self.slab.erase(slot)
        except OSError as exc:
            self._degrade(f"erasing in {self.slab.path} failed: {exc.strerror or exc}")
            ok = False
        else:
            ok = True
        with self._lock:
            if ok:
                self._index.free.append(slot)
            if in_flight:
                self._done_io()

    # ---- inside the lock --------------------------------------------------------------
    def _touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used, in memory and in the slab's table (so a restart keeps it)."""
        assert self.slab is not None
        self._index.touch(entry)
        self._clock += 1
        if self.stats.degraded:
            return
        try:
            self.slab.note(entry.record, used=self._clock)
        except OSError as exc:
            self._degrade(f"writing {self.slab.table_path} failed: {exc.strerror or exc}")

    def _done_io(self) -> None:
        self._io_in_flight -= 1
        if self._io_in_flight == 0 and self._closed:
            self._idle.notify_all()

    def _still_linked(self) -> bool:
        assert self.slab is not None
        try:
            if os.fstat(self.slab.fileno()).st_nlink > 0:  # removing the directory unlinks the file
                return True
        except OSError:
            pass
        self._degrade(f"{self.slab.path} was removed under the node")
        return False

    def _degrade(self, why: str) -> None:
        if not self.stats.degraded:
            log.error("disk tier: %s; it stores nothing more (puts are dropped and counted)", why)
            self.stats.degraded = why
