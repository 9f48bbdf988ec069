"""``kvctl bench tiers``: the page tiers against their raw ceilings, and a disk tier's restart.

For each case (``1MiB`` and ``4MiB``: one page per call from one thread; ``8x1MiB``: batches of 8 pages
of 1 MiB, each batch issued on 4 threads at once and waited for, as the tier stack promotes and demotes)
and each tier:

* **disk** (:class:`~kvstore.tiers.disk.DiskPages`): ``--total`` bytes of pages put (demotion) into a
  fresh slab, then read back with ``get_into`` (promotion, every payload's checksum verified), against
  the raw ceiling on the same filesystem: the best of 1, 2 and 4 threads of aligned ``pwrite`` (then
  ``pread``) loops over a preallocated file in chunks of the page size, under the same I/O mode. Both
  are measured over blocks written once already (an untimed first pass each): the first write into
  preallocated blocks is slower on ext4 and XFS (their extents turn from unwritten to written), a cost
  a slab pays once in its life; the tier's first fill is reported beside (``first_fill_write_gbs``);
* **host** (:class:`~kvstore.tiers.host.HostPages`): the same pages put into and read out of host
  memory, against ``numpy`` copies of the same bytes into and out of one preallocated buffer (best of
  1, 2 and 4 threads).

Source and destination buffers are 4 KiB aligned (as the pool's pages are), so ``O_DIRECT`` moves them
without a copy. Each repeat measures the ceiling and the tier back to back; each number is the best of
``--repeats``. Then, through real ``kvstored`` processes (:mod:`kvstore.bench.tier_node`):

* the time to reopen a slab of N 4 KiB pages (``--reopen-pages``), its page cache dropped first
  (``posix_fadvise``): in process (the index rebuilt), and from the ``exec`` of a ``kvstored`` over it
  until it answers Lookups for its pages (``restart``);
* for each ``--node-cases`` case and ``--readers`` count: a node whose pool holds a quarter of the pages
  written, read back over the data channel; the GB/s of the Gets served from disk (each promotes its
  pages) against the same Gets from a node whose pool holds them all, and against the disk tier's page
  store alone in this run;
* Put and Get latency (p99) of a namespace that never evicts while another process writes as fast as it
  can into a namespace whose pool is full, on a node with a disk tier (its evictions demoted) and on one
  without (dropped), twice each, interleaved; with the demotion rate reached against the raw write
  ceiling.

Writes ``tiers.json``, ``tiers.md`` and ``tiers.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvstore.tiers.disk import DiskPages
from kvstore.tiers.host import HostPages
from kvstore.bench import tier_node
from kvstore.tiers.slab import BLOCK, probe_direct
from kvstore.tiers.stack import slab_name
from kvstore.units import format_size, parse_size

CASES = ("1MiB", "4MiB", "8x1MiB")
BATCH, BATCH_THREADS = 8, 4
TIERS = ("disk", "host")
RESTART_NS = "r"


def _case(name: str) -> tuple[int, int]:
    """(page bytes, pages per batch; 1 = one page per call from one thread)."""
    if "x" in name:
        count, size = name.split("x")
        return parse_size(size), int(count)
    return parse_size(name), 1


def _aligned(nbytes: int, fill: bool = False) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    if fill:
        block = os.urandom(min(nbytes, 1 << 16))
        for at in range(0, nbytes, len(block)):
            buf[at:at + len(block)] = block[:nbytes - at]
    return buf


def _mapped(nbytes: int) -> np.ndarray:
    """Host memory with every page mapped before it is timed."""
    array = np.frombuffer(_aligned(nbytes), dtype=np.uint8)
    array.fill(0)
    return array


def _threads_at_once(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads, started together, each to run ``work(k)``."""
    barrier = threading.Barrier(threads + 1)

    def run(k: int) -> None:
        barrier.wait()
        work(k)
        barrier.wait()

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    barrier.wait()
    took = time.perf_counter() - start
    for w in workers:
        w.join()
    return took


# ---- ceilings ------------------------------------------------------------------------
def raw_disk(path: Path, total: int, chunk: int, io: str) -> dict[str, float]:
    """Best GB/s over 1, 2 and 4 threads of aligned ``chunk``-byte pwrite (then pread) over ``path``."""
    best: dict[str, float] = {"write_gbs": 0.0, "read_gbs": 0.0}
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if io == "direct" else 0))
    try:
        for threads in (1, 2, 4):
            share = total // threads // chunk * chunk
            bufs = [_aligned(chunk, fill=True) for _ in range(threads)]
            for side, call in (("write_gbs", os.pwritev), ("read_gbs", os.preadv)):
                def work(k: int) -> None:
                    view = memoryview(bufs[k])
                    for offset in range(k * share, (k + 1) * share, chunk):
                        call(fd, [view], offset)
                took = _threads_at_once(threads, work)
                best[side] = max(best[side], threads * share / took / 1e9)
                best[f"{side[:-4]}_{threads}t_gbs"] = threads * share / took / 1e9
    finally:
        os.close(fd)
    return best


