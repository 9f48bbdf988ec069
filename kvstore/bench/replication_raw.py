"""Replication transfer benchmark: the peer transports vs raw TCP and raw UCX.

For batches of 1, 4, 16, 64 and 256 pages of 1 MiB, measured in one run on
the same machine (so the ratios mean something on a shared, noisy host),
each as a pull between two processes on loopback, timed on the pulling side
from "request sent" to "last byte received":

* ``raw_tcp``: blocking sockets; the puller sends one byte, the holder
  ``sendall``\\ s the batch, the puller ``recv_into``\\ s a preallocated buffer.
* ``raw_ucx``: ucxx; the puller sends one byte, the holder ``ep.send``\\ s the
  batch as ONE message, the puller ``ep.recv``\\ s it into a preallocated
  buffer, with the daemon's UCX settings and the transport's way of
  progressing the worker from the event loop (``kvstore.transport.ucx``),
  so the ratio isolates the transport's own costs.
* ``tcp`` / ``ucx``: a pull through ``TcpTransport`` / ``UcxTransport``: the
  holder process serves a numpy ``PagePool`` holding the pages (acquire,
  ``ops.pack`` into a reused staging buffer, RESULT header with the stored
  checksums, release), the puller calls ``transport.fetch`` into a
  preallocated buffer. The pack is one extra copy of the batch that the raw
  pulls do not make (``memcpy`` is measured too, for scale).

Every puller and holder is a fresh process (``spawn``): each has its own
ucxx context, as two daemons would.

Each cell is the median and the best of ``--repeats`` pulls after
``WARMUP`` untimed pulls (UCX wires up its shared-memory lanes during the
first transfers: the first 1 MiB pull took ~3.7 ms, the next ones 0.1 ms);
the table shows the median (best in brackets) and the transport/raw ratios
of the medians. All numbers are measured, none
modelled. Writes ``replication_raw.{json,md,png}`` to ``--out``.

The per-batch functions (:func:`raw_tcp`, :func:`raw_ucx`,
:func:`transport_pull`) each start their own holder process and return the
per-repeat seconds, so another column (e.g. a node-level pull) can be added
with the same shape::

    kvctl bench replication_raw --out kvstore-out/bench
    kvctl bench replication_raw --batches 1,16 --repeats 3   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvstore.transport.ucx import configure_ucx_env  # imports no ucxx

MiB = 1 << 20
BATCHES = (1, 4, 16, 64, 256)
METHODS = ("raw_tcp", "raw_ucx", "tcp", "ucx")
WARMUP = 2  # untimed pulls on each connection before the timed ones
Progress = Callable[[int], None] | None

# Loopback benchmark: the daemon's UCX defaults plus UCX_NET_DEVICES=lo, set
# before anything imports ucxx (children inherit the environment).
UCX_ENV = configure_ucx_env(os.environ, loopback=True)

_ctx = mp.get_context("spawn")


_PERIOD = 1_048_573  # prime: no two 1 MiB pages of the pattern are equal
_BASE = np.random.default_rng(20240607).integers(0, 256, _PERIOD, dtype=np.uint8)


def _pattern(nbytes: int) -> np.ndarray:
    """A recognisable, non-constant, prefaulted buffer."""
    return np.resize(_BASE, nbytes)


def _start(target: Callable[..., None], *args: Any) -> tuple[Any, int]:
    q = _ctx.Queue()
    proc = _ctx.Process(target=target, args=(q, *args), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
    except Exception:
        proc.kill()
        raise RuntimeError(f"{target.__name__} holder process did not start") from None
    return proc, port


def _stop(proc: Any) -> None:
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _in_child(target: Callable[..., None], *args: Any, progress: Progress = None) -> list[float]:
    """Run a puller ``target(q, *args)`` in a fresh process (its own ucxx
    context); it puts each timed pull's seconds on ``q``, then None."""
    q = _ctx.Queue()
    proc = _ctx.Process(target=_child_main, args=(q, target.__name__, *args), daemon=True)
    proc.start()
    times: list[float] = []
    try:
        while True:
            item = q.get(timeout=300)
            if item is None:
                break
            if isinstance(item, str):
                raise RuntimeError(f"{target.__name__}: {item}")
            times.append(item[1])
            if progress:
                progress(item[0])
    finally:
        _stop(proc)
    return times


