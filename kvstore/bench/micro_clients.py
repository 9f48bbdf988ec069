"""Several clients at once (``kvctl bench micro --clients N``): N processes,
each with its own ``KvClient`` on the node's socket data channel (or shared
memory) and its own namespace, start together (a barrier) and put, then
get, the same bytes each; the aggregate GB/s is all their bytes over the
wall time from the common start to the last one done. Beside it,
:func:`kvstore.bench.ceilings.raw_streams` times N raw TCP streams the same
way."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np


def _client(address: str, path: str, ns: str, page_bytes: int, count: int, batch: int,
            barrier: Any, results: Any) -> None:
    from kvstore_client import KvClient

    pages = np.random.randint(0, 255, (count, page_bytes), dtype=np.uint8)
    out = np.empty((batch, page_bytes), dtype=np.uint8)
    keys = [b"%s-%d" % (ns.encode(), i) for i in range(count)]
    with KvClient(address, data_path=path) as kv:
        kv.create_namespace(ns, page_bytes, capacity=clients_capacity(1, page_bytes, count, batch))
        kv.put(ns, [b"warm"], pages[:1])
        kv.get(ns, [b"warm"], out=out[:1])
        barrier.wait()
        start = time.perf_counter()
        for i in range(0, count, batch):
            kv.put(ns, keys[i:i + batch], pages[i:i + batch])
        put_done = time.perf_counter()
        barrier.wait()
        get_start = time.perf_counter()
        for i in range(0, count, batch):
            got = kv.get(ns, keys[i:i + batch], out=out)
            if not got.found.all():
                raise RuntimeError("a page put by this client was not found")
        get_done = time.perf_counter()
        if not np.array_equal(out[:batch], pages[count - batch:count]):
            raise RuntimeError("get returned wrong bytes")
        kv.delete_namespace(ns)
    results.put((start, put_done, get_start, get_done))


def _result(results: Any, procs: list[Any], timeout: float = 300.0) -> tuple[float, ...]:
    """The next client's times; a client that died instead ends the measurement at once."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)  # type: ignore[no-any-return]
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a benchmark client failed (exit codes {dead}); its error is above")
    raise TimeoutError(f"clients gave no result in {timeout:.0f} s")


def clients_capacity(clients: int, page_bytes: int, count: int, batch: int) -> int:
    """Bytes the namespaces of :func:`kv_clients` reserve together."""
    return clients * (count + batch) * page_bytes


def kv_clients(address: str, path: str, clients: int, page_bytes: int, count: int, batch: int) -> dict[str, float]:
    """Aggregate put and get GB/s of ``clients`` processes at once."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(address, path, f"conc-{i}", page_bytes, count, batch, barrier,
                                               results)) for i in range(clients)]
    for proc in procs:
        proc.start()
    try:
        times = [_result(results, procs) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
    total = clients * count * page_bytes
    put_s = max(t[1] for t in times) - min(t[0] for t in times)
    get_s = max(t[3] for t in times) - min(t[2] for t in times)
    return {"put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9}
