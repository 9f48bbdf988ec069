"""The ``kvstore.v1.Cluster`` gRPC service: node-to-node control calls.

Peers are checked like clients: every request's names, keys, counts, enum
values and durations are validated first, and a bad one is
INVALID_ARGUMENT with a bounded message (:mod:`kvstore.cluster.checks`).
"""

from __future__ import annotations

from typing import Any

import grpc

from kvstore.cluster.agent import ClusterAgent
from kvstore.cluster.checks import check_claim_seconds, check_heartbeat, check_replicate
from kvstore.errors import KvError, Unavailable, bounded
from kvstore.node import page_kind
from kvstore.pool.pool import PageKind
from kvstore.tracing import TRACER, SpanKind, context_from
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


async def _abort(context: grpc.aio.ServicerContext, exc: KvError) -> None:
    await context.abort(exc.code, bounded(str(exc)))
    raise AssertionError("unreachable")  # abort raises


class ClusterService(pb_grpc.ClusterServicer):
    def __init__(self, agent: ClusterAgent) -> None:
        self.agent = agent

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        try:
            check_heartbeat(request, self.agent.config.max_batch_pages)
            return self.agent.on_heartbeat(request)
        except KvError as exc:
            await _abort(context, exc)
            raise

    async def Locate(self, request: pb.LocateRequest, context: Any) -> pb.LocateResponse:
        try:
            self.agent.check_keys(request.namespace, request.keys)
            reply = self.agent.on_locate(request.namespace, list(request.keys))
            self._check_warm(any(not h.node_ids for h in reply.holders))
            return reply
        except KvError as exc:
            await _abort(context, exc)
            raise

    async def ClusterLookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        try:
            self.agent.check_keys(request.namespace, request.keys)
            check_claim_seconds(request.claim_seconds, self.agent.config.max_claim_seconds)
            nodes = self.agent.prefixes(request.namespace, list(request.keys), request.claim_node_id,
                                        request.claim_seconds, min(request.claim_start, len(request.keys)),
                                        request.record)
            self._check_warm(max((n.prefix_length for n in nodes), default=0) < len(request.keys))
            return pb.LookupResponse(nodes=nodes)
        except KvError as exc:
            await _abort(context, exc)
            raise

    def _check_warm(self, incomplete: bool) -> None:
        """An answer that misses pages, from a directory copy that just took
        its role and lacks a live member's report, is UNAVAILABLE instead,
        so the asker tries the other copy."""
        if incomplete and self.agent.warming():
            raise Unavailable("the directory here is still warming up (its role is new); ask the other copy")

    async def Status(self, request: pb.ClusterStatusRequest, context: Any) -> pb.ClusterStatusResponse:
        return self.agent.status()

    async def DropSpeculative(self, request: pb.DropSpeculativeRequest,
                              context: grpc.aio.ServicerContext) -> pb.DropSpeculativeResponse:
        try:
            ns = self.agent.node.namespace(request.namespace)
            self.agent.node.check_read_batch(ns, list(request.keys))
        except KvError as exc:
            await _abort(context, exc)
            raise
        return pb.DropSpeculativeResponse(dropped=len(ns.pool.drop_speculative(list(request.keys))))

    async def Replicate(self, request: pb.ReplicateRequest, context: grpc.aio.ServicerContext) -> pb.ReplicateResponse:
        with TRACER.start_as_current_span("kvstore.replicate", context=context_from(context.invocation_metadata()),
                                          kind=SpanKind.SERVER,
                                          attributes={"kvstore.pages": len(request.keys),
                                                      "kvstore.source": request.source_node_id}):
            return await self._replicate(request, context)

    async def _replicate(self, request: pb.ReplicateRequest, context: grpc.aio.ServicerContext) -> pb.ReplicateResponse:
        try:
            kind = page_kind(request.kind, PageKind.REPLICA)
            self.agent.node.check_read_batch(self.agent.node.namespace(request.namespace), list(request.keys))
            check_replicate(request, self.agent.config.max_pin_ttl * 1000)
            return await self.agent.replicator.replicate(request.namespace, list(request.keys),
                                                         request.source_node_id, kind, request.ttl_seconds)
        except KvError as exc:
            await _abort(context, exc)
            raise
