"""Membership as etcd says it is: pure logic, the clock injected.

Every node keeps one key, ``<prefix>/members/<node_id>`` (its serialized
:class:`MemberInfo`), attached to an etcd lease it keeps alive, and watches
the prefix: a member is alive while its key exists, so a node that stops
renewing disappears from every view one lease TTL later. The coordinator
is whoever holds ``<prefix>/coordinator``, created only if absent and
attached to the holder's lease: etcd makes the holder unique, and when its
lease goes the key goes with it and the others campaign, the standby first
(the lowest live id other than the coordinator's, which keeps the warm
directory copy) and the rest a step later each, so the warm copy usually
wins.

This module holds the view and those decisions; ``etcd`` is the
I/O shell that feeds it. It offers the same calls as the gossip
:class:`~kvstore.cluster.membership.gossip.Membership`. Heartbeats still arrive
(they carry directory reports) but only refresh a known member's load
figures: they never make anyone alive, change an address or a role.

A node that cannot reach etcd keeps its last view (it sees no joins or
departures) and does not act as coordinator once its own lease may have
expired: :meth:`EtcdView.coordinator` is then "" for it, and lookups go to
the standby's copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.cluster.membership.gossip import Change
from kvstore.v1 import kvstore_pb2 as pb

_LOAD_FIELDS = ("capacity_bytes", "used_bytes", "hits", "misses", "remote_hits", "speculative_bytes")


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """Where etcd is and which keys are this cluster's (``--membership``)."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool
    prefix: str = "/kvstore"

    @property
    def members_prefix(self) -> bytes:
        return f"{self.prefix}/members/".encode()

    @property
    def coordinator_key(self) -> bytes:
        return f"{self.prefix}/coordinator".encode()

    def member_key(self, node_id: str) -> bytes:
        return self.members_prefix + node_id.encode()


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (``etcds://`` for TLS);
    the prefix keeps clusters sharing one etcd apart (default ``/kvstore``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds") or not parts.netloc:
        raise ValueError(f"not an etcd URL: {url!r} (etcd://HOST:PORT[,HOST:PORT][/PREFIX])")
    endpoints = []
    for item in parts.netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"etcd endpoint must be HOST:PORT, got {item!r}")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parts.path.rstrip("/") or "/kvstore"
    return EtcdTarget(tuple(endpoints), parts.scheme == "etcds", prefix)


def lease_ttl(heartbeat_timeout: float) -> int:
    """etcd grants whole seconds: the heartbeat timeout rounded up, at least 1."""
    return max(1, int(-(-heartbeat_timeout // 1)))


def encode_member(info: pb.MemberInfo) -> bytes:
    """What a member publishes: identity, addresses and capacity (no role or age)."""
    return pb.MemberInfo(node_id=info.node_id, address=info.address, incarnation=info.incarnation,
                         endpoints=info.endpoints, capacity_bytes=info.capacity_bytes).SerializeToString()


def decode_member(key: bytes, value: bytes, prefix: bytes) -> pb.MemberInfo | None:
    """A member key's value, None when it does not parse or names another node than its key."""
    try:
        info = pb.MemberInfo.FromString(value)
    except Exception:  # DecodeError: a foreign writer under our prefix
        return None
    return info if info.node_id and key == prefix + info.node_id.encode() else None


@dataclass(slots=True)
class _Seen:
    info: pb.MemberInfo
    since: float  # last heard of (etcd event or heartbeat), for the age shown in views


class EtcdView:
    """This node's view of the live members and the coordinator, from etcd."""

    from_heartbeats = False

    def __init__(self, self_info: pb.MemberInfo, clock: Callable[[], float] = time.monotonic) -> None:
        self.self_info = self_info
        self._clock = clock
        self._members: dict[str, _Seen] = {}  # the others, as etcd lists them
        self._holder = ""                     # node id in the coordinator key ("" none)
        self._departed: list[pb.MemberInfo] = []
        self._lease_until = 0.0               # this node's lease surely holds until then

    @property
    def self_id(self) -> str:
        return self.self_info.node_id

    # ---- what etcd says --------------------------------------------------------
    def reset(self, members: Iterable[pb.MemberInfo], holder: str) -> bool:
        """A full listing (at start, or after a lost watch); True if the view changed."""
        fresh = {m.node_id: m for m in members if m.node_id != self.self_id}
        changed = holder != self._holder or fresh.keys() != self._members.keys()
        for node_id in list(self._members):
            if node_id not in fresh:
                changed = self.member_gone(node_id) or changed
        for info in fresh.values():
            changed = self.member_put(info) or changed
        self._holder = holder
        return changed

    def member_put(self, info: pb.MemberInfo) -> bool:
        """A member key written; True if it is new or restarted (the old one departs)."""
        if info.node_id == self.self_id:
            return False
        old = self._members.get(info.node_id)
        self._members[info.node_id] = _Seen(info, self._clock())
        if old is not None and old.info.incarnation != info.incarnation:
            self._departed.append(old.info)
        return old is None or old.info.incarnation != info.incarnation

    def member_gone(self, node_id: str) -> bool:
        """A member key deleted (its lease expired or was revoked)."""
        old = self._members.pop(node_id, None)
        if old is not None:
            self._departed.append(old.info)
        return old is not None

    def holder_set(self, node_id: str) -> bool:
        changed = node_id != self._holder
        self._holder = node_id
        return changed

    def lease_held_until(self, deadline: float) -> None:
        """This node's lease was renewed: it holds at least until ``deadline``."""
        self._lease_until = deadline

    def lease_lost(self) -> None:
        self._lease_until = 0.0

    @property
    def holder(self) -> str:
        return self._holder

    def session_ok(self) -> bool:
        return self._clock() < self._lease_until

    def campaign_delay(self, step: float) -> float | None:
        """How long to wait before trying for the coordinator key: None while
        someone holds it or this node's lease is in doubt; else by rank in
        the live ids (the standby first, at 0)."""
        if self._holder or not self.session_ok():
            return None
        return self.live_ids().index(self.self_id) * step

    # ---- heartbeats (reports still ride on them) ------------------------------
    def heard(self, info: pb.MemberInfo) -> Change | None:
        """A heartbeat from a member etcd lists, same incarnation: its load
        figures are fresher than its key's. Nothing else is taken from it."""
        seen = self._members.get(info.node_id)
        if seen is not None and seen.info.incarnation == info.incarnation:
            for name in _LOAD_FIELDS:
                setattr(seen.info, name, getattr(info, name))
            seen.since = self._clock()
        return None

    observe = heard

    # ---- the view ----------------------------------------------------------------
    def expire(self) -> list[pb.MemberInfo]:
        gone, self._departed = self._departed, []
        return gone

    def alive(self, node_id: str) -> bool:
        return node_id == self.self_id or node_id in self._members

    def member(self, node_id: str) -> pb.MemberInfo | None:
        if node_id == self.self_id:
            return self.self_info
        seen = self._members.get(node_id)
        return seen.info if seen is not None else None

    def live_ids(self) -> list[str]:
        return sorted([self.self_id, *self._members])

    def coordinator(self) -> str:
        """The holder of the coordinator key, if live in this view; this node
        only while its lease surely holds. "" when nobody may coordinate."""
        if self._holder == self.self_id:
            return self.self_id if self.session_ok() else ""
        return self._holder if self._holder in self._members else ""

    def standby(self) -> str:
        """The lowest live id other than the coordinator's ("" when alone; this
        node's own while nobody coordinates): it keeps the second copy."""
        coordinator = self.coordinator()
        others = [n for n in self.live_ids() if n != coordinator]
        return others[0] if others else ""

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator() == self.self_id

    @property
    def keeps_directory(self) -> bool:
        return self.self_id in (self.coordinator(), self.standby())

    def view(self) -> list[pb.MemberInfo]:
        now, coordinator = self._clock(), self.coordinator()
        out = []
        for node_id in [self.self_id, *sorted(self._members)]:
            copy = pb.MemberInfo()
            if node_id == self.self_id:
                copy.CopyFrom(self.self_info)
            else:
                seen = self._members[node_id]
                copy.CopyFrom(seen.info)
                copy.last_seen_seconds_ago = now - seen.since
            copy.role = "coordinator" if node_id == coordinator else "member"
            copy.alive = True
            out.append(copy)
        return out
