"""A node's logic: namespaces, batched puts, reads, pins with leases.

No gRPC and no sockets here: the gRPC service (``kvstore.server``) and the
data channel (``kvstore.datapath``) both call these methods and translate the
:class:`~kvstore.errors.KvError` they raise. Everything runs on the event
loop thread, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import NodeConfig
from kvstore.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, shown
from kvstore.hostmem import shared_memory_available
from kvstore.ops.base import PageOps
from kvstore.pool.layout import PageLayout, check_keys, check_namespace
from kvstore.pool.movement import SOCKET, Carrier, Landing, page_checksum
from kvstore.pool.pool import PageKind, PagePool, ReadHandle, Reservation
from kvstore.tiers.stack import NamespaceTiers, TierPage, TierRun, TierStack

__all__ = ["MESSAGE_OVERHEAD", "Lease", "Namespace", "Node", "PutBatch", "PutResult", "page_checksum", "page_kind"]

# Room for protobuf framing around the pages of one gRPC message.
MESSAGE_OVERHEAD = 64 << 10


def page_kind(value: int, default: PageKind) -> PageKind:
    """A request's ``PageKind`` field: 0 means ``default``; a value the
    enum does not name is :class:`InvalidArgument`."""
    if not value:
        return default
    try:
        return PageKind(value)
    except ValueError:
        raise InvalidArgument(f"unknown page kind {shown(value)}: expected one of "
                              f"{', '.join(f'{k.value} ({k.name})' for k in PageKind)}") from None


@dataclass(slots=True)
class NamespaceCounters:
    hits: int = 0  # pages a Get found, locally or after a remote fetch
    misses: int = 0
    puts: int = 0
    remote_hits: int = 0  # of the hits, pages fetched from a peer for that Get


@dataclass(slots=True)
class Namespace:
    name: str
    layout: PageLayout
    capacity: int
    pool: PagePool
    counters: NamespaceCounters = field(default_factory=NamespaceCounters)
    below: NamespaceTiers | None = None  # its tiers below the pool (``--tier``), if any


@dataclass(slots=True)
class Lease:
    lease_id: str
    namespace: str
    keys: list[bytes]
    expires_at: float
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Part:
    res: Reservation
    keys: list[bytes]  # the new keys, in slot order
    checksums: list[int] | None = None
    ready: bool = False  # its landing finished: all its bytes are in the slots


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    already_present: int
    evicted: int


class PutBatch:
    """One Put: chunks reserve slots as their bytes arrive (:meth:`write_in`);
    keys become visible only at :meth:`commit`, with the batch's ``kind``
    and (speculative pages) ``expires_at``. :meth:`abort` undoes every
    reservation. ``deadline`` (monotonic seconds, 0 = none) bounds how long
    the batch may hold reserved slots: its carrier stops receiving then and
    aborts (:meth:`time_left`)."""

    def __init__(self, node: "Node", ns: Namespace, kind: PageKind, expires_at: float = 0.0,
                 deadline: float = 0.0) -> None:
        self._node = node
        self.ns = ns
        self.kind = kind
        self.expires_at = expires_at if kind is PageKind.SPECULATIVE else 0.0
        self.deadline = deadline
        self._seen: set[bytes] = set()
        self._parts: list[_Part] = []
        self.kinds: dict[bytes, PageKind] = {}  # a key's own kind, over ``kind`` (pages promoted from a tier)
        self._closed = False

    @property
    def pages(self) -> int:
        return len(self._seen)

    def time_left(self) -> float | None:
        """Seconds until the reservation deadline (None: no deadline)."""
        return max(0.0, self.deadline - time.monotonic()) if self.deadline else None

    def _check(self, keys: Sequence[bytes]) -> None:
        if self._closed:
            raise RuntimeError("batch already committed or aborted")
        check_keys(keys)
        again = next((k for k in keys if k in self._seen), None)
        if again is not None:
            raise InvalidArgument(f"duplicate key {again.hex()} in one batch")
        cfg, page_bytes = self._node.config, self.ns.layout.page_bytes
        total = len(self._seen) + len(keys)
        if total > cfg.max_batch_pages or total * page_bytes > cfg.max_batch_bytes:
            raise ResourceExhausted(
                f"batch of {total} pages ({total * page_bytes} bytes) is over the node's limit of "
                f"{cfg.max_batch_pages} pages / {cfg.max_batch_bytes} bytes; split it"
            )

    def _reserve(self, keys: Sequence[bytes]) -> tuple[list[int], Reservation]:
        self._check(keys)
        pool = self.ns.pool
        new = [i for i, k in enumerate(keys) if k not in pool]
        # Hold the keys already stored while reserving, so this batch cannot
        # evict its own pages; the release marks them recently used.
        present = pool.acquire([k for k in keys if k in pool], promote=False)
        try:
            res = pool.reserve(len(new))
        finally:
            pool.release(present)
        self._seen.update(keys)
        self._parts.append(_Part(res, [keys[i] for i in new]))
        return new, res

    def write_in(self, keys: Sequence[bytes], carrier: Carrier = SOCKET) -> Landing:
        """Reserve slots for the next chunk of keys and return where its
        bytes land (see :class:`~kvstore.pool.movement.Landing`); call the
        landing's ``finish`` once they have all arrived."""
        new, res = self._reserve(keys)
        return self._landing(self._parts[-1], keys, new, res.slots, carrier)

    def _landing(self, part: _Part, keys: Sequence[bytes], new: list[int], slots: Sequence[int],
                 carrier: Carrier) -> Landing:
        def done(stored: list[bytes], sums: list[int], bad: set[bytes]) -> None:
            part.checksums = sums if (self._node.config.checksum or any(sums)) else None
            part.ready = True
            if bad:
                self.discard(bad)

        return Landing(self.ns.pool, keys, new, slots, carrier, self._node.config.checksum, done)

    def write_ahead(self, keys: Sequence[bytes], res: Reservation, carrier: Carrier = SOCKET) -> Landing:
        """The chunk's bytes were written ahead, ``keys[i]`` into
        ``res.slots[i]``, slots reserved before the keys were known (the
        shared-memory path's write-ahead slots, :meth:`PagePool.reserve_free`).
        The batch takes ``res`` over: the slots of keys already stored and the
        unused rest go back to the pool, and the landing (over the new keys,
        in place) computes their checksums from the slots when finished. On
        a refusal ``res`` is left to the caller."""
        self._check(keys)
        if len(keys) > len(res.slots):
            raise InvalidArgument(f"{len(keys)} keys for {len(res.slots)} write-ahead slots")
        pool = self.ns.pool
        new = [i for i, k in enumerate(keys) if k not in pool]
        keep = {res.slots[i] for i in new}
        pool.unreserve(res, [s for s in res.slots if s not in keep])  # res.slots: the new keys' slots, in order
        self._seen.update(keys)
        self._parts.append(_Part(res, [keys[i] for i in new]))
        return self._landing(self._parts[-1], keys, new, list(res.slots), carrier)

    def add(self, keys: Sequence[bytes], pages: Sequence[bytes]) -> None:
        """Validate and copy one chunk of (key, page bytes) (gRPC Put)."""
        if len(keys) != len(pages):
            raise InvalidArgument(f"{len(keys)} keys but {len(pages)} pages")
        page_bytes = self.ns.layout.page_bytes
        for i, page in enumerate(pages):
            if len(page) != page_bytes:
                raise InvalidArgument(
                    f"page #{i} has {len(page)} bytes; namespace {self.ns.name!r} pages are {page_bytes} bytes"
                )
        landing = self.write_in(keys)
        for target, page in zip(landing.targets, pages):
            target[:] = page
        landing.finish()

    def discard(self, keys: set[bytes]) -> int:
        """Drop ``keys`` from the batch before commit (e.g. a failed
        checksum): their reserved slots go back to the pool."""
        dropped = 0
        for part in self._parts:
            keep = [i for i, k in enumerate(part.keys) if k not in keys]
            if len(keep) == len(part.keys):
                continue
            gone = [part.res.slots[i] for i in range(len(part.keys)) if i not in set(keep)]
            self.ns.pool.unreserve(part.res, gone)
            part.keys = [part.keys[i] for i in keep]
            if part.checksums is not None:
                part.checksums = [part.checksums[i] for i in keep]
            dropped += len(gone)
        self._seen -= keys
        return dropped

    def commit(self) -> PutResult:
        """Publish every page whose bytes have all arrived; report what was
        new. A chunk whose landing never finished is not published: its
        slots go back (no partial write is ever visible)."""
        self._closed = True
        stored = evicted = 0
        for part in self._parts:
            evicted += len(part.res.evicted)
            if not part.ready:
                self.ns.pool.abort(part.res)
                self._seen.difference_update(part.keys)
                continue
            kind = [self.kinds.get(k, self.kind) for k in part.keys] if self.kinds else self.kind
            stored += self.ns.pool.commit(part.res, part.keys, kind, part.checksums, self.expires_at)
        self.ns.counters.puts += stored
        return PutResult(stored, len(self._seen) - stored, evicted)

    def abort(self) -> None:
        """Give back every reserved slot; safe after commit and twice."""
        self._closed = True
        for part in self._parts:
            self.ns.pool.abort(part.res)


