"""Replication benchmark: the Replicate primitive between two real kvstored
nodes, beside raw TCP and raw UCX transfers of the same bytes, in one run.

For batches of 1-256 pages of 1 MiB and each transport (``ucx``, ``tcp``):
node A holds the pages; a ``Replicate`` call makes node B pull them (one
gRPC round trip + pull request + pack on A + one transfer + checksum check +
unpack into B's slots + commit). B's copies are deleted between repeats.
The raw columns come from :mod:`kvstore.bench.replication_raw` (two
processes, preallocated buffers, one message per batch), measured in the
same run.

Reports the median seconds per batch as GB/s and node/raw ratios; the
target is >= 0.7x the raw transport for batches >= 16 MiB.
All numbers measured. Writes ``replication.{json,md,png}`` to ``--out``.

    kvctl bench replication --out kvstore-out/bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import grpc
import numpy as np
from tqdm import tqdm

from kvstore.bench import replication_raw as raw

from kvstore.launch import NodeProcess

MiB = 1 << 20


def start_node(node_id: str, transport: str, capacity: str, peers: str | None = None) -> NodeProcess:
    args = ["--node-id", node_id, "--transport", transport, "--capacity", capacity, "--namespace", f"m:{MiB}",
            "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
    return NodeProcess(args + (["--peers", peers] if peers else []))


def node_replicate(transport: str, batches: list[int], repeats: int, bar: tqdm) -> dict[int, list[float]]:
    """Seconds per Replicate of each batch size from node a to node b."""
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
    from kvstore_client import KvClient

    most = max(batches)
    capacity = f"{most + 16}MiB"
    a = start_node("a", transport, capacity)
    b = start_node("b", transport, capacity, peers=a.address)
    addr_a, addr_b = a.address, b.address
    out: dict[int, list[float]] = {}
    try:
        keys = [i.to_bytes(8, "little") for i in range(most)]
        with KvClient(addr_a) as ka, KvClient(addr_b) as kb, grpc.insecure_channel(addr_b) as channel:
            ka.put("m", keys, np.random.default_rng(0).integers(0, 256, (most, MiB), dtype=np.uint8))
            stub = pb_grpc.ClusterStub(channel)
            deadline = time.monotonic() + 10
            while len(stub.Status(pb.ClusterStatusRequest()).members) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("nodes did not see each other")
                time.sleep(0.05)
            for n in batches:
                times = []
                for rep in range(repeats + 1):  # the first is warm-up
                    request = pb.ReplicateRequest(namespace="m", keys=keys[:n], source_node_id="a")
                    start = time.perf_counter()
                    reply = stub.Replicate(request, timeout=60)
                    took = time.perf_counter() - start
                    if reply.copied != n:
                        raise RuntimeError(f"replicated {reply.copied} of {n} pages")
                    if rep:
                        times.append(took)
                        bar.update(n * MiB)
                    kb.delete("m", keys[:n])
                out[n] = times
    finally:
        for node in (b, a):
            node.terminate()
    return out


def xxh3_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds of one xxh3_64 pass over ``nbytes`` in 1 MiB pages (the
    checksum every pull verifies; part of the contract, so part of the ceiling)."""
    from kvstore.pool.movement import page_checksum

    pages = np.random.default_rng(1).integers(0, 256, (nbytes // MiB, MiB), dtype=np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for page in pages:
            page_checksum(page)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvctl bench replication``'s options to ``parser``."""
    parser.add_argument("--out", type=Path, default=Path("kvstore-out/bench"))
    parser.add_argument("--batches", default="1,4,16,64,256", help="pages of 1 MiB per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="ucx,tcp")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed options describe; returns the process exit code."""
    batches = [int(b) for b in args.batches.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    total = sum(batches) * MiB * args.repeats * len(transports) * 2
    results: dict = {"machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                     "page_bytes": MiB, "repeats": args.repeats, "statistic": "median", "rows": []}
    with tqdm(total=total, unit="B", unit_scale=True, desc="replication") as bar:
        for transport in transports:
            node = node_replicate(transport, batches, args.repeats, bar)
            for n in batches:
                measure = raw.raw_ucx if transport == "ucx" else raw.raw_tcp
                base = measure(n * MiB, args.repeats)
                bar.update(n * MiB * args.repeats)
                node_s, raw_s = statistics.median(node[n]), statistics.median(base)
                hash_s = xxh3_seconds(n * MiB, args.repeats)
                results["rows"].append({"transport": transport, "pages": n, "mib": n,
                                        "node_gbps": n * MiB / node_s / 1e9, "raw_gbps": n * MiB / raw_s / 1e9,
                                        "node_ms": node_s * 1e3, "raw_ms": raw_s * 1e3, "xxh3_ms": hash_s * 1e3,
                                        "ratio": raw_s / node_s, "ratio_with_checksum": (raw_s + hash_s) / node_s})
    lines = [f"Measured on {results['machine']} ({results['cpus']} CPUs), {results['date']}; median of "
             f"{args.repeats} after one warm-up; all numbers measured.", "",
             "`/ (raw + xxh3)`: against the raw transfer plus one xxh3 pass over the same bytes, measured here "
             "(every pull verifies the checksums, so that is the ceiling).", "",
             "| transport | batch | Replicate GB/s | raw GB/s | Replicate / raw | Replicate / (raw + xxh3) "
             "| Replicate ms | raw ms | xxh3 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['transport']} | {r['pages']} x 1 MiB | {r['node_gbps']:.2f} | {r['raw_gbps']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['ratio_with_checksum']:.2f}x | {r['node_ms']:.2f} | {r['raw_ms']:.2f} "
                     f"| {r['xxh3_ms']:.2f} |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replication.json").write_text(json.dumps(results, indent=2))
    (args.out / "replication.md").write_text(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for transport in transports:
            rows = [r for r in results["rows"] if r["transport"] == transport]
            ax.plot([r["mib"] for r in rows], [r["node_gbps"] for r in rows], "o-", label=f"Replicate over {transport}")
            ax.plot([r["mib"] for r in rows], [r["raw_gbps"] for r in rows], "x--", label=f"raw {transport}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (MiB, 1 MiB pages)")
        ax.set_ylabel("GB/s (median)")
        ax.set_title("Node-to-node replication vs raw transport, loopback, measured")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "replication.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    print(table)
    return 0

