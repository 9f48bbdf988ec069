"""Tenants on one node with a token file: roles, isolation, quotas, rotation.

Each test is an attacker's probe (or the owner's view of it) on a real node
on 127.0.0.1, through raw gRPC stubs with ``authorization`` metadata; on a
node without tokens every one of them succeeded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import keys_for, random_pages, wait_until
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20
PAGE = 4096

TOKENS = """
[[token]]
token = "acme-write"
tenant = "acme"
role = "write"

[[token]]
token = "acme-read"
tenant = "acme"
role = "read"

[[token]]
token = "globex-write"
tenant = "globex"
role = "write"

[[token]]
token = "ops-admin"
tenant = "ops"
role = "admin"

[tenant.acme]
max_bytes = "8MiB"
max_namespaces = 3
"""


def write_tokens(path: Path, text: str) -> None:
    """Replace the token file as an operator would (a new file renamed over the old)."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


class Caller:
    """Raw KvStore calls to one node with one token."""

    def __init__(self, address: str, token: str | None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.KvStoreStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()

    def __getattr__(self, method: str):  # type: ignore[no-untyped-def]
        fn = getattr(self.stub, method)
        return lambda request, **kw: fn(request, metadata=self.metadata, timeout=10, **kw)

    def create(self, name: str, capacity: int = MiB, **kw) -> pb.NamespaceInfo:  # type: ignore[no-untyped-def]
        return self.CreateNamespace(pb.CreateNamespaceRequest(
            namespace=name, layout=pb.PageLayout(page_bytes=PAGE), capacity_bytes=capacity, **kw))

    def put(self, name: str, keys: list[bytes], pages) -> pb.PutResponse:  # type: ignore[no-untyped-def]
        return self.Put(iter([pb.PutRequest(namespace=name, keys=keys, pages=[bytes(p) for p in pages])]))

    def get(self, name: str, keys: list[bytes]) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for msg in self.Get(pb.GetRequest(namespace=name, keys=keys)):
            out.update(zip(msg.keys, msg.pages))
        return out

    def close(self) -> None:
        self.channel.close()


def status_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    write_tokens(path, TOKENS)
    return path


@pytest.fixture
def tenant_node(make_server, token_file):  # type: ignore[no-untyped-def]
    return make_server(token_file=str(token_file))


@pytest.fixture
def callers(tenant_node) -> Iterator:  # type: ignore[type-arg]
    made: list[Caller] = []

    def make(token: str | None) -> Caller:
        made.append(Caller(tenant_node.address, token))
        return made[-1]

    yield make
    for c in made:
        c.close()


def rejected(srv, plane: str) -> float:  # type: ignore[no-untyped-def]
    return srv.call(lambda: srv.server.metrics.auth_rejected.labels(plane)._value.get())


# ---- authentication and roles --------------------------------------------------------
def test_no_token_or_a_wrong_one_is_unauthenticated_and_counted(tenant_node, callers) -> None:
    for token in (None, "", "guess", "acme-write-but-longer"):
        caller = callers(token)
        assert code_of(lambda: caller.ListNamespaces(pb.ListNamespacesRequest())) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: caller.create("m")) == grpc.StatusCode.UNAUTHENTICATED
    assert rejected(tenant_node, "client") == 8
    with pytest.raises(grpc.RpcError) as info:
        callers("secret-guess-123").NodeInfo(pb.NodeInfoRequest())
    assert "secret-guess-123" not in (info.value.details() or "")


