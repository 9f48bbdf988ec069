"""A slab file of fixed-size page slots on local disk, and its slot table: the record format of the disk tier.

One preallocated file per slab, ``0600`` in a ``0700`` directory the node owns; its name is fixed
here (``slab-<name>.kv`` with ``name`` from the node's configuration, checked), never built from client
input. The file is a superblock followed by ``slots`` slots of ``stride`` bytes::

    offset 0        superblock (4 KiB): magic, format version, payload capacity, stride, slots, slab id
    4096 + i*stride slot i: a 4 KiB header block, then the payload (``stride - 4096`` bytes, 4 KiB aligned)

A slot's header holds the namespace, the key, the payload length, a generation number (set by the
slab's owner; the newer of two records of one key wins after a crash), the page's kind and the checksum
its owner gave it, and two xxh3-64 checksums: one of the header itself, one of the payload (the owner's
checksum when it gave one, which is the xxh3-64 of the same bytes: not computed again). A record is written in one ``pwritev`` of its header and payload; erasing one zeroes its
header block. What a crash or a torn write can leave:

* a header that does not check (torn inside the header, or never written): the slot is empty;
* a header that checks over a payload that does not (torn inside the payload): :meth:`Slab.read` and
  :meth:`Slab.read_into` find the mismatch, count the record corrupt and return nothing, so it is never
  served.

**The slot table** (``slab-<name>.idx``, beside the slab, same modes) is what makes a restart fast: a
4 KiB header (magic, version, slots, the slab's id) and one 256-byte entry per slot that repeats what
the slot's record header says (generation, kind, checksums, length, namespace and key when they fit
in 200 bytes) plus when the page was last used (a tick of the owner's clock, so the least recently used
order survives a restart). :meth:`Slab.write` writes the entry after the record; :meth:`Slab.erase`
zeroes the header block, then the entry; :meth:`Slab.note` rewrites an entry (a hit). The table goes
through the page cache (small writes, no ``O_DIRECT``): a killed process leaves every completed write
in it, and each entry carries its own xxh3-64, so an entry torn by a kill reads as empty. A restart
(:meth:`Slab.records`) reads the table in one go instead of a header block per slot. The table may lag
the slab by the record a kill interrupted (written, entry not yet): that record's put never returned,
and an entry that names an older record of the slot fails the check every read makes (the header's
namespace, key and generation against the entry's, then the payload's checksum), so a wrong page is
never served. A table that does not match its slab (missing, another slab's id, damaged header) is
rebuilt by :meth:`Slab.scan`, which reads the header blocks in large sequential reads.

A process that is killed leaves every completed ``pwritev`` in the files (the page cache, or the
device under ``O_DIRECT``); a power loss is not covered (there is no ``fsync`` per record).

I/O is blocking and positional (``os.preadv``/``os.pwritev`` on one descriptor, safe from several
threads): callers run it off the event loop. ``io="direct"`` opens the slab with ``O_DIRECT``: a payload
or an ``out`` buffer that is 4 KiB aligned and a multiple of 4 KiB long moves straight between it and
the device; others go through this thread's aligned staging buffer (reused, never mapped per call).
``"buffered"`` uses the page cache (every buffer is used as is) and tells the kernel
(``posix_fadvise``) that access is random and written pages are not read back soon; ``"auto"`` probes
``O_DIRECT`` on the slab's filesystem once and falls back to buffered where it is refused.

**Fault injection, for tests only:** the environment variable ``KVSTORE_TEST_FAIL_READS`` makes record
reads (:meth:`Slab.read`, :meth:`Slab.read_into`) raise ``OSError(EIO)`` as a failing device would: a
value below 1 (``0.25``) fails each read with that probability, a whole number ``N`` fails the next ``N``
reads (counted from when the value is first seen; setting another value starts a new count). Unset,
it costs one dictionary lookup per read.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger(__name__)

BLOCK = 4096
"""Alignment of every offset, length and buffer (the largest logical block size of common devices)."""
IO_MODES = ("auto", "direct", "buffered")
MAX_NAME = 255  # namespace and key bytes, each
FAIL_READS_ENV = "KVSTORE_TEST_FAIL_READS"

_SUPER = struct.Struct("<8sHHQQQQ")  # magic, version, reserved, payload capacity, stride, slots, slab id
_SUPER_MAGIC = b"KVSLAB\x00\x01"
_VERSION = 2
# magic, flags, ns len, key len, generation, length, kind, payload xxh3, owner's checksum
_HEAD = struct.Struct("<4sHBBQIIQQ")
_HEAD_MAGIC = b"KVR2"
_HEAD_SUM = struct.Struct("<Q")  # header xxh3, right after _HEAD
_FIXED = _HEAD.size + _HEAD_SUM.size
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ZERO_BLOCK = bytes(BLOCK)

_TABLE = struct.Struct("<8sHHIQQ")  # magic, version, reserved, reserved, slots, slab id
_TABLE_MAGIC = b"KVSIDX\x00\x01"
ENTRY = 256
# magic, kind, ns len, key len, flags (1: names inline), reserved, generation, used, length, reserved,
# payload xxh3, owner's checksum; then the names (200 bytes), then the entry's xxh3 of bytes 0..248
_ENTRY = struct.Struct("<HBBBBHQQIIQQ")
_ENTRY_MAGIC = 0x4B56
_ENTRY_NAMES = ENTRY - 8 - _ENTRY.size
_ENTRY_SUM = ENTRY - 8
_ZERO_ENTRY = bytes(ENTRY)
_ENTRY_DTYPE = np.dtype([("magic", "<u2"), ("kind", "u1"), ("ns_len", "u1"), ("key_len", "u1"), ("flags", "u1"),
                         ("r0", "<u2"), ("generation", "<u8"), ("used", "<u8"), ("length", "<u4"), ("r1", "<u4"),
                         ("payload_sum", "<u8"), ("checksum", "<u8"), ("names", f"V{_ENTRY_NAMES}"),
                         ("sum", "<u8")])
assert _ENTRY_DTYPE.itemsize == ENTRY

_SCAN_CHUNK = 8 << 20  # bytes per read of a scan where slots are small enough to read whole


def round_up(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class Record:
    """A slot's record as its header (or its table entry) states it. ``used``: the table's last-used tick
    (0 where the record came from a scan)."""

    slot: int
    namespace: str
    key: bytes
    length: int
    generation: int
    kind: int = 1
    checksum: int = 0
    payload_sum: int = 0
    used: int = 0


class Slab:
    """One slab file and its slot table (see the module doc). ``payload_bytes``: the largest page a slot
    holds (a namespace's page size); ``capacity_bytes``: the most the slab file may take, superblock
    included (the table adds ``4096 + 256 * slots`` bytes beside it)."""

    def __init__(self, directory: str | Path, name: str, payload_bytes: int, capacity_bytes: int,
                 io: str = "auto") -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"slab name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        if io not in IO_MODES:
            raise ValueError(f"io mode {io!r}: choose from {', '.join(IO_MODES)}")
        if payload_bytes <= 0:
            raise ValueError("payload_bytes must be > 0")
        self.payload_bytes = int(payload_bytes)
        self.stride = BLOCK + round_up(self.payload_bytes)
        self.slots = max(0, (int(capacity_bytes) - BLOCK) // self.stride)
        if self.slots == 0:
            raise ValueError(f"capacity {capacity_bytes} B holds no slot of {self.stride} B")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = self.directory / f"slab-{name}.kv"
        self.table_path = self.directory / f"slab-{name}.idx"
        self.io = probe_direct(self.directory) if io == "auto" else io
        self.corrupt = 0  # records whose payload did not match its checksum (dropped)
        self.slab_id = 0
        self._fresh = False  # the slab file was (re)made empty at this open
        self.intact_slots = self.slots  # slots whose bytes were all in the file at open
        self._local = threading.local()
        self._zero = _aligned(BLOCK)
        self._fd = -1
        self._table_fd = -1
        self._fd = self._open()
        try:
            self._table_fd, self._table_ok = self._open_table()
        except BaseException:
            self.close()
            raise

    # ---- the files ------------------------------------------------------------------
    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if self.io == "direct":
            flags |= os.O_DIRECT
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = BLOCK + self.slots * self.stride
            found = self._superblock(fd)
            if found is None:
                if os.fstat(fd).st_size:
                    log.warning("slab %s: written with another format version, page size or capacity; starting "
                                "it empty", self.path)
                os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, not at a later write
                self.slab_id = int.from_bytes(os.urandom(8), "little") or 1
                self._write_superblock(fd)
                self._fresh = True
            else:
                self.slab_id = found
                have = os.fstat(fd).st_size
                if have < size:  # truncated: keep what is left, the rest reads as empty slots
                    log.warning("slab %s: %d of %d bytes left; the records past the end are lost", self.path,
                                have, size)
                    self.intact_slots = max(0, (have - BLOCK) // self.stride)
                    os.posix_fallocate(fd, 0, size)
            if self.io == "buffered":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _superblock(self, fd: int) -> int | None:
        """The slab id when the file is a slab of this format and geometry, else None."""
        if os.fstat(fd).st_size < BLOCK:
            return None
        buf = _aligned(BLOCK)
        if os.preadv(fd, [buf], 0) < _SUPER.size:
            return None
        magic, version, _, payload, stride, slots, slab_id = _SUPER.unpack_from(buf)
        if (magic, version, payload, stride, slots) != (_SUPER_MAGIC, _VERSION, self.payload_bytes, self.stride,
                                                        self.slots):
            return None
        return int(slab_id)

    def _write_superblock(self, fd: int) -> None:
        buf = _aligned(BLOCK)
        _SUPER.pack_into(buf, 0, _SUPER_MAGIC, _VERSION, 0, self.payload_bytes, self.stride, self.slots, self.slab_id)
        _write_all(fd, [memoryview(buf)], 0)

    def _open_table(self) -> tuple[int, bool]:
        """The table's descriptor, and whether its entries belong to this slab (else :meth:`records`
        rebuilds them from a scan)."""
        fd = os.open(self.table_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = BLOCK + self.slots * ENTRY
            head = os.pread(fd, _TABLE.size, 0)
            if len(head) == _TABLE.size and _TABLE.unpack(head) == (_TABLE_MAGIC, 1, 0, 0, self.slots, self.slab_id) \
                    and os.fstat(fd).st_size >= size:
                return fd, True
            os.ftruncate(fd, 0)  # every entry empty
            os.posix_fallocate(fd, 0, size)
            if self._fresh:  # an empty slab: the empty table is its table
                os.pwrite(fd, _TABLE.pack(_TABLE_MAGIC, 1, 0, 0, self.slots, self.slab_id), 0)
                return fd, True
            return fd, False
        except BaseException:
            os.close(fd)
            raise

    def _write_table_header(self) -> None:
        os.pwrite(self._table_fd, _TABLE.pack(_TABLE_MAGIC, 1, 0, 0, self.slots, self.slab_id), 0)

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} not in 0..{self.slots - 1}")
        return BLOCK + slot * self.stride

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        for name in ("_fd", "_table_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> "Slab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _buffer(self, which: str, size: int) -> mmap.mmap:
        """This thread's aligned buffer ``which``, at least ``size`` bytes (kept between calls: a fresh one
        per call costs its page faults every time)."""
        buf = getattr(self._local, which, None)
        if buf is None or len(buf) < size:
            buf = _aligned(size)
            setattr(self._local, which, buf)
        return buf

    # ---- records --------------------------------------------------------------------
    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | memoryview, generation: int,
              kind: int = 1, checksum: int = 0, used: int | None = None) -> Record:
        """Write one record into ``slot`` (replacing what it held), header and payload in one ``pwritev``,
        then its table entry (``used`` defaults to the generation). Returns the record written."""
        ns = namespace.encode()
        data = _flat(payload)
        if len(ns) > MAX_NAME or len(key) > MAX_NAME:
            raise ValueError(f"namespace and key are at most {MAX_NAME} bytes")
        if len(data) > self.payload_bytes:
            raise ValueError(f"payload of {len(data)} B is larger than a slot's {self.payload_bytes} B")
        if not 0 <= kind <= 0xFF or not 0 <= checksum < 1 << 64:
            raise ValueError("kind is 0..255 and checksum a 64-bit unsigned number")
        offset = self._offset(slot)
        # the owner's checksum is the xxh3 of the same bytes (the pool's page checksum): not computed again.
        # Were the bytes changed since, the record fails its check when read, and is never served.
        record = Record(slot, namespace, bytes(key), len(data), generation, int(kind), int(checksum),
                        int(checksum) or xxhash.xxh3_64_intdigest(data), generation if used is None else used)
        head = self._buffer("head_w", BLOCK)
        head[:] = _ZERO_BLOCK  # the header block starts clean: no byte of an earlier record
        _HEAD.pack_into(head, 0, _HEAD_MAGIC, 1, len(ns), len(key), generation, len(data), record.kind,
                        record.payload_sum, record.checksum)
        head[_FIXED:_FIXED + len(ns)] = ns
        head[_FIXED + len(ns):_FIXED + len(ns) + len(key)] = key
        _HEAD_SUM.pack_into(head, _HEAD.size, _header_sum(head, len(ns), len(key)))
        padded = round_up(len(data))
        if self.io != "direct" or (padded == len(data) and _is_aligned(data)):
            views = [memoryview(head), data]  # straight from the caller's buffer
        else:
            stage = self._buffer("stage_w", round_up(self.payload_bytes))
            view = memoryview(stage)
            view[:len(data)] = data
            if padded > len(data):
                view[len(data):padded] = bytes(padded - len(data))
            views = [memoryview(head), view[:padded]]
        _write_all(self._fd, views, offset)
        if self.io == "buffered":
            os.posix_fadvise(self._fd, offset, BLOCK + padded, os.POSIX_FADV_DONTNEED)
        self.note(record)
        return record

    def note(self, record: Record, used: int | None = None) -> None:
        """(Re)write ``record``'s table entry, with ``used`` as its last-used tick when given."""
        os.pwrite(self._table_fd, _entry(record if used is None else replace(record, used=used)),
                  BLOCK + record.slot * ENTRY)

    def erase(self, slot: int) -> None:
        """Empty ``slot``: its header block is zeroed (no scan finds the record again), then its entry."""
        _write_all(self._fd, [memoryview(self._zero)], self._offset(slot))
        os.pwrite(self._table_fd, _ZERO_ENTRY, BLOCK + slot * ENTRY)

    def read(self, slot: int) -> tuple[Record, memoryview] | None:
        """The record in ``slot`` and its payload (a view of this thread's read buffer, valid until its next
        read), or None if the slot is empty or its record is corrupt (counted in :attr:`corrupt`: a torn
        write, or bytes changed on disk)."""
        stage = self._buffer("stage_r", round_up(self.payload_bytes))
        got = self._read(slot, memoryview(stage)[:round_up(self.payload_bytes)], None)
        if got is None:
            return None
        return got, memoryview(stage)[:got.length]

    def read_into(self, slot: int, out: memoryview, expect: Record | None = None) -> Record | None:
        """Read the record in ``slot`` into ``out`` (exactly its payload's length) and check it: None if the
        slot is empty, holds another record than ``expect`` (same namespace, key and generation), has
        another length, or fails its payload checksum (counted corrupt). ``out`` may hold any bytes after
        None. Raises ``OSError`` on an I/O error."""
        dest = _flat(out)
        if self.io != "direct" or (len(dest) % BLOCK == 0 and _is_aligned(dest)):
            return self._read(slot, dest, expect, length=len(dest))  # straight into the caller's buffer
        stage = self._buffer("stage_r", round_up(self.payload_bytes))
        got = self._read(slot, memoryview(stage)[:round_up(len(dest))], expect, length=len(dest))
        if got is not None:
            dest[:] = memoryview(stage)[:len(dest)]
        return got

    def _read(self, slot: int, into: memoryview, expect: Record | None, length: int | None = None) -> Record | None:
        offset = self._offset(slot)
        _injected_fault()
        head = self._buffer("head_r", BLOCK)
        n = os.preadv(self._fd, [memoryview(head), into], offset)
        if n < BLOCK:
            return None
        record = _parse(slot, head)
        if record is None:
            return None
        if expect is not None and (record.namespace, record.key, record.generation) != (
                expect.namespace, expect.key, expect.generation):
            return None
        if length is not None and record.length != length:
            return None
        if record.length > len(into) or n - BLOCK < record.length:  # the file ends inside the payload
            self.corrupt += 1
            log.warning("slab %s: slot %d is cut short; dropped", self.path, slot)
            return None
        if xxhash.xxh3_64_intdigest(into[:record.length]) != record.payload_sum:
            self.corrupt += 1
            log.warning("slab %s: slot %d failed its checksum; dropped", self.path, slot)
            return None
        return record

    def read_header(self, slot: int) -> Record | None:
        """The record ``slot``'s header states, or None (empty, or the header does not check)."""
        head = self._buffer("head_r", BLOCK)
        if os.preadv(self._fd, [memoryview(head)], self._offset(slot)) < BLOCK:
            return None
        return _parse(slot, head)

    def scan(self) -> Iterator[Record]:
        """Every slot whose header checks, in slot order (payloads are checked when read). Small slots are
        read whole, many per call; large ones a header block per call."""
        per = _SCAN_CHUNK // self.stride
        if per < 2:
            for slot in range(self.slots):
                record = self.read_header(slot)
                if record is not None:
                    yield record
            return
        buf = _aligned(per * self.stride)
        view = memoryview(buf)
        for first in range(0, self.slots, per):
            n = min(per, self.slots - first)
            got = os.preadv(self._fd, [view[:n * self.stride]], self._offset(first))
            for i in range(n):
                at = i * self.stride
                if at + BLOCK > got:
                    return
                if view[at:at + 4] != _HEAD_MAGIC:
                    continue
                record = _parse(first + i, view[at:at + BLOCK])
                if record is not None:
                    yield record

    def records(self) -> list[Record]:
        """Every record the slab holds as its table states it (a restart), ordered by slot; entries of
        slots past a truncation are dropped. A table that does not belong to the slab is rebuilt from
        :meth:`scan` first. Raises ``OSError`` on an I/O error."""
        if not self._table_ok:
            found = list(self.scan())
            self._write_entries(found)
            self._write_table_header()
            self._table_ok = True
            return found
        size = self.slots * ENTRY
        table = bytearray(size)
        view = memoryview(table)
        done = 0
        while done < size:
            n = os.preadv(self._table_fd, [view[done:]], BLOCK + done)
            if n <= 0:
                break
            done += n
        rows = np.frombuffer(table, dtype=_ENTRY_DTYPE)
        live = np.flatnonzero(rows["magic"] == _ENTRY_MAGIC).tolist()
        if not live:
            return []
        fields = rows[live]
        found: list[Record] = []
        dropped: list[int] = []
        for slot, kind, ns_len, key_len, flags, generation, used, length, payload_sum, checksum, entry_sum in zip(
                live, fields["kind"].tolist(), fields["ns_len"].tolist(), fields["key_len"].tolist(),
                fields["flags"].tolist(), fields["generation"].tolist(), fields["used"].tolist(),
                fields["length"].tolist(), fields["payload_sum"].tolist(), fields["checksum"].tolist(),
                fields["sum"].tolist()):
            at = slot * ENTRY
            if xxhash.xxh3_64_intdigest(view[at:at + _ENTRY_SUM]) != entry_sum:
                continue  # torn by a kill: as if never written
            if slot >= self.intact_slots:
                dropped.append(slot)
                continue
            if flags & 1:
                names = at + _ENTRY.size
                try:
                    namespace = bytes(view[names:names + ns_len]).decode()
                except UnicodeDecodeError:
                    continue
                key = bytes(view[names + ns_len:names + ns_len + key_len])
            else:  # long names live in the slot's header only
                header = self.read_header(slot)
                if header is None or header.generation != generation:
                    dropped.append(slot)
                    continue
                namespace, key = header.namespace, header.key
            found.append(Record(slot, namespace, key, length, generation, kind, checksum, payload_sum, used))
        for slot in dropped:
            os.pwrite(self._table_fd, _ZERO_ENTRY, BLOCK + slot * ENTRY)
        return found

    def _write_entries(self, records: Sequence[Record]) -> None:
        """Every entry of the table at once: ``records``' entries, the rest empty."""
        table = bytearray(self.slots * ENTRY)
        for record in records:
            table[record.slot * ENTRY:(record.slot + 1) * ENTRY] = _entry(record)
        _write_all(self._table_fd, [memoryview(table)], BLOCK)


