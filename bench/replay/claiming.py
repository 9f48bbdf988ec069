"""What a replay engine does with in-flight prefill claims (``+claims`` policies), shared by the real
replay (:mod:`bench.replay.engine`) and the simulated one (:mod:`bench.replay.sim`).

The engine's side of :mod:`kvstore.cluster.claims`, as an inference engine's connector would do it:

* its recorded Lookup carries ``claim_seconds``: when it expects to have
  prefilled and stored the chain (its prefill queue plus this prefill);
* when the answer shows another request computing a deeper prefix than the
  cluster holds (``NodePrefix.computing``), it waits for that one if
  :func:`~kvstore.cluster.claims.worth_waiting` says so -- the claimant's
  ready time plus the copy (nothing on the same node) against its own
  prefill of those blocks -- then re-looks until the prefix is held, at most
  its own prefill time, and Gets (which pulls).

Times: the daemons' (``ready_in_seconds``, ``claim_seconds``) are real
seconds; the engines' cost model is trace seconds (real x speedup).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay.costmodel import CostModel
from kvstore.cluster.claims import worth_waiting
from kvstore.v1 import kvstore_pb2 as pb

POLL_S = 0.010  # real seconds between the re-lookups of a waiting follower
# --claim-margin auto: the margin each policy did best with on agent-fanout (simulated sweep over 1, 1.5,
# 2, 4; docs/benchmark.md): reactive's waiters all pull from the claimant's egress, so waiting pays only
# when clearly faster; predictive's get a copy tree (and the copies its coordinator sends ahead)
AUTO_MARGIN = {"reactive": 1.0, "predictive": 2.0}


def margin_for(policy: str, setting: str) -> float:
    """``--claim-margin``: a number, or ``auto`` (:data:`AUTO_MARGIN` by base policy, 1.0 otherwise)."""
    if setting == "auto":
        return AUTO_MARGIN.get(split_policy(policy)[0], 1.0)
    value = float(setting)
    if not value > 0:
        raise ValueError(f"--claim-margin must be > 0 or auto, got {setting}")
    return value


def split_policy(policy: str) -> tuple[str, bool]:
    """``"reactive+claims"`` -> ``("reactive", True)``; a plain name -> ``(name, False)``."""
    base, _, extra = policy.partition("+")
    if extra not in ("", "claims"):
        raise ValueError(f"unknown policy suffix {extra!r} (only +claims)")
    return base, extra == "claims"


def claim_seconds(cost: CostModel, input_tokens: int, local_blocks: int, backlog_s: float, speedup: float) -> float:
    """Real seconds until this engine will have stored the chain: the prefill work queued before it
    (trace s) plus its own prefill of what it lacks locally (an upper bound: the cluster may hold more)."""
    own = cost.prefill_s(cost.uncached_tokens(input_tokens, local_blocks))
    return (backlog_s + own) / speedup


@dataclass(slots=True, frozen=True)
class Wait:
    node: str            # the claimant
    length: int          # blocks it will hold
    ready_in_s: float    # trace s
    budget_s: float      # trace s: the longest the wait may take (own prefill of those blocks, queue included)


def wait_for(nodes: Sequence[pb.NodePrefix], me: str, local: int, cluster_max: int, cost: CostModel,
             speedup: float, link_bytes_s: float, backlog_s: float = 0.0, margin: float = 1.0) -> Wait | None:
    """The claim worth waiting for in a Lookup's answer, or None: compute it yourself. The alternative
    is this engine's own prefill of those blocks behind its prefill queue (``backlog_s``, trace s)."""
    best: Wait | None = None
    for e in nodes:
        length = int(e.prefix_length)
        if not e.computing or length <= cluster_max:
            continue
        ready = float(e.ready_in_seconds) * speedup
        # the copy over this run's link, behind the copy waves that go out before it
        one = (length - local) * cost.page_bytes / link_bytes_s
        copy = 0.0 if e.node_id == me else one * (int(e.copies_ahead) + 1)
        mine = cost.prefill_s((length - cluster_max) * cost.block_tokens)
        own = backlog_s + mine
        # a margin above 1 accepts a longer wait to spare the GPU for the requests queued behind this
        # one: in full once a prefill's worth is queued, not at all with nothing queued
        m = 1.0 + (margin - 1.0) * min(1.0, backlog_s / mine) if margin > 1 and mine > 0 else margin
        if worth_waiting(ready, copy, own, m) and (best is None or length > best.length):
            best = Wait(node=e.node_id, length=length, ready_in_s=ready, budget_s=m * own)
    return best


def incoming(nodes: Sequence[pb.NodePrefix], me: str, local: int, cost: CostModel,
             backlog_s: float = 0.0) -> Wait | None:
    """A copy on its way to this node (the coordinator's copy tree answers its target ``pending``): wait
    for it rather than pull a second copy of the same pages from a holder, at most as long as computing
    them would take."""
    for e in nodes:
        length = int(e.prefix_length)
        if e.node_id == me and e.pending and not e.computing and length > local:
            own = backlog_s + cost.prefill_s((length - local) * cost.block_tokens)
            return Wait(node=me, length=length, ready_in_s=0.0, budget_s=own)
    return None


def landed(nodes: Sequence[pb.NodePrefix], me: str, local: int, length: int, claimant: str = "") -> bool:
    """The awaited prefix is here, or held elsewhere and not on its way here (a copy tree that has this
    node as a target answers it ``pending``: wait for that copy rather than pull a second one). When the
    claimant is this node, only here counts."""
    if local >= length or claimant == me:
        return local >= length
    if any(e.node_id == me and e.pending and not e.computing and int(e.prefix_length) >= length for e in nodes):
        return False
    return any(int(e.prefix_length) >= length and not e.pending for e in nodes)
