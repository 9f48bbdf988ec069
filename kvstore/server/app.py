"""One node's servers and their lifecycle: gRPC (+health), data channel, metrics.

Start order: pool/ops -> gRPC server (bound, port known) -> data channel ->
metrics -> health SERVING. Stop runs the other way in steps, like uvicorn and
gRPC's own guidance: health NOT_SERVING, stop accepting, let in-flight calls
finish within the grace period, cancel the rest, release leases.

Security (docs/security.md, "Transport security"): before anything binds,
:func:`~kvstore.security.tls.listen_mode` decides the node's mode
(``secure``, ``development`` on loopback, ``insecure`` with a loud warning)
or refuses to start. With a certificate every port speaks TLS: gRPC
(reloading credentials), the data channel and the TCP peer transport
(reloading contexts), metrics over HTTPS; without one, metrics bind to
loopback unless ``--insecure``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

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
from kvstore.security.identity import ClusterSecret
from kvstore.security.tls import (
    ReloadingContext, TlsFiles, grpc_channel_credentials, grpc_server_credentials, listen_mode, peer_context,
    server_context,
)
from kvstore.security.tokens import TokenStore
from kvstore.server.auth import AuthInterceptor
from kvstore.server.service import KvStoreService
from kvstore.transport.auto import make_transport
from kvstore.transport.base import Transport
from kvstore.transport.shaped import shape
from kvstore.v1 import kvstore_pb2 as pb
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
        self.mode = ""  # secure, development or insecure (listen_mode), once started
        self._tls = TlsFiles.of(config)
        self._server_tls: ReloadingContext | None = None
        self._tokens: TokenStore | None = None
        self._secret: ClusterSecret | None = None

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def data_port(self) -> int | None:
        return self._data.port if self._data is not None else None

    def _transport(self) -> Transport:
        """The peer transport, shaped to ``--link-rate``/``--link-latency`` when
        set; TLS both ways and a HELLO proof of the cluster secret on each
        connection when configured (which rules UCX out: auto picks TCP)."""
        cfg, tls, secret = self.config, self._tls, self._secret
        options: dict[str, Any] = {}
        if tls is not None:
            # peers prove themselves with their node certificate when there is a cluster CA
            peers_in = ReloadingContext(tls, lambda f: server_context(f, require_client_cert=bool(f.ca)))
            peers_out = ReloadingContext(tls, peer_context)
            options.update(server_tls=peers_in.get, client_tls=peers_out.get)
        if secret is not None:
            options.update(prove=lambda: secret.sign("transport", self.node.node_id if self.node else ""),
                           verify=lambda token: secret.verify(token, "transport"))
        transport = make_transport(cfg.transport, secure=tls is not None or secret is not None,
                                   insecure=cfg.insecure, **options)
        return shape(transport, cfg.link_rate, cfg.link_latency)

    async def start(self) -> None:
        """Bind everything and report SERVING; a second call does nothing."""
        if self._grpc is not None:
            return
        self.mode = listen_mode(self.config)  # raises RefusedToStart before anything binds
        if self.mode == "insecure":
            log.warning("INSECURE: listening on %s beyond loopback without TLS, client tokens and a cluster secret "
                        "(--insecure): anyone who reaches these ports can read, write and join. Never in production.",
                        self.config.listen)
        # the token file and the cluster secret, read once: every port and the peer client share them
        self._tokens, self._secret = TokenStore.from_config(self.config), ClusterSecret.from_config(self.config)
        transport = self._transport()
        ops = self._ops or select_ops("auto", self.config.device)
        self.node = node = Node(self.config, ops)
        self.metrics = NodeMetrics(node)
        credentials = grpc_channel_credentials(self._tls.ca, self._tls.cert, self._tls.key) if self._tls else None
        self.agent = agent = ClusterAgent(node, self.config, transport, self.metrics, secret=self._secret,
                                          credentials=credentials)
        self.coordinator = Coordinator(self.config, agent.directory, agent.membership, agent.peers, self.metrics,
                                       page_bytes=self._page_bytes)
        agent.placement = self.coordinator
        if self.config.replication == "predictive":  # a landed claim goes to its waiters as a copy tree
            agent.claims.tree_fanout = self.coordinator.plan_cfg.fanout
            agent.claims.tree_parts = self.coordinator.relay_parts
        self.metrics.watch_coordinator(self.coordinator)
        self.metrics.watch_cluster(agent)
        server = grpc.aio.server(options=server_options(self.config.max_message_bytes),
                                 interceptors=[BoundaryInterceptor(),
                                               AuthInterceptor(self._tokens, self._secret, self.metrics)])
        pb_grpc.add_KvStoreServicer_to_server(KvStoreService(node, self.metrics, agent, lambda: self.data_port,
                                                             lambda: self._shm.path if self._shm else None,
                                                             self._tokens),
                                              server)
        pb_grpc.add_ClusterServicer_to_server(ClusterService(agent), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # grpcurl and similar tools list and call the API without the proto file (admin only where tokens are)
        reflection.enable_server_reflection(
            [pb.DESCRIPTOR.services_by_name[name].full_name for name in ("KvStore", "Cluster")]
            + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        host, port = parse_hostport(self.config.listen)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._tls is not None:
            self._server_tls = ReloadingContext(self._tls, server_context)
            self.port = server.add_secure_port(bind, grpc_server_credentials(self._tls))
        else:
            self.port = server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind gRPC to {self.config.listen}")
        node.address = self.address
        if not self.config.node_id:
            node.node_id = self.address
        agent.self_info.node_id, agent.self_info.address = node.node_id, node.address
        await server.start()
        self._grpc = server
        if self.config.data_port >= 0:
            self._data = DataServer(node, self.metrics, agent.replicator, host, self.config.data_port,
                                    tls=self._server_tls.get if self._server_tls else None,
                                    authenticate=self._tokens.authenticate if self._tokens else None)
            await self._data.start()
        if node.shares_memory:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{node.node_id}-{self.port}")[:80]
            self._shm = ShmServer(node, self.metrics, agent.replicator, self.config.shm_dir, name, self._tokens)
            await self._shm.start()
        await agent.start()
        self._coordinator_task = asyncio.get_running_loop().create_task(self.coordinator.run())
        if self.config.metrics_port >= 0:
            # HTTPS with the node's certificate; plaintext only on loopback unless --insecure
            metrics_host = host if self._tls is not None or self.config.insecure or self.config.loopback_only \
                else "127.0.0.1"
            self._metrics_http = _metrics_server(self.config.metrics_port, metrics_host, self.metrics.registry,
                                                 self._server_tls.get if self._server_tls else None,
                                                 self.config.read_timeout)
            self.metrics_port = self._metrics_http.server_port
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvstored %s serving gRPC on %s, data channel port %s, metrics port %s, device %s, mode %s%s",
                 node.node_id, self.address, self.data_port, self.metrics_port, ops.device, self.mode,
                 ", TLS" if self._tls else "")

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


def _metrics_server(port: int, host: str, registry: Any, tls: Callable[[], ssl.SSLContext] | None,
                    read_timeout: float) -> Any:
    """Prometheus' exposition app (``make_wsgi_app``) on a threading WSGI server of the standard library;
    with ``tls`` (the node's reloading server context) HTTPS, each connection wrapped with the context
    current when it is accepted, its handshake done in the request's own thread."""
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app, start_http_server

    if tls is None:
        return start_http_server(port, host, registry=registry)[0]

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    class HttpsServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        def get_request(self) -> tuple[Any, Any]:
            sock, addr = self.socket.accept()
            sock.settimeout(read_timeout)
            return tls().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def handle_error(self, request: Any, client_address: Any) -> None:
            log.debug("metrics: a request from %s failed", client_address, exc_info=True)

    httpd = make_server(host, port, make_wsgi_app(registry), HttpsServer, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-https").start()
    return httpd
