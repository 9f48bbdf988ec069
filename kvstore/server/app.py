"""One node's servers and their lifecycle: gRPC (+health), data channel, metrics.

Start order: pool/ops -> gRPC server (bound, port known) -> data channel ->
metrics -> health SERVING. Stop runs the other way in steps, like uvicorn and
gRPC's own guidance: health NOT_SERVING, stop accepting, let in-flight calls
finish within the grace period, cancel the rest, release leases.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvstore.cluster.agent import ClusterAgent
from kvstore.cluster.coordinator import Coordinator
from kvstore.cluster.service import ClusterService
from kvstore.config import NodeConfig, parse_hostport
from kvstore.datapath.server import DataServer
from kvstore.datapath.shm import ShmServer
from kvstore.metrics import NodeMetrics
from kvstore.node import Node
from kvstore.ops.auto import select as select_ops
from kvstore.ops.base import PageOps
from kvstore.rpc import BoundaryInterceptor, server_options
from kvstore.server.auth import AuthInterceptor
from kvstore.server.service import KvStoreService
from kvstore.transport.auto import make_transport
from kvstore.transport.base import Transport
from kvstore.transport.shaped import shape
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "kvstore.v1.KvStore"


class NodeServer:
    """A running ``kvstored``: ``async with NodeServer(cfg) as srv: ...``."""

    def __init__(self, config: NodeConfig, ops: PageOps | None = None) -> None:
        self.config = config
        self._ops = ops
        self.node: Node | None = None
        self.metrics: NodeMetrics | None = None
        self.agent: ClusterAgent | None = None
        self.coordinator: Coordinator | None = None
        self._coordinator_task: asyncio.Task[None] | None = None
        self.health = health_aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._data: DataServer | None = None
        self._shm: ShmServer | None = None
        self._metrics_http = None
        self.port = 0
        self.metrics_port: int | None = None
        self._stopping = False
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def data_port(self) -> int | None:
        return self._data.port if self._data is not None else None

    def _transport(self) -> Transport:
        """The peer transport, shaped to ``--link-rate``/``--link-latency`` when set."""
        return shape(make_transport(self.config.transport), self.config.link_rate, self.config.link_latency)

    async def start(self) -> None:
        """Bind everything and report SERVING; a second call does nothing."""
        if self._grpc is not None:
            return
        ops = self._ops or select_ops("auto", self.config.device)
        self.node = node = Node(self.config, ops)
        self.metrics = NodeMetrics(node)
        self.agent = agent = ClusterAgent(node, self.config, self._transport(), self.metrics)
        self.coordinator = Coordinator(self.config, agent.directory, agent.membership, agent.peers, self.metrics,
                                       page_bytes=self._page_bytes)
        agent.placement = self.coordinator
        self.metrics.watch_coordinator(self.coordinator)
        server = grpc.aio.server(options=server_options(self.config.max_message_bytes),
                                 interceptors=[BoundaryInterceptor(),
                                               AuthInterceptor.from_config(self.config, self.metrics)])
        pb_grpc.add_KvStoreServicer_to_server(KvStoreService(node, self.metrics, agent, lambda: self.data_port,
                                                             lambda: self._shm.path if self._shm else None),
                                              server)
        pb_grpc.add_ClusterServicer_to_server(ClusterService(agent), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        host, port = parse_hostport(self.config.listen)
        self.port = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC to {self.config.listen}")
        node.address = self.address
        if not self.config.node_id:
            node.node_id = self.address
        agent.self_info.node_id, agent.self_info.address = node.node_id, node.address
        await server.start()
        self._grpc = server
        if self.config.data_port >= 0:
            self._data = DataServer(node, self.metrics, agent.replicator, host, self.config.data_port)
            await self._data.start()
        if node.shares_memory:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{node.node_id}-{self.port}")[:80]
            self._shm = ShmServer(node, self.metrics, agent.replicator, self.config.shm_dir, name)
            await self._shm.start()
        await agent.start()
        self._coordinator_task = asyncio.get_running_loop().create_task(self.coordinator.run())
        if self.config.metrics_port >= 0:
            from prometheus_client import start_http_server

            self._metrics_http, _ = start_http_server(self.config.metrics_port, host, registry=self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvstored %s serving gRPC on %s, data channel port %s, metrics port %s, device %s",
                 node.node_id, self.address, self.data_port, self.metrics_port, ops.device)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown in steps; safe to call twice."""
        if self._grpc is None:
            return
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.config.grace if grace is None else grace
        await self.health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        if self._data is not None:
            await self._data.stop()
        if self._shm is not None:
            await self._shm.stop()
        await self._grpc.stop(grace)
        if self._coordinator_task is not None:
            self._coordinator_task.cancel()
            await asyncio.gather(self._coordinator_task, return_exceptions=True)
        if self.coordinator is not None:
            await self.coordinator.close()
        if self.agent is not None:
            await self.agent.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        assert self.node is not None
        self.node.close()
        log.info("kvstored %s stopped", self.node.node_id)
        self._stopped.set()

    def _page_bytes(self, namespace: str) -> int:
        assert self.node is not None
        ns = self.node.namespaces.get(namespace)
        return ns.layout.page_bytes if ns is not None else 0

    async def wait_closed(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> "NodeServer":
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop(grace=0)