def _child_main(q: Any, name: str, *args: Any) -> None:
    """Child entry point: run puller ``name``; a failure goes to the parent."""
    try:
        globals()[name](q, *args)
    except BaseException as exc:
        q.put(f"{type(exc).__name__}: {exc}")
        raise
    q.put(None)


# ---- raw TCP ----------------------------------------------------------------
def _tcp_holder(q: Any, nbytes: int, pulls: int) -> None:
    payload = memoryview(_pattern(nbytes))
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(pulls):
        if not conn.recv(1):
            break
        conn.sendall(payload)
    conn.close()
    srv.close()


def raw_tcp(batch_bytes: int, repeats: int, progress: Progress = None) -> list[float]:
    """Seconds per pull of ``batch_bytes`` over blocking loopback TCP."""
    proc, port = _start(_tcp_holder, batch_bytes, repeats + WARMUP)
    times = []
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dst = np.zeros(batch_bytes, dtype=np.uint8)
        view = memoryview(dst)
        for i in range(repeats + WARMUP):
            start = time.perf_counter()
            sock.sendall(b"r")
            got = 0
            while got < batch_bytes:
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise RuntimeError("raw tcp holder closed early")
                got += n
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                times.append(elapsed)
                if progress:
                    progress(batch_bytes)
        sock.close()
        _check(dst)
    finally:
        _stop(proc)
    return times


# ---- raw UCX ------------------------------------------------------------------
async def _ucx_op(driver: Any, op: Any) -> Any:
    """Await one ucxx operation, progressing the worker the way UcxTransport does."""
    if driver is None:
        return await op
    driver.hold()
    try:
        return await op
    finally:
        driver.release()


def _ucx_holder(q: Any, nbytes: int, pulls: int) -> None:
    import ucxx

    from kvstore.transport.ucx import ucx_loop_progress

    async def main() -> None:
        driver = ucx_loop_progress()
        payload = _pattern(nbytes)
        eps: asyncio.Queue[Any] = asyncio.Queue()
        listener = ucxx.create_listener(eps.put_nowait, 0)
        q.put(listener.port)
        ep = await eps.get()
        req = np.empty(1, dtype=np.uint8)
        try:
            for _ in range(pulls):
                await _ucx_op(driver, ep.recv(req))
                await _ucx_op(driver, ep.send(payload))
            await asyncio.sleep(0.2)  # let the last message drain before closing
        finally:
            ep.abort()
            listener.close()

    asyncio.run(main())


def _ucx_puller(q: Any, port: int, nbytes: int, repeats: int) -> None:
    import ucxx

    from kvstore.transport.ucx import ucx_loop_progress

    async def pull() -> None:
        driver = ucx_loop_progress()
        ep = await _ucx_op(driver, ucxx.create_endpoint("127.0.0.1", port))
        dst = np.zeros(nbytes, dtype=np.uint8)
        req = np.ones(1, dtype=np.uint8)
        try:
            for i in range(repeats + WARMUP):
                start = time.perf_counter()
                await _ucx_op(driver, ep.send(req))
                await _ucx_op(driver, ep.recv(dst))
                elapsed = time.perf_counter() - start
                if i >= WARMUP:
                    q.put((nbytes, elapsed))
        finally:
            ep.abort()
        _check(dst)

    asyncio.run(pull())


def raw_ucx(batch_bytes: int, repeats: int, progress: Progress = None) -> list[float]:
    """Seconds per pull of ``batch_bytes`` as one ucxx tagged message (both
    sides progressed like ``UcxTransport``: from the event loop)."""
    proc, port = _start(_ucx_holder, batch_bytes, repeats + WARMUP)
    try:
        return _in_child(_ucx_puller, port, batch_bytes, repeats, progress=progress)
    finally:
        _stop(proc)


# ---- transport pull -------------------------------------------------------------
def _keys(n: int) -> list[bytes]:
    return [b"bench-%08d" % i for i in range(n)]


