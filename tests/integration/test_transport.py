"""The peer transports (``kvstore.transport``): the same tests over every
backend (TCP, UCX) and event loop (uvloop, asyncio).

Two transports in one process on 127.0.0.1:0; the serving side is a real
``PagePool`` on numpy memory, answered by a ``serve`` callback built here the
way a node builds it (acquire, pack, RESULT header with checksums, release).
Every test body runs under ``asyncio.wait_for`` so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import pytest
import xxhash

from kvstore.loops import loop_factory
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.pool.pool import PagePool
from kvstore.transport.auto import make_transport, resolve_transport
from kvstore.transport.base import Served, ServeFn, Transport, TransportError
from kvstore.transport.shaped import ShapedTransport
from kvstore.transport.shaper import LinkShaper
from kvstore.transport.tcp import TcpTransport
from kvstore.transport.ucx import UcxTransport
from kvstore.transport.ucx_progress import configure_ucx_env, ucx_context_created
from kvstore.v1 import kvstore_pb2 as pb

# UCX reads its environment once per process (at import and when ucxx creates
# its context): keep these tests on loopback, with the daemon's defaults.
if not ucx_context_created():
    configure_ucx_env(os.environ, loopback=True)

try:
    import ucxx  # noqa: F401

    HAVE_UCXX = True
except ImportError:
    HAVE_UCXX = False

KiB, MiB = 1 << 10, 1 << 20
T = TypeVar("T")

BACKENDS = [pytest.param("tcp", id="tcp"),
            pytest.param("ucx", id="ucx", marks=pytest.mark.skipif(not HAVE_UCXX, reason="ucxx not installed")),
            pytest.param("shaped-tcp", id="shaped-tcp")]  # the contract holds through the link shaper too
LOOPS = ["uvloop", "asyncio"]


def new_transport(backend: str) -> Transport:
    """A fresh transport of ``backend``; ``shaped-tcp`` is TCP behind a 4 GB/s, 50 us link shaper."""
    if backend == "shaped-tcp":
        return ShapedTransport(TcpTransport(), LinkShaper(4e9, 50e-6))
    return make_transport(backend)


@pytest.fixture(params=LOOPS)
def loop_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def run(loop_name: str, body: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """Run ``body()`` on a fresh event loop of the given kind, with a deadline."""

    async def main() -> T:
        return await asyncio.wait_for(body(), timeout)

    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        return runner.run(main())


# ---- the serving side --------------------------------------------------------
class Store:
    """A numpy page pool holding ``n`` random pages under known keys."""

    def __init__(self, n: int, page_bytes: int, seed: int = 0) -> None:
        self.pool = PagePool(NumpyPageOps(), n, page_bytes)
        self.page_bytes = page_bytes
        self.keys = [b"page-%06d" % i for i in range(n)]
        self.pages = np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)
        res = self.pool.reserve(n)
        self.pool.buffer[res.slots] = self.pages  # a raw fill: this pool has no node around it
        assert self.pool.commit(res, self.keys) == n
        self.served = 0

    def serve(self, request: pb.DataHeader) -> Served:
        assert request.op == pb.DataHeader.GET and request.local_only
        pool, ops = self.pool, self.pool.ops
        handle = pool.acquire(list(request.keys))
        slots = handle.slots
        payload = ops.pack(pool.buffer, slots) if slots else None
        header = pb.DataHeader(
            op=pb.DataHeader.RESULT, namespace=request.namespace, page_bytes=self.page_bytes,
            found=handle.found, checksums=[xxhash.xxh3_64_intdigest(pool.buffer[s]) for s in slots])
        self.served += 1
        return Served(header, payload, lambda: pool.release(handle))

    def index(self, key: bytes) -> int:
        return self.keys.index(key)

    def readers(self) -> int:
        return sum(e.readers for e in self.pool._table.values())

    def check_released(self) -> None:
        self.pool.check_invariants()
        assert self.readers() == 0, "a served pull never released its read hold"


def request_for(keys: list[bytes]) -> pb.DataHeader:
    return pb.DataHeader(op=pb.DataHeader.GET, namespace="ns", keys=keys, local_only=True)


def alloc(n: int, page_bytes: int, reply: pb.DataHeader | None = None) -> np.ndarray:
    return np.empty((n, page_bytes), dtype=np.uint8)


def check_reply(store: Store, keys: list[bytes], reply: pb.DataHeader, payload: Any) -> None:
    """The reply to a pull of ``keys`` is exactly what the store holds."""
    assert reply.op == pb.DataHeader.RESULT
    assert reply.page_bytes == store.page_bytes
    found = [k in store.keys for k in keys]
    assert list(reply.found) == found
    hits = [store.index(k) for k in keys if k in store.keys]
    assert list(reply.checksums) == [xxhash.xxh3_64_intdigest(store.pages[i]) for i in hits]
    if not hits:
        assert payload is None
        return
    assert payload.shape == (len(hits), store.page_bytes)
    assert np.array_equal(payload, store.pages[hits])


@asynccontextmanager
async def pair(backend: str, store: Store,
               serve: ServeFn | None = None) -> AsyncIterator[tuple[Transport, Transport, pb.TransportEndpoint]]:
    """A started server transport over ``store`` and a client transport;
    both closed afterwards, and every served read hold released."""
    server, client = new_transport(backend), new_transport(backend)
    try:
        endpoint = await server.start("127.0.0.1", 0, serve or store.serve)
        yield server, client, endpoint
    finally:
        await client.close()
        await server.close()
    assert client.connections() == 0
    store.check_released()


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ---- tests ---------------------------------------------------------------------
def test_pull_pages_gives_bytes_and_header(backend: str, loop_name: str) -> None:
    store = Store(16, 64 * KiB)

    async def body() -> None:
        async with pair(backend, store) as (server, client, endpoint):
            assert endpoint.kind == backend.removeprefix("shaped-") and endpoint.host == "127.0.0.1" and endpoint.port > 0
            assert await server.start("127.0.0.1", 0, store.serve) == endpoint  # second call: same
            assert client.connections() == 0
            for keys in (store.keys, store.keys[3:7], store.keys[::-1][:5]):
                reply, payload = await client.fetch(endpoint, request_for(keys), alloc)
                check_reply(store, keys, reply, payload)
                assert client.connections() == 1  # one connection, reused
            assert store.served == 3
            await eventually(lambda: store.readers() == 0)  # the server's send may finish just after

    run(loop_name, body)


def test_none_found_gives_no_payload(backend: str, loop_name: str) -> None:
    store = Store(4, 4 * KiB)
    missing = [b"absent-1", b"absent-2", b"absent-3"]

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            reply, payload = await client.fetch(endpoint, request_for(missing), alloc)
            assert payload is None
            assert list(reply.found) == [False] * 3 and not reply.checksums
            check_reply(store, missing, reply, payload)
            # The connection stays in step: the next pull on it works.
            reply, payload = await client.fetch(endpoint, request_for(store.keys[:2]), alloc)
            check_reply(store, store.keys[:2], reply, payload)
            assert client.connections() == 1

    run(loop_name, body)


def test_mixed_found_and_missing(backend: str, loop_name: str) -> None:
    store = Store(8, 16 * KiB)
    keys = [store.keys[5], b"nope-1", store.keys[0], b"nope-2", b"nope-3", store.keys[7], store.keys[5]]

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            reply, payload = await client.fetch(endpoint, request_for(keys), alloc)
            assert list(reply.found) == [True, False, True, False, False, True, True]
            check_reply(store, keys, reply, payload)

    run(loop_name, body)


def test_64_mib_payload(backend: str, loop_name: str) -> None:
    store = Store(64, MiB, seed=1)

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            reply, payload = await client.fetch(endpoint, request_for(store.keys), alloc)
            assert payload.nbytes == 64 * MiB
            check_reply(store, store.keys, reply, payload)

    run(loop_name, body)


def test_eight_concurrent_fetches_to_one_peer(backend: str, loop_name: str) -> None:
    store = Store(32, 256 * KiB, seed=2)
    batches = [store.keys[i::8] + [b"missing-%d" % i] for i in range(8)]

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            for _ in range(2):  # the second round reuses pooled connections
                results = await asyncio.gather(
                    *(client.fetch(endpoint, request_for(keys), alloc) for keys in batches))
                for keys, (reply, payload) in zip(batches, results):
                    check_reply(store, keys, reply, payload)
                assert 1 <= client.connections() <= 8
            await eventually(lambda: store.readers() == 0)  # the server's send may finish just after

    run(loop_name, body)


def test_server_closed_mid_transfer_raises(backend: str, loop_name: str) -> None:
    """The server transport closes while it sends a 32 MiB payload: the pull
    fails with TransportError (no hang) and the read hold is released."""
    store = Store(32, MiB, seed=3)
    holder: list[Transport] = []

    def serve_then_close(request: pb.DataHeader) -> Served:
        served = store.serve(request)
        asyncio.get_running_loop().create_task(holder[0].close())
        return served

    async def body() -> None:
        async with pair(backend, store, serve_then_close) as (server, client, endpoint):
            holder.append(server)
            with pytest.raises(TransportError):
                await client.fetch(endpoint, request_for(store.keys), alloc)
            assert client.connections() == 0  # the broken connection was dropped
            await eventually(lambda: store.readers() == 0)

    run(loop_name, body)


def test_server_closed_between_fetches_raises(backend: str, loop_name: str) -> None:
    """A cached connection to a server that has since closed, and a fresh
    connection to a closed port: both fail with TransportError, no hang."""
    store = Store(4, 4 * KiB)

    async def body() -> None:
        async with pair(backend, store) as (server, client, endpoint):
            reply, payload = await client.fetch(endpoint, request_for(store.keys), alloc)
            check_reply(store, store.keys, reply, payload)
            await server.close()
            for _ in range(2):
                with pytest.raises(TransportError):
                    await client.fetch(endpoint, request_for(store.keys), alloc)
            assert client.connections() == 0

    run(loop_name, body)


def _slow_holder(q: Any, backend: str, loop_name: str) -> None:
    """A holder process whose serve blocks (a wedged node), to be killed."""
    store = Store(2, 4 * KiB)

    def slow_serve(request: pb.DataHeader) -> Served:
        q.put("serving")
        time.sleep(60)
        return store.serve(request)

    async def main() -> None:
        transport = new_transport(backend)
        endpoint = await transport.start("127.0.0.1", 0, slow_serve)
        q.put(endpoint.port)
        await asyncio.Event().wait()

    run(loop_name, main, timeout=120)


def test_holder_process_killed_mid_pull_raises(backend: str, loop_name: str) -> None:
    """The peer process dies (SIGKILL) while a pull waits on it: the pull
    fails with TransportError within seconds, it does not hang."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_slow_holder, args=(q, backend, loop_name), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)

        async def body() -> float:
            client = new_transport(backend)
            endpoint = pb.TransportEndpoint(kind=backend, host="127.0.0.1", port=port)
            try:
                pull = asyncio.ensure_future(client.fetch(endpoint, request_for([b"page-000000"]), alloc))
                assert await asyncio.get_running_loop().run_in_executor(None, q.get, True, 30) == "serving"
                proc.kill()
                start = time.monotonic()
                with pytest.raises(TransportError):
                    await pull
                assert client.connections() == 0
                return time.monotonic() - start
            finally:
                await client.close()

        elapsed = run(loop_name, body)
        assert elapsed < 10.0
    finally:
        proc.kill()
        proc.join(10)


