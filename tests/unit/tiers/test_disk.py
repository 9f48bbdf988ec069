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


def get(disk: DiskPages, namespace: str, key: bytes) -> bytes | None:
    out = bytearray(PAGE)
    return bytes(out) if disk.get_into(namespace, key, memoryview(out)) is not None else None


@pytest.fixture(params=["direct", "buffered"])
def io(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_full_tier_evicts_its_least_recently_used_page(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, BLOCK + 4 * (BLOCK + PAGE), io=io)
    assert disk.slots == 4 and disk.io == io
    for i in range(4):
        assert disk.put("ns", b"k%d" % i, page(i)) == []
    assert get(disk, "ns", b"k0") is not None  # k1 is now the least recently used
    assert disk.put("ns", b"k1", page(1)) == []  # held already: touched, not written again
    assert disk.stats.writes == 4
    assert disk.put("ns", b"k4", page(4)) == [("ns", b"k2")]
    assert ("ns", b"k2") not in disk and get(disk, "ns", b"k2") is None
    assert get(disk, "ns", b"k4") == page(4)
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
    assert get(again, "ns", b"k5") == page(5)
    assert all(get(again, "ns", b"k%d" % i) == page(i) for i in (0, 1, 2, 4, 6, 7, 8, 9))
    again.put("ns", b"new", page(42))  # generations continue above what was found
    again.close()
    third = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    assert get(third, "ns", b"new") == page(42) and len(third) == 10
    third.close()


def test_a_corrupt_record_is_dropped_counted_and_its_slot_reused(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, BLOCK + 2 * (BLOCK + PAGE), io=io)
    disk.put("ns", b"a", page(1))
    assert disk.slab is not None
    stride = disk.slab.stride
    with open(disk.slab.path, "r+b") as f:  # bytes changed on disk under slot 0's payload
        f.seek(BLOCK + 0 * stride + BLOCK + 100)
        f.write(b"\x01\x02\x03")
    assert get(disk, "ns", b"a") is None and disk.stats.corrupt == 1 and ("ns", b"a") not in disk
    assert disk.put("ns", b"b", page(2)) == [] and disk.put("ns", b"c", page(3)) == []  # both slots usable
    disk.close()


def test_a_removed_directory_stops_the_writes_and_keeps_the_reads(tmp_path: Path, io: str) -> None:
    where = tmp_path / "tier"
    disk = DiskPages(where, "p8k", PAGE, 1 << 20, io=io)
    disk.put("ns", b"a", page(1))
    shutil.rmtree(where)
    assert disk.put("ns", b"b", page(2)) == []
    assert disk.stats.drops == 1 and "removed" in disk.stats.degraded and ("ns", b"b") not in disk
    assert get(disk, "ns", b"a") == page(1)  # the open file still reads
    disk.close()


def test_a_tier_that_cannot_open_starts_degraded_and_empty(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    disk = DiskPages(blocker / "tier", "p8k", PAGE, 1 << 20)
    assert disk.slots == 0 and disk.stats.degraded
    assert disk.put("ns", b"a", page(1)) == [] and disk.stats.drops == 1 and get(disk, "ns", b"a") is None


def test_a_table_entry_that_names_an_older_record_of_its_slot_is_never_served(tmp_path: Path, io: str) -> None:
    disk = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    disk.put("ns", b"a", page(1))
    disk.put("ns", b"b", page(2))
    assert disk.slab is not None
    slot = disk.slab.records()[0].slot
    table = disk.slab.table_path
    disk.close()
    entry_at = BLOCK + slot * 256
    old_entry = table.read_bytes()[entry_at:entry_at + 256]
    with Slab(tmp_path, "p8k", PAGE, 1 << 20, io=io) as slab:  # a kill between a record and its entry
        slab.write(slot, "ns", b"c", page(3), generation=99)
    with open(table, "r+b") as f:
        f.seek(entry_at)
        f.write(old_entry)
    again = DiskPages(tmp_path, "p8k", PAGE, 1 << 20, io=io)
    assert [s.page for s in again.pages()] == [("ns", b"a"), ("ns", b"b")]
    assert get(again, "ns", b"a") is None and again.stats.corrupt == 1 and ("ns", b"a") not in again
    assert get(again, "ns", b"b") == page(2) and ("ns", b"c") not in again
    again.close()
