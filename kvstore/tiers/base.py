"""What every tier below the pool offers the tier stack (:mod:`kvstore.tiers.stack`).

A tier holds pages of one size, each under a ``(namespace, key)`` and with its kind (primary or
replica, the pool's :class:`~kvstore.pool.pool.PageKind` value) and the xxh3-64 checksum the pool
computed of its bytes (0 = none; a tier may use it as the checksum of what it stores, since a page whose
bytes no longer match it fails the check when read back). It is a bounded store with its own eviction (least recently used within
a namespace's share, see :meth:`PageTier.set_share`); pages the stack holds (pins) are never evicted.
Its calls block (a disk tier does I/O) and are made from the stack's worker threads, never from the
event loop; an implementation is safe to call from several threads at once.

Two implementations: :class:`~kvstore.tiers.host.HostPages` (host memory) and
:class:`~kvstore.tiers.disk.DiskPages` (a slab file on local disk). The same tests run over both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

PageId = tuple[str, bytes]
"""(namespace, key)."""

Spill = Callable[[PageId, int, int, memoryview], None]
"""Called with (page, kind, checksum, bytes) for each page a put evicts, before its bytes are
overwritten: where the stack cascades a tier's evictions into the next tier down."""


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (read without the tier's lock: a snapshot may be a moment stale)."""

    pages: int = 0
    capacity_pages: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    bytes_written: int = 0   # what the tier wrote, headers and padding included (a disk's wear)
    evictions: int = 0
    corrupt: int = 0         # records that failed their checksum on read (dropped, never served)
    drops: int = 0           # puts not stored: the tier is degraded
    recovered: int = 0       # pages found at open (a restarted node's disk pages)
    degraded: str = ""       # why the tier stopped storing ("" while it stores)


@dataclass(frozen=True, slots=True)
class Stored:
    """A page as a tier holds it."""

    page: PageId
    kind: int
    checksum: int


class PageTier(Protocol):
    """A bounded page store below the pool (module doc)."""

    page_bytes: int
    stats: TierStats

    def __contains__(self, page: PageId) -> bool: ...

    def __len__(self) -> int: ...

    def put(self, namespace: str, key: bytes, payload: bytes | memoryview, kind: int = 1, checksum: int = 0,
            spill: Spill | None = None) -> list[PageId]:
        """Store one page; returns the pages evicted for room (each passed to ``spill`` first, with its
        bytes, when given). A page already held is only touched. A degraded tier drops it (counted)."""
        ...

    def get_into(self, namespace: str, key: bytes, out: memoryview) -> Stored | None:
        """Copy the page's bytes into ``out`` (``page_bytes`` long); None if not held or its record is
        corrupt (then dropped and counted). A hit marks the page recently used."""
        ...

    def remove(self, namespace: str, key: bytes) -> bool: ...

    def pages(self) -> list[Stored]:
        """Every page held, least recently used first."""
        ...

    def set_share(self, namespace: str, max_pages: int) -> None:
        """At most ``max_pages`` of ``namespace`` (a tenant's share of the tier): a put over it evicts that
        namespace's least recently used page, never another namespace's. Without a share a namespace
        competes for the whole tier."""
        ...

    def hold(self, page: PageId) -> bool:
        """Keep ``page`` from eviction until :meth:`unhold` (a pin); False if not held here."""
        ...

    def unhold(self, page: PageId) -> None: ...

    def close(self) -> None: ...
