"""gRPC plumbing shared by the node, its peers and the clients: channel and
server options, and the one translation of a failed call into a
:class:`~kvstore.errors.KvError`."""

from __future__ import annotations

import grpc

from kvstore.errors import KvError, error_for_code

# Channels accept messages as large as any node may send (the node's own
# --max-message-bytes bounds what it sends and accepts).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of a node's gRPC server: its message limit, no port sharing."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def from_rpc_error(exc: grpc.RpcError, what: str) -> KvError:
    """A failed call as a typed error: its status code and a bounded message."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else ""
    return error_for_code(code.value[0] if code is not None else 2, f"{what}: {(details or str(code))[:200]}")
