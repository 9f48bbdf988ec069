"""The client side of the shared-memory data path (``kvstore.datapath.shm``).

For a client on the node's host: each namespace's pool is mapped once (the
node passes its memfd over the unix socket), a Get copies the granted slots
straight into the caller's buffer (one memcpy per page), a Put writes the
pages straight into the slots the node reserved. The socket carries only
keys, slot numbers and grants.

Write-ahead: every Put's COMMIT asks for free slots for the next one (as many
as it had pages); the next Put of at most that many pages writes straight
into them and commits in one round trip. Slots are used only within half the
lease the node gave them (the node keeps them to the end of the lease even if
the connection drops) and are forgotten with the connection.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import KvError, Unavailable
from kvstore.framing import PREFIX, WireError, decode_prefix, encode_header
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client._common import BlockingFrames, PutResult, parse_result

SHM_PRESENT = (1 << 64) - 1


@dataclass(slots=True)
class _Ahead:
    """Write-ahead slots the node reserved for this connection's next Put."""

    grant: int
    slots: list[int]
    use_by: float  # time.monotonic(): half the node's lease after the reply came


class ShmConn(BlockingFrames):
    """One connection to a node's shared-memory socket, with its mappings."""

    _what = "shared-memory socket"

    def __init__(self, path: str, timeout: float | None, token: str = "") -> None:
        self.path = path
        self._token = token  # a node with a token file wants it in a HELLO first
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._pools: dict[str, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._got_reply = False
        self._ahead: dict[str, _Ahead] = {}  # namespace -> its write-ahead slots (this connection's)

    @staticmethod
    def usable(path: str) -> bool:
        """Whether this process can reach the socket (it is on the node's host)."""
        return bool(path) and os.access(path, os.R_OK | os.W_OK)

    def close(self) -> None:
        if self._sock is not None:
            for spare in list(self._ahead.values()):  # give write-ahead slots back now, not at lease end
                self._release(spare.grant)
        self._ahead.clear()
        if self._sock is not None:  # (a failed release dropped it)
            self._sock.close()
            self._sock = None
        self._pools.clear()  # the mappings go with the last array that views them

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise Unavailable(f"shared-memory socket {self.path}: {exc}") from None
            self._sock = sock
            if self._token:
                try:
                    sock.sendall(encode_header(pb.DataHeader(op=pb.DataHeader.HELLO, token=self._token), 0))
                    self._result()
                except BaseException:
                    self._drop_socket()
                    raise
        return self._sock

    def _send(self, header: pb.DataHeader) -> None:
        self._socket().sendall(encode_header(header, 0))

    def _result(self, want_fd: bool = False) -> tuple[pb.DataHeader, int]:
        sock = self._socket()
        fd = -1
        if want_fd:  # the frame and the descriptor come in one message
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
            if not data:
                raise ConnectionError("node closed the shared-memory socket")
            self._got_reply = True
            fd = fds[0] if fds else -1
            buf = bytearray(data)
        else:
            buf = bytearray(PREFIX.size)
            self._recv_exact(memoryview(buf))
        if len(buf) < PREFIX.size:
            more = bytearray(PREFIX.size - len(buf))
            self._recv_exact(memoryview(more))
            buf += more
        header_len, _ = decode_prefix(bytes(buf[:PREFIX.size]))
        body = bytearray(buf[PREFIX.size:])
        if len(body) < header_len:
            rest = bytearray(header_len - len(body))
            self._recv_exact(memoryview(rest))
            body += rest
        return parse_result(bytes(body[:header_len])), fd

    def _exchange(self, header: pb.DataHeader, want_fd: bool = False,
                  retry: bool = True) -> tuple[pb.DataHeader, int]:
        """One request and its answer. A connection the node closed while it
        sat idle (``--idle-timeout``) fails before any answer byte: the
        request goes once more on a fresh connection (the mappings stay),
        unless ``retry`` is False (a request whose grant was the old connection's)."""
        for attempt in (0, 1) if retry else (0,):
            reused = self._sock is not None
            self._got_reply = False
            try:
                self._send(header)
                return self._result(want_fd)
            except KvError:
                raise
            except (OSError, ValueError, WireError) as exc:
                self._drop_socket()
                if attempt == 0 and reused and not self._got_reply and not isinstance(exc, TimeoutError):
                    continue
                raise Unavailable(f"shared-memory path to {self.path} failed: {exc}") from None
        raise AssertionError("unreachable")

    def _release(self, grant: int) -> None:
        """End a grant (one-way). If the connection is gone the node has
        already ended it with the connection."""
        try:
            self._send(pb.DataHeader(op=pb.DataHeader.RELEASE, grant=grant))
        except OSError:
            self._drop_socket()

    def _drop_socket(self) -> None:
        self._ahead.clear()  # they were this connection's
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _pool(self, namespace: str) -> np.ndarray:
        pool = self._pools.get(namespace)
        if pool is None:
            reply, fd = self._exchange(pb.DataHeader(op=pb.DataHeader.ATTACH, namespace=namespace), want_fd=True)
            if fd < 0:
                raise Unavailable("the node sent no shared-memory descriptor")
            try:
                nbytes = reply.num_slots * reply.page_bytes
                # populated: first writes into fresh slots then run at memcpy speed, not the page-fault rate
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                try:
                    region = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                except PermissionError:  # a read-only token's descriptor: map it for reading
                    region = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            pool = np.frombuffer(region, dtype=np.uint8, count=nbytes).reshape(reply.num_slots, reply.page_bytes)
            self._pools[namespace] = pool
        return pool

    def get(self, namespace: str, keys: Sequence[bytes], out: np.ndarray, timeout: float | None,
            local_only: bool) -> np.ndarray:
        """Copy the found pages into ``out``; returns ``found``."""
        with self._lock:
            pool = self._pool(namespace)
            deadline_ms = max(1, int(timeout * 1000)) if timeout else 0
            reply, _ = self._exchange(pb.DataHeader(op=pb.DataHeader.GET, namespace=namespace, keys=keys,
                                                    deadline_ms=deadline_ms, local_only=local_only))
            try:
                found = np.array(reply.found, dtype=bool)
                slots = np.array(reply.slots, dtype=np.int64)
                if len(found) != len(keys) or len(slots) != int(found.sum()) or reply.page_bytes != out.shape[1]:
                    raise Unavailable("shared-memory reply does not match the request")
                for row, slot in zip(np.flatnonzero(found).tolist(), slots.tolist()):
                    out[row] = pool[slot]  # one memcpy a page (np.take is 3-4x slower on large rows)
            finally:
                self._release(reply.grant)
            return found

    def put(self, namespace: str, keys: Sequence[bytes], views: Sequence[memoryview], page_bytes: int,
            kind: int) -> PutResult:
        with self._lock:
            pool = self._pool(namespace)
            spare = self._ahead.pop(namespace, None)
            if spare is not None and (len(spare.slots) < len(keys) or time.monotonic() > spare.use_by
                                      or pool.shape[1] != page_bytes):
                self._release(spare.grant)  # too few, or too old to trust: give them back
                spare = None
            if spare is not None:  # one round trip: the pages go into the slots reserved ahead
                for view, slot in zip(views, spare.slots):
                    pool[slot] = np.frombuffer(view, dtype=np.uint8)
                commit = pb.DataHeader(op=pb.DataHeader.COMMIT, grant=spare.grant, namespace=namespace, keys=keys,
                                       page_bytes=page_bytes, kind=kind, ahead=len(keys))
            else:
                reply, _ = self._exchange(pb.DataHeader(op=pb.DataHeader.PUT, namespace=namespace, keys=keys,
                                                        page_bytes=page_bytes, kind=kind))
                if len(reply.slots) != len(keys):
                    self._release(reply.grant)
                    raise Unavailable("shared-memory reply does not match the request")
                for view, slot in zip(views, reply.slots):
                    if slot != SHM_PRESENT:
                        pool[slot] = np.frombuffer(view, dtype=np.uint8)
                commit = pb.DataHeader(op=pb.DataHeader.COMMIT, grant=reply.grant, ahead=len(keys))
            done, _ = self._exchange(commit, retry=spare is None)
            if done.ahead_grant:
                if len(done.ahead_slots) and max(done.ahead_slots) < pool.shape[0]:
                    self._ahead[namespace] = _Ahead(done.ahead_grant, list(done.ahead_slots),
                                                    time.monotonic() + done.ahead_ms / 2000)
                else:
                    self._release(done.ahead_grant)
            return PutResult(done.put.stored, done.put.already_present, done.put.evicted)
