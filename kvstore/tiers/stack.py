"""The tiers below each namespace's pool: what the pool evicts goes down, a read brings it back up.

:class:`TierStack` is the node's (one per node, from ``--tier``): the tier specs, their worker threads and
the staging budget. :class:`NamespaceTiers` is one namespace's view of it: one
:class:`~kvstore.tiers.base.PageTier` per spec (a host buffer, a slab file per disk), sized as the
namespace's share of the node (its pool capacity over the node's), so a tenant's quota holds in every tier.

**Down (demotion).** When the pool evicts pages for room, or drops speculative copies whose forecast
ended (:meth:`NamespaceTiers.demote`, called by the pool while their slots still hold their bytes), each
page not already below is copied into host *staging* memory and queued for a write into the first tier,
where the admission (``--tier-admit``) takes it; it stays readable from staging until written. The
staging memory is bounded node-wide (``--tier-staging``): an eviction that finds it full drops the page
(counted). A request never waits on a write. A speculative copy goes down as a replica: it sinks with
its forecast (:mod:`kvstore.pool.room`). Each tier
evicts on its own (least recently used within the namespace's share); what the first tier evicts cascades
into the next, and what the last evicts is gone. With ``--tier-write through`` every committed page is
also copied down in the background, so an eviction finds it below already and writes nothing.

**Up (promotion).** A read that misses the pool (:meth:`NamespaceTiers.promote`) brings the pages it finds
below into the pool: one job per page, single-flight (a second reader waits for the first), reads of one
batch in parallel on the tier's threads, each page committed as soon as its bytes landed and matched the
checksum the pool computed when it was first stored. The caller waits until its deadline and then serves
what arrived; the rest still lands. The copy below stays (so the next eviction of the page writes
nothing). A page's kind, checksum and pins travel with it; a Pin on a page below the pool holds it in its
tier (never evicted there) and moves into the pool with it.

**Threads.** Everything here runs on the event loop thread except the tier calls, which run on each
tier's reader and writer threads; their results come back with ``call_soon_threadsafe``. Without a
running loop (pure-logic use in tests) the tier calls run inline.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import xxhash

from kvstore.config import NodeConfig, TierSpec
from kvstore.hostmem import as_bytes, copy_into
from kvstore.pool.movement import page_checksum
from kvstore.pool.pool import Entry, PageKind
from kvstore.tiers.admission import Admission, admission_for
from kvstore.tiers.base import PageId, PageTier, Stored


class Node(Protocol):
    """What the stack uses of its node (``kvstore.node.Node``): a put batch to promote into, and the
    directory listeners to tell of pages gone."""

    def begin_put(self, name: str, kind: PageKind = ..., *, expires_at: float = ...,
                  timeout: float | None = ...) -> Any: ...

    def report(self, namespace: str, added: list[Any], removed: list[bytes]) -> None: ...


Namespace = Any  # kvstore.node.Namespace: name, layout, capacity, pool

log = logging.getLogger(__name__)
T = TypeVar("T")

IO_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the tier I/O latency histograms."""

PREPARED_MIN = 256 << 10
"""Staging rows of pages at least this large are mapped ahead (:class:`StagingRows`)."""

MOVE_WAIT_S = 1.0
"""Longest a read waits for its page to land in the next tier down while a cascading put moves it."""

STAGING = "staging"
"""The tier name of a page waiting in staging memory for its write down."""


