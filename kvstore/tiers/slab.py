"""A slab file of fixed-size page slots on local disk: the record format of the disk tier.

One preallocated file per slab, ``0600`` in a ``0700`` directory the node owns; its name is fixed
here (``slab-<name>.kv`` with ``name`` from the node's configuration, checked), never built from client
input. The file is a superblock followed by ``slots`` slots of ``stride`` bytes::

    offset 0        superblock (4 KiB): magic, format version, payload capacity, stride, slots
    4096 + i*stride slot i: a 4 KiB header block, then the payload (``stride - 4096`` bytes, 4 KiB aligned)

A slot's header holds the namespace, the key, the payload length, a generation number (set by the
slab's owner; the newer of two records of one key wins after a crash) and two xxh3-64 checksums: one
of the header itself, one of the payload. A record is written in one ``pwrite`` of its header and
payload; erasing one zeroes its header block. What a crash or a torn write can leave:

* a header that does not check (torn inside the header, or never written): the slot is empty;
* a header that checks over a payload that does not (torn inside the payload): :meth:`Slab.read`
  finds the mismatch, counts the record corrupt and returns nothing, so it is never served.

The index is rebuilt at start by :meth:`Slab.scan`, which reads only the header blocks (4 KiB per
slot) and verifies their checksums; payloads are verified when read. A process that is killed leaves
every completed ``pwrite`` in the file (the page cache, or the device under ``O_DIRECT``); a power
loss is not covered (there is no ``fsync`` per record).

I/O is blocking and positional (``os.pread``/``os.pwrite`` on one descriptor, safe from several
threads): callers run it off the event loop. ``io="direct"`` opens the file with ``O_DIRECT`` and
moves every record through page-aligned buffers; ``"buffered"`` uses the page cache and tells the
kernel (``posix_fadvise``) that access is random and written pages are not read back soon; ``"auto"``
probes ``O_DIRECT`` on the slab's filesystem once and falls back to buffered where it is refused.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

BLOCK = 4096
"""Alignment of every offset, length and buffer (the largest logical block size of common devices)."""
IO_MODES = ("auto", "direct", "buffered")
MAX_NAME = 255  # namespace and key bytes, each

_SUPER = struct.Struct("<8sHHQQQ")  # magic, version, reserved, payload capacity, stride, slots
_SUPER_MAGIC = b"KVSLAB\x00\x01"
_VERSION = 1
_HEAD = struct.Struct("<4sHBBQIIQ")  # magic, flags, ns len, key len, generation, length, reserved, payload xxh3
_HEAD_MAGIC = b"KVR1"
_HEAD_SUM = struct.Struct("<Q")  # header xxh3, right after _HEAD
_FIXED = _HEAD.size + _HEAD_SUM.size
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ZERO_BLOCK = bytes(BLOCK)


def round_up(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class Record:
    """A slot's record as its header states it."""

    slot: int
    namespace: str
    key: bytes
    length: int
    generation: int


