"""The node as a hostile client or a failing network sees it: slow and
stalled PUTs, oversized headers, short garbage, idle and half-open
connections, connection floods, unknown enum values and undecodable bodies,
on the data channel, the peer transport listener and gRPC. Real nodes on
127.0.0.1; every probe here failed on the code before these limits."""

from __future__ import annotations

import random
import socket
import threading
import time

import grpc
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages, wait_until
from kvstore.framing import PREFIX, encode_header, encode_prefix
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import InvalidArgument, KvClient

PAGE = 4096
DEFAULT_READ_TIMEOUT = 5.0  # NodeConfig.read_timeout


def read_result(sock: socket.socket, timeout: float) -> tuple[pb.DataHeader | None, bool]:
    """(the first RESULT frame, whether the node then closed), within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, socket.timeout):
        return _parse(data), False
    except ConnectionResetError:
        pass
    return _parse(data), True


def _parse(data: bytes) -> pb.DataHeader | None:
    if len(data) < PREFIX.size:
        return None
    header_len = int.from_bytes(data[8:12], "little")
    reply = pb.DataHeader()
    reply.ParseFromString(data[PREFIX.size:PREFIX.size + header_len])
    return reply


def data_socket(srv) -> socket.socket:  # type: ignore[no-untyped-def]
    host = srv.address.rsplit(":", 1)[0]
    return socket.create_connection((host, srv.server.data_port), timeout=10)


def used(srv, ns: str = "m") -> int:  # type: ignore[no-untyped-def]
    return srv.call(lambda: srv.node.namespace(ns).pool.used_slots)


def test_stalled_put_holds_one_page_then_is_cut_off(make_server) -> None:  # type: ignore[no-untyped-def]
    """A PUT header for 64 pages and one byte: the node reserves (and evicts
    for) one page, not 64; later puts succeed; after --read-timeout the
    stalled sender gets an error frame and is closed, and the page is back."""
    srv = make_server()
    old = keys_for(64, b"old")
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE, capacity=64 * PAGE)
        kv.put("m", old, random_pages(64, PAGE))
        attacker = data_socket(srv)
        header = pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=keys_for(64, b"evil"), page_bytes=PAGE)
        attacker.sendall(encode_header(header, 64 * PAGE) + b"x")
        time.sleep(0.3)  # the node has read the header and the byte
        start = time.monotonic()
        assert kv.put("m", [b"new"], random_pages(1, PAGE)).stored == 1  # room despite the stalled PUT
        assert sum(kv.exists("m", old)) >= 62, "the stalled PUT evicted more than a page"
        reply, closed = read_result(attacker, DEFAULT_READ_TIMEOUT + 3)
        attacker.close()
        assert reply is not None and reply.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply
        assert closed and time.monotonic() - start < DEFAULT_READ_TIMEOUT + 3
        assert len(reply.message) <= 300
        assert kv.exists("m", keys_for(64, b"evil")) == [False] * 64
    check_pools_sound(srv)


def test_oversized_headers_cost_no_memory(daemon) -> None:  # type: ignore[no-untyped-def]
    """16 connections that each promise a header just under the cap and send
    nothing more cost no memory; one that promises 16 MiB gets an error frame
    at once."""
    d = daemon("--device", "cpu", "--namespace", "m:4KiB:1MiB", "--prefault", "false")
    with KvClient(d.address) as kv:
        kv.wait_ready()
        port = kv.node_info().data_endpoints[0].port

    def rss() -> int:
        with open(f"/proc/{d.proc.pid}/status") as fh:
            return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS:"))

    before = rss()
    socks = []
    cap = (64 << 10) + 65536 * 80  # kvstore.framing.header_cap at the default --max-batch-pages
    for _ in range(16):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(encode_prefix(b"", 0)[:8] + (cap - 1).to_bytes(4, "little") + bytes(8) + b"\x0a")
        socks.append(sock)
    time.sleep(1.0)
    grown = rss() - before
    big = socket.create_connection(("127.0.0.1", port), timeout=10)
    big.sendall(encode_prefix(b"", 0)[:8] + (16 << 20).to_bytes(4, "little") + bytes(8))
    reply, closed = read_result(big, 5)
    for sock in socks + [big]:
        sock.close()
    assert grown < 24 << 20, f"RSS grew by {grown >> 20} MiB for 16 unsent headers"
    assert reply is not None and reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and closed
    assert "header" in reply.message


def test_short_garbage_is_answered_and_closed(make_server) -> None:  # type: ignore[no-untyped-def]
    """200 short garbage inputs (some shorter than a frame prefix): each gets
    an error frame and a close within --read-timeout; the node keeps serving."""
    srv = make_server()
    rng = random.Random(13)
    inputs = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    results: list[tuple[pb.DataHeader | None, bool]] = [(None, False)] * len(inputs)

    def probe(i: int) -> None:
        with data_socket(srv) as sock:
            sock.sendall(inputs[i])
            results[i] = read_result(sock, DEFAULT_READ_TIMEOUT + 5)

    threads = [threading.Thread(target=probe, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    unanswered = [i for i, (reply, closed) in enumerate(results) if reply is None or not reply.code or not closed]
    assert not unanswered, f"{len(unanswered)} of {len(inputs)} never answered or closed, e.g. {inputs[unanswered[0]]!r}"
    assert {r.code for r, _ in results} <= {grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                             grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE)
        assert kv.put("m", [b"k"], random_pages(1, PAGE)).stored == 1


def test_idle_and_half_open_connections_are_closed(make_server) -> None:  # type: ignore[no-untyped-def]
    """A connection that never sends and one that stops after a request are
    closed after --idle-timeout; a client whose pooled connection was closed
    that way reconnects without an error."""
    srv = make_server(idle_timeout=0.5)
    with KvClient(srv.address, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE)
        silent = data_socket(srv)
        used_once = data_socket(srv)
        used_once.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=[b"k"]), 0))
        reply, closed = read_result(used_once, 5)
        assert reply is not None and reply.code == 0 and closed  # answered, then closed once idle
        assert read_result(silent, 5) == (None, True)
        silent.close()
        used_once.close()
        for _ in range(3):
            assert kv.put("m", [b"k"], random_pages(1, PAGE)).already_present in (0, 1)
            time.sleep(0.8)  # the node closes the client's pooled connection meanwhile
            assert kv.get("m", [b"k"]).found.all()


def test_connection_limit(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(max_connections=4)
    held = [data_socket(srv) for _ in range(4)]
    time.sleep(0.2)
    extra = data_socket(srv)
    reply, closed = read_result(extra, 5)
    extra.close()
    assert reply is not None and reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and closed
    held.pop().close()
    time.sleep(0.2)
    with KvClient(srv.address) as kv:  # a freed place serves again
        kv.create_namespace("m", PAGE)
        assert kv.put("m", [b"k"], random_pages(1, PAGE)).stored == 1
    for sock in held:
        sock.close()


def test_unknown_page_kind_everywhere(make_server) -> None:  # type: ignore[no-untyped-def]
    """PageKind 99 on the data channel, a gRPC Put and Replicate:
    INVALID_ARGUMENT with the valid kinds named, nothing stored."""
    srv = make_server()
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE)
        with data_socket(srv) as sock:
            header = pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=[b"k"], page_bytes=PAGE, kind=99)
            sock.sendall(encode_header(header, PAGE) + bytes(PAGE))
            sock.settimeout(5)
            reply = _parse(sock.recv(4096))
            assert reply is not None and reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "page kind" in reply.message
            # the connection stays in step: the next request is served
            sock.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=[b"k"]), 0))
            again = _parse(sock.recv(4096))
            assert again is not None and again.code == 0 and list(again.found) == [False]
        with grpc.insecure_channel(srv.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.KvStoreStub(channel).Put(iter([pb.PutRequest(namespace="m", keys=[b"k"], pages=[bytes(PAGE)],
                                                                     kind=99)]), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page kind" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ClusterStub(channel).Replicate(pb.ReplicateRequest(namespace="m", keys=[b"k"],
                                                                           source_node_id="x", kind=99), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page kind" in info.value.details()
        assert kv.exists("m", [b"k"]) == [False]


def test_undecodable_bodies_and_huge_names(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server()
    with grpc.insecure_channel(srv.address) as channel:
        for path in ("/kvstore.v1.KvStore/CreateNamespace", "/kvstore.v1.KvStore/Lookup",
                     "/kvstore.v1.Cluster/Heartbeat", "/kvstore.v1.Cluster/Replicate"):
            rpc = channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                rpc(b"\xff\xff\xff", timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
            assert "Error" not in info.value.details()
        stub = pb_grpc.KvStoreStub(channel)
        for call in (lambda: stub.DescribeNamespace(pb.DescribeNamespaceRequest(namespace="n" * 20_000), timeout=10),
                     lambda: stub.Exists(pb.KeysRequest(namespace="n" * 20_000, keys=[b"k"]), timeout=10),
                     lambda: stub.CreateNamespace(pb.CreateNamespaceRequest(
                         namespace="n" * 20_000, layout=pb.PageLayout(page_bytes=64)), timeout=10)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(info.value.details()) <= 300 and "20000 chars" in info.value.details()


def test_stalled_grpc_put_stream_frees_its_slots(make_server) -> None:  # type: ignore[no-untyped-def]
    """A gRPC Put stream that sends one message and then nothing: after
    --read-timeout it fails with DEADLINE_EXCEEDED and its slots are free."""
    srv = make_server()
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE, capacity=16 * PAGE)
    release = threading.Event()

    def messages():  # type: ignore[no-untyped-def]
        yield pb.PutRequest(namespace="m", keys=keys_for(8), pages=[bytes(PAGE)] * 8)
        release.wait(30)

    outcome: dict[str, object] = {}

    def put() -> None:
        with grpc.insecure_channel(srv.address) as channel:
            try:
                pb_grpc.KvStoreStub(channel).Put(messages(), timeout=30)
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

    thread = threading.Thread(target=put)
    start = time.monotonic()
    thread.start()
    try:
        wait_until(lambda: used(srv) == 8, 5, "the first message's slots")
        wait_until(lambda: used(srv) == 0, DEFAULT_READ_TIMEOUT + 3, "the stalled stream's slots to be freed")
        thread.join(10)
        assert outcome.get("code") == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < DEFAULT_READ_TIMEOUT + 3
    finally:
        release.set()
        thread.join(10)
    check_pools_sound(srv)


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_peer_transport_listener_limits(make_server, backend: str) -> None:  # type: ignore[no-untyped-def]
    """The peer transport's listener: short garbage and a stalled request get
    an error and a close (TCP); a silent connection is closed when idle; the
    node still serves pulls."""
    if backend == "ucx":
        pytest.importorskip("ucxx")
    srv = make_server(transport=backend, idle_timeout=1.0, read_timeout=1.0)
    endpoint = srv.call(lambda: srv.server.agent.self_info.endpoints[0])
    if backend == "tcp":
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
            sock.sendall(b"KVSD\x01")  # a prefix that never completes
            reply, closed = read_result(sock, 5)
            assert reply is not None and reply.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and closed
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
            sock.sendall(encode_prefix(b"", 0)[:8] + (16 << 20).to_bytes(4, "little") + bytes(8))
            reply, closed = read_result(sock, 5)
            assert reply is not None and reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and closed
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
            assert read_result(sock, 5) == (None, True)  # idle: closed
    with KvClient(srv.address) as kv:  # the node and its transport still work
        kv.create_namespace("m", PAGE)
        kv.put("m", [b"k"], random_pages(1, PAGE))
        assert kv.get("m", [b"k"]).found.all()
    check_pools_sound(srv)


def test_client_checks_sizes_before_allocating(make_server) -> None:  # type: ignore[no-untyped-def]
    """A Get of 100,000 keys of 1 MiB pages (98 GiB of output) is refused by
    the client before it allocates; a zero-width page array is InvalidArgument."""
    import numpy as np

    from kvstore_client import ResourceExhausted

    srv = make_server()
    for path in ("tcp", "grpc"):
        with KvClient(srv.address, data_path=path) as kv:
            kv.create_namespace(f"big{path}", 1 << 20, capacity=4 << 20)
            with pytest.raises(ResourceExhausted, match="limit"):
                kv.get(f"big{path}", keys_for(100_000))
            with pytest.raises(InvalidArgument, match="0 bytes"):
                kv.put(f"big{path}", keys_for(3), np.zeros((3, 0), dtype=np.uint8))
