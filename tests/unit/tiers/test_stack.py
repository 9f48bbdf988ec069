"""The tier stack under a node (``kvstore.tiers.stack`` through ``kvstore.node``): real pools, real host
buffers and real slab files in a temporary folder, an event loop for the worker threads' results; no
sockets. The same tests run over a host pool with a disk tier and over a staged pool (driven like a GPU
pool) with a host tier above the disk tier."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import NodeConfig
from kvstore.node import Node
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.ops.staged import StagedNumpyPageOps
from kvstore.pool.layout import PageLayout
from kvstore.pool.movement import SOCKET
from kvstore.pool.pool import PageKind

PB = 4096
POOL_PAGES = 4


def page(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (PB // 4))


def key(i: int) -> bytes:
    return b"k%05d" % i


STACKS = {
    "host-pool+disk": (NumpyPageOps, lambda d: [f"disk:{d}/d0:{64 * 8 * 1024 + 4096}"]),
    "staged-pool+host+disk": (StagedNumpyPageOps, lambda d: [f"host:{8 * PB}", f"disk:{d}/d0:{64 * 8 * 1024 + 4096}"]),
}


@pytest.fixture(params=list(STACKS), ids=list(STACKS))
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, list[str]]:
    ops, tiers = STACKS[request.param]
    return ops, tiers(tmp_path)


def make_node(stack: tuple[Any, list[str]], **overrides: Any) -> Node:
    ops, tiers = stack
    settings: dict[str, Any] = dict(listen="127.0.0.1:0", capacity=POOL_PAGES * PB, device="cpu", prefault=False,
                                    shm=False, namespace=[f"ns:{PB}"], tier=tiers, tier_io="buffered")
    settings.update(overrides)
    return Node(NodeConfig(**settings), ops())


def run(fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(fn())


def put(node: Node, keys: list[bytes], pages: list[bytes], kind: PageKind = PageKind.PRIMARY) -> None:
    batch = node.begin_put("ns", kind)
    batch.add(keys, pages)
    batch.commit()


async def get(node: Node, keys: list[bytes], timeout: float | None = 10.0) -> list[bytes | None]:
    """What a read path does: promote what is below, then read the pool."""
    await node.promote("ns", keys, timeout)
    ns, handle = node.acquire("ns", keys)
    try:
        out = ns.pool.read_out(handle, SOCKET)
        got = iter([bytes(v) for v in out.payload or []])
        out.release()
    finally:
        ns.pool.release(handle)
    return [next(got) if hit else None for hit in handle.found]


def below(node: Node) -> Any:
    below = node.namespace("ns").below
    assert below is not None
    return below


def test_evicted_pages_go_down_and_come_back_with_their_bytes(stack: Any) -> None:
    node = make_node(stack)
    events: list[tuple[list[Any], list[bytes]]] = []
    node.listeners.append(lambda ns, added, removed: events.append((list(added), list(removed))))

    async def main() -> None:
        keys = [key(i) for i in range(16)]
        for i in range(16):
            put(node, [keys[i]], [page(i)])
        assert await below(node).settle()
        assert len(node.namespace("ns").pool) == POOL_PAGES
        assert node.lookup("ns", keys) == 16  # every page is still this node's
        assert all(node.exists("ns", keys))
        # the pool's evictions were never reported as removals: the pages went down
        assert not [k for _, removed in events for k in removed]
        for start in range(0, 16, POOL_PAGES):  # a read at most the pool's size at a time
            got = await get(node, keys[start:start + POOL_PAGES])
            assert got == [page(i) for i in range(start, start + POOL_PAGES)]
        runs = node.tier_runs("ns", keys)
        assert sum(r.pages for r in runs) == 16 and runs[0].tier in ("pool", "host", "disk0")
        summary = node.tiers.summary()
        assert summary[-1]["demotions"] > 0 and sum(t["promotions"] for t in summary) >= 4
    try:
        run(main)
    finally:
        node.close()


def test_kind_and_checksum_travel_and_a_forecast_copy_sinks_as_a_replica(stack: Any) -> None:
    node = make_node(stack)

    async def main() -> None:
        put(node, [key(0)], [page(0)], PageKind.REPLICA)
        batch = node.begin_put("ns", PageKind.SPECULATIVE, expires_at=1e12)
        batch.add([key(1)], [page(1)])
        batch.commit()
        put(node, [key(i) for i in range(2, 1 + POOL_PAGES)], [page(i) for i in range(2, 1 + POOL_PAGES)])
        put(node, [key(99)], [page(99)])  # the pool is full: the oldest plain page goes, the copy stays
        assert await below(node).settle()
        pool = node.namespace("ns").pool
        assert key(1) in pool and key(0) not in pool and node.lookup("ns", [key(0)]) == 1
        assert pool.drop_speculative([key(1)]) == [key(1)]  # its forecast ended: it sinks
        assert await below(node).settle()
        assert key(1) not in pool and node.lookup("ns", [key(1)]) == 1 and below(node).spec_sunk == 1
        assert (await get(node, [key(0)])) == [page(0)] and (await get(node, [key(1)])) == [page(1)]
        for k, kind in ((key(0), PageKind.REPLICA), (key(1), PageKind.REPLICA)):
            entry = pool.entry(k)
            assert entry is not None and entry.kind is kind and entry.checksum != 0
    try:
        run(main)
    finally:
        node.close()


def test_a_full_staging_budget_drops_the_page_and_says_so(stack: Any) -> None:
    node = make_node(stack, tier_staging=0)
    removed: list[bytes] = []
    node.listeners.append(lambda ns, added, gone: removed.extend(gone))

    async def main() -> None:
        for i in range(POOL_PAGES + 2):
            put(node, [key(i)], [page(i)])
        assert node.tiers.summary()[0]["drops"] == 2
        assert sorted(removed) == [key(0), key(1)]  # gone from the node, and the directory is told
        assert node.lookup("ns", [key(0)]) == 0
    try:
        run(main)
    finally:
        node.close()


def test_write_through_copies_down_at_once_so_eviction_writes_nothing(stack: Any) -> None:
    node = make_node(stack, tier_write="through")

    async def main() -> None:
        put(node, [key(i) for i in range(POOL_PAGES)], [page(i) for i in range(POOL_PAGES)])
        assert await below(node).settle()
        first = node.tiers.summary()[0]["demotions"]
        assert first == POOL_PAGES  # copied down while still in the pool
        put(node, [key(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)],
            [page(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)])
        assert await below(node).settle()
        # the evicted pages were below already: only the new pages were written
        assert node.tiers.summary()[0]["demotions"] == 2 * POOL_PAGES
        assert (await get(node, [key(0), key(1)])) == [page(0), page(1)]
    try:
        run(main)
    finally:
        node.close()


def test_a_pin_holds_a_page_below_and_moves_up_with_it(stack: Any) -> None:
    node = make_node(stack)

    async def main() -> None:
        put(node, [key(i) for i in range(POOL_PAGES)], [page(i) for i in range(POOL_PAGES)])
        put(node, [key(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)], [page(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)])
        assert await below(node).settle()
        assert key(0) not in node.namespace("ns").pool
        lease, missing = node.pin("ns", [key(0), key(999)], ttl=60)
        assert lease.keys == [key(0)] and missing == [key(999)]
        # a Delete leaves a pinned page below, like a pinned page in the pool
        deleted, not_found, pinned = node.delete("ns", [key(0)])
        assert (deleted, not_found, pinned) == (0, [], [key(0)])
        assert (await get(node, [key(0)])) == [page(0)]
        entry = node.namespace("ns").pool.entry(key(0))
        assert entry is not None and entry.pins == 1  # the pin came up with the page
        assert node.unpin("ns", lease.lease_id) == 1
        assert node.namespace("ns").pool.entry(key(0)).pins == 0  # type: ignore[union-attr]
    try:
        run(main)
    finally:
        node.close()


def test_delete_removes_a_page_from_every_tier(stack: Any) -> None:
    node = make_node(stack)

    async def main() -> None:
        put(node, [key(i) for i in range(POOL_PAGES)], [page(i) for i in range(POOL_PAGES)])
        put(node, [key(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)], [page(i) for i in range(POOL_PAGES, 2 * POOL_PAGES)])
        assert await below(node).settle()
        deleted, not_found, pinned = node.delete("ns", [key(0), key(7), key(999)])
        assert (deleted, not_found, pinned) == (2, [key(999)], [])
        assert node.lookup("ns", [key(0)]) == 0 and not node.exists("ns", [key(7)])[0]
        assert await below(node).settle()
        assert (await get(node, [key(0)])) == [None]
    try:
        run(main)
    finally:
        node.close()


def test_a_restarted_node_serves_its_disk_pages(stack: Any) -> None:
    node = make_node(stack)

    async def fill() -> None:
        for i in range(0, 24, POOL_PAGES):
            put(node, [key(j) for j in range(i, i + POOL_PAGES)], [page(j) for j in range(i, i + POOL_PAGES)])
        assert await below(node).settle()
    run(fill)
    node.close()

    again = make_node(stack)
    try:
        snapshot = again.snapshot()["ns"]
        held = {p.key for p in snapshot}
        # what was in the pool at the stop is gone (memory); what was on disk is back and announced
        disk_keys = {key(i) for i in range(24 - POOL_PAGES - (8 if len(stack[1]) == 2 else 0))}
        assert disk_keys <= held and all(getattr(p, "tier", 0) >= 1 for p in snapshot)

        async def read() -> None:
            ordered = sorted(disk_keys)
            for i in range(0, len(ordered), POOL_PAGES):
                chunk = ordered[i:i + POOL_PAGES]
                assert await get(again, chunk) == [page(int(k[1:])) for k in chunk]
        run(read)
    finally:
        again.close()


def test_a_page_whose_record_is_damaged_is_never_served(stack: Any, tmp_path: Path) -> None:
    node = make_node(stack)
    n = 4 * POOL_PAGES

    async def main() -> None:
        for i in range(0, n, POOL_PAGES):
            put(node, [key(j) for j in range(i, i + POOL_PAGES)], [page(j) for j in range(i, i + POOL_PAGES)])
        assert await below(node).settle()
        # flip one payload byte of every record in the slab: each fails its checksum when read
        slab = next(Path(tmp_path).rglob("slab-*.kv"))
        fd = os.open(slab, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for off in range(4096 + 4096 + 100, size, 8192):
                byte = os.pread(fd, 1, off)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
        got = []
        for i in range(0, n, POOL_PAGES):
            got += await get(node, [key(j) for j in range(i, i + POOL_PAGES)])
        assert all(g is None or g == page(i) for i, g in enumerate(got))  # never other bytes
        assert None in got  # the disk's pages were lost...
        assert sum(t["corrupt"] for t in node.tiers.summary()) == got.count(None)  # ...and counted
    try:
        run(main)
    finally:
        node.close()


def test_delete_namespace_removes_its_slab_files(stack: Any, tmp_path: Path) -> None:
    node = make_node(stack)
    try:
        assert list(tmp_path.rglob("slab-*.kv"))
        node.delete_namespace("ns")
        assert not list(tmp_path.rglob("slab-*.kv"))
    finally:
        node.close()


def test_slab_files_are_named_by_digest_not_by_the_client_namespace(tmp_path: Path) -> None:
    node = make_node((NumpyPageOps, [f"disk:{tmp_path}:{1 << 20}"]), namespace=[])
    try:
        node.create_namespace("a/../../etc/passwd", PageLayout(PB))
        names = [p.name for p in tmp_path.iterdir()]
        assert names and all(n.startswith("slab-ns-") and ".." not in n for n in names)
        assert all(c.isalnum() or c in "-._" for n in names for c in n)
    finally:
        node.close()


def test_a_pace_gives_out_the_device_in_turn_at_its_rate() -> None:
    from kvstore.tiers.stack import Pace

    pace = Pace(1000.0)  # bytes/s
    assert pace.delay(500, now=10.0) == pytest.approx(0.5)     # the device is free: its own bytes only
    assert pace.delay(500, now=10.0) == pytest.approx(1.0)     # a second reader at once queues behind it
    assert pace.delay(100, now=12.0) == pytest.approx(0.1)     # idle since: no debt carried over
    assert Pace(0.0).delay(1 << 30, now=0.0) == 0.0            # no rate: unpaced


def disk_node(tmp_path: Path, **overrides: Any) -> Node:
    """A node with a host pool and one disk tier of 8 slots."""
    return make_node(STACKS["host-pool+disk"], tier=[f"disk:{tmp_path}/d0:{64 * 8 * 1024 + 4096}"], **overrides)


async def eight_on_disk(node: Node) -> list[bytes]:
    """Eight pages put one at a time, the pool's overflow written down; returns their keys."""
    keys = [key(i) for i in range(8)]
    for i in range(8):
        put(node, [keys[i]], [page(i)])
    assert await below(node).settle()
    return keys