@dataclass(slots=True)
class Histogram:
    """Counts of observations per bucket of :data:`IO_BUCKETS` (the last: above them), and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(IO_BUCKETS) + 1))
    total: float = 0.0

    @property
    def bounds(self) -> tuple[float, ...]:
        return IO_BUCKETS

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(IO_BUCKETS) and seconds > IO_BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.total += seconds


@dataclass(slots=True)
class LevelCounters:
    """What the stack counts per tier (on top of the tier's own :class:`~kvstore.tiers.base.TierStats`)."""

    demotions: int = 0       # pages written into this tier (from the pool or cascaded from the tier above)
    promotions: int = 0      # pages read from this tier into the pool
    drops: int = 0           # pages that could not go down: staging full (first tier) or the tier refused
    declined: int = 0        # pages not written down by choice (--tier-admit reused: never read)
    mismatched: int = 0      # pages read back whose bytes did not match the pool's checksum (dropped)
    reads: Histogram = field(default_factory=Histogram)
    writes: Histogram = field(default_factory=Histogram)
    read_seconds_per_page: float = 0.0  # moving average of measured reads (0: none measured yet)
    readup_seconds: float = 0.0  # moving average of a read-up's time beyond its pages' reads (a worker's turn,
                                 # the promotion into the pool): what a run on this tier costs however short


class Pace:
    """A byte rate shared by threads: :meth:`take` blocks the calling worker until its bytes fit the rate
    (each caller is given the next ``nbytes / rate`` seconds of the device after those already given
    out). A rate of 0 takes nothing."""

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = float(rate)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def delay(self, nbytes: int, now: float) -> float:
        """Reserve ``nbytes`` at ``now``: the seconds until they have passed (pure: the caller sleeps)."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            self._free_at = max(now, self._free_at) + nbytes / self.rate
            return self._free_at - now

    def take(self, nbytes: int) -> None:
        wait = self.delay(nbytes, time.monotonic())
        if wait > 0:
            time.sleep(wait)


@dataclass(slots=True)
class Level:
    """One tier spec of the node: its worker threads and counters, shared by the namespaces, and its
    disk's paces (``--tier-read-rate``, ``--tier-write-rate``; a host tier is not paced)."""

    name: str
    spec: TierSpec
    readers: ThreadPoolExecutor
    writers: ThreadPoolExecutor
    counters: LevelCounters = field(default_factory=LevelCounters)
    lock: threading.Lock = field(default_factory=threading.Lock)  # counters written from worker threads
    read_pace: Pace = field(default_factory=Pace)
    write_pace: Pace = field(default_factory=Pace)
    reading: int = 0  # reads given to this tier (queued for a worker or under way) and not finished

    def page_seconds(self, nbytes: int, threads: int) -> float:
        """Seconds one more page of ``nbytes`` adds to a read-up from this tier: the measured read time per page,
        ``threads`` reading at once, and no less than its disk's pace gives a page (a paced disk reads one
        page at a time at its rate, however many threads wait on it)."""
        measured = self.counters.read_seconds_per_page / max(1, threads)
        return max(measured, nbytes / self.read_pace.rate) if self.read_pace.rate > 0 else measured

    def backlog_seconds(self, nbytes: int, threads: int, own: int = 0) -> float:
        """Seconds of reads this tier was given before a new one, ``own`` of them the asker's own pages (read
        for it already: no queue ahead of it): a read-up waits its turn behind the others."""
        return max(0, self.reading - own) * self.page_seconds(nbytes, threads)

    def observe_read(self, seconds: float) -> None:
        with self.lock:
            self.counters.reads.observe(seconds)
            avg = self.counters.read_seconds_per_page
            self.counters.read_seconds_per_page = seconds if avg == 0 else 0.8 * avg + 0.2 * seconds

    def observe_readup(self, seconds: float, pages: int, nbytes: int, threads: int, behind: float = 0.0) -> None:
        """A read-up of ``pages`` pages of ``nbytes`` from this tier into the pool took ``seconds``, ``behind`` of
        them waiting for the reads given to the tier before it: its time beyond that wait and the pages' reads
        (:meth:`page_seconds`) is the fixed cost of one."""
        with self.lock:
            c = self.counters
            fixed = max(0.0, seconds - behind - pages * self.page_seconds(nbytes, threads))
            c.readup_seconds = fixed if c.readup_seconds == 0 else 0.8 * c.readup_seconds + 0.2 * fixed

    def observe_write(self, seconds: float) -> None:
        with self.lock:
            self.counters.writes.observe(seconds)
            self.counters.demotions += 1


@dataclass(slots=True)
class TierPage:
    """A page held below the pool, as the directory outbox reads it (``kvstore.cluster.directory.PageState``)."""

    key: bytes
    kind: int
    expires_at: float = 0.0
    tier: int = 1  # 0: the pool; 1: the first tier below, ...


def _kept_as(entry: Entry) -> int:
    """The kind a pool page keeps below the pool: its own, a speculative copy's a replica's (it sank)."""
    return int(PageKind.REPLICA if entry.kind is PageKind.SPECULATIVE else entry.kind)


@dataclass(slots=True)
class _Staged:
    data: np.ndarray  # one page of bytes
    kind: int
    checksum: int
    row: bool = False  # ``data`` is a row of the staging rows (given back once written)


class StagingRows:
    """Host memory for evicted pages waiting for their write: page-aligned rows (an ``O_DIRECT`` write takes
    them without another copy), kept for reuse once written (their count is bounded by the staging budget).
    :meth:`prepare` maps a page size's rows ahead, in a thread: a fresh row's first copy would otherwise pay
    its page faults on the eviction's path (measured: 4 MiB copies 0.5 ms warm, 5-6 ms fresh)."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()  # prepare's thread adds rows while the loop takes them

    def take(self, page_bytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(page_bytes)
            if free:
                return free.pop()
        return self._row(page_bytes)

    def give(self, row: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(row.nbytes, []).append(row)

    def prepare(self, page_bytes: int, count: int) -> None:
        """Map ``count`` rows of ``page_bytes`` ahead, in one mapping, from a background thread (once per page
        size; pages under 256 KiB fault in a few times per copy, not worth it)."""
        with self._lock:
            if page_bytes in self._free or page_bytes < PREPARED_MIN or count <= 0:
                return
            self._free[page_bytes] = []

        def fill() -> None:
            rows = self._row(page_bytes * count).reshape(count, page_bytes)
            for row in rows:
                self.give(row)

        threading.Thread(target=fill, name="tier-staging", daemon=True).start()

    @staticmethod
    def _row(nbytes: int) -> np.ndarray:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class TierRun:
    """A run of a Lookup's prefix held in one tier, and the expected time to load it from there."""

    tier: str
    pages: int
    load_seconds: float


class TierStack:
    """The node's tiers below the pool (module doc)."""

    def __init__(self, config: NodeConfig, host_visible_pool: bool,
                 allocate_host: Callable[[int], np.ndarray] | None = None) -> None:
        self.config = config
        self.staging_budget = config.tier_staging
        self.staged_bytes = 0
        self.rows = StagingRows()
        self.allocate_host = allocate_host
        self.levels: list[Level] = []
        disks = 0
        for spec in config.tier:
            if spec.kind == "host" and host_visible_pool:
                log.warning("tiers: the pool is host memory already; the host tier is skipped")
                continue
            name = "host" if spec.kind == "host" else f"disk{disks}"
            disks += spec.kind == "disk"
            # one writer per tier: the only thread that puts into it (and cascades from it), so what a put
            # stored is known right after it, without racing another put's evictions
            disk = spec.kind == "disk"
            self.levels.append(Level(name, spec,
                                     ThreadPoolExecutor(config.tier_threads, thread_name_prefix=f"tier-{name}-r"),
                                     ThreadPoolExecutor(1, thread_name_prefix=f"tier-{name}-w"),
                                     read_pace=Pace(config.tier_read_rate if disk else 0.0),
                                     write_pace=Pace(config.tier_write_rate if disk else 0.0)))
        self.namespaces: dict[str, NamespaceTiers] = {}

    def __bool__(self) -> bool:
        return bool(self.levels)

    def attach(self, node: Node, ns: Namespace) -> NamespaceTiers:
        """Open ``ns``'s tiers (a disk tier's pages written before a restart come back) and hook its pool."""
        share = ns.capacity / max(1, self.config.capacity)
        tiers: list[PageTier] = []
        for level in self.levels:
            capacity = int(level.spec.capacity * share)
            if level.spec.kind == "host":
                from kvstore.tiers.host import HostPages
                tiers.append(HostPages(ns.name, ns.layout.page_bytes, capacity, allocate=self.allocate_host))
            else:
                from kvstore.tiers.disk import DiskPages
                tiers.append(DiskPages(level.spec.path, slab_name(ns.name, ns.layout.page_bytes),
                                       ns.layout.page_bytes, capacity, io=self.config.tier_io))
        below = NamespaceTiers(self, node, ns, tiers)
        self.namespaces[ns.name] = below
        if ns.pool.ops.host_visible and self.staging_budget:
            self.rows.prepare(ns.layout.page_bytes, self.staging_budget // ns.layout.page_bytes)
        ns.pool.on_evict = below.demote
        return below

    def detach(self, name: str) -> None:
        """A namespace is deleted: close its tiers and delete its slab files."""
        below = self.namespaces.pop(name, None)
        if below is not None:
            below.close()
            for level in self.levels:
                if level.spec.kind == "disk":  # the slab and what the slab keeps beside it
                    for path in Path(level.spec.path).glob(f"slab-{slab_name(name, below.page_bytes)}.*"):
                        path.unlink(missing_ok=True)

    def summary(self) -> list[dict[str, Any]]:
        """Per tier, its counters summed over the namespaces (``kvctl stats``, the metrics)."""
        out = []
        for i, level in enumerate(self.levels):
            tiers = [below.tiers[i] for below in self.namespaces.values()]
            stats = [t.stats for t in tiers]
            page_bytes = [below.page_bytes for below in self.namespaces.values()]
            out.append(dict(
                tier=level.name, path=level.spec.path,
                io=next((getattr(t, "io", "") for t in tiers if getattr(t, "io", "")), ""),
                capacity_bytes=sum(st.capacity_pages * pb for st, pb in zip(stats, page_bytes)),
                used_bytes=sum(st.pages * pb for st, pb in zip(stats, page_bytes)),
                pages=sum(st.pages for st in stats), hits=sum(st.hits for st in stats),
                misses=sum(st.misses for st in stats), demotions=level.counters.demotions,
                promotions=level.counters.promotions, drops=level.counters.drops,
                declined=level.counters.declined,
                evictions=sum(st.evictions for st in stats),
                corrupt=sum(st.corrupt for st in stats) + level.counters.mismatched,
                bytes_written=sum(st.bytes_written for st in stats), recovered=sum(st.recovered for st in stats),
                degraded="; ".join(sorted({st.degraded for st in stats if st.degraded})),
                staged_bytes=self.staged_bytes if i == 0 else 0,
            ))
        return out

    def close(self) -> None:
        """Stop: the pages waiting in staging are written first (a clean stop loses none of them; at most
        ``--tier-staging`` bytes at the disk's speed), then the tiers close."""
        for level in self.levels:
            level.writers.shutdown(wait=True)
        for level in self.levels:
            level.readers.shutdown(wait=True, cancel_futures=True)
        for below in list(self.namespaces.values()):
            below.close()
        self.namespaces.clear()


def slab_name(namespace: str, page_bytes: int) -> str:
    """A namespace's slab file name: a digest of its name (a client's input never becomes a path) and its
    page size. The records inside name the namespace, so a digest collision serves nothing wrong."""
    return f"ns-{xxhash.xxh3_64_hexdigest(namespace.encode())}-{page_bytes}"


class NamespaceTiers:
    """One namespace's pages below its pool (module doc)."""

    def __init__(self, stack: TierStack, node: Node, ns: Namespace, tiers: list[PageTier]) -> None:
        self.stack = stack
        self.node = node
        self.ns = ns
        self.name = ns.name
        self.page_bytes = ns.layout.page_bytes
        self.tiers = tiers
        self.levels = stack.levels
        self.staged: dict[bytes, _Staged] = {}
        self.pins: Counter[bytes] = Counter()  # pins on pages below the pool
        self.hidden: set[bytes] = set()        # deleted, their removal from the tiers under way
        self._inflight: dict[bytes, asyncio.Future[bool]] = {}
        self.spec_sunk = 0                     # speculative copies sent down (their forecast ended), as replicas
        self.loop: asyncio.AbstractEventLoop | None = None  # where worker results go (None: inline)
        self._cascading = 0  # puts under way whose evictions go into the next tier (written by the writer)
        self._closed = False
        cfg = stack.config
        share = ns.capacity / max(1, cfg.capacity)  # the namespace's share of the budget, as of every tier
        self.admission: Admission | None = admission_for(
            cfg.tier_admit, budget_bytes_s=cfg.tier_write_budget * share,
            tier_bytes=stack.levels[0].spec.capacity * share if tiers else 0.0, page_bytes=self.page_bytes,
            horizon_s=cfg.tier_reuse_horizon) if tiers else None

    # ---- what is held -------------------------------------------------------------------
    def level_of(self, key: bytes) -> int:
        """1 + the index of the fastest tier holding ``key`` (staging counts as the first), 0 if none."""
        if key in self.hidden:
            return 0
        if key in self.staged:
            return 1
        page = (self.name, key)
        for i, tier in enumerate(self.tiers):
            if page in tier:
                return i + 1
        return 0

    def holds(self, key: bytes) -> bool:
        return self.level_of(key) > 0

    def recovered(self) -> list[TierPage]:
        """Every page held below (at open: what a disk tier kept over a restart)."""
        seen: dict[bytes, TierPage] = {}
        for i, tier in enumerate(self.tiers):
            for stored in tier.pages():
                if stored.page[0] == self.name and stored.page[1] not in seen:
                    seen[stored.page[1]] = TierPage(stored.page[1], stored.kind, tier=i + 1)
        return list(seen.values())

    def runs(self, keys: Sequence[bytes]) -> list[TierRun]:
        """Per run of ``keys`` (a prefix the node holds), the tier holding it and the expected load time
        from there (0 for the pool; measured read rates below it, 0 while none is measured). A Lookup's keys:
        the admission counts the evicted ones as asked for again."""
        if self.admission is not None:
            self.admission.seen(keys, time.monotonic())
        out: list[tuple[str, int, float]] = []
        for _, name, cost in self._priced(keys):
            if out and out[-1][0] == name:
                out[-1] = (name, out[-1][1] + 1, out[-1][2] + cost)
            else:
                out.append((name, 1, cost))
        return [TierRun(name, n, seconds) for name, n, seconds in out]

    def _priced(self, keys: Sequence[bytes], prefix: bool = True) -> Iterator[tuple[bytes, str, float]]:
        """The leading ``keys`` the node holds (``prefix`` False: every one it holds), each with where it is
        and its share of the expected time to bring them into the pool: 0 in the pool or staging; below, its
        read (measured per page, shared by the I/O threads, no less than a paced disk's pace), plus once the
        fixed cost of a read-up and once per tier the reads that tier was given already."""
        fixed = True  # one read-up brings every run below the pool: its fixed cost counts once, on the first
        waited: set[int] = set()  # a tier's backlog (the reads it was given already) is waited for once
        threads = self.stack.config.tier_threads
        # read-ups of this prefix's own pages under way (a promotion ahead of a forecast burst, another
        # Get): they are this Lookup's reads, not a queue ahead of them
        own = Counter(self.level_of(k) for k in keys if k in self._inflight) if self._inflight else Counter()
        for key in keys:
            if key in self.ns.pool:
                yield key, "pool", 0.0
                continue
            if key in self.staged and key not in self.hidden:
                yield key, STAGING, 0.0
                continue
            level = self.level_of(key)
            if level == 0:
                if prefix:
                    return
                continue
            lv = self.levels[level - 1]
            cost = lv.page_seconds(self.page_bytes, threads)
            if fixed:
                cost, fixed = cost + lv.counters.readup_seconds, False
            if level not in waited:
                cost += lv.backlog_seconds(self.page_bytes, threads, own.get(level, 0))
                waited.add(level)
            yield key, lv.name, cost

    # ---- down -----------------------------------------------------------------------------
    def demote(self, entries: list[Entry]) -> None:
        """The pool evicted ``entries``, or dropped speculative copies whose forecast ended (their slots
        still hold their bytes): stage them for the first tier, a copy as a replica."""
        if self._closed or not self.tiers:
            return
        todo = []
        for entry in entries:
            if entry.key in self.hidden or self.holds(entry.key):
                continue  # below already (write-through, or promoted from there): nothing to write
            elif self.admission is not None and not self.admission.admit(entry.key, entry.reads, _kept_as(entry),
                                                                          time.monotonic()):
                self.levels[0].counters.declined += 1
            elif self.stack.staged_bytes + (len(todo) + 1) * self.page_bytes > self.stack.staging_budget:
                self.levels[0].counters.drops += 1
            else:
                todo.append(entry)
                self.spec_sunk += entry.kind is PageKind.SPECULATIVE
        self._stage(todo)

    def write_through(self, entries: Sequence[Any]) -> None:
        """Committed pages (``--tier-write through``): copy each one not below yet down in the background,
        within the staging budget (past it the page goes down at its eviction instead)."""
        if self._closed or not self.tiers or self.stack.config.tier_admit != "all":
            return  # (a page is judged at its eviction: nothing is read at its store)
        todo = [e for e in entries if e.kind is not PageKind.SPECULATIVE and e.key not in self.hidden
                and not self.holds(e.key)]
        room = max(0, (self.stack.staging_budget - self.stack.staged_bytes) // self.page_bytes)
        self._stage(todo[:room])

    def _stage(self, entries: Sequence[Any]) -> None:
        """Copy the pool pages of ``entries`` (their slots hold their bytes) into staging memory (counted
        against the budget, which the caller checked) and queue their write into the first tier."""
        if not entries:
            return
        self.stack.staged_bytes += len(entries) * self.page_bytes
        pool = self.ns.pool
        if pool.ops.host_visible:
            for e in entries:
                row = self.stack.rows.take(self.page_bytes)
                copy_into(row, pool.buffer[e.slot])
                self.staged[e.key] = _Staged(row, _kept_as(e), e.checksum, row=True)
        else:  # a device pool: one pack kernel and one download into pinned staging memory
            data = pool.ops.to_host(pool.ops.pack(pool.buffer, [e.slot for e in entries]),
                                    out=pool.ops.host_empty((len(entries), self.page_bytes)))
            for e, row in zip(entries, data):
                self.staged[e.key] = _Staged(row, _kept_as(e), e.checksum)
        keys = [e.key for e in entries]
        self._submit(self.levels[0].writers, self._write_down, keys, lambda lost: self._written(keys, lost))

    def _write_down(self, keys: list[bytes]) -> list[bytes]:
        """(worker) Write staged pages into the first tier (what it evicts cascades down); returns the keys
        it did not store (the tier refused them: degraded, or nothing it may evict)."""
        lost = []
        for key in keys:
            staged = self.staged.get(key)
            if staged is None or self._closed:
                continue
            self._put(0, key, staged.kind, staged.checksum, memoryview(staged.data))
            if (self.name, key) not in self.tiers[0]:
                lost.append(key)
        return lost

    def _put(self, i: int, key: bytes, kind: int, checksum: int, data: memoryview) -> None:
        """(worker) ``key`` into tier ``i``; its evictions into tier ``i + 1``, the last one's are gone."""
        tier, level = self.tiers[i], self.levels[i]
        spill = None
        if i + 1 < len(self.tiers):
            def spill(page: PageId, kind: int, checksum: int, data: memoryview) -> None:
                self._put(i + 1, page[1], kind, checksum, data)
        start = time.perf_counter()
        level.write_pace.take(data.nbytes)
        if spill is not None:
            self._cascading += 1  # its victims move to the next tier, in neither for a moment (_read_any)
        try:
            evicted = tier.put(self.name, key, data, kind, checksum, spill)
        finally:
            if spill is not None:
                self._cascading -= 1
        level.observe_write(time.perf_counter() - start)
        if (self.name, key) not in tier:
            with level.lock:
                level.counters.drops += 1
        if evicted and spill is None:
            self._call_soon(self._gone, [page[1] for page in evicted])
        if self.pins.get(key):
            tier.hold((self.name, key))

    def _written(self, keys: list[bytes], lost: list[bytes] | None) -> None:
        for key in keys:
            self._unstage(key)
        if lost:
            self._gone(lost)

    def _unstage(self, key: bytes, reuse: bool = True) -> None:
        """``key`` leaves staging; its row is reused only once no write may still read it (``reuse``)."""
        staged = self.staged.pop(key, None)
        if staged is not None:
            self.stack.staged_bytes -= self.page_bytes
            if staged.row and reuse:
                self.stack.rows.give(staged.data)

    def _gone(self, keys: list[bytes]) -> None:
        """Pages that left the last tier: the node no longer holds those not in its pool."""
        lost = [k for k in keys if k not in self.ns.pool and not self.holds(k)]
        if lost and not self._closed:
            self.node.report(self.name, [], lost)

    # ---- up -------------------------------------------------------------------------------
    async def promote(self, keys: Sequence[bytes], timeout: float | None) -> int:
        """Bring the pages of ``keys`` held below into the pool; wait at most ``timeout`` seconds (None: until
        all landed), starting no read expected to land after it (:meth:`_in_time`). Only as many come up as
        the pool takes in without evicting a page of ``keys`` (:meth:`room`), leading ones first: a Get of
        more pages than that serves the rest straight from their tiers (:meth:`serve_into`). Returns how many
        of ``keys`` are in the pool now."""
        pool = self.ns.pool
        # with a deadline, read only what is expected to land in time: the rest is the caller's to compute,
        # and its reads would only queue others' behind them
        wanted = keys if timeout is None else self._in_time(keys, timeout)
        room = self.room(keys)
        pool.touch(keys)  # the pool's evictions for these promotions take other pages before the asked ones
        waits = []
        started = time.monotonic()
        first = self.levels[0] if self.tiers else None
        behind = first.backlog_seconds(self.page_bytes, self.stack.config.tier_threads) if first else 0.0
        mine = 0  # reads this call started on the first tier: only a read-up of those alone is timed
        for key in dict.fromkeys(wanted):
            if key in pool:
                continue
            job = self._inflight.get(key)
            level = self.level_of(key) if job is None else 0
            if job is None and level == 0 and not self._cascading:
                continue  # (while a cascading put runs, the page may be on its way down: _read_any)
            if room <= 0:
                break  # the pool holds no more of them at once: the rest stays below
            room -= 1
            if job is None:
                if level == 1 and key not in self.staged:
                    mine += 1
                promotion = self._promote_one(key, level - 1)
                job = self._inflight[key] = (self._given(level - 1, promotion) if level and key not in self.staged
                                             else asyncio.ensure_future(promotion))
                job.add_done_callback(lambda _, k=key: self._inflight.pop(k, None))
            waits.append(job)
        if waits and (timeout is None or timeout > 0):
            done, _ = await asyncio.wait(waits, timeout=timeout)
            if mine and mine == len(waits) == len(done) and self.tiers:
                self.levels[0].observe_readup(time.monotonic() - started, mine, self.page_bytes,
                                              self.stack.config.tier_threads, behind)
        return sum(1 for k in keys if k in pool)

    def room(self, keys: Sequence[bytes]) -> int:
        """How many pages the pool can take in without evicting a page of ``keys``: its free slots and the
        pages it may evict (neither pinned nor being read) that are not among ``keys``."""
        pool = self.ns.pool
        own = sum(1 for k in dict.fromkeys(keys) if k in pool and not pool.held(k))
        return pool.free_slots + pool.evictable() - own

    def _in_time(self, keys: Sequence[bytes], timeout: float) -> Sequence[bytes]:
        """The leading ``keys`` whose expected load into the pool (:meth:`_priced`, priced at this moment,
        with the reads given before) ends within ``timeout`` seconds: a Get's deadline is the time it has
        before its caller computes the rest instead (the load-or-recompute rule decided at the Lookup; the
        disk may have been given others' reads since)."""
        spent = 0.0
        for key, _, cost in self._priced(keys, prefix=False):
            spent += cost
            if spent > timeout:
                return keys[:keys.index(key)]
        return keys

    async def _promote_one(self, key: bytes, i: int) -> bool:
        if i < 0 and (i := await self._landed(key, time.monotonic() + MOVE_WAIT_S) - 1) < 0:
            return False  # it was not on its way down: gone
        try:
            batch = self.node.begin_put(self.name, PageKind.PRIMARY)
            landing = batch.write_in([key])
        except Exception as exc:  # no room in the pool (all pinned), the namespace went away
            log.debug("promotion of %s into %s refused: %s", key.hex(), self.name, exc)
            return False
        try:
            target = memoryview(landing.targets[0]).cast("B")
            staged = self.staged.get(key)
            if staged is not None:
                copy_into(as_bytes(target), as_bytes(staged.data))
                stored: Stored | None = Stored((self.name, key), staged.kind, staged.checksum)
            else:
                stored = await self._read_any(i, key, target)
            if stored is None or self._closed:
                return False
            if landing.finish([stored.checksum]):  # not what the pool stored: never served, dropped below
                if staged is None:
                    self.levels[i].counters.mismatched += 1
                log.warning("tiers: %s page %s came back with other bytes than stored; dropped", self.name,
                            key.hex())
                self.remove([key])
                return False
            batch.kinds[key] = PageKind(stored.kind) if stored.kind in (1, 2) else PageKind.PRIMARY
            if not batch.commit().stored:
                return key in self.ns.pool
        finally:
            landing.abandon()
            batch.abort()
        if staged is None:
            self.levels[i].counters.promotions += 1
        pins = self.pins.pop(key, 0)
        if pins:
            for _ in range(pins):
                self.ns.pool.pin([key])
            for tier in self.tiers:
                tier.unhold((self.name, key))
        return True

    async def _read_any(self, i: int, key: bytes, out: memoryview) -> Stored | None:
        """The page from tier ``i``, or, when it left that tier meanwhile, from where it went. A page leaves a
        tier by a remove, a failed check (then it is gone: a miss at once) or an eviction into the next tier
        during a cascading put, when for a moment it is in neither: while such a put runs, the read waits
        for it (at most :data:`MOVE_WAIT_S`) and looks again."""
        end = time.monotonic() + MOVE_WAIT_S
        while time.monotonic() < end:
            stored = await self._run(self.levels[i].readers, self._read, i, key, out)
            if stored is not None or self._closed or key in self.staged:
                return stored
            await asyncio.sleep(0.001)
            i = await self._landed(key, end) - 1
            if i < 0:
                return None
        return None

    def _given(self, i: int, read: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """``read`` (of a page on tier ``i``) under way, counted as given to that tier from now until it ends:
        a Lookup's price and a Get's deadline wait behind it from the moment it is given, not from when
        its task first runs (a Get that comes in before then would see the tier idle)."""
        level = self.levels[i]
        level.reading += 1  # (the loop thread's count)
        task = asyncio.ensure_future(read)

        def ended(_: Any) -> None:
            level.reading -= 1
        task.add_done_callback(ended)
        return task

    async def _landed(self, key: bytes, end: float) -> int:
        """:meth:`level_of` ``key``, once no cascading put may be moving it down (waiting until ``end``)."""
        while self._cascading and self.level_of(key) == 0 and time.monotonic() < end:
            await asyncio.sleep(0.001)
        return self.level_of(key)

    def _read(self, i: int, key: bytes, out: memoryview) -> Stored | None:
        """(worker) One page from tier ``i``, its read timed (the wait for its disk's pace is
        :meth:`Level.page_seconds`'s floor, not the read's time)."""
        self.levels[i].read_pace.take(out.nbytes)
        start = time.perf_counter()
        stored = self.tiers[i].get_into(self.name, key, out)
        if stored is not None:
            self.levels[i].observe_read(time.perf_counter() - start)
        return stored

    async def read(self, keys: Sequence[bytes]) -> dict[bytes, tuple[np.ndarray, int]]:
        """The bytes and checksums of the pages of ``keys`` held below, read without promoting them (a peer's
        pull); pages not found (or corrupt) are left out."""
        out = np.empty((len(keys), self.page_bytes), dtype=np.uint8)
        read = await self._read_rows(keys, out)
        return {key: (out[i], stored.checksum) for i, (key, stored) in enumerate(zip(keys, read))
                if stored is not None}

    def unpromoted(self, keys: Sequence[bytes], timeout: float | None) -> list[bytes]:
        """Of ``keys`` (those a Get did not find in the pool), the distinct ones held below, in order, that
        it serves straight from their tiers (:meth:`serve_into`): with a deadline ``timeout`` (seconds), the
        leading ones expected to be read within it, priced as a promotion is (:meth:`_in_time`). While a
        cascading put runs, a page on its way into the next tier counts as held (:meth:`_read_any`)."""
        held = [k for k in dict.fromkeys(keys) if k not in self.ns.pool and (self._cascading or self.holds(k))]
        return held if timeout is None else list(self._in_time(held, timeout))

    async def serve_into(self, keys: Sequence[bytes], out: np.ndarray, timeout: float | None = None) -> list[bool]:
        """Read the pages of ``keys`` held below into the rows of ``out`` (``keys[i]`` into ``out[i]``), without
        promoting them: the pages of a Get that its pool cannot take in at once. Each page's bytes are checked
        against the checksum the pool stored it with, as a promotion checks them: one that does not match is
        never served (dropped below and counted). A page on its way into the next tier is waited for at most
        ``timeout`` seconds (and :data:`MOVE_WAIT_S`). Returns per key whether its row holds its page. After a
        cancelled call, worker threads may still write into ``out``: the caller does not reuse it."""
        served = []
        wait = MOVE_WAIT_S if timeout is None else min(MOVE_WAIT_S, timeout)
        read = await self._read_rows(keys, out, moving=time.monotonic() + wait)
        for i, (key, stored) in enumerate(zip(keys, read)):
            ok = stored is not None and (not stored.checksum or page_checksum(out[i]) == stored.checksum)
            if stored is not None and not ok and not self._closed:
                level = self.level_of(key)
                if level and key not in self.staged:
                    self.levels[level - 1].counters.mismatched += 1
                log.warning("tiers: %s page %s came back with other bytes than stored; dropped", self.name,
                            key.hex())
                self.remove([key])
            served.append(ok)
        return served

    async def _read_rows(self, keys: Sequence[bytes], out: np.ndarray, moving: float = 0.0) -> list[Stored | None]:
        """Per key of ``keys``, its page read into ``out``'s row (from staging or the tier holding it, the
        tiers' reads in parallel) and what was stored with it (None: not found, or its record failed its
        check). With ``moving`` (a monotonic time), a page in no tier while a cascading put runs is looked
        for again once it landed (:meth:`_landed`), until then."""
        jobs = []
        got: list[Stored | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            staged = self.staged.get(key)
            if staged is not None:
                out[i] = staged.data
                got[i] = Stored((self.name, key), staged.kind, staged.checksum)
                continue
            level = self.level_of(key)
            if level:
                jobs.append((i, self._given(level - 1, self._read_any(level - 1, key, memoryview(out[i])))))
            elif moving and self._cascading:
                jobs.append((i, asyncio.ensure_future(self._read_landed(key, memoryview(out[i]), moving))))
        results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
        for (i, _), stored in zip(jobs, results):
            if isinstance(stored, Stored):
                got[i] = stored
        return got

    async def _read_landed(self, key: bytes, out: memoryview, end: float) -> Stored | None:
        """The page of ``key``, in no tier for the moment while a cascading put moves it, once it landed (if it
        did by ``end``, a monotonic time)."""
        i = await self._landed(key, end) - 1
        return None if i < 0 else await self._read_any(i, key, out)

    async def settle(self, timeout: float = 30.0) -> bool:
        """Wait until no page waits in staging, no promotion is in flight and no erase is under way (at most
        ``timeout`` seconds; benches and tests); returns whether it settled."""
        end = time.monotonic() + timeout
        while self.staged or self._inflight or self.hidden:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.002)
        return True

    # ---- pins and deletes -----------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin the pages of ``keys`` held below (not in the pool); returns those pinned."""
        pinned = []
        for key in keys:
            level = self.level_of(key)
            if level == 0 or key in self.ns.pool:
                continue
            if self.pins[key] == 0 and key not in self.staged:
                self.tiers[level - 1].hold((self.name, key))
            self.pins[key] += 1
            pinned.append(key)
        return pinned

    def unpin(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop one pin of each key pinned below; returns the keys not pinned here (pinned in the pool)."""
        rest = []
        for key in keys:
            if not self.pins.get(key):
                rest.append(key)
                continue
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]
                for tier in self.tiers:
                    tier.unhold((self.name, key))
        return rest

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Delete ``keys`` from every tier (hidden at once, erased in the background); returns those that
        were held below."""
        held = [k for k in keys if self.holds(k) and not self.pins.get(k)]
        for key in held:
            self.hidden.add(key)
            self._unstage(key, reuse=False)  # its write may be under way

        def erase(keys: list[bytes]) -> None:
            for key in keys:
                for tier in self.tiers:
                    tier.remove(self.name, key)

        if held:
            self._submit(self.levels[0].writers, erase, held, lambda _: self.hidden.difference_update(held))
        return held

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in list(self._inflight.values()):
            job.cancel()
        self.stack.staged_bytes -= len(self.staged) * self.page_bytes
        self.staged.clear()
        for tier in self.tiers:
            tier.close()

    # ---- threads --------------------------------------------------------------------------
    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], arg: Any,
                done: Callable[[Any], None]) -> None:
        """Run ``fn(arg)`` on a worker, then ``done(result)`` on the loop (inline without a loop)."""
        try:
            loop = self.loop = asyncio.get_running_loop()
        except RuntimeError:
            done(fn(arg))
            return

        def finished(future: Any) -> None:
            if future.cancelled():
                return
            exc = future.exception()
            if exc is not None:
                log.error("tier I/O failed in %s: %r", self.name, exc)
            if not loop.is_closed():
                loop.call_soon_threadsafe(done, None if exc else future.result())

        pool.submit(fn, arg).add_done_callback(finished)

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """(worker) Run ``fn`` on the loop thread (inline without a loop)."""
        loop = self.loop
        if loop is None:
            fn(*args)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)
