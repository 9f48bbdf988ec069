"""``kvctl bench tiers``: the disk tier's page store against raw ``O_DIRECT`` file I/O on the same filesystem.

For each page size, pages are written into a :class:`~kvstore.tiers.disk.DiskPages` slab (one ``pwrite``
of header and payload each) and read back with their checksums verified, one page at a time, and the
GB/s of payload is set against the raw ceiling of the same bytes: the best of 1, 2 and 4 threads of
aligned ``O_DIRECT`` ``pwrite`` (then ``pread``) loops over a preallocated file, in chunks of the page
size. Then the time to reopen a slab of N 4 KiB pages (a restarted node rebuilding its index from the
headers) for each N of ``--scan-pages``.

What it does not measure yet: the tier stack under a node (demotion from the pool, promotion into it,
a Get that promotes from disk); the page store alone is what exists. Writes ``tiers.json``,
``tiers.md`` and ``tiers.png`` to ``--out``; each timed number is the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.tiers.disk import DiskPages
from kvstore.tiers.slab import BLOCK, probe_direct
from kvstore.units import format_size, parse_size

PAGES = ("1MiB", "4MiB")


def _raw(path: Path, total: int, chunk: int, threads: int, write: bool, io: str) -> float:
    """GB/s of ``threads`` threads each moving its share of ``total`` bytes in ``chunk``-byte aligned calls."""
    flags = os.O_RDWR | (os.O_DIRECT if io == "direct" else 0)
    fd = os.open(path, flags)
    share = total // threads // chunk * chunk
    barrier = threading.Barrier(threads + 1)

    def work(k: int) -> None:
        buf = mmap.mmap(-1, chunk)
        buf.write(os.urandom(min(chunk, 1 << 16)) * (chunk // min(chunk, 1 << 16)))
        view = memoryview(buf)
        barrier.wait()
        for offset in range(k * share, (k + 1) * share, chunk):
            if write:
                os.pwritev(fd, [view], offset)
            else:
                os.preadv(fd, [view], offset)
        barrier.wait()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    barrier.wait()
    took = time.perf_counter() - start
    for w in workers:
        w.join()
    os.close(fd)
    return threads * share / took / 1e9


def raw_ceiling(folder: Path, total: int, chunk: int, io: str, repeats: int) -> dict[str, float]:
    """Best GB/s over 1, 2 and 4 threads and ``repeats`` runs, writing then reading a preallocated file."""
    path = folder / "raw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, total)
    os.close(fd)
    best = {"write_gbs": 0.0, "read_gbs": 0.0}
    for _ in range(repeats):
        for threads in (1, 2, 4):
            best["write_gbs"] = max(best["write_gbs"], _raw(path, total, chunk, threads, True, io))
            best["read_gbs"] = max(best["read_gbs"], _raw(path, total, chunk, threads, False, io))
    path.unlink()
    return best


def store(folder: Path, total: int, page: int, io: str, repeats: int, bar: Any) -> dict[str, float]:
    """Best GB/s of payload over ``repeats``: put every page of ``total`` bytes, then get each back."""
    n = max(1, total // page)
    payload = os.urandom(page)
    best = {"write_gbs": 0.0, "read_gbs": 0.0}
    for r in range(repeats):
        where = folder / f"store-{page}"
        shutil.rmtree(where, ignore_errors=True)
        disk = DiskPages(where, "bench", page, BLOCK + n * (BLOCK + page), io=io)
        start = time.perf_counter()
        for i in range(n):
            disk.put("ns", i.to_bytes(8, "little"), payload)
        best["write_gbs"] = max(best["write_gbs"], n * page / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        for i in range(n):
            if disk.get("ns", i.to_bytes(8, "little")) is None:
                raise RuntimeError(f"page {i} did not come back")
        best["read_gbs"] = max(best["read_gbs"], n * page / (time.perf_counter() - start) / 1e9)
        assert disk.stats.corrupt == 0 and disk.stats.drops == 0
        disk.close()
        shutil.rmtree(where, ignore_errors=True)
        bar.update(1)
    return best


def reopen_seconds(folder: Path, pages: int, io: str, repeats: int) -> float:
    """Best seconds to reopen a slab of ``pages`` 4 KiB pages and have its index back (all of them)."""
    where = folder / f"scan-{pages}"
    shutil.rmtree(where, ignore_errors=True)
    page = 4096
    disk = DiskPages(where, "scan", page, BLOCK + pages * (BLOCK + page), io=io)
    payload = os.urandom(page)
    for i in range(pages):
        disk.put("ns", i.to_bytes(8, "little"), payload)
    disk.close()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        again = DiskPages(where, "scan", page, BLOCK + pages * (BLOCK + page), io=io)
        took = time.perf_counter() - start
        if len(again) != pages:
            raise RuntimeError(f"{len(again)} of {pages} pages came back")
        again.close()
        best = min(best, took)
    shutil.rmtree(where, ignore_errors=True)
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path("kvstore-out/bench/tiers-data"),
                        help="folder on the filesystem to measure (its files are removed after)")
    parser.add_argument("--total", default="512MiB", help="bytes written and read per page size")
    parser.add_argument("--scan-pages", default="10000,100000", help="comma list of slab sizes in 4 KiB pages "
                        "to reopen (1000000 writes about 8 GiB)")
    parser.add_argument("--io", default="auto", choices=["auto", "direct", "buffered"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("kvstore-out/bench"), help="folder for tiers.{json,md,png}")


def run(args: argparse.Namespace) -> int:
    folder: Path = args.dir
    folder.mkdir(parents=True, exist_ok=True)
    io = probe_direct(folder) if args.io == "auto" else args.io
    total = parse_size(args.total)
    scans = [int(x) for x in args.scan_pages.split(",") if x]
    results: dict[str, Any] = {"io": io, "total_bytes": total, "filesystem": str(folder.resolve()), "pages": {},
                               "reopen_s": {}}
    with tqdm(total=len(PAGES) * args.repeats, desc="tiers", unit="run") as bar:
        for name in PAGES:
            page = parse_size(name)
            raw = raw_ceiling(folder, total, page, io, args.repeats)
            got = store(folder, total, page, io, args.repeats, bar)
            results["pages"][name] = {"raw": raw, "store": got,
                                      "write_ratio": got["write_gbs"] / raw["write_gbs"],
                                      "read_ratio": got["read_gbs"] / raw["read_gbs"]}
    for pages in scans:
        results["reopen_s"][str(pages)] = reopen_seconds(folder, pages, io, args.repeats)
    shutil.rmtree(folder, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tiers.json").write_text(json.dumps(results, indent=2))
    lines = [f"Disk tier page store against raw {io} I/O, {format_size(total)} per page size, best of "
             f"{args.repeats}", "", "| page | store write GB/s | raw write GB/s | ratio | store read GB/s | "
             "raw read GB/s | ratio |", "|---|---|---|---|---|---|---|"]
    for name, r in results["pages"].items():
        lines.append(f"| {name} | {r['store']['write_gbs']:.2f} | {r['raw']['write_gbs']:.2f} | "
                     f"{r['write_ratio']:.2f}x | {r['store']['read_gbs']:.2f} | {r['raw']['read_gbs']:.2f} | "
                     f"{r['read_ratio']:.2f}x |")
    lines += ["", "| 4 KiB pages in the slab | reopen, index rebuilt (s) |", "|---|---|"]
    lines += [f"| {p} | {s:.3f} |" for p, s in results["reopen_s"].items()]
    table = "\n".join(lines) + "\n"
    (args.out / "tiers.md").write_text(table)
    print(table)
    _plot(results, args.out / "tiers.png")
    return 0


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results["pages"])
    width = 0.2
    for k, (label, pick) in enumerate((("store write", ("store", "write_gbs")), ("raw write", ("raw", "write_gbs")),
                                       ("store read", ("store", "read_gbs")), ("raw read", ("raw", "read_gbs")))):
        ax.bar([i + (k - 1.5) * width for i in range(len(names))],
               [results["pages"][n][pick[0]][pick[1]] for n in names], width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GB/s")
    ax.set_title(f"disk tier page store vs raw {results['io']} I/O")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
