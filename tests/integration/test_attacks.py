"""An attacker's probes on a real 3-node cluster on 127.0.0.1
with a cluster secret and a token file: a caller without the secret cannot
heartbeat, take the coordinator role, Replicate or DropSpeculative, and a
signed call cannot be bent to another method, body or node. Before node
identity, a single forged heartbeat with a lower id made every node name
the forger coordinator within half a second."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import keys_for, random_pages, wait_until
from kvstore.security.identity import METADATA_KEY, ClusterSecret
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.integration.test_tenants import PAGE, TOKENS, Caller, write_tokens

SECRET = b"test-cluster-secret-0123456789"
FAST = {"heartbeat_interval": 0.1, "heartbeat_timeout": 0.8}


@pytest.fixture
def secured(tmp_path: Path, make_server):  # type: ignore[no-untyped-def]
    """Nodes b, c, d holding the cluster secret (c and d know b), with tokens."""
    secret_file, token_file = tmp_path / "secret", tmp_path / "tokens.toml"
    secret_file.write_bytes(SECRET + b"\n")
    write_tokens(token_file, TOKENS)
    common = dict(cluster_secret_file=str(secret_file), token_file=str(token_file), **FAST)
    b = make_server(node_id="b", **common)
    c = make_server(node_id="c", peers=(b.address,), **common)
    d = make_server(node_id="d", peers=(b.address,), **common)
    nodes = (b, c, d)
    wait_until(lambda: all(live(n) == ["b", "c", "d"] for n in nodes), 10, "the signed cluster to converge",
               lambda: [live(n) for n in nodes])
    return nodes


def create_on(srv, token: str, name: str) -> None:  # type: ignore[no-untyped-def]
    caller = Caller(srv.address, token)
    try:
        caller.create(name)
    finally:
        caller.close()


def live(srv) -> list[str]:  # type: ignore[no-untyped-def]
    return srv.call(lambda: sorted(srv.server.agent.membership.live_ids()))


def coordinator(srv) -> str:  # type: ignore[no-untyped-def]
    return srv.call(lambda: srv.server.agent.membership.coordinator())


def rejected(srv, plane: str = "peer") -> float:  # type: ignore[no-untyped-def]
    return srv.call(lambda: srv.server.metrics.auth_rejected.labels(plane)._value.get())


def cluster_call(address: str, method: str, request, proof: str | None = None):  # type: ignore[no-untyped-def]
    metadata = ((METADATA_KEY, proof),) if proof is not None else ()
    with grpc.insecure_channel(address) as channel:
        return getattr(pb_grpc.ClusterStub(channel), method)(request, metadata=metadata, timeout=5)


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def forged_heartbeat(node_id: str = "a") -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(sender=pb.MemberInfo(node_id=node_id, address="127.0.0.1:1", incarnation="evil"),
                               has_directory=True, full=True, seq=1)


def test_forged_heartbeat_does_not_become_coordinator_and_is_counted(secured) -> None:
    b, c, d = secured
    assert {coordinator(n) for n in secured} == {"b"}
    other_secret = ClusterSecret(b"not-the-cluster-secret-at-all")
    forged = forged_heartbeat()
    for proof in (None, "v1.YQ.1.00.00", other_secret.sign("Heartbeat", "a", forged.SerializeToString())):
        for node in secured:
            code = code_of(lambda: cluster_call(node.address, "Heartbeat", forged, proof))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(0.5)  # a few heartbeat rounds: before node identity the forger took over within 0.12-0.54 s
    for node in secured:
        assert coordinator(node) == "b" and live(node) == ["b", "c", "d"]
        assert rejected(node) >= 3
    assert b.call(lambda: "a" not in b.server.agent.directory.nodes())


def test_a_members_proof_cannot_claim_another_node(secured) -> None:
    """Even with the secret, a heartbeat's sender must be the node that signed it."""
    b = secured[0]
    forged = forged_heartbeat("a")
    proof = ClusterSecret(SECRET).sign("Heartbeat", "c", forged.SerializeToString())
    assert code_of(lambda: cluster_call(b.address, "Heartbeat", forged, proof)) == grpc.StatusCode.UNAUTHENTICATED
    assert coordinator(b) == "b"


def test_forged_replicate_and_drop_speculative_are_rejected(secured) -> None:
    b, c, _ = secured
    owner = Caller(b.address, "acme-write")
    try:
        for node in (b, c):
            create_on(node, "acme-write", "m")
        keys = keys_for(4)
        owner.put("m", keys, random_pages(4, PAGE))
    finally:
        owner.close()
    replicate = pb.ReplicateRequest(namespace="acme/m", keys=keys, source_node_id="b")
    drop = pb.DropSpeculativeRequest(namespace="acme/m", keys=keys)
    heartbeat_proof = ClusterSecret(SECRET).sign("Heartbeat", "b", replicate.SerializeToString())
    other_body = ClusterSecret(SECRET).sign("Replicate", "b", b"another request")
    for proof in (None, "garbage", heartbeat_proof, other_body):
        assert code_of(lambda: cluster_call(c.address, "Replicate", replicate, proof)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: cluster_call(c.address, "DropSpeculative", drop, proof)) == \
            grpc.StatusCode.UNAUTHENTICATED
    assert c.call(lambda: len(c.node.namespace("acme/m").pool)) == 0  # nothing was copied
    assert rejected(c) >= 8
    # signed by a member, for this method and these bytes: accepted (and only once)
    proof = ClusterSecret(SECRET).sign("Replicate", "b", replicate.SerializeToString())
    assert cluster_call(c.address, "Replicate", replicate, proof).copied == 4
    assert code_of(lambda: cluster_call(c.address, "Replicate", replicate, proof)) == \
        grpc.StatusCode.UNAUTHENTICATED  # replayed


def test_locate_and_status_need_credentials(secured) -> None:
    b = secured[0]
    assert code_of(lambda: cluster_call(b.address, "Locate", pb.LocateRequest(namespace="acme/m", keys=[b"k"]))) \
        == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: cluster_call(b.address, "Status", pb.ClusterStatusRequest())) == \
        grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(b.address) as channel:
        stub = pb_grpc.ClusterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Status(pb.ClusterStatusRequest(), metadata=(("authorization", "Bearer acme-write"),), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = stub.Status(pb.ClusterStatusRequest(), metadata=(("authorization", "Bearer ops-admin"),), timeout=5)
    assert reply.coordinator == "b" and len(reply.members) == 3


def test_tenants_work_across_the_signed_cluster(secured) -> None:
    """The members' own signed calls (heartbeats, directory lookups) pass:
    a tenant's Lookup on one node sees its pages on another."""
    b, c, _ = secured
    writer, reader = Caller(b.address, "acme-write"), Caller(c.address, "acme-read")
    other = Caller(c.address, "globex-write")
    try:
        writer.create("m")
        create_on(c, "acme-write", "m")
        other.create("m")
        keys = keys_for(6, b"shared-prompt")
        writer.put("m", keys, random_pages(6, PAGE))

        def seen_by_c() -> int:
            reply = reader.Lookup(pb.LookupRequest(namespace="m", keys=keys))
            return max((n.prefix_length for n in reply.nodes), default=0)
        wait_until(lambda: seen_by_c() == 6, 10, "c's lookup to see b's pages")
        theirs = other.Lookup(pb.LookupRequest(namespace="m", keys=keys))  # same name, same keys, other tenant
        assert max((n.prefix_length for n in theirs.nodes), default=0) == 0
    finally:
        for caller in (writer, reader, other):
            caller.close()
