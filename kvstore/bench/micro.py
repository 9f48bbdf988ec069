"""Data-path microbenchmark: one kvstored node vs raw memcpy and raw TCP.

Everything is measured in the same run on the same machine, so the ratios
mean something on a shared, noisy host:

* ``memcpy``: numpy copy of a 64 MiB buffer (the ceiling of any copy).
* ``raw tcp``: two processes, blocking ``sendall`` -> ``recv_into`` into a
  preallocated buffer (the ceiling of any loopback transfer).
* ``kvstore``: a real ``kvstored --device cpu`` process and the Python
  client, put and get, one page per call and batches of 8 pages per call
  (``--batch``), for each page size, through shared memory (``shm``: the
  co-located path, which counts the copy into the caller's buffer), over the
  bulk data channel (``tcp``), over the data channel with TLS (``tls``: a
  second node with a throwaway trustme certificate, so the node's TLS receive
  path and the client's ``ssl`` socket) and over gRPC streams (``grpc``).
  Ratios are against memcpy for ``shm`` and against raw TCP for the socket
  paths; ``tls`` is also set against ``tcp`` of the same run, page size and
  batch (what TLS costs the data channel).
* peers (``--peers redis,mooncake``, :mod:`kvstore.bench.peers`): Redis and Mooncake
  Store started on 127.0.0.1 beside the node and measured through their own
  Python clients with the same loop, page sizes, batches and bytes, each
  page size right after kvstore's rows of that size; ratios kvstore / peer
  for the data channel (``tcp``: the peers cross a socket too), ``tls`` and
  ``shm``. A peer not installed is skipped with one ``peer X skipped: <why>``
  line (``pip install -e '.[bench]'``, Debian ``redis-server`` and
  ``libibverbs1``).

All numbers are measured; none are modelled. Writes ``micro.json``,
``micro.md`` and ``micro.png`` to ``--out``.

    kvctl bench micro --out kvstore-out/bench      (or: make bench)
    kvctl bench micro --peers redis,mooncake --total 64MiB --sizes 1MiB,4MiB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvstore.bench import micro_clients, peers
from kvstore.bench.ceilings import raw_streams, raw_tcp_gbps

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


def memcpy_gbps(nbytes: int = 64 << 20, repeat: int = 20) -> float:
    src = np.random.randint(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    return nbytes / best / 1e9


def memcpy_pages_gbps(page_bytes: int, total: int, batch: int, repeat: int = 3) -> float:
    """numpy copies of the same bytes a shm row moves: the same number of
    pages of the same size, page by page, from one array into another of the
    same shape (memory mapped up front, as the pool is): best of ``repeat``."""
    from kvstore.hostmem import populated_empty

    count = peers.page_count(page_bytes, total, batch)
    src = np.random.randint(0, 255, (count, page_bytes), dtype=np.uint8)
    dst = populated_empty(count, page_bytes)

    def copy() -> None:
        for i in range(count):
            np.copyto(dst[i], src[i])

    return count * page_bytes / min(_timed(copy) for _ in range(repeat)) / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tls_node(capacity: int, folder: Path):  # type: ignore[no-untyped-def]
    """A kvstored with a throwaway CA and node certificate (trustme); returns (node, CA file)."""
    import trustme

    from kvstore.launch import NodeProcess

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    (folder / "node.pem").write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(folder / "node.key"))
    node = NodeProcess(["--capacity", str(capacity), "--tls-cert", str(folder / "node.pem"),
                        "--tls-key", str(folder / "node.key"), "--tls-ca", str(folder / "ca.pem")])
    return node, str(folder / "ca.pem")


class KvTarget:
    """A kvstore namespace through ``KvClient``, for :func:`bench.peers.measure`."""

    def __init__(self, kv, ns: str) -> None:  # type: ignore[no-untyped-def]
        self.kv, self.ns = kv, ns

    def prepare(self, pages: np.ndarray, out: np.ndarray) -> None:
        pass

    def put(self, keys: list[bytes], block: np.ndarray) -> None:
        self.kv.put(self.ns, keys, block)

    def get(self, keys: list[bytes], out: np.ndarray) -> None:
        self.kv.get(self.ns, keys, out=out)

    def clear(self) -> None:
        pass


def bench_store(address: str, path: str, page_bytes: int, total: int, bar: tqdm, batch: int = 1,
                tls_ca: str | None = None) -> dict[str, float]:
    """Put then get ``total`` bytes, ``batch`` pages per call; latency per call.
    ``path`` ``tls``: the data channel of a TLS node (``tls_ca``)."""
    from kvstore_client import KvClient

    ns = f"bench-{path}-{page_bytes}-{batch}"
    count = peers.page_count(page_bytes, total, batch)
    with KvClient(address, data_path="tcp" if path == "tls" else path, tls_ca=tls_ca) as kv:
        kv.create_namespace(ns, page_bytes, capacity=(count + batch) * page_bytes)
        row = peers.measure(KvTarget(kv, ns), page_bytes, total, bar, batch)
        kv.delete_namespace(ns)
    return row


def render(results: dict) -> str:  # type: ignore[type-arg]
    tcp, mem = results["raw_tcp_gbps"], results["memcpy_gbps"]
    lines = [
        f"Measured on {results['machine']} ({results['cpus']} CPUs), {results['date']}. All numbers measured.",
        "",
        f"raw memcpy (64 MiB): **{mem:.2f} GB/s**; raw blocking TCP between two processes: **{tcp:.2f} GB/s** "
        f"(one 4 MiB buffer reused on both sides); raw TCP from and into distinct memory of the row's size: "
        f"**{results.get('raw_tcp_spread_gbps', 0.0):.2f} GB/s** (`/ spread` below)",
        "",
        "`raw` for shm rows is numpy memcpy of the same bytes (the row's pages, page by page, into a second "
        "array: `memcpy GB/s` below); for the socket rows raw TCP.",
        "",
        "| path | page | pages/call | put GB/s | get GB/s | put / raw | get / raw | raw | put / spread | get / spread "
        "| put p50/p99 ms | get p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        raw, name = (row["memcpy_gbps"], f"memcpy {row['memcpy_gbps']:.2f} GB/s") if row["path"] == "shm" \
            else (tcp, "tcp")
        lines.append(
            f"| {row['path']} | {row['page']} | {row.get('batch', 1)} | {row['put_gbps']:.2f} | {row['get_gbps']:.2f} | "
            f"{row['put_gbps'] / raw:.2f}x | {row['get_gbps'] / raw:.2f}x | {name} | {spread_cells(row, results)} | "
            f"{row['put_p50_ms']:.2f} / {row['put_p99_ms']:.2f} | {row['get_p50_ms']:.2f} / {row['get_p99_ms']:.2f} |")
    plain = {(r["page"], r.get("batch", 1)): r for r in results["rows"] if r["path"] == "tcp"}
    tls = [r for r in results["rows"] if r["path"] == "tls" and (r["page"], r.get("batch", 1)) in plain]
    if tls:
        lines += ["", "TLS on the data channel against plaintext, same run (ratio = TLS / plaintext):", "",
                  "| page | pages/call | put GB/s tls / plain | get GB/s tls / plain | put ratio | get ratio |",
                  "|---|---|---|---|---|---|"]
        for row in tls:
            base = plain[(row["page"], row.get("batch", 1))]
            lines.append(f"| {row['page']} | {row.get('batch', 1)} | {row['put_gbps']:.2f} / {base['put_gbps']:.2f} | "
                         f"{row['get_gbps']:.2f} / {base['get_gbps']:.2f} | "
                         f"{row['put_gbps'] / base['put_gbps']:.2f}x | {row['get_gbps'] / base['get_gbps']:.2f}x |")
    lines += render_clients(results)
    lines += render_peers(results)
    return "\n".join(lines) + "\n"


def spread_cells(row: dict, results: dict) -> str:  # type: ignore[type-arg]
    spread = results.get("raw_tcp_spread_gbps")
    if row["path"] == "shm" or not spread:
        return "- | -"
    return f"{row['put_gbps'] / spread:.2f}x | {row['get_gbps'] / spread:.2f}x"


CONCURRENT = (("4MiB", 1), ("1MiB", 8))  # the shapes of the socket target, with several clients at once


def render_clients(results: dict) -> list[str]:  # type: ignore[type-arg]
    rows = results.get("concurrent", [])
    if not rows:
        return []
    raw = results["raw_tcp_streams_gbps"]
    lines = ["", f"{rows[0]['clients']} clients at once (each its own process, connection and namespace; aggregate "
             f"GB/s from the common start to the last done) against {rows[0]['clients']} concurrent raw TCP streams: "
             f"**{raw:.2f} GB/s**:", "",
             "| path | page | pages/call | clients | put GB/s | get GB/s | put / raw streams | get / raw streams |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['path']} | {row['page']} | {row['batch']} | {row['clients']} | {row['put_gbps']:.2f} | "
                     f"{row['get_gbps']:.2f} | {row['put_gbps'] / raw:.2f}x | {row['get_gbps'] / raw:.2f}x |")
    return lines


TARGETS = {"redis": (("get",), 1.0), "mooncake": (("put", "get"), 1.5)}  # targets: kvstore tcp / peer at 4MiB


def render_peers(results: dict) -> list[str]:  # type: ignore[type-arg]
    """kvstore / peer for each peer row, against kvstore's rows of the same page size and batch."""
    mine = {(r["path"], r["page"], r.get("batch", 1)): r for r in results["rows"] if not r.get("peer")}
    rows = [r for r in results["rows"] if r.get("peer")]
    skipped = [f"peer {name} skipped: {why}" for name, why in results.get("peers_skipped", {}).items()]
    if not rows:
        return ["", *skipped] if skipped else []
    paths = [p for p in ("tcp", "tls", "shm") if any(k[0] == p for k in mine)]
    lines = ["", ("Beside other stores, same run (ratio = kvstore GB/s / peer GB/s; `tcp` is kvstore's socket data "
                  "channel, as the peers cross a socket too; `tls` the same with TLS; `shm` shared memory):"), "",
             "| peer | page | pages/call | peer put GB/s | peer get GB/s |"
             + "".join(f" {p} / peer put | {p} / peer get |" for p in paths),
             "|---|---|---|---|---|" + "---|---|" * len(paths)]
    for row in rows:
        cells = []
        for path in paths:
            base = mine.get((path, row["page"], row.get("batch", 1)))
            cells += ["-", "-"] if base is None else [f"{base['put_gbps'] / row['put_gbps']:.2f}x",
                                                      f"{base['get_gbps'] / row['get_gbps']:.2f}x"]
        lines.append(f"| {row['path']} | {row['page']} | {row.get('batch', 1)} | {row['put_gbps']:.2f} | "
                     f"{row['get_gbps']:.2f} | " + " | ".join(cells) + " |")
    lines += [""] + skipped if skipped else []
    tcp = mine.get(("tcp", "4MiB", 1))
    for row in rows:
        if tcp is None or row["path"] not in TARGETS or row["page"] != "4MiB" or row.get("batch", 1) != 1:
            continue
        ops, need = TARGETS[row["path"]]
        got = [tcp[f"{op}_gbps"] / row[f"{op}_gbps"] for op in ops]
        lines.append(f"\n4MiB, 1 page/call, kvstore tcp / {row['path']} {' and '.join(ops)}: "
                     f"{' / '.join(f'{g:.2f}x' for g in got)} (target >= {need:g}x: "
                     f"{'met' if min(got) >= need else 'NOT met'})")
    return lines