def test_a_paced_disk_tier_reads_no_faster_than_its_rate(tmp_path: Path) -> None:
    """--tier-read-rate: reading 4 pages back from disk at 8 pages/s takes at least half a second (a lower
    bound the pacing sleeps guarantee, however loaded the machine)."""
    node = disk_node(tmp_path, tier_read_rate=8.0 * PB)

    async def main() -> None:
        keys = await eight_on_disk(node)
        start = asyncio.get_running_loop().time()
        assert await get(node, keys[:POOL_PAGES]) == [page(i) for i in range(POOL_PAGES)]
        assert asyncio.get_running_loop().time() - start >= POOL_PAGES / 8.0 - 0.01
    try:
        run(main)
    finally:
        node.close()


def test_a_get_with_a_deadline_reads_from_disk_only_what_lands_before_it(tmp_path: Path) -> None:
    """A Get's deadline is the time its caller gives the node before computing the rest: the node starts
    no read expected to end after it (priced at the Get, behind the reads its disk was given since the
    caller's Lookup), so such a read neither keeps the caller waiting nor queues others' reads behind it."""
    node = disk_node(tmp_path, tier_read_rate=50.0 * PB)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await eight_on_disk(node)
        assert await get(node, keys[:2]) == [page(0), page(1)]  # measured: a read, a read-up's fixed cost
        level = node.tiers.levels[0]
        fixed = level.counters.readup_seconds
        level.reading = 10  # others' reads given to the disk since: 10 pages at 50 a second are ahead
        try:
            # (each check after every read started has ended: what was not read was never started)
            await node.promote("ns", keys[2:4], fixed + 0.15)  # its two pages would end at fixed + 0.24 s
            assert await below(node).settle() and not any(k in pool for k in keys[2:4])
            await node.promote("ns", keys[2:4], fixed + 0.23)  # the first would land in time, not the second
            assert await below(node).settle() and keys[2] in pool and keys[3] not in pool
        finally:
            level.reading = 0
        await node.promote("ns", keys[3:6], fixed + 3 / 50.0 + 0.01)  # nothing ahead: all three in time
        assert await below(node).settle() and all(k in pool for k in keys[3:6])
        await node.promote("ns", keys[6:8], None)  # no deadline (the coordinator's promotions): all of it
        assert all(k in pool for k in keys[6:8])
    try:
        run(main)
    finally:
        node.close()


