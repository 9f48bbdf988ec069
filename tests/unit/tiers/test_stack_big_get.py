"""A Get of more pages than the pool can hold at once (``kvstore.tiers.stack`` through ``kvstore.node``):
a promotion brings up only what the pool takes in without evicting a page of the same Get, leading pages
first; the rest is served straight from the tiers (``NamespaceTiers.serve_into``), checked against the
checksum the pool stored, never promoted. Pinned pages are never evicted to make room."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvstore.node import Node
from kvstore.pool.movement import SOCKET
from tests.unit.tiers.test_stack import PB, POOL_PAGES, below, disk_node, key, make_node, page, put, run, stack

__all__ = ["stack"]  # the fixture: every test here runs over each stack of test_stack

PAGES = 4 * POOL_PAGES


async def on_disk(node: Node, n: int = PAGES) -> list[bytes]:
    """``n`` pages put one at a time (the pool holds the last POOL_PAGES), written down; returns their keys."""
    keys = [key(i) for i in range(n)]
    for i in range(n):
        put(node, [keys[i]], [page(i)])
    assert await below(node).settle()
    return keys


async def big_get(node: Node, keys: list[bytes], timeout: float | None = None) -> list[bytes | None]:
    """What a read path does: promote, hold what the pool has, serve the rest from the tiers."""
    await node.promote("ns", keys, timeout)
    ns, handle = node.acquire("ns", keys)
    try:
        out = ns.pool.read_out(handle, SOCKET)
        pooled = iter([bytes(v) for v in out.payload or []])
        out.release()
        rest = below(node).unpromoted([k for k, hit in zip(keys, handle.found) if not hit], timeout)
        rows = np.empty((len(rest), PB), dtype=np.uint8)
        ok = await below(node).serve_into(rest, rows)
        tiered = {k: bytes(rows[i]) for i, k in enumerate(rest) if ok[i]}
    finally:
        ns.pool.release(handle)
    return [next(pooled) if hit else tiered.get(k) for k, hit in zip(keys, handle.found)]


def promotions(node: Node) -> int:
    return sum(t["promotions"] for t in node.tiers.summary())


def test_a_get_of_twice_the_pool_serves_every_page_and_promotes_what_fits(stack: Any) -> None:
    node = make_node(stack)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await on_disk(node)
        asked = keys[:2 * POOL_PAGES]
        before = promotions(node)
        assert below(node).room(asked) == POOL_PAGES  # the pool's pages are none of these: all may go
        assert await big_get(node, asked) == [page(i) for i in range(2 * POOL_PAGES)]
        # the leading pages came up (each once: none evicted by the same Get), the rest was read straight
        assert [k in pool for k in asked] == [True] * POOL_PAGES + [False] * POOL_PAGES
        assert promotions(node) - before == POOL_PAGES
        assert node.lookup("ns", keys) == PAGES  # nothing was lost on the way
        # repeats and any order
        mixed = asked[::-1] + asked[:2]
        assert await big_get(node, mixed) == [page(int(k[1:])) for k in mixed]
        pool.check_invariants()
    try:
        run(main)
    finally:
        node.close()


def test_pinned_pages_are_not_evicted_for_a_big_get(stack: Any) -> None:
    node = make_node(stack)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await on_disk(node)
        held = [k for k in keys if k in pool]
        assert len(held) == POOL_PAGES
        node.pin("ns", held, ttl=60)
        asked = keys[:2 * POOL_PAGES]
        assert below(node).room(asked) == 0
        assert await big_get(node, asked) == [page(i) for i in range(2 * POOL_PAGES)]
        assert all(k in pool for k in held) and not any(k in pool for k in asked)
        assert pool.pinned_slots == POOL_PAGES
        pool.check_invariants()
    try:
        run(main)
    finally:
        node.close()


def test_a_promotion_never_evicts_a_page_of_its_own_get(stack: Any) -> None:
    """The Get's own pages in the pool are the least recently used ones: the promotions for its other pages
    evict the others first, and only as many come up as leave its own in place."""
    node = make_node(stack)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await on_disk(node)
        oldest = next(k for k in keys if k in pool)  # the pool's least recently used page
        asked = [oldest] + keys[:POOL_PAGES]
        assert below(node).room(asked) == POOL_PAGES - 1
        assert await big_get(node, asked) == [page(int(k[1:])) for k in asked]
        assert oldest in pool and all(k in pool for k in keys[:POOL_PAGES - 1])
    try:
        run(main)
    finally:
        node.close()


def test_a_page_that_comes_back_with_other_bytes_is_never_served(tmp_path: Path) -> None:
    node = disk_node(tmp_path)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await on_disk(node, 2 * POOL_PAGES)
        tier = below(node).tiers[0]
        get_into = tier.get_into
        bad = keys[1]

        def damaged(namespace: str, k: bytes, out: memoryview) -> Any:  # the record checks out, the bytes not
            stored = get_into(namespace, k, out)
            if k == bad and stored is not None:
                np.frombuffer(out, dtype=np.uint8)[:PB] ^= 0xFF
            return stored

        tier.get_into = damaged
        rows = np.empty((2, PB), dtype=np.uint8)
        assert await below(node).serve_into(keys[:2], rows) == [True, False]
        assert bytes(rows[0]) == page(0)
        assert node.tiers.summary()[0]["corrupt"] >= 1
        assert await below(node).settle()
        assert node.exists("ns", keys[:2]) == [True, False] and bad not in pool  # dropped below
    try:
        run(main)
    finally:
        node.close()


def test_a_deadline_bounds_what_is_read_straight_from_disk(tmp_path: Path) -> None:
    """Pages served from their tier are priced as a promotion's: with a deadline, only the leading ones
    expected to be read within it (here a paced disk at 50 pages a second: 8 pages take 0.16 s)."""
    node = disk_node(tmp_path, tier_read_rate=50.0 * PB)

    async def main() -> None:
        keys = await on_disk(node, 3 * POOL_PAGES)
        down = [k for k in keys if k not in node.namespace("ns").pool]
        assert len(down) == 2 * POOL_PAGES
        assert 1 <= len(below(node).unpromoted(down, 0.1)) < len(down)
        assert below(node).unpromoted(down, 0.1) == down[:len(below(node).unpromoted(down, 0.1))]  # leading
        assert below(node).unpromoted(down, None) == down
        assert below(node).unpromoted(down + down[:1], None) == down  # each key once
    try:
        run(main)
    finally:
        node.close()
