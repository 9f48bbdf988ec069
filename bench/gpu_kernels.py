"""GPU kernels and the GPU pool, against the hardware's own copy, in one run.

Needs a CUDA device and CuPy (``scripts/gpu-check`` runs it on a lent GPU
machine). Measured with CUDA events after a warm-up, each configuration's
result checked against numpy before it is timed:

* ``pack`` (scattered pool slots -> one contiguous staging buffer) and
  ``unpack`` (staging -> slots) against a CuPy device-to-device copy of the
  same bytes (``cupy.copyto`` of one contiguous array): target >= 0.8x;
* a GPU pool served over the data channel: Put and Get of 4 MiB pages
  through ``KvClient`` against an in-process node on ``cuda:0``, beside the
  raw device-to-host plus host-to-device copy of the same bytes (what a
  socket path must at least pay).

Writes ``gpu_kernels.{json,md}`` to ``--out``.

    python bench/gpu_kernels.py --out kvstore-out/bench
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients"))

MiB = 1 << 20


def cuda_time(cupy: Any, fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` by CUDA events, after two warm-up calls."""
    fn()
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def kernels(cupy: Any, page_bytes: int, pages: int, repeats: int) -> dict[str, float]:
    from kvstore.ops.auto import select

    ops = select("cupy", "cuda:0")
    slots_total = pages * 2
    pool = ops.empty_pool(slots_total, page_bytes)
    pool[:] = cupy.random.randint(0, 256, pool.shape, dtype=cupy.uint8)
    rng = np.random.default_rng(0)
    slots = np.sort(rng.choice(slots_total, pages, replace=False))
    staging = cupy.empty((pages, page_bytes), dtype=cupy.uint8)
    ops.pack(pool, slots, out=staging)
    assert np.array_equal(cupy.asnumpy(staging), cupy.asnumpy(pool)[slots]), "pack is wrong"
    target = ops.empty_pool(slots_total, page_bytes)
    ops.unpack(staging, slots, target)
    assert np.array_equal(cupy.asnumpy(target)[slots], cupy.asnumpy(staging)), "unpack is wrong"
    src = cupy.empty_like(staging)
    nbytes = pages * page_bytes
    t_copy = cuda_time(cupy, lambda: cupy.copyto(staging, src), repeats)
    t_pack = cuda_time(cupy, lambda: ops.pack(pool, slots, out=staging), repeats)
    t_unpack = cuda_time(cupy, lambda: ops.unpack(staging, slots, target), repeats)
    return {"page_bytes": page_bytes, "pages": pages, "copy_gbs": nbytes / t_copy / 1e9,
            "pack_gbs": nbytes / t_pack / 1e9, "unpack_gbs": nbytes / t_unpack / 1e9,
            "pack_vs_copy": t_copy / t_pack, "unpack_vs_copy": t_copy / t_unpack}


def data_channel(cupy: Any, page_bytes: int, pages: int, repeats: int) -> dict[str, float]:
    """Put/Get through the client into a GPU pool, beside D2H + H2D of the same bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import ServerThread
    from kvstore.config import NodeConfig
    from kvstore.ops.auto import select
    from kvstore_client import KvClient

    cfg = NodeConfig(listen="127.0.0.1:0", capacity=4 * pages * page_bytes, device="cuda:0", grace=1.0)
    srv = ServerThread(cfg, select("cupy", "cuda:0")).start()
    try:
        data = np.random.default_rng(1).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
        put_s, get_s = [], []
        with KvClient(srv.address) as kv:
            kv.create_namespace("g", page_bytes)
            for r in range(repeats + 1):
                keys = [b"r%03d-%05d" % (r, i) for i in range(pages)]
                t0 = time.perf_counter()
                kv.put("g", keys, data)
                t1 = time.perf_counter()
                got = kv.get("g", keys)
                t2 = time.perf_counter()
                assert got.found.all() and np.array_equal(got.pages, data), "GPU pool returned other bytes"
                if r:
                    put_s.append(t1 - t0)
                    get_s.append(t2 - t1)
                kv.delete("g", keys)
        dev = cupy.asarray(data)
        host = np.empty_like(data)
        t_raw = cuda_time(cupy, lambda: (dev.get(out=host), dev.set(host)), repeats)
    finally:
        srv.stop()
    nbytes = pages * page_bytes
    return {"page_bytes": page_bytes, "pages": pages, "put_gbs": nbytes / float(np.median(put_s)) / 1e9,
            "get_gbs": nbytes / float(np.median(get_s)) / 1e9, "d2h_h2d_gbs": nbytes / t_raw / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("kvstore-out/bench"))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    import cupy

    report: dict[str, Any] = {"bench": "gpu_kernels", "device": cupy.cuda.runtime.getDeviceProperties(0)["name"]
                              .decode(), "python": platform.python_version(), "kernels": [], "data_channel": []}
    for page_bytes, pages in ((64 << 10, 1024), (1 * MiB, 256), (4 * MiB, 64)):
        report["kernels"].append(kernels(cupy, page_bytes, pages, args.repeats))
    report["data_channel"].append(data_channel(cupy, 4 * MiB, 16, min(args.repeats, 5)))
    lines = ["| page | pages | D2D copy GB/s | pack GB/s (x copy) | unpack GB/s (x copy) |", "|---|---|---|---|---|"]
    for k in report["kernels"]:
        lines.append(f"| {k['page_bytes'] // 1024} KiB | {k['pages']} | {k['copy_gbs']:.0f} | "
                     f"{k['pack_gbs']:.0f} ({k['pack_vs_copy']:.2f}x) | {k['unpack_gbs']:.0f} ({k['unpack_vs_copy']:.2f}x) |")
    lines += ["", "| GPU pool, data channel | put GB/s | get GB/s | raw D2H+H2D GB/s |", "|---|---|---|---|"]
    for d in report["data_channel"]:
        lines.append(f"| {d['pages']} x {d['page_bytes'] // MiB} MiB | {d['put_gbs']:.2f} | {d['get_gbs']:.2f} | "
                     f"{d['d2h_h2d_gbs']:.1f} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(report, indent=2))
    (args.out / "gpu_kernels.md").write_text(f"Device: {report['device']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
