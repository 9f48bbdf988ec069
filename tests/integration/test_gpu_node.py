"""A node whose pool lives on the GPU: puts and gets over both client data
paths and a replicate between two GPU nodes over each transport, byte for
byte. Skipped cleanly without CuPy or a CUDA device."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

import grpc  # noqa: E402

from tests.conftest import check_pools_sound, keys_for, random_pages  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc  # noqa: E402
from kvstore_client import KvClient  # noqa: E402


@pytest.fixture
def gpu_server(make_server):  # type: ignore[no-untyped-def]
    def make(**overrides):  # type: ignore[no-untyped-def]
        srv = make_server(ops="cupy", **overrides)
        assert srv.node.ops.device == "cuda:0" and not srv.node.ops.host_visible
        return srv

    return make


@pytest.mark.parametrize("path", ["tcp", "grpc"])
def test_gpu_pool_round_trip(gpu_server, path: str) -> None:  # type: ignore[no-untyped-def]
    srv = gpu_server(capacity=256 << 20)
    with KvClient(srv.address, data_path=path) as kv:
        kv.create_namespace("m", 1 << 20)
        pages = random_pages(64, 1 << 20)
        assert kv.put("m", keys_for(64), pages).stored == 64
        got = kv.get("m", keys_for(64) + [b"absent"])
        assert got.found.tolist() == [True] * 64 + [False]
        assert np.array_equal(got.pages[:64], pages)
    check_pools_sound(srv)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_gpu_replicate(gpu_server, transport: str) -> None:  # type: ignore[no-untyped-def]
    common = dict(transport=transport, heartbeat_interval=0.05, heartbeat_timeout=2.0, capacity=128 << 20)
    a = gpu_server(node_id="a", **common)
    b = gpu_server(node_id="b", peers=(a.address,), **common)
    pages = random_pages(32, 1 << 20, seed=7)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 1 << 20)
    deadline = time.monotonic() + 10
    while b.call(lambda: len(b.server.agent.membership.live_ids())) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with KvClient(a.address) as ka, KvClient(b.address) as kb, grpc.insecure_channel(b.address) as ch:
        ka.put("m", keys_for(32), pages)
        reply = pb_grpc.ClusterStub(ch).Replicate(
            pb.ReplicateRequest(namespace="m", keys=keys_for(32), source_node_id="a"), timeout=30)
        assert reply.copied == 32
        got = kb.get("m", keys_for(32), local_only=True)
        assert got.found.all() and np.array_equal(got.pages, pages)