class Node:
    """Namespaces of page pools on one device, with leases."""

    def __init__(self, config: NodeConfig, ops: PageOps, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.ops = ops
        self.node_id = config.node_id or config.listen
        self.namespaces: dict[str, Namespace] = {}
        self.leases: dict[str, Lease] = {}
        # listener(namespace, added_keys, removed_keys): the cluster directory outbox
        self.listeners: list[Callable[[str, list[bytes], list[bytes]], None]] = []
        self._clock = clock
        self.started_at = clock()
        self.address = config.listen  # replaced by the bound address once serving
        # host pools live in memfds that clients on this host map (the shared-memory path)
        self.shares_memory = config.shm and ops.host_visible and shared_memory_available()
        self.tiers = TierStack(config, ops.host_visible, allocate_host=ops.host_empty)
        for spec in config.namespace:
            self.create_namespace(spec.name, PageLayout(spec.page_bytes), spec.capacity)

    # ---- namespaces ----------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(ns.capacity for ns in self.namespaces.values())

    def create_namespace(self, name: str, layout: PageLayout, capacity: int = 0,
                         exist_ok: bool = False) -> Namespace:
        check_namespace(name)
        page_limit = self.config.max_message_bytes - MESSAGE_OVERHEAD
        if layout.page_bytes > page_limit:
            raise InvalidArgument(f"page_bytes {layout.page_bytes} is over {page_limit}: a page must fit one gRPC "
                                  f"message (raise --max-message-bytes)")
        existing = self.namespaces.get(name)
        if existing is not None:
            if exist_ok and existing.layout == layout:
                return existing
            raise AlreadyExists(f"namespace {shown(name)} exists with layout {existing.layout}")
        free = self.config.capacity - self.reserved_bytes
        if not capacity and free <= 0:
            raise ResourceExhausted(f"namespace {name!r}: the node's capacity is all reserved by other namespaces")
        capacity = capacity or free
        if capacity > free:
            raise ResourceExhausted(f"namespace {name!r} asks for {capacity} bytes; {free} unreserved")
        num_slots = capacity // layout.page_bytes
        if num_slots == 0:
            raise ResourceExhausted(
                f"namespace {name!r}: capacity {capacity} bytes holds no page of {layout.page_bytes} bytes"
            )
        pool = PagePool(self.ops, num_slots, layout.page_bytes, prefault=self.config.prefault,
                        shared=self.shares_memory,
                        on_change=lambda added, removed: self._changed(name, added, removed))
        ns = Namespace(name, layout, num_slots * layout.page_bytes, pool)
        self.namespaces[name] = ns
        if self.tiers:
            ns.below = self.tiers.attach(self, ns)
            if self.listeners:  # (at start there are none yet: the directory's first report is a snapshot)
                recovered = ns.below.recovered()  # a disk tier's pages from before a restart
                if recovered:
                    self.report(name, recovered, [])
        return ns

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            check_namespace(name)
            raise NotFound(f"unknown namespace {shown(name)}")
        return ns

    def delete_namespace(self, name: str) -> None:
        ns = self.namespace(name)
        if ns.pool.pinned_slots:
            raise InvalidArgument(f"namespace {shown(name)} has pinned pages; unpin them first")
        for lease_id in [lid for lid, lease in self.leases.items() if lease.namespace == name]:
            self._drop_lease(lease_id)
        del self.namespaces[name]
        gone = ns.pool.keys() + [p.key for p in ns.below.recovered()] if ns.below else ns.pool.keys()
        self.tiers.detach(name)
        self.report(name, [], list(dict.fromkeys(gone)))
        ns.pool.close()

    def _changed(self, namespace: str, added: list[Any], removed: list[bytes]) -> None:
        """The pool's adds and removes; a page removed from the pool but held below it is still this node's
        (reported with its tier)."""
        ns = self.namespaces.get(namespace)
        below = ns.below if ns is not None else None
        if below is not None:
            if added and self.config.tier_write == "through":
                below.write_through(added)
            if removed:
                levels = [below.level_of(k) for k in removed]
                if any(levels):
                    added = [*added, *(TierPage(k, 1, tier=lv) for k, lv in zip(removed, levels) if lv)]
                    removed = [k for k, lv in zip(removed, levels) if not lv]
        self.report(namespace, added, removed)

    def report(self, namespace: str, added: list[Any], removed: list[bytes]) -> None:
        """Tell the listeners (the directory outbox) of pages added (pool entries or tier pages) and removed."""
        for listener in self.listeners:
            listener(namespace, added, removed)

    def snapshot(self) -> dict[str, list[Any]]:
        """Every page this node holds, per namespace: pool entries, then the pages only its tiers hold."""
        out: dict[str, list[Any]] = {}
        for ns in self.namespaces.values():
            pages: list[Any] = [ns.pool.entry(k) for k in ns.pool.keys()]
            if ns.below is not None:
                pages += [p for p in ns.below.recovered() if p.key not in ns.pool and p.key not in ns.below.hidden]
                pages += [TierPage(k, s.kind) for k, s in ns.below.staged.items() if k not in ns.pool]
            out[ns.name] = pages
        return out

    # ---- pages ---------------------------------------------------------
    def begin_put(self, name: str, kind: PageKind = PageKind.PRIMARY, *, expires_at: float = 0.0,
                  timeout: float | None = None) -> PutBatch:
        """A put batch; ``timeout`` (default ``--transfer-timeout``) bounds how
        long it may hold reserved slots waiting for bytes."""
        timeout = self.config.transfer_timeout if timeout is None else timeout
        return PutBatch(self, self.namespace(name), kind, expires_at, time.monotonic() + timeout)

    def check_read_batch(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        check_keys(keys, allow_duplicates=True)
        if len(keys) > self.config.max_batch_pages:
            raise ResourceExhausted(f"batch of {len(keys)} keys is over the limit of {self.config.max_batch_pages}")

    def acquire(self, name: str, keys: Sequence[bytes]) -> tuple[Namespace, ReadHandle]:
        """Hold the found pages for reading; count hits and misses."""
        ns = self.namespace(name)
        self.check_read_batch(ns, keys)
        handle = ns.pool.acquire(keys)
        hits = len(handle.entries)
        ns.counters.hits += hits
        ns.counters.misses += len(keys) - hits
        return ns, handle

    def lookup(self, name: str, keys: Sequence[bytes]) -> int:
        """Length of the longest leading run of ``keys`` this node holds, in its pool or below it."""
        return sum(run.pages for run in self.tier_runs(name, keys))

    def tier_runs(self, name: str, keys: Sequence[bytes]) -> list[TierRun]:
        """The longest leading run of ``keys`` this node holds, as runs by the tier holding them, each with
        the expected time to load it into the pool."""
        ns = self.namespace(name)
        self.check_read_batch(ns, keys)
        if ns.below is not None:
            return ns.below.runs(keys)
        n = ns.pool.prefix_length(keys)
        return [TierRun("pool", n, 0.0)] if n else []

    async def promote(self, name: str, keys: Sequence[bytes], timeout: float | None) -> None:
        """Bring the pages of ``keys`` held below the pool into it, waiting at most ``timeout`` seconds
        (the rest keeps landing); a no-op without tiers."""
        ns = self.namespace(name)
        if ns.below is not None:
            await ns.below.promote(keys, timeout)

    def exists(self, name: str, keys: Sequence[bytes]) -> list[bool]:
        ns = self.namespace(name)
        self.check_read_batch(ns, keys)
        if ns.below is None:
            return ns.pool.exists(keys)
        return [k in ns.pool or ns.below.holds(k) for k in keys]

    def delete(self, name: str, keys: Sequence[bytes]) -> tuple[int, list[bytes], list[bytes]]:
        ns = self.namespace(name)
        self.check_read_batch(ns, keys)
        below = ns.below
        if below is None:
            return ns.pool.delete(keys)
        erased = set(below.remove(keys))  # a page pinned below stays, like a pinned page in the pool
        deleted, not_found, pinned = ns.pool.delete(keys)
        deleted += sum(1 for k in not_found if k in erased)
        pinned += [k for k in not_found if below.pins.get(k)]
        not_found = [k for k in not_found if k not in erased and not below.pins.get(k)]
        # the pool reported the pages it deleted; those only below are gone from this node too
        self.report(name, [], [k for k in erased if k not in ns.pool])
        return deleted, not_found, pinned

    # ---- leases --------------------------------------------------------
    def pin(self, name: str, keys: Sequence[bytes], ttl: float) -> tuple[Lease, list[bytes]]:
        """Pin the pages present for ``ttl`` seconds: (lease, missing keys)."""
        ns = self.namespace(name)
        self.check_read_batch(ns, keys)
        if not (ttl > 0 and ttl <= self.config.max_pin_ttl):  # also rejects NaN
            raise InvalidArgument(f"ttl_seconds must be in (0, {self.config.max_pin_ttl}], got {ttl}")
        pinned, missing = ns.pool.pin(dict.fromkeys(keys))
        if ns.below is not None and missing:
            below = ns.below.pin(missing)
            pinned += below
            missing = [k for k in missing if k not in set(below)]
        lease = Lease(secrets.token_hex(8), name, pinned, self._clock() + ttl)
        self.leases[lease.lease_id] = lease
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # pure-logic use (tests): expire_leases() does it
        if loop is not None:
            lease.timer = loop.call_later(ttl, self._drop_lease, lease.lease_id)
        return lease, missing

    def unpin(self, name: str, lease_id: str) -> int:
        check_namespace(name)
        lease = self.leases.get(lease_id)
        if lease is None or lease.namespace != name:
            raise NotFound(f"no lease {shown(lease_id)} in namespace {shown(name)} (expired or released)")
        return self._drop_lease(lease_id)

    def expire_leases(self) -> int:
        """Drop every lease past its expiry (the timers normally do this)."""
        now = self._clock()
        expired = [lid for lid, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self._drop_lease(lease_id)
        return len(expired)

    def _drop_lease(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        if lease.timer is not None:
            lease.timer.cancel()
        ns = self.namespaces.get(lease.namespace)
        if ns is None:
            return 0
        rest = ns.below.unpin(lease.keys) if ns.below is not None else lease.keys
        return ns.pool.unpin(rest) + len(lease.keys) - len(rest)

    def close(self) -> None:
        for lease_id in list(self.leases):
            self._drop_lease(lease_id)
        self.tiers.close()
        for ns in self.namespaces.values():
            ns.pool.close()

    def uptime(self) -> float:
        return self._clock() - self.started_at
