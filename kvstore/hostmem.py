"""Host buffers that are mapped up front.

Receiving into never-touched anonymous memory faults page by page inside the
kernel. Measured on the CI kind of machine: a 64 MiB Get into fresh
``np.empty`` memory took ~150 ms against ~20 ms into a reused buffer, while
``mmap(MAP_POPULATE)`` maps the same 64 MiB in ~20 ms (and ``fill(0)`` of
fresh memory runs at the slow fault rate too). Large client buffers and
host page pools use this.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

POPULATE_MIN_BYTES = 4 << 20


def populated_empty(count: int, page_bytes: int) -> np.ndarray:
    """A ``[count, page_bytes]`` uint8 array whose memory is already mapped."""
    nbytes = count * page_bytes
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < POPULATE_MIN_BYTES or not populate:
        array = np.empty((count, page_bytes), dtype=np.uint8)
        array.fill(0)
        return array
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return np.frombuffer(region, dtype=np.uint8).reshape(count, page_bytes)


def shared_memory_available() -> bool:
    """Whether host pools can live in memfds here (Linux)."""
    return hasattr(os, "memfd_create")


def shared_empty(count: int, page_bytes: int, name: str = "kvstore-pool") -> tuple[np.ndarray, int]:
    """A ``[count, page_bytes]`` uint8 array in an anonymous shared-memory
    file (``memfd_create``), mapped up front, and that file's descriptor.

    The descriptor can be passed to a process on the same host
    (``SCM_RIGHTS``), which maps the same pages: the co-located data path.
    Linux only; raises ``OSError`` elsewhere."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        raise OSError("memfd_create is not available on this platform")
    nbytes = count * page_bytes
    fd = create(name, getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.ftruncate(fd, max(nbytes, 1))
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(fd, max(nbytes, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    array = np.frombuffer(region, dtype=np.uint8, count=nbytes).reshape(count, page_bytes)
    return array, fd
