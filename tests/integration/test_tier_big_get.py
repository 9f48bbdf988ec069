"""A Get of more pages than the pool can hold at once, through real ``kvstored`` processes: a node with a
32-page pool and a disk tier, 128 pages put, serves all 64 pages of one Get (the bytes that belong to
each key) on the gRPC path and on the data channel, before and after a ``kill -9`` and a restart on the
same disk folder; pages a lease pins in the pool stay there meanwhile. Over shared memory one Get answers
from the pool's slots: at most what the pool holds at once, a leading run, the rest in a next Get."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore_client import KvClient
from tests.conftest import wait_until

MiB = 1 << 20
PAGE = MiB
POOL_PAGES = 32
NS = "demo"


def content(key: bytes) -> np.ndarray:
    """The bytes that belong to ``key``: any page served can be checked on its own."""
    seed = int.from_bytes(key[-8:], "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def keys_of(tag: int, n: int) -> list[bytes]:
    return [b"b" + tag.to_bytes(4, "little") + i.to_bytes(8, "little") for i in range(n)]


def start(daemon, disk: Path, *extra: str):  # type: ignore[no-untyped-def]
    """The node of the report: ``--capacity 32MiB --namespace demo:1MiB --tier disk:DIR:512MiB``; gRPC
    messages of at most 4 MiB, so a Get's answer there comes in many messages."""
    return daemon("--capacity", f"{POOL_PAGES}MiB", "--namespace", f"{NS}:{PAGE}", "--tier", f"disk:{disk}:512MiB",
                  "--max-message-bytes", "4MiB", *extra)


def put_all(kv: KvClient, keys: list[bytes], batch: int = 8) -> None:
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        kv.put(NS, chunk, np.stack([content(k) for k in chunk]))


def staged_bytes(kv: KvClient) -> int:
    (tier,) = kv.stats().tiers
    return tier.staged_bytes


def assert_all_served(kv: KvClient, keys: list[bytes]) -> None:
    got = kv.get(NS, keys)
    assert not got.missing, f"{len(got.missing)} of {len(keys)} pages missing"
    bad = [i for i, (k, row) in enumerate(zip(keys, got.pages)) if not np.array_equal(row, content(k))]
    assert not bad, f"pages {bad} came back with other bytes"


@pytest.mark.parametrize("path, device", [("grpc", "cpu"), ("tcp", "cpu"), ("tcp", "cpu-staged")])
def test_a_get_larger_than_the_pool_serves_every_page_also_after_kill_9(daemon, tmp_path: Path, path: str,  # type: ignore[no-untyped-def]
                                                                         device: str) -> None:
    """(``cpu-staged``: a host pool driven like a GPU pool, its pages packed into staging to be sent.)"""
    disk = tmp_path / "disk"
    d = start(daemon, disk, "--device", device)
    keys = keys_of(1, 4 * POOL_PAGES)
    first = keys[:2 * POOL_PAGES]
    with KvClient(d.address, data_path=path) as kv:
        put_all(kv, keys)
        wait_until(lambda: staged_bytes(kv) == 0, 30, "the demotions to land")
        assert kv.lookup(NS, first) == len(first)
        assert_all_served(kv, first)  # all of it below the pool
        assert_all_served(kv, first)  # part of it in the pool now
        assert_all_served(kv, keys)   # the whole lot: 4 pools' worth
        assert kv.lookup(NS, first) == len(first)
    d.proc.kill()
    d.proc.wait(10)
    again = start(daemon, disk, "--device", device)
    with KvClient(again.address, data_path=path) as kv:
        assert kv.lookup(NS, first) == len(first)
        assert_all_served(kv, first)
        assert_all_served(kv, first[::-1])  # any order; the answer follows the keys
        with_repeats = first[:8] * 2 + first
        got = kv.get(NS, with_repeats)
        assert not got.missing and all(np.array_equal(r, content(k)) for k, r in zip(with_repeats, got.pages))


@pytest.mark.parametrize("path", ["grpc", "tcp"])
def test_pages_leased_in_the_pool_stay_while_a_big_get_is_served_from_disk(daemon, tmp_path: Path, path: str) -> None:  # type: ignore[no-untyped-def]
    d = start(daemon, tmp_path / "disk")
    keys = keys_of(2, 3 * POOL_PAGES)
    with KvClient(d.address, data_path=path) as kv:
        put_all(kv, keys)
        wait_until(lambda: staged_bytes(kv) == 0, 30, "the demotions to land")
        last = keys[-POOL_PAGES:]  # the pool holds these: a lease pins all of it, nothing is left to evict
        lease = kv.lookup_lease(NS, last, ttl=60)
        assert lease.leased_length == POOL_PAGES
        assert_all_served(kv, keys[:2 * POOL_PAGES])  # every page from disk, none through the pool
        runs = kv.lookup_nodes(NS, last).tiers
        assert [(r.tier, r.pages) for r in runs] == [("pool", POOL_PAGES)]  # the leased pages were not evicted
        assert_all_served(kv, keys)
        assert [(r.tier, r.pages) for r in kv.lookup_nodes(NS, last).tiers] == [("pool", POOL_PAGES)]


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shared memory needs memfd (Linux)")
def test_over_shared_memory_a_get_answers_what_the_pool_holds_at_once(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = start(daemon, tmp_path / "disk", "--shm", "true")
    keys = keys_of(3, 4 * POOL_PAGES)
    first = keys[:2 * POOL_PAGES]
    with KvClient(d.address, data_path="shm") as kv:
        put_all(kv, keys)
        wait_until(lambda: staged_bytes(kv) == 0, 30, "the demotions to land")
        got = kv.get(NS, first)
        found = [k not in set(got.missing) for k in first]
        n = sum(found)
        assert n == POOL_PAGES and all(found[:n])  # a leading run, as much as the pool holds
        assert all(np.array_equal(r, content(k)) for k, r, hit in zip(first, got.pages, found) if hit)
        rest = kv.get(NS, first[n:])
        assert not rest.missing and all(np.array_equal(r, content(k)) for k, r in zip(first[n:], rest.pages))
