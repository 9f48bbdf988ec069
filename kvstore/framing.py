"""Framing shared by the data channel and the TCP peer transport: the frame
format and the socket helpers that read and skip frames.

A frame is a fixed 20-byte prefix, a ``kvstore.v1.DataHeader`` protobuf of
``header_len`` bytes, then ``payload_len`` bytes of pages (in key order)::

    magic  b"KVSD"   4 bytes
    version          uint16 LE   (WIRE_VERSION)
    flags            uint16 LE   (0; reserved)
    header_len       uint32 LE   (<= MAX_HEADER_BYTES)
    payload_len      uint64 LE

A request is a PUT (payload: the pages) or a GET (no payload); the node
answers each with one RESULT (payload: the found pages of a GET). Requests on
one connection are answered in order. On a port that authenticates its
callers, the first frame is a HELLO carrying a token (:func:`hello`,
:func:`expect_hello`).

Every helper takes a plain non-blocking socket or a
:class:`~kvstore.security.tls.TlsStream` on one (:data:`Conn`): the plain
socket goes straight to the loop's ``sock_recv_into``/``sock_sendall``.

Version history:
    1  first version (PUT, GET, RESULT); HELLO (op 7) added within 1: a node
       that does not authenticate answers it OK and ignores its token.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.config import NodeConfig
from kvstore.errors import KvError, Unauthenticated, bounded, error_for_code
from kvstore.security.tls import TlsStream
from kvstore.v1 import kvstore_pb2 as pb

Conn = socket.socket | TlsStream  # what the helpers below read and write

MAGIC = b"KVSD"
WIRE_VERSION = 1
PREFIX = struct.Struct("<4sHHIQ")
MAX_HEADER_BYTES = 16 << 20


class WireError(Exception):
    """The peer sent something that is not a valid frame; close the channel."""


class ChannelClosed(Exception):
    """The connection ended (EOF or reset) in the middle of a frame."""


class Idle(ChannelClosed):
    """No frame started within the idle timeout: close the connection quietly."""


class Stalled(WireError):
    """A frame started, then no byte came for the read timeout."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a server of frames grants one connection (the data channel and
    both peer transports): header bytes read before the header is checked,
    seconds without a byte once a frame started (``read_timeout``) and
    between frames (``idle_timeout``), and open connections per listener.
    None means no limit (a puller reading its own peer's reply)."""

    max_header: int = MAX_HEADER_BYTES
    read_timeout: float | None = None
    idle_timeout: float | None = None
    max_connections: int = 1 << 30


def header_cap(max_batch_pages: int) -> int:
    """Header bytes a request of ``max_batch_pages`` keys can need: each key
    costs at most 66 bytes on the wire (64 bytes, tag, length), a found
    flag and a checksum at most 11 more; 64 KiB for the rest."""
    return min(MAX_HEADER_BYTES, (64 << 10) + max_batch_pages * 80)


def encode_prefix(header: bytes, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(header), payload_len)


def decode_prefix(data: bytes | memoryview) -> tuple[int, int]:
    """Check a prefix; returns (header_len, payload_len)."""
    magic, version, _flags, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a kvstore data channel frame")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version} not supported (this node speaks {WIRE_VERSION})")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"header of {header_len} bytes is over {MAX_HEADER_BYTES}")
    return header_len, payload_len


def encode_header(header: pb.DataHeader, payload_len: int) -> bytes:
    body = header.SerializeToString()
    return encode_prefix(body, payload_len) + body


def decode_header(body: bytes | memoryview) -> pb.DataHeader:
    header = pb.DataHeader()
    try:
        header.ParseFromString(bytes(body))
    except Exception as exc:  # protobuf raises DecodeError; any failure is a bad frame
        raise WireError(bounded(f"undecodable header: {exc}", 200)) from None
    return header



_LOWAT_MIN = 256 << 10  # a wait for at least this much wakes only once this much is queued
_LOWAT_MAX = 1 << 20


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: Conn, view: memoryview,
                     timeout: float | None) -> int:
    """One receive into ``view``: ``TimeoutError`` after ``timeout`` seconds
    without a byte (None: no limit); any other socket error is :class:`ChannelClosed`.

    On a plain socket, bytes already queued are taken at once: no timer, no
    loop turn (profiled: ``asyncio.timeout``'s ``get_running_loop`` calls
    ``getpid()``, a syscall, several times per receive). A TCP wait for 256 KiB
    or more sets ``SO_RCVLOWAT`` (up to 1 MiB) so the loop wakes once that much
    is queued, not per 64 KiB segment (measured: ~23 wake-ups per 4 MiB PUT);
    the mark goes back to 1 afterwards, so small reads are not held."""
    lowat = False
    try:
        if sock.__class__ is TlsStream:
            recv = sock.recv_into(loop, view)
        else:
            try:
                return sock.recv_into(view)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                pass
            lowat = view.nbytes >= _LOWAT_MIN and sock.family != socket.AF_UNIX  # type: ignore[union-attr]
            if lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(view.nbytes, _LOWAT_MAX))  # type: ignore[union-attr]
            recv = loop.sock_recv_into(sock, view)  # type: ignore[arg-type]
        if timeout is None:
            return await recv
        async with asyncio.timeout(timeout):
            return await recv
    except TimeoutError:
        raise
    except OSError as exc:  # TimeoutError is an OSError: it is passed on above (ssl.SSLError is one too)
        raise ChannelClosed(str(exc)) from None
    finally:
        if lowat:
            with contextlib.suppress(OSError):  # a socket that broke meanwhile fails its next use
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # type: ignore[union-attr]


