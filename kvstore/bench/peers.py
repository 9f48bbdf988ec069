"""Other KV stores beside kvstore in ``kvctl bench micro`` (``--peers redis,mooncake``).

Each peer runs on 127.0.0.1 on free ports for the length of a ``with`` block
and is measured through its own Python client with the loop that measures
kvstore (:func:`measure`): the same page sizes, the same bytes per row, one
page or a batch per call, every page read back compared with what was
written (outside the timed calls).

* ``redis``: Debian's ``redis-server`` (no persistence) and redis-py. SET/GET
  per page; a batch is one MSET / MGET. hiredis parses the replies when it
  is installed (redis-py's fastest GET); redis-py's own packer sends the
  values, because it passes large values to the socket without a copy and
  hiredis's packer copies them (measured slower PUT).
* ``mooncake``: Mooncake Store from ``mooncake-transfer-engine-non-cuda``:
  ``mooncake_master`` (with its HTTP metadata server) and one storage
  process, ``mooncake_client``, that mounts the memory segment; the
  benchmark's ``MooncakeDistributedStore`` mounts none, so every byte crosses
  Mooncake's TCP transfer engine to that process. ``put_from`` /
  ``get_into`` (``batch_*`` for batches) from registered buffers: its
  zero-copy path, like kvstore's ``get(out=...)``.

A peer that is not installed, or does not start, raises
:class:`PeerUnavailable`; :func:`started` prints ``peer X skipped: <why>``
for it and goes on with the others.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

PEERS = ("redis", "mooncake")
INSTALL = "pip install -e '.[bench]'"


class PeerUnavailable(Exception):
    """A peer is not installed here or did not start; the message says why."""


class Target(Protocol):
    """What :func:`measure` drives: one store through one client."""

    def prepare(self, pages: np.ndarray, out: np.ndarray) -> None: ...
    def put(self, keys: list[bytes], block: np.ndarray) -> None: ...
    def get(self, keys: list[bytes], out: np.ndarray) -> Sequence[Any] | None: ...
    def clear(self) -> None: ...


def page_count(page_bytes: int, total: int, batch: int) -> int:
    """Pages moved per (store, page size, batch, op): the same for every store."""
    return max(batch, max(8, total // page_bytes) // batch * batch)


def measure(target: Target, page_bytes: int, total: int, bar: Any, batch: int = 1) -> dict[str, float]:
    """Put then get ``total`` bytes through ``target``, ``batch`` pages per call;
    checks every page read back. Returns GB/s and per-call latencies."""
    count = page_count(page_bytes, total, batch)
    pages = np.random.randint(0, 255, (count, page_bytes), dtype=np.uint8)
    keys = [i.to_bytes(8, "little") for i in range(count)]
    out = np.empty((batch, page_bytes), dtype=np.uint8)
    target.prepare(pages, out)
    try:
        warm = [b"warm%04d" % i for i in range(batch)]
        target.put(warm, pages[:batch])
        target.get(warm, out)
        put_lat, get_lat = [], []
        for i in range(0, count, batch):
            start = time.perf_counter()
            target.put(keys[i:i + batch], pages[i:i + batch])
            put_lat.append(time.perf_counter() - start)
            bar.update(page_bytes * batch)
        for i in range(0, count, batch):
            start = time.perf_counter()
            got = target.get(keys[i:i + batch], out)
            get_lat.append(time.perf_counter() - start)
            views = out if got is None else got
            assert len(views) == batch, f"get returned {len(views)} pages, asked for {batch}"
            for j, view in enumerate(views):
                assert np.array_equal(np.frombuffer(view, np.uint8), pages[i + j]), "get returned wrong bytes"
            bar.update(page_bytes * batch)
    finally:
        target.clear()
    return {
        "batch": batch,
        "put_gbps": count * page_bytes / sum(put_lat) / 1e9,
        "get_gbps": count * page_bytes / sum(get_lat) / 1e9,
        "put_p50_ms": statistics.median(put_lat) * 1e3,
        "put_p99_ms": float(np.percentile(put_lat, 99)) * 1e3,
        "get_p50_ms": statistics.median(get_lat) * 1e3,
        "get_p99_ms": float(np.percentile(get_lat, 99)) * 1e3,
        "pages": count,
    }


# -- processes ---------------------------------------------------------------


def free_port() -> int:
    """A port the kernel hands out for port 0 on 127.0.0.1, released for the child."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Proc:
    """A child process whose output goes to a temporary file (never an unread pipe)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in stop(), after the child exits
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)

    def tail(self, limit: int = 600) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip()
        return " | ".join(text[-limit:].splitlines())

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout)
        self.log.close()


@contextlib.contextmanager
def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> Iterator[Proc]:
    proc = Proc(name, argv, env)
    try:
        yield proc
    finally:
        proc.stop()


def wait_ready(ready: Callable[[], bool], procs: Sequence[Proc], what: str, timeout: float) -> None:
    """Poll ``ready`` until it holds; a child that exits or ``timeout`` is a PeerUnavailable."""
    deadline = time.monotonic() + timeout
    while not ready():
        for proc in procs:
            if proc.proc.poll() is not None:
                raise PeerUnavailable(f"{proc.name} exited with code {proc.proc.returncode}: {proc.tail()}")
        if time.monotonic() > deadline:
            logs = "; ".join(f"{p.name}: {p.tail(300)}" for p in procs)
            raise PeerUnavailable(f"{what} not ready within {timeout:.0f} s ({logs})")
        time.sleep(0.02)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # not installed, or a shared library missing
        raise PeerUnavailable(f"Python module {name} not importable ({exc}); {INSTALL}") from None


# -- Redis -------------------------------------------------------------------


class RedisTarget:
    def __init__(self, client: Any, ports: list[int]) -> None:
        self.client, self.ports = client, ports  # ports: what the peer listens on

    def prepare(self, pages: np.ndarray, out: np.ndarray) -> None:
        pass

    def put(self, keys: list[bytes], block: np.ndarray) -> None:
        if len(keys) == 1:
            self.client.set(keys[0], memoryview(block[0]))
        else:
            self.client.mset({key: memoryview(row) for key, row in zip(keys, block)})

    def get(self, keys: list[bytes], out: np.ndarray) -> Sequence[Any]:
        return [self.client.get(keys[0])] if len(keys) == 1 else self.client.mget(keys)

    def clear(self) -> None:
        self.client.flushdb()


@contextlib.contextmanager
def redis_peer(timeout: float = 15.0) -> Iterator[RedisTarget]:
    """``redis-server`` on a free 127.0.0.1 port, no persistence; a redis-py client."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise PeerUnavailable("redis-server not found on PATH (Debian: apt-get install redis-server)")
    redis = _module("redis")
    conn_mod = importlib.import_module("redis.connection")

    class Connection(conn_mod.Connection):  # type: ignore[misc,name-defined]
        def _construct_command_packer(self, packer: Any) -> Any:  # large values go out without a copy
            return conn_mod.PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "yes", "--daemonize", "no"]
    with spawn("redis-server", argv) as proc:
        wait_ready(lambda: port_open(port), [proc], "redis-server", timeout)
        pool = redis.ConnectionPool(connection_class=Connection, host="127.0.0.1", port=port,
                                    socket_timeout=timeout)
        client = redis.Redis(connection_pool=pool)
        try:
            client.ping()
            yield RedisTarget(client, [port])
        finally:
            client.close()
            pool.disconnect()


