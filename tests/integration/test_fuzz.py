"""Every RPC of a real node, fuzzed as a hostile client would (hypothesis):
random field values, unknown enum values, huge and empty names, counts past
every limit, NaN and negative durations, undecodable bodies, and frames on
the data channel. After each request: no UNKNOWN or INTERNAL status, a
bounded message without stack traces or exception names, the node still
serving, and, when the request was rejected, the store unchanged.

The default run tries a few hundred cases; ``make test-slow`` runs the same
fuzz with 10,000 (``KVSTORE_FUZZ_CASES`` overrides both).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections import Counter
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import keys_for, random_pages
from kvstore.framing import PREFIX, WIRE_VERSION, encode_prefix
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KvClient

PAGE = 64
BAD_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
LEAKS = re.compile(r"Traceback|Exception|[A-Z][a-z]+Error\b|File \"|line \d+")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")  # inputs the message quotes back (cut short)


def leaks(message: str) -> bool:
    """Whether an error text shows a stack trace or an exception's name
    (outside the inputs it quotes)."""
    return bool(LEAKS.search(QUOTED.sub("", message)))
SERVICES = [s for s in pb.DESCRIPTOR.services_by_name.values()]
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]

NAMES = st.sampled_from(["m", "m", "m", "", "x" * 20_000, "bad name!", "m\x00", "\u00ff", "-m", "n" * 129, "other"])
KEYS = st.one_of(st.sampled_from(keys_for(8)), st.binary(max_size=70), st.sampled_from([b"", b"k" * 65]))
PAGES = st.one_of(st.binary(min_size=PAGE, max_size=PAGE), st.binary(max_size=130), st.just(b""))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 0.5, 5.0, 1e12]))
ADDRESSES = st.sampled_from(["127.0.0.1:1", "127.0.0.1:0", "nohost", "[::1]:5", ":", "a:b:c", ""])


def _int(field: FD) -> st.SearchStrategy[int]:
    bits = 32 if field.type in (FD.TYPE_INT32, FD.TYPE_UINT32, FD.TYPE_SINT32, FD.TYPE_FIXED32,
                                FD.TYPE_SFIXED32, FD.TYPE_ENUM) else 64
    signed = field.type in (FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_SINT32, FD.TYPE_SINT64, FD.TYPE_SFIXED32,
                            FD.TYPE_SFIXED64, FD.TYPE_ENUM)
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = [v for v in (0, 1, 2, 3, 4, 5, 99, 4096, 1 << 20, 1 << 40, high, low) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _scalar(field: FD) -> st.SearchStrategy[Any]:
    name = field.name
    if field.type == FD.TYPE_STRING:
        if name in ("namespace",):
            return NAMES
        if name == "address":
            return ADDRESSES
        return st.one_of(st.sampled_from(["a", "b", "tcp", "ucx", "", "x" * 5000]), st.text(max_size=20))
    if field.type == FD.TYPE_BYTES:
        return PAGES if name == "pages" else KEYS
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return FLOATS if field.type == FD.TYPE_DOUBLE else st.floats(width=32, allow_nan=True)
    return _int(field)


def message(descriptor: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Random instances of a protobuf message type (nested up to depth 2)."""
    fields = [f for f in descriptor.fields if not (f.message_type and f.message_type.GetOptions().map_entry)]

    def value(field: FD) -> st.SearchStrategy[Any]:
        if field.type == FD.TYPE_MESSAGE:
            return message(field.message_type, depth + 1) if depth < 2 else st.just(None)
        return _scalar(field)

    def build(values: dict[str, Any]) -> Any:
        msg = descriptor._concrete_class()
        for name, v in values.items():
            field = descriptor.fields_by_name[name]
            if field.is_repeated:
                if field.type == FD.TYPE_MESSAGE:
                    getattr(msg, name).extend([x for x in v if x is not None])
                else:
                    getattr(msg, name).extend(v)
            elif field.type == FD.TYPE_MESSAGE:
                if v is not None:
                    getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    def one(field: FD) -> st.SearchStrategy[Any]:
        if not field.is_repeated:
            return value(field)
        many = st.builds(lambda v, n: [v] * n, value(field), st.sampled_from([70_000, 1000]))
        return st.one_of(st.lists(value(field), max_size=6), many) if field.type != FD.TYPE_MESSAGE \
            else st.lists(value(field), max_size=3)

    return st.fixed_dictionaries({}, optional={f.name: one(f) for f in fields}).map(build)


class Case(tuple):  # type: ignore[type-arg]
    """(path, request, how) with a short repr (hypothesis prints failing cases)."""

    def __repr__(self) -> str:
        text = repr(tuple(self))
        return text if len(text) < 2000 else text[:2000] + f"... ({len(text)} chars)"


@st.composite
def cases(draw: Any) -> tuple[str, Any, str]:
    """(method path, request or list of requests or raw bytes, how to send)."""
    path, method = draw(st.sampled_from(METHODS))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(min_size=1, max_size=64)), "raw"
    request = message(method.input_type)
    if method.client_streaming:
        return path, draw(st.lists(request, min_size=0, max_size=3)), "stream"
    return path, draw(request), "stream-reply" if method.server_streaming else "unary"