def test_reads_count_as_given_to_the_disk_the_moment_a_get_gives_them(tmp_path: Path) -> None:
    """Two Gets arriving together: the first gives the disk three reads and waits; the second, handled
    before those reads' tasks first run, prices its page behind them (0.06 s at 50 pages a second), so
    with a deadline shorter than that it reads nothing (counted from the tasks' first step, the disk looked
    idle and its page was read behind the others, past its deadline)."""
    node = disk_node(tmp_path, tier_read_rate=50.0 * PB)
    pool = node.namespace("ns").pool

    async def main() -> None:
        keys = await eight_on_disk(node)
        assert await get(node, keys[:2]) == [page(0), page(1)]  # measured: a read, a read-up's fixed cost
        fixed = node.tiers.levels[0].counters.readup_seconds
        down = [k for k in keys if k not in pool]
        first = asyncio.ensure_future(node.promote("ns", down[:3], None))
        await asyncio.sleep(0)  # the first Get has given its reads; their tasks have not run yet
        assert node.tiers.levels[0].reading == 3
        await node.promote("ns", down[3:4], fixed + 0.05)  # alone it would land at fixed + 0.02 s
        await first
        assert await below(node).settle() and all(k in pool for k in down[:3]) and down[3] not in pool
        assert node.tiers.levels[0].reading == 0
    try:
        run(main)
    finally:
        node.close()