# -- Mooncake Store ------------------------------------------------------------


class MooncakeTarget:
    def __init__(self, store: Any, ports: list[int]) -> None:
        self.store, self.ports = store, ports  # ports: what the peer's processes listen on
        self.registered: list[int] = []

    def prepare(self, pages: np.ndarray, out: np.ndarray) -> None:
        for buf in (pages, out):
            rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake register_buffer returned {rc}")
            self.registered.append(buf.ctypes.data)

    @staticmethod
    def _names(keys: list[bytes]) -> list[str]:
        return [key.hex() for key in keys]

    def put(self, keys: list[bytes], block: np.ndarray) -> None:
        size = block.shape[1]
        if len(keys) == 1:
            codes = [self.store.put_from(keys[0].hex(), block.ctypes.data, size)]
        else:
            base = block.ctypes.data
            codes = self.store.batch_put_from(self._names(keys), [base + j * size for j in range(len(keys))],
                                              [size] * len(keys))
        if any(codes):
            raise RuntimeError(f"mooncake put returned {codes}")

    def get(self, keys: list[bytes], out: np.ndarray) -> None:
        size = out.shape[1]
        if len(keys) == 1:
            got = [self.store.get_into(keys[0].hex(), out.ctypes.data, size)]
        else:
            got = self.store.batch_get_into(self._names(keys), [out.ctypes.data + j * size
                                                                for j in range(len(keys))], [size] * len(keys))
        if got != [size] * len(keys):
            raise RuntimeError(f"mooncake get returned {got}, expected {size} bytes per key")

    def clear(self) -> None:
        self.store.remove_all(True)
        for ptr in self.registered:
            self.store.unregister_buffer(ptr)
        self.registered.clear()


