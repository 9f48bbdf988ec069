"""The disk tier's page store under faults, with real processes and real files: a writer killed with
SIGKILL in the middle of its writes, 20 times, leaves a slab that serves every page completed before
each kill, byte for byte, and nothing it did not write; a full filesystem and a truncated slab leave the
tier serving what it can with the loss counted, never an error."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tiers.disk import DiskPages

PAGE = 8192
WRITES = 400  # per writer; 20 writers fill 8,000 of the slab's slots, so nothing is evicted
CAPACITY = 4096 + 20 * WRITES * (4096 + PAGE)

WRITER = """
import sys
from kvstore.tiers.disk import DiskPages
from tests.integration.test_disk_faults import PAGE, CAPACITY, WRITES, payload
disk = DiskPages(sys.argv[1], "p", PAGE, CAPACITY, io=sys.argv[2])
first = int(sys.argv[3])
print("open", flush=True)
for i in range(first, first + WRITES):
    for page in disk.put("ns", i.to_bytes(8, "little"), payload(i), kind=1 + i % 3):
        sys.stdout.write(f"e {int.from_bytes(page[1], 'little')}\\n")
    sys.stdout.write(f"p {i}\\n")  # one write per line
    sys.stdout.flush()
"""


def payload(i: int) -> bytes:
    return (i.to_bytes(8, "little") * (PAGE // 8))[:PAGE]


def get(disk: DiskPages, namespace: str, key: bytes) -> bytes | None:
    out = bytearray(PAGE)
    return bytes(out) if disk.get_into(namespace, key, memoryview(out)) is not None else None


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_twenty_kills_mid_write_lose_nothing_completed_and_serve_nothing_torn(tmp_path: Path, io: str) -> None:
    rng = random.Random(7)
    completed: set[int] = set()
    started_below = 0
    interrupted = 0  # writers killed before their last write
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for round_ in range(20):
        first = round_ * WRITES
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), io, str(first)], stdout=subprocess.PIPE,
                                text=True, env=env)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "open"
        lines = [proc.stdout.readline().rstrip("\n") for _ in range(rng.randint(1, 300))]
        proc.send_signal(signal.SIGKILL)  # lands while later writes are under way
        proc.wait(10)
        rest = proc.stdout.read().split("\n")
        lines += rest[:-1]  # the text after the last newline is a line the kill cut: its put did end, unrecorded
        proc.stdout.close()
        assert all(line.startswith("p ") for line in lines), [x for x in lines if not x.startswith("p ")][:5]
        completed.update(int(line.split()[1]) for line in lines)
        interrupted += len(lines) < WRITES
        started_below = first + WRITES
    disk = DiskPages(tmp_path, "p", PAGE, CAPACITY, io=io)
    served = 0
    for stored in disk.pages():
        namespace, key = stored.page
        i = int.from_bytes(key, "little")
        assert namespace == "ns" and i < started_below and stored.kind == 1 + i % 3  # nothing it did not write
        got = get(disk, namespace, key)
        if got is not None:  # a torn record is dropped (counted), never served
            assert got == payload(i), i
            served += 1
    assert all(get(disk, "ns", i.to_bytes(8, "little")) == payload(i) for i in completed)
    assert served >= len(completed) > 0
    assert interrupted >= 5, interrupted  # the kills did land mid-burst
    disk.close()


@pytest.fixture
def small_filesystem(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 1 MiB tmpfs (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_filesystem_leaves_the_tier_empty_and_counting(small_filesystem: Path) -> None:
    disk = DiskPages(small_filesystem / "tier", "p", PAGE, 4 << 20)  # 4 MiB of slab on a 1 MiB filesystem
    assert disk.stats.degraded and disk.slots == 0
    assert disk.put("ns", b"k", payload(1)) == [] and disk.stats.drops == 1
    assert get(disk, "ns", b"k") is None
    fits = DiskPages(small_filesystem / "tier2", "p", PAGE, 256 << 10)  # a slab the filesystem holds
    assert not fits.stats.degraded and fits.put("ns", b"k", payload(1)) == []
    assert get(fits, "ns", b"k") == payload(1)
    fits.close()


def test_a_truncated_slab_serves_what_is_left_and_counts_the_rest(tmp_path: Path) -> None:
    disk = DiskPages(tmp_path, "p", PAGE, 4096 + 10 * (4096 + PAGE))
    for i in range(10):
        disk.put("ns", i.to_bytes(8, "little"), payload(i))
    assert disk.slab is not None
    half = 4096 + 5 * disk.slab.stride
    os.truncate(disk.slab.path, half)  # under the running tier
    lost = [i for i in range(10) if get(disk, "ns", i.to_bytes(8, "little")) is None]
    assert lost and disk.stats.corrupt == len(lost)  # the records past the end, counted
    disk.close()
    again = DiskPages(tmp_path, "p", PAGE, 4096 + 10 * (4096 + PAGE))  # a restart keeps what is left
    assert len(again) == 10 - len(lost)
    assert all(get(again, *s.page) == payload(int.from_bytes(s.page[1], "little")) for s in again.pages())
    again.close()