def raw_memory(area: np.ndarray, page: int) -> dict[str, float]:
    """Best GB/s over 1, 2 and 4 threads of numpy copies of ``page`` bytes into (then out of) ``area``."""
    best = {"write_gbs": 0.0, "read_gbs": 0.0}
    n = len(area) // page
    for threads in (1, 2, 4):
        share = n // threads
        pages = [np.frombuffer(_aligned(page, fill=True), dtype=np.uint8) for _ in range(threads)]
        for side in ("write_gbs", "read_gbs"):
            def work(k: int) -> None:
                for i in range(k * share, (k + 1) * share):
                    slot = area[i * page:(i + 1) * page]
                    if side == "write_gbs":
                        np.copyto(slot, pages[k])
                    else:
                        np.copyto(pages[k], slot)
            took = _threads_at_once(threads, work)
            best[side] = max(best[side], threads * share * page / took / 1e9)
    return best


# ---- the tiers -----------------------------------------------------------------------
def _drive(tier: Any, n: int, page: int, batch: int, pool: ThreadPoolExecutor | None, prefix: bytes,
           payload: mmap.mmap, outs: list[mmap.mmap]) -> tuple[float, float]:
    """Seconds to put ``n`` pages, then to get each back (one at a time, or ``batch`` at once on ``pool``)."""
    def key(i: int) -> bytes:
        return prefix + i.to_bytes(8, "little")

    def put(i: int) -> None:
        tier.put("ns", key(i), memoryview(payload))

    def get(i: int, out: mmap.mmap) -> None:
        if tier.get_into("ns", key(i), memoryview(out)) is None:
            raise RuntimeError(f"page {i} did not come back")

    start = time.perf_counter()
    if pool is None:
        for i in range(n):
            put(i)
    else:
        for first in range(0, n, batch):
            list(pool.map(put, range(first, min(n, first + batch))))
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    if pool is None:
        for i in range(n):
            get(i, outs[0])
    else:
        for first in range(0, n, batch):
            list(pool.map(get, range(first, min(n, first + batch)), outs))
    return wrote, time.perf_counter() - start


def _empty(tier: Any, n: int, prefix: bytes) -> None:
    """Remove the ``n`` pages of ``prefix`` (last first, so the next puts take the slots in order again)."""
    for i in range(n - 1, -1, -1):
        tier.remove("ns", prefix + i.to_bytes(8, "little"))


def _best_of(repeats: int, ceiling: Callable[[], dict[str, float]], tier: Any, n: int,
             drive: Callable[[bytes], tuple[float, float]], page: int, bar: Any) -> dict[str, Any]:
    """The ceiling and the tier, back to back in each of ``repeats``: the best GB/s of each, and the ratios."""
    raw: dict[str, float] = {"write_gbs": 0.0, "read_gbs": 0.0}
    store = {"write_gbs": 0.0, "read_gbs": 0.0}
    for r in range(repeats):
        for side, gbs in ceiling().items():
            raw[side] = max(raw.get(side, 0.0), gbs)
        prefix = r.to_bytes(4, "little")
        wrote, read = drive(prefix)
        _empty(tier, n, prefix)
        store["write_gbs"] = max(store["write_gbs"], n * page / wrote / 1e9)
        store["read_gbs"] = max(store["read_gbs"], n * page / read / 1e9)
        bar.update(1)
    return {"raw": raw, "store": store, "write_ratio": store["write_gbs"] / raw["write_gbs"],
            "read_ratio": store["read_gbs"] / raw["read_gbs"]}


