"""Page movement between nodes: serving pulls, pulling, Replicate and the
reactive fetch of a Get. All of it over the pool's one movement API
(:mod:`kvstore.pool.movement`) and the peer :class:`Transport`.

A pull of keys from a source, step by step:

1. ``pull`` drops keys already stored and keys another pull is already
   bringing here (single flight per (namespace, key): a later reader waits
   on the transfer in flight instead of starting a second one);
2. the rest goes in chunks of at most ``--max-pull-bytes``, two in flight,
   so the source packs one chunk while this node verifies the previous one;
3. each chunk is one ``Transport.fetch``: once the source's reply header
   says which keys it found, ``PutBatch.write_in`` reserves their slots and
   hands the transport the buffers to receive into (the slots themselves
   where possible);
4. ``Landing.finish`` verifies every page against the source's checksum
   (a page that fails is never stored, and is pulled once more), then the
   batch commits with its kind and, for speculative copies, ``expires_at``:
   from then on the node itself enforces the replica's TTL.

Errors: a failed transfer is a :class:`TransportError`; everything else is
the :class:`KvError` family. A failed or late pull turns pages into misses,
never into a client error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from kvstore.config import NodeConfig
from kvstore.errors import KvError, ResourceExhausted
from kvstore.metrics import NodeMetrics
from kvstore.node import Namespace, Node
from kvstore.pool.movement import Landing
from kvstore.pool.pool import PageKind, ReadHandle
from kvstore.tracing import TRACER, SpanKind, context_from, traceparent
from kvstore.transport.base import Served, Transport, TransportError
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
_PULLS_IN_FLIGHT = 2
_CANCEL_GRACE_S = 0.05  # how long a reader waits for its cancelled pulls to end

# locate(namespace, keys) -> per key the nodes that hold it, and their member infos
Locate = Callable[[str, Sequence[bytes]], Awaitable[pb.LocateResponse]]


def assign_sources(keys: Sequence[bytes], holders: Sequence[set[str]], usable: set[str],
                   puller: str = "") -> dict[str, list[bytes]]:
    """Pick one source per key: greedily the node that holds the most of the
    keys still unassigned, so each peer gets one batched transfer. Among
    holders of as many keys, each puller ranks them in its own order (a
    hash of puller and holder), so nodes pulling one prefix at once spread
    over its holders instead of all queueing on the lowest id's egress."""
    options = {k: h & usable for k, h in zip(keys, holders)}
    todo = [k for k in keys if options[k]]
    groups: dict[str, list[bytes]] = {}
    while todo:
        counts: dict[str, int] = {}
        for key in todo:
            for node in options[key]:
                counts[node] = counts.get(node, 0) + 1
        best = min(counts, key=lambda n: (-counts[n], zlib.crc32(f"{puller}/{n}".encode()) if puller else 0, n))
        groups[best] = [k for k in todo if best in options[k]]
        todo = [k for k in todo if best not in options[k]]
    return groups


