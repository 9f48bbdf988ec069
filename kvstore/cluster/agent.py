"""The cluster agent of one node: heartbeats, directory reports, lookups,
remote fetch and replication. The I/O shell around ``membership`` and
``directory``.

Every ``--heartbeat-interval`` the agent heartbeats every peer it knows
(static ``--peers`` plus members learned by gossip). The heartbeat to the
node it takes for coordinator carries the page adds/removes since its last
accepted report, so the coordinator's directory converges within one
heartbeat. Every node applies the reports it receives (the directory is
soft state); only the coordinator's copy is asked.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.cluster.coordinator import Coordinator
from kvstore.cluster.directory import Directory, Outbox
from kvstore.cluster.membership import Membership
from kvstore.config import NodeConfig
from kvstore.errors import KvError, ResourceExhausted
from kvstore.hostmem import populated_empty
from kvstore.metrics import NodeMetrics
from kvstore.node import Namespace, Node, page_checksum
from kvstore.pool.pool import PageKind, ReadHandle, contiguous_run
from kvstore.transport.base import Served, Transport, TransportError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_PULLS_IN_FLIGHT = 2
_MAX_ACCESS_BACKLOG = 50_000


class _NotAMember(grpc.RpcError):
    """A call to a node this node does not see alive."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"{node_id} is not a live member")
        self._node_id = node_id

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE
_GRPC_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def assign_sources(keys: Sequence[bytes], holders: Sequence[set[str]], usable: set[str]) -> dict[str, list[bytes]]:
    """Pick one source per key: greedily the node that holds the most of the
    keys still unassigned, so each peer gets one batched transfer."""
    options = {k: h & usable for k, h in zip(keys, holders)}
    todo = [k for k in keys if options[k]]
    groups: dict[str, list[bytes]] = {}
    while todo:
        counts: dict[str, int] = {}
        for key in todo:
            for node in options[key]:
                counts[node] = counts.get(node, 0) + 1
        best = min(counts, key=lambda n: (-counts[n], n))
        groups[best] = [k for k in todo if best in options[k]]
        todo = [k for k in todo if best not in options[k]]
    return groups


class StagingBuffers:
    """Reusable host buffers, mapped up front, for pulls and serves.

    A fresh 64 MiB ``np.empty`` faults page by page on first touch (see
    kvstore.hostmem); reusing a few mapped buffers keeps that off the
    transfer path."""

    def __init__(self, keep: int = 4) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep

    def take(self, n: int, page_bytes: int) -> np.ndarray:
        nbytes = n * page_bytes
        for i, buf in enumerate(self._free):
            if buf.nbytes >= nbytes:
                del self._free[i]
                return buf[:nbytes].reshape(n, page_bytes)
        return populated_empty(1, max(nbytes, 1 << 20))[0][:nbytes].reshape(n, page_bytes)

    def give(self, array: np.ndarray) -> None:
        base = array
        while base.base is not None and isinstance(base.base, np.ndarray):
            base = base.base
        flat = base.reshape(-1)
        if len(self._free) < self._keep:
            self._free.append(flat)
        else:  # keep the largest ones
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].nbytes)
            if self._free[smallest].nbytes < flat.nbytes:
                self._free[smallest] = flat