def bench_case(folder: Path, name: str, total: int, io: str, repeats: int, tiers: list[str],
               bar: Any) -> dict[str, Any]:
    """Ceiling and tier, back to back in each repeat, for each of ``tiers``; best of ``repeats``."""
    page, batch = _case(name)
    n = max(batch, total // page // batch * batch)
    payload = _aligned(page, fill=True)
    outs = [_aligned(page) for _ in range(batch)]
    pool = ThreadPoolExecutor(BATCH_THREADS) if batch > 1 else None
    got: dict[str, Any] = {}
    try:
        if "disk" in tiers:
            raw_path = folder / "raw.bin"
            fd = os.open(raw_path, os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(fd, 0, n * page)
            os.close(fd)
            raw_disk(raw_path, n * page, page, io)  # untimed: the first write of preallocated blocks is slower
            where = folder / f"store-{name}"
            shutil.rmtree(where, ignore_errors=True)
            disk = DiskPages(where, "bench", page, BLOCK + n * (BLOCK + page), io=io)
            wrote, _ = _drive(disk, n, page, batch, pool, b"fill", payload, outs)  # the same for the slab
            first_fill = n * page / wrote / 1e9
            _empty(disk, n, b"fill")
            got["disk"] = _best_of(repeats, lambda: raw_disk(raw_path, n * page, page, io), disk, n,
                                   lambda prefix: _drive(disk, n, page, batch, pool, prefix, payload, outs), page, bar)
            got["disk"]["first_fill_write_gbs"] = first_fill
            if disk.stats.corrupt or disk.stats.drops or disk.stats.evictions:
                raise RuntimeError(f"disk tier: {disk.stats}")
            disk.close()
            shutil.rmtree(where, ignore_errors=True)
            raw_path.unlink()
        if "host" in tiers:
            area = _mapped(n * page)
            host = HostPages("bench", page, n * page, allocate=_mapped)
            got["host"] = _best_of(repeats, lambda: raw_memory(area, page), host, n,
                                   lambda prefix: _drive(host, n, page, batch, pool, prefix, payload, outs), page, bar)
            host.close()
    finally:
        if pool is not None:
            pool.shutdown()
    return got


# ---- restart -------------------------------------------------------------------------
def _fill(where: Path, pages: int, io: str) -> int:
    """A slab of ``pages`` 4 KiB pages of namespace ``r`` (keys 0..pages-1), as a node's disk tier keeps them,
    written through the tier (4 threads); returns the tier's capacity."""
    capacity = BLOCK + pages * (BLOCK + 4096)
    disk = DiskPages(where, slab_name(RESTART_NS, 4096), 4096, capacity, io=io)
    payload = _aligned(4096, fill=True)

    def put(k: int) -> None:
        for i in range(k, pages, 4):
            disk.put(RESTART_NS, i.to_bytes(8, "little"), memoryview(payload), kind=1 + i % 2, checksum=0)

    _threads_at_once(4, put)
    if len(disk) != pages:
        raise RuntimeError(f"{len(disk)} of {pages} pages written")
    disk.close()
    return capacity


def _drop_cache(where: Path) -> None:
    for path in where.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reopen_seconds(folder: Path, pages: int, io: str, repeats: int) -> dict[str, float]:
    """Best seconds to reopen a slab of ``pages`` 4 KiB pages with its index back (in process), and from the
    ``exec`` of a ``kvstored`` over it until it answers Lookups for its pages (``restart``)."""
    where = folder / f"scan-{pages}"
    shutil.rmtree(where, ignore_errors=True)
    capacity = _fill(where, pages, io)
    best = {"reopen_s": float("inf"), "restart_s": float("inf")}
    for _ in range(repeats):
        _drop_cache(where)
        start = time.perf_counter()
        again = DiskPages(where, slab_name(RESTART_NS, 4096), 4096, capacity, io=io)
        took = time.perf_counter() - start
        if len(again) != pages:
            raise RuntimeError(f"{len(again)} of {pages} pages came back")
        again.close()
        best["reopen_s"] = min(best["reopen_s"], took)
        _drop_cache(where)
        row = tier_node.restart_time(where, RESTART_NS, pages, capacity, io)
        if row["held"] != pages:
            raise RuntimeError(f"restart: the node holds {row['held']} of {pages} pages")
        best["restart_s"] = min(best["restart_s"], row["seconds"])
    shutil.rmtree(where, ignore_errors=True)
    return best


# ---- the command ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path("kvstore-out/bench/tiers-data"),
                        help="folder on the filesystem to measure (its files are removed after)")
    parser.add_argument("--total", default="512MiB", help="bytes put and read per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of page cases: a size (one page per "
                        f"call) or NxSIZE (batches of N pages on {BATCH_THREADS} threads)")
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma list of tiers to measure: disk, host")
    parser.add_argument("--reopen-pages", "--scan-pages", dest="reopen_pages", default="10000,100000",
                        help="comma list of slab sizes in 4 KiB pages to reopen (1000000 writes about 8 GiB); "
                        "empty for none")
    parser.add_argument("--node-cases", default="4MiB,8x1MiB", help="comma list of page cases read back through a "
                        "real node whose pool holds a quarter of them (Gets that promote from disk, against the same "
                        "Gets from a pool); empty for none")
    parser.add_argument("--readers", default="1,4", help="comma list of concurrent clients for --node-cases")
    parser.add_argument("--latency-seconds", type=float, default=8.0, help="length of each Put/Get latency run, with "
                        "and without tiers, while another process's writes are demoted (0: skip)")
    parser.add_argument("--demotion-share", type=float, default=0.55, help="the latency runs' write load, as a "
                        "share of the raw write ceiling measured in the same run (0: as fast as the node takes it)")
    parser.add_argument("--io", default="auto", choices=["auto", "direct", "buffered"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("kvstore-out/bench"), help="folder for tiers.{json,md,png}")


def run(args: argparse.Namespace) -> int:
    folder: Path = args.dir
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()  # a node's disk tier takes an absolute path
    io = probe_direct(folder) if args.io == "auto" else args.io
    total = parse_size(args.total)
    cases = [c for c in args.cases.split(",") if c]
    tiers = [t for t in args.tiers.split(",") if t]
    if set(tiers) - set(TIERS):
        raise SystemExit(f"--tiers: choose from {', '.join(TIERS)}")
    reopens = [int(x) for x in args.reopen_pages.split(",") if x]
    results: dict[str, Any] = {"io": io, "total_bytes": total, "filesystem": str(folder.resolve()),
                               "repeats": args.repeats, "cases": {}, "reopen": {}}
    try:
        with tqdm(total=len(cases) * len(tiers) * args.repeats, desc="tiers", unit="run") as bar:
            for name in cases:
                results["cases"][name] = bench_case(folder, name, total, io, args.repeats, tiers, bar)
        for pages in tqdm(reopens, desc="reopen", unit="slab"):
            results["reopen"][str(pages)] = reopen_seconds(folder, pages, io, args.repeats)
        node_cases = [c for c in args.node_cases.split(",") if c]
        readers = [int(r) for r in args.readers.split(",") if r]
        results["node"] = []
        for name in tqdm(node_cases, desc="through a node", unit="case"):
            page, batch = _case(name)
            for r in readers:
                row = tier_node.promote_vs_pool(folder / f"node-{name}-{r}", page, max(8 * batch * r, total // page),
                                                batch, io, readers=r)
                row["case"] = name
                tier = results["cases"].get(name, {}).get("disk")
                if tier:  # the same case through the disk tier's page store alone, in this run
                    row["tier_get_gbs"] = tier["store"]["read_gbs"]
                    row["promote_over_tier"] = row["promote_gbps"] / tier["store"]["read_gbs"]
                results["node"].append(row)
        if args.latency_seconds > 0:
            raw_write = max((row["disk"]["raw"]["write_gbs"] for row in results["cases"].values() if "disk" in row),
                            default=0.0)
            results["raw_write_gbs"] = raw_write
            # the same write load on both nodes: a little over half the raw write ceiling of this run
            rate = args.demotion_share * raw_write * 1e9
            lat: list[dict[str, Any]] = []
            with tqdm(total=6, desc="latency under demotion", unit="run") as bar:
                for _ in range(2):
                    for tiers_on in (False, True):
                        lat.append(tier_node.p99_under_demotion(folder / "lat" if tiers_on else None, io,
                                                                args.latency_seconds, rate))
                        bar.update()
                    # the disk writes of that demotion rate alone, beside a node without tiers
                    lat.append(tier_node.p99_under_demotion(None, io, args.latency_seconds, rate,
                                                            raw_disk=(folder / "raw", lat[-1].get("demotion_gbps", 0)
                                                                      * 1e9 or rate)))
                    bar.update()
            results["latency"] = lat
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tiers.json").write_text(json.dumps(results, indent=2))
    table = _table(results)
    (args.out / "tiers.md").write_text(table)
    print(table)
    _plot(results, args.out / "tiers.png")
    return 0


def _table(results: dict[str, Any]) -> str:
    lines = [f"Page tiers against their ceilings ({results['io']} I/O for disk, numpy copies for host), "
             f"{format_size(results['total_bytes'])} per case, best of {results['repeats']}", "",
             "| tier | case | put GB/s | ceiling write GB/s | ratio | get GB/s | ceiling read GB/s | ratio | "
             "ratios to raw at the same threads |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in results["cases"].items():
        threads = 1 if _case(name)[1] == 1 else BATCH_THREADS
        for tier, r in row.items():
            same = "-"
            if f"write_{threads}t_gbs" in r["raw"]:
                same = (f"{r['store']['write_gbs'] / r['raw'][f'write_{threads}t_gbs']:.2f}x / "
                        f"{r['store']['read_gbs'] / r['raw'][f'read_{threads}t_gbs']:.2f}x ({threads}t)")
            lines.append(f"| {tier} | {name} | {r['store']['write_gbs']:.2f} | {r['raw']['write_gbs']:.2f} | "
                         f"{r['write_ratio']:.2f}x | {r['store']['read_gbs']:.2f} | {r['raw']['read_gbs']:.2f} | "
                         f"{r['read_ratio']:.2f}x | {same} |")
    fills = [f"{name} {row['disk']['first_fill_write_gbs']:.2f} GB/s" for name, row in results["cases"].items()
             if "disk" in row]
    if fills:
        lines += ["", "A fresh slab's first fill (preallocated blocks written the first time): " + ", ".join(fills)]
    if results.get("node"):
        lines += ["", "Through a node (`tcp` data channel, a pool a quarter of the pages): Gets of the pages on disk "
                  "(promoted) against the same Gets from a pool holding them all, and against the disk tier's page "
                  "store alone (above)", "",
                  "| case | readers | Get from disk GB/s | Get from pool GB/s | disk / pool | disk tier alone GB/s | "
                  "node / tier | missing |", "|---|---|---|---|---|---|---|---|"]
        for r in results["node"]:
            tier = f"{r['tier_get_gbs']:.2f} | {r['promote_over_tier']:.2f}x" if "tier_get_gbs" in r else "- | -"
            lines.append(f"| {r['case']} | {r['readers']} | {r['promote_gbps']:.2f} | {r['pool_gbps']:.2f} | "
                         f"{r['promote_over_pool']:.2f}x | {tier} | {r['promote_missing']} |")
    if results.get("latency"):
        lines += ["", "Put/Get latency of 1 MiB pages in a namespace that never evicts, while another process "
                  "writes 4 MiB pages into a full one at the same rate on both nodes (demoted to disk with tiers, "
                  "dropped without)", "",
                  "| tiers | calls | Put p99 ms | Get p99 ms | Put median ms | write load GB/s | demotion GB/s (of raw "
                  "write) | drops |", "|---|---|---|---|---|---|---|---|"]
        raw = results.get("raw_write_gbs") or 0.0
        for r in results["latency"]:
            dem = r.get("demotion_gbps")
            share = f"{dem:.2f} ({dem / raw:.0%})" if dem is not None and raw else "-"
            if "raw_disk_gbps" in r:
                share = f"raw writes {r['raw_disk_gbps']:.2f}"
            what = "on" if r["tiers"] else "off, raw disk writes beside" if "raw_disk_gbps" in r else "off"
            lines.append(f"| {what} | {r['calls']} | {r['put_p99_ms']:.2f} | "
                         f"{r['get_p99_ms']:.2f} | {r['put_median_ms']:.2f} | {r['writer_gbps']:.2f} | {share} | "
                         f"{r.get('drops', '-')} |")
    if results["reopen"]:
        lines += ["", "| 4 KiB pages in the slab | reopen, index back (s) | kvstored exec to Lookups answered (s) |",
                  "|---|---|---|"]
        lines += [f"| {p} | {s['reopen_s']:.3f} | {s['restart_s']:.3f} |" for p, s in results["reopen"].items()]
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tiers = [t for t in TIERS if any(t in row for row in results["cases"].values())]
    fig, axes = plt.subplots(1, max(1, len(tiers)), figsize=(6 * max(1, len(tiers)), 4), squeeze=False)
    width = 0.2
    for ax, tier in zip(axes[0], tiers):  # one linear scale per tier: host and disk differ tenfold
        rows = [(name, row[tier]) for name, row in results["cases"].items() if tier in row]
        for k, (label, pick) in enumerate((("put", ("store", "write_gbs")), ("ceiling write", ("raw", "write_gbs")),
                                           ("get", ("store", "read_gbs")), ("ceiling read", ("raw", "read_gbs")))):
            ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r[pick[0]][pick[1]] for _, r in rows], width,
                   label=label)
        ax.set_xticks(range(len(rows)), [name for name, _ in rows])
        ax.set_ylabel("GB/s")
        ax.set_title(f"{tier} tier vs its ceiling" + (f" ({results['io']} I/O)" if tier == "disk" else ""))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
