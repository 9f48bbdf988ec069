"""How page bytes leave and enter a pool: the one movement API.

Every mover of bytes (the data channel, the gRPC service, the TCP and UCX
peer transports, the replicator) states what it accepts as a
:class:`Carrier` and then uses only two calls:

* **read-out** -- :meth:`PagePool.read_out` turns a read hold into an
  :class:`Outgoing`: the pages as the carrier takes them (a list of slot
  views, one contiguous run of slots, or one packed staging buffer, on the
  host or the device) and a ``release`` to call once they are sent;
* **write-in** -- :meth:`kvstore.node.PutBatch.write_in` reserves slots and
  returns a :class:`Landing`: buffers to receive into (the slots themselves
  where the memory and the carrier allow, else a staging buffer) and
  :meth:`Landing.finish`, which moves staged bytes into the slots, computes
  or verifies the checksums and drops pages that fail. The batch commits.

Choosing the form is done here once, so no carrier packs, stages or uploads
on its own. Staging buffers belong to the pool (:class:`StagingBuffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.hostmem import populated_empty
from kvstore.ops.base import PageOps


def page_checksum(page: Any) -> int:
    """xxh3_64 of a page's bytes: computed when stored, verified by peers."""
    return xxhash.xxh3_64_intdigest(page)


def contiguous_run(slots: Sequence[int]) -> slice | None:
    """``slice(a, a+n)`` when ``slots`` are exactly a, a+1, ..., else None."""
    if not slots:
        return None
    first = slots[0]
    if slots[-1] - first + 1 != len(slots) or any(s != first + i for i, s in enumerate(slots)):
        return None
    return slice(first, first + len(slots))


@dataclass(frozen=True, slots=True)
class Carrier:
    """What a mover of bytes accepts.

    ``scatter``: lists of host page views, sent or received one after the
    other (sockets), so host slots move in place whatever their order.
    ``device``: device arrays as they are (UCX moves CuPy memory itself).
    A carrier with neither takes one contiguous host array per transfer.
    """

    scatter: bool = False
    device: bool = False


SOCKET = Carrier(scatter=True)  # the data channel, the TCP transport, gRPC messages


@dataclass(slots=True)
class Outgoing:
    """Pages on their way out, in the form the carrier asked for.

    ``payload`` is None (nothing found), a list of host page views, or one
    contiguous ``[n, page_bytes]`` uint8 array (host or device). Call
    :attr:`release` exactly once the bytes are sent: it ends the read hold
    (when the payload still points into slots) or returns the staging.
    """

    payload: Any
    pages: int
    release: Callable[[], None]


class StagingBuffers:
    """Reusable host buffers, mapped up front, for packed transfers.

    A fresh 64 MiB ``np.empty`` faults page by page on first touch (see
    kvstore.hostmem); reusing a few mapped buffers keeps that off the
    transfer path."""

    def __init__(self, keep: int = 4) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep

    def take(self, n: int, page_bytes: int) -> np.ndarray:
        nbytes = n * page_bytes
        for i, buf in enumerate(self._free):
            if buf.nbytes >= nbytes:
                del self._free[i]
                return buf[:nbytes].reshape(n, page_bytes)
        return populated_empty(1, max(nbytes, 1 << 20))[0][:nbytes].reshape(n, page_bytes)

    def give(self, array: np.ndarray) -> None:
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        flat = base.reshape(-1)
        if len(self._free) < self._keep:
            self._free.append(flat)
        else:  # keep the largest ones
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].nbytes)
            if self._free[smallest].nbytes < flat.nbytes:
                self._free[smallest] = flat


class SlotMemory(Protocol):
    """What movement needs of a pool (``kvstore.pool.pool.PagePool``, which
    imports this module): its memory, its ops and its staging."""

    ops: PageOps
    buffer: Any
    page_bytes: int
    staging: "StagingBuffers"

    def scratch_page(self) -> np.ndarray: ...


def read_out(pool: SlotMemory, slots: Sequence[int], carrier: Carrier,
             release_hold: Callable[[], None]) -> Outgoing:
    """The pages at ``slots`` (held for reading) in the carrier's form.

    Zero copy where possible: host slots as views (scatter carriers) or as
    one run. Otherwise one pack kernel into a staging buffer (downloaded to
    the host unless the carrier takes device memory); the hold then ends at
    once, since the bytes were copied."""
    ops, n = pool.ops, len(slots)
    if not n:
        release_hold()
        return Outgoing(None, 0, lambda: None)
    if ops.host_visible:
        if carrier.scatter:
            return Outgoing([memoryview(pool.buffer[s]) for s in slots], n, release_hold)
        run = contiguous_run(slots)
        if run is not None:
            return Outgoing(pool.buffer[run], n, release_hold)
    try:
        if ops.host_visible:
            staging = pool.staging.take(n, pool.page_bytes)
            ops.pack(pool.buffer, list(slots), out=staging)
        else:
            packed = ops.pack(pool.buffer, list(slots))
            if carrier.device:
                return Outgoing(packed, n, lambda: None)
            staging = pool.staging.take(n, pool.page_bytes)
            ops.to_host(packed, out=staging)
    finally:
        release_hold()
    payload = [memoryview(row) for row in staging] if carrier.scatter else staging
    return Outgoing(payload, n, lambda: pool.staging.give(staging))