def _paced_holder(q: Any, commands: Any, backend: str, loop_name: str) -> None:
    """A slow holder process, so a 64 MiB payload arrives piece by piece:
    its event loop stalls 2 ms per iteration (it sends only between stalls),
    and under UCX it may use only UCX's TCP transport (shared memory would
    move the whole payload in one copy; within one process it even lands in
    a single worker progress, before any cancel could). Answers "readers"
    on ``commands`` with its pool's read holds."""
    os.environ["UCX_TLS"] = "tcp,self"  # read when this process's ucxx context is made
    store = Store(64, MiB, seed=4)

    async def stall() -> None:
        while True:
            time.sleep(0.002)  # a busy holder: its loop (and UCX progress) runs in between
            await asyncio.sleep(0)

    async def main() -> None:
        stalling = asyncio.ensure_future(stall())  # noqa: F841  (runs until the process is killed)
        transport = new_transport(backend)
        endpoint = await transport.start("127.0.0.1", 0, store.serve)
        q.put(endpoint.port)
        loop = asyncio.get_running_loop()
        while True:
            if await loop.run_in_executor(None, commands.get) == "readers":
                q.put(store.readers())

    run(loop_name, main, timeout=120)


def test_cancelled_fetch_drops_its_connection(backend: str, loop_name: str) -> None:
    """A pull cancelled while its payload is on the wire (a deadline)
    closes its connection. Once the cancelled fetch has raised, nothing
    writes into the buffer ``alloc`` gave any more; the connection count
    does not grow, the holder releases its read hold, and the next pull
    works."""
    ctx = multiprocessing.get_context("spawn")
    q, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_paced_holder, args=(q, commands, backend, loop_name), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        ref = Store(64, MiB, seed=4)  # the holder's pages

        async def body() -> None:
            loop = asyncio.get_running_loop()
            client = new_transport(backend)
            endpoint = pb.TransportEndpoint(kind=backend, host="127.0.0.1", port=port)
            try:
                reply, payload = await client.fetch(endpoint, request_for(ref.keys[:1]), alloc)
                check_reply(ref, ref.keys[:1], reply, payload)
                assert client.connections() == 1
                mid_payload = 0  # cancels that landed while payload bytes were on the wire
                for _ in range(6):
                    started = asyncio.Event()
                    buffers: list[np.ndarray] = []

                    def signalling_alloc(n: int, page_bytes: int, reply: pb.DataHeader | None = None) -> np.ndarray:
                        buffers.append(np.zeros((n, page_bytes), dtype=np.uint8))
                        started.set()  # the reply header is in; the payload receive starts now
                        return buffers[-1]

                    pull = asyncio.ensure_future(client.fetch(endpoint, request_for(ref.keys), signalling_alloc))
                    await asyncio.wait_for(started.wait(), 10)
                    buf = buffers[0]
                    # cancel only once payload bytes are landing: the first page is in ...
                    deadline = loop.time() + 5
                    while not buf[0, -64:].any() and not pull.done():
                        assert loop.time() < deadline, "no payload byte arrived within 5 s"
                        await asyncio.sleep(0)
                    landing = not buf[-1, -64:].any()  # ... and the last is not (else UCX moved it in one step)
                    pull.cancel()
                    try:
                        await pull
                    except asyncio.CancelledError:
                        pass
                    else:  # it had already ended: no cancel happened
                        assert not landing, "a pull cancelled mid-payload returned normally"
                        continue
                    settled = buf.copy()
                    await asyncio.sleep(0.05)  # the loop (and UCX's progress) runs meanwhile
                    assert np.array_equal(settled, buf), "the transport wrote into the buffer after fetch raised"
                    assert client.connections() == 0, "the cancelled pull's connection was kept"
                    mid_payload += landing
                    if mid_payload == 2:
                        break
                assert mid_payload == 2, f"only {mid_payload} of 6 cancels landed while the payload was on the wire"
                reply, payload = await client.fetch(endpoint, request_for(ref.keys), alloc)
                check_reply(ref, ref.keys, reply, payload)
                assert client.connections() == 1
                deadline = loop.time() + 5
                while True:  # the holder saw the aborts and released every read hold
                    commands.put("readers")
                    readers = await loop.run_in_executor(None, q.get, True, 10)
                    if readers == 0:
                        break
                    assert loop.time() < deadline, f"the holder still has {readers} read holds"
                    await asyncio.sleep(0.05)
            finally:
                await client.close()
            assert client.connections() == 0

        run(loop_name, body)
    finally:
        proc.kill()
        proc.join(10)