def plot(results: dict, path: Path) -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = results["rows"]
    labels = [f"{r['path']}\n{r['page']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, [r["put_gbps"] for r in rows], 0.4, label="put")
    ax.bar(x + 0.2, [r["get_gbps"] for r in rows], 0.4, label="get")
    ax.axhline(results["raw_tcp_gbps"], color="k", ls="--", label="raw TCP (2 processes)")
    ax.axhline(results["raw_tcp_gbps"] * 0.5, color="grey", ls=":", label="0.5x raw TCP (target)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s (one page per call)")
    ax.set_title("kvstored data path on loopback, measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvctl bench micro``'s options to ``parser``."""
    parser.add_argument("--out", type=Path, default=Path("kvstore-out/bench"), help="folder for micro.{json,md,png}")
    parser.add_argument("--total", type=str, default="256MiB", help="bytes moved per (path, page size, op)")
    parser.add_argument("--paths", default="shm,tcp,tls,grpc", help="client data paths to measure (tls: the "
                        "data channel of a second node with TLS)")
    parser.add_argument("--batch", default="1,8", help="pages per call to measure, e.g. 1,8")
    parser.add_argument("--sizes", default=",".join(SIZES), help="page sizes: " + ",".join(SIZES))
    parser.add_argument("--clients", type=int, default=4, help="also measure this many clients at once on the "
                        "data channel (4 MiB x1 and 1 MiB x8) against as many concurrent raw TCP streams; 0: skip")
    parser.add_argument("--peers", default="", help="other stores measured beside kvstore in the same run: "
                        "redis,mooncake (pip install -e '.[bench]'; Debian redis-server and libibverbs1); one "
                        "not installed is skipped with one line")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed options describe; returns the process exit code."""
    from kvstore.units import parse_size

    total = parse_size(args.total)
    paths = [p for p in args.paths.split(",") if p]
    batches = [int(b) for b in args.batch.split(",") if b]
    sizes = [s for s in args.sizes.split(",") if s]
    names = [p for p in args.peers.split(",") if p]
    if names and "tcp" not in paths:
        print("--peers: kvstore's data channel (tcp) added to --paths, the peers are set against it")
        paths.append("tcp")
    results = {"machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "total_bytes": total, "rows": [], "peers": names, "peers_skipped": {}}
    print("measuring raw memcpy and raw TCP ...", flush=True)
    results["memcpy_gbps"] = memcpy_gbps()
    results["raw_tcp_gbps"] = raw_tcp_gbps()
    results["raw_tcp_spread_gbps"] = raw_tcp_gbps(total=max(total, 64 << 20), spread=True)
    from kvstore.launch import NodeProcess

    capacity = 2 * total * len(batches) + (64 << 20)
    if args.clients > 1:  # the clients-at-once rows reserve namespaces of their own beside the rows above
        capacity += max(micro_clients.clients_capacity(
            args.clients, SIZES[size], peers.page_count(SIZES[size], total // args.clients, batch), batch)
            for size, batch in CONCURRENT)
    node = NodeProcess(["--capacity", str(capacity)])
    address = node.address
    secure = ca = None
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-tls-")
    try:
        if "tls" in paths:
            secure, ca = tls_node(capacity, Path(tmp.name))
        with peers.started(names, capacity, skipped=results["peers_skipped"]) as others, \
                tqdm(total=2 * (len(paths) + len(others)) * sum(peers.page_count(SIZES[s], total, b) * SIZES[s]
                                                               for s in sizes for b in batches),
                     unit="B", unit_scale=True, desc="kvstore" + "".join(f"+{n}" for n in others)) as bar:
            for size in sizes:  # size by size, so each peer's row is measured right after kvstore's
                for batch in batches:
                    for path in paths:
                        if path == "tls":
                            assert secure is not None
                            row = bench_store(secure.address, path, SIZES[size], total, bar, batch, tls_ca=ca)
                        else:
                            row = bench_store(address, path, SIZES[size], total, bar, batch)
                        if path == "shm":  # its ceiling, measured beside it
                            row["memcpy_gbps"] = memcpy_pages_gbps(SIZES[size], total, batch)
                        results["rows"].append({"path": path, "page": size, **row})
                    for name, target in others.items():
                        row = peers.measure(target, SIZES[size], total, bar, batch)
                        results["rows"].append({"path": name, "page": size, "peer": True, **row})
        if args.clients > 1 and "tcp" in paths:
            print(f"measuring {args.clients} clients at once ...", flush=True)
            for size, batch in CONCURRENT:
                count = peers.page_count(SIZES[size], total // args.clients, batch)
                row = micro_clients.kv_clients(address, "tcp", args.clients, SIZES[size], count, batch)
                results.setdefault("concurrent", []).append(
                    {"path": "tcp", "page": size, "batch": batch, "clients": args.clients, **row})
            results["raw_tcp_streams_gbps"] = raw_streams(args.clients)
        order = [*paths, *names]
        results["rows"].sort(key=lambda r: (order.index(r["path"]), sizes.index(r["page"]), r["batch"]))
    finally:
        node.terminate()
        if secure is not None:
            secure.terminate()
        tmp.cleanup()
    # raw TCP again after, so drift over the run shows up
    results["raw_tcp_gbps_after"] = raw_tcp_gbps()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "micro.json").write_text(json.dumps(results, indent=2))
    table = render(results)
    (args.out / "micro.md").write_text(table)
    plot(results, args.out / "micro.png")
    print(table)
    print(f"raw TCP after the kvstore runs: {results['raw_tcp_gbps_after']:.2f} GB/s")
    return 0

