"""Cluster RPCs to other nodes: one cached channel per address, and every
failure translated into the :class:`~kvstore.errors.KvError` family.

The agent heartbeats and asks the coordinator through it; the coordinator
carries out its placements through it (:meth:`PeerClient.replicate`,
:meth:`PeerClient.drop_speculative`), knowing nothing else of the agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.cluster.membership import Membership
from kvstore.errors import Unavailable
from kvstore.rpc import CHANNEL_OPTIONS, from_rpc_error
from kvstore.security.identity import METADATA_KEY
from kvstore import tracing
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


_RESET_GRACE_S = 5.0  # calls in flight on a reset channel may finish (they have their own timeouts)


class PeerClient:
    """Calls the ``kvstore.v1.Cluster`` service of peers by address or by id.

    A channel to a peer that went away backs off its reconnects (gRPC's
    default grows to two minutes); here the backoff is capped at
    ``reconnect_s``, and :meth:`reset` drops a channel at once when the peer
    is heard from again (a restart on the same address), so a returning node
    is reached within a heartbeat, however long it was down.

    With ``sign`` (``sign(method, request_bytes) -> proof``, the cluster
    secret's), every call carries its proof in ``x-kvstore-peer``."""

    def __init__(self, membership: Membership, reconnect_s: float = 1.0,
                 sign: Callable[[str, bytes], str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self._membership = membership
        self._sign = sign
        # TLS to peers (the node has a certificate): the cluster CA verifies the peer and its listen host (the
        # SAN rule), the node's own certificate is the client certificate. None: plaintext channels.
        self._credentials = credentials
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.ClusterStub]] = {}
        backoff_ms = max(50, int(reconnect_s * 1000))
        self._options = CHANNEL_OPTIONS + [("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
                                           ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
                                           ("grpc.max_reconnect_backoff_ms", backoff_ms)]
        self._closing: set[asyncio.Task[None]] = set()

    def _stub(self, address: str) -> pb_grpc.ClusterStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address, options=self._options) if self._credentials is None \
                else grpc.aio.secure_channel(address, self._credentials, options=self._options)
            entry = self._channels[address] = (channel, pb_grpc.ClusterStub(channel))
        return entry[1]

    def reset(self, address: str) -> None:
        """Drop the channel to ``address`` (the next call connects afresh)."""
        entry = self._channels.pop(address, None)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(entry[0].close(grace=_RESET_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def call_address(self, address: str, method: str, request: Any, timeout: float) -> Any:
        """One Cluster RPC to ``address``; raises a :class:`KvError`."""
        metadata = tracing.metadata()  # the caller's trace context, if a span is recording
        if self._sign is not None:  # a fresh proof per call, over the bytes the stub sends
            metadata += ((METADATA_KEY, self._sign(method, request.SerializeToString())),)
        try:
            return await getattr(self._stub(address), method)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, f"{method} at {address}") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this caller was cancelled
            # the call's channel was closed under it (reset): a failed call, not a cancelled caller
            raise Unavailable(f"{method} at {address}: its channel was reset") from None

    async def call(self, node_id: str, method: str, request: Any, timeout: float) -> Any:
        """One Cluster RPC to a live member; :class:`Unavailable` if it is not one."""
        member = self._membership.member(node_id)
        if member is None:
            raise Unavailable(f"{node_id[:100]} is not a live member")
        return await self.call_address(member.address, method, request, timeout)

    async def replicate(self, node_id: str, request: pb.ReplicateRequest, timeout: float) -> pb.ReplicateResponse:
        """Ask ``node_id`` to copy pages to itself (it pulls them)."""
        return await self.call(node_id, "Replicate", request, timeout)

    async def drop_speculative(self, node_id: str, request: pb.DropSpeculativeRequest,
                               timeout: float) -> pb.DropSpeculativeResponse:
        """Ask ``node_id`` to drop unread speculative replicas."""
        return await self.call(node_id, "DropSpeculative", request, timeout)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
