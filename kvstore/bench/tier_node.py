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

import mmap
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.launch import NodeProcess

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


def _read_rate(address: str, ns: str, keys: list[bytes], batch: int, page_bytes: int,
               readers: int = 1) -> tuple[float, int]:
    """GB/s of Gets of ``keys`` in batches from ``readers`` clients at once (each its own share of the keys,
    on its own connection), and how many pages were missing."""
    from kvstore_client import KvClient

    chunks = [keys[i:i + batch] for i in range(0, len(keys), batch)]
    missing = [0] * readers
    clients = [KvClient(address, data_path="tcp") for _ in range(readers)]
    for kv in clients:
        kv.page_bytes(ns)  # the namespace's layout, asked before the clock starts

    def read(k: int) -> None:
        out = np.empty((batch, page_bytes), dtype=np.uint8)
        for chunk in chunks[k::readers]:
            missing[k] += len(clients[k].get(ns, chunk, out=out[:len(chunk)]).missing)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            list(pool.map(read, range(readers)))
        seconds = time.perf_counter() - start
    finally:
        for kv in clients:
            kv.close()
    return len(keys) * page_bytes / seconds / 1e9, sum(missing)


def promote_vs_pool(folder: Path, page_bytes: int, pages: int, batch: int, io: str,
                    readers: int = 1, write: str = "back") -> dict[str, Any]:
    """Get GB/s of pages promoted from disk against the same Gets from a pool (module doc)."""
    from kvstore_client import KvClient

    data = _pages(pages, page_bytes)
    keys = _keys("p", pages)
    pool_pages = max(batch * readers * 2, pages // 4)
    tier = f"disk:{folder}:{pages * (page_bytes + 8192) + MiB}"
    row: dict[str, Any] = {"page_bytes": page_bytes, "batch": batch, "readers": readers, "pages": pages,
                           "pool_pages": pool_pages}
    below = keys[:pages - pool_pages]  # the pool keeps the last ones written
    node = NodeProcess(["--capacity", str(pool_pages * page_bytes), "--namespace", f"b:{page_bytes}",
                        "--tier", tier, "--tier-io", io, "--tier-write", write, "--shm", "false"])
    row["write"] = write
    try:
        with KvClient(node.address, data_path="tcp") as kv:
            for i in range(0, pages, batch):
                kv.put("b", keys[i:i + batch], data[i:i + batch])
                _settle(kv)  # written down before the next put: no demotion dropped for want of staging room
            row["fill_drops"] = _tier_stats(kv).drops
            row["promote_gbps"], row["promote_missing"] = _read_rate(node.address, "b", below, batch, page_bytes,
                                                                     readers)
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
        row["pool_gbps"], _ = _read_rate(node.address, "b", below, batch, page_bytes, readers)
    finally:
        node.terminate()
    row["promote_over_pool"] = row["promote_gbps"] / row["pool_gbps"]
    return row


def restart_time(folder: Path, namespace: str, n: int, capacity: int, io: str) -> dict[str, Any]:
    """Seconds from the ``exec`` of a node over ``folder`` (a slab of ``n`` 4 KiB pages of ``namespace`` keyed
    0..n-1, as a node leaves it, for a tier of ``capacity`` bytes) until it answers a Lookup of them; then
    (not timed) how many of the ``n`` it holds."""
    from kvstore_client import KvClient

    page_bytes = 4096
    sample = [int(i).to_bytes(8, "little") for i in np.random.default_rng(1).choice(n, min(n, 1000), replace=False)]
    start = time.perf_counter()
    node = NodeProcess(["--capacity", str(64 * page_bytes), "--namespace", f"{namespace}:{page_bytes}",
                        "--tier", f"disk:{folder}:{capacity}", "--tier-io", io, "--shm", "false"])
    try:
        with KvClient(node.address, data_path="grpc") as kv:
            while kv.lookup(namespace, sample[:1]) < 1 or not all(kv.exists(namespace, sample)):
                time.sleep(0.001)
            seconds = time.perf_counter() - start
            held = 0
            for i in range(0, n, 65536):
                held += sum(kv.exists(namespace, [j.to_bytes(8, "little") for j in range(i, min(n, i + 65536))]))
    finally:
        node.terminate()
    return {"pages": n, "seconds": seconds, "held": held}


def _writer(address: str, page_bytes: int, seconds: float, rate: float, pages_out: Any) -> None:
    """(a process) Put distinct pages into namespace ``cold`` at ``rate`` bytes/s (0: as fast as the node takes
    them), one page per call."""
    from kvstore_client import KvClient

    block = _pages(1, page_bytes)
    start = time.monotonic()
    end, i = start + seconds, 0
    with KvClient(address, data_path="tcp") as kv:
        while time.monotonic() < end:
            kv.put("cold", [f"c-{i}".encode()], block)
            i += 1
            if rate:
                ahead = start + i * page_bytes / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
    pages_out.value = i


def _raw_writer(path: str, rate: float, seconds: float, io: str, done: Any) -> None:
    """(a process) Aligned ``pwrite`` of 4 MiB chunks into a preallocated file at ``rate`` bytes/s: the disk
    writes of a demotion at that rate, without the node."""
    chunk = 4 * MiB
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if io == "direct" else 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, 1024 * MiB)
        buf = mmap.mmap(-1, chunk)
        buf.write(os.urandom(chunk))
        start, i = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            os.pwritev(fd, [buf], (i % 256) * chunk)
            i += 1
            ahead = start + i * chunk / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        done.value = i * chunk / (time.monotonic() - start) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)


