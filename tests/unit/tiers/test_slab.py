"""The disk tier's slab files, on real files: records round-trip, survive a reopen, and a torn or
changed record is never served. Every test runs over O_DIRECT and buffered I/O."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import xxhash

from kvstore.tiers.slab import BLOCK, Slab, probe_direct

PAGE = 3 * 4096 + 100  # not a multiple of the block: the payload's tail is padded


@pytest.fixture(params=["direct", "buffered"])
def io(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "direct" and probe_direct(tmp_path) != "direct":
        pytest.fail("this filesystem refuses O_DIRECT: the direct path would go untested")
    return str(request.param)


def page(i: int, n: int = PAGE) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def test_records_round_trip_and_come_back_after_a_reopen(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path / "d", "n0", PAGE, 64 * PAGE, io=io) as slab:
        assert slab.io == io and slab.slots > 8
        for i in range(8):
            slab.write(i, "ns", b"key-%d" % i, page(i), generation=100 + i)
        slab.write(3, "other", b"short", page(3, 10), generation=200)  # replaces slot 3's record
        slab.erase(5)
        got = slab.read(2)
        assert got is not None and bytes(got[1]) == page(2)
        assert (got[0].namespace, got[0].key, got[0].generation) == ("ns", b"key-2", 102)
        assert slab.read(5) is None and slab.read(20) is None
    with Slab(tmp_path / "d", "n0", PAGE, 64 * PAGE, io=io) as again:
        found = {r.slot: r for r in again.scan()}
        assert sorted(found) == [0, 1, 2, 3, 4, 6, 7]
        assert (found[3].namespace, found[3].key, found[3].length, found[3].generation) == ("other", b"short", 10, 200)
        for slot in (0, 1, 4, 6, 7):
            record, payload = again.read(slot)  # type: ignore[misc]
            assert bytes(payload) == page(slot) and record.key == b"key-%d" % slot
        assert again.corrupt == 0


def test_a_torn_payload_is_counted_and_never_served(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as slab:
        slab.write(1, "ns", b"k", page(1), generation=1)
        offset = BLOCK + 1 * slab.stride + BLOCK + 4096  # inside the payload
    with open(slab.path, "r+b") as f:  # a write that stopped half way: the tail of the payload is old bytes
        f.seek(offset)
        f.write(b"\0" * 4096)
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as again:
        assert [r.slot for r in again.scan()] == [1]  # the header checks; the payload is checked on read
        assert again.read(1) is None and again.corrupt == 1


def test_a_damaged_header_leaves_the_slot_empty(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as slab:
        for i in range(3):
            slab.write(i, "ns", b"k%d" % i, page(i), generation=i)
        at = BLOCK + 1 * slab.stride + 20  # a byte of slot 1's header
    with open(slab.path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff")
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as again:
        assert [r.slot for r in again.scan()] == [0, 2]
        assert again.read(1) is None


def test_the_file_is_bounded_private_and_restarts_empty_with_another_geometry(tmp_path: Path, io: str) -> None:
    capacity = 10 * PAGE
    with Slab(tmp_path / "tier", "n0", PAGE, capacity, io=io) as slab:
        assert os.path.getsize(slab.path) <= capacity
        assert stat.S_IMODE(os.stat(slab.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(slab.table_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "tier").st_mode) == 0o700
        slab.write(0, "ns", b"k", page(0), generation=1)
        with pytest.raises(IndexError):
            slab.write(slab.slots, "ns", b"k", page(0), generation=1)
        with pytest.raises(ValueError):
            slab.write(1, "ns", b"k", page(0, PAGE + 1), generation=1)
    with Slab(tmp_path / "tier", "n0", 2 * PAGE, capacity, io=io) as bigger:  # another page size
        assert list(bigger.scan()) == []


def test_names_that_could_leave_the_directory_are_refused(tmp_path: Path) -> None:
    for bad in ("../x", "a/b", "", "x" * 65):
        with pytest.raises(ValueError):
            Slab(tmp_path, bad, PAGE, 4 * PAGE)


def test_kind_and_checksum_come_back_from_the_table_and_from_a_scan(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as slab:
        slab.write(0, "ns", b"a", page(0), generation=5, kind=2, checksum=xxhash.xxh3_64_intdigest(page(0)))
        slab.write(2, "ns", b"b" * 250, page(2), generation=6, kind=3, checksum=xxhash.xxh3_64_intdigest(page(2)), used=40)  # names too long to inline
        slab.write(3, "ns", b"c", page(3), generation=7)
        slab.erase(3)
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as again:
        found = {r.slot: r for r in again.records()}
        assert sorted(found) == [0, 2]
        assert (found[0].kind, found[0].checksum, found[0].used) == (2, xxhash.xxh3_64_intdigest(page(0)), 5)
        assert (found[2].key, found[2].kind, found[2].checksum, found[2].used) == (b"b" * 250, 3, xxhash.xxh3_64_intdigest(page(2)), 40)
        out = bytearray(PAGE)
        got = again.read_into(2, memoryview(out), expect=found[2])
        assert got is not None and bytes(out) == page(2)
        assert again.read_into(2, memoryview(out), expect=found[0]) is None  # another record: not served
        assert again.corrupt == 0
    again.table_path.unlink()  # no table: rebuilt from the headers, with the same records
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as third:
        assert {(r.slot, r.key, r.kind, r.checksum) for r in third.records()} == {
            (0, b"a", 2, xxhash.xxh3_64_intdigest(page(0))), (2, b"b" * 250, 3, xxhash.xxh3_64_intdigest(page(2)))}
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as fourth:  # and the rebuilt table is used next time
        assert sorted(r.slot for r in fourth.records()) == [0, 2]


def test_a_slab_of_the_older_format_opens_empty(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as slab:
        slab.write(0, "ns", b"a", page(0), generation=1)
    with open(slab.path, "r+b") as f:  # the superblock's version field
        f.seek(8)
        f.write((1).to_bytes(2, "little"))
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as again:
        assert again.records() == [] and list(again.scan()) == []


def test_a_table_entry_torn_by_a_kill_reads_as_empty(tmp_path: Path, io: str) -> None:
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as slab:
        slab.write(0, "ns", b"a", page(0), generation=1)
        slab.write(1, "ns", b"b", page(1), generation=2)
    with open(slab.table_path, "r+b") as f:
        f.seek(BLOCK + 1 * 256 + 60)  # inside slot 1's entry
        f.write(b"\xff\xff")
    with Slab(tmp_path, "n0", PAGE, 16 * PAGE, io=io) as again:
        assert [r.key for r in again.records()] == [b"a"]
