"""The ``kvstore.v1.Cluster`` gRPC service: node-to-node control calls."""

from __future__ import annotations

from typing import Any

import grpc

from kvstore.cluster.agent import ClusterAgent
from kvstore.errors import KvError
from kvstore.pool.pool import PageKind
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class ClusterService(pb_grpc.ClusterServicer):
    def __init__(self, agent: ClusterAgent) -> None:
        self.agent = agent

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        return self.agent.on_heartbeat(request)

    async def Locate(self, request: pb.LocateRequest, context: Any) -> pb.LocateResponse:
        return self.agent.on_locate(request.namespace, list(request.keys))

    async def ClusterLookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(nodes=self.agent.prefixes(request.namespace, list(request.keys)))

    async def Status(self, request: pb.ClusterStatusRequest, context: Any) -> pb.ClusterStatusResponse:
        return self.agent.status()

    async def DropSpeculative(self, request: pb.DropSpeculativeRequest,
                              context: grpc.aio.ServicerContext) -> pb.DropSpeculativeResponse:
        try:
            ns = self.agent.node.namespace(request.namespace)
        except KvError as exc:
            await context.abort(exc.code, str(exc))
            raise AssertionError("unreachable")
        return pb.DropSpeculativeResponse(dropped=len(ns.pool.drop_speculative(list(request.keys))))

    async def Replicate(self, request: pb.ReplicateRequest, context: grpc.aio.ServicerContext) -> pb.ReplicateResponse:
        try:
            self.agent.node.check_read_batch(self.agent.node.namespace(request.namespace), list(request.keys))
            return await self.agent.replicator.replicate(request.namespace, list(request.keys), request.source_node_id,
                                              PageKind(request.kind or PageKind.REPLICA), request.ttl_seconds)
        except KvError as exc:
            await context.abort(exc.code, str(exc))
            raise AssertionError("unreachable")