class Landing:
    """Where one chunk of a put batch receives its bytes, and its finisher.

    ``targets`` is what the carrier receives into: for a scatter carrier one
    host view per key (a shared scratch page for keys the pool already holds:
    their bytes are read and dropped), else one contiguous array of all the
    chunk's pages. Built by :meth:`kvstore.node.PutBatch.write_in`.

    The four forms, chosen once here:

    ==============  ==================  =======================================
    pool memory     carrier             targets
    ==============  ==================  =======================================
    host            scatter             the slots, one view each (in place)
    host            one array           the slots when they form one run
                                        (in place), else a host staging buffer
    device          device              a device staging array (unpack kernel)
    device          host                a host staging buffer (upload, unpack)
    ==============  ==================  =======================================
    """

    def __init__(self, pool: SlotMemory, keys: Sequence[bytes], new: Sequence[int], slots: Sequence[int],
                 carrier: Carrier, checksum: bool,
                 on_done: Callable[[list[bytes], list[int], set[bytes]], None]) -> None:
        self._pool, self._keys, self._new, self._slots = pool, list(keys), list(new), list(slots)
        self._checksum, self._on_done = checksum, on_done
        self._staging: np.ndarray | None = None  # host staging, returned to the pool
        self._device: Any = None  # device staging
        self._finished = False
        ops, n, page_bytes = pool.ops, len(self._keys), pool.page_bytes
        run = contiguous_run(self._slots) if len(self._new) == n else None
        if ops.host_visible and carrier.scatter:
            scratch = memoryview(pool.scratch_page())
            views = [scratch] * n
            for i, slot in zip(self._new, self._slots):
                views[i] = memoryview(pool.buffer[slot])
            self.targets: Any = views
        elif ops.host_visible and run is not None:
            self.targets = pool.buffer[run]
        elif not ops.host_visible and carrier.device:
            self._device = self.targets = ops.xp.empty((n, page_bytes), dtype=np.uint8)
        else:
            self._staging = pool.staging.take(n, page_bytes)
            self.targets = [memoryview(row) for row in self._staging] if carrier.scatter else self._staging

    @property
    def key_slots(self) -> list[int | None]:
        """Per key of the chunk, its reserved slot (None: the pool already holds it)."""
        out: list[int | None] = [None] * len(self._keys)
        for i, slot in zip(self._new, self._slots):
            out[i] = slot
        return out

    @property
    def in_place(self) -> bool:
        """Whether the bytes land in the slots themselves (no staging)."""
        return self._staging is None and self._device is None

    def finish(self, expected: Sequence[int] | None = None) -> set[bytes]:
        """All bytes have arrived: verify, move them into the slots, hand the
        checksums to the batch. ``expected`` holds one checksum per key of
        the chunk (0 = unknown); keys whose bytes do not match are returned
        and dropped from the batch. Call once; :meth:`abandon` instead when
        the bytes never came."""
        if self._finished:
            raise RuntimeError("landing already finished")
        self._finished = True
        try:
            sums, bad = self._verify(expected)
            good = [j for j, i in enumerate(self._new) if self._keys[i] not in bad]
            if not self.in_place and good:
                self._move([self._new[j] for j in good], [self._slots[j] for j in good])
        finally:
            self._release_staging()
        self._on_done([self._keys[i] for i in self._new], sums, bad)
        return bad

    def abandon(self) -> None:
        """The bytes will not come (error, deadline): return the staging."""
        self._finished = True
        self._release_staging()

    def _verify(self, expected: Sequence[int] | None) -> tuple[list[int], set[bytes]]:
        want = [expected[i] if expected is not None else 0 for i in self._new]
        if not (self._checksum or any(want)):
            return [0] * len(self._new), set()
        rows = self._pool.ops.to_host(self._device) if self._device is not None else self.targets
        sums, bad = [], set()
        for i, w in zip(self._new, want):
            have = page_checksum(rows[i])
            if w and have != w:
                bad.add(self._keys[i])
            sums.append(have)
        return sums, bad

    def _move(self, rows: list[int], slots: list[int]) -> None:
        """Staged rows -> their slots: one upload (host staging on a device
        pool) and one unpack kernel."""
        ops = self._pool.ops
        src = self._device if self._device is not None else self._staging
        chunk = src if len(rows) == len(self._keys) else src[rows]
        if self._device is None and not ops.host_visible:
            chunk = ops.from_host(np.ascontiguousarray(chunk))
        ops.unpack(chunk, slots, self._pool.buffer)

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._pool.staging.give(self._staging)
            self._staging = None
        self._device = None
