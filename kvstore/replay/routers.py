"""Request routers: round-robin, least-load, cache-aware (SGLang style), eta, kv-router (the engines' own
caches and queues, as llm-d's precise prefix router and Dynamo's KV router see them) and mooncake (Mooncake's
Algorithm 1).

A router sees one :class:`NodeView` per node: its load (requests queued or
running on its engine, plus requests the oracle has already promised to it)
and how much of the request's prefix it holds. No I/O: the driver builds the
views from the cluster's ``Lookup`` answer (:func:`views_from_lookup`).

Cache-aware, as SGLang's router does it:

1. If the cluster is imbalanced -- ``max - min load > abs_threshold`` **and**
   ``max load > rel_threshold x min load`` -- pick the least-loaded node.
2. Otherwise prefix affinity: the node holding the longest prefix of the
   request. With ``use_hints`` a node that the coordinator says is *about to*
   hold the prefix (``pending``) or holds it as a live speculative replica
   (``expires_in_seconds``) counts as holding it, so a burst spreads over the
   holders, least-loaded first, instead of queueing on the one node that
   computed the prefix. "Holding it" is judged with ``hint_cover``: a hinted
   copy covering at least that share of the longest prefix counts as the
   whole of it, because the planner copies prefixes only as deep as the
   predictor tracks them (e.g. 16 of a 17-block prefix), and the node's Get
   pulls the few blocks beyond the copy from a peer.
3. When no node holds any of it (or less than ``match_threshold`` of the
   request's blocks), the least-loaded node.

Ties always go to the lower load, then the longer real (non-hinted) prefix,
then a rotating index, so equal nodes share work.

Eta balances by work, not by request count: per node, the prefill already
queued on its engine (``NodeView.work_s``) plus this request's own cost
there -- the pull of the cluster-held prefix it lacks (where the policy
pulls) and the prefill of the rest -- and the smallest wins. A queue of
recomputes then weighs what it costs, as a KV router that weighs a node's
active prefill against its cache overlap (Dynamo's) does.

Every router skips a node whose store is down (``NodeView.down``: its
kvstored left the cluster's membership, as a fleet router watching the
cluster's Status sees it), unless every node's is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ROUTERS = ("round-robin", "least-load", "cache-aware", "eta", "kv-router", "mooncake")


@dataclass(slots=True)
class NodeView:
    """What a router knows about one node for one request."""

    node_id: str
    load: float = 0.0
    prefix: int = 0        # leading blocks the node holds (directory answer)
    hinted: int = 0        # leading blocks a pending or live speculative copy gives it
    down: bool = False     # its kvstored is not a live member: route elsewhere
    work_s: float = 0.0    # prefill (trace s) queued or running on its engine
    queued_s: float = 0.0  # trace s a newcomer waits for a slot: the queued requests' prefill, or the decodes
                           # ahead of it where every slot is taken (EngineState.queued_s)
    engine: int = 0        # leading blocks its engine's own prefix cache holds, or computes for a request queued
                           # ahead (routers with ``needs_engine_cache``: a KV router fed the engines' KV events)


def up(views: Sequence[NodeView]) -> list[int]:
    """Indices of the nodes whose store is up (all of them if none is)."""
    live = [i for i, v in enumerate(views) if not v.down]
    return live or list(range(len(views)))


class Router(Protocol):
    name: str
    needs_prefix: bool   # the driver asks the cluster for prefixes only if true
    needs_engine_cache: bool  # the driver fills NodeView.engine only if true

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        """Index of the chosen node and the reason (for the report)."""
        ...


class _Rotation:
    """A rotating start index so that ties spread over nodes."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[int], n: int) -> int:
        best = min(candidates, key=lambda i: (i - self._next) % n)
        self._next = (best + 1) % n
        return best


class RoundRobin:
    name = "round-robin"
    needs_prefix = False
    needs_engine_cache = False

    def __init__(self) -> None:
        self._i = 0

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        live = up(views)
        i = live[self._i % len(live)]
        self._i += 1
        return i, "round-robin"


class LeastLoad:
    name = "least-load"
    needs_prefix = False
    needs_engine_cache = False

    def __init__(self) -> None:
        self._rot = _Rotation()

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        return least_loaded(views, self._rot), "least-load"


def least_loaded(views: Sequence[NodeView], rot: _Rotation, among: Iterable[int] | None = None) -> int:
    """The least-loaded node of ``among`` (all by default); ties: longer real prefix, then rotation."""
    live = set(up(views))
    idx = [i for i in (range(len(views)) if among is None else among) if i in live] or sorted(live)
    low = min(views[i].load for i in idx)
    tied = [i for i in idx if views[i].load <= low + 1e-9]
    longest = max(views[i].prefix for i in tied)
    return rot.pick([i for i in tied if views[i].prefix == longest], len(views))


