"""Several clients at once (``bench/micro.py --clients N``): N processes,
each with its own ``KvClient`` on the node's socket data channel (or shared
memory) and its own namespace, start together (a barrier) and put, then
get, the same bytes each; the aggregate GB/s is all their bytes over the
wall time from the common start to the last one done. Beside it, N
concurrent raw blocking TCP streams between N sender and N receiver
processes, timed the same way: what the loopback carries with N streams at
once on this machine."""

from __future__ import annotations

import multiprocessing as mp
import socket
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
        kv.create_namespace(ns, page_bytes, capacity=(count + batch) * page_bytes)
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


def kv_clients(address: str, path: str, clients: int, page_bytes: int, count: int, batch: int) -> dict[str, float]:
    """Aggregate put and get GB/s of ``clients`` processes at once."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(address, path, f"conc-{i}", page_bytes, count, batch, barrier,
                                               results)) for i in range(clients)]
    for proc in procs:
        proc.start()
    try:
        times = [results.get(timeout=300) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
    total = clients * count * page_bytes
    put_s = max(t[1] for t in times) - min(t[0] for t in times)
    get_s = max(t[3] for t in times) - min(t[2] for t in times)
    return {"put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9}


def _sender(port: int, total: int, chunk: int, barrier: Any, results: Any) -> None:
    payload = memoryview(np.random.randint(0, 255, chunk, dtype=np.uint8))
    sock = socket.create_connection(("127.0.0.1", port))
    barrier.wait()
    start = time.perf_counter()
    for _ in range(total // chunk):
        sock.sendall(payload)
    sock.recv(1)
    results.put((start, time.perf_counter()))
    sock.close()


def raw_streams(streams: int, total: int = 256 << 20, chunk: int = 4 << 20) -> float:
    """Aggregate GB/s of ``streams`` concurrent raw TCP streams (blocking sockets)."""
    from bench.micro import _tcp_receiver  # the receiver of micro's own raw TCP baseline

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(streams), ctx.Queue()
    receivers, senders = [], []
    for _ in range(streams):
        q = ctx.Queue()
        recv = ctx.Process(target=_tcp_receiver, args=(q, total, chunk))
        recv.start()
        receivers.append(recv)
        send = ctx.Process(target=_sender, args=(q.get(timeout=30), total, chunk, barrier, results))
        send.start()
        senders.append(send)
    try:
        times = [results.get(timeout=300) for _ in senders]
    finally:
        for proc in senders + receivers:
            proc.join(30)
    return streams * total / (max(t[1] for t in times) - min(t[0] for t in times)) / 1e9
