"""kvstore.bench.peers, the micro benchmark's other stores: a real Redis and a real
Mooncake Store started on free 127.0.0.1 ports, a few pages put and read back
through the measurement loop, every process gone afterwards; a peer that is
not installed is one ``peer X skipped: <why>`` line, never an exception."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import numpy as np
import pytest


from kvstore.bench import peers
from kvstore.bench.micro import render_peers

PAGE = 64 << 10


class Bar:
    def __init__(self) -> None:
        self.bytes = 0

    def update(self, n: int) -> None:
        self.bytes += n


def round_trip(target: peers.Target) -> None:
    """The measurement loop over 8 pages, one per call and 4 per call, then a
    direct put/get of 3 pages compared byte for byte."""
    for batch in (1, 4):
        bar = Bar()
        row = peers.measure(target, PAGE, 8 * PAGE, bar, batch)
        assert row["pages"] == 8 and row["batch"] == batch
        assert row["put_gbps"] > 0 and row["get_gbps"] > 0
        assert bar.bytes == 2 * 8 * PAGE
    pages = np.random.randint(0, 255, (3, PAGE), dtype=np.uint8)
    out = np.empty_like(pages)
    keys = [b"page-%d" % i for i in range(3)]
    target.prepare(pages, out)
    try:
        target.put(keys, pages)
        got = target.get(keys, out)
        views = out if got is None else got
        assert [bytes(view) for view in views] == [page.tobytes() for page in pages]
    finally:
        target.clear()


def test_redis_round_trip() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH (Debian: apt-get install redis-server)")
    if importlib.util.find_spec("redis") is None:
        pytest.skip("Python module redis not installed (pip install -e '.[bench]')")
    with peers.redis_peer() as target:
        round_trip(target)
        assert target.client.dbsize() == 0  # clear() emptied it
        ports = target.ports
    assert not any(peers.port_open(port) for port in ports), "redis-server still listens after the block"


def test_mooncake_round_trip() -> None:
    try:
        with peers.mooncake_peer(64 << 20, buffer_bytes=16 << 20, timeout=15) as target:
            round_trip(target)
            ports = target.ports
    except peers.PeerUnavailable as exc:  # not installed here (or libibverbs1 missing): the reason is the skip
        pytest.skip(f"mooncake: {exc}")
    assert not any(peers.port_open(port) for port in ports), "a Mooncake process still listens after the block"


def test_missing_peers_are_one_clear_line_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers.shutil, "which", lambda name: None)  # no redis-server on PATH
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the Mooncake client does not import
    lines: list[str] = []
    skipped: dict[str, str] = {}
    with peers.started(["redis", "mooncake", "memcached"], 64 << 20, say=lines.append, skipped=skipped) as targets:
        assert targets == {}
    assert lines == [f"peer {name} skipped: {skipped[name]}" for name in ("redis", "mooncake", "memcached")]
    assert "redis-server not found on PATH" in skipped["redis"]
    assert "mooncake.store not importable" in skipped["mooncake"] and "[bench]" in skipped["mooncake"]
    assert "unknown peer" in skipped["memcached"]


def test_a_peer_that_exits_at_start_is_unavailable_with_its_output() -> None:
    with peers.spawn("fake-server", ["sh", "-c", "echo cannot bind; exit 3"]) as proc, \
            pytest.raises(peers.PeerUnavailable, match="fake-server exited with code 3: cannot bind"):
        peers.wait_ready(lambda: False, [proc], "fake-server", timeout=10)


class WrongBytes:
    def prepare(self, pages: np.ndarray, out: np.ndarray) -> None:
        pass

    def put(self, keys: list[bytes], block: np.ndarray) -> None:
        pass

    def get(self, keys: list[bytes], out: np.ndarray) -> list[bytes]:
        return [bytes(out.shape[1])] * len(keys)

    def clear(self) -> None:
        self.cleared = True


def test_measure_refuses_wrong_bytes_and_still_clears() -> None:
    target = WrongBytes()
    with pytest.raises(AssertionError, match="wrong bytes"):
        peers.measure(target, 4096, 8 * 4096, Bar())
    assert target.cleared


def test_ratio_table_and_targets() -> None:
    def row(path: str, put: float, get: float, peer: bool = False) -> dict[str, object]:
        return {"path": path, "page": "4MiB", "batch": 1, "put_gbps": put, "get_gbps": get, "peer": peer}

    results = {"rows": [row("shm", 8.0, 8.0), row("tcp", 4.0, 4.0), row("redis", 2.0, 5.0, True),
                        row("mooncake", 2.0, 2.0, True)], "peers_skipped": {"other": "not here"}}
    text = "\n".join(render_peers(results))
    assert "| redis | 4MiB | 1 | 2.00 | 5.00 | 2.00x | 0.80x | 4.00x | 1.60x |" in text
    assert "| mooncake | 4MiB | 1 | 2.00 | 2.00 | 2.00x | 2.00x | 4.00x | 4.00x |" in text
    assert "kvstore tcp / redis get: 0.80x (target >= 1x: NOT met)" in text
    assert "kvstore tcp / mooncake put and get: 2.00x / 2.00x (target >= 1.5x: met)" in text
    assert "peer other skipped: not here" in text
