"""How cost grows: the coordinator's work as the cluster gets bigger.

Three series, each over sizes a decade apart, with its log-log slope (1.0 =
linear; the per-item cost is flat):

* **lookup** at 10k / 100k / 1M pages in the directory: p99 of one
  ``Lookup`` (the per-node longest prefix of a 16-block chain) and the
  directory's memory per page. Measured twice: on the pure ``Directory``
  (simulated reports from 4 nodes), and through real ``kvstored`` processes
  (2 nodes on 127.0.0.1: pages put on a, a Lookup RPC on b answered by the
  coordinator a) for the sizes in ``--real-pages``;
* **heartbeat** at 4 / 16 / 64 / 256 members: CPU seconds the coordinator
  spends per heartbeat it receives (``ClusterAgent.on_heartbeat``: membership,
  gossip, a 64-page directory report, the reply with its view), simulated
  members against a real agent;
* **planner** at 10k / 100k / 1M active prefixes: p99 of one planner tick
  (candidate selection, building, ``plan``), from ``bench/planner.py``'s
  synthetic cluster.

Writes ``scale.{json,md,png}`` to ``--out``. All numbers measured.

    python bench/scale.py --out kvstore-out/bench
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner as planner_bench  # noqa: E402

from kvstore.cluster.agent import ClusterAgent  # noqa: E402
from kvstore.cluster.directory import Directory  # noqa: E402
from kvstore.config import NodeConfig  # noqa: E402
from kvstore.metrics import NodeMetrics  # noqa: E402
from kvstore.node import Node  # noqa: E402
from kvstore.ops.numpy_ops import NumpyPageOps  # noqa: E402
from kvstore.pool.layout import PageLayout  # noqa: E402
from kvstore.transport.tcp import TcpTransport  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402

CHAIN = 16


def key(chain: int, block: int) -> bytes:
    return chain.to_bytes(6, "little") + block.to_bytes(2, "little")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.maximum(np.asarray(ys, float), 1e-12))
    return float(np.polyfit(lx, ly, 1)[0]) if len(xs) > 1 else math.nan


def p99(samples: list[float]) -> float:
    return float(np.percentile(np.asarray(samples), 99))


# ---- lookup: the pure directory ----------------------------------------------------
def directory_point(pages: int, lookups: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    chains = pages // CHAIN
    nodes = ["a", "b", "c", "d"]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    d = Directory()
    batches: dict[str, list[bytes]] = {n: [] for n in nodes}
    owner = rng.integers(0, len(nodes), chains)
    second = rng.random(chains) < 0.2
    for c in range(chains):
        ks = [key(c, b) for b in range(CHAIN)]
        batches[nodes[owner[c]]].extend(ks)
        if second[c]:
            batches[nodes[(owner[c] + 1) % len(nodes)]].extend(ks[: CHAIN // 2])
    for n in nodes:
        d.report(n, "i", 1, True, [pb.DirectoryBatch(namespace="m", adds=batches[n])])
    del batches
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    picks = rng.integers(0, chains, lookups)
    times = []
    for c in picks:
        chain = [key(int(c), b) for b in range(CHAIN)]
        t0 = time.perf_counter()
        d.prefixes("m", chain)
        times.append(time.perf_counter() - t0)
    return {"pages": pages, "lookup_p99_us": p99(times) * 1e6, "bytes_per_page": used / pages}


# ---- lookup: real processes ---------------------------------------------------------
def real_point(pages: int, lookups: int) -> dict[str, float]:
    from kvstore.launch import NodeProcess
    from kvstore_client import KvClient

    page = 64
    cap = str(max(pages * page * 2, 8 << 20))
    fast = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.0", "--namespace", f"m:{page}",
            "--transport", "tcp", "--capacity", cap]
    procs = [NodeProcess(["--node-id", "a", *fast])]
    try:
        a = procs[0]
        procs.append(NodeProcess(["--node-id", "b", "--peers", a.address, *fast]))
        with KvClient(a.address) as ka:
            for lo in range(0, pages, 32768):
                ks = [key(i // CHAIN, i % CHAIN) for i in range(lo, min(pages, lo + 32768))]
                ka.put("m", ks, np.zeros((len(ks), page), np.uint8))
        with KvClient(procs[1].address) as kb:
            probe = [key(0, i) for i in range(CHAIN)]
            deadline = time.monotonic() + 120
            while not any(n.node_id == "a" and n.prefix_length == CHAIN for n in kb.lookup_nodes("m", probe).nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the directory never learned the pages")
                time.sleep(0.1)
            times = []
            for c in np.random.default_rng(1).integers(0, pages // CHAIN, lookups):
                chain = [key(int(c), i) for i in range(CHAIN)]
                t0 = time.perf_counter()
                kb.lookup_nodes("m", chain)
                times.append(time.perf_counter() - t0)
    finally:
        for proc in procs:
            proc.kill()
    return {"pages": pages, "lookup_p99_us": p99(times) * 1e6}


# ---- heartbeat CPU on the coordinator ----------------------------------------------------
def heartbeat_point(members: int, rounds: int) -> dict[str, float]:
    config = NodeConfig(listen="127.0.0.1:0", node_id="a", capacity=64 << 20, device="cpu", prefault=False)
    node = Node(config, NumpyPageOps())
    node.create_namespace("m", PageLayout(64))
    agent = ClusterAgent(node, config, TcpTransport(), NodeMetrics(node))
    infos = [pb.MemberInfo(node_id=f"n{i:04d}", address=f"127.0.0.1:{10000 + i}", incarnation="1",
                           capacity_bytes=1 << 30) for i in range(members - 1)]
    seqs = dict.fromkeys(range(len(infos)), 0)
    cpu = []
    for r in range(rounds):
        for i, info in enumerate(infos):
            seqs[i] += 1
            adds = [key(100000 * i + r, b) for b in range(64)]
            request = pb.HeartbeatRequest(sender=info, known=infos, has_directory=True, seq=seqs[i], full=r == 0,
                                          directory=[pb.DirectoryBatch(namespace="m", adds=adds)])
            t0 = time.process_time()
            agent.on_heartbeat(request)
            cpu.append(time.process_time() - t0)
    per = float(np.median(cpu[len(infos):]))  # the first round carries full snapshots; median: GC pauses aside
    return {"members": members, "cpu_us_per_heartbeat": per * 1e6, "cpu_ms_per_round": per * (members - 1) * 1e3}


# ---- planner tick -----------------------------------------------------------------------
def planner_point(prefixes: int, ticks: int) -> dict[str, float]:
    args = SimpleNamespace(prefixes=prefixes, nodes=8, seed=0, ticks=ticks, spec_bandwidth=1e9, spec_budget=0.2,
                           max_decisions=256, bandwidth=1e9, limit=512, no_gc_freeze=False, out=None)
    report = planner_bench.run(args)
    gc.unfreeze()
    return {"prefixes": prefixes, "tick_p99_ms": report["tick_ms"]["p99"], "tick_p50_ms": report["tick_ms"]["p50"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "scale", "host": {"python": platform.python_version(),
                                                       "machine": platform.machine()}}
    sizes = [int(x) for x in args.pages.split(",")]
    out["lookup"] = [directory_point(n, args.lookups, 0) for n in tqdm(sizes, desc="directory", unit="size")]
    real = [int(x) for x in args.real_pages.split(",") if x]
    out["lookup_real"] = [real_point(n, args.lookups) for n in tqdm(real, desc="real lookups", unit="size")]
    members = [int(x) for x in args.members.split(",")]
    heartbeat_point(8, 2)  # warm-up: first calls of the protobuf and membership paths are slower
    out["heartbeat"] = [heartbeat_point(m, args.rounds) for m in tqdm(members, desc="heartbeats", unit="size")]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    out["planner"] = [planner_point(n, args.ticks) for n in tqdm(prefixes, desc="planner", unit="size")]
    out["slopes"] = {
        "lookup_p99_vs_pages": slope(sizes, [p["lookup_p99_us"] for p in out["lookup"]]),
        "directory_bytes_vs_pages": slope(sizes, [p["bytes_per_page"] * p["pages"] for p in out["lookup"]]),
        "real_lookup_p99_vs_pages": slope(real, [p["lookup_p99_us"] for p in out["lookup_real"]]),
        "heartbeat_cpu_vs_members": slope(members, [p["cpu_us_per_heartbeat"] for p in out["heartbeat"]]),
        "round_cpu_vs_members": slope(members, [p["cpu_ms_per_round"] for p in out["heartbeat"]]),
        "planner_tick_vs_prefixes": slope(prefixes, [p["tick_p99_ms"] for p in out["planner"]]),
    }
    return out


def markdown(r: dict[str, Any]) -> str:
    s = r["slopes"]
    rows = ["| series | size | measure | value |", "|---|---|---|---|"]
    for p in r["lookup"]:
        rows.append(f"| directory lookup | {p['pages']:,} pages | p99 µs / bytes per page | "
                    f"{p['lookup_p99_us']:.1f} / {p['bytes_per_page']:.0f} |")
    for p in r["lookup_real"]:
        rows.append(f"| Lookup RPC (2 processes) | {p['pages']:,} pages | p99 µs | {p['lookup_p99_us']:.0f} |")
    for p in r["heartbeat"]:
        rows.append(f"| coordinator heartbeat | {p['members']} members | CPU µs per heartbeat / ms per round | "
                    f"{p['cpu_us_per_heartbeat']:.0f} / {p['cpu_ms_per_round']:.1f} |")
    for p in r["planner"]:
        rows.append(f"| planner tick | {p['prefixes']:,} prefixes | p50 / p99 ms | "
                    f"{p['tick_p50_ms']:.2f} / {p['tick_p99_ms']:.2f} |")
    rows += ["", "| log-log slope | value |", "|---|---|"]
    rows += [f"| {k} | {v:.2f} |" for k, v in s.items()]
    return "\n".join(rows)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [
        (axes[0], "pages", [("directory lookup p99 (µs)", r["lookup"], "lookup_p99_us"),
                            ("Lookup RPC p99 (µs)", r["lookup_real"], "lookup_p99_us"),
                            ("directory bytes per page", r["lookup"], "bytes_per_page")]),
        (axes[1], "members", [("CPU µs per heartbeat", r["heartbeat"], "cpu_us_per_heartbeat"),
                              ("CPU ms per round", r["heartbeat"], "cpu_ms_per_round")]),
        (axes[2], "prefixes", [("planner tick p99 (ms)", r["planner"], "tick_p99_ms")]),
    ]
    for ax, x, lines in series:
        for label, points, y in lines:
            if points:
                ax.loglog([p[x] for p in points], [p[y] for p in points], marker="o", label=label)
        ax.set_xlabel(x)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("kvstore: how cost grows (log-log; slopes in scale.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("kvstore-out/bench"))
    ap.add_argument("--pages", default="10000,100000,1000000")
    ap.add_argument("--real-pages", default="10000,100000", help="sizes for the real-process Lookup ('' = none)")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--members", default="4,16,64,256")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prefixes", default="10000,100000,1000000")
    ap.add_argument("--ticks", type=int, default=30)
    args = ap.parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "scale.md").write_text(table + "\n")
    plot(report, args.out / "scale.png")
    print(table)
    print(f"wrote {args.out}/scale.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
