"""The tier stack through real ``kvstored`` processes (part of ``kvctl bench tiers``).

* :func:`promote_vs_pool`: a node whose pool holds a quarter of what a client writes, with a disk tier;
  the client reads everything back over the data channel (``tcp``), and the GB/s of the Gets served from
  disk (each one promotes its pages) is set against the same Gets from a node whose pool holds it all.
* :func:`restart_time`: a slab of N pages written beforehand (the disk tier's own page store, as a node
  leaves it), then the time from ``exec`` of a node over it until it answers a Lookup of its pages, and a
  check (not timed) that it holds all N.
* :func:`p99_under_demotion`: Put and Get latency of a namespace whose pool is never full while a second
  process writes into another namespace whose pool is (so its evictions go down to disk as fast as it
  writes), against the same load on a node without tiers; with the demotion rate reached.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.launch import NodeProcess
from kvstore.tiers.stack import slab_name

MiB = 1 << 20


def _tier_stats(kv: Any) -> Any:
    stats = kv.stats()
    return stats.tiers[0] if stats.tiers else None


def _settle(kv: Any, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        t = _tier_stats(kv)
        if t is None or t.staged_bytes == 0:
            return
        time.sleep(0.01)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def _pages(n: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def _read_rate(kv: Any, ns: str, keys: list[bytes], batch: int, page_bytes: int) -> tuple[float, int]:
    """GB/s of Gets of ``keys`` in batches, and how many pages were missing."""
    out = np.empty((batch, page_bytes), dtype=np.uint8)
    missing = 0
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        got = kv.get(ns, keys[i:i + batch], out=out[:len(keys[i:i + batch])])
        missing += len(got.missing)
    seconds = time.perf_counter() - start
    return len(keys) * page_bytes / seconds / 1e9, missing


def promote_vs_pool(folder: Path, page_bytes: int, pages: int, batch: int, io: str) -> dict[str, Any]:
    """Get GB/s of pages promoted from disk against the same Gets from a pool (module doc)."""
    from kvstore_client import KvClient

    data = _pages(pages, page_bytes)
    keys = _keys("p", pages)
    pool_pages = max(batch, pages // 4)
    tier = f"disk:{folder}:{pages * (page_bytes + 8192) + MiB}"
    row: dict[str, Any] = {"page_bytes": page_bytes, "batch": batch, "pages": pages, "pool_pages": pool_pages}
    node = NodeProcess(["--capacity", str(pool_pages * page_bytes), "--namespace", f"b:{page_bytes}",
                        "--tier", tier, "--tier-io", io, "--shm", "false"])
    try:
        with KvClient(node.address, data_path="tcp") as kv:
            for i in range(0, pages, batch):
                kv.put("b", keys[i:i + batch], data[i:i + batch])
            _settle(kv)
            below = keys[:pages - pool_pages]  # the pool kept the last ones written
            row["promote_gbps"], row["promote_missing"] = _read_rate(kv, "b", below, batch, page_bytes)
            t = _tier_stats(kv)
            row["io"], row["promotions"] = t.io, t.promotions
    finally:
        node.terminate()
    node = NodeProcess(["--capacity", str((pages + batch) * page_bytes), "--namespace", f"b:{page_bytes}",
                        "--shm", "false"])
    try:
        with KvClient(node.address, data_path="tcp") as kv:
            for i in range(0, pages, batch):
                kv.put("b", keys[i:i + batch], data[i:i + batch])
            row["pool_gbps"], _ = _read_rate(kv, "b", keys[:pages - pool_pages], batch, page_bytes)
    finally:
        node.terminate()
    row["promote_over_pool"] = row["promote_gbps"] / row["pool_gbps"]
    return row


def restart_time(folder: Path, n: int, io: str, progress: Any = None) -> dict[str, Any]:
    """Seconds from exec of a node over a slab of ``n`` 4 KiB pages until it answers Lookups for them."""
    from kvstore.tiers.disk import DiskPages
    from kvstore_client import KvClient

    page_bytes, ns = 4096, "r"
    capacity = n * (page_bytes + 4096) + 64 * 4096
    folder.mkdir(parents=True, exist_ok=True)
    store = DiskPages(folder, slab_name(ns, page_bytes), page_bytes, capacity, io=io)
    payload = bytes(page_bytes)
    for i in range(n):
        store.put(ns, i.to_bytes(8, "little"), payload)
        if progress is not None and i % 4096 == 0:
            progress.update(min(4096, n - i))
    store.close()
    os.sync()
    sample = [int(i).to_bytes(8, "little") for i in np.random.default_rng(1).choice(n, min(n, 1000), replace=False)]
    start = time.perf_counter()
    node = NodeProcess(["--capacity", str(64 * page_bytes), "--namespace", f"{ns}:{page_bytes}",
                        "--tier", f"disk:{folder}:{capacity}", "--tier-io", io, "--shm", "false"])
    try:
        with KvClient(node.address, data_path="grpc") as kv:
            while not all(kv.exists(ns, sample)):
                time.sleep(0.001)
            seconds = time.perf_counter() - start
            held = 0
            for i in range(0, n, 65536):
                held += sum(kv.exists(ns, [j.to_bytes(8, "little") for j in range(i, min(n, i + 65536))]))
    finally:
        node.terminate()
    return {"pages": n, "seconds": seconds, "held": held}


def _writer(address: str, page_bytes: int, seconds: float, pages_out: Any) -> None:
    """(a process) Put distinct pages into namespace ``cold`` as fast as the node takes them."""
    from kvstore_client import KvClient

    block = _pages(4, page_bytes)
    end, i = time.monotonic() + seconds, 0
    with KvClient(address, data_path="tcp") as kv:
        while time.monotonic() < end:
            kv.put("cold", [f"c-{i + j}".encode() for j in range(4)], block)
            i += 4
    pages_out.value = i


def p99_under_demotion(folder: Path | None, io: str, seconds: float = 8.0, hot_bytes: int = MiB,
                       cold_bytes: int = 4 * MiB) -> dict[str, Any]:
    """Hot-namespace Put/Get latency while another process's writes are demoted (or dropped without tiers)."""
    from kvstore_client import KvClient

    args = ["--capacity", str(256 * MiB), "--namespace", f"hot:{hot_bytes}:{128 * MiB}",
            "--namespace", f"cold:{cold_bytes}:{64 * MiB}", "--shm", "false"]
    if folder is not None:
        args += ["--tier", f"disk:{folder}:{4096 * MiB}", "--tier-io", io]
    node = NodeProcess(args)
    ctx = multiprocessing.get_context("spawn")
    written = ctx.Value("q", 0)
    try:
        with KvClient(node.address, data_path="tcp") as kv:
            before = _tier_stats(kv)
            writer = ctx.Process(target=_writer, args=(node.address, cold_bytes, seconds, written))
            writer.start()
            page = _pages(1, hot_bytes)
            lat_put, lat_get = [], []
            time.sleep(0.5)  # the writer is up and the cold pool full
            end, i = time.monotonic() + seconds - 1.0, 0
            while time.monotonic() < end:
                key = [f"h-{i % 64}".encode()]
                t0 = time.perf_counter()
                kv.put("hot", key, page)
                t1 = time.perf_counter()
                kv.get("hot", key)
                lat_put.append(t1 - t0)
                lat_get.append(time.perf_counter() - t1)
                i += 1
            writer.join(seconds + 30)
            after = _tier_stats(kv)
    finally:
        node.terminate()
    row: dict[str, Any] = {"tiers": folder is not None, "calls": len(lat_put),
                           "put_p99_ms": 1e3 * float(np.percentile(lat_put, 99)),
                           "get_p99_ms": 1e3 * float(np.percentile(lat_get, 99)),
                           "put_median_ms": 1e3 * statistics.median(lat_put),
                           "writer_gbps": written.value * cold_bytes / seconds / 1e9}
    if before is not None and after is not None:
        row["demotion_gbps"] = (after.bytes_written - before.bytes_written) / seconds / 1e9
        row["drops"] = after.drops - before.drops
    return row


def scratch_folder(base: Path | None) -> Path:
    """A fresh folder for slabs under ``base`` (default: the system's temporary folder)."""
    return Path(tempfile.mkdtemp(prefix="kvstore-tiers-", dir=base))
