"""Transport security: TLS (and mTLS) on every port of a node, clients that
speak it, the HELLO frame, certificate reload, the start-up rule and the
metrics rule (docs/security.md, "Transport security")."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages, wait_until
from kvstore.cli import kvctl, kvstored
from kvstore.errors import Unauthenticated, Unavailable
from kvstore.framing import PREFIX, decode_header, decode_prefix, encode_header, hello_frame
from kvstore.launch import NodeProcess
from kvstore.security.identity import ClusterSecret
from kvstore.security.tls import TlsFiles, client_context, peer_context, server_context
from kvstore.transport.auto import make_transport, resolve_transport
from kvstore.transport.base import Served, TransportError
from kvstore.transport.tcp import TcpTransport
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import AsyncKvClient, KvClient
from tests.tls_certs import Certs, make_certs, tls_certs, write_leaf  # noqa: F401  (tls_certs: the fixture)

PAGE = 64 << 10


def tls_node(make_server, certs: Certs, client_auth: bool = False, **overrides):  # type: ignore[no-untyped-def]
    return make_server(**certs.node_settings(client_auth), **overrides)


def client(srv, certs: Certs, *, cert: bool = False, **kwargs) -> KvClient:  # type: ignore[no-untyped-def]
    extra = dict(tls_cert=certs.client.cert, tls_key=certs.client.key) if cert else {}
    return KvClient(srv.address, tls_ca=certs.ca, timeout=10, **extra, **kwargs)


def recv_frame(sock: socket.socket) -> pb.DataHeader:
    prefix = b""
    while len(prefix) < PREFIX.size:
        chunk = sock.recv(PREFIX.size - len(prefix))
        assert chunk, "closed before a frame"
        prefix += chunk
    header_len, _ = decode_prefix(prefix)
    body = b""
    while len(body) < header_len:
        body += sock.recv(header_len - len(body))
    return decode_header(body)


# ---- the client paths over TLS ----------------------------------------------------------

@pytest.mark.parametrize("path", ["tcp", "grpc"])
def test_tls_client_put_get_lookup(make_server, tls_certs: Certs, path: str) -> None:
    srv = tls_node(make_server, tls_certs)
    pages = random_pages(16, PAGE)
    keys = keys_for(16)
    with client(srv, tls_certs, data_path=path) as kv:
        assert kv.wait_ready(10) == "SERVING"
        kv.create_namespace("m", PAGE)
        assert kv.put("m", keys, pages).stored == 16
        assert kv.lookup("m", keys) == 16
        got = kv.get("m", keys + [b"absent"])
        assert np.array_equal(got.pages[:16], pages) and got.missing == [b"absent"]
        if path == "tcp":
            assert isinstance(kv._data._sock, ssl.SSLSocket), "the data channel did not use TLS"
        endpoint = kv.node_info().data_endpoints[0]
        assert (endpoint.port, endpoint.tls) == (srv.server.data_port, True)
    check_pools_sound(srv)


def test_async_client_over_tls_data_channel(make_server, tls_certs: Certs) -> None:
    srv = tls_node(make_server, tls_certs, client_auth=True)
    pages = random_pages(8, PAGE, seed=2)

    async def run() -> None:
        async with AsyncKvClient(srv.address, tls_ca=tls_certs.ca, tls_cert=tls_certs.client.cert,
                                 tls_key=tls_certs.client.key, data_path="tcp", timeout=10) as kv:
            await kv.create_namespace("m", PAGE)
            assert (await kv.put("m", keys_for(8), pages)).stored == 8
            got = await kv.get("m", keys_for(8))
            assert np.array_equal(got.pages, pages)
            assert [type(c._sock).__name__ for c in kv._data._conns] == ["TlsStream"]

    asyncio.run(asyncio.wait_for(run(), 30))
    check_pools_sound(srv)


def test_plaintext_client_to_tls_node_fails_fast(make_server, tls_certs: Certs) -> None:
    srv = tls_node(make_server, tls_certs)
    start = time.monotonic()
    with KvClient(srv.address, timeout=5) as kv, pytest.raises(Unavailable, match="UNAVAILABLE"):
        kv.health()
    assert time.monotonic() - start < 4, "a plaintext client hung on a TLS node"
    # the data channel: a plaintext frame is not answered with data, the connection is closed
    with socket.create_connection(("127.0.0.1", srv.server.data_port), timeout=5) as raw:
        raw.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=[b"k"]), 0))
        try:
            assert not raw.recv(1 << 16).startswith(b"KVSD")
        except ConnectionResetError:
            pass


def test_client_verifies_the_node(make_server, tls_certs: Certs) -> None:
    srv = tls_node(make_server, tls_certs)
    with KvClient(srv.address, tls_ca=tls_certs.foreign_ca, timeout=5) as kv, pytest.raises(Unavailable):
        kv.health()  # the node's certificate is not of this CA
    with client(srv, tls_certs, server_name="other.example") as kv, pytest.raises(Unavailable):
        kv.health()  # not the name the certificate carries
    with client(srv, tls_certs, server_name="localhost") as kv:
        assert kv.health() == "SERVING"
    ctx = client_context(tls_certs.ca)
    with socket.create_connection(("127.0.0.1", srv.server.data_port), timeout=5) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            ctx.wrap_socket(raw, server_hostname="other.example")


def test_mtls_needs_a_client_certificate(make_server, tls_certs: Certs) -> None:
    srv = tls_node(make_server, tls_certs, client_auth=True)
    with client(srv, tls_certs) as kv, pytest.raises(Unavailable):
        kv.health()
    with client(srv, tls_certs, cert=True, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE)
        assert kv.put("m", keys_for(2), random_pages(2, PAGE)).stored == 2
        assert kv.get("m", keys_for(2)).hits == 2
    # the data channel too: a TLS client without a certificate does not get a frame through
    with socket.create_connection(("127.0.0.1", srv.server.data_port), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with client_context(tls_certs.ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                # TLS 1.3: the client's handshake ends before the node checks its (missing) certificate
                tls.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=[b"k"]), 0))
                if not tls.recv(1):
                    raise ConnectionError("closed")
    # a certificate of another CA is refused as well
    foreign = dict(tls_cert=tls_certs.foreign_node.cert, tls_key=tls_certs.foreign_node.key)
    with KvClient(srv.address, tls_ca=tls_certs.ca, timeout=5, **foreign) as kv, pytest.raises(Unavailable):
        kv.health()


# ---- the data channel's HELLO --------------------------------------------------------------

def test_data_channel_hello_authenticates_tokens(make_server, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[token]]\ntoken = "good-token"\ntenant = "acme"\nrole = "write"\n')
    srv = make_server(token_file=str(tokens))
    with KvClient(srv.address, token="good-token", data_path="tcp", timeout=10) as kv:
        kv.create_namespace("m", PAGE)
        assert kv.put("m", keys_for(3), random_pages(3, PAGE)).stored == 3
        assert kv.get("m", keys_for(3)).hits == 3
    port = srv.server.data_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # no HELLO: refused
        raw.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=keys_for(1)), 0))
        reply = recv_frame(raw)
        assert reply.code == 16 and "HELLO" in reply.message  # UNAUTHENTICATED
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # a wrong token: refused
        raw.sendall(hello_frame("bad-token"))
        assert recv_frame(raw).code == 16
        assert raw.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(hello_frame("good-token"))
        assert recv_frame(raw).code == 0
    check_pools_sound(srv)


def test_hello_is_accepted_where_nothing_is_checked(make_server) -> None:
    srv = make_server()
    with KvClient(srv.address, token="any", data_path="tcp", timeout=10) as kv:
        kv.create_namespace("m", PAGE)
        assert kv.put("m", keys_for(1), random_pages(1, PAGE)).stored == 1


# ---- the peer plane ---------------------------------------------------------------------------

def _served(request: pb.DataHeader) -> Served:
    found = [True] * len(request.keys)
    page = np.full((len(request.keys), 8), 7, dtype=np.uint8)
    return Served(pb.DataHeader(op=pb.DataHeader.RESULT, found=found, page_bytes=8),
                  [memoryview(row) for row in page], lambda: None)


def test_tcp_transport_tls_and_proofs(tls_certs: Certs) -> None:
    files = TlsFiles(tls_certs.node.cert, tls_certs.node.key, tls_certs.ca)
    secret = ClusterSecret(b"s" * 32)
    request = pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=[b"a", b"b"], local_only=True)

    def alloc(n: int, page_bytes: int, reply: pb.DataHeader) -> list[memoryview]:
        return [memoryview(bytearray(page_bytes)) for _ in range(n)]

    async def run() -> None:
        server = TcpTransport(server_tls=lambda: server_context(files, require_client_cert=True),
                              verify=lambda token: secret.verify(token, "transport"))
        endpoint = await server.start("127.0.0.1", 0, _served)
        good = TcpTransport(client_tls=lambda: peer_context(files), prove=lambda: secret.sign("transport", "b"))
        try:
            reply, pages = await good.fetch(endpoint, request, alloc)
            assert list(reply.found) == [True, True] and bytes(pages[0]) == b"\x07" * 8
            # the same connection is reused for the next pull (one proof per connection)
            await good.fetch(endpoint, request, alloc)
            assert good.connections() == 1
            strangers = [
                TcpTransport(client_tls=lambda: peer_context(files)),  # no proof: a raw GET
                TcpTransport(client_tls=lambda: peer_context(files),
                             prove=lambda: ClusterSecret(b"x" * 32).sign("transport", "b")),  # another secret
                TcpTransport(client_tls=lambda: client_context(tls_certs.ca),  # no client certificate
                             prove=lambda: secret.sign("transport", "b")),
                TcpTransport(prove=lambda: secret.sign("transport", "b")),  # plaintext
            ]
            for stranger in strangers:
                with pytest.raises(TransportError):
                    await stranger.fetch(endpoint, request, alloc)
                await stranger.close()
        finally:
            await good.close()
            await server.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_secured_peer_plane_never_picks_ucx() -> None:
    assert resolve_transport("auto", secure=True) == "tcp"
    assert isinstance(make_transport("auto", secure=True), TcpTransport)
    with pytest.raises(RuntimeError, match="cannot carry TLS"):
        resolve_transport("ucx", secure=True)


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mtls"])
def test_two_node_tls_cluster_pulls_over_tls(make_server, tls_certs: Certs, tmp_path: Path,
                                             client_auth: bool) -> None:
    secret = tmp_path / "cluster.secret"
    secret.write_text("a-cluster-secret-of-enough-bytes\n")
    common = dict(transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0, capacity=16 << 20,
                  cluster_secret_file=str(secret), **tls_certs.node_settings(client_auth))
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    wait_until(lambda: a.call(lambda: len(a.server.agent.membership.live_ids())) == 2
               and b.call(lambda: len(b.server.agent.membership.live_ids())) == 2, 15, "the TLS nodes to meet")
    pages = random_pages(10, PAGE, seed=9)
    with client(a, tls_certs, cert=client_auth, data_path="tcp") as ka, \
            client(b, tls_certs, cert=client_auth, data_path="tcp") as kb:
        ka.create_namespace("m", PAGE)
        kb.create_namespace("m", PAGE)
        ka.put("m", keys_for(10), pages)
        # b pulls them from a over the TLS transport once a's report reached the directory
        wait_until(lambda: kb.get("m", keys_for(10)).found.all(), 15, "b to pull a's pages")
        assert np.array_equal(kb.get("m", keys_for(10), local_only=True).pages, pages)
        assert kb.stats("m").namespaces[0].replica_slots == 10
    transport = b.server.agent.transport
    assert isinstance(transport, TcpTransport) and transport._client_tls is not None
    for srv in (a, b):
        check_pools_sound(srv)


# ---- reload -------------------------------------------------------------------------------------

def _serial(srv, ca: str) -> int:  # type: ignore[no-untyped-def]
    with socket.create_connection(("127.0.0.1", srv.server.data_port), timeout=5) as raw:
        with client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    return hash(der)


def test_replaced_certificate_is_served_to_new_connections(make_server, tls_certs: Certs, tmp_path: Path) -> None:
    cert, key = tmp_path / "node.pem", tmp_path / "node.key"
    shutil.copy(tls_certs.node.cert, cert)
    shutil.copy(tls_certs.node.key, key)
    srv = make_server(tls_cert=str(cert), tls_key=str(key), tls_ca=tls_certs.ca)
    with client(srv, tls_certs) as kv:
        assert kv.health() == "SERVING"
    before = _serial(srv, tls_certs.ca)
    # a node certificate of another CA replaces the files
    fresh = make_certs(tmp_path / "next")
    shutil.copy(fresh.node.key, key)
    shutil.copy(fresh.node.cert, cert)
    later = time.time() + 5
    os.utime(cert, (later, later))
    os.utime(key, (later, later))
    assert _serial(srv, fresh.ca) != before  # data channel: the new certificate, verified by the new CA
    with KvClient(srv.address, tls_ca=fresh.ca, timeout=5) as kv:  # gRPC: a new connection, the new files
        assert kv.health() == "SERVING"
    with client(srv, tls_certs) as kv, pytest.raises(Unavailable):
        kv.health()  # the old CA no longer verifies what the node serves


# ---- start-up rule and metrics ----------------------------------------------------------------------

def test_node_refuses_to_listen_beyond_loopback_without_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    code = kvstored.main(["--listen", "0.0.0.0:0", "--device", "cpu", "--capacity", "16MiB", "--log-level", "error"])
    err = capsys.readouterr().err
    assert code == 1
    assert "refusing to listen on 0.0.0.0:0" in err
    for missing in ("--tls-cert", "--token-file", "--cluster-secret-file", "--insecure"):
        assert missing in err


def test_insecure_node_starts_with_a_loud_warning(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon("--listen", "0.0.0.0:0", "--insecure", "true", "--metrics-port", "0")
    assert d.fields["mode"] == "insecure"
    with KvClient(f"127.0.0.1:{d.address.rpartition(':')[2]}", timeout=10) as kv:
        assert kv.wait_ready(10) == "SERVING"
    assert "WARNING" in d.log_text() and "INSECURE" in d.log_text()


def test_development_mode_on_loopback_says_so(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon("--metrics-port", "0")
    assert (d.fields["mode"], d.fields["tls"]) == ("development", "off")
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.fields['metrics_port']}/metrics", timeout=5).read()
    assert b"kvstore_" in body


def test_metrics_bind_loopback_unless_tls_or_insecure(make_server) -> None:
    srv = make_server(metrics_port=0)
    assert srv.server._metrics_http.server_address[0] == "127.0.0.1"


def test_metrics_over_https_with_tls(make_server, tls_certs: Certs) -> None:
    srv = tls_node(make_server, tls_certs, metrics_port=0)
    url = f"https://127.0.0.1:{srv.server.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=5, context=client_context(tls_certs.ca)).read()
    assert b"kvstore_" in body
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=5).read()


def test_tls_daemon_and_kvctl(daemon, tls_certs: Certs, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    d = daemon(*tls_certs.node_flags(client_auth=True))
    assert d.fields["tls"] == "on"
    flags = ["--addr", d.address, "--tls-ca", tls_certs.ca, "--tls-cert", tls_certs.client.cert,
             "--tls-key", tls_certs.client.key]
    assert kvctl.main(["health", *flags]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert kvctl.main(["health", "--addr", d.address, "--tls-ca", tls_certs.ca]) == 1  # no client certificate
