"""The engine's side of kvstored's in-flight prefill claims, shared by the engine connectors
(:mod:`kvstore_vllm`, :mod:`kvstore_sglang`). Pure functions over a Lookup's answer: no I/O.

* **Claim.** A request that is about to prefill passes ``claim_seconds`` on its recorded Lookup:
  when it expects to have stored the chain (:func:`claim_seconds`: its prefill queue plus its own
  prefill, at the engine's configured throughput). The coordinator claims only what the cluster
  lacks and nobody else claims, so a request that turns out to hit, or that follows another
  claimant, claims nothing it will not compute.
* **Wait.** When the answer shows another request computing a deeper prefix than the cluster
  holds (``NodePrefix.computing``), :func:`wait_for` says whether waiting for it beats computing:
  ``ready_in + copy * (copies_ahead + 1) < margin * own prefill of those blocks``
  (:func:`worth_waiting`). A copy already on its way to this node (``pending``, not computing, on
  its own entry: the coordinator's copy tree) is waited for too (:func:`incoming`), rather than
  pulled a second time.
* **Read.** Before its Get an engine reads another node's prefix only when pulling it beats
  computing it (:func:`worth_reading`): the pull's time counts the other pulls of that prefix the
  coordinator expects in flight on its holder (``copies_ahead`` of a holder's entry).
* **Until.** The follower re-looks (no record, no claim, no lease; every :func:`look_again_s`, an
  eighth of what it still expects) until :func:`landed`, at most its
  own prefill time (times the margin; and the connector's cap), then loads what is held; a claim
  that vanishes without landing (:func:`still_coming` false: its claimant died or gave up) ends the
  wait at once. A wait that did not land computes: it reads only what was held before it.

The replay's engines (``kvstore/replay/claiming.py``, real and simulated) run this same rule
(:func:`decide`, :func:`incoming_copy`) in their cost model's units; the connectors in real seconds,
tokens and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_CLAIM_S = 600.0  # kvstored's default --max-claim-seconds: a longer claim is refused


def worth_waiting(ready_in_s: float, copy_s: float, own_prefill_s: float, margin: float = 1.0) -> bool:
    """Wait for a claimant's prefill (then copy it) instead of computing the same blocks when
    ``ready_in + copy < margin * own prefill``."""
    return ready_in_s + copy_s < margin * own_prefill_s


def prefill_s(tokens: float, prefill_tokens_per_s: float) -> float:
    """Seconds this engine needs to prefill ``tokens`` at its configured throughput."""
    return max(0.0, tokens) / prefill_tokens_per_s if prefill_tokens_per_s > 0 else math.inf


def claim_seconds(compute_tokens: int, prefill_tokens_per_s: float, backlog_tokens: int = 0,
                  max_s: float = DEFAULT_MAX_CLAIM_S) -> float:
    """The ``claim_seconds`` of a request that will prefill ``compute_tokens`` behind
    ``backlog_tokens`` of queued prefill; 0 (no claim) when there is nothing to compute or no
    throughput estimate. Capped at ``max_s`` (kvstored refuses a claim over its
    ``--max-claim-seconds``)."""
    if compute_tokens <= 0 or prefill_tokens_per_s <= 0:
        return 0.0
    return min(max_s, prefill_s(compute_tokens + max(0, backlog_tokens), prefill_tokens_per_s))


def held(nodes: Sequence[Any], local: int = 0) -> int:
    """Blocks of the chain the cluster holds now: the longest non-pending entry, or ``local``."""
    return max([local, *(int(e.prefix_length) for e in nodes if not e.pending)])


@dataclass(slots=True, frozen=True)
class Wait:
    """A prefill (or copy) in flight that a follower defers for."""

    node: str           # the claimant (this node for a copy on its way here)
    length: int         # blocks of the chain it will hold
    ready_in_s: float
    budget_s: float     # the longest the wait may take: this engine's own prefill of those blocks
    computing: bool = True  # False: a copy on its way to this node
    prefill_s: float = math.inf  # this engine's prefill of the awaited blocks alone (no queue, no margin)


def wait_for(nodes: Sequence[Any], me: str, local: int, *, block_tokens: int, page_bytes: int,
             prefill_tokens_per_s: float, link_bytes_per_s: float, backlog_tokens: int = 0,
             margin: float = 1.0) -> Wait | None:
    """The claim in a Lookup's ``nodes`` worth waiting for (the deepest such), or None: compute it
    yourself. ``me``: this engine's node id; ``local``: blocks this node holds (the reply's
    ``prefix_length``); ``backlog_tokens``: prefill queued before this request here (its own
    alternative waits behind it too). The copy from another node goes over ``link_bytes_per_s``,
    behind ``copies_ahead`` waves of the same copy to other waiters."""
    if prefill_tokens_per_s <= 0:
        return None
    return decide(nodes, me, local, page_bytes=page_bytes, link_bytes_per_s=link_bytes_per_s,
                  prefill_blocks_s=lambda blocks: prefill_s(blocks * block_tokens, prefill_tokens_per_s),
                  backlog_s=prefill_s(backlog_tokens, prefill_tokens_per_s), margin=margin)


def decide(nodes: Sequence[Any], me: str, local: int, *, page_bytes: int, link_bytes_per_s: float,
           prefill_blocks_s: Callable[[int], float], backlog_s: float = 0.0, margin: float = 1.0,
           time_scale: float = 1.0) -> Wait | None:
    """:func:`wait_for` in any engine's cost model: ``prefill_blocks_s(n)`` is its prefill of ``n``
    blocks, ``backlog_s`` its queued prefill, both on the engine's clock, which runs ``time_scale``
    times the daemon's (``ready_in_seconds``; the replay's engines run on trace time)."""
    cluster = held(nodes, local)
    best: Wait | None = None
    for e in nodes:
        length = int(e.prefix_length)
        if not e.computing or length <= cluster:
            continue
        one = (length - local) * page_bytes / link_bytes_per_s if link_bytes_per_s > 0 else math.inf
        copy = 0.0 if e.node_id == me else one * (int(e.copies_ahead) + 1)
        mine = prefill_blocks_s(length - cluster)
        own = backlog_s + mine
        m = scaled_margin(margin, backlog_s, mine)
        ready = float(e.ready_in_seconds) * time_scale
        if worth_waiting(ready, copy, own, m) and (best is None or length > best.length):
            best = Wait(node=e.node_id, length=length, ready_in_s=ready, budget_s=m * own, prefill_s=mine)
    return best


def pull_s(entry: Any, local: int, *, page_bytes: int, link_bytes_per_s: float) -> float:
    """Seconds to pull ``entry``'s prefix beyond ``local`` blocks over the link, sharing its holder's
    egress with the ``copies_ahead`` other pulls and copies of that prefix the answer counts."""
    if link_bytes_per_s <= 0:
        return math.inf
    blocks = max(0, int(entry.prefix_length) - local)
    return blocks * page_bytes / link_bytes_per_s * (int(entry.copies_ahead) + 1)


def worth_reading(nodes: Sequence[Any], me: str, local: int, *, page_bytes: int, link_bytes_per_s: float,
                  prefill_blocks_s: Callable[[int], float]) -> int:
    """Blocks of the chain to read (load or recompute): ``local`` (this node's own), or the deepest
    prefix another node holds whose pull beats computing the same blocks here (:func:`pull_s`: the
    contention on its holder's egress the answer counts included). No margin: a pull slower than
    computing, taken to spare a queued GPU, loads a holder every other puller of the burst shares, and
    the count of those pullers is an estimate (measured in the regime map, docs/regimes.md: a margin of
    2 on pulls cost up to 2.2x the best baseline on 100 GbE). On a slow link, a short prefix, or a holder
    already serving a burst of pulls, computing is faster and nothing is pulled: the rule every engine
    applies before its Get, whatever the policy (a pull is a cost, not a prediction). With a copy of the
    prefix on its way here (this node's own entry ``pending``, not computing: a copy tree's) that the
    engine did not wait for, a pull would only race it into the same link: it computes."""
    if any(e.node_id == me and e.pending and not e.computing and int(e.prefix_length) > local for e in nodes):
        return local
    best = local
    for e in nodes:
        length = int(e.prefix_length)
        if e.pending or e.node_id == me or length <= best:
            continue
        if pull_s(e, local, page_bytes=page_bytes, link_bytes_per_s=link_bytes_per_s) < prefill_blocks_s(length - local):
            best = length
    return best


def joined(keys: Sequence[Any], local: int, pulling: Iterable[tuple[Sequence[Any], int]]) -> int:
    """Leading blocks of ``keys`` held here (``local``) or on their way here by a pull another request on
    the same engine started (``pulling``: each such request's keys and the blocks it reads). A Get of them
    joins that pull (the node keeps one flight per page), so it ends no later than the pull its request
    found faster than computing: the engine reads them rather than price a second pull on the holder's
    shared egress, compute the prefix, and put that prefill ahead of the other request's short one."""
    best = local
    for theirs, reads in pulling:
        n = 0
        for mine, other in zip(keys[:reads], theirs[:reads]):
            if mine != other:
                break
            n += 1
        best = max(best, n)
    return best


def worth_loading(runs: Sequence[tuple[int, float]], local: int, *,
                  prefill_blocks_s: Callable[[int], float]) -> int:
    """Of this node's ``local`` leading blocks, given as runs by where they are (``(pages, load seconds)``
    per run, in order: the pool's at 0, a tier's at its expected time to bring the run into the pool, the
    Lookup answer's ``TierRun`` entries), how many to read: the depth where reading beats computing by the most.
    Each run below the pool is read only if its load (with every run before it) costs less than computing
    its blocks: on a drive busy with other reads, a short prefix, or a fast GPU, the engine computes what
    only the disk holds, so no request waits for a tier longer than computing would take. Without runs
    (a node without tiers, an older server) every local block is read."""
    if not runs:
        return local
    best = depth = 0
    best_gain = load = 0.0
    for pages, seconds in runs:
        depth = min(local, depth + int(pages))
        load += max(0.0, float(seconds))
        gain = prefill_blocks_s(depth) - load
        if gain >= best_gain:
            best, best_gain = depth, gain
        if depth >= local:
            break
    return best


def read_after_wait(nodes: Sequence[Any], local: int, base: int, *, page_bytes: int, link_bytes_per_s: float,
                    prefill_blocks_s: Callable[[int], float]) -> int:
    """Blocks to read when a wait for another's prefill ended without the prefix landing here (its
    budget spent, typically just after the claimant's Put landed, with a copy tree still on its way):
    what the cluster holds now, when pulling the blocks beyond ``base`` (what was readable before the
    wait) costs less than computing them, else ``base``. The pull is priced as sharing its source's
    link with every copy the answer shows in flight (``pending`` entries that are not computing): on a
    slow link a late pull would queue behind the tree and slow it. The wait is spent either way; this
    only picks the cheaper way on."""
    now = held(nodes, local)
    if now <= base:
        return base
    sharing = 1 + sum(1 for e in nodes if e.pending and not e.computing)
    pull = sharing * (now - base) * page_bytes / link_bytes_per_s if link_bytes_per_s > 0 else math.inf
    return now if pull < prefill_blocks_s(now - base) else base


def scaled_margin(margin: float, backlog_s: float, mine_s: float) -> float:
    """A margin above 1 accepts a longer wait to spare the GPU for the requests queued behind this
    one: in full once a prefill's worth is queued, not at all with nothing queued (the replay's rule)."""
    if margin > 1 and mine_s > 0:
        return 1.0 + (margin - 1.0) * min(1.0, backlog_s / mine_s)
    return margin


def incoming(nodes: Sequence[Any], me: str, local: int, *, block_tokens: int,
             prefill_tokens_per_s: float, backlog_tokens: int = 0, margin: float = 1.0) -> Wait | None:
    """A copy on its way to this node (its own entry ``pending``, not ``computing``, deeper than
    ``local``): wait for it rather than pull the same pages a second time, at most as long as
    computing them would take (by the margin of a wait for a claim, :func:`scaled_margin`); not at
    all when the coordinator expects it later than that (``ready_in_seconds``), since a wait that runs
    out is paid on top of the prefill."""
    if prefill_tokens_per_s <= 0:
        return None
    return incoming_copy(nodes, me, local, lambda blocks: prefill_s(blocks * block_tokens, prefill_tokens_per_s),
                         prefill_s(backlog_tokens, prefill_tokens_per_s), margin=margin)


def incoming_copy(nodes: Sequence[Any], me: str, local: int, prefill_blocks_s: Callable[[int], float],
                  backlog_s: float = 0.0, time_scale: float = 1.0, margin: float = 1.0) -> Wait | None:
    """:func:`incoming` in any engine's cost model (see :func:`decide`; ``time_scale``: the engine's
    seconds per daemon second; ``margin``: as a wait for a claim, :func:`scaled_margin`)."""
    for e in nodes:
        length = int(e.prefix_length)
        if e.node_id == me and e.pending and not e.computing and length > local:
            mine = prefill_blocks_s(length - local)
            budget = scaled_margin(margin, backlog_s, mine) * (backlog_s + mine)
            ready = float(e.ready_in_seconds) * time_scale
            if ready >= budget:
                return None  # due after computing it would end: compute now
            return Wait(node=me, length=length, ready_in_s=ready, budget_s=budget, computing=False, prefill_s=mine)
    return None


def look_again_s(nodes: Sequence[Any], me: str, local: int, wait: Wait, *, page_bytes: int,
                 link_bytes_per_s: float, floor_s: float, time_scale: float = 1.0) -> float:
    """Seconds (the engine's clock) until a waiting follower looks again: an eighth of what it still
    expects to wait -- the awaited entry's ``ready_in`` in the latest answer, plus one copy of the
    awaited blocks over the link when they are computed on another node -- and never less than
    ``floor_s``. A fixed short interval makes every follower of a burst ask its node (and the node the
    coordinator) a hundred times a second while a copy of a long prefix crawls over a slow link; this
    asks about eight times over whatever is left, so a landing is seen within an eighth of the wait --
    and at least every eighth of this engine's own prefill of those blocks: the prefix can come sooner
    than the awaited entry says (another request on this node computed it), and a wait should not cost
    much more than an eighth of what computing would have.

    A copy on its way to this node that is due sooner than that (a copy tree's copy on a fast link) is
    looked for when it is due, under the floor: a follower that pulled the prefix itself would hold it
    one pull after the claimant's landing, and one that waits a whole floor for a copy landing in a
    few milliseconds loses the difference. That is one look per copy: a copy past due shows a
    ``ready_in`` of 0, and the floor holds again."""
    ready = max([0.0, *(float(e.ready_in_seconds) * time_scale for e in nodes if e.pending
                        and (e.node_id == wait.node or (e.node_id == me and not e.computing)))])
    copy = 0.0
    if wait.computing and wait.node != me and link_bytes_per_s > 0:
        copy = max(0, wait.length - local) * page_bytes / link_bytes_per_s
    look = max(floor_s, min(ready + copy, wait.prefill_s) / 8)
    due = next((float(e.ready_in_seconds) * time_scale for e in nodes
                if e.node_id == me and e.pending and not e.computing and int(e.prefix_length) > local), 0.0)
    return due if 0 < due < look else look


def landed(nodes: Sequence[Any], me: str, local: int, length: int, claimant: str = "") -> bool:
    """The awaited prefix is here, or held elsewhere and not on its way here (a copy tree that has
    this node as a target answers it ``pending``: wait for that copy rather than pull a second
    one). When the claimant is this node, only here counts."""
    if local >= length or claimant == me:
        return local >= length
    if any(e.node_id == me and e.pending and not e.computing and int(e.prefix_length) >= length for e in nodes):
        return False
    return any(int(e.prefix_length) >= length and not e.pending for e in nodes)


def still_coming(nodes: Sequence[Any], me: str, length: int, claimant: str) -> bool:
    """The awaited prefill has not vanished: ``claimant`` still computes at least ``length``
    blocks, or a copy of them is on its way to this node (a claim whose claimant died or gave up
    expires, and the wait ends). Only the claimant's entry counts: this node's own entry can show
    the waiter's own claim of its suffix, which is no sign of the awaited one."""
    return any(e.pending and int(e.prefix_length) >= length
               and ((e.node_id == claimant and (e.computing or claimant == me))
                    or (e.node_id == me and not e.computing)) for e in nodes)