def store(node: Any) -> tuple[Any, ...]:
    """What a rejected request must not change: namespaces, layouts, stored keys."""
    return tuple((name, ns.layout, ns.pool.used_slots, frozenset(ns.pool.keys()))
                 for name, ns in sorted(node.namespaces.items()))


def call(channel: grpc.Channel, path: str, request: Any, how: str) -> grpc.StatusCode:
    """Send one fuzz case; returns the status code (OK or the error's) and
    checks the error message."""
    identity = (lambda b: b)
    serialize = identity if how == "raw" else (lambda m: m.SerializeToString())
    try:
        if how == "stream":
            channel.stream_unary(path, request_serializer=serialize, response_deserializer=identity)(
                iter(request), timeout=20)
        elif how == "stream-reply":
            for _ in channel.unary_stream(path, request_serializer=serialize, response_deserializer=identity)(
                    request, timeout=20):
                pass
        elif path.endswith("/Get") and how == "raw":
            for _ in channel.unary_stream(path, request_serializer=serialize, response_deserializer=identity)(
                    request, timeout=20):
                pass
        elif path.endswith("/Put") and how == "raw":
            channel.stream_unary(path, request_serializer=serialize, response_deserializer=identity)(
                iter([request]), timeout=20)
        else:
            channel.unary_unary(path, request_serializer=serialize, response_deserializer=identity)(
                request, timeout=20)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        assert len(details) <= 300, (path, len(details), details[:200])
        assert not leaks(details), (path, details)
        return exc.code()
    return grpc.StatusCode.OK


def data_frames() -> st.SearchStrategy[bytes]:
    """Frames for the data channel: random headers with a matching or wrong
    payload, random prefixes, and garbage."""
    header = message(pb.DataHeader.DESCRIPTOR)

    def frame(h: pb.DataHeader, payload: bytes, lie: int) -> bytes:
        body = h.SerializeToString()
        return encode_prefix(body, max(0, len(payload) + lie)) + body + payload

    prefixes = st.builds(lambda n, p: encode_prefix(b"", 0)[:4] + WIRE_VERSION.to_bytes(2, "little")
                         + bytes(2) + n.to_bytes(4, "little") + p.to_bytes(8, "little"),
                         st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1))
    return st.one_of(st.builds(frame, header, st.binary(max_size=200), st.sampled_from([0, 0, 0, -1, 1, 64])),
                     prefixes, st.binary(min_size=PREFIX.size, max_size=100))


def read_reply(sock: socket.socket) -> pb.DataHeader | None:
    """The first RESULT frame the node sends back, or None if it closed first."""
    data = b""
    try:
        while len(data) < PREFIX.size:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
        header_len = int.from_bytes(data[8:12], "little")
        while len(data) < PREFIX.size + header_len:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
    except ConnectionResetError:
        if len(data) < PREFIX.size or len(data) < PREFIX.size + int.from_bytes(data[8:12], "little"):
            return None
    reply = pb.DataHeader()
    reply.ParseFromString(data[PREFIX.size:PREFIX.size + header_len])
    return reply


def run_fuzz(make_server: Any, cases_count: int) -> None:
    srv = make_server(max_batch_pages=64, max_batch_bytes=1 << 20, max_pin_ttl=30.0)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE, capacity=256 * PAGE)
        kv.put("m", keys_for(8), random_pages(8, PAGE))
    host = srv.address.rsplit(":", 1)[0]
    codes: Counter[str] = Counter()
    started = time.monotonic()
    with grpc.insecure_channel(srv.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        @settings(max_examples=cases_count, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(cases(), cases(), cases(), data_frames().map(lambda f: ("data", f, "data")))
               .map(Case))
        def one(case: tuple[str, Any, str]) -> None:
            path, request, how = case
            before = srv.call(lambda: store(srv.node))
            if how == "data":
                with socket.create_connection((host, srv.server.data_port), timeout=10) as sock:
                    try:
                        sock.sendall(request)
                        sock.shutdown(socket.SHUT_WR)  # the node sees the end of whatever it got
                    except OSError:
                        pass  # it answered and closed before taking all of it
                    reply = read_reply(sock)
                ok = reply is not None and reply.code == 0
                code = grpc.StatusCode.OK if ok or reply is None else \
                    next(c for c in grpc.StatusCode if c.value[0] == reply.code)
                if reply is not None:
                    assert len(reply.message) <= 300 and not leaks(reply.message), reply.message
            else:
                code = call(channel, path, request, how)
            codes[f"{code.name}"] += 1
            assert code not in BAD_CODES, (path, how, code)
            if code is not grpc.StatusCode.OK:
                assert srv.call(lambda: store(srv.node)) == before, f"rejected {path} changed the store"
            reply_health = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply_health.status == health_pb2.HealthCheckResponse.SERVING

        one()
    took = time.monotonic() - started
    print(f"\nfuzz: {cases_count} cases in {took:.1f} s; codes {dict(codes)}")
    assert not (codes["UNKNOWN"] or codes["INTERNAL"])


def test_fuzz_every_rpc(make_server) -> None:  # type: ignore[no-untyped-def]
    run_fuzz(make_server, int(os.environ.get("KVSTORE_FUZZ_CASES", "300")))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_every_rpc_10k(make_server) -> None:  # type: ignore[no-untyped-def]
    run_fuzz(make_server, int(os.environ.get("KVSTORE_FUZZ_CASES", "10000")))
