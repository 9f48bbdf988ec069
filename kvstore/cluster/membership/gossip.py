"""Cluster membership from heartbeats: pure logic, the clock injected.

Every node heartbeats every peer it knows. A member is alive while its last
heartbeat answer (or request) is younger than ``timeout``. A node heard
from for the first time (or with a new incarnation, or after it timed out)
is only *pending* (:meth:`Membership.heard`) until it answers this node's
own call: so a member is listed alive only once it answers. The coordinator
role belongs to the live node with the lowest id, and the *standby* (which
keeps a warm copy of the directory from the same reports) to the next one,
as every node computes them from its own view: no election, no consensus. Views can disagree for up to a
timeout (e.g. during a partition); the coordinator's state is soft, so the
worst outcome is a wasted or missing replica, never wrong data.

:class:`MembershipView` is what the agent, the peer client and the
coordinator role ask of membership; the gossip :class:`Membership` here and
the etcd backend (``kvstore.cluster.membership.etcd``, liveness by etcd
leases, the coordinator elected with one) both offer it, and
:func:`~kvstore.cluster.membership.backend.make_membership` picks one from ``--membership``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstore.v1 import kvstore_pb2 as pb


@dataclass(slots=True)
class Member:
    info: pb.MemberInfo
    last_seen: float


@dataclass(frozen=True, slots=True)
class Change:
    """What an observation changed: a new member, or a restart (new incarnation)."""

    node_id: str
    joined: bool = False
    restarted: bool = False


class MembershipView(Protocol):
    """This node's view of the live members and of who coordinates."""

    self_info: pb.MemberInfo
    #: liveness comes from heartbeats between peers (gossip); False where an
    #: outside engine decides it, and heartbeats only carry reports
    from_heartbeats: bool

    @property
    def self_id(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def heard(self, info: pb.MemberInfo) -> Change | None:
        """A heartbeat *from* ``info.node_id``."""

    def observe(self, info: pb.MemberInfo) -> Change | None:
        """An answer by ``info.node_id``."""

    def expire(self) -> list[pb.MemberInfo]:
        """Members gone since the last call (a restarted one's old incarnation included)."""

    def alive(self, node_id: str) -> bool: ...

    def member(self, node_id: str) -> pb.MemberInfo | None: ...

    def live_ids(self) -> list[str]: ...

    def coordinator(self) -> str:
        """Who coordinates ("" when nobody may right now)."""

    def standby(self) -> str:
        """Who keeps the second copy of the directory ("" none)."""

    @property
    def is_coordinator(self) -> bool: ...

    @property
    def keeps_directory(self) -> bool: ...

    def view(self) -> list[pb.MemberInfo]:
        """Every live member (this node first) with role and age filled in."""


class Membership:
    """This node's view of the live members, from heartbeats (gossip)."""

    from_heartbeats = True

    def __init__(self, self_info: pb.MemberInfo, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout <= 0:
            raise ValueError("heartbeat timeout must be > 0")
        self.self_id = self_info.node_id
        self.self_info = self_info
        self.timeout = timeout
        self._clock = clock
        self._members: dict[str, Member] = {}
        self._pending: dict[str, Member] = {}  # heard from, not yet answering

    async def start(self) -> None:
        pass  # driven by the agent's heartbeats alone

    async def stop(self) -> None:
        pass

    def heard(self, info: pb.MemberInfo) -> Change | None:
        """Record a heartbeat *from* ``info.node_id``: it refreshes a live
        member of the same incarnation; anyone else (new, restarted, timed
        out) stays pending until it answers a call (:meth:`observe`). The
        change says whether it is new or restarted, so the caller can reset
        its connection and call it at once."""
        if info.node_id == self.self_id or not info.node_id:
            return None
        now = self._clock()
        old = self._members.get(info.node_id)
        if old is not None and old.info.incarnation == info.incarnation and now - old.last_seen <= self.timeout:
            self._members[info.node_id] = Member(info, now)
            return None
        before = self._pending.get(info.node_id)
        self._pending[info.node_id] = Member(info, now)
        if before is not None and before.info.incarnation == info.incarnation:
            return None  # already waiting for it to answer
        restarted = old is not None and old.info.incarnation != info.incarnation
        if restarted:
            del self._members[info.node_id]  # the old incarnation is gone
        return Change(info.node_id, joined=not restarted, restarted=restarted)

    def observe(self, info: pb.MemberInfo) -> Change | None:
        """Record an answer by ``info.node_id`` (or a member vouched for by
        the coordinator): it is alive now."""
        if info.node_id == self.self_id or not info.node_id:
            return None
        now = self._clock()
        self._pending.pop(info.node_id, None)
        old = self._members.get(info.node_id)
        self._members[info.node_id] = Member(info, now)
        if old is None or now - old.last_seen > self.timeout:
            return Change(info.node_id, joined=True,
                          restarted=old is not None and old.info.incarnation != info.incarnation)
        if old.info.incarnation != info.incarnation:
            return Change(info.node_id, restarted=True)
        return None

    def expire(self) -> list[pb.MemberInfo]:
        """Remove members silent for longer than the timeout; returns them."""
        now = self._clock()
        dead = [m.info for m in self._members.values() if now - m.last_seen > self.timeout]
        for info in dead:
            del self._members[info.node_id]
        for node_id in [n for n, m in self._pending.items() if now - m.last_seen > self.timeout]:
            del self._pending[node_id]
        return dead

    def alive(self, node_id: str) -> bool:
        if node_id == self.self_id:
            return True
        member = self._members.get(node_id)
        return member is not None and self._clock() - member.last_seen <= self.timeout

    def member(self, node_id: str) -> pb.MemberInfo | None:
        if node_id == self.self_id:
            return self.self_info
        member = self._members.get(node_id)
        return member.info if member is not None and self.alive(node_id) else None

    def live_ids(self) -> list[str]:
        return sorted([self.self_id] + [n for n in self._members if self.alive(n)])

    def coordinator(self) -> str:
        """The live node with the lowest id (this node included)."""
        return self.live_ids()[0]

    def standby(self) -> str:
        """The live node with the second lowest id ("" when alone): it
        keeps a warm copy of the directory and takes over when the
        coordinator dies."""
        live = self.live_ids()
        return live[1] if len(live) > 1 else ""

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator() == self.self_id

    @property
    def keeps_directory(self) -> bool:
        """Whether this node holds a directory: it coordinates or is the standby."""
        return self.self_id in self.live_ids()[:2]

    def view(self) -> list[pb.MemberInfo]:
        """Every live member (this node first) with role and age filled in."""
        now = self._clock()
        coordinator = self.coordinator()
        out = []
        for node_id in [self.self_id] + sorted(self._members):
            if node_id == self.self_id:
                info, age = self.self_info, 0.0
            else:
                member = self._members[node_id]
                info, age = member.info, now - member.last_seen
            copy = pb.MemberInfo()
            copy.CopyFrom(info)
            copy.role = "coordinator" if node_id == coordinator else "member"
            copy.last_seen_seconds_ago = age
            copy.alive = age <= self.timeout
            if copy.alive:
                out.append(copy)
        return out


@dataclass(frozen=True, slots=True)
class Round:
    """What one heartbeat round does, decided without I/O (:func:`plan_round`)."""

    coordinator: str              # who coordinates, in this node's view
    coordinator_changed: bool     # since the last round
    report_locally: bool          # this node coordinates: its report applies here
    report_to: str                # address whose heartbeat carries the report ("" none)
    standby: str                  # who keeps the standby directory ("" none)
    standby_to: str               # its address, whose heartbeat carries the same report ("" none or self)
    targets: tuple[str, ...]      # every address to heartbeat, sorted
    learned: dict[str, float]     # gossip-learned addresses still worth probing


def plan_round(membership: MembershipView, self_address: str, static: set[str], learned: dict[str, float],
               last_coordinator: str, now: float, horizon: float) -> Round:
    """One heartbeat round: whom to probe and where the directory report goes.

    Every static peer and every address learned by gossip within ``horizon``
    seconds is probed (a dead one may come back); the report rides on the
    heartbeats to the coordinator and to the standby, or applies locally
    where this node is one of them. Where liveness does not come from
    heartbeats (etcd), only those two are called: O(nodes) heartbeats per
    round for the fleet, not O(nodes^2), and no addresses to learn."""
    coordinator, standby = membership.coordinator(), membership.standby()
    mine = coordinator == membership.self_id

    def address(node_id: str) -> str:
        member = membership.member(node_id) if node_id and node_id != membership.self_id else None
        return member.address if member is not None else ""

    if membership.from_heartbeats:
        kept = {a: t for a, t in learned.items() if now - t < horizon}
        probed = static | set(kept)
    else:
        kept, probed = {}, {address(coordinator), address(standby)} - {""}
    targets = tuple(sorted(probed - {self_address}))
    return Round(coordinator, coordinator != last_coordinator, mine, address(coordinator), standby,
                 address(standby), targets, kept)