def lowest(views: Sequence[NodeView], estimate: Sequence[float], rot: _Rotation) -> int:
    """The live node with the lowest ``estimate`` (ties: :func:`least_loaded`)."""
    live = up(views)
    low = min(estimate[i] for i in live)
    return least_loaded(views, rot, [i for i in live if estimate[i] <= low + 1e-9])


class CacheAware:
    """SGLang-style cache-aware routing with balance thresholds and hint use."""

    name = "cache-aware"
    needs_prefix = True
    needs_engine_cache = False

    def __init__(self, abs_threshold: float = 32.0, rel_threshold: float = 1.5, use_hints: bool = True,
                 match_threshold: float = 0.0, hint_cover: float = 0.5,
                 pull_s: Callable[[int], float] | None = None) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.use_hints = use_hints
        self.match_threshold = match_threshold
        self.hint_cover = hint_cover
        self._pull_s = pull_s
        self._rot = _Rotation()

    def imbalanced(self, views: Sequence[NodeView]) -> bool:
        loads = [views[i].load for i in up(views)]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > self.rel_threshold * lo

    def effective(self, views: Sequence[NodeView]) -> list[int]:
        """Per node, the prefix length the router credits it with (hints included when enabled)."""
        if not self.use_hints:
            return [v.prefix for v in views]
        longest = max(max(v.prefix, v.hinted) for v in views)
        return [longest if v.hinted and v.hinted >= self.hint_cover * longest else max(v.prefix, v.hinted)
                for v in views]

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        if self.imbalanced(views):
            return least_loaded(views, self._rot), "imbalance"
        live = set(up(views))
        eff = [e if i in live else -1 for i, e in enumerate(self.effective(views))]
        best = max(eff)
        if best <= 0 or best < self.match_threshold * max(1, blocks):
            return least_loaded(views, self._rot), "no-match"
        i = least_loaded(views, self._rot, self.worth_following(views, [i for i, e in enumerate(eff) if e == best],
                                                                best))
        # "affinity-hint": the chosen node is credited with the prefix by a pending or live speculative copy
        credited = self.use_hints and views[i].hinted > 0 and views[i].hinted >= views[i].prefix
        return i, "affinity-hint" if credited else "affinity"


    def worth_following(self, views: Sequence[NodeView], tied: list[int], best: int) -> list[int]:
        """Of the nodes credited with ``best`` blocks, those worth routing to: every real holder, and a
        hinted node only where following it is expected to pay (all of ``tied`` without a link estimate or
        a real holder):

        * its queue (its queued prefill and the wait for a slot, ``work_s + queued_s``) plus the pull of
          the blocks it lacks ends before the least-busy holder's queue; or
        * a burst is under way on the holders: the least-loaded one already carries more than
          ``rel_threshold`` times the requests the hinted node would carry with this one, and the hinted
          node's queue is no longer than the least-busy holder's. The hinted node, once its first request
          pulled what the copy lacks, holds the prefix for the burst's next requests, before the holder's
          slots fill.

        A hint to an idle node beside a holder serving one request with nothing queued changes no route:
        the pull would only delay this request."""
        holders = [i for i in tied if views[i].prefix >= best]
        if self._pull_s is None or not holders or len(holders) == len(tied):
            return tied
        queue = [v.work_s + v.queued_s for v in views]
        floor = min(queue[i] for i in holders)
        busy = min(views[i].load for i in holders)
        return [i for i in tied
                if views[i].prefix >= best or queue[i] + self._pull_s(best - views[i].prefix) < floor
                or (busy > self.rel_threshold * (views[i].load + 1) and queue[i] <= floor)]


class Eta:
    """Earliest estimated first token (see the module's text). ``prefill_s(blocks, cached)``: the
    prefill of a request of ``blocks`` blocks with ``cached`` of them at hand; ``pull_s(blocks)``: pulling
    that many from a peer, or None where the policy does not pull (the node recomputes what it lacks)."""

    name = "eta"
    needs_prefix = True
    needs_engine_cache = False

    def __init__(self, prefill_s: Callable[[int, int], float], pull_s: Callable[[int], float] | None,
                 use_hints: bool = True, hint_cover: float = 0.5) -> None:
        self._prefill_s, self._pull_s = prefill_s, pull_s
        self._credit = CacheAware(use_hints=use_hints, hint_cover=hint_cover)
        self._rot = _Rotation()

    def estimate(self, views: Sequence[NodeView], blocks: int) -> list[float]:
        eff = [min(blocks, e) for e in self._credit.effective(views)]
        held = max(eff)
        if self._pull_s is None:
            return [v.work_s + self._prefill_s(blocks, e) for v, e in zip(views, eff)]
        return [v.work_s + self._pull_s(held - e) + self._prefill_s(blocks, held) for v, e in zip(views, eff)]

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        return lowest(views, self.estimate(views, blocks), self._rot), "eta"


