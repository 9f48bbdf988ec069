"""The cluster agent of one node: heartbeats, gossip, directory reports, the
access log and lookups. The I/O shell around the pure ``membership`` and
``directory`` logic; page movement is the :class:`Replicator`'s.

Every ``--heartbeat-interval`` the agent heartbeats every peer it knows
(static ``--peers`` plus members learned by gossip; :func:`plan_round`
decides whom). The heartbeat to the node it takes for coordinator carries
the page adds/removes since its last accepted report (with each speculative
replica's remaining life) and the recorded requests, so the coordinator's
directory converges within one heartbeat. Every node applies the reports it
receives (the directory is soft state); only the coordinator's copy is asked.

The coordinator role's placement work plugs in as a :class:`Placement`
(``kvstore.cluster.coordinator``); this module does not import it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from kvstore.cluster import answer
from kvstore.cluster.checks import check_key_batch
from kvstore.cluster.claims import Claim, Claims, Pulls
from kvstore.cluster.directory import Directory, Outbox
from kvstore.cluster.membership import make_membership, plan_round
from kvstore.cluster.peers import PeerClient
from kvstore.cluster.replicator import Replicator
from kvstore.config import NodeConfig
from kvstore.errors import KvError
from kvstore.framing import server_limits
from kvstore.metrics import NodeMetrics
from kvstore.node import Node
from kvstore.pool.room import PRIOR_READS, cold_price
from kvstore.security.identity import ClusterSecret
from kvstore.transport.base import Transport
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
_MAX_ACCESS_BACKLOG = 50_000


class Placement(Protocol):
    """What the agent feeds the coordinator role and asks of it."""

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        """One recorded request served by ``node``."""

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        """Directory adds/removes from ``node``, already applied to the directory."""

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        """Nodes about to hold, or holding as speculative replicas, a prefix of ``chain``."""

    def on_claims_landed(self, claims: Sequence[Claim]) -> None:
        """In-flight prefill claims whose Put reached the directory (with the nodes that waited)."""

    def sending(self, node: str) -> int:
        """Copies the coordinator has leaving ``node`` now (they share its egress with any pull)."""

    def joining(self) -> list[str]:
        """Members that joined and are being warmed from the forecast: routers leave them out."""


class NoPlacement:
    """The placement of a node without a coordinator role attached (tests, tools)."""

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        pass

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        pass

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        return []

    def on_claims_landed(self, claims: Sequence[Claim]) -> None:
        pass

    def sending(self, node: str) -> int:
        return 0

    def joining(self) -> list[str]:
        return []


class ClusterAgent:
    """Runs membership and the directory for one node; answers lookups."""

    def __init__(self, node: Node, config: NodeConfig, transport: Transport, metrics: NodeMetrics, *,
                 secret: ClusterSecret | None = None, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.node = node
        self.config = config
        self.transport = transport
        self.metrics = metrics
        self.incarnation = uuid.uuid4().hex[:16]
        self.self_info = pb.MemberInfo(node_id=node.node_id, address=node.address, incarnation=self.incarnation)
        # gossip (heartbeats) or etcd (leases, and an elected coordinator): --membership
        self.membership = make_membership(config, self.self_info, lambda: self._wake.set())
        self.directory = Directory()
        # in-flight prefill claims (kvstore.cluster.claims): kept, like the directory, where it is asked
        self.claims = Claims()
        self.pulls = Pulls()  # the reactive pulls its answers announced (kvstore.cluster.claims.Pulls)
        self._claimed_until = 0.0  # this node forwarded claims that may live until then: report Puts at once
        self.outbox = Outbox()
        node.listeners.append(self.outbox.record)
        node.listeners.append(self._stored)
        # the cluster secret signs every call to a peer (they check the proof); TLS channels with credentials
        sign = (lambda method, body: secret.sign(method, self.self_info.node_id, body)) if secret else None
        self.peers = PeerClient(self.membership, reconnect_s=min(1.0, config.heartbeat_timeout / 2), sign=sign,
                                credentials=credentials)
        self.replicator = Replicator(node, config, transport, metrics, self._endpoint_of, self.locate,
                                     self._live_peers)
        self.placement: Placement = NoPlacement()
        self._static = set(config.peers)
        self._learned: dict[str, float] = {}  # address -> when last heard of
        self._coordinator_seen = ""
        self._keeps_directory = False
        self._warm_from = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # recorded requests (LookupRequest.record) not yet sent to the coordinator
        self._accesses: deque[tuple[float, str, list[bytes], int, int, int]] = deque(maxlen=_MAX_ACCESS_BACKLOG)

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self.transport.set_limits(server_limits(self.config))
        endpoint = await self.transport.start(self.config.host, self.config.transport_port, self.replicator.serve)
        self.self_info.endpoints.append(endpoint)
        await self.membership.start()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        await self.membership.stop()  # etcd: the lease goes now, not a TTL later
        await self.replicator.close()
        await self.peers.close()
        await self.transport.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stop()
                log.error("cluster tick: a call was cancelled under it")  # must not end the heartbeats
            except Exception:  # a bad tick must not end the heartbeats
                log.exception("cluster tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.heartbeat_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    # ---- heartbeats --------------------------------------------------------
    def _refresh_self(self) -> None:
        info, spaces = self.self_info, self.node.namespaces.values()
        info.address = self.node.address
        info.capacity_bytes = self.node.config.capacity
        info.used_bytes = sum(ns.pool.used_slots * ns.layout.page_bytes for ns in spaces)
        info.hits = sum(ns.counters.hits for ns in spaces)
        info.misses = sum(ns.counters.misses for ns in spaces)
        info.remote_hits = sum(ns.counters.remote_hits for ns in spaces)
        info.speculative_bytes = sum(ns.pool.speculative_slots * ns.layout.page_bytes for ns in spaces)
        info.cold_bytes = sum(ns.pool.cold_slots * ns.layout.page_bytes for ns in spaces)
        info.cold_reads = min((cold_price(ns.below.admission if ns.below else None) for ns in spaces),
                              default=PRIOR_READS)

    def _take_report(self) -> tuple[int, bool, list[pb.DirectoryBatch]]:
        now = time.monotonic()
        if self.outbox.need_full:
            snapshot = self.node.snapshot()
            seq, batches = self.outbox.take_full(snapshot, now)
            return seq, True, batches
        seq, batches = self.outbox.take(now)
        return seq, False, batches

    async def tick(self) -> None:
        """One heartbeat round: expire, enforce replica TTLs, report, probe."""
        self._refresh_self()
        for dead in self.membership.expire():
            self._forget_member(dead, "timed out")
        now = time.monotonic()
        for ns in self.node.namespaces.values():
            ns.pool.drop_speculative(now=now)  # unread speculative replicas past their TTL
        plan = plan_round(self.membership, self.node.address, self._static, self._learned, self._coordinator_seen,
                          now, 10 * self.config.heartbeat_timeout)
        self._learned = plan.learned
        if plan.coordinator_changed:
            log.info("coordinator is now %s", plan.coordinator)
            self._coordinator_seen = plan.coordinator
            self.metrics.coordinator_changes.inc()
        self._track_role()
        # One numbered report per round, the same to the coordinator and the
        # standby (or applied here where this node is one of them): each
        # receiver checks the numbers and asks for a full snapshot on a gap.
        report = self._take_report()
        if self.membership.keeps_directory:
            seq, full, batches = report
            self.directory.report(self.node.node_id, self.incarnation, seq, full, batches, now)
            self._claims_landed(self.node.node_id, batches)
        if plan.report_locally:
            self.placement.on_report(self.node.node_id, report[2])
        if plan.report_locally:
            for event in self._take_accesses():
                self.placement.observe(self.node.node_id, event)
        known = self._gossip_view()  # the same gossip for every peer this round
        await asyncio.gather(*(self._beat(addr, report if addr in (plan.report_to, plan.standby_to) else None,
                                          addr == plan.report_to, known) for addr in plan.targets))

    def _track_role(self) -> None:
        """A node that neither coordinates nor stands by holds no directory
        (memory stays O(pages x 2)); one that takes a role starts warming."""
        keeps = self.membership.keeps_directory
        if keeps and not self._keeps_directory:
            self._warm_from = time.monotonic()
        if not keeps and self.directory.nodes():
            self.directory.clear()
        self._keeps_directory = keeps

    def warming(self) -> bool:
        """This node keeps no directory, or as coordinator or standby lacks a live member's report and took
        its role less than a heartbeat timeout ago: askers try the other copy.
        (Roles follow the clock, between heartbeat rounds too: checked here.)"""
        self._track_role()
        if not self._keeps_directory:
            return True  # no copy here at all (the asker's view is older than ours)
        if time.monotonic() - self._warm_from > self.config.heartbeat_timeout:
            return False
        return not set(self.membership.live_ids()) <= set(self.directory.nodes())

    async def _beat(self, address: str, report: tuple[int, bool, list[pb.DirectoryBatch]] | None,
                    accesses: bool, known: Sequence[pb.MemberInfo]) -> None:
        request = pb.HeartbeatRequest(sender=self.self_info, known=known)
        if report is not None:
            request.has_directory = True
            request.seq, request.full, batches = report
            request.directory.extend(batches)
        if accesses:
            request.accesses.extend(self._take_accesses())
        try:
            reply = await self.peers.call_address(address, "Heartbeat", request,
                                                  max(0.2, self.config.heartbeat_interval))
        except KvError as exc:
            # a lost report shows as a gap in the numbers at its receiver
            log.debug("heartbeat to %s failed: %s", address, exc)
            return
        if reply.receiver.node_id == self.node.node_id:
            self._static.discard(address)  # our own address under another name
            return
        self._observe(reply.receiver)
        self._gossip(reply.known)
        if report is not None and reply.need_full:
            self.outbox.need_full = True

    def _observe(self, info: pb.MemberInfo) -> None:
        change = self.membership.observe(info)
        if change is not None and change.restarted:
            self.directory.drop(info.node_id)
            for endpoint in info.endpoints:
                self.transport.forget(endpoint)
        if change is not None and change.joined:
            log.info("member %s (%s) joined", info.node_id, info.address)

    def _heard(self, info: pb.MemberInfo) -> None:
        """A heartbeat from ``info``: a new or restarted member gets fresh
        connections (no reconnect backoff left from its old address) and is
        called at once; it is listed alive when it answers."""
        change = self.membership.heard(info)
        if change is None:
            return
        if change.restarted:
            self.directory.drop(info.node_id)
        for endpoint in info.endpoints:
            self.transport.forget(endpoint)
        self.peers.reset(info.address)
        self._learned[info.address] = time.monotonic()
        self._wake.set()

    def _gossip_view(self) -> list[pb.MemberInfo]:
        """The view a heartbeat carries: none where etcd says who is alive
        (heartbeats then carry only reports: O(members) per round, not O(members^2))."""
        return self.membership.view() if self.membership.from_heartbeats else []

    def _gossip(self, known: Sequence[pb.MemberInfo]) -> None:
        now = time.monotonic()
        for info in known:
            if info.node_id != self.node.node_id and info.address and info.address != self.node.address:
                self._learned[info.address] = now

    def _forget_member(self, info: pb.MemberInfo, why: str) -> None:
        dropped = self.directory.drop(info.node_id)
        self.claims.drop_node(info.node_id)
        for endpoint in info.endpoints:
            self.transport.forget(endpoint)
        log.warning("member %s %s; dropped %d directory entries", info.node_id, why, dropped)

    def _endpoint_of(self, node_id: str) -> pb.TransportEndpoint | None:
        member = self.membership.member(node_id)
        if member is None:
            return None
        return next((e for e in member.endpoints if e.kind == self.transport.name), None)

    def _live_peers(self) -> set[str]:
        return {n for n in self.membership.live_ids() if n != self.node.node_id}

    # ---- the access stream ---------------------------------------------------
    def record_access(self, namespace: str, keys: Sequence[bytes], outcome: int, local: int) -> None:
        """Queue one served request for the coordinator's predictor."""
        depth = self.config.predictor_depths[-1]
        self._accesses.append((time.monotonic(), namespace, list(keys[:depth]), outcome, len(keys), local))

    def _take_accesses(self) -> list[pb.AccessEvent]:
        now = time.monotonic()
        events = [pb.AccessEvent(namespace=ns, keys=keys, age_seconds=now - t, outcome=outcome, total_blocks=total,
                                 local_blocks=local)
                  for t, ns, keys, outcome, total, local in self._accesses]
        self._accesses.clear()
        return events

    # ---- handlers for the Cluster service ----------------------------------
    def on_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self._refresh_self()
        self._heard(request.sender)
        self._gossip(request.known)
        self._learned[request.sender.address] = time.monotonic()
        need_full = False
        if request.has_directory:
            need_full = self.directory.report(request.sender.node_id, request.sender.incarnation, request.seq,
                                              request.full, request.directory, time.monotonic())
            if not need_full:
                self._claims_landed(request.sender.node_id, request.directory)
            if not need_full and self.membership.is_coordinator:
                self.placement.on_report(request.sender.node_id, request.directory)
        for event in request.accesses:
            self.placement.observe(request.sender.node_id, event)
        return pb.HeartbeatResponse(receiver=self.self_info, known=self._gossip_view(), need_full=need_full,
                                    accepted_seq=0 if need_full else request.seq)

    def check_keys(self, namespace: str, keys: Sequence[bytes]) -> None:
        """A peer's Locate or ClusterLookup: a valid name and a batch of keys."""
        check_key_batch(namespace, keys, self.config.max_batch_pages)

    def on_locate(self, namespace: str, keys: Sequence[bytes]) -> pb.LocateResponse:
        holders = self.directory.locate(namespace, keys)
        ids = set().union(*holders) if holders else set()
        members = [m for m in (self.membership.member(n) for n in sorted(ids)) if m is not None]
        return pb.LocateResponse(holders=[pb.KeyHolders(node_ids=sorted(h)) for h in holders], members=members)

    def prefixes(self, namespace: str, keys: Sequence[bytes], asker: str = "", claim_seconds: float = 0.0,
                 claim_start: int = 0, record: bool = False) -> list[pb.NodePrefix]:
        """Per live node: its longest cached prefix of ``keys``, with
        placement hints (speculative copies in flight or alive) and in-flight
        prefill claims (``computing``). ``asker`` (a node id) is noted as a
        waiter of the claims it is shown; with ``claim_seconds`` it claims
        the part of the chain past ``claim_start`` and what the directory
        knows is stored (after the answer is drawn: it never sees itself). The holders' entries count the
        pulls of the prefix in flight (``copies_ahead``); a ``record`` lookup of an asker that holds
        ``claim_start`` blocks announces its own."""
        def address_of(node_id: str) -> str | None:
            member = self.membership.member(node_id)
            return member.address if member is not None else None

        held = {n: length for n, length in self.directory.prefixes(namespace, keys).items()
                if address_of(n) is not None}
        now = time.monotonic()
        seen = self.claims.seen(namespace, keys, now, held, asker, record)
        out = answer.merge(held, self.placement.hints(namespace, keys), seen, address_of)
        answer.pulls_ahead(out, self.pulls, namespace, keys, asker, claim_start, now, held, record,
                           self.placement.sending)
        pool = self.directory.pool_lengths(namespace, keys, held)
        for n in out:
            n.pool_length = n.prefix_length if n.pending else min(n.prefix_length, pool.get(n.node_id, 0))
        if claim_seconds > 0 and asker and self.membership.member(asker) is not None:
            self.claims.claim(namespace, keys, asker, claim_seconds, now, start=max([claim_start, *held.values()]))
        return out

    def _claims_landed(self, node_id: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        landed = [c for b in batches if b.adds for c in self.claims.resolve(node_id, b.namespace, b.adds)]
        if landed and self.membership.is_coordinator:
            self.placement.on_claims_landed(landed)

    def _stored(self, namespace: str, added: Any = (), removed: Any = ()) -> None:
        """A node listener: pages stored here while this node holds claims go to the directory now (the
        heartbeat wakes), so the followers waiting for them learn of it a round trip later, not a beat."""
        if added and time.monotonic() < self._claimed_until:
            self._wake.set()

    def status(self) -> pb.ClusterStatusResponse:
        self._refresh_self()
        return pb.ClusterStatusResponse(node_id=self.node.node_id, coordinator=self.membership.coordinator(),
                                        members=self.membership.view(),
                                        joining=self.placement.joining() if self.membership.is_coordinator else [])

    # ---- lookups -------------------------------------------------------------
    async def _ask_directory(self, method: str, request: Any) -> Any | None:
        """Ask the directory: the coordinator, else (unreachable, or still
        warming after taking the role) the standby; None when neither answers."""
        for node_id in (self.membership.coordinator(), self.membership.standby()):
            member = self.membership.member(node_id) if node_id and node_id != self.node.node_id else None
            if member is None:
                continue
            try:
                return await self.peers.call_address(member.address, method, request,
                                                     max(0.2, self.config.heartbeat_interval))
            except KvError as exc:
                log.debug("%s at %s failed: %s", method, node_id, exc)
        return None

    def _answers_locally(self) -> bool:
        """This node coordinates and its copy is not warming: no RPC needed.
        (The standby asks the coordinator first: its copy of the
        coordinator's own pages lags one heartbeat.)"""
        return self.membership.is_coordinator and not self.warming()

    async def lookup(self, namespace: str, keys: Sequence[bytes], record: bool = False,
                     claim_seconds: float = 0.0) -> pb.LookupResponse:
        """Longest cached prefix here, and per live node (from the directory),
        with placement hints; ``record`` logs the request for the predictor.
        The directory is the coordinator's, else the standby's, else (neither
        answers) this node's own copy if it keeps one."""
        runs = self.node.tier_runs(namespace, keys)
        local = sum(run.pages for run in runs)
        me = self.node.node_id
        if claim_seconds > 0:
            self._claimed_until = max(self._claimed_until,
                                      time.monotonic() + claim_seconds + self.claims.grace_s)
        if self._answers_locally():
            nodes = self.prefixes(namespace, keys, me, claim_seconds, local, record)
        else:
            reply = await self._ask_directory("ClusterLookup", pb.LookupRequest(
                namespace=namespace, keys=keys, claim_seconds=claim_seconds, claim_node_id=me,
                claim_start=local, record=record))
            nodes = list(reply.nodes) if reply is not None else self.prefixes(namespace, keys)
        local_pool = runs[0].pages if runs and runs[0].tier == "pool" else 0
        nodes = answer.as_seen_by(nodes, me, local, self.node.address, self.membership.alive, local_pool)
        nodes.sort(key=lambda n: (-n.prefix_length, n.pending, n.node_id))
        if record and keys:
            depth = min(len(keys), self.config.predictor_depths[-1])
            remote = any(n.prefix_length >= depth and not n.pending for n in nodes if n.node_id != self.node.node_id)
            self.record_access(namespace, keys, 0 if local >= depth else 1 if remote else 2, local)
        return pb.LookupResponse(prefix_length=local, nodes=nodes,
                                 tiers=[pb.TierRun(tier=r.tier, pages=r.pages, load_seconds=r.load_seconds)
                                        for r in runs])

    async def locate(self, namespace: str, keys: Sequence[bytes]) -> pb.LocateResponse:
        """Who holds each of ``keys``: the directory, asked as :meth:`lookup` does."""
        if self._answers_locally():
            return self.on_locate(namespace, keys)
        reply = await self._ask_directory("Locate", pb.LocateRequest(namespace=namespace, keys=keys))
        if reply is None:
            return self.on_locate(namespace, keys)  # this node's own copy, if it keeps one (else empty)
        for info in reply.members:
            if self.membership.member(info.node_id) is None:
                self._observe(info)
        return reply
