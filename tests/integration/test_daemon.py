"""Real ``kvstored`` processes: start-up, health, metrics, kvctl, SIGTERM,
and graceful shutdown of in-flight calls."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import keys_for, random_pages
from kvstore.config import NodeConfig
from kvstore.ops.numpy_ops import NumpyPageOps
from kvstore.server.app import NodeServer
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient


def test_daemon_serves_and_exits_0_on_sigterm(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon("--namespace", "demo:1MiB:32MiB", "--metrics-port", "0")
    with KvClient(d.address) as kv:
        assert kv.wait_ready() == "SERVING"
        assert kv.health("kvstore.v1.KvStore") == "SERVING"
        pages = random_pages(16, 1 << 20)
        assert kv.put("demo", keys_for(16), pages).stored == 16
        assert np.array_equal(kv.get("demo", keys_for(16)).pages, pages)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.fields['metrics_port']}/metrics", timeout=5).read()
    text = metrics.decode()
    assert 'kvstore_operations_total{code="OK",op="put"}' in text
    assert 'kvstore_pool_slots{namespace="demo",state="used"} 16.0' in text
    assert "kvstore_operation_latency_seconds_bucket" in text
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", d.address],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "16/32" in out.stdout
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0


def test_sigint_also_exits_0(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon()
    with KvClient(d.address) as kv:
        kv.wait_ready()
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(15) == 0


@pytest.mark.parametrize("argv, message", [
    (["--capacity", "lots"], "bad size"),
    (["--peers", "a:1,nohost"], "HOST:PORT"),
    (["--device", "tpu"], "bad device"),
    (["--namespace", "x"], "NAME:PAGE_BYTES"),
])
def test_bad_flags_exit_2_with_a_message(argv: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvstored", *argv], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


def test_busy_port_fails_cleanly(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon()
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvstored", "--listen", d.address, "--device", "cpu",
                          "--capacity", "1MiB"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "kvstored:" in out.stderr and "Traceback" not in out.stderr


def test_graceful_stop_finishes_in_flight_get() -> None:
    """Health flips to NOT_SERVING at once; a Get stream already running
    completes; new calls are refused; stop returns within the grace."""

    async def scenario() -> None:
        cfg = NodeConfig(listen="127.0.0.1:0", capacity=64 << 20, device="cpu", prefault=False,
                         max_message_bytes=1 << 20)
        server = NodeServer(cfg, NumpyPageOps())
        await server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.KvStoreStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            await stub.CreateNamespace(pb.CreateNamespaceRequest(
                namespace="m", layout=pb.PageLayout(page_bytes=512 << 10)))
            pages = random_pages(16, 512 << 10)
            await stub.Put(iter([pb.PutRequest(namespace="m", keys=keys_for(16)[i:i + 1], pages=[pages[i].tobytes()])
                                 for i in range(16)]))
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stream = stub.Get(pb.GetRequest(namespace="m", keys=keys_for(16)))
            first = await stream.read()  # the call is in flight
            stopping = asyncio.ensure_future(server.stop(grace=10))
            # a router watching health sees the node leave before it stops
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            got = list(first.keys)
            while (msg := await stream.read()) is not grpc.aio.EOF:
                got.extend(msg.keys)
            assert got == keys_for(16)
            await asyncio.wait_for(stopping, 15)
        assert server.node is not None and not server.node.leases

    asyncio.run(asyncio.wait_for(scenario(), 60))
