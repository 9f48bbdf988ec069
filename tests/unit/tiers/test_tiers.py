"""The PageTier behaviour both tiers share, run over the host tier and the disk tier (O_DIRECT and buffered):
pages round-trip with their kind and checksum, eviction is least recently used first, a share evicts only
its own namespace, held pages are never evicted (a put with nothing evictable is dropped and counted),
spill sees the victim's bytes, and threads putting and getting at once never see another page's bytes.
Then what only the disk tier does: a reopen keeps kind, checksum and order; a failing read drops one
page and the tier serves the rest."""

from __future__ import annotations

import mmap
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.tiers.base import PageTier, Stored
from kvstore.tiers.disk import DiskPages
from kvstore.tiers.host import HostPages
from kvstore.tiers.slab import BLOCK, FAIL_READS_ENV, probe_direct

PAGE = 8192

Make = Callable[[int], PageTier]


def page(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (PAGE // 4))[:PAGE]


def key(i: int) -> bytes:
    return b"k%d" % i


def read(tier: PageTier, namespace: str, k: bytes) -> bytes | None:
    out = bytearray(PAGE)
    return bytes(out) if tier.get_into(namespace, k, memoryview(out)) is not None else None


@pytest.fixture(params=["host", "direct", "buffered"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """``make(slots)``: a fresh tier of ``slots`` pages of each kind."""
    if request.param == "direct" and probe_direct(tmp_path) != "direct":
        pytest.fail("this filesystem refuses O_DIRECT: the direct path would go untested")
    made: list[PageTier] = []

    def build(slots: int) -> PageTier:
        if request.param == "host":
            tier: PageTier = HostPages("t", PAGE, slots * PAGE)
        else:
            tier = DiskPages(tmp_path / f"t{len(made)}", "t", PAGE, BLOCK + slots * (BLOCK + PAGE), io=request.param)
        made.append(tier)
        assert tier.stats.capacity_pages == slots
        return tier

    yield build
    for tier in made:
        tier.close()


def test_pages_round_trip_with_their_kind_and_checksum(make: Make) -> None:
    tier = make(4)
    assert tier.put("ns", key(1), page(1), kind=2, checksum=xxhash.xxh3_64_intdigest(page(1))) == []
    out = bytearray(PAGE)
    got = tier.get_into("ns", key(1), memoryview(out))
    assert got == Stored(("ns", key(1)), 2, xxhash.xxh3_64_intdigest(page(1))) and bytes(out) == page(1)
    aligned = mmap.mmap(-1, PAGE)  # the no-copy path of O_DIRECT
    assert tier.get_into("ns", key(1), memoryview(aligned)) is not None and aligned[:] == page(1)
    assert tier.get_into("ns", key(2), memoryview(out)) is None
    assert ("ns", key(1)) in tier and len(tier) == 1
    assert tier.stats.hits == 2 and tier.stats.misses == 1 and tier.stats.writes == 1 and tier.stats.pages == 1
    assert tier.put("ns", key(1), page(1)) == [] and tier.stats.writes == 1  # held: only touched
    with pytest.raises(ValueError):
        tier.put("ns", key(3), page(3)[:-1])  # pages are page_bytes long


def test_a_full_tier_evicts_its_least_recently_used_page(make: Make) -> None:
    tier = make(4)
    for i in range(4):
        assert tier.put("ns", key(i), page(i)) == []
    assert read(tier, "ns", key(0)) == page(0)  # k1 is now the least recently used
    assert tier.put("ns", key(2), page(2)) == []  # touched: k1, k3, k0, k2
    assert tier.put("ns", key(4), page(4)) == [("ns", key(1))]
    assert tier.put("ns", key(5), page(5)) == [("ns", key(3))]
    assert [s.page[1] for s in tier.pages()] == [key(0), key(2), key(4), key(5)]
    assert read(tier, "ns", key(1)) is None and read(tier, "ns", key(4)) == page(4)
    assert tier.stats.evictions == 2 and len(tier) == 4


def test_a_share_evicts_only_its_own_namespace(make: Make) -> None:
    tier = make(6)
    for i in range(3):
        tier.put("other", key(i), page(i))
    tier.set_share("tenant", 2)
    tier.put("tenant", key(10), page(10))
    tier.put("tenant", key(11), page(11))
    assert tier.put("tenant", key(12), page(12)) == [("tenant", key(10))]  # a free slot is left, yet its own goes
    assert len(tier) == 5 and all(("other", key(i)) in tier for i in range(3))
    tier.put("other", key(3), page(3))  # the last free slot
    assert tier.put("other", key(4), page(4)) == [("other", key(0))]  # no share: the tier's least recently used
    tier.set_share("tenant", 1)  # made smaller: the next put evicts down to it
    assert sorted(tier.put("tenant", key(13), page(13))) == [("tenant", key(11)), ("tenant", key(12))]
    assert [s.page for s in tier.pages() if s.page[0] == "tenant"] == [("tenant", key(13))]
    tier.set_share("none", 0)
    assert tier.put("none", key(1), page(1)) == [] and ("none", key(1)) not in tier and tier.stats.drops == 1


def test_held_pages_are_never_evicted_and_a_put_with_nothing_evictable_is_dropped(make: Make) -> None:
    tier = make(2)
    tier.put("ns", key(0), page(0))
    tier.put("ns", key(1), page(1))
    assert tier.hold(("ns", key(0))) and not tier.hold(("ns", key(9)))
    assert tier.put("ns", key(2), page(2)) == [("ns", key(1))]  # k0 is older but held
    assert tier.hold(("ns", key(2)))
    assert tier.put("ns", key(3), page(3)) == [] and ("ns", key(3)) not in tier
    assert tier.stats.drops == 1 and len(tier) == 2
    tier.unhold(("ns", key(0)))
    assert tier.put("ns", key(3), page(3)) == [("ns", key(0))]
    assert read(tier, "ns", key(2)) == page(2) and read(tier, "ns", key(3)) == page(3)


def test_spill_gets_each_victims_bytes_kind_and_checksum_before_its_slot_is_reused(make: Make) -> None:
    tier = make(3)
    for i in range(3):
        tier.put("ns", key(i), page(i), kind=1 + i % 3, checksum=xxhash.xxh3_64_intdigest(page(i)))
    spilled: list[tuple[tuple[str, bytes], int, int, bytes]] = []
    for i in range(3, 6):
        assert tier.put("ns", key(i), page(i), spill=lambda p, k, c, b: spilled.append((p, k, c, bytes(b)))) == [
            ("ns", key(i - 3))]
    assert spilled == [(("ns", key(i)), 1 + i % 3, xxhash.xxh3_64_intdigest(page(i)), page(i)) for i in range(3)]
    assert [read(tier, "ns", key(i)) for i in range(3, 6)] == [page(i) for i in range(3, 6)]


def test_remove_and_pages(make: Make) -> None:
    tier = make(4)
    for i in range(3):
        tier.put("ns", key(i), page(i), kind=3, checksum=xxhash.xxh3_64_intdigest(page(i)))
    assert tier.remove("ns", key(1)) and not tier.remove("ns", key(1))
    assert read(tier, "ns", key(1)) is None and ("ns", key(1)) not in tier and len(tier) == 2
    assert tier.pages() == [Stored(("ns", key(i)), 3, xxhash.xxh3_64_intdigest(page(i))) for i in (0, 2)]
    for i in range(3, 5):
        assert tier.put("ns", key(i), page(i)) == []  # the removed page's slot is free again
    assert len(tier) == 4 and tier.stats.evictions == 0


def test_threads_putting_and_getting_at_once_never_see_another_pages_bytes(make: Make) -> None:
    tier = make(8)  # far fewer slots than keys: slots are evicted and rewritten under the readers
    keys = 40
    wrong: list[int] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(keys)
            tier.put("ns", key(i), page(i), checksum=xxhash.xxh3_64_intdigest(page(i)))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        out = bytearray(PAGE)
        while not stop.is_set():
            i = rng.randrange(keys)
            got = tier.get_into("ns", key(i), memoryview(out))
            if got is not None and (bytes(out) != page(i) or got.checksum != xxhash.xxh3_64_intdigest(page(i))):
                wrong.append(i)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader, args=(10 + s,)) for s in range(4)]
    for t in threads:
        t.start()
    stop.wait(1.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert not wrong and tier.stats.hits > 0 and tier.stats.corrupt == 0
    assert len(tier) <= 8 and all(read(tier, *s.page) == page(int(s.page[1][1:])) for s in tier.pages())


# ---- the disk tier only ---------------------------------------------------------------
@pytest.fixture(params=["direct", "buffered"])
def io(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_reopened_disk_tier_keeps_kind_checksum_and_lru_order(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "t", PAGE, 1 << 20, io=io)
    for i in range(6):
        disk.put("ns" if i % 2 else "other", key(i), page(i), kind=1 + i % 3, checksum=xxhash.xxh3_64_intdigest(page(i)))
    read(disk, "other", key(0))
    read(disk, "ns", key(3))
    disk.put("other", key(2), page(2))  # a touch
    before = disk.pages()
    assert [s.page[1] for s in before] == [key(1), key(4), key(5), key(0), key(3), key(2)]
    disk.close()
    again = DiskPages(tmp_path, "t", PAGE, 1 << 20, io=io)
    assert again.pages() == before and again.stats.recovered == 6
    assert all(read(again, *s.page) == page(int(s.page[1][1:])) for s in before)
    again.close()


def test_a_failing_read_drops_that_page_and_the_tier_serves_the_rest(tmp_path: Path, io: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskPages(tmp_path, "t", PAGE, 1 << 20, io=io)
    for i in range(4):
        disk.put("ns", key(i), page(i))
    monkeypatch.setenv(FAIL_READS_ENV, "1")  # the next read fails with EIO
    assert read(disk, "ns", key(2)) is None
    assert disk.stats.corrupt == 1 and ("ns", key(2)) not in disk and len(disk) == 3
    assert [read(disk, "ns", key(i)) for i in (0, 1, 3)] == [page(i) for i in (0, 1, 3)]
    assert disk.put("ns", key(5), page(5)) == [] and read(disk, "ns", key(5)) == page(5)
    monkeypatch.setenv(FAIL_READS_ENV, "0.5")
    lost = sum(read(disk, "ns", key(i)) is None for i in (0, 1, 3, 5))
    assert disk.stats.corrupt == 1 + lost and len(disk) == 4 - lost and not disk.stats.degraded
