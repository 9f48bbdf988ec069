"""Types of the placement planner: what it is given and what it decides.

Pure data: no I/O. The coordinator builds :class:`Candidate`\\ s from the
predictor's scores and :class:`NodeState`\\ s from heartbeats; the planner
(:mod:`kvstore.placement.planner`) returns a :class:`PlanResult`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class LazyHolders(Mapping[int, frozenset[str]]):
    """``Candidate.holders`` looked up on first read of each depth.

    Most candidates of a busy tick are turned away by the planner's cheap gates (too late, no room,
    no budget) before it reads a holder, so the caller need not look up every depth of every
    candidate: ``lookup(depth)`` runs at most once per depth, when the planner asks. It reads the
    directory then: the holders are as of that step of the plan, not of the candidate's building."""

    __slots__ = ("_depths", "_lookup", "_seen")

    def __init__(self, depths: tuple[int, ...], lookup: Callable[[int], frozenset[str]]) -> None:
        self._depths, self._lookup = depths, lookup
        self._seen: dict[int, frozenset[str]] = {}

    def __getitem__(self, depth: int) -> frozenset[str]:
        seen = self._seen.get(depth)
        if seen is None:
            if depth not in self._depths:
                raise KeyError(depth)
            seen = self._seen[depth] = self._lookup(depth)
        return seen

    def get(self, depth: int, default: Any = None) -> Any:  # no KeyError round trip for a depth it lacks
        return self[depth] if depth in self._depths else default

    def __iter__(self) -> Iterator[int]:
        return iter(self._depths)

    def __len__(self) -> int:
        return len(self._depths)


@functools.lru_cache(maxsize=256)
def usable_depths(options: tuple[int, ...], chain_len: int) -> tuple[int, ...]:
    """A candidate's usable depth options, deepest first (a depth needs its key in the chain).

    Cached: candidates of one predictor share a handful of option tuples.
    """
    return tuple(sorted({d for d in options if 1 <= d <= chain_len}, reverse=True))


@dataclass(slots=True)
class NodeState:
    """What the planner knows of one live node."""

    node_id: str
    capacity_bytes: int
    used_bytes: int
    spec_bytes: int = 0               # bytes held as speculative replicas
    load: float = 0.0                 # recent requests/s routed to it (optional)
    egress_bps: float = 0.0           # its measured copy egress (0: unknown, plan()'s bandwidth_bps)
    ingress_bps: float = 0.0          # its measured copy ingress (0: unknown, plan()'s bandwidth_bps)
    sending: int = 0                  # copies out of it in flight
    receiving: int = 0                # copies into it in flight
    cold_bytes: int = 0               # bytes a copy may push out once its free space is gone (kvstore.pool.room)
    cold_reads: float = 0.0           # ... their price: expected reads of the coldest of them after eviction


@dataclass(slots=True)
class Candidate:
    """A scored prefix the planner may replicate.

    ``chain`` holds the prefix's keys from block 1 to ``depth`` (the deepest
    tracked depth seen); ``holders[d]`` the nodes holding the first ``d``
    blocks, for each ``d`` in ``depth_options``.
    """

    namespace: str
    chain: tuple[bytes, ...]
    depth_options: tuple[int, ...]
    holders: Mapping[int, frozenset[str]]  # a dict, or LazyHolders
    prob: float                        # P(needed on a node lacking it within H)
    need_in_s: float                   # predicted seconds until the next request
    page_bytes: int
    fanout: int = 1                    # distinct nodes that requested it recently
    demand: float = 0.0                # forecast requests in the next cfg.demand_window_s (0: unknown)


@dataclass(frozen=True, slots=True)
class Decision:
    """Copy ``keys`` (a prefix of ``depth`` blocks) from ``source`` to each target."""

    namespace: str
    keys: tuple[bytes, ...]
    depth: int
    source: str
    targets: tuple[str, ...]
    prob: float
    ttl_s: float
    reason: str
    bytes: int = 0                     # total over all targets
    transfer_s: float = 0.0            # predicted time of the slowest target's copy at the measured link rates
    need_in_s: float = 0.0             # predicted lead time the copy was gated against
    tree: tuple[tuple[str, str], ...] = ()  # (from, to) copies in wave order; () = all from ``source``
    waves: int = 1                     # rounds of the copy tree (its time is waves x transfer_s)
    parts: int = 1                     # > 1: the tree relays the copy in this many parts (copytree.relay_parts)
    demand: float = 0.0                # forecast requests in the demand window that sized it (0: unsized)

    def explain(self) -> str:
        """The decision in one line for the log: the numbers it was made on, then ``reason`` (what they
        do not say). Formatted only when asked: the planner's tick does not pay for it."""
        text = f"p={self.prob:.2f} need_in={self.need_in_s:.1f}s transfer {self.transfer_s:.3f}s x{self.waves} wave(s)"
        if self.demand:
            text += f" demand {self.demand:.1f} req"
        return f"{text}; {self.reason}" if self.reason else text


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    threshold: float = 0.65            # replicate when prob >= threshold (kvstored --spec-threshold)
    spec_budget: float = 0.2           # share of each node's capacity for speculative replicas
    spec_bandwidth: float = 1e9        # bytes/s the planner may spend on copies, cluster-wide
    tick_s: float = 1.0
    ttl_s: float = 120.0               # lifetime of a speculative replica unless renewed
    max_targets: int = 2               # new replicas per prefix per tick
    safety: float = 1.5                # transfer must fit in need_in_s / safety
    max_decisions: int = 256
    drop_below: float | None = None    # hysteresis: keep (renew) a replica while prob >= this; None = threshold / 2
    renew_when_left: float = 0.5       # renew a hot replica once less than this share of ttl_s is left (1.0 = every tick)
    node_rate: float = 0.0             # requests/s one node serves; with a candidate's demand it sizes the replica set
    demand_window_s: float = 10.0      # the demand of a candidate is counted over this window
    fanout: int = 2                    # copies one node sends per wave of a copy tree
    chunks: int = 1                    # > 1: a copy long enough relays along chains in up to this many parts
    min_part_s: float = 0.02           # ... each part taking at least this long (copytree.relay_parts)
    join_warm_s: float = 30.0          # a joining node is warmed from the forecast for at most this long (0: never)
    review_slices: int = 4             # a tick reviews the placed chains of one slice in turn, and those due (to_review)

    @property
    def keep_threshold(self) -> float:
        """Score below which an existing speculative replica is dropped."""
        return self.threshold / 2 if self.drop_below is None else self.drop_below


class Renewal(NamedTuple):
    """Extend a speculative replica still predicted hot (instead of re-copying it)."""

    namespace: str
    key: bytes                         # chain key of the replica's deepest block
    node: str
    expires_at: float                  # new expiry, on the caller's clock


class Drop(NamedTuple):
    """Remove a speculative replica: its TTL ran out or its score decayed."""

    namespace: str
    key: bytes                         # chain key of the replica's deepest block
    node: str
    reason: str                        # "expired" | "decayed" | "surplus"


@dataclass(slots=True)
class PlanResult:
    decisions: list[Decision] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bytes_planned: int = 0
    renewals: list[Renewal] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    bytes_budget: int = 0              # copy bytes this tick allowed (after transfers in flight)