class Slab:
    """One slab file (see the module doc). ``payload_bytes``: the largest page a slot holds (a namespace's
    page size); ``capacity_bytes``: the most the file may take, superblock included."""

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
        self.io = probe_direct(self.directory) if io == "auto" else io
        self.corrupt = 0  # records whose payload did not match its checksum (dropped)
        self._local = threading.local()
        self._fd = self._open()

    # ---- the file -------------------------------------------------------------------
    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if self.io == "direct":
            flags |= os.O_DIRECT
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = BLOCK + self.slots * self.stride
            if not self._geometry_matches(fd):
                if os.fstat(fd).st_size:
                    log.warning("slab %s: written with another page size or capacity; starting it empty", self.path)
                os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, not at a later write
                self._write_superblock(fd)
            elif os.fstat(fd).st_size < size:  # truncated: keep what is left, the rest reads as empty slots
                log.warning("slab %s: %d of %d bytes left; the records past the end are lost", self.path,
                            os.fstat(fd).st_size, size)
                os.posix_fallocate(fd, 0, size)
            if self.io == "buffered":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _geometry_matches(self, fd: int) -> bool:
        if os.fstat(fd).st_size < BLOCK:
            return False
        buf = _aligned(BLOCK)
        if os.preadv(fd, [buf], 0) < _SUPER.size:
            return False
        magic, version, _, payload, stride, slots = _SUPER.unpack_from(buf)
        return (magic, version, payload, stride, slots) == (_SUPER_MAGIC, _VERSION, self.payload_bytes,
                                                            self.stride, self.slots)

    def _write_superblock(self, fd: int) -> None:
        buf = _aligned(BLOCK)
        _SUPER.pack_into(buf, 0, _SUPER_MAGIC, _VERSION, 0, self.payload_bytes, self.stride, self.slots)
        _write_all(fd, buf, 0)

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} not in 0..{self.slots - 1}")
        return BLOCK + slot * self.stride

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Slab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records --------------------------------------------------------------------
    def write(self, slot: int, namespace: str, key: bytes, payload: bytes | memoryview, generation: int) -> None:
        """Write one record into ``slot`` (replacing what it held), header and payload in one ``pwrite``."""
        ns = namespace.encode()
        data = memoryview(payload).cast("B")
        if len(ns) > MAX_NAME or len(key) > MAX_NAME:
            raise ValueError(f"namespace and key are at most {MAX_NAME} bytes")
        if len(data) > self.payload_bytes:
            raise ValueError(f"payload of {len(data)} B is larger than a slot's {self.payload_bytes} B")
        used = BLOCK + round_up(len(data))
        buf = self._write_buffer(used)
        buf[:BLOCK] = _ZERO_BLOCK  # the header block starts clean: no byte of an earlier record
        buf[BLOCK:BLOCK + len(data)] = data
        if len(data) < used - BLOCK:  # the padding too
            buf[BLOCK + len(data):used] = bytes(used - BLOCK - len(data))
        _HEAD.pack_into(buf, 0, _HEAD_MAGIC, 1, len(ns), len(key), generation, len(data), 0,
                        xxhash.xxh3_64_intdigest(data))
        buf[_FIXED:_FIXED + len(ns)] = ns
        buf[_FIXED + len(ns):_FIXED + len(ns) + len(key)] = key
        _HEAD_SUM.pack_into(buf, _HEAD.size, _header_sum(buf, len(ns), len(key)))
        _write_all(self._fd, memoryview(buf)[:used], self._offset(slot))
        if self.io == "buffered":
            os.posix_fadvise(self._fd, self._offset(slot), used, os.POSIX_FADV_DONTNEED)

    def _write_buffer(self, size: int) -> mmap.mmap:
        """This thread's aligned write buffer, at least ``size`` bytes (kept between writes: a fresh one
        per write costs its page faults every time)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = _aligned(max(size, BLOCK + round_up(self.payload_bytes)))
        return buf

    def erase(self, slot: int) -> None:
        """Empty ``slot``: its header block is zeroed, so no scan finds the record again."""
        _write_all(self._fd, _aligned(BLOCK), self._offset(slot))

    def read(self, slot: int) -> tuple[Record, memoryview] | None:
        """The record in ``slot`` and its payload, or None if the slot is empty or its record is corrupt
        (counted in :attr:`corrupt`: a torn write, or bytes changed on disk)."""
        offset = self._offset(slot)
        head = _aligned(BLOCK)
        if os.preadv(self._fd, [head], offset) < BLOCK:
            return None
        record = _parse(slot, head)
        if record is None:
            return None
        buf = _aligned(round_up(record.length)) if record.length else None
        if buf is not None and os.preadv(self._fd, [buf], offset + BLOCK) < record.length:
            self.corrupt += 1
            return None
        payload = memoryview(buf)[:record.length] if buf is not None else memoryview(b"")
        if xxhash.xxh3_64_intdigest(payload) != _HEAD.unpack_from(head)[7]:
            self.corrupt += 1
            log.warning("slab %s: slot %d failed its checksum; dropped", self.path, slot)
            return None
        return record, payload

    def scan(self) -> Iterator[Record]:
        """Every slot whose header checks, in slot order (payloads are checked when read)."""
        head = _aligned(BLOCK)
        for slot in range(self.slots):
            if os.preadv(self._fd, [head], self._offset(slot)) < BLOCK:
                return
            record = _parse(slot, head)
            if record is not None:
                yield record


def _parse(slot: int, head: mmap.mmap) -> Record | None:
    magic, flags, ns_len, key_len, generation, length, _, _ = _HEAD.unpack_from(head)
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
    return Record(slot, namespace, key, length, generation)


def _header_sum(buf: mmap.mmap, ns_len: int, key_len: int) -> int:
    h = xxhash.xxh3_64()
    h.update(memoryview(buf)[:_HEAD.size])
    h.update(memoryview(buf)[_FIXED:_FIXED + ns_len + key_len])
    return h.intdigest()


def _aligned(size: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer (anonymous memory) of ``size`` bytes, as ``O_DIRECT`` needs."""
    return mmap.mmap(-1, size)


def _write_all(fd: int, buf: mmap.mmap | memoryview, offset: int) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


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
        _write_all(fd, _aligned(BLOCK), 0)
        mode = "direct"
    except OSError as exc:
        log.info("%s: O_DIRECT write refused (%s); slabs there use buffered I/O", directory, exc.strerror)
        mode = "buffered"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    log.info("%s: slabs use %s I/O", directory, mode)
    return mode