def _parse(slot: int, head: mmap.mmap | memoryview) -> Record | None:
    magic, flags, ns_len, key_len, generation, length, kind, payload_sum, checksum = _HEAD.unpack_from(head)
    if magic != _HEAD_MAGIC or not flags & 1 or _FIXED + ns_len + key_len > BLOCK:
        return None
    if _HEAD_SUM.unpack_from(head, _HEAD.size)[0] != _header_sum(head, ns_len, key_len):
        return None
    ns = bytes(head[_FIXED:_FIXED + ns_len])
    key = bytes(head[_FIXED + ns_len:_FIXED + ns_len + key_len])
    try:
        namespace = ns.decode()
    except UnicodeDecodeError:
        return None
    return Record(slot, namespace, key, length, generation, kind, checksum, payload_sum, 0)


def _header_sum(buf: mmap.mmap | memoryview, ns_len: int, key_len: int) -> int:
    h = xxhash.xxh3_64()
    h.update(memoryview(buf)[:_HEAD.size])
    h.update(memoryview(buf)[_FIXED:_FIXED + ns_len + key_len])
    return h.intdigest()


def _entry(record: Record) -> bytes:
    ns = record.namespace.encode()
    inline = len(ns) + len(record.key) <= _ENTRY_NAMES
    buf = bytearray(ENTRY)
    _ENTRY.pack_into(buf, 0, _ENTRY_MAGIC, record.kind & 0xFF, len(ns), len(record.key), 1 if inline else 0, 0,
                     record.generation, record.used, record.length, 0, record.payload_sum, record.checksum)
    if inline:
        buf[_ENTRY.size:_ENTRY.size + len(ns) + len(record.key)] = ns + record.key
    struct.pack_into("<Q", buf, _ENTRY_SUM, xxhash.xxh3_64_intdigest(memoryview(buf)[:_ENTRY_SUM]))
    return bytes(buf)


