"""Membership on etcd (``--membership etcd://HOST:PORT[,HOST:PORT][/PREFIX]``):
the I/O shell around :class:`~kvstore.cluster.membership.etcd_view.EtcdView`.

One session at a time against one etcd endpoint (the next one after a
failure): grant a lease of ``ceil(--heartbeat-timeout)`` seconds (or renew
the one still held), put this node's member key on it, list the prefix,
then three loops until one fails: renew the lease every third of its TTL,
watch the prefix from the listed revision, and campaign for the
coordinator key whenever it is vacant. A lost session is retried with
jittered exponential backoff (at most half a TTL); the view meanwhile stays
as it was, and this node stops acting as coordinator once its lease may
have expired. ``stop`` revokes the lease, so the others see the node leave
at once instead of a TTL later.

The stubs are etcd's own v3 API as ``aetcd`` ships them (generated for
current protobuf); its ``Client`` is not used because it dials one endpoint
in plaintext only, and ``etcds://`` needs TLS with this node's
``--tls-ca``/``--tls-cert``/``--tls-key`` (read at every connect, so
rotated files take effect on the next session).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from aetcd import rpc

from kvstore.cluster.membership.etcd_view import (
    EtcdTarget, EtcdView, decode_member, encode_member, lease_ttl, parse_etcd_url,
)
from kvstore.config import NodeConfig
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class SessionLost(Exception):
    """The etcd session cannot go on (lease gone, watch cancelled, stream closed)."""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdMembership(EtcdView):
    """Membership and the coordinator role from etcd, for one node."""

    def __init__(self, self_info: pb.MemberInfo, target: EtcdTarget, ttl: int, *,
                 tls_files: tuple[str, str, str] = ("", "", ""), campaign_step: float = 0.1,
                 on_change: Callable[[], None] = lambda: None, start_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(self_info, clock)
        self.target = target
        self.ttl = ttl
        self._tls_files = tls_files
        self._step = campaign_step
        self._on_change = on_change
        self._start_timeout = start_timeout
        self._call_timeout = max(0.5, ttl / 2)
        self._lease_id = 0
        self._endpoint = 0
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._vacancy = asyncio.Event()  # the view changed: maybe campaign

    @classmethod
    def from_config(cls, config: NodeConfig, self_info: pb.MemberInfo,
                    on_change: Callable[[], None] = lambda: None) -> EtcdMembership:
        ttl = lease_ttl(config.heartbeat_timeout)
        return cls(self_info, parse_etcd_url(config.membership), ttl,
                   tls_files=(config.tls_ca, config.tls_cert, config.tls_key),
                   campaign_step=max(0.05, min(config.heartbeat_interval, ttl / 4)), on_change=on_change)

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Register and list the members; returns once the view is filled in
        (or after ``start_timeout``: the node then runs alone until etcd answers)."""
        if self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self._ready.wait(), self._start_timeout)
        except asyncio.TimeoutError:
            log.error("etcd at %s did not answer within %.1f s: running alone until it does",
                      self._address(), self._start_timeout)

    async def stop(self) -> None:
        """Leave: end the session and revoke the lease (the member key and, if
        held, the coordinator key go with it)."""
        if self._task is None:
            return
        self._task.cancel()
        try:  # every step bounded: a stuck stream must not hold up the node's shutdown
            await asyncio.wait_for(asyncio.gather(self._task, return_exceptions=True), self._call_timeout)
        except asyncio.TimeoutError:
            log.warning("etcd session did not end within %.1f s of stop", self._call_timeout)
        self._task = None
        if self._lease_id and self._channel is not None:
            revoke = rpc.LeaseStub(self._channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=self._lease_id),
                                                               timeout=min(1.0, self._call_timeout))
            try:
                await asyncio.wait_for(revoke, self._call_timeout)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:  # it expires a TTL later anyway
                log.debug("lease revoke at %s failed: %r", self._address(), exc)
        self._lease_id = 0
        self.lease_lost()
        await self._close_channel()

    async def _run(self) -> None:
        attempt = 0
        while True:
            started = self._clock()
            try:
                await self._session()
            except (grpc.aio.AioRpcError, SessionLost, asyncio.TimeoutError, OSError) as exc:
                why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc) or type(exc).__name__
                log.warning("etcd session at %s ended: %s", self._address(), why)
            except Exception:  # a bug must not end membership for good
                log.exception("etcd session at %s failed", self._address())
            await self._close_channel()
            self._endpoint = (self._endpoint + 1) % len(self.target.endpoints)
            attempt = 1 if self._clock() - started > self.ttl else attempt + 1
            await asyncio.sleep(min(self.ttl / 2, 0.05 * 2 ** attempt) * random.uniform(0.5, 1.0))

    # ---- one session ---------------------------------------------------------
    def _address(self) -> str:
        host, port = self.target.endpoints[self._endpoint]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _open_channel(self) -> grpc.aio.Channel:
        if not self.target.tls:
            return grpc.aio.insecure_channel(self._address())

        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        ca, cert, key = self._tls_files
        return grpc.aio.secure_channel(self._address(), grpc.ssl_channel_credentials(read(ca), read(key), read(cert)))

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                await asyncio.wait_for(channel.close(), self._call_timeout)
            except asyncio.TimeoutError:
                log.warning("etcd channel to %s did not close within %.1f s", self._address(), self._call_timeout)

    async def _session(self) -> None:
        self._channel = channel = self._open_channel()
        kv, leases = rpc.KVStub(channel), rpc.LeaseStub(channel)
        keepalive = leases.LeaseKeepAlive()
        try:
            if self._lease_id and not await self._renew(keepalive):
                self._lease_id = 0  # expired while we were away: the others saw this node leave
            if not self._lease_id:
                sent = self._clock()
                grant = await leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=self.ttl), timeout=self._call_timeout)
                self._lease_id = grant.ID
                self.lease_held_until(sent + grant.TTL)
            await kv.Put(rpc.PutRequest(key=self.target.member_key(self.self_id), value=encode_member(self.self_info),
                                        lease=self._lease_id), timeout=self._call_timeout)
            root = f"{self.target.prefix}/".encode()
            listing = await kv.Range(rpc.RangeRequest(key=root, range_end=prefix_end(root)),
                                     timeout=self._call_timeout)
            self._list(listing.kvs)
            self._ready.set()
            log.info("etcd membership at %s: lease %x, %d members, coordinator %s", self._address(),
                     self._lease_id, len(self.live_ids()), self.coordinator() or "(none)")
            await _first_failure(self._keep_alive(keepalive), self._watch(channel, listing.header.revision + 1),
                                 self._campaign(kv))
        finally:
            keepalive.cancel()

    def _list(self, kvs: Any) -> None:
        members, holder = [], ""
        for item in kvs:
            if item.key == self.target.coordinator_key:
                holder = item.value.decode(errors="replace")
            elif item.key.startswith(self.target.members_prefix):
                info = decode_member(item.key, item.value, self.target.members_prefix)
                if info is not None:
                    members.append(info)
        if self.reset(members, holder):
            self._changed()

    def _changed(self) -> None:
        self._vacancy.set()
        self._on_change()

    async def _renew(self, stream: Any) -> bool:
        """One keepalive; False when etcd no longer knows the lease."""
        sent = self._clock()
        await stream.write(rpc.LeaseKeepAliveRequest(ID=self._lease_id))
        reply = await asyncio.wait_for(stream.read(), self._call_timeout)
        if reply is grpc.aio.EOF:
            raise SessionLost("lease keepalive stream closed")
        if reply.TTL <= 0:
            self.lease_lost()
            return False
        self.lease_held_until(sent + reply.TTL)
        return True

    async def _keep_alive(self, stream: Any) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            if not await self._renew(stream):
                self._lease_id = 0
                raise SessionLost("lease expired")

    async def _watch(self, channel: grpc.aio.Channel, start_revision: int) -> None:
        root = f"{self.target.prefix}/".encode()
        call = rpc.WatchStub(channel).Watch()  # written to, not fed by an iterator: closes cleanly on cancel
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=root, range_end=prefix_end(root), start_revision=start_revision)))
            while (reply := await call.read()) is not grpc.aio.EOF:
                if reply.canceled or reply.compact_revision:
                    raise SessionLost(f"watch cancelled ({reply.cancel_reason or 'compacted'})")
                changed = False
                for event in reply.events:
                    changed = self._apply(event) or changed
                if changed:
                    self._changed()
            raise SessionLost("watch stream closed")
        finally:
            call.cancel()

    def _apply(self, event: Any) -> bool:
        key, deleted = event.kv.key, event.type == rpc.Event.DELETE
        if key == self.target.coordinator_key:
            return self.holder_set("" if deleted else event.kv.value.decode(errors="replace"))
        if not key.startswith(self.target.members_prefix):
            return False
        if key == self.target.member_key(self.self_id):
            if deleted:
                self.lease_lost()
                self._lease_id = 0
                raise SessionLost("this node's member key was deleted")
            other = decode_member(key, event.kv.value, self.target.members_prefix)
            if other is not None and other.incarnation != self.self_info.incarnation:
                log.error("another node registered as %s (%s): node ids must be unique", self.self_id, other.address)
            return False
        if deleted:
            return self.member_gone(key[len(self.target.members_prefix):].decode(errors="replace"))
        info = decode_member(key, event.kv.value, self.target.members_prefix)
        if info is None:
            log.warning("ignoring an unreadable member key %r in etcd", key[:80])
            return False
        changed = self.member_put(info)
        if changed:
            log.info("member %s (%s) joined (etcd)", info.node_id, info.address)
        return changed

    async def _campaign(self, kv: Any) -> None:
        """Whenever the coordinator key is vacant: wait this node's turn, then
        create it on this node's lease unless someone did first."""
        key = self.target.coordinator_key
        while True:
            delay = self.campaign_delay(self._step)
            if delay is None or delay > 0:
                self._vacancy.clear()
                try:
                    await asyncio.wait_for(self._vacancy.wait(), delay)
                    continue  # the view changed while waiting: decide again
                except asyncio.TimeoutError:
                    if self.campaign_delay(self._step) is None:
                        continue
            txn = rpc.TxnRequest(
                compare=[rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                     create_revision=0)],
                success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=self.self_id.encode(),
                                                                  lease=self._lease_id))],
                failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))])
            reply = await kv.Txn(txn, timeout=self._call_timeout)
            if reply.succeeded:
                holder = self.self_id
                log.info("coordinator role taken through etcd")
            else:
                kvs = reply.responses[0].response_range.kvs
                holder = kvs[0].value.decode(errors="replace") if kvs else ""
                if not kvs:
                    await asyncio.sleep(self._step)  # gone again already: the watch will tell
            if self.holder_set(holder):
                self._changed()


async def _first_failure(*loops: Coroutine[Any, Any, None]) -> None:
    """Run ``loops`` together until one ends; cancel the rest and raise its error."""
    tasks = [asyncio.ensure_future(loop) for loop in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
        raise SessionLost("a session loop ended")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