def test_a_paced_disk_run_costs_its_pace_per_page_and_waits_behind_the_reads_given_before(tmp_path: Path) -> None:
    """A paced disk reads one page at a time at its rate however many threads wait on it: a run of n pages
    is expected to take at least n pages at that rate (a per-page time divided by the threads would price
    one page at a quarter of its read), and behind the reads the tier was given already (its queue), as
    the simulated disk is priced."""
    node = disk_node(tmp_path, tier_read_rate=50.0 * PB)

    async def main() -> None:
        keys = await eight_on_disk(node)
        assert await get(node, keys[:2]) == [page(0), page(1)]  # measured: a read, a read-up's fixed cost
        level, fixed = node.tiers.levels[0], node.tiers.levels[0].counters.readup_seconds
        (two,) = [r for r in node.tier_runs("ns", keys[2:4]) if r.tier == "disk0"]
        assert two.pages == 2 and two.load_seconds == pytest.approx(fixed + 2 / 50.0)
        level.reading = 3  # three reads given to the disk before this Lookup: its run waits for them too
        try:
            (queued,) = [r for r in node.tier_runs("ns", keys[2:4]) if r.tier == "disk0"]
        finally:
            level.reading = 0
        assert queued.load_seconds == pytest.approx(fixed + (3 + 2) / 50.0)
        # its own pages already being read up (a promotion ahead of a forecast burst): no queue ahead
        promotion = asyncio.ensure_future(node.promote("ns", keys[2:4], 10.0))
        for _ in range(1000):
            if level.reading:
                break
            await asyncio.sleep(0.001)
        assert level.reading > 0
        (joined,) = [r for r in node.tier_runs("ns", keys[2:4]) if r.tier == "disk0"]
        assert joined.load_seconds == pytest.approx(fixed + 2 / 50.0)
        await promotion
        assert await get(node, keys[2:4]) == [page(2), page(3)]
    try:
        run(main)
    finally:
        node.close()