class ClusterAgent:
    """Runs membership and the directory for one node; pulls pages from peers."""

    def __init__(self, node: Node, config: NodeConfig, transport: Transport, metrics: NodeMetrics) -> None:
        self.node = node
        self.config = config
        self.transport = transport
        self.metrics = metrics
        self.incarnation = uuid.uuid4().hex[:16]
        self.self_info = pb.MemberInfo(node_id=node.node_id, address=node.address, incarnation=self.incarnation)
        self.membership = Membership(self.self_info, config.heartbeat_timeout)
        self.directory = Directory()
        self.outbox = Outbox()
        node.listeners.append(self.outbox.record)
        self._static = set(config.peers)
        self._learned: dict[str, float] = {}  # address -> when last heard of
        self._channels: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._coordinator_seen = ""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._fetches: set[asyncio.Task[Any]] = set()
        self.staging = StagingBuffers()
        # recorded requests (LookupRequest.record) not yet sent to the coordinator
        self._accesses: deque[tuple[float, str, list[bytes], int, int]] = deque(maxlen=_MAX_ACCESS_BACKLOG)
        self.coordinator = Coordinator(self)
        self._coordinator_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        endpoint = await self.transport.start(self.config.host, self.config.transport_port, self.serve_pull)
        self.self_info.endpoints.append(endpoint)
        self._task = asyncio.get_running_loop().create_task(self._loop())
        self._coordinator_task = asyncio.get_running_loop().create_task(self.coordinator.run())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        if self._coordinator_task is not None:
            self._coordinator_task.cancel()
        for task in list(self._fetches):
            task.cancel()
        await asyncio.gather(self._task, self._coordinator_task, *self._fetches, return_exceptions=True)
        await self.coordinator.close()
        self._task = None
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self.transport.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bad tick must not end the heartbeats
                log.exception("cluster tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.heartbeat_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    # ---- heartbeats --------------------------------------------------------
    def _refresh_self(self) -> None:
        info, node = self.self_info, self.node
        info.address = node.address
        info.capacity_bytes = node.config.capacity
        info.used_bytes = sum(ns.pool.used_slots * ns.layout.page_bytes for ns in node.namespaces.values())
        info.hits = sum(ns.counters.hits for ns in node.namespaces.values())
        info.misses = sum(ns.counters.misses for ns in node.namespaces.values())
        info.remote_hits = sum(ns.counters.remote_hits for ns in node.namespaces.values())
        info.speculative_bytes = sum(ns.pool.speculative_slots * ns.layout.page_bytes
                                     for ns in node.namespaces.values())

    def _take_report(self) -> tuple[int, bool, list[pb.DirectoryBatch]]:
        if self.outbox.need_full:
            seq, batches = self.outbox.take_full({ns.name: ns.pool.keys() for ns in self.node.namespaces.values()})
            return seq, True, batches
        seq, batches = self.outbox.take()
        return seq, False, batches

    async def tick(self) -> None:
        """One heartbeat round: expire, report, probe every peer."""
        self._refresh_self()
        for dead in self.membership.expire():
            self._forget_member(dead, "timed out")
        coordinator = self.membership.coordinator()
        if coordinator != self._coordinator_seen:
            log.info("coordinator is now %s", coordinator)
            self._coordinator_seen = coordinator
            self.outbox.need_full = True
        now = time.monotonic()
        for ns in self.node.namespaces.values():
            ns.pool.drop_speculative(now=now)  # unread speculative replicas past their TTL
        if coordinator == self.node.node_id:
            seq, full, batches = self._take_report()
            self.directory.report(self.node.node_id, self.incarnation, seq, full, batches)
            self.coordinator.added(self.node.node_id, batches)
            for event in self._take_accesses():
                self.coordinator.observe(self.node.node_id, event)
        coordinator_addr = (self.membership.member(coordinator) or self.self_info).address
        now = time.monotonic()
        horizon = 10 * self.config.heartbeat_timeout
        self._learned = {a: t for a, t in self._learned.items() if now - t < horizon}
        targets = (self._static | set(self._learned)) - {self.node.address}
        known = self.membership.view()  # the same gossip for every peer this round
        await asyncio.gather(*(self._beat(addr, addr == coordinator_addr and coordinator != self.node.node_id, known)
                               for addr in targets))

    async def _beat(self, address: str, report: bool, known: Sequence[pb.MemberInfo]) -> None:
        request = pb.HeartbeatRequest(sender=self.self_info, known=known)
        if report:
            request.has_directory = True
            request.seq, request.full, batches = self._take_report()
            request.directory.extend(batches)
            request.accesses.extend(self._take_accesses())
        try:
            reply = await self._stub(address).Heartbeat(request, timeout=max(0.2, self.config.heartbeat_interval))
        except grpc.RpcError as exc:
            if report:
                self.outbox.need_full = True  # it may or may not have applied it
            log.debug("heartbeat to %s failed: %s", address, exc.code())
            return
        if reply.receiver.node_id == self.node.node_id:
            self._static.discard(address)  # our own address under another name
            return
        self._observe(reply.receiver)
        self._gossip(reply.known)
        if report and reply.need_full:
            self.outbox.need_full = True

    def record_access(self, namespace: str, keys: Sequence[bytes], outcome: int, local: int) -> None:
        """Queue one served request for the coordinator's predictor."""
        depth = self.coordinator.pcfg.depths[-1]
        self._accesses.append((time.monotonic(), namespace, list(keys[:depth]), outcome, len(keys), local))

    def _take_accesses(self) -> list[pb.AccessEvent]:
        now = time.monotonic()
        events = [pb.AccessEvent(namespace=ns, keys=keys, age_seconds=now - t, outcome=outcome, total_blocks=total,
                                 local_blocks=local)
                  for t, ns, keys, outcome, total, local in self._accesses]
        self._accesses.clear()
        return events

    async def call(self, node_id: str, method: str, request: Any, timeout: float) -> Any:
        """A Cluster RPC to a live member (raises grpc.RpcError)."""
        member = self.membership.member(node_id)
        if member is None:
            raise _NotAMember(node_id)
        return await getattr(self._stub(member.address), method)(request, timeout=timeout)

    def _observe(self, info: pb.MemberInfo) -> None:
        change = self.membership.observe(info)
        if change is not None and change.restarted:
            self.directory.drop(info.node_id)
            for endpoint in info.endpoints:
                self.transport.forget(endpoint)
        if change is not None and change.joined:
            log.info("member %s (%s) joined", info.node_id, info.address)

    def _gossip(self, known: Sequence[pb.MemberInfo]) -> None:
        now = time.monotonic()
        for info in known:
            if info.node_id != self.node.node_id and info.address and info.address != self.node.address:
                self._learned[info.address] = now

    def _forget_member(self, info: pb.MemberInfo, why: str) -> None:
        dropped = self.directory.drop(info.node_id)
        for endpoint in info.endpoints:
            self.transport.forget(endpoint)
        log.warning("member %s %s; dropped %d directory entries", info.node_id, why, dropped)

    def _stub(self, address: str) -> Any:
        entry = self._channels.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address, options=_GRPC_OPTIONS)
            entry = self._channels[address] = (channel, pb_grpc.ClusterStub(channel))
        return entry[1]

    # ---- handlers for the Cluster service ----------------------------------
    def on_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self._refresh_self()
        self._observe(request.sender)
        self._gossip(request.known)
        self._learned[request.sender.address] = time.monotonic()
        need_full = False
        if request.has_directory:
            need_full = self.directory.report(request.sender.node_id, request.sender.incarnation, request.seq,
                                              request.full, request.directory)
            if not need_full:
                self.coordinator.added(request.sender.node_id, request.directory)
        for event in request.accesses:
            self.coordinator.observe(request.sender.node_id, event)
        return pb.HeartbeatResponse(receiver=self.self_info, known=self.membership.view(), need_full=need_full,
                                    accepted_seq=0 if need_full else request.seq)

    def on_locate(self, namespace: str, keys: Sequence[bytes]) -> pb.LocateResponse:
        holders = self.directory.locate(namespace, keys)
        ids = set().union(*holders) if holders else set()
        members = [m for m in (self.membership.member(n) for n in sorted(ids)) if m is not None]
        return pb.LocateResponse(holders=[pb.KeyHolders(node_ids=sorted(h)) for h in holders], members=members)

    def prefixes(self, namespace: str, keys: Sequence[bytes]) -> list[pb.NodePrefix]:
        """Per live node: its longest cached prefix of ``keys``, with
        placement hints (speculative copies in flight or alive)."""
        out: dict[str, pb.NodePrefix] = {}
        for node_id, length in self.directory.prefixes(namespace, keys).items():
            member = self.membership.member(node_id)
            if member is not None:
                out[node_id] = pb.NodePrefix(node_id=node_id, address=member.address, prefix_length=length)
        for hint in self.coordinator.hints(namespace, keys):
            have = out.get(hint.node_id)
            if have is None or hint.prefix_length > have.prefix_length:
                out[hint.node_id] = hint  # about to hold more than the directory knows of
            elif hint.prefix_length == have.prefix_length and not hint.pending:
                have.expires_in_seconds = hint.expires_in_seconds
        return list(out.values())

    def status(self) -> pb.ClusterStatusResponse:
        self._refresh_self()
        return pb.ClusterStatusResponse(node_id=self.node.node_id, coordinator=self.membership.coordinator(),
                                        members=self.membership.view())

    # ---- lookups -------------------------------------------------------------
    async def _ask_coordinator(self, method: str, request: Any) -> Any | None:
        coordinator = self.membership.member(self.membership.coordinator())
        if coordinator is None:
            return None
        try:
            return await getattr(self._stub(coordinator.address), method)(
                request, timeout=max(0.2, self.config.heartbeat_interval))
        except grpc.RpcError as exc:
            log.debug("%s at coordinator %s failed: %s", method, coordinator.node_id, exc.code())
            return None

    async def lookup(self, namespace: str, keys: Sequence[bytes], record: bool = False) -> pb.LookupResponse:
        """Longest cached prefix here, and per live node (from the directory),
        with placement hints; ``record`` logs the request for the predictor."""
        local = self.node.lookup(namespace, keys)
        if self.membership.is_coordinator:
            nodes = self.prefixes(namespace, keys)
        else:
            reply = await self._ask_coordinator("ClusterLookup", pb.LookupRequest(namespace=namespace, keys=keys))
            nodes = list(reply.nodes) if reply is not None else []
        nodes = [n for n in nodes if n.node_id != self.node.node_id and self.membership.alive(n.node_id)]
        if local:
            nodes.append(pb.NodePrefix(node_id=self.node.node_id, address=self.node.address, prefix_length=local))
        nodes.sort(key=lambda n: (-n.prefix_length, n.pending, n.node_id))
        if record and keys:
            depth = min(len(keys), self.coordinator.pcfg.depths[-1])
            remote = any(n.prefix_length >= depth and not n.pending for n in nodes if n.node_id != self.node.node_id)
            self.record_access(namespace, keys, 0 if local >= depth else 1 if remote else 2, local)
        return pb.LookupResponse(prefix_length=local, nodes=nodes)

    async def _locate(self, namespace: str, keys: Sequence[bytes]) -> pb.LocateResponse:
        if self.membership.is_coordinator:
            return self.on_locate(namespace, keys)
        reply = await self._ask_coordinator("Locate", pb.LocateRequest(namespace=namespace, keys=keys))
        return reply if reply is not None else pb.LocateResponse()

    # ---- reads with reactive fetch -------------------------------------------
    async def read(self, namespace: str, keys: Sequence[bytes], timeout: float | None,
                   local_only: bool = False) -> tuple[Namespace, ReadHandle, set[bytes]]:
        """Hold the pages of ``keys`` for reading, first pulling missing ones
        from peers (policy ``reactive``) for at most ``timeout`` seconds."""
        fetched: set[bytes] = set()
        if not local_only and self.config.replication != "none" and len(self.membership.live_ids()) > 1:
            ns = self.node.namespace(namespace)
            self.node.check_read_batch(ns, keys)
            budget = self.config.fetch_timeout if timeout is None else min(timeout, self.config.fetch_timeout)
            fetched = await self.fetch_missing(namespace, keys, budget)
        ns, handle = self.node.acquire(namespace, keys)
        remote = sum(1 for e in handle.entries if e.key in fetched) if fetched else 0
        ns.counters.remote_hits += remote
        self.metrics.pages.labels("get", "remote_hit").inc(remote)
        return ns, handle, fetched

    def end_read(self, ns: Namespace, handle: ReadHandle, fetched: set[bytes]) -> None:
        ns.pool.release(handle)
        if fetched and not self.config.keep_fetched:
            ns.pool.delete(fetched)

    # ---- pulling pages -----------------------------------------------------
    async def fetch_missing(self, namespace: str, keys: Sequence[bytes], timeout: float) -> set[bytes]:
        """Pull the pages of ``keys`` this node lacks from the peers that hold
        them, for at most ``timeout`` seconds; returns the keys now stored
        here. Failures and the deadline turn pages into misses, never errors."""
        pool = self.node.namespace(namespace).pool
        missing = [k for k in dict.fromkeys(keys) if k not in pool]
        if not missing or timeout <= 0:
            return set()
        start = time.perf_counter()
        located = await self._locate(namespace, missing)
        if len(located.holders) != len(missing):
            return set()
        for info in located.members:
            if self.membership.member(info.node_id) is None:
                self._observe(info)
        usable = {n for n in self.membership.live_ids() if n != self.node.node_id}
        groups = assign_sources(missing, [set(h.node_ids) for h in located.holders], usable)
        if not groups:
            return set()
        tasks = {asyncio.ensure_future(self._pull_chunks(src, namespace, ks, PageKind.REPLICA)): src
                 for src, ks in groups.items()}
        self._fetches.update(tasks)
        remaining = timeout - (time.perf_counter() - start)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._fetches.difference_update(tasks)
        for task in done:
            if task.exception() is not None:
                log.warning("pull from %s failed: %s", tasks[task], task.exception())
        # what arrived, including chunks of transfers cut off by the deadline
        fetched = {k for k in missing if k in pool}
        self.metrics.remote_fetch.observe(time.perf_counter() - start)
        return fetched

    async def _pull_chunks(self, source: str, namespace: str, keys: list[bytes], kind: PageKind,
                           expires_at: float = 0.0) -> list[bytes]:
        """Pull in chunks of at most ``--max-pull-bytes``, two in flight, so
        the source packs one chunk while this node checks and scatters the
        previous one, and a deadline keeps the chunks that arrived."""
        page_bytes = self.node.namespace(namespace).layout.page_bytes
        per_chunk = max(1, self.config.max_pull_bytes // page_bytes)
        if len(keys) > per_chunk:  # several chunks: smaller ones pipeline better
            per_chunk = max(1, min(per_chunk, -(-len(keys) // 4)))
        window = asyncio.Semaphore(_PULLS_IN_FLIGHT)

        async def one(chunk: list[bytes]) -> list[bytes]:
            async with window:
                return await self.pull(source, namespace, chunk, kind, expires_at=expires_at)

        chunks = [keys[i:i + per_chunk] for i in range(0, len(keys), per_chunk)]
        tasks = [asyncio.ensure_future(one(c)) for c in chunks]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:  # chunks already stored stay stored
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [k for part in done for k in part]

    async def pull(self, source: str, namespace: str, keys: Sequence[bytes], kind: PageKind,
                   retry: bool = True, expires_at: float = 0.0) -> list[bytes]:
        """One transfer of ``keys`` from ``source`` into this node's pool.

        Checksums are verified before anything is stored; a mismatched page
        is never stored, and is pulled once more."""
        member = self.membership.member(source)
        endpoint = next((e for e in member.endpoints if e.kind == self.transport.name), None) if member else None
        if endpoint is None:
            raise TransportError(f"no {self.transport.name} endpoint known for {source}")
        ops = self.node.namespace(namespace).pool.ops
        on_device = self.transport.device_buffers and not ops.host_visible

        taken: list[np.ndarray] = []

        def alloc(n: int, size: int, reply: pb.DataHeader) -> Any:
            if on_device:
                return ops.xp.empty((n, size), dtype=np.uint8)
            taken.append(self.staging.take(n, size))
            return taken[-1]

        request = pb.DataHeader(op=pb.DataHeader.GET, namespace=namespace, keys=keys, local_only=True)
        try:
            reply, payload = await self.transport.fetch(endpoint, request, alloc)
            return await self._store_pulled(source, namespace, keys, kind, reply, payload, retry)
        finally:
            for buf in taken:
                self.staging.give(buf)

    async def _pull_into_slots(self, source: str, endpoint: pb.TransportEndpoint, namespace: str,
                                keys: Sequence[bytes], kind: PageKind, retry: bool,
                                expires_at: float = 0.0) -> list[bytes]:
        """A pull whose bytes land in reserved slots (host pages): in place
        with a scatter transport (TCP); with a one-message transport (UCX)
        in place when the reserved slots form one run, else through a
        staging buffer and the unpack kernel. Checksums are checked before
        the keys are published."""
        ns = self.node.namespace(namespace)
        page_bytes = ns.layout.page_bytes
        batch = self.node.begin_put(namespace, kind)
        batch.expires_at = expires_at
        state: dict[str, Any] = {}

        def alloc(n: int, size: int, reply: pb.DataHeader) -> Any:
            if size != page_bytes:
                raise TransportError(f"{source} sent pages of {size} bytes for {page_bytes}-byte pages")
            found = [k for k, hit in zip(keys, reply.found) if hit]
            views, state["finish"] = batch.add_landing(found)
            state["found"], state["views"] = found, views
            if self.transport.scatter:
                scratch = memoryview(bytearray(page_bytes)) if None in views else None
                return [scratch if v is None else v for v in views]  # present keys: drain
            run = contiguous_run(batch.last_slots) if ns.pool.ops.host_visible and None not in views else None
            if run is not None:
                return ns.pool.buffer[run]  # one message straight into the slots
            state["staging"] = self.staging.take(n, size)
            return state["staging"]

        request = pb.DataHeader(op=pb.DataHeader.GET, namespace=namespace, keys=keys, local_only=True)
        try:
            reply, _ = await self.transport.fetch(endpoint, request, alloc)
            if reply.code:
                raise TransportError(f"{source} refused the pull: {reply.message}")
            found = state.get("found", [])
            if not found:
                return []
            if len(reply.checksums) != len(found):
                raise TransportError(f"{source} sent {len(reply.checksums)} checksums for {len(found)} pages")
            self.metrics.peer_bytes.labels("in").inc(len(found) * page_bytes)
            staging = state.get("staging")
            if staging is not None:  # scatter the staged pages into their slots
                new = [i for i, v in enumerate(state["views"]) if v is not None]
                if new:
                    rows = staging if len(new) == len(found) else staging[new]
                    if ns.pool.ops.host_visible:
                        ns.pool.ops.unpack(rows, batch.last_slots, ns.pool.buffer)
                    else:
                        for i, view in zip(new, (state["views"][j] for j in new)):
                            view[:] = staging[i]  # device pool: landing is host staging
            state["finish"]()  # checksums of what arrived (and the upload on a device pool)
            expected = dict(zip(found, reply.checksums))
            bad = {k for k, c in batch.checksums().items() if expected[k] and c != expected[k]}
            if bad:
                batch.discard(bad)
            batch.commit()
        except ResourceExhausted as exc:
            log.warning("no room for pages pulled from %s: %s", source, exc)
            return []
        finally:
            batch.abort()
            if state.get("staging") is not None:
                self.staging.give(state["staging"])
        stored = [k for k in found if k not in bad]
        if bad:
            self.metrics.checksum_failures.inc(len(bad))
            log.warning("%d pages from %s failed their checksum%s", len(bad), source, "; retrying" if retry else "")
            if retry:
                stored.extend(await self.pull(source, namespace, list(bad), kind, retry=False,
                                              expires_at=expires_at))
        return stored

    async def _store_pulled(self, source: str, namespace: str, keys: Sequence[bytes], kind: PageKind,
                            reply: pb.DataHeader, payload: Any, retry: bool) -> list[bytes]:
        ns = self.node.namespace(namespace)
        ops, page_bytes = ns.pool.ops, ns.layout.page_bytes
        if reply.code:
            raise TransportError(f"{source} refused the pull: {reply.message}")
        found = [k for k, hit in zip(keys, reply.found) if hit]
        if not found:
            return []
        if reply.page_bytes != page_bytes or len(reply.checksums) != len(found):
            raise TransportError(f"{source} sent pages of {reply.page_bytes} bytes for {page_bytes}-byte pages")
        self.metrics.peer_bytes.labels("in").inc(len(found) * page_bytes)
        host = payload if isinstance(payload, np.ndarray) else ops.to_host(payload)
        sums = list(reply.checksums)
        good = [i for i in range(len(found)) if not sums[i] or page_checksum(host[i]) == sums[i]]
        bad = [found[i] for i in range(len(found)) if i not in set(good)]
        stored: list[bytes] = []
        if good:
            batch = self.node.begin_put(namespace, kind)
            try:
                batch.add_packed([found[i] for i in good], payload[good] if len(good) < len(found) else payload,
                                 [sums[i] for i in good])
                batch.commit()
                stored = [found[i] for i in good]
            except ResourceExhausted as exc:
                log.warning("no room for %d pulled pages: %s", len(good), exc)
            finally:
                batch.abort()
        if bad:
            self.metrics.checksum_failures.inc(len(bad))
            log.warning("%d pages from %s failed their checksum%s", len(bad), source, "; retrying" if retry else "")
            if retry:
                stored.extend(await self.pull(source, namespace, bad, kind, retry=False))
        return stored

    def serve_pull(self, request: pb.DataHeader) -> Served:
        """Answer a peer's pull from local pages only (never recursing)."""
        try:
            ns = self.node.namespace(request.namespace)
            self.node.check_read_batch(ns, list(request.keys))
        except KvError as exc:
            header = pb.DataHeader(op=pb.DataHeader.RESULT, code=exc.code.value[0], message=str(exc))
            return Served(header, None, lambda: None)
        handle = ns.pool.acquire(list(request.keys), promote=False)
        ops, payload, release = ns.pool.ops, None, None
        header = pb.DataHeader(op=pb.DataHeader.RESULT, found=handle.found, page_bytes=ns.layout.page_bytes,
                               checksums=[e.checksum for e in handle.entries])
        self.metrics.peer_bytes.labels("out").inc(len(handle.entries) * ns.layout.page_bytes)
        if handle.entries and self.transport.scatter and ops.host_visible:
            # send straight from the slots; the read hold lasts until sent
            return Served(header, ns.pool.source(handle.slots), functools.partial(ns.pool.release, handle))
        run = contiguous_run(handle.slots) if ops.host_visible else None
        if run is not None:
            # one run of slots: send it as it lies; the read hold lasts until sent
            return Served(header, ns.pool.buffer[run], functools.partial(ns.pool.release, handle))
        try:
            if handle.entries:
                if ops.host_visible:
                    staging = self.staging.take(len(handle.entries), ns.layout.page_bytes)
                    payload = ops.pack(ns.pool.buffer, handle.slots, out=staging)  # a copy: holds end here
                    release = functools.partial(self.staging.give, staging)
                else:
                    payload = ops.pack(ns.pool.buffer, handle.slots)
                    if not self.transport.device_buffers:
                        payload = ops.to_host(payload)
        finally:
            ns.pool.release(handle)
        return Served(header, payload, release or (lambda: None))

    async def replicate(self, namespace: str, keys: Sequence[bytes], source: str,
                        kind: PageKind, ttl: float = 0.0) -> pb.ReplicateResponse:
        """Copy ``keys`` from ``source`` here (idempotent: held keys are
        skipped; held speculative ones get their expiry renewed)."""
        pool = self.node.namespace(namespace).pool
        expires_at = time.monotonic() + ttl if kind is PageKind.SPECULATIVE and ttl > 0 else 0.0
        if expires_at:
            pool.renew(keys, expires_at)
        todo = [k for k in dict.fromkeys(keys) if k not in pool]
        present = len(set(keys)) - len(todo)
        try:
            copied = await self._pull_chunks(source, namespace, todo, kind, expires_at) if todo else []
        except TransportError as exc:  # the source died or is unknown: what did not come is missing
            log.warning("replicate from %s: %s", source, exc)
            copied = [k for k in todo if k in pool]
        return pb.ReplicateResponse(copied=len(copied), already_present=present, missing=len(todo) - len(copied))