def _transport_holder(q: Any, kind: str, n_pages: int, page_bytes: int, loop: str) -> None:
    import xxhash

    from kvstore.loops import loop_factory
    from kvstore.ops.numpy_ops import NumpyPageOps
    from kvstore.pool.pool import PagePool
    from kvstore.transport.auto import make_transport
    from kvstore.transport.base import Served
    from kvstore.v1 import kvstore_pb2 as pb

    pool = PagePool(NumpyPageOps(), n_pages, page_bytes, prefault=True)
    keys = _keys(n_pages)
    res = pool.reserve(n_pages)
    pool.buffer[res.slots] = _pattern(n_pages * page_bytes).reshape(n_pages, page_bytes)
    pool.commit(res, keys)
    # A node stores each page's checksum when the page is written.
    checksums = {k: xxhash.xxh3_64_intdigest(pool.buffer[s]) for k, s in zip(keys, res.slots)}
    staging = _pattern(n_pages * page_bytes).reshape(n_pages, page_bytes)  # reused, prefaulted

    def serve(request: pb.DataHeader) -> Served:
        handle = pool.acquire(list(request.keys))
        slots = handle.slots
        payload = pool.ops.pack(pool.buffer, slots, out=staging[:len(slots)]) if slots else None
        header = pb.DataHeader(op=pb.DataHeader.RESULT, namespace=request.namespace, page_bytes=page_bytes,
                               found=handle.found, checksums=[checksums[e.key] for e in handle.entries])
        return Served(header, payload, lambda: pool.release(handle))

    async def main() -> None:
        transport = make_transport(kind)
        endpoint = await transport.start("127.0.0.1", 0, serve)
        q.put(endpoint.port)
        await asyncio.Event().wait()  # until the puller kills this process

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(main())


def _transport_puller(q: Any, kind: str, port: int, batch_pages: int, page_bytes: int, repeats: int,
                      loop: str) -> None:
    from kvstore.loops import loop_factory
    from kvstore.transport.auto import make_transport
    from kvstore.v1 import kvstore_pb2 as pb

    dst = np.zeros((batch_pages, page_bytes), dtype=np.uint8)
    request = pb.DataHeader(op=pb.DataHeader.GET, namespace="bench", keys=_keys(batch_pages), local_only=True)

    async def pull() -> None:
        transport = make_transport(kind)
        endpoint = pb.TransportEndpoint(kind=kind, host="127.0.0.1", port=port)
        try:
            for i in range(repeats + WARMUP):
                start = time.perf_counter()
                reply, payload = await transport.fetch(endpoint, request, lambda n, pb_, reply: dst[:n])
                elapsed = time.perf_counter() - start
                assert all(reply.found) and payload is not None and payload.shape == dst.shape
                if i >= WARMUP:
                    q.put((batch_pages * page_bytes, elapsed))
        finally:
            await transport.close()

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(pull())
    _check(dst.reshape(-1))


def transport_pull(kind: str, batch_pages: int, page_bytes: int, repeats: int,
                   progress: Progress = None, loop: str = "auto") -> list[float]:
    """Seconds per ``transport.fetch`` of ``batch_pages`` pages from a holder
    process serving a numpy ``PagePool`` over transport ``kind``."""
    proc, port = _start(_transport_holder, kind, batch_pages, page_bytes, loop)
    try:
        return _in_child(_transport_puller, kind, port, batch_pages, page_bytes, repeats, loop,
                         progress=progress)
    finally:
        proc.kill()
        proc.join(5)


def _check(dst: np.ndarray) -> None:
    """The received bytes are the holder's pattern (spot checks)."""
    n = dst.nbytes
    idx = np.unique(np.linspace(0, n - 1, 4096, dtype=np.int64))
    assert np.array_equal(dst.reshape(-1)[idx], _BASE[idx % _PERIOD]), "received bytes differ from what was sent"


