"""Tiers below the pool through real ``kvstored`` processes: a pool that holds a quarter of what a client
writes serves everything back from its disk tier on every data path; a peer pulls from a node's disk
without promoting there; a Replicate from a node to itself (the coordinator's promotion ahead of a forecast
burst) brings its disk pages up into its pool; a restarted node serves its disk pages; ``kill -9`` in the
middle of a demotion burst never leads to a wrong page; a full filesystem, a read error, a truncated slab
and a disk folder removed under a running node leave it serving, with the loss counted."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KvClient
from tests.conftest import wait_until

MiB = 1 << 20
PAGE = 256 << 10
POOL_PAGES = 8


def content(key: bytes, page_bytes: int = PAGE) -> np.ndarray:
    """The bytes that belong to ``key``: any page served can be checked on its own."""
    seed = int.from_bytes(key[-8:], "little")
    return np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)


def keys_of(tag: int, n: int) -> list[bytes]:
    return [b"t" + tag.to_bytes(4, "little") + i.to_bytes(8, "little") for i in range(n)]


def start(daemon, tiers: Path, *extra: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    args = ["--capacity", str(POOL_PAGES * PAGE), "--namespace", f"t:{PAGE}", "--shm", "true",
            "--tier", f"disk:{tiers}:{64 * MiB}", *extra]
    if env:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return daemon(*args)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return daemon(*args)


def put_all(kv: KvClient, keys: list[bytes], batch: int = 4) -> None:
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        kv.put("t", chunk, np.stack([content(k) for k in chunk]))


def tier_stats(kv: KvClient) -> dict[str, int | str]:
    stats = kv.stats()
    assert len(stats.tiers) == 1, stats
    t = stats.tiers[0]
    return {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}


@pytest.mark.parametrize("path, io", [("grpc", "direct"), ("tcp", "direct"), ("shm", "direct"), ("tcp", "buffered")])
def test_a_pool_a_quarter_of_the_data_serves_it_all_back(daemon, tmp_path: Path, path: str, io: str) -> None:  # type: ignore[no-untyped-def]
    d = start(daemon, tmp_path / "disk", "--tier-io", io)
    keys = keys_of(1, 4 * POOL_PAGES)
    with KvClient(d.address, data_path=path) as kv:
        put_all(kv, keys)
        wait_until(lambda: tier_stats(kv)["staged_bytes"] == 0, 10, "the demotions to land")
        reply = kv.lookup_nodes("t", keys)
        assert reply.prefix_length == len(keys)  # in the pool or below it: all this node's
        assert sum(r.pages for r in reply.tiers) == len(keys)
        assert {r.tier for r in reply.tiers} <= {"pool", "disk0"} and reply.tiers[0].tier == "disk0"
        for i in range(0, len(keys), 4):
            got = kv.get("t", keys[i:i + 4])
            assert not got.missing, (i, got.missing)
            for k, row in zip(keys[i:i + 4], got.pages):
                assert np.array_equal(row, content(k)), k
        stats = tier_stats(kv)
        assert stats["io"] == io
        assert stats["promotions"] >= 3 * POOL_PAGES and stats["demotions"] >= 3 * POOL_PAGES
        assert stats["bytes_written"] >= stats["demotions"] * PAGE and not stats["degraded"]
        # a read that has to come up from disk says how long it expects (measured, so nonzero now)
        assert any(r.tier == "disk0" and r.load_seconds > 0 for r in kv.lookup_nodes("t", keys).tiers)


def test_a_restarted_node_serves_its_disk_pages(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = start(daemon, tmp_path / "disk")
    keys = keys_of(2, 4 * POOL_PAGES)
    with KvClient(d.address) as kv:
        put_all(kv, keys)
        wait_until(lambda: tier_stats(kv)["staged_bytes"] == 0, 10, "the demotions to land")
    assert d.terminate() == 0
    again = start(daemon, tmp_path / "disk")
    with KvClient(again.address) as kv:
        on_disk = keys[:3 * POOL_PAGES]  # the pool held the last quarter: memory, gone with the process
        assert kv.lookup("t", on_disk) == len(on_disk)
        assert tier_stats(kv)["recovered"] >= len(on_disk)
        for i in range(0, len(on_disk), 4):
            got = kv.get("t", on_disk[i:i + 4])
            assert not got.missing
            assert all(np.array_equal(row, content(k)) for k, row in zip(on_disk[i:i + 4], got.pages))


def test_kill_9_during_demotion_bursts_never_serves_a_wrong_page(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The race is forced, not hoped for: each round's writer puts until its node is gone (bounded far past
    # any round's length), and the kill waits until the node reports demotions to its disk under way.
    rng = random.Random(7)
    written: list[bytes] = []
    for round_ in range(20):
        d = start(daemon, tmp_path / "disk")
        keys = keys_of(100 + round_, 4000)
        stopped = threading.Event()

        def write(address: str = d.address, keys: list[bytes] = keys, stopped: threading.Event = stopped) -> None:
            # every put past the first pool's worth evicts, so demotions run for as long as the puts do
            try:
                with KvClient(address, data_path="tcp") as kv:
                    for i in range(0, len(keys), 2):
                        kv.put("t", keys[i:i + 2], np.stack([content(k) for k in keys[i:i + 2]]))
                        written.extend(keys[i:i + 2])
            except Exception:  # the node was killed under the put: expected
                stopped.set()

        writer = threading.Thread(target=write)
        writer.start()
        with KvClient(d.address) as watch:
            before = tier_stats(watch)["demotions"]
            wait_until(lambda: tier_stats(watch)["demotions"] > before, 30, "demotions under way")
        time.sleep(rng.uniform(0.0, 0.1))
        d.proc.kill()
        d.proc.wait(10)
        writer.join(30)
        assert stopped.is_set(), f"round {round_}: the writer ran out of keys before the kill"
    d = start(daemon, tmp_path / "disk")
    served = 0
    with KvClient(d.address, data_path="tcp") as kv:
        for i in range(0, len(written), 4):
            got = kv.get("t", written[i:i + 4])
            for k, row, hit in zip(written[i:i + 4], got.pages, got.found):
                if hit:
                    served += 1
                    assert np.array_equal(row, content(k)), f"page {k.hex()} served with other bytes"
        # a kill can tear the one record its tier's writer was writing: found when read, counted, never served
        assert tier_stats(kv)["corrupt"] <= 20
    assert served > 0


def test_a_full_filesystem_leaves_the_node_serving_its_pool(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(small)], check=True)
    try:
        d = start(daemon, small)
        keys = keys_of(3, 2 * POOL_PAGES)
        with KvClient(d.address) as kv:
            put_all(kv, keys)
            stats = tier_stats(kv)
            assert stats["degraded"] and stats["pages"] == 0
            wait_until(lambda: tier_stats(kv)["drops"] >= POOL_PAGES, 10, "the dropped demotions to be counted")
            got = kv.get("t", keys[POOL_PAGES:])
            assert not got.missing  # the pool still serves what it holds
        assert "stores nothing more" in d.log_text() or "cannot open" in d.log_text()
        assert d.proc.poll() is None
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_read_errors_lose_those_pages_only(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Root ignores file modes, so the errors are injected at the slab's I/O boundary by its test switch.
    d = start(daemon, tmp_path / "disk", env={"KVSTORE_TEST_FAIL_READS": "1000000"})
    keys = keys_of(4, 3 * POOL_PAGES)
    with KvClient(d.address) as kv:
        put_all(kv, keys)
        wait_until(lambda: tier_stats(kv)["staged_bytes"] == 0, 10, "the demotions to land")
        got = kv.get("t", keys[:4])
        assert len(got.missing) == 4  # each read failed: a miss, never an error or other bytes
        assert tier_stats(kv)["corrupt"] >= 4
        got = kv.get("t", keys[-4:])
        assert not got.missing  # the pool keeps serving
    assert d.proc.poll() is None


def test_a_disk_folder_removed_under_the_node_stops_the_tier_not_the_node(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "disk"
    d = start(daemon, folder)
    keys = keys_of(5, 4 * POOL_PAGES)
    with KvClient(d.address) as kv:
        put_all(kv, keys[:2 * POOL_PAGES])
        wait_until(lambda: tier_stats(kv)["staged_bytes"] == 0, 10, "the demotions to land")
        shutil.rmtree(folder)
        put_all(kv, keys[2 * POOL_PAGES:])
        wait_until(lambda: bool(tier_stats(kv)["degraded"]), 10, "the tier to notice")
        assert tier_stats(kv)["drops"] > 0
        got = kv.get("t", keys[-4:])
        assert not got.missing
    assert "removed under the node" in d.log_text()
    assert d.proc.poll() is None


def test_a_peer_pulls_from_a_nodes_disk_without_promoting_it_there(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fast = ("--heartbeat-interval", "0.1", "--heartbeat-timeout", "0.8", "--transport", "tcp")
    a = start(daemon, tmp_path / "disk", "--node-id", "a", *fast)
    b = daemon("--node-id", "b", "--capacity", str(4 * POOL_PAGES * PAGE), "--namespace", f"t:{PAGE}",
               "--peers", a.address, *fast)
    keys = keys_of(6, 4 * POOL_PAGES)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        put_all(ka, keys)
        wait_until(lambda: tier_stats(ka)["staged_bytes"] == 0, 10, "the demotions to land")

        def a_seen_from_b() -> Any:
            return next((n for n in kb.lookup_nodes("t", keys).nodes if n.node_id == "a"), None)
        wait_until(lambda: (a_seen_from_b() or pb.NodePrefix()).prefix_length == len(keys), 10,
                   "the directory to show all of a's pages")
        seen = a_seen_from_b()
        assert seen.pool_length == 0  # the chain starts with pages a holds below its pool
        before = tier_stats(ka)
        on_disk = keys[:POOL_PAGES]
        got = kb.get("t", on_disk)
        assert not got.missing
        assert all(np.array_equal(row, content(k)) for k, row in zip(on_disk, got.pages))
        after = tier_stats(ka)
        assert after["hits"] >= before["hits"] + POOL_PAGES  # read from a's disk tier...
        assert after["promotions"] == before["promotions"]  # ...and not brought into a's pool
        assert ka.lookup_nodes("t", on_disk).tiers[0].tier == "disk0"


def test_a_replicate_from_the_node_itself_promotes_its_disk_pages_into_its_pool(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    a = start(daemon, tmp_path / "disk", "--node-id", "a")
    keys = keys_of(7, 4 * POOL_PAGES)
    early = keys[:POOL_PAGES // 2]  # written first: evicted down to the disk by the later puts
    with KvClient(a.address) as ka:
        put_all(ka, keys)
        wait_until(lambda: tier_stats(ka)["staged_bytes"] == 0, 10, "the demotions to land")
        assert ka.lookup_nodes("t", early).tiers[0].tier == "disk0"
        before = tier_stats(ka)
        with grpc.insecure_channel(a.address) as channel:
            reply = pb_grpc.ClusterStub(channel).Replicate(
                pb.ReplicateRequest(namespace="t", keys=early, source_node_id="a"), timeout=20)
        assert (reply.copied, reply.already_present, reply.missing) == (len(early), 0, 0)
        assert tier_stats(ka)["promotions"] == before["promotions"] + len(early)
        runs = ka.lookup_nodes("t", early).tiers
        assert runs[0].tier == "pool" and runs[0].pages == len(early)  # in the pool now: no tier read ahead
        got = ka.get("t", early)
        assert all(np.array_equal(row, content(k)) for k, row in zip(early, got.pages))


def test_a_truncated_slab_serves_what_is_left(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = start(daemon, tmp_path / "disk")
    keys = keys_of(7, 4 * POOL_PAGES)
    with KvClient(d.address) as kv:
        put_all(kv, keys)
        wait_until(lambda: tier_stats(kv)["staged_bytes"] == 0, 10, "the demotions to land")
    assert d.terminate() == 0
    (slab,) = (tmp_path / "disk").glob("slab-*.kv")
    stride = 4096 + PAGE  # a header block and the page
    os.truncate(slab, 4096 + 12 * stride + 1000)  # twelve records left whole, the next one cut in its header
    again = start(daemon, tmp_path / "disk")
    with KvClient(again.address) as kv:
        on_disk = keys[:3 * POOL_PAGES]
        held = [k for k, there in zip(on_disk, kv.exists("t", on_disk)) if there]
        assert 0 < len(held) < len(on_disk)  # the records past the cut are gone, the others are served
        for i in range(0, len(held), 4):
            got = kv.get("t", held[i:i + 4])
            assert not got.missing
            assert all(np.array_equal(row, content(k)) for k, row in zip(held[i:i + 4], got.pages))
    assert again.proc.poll() is None