def p99_under_demotion(folder: Path | None, io: str, seconds: float = 8.0, rate: float = 0.0, hot_bytes: int = MiB,
                       cold_bytes: int = 4 * MiB, raw_disk: tuple[Path, float] | None = None) -> dict[str, Any]:
    """Hot-namespace Put/Get latency while another process writes ``rate`` bytes/s (0: all it can) into a full
    namespace, its evictions demoted (or dropped without tiers). ``raw_disk`` (a folder, bytes/s): on a node
    without tiers, a third process writes that rate to a file there meanwhile (what the disk writes alone
    cost the machine)."""
    from kvstore_client import KvClient

    args = ["--capacity", str(256 * MiB), "--namespace", f"hot:{hot_bytes}:{128 * MiB}",
            "--namespace", f"cold:{cold_bytes}:{64 * MiB}", "--shm", "false"]
    if folder is not None:
        args += ["--tier", f"disk:{folder}:{4096 * MiB}", "--tier-io", io]
    node = NodeProcess(args)
    ctx = multiprocessing.get_context("spawn")
    written = ctx.Value("q", 0)
    raw_gbps = ctx.Value("d", 0.0)
    raw = None
    if raw_disk is not None:
        raw_disk[0].mkdir(parents=True, exist_ok=True)
        raw = ctx.Process(target=_raw_writer, args=(str(raw_disk[0] / "raw.bin"), raw_disk[1], seconds, io, raw_gbps))
        raw.start()
    try:
        with KvClient(node.address, data_path="tcp") as kv:
            before = _tier_stats(kv)
            writer = ctx.Process(target=_writer, args=(node.address, cold_bytes, seconds, rate, written))
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
            if raw is not None:
                raw.join(seconds + 30)
            after = _tier_stats(kv)
    finally:
        node.terminate()
    row: dict[str, Any] = {"tiers": folder is not None, "calls": len(lat_put), "rate_gbps": rate / 1e9,
                           "put_p99_ms": 1e3 * float(np.percentile(lat_put, 99)),
                           "get_p99_ms": 1e3 * float(np.percentile(lat_get, 99)),
                           "put_median_ms": 1e3 * statistics.median(lat_put),
                           "writer_gbps": written.value * cold_bytes / seconds / 1e9}
    if raw is not None:
        row["raw_disk_gbps"] = raw_gbps.value
    if before is not None and after is not None:
        row["demotion_gbps"] = (after.bytes_written - before.bytes_written) / seconds / 1e9
        row["drops"] = after.drops - before.drops
    return row
