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
one connection are answered in order.

Version history:
    1  first version (PUT, GET, RESULT).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable

from kvstore.v1 import kvstore_pb2 as pb

MAGIC = b"KVSD"
WIRE_VERSION = 1
PREFIX = struct.Struct("<4sHHIQ")
MAX_HEADER_BYTES = 16 << 20


class WireError(Exception):
    """The peer sent something that is not a valid frame; close the channel."""


class ChannelClosed(Exception):
    """The connection ended (EOF or reset) in the middle of a frame."""


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
        raise WireError(f"undecodable header: {exc}") from None
    return header



async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` or raise :class:`ChannelClosed`."""
    while view.nbytes:
        try:
            n = await loop.sock_recv_into(sock, view)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        if n == 0:
            raise ChannelClosed("peer closed the connection mid-frame")
        view = view[n:]


async def drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int, scratch: memoryview) -> None:
    """Read and drop ``nbytes`` through ``scratch`` so the connection stays in step."""
    while nbytes:
        chunk = min(nbytes, scratch.nbytes)
        await recv_exact(loop, sock, scratch[:chunk])
        nbytes -= chunk


async def read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     max_header: int = MAX_HEADER_BYTES) -> tuple[pb.DataHeader, int]:
    """Read one prefix and header: (header, announced payload length).

    The header is read only once its declared length passed the check, so a
    hostile prefix cannot make the reader allocate more than ``max_header``."""
    prefix = bytearray(PREFIX.size)
    await recv_exact(loop, sock, memoryview(prefix))
    header_len, payload_len = decode_prefix(prefix)
    if header_len > max_header:
        raise WireError(f"header of {header_len} bytes is over {max_header}")
    body = bytearray(header_len)
    await recv_exact(loop, sock, memoryview(body))
    return decode_header(body), payload_len


async def send_views(loop: asyncio.AbstractEventLoop, sock: socket.socket, header: pb.DataHeader,
                     views: list[memoryview]) -> None:
    """Send one frame: ``header`` then ``views`` back to back, without joining them."""
    await loop.sock_sendall(sock, encode_header(header, sum(v.nbytes for v in views)))
    for view in views:
        await loop.sock_sendall(sock, view)


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
