"""The ``kvstore.v1.KvStore`` gRPC service: thin translation to :class:`Node`.

Every handler parses the request, calls the node, builds the response, and
turns a :class:`KvError` into the matching status code with its message
(bounded in length). :class:`kvstore.rpc.BoundaryInterceptor` stands behind
them for undecodable bodies and unexpected errors.

Tenants: with a token file, :class:`kvstore.server.auth.AuthInterceptor`
sets the caller's principal, and every namespace name a client gives is its
tenant's (``m`` is ``acme/m`` inside the node, :func:`qualify`), so equal
keys of two tenants are in two pools, and another tenant's namespace is
NOT_FOUND like one that does not exist. CreateNamespace stays within the
tenant's quota (namespaces, reserved bytes). Without a token file names are
used as given (development mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

import kvstore
from kvstore.cluster.agent import ClusterAgent
from kvstore.cluster.checks import check_claim_seconds
from kvstore.framing import WIRE_VERSION
from kvstore.errors import (DeadlineExceeded, InvalidArgument, KvError, ResourceExhausted, Unauthenticated, bounded,
                            shown)
from kvstore.hostmem import populated_empty
from kvstore.metrics import NodeMetrics
from kvstore.node import MESSAGE_OVERHEAD, Namespace, Node, PutBatch, page_kind
from kvstore.pool.layout import PageLayout
from kvstore.pool.movement import SOCKET
from kvstore.pool.pool import PageKind
from kvstore.tracing import TRACER, SpanKind, context_from
from kvstore.security.tokens import CALLER, DEVELOPMENT, Principal, TokenStore, owns, qualify, unqualify
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

T = TypeVar("T")
# A gRPC Get stops fetching from peers at least this long before its
# deadline, to send what it has (besides --deadline-share).
_SEND_MARGIN_S = 0.15


@dataclass(frozen=True, slots=True)
class _NamedLease:
    """What a leasing Lookup with an idempotency key pinned, kept for repeats."""

    lease_id: str
    leased_length: int
    expires_at: float


def _handler(op: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Count, time and translate errors for a unary(-response) handler."""

    def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(fn)
        async def handler(self: "KvStoreService", request: Any, context: grpc.aio.ServicerContext) -> T:
            start = time.perf_counter()
            code = "OK"
            with TRACER.start_as_current_span(f"kvstore.{op}", context=context_from(context.invocation_metadata()),
                                              kind=SpanKind.SERVER) as span:
                try:
                    return await fn(self, request, context)
                except KvError as exc:
                    code = exc.code.name
                    await context.abort(exc.code, bounded(str(exc)))
                    raise AssertionError("unreachable")  # abort raises
                finally:
                    span.set_attribute("rpc.grpc.status", code)
                    self.metrics.ops.labels(op, code).inc()
                    self.metrics.latency.labels(op, "grpc").observe(time.perf_counter() - start)

        return handler

    return wrap


def namespace_info(ns: Namespace, device: str, name: str | None = None) -> pb.NamespaceInfo:
    """``ns`` as a client sees it (``name``: the name it knows, without its tenant)."""
    layout = ns.layout
    return pb.NamespaceInfo(
        namespace=ns.name if name is None else name,
        layout=pb.PageLayout(page_bytes=layout.page_bytes, block_tokens=layout.block_tokens,
                             num_layers=layout.num_layers, kv_heads=layout.kv_heads,
                             head_dim=layout.head_dim, dtype=layout.dtype),
        capacity_bytes=ns.capacity, num_slots=ns.pool.num_slots, used_slots=ns.pool.used_slots,
        pinned_slots=ns.pool.pinned_slots, device=device,
    )


