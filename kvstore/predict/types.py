"""Shared types of the burst predictor and the placement planner.

Pure data: no I/O. The coordinator's agent turns node reports into
:class:`Access` events, the predictor turns them into scored prefixes, the
planner turns scores and cluster state into :class:`Decision`\\ s.

A *prefix* is identified by ``(namespace, key)`` where ``key`` is the chain
key of its last block (keys are chained hashes, so the last key names the
whole prefix); its ``depth`` is its length in blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

PrefixId = tuple[str, bytes]  # (namespace, chain key of the prefix's last block)


class Outcome(enum.IntEnum):
    """How the request's deepest tracked prefix was served on its node."""

    LOCAL = 0
    REMOTE = 1
    MISS = 2


@dataclass(frozen=True, slots=True)
class Access:
    """One request as the coordinator sees it.

    ``keys`` are the request's chain keys for blocks 1..n, cut at the
    deepest tracked depth (n = min(total_blocks, max depth)); the prefix of
    depth d is named by ``keys[d - 1]``, so one request updates one prefix
    per tracked depth it reaches, and a planner can replicate any of them.
    """

    t: float                      # seconds; any monotonic clock (trace time offline)
    namespace: str
    node: str                     # node that served the request
    keys: tuple[bytes, ...]       # chain keys of blocks 1..n
    outcome: Outcome = Outcome.MISS
    block_tokens: int = 0         # tokens per block (0 = unknown)
    page_bytes: int = 0           # bytes per page (0 = unknown)
    total_blocks: int = 0         # the request's full prefix length in blocks
    local_blocks: int = -1        # leading blocks the serving node held before serving (-1 = unknown)


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """Knobs of features, labels and the model (see docs/predictor.md)."""

    depths: tuple[int, ...] = (1, 2, 4, 8)
    horizon_s: float = 300.0          # H: label window
    min_future: int = 1               # K: label is "at least K more requests within H"
    windows_s: tuple[float, ...] = (10.0, 60.0, 300.0)  # recent-count windows (decayed counters)
    momentum_window_s: float = 60.0   # W of the momentum baseline
    momentum_min: int = 2             # m of the momentum baseline
    max_prefixes: int = 200_000       # tracked prefixes; the stalest are dropped beyond this
    idle_drop_s: float = 1800.0       # prefixes unseen this long are dropped
    retrain_every_s: float = 600.0    # online retraining period
    min_train_rows: int = 2_000
    fanout_window_s: float = 60.0     # fan-out = distinct nodes in the last 1-2 such windows
    active_within_s: float = 300.0    # scored/labelled population: prefixes seen this recently
    threshold: float = 0.5            # operating threshold (the planner's default)
    gate_margin: float = 0.01         # fall back to momentum when model PR-AUC < momentum's - this
    log_every_s: float = 10.0         # online: record a labelled sample this often
    log_rows: int = 512               # online: rows per recorded sample (random subset)
    max_log_rows: int = 100_000       # online: labelled rows kept for retraining
    eval_rows: int = 20_000           # online: most recent labelled rows used for evaluation
    need_in_floor_s: float = 1.0      # floor of need_in_s (timestamps come in batches)
    num_threads: int = 1              # LightGBM threads (training and inference)


@dataclass(slots=True)
class NodeState:
    """What the planner knows of one live node."""

    node_id: str
    capacity_bytes: int
    used_bytes: int
    spec_bytes: int = 0               # bytes held as speculative replicas
    load: float = 0.0                 # recent requests/s routed to it (optional)


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
    holders: dict[int, frozenset[str]]
    prob: float                        # P(needed on a node lacking it within H)
    need_in_s: float                   # predicted seconds until the next request
    page_bytes: int
    fanout: int = 1                    # distinct nodes that requested it recently


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
    transfer_s: float = 0.0            # predicted time of one target's copy at the measured bandwidth
    need_in_s: float = 0.0             # predicted lead time the copy was gated against


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    threshold: float = 0.5             # replicate when prob >= threshold
    spec_budget: float = 0.2           # share of each node's capacity for speculative replicas
    spec_bandwidth: float = 1e9        # bytes/s the planner may spend on copies, cluster-wide
    tick_s: float = 1.0
    ttl_s: float = 120.0               # lifetime of a speculative replica unless renewed
    max_targets: int = 2               # new replicas per prefix per tick
    safety: float = 1.5                # transfer must fit in need_in_s / safety
    max_decisions: int = 256
    drop_below: float | None = None    # hysteresis: keep (renew) a replica while prob >= this; None = threshold / 2
    renew_when_left: float = 0.5       # renew a hot replica once less than this share of ttl_s is left (1.0 = every tick)

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
    reason: str                        # "expired" | "decayed"


@dataclass(slots=True)
class PlanResult:
    decisions: list[Decision] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bytes_planned: int = 0
    renewals: list[Renewal] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    bytes_budget: int = 0              # copy bytes this tick allowed (after transfers in flight)
