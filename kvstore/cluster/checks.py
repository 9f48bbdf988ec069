"""Checks of what peers send: node-to-node requests are input like any
client's. Pure functions; each raises :class:`InvalidArgument` (or
:class:`ResourceExhausted` for counts) with a bounded message."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.config import parse_hostport
from kvstore.errors import InvalidArgument, ResourceExhausted, shown
from kvstore.pool.layout import check_keys, check_namespace
from kvstore.v1 import kvstore_pb2 as pb

MAX_ID_CHARS = 128  # node ids, incarnations
MAX_MEMBERS = 4096  # members one heartbeat may gossip
TRANSPORT_KINDS = ("tcp", "ucx")


def check_id(value: str, what: str) -> None:
    if not 0 < len(value) <= MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(f"{what} {shown(value)}: 1-{MAX_ID_CHARS} printable characters")


def check_key_batch(namespace: str, keys: Sequence[bytes], max_pages: int) -> None:
    """A namespace name and a batch of keys (repeats allowed) of at most ``max_pages``."""
    check_namespace(namespace)
    if len(keys) > max_pages:
        raise ResourceExhausted(f"batch of {len(keys)} keys is over the limit of {max_pages}")
    check_keys(keys, allow_duplicates=True)


def check_claim_seconds(value: float, max_s: float) -> None:
    """A Lookup's ``claim_seconds``: 0 (no claim) or in (0, ``max_s``]; NaN fails the range."""
    if value and not 0 < value <= max_s:
        raise InvalidArgument(f"claim_seconds must be in (0, {max_s}], got {value}")


def check_member(info: pb.MemberInfo) -> None:
    """A member as a peer describes it: id, gRPC address, incarnation, endpoints."""
    check_id(info.node_id, "node id")
    try:
        parse_hostport(info.address, allow_zero_port=False)
    except ValueError:
        raise InvalidArgument(f"member {shown(info.node_id)}: bad address {shown(info.address)}") from None
    check_id(info.incarnation, "incarnation")
    for endpoint in info.endpoints:
        if endpoint.kind not in TRANSPORT_KINDS or not 0 < endpoint.port <= 65535 \
                or not 0 < len(endpoint.host) <= 255:
            raise InvalidArgument(f"member {shown(info.node_id)}: bad transport endpoint "
                                  f"{shown(endpoint.kind)} {shown(endpoint.host)}:{endpoint.port}")


def _finite(value: float, what: str, top: float = math.inf) -> None:
    if not (0 <= value <= top):  # also rejects NaN
        raise InvalidArgument(f"{what} must be in [0, {top:g}], got {shown(value)}")


def check_heartbeat(request: pb.HeartbeatRequest, max_pages: int) -> None:
    """Sender, gossip, directory report and access events of a heartbeat."""
    check_member(request.sender)
    if len(request.known) > MAX_MEMBERS:
        raise ResourceExhausted(f"heartbeat gossips {len(request.known)} members; at most {MAX_MEMBERS}")
    for info in request.known:
        check_member(info)
    for batch in request.directory:
        check_namespace(batch.namespace)
        check_keys(batch.adds, allow_duplicates=True)
        check_keys(batch.removes, allow_duplicates=True)
        check_keys([p.key for p in batch.speculative], allow_duplicates=True)
        for page in batch.speculative:
            _finite(page.expires_in_seconds, "speculative expires_in_seconds")
    for event in request.accesses:
        check_namespace(event.namespace)
        if len(event.keys) > max_pages:
            raise ResourceExhausted(f"access event of {len(event.keys)} keys is over the limit of {max_pages}")
        check_keys(event.keys, allow_duplicates=True)
        _finite(event.age_seconds, "access age_seconds")


def check_replicate(request: pb.ReplicateRequest, max_ttl: float) -> None:
    """Source and lifetime of a Replicate (namespace and keys are checked by the node)."""
    check_id(request.source_node_id, "source_node_id")
    _finite(request.ttl_seconds, "ttl_seconds", max_ttl)