def test_health_stays_open(tenant_node) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(tenant_node.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_read_only_token_cannot_put_create_or_delete(callers) -> None:
    writer, reader = callers("acme-write"), callers("acme-read")
    writer.create("m")
    keys = keys_for(4)
    pages = random_pages(4, PAGE)
    writer.put("m", keys, pages)
    assert code_of(lambda: reader.put("m", keys_for(2, b"r"), pages[:2])) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: reader.create("m2")) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: reader.Delete(pb.KeysRequest(namespace="m", keys=keys))) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: reader.DeleteNamespace(pb.DeleteNamespaceRequest(namespace="m"))) == \
        grpc.StatusCode.PERMISSION_DENIED
    got = reader.get("m", keys)  # what it may do, it does
    assert got == {k: bytes(p) for k, p in zip(keys, pages)}
    assert reader.Lookup(pb.LookupRequest(namespace="m", keys=keys)).prefix_length == 4


# ---- isolation ------------------------------------------------------------------------
def test_equal_keys_of_two_tenants_never_share_a_page(callers) -> None:
    """Poisoning: the attacker puts the owner's keys first in "the same" namespace."""
    attacker, owner = callers("globex-write"), callers("acme-write")
    keys = keys_for(8, b"prompt")
    attacker.create("m")
    poison = random_pages(8, PAGE, seed=1)
    assert attacker.put("m", keys, poison).stored == 8
    owner.create("m")  # squatting the name did not block it
    mine = random_pages(8, PAGE, seed=2)
    reply = owner.put("m", keys, mine)
    assert (reply.stored, reply.already_present) == (8, 0)
    assert owner.get("m", keys) == {k: bytes(p) for k, p in zip(keys, mine)}
    assert attacker.get("m", keys) == {k: bytes(p) for k, p in zip(keys, poison)}


def test_another_tenants_namespace_looks_like_none(callers) -> None:
    owner, attacker = callers("acme-write"), callers("globex-write")
    owner.create("private")
    keys = keys_for(4)
    owner.put("private", keys, random_pages(4, PAGE))
    probes = {
        "get": lambda ns: attacker.get(ns, keys),
        "lookup": lambda ns: attacker.Lookup(pb.LookupRequest(namespace=ns, keys=keys)),
        "exists": lambda ns: attacker.Exists(pb.KeysRequest(namespace=ns, keys=keys)),
        "delete": lambda ns: attacker.Delete(pb.KeysRequest(namespace=ns, keys=keys)),
        "pin": lambda ns: attacker.Pin(pb.PinRequest(namespace=ns, keys=keys, ttl_seconds=5)),
        "describe": lambda ns: attacker.DescribeNamespace(pb.DescribeNamespaceRequest(namespace=ns)),
        "stats": lambda ns: attacker.Stats(pb.StatsRequest(namespace=ns)),
        "drop": lambda ns: attacker.DeleteNamespace(pb.DeleteNamespaceRequest(namespace=ns)),
        "put": lambda ns: attacker.put(ns, keys_for(1, b"x"), random_pages(1, PAGE)),
    }
    for what, probe in probes.items():
        for name in ("private", "no-such-namespace"):  # the same answer: existence does not leak
            with pytest.raises(grpc.RpcError) as info:
                probe(name)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, (what, name)
            assert "acme" not in info.value.details(), (what, info.value.details())
    for name in ("acme/private", "../acme/private"):  # the internal name is not a way in
        assert code_of(lambda: attacker.get(name, keys)) == grpc.StatusCode.INVALID_ARGUMENT
    listed = attacker.ListNamespaces(pb.ListNamespacesRequest())
    assert [ns.namespace for ns in listed.namespaces] == []
    assert [ns.namespace for ns in attacker.Stats(pb.StatsRequest()).namespaces] == []
    assert owner.Exists(pb.KeysRequest(namespace="private", keys=keys)).exists == [True] * 4  # untouched
    assert [ns.namespace for ns in owner.ListNamespaces(pb.ListNamespacesRequest()).namespaces] == ["private"]


def test_stats_node_wide_view_only_for_admin(callers) -> None:
    callers("acme-write").create("m", capacity=2 * MiB)
    tenant = callers("acme-read").Stats(pb.StatsRequest())
    assert [ns.namespace for ns in tenant.namespaces] == ["m"]
    assert tenant.reserved_bytes == 0 and not tenant.members  # other tenants' reservations do not show
    admin = callers("ops-admin").Stats(pb.StatsRequest())
    assert admin.reserved_bytes == 2 * MiB and len(admin.members) == 1
    assert [ns.namespace for ns in admin.namespaces] == []  # admin is still a tenant: no one else's pages