def test_bad_reply_raises_and_drops_connection(backend: str, loop_name: str) -> None:
    """A reply whose header disagrees with its payload is a bad frame."""
    store = Store(4, 4 * KiB)

    def lying_serve(request: pb.DataHeader) -> Served:
        served = store.serve(request)
        served.header.found.append(True)  # claims one page more than it sends
        return served

    async def body() -> None:
        async with pair(backend, store, lying_serve) as (_, client, endpoint):
            with pytest.raises(TransportError):
                await client.fetch(endpoint, request_for(store.keys[:2]), alloc)
            assert client.connections() == 0

    run(loop_name, body)


def test_alloc_error_is_the_callers(backend: str, loop_name: str) -> None:
    """An exception from ``alloc`` propagates as is; the connection is dropped."""
    store = Store(4, 4 * KiB)

    def failing_alloc(n: int, page_bytes: int, reply: pb.DataHeader | None = None) -> np.ndarray:
        raise MemoryError("no staging")

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            with pytest.raises(MemoryError):
                await client.fetch(endpoint, request_for(store.keys), failing_alloc)
            assert client.connections() == 0
            reply, payload = await client.fetch(endpoint, request_for(store.keys), alloc)
            check_reply(store, store.keys, reply, payload)

    run(loop_name, body)