class KvRouter:
    """Where each engine's own prefix cache is, and the work queued on it: the best router a fleet runs without
    a shared store (llm-d's precise prefix-cache scorer with its load scorer, Dynamo's KV router). Per node,
    the prefill queued there (on its prefill unit and in the requests waiting for a slot) plus this request's
    prefill of what that engine's cache lacks; the smallest wins (ties: lower load, rotation).
    ``prefill_s(blocks, cached)`` as :class:`Eta`'s."""

    name = "kv-router"
    needs_prefix = False
    needs_engine_cache = True

    def __init__(self, prefill_s: Callable[[int, int], float]) -> None:
        self._prefill_s = prefill_s
        self._rot = _Rotation()

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        est = [v.work_s + v.queued_s + self._prefill_s(blocks, min(blocks, v.engine)) for v in views]
        return lowest(views, est, self._rot), "kv-router"


class Mooncake:
    """Mooncake's global scheduler (FAST'25, Algorithm 1) as published: per prefill instance, its queued
    prefill (on its prefill unit and waiting for a slot) plus the cheaper of computing what it holds not (its
    store's prefix or its engine's cache, the longer) and pulling the longest prefix the cluster holds then
    computing the rest; the smallest wins. A hot prefix
    gets copied as a side effect of the pulls. ``pull_s`` None (a policy that does not pull): computing only.

    Where it differs from :class:`CacheAware`: cache-aware goes to the longest prefix unless the cluster is
    imbalanced by request counts; this weighs each node's queued prefill work against what it would compute
    or pull. From :class:`Eta`: eta credits every node with the pull of the longest prefix whether or not
    pulling beats computing, and ignores the engines' own caches. Left out: the paper's
    ``kvcache_balancing_threshold`` for proactive hot-spot migration (kvstore's coordinator decides copies)."""

    name = "mooncake"
    needs_prefix = True
    needs_engine_cache = True

    def __init__(self, prefill_s: Callable[[int, int], float], pull_s: Callable[[int], float] | None) -> None:
        self._prefill_s, self._pull_s = prefill_s, pull_s
        self._rot = _Rotation()

    def estimate(self, views: Sequence[NodeView], blocks: int) -> list[float]:
        have = [min(blocks, max(v.prefix, v.engine)) for v in views]
        best = max(have)
        out = []
        for v, h in zip(views, have):
            compute = self._prefill_s(blocks, h)
            pull = self._pull_s(best - h) + self._prefill_s(blocks, best) if self._pull_s is not None else compute
            out.append(v.work_s + v.queued_s + min(compute, pull))
        return out

    def choose(self, views: Sequence[NodeView], blocks: int) -> tuple[int, str]:
        return lowest(views, self.estimate(views, blocks), self._rot), "mooncake"


def make_router(name: str, abs_threshold: float = 32.0, rel_threshold: float = 1.5, use_hints: bool = True,
                match_threshold: float = 0.0, hint_cover: float = 0.5,
                prefill_s: Callable[[int, int], float] | None = None,
                pull_s: Callable[[int], float] | None = None) -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "cache-aware":
        return CacheAware(abs_threshold, rel_threshold, use_hints, match_threshold, hint_cover, pull_s)
    if name == "eta":
        if prefill_s is None:
            raise ValueError("the eta router needs the cost model's prefill_s")
        return Eta(prefill_s, pull_s, use_hints, hint_cover)
    if name in ("kv-router", "mooncake"):
        if prefill_s is None:
            raise ValueError(f"the {name} router needs the cost model's prefill_s")
        return KvRouter(prefill_s) if name == "kv-router" else Mooncake(prefill_s, pull_s)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")


def views_from_lookup(node_ids: Sequence[str], loads: Sequence[float], entries: Iterable[Any],
                      work: Sequence[float] | None = None) -> list[NodeView]:
    """Views from ``LookupResponse.nodes`` (``NodePrefix``-like objects).

    An entry with ``pending`` is a copy in flight: it sets ``hinted`` only.
    One that is ``computing`` (an in-flight prefill claim) sets nothing: the
    claim's followers wait for it wherever they run, and crediting the
    claimant with the prefix would pile them onto its engine's slots.
    Any other entry is a holding (the directory's, or a live speculative
    replica, which ``expires_in_seconds`` marks); a speculative one sets
    ``hinted`` as well, so hint-aware routing can tell it apart.
    """
    views = [NodeView(n, float(load)) for n, load in zip(node_ids, loads)]
    for v, w in zip(views, work or ()):
        v.work_s = float(w)
    index = {n: i for i, n in enumerate(node_ids)}
    for e in entries:
        i = index.get(e.node_id)
        if i is None:
            continue
        v = views[i]
        if e.pending:
            if getattr(e, "computing", False):
                continue  # an in-flight prefill is not a holding: piling its followers onto it queues them
            v.hinted = max(v.hinted, int(e.prefix_length))
        else:
            v.prefix = max(v.prefix, int(e.prefix_length))
            if e.expires_in_seconds > 0:
                v.hinted = max(v.hinted, int(e.prefix_length))
    return views
