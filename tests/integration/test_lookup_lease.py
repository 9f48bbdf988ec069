"""Lookup with lease: one RPC that answers the longest cached prefix and pins
what this node holds of it, idempotent per lease id (a repeat neither pins
nor records again). Real in-process nodes over real gRPC."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import keys_for, random_pages
from kvstore_client import AsyncKvClient, InvalidArgument, KvClient, NotFound

PAGE = 4096


def accesses(srv) -> int:  # type: ignore[no-untyped-def]
    """Recorded requests still queued for the predictor (heartbeats are slow here)."""
    return srv.call(lambda: len(srv.server.agent._accesses))


def pinned(kv: KvClient, ns: str = "m") -> tuple[int, int]:
    st = kv.stats(ns).namespaces[0]
    return st.pinned_slots, st.active_leases


@pytest.fixture
def srv(make_server):  # type: ignore[no-untyped-def]
    return make_server(heartbeat_interval=60.0, heartbeat_timeout=120.0)


def test_lookup_lease_pins_the_prefix_it_reports(srv) -> None:  # type: ignore[no-untyped-def]
    keys = keys_for(6)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        kv.put("m", keys[:4], random_pages(4, PAGE))
        reply = kv.lookup_lease("m", keys, ttl=30, lease_id="engine-1/req-1", record=True)
        assert reply.prefix_length == 4
        assert reply.leased_length == 4 and reply.lease_id
        assert 0 < reply.lease_expires_in_seconds <= 30
        assert pinned(kv) == (4, 1)
        # a pinned page survives a delete, the lease's whole point
        assert list(kv.delete("m", keys[:1]).pinned) == keys[:1]
        assert kv.unpin("m", reply.lease_id) == 4
        assert pinned(kv) == (0, 0)


def test_repeat_call_neither_double_leases_nor_double_records(srv) -> None:  # type: ignore[no-untyped-def]
    keys = keys_for(5)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        kv.put("m", keys[:3], random_pages(3, PAGE))
        before = accesses(srv)
        first = kv.lookup_lease("m", keys, ttl=30, lease_id="req-7", record=True)
        assert accesses(srv) == before + 1
        kv.put("m", keys[3:], random_pages(2, PAGE, seed=1))  # the prefix grows meanwhile
        again = kv.lookup_lease("m", keys, ttl=30, lease_id="req-7", record=True)
        assert again.lease_id == first.lease_id and again.leased_length == 3
        assert accesses(srv) == before + 1, "a repeat must not record again"
        assert pinned(kv) == (3, 1), "a repeat must not pin again"
        other = kv.lookup_lease("m", keys, ttl=30, lease_id="req-8", record=True)
        assert other.lease_id != first.lease_id and other.leased_length == 5
        assert accesses(srv) == before + 2
        assert pinned(kv) == (5, 2)


def test_no_hit_still_records_once_and_pins_nothing(srv) -> None:  # type: ignore[no-untyped-def]
    keys = keys_for(3, b"x")
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        before = accesses(srv)
        for _ in range(3):
            reply = kv.lookup_lease("m", keys, ttl=10, lease_id="miss-1", record=True)
            assert (reply.prefix_length, reply.leased_length, reply.lease_id) == (0, 0, "")
        assert accesses(srv) == before + 1
        assert pinned(kv) == (0, 0)


def test_lease_expires_and_the_key_can_lease_again(srv) -> None:  # type: ignore[no-untyped-def]
    keys = keys_for(2)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        kv.put("m", keys, random_pages(2, PAGE))
        first = kv.lookup_lease("m", keys, ttl=0.2, lease_id="short")
        time.sleep(0.5)
        assert pinned(kv) == (0, 0)
        with pytest.raises(NotFound):
            kv.unpin("m", first.lease_id)
        again = kv.lookup_lease("m", keys, ttl=5, lease_id="short")
        assert again.lease_id != first.lease_id and again.leased_length == 2


def test_bad_lease_arguments_are_typed_errors(srv) -> None:  # type: ignore[no-untyped-def]
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        kv.put("m", keys_for(1), random_pages(1, PAGE))
        with pytest.raises(InvalidArgument):
            kv.lookup_lease("m", keys_for(1), ttl=0, lease_id="no-ttl")
        with pytest.raises(InvalidArgument):
            kv.lookup_lease("m", keys_for(1, b"miss"), ttl=1e9, lease_id="too-long-ttl")
        with pytest.raises(InvalidArgument):
            kv.lookup_lease("m", keys_for(1), ttl=5, lease_id="x" * 129)
        assert pinned(kv) == (0, 0)


def test_future_and_async_clients(srv) -> None:  # type: ignore[no-untyped-def]
    keys = keys_for(4)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", page_bytes=PAGE)
        kv.put("m", keys, random_pages(4, PAGE))
        fut = kv.lookup_lease_future("m", keys, ttl=30, lease_id="f-1")
        reply = fut.result(timeout=10)
        assert fut.done() and reply.leased_length == 4

        async def run() -> tuple[str, int]:
            async with AsyncKvClient(srv.address) as akv:
                r = await asyncio.wait_for(akv.lookup_lease("m", keys, ttl=30, lease_id="f-1"), 10)
                return r.lease_id, r.leased_length

        assert asyncio.run(run()) == (reply.lease_id, 4)
        assert pinned(kv) == (4, 1)
