"""What a replay engine does with in-flight prefill claims (``+claims`` policies), shared by the real
replay (:mod:`kvstore.replay.engine`) and the simulated one (:mod:`kvstore.replay.sim`).

The engine's side of :mod:`kvstore.cluster.claims`, as an inference engine's connector would do it:

* its recorded Lookup carries ``claim_seconds``: when it expects to have
  prefilled and stored the chain (its prefill queue plus this prefill);
* when the answer shows another request computing a deeper prefix than the
  cluster holds (``NodePrefix.computing``), it waits for that one if the
  connectors' rule says so (:mod:`kvstore_client.claims`, run here in the
  cost model's units) -- the claimant's ready time plus the copy (nothing
  on the same node) against its own queue and prefill of those blocks --
  then re-looks until the prefix is held, the claim vanishes, or its budget
  ends, and Gets (which pulls); a wait that did not land computes.

Times: the daemons' (``ready_in_seconds``, ``claim_seconds``) are real
seconds; the engines' cost model is trace seconds (real x speedup).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.replay.costmodel import CostModel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client.claims import (Wait, decide, held, incoming_copy, joined, landed, look_again_s,
                                   read_after_wait, still_coming, worth_loading, worth_reading)

__all__ = ["POLL_S", "REUSE_HORIZON_S", "TIER_ADMIT", "TIER_POLICIES", "Wait", "choose", "claim_seconds", "held",
           "incoming", "joined", "landed", "loadable", "look_again", "margin_for", "pooled", "readable",
           "readable_after", "split_policy", "still_coming", "tier_policy", "wait_end", "wait_for"]

POLL_S = 0.010  # real seconds between the re-lookups of a waiting follower, at least (look_again)
# --claim-margin auto: wait only where waiting is expected to be faster, under every policy. A margin of 2
# (a wait up to twice this engine's queue and prefill, to spare its GPU) was measured worse than 1 in every
# cell of the regime map that differed, once engines serve a burst's followers from their own prefix cache
# (docs/regimes.md)
AUTO_MARGIN = 1.0


def margin_for(setting: str) -> float:
    """``--claim-margin``: a number, or ``auto`` (:data:`AUTO_MARGIN`)."""
    if setting == "auto":
        return AUTO_MARGIN
    value = float(setting)
    if not value > 0:
        raise ValueError(f"--claim-margin must be > 0 or auto, got {setting}")
    return value


# The tiers below each node's pool (--tier-policies), a policy's last suffix: single-tier has none;
# tiers-lru a disk tier of the preset's NVMe that takes every page the pool evicts (least recently used
# out); tiers-freq the same disk writing only the pages read since they were stored; tiers-budget writing
# every page while the drives' write budget (one drive write a day) pays; tiers-predictive the same disk
# writing the classes of page most often asked for again, within that budget (kvstored --tier-admit all,
# reused, budget, predicted).
TIER_POLICIES = ("single-tier", "tiers-lru", "tiers-freq", "tiers-budget", "tiers-predictive")
TIER_ADMIT = {"tiers-lru": "all", "tiers-freq": "reused", "tiers-budget": "budget", "tiers-predictive": "predicted"}
REUSE_HORIZON_S = 600.0  # tiers-predictive: trace seconds after an eviction within which a page counts as reused


def _parts(policy: str) -> tuple[str, bool, str]:
    base, *extras = policy.split("+")
    tiers = [x for x in extras if x in TIER_POLICIES[1:]]
    bad = [x for x in extras if x != "claims" and x not in TIER_POLICIES[1:]]
    if bad or extras.count("claims") > 1 or len(tiers) > 1:
        raise ValueError(f"unknown policy suffix in {policy!r} (+claims, then at most one of "
                         f"{', '.join('+' + t for t in TIER_POLICIES[1:])})")
    return base, "claims" in extras, tiers[0] if tiers else TIER_POLICIES[0]


def split_policy(policy: str) -> tuple[str, bool]:
    """``"reactive+claims"`` -> ``("reactive", True)``; a plain name -> ``(name, False)``; a tier policy
    suffix (``+tiers-lru``) is left out (:func:`tier_policy`)."""
    base, claims, _ = _parts(policy)
    return base, claims


def tier_policy(policy: str) -> str:
    """``"reactive+tiers-lru"`` -> ``"tiers-lru"``; without a tier suffix ``"single-tier"``."""
    return _parts(policy)[2]


def claim_seconds(cost: CostModel, input_tokens: int, local_blocks: int, backlog_s: float, speedup: float) -> float:
    """Real seconds until this engine will have stored the chain: the prefill work queued before it
    (trace s) plus its own prefill of what it lacks locally (an upper bound: the cluster may hold more)."""
    own = cost.prefill_s(cost.uncached_tokens(input_tokens, local_blocks))
    return (backlog_s + own) / speedup


def wait_for(nodes: Sequence[pb.NodePrefix], me: str, local: int, cost: CostModel, speedup: float,
             link_bytes_s: float, backlog_s: float = 0.0, margin: float = 1.0) -> Wait | None:
    """The connectors' rule (:func:`kvstore_client.claims.decide`) on the replay's clock: trace
    seconds (the daemons' ``ready_in`` x speedup), the cost model's prefill, the modelled link
    (``link_bytes_s``: unscaled bytes per trace second)."""
    return decide(nodes, me, local, page_bytes=cost.page_bytes, link_bytes_per_s=link_bytes_s,
                  prefill_blocks_s=lambda blocks: cost.prefill_s(blocks * cost.block_tokens), backlog_s=backlog_s,
                  margin=margin, time_scale=speedup)


def incoming(nodes: Sequence[pb.NodePrefix], me: str, local: int, cost: CostModel,
             backlog_s: float = 0.0, speedup: float = 1.0, margin: float = 1.0) -> Wait | None:
    """A copy on its way to this node: :func:`kvstore_client.claims.incoming_copy` in trace seconds."""
    return incoming_copy(nodes, me, local, lambda blocks: cost.prefill_s(blocks * cost.block_tokens), backlog_s,
                         time_scale=speedup, margin=margin)


def choose(nodes: Sequence[pb.NodePrefix], me: str, local: int, cost: CostModel, speedup: float,
           link_bytes_s: float, backlog_s: float = 0.0, margin: float = 1.0) -> Wait | None:
    """What a request's first Lookup answer says to wait for: another's claim worth it
    (:func:`wait_for`), else a copy on its way here (:func:`incoming`); None: read and compute now."""
    return (wait_for(nodes, me, local, cost, speedup, link_bytes_s, backlog_s, margin)
            or incoming(nodes, me, local, cost, backlog_s, speedup, margin))


def look_again(nodes: Sequence[pb.NodePrefix], me: str, local: int, wait: Wait, cost: CostModel, speedup: float,
               link_bytes_s: float) -> float:
    """Trace seconds until a waiting follower's next re-lookup (:func:`kvstore_client.claims.look_again_s`
    on the replay's clock), at least :data:`POLL_S` real seconds."""
    return look_again_s(nodes, me, local, wait, page_bytes=cost.page_bytes, link_bytes_per_s=link_bytes_s,
                        floor_s=POLL_S * speedup, time_scale=speedup)


def wait_end(came: bool, waited_s: float, wait: Wait) -> str:
    """Why a wait ended, for the request record: ``came`` (the prefix landed), ``budget`` (its budget
    was spent), ``gone`` (the claim or the copy vanished first)."""
    if came:
        return "came"
    return "budget" if waited_s >= wait.budget_s else "gone"


def pooled(nodes: Sequence[pb.NodePrefix], me: str, local: int) -> int:
    """Of this node's ``local`` blocks, the leading ones in its pool (the rest are in its tiers below): its
    own entry's ``pool_length`` (all of them where the answer does not say)."""
    mine = next((n for n in nodes if n.node_id == me and not n.pending), None)
    return local if mine is None else min(local, int(mine.pool_length))


def loadable(runs: Sequence[pb.TierRun], local: int, cost: CostModel, speedup: float) -> int:
    """Of this node's ``local`` blocks, the leading ones worth reading from where they are (the Lookup's
    tier runs, their load times on the daemons' clock): :func:`kvstore_client.claims.worth_loading`."""
    return worth_loading([(int(r.pages), float(r.load_seconds) * speedup) for r in runs], local,
                         prefill_blocks_s=lambda blocks: cost.prefill_s(blocks * cost.block_tokens))


def readable(nodes: Sequence[pb.NodePrefix], me: str, local: int, cost: CostModel, link_bytes_s: float) -> int:
    """Blocks to read before computing the rest: the connectors' load-or-recompute rule
    (:func:`kvstore_client.claims.worth_reading`) in the cost model's units."""
    return worth_reading(nodes, me, local, page_bytes=cost.page_bytes, link_bytes_per_s=link_bytes_s,
                         prefill_blocks_s=lambda blocks: cost.prefill_s(blocks * cost.block_tokens))


def readable_after(wait: Wait, came: bool, nodes: Sequence[pb.NodePrefix], local: int, held_before: int,
                   cost: CostModel, link_bytes_s: float) -> int:
    """Blocks to read once a wait ended. It came: what the cluster holds now. It did not (budget spent,
    claim gone): what the cluster holds now if pulling it beats computing it
    (:func:`kvstore_client.claims.read_after_wait`), else what was held before the claim -- and after
    a copy to this node that did not come, only what is here (a Get would join that copy)."""
    if came:
        return held(nodes, local)
    if not wait.computing:
        return local
    return read_after_wait(nodes, local, max(local, held_before), page_bytes=cost.page_bytes,
                           link_bytes_per_s=link_bytes_s,
                           prefill_blocks_s=lambda blocks: cost.prefill_s(blocks * cost.block_tokens))
