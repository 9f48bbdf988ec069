"""The pool's one movement API (kvstore.pool.movement): read-out and write-in
over every pool memory (host, staged like a GPU) and every carrier form
(scatter views, one array, device arrays), with checksums. No sockets."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvstore.config import NodeConfig
from kvstore.node import Node
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.ops.staged import StagedNumpyPageOps
from kvstore.pool.layout import PageLayout
from kvstore.pool.movement import SOCKET, Carrier, page_checksum
from kvstore.pool.pool import PageKind

PB = 64
OPS = {"host": NumpyPageOps, "staged": StagedNumpyPageOps}
CARRIERS = {"scatter": SOCKET, "array": Carrier(), "device": Carrier(device=True)}


def page(i: int) -> np.ndarray:
    return np.full(PB, i % 256, dtype=np.uint8)


def make_node(ops: str, slots: int = 8) -> Node:
    node = Node(NodeConfig(listen="127.0.0.1:0", capacity=slots * PB, device="cpu", prefault=False),
                OPS[ops]())
    node.create_namespace("m", PageLayout(PB))
    return node


def fill(targets: Any, rows: list[np.ndarray]) -> None:
    """What a carrier does: write each page's bytes into its target."""
    if isinstance(targets, list):
        for view, row in zip(targets, rows):
            view[:] = row.tobytes()
    else:
        targets[:] = np.stack(rows)


def as_rows(payload: Any, ops: Any) -> list[bytes]:
    if payload is None:
        return []
    if isinstance(payload, list):
        return [bytes(v) for v in payload]
    host = payload if ops.host_visible else ops.to_host(payload)
    return [bytes(r) for r in host]


@pytest.mark.parametrize("carrier", CARRIERS, ids=list(CARRIERS))
@pytest.mark.parametrize("ops", OPS, ids=list(OPS))
def test_write_in_then_read_out_round_trips(ops: str, carrier: str) -> None:
    node = make_node(ops)
    pool = node.namespace("m").pool
    pre = node.begin_put("m")
    fill(pre.write_in([b"pad0", b"b"], CARRIERS[carrier]).targets, [page(0), page(2)])
    assert pre.commit().stored == 0  # the finisher was not called: nothing may be published
    assert len(pool) == 0 and pool.used_slots == 0
    pre = node.begin_put("m")
    landing = pre.write_in([b"pad0", b"b"], CARRIERS[carrier])
    fill(landing.targets, [page(0), page(2)])
    assert landing.finish() == set()
    pre.commit()
    batch = node.begin_put("m")
    landing = batch.write_in([b"a", b"b", b"c"], CARRIERS[carrier])  # b is already there
    fill(landing.targets, [page(1), page(99), page(3)])
    assert landing.finish() == set()
    assert batch.commit().stored == 2
    handle = pool.acquire([b"c", b"a", b"b", b"zz"])
    out = pool.read_out(handle, CARRIERS[carrier])
    try:
        assert as_rows(out.payload, pool.ops) == [page(3).tobytes(), page(1).tobytes(), page(2).tobytes()]
    finally:
        out.release()
    assert all(e.readers == 0 for e in pool._table.values())
    assert all(pool.entry(k).checksum == page_checksum(page(i)) for k, i in [(b"a", 1), (b"b", 2), (b"c", 3)])
    pool.check_invariants()
    assert pool.used_slots == len(pool)


def test_a_staged_pool_stores_nothing_without_the_finisher() -> None:
    """The staged pool copies for real: bytes written into the landing reach
    the slots only through finish() (a forgotten upload fails here)."""
    node = make_node("staged")
    pool = node.namespace("m").pool
    pool.buffer[:] = 0
    batch = node.begin_put("m")
    landing = batch.write_in([b"a"], SOCKET)
    fill(landing.targets, [page(7)])
    assert not landing.in_place and not pool.buffer.any()
    landing.finish()
    assert bytes(pool.buffer[batch._parts[0].res.slots[0]]) == page(7).tobytes()
    batch.commit()
    out = pool.read_out(pool.acquire([b"a"]), Carrier())
    out.payload[0][:] = 0  # a download is a copy: writing it leaves the pool alone
    out.release()
    assert as_rows(pool.read_out(pool.acquire([b"a"]), SOCKET).payload, pool.ops) == [page(7).tobytes()]


def test_host_pool_lands_in_place_for_sockets_and_for_one_run() -> None:
    node = make_node("host")
    pool = node.namespace("m").pool
    landing = node.begin_put("m").write_in([b"a", b"b"], SOCKET)
    assert landing.in_place and all(np.shares_memory(np.asarray(v), pool.buffer) for v in landing.targets)
    one_run = node.begin_put("m").write_in([b"c", b"d"], Carrier())
    assert one_run.in_place and np.shares_memory(one_run.targets, pool.buffer)


@pytest.mark.parametrize("ops", OPS, ids=list(OPS))
def test_a_page_failing_its_checksum_is_never_stored(ops: str) -> None:
    node = make_node(ops)
    pool = node.namespace("m").pool
    batch = node.begin_put("m", PageKind.REPLICA)
    landing = batch.write_in([b"a", b"b"], Carrier(device=True))
    fill(landing.targets, [page(1), page(2)])
    bad = landing.finish([page_checksum(page(1)), page_checksum(page(5))])
    assert bad == {b"b"}
    result = batch.commit()
    assert (result.stored, b"a" in pool, b"b" in pool) == (1, True, False)
    pool.check_invariants()
    assert pool.used_slots == 1  # the failed page's slot went back


def test_abandoned_landing_and_aborted_batch_free_everything() -> None:
    node = make_node("staged")
    pool = node.namespace("m").pool
    batch = node.begin_put("m")
    landing = batch.write_in([b"a", b"b", b"c"], SOCKET)
    assert pool.used_slots == 3
    landing.abandon()
    batch.abort()
    assert pool.used_slots == 0 and len(pool) == 0
    pool.check_invariants()


def test_a_batch_carries_kind_expiry_and_deadline() -> None:
    node = make_node("host")
    pool = node.namespace("m").pool
    expires = time.monotonic() + 30
    batch = node.begin_put("m", PageKind.SPECULATIVE, expires_at=expires, timeout=5.0)
    assert 4.0 < batch.time_left() <= 5.0
    landing = batch.write_in([b"s"], SOCKET)
    fill(landing.targets, [page(1)])
    landing.finish()
    batch.commit()
    entry = pool.entry(b"s")
    assert entry.kind is PageKind.SPECULATIVE and entry.expires_at == expires
    primary = node.begin_put("m", PageKind.PRIMARY, expires_at=expires)
    assert primary.expires_at == 0.0  # only speculative pages expire


def test_read_out_of_nothing_releases_the_hold() -> None:
    node = make_node("staged")
    pool = node.namespace("m").pool
    handle = pool.acquire([b"none"])
    out = pool.read_out(handle, SOCKET)
    assert out.payload is None and out.pages == 0 and handle.released
    out.release()
