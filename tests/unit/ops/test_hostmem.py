"""Host copies split across threads: every byte lands, whatever the size and however many callers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore import hostmem


@pytest.mark.parametrize("nbytes", [0, 1, 4096, (1 << 20) - 1, 2 << 20, (4 << 20) + 12345, 9 << 20])
def test_copy_into_copies_every_byte(nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    hostmem.copy_into(dst, src)
    assert np.array_equal(dst, src)


def test_concurrent_callers_each_get_their_bytes_and_the_copiers_come_back() -> None:
    page = 4 << 20
    srcs = [np.full(page, k, dtype=np.uint8) for k in range(8)]
    dsts = [np.zeros(page, dtype=np.uint8) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            list(pool.map(hostmem.copy_into, dsts, srcs))
            assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
            for d in dsts:
                d.fill(0)
    # every copier taken was given back: a large copy can take all of them again
    taken = 0
    while hostmem._idle.acquire(blocking=False):
        taken += 1
    for _ in range(taken):
        hostmem._idle.release()
    assert taken == hostmem.copy_threads() - 1