def test_tier_admit_reused_writes_down_only_pages_read_since_stored(stack: Any) -> None:
    """--tier-admit reused: an evicted page never read is declined (counted, gone); one read since its store
    goes down and comes back."""
    node = make_node(stack, tier_admit="reused")

    async def main() -> None:
        keys = [key(i) for i in range(2 * POOL_PAGES)]
        for i in range(POOL_PAGES):
            put(node, [keys[i]], [page(i)])
        assert await get(node, keys[:1]) == [page(0)]   # the first page is read once
        for i in range(POOL_PAGES, 2 * POOL_PAGES):     # the first four are evicted
            put(node, [keys[i]], [page(i)])
        assert await below(node).settle()
        assert node.lookup("ns", keys[:1]) == 1 and all(not node.exists("ns", [k])[0] for k in keys[1:POOL_PAGES])
        first = node.tiers.summary()[0]
        assert first["declined"] == POOL_PAGES - 1 and first["demotions"] == 1
        assert await get(node, keys[:1]) == [page(0)]
    try:
        run(main)
    finally:
        node.close()


def test_tier_admit_predicted_writes_within_its_budget(stack: Any) -> None:
    """--tier-admit predicted: with a budget of many pages a second every evicted page goes down; with a
    budget below one page over the whole horizon none does (declined, counted), and the Lookups feed the
    node's reuse counts."""
    for n, (budget, written) in enumerate(((1e9, POOL_PAGES), (1.0, 0))):
        node = make_node(stack, tier_admit="predicted", tier_write_budget=budget)

        async def main() -> None:  # (fresh keys: the second node finds the first one's pages on disk)
            keys = [key(100 * n + i) for i in range(2 * POOL_PAGES)]
            for i in range(2 * POOL_PAGES):
                put(node, [keys[i]], [page(i)])
            assert await below(node).settle()
            first = node.tiers.summary()[0]
            assert (first["demotions"], first["declined"]) == (written, POOL_PAGES - written)
            node.lookup("ns", keys)  # asks for the evicted pages again
            adm = below(node).admission
            assert adm is not None and sum(adm.reused.values()) == POOL_PAGES
        try:
            run(main)
        finally:
            node.close()


def test_a_run_below_the_pool_costs_a_read_up_however_short(tmp_path: Path) -> None:
    """The expected load time of a run on disk (what an engine weighs against computing its blocks) is its
    pages' reads at the measured rate plus the measured fixed cost of one read-up (a worker's turn, the
    promotion into the pool), counted once per Lookup: a one-page run costs more than one page's read."""
    node = disk_node(tmp_path)

    async def main() -> None:
        keys = await eight_on_disk(node)
        assert await get(node, keys[:2]) == [page(0), page(1)]  # two pages read up from disk
        counters = node.tiers.levels[0].counters
        fixed, per_page = counters.readup_seconds, counters.read_seconds_per_page
        assert fixed > 0 and per_page > 0
        threads = node.config.tier_threads
        (one,) = [r for r in node.tier_runs("ns", keys[2:3]) if r.tier == "disk0"]
        assert one.pages == 1 and one.load_seconds == pytest.approx(fixed + per_page / threads)
        (two,) = [r for r in node.tier_runs("ns", keys[2:4]) if r.tier == "disk0"]
        assert two.pages == 2 and two.load_seconds == pytest.approx(fixed + 2 * per_page / threads)
    try:
        run(main)
    finally:
        node.close()