# ---- quotas -------------------------------------------------------------------------------
def test_capacity_grab_is_refused_beyond_the_quota(tenant_node, callers) -> None:
    acme, globex = callers("acme-write"), callers("globex-write")
    assert code_of(lambda: acme.create("big", capacity=9 * MiB)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert acme.create("a", capacity=6 * MiB).capacity_bytes == 6 * MiB
    rest = acme.create("rest", capacity=0)  # "all free capacity" is the quota's rest
    assert rest.capacity_bytes == 2 * MiB
    assert code_of(lambda: acme.create("c", capacity=PAGE)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert acme.create("a", capacity=6 * MiB, exist_ok=True).capacity_bytes == 6 * MiB  # a repeat is no new claim
    acme.DeleteNamespace(pb.DeleteNamespaceRequest(namespace="rest"))
    acme.create("b", capacity=MiB)
    acme.create("c", capacity=MiB)
    assert code_of(lambda: acme.create("d", capacity=PAGE)) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 3 namespaces
    total = tenant_node.call(lambda: tenant_node.node.config.capacity - tenant_node.node.reserved_bytes)
    assert globex.create("m", capacity=0).capacity_bytes == total  # no quota for globex: the node's rest


# ---- rotation -------------------------------------------------------------------------
def test_token_rotation_without_restart(tenant_node, callers, token_file) -> None:
    old = callers("acme-write")
    old.create("m")
    write_tokens(token_file, TOKENS.replace('token = "acme-write"', 'token = "acme-write-2"'))
    new = callers("acme-write-2")
    wait_until(lambda: status_of(lambda: old.ListNamespaces(pb.ListNamespacesRequest()))
               == grpc.StatusCode.UNAUTHENTICATED, 5, "the old token to be rejected")
    assert [ns.namespace for ns in new.ListNamespaces(pb.ListNamespacesRequest()).namespaces] == ["m"]
    write_tokens(token_file, "[[token]]\nthis is not toml")  # a broken file keeps the tokens in force
    time.sleep(1.2)
    assert [ns.namespace for ns in new.ListNamespaces(pb.ListNamespacesRequest()).namespaces] == ["m"]


def test_separator_in_a_client_name_is_refused(callers) -> None:
    assert code_of(lambda: callers("acme-write").create("a/b")) == grpc.StatusCode.INVALID_ARGUMENT


# ---- the shared-memory path ---------------------------------------------------------------
def shm_path(caller: Caller) -> str:
    endpoints = caller.NodeInfo(pb.NodeInfoRequest()).data_endpoints
    paths = [e.path for e in endpoints if e.protocol == "kvs-shm"]
    if not paths:
        pytest.skip("this node serves no shared memory (no memfd here)")
    return paths[0]


def test_shared_memory_needs_the_token_and_keeps_tenants_apart(tenant_node, callers, token_file) -> None:
    import numpy as np

    from kvstore.errors import NotFound, PermissionDenied, Unauthenticated
    from kvstore_client.shm import ShmConn

    writer = callers("acme-write")
    path = shm_path(writer)
    writer.create("m")
    keys = keys_for(4)
    pages = random_pages(4, PAGE)
    out = np.zeros((4, PAGE), dtype=np.uint8)
    anonymous = ShmConn(path, 5.0)
    with pytest.raises(Unauthenticated):
        anonymous.get("m", keys, out, None, True)
    anonymous.close()
    with pytest.raises(Unauthenticated):
        ShmConn(path, 5.0, token="guess").get("m", keys, out, None, True)
    acme = ShmConn(path, 5.0, token="acme-write")
    assert acme.put("m", keys, [memoryview(p) for p in pages], PAGE, 0).stored == 4
    assert acme.get("m", keys, out, None, True).all() and np.array_equal(out, pages)
    assert writer.get("m", keys) == {k: bytes(p) for k, p in zip(keys, pages)}  # the tenant's own "m"
    reader = ShmConn(path, 5.0, token="acme-read")
    out[:] = 0
    assert reader.get("m", keys, out, None, True).all() and np.array_equal(out, pages)
    assert not reader._pools["m"].flags.writeable  # a read-only mapping
    with pytest.raises(PermissionDenied):
        reader.put("m", keys_for(1, b"r"), [memoryview(pages[0])], PAGE, 0)
    globex = ShmConn(path, 5.0, token="globex-write")
    with pytest.raises(NotFound):
        globex.get("m", keys, out, None, True)
    write_tokens(token_file, TOKENS.replace('token = "acme-write"', 'token = "acme-write-2"'))
    time.sleep(1.2)
    with pytest.raises(Unauthenticated):  # the open connection stops working with its token
        acme.get("m", keys, out, None, True)
    for conn in (acme, reader, globex):
        conn.close()


# ---- the data channel -----------------------------------------------------------------------
def test_data_channel_keeps_tenants_apart(tenant_node, callers) -> None:
    from kvstore.errors import InvalidArgument, NotFound, PermissionDenied
    from kvstore_client import KvClient

    callers("acme-write").create("m")
    callers("globex-write").create("m")
    keys = keys_for(4, b"same-prompt")
    mine, theirs = random_pages(4, PAGE, seed=5), random_pages(4, PAGE, seed=6)
    with KvClient(tenant_node.address, token="globex-write", data_path="tcp") as globex, \
            KvClient(tenant_node.address, token="acme-write", data_path="tcp") as acme, \
            KvClient(tenant_node.address, token="acme-read", data_path="tcp") as reader:
        assert globex.put("m", keys, theirs).stored == 4  # poison attempt first
        reply = acme.put("m", keys, mine)
        assert (reply.stored, reply.already_present) == (4, 0)
        got = acme.get("m", keys)
        assert got.found.all() and (got.pages == mine).all()
        with pytest.raises(InvalidArgument):  # the internal name is not a way in
            globex.get("acme/m", keys)
        callers("acme-write").create("private")
        with pytest.raises(NotFound):
            globex.get("private", keys)
        with pytest.raises(PermissionDenied):
            reader.put("m", keys_for(1, b"r"), mine[:1])
        got = reader.get("m", keys)
        assert got.found.all() and (got.pages == mine).all()


def test_data_channel_connection_ends_when_its_token_is_rotated_out(tenant_node, callers, token_file) -> None:
    from kvstore.errors import Unauthenticated
    from kvstore_client import KvClient

    callers("acme-write").create("m")
    keys = keys_for(2, b"rot")
    with KvClient(tenant_node.address, token="acme-write", data_path="tcp") as acme:
        assert acme.put("m", keys, random_pages(2, PAGE)).stored == 2  # the connection is open
        write_tokens(token_file, TOKENS.replace('token = "acme-write"', 'token = "acme-write-2"'))
        time.sleep(1.2)  # the store re-reads the file at most once a second
        with pytest.raises(Unauthenticated):
            acme.get("m", keys)


def test_client_with_a_token_uses_shared_memory(tenant_node, callers) -> None:
    from kvstore_client import KvClient

    shm_path(callers("acme-read"))  # skips without memfd
    callers("acme-write").create("m")
    keys = keys_for(3)
    pages = random_pages(3, PAGE, seed=7)
    with KvClient(tenant_node.address, token="acme-write", data_path="shm") as kv:
        assert kv.put("m", keys, pages).stored == 3
        got = kv.get("m", keys)
        assert got.found.all() and (got.pages == pages).all()
    assert tenant_node.call(lambda: len(tenant_node.node.namespace("acme/m").pool)) == 3
