"""The co-located data path: clients on the node's host move page bytes
through shared memory instead of a socket.

A host pool lives in an anonymous shared-memory file (``memfd``, see
``kvstore.hostmem.shared_empty``). A client on the same host connects to the
node's unix socket (``--shm-dir``; the folder is 0700 and the socket 0600, so
only the node's own user gets in), and speaks data-channel frames there
(:mod:`kvstore.framing`) without page payloads:

* ``ATTACH(namespace)`` -> ``RESULT(page_bytes, num_slots)`` with the pool's
  memfd passed as ``SCM_RIGHTS``: the client maps the pool;
* ``GET(keys)`` -> (reactive fetch as on every path) the node holds the
  found pages for reading and answers ``RESULT(found, slots, grant)``; the
  client copies the rows out of its mapping and sends ``RELEASE(grant)``
  (no reply), which ends the holds;
* ``PUT(keys, page_bytes)`` -> the node reserves slots for the new keys
  (``PutBatch.write_in``) and answers ``RESULT(slots, grant)``, one slot per
  key (``SHM_PRESENT``: already stored); the client writes the pages into
  those slots and sends ``COMMIT(grant)``; the node computes the checksums
  from the slots, commits and answers ``RESULT(put)``;
* write-ahead: a ``COMMIT`` may ask (``ahead``) for free slots for the
  connection's next Put; the node reserves up to that many from the free
  list (never evicting, at most an eighth of the pool) and answers them with
  the result. The client writes its next pages straight into them and sends
  ``COMMIT(grant, keys)``: one round trip per Put instead of two. The slots
  of keys already stored, and unused ones, go back to the pool. A full pool
  has no free slots to give, and its Puts take the two round trips.

A grant is leased: the node takes back its holds or reservation after
``--shm-hold-timeout`` seconds, or when the client's connection ends (a
client that dies mid-operation leaks nothing). Write-ahead slots are leased
for :data:`AHEAD_S` at most and live to the end of their lease even when the
connection ends first (the client may be writing into them that moment; it
uses them only within half the lease it was told), then go back. Trust: every client that may
attach a namespace is trusted with all of it (as with a CUDA IPC handle);
namespaces, and so tenants, do not share a segment. Device pools are not
shared this way (their clients use the socket paths).

With a token file, the first frame must be ``HELLO(token)`` (answered
``RESULT`` code 0, or UNAUTHENTICATED and the connection closed); the token
is checked again on every request (a rotated-out token stops working on an
open connection too), names are the tenant's (as on gRPC), GET/ATTACH need
``read`` and PUT/COMMIT ``write``. A ``read`` caller's ATTACH passes a
read-only descriptor: it can map the pool only for reading.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.cluster.replicator import Replicator
from kvstore.errors import InvalidArgument, KvError, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from kvstore.framing import ChannelClosed, WireError, encode_header, read_frame, sendall, server_limits
from kvstore.metrics import NodeMetrics
from kvstore.node import Namespace, Node, PutBatch
from kvstore.pool.movement import SOCKET, Landing
from kvstore.pool.pool import PageKind, ReadHandle, Reservation
from kvstore.security.tokens import DEVELOPMENT, Principal, TokenStore, qualify
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.tracing import TRACER, SpanKind, context_from

log = logging.getLogger(__name__)
SHM_PRESENT = (1 << 64) - 1  # a PUT slot meaning "already stored: write nothing"
AHEAD_S = 2.0  # longest lease of write-ahead slots (at most --shm-hold-timeout)


def default_dir() -> str:
    return f"/tmp/kvstored-{os.getuid()}"


@dataclass(slots=True)
class _Grant:
    ns: Namespace
    read: tuple[ReadHandle, set[bytes]] | None = None
    write: tuple[PutBatch, Landing, float] | None = None
    ahead: Reservation | None = None  # write-ahead slots, not yet under any key
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    grants: dict[int, _Grant] = field(default_factory=dict)
    token: str = ""  # the HELLO's token, checked again on every request
    principal: Principal = DEVELOPMENT


class ShmServer:
    """The unix-socket side of the shared-memory data path."""

    def __init__(self, node: Node, metrics: NodeMetrics, reader: Replicator, folder: str, name: str,
                 tokens: TokenStore | None = None) -> None:
        self._node = node
        self._metrics = metrics
        self._reader = reader
        self._dir = folder or default_dir()
        self.path = os.path.join(self._dir, f"{name}.sock")
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._limits = server_limits(node.config)  # header cap, read/idle timeouts, connections: as the data channel
        self._tokens = tokens  # the node's token store (None: no token file)

    async def start(self) -> None:
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        os.chmod(self._dir, 0o700)
        try:
            os.unlink(self.path)  # a previous node's socket on this name
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._spawn(self._accept())

    async def stop(self) -> None:
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        for conn in list(self._conns):
            conn.sock.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError:
                return
            if len(self._conns) >= self._limits.max_connections:
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self._tokens is not None and not await self._hello(loop, conn):
                return
            while True:
                try:
                    header, payload_len = await read_frame(loop, conn.sock, self._limits)
                except ChannelClosed:
                    return
                if payload_len:
                    raise WireError("shared-memory frames carry no payload")
                try:
                    self._authorize(conn, header.op)
                    await self._handle(loop, conn, header)
                except Unauthenticated as exc:  # the token was rotated out: this connection ends
                    self._metrics.auth_rejected.labels("client").inc()
                    await self._reply(loop, conn, code=exc.code, message=str(exc))
                    return
                except KvError as exc:
                    await self._reply(loop, conn, code=exc.code, message=str(exc))
        except WireError as exc:
            await self._reply(loop, conn, code=grpc.StatusCode.INVALID_ARGUMENT, message=str(exc))
        except (ChannelClosed, ConnectionError, OSError):
            pass
        finally:
            for grant_id, grant in list(conn.grants.items()):
                if grant.ahead is None:  # write-ahead slots stay reserved to the end of their lease
                    self._end(conn, grant_id, commit=False)
            self._conns.discard(conn)
            conn.sock.close()

    async def _hello(self, loop: asyncio.AbstractEventLoop, conn: _Conn) -> bool:
        """The connection's first frame: HELLO with a valid token, or it ends."""
        assert self._tokens is not None
        try:
            header, payload_len = await read_frame(loop, conn.sock, self._limits)
        except ChannelClosed:
            return False
        try:
            if payload_len or header.op != pb.DataHeader.HELLO:
                raise Unauthenticated("this node requires a HELLO frame with a client token first")
            conn.principal = self._tokens.authenticate(header.token)
            conn.token = header.token
        except Unauthenticated as exc:
            self._metrics.auth_rejected.labels("client").inc()
            await self._reply(loop, conn, code=exc.code, message=str(exc))
            return False
        await self._reply(loop, conn)
        return True

    def _authorize(self, conn: _Conn, op: int) -> None:
        """Raise unless the connection's token (still valid) allows ``op``."""
        if self._tokens is None:
            return
        conn.principal = self._tokens.authenticate(conn.token)
        need = "write" if op in (pb.DataHeader.PUT, pb.DataHeader.COMMIT) else "read"
        if not conn.principal.allows(need):
            raise PermissionDenied(f"shared memory: this op needs a token with the {need} role; this one has "
                                   f"{conn.principal.role}")

    async def _handle(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        op = h.op
        if op == pb.DataHeader.HELLO:  # a node without tokens accepts (and ignores) one
            if self._tokens is not None:
                raise InvalidArgument("HELLO comes once, as the first frame")
            await self._reply(loop, conn)
        elif op == pb.DataHeader.ATTACH:
            await self._attach(loop, conn, h)
        elif op == pb.DataHeader.GET:
            await self._get(loop, conn, h)
        elif op == pb.DataHeader.RELEASE:
            self._end(conn, h.grant, commit=False)
        elif op == pb.DataHeader.PUT:
            await self._put(loop, conn, h)
        elif op == pb.DataHeader.COMMIT:
            await self._commit(loop, conn, h)
        else:
            raise InvalidArgument(f"op {int(op)} is not a shared-memory request")

    async def _reply(self, loop: asyncio.AbstractEventLoop, conn: _Conn, fds: list[int] | None = None,
                     code: grpc.StatusCode | None = None, message: str = "", **fields: Any) -> None:
        header = pb.DataHeader(op=pb.DataHeader.RESULT, code=code.value[0] if code else 0, message=message[:300],
                               **fields)
        frame = encode_header(header, 0)
        if fds:
            # Small: one sendmsg carries the frame and the descriptor.
            conn.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            await sendall(loop, conn.sock, frame)

    def _namespace(self, name: str) -> Namespace:
        ns = self._node.namespace(name)
        if ns.pool.shm_fd < 0:
            raise Unavailable(f"namespace {name[:100]!r} is not in shared memory here (device pool or --shm off)")
        return ns

    async def _attach(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        ns = self._namespace(qualify(conn.principal, h.namespace))
        if conn.principal.allows("write"):
            await self._reply(loop, conn, fds=[ns.pool.shm_fd], page_bytes=ns.layout.page_bytes,
                              num_slots=ns.pool.num_slots)
            return
        fd = os.open(f"/proc/self/fd/{ns.pool.shm_fd}", os.O_RDONLY | os.O_CLOEXEC)  # a read-only descriptor
        try:
            await self._reply(loop, conn, fds=[fd], page_bytes=ns.layout.page_bytes, num_slots=ns.pool.num_slots)
        finally:
            os.close(fd)

    def _grant(self, conn: _Conn, grant: _Grant, timeout: float | None = None) -> int:
        grant_id = next(self._ids)
        conn.grants[grant_id] = grant
        timeout = self._node.config.shm_hold_timeout if timeout is None else timeout
        grant.timer = asyncio.get_running_loop().call_later(timeout, self._expire, conn, grant_id)
        return grant_id

    def _expire(self, conn: _Conn, grant_id: int) -> None:
        grant = conn.grants.get(grant_id)
        if grant is not None:
            if grant.ahead is None:  # write-ahead slots simply lapse when not used
                log.warning("shm: a client held grant %d past --shm-hold-timeout; taking it back", grant_id)
            self._end(conn, grant_id, commit=False)

    def _end(self, conn: _Conn, grant_id: int, commit: bool) -> _Grant | None:
        grant = conn.grants.pop(grant_id, None)
        if grant is None:
            return None
        if grant.timer is not None:
            grant.timer.cancel()
        if grant.read is not None:
            handle, fetched = grant.read
            self._reader.end_read(grant.ns, handle, fetched)
        if grant.write is not None and not commit:
            batch, landing, _ = grant.write
            landing.abandon()
            batch.abort()
        if grant.ahead is not None and not commit:
            grant.ns.pool.abort(grant.ahead)
        return grant

    async def _get(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        with TRACER.start_as_current_span("kvstore.get", context=context_from(getattr(h, "traceparent", "")),
                                          kind=SpanKind.SERVER, attributes={"kvstore.path": "shm"}):
            await self._serve_get(loop, conn, h)

    async def _serve_get(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        start = time.perf_counter()
        name = qualify(conn.principal, h.namespace)
        self._namespace(name)
        share = self._node.config.deadline_share
        timeout = share * h.deadline_ms / 1000 if h.deadline_ms else None
        ns, handle, fetched = await self._reader.read(name, list(h.keys), timeout, h.local_only)
        grant_id = self._grant(conn, _Grant(ns, read=(handle, fetched)))
        await self._reply(loop, conn, found=handle.found, slots=handle.slots, grant=grant_id,
                          page_bytes=ns.layout.page_bytes)
        hits = len(handle.entries)
        self._metrics.count_get("shm", hits, len(handle.found) - hits, ns.layout.page_bytes,
                                time.perf_counter() - start)

    def _begin_put(self, ns: Namespace, h: Any) -> PutBatch:
        """The batch of a PUT (or a write-ahead COMMIT) into ``ns``, once its page size and kind check."""
        if h.page_bytes != ns.layout.page_bytes:
            raise InvalidArgument(f"pages of {h.page_bytes} bytes; namespace {ns.name[:100]!r} pages are "
                                  f"{ns.layout.page_bytes} bytes")
        if h.kind not in (0, PageKind.PRIMARY, PageKind.REPLICA, PageKind.SPECULATIVE):
            raise InvalidArgument(f"unknown page kind {int(h.kind)}")
        return self._node.begin_put(ns.name, PageKind(h.kind or PageKind.PRIMARY),
                                    timeout=self._node.config.shm_hold_timeout)

    async def _put(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        ns = self._namespace(qualify(conn.principal, h.namespace))
        batch = self._begin_put(ns, h)
        try:
            landing = batch.write_in(list(h.keys), SOCKET)
        except BaseException:
            batch.abort()
            raise
        grant_id = self._grant(conn, _Grant(ns, write=(batch, landing, time.perf_counter())))
        slots = [SHM_PRESENT if s is None else s for s in landing.key_slots]
        await self._reply(loop, conn, slots=slots, grant=grant_id, page_bytes=ns.layout.page_bytes)

    async def _commit(self, loop: asyncio.AbstractEventLoop, conn: _Conn, h: Any) -> None:
        grant = conn.grants.get(h.grant)
        if grant is None or (grant.write is None and grant.ahead is None):
            raise ResourceExhausted(f"grant {int(h.grant)} is not a live reservation (taken back after "
                                    f"--shm-hold-timeout?)")
        start = time.perf_counter()
        self._end(conn, h.grant, commit=True)
        if grant.ahead is not None:
            batch, landing = self._written_ahead(conn, h, grant.ns, grant.ahead)
        else:
            batch, landing, start = grant.write  # type: ignore[misc]
        try:
            landing.finish()
            result = batch.commit()
        finally:
            batch.abort()  # no-op after commit
        ns = grant.ns
        page_bytes = ns.layout.page_bytes
        self._metrics.ops.labels("put", "OK").inc()
        self._metrics.bytes.labels("put", "shm").inc(result.stored * page_bytes)
        self._metrics.latency.labels("put", "shm").observe(time.perf_counter() - start)
        ahead = self._ahead(conn, ns, h.ahead) if h.ahead else {}
        await self._reply(loop, conn, put=pb.PutResponse(stored=result.stored, already_present=result.already_present,
                                                         evicted=result.evicted), **ahead)

    def _written_ahead(self, conn: _Conn, h: Any, ns: Namespace, res: Reservation) -> tuple[PutBatch, Landing]:
        """A COMMIT of write-ahead slots: its keys' pages are in them; the batch takes them over."""
        try:
            if self._namespace(qualify(conn.principal, h.namespace)) is not ns:
                raise InvalidArgument("these write-ahead slots belong to another namespace (or one deleted since)")
            batch = self._begin_put(ns, h)
            try:
                return batch, batch.write_ahead(list(h.keys), res)
            except BaseException:
                batch.abort()
                raise
        except BaseException:
            ns.pool.abort(res)  # refused before the batch took the slots over
            raise

    def _ahead(self, conn: _Conn, ns: Namespace, want: int) -> dict[str, Any]:
        """Free slots for the connection's next Put (write-ahead), as RESULT fields; none when the pool
        has no free slot (they never evict) or the namespace went away."""
        cfg, page_bytes = self._node.config, ns.layout.page_bytes
        most = min(want, cfg.max_batch_pages, max(1, cfg.max_batch_bytes // page_bytes), max(1, ns.pool.num_slots // 8))
        if self._node.namespaces.get(ns.name) is not ns:
            return {}
        res = ns.pool.reserve_free(most)
        if res is None:
            return {}
        lease = min(AHEAD_S, cfg.shm_hold_timeout)
        grant_id = self._grant(conn, _Grant(ns, ahead=res), timeout=lease)
        return {"ahead_slots": res.slots, "ahead_grant": grant_id, "ahead_ms": int(lease * 1000)}