async def sendall(loop: asyncio.AbstractEventLoop, sock: Conn, data: bytes | bytearray | memoryview) -> None:
    """Send all of ``data`` (encrypted on a :class:`TlsStream`)."""
    if sock.__class__ is TlsStream:
        await sock.sendall(loop, data)  # type: ignore[union-attr]
        return
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    try:  # what the socket buffer takes now goes at once, without a loop turn
        sent = sock.send(view)  # type: ignore[union-attr]
    except (BlockingIOError, InterruptedError):
        sent = 0
    if sent < view.nbytes:
        await loop.sock_sendall(sock, view[sent:])  # type: ignore[arg-type]


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: Conn, view: memoryview,
                     timeout: float | None = None) -> None:
    """Fill ``view`` from ``sock`` or raise :class:`ChannelClosed`; with
    ``timeout``, raise :class:`Stalled` when no byte comes for that long."""
    while view.nbytes:
        try:
            n = await _recv_into(loop, sock, view, timeout)
        except TimeoutError:
            raise Stalled(f"no byte for {timeout:g} s in the middle of a frame") from None
        if n == 0:
            raise ChannelClosed("peer closed the connection mid-frame")
        view = view[n:]


async def drain(loop: asyncio.AbstractEventLoop, sock: Conn, nbytes: int, scratch: memoryview,
                timeout: float | None = None) -> None:
    """Read and drop ``nbytes`` through ``scratch`` so the connection stays in step."""
    while nbytes:
        chunk = min(nbytes, scratch.nbytes)
        await recv_exact(loop, sock, scratch[:chunk], timeout)
        nbytes -= chunk


async def read_frame(loop: asyncio.AbstractEventLoop, sock: Conn,
                     limits: Limits = Limits()) -> tuple[pb.DataHeader, int]:
    """Read one prefix and header: (header, announced payload length).

    The first byte may take ``limits.idle_timeout`` (else :class:`Idle`);
    every later byte ``limits.read_timeout`` (else :class:`Stalled`). The
    header is read only once its declared length passed ``limits.max_header``,
    and its buffer grows with the bytes that arrived (at most twice them), so
    a prefix that promises a large header and sends nothing costs nothing."""
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    try:
        n = await _recv_into(loop, sock, view, limits.idle_timeout)
    except TimeoutError:
        raise Idle(f"no request for {limits.idle_timeout:g} s") from None
    if n == 0:
        raise ChannelClosed("peer closed the connection")
    await recv_exact(loop, sock, view[n:], limits.read_timeout)
    header_len, payload_len = decode_prefix(prefix)
    if header_len > limits.max_header:
        raise WireError(f"header of {header_len} bytes is over {limits.max_header}")
    body = bytearray()
    while len(body) < header_len:
        piece = bytearray(min(header_len - len(body), max(64 << 10, len(body))))
        await recv_exact(loop, sock, memoryview(piece), limits.read_timeout)
        body += piece
    return decode_header(body), payload_len