def _flat(buffer: bytes | memoryview | mmap.mmap) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_aligned(view: memoryview) -> bool:
    return len(view) == 0 or np.frombuffer(view, dtype=np.uint8).ctypes.data % BLOCK == 0


def _aligned(size: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer (anonymous memory) of ``size`` bytes, as ``O_DIRECT`` needs."""
    return mmap.mmap(-1, size)


def _write_all(fd: int, views: list[memoryview], offset: int) -> None:
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        n = os.pwritev(fd, views, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
        while views and n >= len(views[0]):  # drop what was written
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


_faults = {"spec": "", "left": 0, "p": 0.0}
_faults_lock = threading.Lock()


def _injected_fault() -> None:
    """Raise ``EIO`` as the test switch ``KVSTORE_TEST_FAIL_READS`` asks (module doc)."""
    spec = os.environ.get(FAIL_READS_ENV, "")
    if not spec:
        return
    with _faults_lock:
        if spec != _faults["spec"]:
            value = float(spec)
            _faults.update(spec=spec, p=value if value < 1 else 0.0, left=int(value) if value >= 1 else 0)
        if _faults["left"] > 0:
            _faults["left"] -= 1
            fail = True
        else:
            fail = random.random() < _faults["p"]
    if fail:
        raise OSError(errno.EIO, f"read failed ({FAIL_READS_ENV})")


def probe_direct(directory: str | Path) -> str:
    """``direct`` if the filesystem holding ``directory`` takes an aligned ``O_DIRECT`` write, else
    ``buffered`` (logged once per call)."""
    probe = Path(directory) / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        log.info("%s: O_DIRECT refused (%s); slabs there use buffered I/O", directory, exc.strerror)
        return "buffered"
    try:
        _write_all(fd, [memoryview(_aligned(BLOCK))], 0)
        mode = "direct"
    except OSError as exc:
        log.info("%s: O_DIRECT write refused (%s); slabs there use buffered I/O", directory, exc.strerror)
        mode = "buffered"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    log.info("%s: slabs use %s I/O", directory, mode)
    return mode
