"""Bad input gets a clear status code and changes nothing; the node keeps
serving. Run against real nodes over both client data paths."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages
from kvstore.framing import encode_header
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import (
    AsyncKvClient, InvalidArgument, KvClient, NotFound, ResourceExhausted,
)

PATHS = ["tcp", "grpc"]


def _unchanged(kv: KvClient, ns: str, used_before: int) -> None:
    stats = kv.stats(ns).namespaces[0]
    assert stats.used_slots == used_before, "a rejected batch left pages behind"


@pytest.fixture
def srv(make_server):  # type: ignore[no-untyped-def]
    server = make_server(max_batch_pages=8, max_batch_bytes=64 << 10)
    yield server
    check_pools_sound(server)


@pytest.mark.parametrize("path", PATHS)
def test_bad_batches_are_rejected_whole(srv, path: str) -> None:  # type: ignore[no-untyped-def]
    with KvClient(srv.address, data_path=path) as kv:
        kv.create_namespace("m", 1024)
        kv.put("m", keys_for(2, b"old"), random_pages(2, 1024))
        cases = [
            ("wrong page size", keys_for(3), random_pages(3, 1000), InvalidArgument, "1024"),
            ("empty key", [b"a", b"", b"c"], random_pages(3, 1024), InvalidArgument, "1..64"),
            ("long key", [b"a", b"x" * 65], random_pages(2, 1024), InvalidArgument, "1..64"),
            ("duplicate", [b"a", b"b", b"a"], random_pages(3, 1024), InvalidArgument, "duplicate"),
            ("too many", keys_for(9), random_pages(9, 1024), ResourceExhausted, "limit"),
        ]
        for name, keys, pages, error, text in cases:
            with pytest.raises(error, match=text):
                kv.put("m", keys, pages)
            _unchanged(kv, "m", 2)
            valid = [k for k in keys if 0 < len(k) <= 64][:8]
            assert kv.exists("m", valid) == [False] * len(valid), name
        with pytest.raises(NotFound, match="unknown namespace"):
            kv.put("nope", keys_for(1), random_pages(1, 1024))
        with pytest.raises(InvalidArgument):
            kv.put("m", keys_for(2), random_pages(3, 1024))  # count mismatch
        # the node still serves, and old pages are intact
        assert kv.get("m", keys_for(2, b"old")).found.all()


def test_batch_bytes_limit(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(max_batch_bytes=8 << 10)
    for path in PATHS:
        with KvClient(srv.address, data_path=path) as kv:
            kv.create_namespace(f"m{path}", 1024, capacity=1 << 20)
            with pytest.raises(ResourceExhausted, match="bytes"):
                kv.put(f"m{path}", keys_for(9), random_pages(9, 1024))
            assert kv.stats(f"m{path}").namespaces[0].used_slots == 0
    check_pools_sound(srv)


@pytest.mark.parametrize("path", PATHS)
def test_unknown_namespace_everywhere(srv, path: str) -> None:  # type: ignore[no-untyped-def]
    with KvClient(srv.address, data_path=path) as kv:
        kv.create_namespace("known", 64)  # so get can size its buffer
        kv.delete_namespace("known")
        kv._page_bytes["gone"] = 64
        for call in (lambda: kv.get("gone", [b"k"]), lambda: kv.lookup("gone", [b"k"]),
                     lambda: kv.exists("gone", [b"k"]), lambda: kv.delete("gone", [b"k"]),
                     lambda: kv.pin("gone", [b"k"], 1.0), lambda: kv.unpin("gone", "x"),
                     lambda: kv.stats("gone"), lambda: kv.describe_namespace("gone")):
            with pytest.raises(NotFound):
                call()
        with pytest.raises(InvalidArgument, match="namespace name"):
            kv.create_namespace("bad name!", 64)
        with pytest.raises(InvalidArgument, match="page_bytes"):
            kv.create_namespace("zero", 0)
        with pytest.raises(ResourceExhausted):
            kv.create_namespace("huge", 64, capacity=1 << 40)


@pytest.mark.parametrize("path", PATHS)
def test_all_pinned_put_fails_and_changes_nothing(make_server, path: str) -> None:  # type: ignore[no-untyped-def]
    srv = make_server()
    with KvClient(srv.address, data_path=path) as kv:
        kv.create_namespace("tiny", 512, capacity=4 * 512)
        pages = random_pages(4, 512)
        kv.put("tiny", keys_for(4), pages)
        kv.pin("tiny", keys_for(4), ttl=60)
        with pytest.raises(ResourceExhausted, match="pinned") as info:
            kv.put("tiny", keys_for(1, b"new"), random_pages(1, 512))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        got = kv.get("tiny", keys_for(4))
        assert got.found.all() and np.array_equal(got.pages, pages)
        stats = kv.stats("tiny").namespaces[0]
        assert stats.evictions["lru"] == 0 and stats.used_slots == 4
    check_pools_sound(srv)


def test_oversized_grpc_message_is_resource_exhausted(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(max_message_bytes=1 << 20)
    page = 512 << 10
    with grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        stub = pb_grpc.KvStoreStub(channel)
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", page)
            with pytest.raises(InvalidArgument, match="one gRPC message"):
                kv.create_namespace("huge-pages", 2 << 20)
        big = pb.PutRequest(namespace="m", keys=keys_for(4), pages=[bytes(page)] * 4)
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter([big]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the client cuts the same batch into messages under the limit and works
    with KvClient(srv.address, data_path="grpc") as kv:
        pages = random_pages(4, page)
        assert kv.put("m", keys_for(4), pages).stored == 4
        assert np.array_equal(kv.get("m", keys_for(4)).pages, pages)
    check_pools_sound(srv)


def test_rejected_second_chunk_discards_the_first(srv) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.KvStoreStub(channel)
        KvClient(srv.address).create_namespace("m", 16)
        chunks = [pb.PutRequest(namespace="m", keys=[b"a", b"b"], pages=[bytes(16)] * 2),
                  pb.PutRequest(keys=[b"c"], pages=[bytes(15)])]
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter(chunks), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page #0 has 15 bytes" in info.value.details()
        assert list(stub.Exists(pb.KeysRequest(namespace="m", keys=[b"a", b"b"])).exists) == [False, False]


def test_garbage_on_both_ports_then_still_serving(srv) -> None:  # type: ignore[no-untyped-def]
    host, port = srv.address.rsplit(":", 1)
    for target in (int(port), srv.server.data_port):
        with socket.create_connection((host, target), timeout=5) as sock:
            sock.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
            sock.settimeout(5)
            try:
                while sock.recv(4096):
                    pass  # the node answers with an error and/or closes
            except OSError:
                pass
    with KvClient(srv.address) as kv:
        assert kv.health() == "SERVING"
        kv.create_namespace("m", 64)
        assert kv.put("m", [b"k"], random_pages(1, 64)).stored == 1


def test_data_channel_bad_frames_get_errors(srv) -> None:  # type: ignore[no-untyped-def]
    KvClient(srv.address).create_namespace("m", 64)
    host = srv.address.rsplit(":", 1)[0]
    with socket.create_connection((host, srv.server.data_port), timeout=5) as sock:
        # payload length that does not match keys x page_bytes: protocol error, connection closed
        header = pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=[b"a"], page_bytes=64)
        sock.sendall(encode_header(header, 10) + bytes(10))
        reply = sock.recv(4096)
        assert b"payload" in reply
        try:
            assert sock.recv(4096) == b""  # closed: the stream can't be trusted
        except ConnectionResetError:
            pass  # closed with our unread payload bytes pending


def test_peer_dies_mid_put_leaks_nothing(srv) -> None:  # type: ignore[no-untyped-def]
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", 4096)
        used = kv.stats("m").namespaces[0].used_slots
        host = srv.address.rsplit(":", 1)[0]
        sock = socket.create_connection((host, srv.server.data_port), timeout=5)
        header = pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=keys_for(4), page_bytes=4096)
        sock.sendall(encode_header(header, 4 * 4096) + bytes(4096 + 100))  # 1.02 of 4 pages, then die
        sock.close()
        # the node notices the EOF and gives the reserved slots back
        deadline = time.monotonic() + 10
        while kv.stats("m").namespaces[0].used_slots != used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.stats("m").namespaces[0].used_slots == used
        assert kv.exists("m", keys_for(4)) == [False] * 4
        assert kv.put("m", keys_for(4), random_pages(4, 4096)).stored == 4


@pytest.mark.parametrize("path", PATHS)
def test_cancelled_get_leaves_node_sound(make_server, path: str) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=128 << 20)

    async def scenario() -> None:
        async with AsyncKvClient(srv.address, data_path=path) as kv:
            await kv.create_namespace("m", 1 << 20)
            await kv.put("m", keys_for(48), random_pages(48, 1 << 20))
            task = asyncio.ensure_future(kv.get("m", keys_for(48)))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            got = await kv.get("m", keys_for(2))  # the client recovers
            assert got.found.all()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    check_pools_sound(srv)