async def send_views(loop: asyncio.AbstractEventLoop, sock: Conn, header: pb.DataHeader,
                     views: list[memoryview]) -> None:
    """Send one frame: ``header`` then ``views`` back to back, without joining them."""
    await sendall(loop, sock, encode_header(header, sum(v.nbytes for v in views)))
    for view in views:
        await sendall(loop, sock, view)


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking TCP listener on ``host:port`` (0: any free port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def accept_loop(listener: socket.socket, on_connection: Callable[[socket.socket], None]) -> None:
    """Hand every accepted connection (non-blocking, no Nagle) to
    ``on_connection`` until the listener is closed."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError:
            return  # listener closed
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        on_connection(conn)


def check_pull(request: pb.DataHeader, payload_len: int) -> None:
    """A peer's pull is a GET without payload; anything else is a bad frame."""
    if request.op != pb.DataHeader.GET or payload_len:
        raise WireError(f"peer sent op {request.op} with {payload_len} payload bytes")


def error_frame(code: grpc.StatusCode, message: str) -> bytes:
    """A RESULT frame that reports ``code`` with a bounded message."""
    return encode_header(pb.DataHeader(op=pb.DataHeader.RESULT, code=code.value[0], message=bounded(message)), 0)


async def reply_error(loop: asyncio.AbstractEventLoop, sock: Conn, code: grpc.StatusCode,
                      message: str, timeout: float | None = 1.0) -> None:
    """Send an error frame, best effort: a peer that does not read it within
    ``timeout`` seconds (or is gone) is not waited for."""
    try:
        async with asyncio.timeout(timeout):
            await sendall(loop, sock, error_frame(code, message))
    except (OSError, TimeoutError):
        pass


def refuse(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    """Answer a just-accepted connection with an error frame and close it
    (over a connection limit); the frame fits the empty send buffer."""
    try:
        sock.send(error_frame(code, message))
    except OSError:
        pass
    sock.close()


# ---- TLS and HELLO: opening a connection ---------------------------------------------

async def open_served(loop: asyncio.AbstractEventLoop, sock: socket.socket, context: ssl.SSLContext | None,
                      limits: Limits) -> Conn:
    """A just-accepted connection, after the TLS handshake when ``context``
    is given (within ``limits.read_timeout``); :class:`ChannelClosed` if the
    handshake fails (a plaintext client, an unknown certificate)."""
    if context is None:
        return sock
    try:
        return await TlsStream.wrap(loop, sock, context, server_side=True, timeout=limits.read_timeout)
    except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
        raise ChannelClosed(f"TLS handshake failed: {exc}") from None


async def open_client(loop: asyncio.AbstractEventLoop, sock: socket.socket, context: ssl.SSLContext | None,
                      server_hostname: str, timeout: float | None = None) -> Conn:
    """A connected socket, after the client's TLS handshake when ``context``
    is given; raises OSError (ssl.SSLError) or TimeoutError."""
    if context is None:
        return sock
    return await TlsStream.wrap(loop, sock, context, server_side=False, server_hostname=server_hostname,
                                timeout=timeout)


def hello_frame(token: str) -> bytes:
    return encode_header(pb.DataHeader(op=pb.DataHeader.HELLO, token=token), 0)


async def hello(loop: asyncio.AbstractEventLoop, sock: Conn, token: str, timeout: float | None = None) -> None:
    """The caller's side of HELLO: send ``token``, read the answer; the node's
    refusal is raised as its typed error (:class:`Unauthenticated`)."""
    await sendall(loop, sock, hello_frame(token))
    reply, payload_len = await read_frame(loop, sock, Limits(read_timeout=timeout, idle_timeout=timeout))
    if reply.op != pb.DataHeader.RESULT or payload_len:
        raise WireError(f"HELLO answered with op {reply.op} and {payload_len} payload bytes")
    if reply.code:
        raise error_for_code(reply.code, reply.message)


async def expect_hello(loop: asyncio.AbstractEventLoop, sock: Conn, limits: Limits,
                       authenticate: Callable[[str], Any]) -> Any:
    """The server's side: the first frame must be a HELLO whose token
    ``authenticate`` accepts; its answer (a principal, a node id) is returned
    once the caller was told OK. A refusal is answered with the error
    (UNAUTHENTICATED) and raised as :class:`ChannelClosed`: close the connection."""
    try:
        request, payload_len = await read_frame(loop, sock, limits)
        if request.op != pb.DataHeader.HELLO or payload_len:
            raise Unauthenticated("this port needs credentials: send a HELLO frame with a token first")
        who = authenticate(request.token)
    except KvError as exc:
        await reply_error(loop, sock, exc.code, str(exc), limits.read_timeout)
        raise ChannelClosed(f"caller refused: {exc}") from None
    except WireError as exc:
        await reply_error(loop, sock, grpc.StatusCode.INVALID_ARGUMENT, str(exc), limits.read_timeout)
        raise ChannelClosed(f"bad first frame: {exc}") from None
    await sendall(loop, sock, encode_header(pb.DataHeader(op=pb.DataHeader.RESULT), 0))
    return who


async def skip_hello(loop: asyncio.AbstractEventLoop, sock: Conn) -> None:
    """A HELLO on a port that does not authenticate: answered OK, token ignored."""
    await sendall(loop, sock, encode_header(pb.DataHeader(op=pb.DataHeader.RESULT), 0))


def server_limits(config: NodeConfig) -> Limits:
    """The limits a node's frame servers (data channel, peer transports) apply."""
    return Limits(header_cap(config.max_batch_pages), config.read_timeout, config.idle_timeout,
                  config.max_connections)
