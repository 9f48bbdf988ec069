"""Cluster membership from heartbeats: pure logic, the clock injected.

Every node heartbeats every peer it knows. A member is alive while its last
heartbeat answer (or request) is younger than ``timeout``. The coordinator
role belongs to the live node with the lowest id, as every node computes it
from its own view: no election, no consensus. Views can disagree for up to a
timeout (e.g. during a partition); the coordinator's state is soft, so the
worst outcome is a wasted or missing replica, never wrong data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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


class Membership:
    """This node's view of the live members."""

    def __init__(self, self_info: pb.MemberInfo, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout <= 0:
            raise ValueError("heartbeat timeout must be > 0")
        self.self_id = self_info.node_id
        self.self_info = self_info
        self.timeout = timeout
        self._clock = clock
        self._members: dict[str, Member] = {}

    def observe(self, info: pb.MemberInfo) -> Change | None:
        """Record a heartbeat from (or answer by) ``info.node_id``."""
        if info.node_id == self.self_id or not info.node_id:
            return None
        now = self._clock()
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

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator() == self.self_id

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
    coordinator_changed: bool     # since the last round: send a full snapshot
    report_locally: bool          # this node coordinates: its report applies here
    report_to: str                # address whose heartbeat carries the report ("" none)
    targets: tuple[str, ...]      # every address to heartbeat, sorted
    learned: dict[str, float]     # gossip-learned addresses still worth probing


def plan_round(membership: Membership, self_address: str, static: set[str], learned: dict[str, float],
               last_coordinator: str, now: float, horizon: float) -> Round:
    """One heartbeat round: whom to probe and where the directory report goes.

    Every static peer and every address learned by gossip within ``horizon``
    seconds is probed (a dead one may come back); the report rides on the
    heartbeat to the coordinator, or applies locally when this node is it."""
    coordinator = membership.coordinator()
    mine = coordinator == membership.self_id
    member = membership.member(coordinator)
    report_to = "" if mine or member is None else member.address
    kept = {a: t for a, t in learned.items() if now - t < horizon}
    targets = tuple(sorted((static | set(kept)) - {self_address}))
    return Round(coordinator, coordinator != last_coordinator, mine, report_to, targets, kept)