class Replicator:
    """Serves this node's pages to peers and pulls peers' pages into it."""

    def __init__(self, node: Node, config: NodeConfig, transport: Transport, metrics: NodeMetrics,
                 endpoint_of: Callable[[str], pb.TransportEndpoint | None], locate: Locate,
                 live_peers: Callable[[], set[str]]) -> None:
        self.node = node
        self.config = config
        self.transport = transport
        self.metrics = metrics
        self._endpoint_of = endpoint_of
        self._locate = locate
        self._live_peers = live_peers
        self._inflight: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def pulls_in_flight(self) -> int:
        """Pages this node is pulling from peers right now."""
        return len(self._inflight)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- serving ---------------------------------------------------------
    def serve(self, request: pb.DataHeader) -> Served | Awaitable[Served]:
        """Answer a peer's pull from local pages only (never recursing): the pool's, and those in its tiers
        below, read from there without promoting them here."""
        ns = self.node.namespaces.get(request.namespace)
        if ns is not None and ns.below is not None and len(request.keys) <= self.node.config.max_batch_pages and \
                any(k not in ns.pool and ns.below.holds(k) for k in request.keys):
            return self._serve_below(ns, list(request.keys), request.traceparent)
        with TRACER.start_as_current_span("kvstore.serve_pull", context=context_from(request.traceparent),
                                          kind=SpanKind.SERVER, attributes={"kvstore.pages": len(request.keys)}):
            return self._serve(request)

    async def _serve_below(self, ns: Namespace, keys: list[bytes], traceparent: str) -> Served:
        with TRACER.start_as_current_span("kvstore.serve_pull", context=context_from(traceparent),
                                          kind=SpanKind.SERVER, attributes={"kvstore.pages": len(keys),
                                                                            "kvstore.tiers": True}):
            pool, below = ns.pool, ns.below
            assert below is not None
            handle = pool.acquire(keys, promote=False)
            try:
                slots = handle.slots
                if pool.ops.host_visible:
                    pooled = np.take(pool.buffer, slots, axis=0)
                else:
                    pooled = pool.ops.to_host(pool.ops.pack(pool.buffer, slots)) if slots else None
            finally:
                pool.release(handle)
            got = await below.read([k for k, hit in zip(keys, handle.found) if not hit])
            rows, found, sums = [], [], []
            it = iter(zip(handle.entries, pooled if pooled is not None else ()))
            for key, hit in zip(keys, handle.found):
                if hit:
                    entry, row = next(it)
                    rows.append(row)
                    sums.append(entry.checksum)
                elif key in got:
                    row, checksum = got[key]
                    rows.append(row)
                    sums.append(checksum)
                found.append(hit or key in got)
            header = pb.DataHeader(op=pb.DataHeader.RESULT, found=found, page_bytes=ns.layout.page_bytes,
                                   checksums=sums)
            self.metrics.peer_bytes.labels("out").inc(len(rows) * ns.layout.page_bytes)
            if not rows:
                return Served(header, None, lambda: None)
            payload: Any = [memoryview(r) for r in rows] if self.transport.carrier.scatter else np.stack(rows)
            return Served(header, payload, lambda: None)

    def _serve(self, request: pb.DataHeader) -> Served:
        try:
            ns = self.node.namespace(request.namespace)
            self.node.check_read_batch(ns, list(request.keys))
        except KvError as exc:
            header = pb.DataHeader(op=pb.DataHeader.RESULT, code=exc.code.value[0], message=str(exc)[:300])
            return Served(header, None, lambda: None)
        handle = ns.pool.acquire(list(request.keys), promote=False)
        header = pb.DataHeader(op=pb.DataHeader.RESULT, found=handle.found, page_bytes=ns.layout.page_bytes,
                               checksums=[e.checksum for e in handle.entries])
        out = ns.pool.read_out(handle, self.transport.carrier)
        self.metrics.peer_bytes.labels("out").inc(out.pages * ns.layout.page_bytes)
        return Served(header, out.payload, out.release)

    # ---- reads with reactive fetch -----------------------------------------
    async def read(self, namespace: str, keys: Sequence[bytes], timeout: float | None,
                   local_only: bool = False) -> tuple[Namespace, ReadHandle, set[bytes]]:
        """Hold the pages of ``keys`` for reading, first pulling missing ones
        from peers (unless ``--replication none``) for at most ``timeout``
        seconds; returns the namespace, the hold and the keys pulled."""
        fetched: set[bytes] = set()
        ns = self.node.namespace(namespace)
        self.node.check_read_batch(ns, keys)
        if ns.below is not None:  # this node's tiers first: bring what they hold into the pool
            start = time.monotonic()
            with TRACER.start_as_current_span("kvstore.promote", attributes={"kvstore.pages": len(keys)}):
                await ns.below.promote(keys, self.config.fetch_timeout if timeout is None else timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        if not local_only and self.config.replication != "none" and self._live_peers():
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

    async def fetch_missing(self, namespace: str, keys: Sequence[bytes], timeout: float) -> set[bytes]:
        """Pull the pages of ``keys`` this node lacks from any node that
        holds them (primaries and replicas alike), for at most ``timeout``
        seconds; returns the keys now stored here. Failures and the
        deadline turn pages into misses, never errors."""
        pool = self.node.namespace(namespace).pool
        missing = [k for k in dict.fromkeys(keys) if k not in pool]
        if not missing or timeout <= 0:
            return set()
        start = time.perf_counter()
        waiting = [k for k in missing if (namespace, k) in self._inflight]
        todo = [k for k in missing if (namespace, k) not in self._inflight]
        jobs: list[Awaitable[Any]] = [self._wait_inflight(namespace, waiting)] if waiting else []
        if todo:
            try:  # the directory's answer counts against the same deadline
                located = await asyncio.wait_for(self._locate(namespace, todo), timeout)
            except TimeoutError:
                located = pb.LocateResponse()
            if len(located.holders) == len(todo):
                groups = assign_sources(todo, [set(h.node_ids) for h in located.holders], self._live_peers(),
                                        self.node.node_id)
                jobs.extend(self.pull(src, namespace, ks, PageKind.REPLICA) for src, ks in groups.items())
        if jobs:
            await self._run_bounded(jobs, timeout - (time.perf_counter() - start))
        # what arrived, including chunks of transfers cut off by the deadline
        fetched = {k for k in missing if k in pool}
        self.metrics.remote_fetch.observe(time.perf_counter() - start)
        return fetched

    async def _run_bounded(self, jobs: list[Awaitable[Any]], timeout: float) -> None:
        """Run ``jobs`` for at most ``timeout`` seconds, then cancel the rest.
        A cancelled pull usually ends at once; one that needs longer to clean
        up (a UCX receive retiring) finishes on its own, tracked for
        :meth:`close`, while the reader answers with what arrived."""
        tasks = {asyncio.ensure_future(job) for job in jobs}
        for task in tasks:
            self._tasks.add(task)
            task.add_done_callback(self._retired)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)
        for task in done:
            if task.exception() is not None:
                log.warning("pull failed: %s", task.exception())

    def _retired(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("pull ended with %s", task.exception())

    async def _wait_inflight(self, namespace: str, keys: Sequence[bytes]) -> None:
        futures = [f for f in (self._inflight.get((namespace, k)) for k in keys) if f is not None]
        if futures:
            await asyncio.gather(*(asyncio.shield(f) for f in futures))

    # ---- Replicate -----------------------------------------------------------
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
        if source == self.node.node_id:
            # from itself: a promotion of the pages its tiers hold, up into the pool ahead of a forecast burst
            if todo:
                await self.node.promote(namespace, todo, None)
            copied = [k for k in todo if k in pool]
            return pb.ReplicateResponse(copied=len(copied), already_present=present, missing=len(todo) - len(copied))
        coming = {k for k in todo if (namespace, k) in self._inflight}  # another pull brings these: not ours
        try:
            copied = await self.pull(source, namespace, todo, kind, expires_at) if todo else []
        except TransportError as exc:  # the source died or is unknown: what did not come is missing
            log.warning("replicate from %s: %s", source, exc)
            copied = [k for k in todo if k in pool]
        theirs = sum(1 for k in copied if k in coming)
        return pb.ReplicateResponse(copied=len(copied) - theirs, already_present=present + theirs,
                                    missing=len(todo) - len(copied))

    # ---- pulling -------------------------------------------------------------
    async def pull(self, source: str, namespace: str, keys: Sequence[bytes], kind: PageKind,
                   expires_at: float = 0.0) -> list[bytes]:
        """Copy ``keys`` from ``source`` into this node's pool; returns the
        keys now stored. Keys another pull is bringing here are not pulled
        again: this call waits for that transfer instead."""
        with TRACER.start_as_current_span("kvstore.pull", kind=SpanKind.CLIENT,
                                          attributes={"kvstore.source": source, "kvstore.pages": len(keys)}):
            return await self._pull(source, namespace, keys, kind, expires_at)

    async def _pull(self, source: str, namespace: str, keys: Sequence[bytes], kind: PageKind,
                    expires_at: float) -> list[bytes]:
        pool = self.node.namespace(namespace).pool
        loop = asyncio.get_running_loop()
        mine: list[bytes] = []
        theirs: list[bytes] = []
        for key in dict.fromkeys(keys):
            if key in pool:
                continue
            if (namespace, key) in self._inflight:
                theirs.append(key)
            else:
                self._inflight[(namespace, key)] = loop.create_future()
                mine.append(key)
        try:
            stored = await self._pull_chunks(source, namespace, mine, kind, expires_at) if mine else []
        finally:
            for key in mine:
                future = self._inflight.pop((namespace, key))
                if not future.done():
                    future.set_result(key in pool)
        if theirs:
            await self._wait_inflight(namespace, theirs)
        return stored + [k for k in theirs if k in pool]

    async def _pull_chunks(self, source: str, namespace: str, keys: list[bytes], kind: PageKind,
                           expires_at: float) -> list[bytes]:
        """Pull in chunks of at most ``--max-pull-bytes``, two in flight; a
        deadline keeps the chunks that arrived."""
        page_bytes = self.node.namespace(namespace).layout.page_bytes
        per_chunk = max(1, self.config.max_pull_bytes // page_bytes)
        if len(keys) > per_chunk:  # several chunks: smaller ones pipeline better
            per_chunk = max(1, min(per_chunk, -(-len(keys) // 4)))
        window = asyncio.Semaphore(_PULLS_IN_FLIGHT)

        async def one(chunk: list[bytes]) -> list[bytes]:
            async with window:
                return await self._transfer(source, namespace, chunk, kind, expires_at, retry=True)

        tasks = [asyncio.ensure_future(one(keys[i:i + per_chunk])) for i in range(0, len(keys), per_chunk)]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:  # chunks already stored stay stored
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [k for part in done for k in part]

    async def _transfer(self, source: str, namespace: str, keys: Sequence[bytes], kind: PageKind,
                        expires_at: float, retry: bool) -> list[bytes]:
        """One fetch of ``keys`` from ``source`` straight into reserved slots."""
        endpoint = self._endpoint_of(source)
        if endpoint is None:
            raise TransportError(f"no {self.transport.name} endpoint known for {source[:100]}")
        page_bytes = self.node.namespace(namespace).layout.page_bytes
        batch = self.node.begin_put(namespace, kind, expires_at=expires_at)
        landed: list[tuple[list[bytes], Landing]] = []

        def alloc(n: int, size: int, reply: pb.DataHeader) -> Any:
            found = [k for k, hit in zip(keys, reply.found) if hit]
            if size != page_bytes or len(found) != n or len(reply.checksums) != n:
                raise TransportError(f"{source[:100]} sent {n} pages of {size} bytes with {len(reply.checksums)} "
                                     f"checksums for {len(found)} pages of {page_bytes} bytes")
            landed.append((found, batch.write_in(found, self.transport.carrier)))
            return landed[-1][1].targets

        request = pb.DataHeader(op=pb.DataHeader.GET, namespace=namespace, keys=keys, local_only=True,
                                traceparent=traceparent())
        found: list[bytes] = []
        bad: set[bytes] = set()
        try:
            try:
                async with asyncio.timeout(batch.time_left()):  # reserved slots are held this long at most
                    reply, _ = await self.transport.fetch(endpoint, request, alloc)
            except TimeoutError:
                raise TransportError(f"pull from {source[:100]} took over {self.config.transfer_timeout:g} s") from None
            if reply.code:
                raise TransportError(f"{source[:100]} refused the pull: {reply.message[:200]}")
            if not landed:
                return []
            found, landing = landed[0]
            bad = landing.finish(list(reply.checksums))
            batch.commit()
        except ResourceExhausted as exc:
            log.warning("no room for pages pulled from %s: %s", source, exc)
            return []
        finally:
            for _, landing in landed:
                landing.abandon()  # no-op once finished
            batch.abort()  # no-op after commit
        self.metrics.peer_bytes.labels("in").inc(len(found) * page_bytes)
        stored = [k for k in found if k not in bad]
        if bad:
            self.metrics.checksum_failures.inc(len(bad))
            log.warning("%d pages from %s failed their checksum%s", len(bad), source, "; retrying" if retry else "")
            if retry:
                stored.extend(await self._transfer(source, namespace, list(bad), kind, expires_at, retry=False))
        return stored
