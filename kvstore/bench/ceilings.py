"""The ceilings the benchmarks set kvstore against: raw TCP between processes.

Blocking sockets between two processes on 127.0.0.1, with nothing of kvstore
in the way: one stream (:func:`raw_tcp_gbps`) and several side by side
(:func:`raw_streams`). ``kvctl bench micro`` and ``kvctl bench replication``
report their rows as ratios to these, measured in the same run.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import numpy as np


def tcp_receiver(port_q: "mp.Queue[int]", total: int, chunk: int, spread: bool = False) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    # spread: every chunk lands in its own memory (a populated array of the
    # whole transfer), as a store's slots do; else one reused chunk buffer
    buf = np.ones(total if spread else chunk, dtype=np.uint8)
    view = memoryview(buf)
    done = 0
    while done < total:
        at = done if spread else done % chunk
        n = conn.recv_into(view[at: at + min(chunk - done % chunk, total - done)])
        if n == 0:
            break
        done += n
    conn.sendall(b"k")
    conn.close()
    srv.close()


def raw_tcp_gbps(total: int = 512 << 20, chunk: int = 4 << 20, repeat: int = 3, spread: bool = False) -> float:
    """Blocking sockets between two processes: best of ``repeat``. Default:
    the same 4 MiB chunk sent again and again into one reused buffer (both
    cache-hot: the ceiling of any loopback transfer). ``spread``: each chunk
    sent from and received into its own memory, across ``total`` bytes on
    both sides (what a store moving distinct pages into distinct slots can
    reach at best)."""
    ctx = mp.get_context("spawn")
    best = 0.0
    source = np.random.randint(0, 255, total if spread else chunk, dtype=np.uint8)
    for _ in range(repeat):
        q: "mp.Queue[int]" = ctx.Queue()
        proc = ctx.Process(target=tcp_receiver, args=(q, total, chunk, spread))
        proc.start()
        sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        start = time.perf_counter()
        for i in range(total // chunk):
            at = i * chunk if spread else 0
            sock.sendall(memoryview(source[at:at + chunk]))
        sock.recv(1)
        best = max(best, total / (time.perf_counter() - start) / 1e9)
        sock.close()
        proc.join(10)
    return best


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
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(streams), ctx.Queue()
    receivers, senders = [], []
    for _ in range(streams):
        q = ctx.Queue()
        recv = ctx.Process(target=tcp_receiver, args=(q, total, chunk))
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
