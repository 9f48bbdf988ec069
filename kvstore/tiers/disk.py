"""Pages of one size on local disk: one slab file (:mod:`kvstore.tiers.slab`) and its index.

:class:`DiskPages` keeps which slot holds which (namespace, key), the free slots, the least recently
used order and the generation counter, and turns the slab into a bounded page store:

* **put** writes a page into a free slot, or into the least recently used page's slot when none is free
  (that page is evicted and counted). A key names its content, so a page put again is only touched.
* **get** reads and checks a page; one that fails its checksum is dropped, counted and its slot erased.
* **rebuild** (at open): a scan of the slab's headers; where a key has two records (a crash between a
  write and the erase of an older record), the newer generation wins and the other is erased. A
  restarted node serves what it held.
* **failures**: a write that fails (``EIO``, ``ENOSPC`` on a filesystem that did not honour the
  preallocation) or a slab file whose directory was removed under the node (``st_nlink == 0``; the
  open descriptor keeps working, so nothing else would notice) puts the pages in the *degraded* state:
  every later put is dropped and counted, with one log line, and gets keep serving what the file
  still holds. An open that fails (no space for the preallocation, an unusable directory) starts it
  degraded and empty. Nothing here raises an I/O error to its caller.

Blocking I/O under one lock: callers run it off the event loop (one worker thread per tier is enough to
keep the disk busy with large pages; several readers on one slab would need per-slot locking).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvstore.tiers.slab import Slab

log = logging.getLogger(__name__)

PageId = tuple[str, bytes]  # (namespace, key)


@dataclass(slots=True)
class DiskStats:
    pages: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    bytes_written: int = 0   # what the tier wrote (headers and padding included): the SSD's wear
    evictions: int = 0
    corrupt: int = 0         # records that failed their checksum on read (dropped)
    drops: int = 0           # puts not stored: the tier is degraded
    recovered: int = 0       # pages found at open
    degraded: str = ""       # why the tier stopped writing ("" while it writes)


class DiskPages:
    """A bounded store of ``page_bytes`` pages in the slab ``directory``/``slab-<name>.kv`` (module doc)."""

    def __init__(self, directory: str | Path, name: str, page_bytes: int, capacity_bytes: int,
                 io: str = "auto") -> None:
        self.page_bytes = int(page_bytes)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._slot: dict[PageId, int] = {}
        self._lru: OrderedDict[PageId, None] = OrderedDict()  # least recently used first
        self._generation = 0
        self._free: list[int] = []
        self.slab: Slab | None = None
        try:
            self.slab = Slab(directory, name, page_bytes, capacity_bytes, io=io)
        except OSError as exc:
            self._degrade(f"cannot open the slab in {directory}: {exc.strerror or exc}")
            return
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
        newest: dict[PageId, tuple[int, int]] = {}  # page -> (generation, slot)
        stale: list[int] = []
        try:
            for record in self.slab.scan():
                page = (record.namespace, record.key)
                self._generation = max(self._generation, record.generation)
                if record.length != self.page_bytes:
                    stale.append(record.slot)  # not a page of this tier's size: not ours to serve
                    continue
                held = newest.get(page)
                if held is None or record.generation > held[0]:
                    if held is not None:
                        stale.append(held[1])
                    newest[page] = (record.generation, record.slot)
                else:
                    stale.append(record.slot)
            for slot in stale:
                self.slab.erase(slot)
        except OSError as exc:
            self._degrade(f"reading {self.slab.path} back failed: {exc.strerror or exc}")
            return
        for page, (_, slot) in sorted(newest.items(), key=lambda item: item[1][0]):  # oldest first
            self._slot[page] = slot
            self._lru[page] = None
        used = set(self._slot.values())
        self._free = [s for s in range(self.slab.slots - 1, -1, -1) if s not in used]
        self.stats.recovered = self.stats.pages = len(self._slot)
        if self._slot or stale:
            log.info("disk tier %s: %d pages back, %d stale records erased", self.slab.path, len(self._slot),
                     len(stale))

    # ---- pages ------------------------------------------------------------------------
    def __contains__(self, page: PageId) -> bool:
        return page in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def pages(self) -> list[PageId]:
        """Every page held, least recently used first."""
        with self._lock:
            return list(self._lru)

    def put(self, namespace: str, key: bytes, payload: bytes | memoryview) -> list[PageId]:
        """Store one page; returns the pages evicted to make room. A page already held is only touched (a
        key names its content). A degraded tier drops the page (counted)."""
        page = (namespace, key)
        if memoryview(payload).nbytes > self.page_bytes:
            raise ValueError(f"a {memoryview(payload).nbytes} B page in a tier of {self.page_bytes} B pages")
        with self._lock:
            if page in self._slot:
                self._lru.move_to_end(page)
                return []
            if self.slab is None or self.stats.degraded or not self._still_linked():
                self.stats.drops += 1
                return []
            evicted: list[PageId] = []
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(iter(self._lru))
                slot = self._slot.pop(victim)
                del self._lru[victim]
                evicted.append(victim)
                self.stats.evictions += 1
            self._generation += 1
            try:
                self.slab.write(slot, namespace, key, payload, self._generation)
            except OSError as exc:
                self._free.append(slot)
                self.stats.drops += 1
                self.stats.pages = len(self._slot)
                self._degrade(f"writing {self.slab.path} failed: {exc.strerror or exc}")
                return evicted
            self.stats.writes += 1
            self.stats.bytes_written += self.slab.stride
            self._slot[page] = slot
            self._lru[page] = None
            self.stats.pages = len(self._slot)
            return evicted

    def get(self, namespace: str, key: bytes) -> memoryview | None:
        """The page's bytes, or None (not held, or its record failed its checksum: dropped)."""
        page = (namespace, key)
        with self._lock:
            slot = self._slot.get(page)
            if slot is None or self.slab is None:
                self.stats.misses += 1
                return None
            try:
                got = self.slab.read(slot)
            except OSError as exc:
                log.warning("disk tier %s: reading slot %d failed: %s", self.slab.path, slot, exc.strerror or exc)
                got = None
            if got is None or (got[0].namespace, got[0].key) != page:
                self.stats.corrupt += 1
                self.stats.misses += 1
                self._forget(page)
                return None
            self._lru.move_to_end(page)
            self.stats.hits += 1
            return got[1]

    def remove(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return self._forget((namespace, key))

    def close(self) -> None:
        with self._lock:
            if self.slab is not None:
                self.slab.close()

    # ---- inside the lock --------------------------------------------------------------
    def _forget(self, page: PageId) -> bool:
        slot = self._slot.pop(page, None)
        if slot is None:
            return False
        del self._lru[page]
        self._erase(slot)
        self.stats.pages = len(self._slot)
        return True

    def _erase(self, slot: int) -> None:
        assert self.slab is not None
        try:
            self.slab.erase(slot)
            self._free.append(slot)
        except OSError as exc:  # the slot keeps its old record: a rebuild may find it; never reuse it
            self._degrade(f"erasing in {self.slab.path} failed: {exc.strerror or exc}")

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
