"""The disk tier's page store over a real slab file: bounded with LRU eviction, back after a reopen,
corrupt records dropped, and a removed directory or an unusable one degrades it without an error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvstore.tiers.disk import DiskPages
from kvstore.tiers.slab import BLOCK, Slab

PAGE = 8192


def page(i: int) -> bytes:
    return bytes([i % 256]) * PAGE


@pytest.fixture(params=["direct", "buffered"])
def io(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_full_tier_evicts_its_least_recently_used_page(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, BLOCK + 4 * (BLOCK + PAGE), io=io)
    assert disk.slots == 4 and disk.io == io
    for i in range(4):
        assert disk.put("ns", b"k%d" % i, page(i)) == []
    assert disk.get("ns", b"k0") is not None  # k1 is now the least recently used
    assert disk.put("ns", b"k1", page(1)) == []  # held already: touched, not written again
    assert disk.stats.writes == 4
    assert disk.put("ns", b"k4", page(4)) == [("ns", b"k2")]
    assert ("ns", b"k2") not in disk and disk.get("ns", b"k2") is None
    assert bytes(disk.get("ns", b"k4")) == page(4)  # type: ignore[arg-type]
    assert disk.stats.evictions == 1 and len(disk) == 4
    with pytest.raises(ValueError):
        disk.put("ns", b"big", bytes(PAGE + 1))
    disk.close()


def test_a_reopened_tier_serves_what_it_held_and_the_newest_of_two_records(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    for i in range(10):
        disk.put("ns", b"k%d" % i, page(i))
    assert disk.remove("ns", b"k3")
    disk.close()
    with Slab(tmp_path, "p8k", PAGE, 1 << 20, io=io) as slab:  # a crash left an older record of k5 behind
        free = next(s for s in range(slab.slots) if s not in {r.slot for r in slab.scan()})
        slab.write(free, "ns", b"k5", page(99), generation=0)
    again = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    assert again.stats.recovered == 9 and ("ns", b"k3") not in again
    assert bytes(again.get("ns", b"k5")) == page(5)  # type: ignore[arg-type]
    assert all(bytes(again.get("ns", b"k%d" % i)) == page(i) for i in (0, 1, 2, 4, 6, 7, 8, 9))  # type: ignore[arg-type]
    again.put("ns", b"new", page(42))  # generations continue above what was found
    again.close()
    third = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    assert bytes(third.get("ns", b"new")) == page(42) and len(third) == 10  # type: ignore[arg-type]
    third.close()


def test_a_corrupt_record_is_dropped_counted_and_its_slot_reused(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, BLOCK + 2 * (BLOCK + PAGE), io=io)
    disk.put("ns", b"a", page(1))
    assert disk.slab is not None
    stride = disk.slab.stride
    with open(disk.slab.path, "r+b") as f:  # bytes changed on disk under slot 0's payload
        f.seek(BLOCK + 0 * stride + BLOCK + 100)
        f.write(b"\x01\x02\x03")
    assert disk.get("ns", b"a") is None and disk.stats.corrupt == 1 and ("ns", b"a") not in disk
    assert disk.put("ns", b"b", page(2)) == [] and disk.put("ns", b"c", page(3)) == []  # both slots usable
    disk.close()


def test_a_removed_directory_stops_the_writes_and_keeps_the_reads(tmp_path: Path, io: str) -> None:
    where = tmp_path / "tier"
    disk = DiskPages(where, "p8k", PAGE, 1 << 20, io=io)
    disk.put("ns", b"a", page(1))
    shutil.rmtree(where)
    assert disk.put("ns", b"b", page(2)) == []
    assert disk.stats.drops == 1 and "removed" in disk.stats.degraded and ("ns", b"b") not in disk
    assert bytes(disk.get("ns", b"a")) == page(1)  # type: ignore[arg-type]  # the open file still reads
    disk.close()


def test_a_tier_that_cannot_open_starts_degraded_and_empty(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    disk = DiskPages(blocker / "tier", "p8k", PAGE, 1 << 20)
    assert disk.slots == 0 and disk.stats.degraded
    assert disk.put("ns", b"a", page(1)) == [] and disk.stats.drops == 1 and disk.get("ns", b"a") is None
