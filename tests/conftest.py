"""Shared fixtures: real in-process nodes on 127.0.0.1:0, real kvstored
processes, and the implementation matrix (event loop x pool memory x data
path) that the same tests run over."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import NodeConfig
from kvstore.launch import NodeProcess
from kvstore.loops import loop_factory
from kvstore.ops.base import PageOps
from kvstore.ops.auto import select as select_ops
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.ops.staged import StagedNumpyPageOps
from kvstore.server.app import NodeServer

TESTS_DIR = Path(__file__).resolve().parent  # the shared helpers, data/ and engines/
REPO_ROOT = TESTS_DIR.parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is marked ``integration`` (it starts
    real processes, servers or sockets), so ``-m "not integration"`` runs the
    unit tests alone; before ``-m`` selects, hence ``tryfirst``.

    Tests marked ``slow`` (the 10,000-case fuzz, rejoin after long
    downtimes) run only when asked for: ``make test-slow`` (``-m slow``)."""
    integration = TESTS_DIR / "integration"
    for item in items:
        if item.path.is_relative_to(integration):
            item.add_marker(pytest.mark.integration)
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with make test-slow (pytest -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def drain_steps(steps: Any) -> tuple[Any, int]:
    """Run a generator of steps (``kvstore.loops.slices``) to its end: (its result, how often it yielded)."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, yields
        yields += 1


def wait_until(cond: Callable[[], bool], timeout: float, what: str,
               state: Callable[[], Any] | None = None) -> float:
    """Poll ``cond`` until it holds, for at most ``timeout`` seconds; returns
    the seconds it took. Fails with ``what`` and, if given, the last ``state()``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            detail = f"; last state: {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        time.sleep(0.01)
    return time.monotonic() - start


def require_gpu():  # type: ignore[no-untyped-def]
    """CuPy with a usable CUDA device, or skip the calling test module cleanly; with
    ``KVSTORE_REQUIRE_GPU=1`` (scripts/gpu-check) fail instead, so a GPU run never passes by skipping."""
    def missing(why: str) -> None:
        if os.environ.get("KVSTORE_REQUIRE_GPU") == "1":
            pytest.fail(f"KVSTORE_REQUIRE_GPU=1 but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)

    try:
        import cupy
    except ImportError as exc:
        missing(f"CuPy does not import ({exc})")
    try:
        usable = bool(cupy.is_available())
    except Exception:  # CUDA libraries present but unusable
        usable = False
    if not usable:
        missing("CuPy is installed but no CUDA device is available")
    return cupy


# numpy memory driven like a device pool: every byte goes through staging
# copies and the pack/unpack kernels, as on a GPU (the daemon's --device cpu-staged).
StagedNumpyOps = StagedNumpyPageOps


OPS = {"numpy": NumpyPageOps, "staged": StagedNumpyOps, "cupy": lambda: select_ops("cupy", "cuda:0")}


class ServerThread:
    """A NodeServer on its own event loop in a background thread."""

    def __init__(self, config: NodeConfig, ops: PageOps | None = None, loop: str = "auto") -> None:
        self.server = NodeServer(config, ops)
        self._loop_name = loop
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.client_auth: dict[str, Any] = {}  # what a client of this node passes (TLS, a token)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=loop_factory(self._loop_name)) as runner:
            try:
                runner.run(self._main())
            except BaseException as exc:  # surfaced by start()
                self._error = exc
                self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(grace=1.0)

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        """Run ``fn()`` on the server's loop thread and return its result."""
        assert self.loop is not None

        async def run():  # type: ignore[no-untyped-def]
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
        assert not self._thread.is_alive(), "server thread did not stop"

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def node(self):  # type: ignore[no-untyped-def]
        return self.server.node


BASE_CONFIG = NodeConfig(listen="127.0.0.1:0", capacity=64 << 20, device="cpu", prefault=False, grace=1.0)


@pytest.fixture
def make_server() -> Iterator:  # type: ignore[type-arg]
    started: list[ServerThread] = []

    def make(ops: str = "numpy", loop: str = "auto", **overrides) -> ServerThread:  # type: ignore[no-untyped-def]
        srv = ServerThread(BASE_CONFIG.replace(**overrides), OPS[ops](), loop).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def check_pools_sound(srv: ServerThread, settle: float = 2.0) -> None:
    """No leaked slot, read hold or pin once every client is done.

    A server may still be retiring its last send for a moment after the
    client has every byte (a UCX send completes on the next progress), so
    the check is retried for ``settle`` seconds: a leak never clears."""

    def check() -> None:
        for ns in srv.node.namespaces.values():
            ns.pool.check_invariants()
            assert all(e.readers == 0 for e in ns.pool._table.values()), "a read hold leaked"
            assert ns.pool.used_slots == len(ns.pool), "a reserved slot leaked"

    deadline = time.monotonic() + settle
    while True:
        try:
            srv.call(check)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@dataclass(frozen=True)
class Secured:
    """What a secured node is started with (TLS, a token file, a cluster
    secret) and what its client passes: made once per session, at test time."""

    node: dict[str, Any]
    client: dict[str, Any]


@pytest.fixture(scope="session")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Secured:
    from tests.tls_certs import make_certs

    folder = tmp_path_factory.mktemp("secured")
    certs = make_certs(folder / "tls")
    token = "tok-" + os.urandom(12).hex()
    (folder / "tokens.toml").write_text(f'[[token]]\ntoken = "{token}"\ntenant = "t1"\nrole = "admin"\n')
    (folder / "cluster.secret").write_text(os.urandom(32).hex())
    return Secured(node=dict(certs.node_settings(), token_file=str(folder / "tokens.toml"),
                             cluster_secret_file=str(folder / "cluster.secret")),
                   client=dict(tls_ca=certs.ca, token=token))


@pytest.fixture(params=[("numpy", "auto", "tcp", False), ("numpy", "asyncio", "grpc", False),
                        ("staged", "asyncio", "tcp", False), ("staged", "auto", "grpc", False),
                        ("numpy", "auto", "shm", False), ("numpy", "asyncio", "shm", False),
                        ("numpy", "auto", "tcp", True), ("staged", "asyncio", "grpc", True),
                        ("numpy", "auto", "shm", True)],
                ids=["host-uvloop-tcp", "host-asyncio-grpc", "staged-asyncio-tcp", "staged-uvloop-grpc",
                     "host-uvloop-shm", "host-asyncio-shm",
                     "tls-tokens-host-uvloop-tcp", "tls-tokens-staged-asyncio-grpc", "tls-tokens-host-uvloop-shm"])
def node(request, make_server) -> Iterator[tuple[ServerThread, str]]:  # type: ignore[no-untyped-def]
    """A node over each pool memory x event loop, with the client data path
    to use, plaintext and secured (TLS, tokens, cluster secret: its
    ``client_auth`` holds what a client passes); checks after the test that
    nothing leaked."""
    ops, loop, path, secure = request.param
    overrides = request.getfixturevalue("secured").node if secure else {}
    srv = make_server(ops=ops, loop=loop, **overrides)
    srv.client_auth = request.getfixturevalue("secured").client if secure else {}
    yield srv, path
    check_pools_sound(srv)


@pytest.fixture(params=["numpy", "staged"], ids=["host-pool", "staged-pool"])
def pool_ops(request) -> str:  # type: ignore[no-untyped-def]
    """Each pool memory the cluster tests run over: host pages, and host pages
    driven like a GPU pool (``--device cpu-staged``: packed serving, staging,
    the upload finisher), so CI runs the GPU node's movement code."""
    return request.param


DEVICE_FLAG = {"numpy": "cpu", "staged": "cpu-staged"}


def random_pages(n: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def keys_for(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "little") for i in range(n)]


class Daemon(NodeProcess):
    """A real ``kvstored`` process on 127.0.0.1:0 with test defaults."""

    def __init__(self, *args: str) -> None:
        super().__init__(["--capacity", "64MiB", *args], capture_stderr=True)

    def stop(self) -> None:
        self.kill()


@pytest.fixture
def daemon() -> Iterator:  # type: ignore[type-arg]
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        d = Daemon(*args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