class KvStoreService(pb_grpc.KvStoreServicer):
    def __init__(self, node: Node, metrics: NodeMetrics, agent: ClusterAgent,
                 data_port: Callable[[], int | None], shm_path: Callable[[], str | None] = lambda: None,
                 tokens: TokenStore | None = None) -> None:
        self.node = node
        self._tokens = tokens  # tenant quotas (None: development mode, no tenants)
        self.metrics = metrics
        self.agent = agent
        self._data_port = data_port
        self._shm_path = shm_path
        self._named_leases: OrderedDict[tuple[str, str], _NamedLease] = OrderedDict()

    # ---- tenants -------------------------------------------------------
    def _caller(self) -> Principal:
        """Who is calling: the interceptor's principal, or DEVELOPMENT on a
        node without a token file (with one and no principal: refused)."""
        principal = CALLER.get()
        if principal is not None:
            return principal
        if self._tokens is not None:
            raise Unauthenticated("this node requires a client token (authorization: Bearer <token>)")
        return DEVELOPMENT

    def _name(self, name: str) -> str:
        """The internal name of the caller's namespace ``name``."""
        return qualify(self._caller(), name)

    def _within_quota(self, who: Principal, name: str, capacity: int) -> int:
        """The capacity a new namespace of ``who`` may reserve (0: the node's
        free bytes), or ResourceExhausted past the tenant's quota. No await
        between this and the creation: two calls cannot both take the rest."""
        if self._tokens is None or not who.tenant or name in self.node.namespaces:
            return capacity  # development mode, or exist_ok / AlreadyExists decides
        quota = self._tokens.quota(who.tenant)
        mine = [ns for internal, ns in self.node.namespaces.items() if owns(who, internal)]
        if quota.max_namespaces is not None and len(mine) >= quota.max_namespaces:
            raise ResourceExhausted(f"tenant {who.tenant!r} has {len(mine)} namespaces here, its quota is "
                                    f"{quota.max_namespaces}")
        if quota.max_bytes is None:
            return capacity
        left = quota.max_bytes - sum(ns.capacity for ns in mine)
        free = self.node.config.capacity - self.node.reserved_bytes
        want = capacity or min(left, free)
        if want > left or want <= 0:
            raise ResourceExhausted(f"tenant {who.tenant!r} may reserve {max(0, left)} more bytes here "
                                    f"(quota {quota.max_bytes}); asked for {capacity or 'the rest'}")
        return want

    # ---- namespaces ----------------------------------------------------
    @_handler("create_namespace")
    async def CreateNamespace(self, request: pb.CreateNamespaceRequest, context: Any) -> pb.NamespaceInfo:
        lay = request.layout
        layout = PageLayout(lay.page_bytes, lay.block_tokens, lay.num_layers, lay.kv_heads, lay.head_dim, lay.dtype)
        who = self._caller()
        name = qualify(who, request.namespace)
        capacity = self._within_quota(who, name, request.capacity_bytes)
        ns = self.node.create_namespace(name, layout, capacity, request.exist_ok)
        return namespace_info(ns, self.node.ops.device, request.namespace)

    @_handler("describe_namespace")
    async def DescribeNamespace(self, request: pb.DescribeNamespaceRequest, context: Any) -> pb.NamespaceInfo:
        return namespace_info(self.node.namespace(self._name(request.namespace)), self.node.ops.device,
                              request.namespace)

    @_handler("list_namespaces")
    async def ListNamespaces(self, request: pb.ListNamespacesRequest, context: Any) -> pb.ListNamespacesResponse:
        who = self._caller()
        return pb.ListNamespacesResponse(
            namespaces=[namespace_info(ns, self.node.ops.device, unqualify(who, name))
                        for name, ns in self.node.namespaces.items() if owns(who, name)])

    @_handler("delete_namespace")
    async def DeleteNamespace(self, request: pb.DeleteNamespaceRequest, context: Any) -> pb.DeleteNamespaceResponse:
        self.node.delete_namespace(self._name(request.namespace))
        return pb.DeleteNamespaceResponse()

    # ---- pages ---------------------------------------------------------
    @_handler("put")
    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutResponse:
        """One batch per stream. Each message's pages reserve their slots only
        when the message is here; once the first one is, every next message
        must come within ``--read-timeout`` and the stream must end within
        ``--transfer-timeout``, or the batch aborts and frees its slots."""
        batch = None
        nbytes = 0
        messages = request_iterator.__aiter__()
        who = self._caller()
        try:
            while (chunk := await self._next_put(messages, batch)) is not None:
                if batch is None:
                    batch = self.node.begin_put(qualify(who, chunk.namespace), page_kind(chunk.kind, PageKind.PRIMARY))
                elif chunk.namespace and qualify(who, chunk.namespace) != batch.ns.name:
                    raise InvalidArgument(f"one Put stream names two namespaces: "
                                          f"{shown(unqualify(who, batch.ns.name))}, {shown(chunk.namespace)}")
                elif chunk.kind and page_kind(chunk.kind, batch.kind) is not batch.kind:
                    raise InvalidArgument(f"one Put stream names two page kinds: {batch.kind.name}, {chunk.kind}")
                batch.add(chunk.keys, chunk.pages)
                nbytes += len(chunk.pages) * batch.ns.layout.page_bytes
            if batch is None:
                raise InvalidArgument("empty Put stream: the first message must name a namespace")
            result = batch.commit()
        finally:
            if batch is not None:
                batch.abort()
        self.metrics.bytes.labels("put", "grpc").inc(nbytes)
        self.metrics.pages.labels("put", "stored").inc(result.stored)
        self.metrics.pages.labels("put", "present").inc(result.already_present)
        return pb.PutResponse(stored=result.stored, already_present=result.already_present, evicted=result.evicted)

    async def _next_put(self, messages: AsyncIterator[pb.PutRequest], batch: PutBatch | None) -> pb.PutRequest | None:
        """The stream's next message (None at its end), under the batch's limits."""
        cfg = self.node.config
        left = batch.time_left() if batch is not None else None
        wait = cfg.idle_timeout if batch is None else min(cfg.read_timeout, left if left is not None else 1e9)
        try:
            async with asyncio.timeout(wait):
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if batch is None:
                raise DeadlineExceeded(f"the Put stream sent no message for {wait:g} s") from None
            if left is not None and left <= cfg.read_timeout:
                raise DeadlineExceeded(f"the Put stream did not end within {cfg.transfer_timeout:g} s "
                                       f"(--transfer-timeout); its slots were freed") from None
            raise DeadlineExceeded(f"the Put stream sent no message for {cfg.read_timeout:g} s "
                                   f"(--read-timeout); its slots were freed") from None

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetResponse]:
        """The pages this node holds are streamed at once; then the missing
        ones are pulled from peers (within ``--deadline-share`` of the
        deadline, and a margin) and streamed; the last message lists the keys
        still missing. So a caller at its deadline has the local pages."""
        span = TRACER.start_span("kvstore.get", context=context_from(context.invocation_metadata()),
                                 kind=SpanKind.SERVER)
        try:
            async for message in self._get(request, context, span):
                yield message
        finally:
            span.end()

    async def _get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext,
                   span: Any) -> AsyncIterator[pb.GetResponse]:
        start = time.perf_counter()
        keys = list(request.keys)
        try:
            name = self._name(request.namespace)
            ns = self.node.namespace(name)
            self.node.check_read_batch(ns, keys)
        except KvError as exc:
            self.metrics.ops.labels("get", exc.code.name).inc()
            await context.abort(exc.code, bounded(str(exc)))
            return
        limit = self.node.config.max_message_bytes - MESSAGE_OVERHEAD
        if request.max_chunk_bytes:
            limit = min(limit, request.max_chunk_bytes)
        per_msg = max(1, limit // ns.layout.page_bytes)
        local = ns.pool.acquire(keys)
        ns.counters.hits += len(local.entries)
        try:
            with contextlib.closing(_messages(ns, local, per_msg)) as messages:
                for msg in messages:
                    yield msg
        finally:
            ns.pool.release(local)
        hits = len(local.entries)
        missing = [k for k, hit in zip(keys, local.found) if not hit]
        if missing:
            remaining = context.time_remaining()
            budget = None
            asked = time.monotonic()
            if remaining is not None:
                budget = max(0.0, min(self.node.config.deadline_share * remaining, remaining - _SEND_MARGIN_S))
            try:
                with trace.use_span(span, end_on_exit=False):  # the pulls join the Get's trace
                    ns, handle, fetched = await self.agent.replicator.read(name, missing, budget,
                                                                           request.local_only)
            except KvError as exc:  # e.g. the namespace was deleted meanwhile
                self.metrics.ops.labels("get", exc.code.name).inc()
                await context.abort(exc.code, bounded(str(exc)))
                return
            try:
                with contextlib.closing(_messages(ns, handle, per_msg)) as messages:
                    for msg in messages:
                        yield msg
            finally:
                self.agent.replicator.end_read(ns, handle, fetched)
            hits += len(handle.entries)
            missing = [k for k, hit in zip(missing, handle.found) if not hit]
            if missing and ns.below is not None:  # held below, more than the pool took in: from their tiers
                left = None if budget is None else max(0.0, budget - (time.monotonic() - asked))
                served: Counter[bytes] = Counter()
                async for msg in _from_tiers(ns, missing, left, per_msg, served):
                    yield msg
                if served:
                    n = sum(served.values())
                    hits += n
                    ns.counters.hits += n
                    ns.counters.misses -= n
                    missing = [k for k in missing if k not in served]
        yield pb.GetResponse(missing_keys=missing)
        self.metrics.count_get("grpc", hits, len(keys) - hits, ns.layout.page_bytes, time.perf_counter() - start)

    @_handler("lookup")
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        name = self._name(request.namespace)
        check_claim_seconds(request.claim_seconds, self.node.config.max_claim_seconds)
        if request.lease_ttl_seconds or request.lease_id:
            return await self._lookup_and_lease(name, request)
        return await self.agent.lookup(name, list(request.keys), request.record, request.claim_seconds)

    async def _lookup_and_lease(self, name: str, request: pb.LookupRequest) -> pb.LookupResponse:
        """Lookup that pins this node's answer in the same call, idempotent
        per ``lease_id``: a repeat neither pins nor records again.

        The check and the pin run without an await between them, so two
        concurrent calls with one key on the loop cannot both pin.
        """
        keys, client_id = list(request.keys), request.lease_id
        if len(client_id.encode()) > 128:
            raise InvalidArgument("lease_id must be at most 128 bytes")
        now = time.monotonic()
        while self._named_leases and next(iter(self._named_leases.values())).expires_at <= now:
            self._named_leases.popitem(last=False)  # oldest first; a longer-lived one waits its turn
        held = self._named_leases.get((name, client_id)) if client_id else None
        if held is not None and held.expires_at <= now:
            held = None
        if held is None:
            local = self.node.lookup(name, keys)
            lease_id, pinned = "", 0
            ttl = request.lease_ttl_seconds
            if local:
                lease, _ = self.node.pin(name, keys[:local], ttl)  # validates ttl
                lease_id, pinned = lease.lease_id, len(lease.keys)
            elif not (0 < ttl <= self.node.config.max_pin_ttl):
                raise InvalidArgument(f"lease_ttl_seconds must be in (0, {self.node.config.max_pin_ttl}], got {ttl}")
            held = _NamedLease(lease_id, pinned, now + ttl)
            if client_id:
                self._named_leases[(name, client_id)] = held
                self._named_leases.move_to_end((name, client_id))
            first = True
        else:
            first = False
        reply = await self.agent.lookup(name, keys, request.record and first, request.claim_seconds if first else 0.0)
        reply.lease_id, reply.leased_length = held.lease_id, held.leased_length
        reply.lease_expires_in_seconds = max(0.0, held.expires_at - time.monotonic())
        if first:
            self.metrics.pages.labels("lookup", "leased").inc(held.leased_length)
        return reply

    @_handler("exists")
    async def Exists(self, request: pb.KeysRequest, context: Any) -> pb.ExistsResponse:
        return pb.ExistsResponse(exists=self.node.exists(self._name(request.namespace), list(request.keys)))

    @_handler("delete")
    async def Delete(self, request: pb.KeysRequest, context: Any) -> pb.DeleteResponse:
        deleted, not_found, pinned = self.node.delete(self._name(request.namespace), list(request.keys))
        return pb.DeleteResponse(deleted=deleted, not_found=not_found, pinned=pinned)

    @_handler("pin")
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        lease, missing = self.node.pin(self._name(request.namespace), list(request.keys), request.ttl_seconds)
        return pb.PinResponse(lease_id=lease.lease_id, pinned_keys=lease.keys, missing_keys=missing,
                              expires_in_seconds=request.ttl_seconds)

    @_handler("unpin")
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> pb.UnpinResponse:
        return pb.UnpinResponse(released=self.node.unpin(self._name(request.namespace), request.lease_id))

    # ---- node ----------------------------------------------------------
    @_handler("stats")
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        node = self.node
        who = self._caller()
        names = [qualify(who, request.namespace)] if request.namespace else [n for n in node.namespaces if owns(who, n)]
        out = []
        for name in names:
            ns = node.namespace(name)
            pool = ns.pool
            out.append(pb.NamespaceStats(
                namespace=unqualify(who, name), page_bytes=ns.layout.page_bytes, capacity_bytes=ns.capacity,
                used_bytes=pool.used_slots * ns.layout.page_bytes, num_slots=pool.num_slots,
                used_slots=pool.used_slots, pinned_slots=pool.pinned_slots,
                speculative_slots=pool.speculative_slots, hits=ns.counters.hits, misses=ns.counters.misses,
                puts=ns.counters.puts, evictions={r: pool.evictions[r] for r in ("speculative", "lru")},
                active_leases=sum(1 for lease in node.leases.values() if lease.namespace == name),
                remote_hits=ns.counters.remote_hits, replica_slots=pool.replica_slots,
                speculative_hits=pool.spec_hits, speculative_wasted_bytes=pool.spec_wasted * ns.layout.page_bytes))
        reply = pb.StatsResponse(node_id=node.node_id, uptime_seconds=node.uptime(),
                                 capacity_bytes=node.config.capacity, namespaces=out, device=node.ops.device,
                                 pulls_in_flight=self.agent.replicator.pulls_in_flight,
                                 claimed_keys=len(self.agent.claims))
        if who.allows("admin"):  # the node-wide view: other tenants' reservations, the cluster's members
            view = self.agent.status()
            reply.reserved_bytes, reply.coordinator = node.reserved_bytes, view.coordinator
            reply.members.extend(view.members)
            reply.tiers.extend(pb.TierStats(**t) for t in node.tiers.summary())
        return reply

    @_handler("node_info")
    async def NodeInfo(self, request: pb.NodeInfoRequest, context: Any) -> pb.NodeInfoResponse:
        cfg = self.node.config
        endpoints = []
        port = self._data_port()
        if port is not None:
            endpoints.append(pb.DataEndpoint(protocol="kvs-tcp", host=cfg.host, port=port, version=WIRE_VERSION,
                                             tls=cfg.tls))  # a node with a certificate: TLS on every port
        shm = self._shm_path()
        if shm:  # clients on this host (they can open the socket) move bytes through shared memory
            endpoints.append(pb.DataEndpoint(protocol="kvs-shm", host=cfg.host, path=shm, version=WIRE_VERSION))
        return pb.NodeInfoResponse(
            node_id=self.node.node_id, version=kvstore.__version__, device=self.node.ops.device,
            max_message_bytes=cfg.max_message_bytes, max_batch_pages=cfg.max_batch_pages,
            max_batch_bytes=cfg.max_batch_bytes, max_pin_ttl_seconds=cfg.max_pin_ttl, data_endpoints=endpoints)


async def _from_tiers(ns: Namespace, missing: list[bytes], timeout: float | None, per_msg: int,
                      served: Counter[bytes]) -> AsyncIterator[pb.GetResponse]:
    """The pages of ``missing`` (a Get's keys, repeats included, that its pool did not have) its tiers hold,
    read straight from there (``NamespaceTiers.serve_into``) as Get messages of at most ``per_msg`` pages, a
    message's worth at a time through one buffer of that many pages; ``served`` counts the keys answered."""
    below = ns.below
    assert below is not None
    wanted = below.unpromoted(missing, timeout)
    if not wanted:
        return
    end = None if timeout is None else time.monotonic() + timeout
    repeats = Counter(missing)
    rows = populated_empty(min(per_msg, len(wanted)), ns.layout.page_bytes)
    for i in range(0, len(wanted), len(rows)):
        part = wanted[i:i + len(rows)]
        ok = await below.serve_into(part, rows[:len(part)], None if end is None else max(0.0, end - time.monotonic()))
        pages = [(key, j) for j, key in enumerate(part) if ok[j] for _ in range(repeats[key])]
        for start in range(0, len(pages), per_msg):
            chunk = pages[start:start + per_msg]
            yield pb.GetResponse(keys=[key for key, _ in chunk], pages=[rows[j].tobytes() for _, j in chunk])
        for key, _ in pages:
            served[key] += 1


def _messages(ns: Namespace, handle: Any, per_msg: int) -> Iterator[pb.GetResponse]:
    """The held pages of ``handle`` as Get messages of at most ``per_msg`` pages."""
    found_keys = [e.key for e in handle.entries]
    out = ns.pool.read_out(handle, SOCKET)
    try:
        views = out.payload or []
        for i in range(0, len(views), per_msg):
            yield pb.GetResponse(keys=found_keys[i:i + per_msg], pages=[v.tobytes() for v in views[i:i + per_msg]])
    finally:
        out.release()