@contextlib.contextmanager
def _stderr_to_file() -> Iterator[list[str]]:
    """File descriptor 2 (C++ logs) to a temporary file; the text lands in the yielded list."""
    said: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            said.append(log.read().decode(errors="replace"))


def _mooncake_binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    for folder in ([] if spec is None or not spec.submodule_search_locations else
                   list(spec.submodule_search_locations)):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise PeerUnavailable(f"{name} not found (it ships in mooncake-transfer-engine-non-cuda; {INSTALL})")
    return found


@contextlib.contextmanager
def mooncake_peer(segment_bytes: int, buffer_bytes: int = 64 << 20, timeout: float = 30.0) -> Iterator[MooncakeTarget]:
    """``mooncake_master`` (HTTP metadata server inside) and one ``mooncake_client``
    storage process holding ``segment_bytes``, TCP protocol, all on 127.0.0.1."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the in-process client logs errors only
    store_mod = _module("mooncake.store")
    master_bin, client_bin = _mooncake_binary("mooncake_master"), _mooncake_binary("mooncake_client")
    rpc, meta, metrics, service = free_port(), free_port(), free_port(), free_port()
    metadata = f"http://127.0.0.1:{meta}/metadata"
    env = dict(os.environ, MC_LOG_LEVEL="WARNING")
    master_argv = [master_bin, f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", "-enable_http_metadata_server=true",
                   "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={meta}",
                   f"-metrics_port={metrics}", "-metrics_host=127.0.0.1", "-logtostderr"]
    client_argv = [client_bin, "-host=127.0.0.1", f"-port={service}", f"-master_server_address=127.0.0.1:{rpc}",
                   f"-metadata_server={metadata}", f"-global_segment_size={segment_bytes}", "-protocol=tcp",
                   "-logtostderr"]
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(spawn("mooncake_master", master_argv, env))
        wait_ready(lambda: port_open(rpc) and port_open(meta), [master], "mooncake_master", timeout)
        storage = stack.enter_context(spawn("mooncake_client", client_argv, env))
        # its service port opens after it has mounted its segment with the master
        wait_ready(lambda: port_open(service), [master, storage], "mooncake_client", timeout)
        store = store_mod.MooncakeDistributedStore()
        with _stderr_to_file() as said:  # setup logs a benign "metadata not found" as it registers
            rc = store.setup("127.0.0.1", metadata, 0, buffer_bytes, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            raise PeerUnavailable(f"MooncakeDistributedStore.setup returned {rc}: {said[0][-300:]}")
        stack.callback(store.close)
        yield MooncakeTarget(store, [rpc, meta, metrics, service])


# -- several at once -----------------------------------------------------------


def open_peer(name: str, capacity: int) -> contextlib.AbstractContextManager[Target]:
    """The context manager that runs peer ``name`` able to hold ``capacity`` bytes."""
    if name == "redis":
        return redis_peer()
    if name == "mooncake":
        return mooncake_peer(capacity)
    raise PeerUnavailable(f"unknown peer (known: {', '.join(PEERS)})")


@contextlib.contextmanager
def started(names: Sequence[str], capacity: int, say: Callable[[str], object] = print,
            skipped: dict[str, str] | None = None) -> Iterator[dict[str, Target]]:
    """Start every peer in ``names``; each one that cannot run is left out with one
    ``peer X skipped: <why>`` line (and its reason in ``skipped``). All stop on exit."""
    targets: dict[str, Target] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            try:
                targets[name] = stack.enter_context(open_peer(name, capacity))
            except PeerUnavailable as exc:
                say(f"peer {name} skipped: {exc}")
                if skipped is not None:
                    skipped[name] = str(exc)
        yield targets
