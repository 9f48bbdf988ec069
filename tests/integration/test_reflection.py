"""gRPC server reflection on a real node: a tool lists the services and reads the API's descriptors
without the proto file; on a node with a token file only an admin token may."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.integration.test_tenants import TOKENS, write_tokens


def _list(address: str, token: str | None = None) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            metadata=metadata, timeout=10)
        return [s.name for reply in replies for s in reply.list_services_response.service]


def test_a_tool_reads_the_api_without_the_proto_file(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server()
    assert {"kvstore.v1.KvStore", "kvstore.v1.Cluster", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(_list(srv.address))
    with grpc.insecure_channel(srv.address) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))  # descriptors fetched from the node
        service = pool.FindServiceByName("kvstore.v1.KvStore")
        assert {"Put", "Get", "Lookup", "CreateNamespace"} <= {m.name for m in service.methods}
        assert [f.name for f in pool.FindMessageTypeByName("kvstore.v1.GetRequest").fields][:2] == ["namespace", "keys"]


def test_reflection_needs_an_admin_token_where_tokens_are_required(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tokens = tmp_path / "tokens.toml"
    write_tokens(tokens, TOKENS)
    srv = make_server(token_file=str(tokens))
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("acme-read", grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as refused:
            _list(srv.address, token)
        assert refused.value.code() == code
    assert "kvstore.v1.KvStore" in _list(srv.address, "ops-admin")
