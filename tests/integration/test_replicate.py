"""The replicate primitive between in-process nodes over each transport:
checksums, idempotence, fragmented pools, and no leaks."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient

PAGE = 64 << 10


@pytest.fixture(params=["tcp", "ucx"])
def pair(request, make_server, pool_ops):  # type: ignore[no-untyped-def]
    """Nodes a and b (b seeded with a), both with namespace m."""
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    common = dict(transport=request.param, heartbeat_interval=0.05, heartbeat_timeout=2.0, capacity=16 << 20)
    a = make_server(ops=pool_ops, node_id="a", **common)
    b = make_server(ops=pool_ops, node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    deadline = time.monotonic() + 10
    while not (a.call(lambda: len(a.server.agent.membership.live_ids())) == 2
               and b.call(lambda: len(b.server.agent.membership.live_ids())) == 2):
        assert time.monotonic() < deadline, "nodes did not meet"
        time.sleep(0.02)
    yield a, b
    for srv in (a, b):
        check_pools_sound(srv)
        assert srv.call(lambda srv=srv: srv.server.agent.transport.connections()) <= 8


def replicate(srv, keys: list[bytes], source: str = "a") -> pb.ReplicateResponse:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(srv.address) as channel:
        return pb_grpc.ClusterStub(channel).Replicate(
            pb.ReplicateRequest(namespace="m", keys=keys, source_node_id=source), timeout=20)


def test_replicate_is_exact_and_idempotent(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    pages = random_pages(12, PAGE)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys_for(12), pages)
        kb.put("m", keys_for(12)[:2], pages[:2])  # b already holds two
        reply = replicate(b, keys_for(12) + [b"absent"])
        assert (reply.copied, reply.already_present, reply.missing) == (10, 2, 1)
        got = kb.get("m", keys_for(12), local_only=True)
        assert got.found.all() and np.array_equal(got.pages, pages)
        assert kb.stats("m").namespaces[0].replica_slots == 10
        again = replicate(b, keys_for(12))
        assert (again.copied, again.already_present) == (0, 12)


def test_replicate_into_a_fragmented_pool(pair) -> None:  # type: ignore[no-untyped-def]
    """b's free slots are scattered, so pulled pages go through staging and
    the unpack path (UCX) or land page by page (TCP)."""
    a, b = pair
    pages = random_pages(20, PAGE, seed=3)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys_for(20), pages)
        filler = keys_for(40, b"f")
        kb.put("m", filler, random_pages(40, PAGE, seed=4))
        kb.delete("m", filler[::2])  # every other slot free
        assert replicate(b, keys_for(20)).copied == 20
        got = kb.get("m", keys_for(20), local_only=True)
        assert got.found.all() and np.array_equal(got.pages, pages)


def test_corrupted_page_is_never_stored(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    pages = random_pages(4, PAGE, seed=5)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys_for(4), pages)

        def corrupt() -> None:  # flip a byte in a's copy of page 2, under its checksum
            pool = a.node.namespace("m").pool
            pool.buffer[pool.entry(keys_for(4)[2]).slot][100] ^= 0xFF

        a.call(corrupt)
        reply = replicate(b, keys_for(4))
        assert (reply.copied, reply.missing) == (3, 1)
        assert kb.exists("m", keys_for(4)) == [True, True, False, True]
        failures = b.call(lambda: b.server.metrics.checksum_failures._value.get())
        assert failures == 2  # the first pull and its one retry


def test_replicate_bad_requests(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    with grpc.insecure_channel(b.address) as channel:
        stub = pb_grpc.ClusterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Replicate(pb.ReplicateRequest(namespace="nope", keys=[b"k"], source_node_id="a"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            stub.Replicate(pb.ReplicateRequest(namespace="m", keys=[b""], source_node_id="a"), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # an unknown source is a miss, not an error
        reply = stub.Replicate(pb.ReplicateRequest(namespace="m", keys=[b"k"], source_node_id="zz"), timeout=5)
        assert reply.missing == 1
