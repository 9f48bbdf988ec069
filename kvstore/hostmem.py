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
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


# ---- copies -------------------------------------------------------------------------
def as_bytes(buffer: Any) -> np.ndarray:
    """A flat uint8 array over ``buffer``'s bytes (anything with the buffer protocol; no copy)."""
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


PIECE_MIN_BYTES = 1 << 20   # a copy is split across threads in pieces of at least this (smaller: the
                            # hand-off costs more than the second stream gains; measured on 2 cores)
_PIECE = 64 << 10           # pieces start on 64 KiB boundaries (whole cache lines and 4 KiB pages)
_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()
_idle = threading.Semaphore(0)  # copiers free to take a piece (set with the pool)


def copy_threads() -> int:
    """Threads one large host copy is split across: one memory stream per core, up to four (on a
    2-core machine, two; a single stream reaches about half of what two reach there)."""
    return max(1, min(4, os.cpu_count() or 1))


def _pool() -> ThreadPoolExecutor:
    global _copiers, _idle
    with _copiers_lock:
        if _copiers is None:
            _idle = threading.Semaphore(copy_threads() - 1)
            _copiers = ThreadPoolExecutor(max(1, copy_threads() - 1), thread_name_prefix="kvstore-copy")
        return _copiers


def _piece(dst: np.ndarray, src: np.ndarray) -> None:
    try:
        np.copyto(dst, src)
    finally:
        _idle.release()


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for flat uint8 arrays of one length. From two ``PIECE_MIN_BYTES`` on, idle copier
    threads (one per core but the caller's, up to three) each take a piece while the calling thread copies
    the first, as one thread's copy stream reaches a fraction of a socket's memory bandwidth. Copiers busy
    with other callers' pieces are not waited for: the caller then copies more itself (alone, when none is
    idle), so concurrent callers never queue behind each other. Returns when every byte is copied."""
    n = dst.nbytes
    want = min(copy_threads(), n // PIECE_MIN_BYTES) - 1
    pool = _pool() if want > 0 else None
    helpers = 0
    while helpers < want and _idle.acquire(blocking=False):
        helpers += 1
    if pool is None or helpers == 0:
        np.copyto(dst, src)
        return
    step = -(-n // (helpers + 1) // _PIECE) * _PIECE
    starts = list(range(step, n, step))
    for _ in range(helpers - len(starts)):  # fewer pieces than helpers taken (a short copy): give them back
        _idle.release()
    rest = [pool.submit(_piece, dst[at:at + step], src[at:at + step]) for at in starts]
    try:
        np.copyto(dst[:step], src[:step])
    finally:
        for done in rest:
            done.result()