def test_forget_drops_cached_connections(backend: str, loop_name: str) -> None:
    store = Store(4, 4 * KiB)

    async def body() -> None:
        async with pair(backend, store) as (_, client, endpoint):
            await asyncio.gather(*(client.fetch(endpoint, request_for(store.keys), alloc) for _ in range(3)))
            assert client.connections() >= 1
            client.forget(pb.TransportEndpoint(kind=backend, host="127.0.0.1", port=1))  # unknown: no-op
            assert client.connections() >= 1
            client.forget(endpoint)
            assert client.connections() == 0
            reply, payload = await client.fetch(endpoint, request_for(store.keys), alloc)
            check_reply(store, store.keys, reply, payload)
            assert client.connections() == 1

    run(loop_name, body)


def test_close_twice_is_fine(backend: str, loop_name: str) -> None:
    store = Store(4, 4 * KiB)

    async def body() -> None:
        async with pair(backend, store) as (server, client, endpoint):
            await client.fetch(endpoint, request_for(store.keys), alloc)
            await client.close()
            await client.close()
            await server.close()
            await server.close()
            assert client.connections() == 0
            never_started = new_transport(backend)
            await never_started.close()
            await never_started.close()

    run(loop_name, body)


# ---- choosing a backend ----------------------------------------------------------
def test_auto_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_transport("tcp") == "tcp"
    assert isinstance(make_transport("tcp"), TcpTransport)
    with pytest.raises(ValueError):
        resolve_transport("rdma")
    assert TcpTransport.device_buffers is False
    if HAVE_UCXX:  # ucxx-cu12 is a dependency on Linux: the usual case
        assert resolve_transport("auto") == "ucx"
        assert resolve_transport("ucx") == "ucx"
        transport = make_transport("auto")
        assert isinstance(transport, UcxTransport)
        assert transport.name == "ucx" and transport.device_buffers is True
    else:
        assert resolve_transport("auto") == "tcp"

    monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` now fails
    assert resolve_transport("auto") == "tcp"
    assert isinstance(make_transport("auto"), TcpTransport)
    with pytest.raises(RuntimeError, match="ucxx"):
        resolve_transport("ucx")


def test_configure_ucx_env_only_fills_unset() -> None:
    env = {"UCX_MM_ERROR_HANDLING": "n"}
    applied = configure_ucx_env(env)
    assert env["UCX_MM_ERROR_HANDLING"] == "n"  # the operator's choice stands
    assert applied == {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    assert "UCX_NET_DEVICES" not in env  # a daemon is not pinned to loopback
    assert configure_ucx_env(env) == {}
    assert configure_ucx_env(env, loopback=True) == {"UCX_NET_DEVICES": "lo"}