# ---- report -----------------------------------------------------------------------
def memcpy_gbps(nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """numpy copy of ``nbytes`` (warm buffers): best of ``repeats``."""
    src = _pattern(nbytes)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def gbps(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {"median_gbps": nbytes / statistics.median(seconds) / 1e9, "best_gbps": nbytes / min(seconds) / 1e9}


LABELS = {"raw_tcp": "raw TCP", "raw_ucx": "raw UCX", "tcp": "TcpTransport", "ucx": "UcxTransport"}


def render(results: dict[str, Any]) -> str:
    methods = results["methods"]
    lines = [
        f"Measured on {results['machine']} ({results['cpus']} CPUs), {results['date']}; "
        f"pulls between two processes on loopback, pages of {results['page_bytes'] // MiB} MiB; "
        f"GB/s = median of {results['repeats']} pulls (best in brackets). UCX env: "
        + ", ".join(f"{k}={v}" for k, v in sorted(results["ucx_env"].items())) + ".",
        "",
        f"memcpy (256 MiB, best of 5): {results['memcpy_gbps']:.2f} GB/s; a transport pull also packs "
        "the batch once on the holder (one such copy).",
        "",
    ]
    ratios = [(a, b) for a, b in (("tcp", "raw_tcp"), ("ucx", "raw_ucx"), ("ucx", "raw_tcp"))
              if a in methods and b in methods]
    head = ["pages", "MiB"] + [LABELS[m] for m in methods] + [f"{LABELS[a]} / {LABELS[b]}" for a, b in ratios]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for row in results["rows"]:
        cells = [str(row["pages"]), str(row["bytes"] // MiB)]
        for m in methods:
            cells.append(f"{row[m]['median_gbps']:.2f} ({row[m]['best_gbps']:.2f})")
        for a, b in ratios:
            cells.append(f"{row[a]['median_gbps'] / row[b]['median_gbps']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["rows"]
    x = [r["pages"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"raw_tcp": ("C0", "--"), "raw_ucx": ("C1", "--"), "tcp": ("C0", "-"), "ucx": ("C1", "-")}
    for m in results["methods"]:
        color, ls = styles[m]
        med = [r[m]["median_gbps"] for r in rows]
        best = [r[m]["best_gbps"] for r in rows]
        ax.plot(x, med, ls=ls, color=color, marker="o", label=f"{LABELS[m]} (median)")
        ax.fill_between(x, med, best, color=color, alpha=0.12)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel(f"pages per pull ({results['page_bytes'] // MiB} MiB each)")
    ax.set_ylabel("GB/s (shaded up to best)")
    ax.set_title("Replication pull between two processes on loopback, measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvctl bench replication_raw``'s options to ``parser``."""
    parser.add_argument("--out", type=Path, default=Path("kvstore-out/bench"),
                        help="folder for replication_raw.{json,md,png}")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="pages per pull")
    parser.add_argument("--page-bytes", type=str, default="1MiB", help="bytes per page")
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per cell (after one warm-up)")
    parser.add_argument("--methods", default=",".join(METHODS), help="subset of " + ",".join(METHODS))
    parser.add_argument("--loop", default="auto", help="event loop of the transport pulls: auto, uvloop, asyncio")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed options describe; returns the process exit code."""
    from kvstore.units import parse_size

    page_bytes = parse_size(args.page_bytes)
    batches = [int(b) for b in args.batches.split(",") if b]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    results: dict[str, Any] = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "page_bytes": page_bytes, "repeats": args.repeats, "loop": args.loop, "methods": methods,
        "statistic": f"median and best of repeats, after {WARMUP} warm-up pulls",
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}, "rows": [],
    }
    results["memcpy_gbps"] = memcpy_gbps()
    total = sum(b * page_bytes for b in batches) * args.repeats * len(methods)
    with tqdm(total=total, unit="B", unit_scale=True, desc="replication pulls") as bar:
        for batch in batches:
            nbytes = batch * page_bytes
            row: dict[str, Any] = {"pages": batch, "bytes": nbytes}
            for method in methods:
                bar.set_postfix_str(f"{method} x{batch}")
                if method == "raw_tcp":
                    times = raw_tcp(nbytes, args.repeats, bar.update)
                elif method == "raw_ucx":
                    times = raw_ucx(nbytes, args.repeats, bar.update)
                else:
                    times = transport_pull(method, batch, page_bytes, args.repeats, bar.update, args.loop)
                row[method] = {**gbps(nbytes, times), "seconds": times}
            results["rows"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replication_raw.json").write_text(json.dumps(results, indent=2))
    table = render(results)
    (args.out / "replication_raw.md").write_text(table)
    plot(results, args.out / "replication_raw.png")
    print(table)
    return 0

